"""Soak test: many synthetic users through ``rmm-jax simulate`` then ``rmm-jax replay``,
with peak memory that must not grow with the number of users.

For each user count in ``--users`` (default 1000 and 10000):

1. a synthetic embedding store is written directly as arrays (no model, no dialogue
   text): ``--memories`` (64) memories and ``--queries`` (100) queries per user, dim
   ``--dim`` (32); each query is a noisy copy of one of the user's memories (its gold
   memory), so the base retriever and the reranker have signal. The layout is the
   standard one (``rmm_jax.data.store``), validated by ``open_store``.
2. ``rmm-jax simulate STORE --policies P1 --log-out LOG`` (its default citations, the
   class-calibrated oracle) runs the
   online loop over every user, writing per-user policies and the citation log (one
   record per query, appended chunk by chunk and renamed into place at the end).
3. ``rmm-jax replay STORE --log LOG --policies P2`` validates the whole log in one
   streaming pass, then replays it ``--users-per-chunk`` users at a time.

Both commands run as the real console script in a child process; the peak RSS of each
child is read from ``os.wait4`` (``ru_maxrss``). Reported per run: wall seconds, users/s,
queries/s, peak RSS (MiB), and the disk use of the policy store and the log.

The bound: peak RSS must stay under ``--rss-bound-mib`` (default 1500 MiB) for every user
count, and the largest run's peak may exceed the smallest's by at most
``--growth-mib`` (default 150 MiB) — what remains per user is O(1) ids and summary
numbers (~a few hundred bytes/user: the per-user summary and the users table). PASS/MISS
is printed, and the exit status is 1 on a MISS.

Usage::

    .venv/bin/python benchmarks/soak.py [--users 1000,10000] [--json OUT.json] [--workdir DIR]

``--users 200,1000`` is a minute-long smoke run. Disk: at d=32 a user's policy (params,
Adam moments, learner state) is ~25 KB (at d=384 it is ~3.5 MB/user).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # benchmarks/_common.py
import numpy as np

from rmm_jax.data.store import FORMAT, VERSION
from rmm_jax.persist.atomic import atomic_dir

ROOT = _common.REPO


def write_synthetic_store(path: Path, users: int, memories: int, queries: int, dim: int, seed: int = 0) -> dict:
    """A store of ``users`` users written directly (fast): unit-norm random memories, queries
    = gold memory + noise. Same files and manifest as :func:`rmm_jax.data.store.write_store`."""
    rng = np.random.default_rng(seed)
    n_mem, n_q = users * memories, users * queries
    manifest = {"format": FORMAT, "version": VERSION, "model": f"soak/random-{dim}", "dim": dim,
                "granularity": "turn", "dataset": "soak", "spec": f"soak:users={users}",
                "counts": {"users": users, "memories": n_mem, "queries": n_q}, "stats": {}}
    with atomic_dir(path) as tmp:
        mem = np.lib.format.open_memmap(tmp / "memories.npy", "w+", np.float32, (n_mem, dim))
        qry = np.lib.format.open_memmap(tmp / "queries.npy", "w+", np.float32, (n_q, dim))
        rows_u = []
        with open(tmp / "memories.jsonl", "w") as fm, open(tmp / "queries.jsonl", "w") as fq:
            for u in range(users):
                m = rng.standard_normal((memories, dim)).astype(np.float32)
                m /= np.linalg.norm(m, axis=1, keepdims=True)
                gold = rng.integers(0, memories, queries)
                q = m[gold] + 2.5 * rng.standard_normal((queries, dim)).astype(np.float32) / np.sqrt(dim)
                q /= np.linalg.norm(q, axis=1, keepdims=True)
                mem[u * memories:(u + 1) * memories] = m
                qry[u * queries:(u + 1) * queries] = q
                uid = f"u{u:06d}"
                fm.writelines(f'{{"user": "{uid}", "id": "m{j}", "text": ""}}\n' for j in range(memories))
                fq.writelines(f'{{"user": "{uid}", "id": "q{i}", "text": "", "gold_memory_ids": ["m{g}"]}}\n'
                              for i, g in enumerate(gold))
                rows_u.append({"id": uid, "mem_start": u * memories, "mem_end": (u + 1) * memories,
                               "query_start": u * queries, "query_end": (u + 1) * queries})
        mem.flush(), qry.flush()
        del mem, qry
        (tmp / "users.json").write_text(json.dumps(rows_u) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def run_measured(argv: list[str], out_path: Path) -> dict:
    """Run a child; return wall seconds, exit code and its peak RSS (from wait4)."""
    t0 = time.perf_counter()
    with open(out_path, "w") as out, open(out_path.with_suffix(".err"), "w") as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = out_path.with_suffix(".err").read_text()[-2000:]
        raise SystemExit(f"{' '.join(argv[:3])} failed with status {code}:\n{tail}")
    return {"seconds": round(wall, 2), "peak_rss_mib": _common.peak_rss_mib(ru)}


def soak(users: int, args, work: Path) -> dict:
    d = work / f"u{users}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    t0 = time.perf_counter()
    write_synthetic_store(d / "store", users, args.memories, args.queries, args.dim)
    t_store = time.perf_counter() - t0
    exe = [str(ROOT / ".venv" / "bin" / "rmm-jax")] if (ROOT / ".venv" / "bin" / "rmm-jax").exists() \
        else [sys.executable, "-m", "rmm_jax.cli.main"]
    common = ["--k", str(args.k), "--m", str(args.m), "--users-per-chunk", str(args.users_per_chunk), "--json"]
    sim = run_measured(exe + ["simulate", str(d / "store"), "--policies", str(d / "pol_sim"),
                              "--log-out", str(d / "log.jsonl")] + common, d / "simulate.json")
    rep = run_measured(exe + ["replay", str(d / "store"), "--log", str(d / "log.jsonl"),
                              "--policies", str(d / "pol_replay")] + common, d / "replay.json")
    s_sum, r_sum = json.loads((d / "simulate.json").read_text()), json.loads((d / "replay.json").read_text())
    nq = users * args.queries
    out = {"users": users, "queries": nq, "store_seconds": round(t_store, 2),
           "store_bytes": _common.du(d / "store"), "log_bytes": _common.du(d / "log.jsonl")}
    for name, m, summ, pol in (("simulate", sim, s_sum, "pol_sim"), ("replay", rep, r_sum, "pol_replay")):
        out[name] = {**m, "users_per_s": round(users / m["seconds"], 1), "queries_per_s": round(nq / m["seconds"], 1),
                     "policy_store_bytes": _common.du(d / pol), "online_queries": summ["online"]["queries"],
                     f"recall@{args.m}": summ["online"][f"recall@{args.m}"],
                     f"base_recall@{args.m}": summ["base"][f"recall@{args.m}"]}
    out["replay"]["log_records"] = r_sum["log"]["records"]
    out["replay_matches_simulate"] = s_sum["online"][f"recall@{args.m}"] == r_sum["online"][f"recall@{args.m}"]
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=_common.HelpFormatter)
    ap.add_argument("--users", type=_common.positive_int_list, default="1000,10000",
                    help="Comma-separated user counts (one soak each).")
    ap.add_argument("--queries", type=_common.positive_int, default=100, help="Queries per user.")
    ap.add_argument("--memories", type=_common.positive_int, default=64, help="Memories per user.")
    ap.add_argument("--dim", type=_common.positive_int, default=32, help="Embedding dimension.")
    ap.add_argument("--k", type=_common.positive_int, default=20)
    ap.add_argument("--m", type=_common.positive_int, default=5)
    ap.add_argument("--users-per-chunk", type=_common.positive_int, default=256)
    ap.add_argument("--rss-bound-mib", type=float, default=1500.0, help="Peak RSS bound for every run.")
    ap.add_argument("--growth-mib", type=float, default=150.0,
                    help="Allowed peak-RSS growth from the smallest to the largest user count.")
    ap.add_argument("--workdir", default=None, help="Where stores/logs/policies go (default: a temp dir).")
    ap.add_argument("--keep", action="store_true", help="Keep each run's files.")
    ap.add_argument("--json", dest="json_out", default=None, help="Write the results as JSON here.")
    args = ap.parse_args(argv)
    if args.memories < args.k:      # simulate would log fewer than --k candidates, which replay refuses
        ap.error(f"--memories {args.memories} is below --k {args.k}: each call retrieves --k candidates "
                 f"(give --k {args.memories} or fewer)")
    counts = args.users
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rmm-soak-"))
    watch = _common.LoadWatch()
    results = []
    for n in sorted(counts):
        results.append(soak(n, args, work))
        watch.sample()
    peaks = [max(r["simulate"]["peak_rss_mib"], r["replay"]["peak_rss_mib"]) for r in results]
    growth = peaks[-1] - peaks[0]
    ok_bound = max(peaks) <= args.rss_bound_mib
    ok_growth = growth <= args.growth_mib
    hdr = (f"{'users':>7} {'queries':>9} {'job':>8} {'seconds':>8} {'users/s':>8} {'queries/s':>10} "
           f"{'peak RSS MiB':>12} {'policies MiB':>12} {'R@' + str(args.m):>7} {'base':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        for job in ("simulate", "replay"):
            j = r[job]
            print(f"{r['users']:>7} {r['queries']:>9} {job:>8} {j['seconds']:>8.1f} {j['users_per_s']:>8.1f} "
                  f"{j['queries_per_s']:>10.0f} {j['peak_rss_mib']:>12.1f} {j['policy_store_bytes'] / 2**20:>12.1f} "
                  f"{j[f'recall@{args.m}']:>7.4f} {j[f'base_recall@{args.m}']:>7.4f}")
        print(f"{'':>7} log {r['log_bytes'] / 2**20:.1f} MiB, store {r['store_bytes'] / 2**20:.1f} MiB "
              f"(written in {r['store_seconds']:.1f}s); replay reproduces simulate's recall: "
              f"{r['replay_matches_simulate']}")
    print(f"peak RSS bound {args.rss_bound_mib:.0f} MiB: {'PASS' if ok_bound else 'MISS'} (max {max(peaks):.1f}); "
          f"growth {counts[0] if len(counts) == 1 else sorted(counts)[0]}->{sorted(counts)[-1]} users "
          f"{growth:+.1f} MiB (allowed {args.growth_mib:.0f}): {'PASS' if ok_growth else 'MISS'}")
    doc = {"config": {k: v for k, v in vars(args).items() if k != "json_out"}, "runs": results,
           "peak_rss_mib": peaks, "growth_mib": round(growth, 1), "pass": ok_bound and ok_growth,
           "load": watch.result()}
    if args.json_out:
        _common.write_result(args.json_out, doc)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if doc["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
