"""Throughput of rmm-jax's online loop against PyTorch (eager and ``torch.compile``) and NumPy, and its floors.

What is timed (all in ONE process, on the same random data: L2-normalised query and memory
embeddings, candidates = base-retriever top-K by dot product, random gold labels, oracle
citations with the paper's precision/recall):

* ``configs``: one user, one stream of ``--queries`` (512) queries, batch B=4:
  ``paper`` (linear, d=384, K=20, M=5), ``large`` (linear, d=1024, K=50, M=10) and
  ``mlp`` (d=384, hidden 384, K=20, M=5).
  - rmm-jax: the library's own path, ``rmm_jax.make_run(*preset, cite_fn=oracle_cite)`` on a
    1-user chunk built by ``program.pad`` (one jitted ``vmap``/``fori_loop``: score →
    prequential top-M eval → Gumbel top-M → oracle citations → REINFORCE + Adam), at
    ``--preset reinforce`` unless another is given: the step every reference takes, so each
    ratio compares one algorithm in two implementations. (The file committed before this
    option, at ad4482b, timed the default's logistic step against the references' REINFORCE.)
    Compile time = ``run.lower(...).compile()``; a timed run = one call of the compiled
    executable on fresh states (data already on device; result blocked on).
  - PyTorch eager (``benchmarks/ref_torch.py``): per-batch Python loop, naive scoring
    (all K memories adapted), the same prequential top-M eval, Gumbel top-M, oracle
    citations, exact Plackett–Luce REINFORCE (reward-to-go credit in all implementations;
    the library's per-item default costs the same), ``loss.backward()``,
    ``torch.optim.Adam``. ``torch_fused``: the same with the fused O(d²+Kd) scoring
    (linear only), to separate algebra from compilation.
  - ``torch.compile`` ("PyTorch done well", ``ref_torch.CompiledStep``): fused scoring
    (linear), and inductor-compiled forward, act/eval/cite, loss and ``Adam.step``; its
    compile time (the first pass over the stream) is reported separately. Needs a C++
    compiler (inductor's CPU backend); without one the JSON and report say why.
  - NumPy (``benchmarks/ref_numpy.py``, linear only): same loop with hand-written
    gradients and the fused forward.
  **Threads**: each reference runs with the faster of 1 thread and the default count
  (torch's intra-op threads; NumPy's BLAS pool via threadpoolctl), chosen by one untimed
  run of each (``torch.compile`` uses the eager reference's choice: its graphs are guarded
  on the thread count); rmm-jax keeps XLA's default. On the shared 2-core machine a second torch
  thread made the eager reference 20–70× slower whenever another process was busy.
  **Repeats are interleaved**: after one untimed warm-up run of each implementation,
  repeat r runs every implementation once (order rotated by r) and measures the copy
  bandwidth of the floor; every ratio is computed per repeat and reported as the median
  with [min, max] over ``--repeats`` (3) repeats, with the load average at each repeat.
  (``ratio_vs_torch`` etc. stay the ratio of the median queries/s, for old readers.)
* ``users_scaling``: 1, 10, 100, 1000 users × ``--user-queries`` (200) queries, d=384,
  paper config, bank of 256 memories per user, through ``rmm_jax.online.driver.drive`` with
  ``users_per_chunk = min(users, --chunk)`` (100): end-to-end seconds after compile
  (host padding, state init, the jitted run, device→host copy), queries/s counting real
  (unpadded) queries, ``--repeats`` interleaved repeats. Compile time per chunk shape is
  reported separately. 200 queries = 50 batches are padded by the library to a 56-batch
  bucket, which is reported. For the largest count, ``breakdown`` also times the compiled
  program alone on one chunk already on the device (the rest of a chunk's time is the
  host side: padding, state init, transfers).
* ``floor``, per regime. Per query of the linear fused path:
  FLOPs = forward 4d² + 2Kd (q' = (I+A)q, v = (I+B)ᵀq', s = Mv) + backward 6d² + 2Kd
  (u = Mᵀ∂s, (I+B)u, two rank-B outer products) + Adam ≈ 12·P/B (P = 2d² parameters);
  bytes per update = 32·P (params, Adam μ and ν each read and written, the gradient
  written and read, float32) + B·K·d·4 gathered memories + B·d·4 queries.
  Time floor per batch = max(FLOPs / matmul rate, bytes / bandwidth), the roofline.
  - one user (``configs``): the state (params + μ + ν = 12·P bytes) stays in cache, so the
    bandwidth is that of a copy the size of one user's state (warm, repeated; the max of
    NumPy ``copyto`` and a jitted in-place loop), measured in every repeat;
  - many users (``users_scaling``): 100 users' states (354 MB) cannot stay in cache, so
    the bandwidth is that of a 512 MiB copy (main memory), measured in every repeat.
  The fraction of the floor = floor time / measured time (1 = at the floor).

Targets (reported, never asserted): paper config ≥ 20× PyTorch eager and ahead of
``torch.compile``; 1000 users × 200 queries ≤ 60 s after compile and ≥ 0.6 of the
main-memory floor; the large configuration within 2× of its (state-size copy) floor. Each
prints PASS/MISS with its value.

Usage::

    python benchmarks/throughput.py [--json OUT.json] [--plot OUT.png] [--repeats 3] [--quick]

``--quick`` is a seconds-long smoke run with tiny shapes (used by the tests; it skips
``torch.compile`` unless ``--torch-compile`` is given).

The JSON records each learner: rmm-jax's, preset name and resolved fields
(:func:`rmm_jax.core.config.setting_record`), as ``configs.NAME.setting``,
``users_scaling_setting`` and ``profile_setting``; the fields of it the references read, and
the algorithm they run, as ``configs.NAME.reference_setting``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from typing import NamedTuple

import _ref_numpy as ref_numpy
import _ref_torch as ref_torch
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from _common import HelpFormatter, load_summary, positive_int, save_figure, timed, write_result
from _common import spread as interval

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # NumPy's BLAS then keeps its default threads
    threadpool_limits = None

import rmm_jax as rj
from rmm_jax.core.config import setting_record
from rmm_jax.data.citations import oracle_cite
from rmm_jax.online.driver import ChunkDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.streams import Stream, bucket, user_key

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

_COPY_LOOPS: dict = {}


def copy_bandwidth(n_bytes: int) -> dict:
    """Bytes/s (read + write counted) of a warm copy of ``n_bytes``: NumPy ``copyto`` between
    two buffers, and a jitted loop rewriting one buffer in place (no dispatch per copy).
    Small sizes repeat the copy so that each timing spans ≥ ~32 MiB. Returns both and the max."""
    n = max(n_bytes // 4, 1024)
    n_bytes = 4 * n
    reps = max(1, min(256, (32 << 20) // n_bytes))
    x = np.ones(n, np.float32)
    y = np.empty_like(x)

    def np_copy():
        for _ in range(reps):
            np.copyto(y, x)

    np_copy()
    t_np = min(timed(np_copy) for _ in range(5)) / reps
    key = (n, reps)
    if key not in _COPY_LOOPS:
        _COPY_LOOPS[key] = jax.jit(lambda a: jax.lax.fori_loop(0, reps, lambda i, v: v * 1.0000001, a))
    loop = _COPY_LOOPS[key]
    xj = jnp.ones(n, jnp.float32)
    loop(xj).block_until_ready()
    t_jx = min(timed(lambda: loop(xj)) for _ in range(5)) / reps
    bw_np, bw_jx = 2 * n_bytes / t_np, 2 * n_bytes / t_jx
    return {"bytes": n_bytes, "GBps": max(bw_np, bw_jx) / 1e9, "numpy_GBps": bw_np / 1e9, "jax_GBps": bw_jx / 1e9}


def main_memory_bytes(quick: bool) -> int:
    return (16 if quick else 512) * 2 ** 20


def measure_machine(quick):
    """Main-memory bandwidth (a 512 MiB copy, read + write bytes), float32 matmul rate, versions."""
    bw = copy_bandwidth(main_memory_bytes(quick))
    nm = 512 if quick else 4096
    a = jnp.asarray(np.random.default_rng(0).standard_normal((nm, nm), dtype=np.float32))
    mm = jax.jit(lambda u, v: u @ v)
    mm(a, a).block_until_ready()
    t_mm = min(timed(lambda: mm(a, a)) for _ in range(3))
    ok, why = ref_torch.compile_available()
    return {"bandwidth_GBps": bw["GBps"], "bandwidth_numpy_GBps": bw["numpy_GBps"],
            "bandwidth_jax_GBps": bw["jax_GBps"], "copy_MiB": bw["bytes"] / 2 ** 20,
            "matmul_GFLOPs": 2 * nm ** 3 / t_mm / 1e9, "matmul_n": nm,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_avg": os.getloadavg(), "backend": jax.default_backend(),
            "devices": [str(dv) for dv in jax.devices()], "jax": jax.__version__,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "numpy": np.__version__,
            "torch_compile": {"available": ok, "why": why}}


def floor_for(d, k, bandwidth_GBps, matmul_GFLOPs, n_params):
    """Roofline floor per batch of B queries (see module docstring) at the given bandwidth."""
    flops = B * (10 * d * d + 4 * k * d) + 12 * n_params
    bytes_ = 32 * n_params + B * (k + 1) * d * 4
    t_c = flops / (matmul_GFLOPs * 1e9)
    t_m = bytes_ / (bandwidth_GBps * 1e9)
    return {"flops_per_query": flops / B, "bytes_per_update": bytes_, "compute_s_per_batch": t_c,
            "memory_s_per_batch": t_m, "bound": "memory" if t_m >= t_c else "compute",
            "bandwidth_GBps": bandwidth_GBps, "floor_queries_per_s": B / max(t_c, t_m)}


# --------------------------------------------------------------------------- one-user configs

def jax_runner(stream, setting, params, seed=0):
    """(compile seconds, run()): run() times one call of the compiled loop on fresh states."""
    program = make_run(*setting, cite_fn=oracle_cite)
    data = jax.device_put(program.pad([stream], 1))
    fresh = lambda: program.init(params, jnp.stack([user_key(seed, stream.user_id)]))
    states = block(fresh())
    t0 = time.perf_counter()
    compiled = program.run.lower(states, data, 0).compile()
    compile_s = time.perf_counter() - t0

    def once():
        st = block(fresh())
        return timed(lambda: compiled(st, data, 0))

    return compile_s, once


class Flat(NamedTuple):
    """The fields of a setting the references read."""
    kind: str
    hidden: int | None
    m: int
    batch: int
    tau: float
    lr: float


def flat(setting) -> Flat:
    lay, est, opt = setting
    return Flat(lay.kind, lay.hidden, lay.m, lay.batch, est.tau, opt.lr)


# What the references (_ref_torch, _ref_numpy) run at the fields of a setting they read (flat),
# whatever the setting's own estimator: their update is written out, not read from it.
REFERENCE_ALGORITHM = ("REINFORCE: binary rewards, batch-mean baseline over the shown memories, reward-to-go "
                       "credit, the exact Plackett-Luce log-probability at tau, Adam at lr")


def reference_setting(setting) -> dict:
    """What a result records of the references' learner at ``setting``."""
    return {**flat(setting)._asdict(), "algorithm": REFERENCE_ALGORITHM}


