"""The persistent compilation cache every verb sets up: where it lives, the switch, and
that a second process loads what the first compiled."""
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from rmm_jax.cli import main as cli_main
from rmm_jax.core import executables
from rmm_jax.online import compile_cache

# One small program, compiled in a fresh process after setup(); JAX logs its cache hits.
PROG = """
import jax, jax.numpy as jnp
from rmm_jax.online.compile_cache import setup
from rmm_jax.core.executables import where
print("dir", setup())
print("exe", where())
jax.config.update("jax_log_compiles", True)
print(jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.0)(jnp.ones((7, 5))).sum())
"""


def run(env_over: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", compile_cache.ENV, "XDG_CACHE_HOME")}
    return subprocess.run([sys.executable, "-c", PROG], env={**env, **env_over}, capture_output=True, text=True,
                          check=True, timeout=120)


def test_second_process_loads_what_the_first_compiled(tmp_path):
    xdg = tmp_path / "xdg"
    first = run({"XDG_CACHE_HOME": str(xdg)})
    where = xdg / "rmm-jax" / "jax"
    assert f"dir {where}" in first.stdout and f"exe {where}-executables" in first.stdout
    assert any(where.iterdir()) and "cache hit" not in first.stderr
    second = run({"XDG_CACHE_HOME": str(xdg)})
    assert "Persistent compilation cache hit" in second.stderr
    # switched off: the user's own JAX directory is left alone, nothing is read or written
    own = tmp_path / "own"
    off = run({"XDG_CACHE_HOME": str(xdg), "JAX_COMPILATION_CACHE_DIR": str(own), compile_cache.ENV: "0"})
    assert "dir None" in off.stdout and "exe None" in off.stdout and not own.exists() and "cache hit" not in off.stderr


def test_a_directory_the_user_gave_jax_is_kept():
    given = os.environ["JAX_COMPILATION_CACHE_DIR"]          # tests/conftest.py sets the suite's
    assert compile_cache.setup() == Path(given)
    # the executables kept whole live beside it, and are on and off with it
    assert executables.where() == Path(given + "-executables")
    assert compile_cache.default_dir({}) == Path.home() / ".cache" / "rmm-jax" / "jax"


def test_every_verb_that_loads_jax_sets_it_up_first(monkeypatch):
    calls = []
    monkeypatch.setattr(compile_cache, "setup", calls.append)
    runner = CliRunner()
    assert runner.invoke(cli_main.cli, ["version"]).exit_code == 0
    assert runner.invoke(cli_main.cli, ["--no-compile-cache", "version"]).exit_code == 0
    assert runner.invoke(cli_main.cli, ["embed", "--help"]).exit_code == 0     # no JAX, nothing to compile
    assert runner.invoke(cli_main.cli, ["pretrain", "--help"]).exit_code == 0
    assert calls == [True, False, True]


# A Python service that builds a Reranker: the CLI sets the cache up, the API did not, and
# its first rank compiled every program (376-588 ms against 41-54 ms with setup()).
SERVE = """
import sys, jax
from rmm_jax.online.serve import Reranker
from rmm_jax.core.executables import where
from rmm_jax.online.compile_cache import setup
if sys.argv[1] == "cli-off":    # rmm-jax --no-compile-cache, then the verb builds its Reranker
    setup(False)
if sys.argv[1] == "app-off":    # the application switched JAX's cache off itself
    jax.config.update("jax_enable_compilation_cache", False)
Reranker(None, dim=4, **({"compile_cache": False} if sys.argv[1] == "off" else {}))
print("dir", jax.config.jax_compilation_cache_dir)
print("exe", where())
"""


def serve(how: str, env_over: dict) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", compile_cache.ENV, "XDG_CACHE_HOME")}
    return subprocess.run([sys.executable, "-c", SERVE, how], env={**env, **env_over}, capture_output=True,
                          text=True, check=True, timeout=120).stdout


def test_a_reranker_built_in_a_fresh_process_uses_the_cache_as_the_cli_does(tmp_path):
    xdg = tmp_path / "xdg"
    where = xdg / "rmm-jax" / "jax"
    assert serve("on", {"XDG_CACHE_HOME": str(xdg)}).split("\n")[:2] == [f"dir {where}", f"exe {where}-executables"]
    # compile_cache=False, RMM_JAX_COMPILE_CACHE=0, or the CLI's --no-compile-cache: left as it was
    for how, env in (("off", {}), ("on", {compile_cache.ENV: "0"}), ("cli-off", {}), ("app-off", {})):
        assert serve(how, {"XDG_CACHE_HOME": str(xdg), **env}).split("\n")[:2] == ["dir None", "exe None"]
    # a directory the application gave JAX is its own: kept, and nothing else set up
    own = tmp_path / "own"
    assert serve("on", {"XDG_CACHE_HOME": str(xdg), "JAX_COMPILATION_CACHE_DIR": str(own)}).split("\n")[:2] == \
        [f"dir {own}", "exe None"]

