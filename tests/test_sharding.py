"""Sharding the users axis over devices changes nothing: same params, same outputs.

A subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 CPU
devices) runs the simulated online loop (Gumbel top-M, oracle citations, REINFORCE +
Adam) for 11 users with ``users_per_chunk=8`` (so one full and one padded chunk) twice
with the same seed: once with ``mesh=rmm_jax.online.sharding.users_mesh()`` and once without.
Integer/bool outputs (selections, citations, steps) must be identical, and every float
leaf (final params, Adam state, baseline, recall/NDCG, log-probs, losses) must agree
within 1e-4·max(1, |x|) (1e-4 absolute for |x| ≤ 1). The test prints whether the runs
were bitwise identical; on the 8-device CPU backend they are not: the per-device program
works on 1 user instead of 8, XLA picks different matmul/reduction orders, and float
leaves differ by rounding that compounds over the run (seen: max scaled diff 2.8e-6 and
3.8e-6 on two x86 machines after 64 Adam steps at lr 3e-4), while every discrete decision
(what was sampled and cited) is identical. 1e-4 is an allowance, not a float32 error bound:
the worst-case bound of a whole learning run is vacuous (tests/test_distributed.py), and a
real sharding bug (a wrong reduction, users mixed up) moves leaves by far more.
"""
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json
    import jax, numpy as np
    import rmm_jax as rj
    from rmm_jax.data.citations import oracle_cite
    from rmm_jax.online.driver import ChunkDone, drive
    from rmm_jax.online.loop import make_run
    from rmm_jax.online.sharding import users_mesh
    from rmm_jax.online.streams import Stream

    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    d, k = 16, 8

    def mk(uid, t, n):
        bank = rng.normal(size=(n, d)).astype(np.float32)
        bank /= np.linalg.norm(bank, axis=1, keepdims=True)
        q = rng.normal(size=(t, d)).astype(np.float32)
        cand = np.argsort(-(q @ bank.T), 1)[:, :k].astype(np.int32)
        gold = rng.random((t, n)) < 0.1
        return Stream(uid, bank, q, cand, np.ones((t, k), bool), np.take_along_axis(gold, cand, 1),
                      gold.sum(1).astype(np.int32), gold.sum(1) > 0)

    streams = [mk(f"u{i}", 20 + 3 * i, 30 + i) for i in range(11)]
    params = rj.init_reranker(jax.random.key(0), d)
    run = make_run(*rj.preset("default", k=k, m=3, lr=1e-2), cite_fn=oracle_cite)
    mesh = users_mesh()

    def collect(mesh_arg):
        out = []
        chunks = [streams[:8], streams[8:]]
        for e in drive(chunks, run, params, seed=3, users_per_chunk=8, mesh=mesh_arg):
            if isinstance(e, ChunkDone):
                out.append((e.states, e.outputs))
        return out

    plain, sharded = collect(None), collect(mesh)
    a = jax.tree.leaves(plain)
    b = jax.tree.leaves(sharded)
    assert len(a) == len(b)
    max_diff, max_scaled, bitwise, discrete_equal = 0.0, 0.0, True, True
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        bitwise &= x.tobytes() == y.tobytes()
        if x.dtype.kind == "f":
            both_nan = np.isnan(x) & np.isnan(y)
            diff = np.where(both_nan, 0, np.abs(x - y))
            max_diff = max(max_diff, float(np.max(diff, initial=0.0)))
            max_scaled = max(max_scaled, float(np.max(diff / np.maximum(1.0, np.abs(y)), initial=0.0)))
        else:
            discrete_equal &= bool(np.array_equal(x, y))
    moved = float(np.max(np.abs(np.asarray(plain[0][0].params["q_adapter"]["W"]["kernel"]))))
    print("RESULT " + json.dumps({"bitwise": bool(bitwise), "max_diff": max_diff, "max_scaled_diff": max_scaled,
                                  "discrete_equal": discrete_equal, "leaves": len(a),
                                  "moved": moved, "devices": len(jax.devices())}))
""")


def test_sharded_run_equals_unsharded_run():
    # the suite's fast-compile flags too (conftest): both runs compared here compile under them
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    print(res)
    assert res["devices"] == 8
    assert res["moved"] > 0                                 # the loop really updated the params
    assert res["discrete_equal"], res                     # same selections, citations, steps
    assert res["max_scaled_diff"] <= 1e-4, res             # an allowance: see the module docstring
