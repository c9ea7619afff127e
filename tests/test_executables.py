"""Executables kept whole on disk (rmm_jax.core.executables): a second process runs what the
first compiled without tracing it, bit for bit; keys follow shapes, static arguments and the
source; a damaged entry or one that fails to run is compiled again; where JAX's persistent
cache supplied an executable (on CPU it would fail once saved and loaded again), it is compiled
once more without that cache and saved; off, or under a transformation, an aot function is its
jit."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rmm_jax.core import executables
from rmm_jax.core.executables import aot

# Serving in a fresh process: the keys of three calls, a sample and a ranking of the identity
# reranker. JAX logs every trace; the script prints the results.
PROG = """
import jax, numpy as np
from rmm_jax.online.compile_cache import setup
setup()
jax.config.update("jax_log_compiles", True)
from rmm_jax.online.serve import Reranker, call_keys
rr = Reranker(None, dim=8)
rng = np.random.default_rng(0)
q, c = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=(3, 6, 8)).astype(np.float32)
keys = call_keys(4, "u1", ["call:a", "call:b", "call:c"])
got = rr.sample("u1", q, c, 2, keys=keys, tau=0.5)
top = rr.rank("u1", q, c, 3)
print(jax.random.key_data(keys).tolist(), got.selected.tolist(), got.log_prob.tolist(), top.selected.tolist(),
      top.scores.tolist())
