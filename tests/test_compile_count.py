"""The jitted online loop compiles once per padded shape, not per user or per stream length.

``make_run`` returns one ``jax.jit`` function; its ``_cache_size()`` counts compiled
executables. Running ``run_streams`` with ``users_per_chunk=4`` over 3 users (one padded
chunk) and then 11 users (three chunks, the last padded) must not add compilations, nor
must streams of 57 vs 64 queries with batch 4 (15 vs 16 batches → both the 16-batch
bucket; banks of 50 vs 56 memories → both the 56 bucket). A stream of 100 queries (25
batches → 28-batch bucket) is the positive control: it compiles exactly once more.

Also: ``benchmarks/throughput.py --quick --json`` runs and writes every top-level key.
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np

import rmm_jax as rj
from rmm_jax.data.citations import oracle_cite
from rmm_jax.online.loop import Stream, make_run, run_streams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, K = 8, 6


def mk(rng, uid, t, n):
    bank = rng.normal(size=(n, D)).astype(np.float32)
    q = rng.normal(size=(t, D)).astype(np.float32)
    cand = np.argsort(-(q @ bank.T), 1)[:, :K].astype(np.int32)
    gold = rng.random((t, n)) < 0.1
    return Stream(uid, bank, q, cand, np.ones((t, K), bool), np.take_along_axis(gold, cand, 1),
                  gold.sum(1).astype(np.int32), gold.sum(1) > 0)


def drain(run, streams, cfg, params):
    n = 0
    for chunk, states, outputs in run_streams(streams, params, cfg, cite_fn=oracle_cite, users_per_chunk=4,
                                              run_fn=run):
        n += len(chunk)
        assert np.all(np.isfinite(np.asarray(states[0]["q_adapter"]["W"]["kernel"])))
    return n


def test_compilations_do_not_grow_with_users_or_lengths_within_a_bucket():
    rng = np.random.default_rng(0)
    cfg = rj.Config(k=K, m=2, batch=4)
    params = rj.init_reranker(jax.random.key(0), D)
    run = make_run(cfg, oracle_cite)
    assert run._cache_size() == 0

    assert drain(run, [mk(rng, f"a{i}", 57, 50) for i in range(3)], cfg, params) == 3
    assert run._cache_size() == 1
    assert drain(run, [mk(rng, f"b{i}", 57, 50) for i in range(11)], cfg, params) == 11
    assert run._cache_size() == 1                              # more users: same program
    assert drain(run, [mk(rng, f"c{i}", 64, 56) for i in range(5)], cfg, params) == 5
    assert run._cache_size() == 1                              # 57 vs 64 queries: same bucket
    assert drain(run, [mk(rng, "d0", 100, 60)], cfg, params) == 1
    assert run._cache_size() == 2                              # control: a new bucket compiles


def test_throughput_quick_writes_json(tmp_path):
    out = tmp_path / "tmp.json"
    png = tmp_path / "tmp.png"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "throughput.py"), "--quick",
                           "--json", str(out), "--plot", str(png)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for key in ("configs", "users_scaling", "floor", "machine", "date"):
        assert key in res, key
    assert set(res["configs"]) == {"paper", "large", "mlp"}
    for r in res["configs"].values():
        assert r["rmm_jax_qps"] > 0 and r["torch_qps"] > 0 and r["rmm_jax_compile_s"] > 0
    assert res["configs"]["paper"]["numpy_qps"] > 0
    assert all(r["seconds"] > 0 for r in res["users_scaling"].values())
    assert res["machine"]["bandwidth_GBps"] > 0 and res["machine"]["matmul_GFLOPs"] > 0
    assert png.stat().st_size > 0
    assert "PASS" in proc.stdout or "MISS" in proc.stdout
