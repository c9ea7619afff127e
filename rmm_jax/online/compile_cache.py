"""A persistent compilation cache, so that a command compiles a program once per machine.

Every ``rmm-jax`` verb builds its programs afresh (a new process, a new closure), and on
CPU compiling the online loop costs several times what a day's replay of a few users
does. JAX can keep compiled executables on disk, keyed by what it compiles (the HLO of the
program, its input shapes, the compile options and flags, the JAX and backend versions):
:func:`setup` turns that on before the first compile, so the second run of a command
loads what the first compiled. A change of code, shapes or flags changes the key and
compiles anew; nothing stale is ever run.

Where (the first that applies):

1. ``RMM_JAX_COMPILE_CACHE=0`` (or ``off``/``false``/``no``), or ``rmm-jax --no-compile-cache``:
   no persistent cache;
2. a directory the user already gave JAX (``JAX_COMPILATION_CACHE_DIR``, or
   ``jax.config.update("jax_compilation_cache_dir", ...)`` before this runs): that one;
3. ``$XDG_CACHE_HOME/rmm-jax/jax``, else ``~/.cache/rmm-jax/jax`` (:func:`default_dir`).

The serving API sets it up too, when a :class:`~rmm_jax.online.serve.Reranker` is built
(:func:`ensure`: not when the application configured JAX's cache itself; the
Reranker's ``compile_cache=False`` leaves it off).

Beside it, :mod:`rmm_jax.core.executables` keeps the serving and evaluation programs'
executables whole (``DIR-executables``), so that a warm ``rerank`` does not even trace
them; it is on and off with this cache.

Programs that compile in under a second are cached too (JAX's default skips them; here a
command is made of such programs), unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
says otherwise. The cache holds executables for this machine's CPU: on a home directory
shared by machines of different CPUs, give each its own ``JAX_COMPILATION_CACHE_DIR``.
Like any JAX compilation cache it is trusted code: do not point it at a directory others
can write. Deleting it is always safe (the next run compiles again).

Examples:
  >>> from rmm_jax.online.compile_cache import default_dir, wanted
  >>> env = {"XDG_CACHE_HOME": "/tmp/xdg"}
  >>> str(default_dir(env))
  '/tmp/xdg/rmm-jax/jax'
  >>> wanted({"RMM_JAX_COMPILE_CACHE": "0"}), wanted({})
  (False, True)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import jax

from rmm_jax.core import executables

ENV = "RMM_JAX_COMPILE_CACHE"
MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_OFF = ("0", "off", "false", "no")


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """False when ``RMM_JAX_COMPILE_CACHE`` switches the cache off."""
    return environ.get(ENV, "").strip().lower() not in _OFF


def default_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/rmm-jax/jax``, else ``~/.cache/rmm-jax/jax``."""
    root = environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(root).expanduser() / "rmm-jax" / "jax"


_set_up = False      # setup() ran in this process (the CLI's, or the serving API's through ensure())


def setup(enabled: bool = True) -> Path | None:
    """Use the persistent compilation cache (see the module docstring) from the next
    compile on; returns its directory, or None when it is off. ``enabled=False`` (the
    CLI's ``--no-compile-cache``) and ``RMM_JAX_COMPILE_CACHE=0`` switch it off. JAX
    settles whether a process uses the cache at its first compile: call this before."""
    global _set_up
    _set_up = True
    if not (enabled and wanted()):
        jax.config.update("jax_enable_compilation_cache", False)
        executables.use(None)
        return None
    given = jax.config.jax_compilation_cache_dir          # JAX_COMPILATION_CACHE_DIR or the user's own setting
    path = Path(given) if given else default_dir()
    if not given:
        jax.config.update("jax_compilation_cache_dir", str(path))
    if MIN_TIME_ENV not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    executables.use(path.with_name(path.name + executables.SUFFIX))
    return path


def ensure() -> Path | None:
    """:func:`setup` for the Python API (:class:`rmm_jax.online.serve.Reranker`), as the CLI
    sets it up for every verb: once per process, and only where nothing configured it
    before: not after :func:`setup` (the CLI's, ``--no-compile-cache`` included), not under
    ``RMM_JAX_COMPILE_CACHE=0``, not when the application gave JAX a cache directory of
    its own (``JAX_COMPILATION_CACHE_DIR``, or ``jax_compilation_cache_dir``) or switched
    JAX's cache off (``jax_enable_compilation_cache``), whose settings are left as they are.
    What it sets is the process's, as JAX's settings are: the cache directory, a minimum
    compile time of 0 (every program the process compiles is kept, the application's too)
    and rmm-jax's executables beside it. Returns the directory it set up, else None."""
    if (_set_up or not wanted() or jax.config.jax_compilation_cache_dir
            or not jax.config.jax_enable_compilation_cache):
        return None
    return setup()
