"""Scale: many users online in one process, with their policies written to a policy store.

    python benchmarks/scale.py --users 100000 --scopes hybrid --root /work/cache/scale \\
        --json benchmarks/results/scale_100k.json
    python benchmarks/scale.py --users 10000 --scopes user,shared,hybrid --json benchmarks/results/scale_10k.json
    python benchmarks/scale.py --throughput --json benchmarks/results/scale_throughput.json
    python benchmarks/scale.py --users 10000 --preset realistic --json benchmarks/results/scale_10k_realistic.json
    python benchmarks/scale.py --users 10000 --json benchmarks/results/scale_10k_default.json
    python benchmarks/scale.py --users 10000 --offset 1 --json benchmarks/results/scale_10k_offset1.json
    python benchmarks/scale.py --users 10000 --offset 0 --json benchmarks/results/scale_10k_offset0.json

Users are synthetic vector streams (:mod:`rmm_jax.online.vectors`): each user's 100
memories are Gaussian vectors in d = 384, each query a distorted copy of one of them
(a distortion shared by all users plus a low-rank one of the user's own), generated from
``(seed, user index)``. **They are generated before the clock starts**, into a file of
fixed-size records (``--streams``; memories and queries as float16, which halves the file:
100,000 users take 16 GB; candidates and gold labels as small integers), and the timed run
reads each chunk of users from it as the CLI reads an embedding store from disk: the time
is the tool's, not the generator's (which on two cores competed with XLA for them). Each
chunk of users runs through the compiled loop (:func:`rmm_jax.online.driver.drive`);
after each chunk, in the shared scopes, the shared part is saved to the store
(:meth:`PolicyStore.save_shared`) and then its users' policies (:meth:`PolicyStore.save`),
as ``rmm-jax simulate`` does, through the run that it runs
(:func:`rmm_jax.online.session.open_run`) with its policy sink
(:class:`rmm_jax.online.sinks.PolicySink`), timed.

Reported per scope: wall time (total, and the part spent saving), queries/s, peak RSS of
the process (MiB, under the keys ``peak_rss_mb`` and ``peak_rss_mb_so_far``), bytes per
user on disk, and the median time to open the store and load one user's policy (20 random
users, a new store object each time), and the 1-minute load average around the run
(``load``; ``noisy`` above 2.5). Scope ``user`` at d=384 holds 3.5 MB per user: with
``--user-save-limit`` (default 200) only that many of its users are written, rounded up to
whole chunks (bytes per user are the same for every user), the rest only run.
Targets (100,000 hybrid users × 100 queries): ≤ 600 s, saving included, and peak RSS ≤ 2 GB.

``--preset`` and ``--offset`` choose the learner (default: the default preset), so that the
learning the run reports (prequential Recall@5) can be compared between learners on the same
users; the 10,000-user hybrid runs above do that. Each row records its scope's learner, preset
name and resolved fields (:func:`rmm_jax.core.config.setting_record`), as ``setting``;
``--throughput`` as ``throughput.settings`` (by scope).

``--throughput``: queries/s of 1,000 users × 200 queries, ``hybrid`` against ``user``,
interleaved repeats in one run (median [min, max]), no saving.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy BLAS threads spin against XLA on a small, busy machine
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import HelpFormatter, LoadWatch, du, peak_rss_mib, positive_int, spread, write_result  # noqa: E402
from tqdm import tqdm  # noqa: E402

import rmm_jax as rj  # noqa: E402
from rmm_jax.core.config import setting_record  # noqa: E402
from rmm_jax.core.scope import DEFAULT_RANK  # noqa: E402
from rmm_jax.data.citations import (  # noqa: E402
    DEFAULT_PRECISION,
    DEFAULT_RECALL,
    precision_recall_oracle,
)
from rmm_jax.online.driver import drive  # noqa: E402
from rmm_jax.online.loop import make_run  # noqa: E402
from rmm_jax.online.serve import user_params  # noqa: E402
from rmm_jax.online.session import Start, create_policies, open_run  # noqa: E402
from rmm_jax.online.sinks import PolicySink  # noqa: E402
from rmm_jax.online.streams import Stream  # noqa: E402
from rmm_jax.online.vectors import VectorSpec, vector_chunks  # noqa: E402
from rmm_jax.persist.policy_store import PolicyStore  # noqa: E402


class StreamFile:
    """Users ``0 .. users-1`` of a vector population as fixed-size records in one file, written
    once (:meth:`write`, before the clock starts) and read a chunk of users at a time with one
    ``read`` per chunk (no memory map: pages of a mapped file would count in the resident set).
    A JSON header beside it records what the records hold; a file of another population is
    written anew."""

    def __init__(self, path: Path, spec: VectorSpec, seed: int, users: int):
        self.path, self.spec, self.seed, self.users = path, spec, seed, users
        idx = np.uint8 if spec.memories <= 256 else np.int32
        t, n, d, k = spec.queries, spec.memories, spec.dim, spec.k
        self.record = np.dtype([("bank", np.float16, (n, d)), ("queries", np.float16, (t, d)),
                                ("cand", idx, (t, k)), ("gold", np.bool_, (t, k))])
        self.header = {"spec": spec._asdict(), "seed": seed, "users": users, "record_bytes": self.record.itemsize}
        self._ones = (np.ones((t, k), bool), np.ones(t, np.int32), np.ones(t, bool))
        self._ids = tuple(f"m{j}" for j in range(n)), tuple(f"q{j}" for j in range(t))

    def ready(self) -> bool:
        head = self.path.with_suffix(".json")
        return (head.is_file() and json.loads(head.read_text()) == self.header and self.path.is_file()
                and self.path.stat().st_size == self.users * self.record.itemsize)

    def write(self, per_call: int = 500) -> float:
        """Generate the population into the file; returns the seconds it took."""
        t0 = time.perf_counter()
        self.path.with_suffix(".json").unlink(missing_ok=True)
        with open(self.path, "wb") as f, tqdm(total=self.users, desc="streams", unit="user", file=sys.stderr) as bar:
            for streams in vector_chunks(self.spec, self.seed, self.users, per_call):
                rec = np.zeros(len(streams), self.record)
                for j, st in enumerate(streams):
                    rec[j] = (st.bank, st.queries, st.cand, st.cand_gold)
                f.write(rec.tobytes())
                bar.update(len(streams))
        self.path.with_suffix(".json").write_text(json.dumps(self.header))
        return time.perf_counter() - t0

    def chunks(self, users_per_chunk: int):
        """The users as :class:`Stream` chunks, read from the file as they are needed."""
        (mask, num_gold, valid), (mem_ids, q_ids) = self._ones, self._ids
        with open(self.path, "rb") as f:
            for lo in range(0, self.users, users_per_chunk):
                n = min(users_per_chunk, self.users - lo)
                f.seek(lo * self.record.itemsize)
                rec = np.fromfile(f, self.record, count=n)
                yield [Stream(user_id=f"u{lo + j:07d}", bank=rec["bank"][j], queries=rec["queries"][j],
                              cand=rec["cand"][j], cand_mask=mask, cand_gold=rec["gold"][j], num_gold=num_gold,
                              valid=valid, memory_ids=mem_ids, query_ids=q_ids) for j in range(n)]


class TimedSaves(PolicySink):
    """The CLI's policy sink, timed, writing at most ``limit`` users (the shared part always)."""

    def __init__(self, store, program, limit: int):
        super().__init__(store, program)
        self.limit, self.saved, self.seconds = limit, 0, 0.0

    def chunk(self, event) -> None:
        t = time.perf_counter()
        if self.saved < self.limit:
            super().chunk(event)
            self.saved += len(event.streams)
        elif self.program.layout.scope.has_shared:
            self.save_shared(event)
        self.seconds += time.perf_counter() - t


