"""Shared test helpers. Keep this small; append helpers below."""
from __future__ import annotations

import os
from pathlib import Path

# Compiled programs are cached on disk, keyed by their HLO: the CLI builds a new program per
# command (a new closure, so jit's in-memory cache misses), and the tests run hundreds of
# commands of a few shapes. Set before JAX is imported; subprocesses inherit it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# The tests' programs are tiny and compiled hundreds of times: XLA's CPU backend at its lowest
# optimisation level compiles them about a quarter faster (measured on test_continue.py and
# test_core_update.py: 124 s -> 92 s), and at that level its older fusion codegen (fusion
# emitters off) about a third faster again (the same two files, cold cache, one process:
# 156 s -> 105 s; one simulate program 3.3 s -> 1.8 s; at the default level it gains nothing,
# 6.4 s -> 6.8 s, so users keep XLA's defaults). Every comparison in a test runs both sides under the same
# flags; a test that sets XLA_FLAGS itself (forced device counts) replaces these. The resume
# tests run their subprocesses under the user's own flags (USER_XLA_FLAGS): bit-identical resume
# after a kill is the guarantee users get under their flags (every segment of a chunk runs one
# compiled program, whatever its length; test_resume.py checks --checkpoint-every at ours too).
# (pytest-xdist's workers inherit the controller's environment, where this already ran: the
# user's flags are what remains without ours.)
#
# Tests marked `user_xla_flags` assert that two different programs agree bit for bit (a
# simulate and the replay of its log): that too holds under XLA's own flags, not ours (with
# fusion emitters off, a shared and a hybrid replay round one ulp apart), so such a test runs
# in a child pytest under the user's flags (pytest_pyfunc_call below; UNDER_USER_FLAGS marks
# the child).
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false")
UNDER_USER_FLAGS = "RMM_TESTS_UNDER_USER_XLA_FLAGS"
USER_XLA_FLAGS = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in _FAST_COMPILE)
if os.environ.get(UNDER_USER_FLAGS) != "1":
    os.environ["XLA_FLAGS"] = " ".join([USER_XLA_FLAGS, *_FAST_COMPILE]).strip()

import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from fake_embedder import FakeEmbedder  # noqa: E402, F401 - the tests import it from here

from rmm_jax.cli.main import main  # noqa: E402
from rmm_jax.data import make_synthetic  # noqa: E402
from rmm_jax.data.store import write_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# `make test` hands whole files to the xdist workers (--dist loadfile): a file's tests share
# one process, so its module fixtures are built once and its programs traced once (worksteal
# built test_resume.py's reference run on both workers). Files go out in this order, the
# longest first (cold-cache seconds, `make test`'s --durations), then the rest as collected, so
# a long file does not start last while the other worker sits idle.
LONGEST_FIRST = ("test_resume.py", "test_bench_references.py", "test_docs.py", "test_core_update.py",
                 "test_distributed.py", "test_production.py", "test_online_jobs.py", "test_core_losses.py",
                 "test_continue.py", "test_scopes.py", "test_cli_scopes.py", "test_doctests.py", "test_sharding.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: a file keeps its order


def pytest_pyfunc_call(pyfuncitem):
    """A `user_xla_flags` test runs in a child pytest under the user's XLA flags, and passes,
    fails or skips as it does there."""
    if pyfuncitem.get_closest_marker("user_xla_flags") is None or os.environ.get(UNDER_USER_FLAGS) == "1":
        return None
    env = {**os.environ, "XLA_FLAGS": USER_XLA_FLAGS, UNDER_USER_FLAGS: "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode == 0 and " passed" in last:
        return True
    if proc.returncode == 0 and " skipped" in last:
        why = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(f"under the user's XLA flags: {why[0] if why else last}")
    pytest.fail(f"under the user's XLA flags ({USER_XLA_FLAGS or 'none'}):\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}",
                pytrace=False)


@pytest.fixture(params=["jit", "eager"])
def variant(request):
    """``variant(fn, static_argnames=...)``: ``jax.jit(fn, ...)`` or ``fn`` itself, so a test
    of a pure function runs both ways (rlax's ``chex.variants``). Static arguments (m,
    mode, credit, kinds) stay Python values under jit, as callers pass them."""
    if request.param == "eager":
        return lambda fn, static_argnames=(): fn
    return lambda fn, static_argnames=(): jax.jit(fn, static_argnames=static_argnames)


def locomo_dir() -> Path:
    """The LoCoMo data directory: $RMM_LOCOMO_DIR, default <repo>/../shared/data/locomo.

    Skips the calling test when the data is absent, except on CI (CI=true) where a
    missing dataset is a failure rather than a silent skip.
    """
    path = Path(os.environ.get("RMM_LOCOMO_DIR") or REPO.parent / "shared" / "data" / "locomo")
    if path.is_dir() and any(path.glob("*.json")):
        return path
    msg = f"LoCoMo data not found at {path}: set RMM_LOCOMO_DIR"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def make_fake_store(path, users=4, sessions=4, turns=8, seed=0, dim=32):
    """An embedding store of synthetic users with hash embeddings (no model, ~1 s)."""
    spec = f"synthetic:users={users},sessions={sessions},turns={turns},seed={seed}"
    write_store(path, make_synthetic(users=users, sessions=sessions, turns=turns, seed=seed), "turn",
                FakeEmbedder(dim), spec=spec)
    return path


def use_fake_embedder(mp, dim: int = 16) -> None:
    """Every verb that embeds (embed, demo, and the data layer the others call) gets
    FakeEmbedder(dim) instead of the model, through ``mp`` (a pytest MonkeyPatch): the verbs
    bind Embedder at import, so each module is patched."""
    import rmm_jax.cli.demo as demo_verb
    import rmm_jax.cli.embed as embed_verb
    from rmm_jax.data import embed as embed_mod

    for module in (embed_verb, embed_mod, demo_verb):
        mp.setattr(module, "Embedder", lambda *a, **kw: FakeEmbedder(dim))


def run_cli(capsys, *args):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err