def torch_runner(stream, cfg, params, fused=False, seed=0):
    data = stream_dict(stream)

    def once():
        model, opt = ref_torch.make(stream.bank.shape[1], cfg.kind, cfg.hidden, cfg.lr, params, fused=fused)
        t0 = time.perf_counter()
        ref_torch.run_stream(model, opt, data, m=cfg.m, batch=cfg.batch, tau=cfg.tau, seed=seed)
        return time.perf_counter() - t0

    return once


def torch_compile_runner(stream, cfg, params, seed=0):
    """(compile seconds, run()): the first pass over the stream compiles (timed as compile);
    run() resets the same model and optimiser in place (so no guard fails) and times a pass."""
    data = stream_dict(stream)
    torch._dynamo.reset()                       # each config compiles from scratch (no shapes carried over)
    model, opt = ref_torch.make(stream.bank.shape[1], cfg.kind, cfg.hidden, cfg.lr, params, fused=True)
    step = ref_torch.CompiledStep(model, opt, m=cfg.m, tau=cfg.tau)
    t0 = time.perf_counter()
    ref_torch.run_stream_compiled(step, data, batch=cfg.batch, seed=seed)
    compile_s = time.perf_counter() - t0

    def once():
        ref_torch.reset(model, opt, params)
        t0 = time.perf_counter()
        ref_torch.run_stream_compiled(step, data, batch=cfg.batch, seed=seed)
        return time.perf_counter() - t0

    return compile_s, once