"""
SERVING = ("_fold_twice", "_sample", "_rank")


def serve_once(tmp_path) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "RMM_JAX_COMPILE_CACHE")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", PROG], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, r.stderr


def traced(stderr: str) -> set[str]:
    """The serving programs this process traced (JAX logs "Finished tracing NAME for jit";
    an aot program is lowered under NAME_rmm_DIGEST)."""
    return {name for name in SERVING if re.search(rf"Finished tracing {name}(_rmm_[0-9a-f]+)? for jit", stderr)}


def saved(tmp_path) -> list:
    root = tmp_path / "xdg" / "rmm-jax" / "jax-executables"
    return sorted(p.name.split("-")[0] for p in root.rglob("*.exe")) if root.exists() else []


def test_a_second_process_runs_what_the_first_compiled_without_tracing_it(tmp_path):
    out1, err1 = serve_once(tmp_path)
    assert traced(err1) == set(SERVING), err1[-2000:]
    assert saved(tmp_path) == sorted(SERVING)
    out2, err2 = serve_once(tmp_path)
    assert out2 == out1                       # bit for bit (every float printed in full)
    assert traced(err2) == set(), err2[-2000:]
    # entries gone, JAX's persistent cache warm: what it supplies would fail to run once saved
    # and loaded again (on CPU), so each program is compiled again without it and that one is
    # saved. They were used and not saved: every later process traced and lowered them again.
    # Twice: a review found the second refill saving JAX's copy of the first (the refill compiled
    # under one fixed name, which JAX's cache then held), and every later process failing.
    root = tmp_path / "xdg" / "rmm-jax" / "jax-executables"
    for _ in range(2):
        for p in root.rglob("*.exe"):
            p.unlink()
        out3, _ = serve_once(tmp_path)
        assert out3 == out1 and saved(tmp_path) == sorted(SERVING)
        out4, err4 = serve_once(tmp_path)
        assert out4 == out1 and traced(err4) == set(), err4[-2000:]      # the refilled entries load and run


# The suite keeps a persistent JAX cache (tests/conftest.py), which would supply the programs of
# an earlier run (and then they are compiled twice): each run's programs carry a constant of their own.
SALT = float(np.random.default_rng().integers(1, 1 << 20))


@pytest.fixture
def kept(tmp_path):
    executables.use(tmp_path)
    yield tmp_path
    executables.use(None)


def entries(root) -> list:
    return sorted(root.rglob("*.exe"))


def test_keys_follow_shapes_dtypes_statics_and_the_source(kept, monkeypatch):
    @aot(static_argnames=("m",))
    def scale(x, m):
        return x * m + SALT

    a, b = np.ones(3, np.float32), np.ones(4, np.float32)
    for x, m in ((a, 2), (a, 2), (b, 2), (a, 3), (a.astype(np.int32), 2)):
        assert np.array_equal(np.asarray(scale(x, m=m)), x * m + SALT)
    assert len(entries(kept)) == 4                        # (3,) f32 m=2, (4,) m=2, m=3, int32
    # a fresh function object (a new process) finds them; another source is another key
    again = aot(scale.fn, static_argnames=("m",))
    assert np.array_equal(np.asarray(again(a, m=2)), a * 2 + SALT) and len(entries(kept)) == 4
    monkeypatch.setattr(executables, "source_digest", lambda: "f" * 64)
    executables._environment.cache_clear()
    try:
        other = aot(scale.fn, static_argnames=("m",))
        assert np.array_equal(np.asarray(other(a, m=2)), a * 2 + SALT) and len(entries(kept)) == 5
    finally:
        executables._environment.cache_clear()


def test_a_damaged_entry_or_one_that_fails_to_run_is_compiled_again(kept, monkeypatch):
    def cube(x):
        return x ** 3 + SALT

    x = jnp.arange(5.0)
    assert np.array_equal(np.asarray(aot(cube)(x)), np.arange(5.0) ** 3 + SALT)
    (entry,) = entries(kept)
    good = entry.read_bytes()
    entry.write_bytes(good[:40] + bytes([good[40] ^ 0xFF]) + good[41:])      # damaged: its checksum fails
    assert np.array_equal(np.asarray(aot(cube)(x)), np.arange(5.0) ** 3 + SALT)
    # replaced by a fresh compile (JAX's persistent cache supplies this program: compiled again without it)
    assert entry.exists() and entry.read_bytes() != good.replace(good[40:41], bytes([good[40] ^ 0xFF]), 1)
    executables_loaded = aot(cube)                   # a new wrapper loads the refilled entry and runs it
    assert np.array_equal(np.asarray(executables_loaded(x)), np.arange(5.0) ** 3 + SALT)
    entry.write_bytes(good)

    class Broken:                                    # loads, then fails when run (like a re-serialised one)
        def __call__(self, *a, **k):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion not found")

    import jax.experimental.serialize_executable as se
    monkeypatch.setattr(se, "deserialize_and_load", lambda *a, **k: Broken())
    assert np.array_equal(np.asarray(aot(cube)(x)), np.arange(5.0) ** 3 + SALT)


def test_off_or_traced_it_is_its_jit(tmp_path):
    @aot
    def inc(x):
        return x + 1

    executables.use(None)
    assert np.array_equal(np.asarray(inc(np.zeros(2))), np.ones(2))
    executables.use(tmp_path)
    try:
        assert np.array_equal(np.asarray(jax.jit(lambda v: inc(v) * 2)(np.zeros(2))), 2 * np.ones(2))
        assert np.array_equal(np.asarray(jax.vmap(inc)(np.zeros((3, 2)))), np.ones((3, 2)))
        assert entries(tmp_path) == []
    finally:
        executables.use(None)


def test_a_second_rerank_with_no_policy_yet_traces_nothing(tmp_path):
    """Day 1, no policy store yet: every rerank built the identity reranker with init_reranker,
    13 small programs traced in each new process, though a second rerank should trace none."""
    from conftest import make_fake_store

    store = make_fake_store(tmp_path / "store", users=2, dim=8)
    (tmp_path / "calls.jsonl").write_text('{"user_id": "user0", "query_id": "q0"}\n')
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "RMM_JAX_COMPILE_CACHE")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1")
    cmd = [sys.executable, "-c", "from rmm_jax.cli.main import main; main()", "rerank", str(store),
           "--calls", str(tmp_path / "calls.jsonl"), "--k", "4", "--m", "2"]
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-3000:]
    assert "Finished tracing" in runs[0].stderr                # the log is on: the first run traced
    assert re.findall(r"Finished tracing \S+", runs[1].stderr) == [], runs[1].stderr[-3000:]
