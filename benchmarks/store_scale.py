"""Policy-store scale: save N synthetic hybrid-scope users, then open the store and load
one random user, as a server answering one user's query would.

Per user (hybrid scope, d=384, rank 8), as ``PolicyStore.save`` gets it from the online loop:
params ``{q: {a: (384, 8), b: (384, 8)}, m: {a, b}}`` float32, an optax Adam state
``(ScaleByAdamState(count, mu, nu), EmptyState())`` with moments of the same shapes, and
a learner state ``{baseline f32, step i32, key (2,) u32}``: 147,472 array bytes.

1. A store is created in a temp dir (``--workdir``), and N users are saved in
   ``save`` calls of ``--per-save`` users (chunks sized by bytes, the default).
   Reported: total and per-call save time, bytes on disk per user (allocated blocks of the
   whole store / N, and :meth:`PolicyStore.user_bytes`), the index size.
2. For comparison, a few ``user``-scope states at d=384 (two (384, 384) kernels + two
   Adam moments) are saved to a second store and their bytes per user reported.
3. 20 random users are loaded, each with a NEW ``PolicyStore`` object (open + load,
   checked against what was saved). Before each load the user's chunk files are evicted
   from the page cache (``posix_fadvise(DONTNEED)``), so the chunk is read from disk;
   the index and the Python process are warm. Median and max are reported, and the same
   20 loads again with the chunk cached. One load in a fresh Python process (imports
   included) is timed too.
4. A night rolled back (``--rollback``, the default): every user saved once more, in the same
   calls, as a second night's run, then :func:`rmm_jax.persist.policy_rollback.rollback`
   undoes that run (``rmm-jax policies rollback``). Reported: its seconds, the versions it
   forgot and the bytes freed; 20 random users are checked to load their first night's
   state again. The store holds both nights meanwhile (twice the disk).
5. Peak RSS of this process (``ru_maxrss``).

Targets: loading one user from a 100,000-user store in <= 1 s; saving 100,000 users in
1,000-user calls in a few minutes.

Usage::

    .venv/bin/python benchmarks/store_scale.py [--users 10000] [--per-save 1000] [--json]
        [--workdir DIR] [--keep] [--no-rollback] [--out benchmarks/results/store_scale.json]

The result is merged into ``--out`` when given (one entry per (users, per_save), replacing an
older one, each entry with the ``provenance`` of the run that wrote it; without ``--out`` no
file is written); ``--json`` also prints it on stdout. The store is deleted afterwards unless
``--keep``. Disk: ~150 KB per user (100,000 users: ~15 GB).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # benchmarks/_common.py
import jax
import numpy as np
import optax

from rmm_jax.core.types import LearnerState, UserState
from rmm_jax.persist.policy_rollback import rollback
from rmm_jax.persist.policy_store import PolicyMeta, PolicyStore

ROOT = _common.REPO

D, RANK = 384, 8
META = PolicyMeta("linear", D, scope="hybrid", rank=RANK, config={"benchmark": "store_scale"})


def hybrid_block(n: int, rng: np.random.Generator) -> UserState:
    """Stacked hybrid states of ``n`` users (random values)."""
    def factors():
        return {s: {f: rng.standard_normal((n, D, RANK), dtype=np.float32) for f in ("a", "b")} for s in ("q", "m")}

    adam = (optax.ScaleByAdamState(count=np.ones(n, np.int32), mu=factors(), nu=factors()), optax.EmptyState())
    learner = LearnerState(baseline=np.zeros(n, np.float32), step=np.zeros(n, np.int32),
                           key=rng.integers(0, 2**32, (n, 2), dtype=np.uint32))
    return UserState(factors(), adam, learner)


def uid(i: int) -> str:
    return f"user_{i:07d}"


def user_scope_bytes(work: Path) -> dict:
    """Bytes per user of a user-scope d=384 policy (2 kernels + Adam), 4 users saved."""
    rng = np.random.default_rng(1)
    n = 4
    k = lambda: {s: {"W": {"kernel": rng.standard_normal((n, D, D), dtype=np.float32)}}  # noqa: E731
                 for s in ("q_adapter", "m_adapter")}
    state = UserState(k(), (optax.ScaleByAdamState(np.ones(n, np.int32), k(), k()), optax.EmptyState()),
                      LearnerState(np.zeros(n, np.float32), np.zeros(n, np.int32), np.zeros((n, 2), np.uint32)))
    st = PolicyStore.create(work / "user_scope", META._replace(scope="user", rank=None), {})
    st.save([uid(i) for i in range(n)], state)
    ub = st.user_bytes(uid(0))
    return {"array_bytes": ub["array_bytes"], "bytes_on_disk": ub["bytes"], "users_per_chunk": ub["users_in_chunk"]}


def load_in_fresh_process(path: Path, user: str) -> dict:
    code = ("import json, time; t0 = time.perf_counter()\n"
            "from rmm_jax.persist.policy_store import PolicyStore\n"
            "t1 = time.perf_counter()\n"
            f"PolicyStore.open({str(path)!r}).load({user!r})\n"
            "t2 = time.perf_counter()\n"
            "print(json.dumps({'import_s': t1 - t0, 'open_and_load_s': t2 - t1}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def save_night(st: PolicyStore, n: int, per_save: int, block: UserState, night: int) -> list[float]:
    """Every user saved once, ``per_save`` at a time, as one run (each version records it);
    each user's baseline is its global index plus ``night``, so a load can be checked.
    Returns the seconds of each save call."""
    run_rec, save_s, t_all = {"first_version": st.next_version(), "setting_before": None}, [], time.perf_counter()
    for lo in range(0, n, per_save):
        hi = min(n, lo + per_save)
        part = jax.tree_util.tree_map(lambda a: a[:hi - lo], block)
        part = part._replace(learner_state=part.learner_state._replace(
            baseline=np.arange(lo, hi, dtype=np.float32) + night))
        t = time.perf_counter()
        st.save([uid(i) for i in range(lo, hi)], part, [{"i": i} for i in range(lo, hi)], shared_version=1,
                run=run_rec)
        save_s.append(time.perf_counter() - t)
        if len(save_s) % 10 == 0 or hi == n:
            print(f"  night {night}: saved {hi:,}/{n:,} users  ({time.perf_counter() - t_all:.1f} s)",
                  file=sys.stderr, flush=True)
    return save_s


def night_rolled_back(st: PolicyStore, n: int, per_save: int, block: UserState, picks: list[int]) -> dict:
    """A second night saved and rolled back (step 4): the rollback's seconds, what it forgot,
    the bytes it freed; the picked users load their first night again."""
    save_night(st, n, per_save, block, night=1)
    before = _common.du_allocated(st.path)[0]
    t = time.perf_counter()
    undone = rollback(PolicyStore.open(st.path))
    seconds = time.perf_counter() - t
    after = _common.du_allocated(st.path)[0]
    reader = PolicyStore.open(st.path)
    for i in picks:
        assert float(reader.load(uid(i)).state.learner_state.baseline) == i
    assert len(undone.users) == n and not undone.removed
    return {"rollback_s": round(seconds, 2), "versions_forgotten": len(undone.versions),
            "bytes_freed": before - after, "users_back": len(undone.users)}


def run(n: int, per_save: int, work: Path, loads: int = 20, seed: int = 0, night: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    path = work / "store"
    st = PolicyStore.create(path, META, {})
    block = hybrid_block(min(per_save, n), rng)
    t_all = time.perf_counter()
    save_s = save_night(st, n, per_save, block, night=0)
    total_save = time.perf_counter() - t_all
    alloc, apparent = _common.du_allocated(path)
    ub = st.user_bytes(uid(0))

    picks = random.Random(seed).sample(range(n), min(loads, n))
    cold, warm = [], []
    for pass_, out in (("cold", cold), ("warm", warm)):
        for i in picks:
            e = st.entries(uid(i))[-1]
            if pass_ == "cold":
                _common.drop_page_cache(path / "gens" / f"v{e.version:08d}" / f"c{e.chunk:04d}")
            t = time.perf_counter()
            pol = PolicyStore.open(path).load(uid(i))
            out.append(time.perf_counter() - t)
            row = i % per_save
            assert float(pol.state.learner_state.baseline) == i and pol.info == {"i": i}
            assert np.array_equal(pol.state.params["q"]["a"], block.params["q"]["a"][row])
    fresh = load_in_fresh_process(path, uid(picks[0]))
    t = time.perf_counter()
    n_users = PolicyStore.open(path).n_users()
    n_users_s = time.perf_counter() - t
    assert n_users == n
    rolled = night_rolled_back(st, n, per_save, block, picks) if night else None
    return {
        "users": n, "per_save": per_save, "saves": len(save_s),
        "provenance": _common.provenance(),
        "user_state": "hybrid d=384 rank 8: params q/m a,b (384,8) f32 + Adam mu,nu + learner state",
        "save_total_s": round(total_save, 2), "save_call_s_median": round(float(np.median(save_s)), 3),
        "save_call_s_max": round(max(save_s), 3), "users_per_s": round(n / total_save, 1),
        # a save must not slow down as the store grows: the first and the last 10 calls
        "save_call_s_median_first10": round(float(np.median(save_s[:10])), 3),
        "save_call_s_median_last10": round(float(np.median(save_s[-10:])), 3),
        "store_bytes_allocated": alloc, "store_bytes_apparent": apparent,
        "bytes_per_user_on_disk": round(alloc / n), "index_sqlite_bytes": (path / "index.sqlite").stat().st_size,
        "user_bytes": ub, "user_scope_d384_bytes_per_user": user_scope_bytes(work),
        "load_one_user_s_median": round(float(np.median(cold)), 4), "load_one_user_s_max": round(max(cold), 4),
        "load_one_user_cached_s_median": round(float(np.median(warm)), 4),
        "load_fresh_process": {k: round(v, 3) for k, v in fresh.items()},
        "n_users_s": round(n_users_s, 4), "night_rolled_back": rolled,
        "peak_rss_mib": _common.peak_rss_mib(),
        "target_load_le_1s": bool(max(cold) <= 1.0),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=_common.HelpFormatter)
    ap.add_argument("--users", type=_common.positive_int, default=10_000, help="Users to save.")
    ap.add_argument("--per-save", type=_common.positive_int, default=1000, help="Users per save call.")
    ap.add_argument("--loads", type=_common.positive_int, default=20, help="Random users to load.")
    ap.add_argument("--json", action="store_true", help="Also print the result as JSON on stdout.")
    ap.add_argument("--out", type=Path, default=None,
                    help="Results file; this run's entry is merged in (default: none written).")
    ap.add_argument("--workdir", default=None, help="Where the store goes (default: a temp dir).")
    ap.add_argument("--keep", action="store_true", help="Keep the store.")
    ap.add_argument("--rollback", action=argparse.BooleanOptionalAction, default=True,
                    help="Step 4: save every user once more and time rolling that night back (twice the disk).")
    args = ap.parse_args(argv)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="store_scale-", dir=args.workdir))
    watch = _common.LoadWatch()
    try:
        res = {**run(args.users, args.per_save, work, args.loads, night=args.rollback), "load": watch.result()}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.out is not None:
        out = args.out
        doc = json.loads(out.read_text()) if out.exists() else {"benchmark": "store_scale", "runs": []}
        doc["runs"] = [r for r in doc["runs"]
                       if (r["users"], r["per_save"]) != (res["users"], res["per_save"])] + [res]
        doc["runs"].sort(key=lambda r: (r["users"], r["per_save"]))
        _common.write_result(out, doc)    # the file's provenance: the newest run's (each run keeps its own)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['users']:,} users in {res['saves']} saves: {res['save_total_s']} s; "
              f"{res['bytes_per_user_on_disk']:,} B/user on disk; load one user {res['load_one_user_s_median']} s "
              f"median, {res['load_one_user_s_max']} s max; peak RSS {res['peak_rss_mib']} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
