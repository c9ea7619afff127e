"""Pytrees as a JSON *spec* plus numpy leaves, structure-agnostically (no pickle).

:func:`encode_tree` flattens a pytree in JAX order (dict keys sorted) into a small
JSON-able spec (dicts, lists, tuples, None, leaves with path/shape/dtype, and
NamedTuples such as optax's ``ScaleByAdamState`` or
:class:`rmm_jax.core.types.LearnerState`) and a list of numpy arrays;
:func:`decode_tree` rebuilds the same tree, re-importing NamedTuple classes by name,
but only from the packages in :data:`ALLOWED_MODULE_ROOTS`. Typed PRNG keys are stored
as their key data plus the impl name and come back typed. :func:`unflatten_like` puts
leaves into the structure of a given template instead.

Used by the policy store and the run-state checkpoints (which write the leaves to an
``.npz`` and the spec as JSON), and by :func:`tree_digest` for run fingerprints.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
from typing import Sequence

import jax
import numpy as np

from rmm_jax.errors import InputError

# NamedTuple classes in a spec are re-imported only from these top-level packages.
ALLOWED_MODULE_ROOTS = ("optax", "rmm_jax", "flax", "chex", "jax", "collections")


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _as_leaf(x, where: str):
    """Return ``(numpy array, extra spec)`` for a leaf; typed PRNG keys store key data."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x)), {"prng_impl": str(jax.random.key_impl(x))}
    if isinstance(x, (np.ndarray, np.generic, jax.Array, bool, int, float, complex)):
        return np.asarray(x), {}
    raise InputError(f"unsupported pytree node of type {type(x).__qualname__}", where=where)


def encode_tree(tree, *, batch: int | None = None, where: str = "tree"):
    """Flatten ``tree`` into ``(spec, leaves)``: a JSON-able structure + numpy leaves.

    Leaves come in JAX flattening order (dict keys sorted). With ``batch`` every leaf must
    have that leading (users) axis; the spec then records per-user shapes.
    """
    leaves: list[np.ndarray] = []

    def enc(node, path: list[str]):
        here = "/".join(path) or "<root>"
        if node is None:
            return {"t": "none"}
        if type(node) is dict:
            bad = [k for k in node if not isinstance(k, (str, int))]
            if bad:
                raise InputError(f"dict key {bad[0]!r} is not str or int", where=f"{where}:{here}")
            keys = sorted(node)
            return {"t": "dict", "k": keys, "c": [enc(node[k], path + [str(k)]) for k in keys]}
        if _is_namedtuple(node):
            cls = type(node)
            return {"t": "nt", "cls": f"{cls.__module__}:{cls.__qualname__}", "f": list(cls._fields),
                    "c": [enc(v, path + [f]) for f, v in zip(cls._fields, node)]}
        if type(node) in (tuple, list):
            return {"t": type(node).__name__, "c": [enc(v, path + [str(i)]) for i, v in enumerate(node)]}
        arr, extra = _as_leaf(node, f"{where}:{here}")
        shape = list(arr.shape)
        if batch is not None:
            if arr.ndim == 0 or arr.shape[0] != batch:
                raise InputError(f"leaf has shape {tuple(arr.shape)}, expected a leading users axis of "
                                 f"{batch}", where=f"{where}:{here}")
            shape = shape[1:]
        leaves.append(arr)
        return {"t": "leaf", "i": len(leaves) - 1, "path": here, "shape": shape,
                "dtype": str(arr.dtype), **extra}

    return enc(tree, []), leaves


@functools.lru_cache(maxsize=256)
def import_namedtuple(name: str):
    """The NamedTuple class ``"module:QualName"`` of a spec, from an allowed package only."""
    module, _, qual = name.partition(":")
    if module.split(".")[0] not in ALLOWED_MODULE_ROOTS:
        raise InputError(f"NamedTuple class {name} is not in an allowed package "
                         f"{ALLOWED_MODULE_ROOTS}; pass template= to restore", where="spec")
    try:
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise InputError(f"cannot import NamedTuple class {name} ({e}); pass template= to restore",
                         where="spec") from None
    return obj


def decode_tree(spec: dict, leaves: Sequence):
    """Rebuild the pytree described by ``spec`` from ``leaves`` (inverse of encode_tree)."""
    t = spec["t"]
    if t == "none":
        return None
    if t == "leaf":
        arr = leaves[spec["i"]]
        if "prng_impl" in spec:
            return jax.random.wrap_key_data(arr, impl=spec["prng_impl"])
        return arr
    children = [decode_tree(c, leaves) for c in spec["c"]]
    if t == "dict":
        return dict(zip(spec["k"], children))
    if t == "nt":
        return import_namedtuple(spec["cls"])(*children)
    return tuple(children) if t == "tuple" else list(children)


def leaf_specs(spec: dict) -> list[dict]:
    """The leaf entries of a spec (path, shape, dtype), in leaf order."""
    if spec["t"] == "leaf":
        return [spec]
    return [leaf for c in spec.get("c", []) for leaf in leaf_specs(c)]


def unflatten_like(template, leaves: list, where: str):
    """Put ``leaves`` into the structure of ``template`` (same count and shapes)."""
    tl, treedef = jax.tree_util.tree_flatten(template)
    if len(tl) != len(leaves):
        raise InputError(f"template has {len(tl)} leaves, stored tree has {len(leaves)}", where=where)
    for i, (a, b) in enumerate(zip(tl, leaves)):
        if tuple(np.shape(a)) != tuple(np.shape(b)):
            raise InputError(f"leaf {i}: template shape {np.shape(a)} != stored {np.shape(b)}", where=where)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def tree_digest(tree) -> str:
    """sha256 of a pytree's structure and leaves (dtype, shape, bytes)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    h = hashlib.sha256(str(treedef).encode())
    for x in leaves:
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
