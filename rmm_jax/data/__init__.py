"""Datasets (LoCoMo, LongMemEval, synthetic) and memory granularity.

A dataset is named on the command line by a SPEC string (:func:`load_spec`)::

    locomo:PATH                     LoCoMo file (per-conversation or locomo10.json) or directory
    longmemeval:PATH                LongMemEval file, turn-level gold (has_answer turns)
    longmemeval:PATH@session        ... session-level gold (all turns of the answer sessions)
    longmemeval:PATH@turn           ... turn-level gold, explicitly
    synthetic                       built-in demo data, default sizes
    synthetic:users=N,sessions=S,turns=T,seed=X   (any subset of the keys)
"""
from __future__ import annotations

from rmm_jax.data.granularity import GRANULARITIES, Topic, build_memories
from rmm_jax.data.locomo import load_locomo
from rmm_jax.data.longmemeval import load_longmemeval
from rmm_jax.data.synthetic import make_synthetic, parse_synthetic_spec
from rmm_jax.data.types import Dataset, MemoryUnit, Query, Session, Turn, User, gold_matrix
from rmm_jax.errors import InputError

__all__ = [
    "GRANULARITIES", "Dataset", "MemoryUnit", "Query", "SCHEMES", "Session", "Topic", "Turn", "User",
    "build_memories", "gold_matrix", "load_locomo", "load_longmemeval", "load_spec", "make_synthetic",
    "parse_synthetic_spec",
]

SCHEMES = ("locomo", "longmemeval", "synthetic")


def load_spec(spec: str) -> Dataset:
    """Load the dataset a SPEC string names (see the module docstring).

    An unknown scheme or a missing path raises InputError naming the SPEC; a missing or
    unreadable file raises InputError naming the file (and line or key).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"empty dataset SPEC (expected one of {', '.join(SCHEMES)})", where="SPEC")
    scheme, colon, rest = spec.strip().partition(":")
    if scheme == "synthetic":
        return make_synthetic(**parse_synthetic_spec(rest))
    if scheme not in SCHEMES:
        raise InputError(f"unknown dataset scheme {scheme!r} (expected one of {', '.join(SCHEMES)}, "
                         f"e.g. locomo:PATH)", where=f"SPEC {spec!r}")
    if not rest:
        raise InputError(f"missing path, expected {scheme}:PATH", where=f"SPEC {spec!r}")
    if scheme == "locomo":
        return load_locomo(rest)
    path, level = rest, "turn"
    head, at_sign, tail = rest.rpartition("@")
    if at_sign and tail in ("turn", "session"):
        path, level = head, tail
    if not path:
        raise InputError(f"missing path, expected {scheme}:PATH", where=f"SPEC {spec!r}")
    return load_longmemeval(path, gold_level=level)
