"""Learning across devices and processes: the shared part's gradient is reduced by XLA
collectives, so a sharded run equals a single-device run up to float32 summation order.

Two real processes talk over gloo (``jax.distributed``) on localhost; eight devices are
forced on the CPU backend. Selections and citations (discrete) must be identical through the
whole run. Float leaves: the sum over users is reassociated across devices, and the difference
then compounds through every later learning step, so max |a − b| / max(1, |b|) ≤ 1e-5 is an
allowance, not a float32 error bound: the worst-case bound of a whole run (tests/helpers.py
``f32_error``, chunk by chunk) is vacuous here, above 1e7 on the parameters, as rounding differences are amplified
by later gradients and Adam's division by √v. Measured: ≤ 1.5e-7 (two processes), ≤ 1.2e-7
(eight devices), ≤ 3e-8 (the CLI), so the allowance is about 65 times the observed difference.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys
    pid, n, port, out, scope = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    import jax
    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    import numpy as np
    import rmm_jax as rj
    from rmm_jax.data.citations import oracle_cite
    from rmm_jax.online.driver import ChunkDone, drive
    from rmm_jax.online.loop import make_run
    from rmm_jax.online.sharding import users_mesh
    from rmm_jax.online.vectors import VectorSpec, vector_chunks

    spec = VectorSpec(dim=16, memories=30, queries=24, k=8)
    program = make_run(*rj.preset("default", k=8, m=3, lr=1e-2, scope=scope, rank=2 if scope == "hybrid" else None),
                       cite_fn=oracle_cite)
    params = rj.init_reranker(jax.random.key(0), 16)
    mesh = users_mesh() if len(jax.devices()) > 1 else None
    out_arrays = {}
    for e in drive(vector_chunks(spec, 0, 14, 8), program, params, users_per_chunk=8,
                   mesh=mesh):
        if isinstance(e, ChunkDone):
            for i, x in enumerate(jax.tree.leaves(e.shared.params)):
                out_arrays[f"c{e.chunk}_shared{i}"] = np.asarray(x)
            for i, x in enumerate(jax.tree.leaves(e.states)):
                out_arrays[f"c{e.chunk}_users{i}"] = np.asarray(x)
            for u, o in e.outputs.items():
                for k, v in o.items():
                    out_arrays[f"c{e.chunk}_{u}_{k}"] = np.asarray(v)
    if pid == 0:
        np.savez(out, devices=len(jax.devices()), processes=jax.process_count(), **out_arrays)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args_per_process, env_extra=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, *map(str, a)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in args_per_process]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]


def compare(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    keys = [k for k in a.files if k not in ("devices", "processes")]
    assert sorted(keys) == sorted(k for k in b.files if k not in ("devices", "processes"))
    worst = 0.0
    for k in keys:
        x, y = a[k], b[k]
        assert x.shape == y.shape and x.dtype == y.dtype, k
        if x.dtype.kind == "f" and not k.endswith("_log_prob") and "_recall" not in k and "_ndcg" not in k:
            worst = max(worst, float(np.max(np.abs(x - y) / np.maximum(1.0, np.abs(y)), initial=0.0)))
        elif x.dtype.kind != "f":
            assert np.array_equal(x, y), k                       # selections, citations, steps, keys
    moved = max(float(np.abs(a[k]).max()) for k in keys if "_shared" in k)
    return worst, moved, int(a["devices"]), int(b["devices"]), int(a["processes"])


def test_two_processes_learn_the_same_shared_policy_as_one(tmp_path):
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    launch([(0, 1, 0, one, "hybrid")])
    port = free_port()
    launch([(i, 2, port, two, "hybrid") for i in range(2)])
    worst, moved, d2, d1, procs = compare(two, one)
    assert (d2, procs, d1) == (2, 2, 1)
    assert moved > 0
    assert worst <= 1e-5, worst


def test_eight_devices_learn_the_same_shared_policy_as_one(tmp_path):
    one, eight = tmp_path / "one.npz", tmp_path / "eight.npz"
    launch([(0, 1, 0, one, "shared")])
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"   # and the suite's
    launch([(0, 1, 0, eight, "shared")], {"XLA_FLAGS": flags})
    worst, moved, d8, d1, _ = compare(eight, one)
    assert (d8, d1) == (8, 1)
    assert moved > 0
    assert worst <= 1e-5, worst


def test_the_same_command_per_process_writes_what_one_process_writes(tmp_path):
    """`rmm-jax simulate ... --coordinator HOST:PORT --num-processes 2 --process-id I` on two
    processes: process 0 writes the policy store, and it holds the single-process result."""
    import jax
    from conftest import make_fake_store

    from rmm_jax.online.serve import user_params
    from rmm_jax.persist.policy_store import PolicyStore

    store = make_fake_store(tmp_path / "store", users=4, dim=16)
    args = ["simulate", str(store), "--k", "8", "--m", "3", "--lr", "0.01", "--scope", "hybrid", "--rank", "2",
            "--users-per-chunk", "2", "--checkpoint-every", "0"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    one = subprocess.run([sys.executable, "-m", "rmm_jax.cli.main", *args, "--policies", str(tmp_path / "one")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "rmm_jax.cli.main", *args, "--policies", str(tmp_path / "two"),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    a, b = PolicyStore.open(tmp_path / "one"), PolicyStore.open(tmp_path / "two")
    assert a.users() == b.users() and len(a.users()) == 4
    worst = 0.0
    for u in a.users():
        for x, y in zip(jax.tree.leaves(user_params(b, u)), jax.tree.leaves(user_params(a, u))):
            x, y = np.asarray(x), np.asarray(y)
            worst = max(worst, float(np.max(np.abs(x - y) / np.maximum(1.0, np.abs(y)))))
    assert worst <= 1e-5, worst
    assert max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(a.shared_state().state.params)) > 0
