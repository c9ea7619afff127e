"""The data layer: datasets -> memories -> embedding store; retrieval; citations.

Modules (each imports only :mod:`rmm_jax.core`, :mod:`rmm_jax.persist`,
:mod:`rmm_jax.errors` and this package, never :mod:`rmm_jax.online` or :mod:`rmm_jax.cli`):

* :mod:`~rmm_jax.data.types` - users, sessions, turns, queries, memory units;
  :mod:`~rmm_jax.data.locomo`, :mod:`~rmm_jax.data.longmemeval`,
  :mod:`~rmm_jax.data.synthetic` - the loaders, over the checked JSON reads of
  :mod:`~rmm_jax.data.json_fields`; :mod:`~rmm_jax.data.jsonl` - your own chat
  histories; :mod:`~rmm_jax.data.log_dataset` - your generator-call logs;
* :mod:`~rmm_jax.data.granularity` - memory units per turn, session or topic segment;
* :mod:`~rmm_jax.data.embed` - sentence embeddings with a disk cache;
* :mod:`~rmm_jax.data.store` - the embedding store on disk;
* :mod:`~rmm_jax.data.retrieval` - exact dense top-k in JAX;
* :mod:`~rmm_jax.data.citations` - the citation simulators;
  :mod:`~rmm_jax.data.prompt` - a real generator's prompt and its citations read back;
* :mod:`~rmm_jax.data.citation_log` - the citation log (JSONL): schema, reader, writer.

This package itself exports the dataset side. A dataset is named on the command line
by a SPEC string (:func:`load_spec`)::

    locomo:PATH                     LoCoMo file (per-conversation or locomo10.json) or directory
    longmemeval:PATH                LongMemEval file, turn-level gold (has_answer turns)
    longmemeval:PATH@session        ... session-level gold (all turns of the answer sessions)
    longmemeval:PATH@turn           ... turn-level gold, explicitly
    synthetic                       built-in demo data, default sizes
    synthetic:users=N,sessions=S,turns=T,seed=X   (any subset of the keys)
    jsonl:PATH                      your chat histories (OpenAI messages), schema in rmm_jax.data.jsonl
    log:PATH[,memories=MEMS]        a generator-call log carrying query and memory texts
"""
from __future__ import annotations

from pathlib import Path

from rmm_jax.data.granularity import (
    DEFAULT_GRANULARITY,
    DEFAULT_MERGE_THRESHOLD,
    DEFAULT_SEGMENT_THRESHOLD,
    GRANULARITIES,
    Topic,
    build_memories,
)
from rmm_jax.data.jsonl import load_jsonl
from rmm_jax.data.locomo import load_locomo
from rmm_jax.data.log_dataset import load_log_dataset, parse_log_spec
from rmm_jax.data.longmemeval import DEFAULT_GOLD_LEVEL, GOLD_LEVELS, load_longmemeval
from rmm_jax.data.synthetic import make_synthetic, parse_synthetic_spec
from rmm_jax.data.types import Dataset, MemoryUnit, Query, Session, Turn, User, gold_matrix
from rmm_jax.errors import InputError

__all__ = [
    "DEFAULT_GRANULARITY", "DEFAULT_MERGE_THRESHOLD", "DEFAULT_SEGMENT_THRESHOLD",
    "GRANULARITIES", "Dataset", "MemoryUnit", "Query", "SCHEMES", "Session", "Topic", "Turn", "User",
    "build_memories", "gold_matrix", "load_jsonl", "load_locomo", "load_log_dataset", "load_longmemeval",
    "load_spec", "make_synthetic", "parse_synthetic_spec",
]

SCHEMES = ("locomo", "longmemeval", "synthetic", "jsonl", "log")


def load_spec(spec: str, *, skip_invalid: bool = False, keep_roles: tuple[str, ...] = (),
              gold_elsewhere: bool = False) -> Dataset:
    """Load the dataset a SPEC string names (see the module docstring).

    An unknown scheme or a missing path raises InputError naming the SPEC; a missing or
    unreadable file raises InputError naming the file (and line or key).
    ``skip_invalid``: ``jsonl:`` skips and counts invalid messages; ``keep_roles``: ``jsonl:``
    keeps these instruction roles' messages (``system``, ``developer``) as memories
    (:func:`~rmm_jax.data.jsonl.load_jsonl`); other schemes refuse both. ``gold_elsewhere``:
    ``jsonl:`` keeps gold ids its file does not hold aside, for a store append to look up
    (``rmm-jax embed --into``); the other schemes check their gold as they always do.
    ``spec`` is the str itself, scheme first: a path (``pathlib.Path``) or another type is an
    InputError naming ``spec`` (a path has no scheme: give ``f"jsonl:{path}"``).
    """
    if not isinstance(spec, str):         # Path("synthetic") said "empty dataset SPEC"
        raise InputError(f"expected a SPEC str, scheme first (\"synthetic\", \"jsonl:PATH\"; one of "
                         f"{', '.join(SCHEMES)}), got {type(spec).__name__} {str(spec)!r}"[:200], arg="spec")
    if not spec.strip():
        raise InputError(f"empty dataset SPEC (expected one of {', '.join(SCHEMES)})", where="SPEC")
    scheme, colon, rest = spec.strip().partition(":")
    for name, given in (("skip_invalid", skip_invalid), ("keep_roles", keep_roles)):
        if given and scheme in SCHEMES and scheme != "jsonl":
            raise InputError(f"applies to jsonl: datasets only, not {scheme}:", arg=name)
    if scheme == "synthetic":
        return make_synthetic(**parse_synthetic_spec(rest))
    if scheme not in SCHEMES:
        raise InputError(f"unknown dataset scheme {scheme!r} (expected one of {', '.join(SCHEMES)}, "
                         f"e.g. locomo:PATH)", where=f"SPEC {spec!r}")
    if not rest:
        raise InputError(f"missing path, expected {scheme}:PATH", where=f"SPEC {spec!r}")
    if scheme == "locomo":
        return load_locomo(rest)
    if scheme == "jsonl":
        return load_jsonl(rest, skip_invalid=skip_invalid, keep_roles=keep_roles, gold_elsewhere=gold_elsewhere)
    if scheme == "log":
        return load_log_dataset(*parse_log_spec(rest))
    path, level = rest, DEFAULT_GOLD_LEVEL
    head, at_sign, tail = rest.rpartition("@")
    if at_sign and tail in GOLD_LEVELS:
        path, level = head, tail
    elif at_sign and head and Path(head).is_file() and not Path(rest).exists():   # a mistyped level
        raise InputError(f"unknown gold level {tail!r} after '@' (expected {' or '.join(GOLD_LEVELS)})",
                         where=f"SPEC {spec!r}")
    if not path:
        raise InputError(f"missing path, expected {scheme}:PATH", where=f"SPEC {spec!r}")
    return load_longmemeval(path, gold_level=level)