def numpy_runner(stream, cfg, seed=0):
    data = stream_dict(stream)

    def once():
        p = ref_numpy.init(stream.bank.shape[1])
        opt = ref_numpy.Adam(p, lr=cfg.lr)
        t0 = time.perf_counter()
        ref_numpy.run_stream(p, opt, data, m=cfg.m, batch=cfg.batch, tau=cfg.tau, seed=seed)
        return time.perf_counter() - t0

    return once


def profile_substeps(setting, params, d, k, repeats=20):
    """Time the pieces of one jitted update on one user's batch (why a config is slow)."""
    layout, est, opt = setting
    cfg = flat(setting)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, d), dtype=np.float32))
    m = jnp.asarray(rng.standard_normal((B, k, d), dtype=np.float32))
    mask = jnp.ones((B, k), bool)
    opt_state = opt.init(params)
    g = jax.tree.map(jnp.ones_like, params)
    sel = jnp.tile(jnp.arange(cfg.m, dtype=jnp.int32)[None], (B, 1))
    batch = rj.Batch(q=q, m=m, mask=mask, selected=sel, cited=jnp.zeros((B, cfg.m), bool).at[:, 0].set(True),
                     gumbel=jnp.zeros((B, k)), valid=jnp.ones((B,), bool), logged_log_prob=jnp.zeros((B,)),
                     has_logged=jnp.zeros((B,), bool))
    batch = jax.tree.map(lambda x: x[None], batch._replace(scores=rj.score_batch(params, q, m, mask)))
    apply = rj.make_update(layout, est, opt)
    shared = rj.init_shared(params, layout, opt)
    user = jax.tree.map(lambda x: x[None], rj.init_user(params, jax.random.key(0), layout, est, opt))
    fns = {
        "score_batch": (jax.jit(lambda p: rj.score_batch(p, q, m, mask)), (params,)),
        "value_and_grad": (jax.jit(lambda p: jax.value_and_grad(
            lambda pp: jnp.sum(rj.score_batch(pp, q, m, mask) ** 2))(p)), (params,)),
        "adam_update": (jax.jit(lambda gg, st, p: _adam(opt, gg, st, p)), (g, opt_state, params)),
        "update (all)": (jax.jit(lambda u: apply(shared, u, batch)), (user,)),
    }
    out = {}
    for name, (fn, args) in fns.items():
        block(fn(*args))
        ts = [timed(lambda: fn(*args)) for _ in range(repeats)]
        out[name] = float(np.median(ts))
    return out


