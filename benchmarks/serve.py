"""Serving latency and throughput: ``Reranker.rank`` against a 100,000-user hybrid policy store.

    python benchmarks/serve.py --json benchmarks/results/serve.json

The store holds ``--users`` hybrid users (d = 384, rank 8: each user's low-rank factors,
their Adam moments and learner state, 147 KB a user, as ``simulate --scope hybrid``
writes them) saved against one shared version; their values are random (serving cost does
not depend on them). It is built once into ``--store`` (kept for reuse with ``--keep``).

Measured, each as a median of ``--repeats`` interleaved repeats with [min, max]:

* **cold**: one query (K = 20 candidates, top 5) for a user whose policy is not in the
  reranker's cache: the load (an indexed SQLite lookup, the chunk's ``chunk.json``
  verified against its checksum, the user's own row read and verified against its
  sha256, the user's factors handed to the compiled ranking beside their shared version,
  which one reranker reads and places once) plus the ranking. p50 and p99 over
  ``--samples`` random users, from the OS page cache as the build left it (the store's
  files may be in memory).
* **cold from disk**: the same for ``--samples`` other users after the store's pages were
  dropped from the OS page cache (``posix_fadvise(DONTNEED)`` on every file of the store,
  which needs no root), so the chunk's files and the row come from the disk.
* **warm**: the same users again, their policies cached on the device: the ranking alone.
* **batched**: ``--batch`` queries of one cached user in one call: queries/s.

The 1-minute load average is sampled at every repeat (``load``; ``noisy``: above 2.5).
Targets: cold p50 ≤ 3 ms and p99 ≤ 10 ms; warm and batched no worse than before the
per-user rows (0.53 ms and 25,084 queries/s, ``serve.json`` at commit 03e0b1c, written by code at
c655ff9).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from _common import HelpFormatter, LoadWatch, drop_page_cache, positive_int, spread, timed, write_result
from tqdm import tqdm

import rmm_jax as rj
from rmm_jax.online.serve import Reranker
from rmm_jax.persist.policy_store import FORMAT_VERSION, STORE_FILE, PolicyMeta, PolicyStore


def build(path: Path, users: int, dim: int, rank: int, per_save: int = 2000) -> None:
    """A hybrid store of ``users`` random users, saved ``per_save`` at a time."""
    layout, est, opt = rj.preset("default", scope="hybrid", rank=rank)
    params = rj.init_reranker(jax.random.key(0), dim)
    store = PolicyStore.create(path, PolicyMeta.of(layout, dim, benchmark="serve"), params)
    sv = store.save_shared(rj.init_shared(params, layout, opt))
    one = jax.jit(jax.vmap(lambda k: rj.init_user(params, k, layout, est, opt)))
    noise = jax.jit(lambda t, k: jax.tree.map(lambda x: x + 0.01 * jax.random.normal(k, x.shape), t))
    with store.writer(), tqdm(total=users, desc="build", unit="user", file=sys.stderr) as bar:
        for lo in range(0, users, per_save):
            n = min(per_save, users - lo)
            keys = jax.random.split(jax.random.fold_in(jax.random.key(1), lo), n)
            st = one(keys)
            st = st._replace(params=noise(st.params, keys[0]))
            store.save([f"u{i:07d}" for i in range(lo, lo + n)], jax.device_get(st), shared_version=sv)
            bar.update(n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--users", type=positive_int, default=100_000, help="hybrid users in the store")
    ap.add_argument("--dim", type=positive_int, default=384, help="embedding dimension")
    ap.add_argument("--rank", type=int, default=8, help="hybrid rank of each user's factors")
    ap.add_argument("--k", type=positive_int, default=20, help="candidates per query")
    ap.add_argument("--m", type=positive_int, default=5, help="memories returned per query")
    ap.add_argument("--samples", type=positive_int, default=200, help="users timed per repeat (cold, then warm)")
    ap.add_argument("--batch", type=positive_int, default=256, help="queries per batched call")
    ap.add_argument("--repeats", type=positive_int, default=3, help="interleaved repeats (median, min, max)")
    ap.add_argument("--store", type=Path, default=None, help="where the store is built (reused if present)")
    ap.add_argument("--keep", action="store_true", help="keep the store")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    root = args.store or Path(tempfile.mkdtemp(prefix="rmm-serve-")) / "store"
    t0 = time.perf_counter()
    if not root.exists():
        build(root, args.users, args.dim, args.rank)
    written = json.loads((root / STORE_FILE).read_text())["format_version"]
    if written != FORMAT_VERSION:
        sys.exit(f"error: {root} is a store of format {written}, not {FORMAT_VERSION} (what this rmm-jax writes); "
                 "the cost of a load depends on the format: pass a new --store")
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    q = rng.standard_normal((args.batch, args.dim)).astype(np.float32)
    cands = rng.standard_normal((args.batch, args.k, args.dim)).astype(np.float32)
    rows = {"cold_p50_ms": [], "cold_p99_ms": [], "cold_disk_p50_ms": [], "cold_disk_p99_ms": [],
            "warm_p50_ms": [], "warm_p99_ms": [], "batched_qps": []}
    Reranker.open(root).rank("u0000000", q[0], cands[0], args.m)          # compile once (both shapes)
    Reranker.open(root).rank("u0000000", q, cands, args.m)
    watch = LoadWatch()
    for rep in range(args.repeats):
        watch.sample()
        rr = Reranker.open(root, cache_users=2 * args.samples)              # a new store object: nothing cached
        drawn = [f"u{i:07d}" for i in rng.choice(args.users, 2 * args.samples, replace=False)]
        users, others = drawn[:args.samples], drawn[args.samples:]
        cold = [timed(lambda: rr.rank(u, q[i % 8], cands[i % 8], args.m).scores) for i, u in enumerate(users)]
        drop_page_cache(root)
        disk = [timed(lambda: rr.rank(u, q[i % 8], cands[i % 8], args.m).scores) for i, u in enumerate(others)]
        warm = [timed(lambda: rr.rank(u, q[i % 8], cands[i % 8], args.m).scores) for i, u in enumerate(users)]
        batched = [args.batch / timed(lambda: rr.rank(users[0], q, cands, args.m).scores) for _ in range(5)]
        rows["cold_p50_ms"].append(1e3 * np.percentile(cold, 50))
        rows["cold_p99_ms"].append(1e3 * np.percentile(cold, 99))
        rows["cold_disk_p50_ms"].append(1e3 * np.percentile(disk, 50))
        rows["cold_disk_p99_ms"].append(1e3 * np.percentile(disk, 99))
        rows["warm_p50_ms"].append(1e3 * np.percentile(warm, 50))
        rows["warm_p99_ms"].append(1e3 * np.percentile(warm, 99))
        rows["batched_qps"].append(float(np.median(batched)))
        print(f"repeat {rep}: cold p50 {rows['cold_p50_ms'][-1]:.1f} ms, p99 {rows['cold_p99_ms'][-1]:.1f} ms; "
              f"from disk p50 {rows['cold_disk_p50_ms'][-1]:.1f} ms, p99 {rows['cold_disk_p99_ms'][-1]:.1f} ms; warm "
              f"p50 {rows['warm_p50_ms'][-1]:.2f} ms, p99 {rows['warm_p99_ms'][-1]:.2f} ms; batched "
              f"{rows['batched_qps'][-1]:.0f} queries/s", flush=True)
    ps = PolicyStore.open(root)
    out = {"setup": {"users": ps.n_users(), "dim": args.dim, "rank": args.rank, "k": args.k, "m": args.m,
                     "samples": args.samples, "batch": args.batch, "repeats": args.repeats,
                     "bytes_per_user": ps.user_bytes("u0000000")["bytes"], "build_s": round(build_s, 1),
                     "backend": jax.default_backend(), "device": str(jax.devices()[0])},
           **{k: spread(v) for k, v in rows.items()}, "load": watch.result()}
    out["targets"] = [{"name": name, "value": out[key]["median"], "target": f"{op} {bound}",
                       "pass": out[key]["median"] <= bound if op == "<=" else out[key]["median"] >= bound,
                       "noisy": out["load"]["noisy"]}
                      for name, key, op, bound in (("cold p50 ms", "cold_p50_ms", "<=", 3.0),
                                                   ("cold p99 ms", "cold_p99_ms", "<=", 10.0),
                                                   ("cold from disk p50 ms", "cold_disk_p50_ms", "<=", 3.0),
                                                   ("cold from disk p99 ms", "cold_disk_p99_ms", "<=", 10.0),
                                                   ("warm p50 ms", "warm_p50_ms", "<=", 0.53),
                                                   ("batched queries/s", "batched_qps", ">=", 25084.0))]
    for t in out["targets"]:
        print(f"  {'PASS' if t['pass'] else 'MISS'}  {t['name']}: {t['value']:.2f} (target {t['target']})"
              + (" NOISY" if t["noisy"] else ""))
    if args.json:
        write_result(args.json, out)
    if not args.keep and args.store is None:
        shutil.rmtree(root.parent, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