def setting_for(scope: str, args, spec: VectorSpec) -> rj.Setting:
    """The learner of ``scope``: ``--preset`` with ``--offset`` over it."""
    extra = {} if args.offset is None else {"offset": args.offset}
    return rj.preset(args.preset, k=spec.k, m=5, scope=scope, rank=args.rank if scope == "hybrid" else None,
                     **extra)


def program_for(scope: str, args, spec: VectorSpec):
    return make_run(*setting_for(scope, args, spec), cite_fn=precision_recall_oracle(DEFAULT_PRECISION, DEFAULT_RECALL))


def run_scope(scope: str, args, spec: VectorSpec, root: Path, streams: StreamFile) -> dict:
    program = program_for(scope, args, spec)
    params = rj.init_reranker(jax.random.key(0), spec.dim)
    path = root / f"policies-{scope}"
    ps = create_policies(path, program.layout, spec.dim, params, config={"benchmark": "scale"})
    saves = TimedSaves(ps, program, args.user_save_limit if scope == "user" else args.users)
    watch = LoadWatch()
    t0 = time.perf_counter()
    with tqdm(total=args.users, desc=scope, unit="user", file=sys.stderr) as bar, \
            open_run(streams.chunks(args.chunk), program, Start(params), ps, None, seed=args.seed,
                     users_per_chunk=args.chunk, checkpoint_every=0, saves=saves) as run:
        for done in run:
            bar.update(done)
            if bar.n % (20 * args.chunk) == 0:     # the load average each time 20 more chunks of users are done
                watch.sample()
    result = run.result()
    total_s = time.perf_counter() - t0
    load = watch.result()
    summary = result.summary
    saved, save_s, n_q = saves.saved, saves.seconds, summary["queries"]
    # Loading one user: open the store afresh, then the user's usable params.
    rng = np.random.default_rng(0)
    users = ps.users()
    loads = []
    for u in rng.choice(users, size=min(20, len(users)), replace=False):
        t = time.perf_counter()
        p = user_params(PolicyStore.open(path), str(u))
        jax.block_until_ready(p)
        loads.append(time.perf_counter() - t)
    user_bytes = ps.user_bytes(users[0]) if hasattr(ps, "user_bytes") else None
    disk = du(path)
    row = {"scope": scope, "users": args.users, "queries_per_user": spec.queries, "dim": spec.dim,
           "rank": args.rank if scope == "hybrid" else None, "users_per_chunk": args.chunk,
           "seconds": round(total_s, 1), "save_seconds": round(save_s, 1),
           "queries_per_s": round(n_q / total_s, 1), "prequential_recall@5": summary["recall@5"],
           "users_saved": saved, "store_bytes": disk, "bytes_per_user_on_disk": user_bytes,
           "store_bytes_per_saved_user": disk / max(saved, 1),
           "load_one_user_s": spread(loads),
           # "_mb" (the committed results' and the docs' key) holds MiB
           "peak_rss_mb_so_far": peak_rss_mib(), "loadavg": os.getloadavg(), "load": load,
           "setting": setting_record(args.preset, setting_for(scope, args, spec))}
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    return row