def _adam(opt, g, st, p):
    u, st = opt.update(g, st, p)
    return optax.apply_updates(p, u), st


def config_specs(quick):
    if quick:
        return {"paper": dict(kind="linear", d=32, k=8, m=3), "large": dict(kind="linear", d=64, k=12, m=4),
                "mlp": dict(kind="mlp", d=32, k=8, m=3, hidden=32)}
    return {"paper": dict(kind="linear", d=384, k=20, m=5), "large": dict(kind="linear", d=1024, k=50, m=10),
            "mlp": dict(kind="mlp", d=384, k=20, m=5, hidden=384)}


REF_IMPLS = ("torch", "torch_fused", "torch_compile", "numpy")


def with_threads(fn, n: int, impl: str):
    """``fn`` run with ``n`` intra-op threads: torch's for the torch references, the BLAS
    pool's (threadpoolctl) for NumPy."""
    def run():
        if impl.startswith("torch"):
            old = torch.get_num_threads()
            torch.set_num_threads(n)
            try:
                return fn()
            finally:
                torch.set_num_threads(old)
        if threadpool_limits is None:
            return fn()
        with threadpool_limits(n, user_api="blas"):
            return fn()
    return run


def pick_threads(fn, impl: str):
    """The faster of 1 thread and the default count, by one untimed run of each. On a busy
    2-core machine a second torch/BLAS thread can make a reference 20–70× slower (its
    threads wait on each other), which would measure the machine's load, not the reference."""
    default = torch.get_num_threads() if impl.startswith("torch") else os.cpu_count() or 1
    trials = {n: with_threads(fn, n, impl)() for n in sorted({1, default})}
    best = min(trials, key=trials.get)
    return best, with_threads(fn, best, impl), trials


