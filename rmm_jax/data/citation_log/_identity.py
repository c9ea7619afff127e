"""Which call a record is (:func:`call_key`), and what a policy store remembers of a call
once learned: its identity and content hashed, and its time (:mod:`rmm_jax.persist.learned_calls`)."""
from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np

from rmm_jax.data.citation_log._record import record_to_json
from rmm_jax.data.citation_log._schema import LogRecord
from rmm_jax.data.citation_log._time import timestamp_seconds
from rmm_jax.persist.learned_calls import Calls, hash64


def call_key(rec: LogRecord) -> str:
    """The identity of a call within its user's log (the package docstring, "Identity"):
    ``call:<call_id>``, else ``query:<query_id>``, else ``text:<query>``. ``rec`` may be
    anything with ``call_id``, ``query_id`` and ``query_text`` (a ``rerank`` request too).

    >>> from rmm_jax.data.citation_log import LogRecord, call_key
    >>> call_key(LogRecord("u1", "q7", ("m1",), ("m1",), ()))
    'query:q7'
    >>> call_key(LogRecord("u1", "q7", ("m1",), ("m1",), (), call_id="c9"))
    'call:c9'
    """
    if rec.call_id is not None:
        return f"call:{rec.call_id}"
    if rec.query_id is not None:
        return f"query:{rec.query_id}"
    return f"text:{rec.query_text}"


def _call_name(rec: LogRecord) -> tuple[str, str]:
    """``(key, what)`` naming a record's call in messages: the key that gives its identity."""
    if rec.call_id is not None:
        return "call_id", f"call_id {rec.call_id!r}"
    if rec.query_id is not None:
        return "query_id", f"(user_id, query_id) ({rec.user_id!r}, {rec.query_id!r})"
    return "query", f"query text of user {rec.user_id!r}"


CONTENT_LEFT_OUT = ("gold", "timestamp", "policy_version", "shared_version")


def learned_content(rec: LogRecord) -> str:
    """The canonical JSON of what learning from ``rec`` reads: the record as logged
    (:func:`record_to_json`, keys sorted, no spaces) without ``gold``, ``timestamp``,
    ``policy_version`` and ``shared_version``. Its hash is what a policy store remembers of
    a learned call (:mod:`rmm_jax.persist.learned_calls`): a record replayed with the same
    content was learned already, one with other content (another citation, another
    selection or propensity, another text) is a rewritten log. Gold only scores the call
    and the others say when and by whom it was served, so adding gold to an old log, or
    re-exporting its timestamps, is not a rewrite.

    >>> from rmm_jax.data.citation_log import LogRecord, learned_content
    >>> learned_content(LogRecord("u1", "q7", ("m1", "m2"), ("m1",), ("m1",), gold=("m1",)))
    '{"candidates":["m1","m2"],"cited":["m1"],"query_id":"q7","selected":["m1"],"user_id":"u1"}'
    """
    obj = {k: v for k, v in record_to_json(rec).items() if k not in CONTENT_LEFT_OUT}
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def call_hash(rec: LogRecord) -> tuple[np.uint64, np.uint64, float]:
    """What a policy store remembers of a call once learned (:mod:`rmm_jax.persist.learned_calls`):
    its identity (:func:`call_key`) and content (:func:`learned_content`) hashed, and its
    timestamp in seconds (:func:`timestamp_seconds`)."""
    return hash64(call_key(rec)), hash64(learned_content(rec)), timestamp_seconds(rec.timestamp)


def call_hashes(hashed: Iterable[tuple]) -> Calls:
    """:func:`call_hash` of calls (or the tuples it gave), in order, as :class:`Calls`."""
    rows = [h if isinstance(h, tuple) else call_hash(h) for h in hashed]
    return Calls(np.array([h[0] for h in rows], np.uint64), np.array([h[1] for h in rows], np.uint64),
                 np.array([h[2] for h in rows], np.float64))