def throughput(args) -> dict:
    """hybrid vs user queries/s on 1,000 users × 200 queries, interleaved repeats, no saving."""
    spec = VectorSpec(dim=args.dim, memories=100, queries=200)
    chunks = [list(c) for c in vector_chunks(spec, args.seed, args.tp_users, args.chunk)]
    params = rj.init_reranker(jax.random.key(0), spec.dim)
    programs = {s: program_for(s, args, spec) for s in ("user", "hybrid")}
    times = {s: [] for s in programs}
    for rep in range(args.repeats + 1):                     # repeat 0 compiles (not counted)
        for s, program in (programs.items() if rep % 2 else reversed(programs.items())):
            t0 = time.perf_counter()
            for _ in drive(chunks, program, params, seed=args.seed, users_per_chunk=args.chunk):
                pass
            if rep:
                times[s].append(time.perf_counter() - t0)
            print(f"  repeat {rep} {s}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    n_q = args.tp_users * spec.queries
    qps = {s: [n_q / t for t in ts] for s, ts in times.items()}
    ratios = [h / u for h, u in zip(qps["hybrid"], qps["user"])]
    return {"users": args.tp_users, "queries_per_user": spec.queries, "dim": spec.dim, "rank": args.rank,
            "users_per_chunk": args.chunk, "repeats": args.repeats,
            "queries_per_s": {s: spread(v) for s, v in qps.items()}, "hybrid_over_user": spread(ratios),
            "loadavg": os.getloadavg(),
            "settings": {s: setting_record(args.preset, setting_for(s, args, spec)) for s in programs}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--users", type=positive_int, default=10_000)
    ap.add_argument("--queries", type=positive_int, default=100)
    ap.add_argument("--dim", type=positive_int, default=384)
    ap.add_argument("--rank", type=positive_int, default=DEFAULT_RANK)
    ap.add_argument("--scopes", default="hybrid", help="comma-separated scopes to run one after another")
    ap.add_argument("--chunk", type=positive_int, default=250, help="users per compiled call")
    ap.add_argument("--user-save-limit", type=int, default=200, help="users of scope `user` written to disk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="default", choices=tuple(rj.PRESETS), help="the learner")
    ap.add_argument("--offset", type=float, default=None,
                    help="the logistic loss's offset, the best memory's logit (default: the preset's)")
    ap.add_argument("--root", type=Path, default=None, help="where the policy stores go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the policy stores")
    ap.add_argument("--streams", type=Path, default=None, help="the synthetic streams' file, written before the "
                    "timed run if it does not hold this population (default: in --root; reused while it matches)")
    ap.add_argument("--throughput", action="store_true", help="only the hybrid-vs-user throughput comparison")
    ap.add_argument("--tp-users", type=positive_int, default=1000)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = {"machine": {"cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend()},
           "preset": args.preset, "offset": args.offset}
    if args.throughput:
        out["throughput"] = throughput(args)
        t = out["throughput"]
        print(f"1,000 users x 200 queries, d={args.dim}: hybrid/user = {t['hybrid_over_user']['median']:.2f}x "
              f"[{t['hybrid_over_user']['min']:.2f}, {t['hybrid_over_user']['max']:.2f}]; "
              + ", ".join(f"{s} {v['median']:.0f} q/s" for s, v in t["queries_per_s"].items()))
    else:
        spec = VectorSpec(dim=args.dim, memories=100, queries=args.queries)
        root = args.root or Path(tempfile.mkdtemp(prefix="rmm-scale-"))
        root.mkdir(parents=True, exist_ok=True)
        streams = StreamFile(args.streams or root / f"streams-{args.users}x{args.queries}-seed{args.seed}.bin",
                             spec, args.seed, args.users)
        out["streams"] = {"file": str(streams.path), "bytes": streams.users * streams.record.itemsize,
                          "generated_s": None if streams.ready() else round(streams.write(), 1)}
        out["rows"] = [run_scope(s, args, spec, root, streams) for s in args.scopes.split(",")]
        out["peak_rss_mb"] = peak_rss_mib()             # MiB, under the key the results and docs read
        print(f"{'scope':<8}{'users':>8}{'seconds':>9}{'q/s':>9}{'R@5':>7}{'B/user':>11}{'load 1 user':>12}")
        for r in out["rows"]:
            print(f"{r['scope']:<8}{r['users']:>8}{r['seconds']:>9}{r['queries_per_s']:>9.0f}"
                  f"{r['prequential_recall@5']:>7.3f}{r['store_bytes_per_saved_user']:>11.0f}"
                  f"{r['load_one_user_s']['median']:>11.3f}s")
        print(f"peak RSS {out['peak_rss_mb']} MB")
        if not args.keep and args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        write_result(args.json, out)


if __name__ == "__main__":
    main()