def run_configs(args, machine):
    out = {}
    for name, sp in config_specs(args.quick).items():
        rng = np.random.default_rng(0)
        stream = make_stream(rng, "bench-user", sp["d"], sp["k"], args.queries, args.bank)
        setting = rj.preset(args.preset, kind=sp["kind"], hidden=sp.get("hidden"), k=sp["k"], m=sp["m"], batch=B,
                            credit="reward_to_go")
        cfg = flat(setting)
        params = rj.init_reranker(jax.random.key(0), sp["d"], sp["kind"], sp.get("hidden"))
        n_params = sum(int(x.size) for x in jax.tree.leaves(params))
        linear = sp["kind"] == "linear"
        r = {**sp, "queries": args.queries, "batch": B, "params": n_params,
             "setting": setting_record(args.preset, setting), "reference_setting": reference_setting(setting)}
        runners = {}
        r["rmm_jax_compile_s"], runners["rmm_jax"] = jax_runner(stream, setting, params)
        runners["torch"] = torch_runner(stream, cfg, params)
        if linear:
            runners["torch_fused"] = torch_runner(stream, cfg, params, fused=True)
            runners["numpy"] = numpy_runner(stream, cfg)
        r["threads"], r["thread_trials_s"] = {}, {}
        for impl in list(runners):                                    # untimed warm-up of each
            if impl == "rmm_jax":
                runners[impl]()
            else:
                r["threads"][impl], runners[impl], r["thread_trials_s"][impl] = pick_threads(runners[impl], impl)
        # torch.compile guards on torch's thread count (a change recompiles), so it is compiled
        # and timed with the count the eager reference ran best with, never switched.
        compile_threads = r["threads"]["torch"]
        want_compile = args.torch_compile and (not args.compile_configs or name in args.compile_configs.split(","))
        if want_compile and machine["torch_compile"]["available"]:
            try:
                r["torch_compile_compile_s"], fn = with_threads(
                    lambda: torch_compile_runner(stream, cfg, params), compile_threads, "torch")()
                runners["torch_compile"] = with_threads(fn, compile_threads, "torch")
                r["threads"]["torch_compile"] = compile_threads
                runners["torch_compile"]()                            # untimed warm-up
            except Exception as e:  # noqa: BLE001 - a failed backend is a result to report, not a crash
                r["torch_compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        elif not want_compile:
            r["torch_compile_error"] = "skipped (--no-torch-compile, --compile-configs, or --quick)"
        else:
            r["torch_compile_error"] = machine["torch_compile"]["why"]
        state_bytes = 12 * n_params                                   # params + Adam mu + nu, float32
        times = {impl: [] for impl in runners}
        bws, loads = [], []
        names = list(runners)
        for rep in range(args.repeats):
            loads.append(os.getloadavg())
            if linear:
                bws.append(copy_bandwidth(state_bytes))
            order = names[rep % len(names):] + names[:rep % len(names)]
            for impl in order:
                times[impl].append(runners[impl]())
        nq = args.queries
        r["load_avg"] = loads
        for impl, ts in times.items():
            r[f"{impl}_times"] = ts
            r[f"{impl}_s"] = float(np.median(ts))
            r[f"{impl}_qps"] = nq / r[f"{impl}_s"]
            r[f"{impl}_qps_repeats"] = interval([nq / t for t in ts])
        r["ratios"] = {f"vs_{impl}": interval([t / j for t, j in zip(times[impl], times["rmm_jax"])])
                       for impl in REF_IMPLS if impl in times}
        for impl in REF_IMPLS:                                        # ratio of medians (older readers)
            if impl in times:
                r[f"ratio_vs_{impl}"] = r["rmm_jax_qps"] / r[f"{impl}_qps"]
        if linear:
            floors = [floor_for(sp["d"], sp["k"], bw["GBps"], machine["matmul_GFLOPs"], n_params) for bw in bws]
            fracs = [t_floor / t for t_floor, t in
                     zip([nq / f["floor_queries_per_s"] for f in floors], times["rmm_jax"])]
            i_med = int(np.argsort(fracs)[len(fracs) // 2])
            r["floor"] = {**floors[i_med], "regime": "one user, state in cache: copy of the state's size",
                          "state_bytes": state_bytes, "copy": bws[i_med]}
            r["floor_main_memory"] = floor_for(sp["d"], sp["k"], machine["bandwidth_GBps"], machine["matmul_GFLOPs"],
                                               n_params)
            r["fraction_of_floor_repeats"] = interval(fracs)
            r["fraction_of_floor"] = r["fraction_of_floor_repeats"]["median"]
            r["fraction_of_main_memory_floor"] = r["rmm_jax_qps"] / r["floor_main_memory"]["floor_queries_per_s"]
        out[name] = r
        msg = ", ".join(f"{impl} {r[f'{impl}_qps']:.0f} q/s" for impl in times)
        print(f"  [{name}] {msg}", flush=True)
    return out


# --------------------------------------------------------------------------- users scaling

def run_users(args, machine):
    d, k, m = (32, 8, 3) if args.quick else (384, 20, 5)
    counts = [2, 4] if args.quick else [1, 10, 100, 1000]
    chunk_max = 2 if args.quick else args.chunk
    params = rj.init_reranker(jax.random.key(0), d)
    p_count = sum(int(x.size) for x in jax.tree.leaves(params))
    rng = np.random.default_rng(1)
    all_streams = [make_stream(rng, f"user{i:05d}", d, k, args.user_queries, args.bank) for i in range(max(counts))]
    setting = rj.preset(args.preset, k=k, m=m, batch=B, credit="reward_to_go")
    program = make_run(*setting, cite_fn=oracle_cite)
    keys = lambda streams: jnp.stack([user_key(0, s.user_id) for s in streams])
    compiled_by_chunk = {}
    for n_users in counts:
        chunk = min(n_users, chunk_max)
        if chunk not in compiled_by_chunk:
            data = program.pad(all_streams[:chunk], chunk)
            states = program.init(params, keys(all_streams[:chunk]))
            t0 = time.perf_counter()
            compiled_by_chunk[chunk] = (program.run.lower(states, data, 0).compile(), time.perf_counter() - t0)

    def drive_all(n_users):
        chunk = min(n_users, chunk_max)
        compiled = compiled_by_chunk[chunk][0]
        streams = all_streams[:n_users]
        chunks = [streams[i:i + chunk] for i in range(0, n_users, chunk)]
        precompiled = program._replace(run=lambda s, dt, st, stop=None, group=None: compiled(s, dt, st))
        t0 = time.perf_counter()
        n_done = 0
        for event in drive(chunks, precompiled, params, users_per_chunk=chunk):
            if isinstance(event, ChunkDone):
                n_done += len(event.states.learner_state.step)
        assert n_done == n_users
        return time.perf_counter() - t0

    def program_alone(n_users):
        """The compiled program on one chunk already on the device: no host work."""
        chunk = min(n_users, chunk_max)
        compiled = compiled_by_chunk[chunk][0]
        data = jax.device_put(program.pad(all_streams[:chunk], chunk))
        states = block(program.init(params, keys(all_streams[:chunk])))
        t0 = time.perf_counter()
        block(compiled(states, data, 0))
        return time.perf_counter() - t0

    for n in counts:                                                  # warm-up (first-call allocations)
        if n <= chunk_max:
            drive_all(n)
    secs = {n: [] for n in counts}
    bws, loads, alone = [], [], []
    biggest = max(counts)
    for rep in range(args.repeats):
        loads.append(os.getloadavg())
        bws.append(copy_bandwidth(main_memory_bytes(args.quick)))
        for n in (counts if rep % 2 == 0 else counts[::-1]):
            secs[n].append(drive_all(n))
        alone.append(program_alone(biggest))
    out = {}
    padded_batches = bucket(-(-args.user_queries // B), 4)
    for n_users in counts:
        chunk = min(n_users, chunk_max)
        n_q = n_users * args.user_queries
        floors = [floor_for(d, k, bw["GBps"], machine["matmul_GFLOPs"], p_count) for bw in bws]
        floor_s = [n_q / f["floor_queries_per_s"] for f in floors]
        fracs = [fs / t for fs, t in zip(floor_s, secs[n_users])]
        med = float(np.median(secs[n_users]))
        out[str(n_users)] = {
            "users": n_users, "queries_per_user": args.user_queries, "users_per_chunk": chunk,
            "chunks": -(-n_users // chunk), "batches_padded_per_user": padded_batches,
            "batches_real_per_user": -(-args.user_queries // B), "compile_s": compiled_by_chunk[chunk][1],
            "seconds": med, "seconds_repeats": interval(secs[n_users]), "queries_per_s": n_q / med,
            "queries_per_s_repeats": interval([n_q / t for t in secs[n_users]]),
            "floor_s": float(np.median(floor_s)), "floor_s_padded": float(np.median(floor_s)) * padded_batches
            / (-(-args.user_queries // B)), "fraction_of_floor": float(np.median(fracs)),
            "fraction_of_floor_repeats": interval(fracs), "floor_regime": "many users: main-memory copy bandwidth"}
        print(f"  [users={n_users}] {med:.2f} s, {n_q / med:.0f} q/s, {np.median(fracs):.2f} of floor", flush=True)
    big = out[str(biggest)]
    per_chunk = big["seconds"] / big["chunks"]
    big["breakdown"] = {
        "drive_s_per_chunk": per_chunk, "program_alone_s_per_chunk_repeats": interval(alone),
        "host_side_fraction": 1 - float(np.median(alone)) / per_chunk,
        "padded_batches_fraction": 1 - big["batches_real_per_user"] / big["batches_padded_per_user"],
        "note": "program alone: the compiled loop on one chunk with data already on the device; the rest of "
                "drive's time per chunk is host padding, state init and transfers. padded_batches_fraction: "
                "batches of the length bucket that are padding for every user of the chunk (every user has 200 "
                "queries): padded on the host, skipped by the loop (not run)."}
    return out, {"load_avg": loads, "copy": bws}, setting_record(args.preset, setting)


# --------------------------------------------------------------------------- report

def _iv(iv, fmt="{:.2f}"):
    return f"{fmt.format(iv['median'])} [{fmt.format(iv['min'])}, {fmt.format(iv['max'])}]"


def report(res, args):
    m = res["machine"]
    loads = [x[0] for x in res["load_avg_all"]]
    lines = [f"rmm-jax throughput — {res['date']} — backend {m['backend']}, {m['cores']} cores, "
             f"load avg (1 min) during the run {min(loads):.2f}–{max(loads):.2f}",
             f"machine: main-memory copy bandwidth {m['bandwidth_GBps']:.1f} GB/s (numpy "
             f"{m['bandwidth_numpy_GBps']:.1f}, jax {m['bandwidth_jax_GBps']:.1f}), f32 matmul "
             f"{m['matmul_GFLOPs']:.1f} GFLOP/s (n={m['matmul_n']}), torch threads {m['torch_threads']}, "
             f"torch.compile: {m['torch_compile']['why']}", ""]
    lines.append("One user, one stream of %d queries, batch %d: queries/s, median of %d interleaved repeats:"
                 % (args.queries, B, args.repeats))
    hdr = (f"{'config':<7} {'d':>5} {'K':>3} {'M':>3} {'jax compile s':>13} {'rmm-jax':>8} {'torch':>7} "
           f"{'torch fused':>11} {'torch.compile':>13} {'numpy':>7}")
    lines += [hdr, "-" * len(hdr)]
    for name, r in res["configs"].items():
        g = lambda k: f"{r[k]:.0f}" if k in r else "–"  # noqa: E731
        lines.append(f"{name:<7} {r['d']:>5} {r['k']:>3} {r['m']:>3} {r['rmm_jax_compile_s']:>13.2f} "
                     f"{g('rmm_jax_qps'):>8} {g('torch_qps'):>7} {g('torch_fused_qps'):>11} "
                     f"{g('torch_compile_qps'):>13} {g('numpy_qps'):>7}")
    lines += ["", "rmm-jax speed-up, median [min, max] of per-repeat ratios:"]
    for name, r in res["configs"].items():
        cells = "; ".join(f"{k[3:]} {_iv(v, '{:.1f}')}×" for k, v in r["ratios"].items())
        extra = f" (torch.compile compile {r['torch_compile_compile_s']:.0f} s)" if "torch_compile_compile_s" in r \
            else (f" (torch.compile: {r['torch_compile_error']})" if "torch_compile_error" in r else "")
        extra += " threads " + ", ".join(f"{k} {v}" for k, v in r["threads"].items())
        lines.append(f"  {name:<7} {cells}{extra}")
    lines += ["", "Floors (roofline; one user: copy of the state's size; many users: main memory):"]
    for name, r in res["configs"].items():
        if "floor" in r:
            f = r["floor"]
            lines.append(f"  {name:<7} state {f['state_bytes'] / 1e6:.1f} MB, copy {f['copy']['GBps']:.1f} GB/s, "
                         f"{f['bytes_per_update'] / 1e6:.2f} MB/update, {f['flops_per_query'] / 1e6:.2f} MFLOP/query "
                         f"→ {f['bound']}-bound, floor {f['floor_queries_per_s']:.0f} q/s; rmm-jax at "
                         f"{_iv(r['fraction_of_floor_repeats'])} of it (of the main-memory floor "
                         f"{r['floor_main_memory']['floor_queries_per_s']:.0f} q/s: "
                         f"{r['fraction_of_main_memory_floor']:.2f})")
    lines += ["", "Users scaling (d=%d, %d queries/user, bank %d, drive; after compile; median [min, max]):"
              % (res["users_scaling_d"], args.user_queries, args.bank)]
    hdr2 = (f"{'users':>6} {'chunk':>6} {'compile s':>9} {'seconds':>24} {'queries/s':>10} "
            f"{'batches padded/real':>16} {'floor s':>8} {'of floor':>20}")
    lines += [hdr2, "-" * len(hdr2)]
    for r in res["users_scaling"].values():
        lines.append(f"{r['users']:>6} {r['users_per_chunk']:>6} {r['compile_s']:>9.2f} "
                     f"{_iv(r['seconds_repeats']):>24} {r['queries_per_s']:>10.0f} "
                     f"{r['batches_padded_per_user']:>8}/{r['batches_real_per_user']:<7} {r['floor_s']:>8.2f} "
                     f"{_iv(r['fraction_of_floor_repeats']):>20}")
    big = res["users_scaling"][max(res["users_scaling"], key=int)]
    bd = big["breakdown"]
    lines.append(f"  {big['users']} users, per chunk of {big['users_per_chunk']}: "
                 f"drive {bd['drive_s_per_chunk']:.2f} s, "
                 f"compiled program alone {_iv(bd['program_alone_s_per_chunk_repeats'])} s → host side "
                 f"{bd['host_side_fraction']:.0%}; padding-only batches {bd['padded_batches_fraction']:.0%} of the "
                 "padded stream (skipped by the loop)")
    lines += ["", "Targets:"]
    for t in res["targets"]:
        lines.append(f"  {'PASS' if t['pass'] else 'MISS'}  {t['name']}: {t['value']:.3g} (target {t['target']})"
                     + (" NOISY" if t["noisy"] else ""))
    if res.get("profile"):
        lines += ["", "Profile of one jitted update, paper config, 1 user (median seconds):"]
        for k, v in res["profile"].items():
            lines.append(f"  {k:<22} {v * 1e6:9.1f} us")
    return "\n".join(lines)


def targets(res):
    c, u = res["configs"], res["users_scaling"]
    paper = c["paper"]
    out = [{"name": "paper config rmm-jax / torch eager (median of repeats)",
            "value": paper["ratios"]["vs_torch"]["median"], "target": ">= 20"}]
    if "vs_torch_compile" in paper["ratios"]:
        out.append({"name": "paper config rmm-jax / torch.compile (median of repeats)",
                    "value": paper["ratios"]["vs_torch_compile"]["median"], "target": ">= 1"})
    biggest = u[max(u, key=int)]
    out.append({"name": f"{biggest['users']} users x {biggest['queries_per_user']} queries seconds after compile "
                        "(median)", "value": biggest["seconds"], "target": "<= 60"})
    out.append({"name": f"{biggest['users']} users: fraction of the main-memory floor (median)",
                "value": biggest["fraction_of_floor"], "target": ">= 0.6"})
    out.append({"name": "large config: measured time / state-size floor (median)",
                "value": 1 / c["large"]["fraction_of_floor"], "target": "<= 2"})
    for t in out:
        op, bound = t["target"].split()
        t["pass"] = bool(t["value"] >= float(bound) if op == ">=" else t["value"] <= float(bound))
        t["noisy"] = res["load"]["noisy"]          # measured with the 1-minute load above 2.5: re-run quietly
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--json", help="write results as JSON here")
    ap.add_argument("--plot", help="write a PNG of queries/s vs users here")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help="interleaved timing repeats (median); default 3, quick 1")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, seconds-long smoke run")
    ap.add_argument("--queries", type=positive_int, default=None, help="stream length of the one-user configs (512)")
    ap.add_argument("--user-queries", type=positive_int, default=None, help="queries per user in users scaling (200)")
    ap.add_argument("--bank", type=positive_int, default=None, help="memories per user (256)")
    ap.add_argument("--chunk", type=positive_int, default=100, help="max users per chunk in users scaling")
    ap.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="time the torch.compile reference (default: on, off with --quick)")
    ap.add_argument("--compile-configs", default=None, help="comma-separated configs to time torch.compile on "
                    "(default: all)")
    ap.add_argument("--no-profile", action="store_true", help="skip the sub-step profile")
    ap.add_argument("--preset", default="reinforce", choices=("reinforce", "default"),
                    help="rmm-jax's learner (default: reinforce, the exact Plackett-Luce REINFORCE step with Adam "
                         "that every reference implements, so that the ratios compare one algorithm; 'default' "
                         "times the CLI's default, the logistic loss against the retriever's best score)")
    ap.add_argument("--ref-repeats", type=int, default=None, help=argparse.SUPPRESS)  # old flag: repeats are shared
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.queries = args.queries or (32 if args.quick else 512)
    args.user_queries = args.user_queries or (24 if args.quick else 200)
    args.bank = args.bank or (48 if args.quick else 256)
    if args.torch_compile is None:
        args.torch_compile = not args.quick

    t_start = time.perf_counter()
    print("measuring machine ...", flush=True)
    machine = measure_machine(args.quick)
    print("one-user configs ...", flush=True)
    configs = run_configs(args, machine)
    print("users scaling ...", flush=True)
    users, users_machine, users_setting = run_users(args, machine)
    d_users = 32 if args.quick else 384
    res = {"configs": configs, "users_scaling": users, "users_scaling_d": d_users,
           "users_scaling_machine": users_machine, "users_scaling_setting": users_setting,
           "floor": {name: r["floor"] for name, r in configs.items() if "floor" in r},
           "machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "args": vars(args)}
    res["load_avg_all"] = ([machine["load_avg"]] + [x for r in configs.values() for x in r["load_avg"]]
                           + users_machine["load_avg"] + [os.getloadavg()])
    res["load"] = load_summary([x[0] for x in res["load_avg_all"]])
    res["targets"] = targets(res)
    if not (args.no_profile or args.quick):
        sp = configs["paper"]
        setting = rj.preset(args.preset, k=sp["k"], m=sp["m"], batch=B, credit="reward_to_go")
        res["profile"] = profile_substeps(setting, rj.init_reranker(jax.random.key(0), sp["d"]), sp["d"], sp["k"],
                                          repeats=50)
        res["profile_setting"] = setting_record(args.preset, setting)
    res["total_s"] = time.perf_counter() - t_start
    print()
    print(report(res, args))
    print(f"\ntotal benchmark time {res['total_s']:.1f} s")
    if args.json:
        write_result(args.json, res)
    if args.plot:
        import matplotlib  # lazy: only for --plot, and Agg must be chosen before pyplot loads
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        xs = [r["users"] for r in users.values()]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ys = [r["queries_per_s"] for r in users.values()]
        lo = [r["queries_per_s_repeats"]["min"] for r in users.values()]
        hi = [r["queries_per_s_repeats"]["max"] for r in users.values()]
        ax.errorbar(xs, ys, yerr=[np.subtract(ys, lo), np.subtract(hi, ys)], fmt="o-", capsize=3,
                    label="rmm-jax (drive)")
        floor = [x / r["floor_s"] * r["queries_per_user"] for x, r in zip(xs, users.values())]
        ax.plot(xs, floor, "k:", label="main-memory floor")
        paper = configs["paper"]
        for key, style, label in (("torch_qps", ("C1", "--"), "PyTorch eager, 1 user"),
                                  ("torch_compile_qps", ("C3", "-."), "torch.compile, 1 user"),
                                  ("numpy_qps", ("C2", ":"), "NumPy, 1 user")):
            if key in paper:
                ax.axhline(paper[key], color=style[0], ls=style[1], label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("users")
        ax.set_ylabel("queries / s")
        ax.set_title(f"d={d_users}, {args.user_queries} queries/user, {machine['backend']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save_figure(fig, args.plot)
    return res


if __name__ == "__main__":
    main()
