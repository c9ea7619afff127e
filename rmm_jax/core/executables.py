"""Compiled programs kept whole on disk, so that a warm command neither traces nor lowers them.

JAX's persistent compilation cache (:mod:`rmm_jax.online.compile_cache`) saves XLA's
compile, but its key is the lowered program: every process still traces and lowers each
program to find its entry. For the serving programs that is 20 to 70 ms a program, most
of what a warm ``rerank`` spends in JAX. :func:`aot` wraps a function like ``jax.jit``
and keeps each compiled executable (:mod:`jax.experimental.serialize_executable`) under a
key made without tracing:

* the function's module and name, and a digest of rmm-jax's own source files (a change
  anywhere in the package is a new key: the function's body and all it calls are in it);
* the JAX and jaxlib versions, the backend, its platform version and devices,
  ``XLA_FLAGS``, and the JAX options that change a program (x64, matmul precision);
* the values of the static arguments, and the tree, shapes, dtypes and weak types of
  the others.

Each version of rmm-jax's source keeps its executables in a directory of its own, and
the newest four such directories are kept.

A key not on disk is compiled and saved: written to a temporary file, then renamed, with
a sha256 of the executable that is checked before it is loaded. An entry that is damaged,
does not load (another jaxlib build) or fails on its first run is compiled again and
replaced. An executable that JAX's persistent cache supplied is not the one saved: on CPU
one loaded from that cache does not serialize whole (it fails to run once loaded again),
so the program is compiled once more under a name no process used before (which that
cache cannot hold; it keeps the copy, one entry a refill), and that one is used and
saved. JAX's cache holds the program only if this version of rmm-jax compiled it before
(it is lowered under a name that holds the source digest) and its entry here was then
deleted or damaged: without the second compile that entry was never written again, and
every later process traced and lowered the program. A process keeps what it loaded in memory.

Where: beside the compilation cache's directory, its name followed by ``-executables``
(``$XDG_CACHE_HOME/rmm-jax/jax-executables``, else ``~/.cache/rmm-jax/jax-executables``), and
only while that cache is on (:func:`rmm_jax.online.compile_cache.setup` calls :func:`use`), on one device in one
process; otherwise an :func:`aot` function is its ``jax.jit``. Like any compilation
cache it holds code to run: keep it where only you can write.

Examples:
  >>> import jax.numpy as jnp
  >>> from rmm_jax.core.executables import aot
  >>> @aot
  ... def double(x):
  ...     return 2 * x
  >>> double(jnp.arange(3)).tolist()
  [0, 2, 4]
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

SUFFIX = "-executables"
_dir: Path | None = None


def use(path: Path | None) -> None:
    """Keep executables under ``path`` from now on (None: do not; :func:`aot` is ``jax.jit``)."""
    global _dir
    _dir = None if path is None else Path(path)


def where() -> Path | None:
    """The directory executables are kept in (None: off)."""
    return _dir


@functools.cache
def source_digest() -> str:
    """sha256 of every ``.py`` file of the installed rmm-jax package (path and bytes)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _environment() -> str:
    import jaxlib
    client = jax.devices()[0].client
    return json.dumps({
        "rmm_jax": source_digest(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "platform": client.platform, "platform_version": client.platform_version,
        "devices": [str(d.device_kind) for d in jax.devices()], "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x64": bool(jax.config.jax_enable_x64), "precision": str(jax.config.jax_default_matmul_precision)})


@functools.cache
def _one_device() -> bool:
    """One process with one device: where a kept executable runs as compiled (settled once
    JAX's backend is up)."""
    return jax.process_count() == 1 and jax.device_count() == 1


def _leaf(x) -> tuple:
    """What a compiled program depends on of one argument leaf (shape, dtype, weak type);
    TypeError for a tracer or a value this cache cannot key."""
    if type(x) is np.ndarray:                           # the usual leaf: checked first, cheaply
        return x.shape, x.dtype, False
    if isinstance(x, jax.core.Tracer):                  # under a transformation: the caller's trace, not ours
        raise TypeError("traced")
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return tuple(np.shape(x)), x.dtype, bool(getattr(x, "weak_type", False))
    if isinstance(x, (bool, int, float)):
        return ("python", type(x).__name__)
    raise TypeError(type(x).__name__)


_HIT = "/jax/compilation_cache/cache_hits"
_hits = [0]


def _count_hit(event: str, **_) -> None:
    if event == _HIT:
        _hits[0] += 1


@functools.cache
def _listen_for_hits() -> None:
    """Count JAX's persistent-cache hits from now on (once per process)."""
    jax.monitoring.register_event_listener(_count_hit)


class Aot:
    """A function compiled once per argument signature and machine (module docstring)."""

    def __init__(self, fn: Callable, static_argnames: tuple[str, ...] = ()):
        functools.update_wrapper(self, fn)
        self.fn, self.static = fn, tuple(static_argnames)
        self.jitted = jax.jit(fn, static_argnames=self.static)
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.signature = inspect.signature(fn)
        self._loaded: dict = {}        # signature -> executable
        self._unproven: set = set()    # signatures loaded from disk and not yet run

    def __call__(self, *args, **kwargs):
        if _dir is None or not _one_device():
            return self.jitted(*args, **kwargs)
        if kwargs.keys() <= set(self.static):            # the usual call: statics by name, the rest in order
            statics, dynamic = kwargs, (args, {})
        else:
            bound = self.signature.bind(*args, **kwargs)
            statics = {n: bound.arguments.pop(n) for n in self.static if n in bound.arguments}
            dynamic = (bound.args, bound.kwargs)
        try:
            leaves, tree = jax.tree.flatten(dynamic)
            sig = (tree, tuple(_leaf(x) for x in leaves), tuple(sorted(statics.items())))
            hash(sig)
        except TypeError:               # traced, or an argument this cache cannot key: plain jit
            return self.jitted(*args, **kwargs)
        exe = self._loaded.get(sig)
        if exe is None:
            exe = self._loaded[sig] = self._load_or_compile(sig, dynamic, statics)
        if sig not in self._unproven:
            return exe(*dynamic[0], **dynamic[1])
        try:
            out = exe(*dynamic[0], **dynamic[1])
        except jax.errors.JaxRuntimeError:   # an entry that loads but does not run: compiled again, replaced
            self.path(sig).unlink(missing_ok=True)
            self._unproven.discard(sig)
            exe = self._loaded[sig] = self._compile_and_save(sig, dynamic, statics)
            return exe(*dynamic[0], **dynamic[1])
        self._unproven.discard(sig)
        return out

    def path(self, sig: tuple) -> Path:
        tree, leaves, statics = sig
        key = hashlib.sha256(json.dumps([self.name, _environment(), str(tree), [list(map(str, x)) for x in leaves],
                                         repr(statics)]).encode()).hexdigest()
        return _dir / source_digest()[:16] / f"{self.fn.__name__}-{key[:40]}.exe"

    def _load_or_compile(self, sig: tuple, dynamic: tuple, statics: dict):
        from jax.experimental.serialize_executable import deserialize_and_load
        path = self.path(sig)
        try:
            blob = path.read_bytes()
        except OSError:
            blob = None
        if blob is not None:
            try:
                digest, body = blob[:32], blob[32:]
                if hashlib.sha256(body).digest() != digest:
                    raise ValueError("damaged")
                exe = deserialize_and_load(*pickle.loads(body))
                self._unproven.add(sig)
                return exe
            except Exception:  # noqa: BLE001 - damaged or from another build: removed, compiled below
                path.unlink(missing_ok=True)
        return self._compile_and_save(sig, dynamic, statics)

    def _compile_and_save(self, sig: tuple, dynamic: tuple, statics: dict):
        """Compile and save; compiled again with JAX's persistent cache off when that cache
        supplied the executable (module docstring)."""
        from jax.experimental.serialize_executable import serialize
        _listen_for_hits()
        hits = _hits[0]
        compiled = self._jit_named.lower(*dynamic[0], **dynamic[1], **statics).compile()
        if _hits[0] != hits:
            # under a name no process used before: JAX's cache cannot hold it (the same name would get the same
            # executable back; switching that cache off has no effect once a process has used it)
            hits = _hits[0]
            fresh = self._jit_as(f"{self.fn.__name__}_rmm_{source_digest()[:12]}_{os.getpid()}_{time.time_ns()}")
            compiled = fresh.lower(*dynamic[0], **dynamic[1], **statics).compile()
            if _hits[0] != hits:         # supplied all the same: used, not saved
                return compiled
        path = self.path(sig)
        try:
            body = pickle.dumps(serialize(compiled))
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True)
                _prune(path.parent.parent)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(hashlib.sha256(body).digest() + body)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except Exception:  # noqa: BLE001 - a cache that cannot be written only costs the next run a compile
            pass
        return compiled

    @functools.cached_property
    def _jit_named(self):
        return self._jit_as(f"{self.fn.__name__}_rmm_{source_digest()[:12]}")

    def _jit_as(self, name: str):
        @functools.wraps(self.fn)
        def named(*args, **kwargs):
            return self.fn(*args, **kwargs)
        named.__name__ = named.__qualname__ = name
        return jax.jit(named, static_argnames=self.static)


KEEP_VERSIONS = 4


def _prune(root: Path) -> None:
    """Keep the executables of the newest :data:`KEEP_VERSIONS` rmm-jax sources (one
    directory each, by modification time): an upgrade or an edit leaves the old ones unused."""
    dirs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in dirs[KEEP_VERSIONS:]:
        shutil.rmtree(old, ignore_errors=True)


def aot(fn: Callable | None = None, *, static_argnames: tuple[str, ...] = ()):
    """``jax.jit`` whose executables are kept on disk (module docstring); as a decorator,
    bare or with ``static_argnames``."""
    if fn is None:
        return functools.partial(aot, static_argnames=static_argnames)
    return Aot(fn, static_argnames)
