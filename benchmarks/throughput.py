"""Throughput of rmm-jax's online loop against eager PyTorch and NumPy references, and a floor.

What is timed (all in ONE process, on the same random data: L2-normalised query and memory
embeddings, candidates = base-retriever top-K by dot product, random gold labels, oracle
citations with the paper's precision/recall):

* ``configs`` — one user, one stream of ``--queries`` (512) queries, batch B=4:
  ``paper`` (linear, d=384, K=20, M=5), ``large`` (linear, d=1024, K=50, M=10) and
  ``mlp`` (d=384, hidden 384, K=20, M=5).
  - rmm-jax: the library's own path, ``rmm_jax.online.loop.make_run(cfg, oracle_cite)`` on a
    1-user chunk built by ``pad_streams`` (one jitted ``vmap``/``lax.scan``: score →
    prequential top-M eval → Gumbel top-M → oracle citations → REINFORCE + Adam).
    Compile time = ``run.lower(...).compile()``; steady time = median over ``--repeats``
    calls of the compiled executable on fresh states (data already on device; result
    blocked on). queries/s = real queries / steady seconds.
  - PyTorch eager (``benchmarks/ref_torch.py``): per-batch Python loop, naive scoring
    (all K memories adapted), the same prequential top-M eval, Gumbel top-M, oracle
    citations, exact Plackett–Luce REINFORCE (reward-to-go credit in all three
    implementations; the library's per-item default costs the same), ``loss.backward()``,
    ``torch.optim.Adam``.
    Median over ``--ref-repeats`` (1) runs of the whole stream, fresh model each time
    (default threads; BLAS thread pools suffer most on an oversubscribed machine, so
    check ``machine.load_avg`` in the JSON before trusting the ratios).
  - NumPy (``benchmarks/ref_numpy.py``, linear only): same loop with hand-written
    gradients and the fused O(d²+Kd) forward.
  The same work is done by all three (rmm-jax additionally computes NDCG and computes
  the forward twice, once for acting and once inside ``value_and_grad``).
* ``users_scaling`` — 1, 10, 100, 1000 users × ``--user-queries`` (200) queries, d=384,
  paper config, bank of 256 memories per user, through ``rmm_jax.online.driver.drive`` with
  ``users_per_chunk = min(users, --chunk)`` (100): end-to-end seconds after compile
  (host padding, state init, the jitted run, device→host copy), queries/s counting real
  (unpadded) queries. Compile time per chunk shape is reported separately. 200 queries
  = 50 batches are padded by the library to a 64-batch bucket, which is reported.
* ``floor`` — per query of the linear fused path:
  FLOPs = forward 4d² + 2Kd (q' = (I+A)q, v = (I+B)ᵀq', s = Mv) + backward 6d² + 2Kd
  (u = Mᵀ∂s, (I+B)u, two rank-B outer products) + Adam ≈ 12·P/B (P = 2d² parameters);
  bytes per update = 32·P (params, Adam μ and ν each read and written, the gradient
  written and read, float32) + B·K·d·4 gathered memories + B·d·4 queries.
  Time floor per batch = max(FLOPs / matmul rate, bytes / bandwidth), the roofline,
  with the memory bandwidth of a large array copy (max of numpy and jitted jax, counting
  read + write) and the rate of a large float32 jax matmul, both measured in this run.
  Printed: the floor's queries/s and the fraction of it reached.

Targets (reported, never asserted): paper config ≥ 20× PyTorch eager; 1000 users × 200
queries ≤ 60 s after compile; within 3× of the memory-traffic floor for the update-bound
configuration (``large``, and the 1000-user run, where 1000 users' Adam state cannot be
cached). Each prints PASS/MISS with its ratio.

Usage::

    python benchmarks/throughput.py [--json OUT.json] [--plot OUT.png] [--repeats 3] [--quick]

``--quick`` is a seconds-long smoke run with tiny shapes (used by the tests).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import ref_numpy  # noqa: E402
import ref_torch  # noqa: E402
import torch  # noqa: E402

import rmm_jax as rj  # noqa: E402
from rmm_jax.data.citations import oracle_cite  # noqa: E402
from rmm_jax.online.driver import ChunkDone, drive  # noqa: E402
from rmm_jax.online.loop import init_states, make_run  # noqa: E402
from rmm_jax.online.streams import Stream, bucket, pad_streams, user_key  # noqa: E402
from rmm_jax.persist.atomic import write_json  # noqa: E402

B = 4


# --------------------------------------------------------------------------- data

def make_stream(rng, uid, d, k, t, n):
    """Random user: normalised bank (n, d) and queries (t, d), top-k candidates, random gold."""
    bank = rng.standard_normal((n, d), dtype=np.float32)
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    q = rng.standard_normal((t, d), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    cand = np.argsort(-(q @ bank.T), axis=1)[:, :k].astype(np.int32)
    gold = np.zeros((t, n), bool)
    rows = np.arange(t)
    gold[rows, rng.integers(0, n, t)] = True                       # one gold anywhere in the bank
    hit = rng.random(t) < 0.7                                      # 70%: one gold among candidates
    gold[rows[hit], cand[rows[hit], rng.integers(0, k, hit.sum())]] = True
    cand_gold = np.take_along_axis(gold, cand, 1)
    num_gold = gold.sum(1).astype(np.int32)
    return Stream(uid, bank, q, cand, np.ones((t, k), bool), cand_gold, num_gold, num_gold > 0)


def stream_dict(s):
    return dict(bank=s.bank, q=s.queries, cand=s.cand, mask=s.cand_mask, gold=s.cand_gold, num_gold=s.num_gold)


def block(tree):
    return jax.tree.map(lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, tree)


# --------------------------------------------------------------------------- machine

def _copy_bandwidths(n_bytes):
    """(NumPy, JAX) bytes/s of a copy of ``n_bytes`` (read + write); the buffers die on return."""
    x = np.ones(n_bytes // 4, np.float32)
    y = np.empty_like(x)
    np.copyto(y, x)
    t_np = min(_timeit(lambda: np.copyto(y, x)) for _ in range(5))
    xj = jnp.ones(n_bytes // 4, jnp.float32)
    cp = jax.jit(lambda a: a * 1.0000001)                         # not elided, one read + one write
    cp(xj).block_until_ready()
    t_jx = min(_timeit(lambda: cp(xj).block_until_ready()) for _ in range(5))
    return 2 * n_bytes / t_np, 2 * n_bytes / t_jx


def measure_machine(quick):
    """Memory bandwidth (large copy, read+write bytes) and float32 matmul rate."""
    n_bytes = (16 if quick else 512) * 2 ** 20
    bw_np, bw_jx = _copy_bandwidths(n_bytes)
    nm = 512 if quick else 4096
    a = jnp.asarray(np.random.default_rng(0).standard_normal((nm, nm), dtype=np.float32))
    mm = jax.jit(lambda u, v: u @ v)
    mm(a, a).block_until_ready()
    t_mm = min(_timeit(lambda: mm(a, a).block_until_ready()) for _ in range(3))
    return {"bandwidth_GBps": max(bw_np, bw_jx) / 1e9, "bandwidth_numpy_GBps": bw_np / 1e9,
            "bandwidth_jax_GBps": bw_jx / 1e9, "copy_MiB": n_bytes / 2 ** 20,
            "matmul_GFLOPs": 2 * nm ** 3 / t_mm / 1e9, "matmul_n": nm,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_avg": os.getloadavg(), "backend": jax.default_backend(),
            "devices": [str(dv) for dv in jax.devices()], "jax": jax.__version__,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "numpy": np.__version__}


def _timeit(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def floor_for(d, k, machine, n_params):
    """Roofline floor per batch of B queries (see module docstring)."""
    flops = B * (10 * d * d + 4 * k * d) + 12 * n_params
    bytes_ = 32 * n_params + B * (k + 1) * d * 4
    t_c = flops / (machine["matmul_GFLOPs"] * 1e9)
    t_m = bytes_ / (machine["bandwidth_GBps"] * 1e9)
    return {"flops_per_query": flops / B, "bytes_per_update": bytes_, "compute_s_per_batch": t_c,
            "memory_s_per_batch": t_m, "bound": "memory" if t_m >= t_c else "compute",
            "floor_queries_per_s": B / max(t_c, t_m)}


# --------------------------------------------------------------------------- one-user configs

def time_rmm_jax(stream, cfg, params, repeats, seed=0):
    run = make_run(cfg, oracle_cite)
    data = jax.device_put(pad_streams([stream], cfg, 1))
    fresh = lambda: init_states(params, cfg, jnp.stack([user_key(seed, stream.user_id)]))
    states = block(fresh())
    t0 = time.perf_counter()
    compiled = run.lower(states, data, 0).compile()
    compile_s = time.perf_counter() - t0
    block(compiled(states, data, 0))                               # first (warm) call
    times = []
    for _ in range(repeats):
        states = block(fresh())
        t0 = time.perf_counter()
        block(compiled(states, data, 0))
        times.append(time.perf_counter() - t0)
    return compile_s, times, compiled, data, fresh


def time_torch(stream, cfg, params, repeats, seed=0):
    data = stream_dict(stream)
    times = []
    for r in range(repeats):
        model, opt = ref_torch.make(stream.bank.shape[1], cfg.kind, cfg.hidden, cfg.lr, params)
        t0 = time.perf_counter()
        ref_torch.run_stream(model, opt, data, m=cfg.m, batch=cfg.batch, tau=cfg.tau, seed=seed + r)
        times.append(time.perf_counter() - t0)
    return times


def time_numpy(stream, cfg, repeats, seed=0):
    data = stream_dict(stream)
    times = []
    for r in range(repeats):
        p = ref_numpy.init(stream.bank.shape[1])
        opt = ref_numpy.Adam(p, lr=cfg.lr)
        t0 = time.perf_counter()
        ref_numpy.run_stream(p, opt, data, m=cfg.m, batch=cfg.batch, tau=cfg.tau, seed=seed + r)
        times.append(time.perf_counter() - t0)
    return times


def profile_substeps(cfg, params, d, k, repeats=20):
    """Time the pieces of one jitted update on one user's batch (why a config is slow)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, d), dtype=np.float32))
    m = jnp.asarray(rng.standard_normal((B, k, d), dtype=np.float32))
    mask = jnp.ones((B, k), bool)
    opt = rj.make_optimizer(cfg)
    opt_state = opt.init(params)
    g = jax.tree.map(jnp.ones_like, params)
    sel = jnp.tile(jnp.arange(cfg.m, dtype=jnp.int32)[None], (B, 1))
    batch = rj.Batch(q=q, m=m, mask=mask, selected=sel, cited=jnp.zeros((B, cfg.m), bool).at[:, 0].set(True),
                     gumbel=jnp.zeros((B, k)), valid=jnp.ones((B,), bool), logged_log_prob=jnp.zeros((B,)),
                     has_logged=jnp.zeros((B,), bool))
    apply = rj.make_apply_update(cfg)
    ls = rj.init_learner_state(jax.random.key(0), cfg)
    fns = {
        "score_batch": (jax.jit(lambda p: rj.score_batch(p, q, m, mask)), (params,)),
        "value_and_grad": (jax.jit(lambda p: jax.value_and_grad(
            lambda pp: jnp.sum(rj.score_batch(pp, q, m, mask) ** 2))(p)), (params,)),
        "adam_update": (jax.jit(lambda gg, st, p: _adam(opt, gg, st, p)), (g, opt_state, params)),
        "apply_update (all)": (jax.jit(lambda p, st: apply(rj.UserState(p, st, ls), batch)), (params, opt_state)),
    }
    out = {}
    for name, (fn, args) in fns.items():
        block(fn(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            block(fn(*args))
            ts.append(time.perf_counter() - t0)
        out[name] = float(np.median(ts))
    return out


def _adam(opt, g, st, p):
    u, st = opt.update(g, st, p)
    return optax.apply_updates(p, u), st


def run_configs(args, machine):
    if args.quick:
        specs = {"paper": dict(kind="linear", d=32, k=8, m=3), "large": dict(kind="linear", d=64, k=12, m=4),
                 "mlp": dict(kind="mlp", d=32, k=8, m=3, hidden=32)}
    else:
        specs = {"paper": dict(kind="linear", d=384, k=20, m=5), "large": dict(kind="linear", d=1024, k=50, m=10),
                 "mlp": dict(kind="mlp", d=384, k=20, m=5, hidden=384)}
    out = {}
    for name, sp in specs.items():
        rng = np.random.default_rng(0)
        stream = make_stream(rng, "bench-user", sp["d"], sp["k"], args.queries, args.bank)
        cfg = rj.Config(kind=sp["kind"], hidden=sp.get("hidden"), k=sp["k"], m=sp["m"], batch=B, credit="reward_to_go")
        params = rj.init_reranker(jax.random.key(0), sp["d"], sp["kind"], sp.get("hidden"))
        n_params = sum(int(x.size) for x in jax.tree.leaves(params))
        compile_s, jt, *_ = time_rmm_jax(stream, cfg, params, args.repeats)
        tt = time_torch(stream, cfg, params, args.ref_repeats)
        nt = time_numpy(stream, cfg, args.ref_repeats) if sp["kind"] == "linear" else None
        nq = args.queries
        r = {**sp, "queries": nq, "batch": B, "params": n_params,
             "rmm_jax_compile_s": compile_s, "rmm_jax_s": float(np.median(jt)), "rmm_jax_times": jt,
             "torch_s": float(np.median(tt)), "torch_times": tt}
        r["rmm_jax_qps"] = nq / r["rmm_jax_s"]
        r["torch_qps"] = nq / r["torch_s"]
        r["ratio_vs_torch"] = r["rmm_jax_qps"] / r["torch_qps"]
        if nt is not None:
            r["numpy_s"] = float(np.median(nt))
            r["numpy_times"] = nt
            r["numpy_qps"] = nq / r["numpy_s"]
            r["ratio_vs_numpy"] = r["rmm_jax_qps"] / r["numpy_qps"]
        if sp["kind"] == "linear":
            fl = floor_for(sp["d"], sp["k"], machine, n_params)
            r["floor"] = fl
            r["fraction_of_floor"] = r["rmm_jax_qps"] / fl["floor_queries_per_s"]
        out[name] = r
        print(f"  [{name}] jax {r['rmm_jax_qps']:.0f} q/s, torch {r['torch_qps']:.0f} q/s", flush=True)
    return out


# --------------------------------------------------------------------------- users scaling

def run_users(args, machine):
    d, k, m = (32, 8, 3) if args.quick else (384, 20, 5)
    counts = [2, 4] if args.quick else [1, 10, 100, 1000]
    chunk_max = 2 if args.quick else args.chunk
    cfg = rj.Config(k=k, m=m, batch=B, credit="reward_to_go")
    params = rj.init_reranker(jax.random.key(0), d)
    rng = np.random.default_rng(1)
    all_streams = [make_stream(rng, f"user{i:05d}", d, k, args.user_queries, args.bank) for i in range(max(counts))]
    run = make_run(cfg, oracle_cite)
    compiled_by_chunk = {}
    out = {}
    for n_users in counts:
        chunk = min(n_users, chunk_max)
        streams = all_streams[:n_users]
        if chunk not in compiled_by_chunk:
            data = pad_streams(streams[:chunk], cfg, chunk)
            states = init_states(params, cfg, jnp.stack([user_key(0, s.user_id) for s in streams[:chunk]]))
            t0 = time.perf_counter()
            compiled_by_chunk[chunk] = (run.lower(states, data, 0).compile(), time.perf_counter() - t0)
        compiled, compile_s = compiled_by_chunk[chunk]
        t0 = time.perf_counter()
        n_done = 0
        chunks = [streams[i:i + chunk] for i in range(0, n_users, chunk)]
        program = lambda s, dt, st, n_batches=None: compiled(s, dt, st)  # noqa: E731 - the precompiled loop
        for event in drive(chunks, params, cfg, program, users_per_chunk=chunk):
            if isinstance(event, ChunkDone):
                n_done += len(event.states.learner_state.step)
        secs = time.perf_counter() - t0
        assert n_done == n_users
        n_q = n_users * args.user_queries
        padded_batches = bucket(-(-args.user_queries // B), 4)
        p_count = sum(int(x.size) for x in jax.tree.leaves(params))
        fl = floor_for(d, k, machine, p_count)
        floor_s = n_users * padded_batches * B / fl["floor_queries_per_s"]  # the steps the scan runs
        floor_s_real = n_q / fl["floor_queries_per_s"]
        out[str(n_users)] = {"users": n_users, "queries_per_user": args.user_queries, "users_per_chunk": chunk,
                             "chunks": -(-n_users // chunk), "batches_run_per_user": padded_batches,
                             "batches_real_per_user": -(-args.user_queries // B),
                             "compile_s": compile_s, "seconds": secs, "queries_per_s": n_q / secs,
                             "floor_s_padded": floor_s, "floor_s": floor_s_real,
                             "fraction_of_floor": floor_s_real / secs}
        print(f"  [users={n_users}] {secs:.2f} s, {n_q / secs:.0f} q/s", flush=True)
    return out


# --------------------------------------------------------------------------- report

def report(res, args):
    m = res["machine"]
    lines = [f"rmm-jax throughput — {res['date']} — backend {m['backend']}, {m['cores']} cores, "
             f"load avg {m['load_avg'][0]:.1f}",
             f"machine: copy bandwidth {m['bandwidth_GBps']:.1f} GB/s (numpy {m['bandwidth_numpy_GBps']:.1f}, "
             f"jax {m['bandwidth_jax_GBps']:.1f}), f32 matmul {m['matmul_GFLOPs']:.1f} GFLOP/s "
             f"(n={m['matmul_n']}), torch threads {m['torch_threads']}", ""]
    hdr = (f"{'config':<7} {'d':>5} {'K':>3} {'M':>3} {'compile s':>9} {'rmm-jax q/s':>12} {'torch q/s':>10} "
           f"{'numpy q/s':>10} {'jax/torch':>9} {'jax/numpy':>9} {'floor q/s':>10} {'of floor':>8}")
    lines += ["One user, one stream of %d queries, batch %d (median of repeats):" % (args.queries, B), hdr,
              "-" * len(hdr)]
    for name, r in res["configs"].items():
        lines.append(
            f"{name:<7} {r['d']:>5} {r['k']:>3} {r['m']:>3} {r['rmm_jax_compile_s']:>9.2f} {r['rmm_jax_qps']:>12.0f} "
            f"{r['torch_qps']:>10.0f} {r.get('numpy_qps', float('nan')):>10.0f} {r['ratio_vs_torch']:>9.1f} "
            f"{r.get('ratio_vs_numpy', float('nan')):>9.1f} "
            f"{r.get('floor', {}).get('floor_queries_per_s', float('nan')):>10.0f} "
            f"{r.get('fraction_of_floor', float('nan')):>8.2f}")
    lines += ["", "Users scaling (d=%d, %d queries/user, bank %d, drive; after compile):"
              % (res["users_scaling_d"], args.user_queries, args.bank)]
    hdr2 = (f"{'users':>6} {'chunk':>6} {'compile s':>9} {'seconds':>9} {'queries/s':>10} "
            f"{'batches run/real':>16} {'floor s':>8} {'of floor':>8}")
    lines += [hdr2, "-" * len(hdr2)]
    for r in res["users_scaling"].values():
        lines.append(f"{r['users']:>6} {r['users_per_chunk']:>6} {r['compile_s']:>9.2f} {r['seconds']:>9.2f} "
                     f"{r['queries_per_s']:>10.0f} {r['batches_run_per_user']:>8}/{r['batches_real_per_user']:<7} "
                     f"{r['floor_s']:>8.2f} {r['fraction_of_floor']:>8.2f}")
    f = res["floor"]
    lines += ["", "Floor (linear fused path, per query / per update):"]
    for name, fl in f.items():
        lines.append(f"  {name}: {fl['flops_per_query'] / 1e6:.2f} MFLOP/query, "
                     f"{fl['bytes_per_update'] / 1e6:.2f} MB/update, "
                     f"compute {fl['compute_s_per_batch'] * 1e6:.1f} us/batch, memory "
                     f"{fl['memory_s_per_batch'] * 1e6:.1f} us/batch -> {fl['bound']}-bound, "
                     f"floor {fl['floor_queries_per_s']:.0f} q/s")
    lines += ["", "Targets:"]
    for t in res["targets"]:
        lines.append(f"  {'PASS' if t['pass'] else 'MISS'}  {t['name']}: {t['value']:.3g} (target {t['target']})")
    if res.get("profile"):
        lines += ["", "Profile of one jitted update, paper config, 1 user (median seconds):"]
        for k, v in res["profile"].items():
            lines.append(f"  {k:<22} {v * 1e6:9.1f} us")
    return "\n".join(lines)


def targets(res):
    c, u = res["configs"], res["users_scaling"]
    out = [{"name": "paper config rmm-jax / torch eager", "value": c["paper"]["ratio_vs_torch"], "target": ">= 20",
            "pass": c["paper"]["ratio_vs_torch"] >= 20}]
    biggest = u[max(u, key=int)]
    out.append({"name": f"{biggest['users']} users x {biggest['queries_per_user']} queries seconds after compile",
                "value": biggest["seconds"], "target": "<= 60", "pass": biggest["seconds"] <= 60})
    for name, value in (("large config (update-bound): measured time / floor", 1 / c["large"]["fraction_of_floor"]),
                        (f"{biggest['users']} users: measured time / floor", 1 / biggest["fraction_of_floor"])):
        out.append({"name": name, "value": value, "target": "<= 3", "pass": value <= 3})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results as JSON here")
    ap.add_argument("--plot", help="write a PNG of queries/s vs users here")
    ap.add_argument("--repeats", type=int, default=None, help="rmm-jax timing repeats (median); default 3, quick 1")
    ap.add_argument("--ref-repeats", type=int, default=1, help="PyTorch / NumPy timing repeats (median)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, seconds-long smoke run")
    ap.add_argument("--queries", type=int, default=None, help="stream length of the one-user configs (512)")
    ap.add_argument("--user-queries", type=int, default=None, help="queries per user in users scaling (200)")
    ap.add_argument("--bank", type=int, default=None, help="memories per user (256)")
    ap.add_argument("--chunk", type=int, default=100, help="max users per chunk in users scaling")
    ap.add_argument("--no-profile", action="store_true", help="skip the sub-step profile")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.queries = args.queries or (32 if args.quick else 512)
    args.user_queries = args.user_queries or (24 if args.quick else 200)
    args.bank = args.bank or (48 if args.quick else 256)

    t_start = time.perf_counter()
    print("measuring machine ...", flush=True)
    machine = measure_machine(args.quick)
    print("one-user configs ...", flush=True)
    configs = run_configs(args, machine)
    print("users scaling ...", flush=True)
    users = run_users(args, machine)
    d_users = 32 if args.quick else 384
    res = {"configs": configs, "users_scaling": users, "users_scaling_d": d_users,
           "floor": {name: r["floor"] for name, r in configs.items() if "floor" in r},
           "machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "args": vars(args)}
    res["targets"] = targets(res)
    if not (args.no_profile or args.quick):
        sp = configs["paper"]
        cfg = rj.Config(k=sp["k"], m=sp["m"], batch=B, credit="reward_to_go")
        res["profile"] = profile_substeps(cfg, rj.init_reranker(jax.random.key(0), sp["d"]), sp["d"], sp["k"],
                                          repeats=3 if args.quick else 50)
    res["total_s"] = time.perf_counter() - t_start
    print()
    print(report(res, args))
    print(f"\ntotal benchmark time {res['total_s']:.1f} s")
    if args.json:
        write_json(args.json, json.loads(json.dumps(res, default=float)))  # numpy scalars → JSON numbers
    if args.plot:
        import matplotlib  # lazy: only for --plot, and Agg must be chosen before pyplot loads
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        xs = [r["users"] for r in users.values()]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(xs, [r["queries_per_s"] for r in users.values()], "o-", label="rmm-jax (drive)")
        ax.axhline(configs["paper"]["torch_qps"], color="C1", ls="--", label="PyTorch eager, 1 user")
        if "numpy_qps" in configs["paper"]:
            ax.axhline(configs["paper"]["numpy_qps"], color="C2", ls=":", label="NumPy, 1 user")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("users")
        ax.set_ylabel("queries / s")
        ax.set_title(f"d={d_users}, {args.user_queries} queries/user, {machine['backend']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return res


if __name__ == "__main__":
    main()
