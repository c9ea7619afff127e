"""Logged citations: the JSONL schema for real generator calls.

A citation log is a UTF-8 JSONL file with one JSON object per generator call, in any
order. Blank lines are skipped; line numbers in error messages count every physical
line (``\\n``), blank ones included, starting at 1.

| key              | type                  | required | meaning / constraints                                         |
|------------------|-----------------------|----------|---------------------------------------------------------------|
| `user_id`        | string (non-empty)    | yes      | the user whose memory bank was searched                       |
| `call_id`        | string (non-empty)    | no       | the call's own id (what a serving system writes); names the call |
| `query_id`       | string (non-empty)    | one of these three | the query: a question of the store, or the application's id for it |
| `query`          | string                | (see "Identity") | the query text; embedded when the store lacks the query |
| `candidates`     | list of string        | yes      | the K memory ids the retriever returned, in retriever order; non-empty, unique |
| `selected`       | list of string        | yes      | the M memory ids shown to the generator, in display order (position 1 first); non-empty, unique, each in `candidates` |
| `cited`          | list of string        | yes      | memory ids the generator cited; may be empty; unique, each in `selected` |
| `log_prob`       | number or null        | no       | log-probability of `selected` under the policy that logged it; finite, `<= 0` (integers accepted) |
| `logits`         | list of number, null  | no       | the logging policy's Plackett–Luce logits s_i/τ, one per candidate, in `candidates` order; finite. With `log_prob` too, the two must agree (see below) |
| `timestamp`      | string, number, null  | no       | when the call happened (free form; numbers must be finite)    |
| `gold`           | list of string, null  | no       | memory ids relevant to the query (gold), for Recall@M; unique |
| `policy_version` | integer ≥ 1, null     | no       | the served user's policy version (``rmm-jax rerank``; null: none of its own) |
| `shared_version` | integer ≥ 1, null     | no       | the shared version it was served with (null: none)            |

**Identity of a call.** Within one user, a call is named by its ``call_id`` when it has
one, else by its ``query_id``, else by its ``query`` text (:func:`call_key`); a record
needs at least one of the three, and two records of a log may not name the same call
(the first one wins with ``skip_invalid``). So a production log that asks the same
question twice gives each call its own ``call_id``.

Each item of `candidates` is either a memory id (a string) or an object
``{"id": "m3", "text": "..."}`` carrying the memory's text; the two forms may be mixed.
A text, like a ``query``, may not be empty or only whitespace.
Texts, `query` and `gold` are what ``rmm-jax embed log:calls.jsonl --out STORE`` needs
to build an embedding store straight from a production log (:mod:`rmm_jax.data.jsonl`).
``replay`` and ``evaluate`` take a query or a memory from the store when the store holds
its id, and embed the record's text otherwise (:mod:`rmm_jax.data.log_vectors`); gold
comes from the store for a question it holds, from the record's ``gold`` otherwise.

A **served record** (what ``rmm-jax rerank --explore`` writes, :func:`validate_record`
with ``served=True``) is a record without ``cited``: the application adds the memories
the generator cited, and the line becomes a log record. Its ``timestamp`` is the
request's, or the time ``rerank`` served the call (:func:`utc_timestamp`).

Example lines::

    {"user_id": "u1", "query_id": "q7", "candidates": ["m3", "m1", "m9"],
     "selected": ["m1", "m3"], "cited": ["m1"], "log_prob": -1.2}
    {"user_id": "u1", "call_id": "c-0412", "query": "Where does my sister live now?",
     "candidates": [{"id": "m3", "text": "My sister moved to Lisbon."}, {"id": "m1", "text": "..."}],
     "selected": ["m3"], "cited": ["m3"], "logits": [4.1, 2.0], "log_prob": -0.115, "gold": ["m3"]}

Decisions:

* ``true``/``false`` are not numbers (``log_prob: true`` is a type error).
* ``null`` for an optional key means "absent"; :func:`write_log` and :class:`LogWriter`
  omit absent keys.
* Numeric ``timestamp`` values must be finite.
* Memory, user and query ids must be non-empty strings.
* `logits` and `log_prob` together must agree: the exact Plackett–Luce log-probability
  of `selected` under `logits`, Σ_j [z_{i_j} − logsumexp of the candidates not drawn
  yet], may differ from `log_prob` by at most :func:`pl_tolerance` (a float32 logger's
  rounding: max(1e-3, 1e-4·|log_prob|), or the float32 bound for large logits). Off-policy evaluation needs `logits` for the slate
  estimators (RIPS, IIPS); IPS and SNIPS need only `log_prob`.
* A memory's text may appear in several records of a user; it must be the same in all
  of them (the reader checks it). A record may carry the text of a memory the store
  holds, and it must be the store's text of that id (checked when ``known`` maps memory
  ids to texts, as :func:`rmm_jax.data.log_vectors.known_ids` does): the store's
  embedding is used, so another text under that id would be silently ignored.
* Unknown extra keys are **allowed and ignored** (forward compatibility: a logger may
  add e.g. ``"answer"``); they are not kept in :class:`LogRecord`. A key repeated
  inside any JSON object on a line is an error (JSON parsers silently keep the last).
* An unknown key that is probably a misspelt log key (``timestmap``, ``log_porb``,
  ``Cited``: :func:`misspelt_key`, a difflib ratio of at least 0.8 to a log key, in
  lower case) is still ignored, but the reader notes it (the report's ``notes``), once
  per key and log, naming the first line that has it:
  ``log.jsonl:3: key 'timestmap' is not a log key and was ignored (did you mean
  'timestamp'?)``; ``replay``, ``evaluate``, ``cite-rates`` and ``embed log:`` print
  each as a ``note:`` line on stderr. Keys of other names (``answer``, ``model``,
  ``latency_ms``, the ``scores`` and ``positions`` ``rerank`` writes) are not noted.
  A log key with ``_ids``, ``_id``, ``_texts`` or ``_text`` appended (``gold_ids``,
  ``cited_ids``, ``query_text``) is noted too, unless the record also has the log key.
  Only a key not seen on an earlier line is compared, so reading stays one subset test
  a record.

Every problem raises :class:`~rmm_jax.errors.InputError` with a one-line message that
starts ``path:line`` and names the key, e.g.
``logs.jsonl:12: key 'cited': id 'm4' is not in 'selected'``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import difflib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rmm_jax.data.json_fields import check_surrogates
from rmm_jax.errors import InputError, at
from rmm_jax.persist.atomic import atomic_file
from rmm_jax.persist.learned_calls import Calls, hash64

__all__ = [
    "LogRecord",
    "LogWriter",
    "iter_log",
    "iter_numbered",
    "json_lines",
    "pl_log_prob",
    "iter_user_chunks",
    "call_hash",
    "call_hashes",
    "call_key",
    "learned_content",
    "read_log",
    "record_to_json",
    "timestamp_seconds",
    "utc_timestamp",
    "validate_record",
    "write_log",
]

REQUIRED_KEYS = ("user_id", "candidates", "selected", "cited")
OPTIONAL_KEYS = ("call_id", "query_id", "log_prob", "timestamp", "query", "gold", "logits", "policy_version",
                 "shared_version")
LOG_KEYS = REQUIRED_KEYS + OPTIONAL_KEYS
MAX_FIRST_ERRORS = 5
#: An unknown key this close to a log key (difflib's ratio, lower case) is noted as a likely misspelling.
CLOSE_KEY = 0.8
#: A log key with one of these appended (``gold_ids``, ``query_text``) is noted as the log key.
KEY_SUFFIXES = ("_ids", "_id", "_texts", "_text")


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One generator call. Id lists are tuples; ``selected`` is in display order.
    ``query_id``, ``call_id`` and ``query_text`` may be None, not all three."""

    user_id: str
    query_id: str | None
    candidates: tuple[str, ...]
    selected: tuple[str, ...]
    cited: tuple[str, ...]
    log_prob: float | None = None
    timestamp: str | int | float | None = None
    query_text: str | None = None                           # key 'query'
    candidate_texts: tuple[str | None, ...] | None = None   # per candidate; None: ids only
    gold: tuple[str, ...] | None = None
    logits: tuple[float, ...] | None = None
    call_id: str | None = None
    policy_version: int | None = None
    shared_version: int | None = None


def call_key(rec: LogRecord) -> str:
    """The identity of a call within its user's log (module docstring, "Identity"):
    ``call:<call_id>``, else ``query:<query_id>``, else ``text:<query>``. ``rec`` may be
    anything with ``call_id``, ``query_id`` and ``query_text`` (a ``rerank`` request too).

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


# ---------------------------------------------------------------------------
# Validation of one record
# ---------------------------------------------------------------------------

def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _key_where(where: str, key: str) -> str:
    return f"{where}: key '{key}'"


def _id(value: Any, where: str, key: str, what: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{what} must be a string, got {_type_name(value)}",
                         where=_key_where(where, key))
    if not value:
        raise InputError(f"{what} must be a non-empty string", where=_key_where(where, key))
    return value


def _id_list(value: Any, where: str, key: str, *, allow_empty: bool) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise InputError(f"must be a list of strings, got {_type_name(value)}",
                         where=_key_where(where, key))
    if not value and not allow_empty:
        raise InputError("must be a non-empty list", where=_key_where(where, key))
    ids = tuple(_id(item, where, key, f"item {i}") for i, item in enumerate(value))
    seen: set[str] = set()
    for item in ids:
        if item in seen:
            raise InputError(f"duplicate id {item!r}", where=_key_where(where, key))
        seen.add(item)
    return ids


def _log_prob(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"must be a number, got {_type_name(value)}",
                         where=_key_where(where, "log_prob"))
    try:
        out = float(value)
    except OverflowError:
        out = math.inf if value > 0 else -math.inf
    if not math.isfinite(out):
        raise InputError(f"must be finite, got {value!r}", where=_key_where(where, "log_prob"))
    if out > 0.0:
        raise InputError(f"must be <= 0 (a log-probability), got {value!r}",
                         where=_key_where(where, "log_prob"))
    return out


def check_timestamp(value: Any, where: str) -> str | int | float | None:
    """A record's ``timestamp`` (``where``: its ``FILE:LINE``): None, a string, or a number
    that is finite as a float (:func:`timestamp_seconds` reads it as one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"must be a string or a number, got {_type_name(value)}",
                         where=_key_where(where, "timestamp"))
    try:
        finite = math.isfinite(float(value))
    except OverflowError:        # an int beyond float's range
        finite = False
    if not finite:
        shown = repr(value) if len(repr(value)) <= 24 else repr(value)[:20] + "…"
        raise InputError(f"must be finite (seconds), got {shown}", where=_key_where(where, "timestamp"))
    return value


def _candidates(value: Any, where: str) -> tuple[tuple[str, ...], tuple[str | None, ...] | None]:
    """``candidates``: ids, or objects ``{"id", "text"}`` (mixed allowed) -> (ids, texts or None)."""
    if not isinstance(value, (list, tuple)):
        raise InputError(f"must be a list of strings, got {_type_name(value)} (items may also be "
                         f"{{\"id\", \"text\"}} objects)", where=_key_where(where, "candidates"))
    if not value:
        raise InputError("must be a non-empty list", where=_key_where(where, "candidates"))
    ids, texts = [], []
    for i, item in enumerate(value):
        if isinstance(item, Mapping):
            if "id" not in item:
                raise InputError(f"item {i}: object without 'id'", where=_key_where(where, "candidates"))
            ids.append(_id(item["id"], where, "candidates", f"item {i} 'id'"))
            text = item.get("text")
            if not isinstance(text, str):
                raise InputError(f"item {i} 'text' must be a string, got {_type_name(text)}",
                                 where=_key_where(where, "candidates"))
            if not text.strip():    # embedded, it would be a memory with nothing to match
                raise InputError(f"item {i} 'text' is empty (or only whitespace)",
                                 where=_key_where(where, "candidates"))
            texts.append(text)
        else:
            ids.append(_id(item, where, "candidates", f"item {i}"))
            texts.append(None)
    seen: set[str] = set()
    for item in ids:
        if item in seen:
            raise InputError(f"duplicate id {item!r}", where=_key_where(where, "candidates"))
        seen.add(item)
    return tuple(ids), (tuple(texts) if any(t is not None for t in texts) else None)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _logits(value: Any, where: str, n: int) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise InputError(f"must be a list of numbers, got {_type_name(value)}", where=_key_where(where, "logits"))
    if len(value) != n:
        raise InputError(f"has {len(value)} numbers, 'candidates' has {n}: one logit per candidate",
                         where=_key_where(where, "logits"))
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(f"item {i} must be a number, got {_type_name(v)}", where=_key_where(where, "logits"))
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not abs(f) <= FLOAT32_MAX:          # read as float32 (log_vectors): beyond it, inf
            raise InputError(f"item {i} must be finite in float32 (|x| <= 3.4e38), got {str(v)[:24]}",
                             where=_key_where(where, "logits"))
        out.append(f)
    return tuple(out)


def pl_tolerance(logits, m: int, log_prob: float) -> float:
    """How far a producer's float32 Plackett–Luce log-probability of ``m`` draws may lie from
    :func:`pl_log_prob` of the same ``logits``. Each of the m terms z_i − logsumexp rounds
    the logits and the running maximum (|z| ≤ Z, error ≤ Z·2⁻²⁴ each) and sums at most K
    exponentials (≤ K·2⁻²⁴ in the log), so the sum errs by at most m·(2Z + K + 2)·2⁻²⁴; the
    bound takes 4 times that, for other orders of the same sums. Where that is small (the
    logits of a policy at τ ≳ 1e-3), the floor max(1e-3, 1e-4·|log P|) decides, as always.

    >>> pl_tolerance([0.5, -1.0, 2.0], 2, -1.2)
    0.001
    >>> round(pl_tolerance([1.4e5, 1.3e5, 0.0], 2, -3.0), 3)       # rerank --explore --tau 1e-5
    0.134
    """
    z = max((abs(float(x)) for x in logits), default=0.0)
    return max(1e-3, 1e-4 * abs(log_prob), 4 * m * (2 * z + len(logits) + 2) * 2.0**-24)


def pl_log_prob(logits, order) -> float:
    """Exact Plackett–Luce log-probability of drawing ``order`` (positions into
    ``logits``) in that order without replacement, in float64:

        log P = Σ_j [z_{i_j} − logsumexp_{k not drawn before j} z_k]

    (Plackett 1975; Luce 1959). The NumPy twin of
    :func:`rmm_jax.core.sampling.selection_log_prob` with τ = 1, for validating records
    without tracing a JAX function per record shape.

    >>> round(pl_log_prob([0.0, math.log(2.0), 0.0], [1, 0]), 6) == round(math.log(0.25), 6)
    True
    """
    z = [float(x) for x in logits]
    left = list(range(len(z)))
    total = 0.0
    for i in order:
        top = max(z[k] for k in left)
        total += z[i] - (top + math.log(sum(math.exp(z[k] - top) for k in left)))
        left.remove(i)
    return total


def _version(value: Any, where: str, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"must be an integer >= 1 or null, got {value!r}", where=_key_where(where, key))
    return value


def validate_record(obj: Any, where: str = "<record>", *, served: bool = False) -> LogRecord:
    """Check one decoded JSON value against the schema and return a :class:`LogRecord`.

    ``where`` locates the record in messages, usually ``at(path, line)``; errors read
    ``{where}: key 'k': ...``. Raises :class:`InputError` for: not an object, a missing
    required key, no identity (none of ``call_id``, ``query_id``, ``query``), a wrong
    type, an empty ``candidates``/``selected``, a ``query`` or candidate text that is
    empty or only whitespace (embedded, it would match nothing), duplicate ids, ``selected`` outside
    ``candidates``, ``cited`` outside ``selected``, and a non-finite or positive
    ``log_prob``. Unknown keys are ignored. ``served``: a served record, which has no
    ``cited`` yet (``cited`` is then ``()``).
    """
    if not isinstance(obj, Mapping):
        raise InputError(f"expected a JSON object, got {_type_name(obj)}", where=where)
    for key in REQUIRED_KEYS:
        if key not in obj and not (served and key == "cited"):
            near = [k for k in obj if isinstance(k, str) and k not in LOG_KEYS and misspelt_key(k) == key]
            raise InputError("missing required key" + (f" (the record has {near[0]!r})" if near else ""),
                             where=_key_where(where, key))
    user_id = _id(obj["user_id"], where, "user_id", "user_id")
    call_id = None if obj.get("call_id") is None else _id(obj["call_id"], where, "call_id", "call_id")
    query_id = None if obj.get("query_id") is None else _id(obj["query_id"], where, "query_id", "query_id")
    candidates, texts = _candidates(obj["candidates"], where)
    selected = _id_list(obj["selected"], where, "selected", allow_empty=False)
    cited = _id_list(obj.get("cited", []), where, "cited", allow_empty=True)
    log_prob = _log_prob(obj.get("log_prob"), where)
    timestamp = check_timestamp(obj.get("timestamp"), where)
    query = obj.get("query")
    if query is not None and not isinstance(query, str):
        raise InputError(f"must be a string, got {_type_name(query)}", where=_key_where(where, "query"))
    if query is not None and not query.strip():   # embedded for a question the store lacks: nothing to match
        raise InputError("empty query text (or only whitespace)", where=_key_where(where, "query"))
    if call_id is None and query_id is None and not (query or "").strip():
        raise InputError("missing: a record names its call by 'call_id', 'query_id' or the 'query' text",
                         where=_key_where(where, "query_id"))
    gold = obj.get("gold")
    gold = None if gold is None else _id_list(gold, where, "gold", allow_empty=True)
    logits = _logits(obj.get("logits"), where, len(candidates))
    versions = {k: _version(obj.get(k), where, k) for k in ("policy_version", "shared_version")}
    cand_set = set(candidates)
    for mid in selected:
        if mid not in cand_set:
            raise InputError(f"id {mid!r} is not in 'candidates'",
                             where=_key_where(where, "selected"))
    sel_set = set(selected)
    for mid in cited:
        if mid not in sel_set:
            raise InputError(f"id {mid!r} is not in 'selected'",
                             where=_key_where(where, "cited"))
    if logits is not None and log_prob is not None:
        pos = {c: p for p, c in enumerate(candidates)}
        implied = pl_log_prob(logits, [pos[x] for x in selected])
        if abs(implied - log_prob) > pl_tolerance(logits, len(selected), log_prob):
            raise InputError(f"{log_prob!r} is not the Plackett–Luce log-probability of 'selected' under "
                             f"'logits' ({implied:.6g})", where=_key_where(where, "log_prob"))
    return LogRecord(user_id=user_id, query_id=query_id, candidates=candidates,
                     selected=selected, cited=cited, log_prob=log_prob, timestamp=timestamp,
                     query_text=query, candidate_texts=texts, gold=gold, logits=logits, call_id=call_id,
                     **versions)


def record_to_json(rec: LogRecord, *, served: bool = False) -> dict:
    """The JSON object for ``rec`` (absent optional keys are omitted; ``served``: without
    ``cited``, and with ``policy_version``/``shared_version`` even when null)."""
    cands: list[Any] = list(rec.candidates)
    if rec.candidate_texts is not None:
        cands = [c if t is None else {"id": c, "text": t} for c, t in zip(rec.candidates, rec.candidate_texts)]
    out: dict[str, Any] = {"user_id": rec.user_id}
    for key, value in (("call_id", rec.call_id), ("query_id", rec.query_id), ("query", rec.query_text)):
        if value is not None:
            out[key] = value
    out.update(candidates=cands, selected=list(rec.selected))
    if not served:
        out["cited"] = list(rec.cited)
    optional = (("log_prob", rec.log_prob), ("logits", None if rec.logits is None else list(rec.logits)),
                ("timestamp", rec.timestamp), ("gold", None if rec.gold is None else list(rec.gold)))
    out.update({k: v for k, v in optional if v is not None})
    for key, value in (("policy_version", rec.policy_version), ("shared_version", rec.shared_version)):
        if value is not None or served:
            out[key] = value
    return out


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

    >>> learned_content(LogRecord("u1", "q7", ("m1", "m2"), ("m1",), ("m1",), gold=("m1",)))
    '{"candidates":["m1","m2"],"cited":["m1"],"query_id":"q7","selected":["m1"],"user_id":"u1"}'
    """
    obj = {k: v for k, v in record_to_json(rec).items() if k not in CONTENT_LEFT_OUT}
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def timestamp_seconds(value: str | int | float | None) -> float:
    """A record's ``timestamp`` as seconds that compare in time: a number as it is, an ISO
    8601 string (``2024-05-01``, ``2024-05-01T09:30:00+02:00``; without a zone, UTC) as
    seconds since the epoch; NaN when there is none or it is free text.

    >>> timestamp_seconds("1970-01-02"), timestamp_seconds(5), math.isnan(timestamp_seconds("last Tuesday"))
    (86400.0, 5.0, True)
    """
    if value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    try:
        t = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        return math.nan
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def utc_timestamp(microseconds: int) -> str:
    """A time in whole microseconds since the epoch as the ISO 8601 UTC string a log's
    ``timestamp`` holds (``rmm-jax rerank`` stamps a call that came without one with it).
    :func:`timestamp_seconds` reads it back to the microsecond, and two such strings of one
    length compare as their times do.

    >>> utc_timestamp(1_714_555_800_000_001)
    '2024-05-01T09:30:00.000001Z'
    >>> timestamp_seconds(utc_timestamp(86_400_000_000))
    86400.0
    """
    seconds, micro = divmod(int(microseconds), 1_000_000)
    t = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).replace(microsecond=micro)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---------------------------------------------------------------------------
# Known ids
# ---------------------------------------------------------------------------

Known = Any  # object with .users, a Mapping, or a callable; see _known_lookup


def _known_lookup(known: Known) -> Callable[[str], Any]:
    """Normalise ``known`` to ``user_id -> (query_ids, memory_ids) | None``.

    Accepted: an object with a ``users`` mapping ``user_id -> (query_ids, memory_ids)``,
    such a mapping itself, or a callable taking a user id and returning the pair or
    ``None`` for an unknown user (an embedding store has no ``users`` mapping: wrap it
    in a callable that reads one user's ids at a time). ``memory_ids`` may be a mapping
    ``id -> text``: a record's text for such a memory must then be that text.
    """
    users = getattr(known, "users", None)
    if isinstance(users, Mapping):
        return users.get
    if isinstance(known, Mapping):
        return known.get
    if callable(known):
        return known
    raise InputError("must be an object with a 'users' mapping, a mapping or a callable, "
                     f"got {type(known).__name__}", where="argument 'known'")


def _check_known(rec: LogRecord, lookup: Callable[[str], Any], where: str) -> None:
    """What the store lacks the record must carry as text: a query id the store does not
    hold needs the ``query`` text, a memory id it does not hold needs the candidate's
    text, and a user it does not hold needs both for everything. When the lookup's memory
    ids are a mapping ``id -> text`` (:func:`rmm_jax.data.log_vectors.known_ids`), a text
    the record carries for a memory the store holds must be the store's."""
    entry = lookup(rec.user_id)
    query_ids, memory_ids = entry if entry is not None else ((), ())
    texts = rec.candidate_texts or (None,) * len(rec.candidates)
    if entry is None and (rec.query_text is None or any(t is None for t in texts)):
        raise InputError(f"unknown user id {rec.user_id!r} (a user the store lacks needs the 'query' text and "
                         "every candidate's text)", where=_key_where(where, "user_id"))
    if rec.query_text is None and rec.query_id not in query_ids:
        what = f"unknown query id {rec.query_id!r}" if rec.query_id is not None else "no query id"
        raise InputError(f"{what} for user {rec.user_id!r} (give the call's text in 'query' to embed it)",
                         where=_key_where(where, "query_id" if rec.query_id is not None else "query"))
    for mid, text in zip(rec.candidates, texts):  # selected and cited are subsets of candidates
        if text is None and mid not in memory_ids:
            raise InputError(f"unknown memory id {mid!r} for user {rec.user_id!r} (give candidates the store "
                             'lacks as {"id", "text"} objects, or append them with `rmm-jax embed --into`)',
                             where=_key_where(where, "candidates"))
        if text is not None and isinstance(memory_ids, Mapping) and mid in memory_ids and memory_ids[mid] != text:
            raise InputError(f"memory {mid!r} of user {rec.user_id!r}: the record's text differs from the store's "
                             "memory of that id (give the store's text, or the id alone)",
                             where=_key_where(where, "candidates"))
    for mid in rec.gold or ():
        if mid not in memory_ids and mid not in rec.candidates:
            raise InputError(f"unknown memory id {mid!r} for user {rec.user_id!r} (neither in the store nor a "
                             "candidate of the record)", where=_key_where(where, "gold"))


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------

def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class NotGroupedError(InputError):
    """A streamed (grouped) log holds a user's records on non-consecutive lines."""


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _decode_line(raw: bytes, path: str | os.PathLike, lineno: int) -> Any:
    where = at(path, lineno)
    try:
        text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"invalid UTF-8 ({exc.reason} at byte {exc.start})", where=where) from None
    try:
        value = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateKey as exc:
        raise InputError("key repeated within one JSON object",
                         where=_key_where(where, exc.key)) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON ({exc.msg} at column {exc.colno})", where=where) from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer with too many digits
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"invalid JSON ({msg})", where=where) from None
    check_surrogates(text, value, where)
    return value


def _open_log(path: str | os.PathLike):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise InputError("file not found", where=str(path)) from None
    except IsADirectoryError:
        raise InputError("is a directory, expected a JSONL file", where=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot open ({exc.strerror})", where=str(path)) from None


def _new_report() -> dict:
    return {"records": 0, "skipped": 0, "first_errors": [], "notes": []}


def misspelt_key(key: str) -> str | None:
    """The log key an unknown ``key`` is likely a misspelling of, else None: the closest
    with a difflib ratio of at least :data:`CLOSE_KEY` to ``key`` in lower case (a key
    that differs by case, one swapped, missing or extra letter, or ``-`` for ``_``).

    A swap of two adjacent letters counts whatever the ratio, which is below the cutoff for
    a short key (``glod`` to ``gold``: 0.75). So does a log key, or a misspelling of one, with
    a suffix of :data:`KEY_SUFFIXES` appended (``gold_ids`` to ``gold``: 0.67).

    >>> misspelt_key("timestmap"), misspelt_key("log_porb"), misspelt_key("Cited"), misspelt_key("answer")
    ('timestamp', 'log_prob', 'cited', None)
    >>> misspelt_key("glod"), misspelt_key("Gold"), misspelt_key("lgoits")
    ('gold', 'gold', 'logits')
    >>> misspelt_key("gold_ids"), misspelt_key("query_text"), misspelt_key("candidate_ids"), misspelt_key("user")
    ('gold', 'query', 'candidates', None)
    """
    low = key.lower()
    return _close_key(low) or _suffixed_key(low)


def _close_key(low: str) -> str | None:
    """The log key within a difflib ratio of :data:`CLOSE_KEY`, or one swap, of ``low``."""
    near = difflib.get_close_matches(low, LOG_KEYS, n=1, cutoff=CLOSE_KEY)
    if near:
        return near[0]
    return next((k for k in LOG_KEYS if len(k) == len(low) and _one_swap(low, k)), None)


def _suffixed_key(low: str) -> str | None:
    """The log key ``low`` is (up to a misspelling) with a suffix of :data:`KEY_SUFFIXES` appended."""
    for suffix in KEY_SUFFIXES:
        stem = low.removesuffix(suffix)
        if stem != low and stem:
            return stem if stem in LOG_KEYS else _close_key(stem)
    return None


def _one_swap(a: str, b: str) -> bool:
    """``a`` is ``b`` with two adjacent characters swapped (equal lengths)."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]


def _note_keys(obj: Mapping, seen: set, path, lineno: int, notes: list) -> None:
    """Note each key of ``obj`` not seen before in this log that looks like a misspelt log
    key (:func:`misspelt_key`). ``seen`` starts as the log keys, so a record with only
    those, or with extra keys seen on earlier lines, costs one subset test."""
    if obj.keys() <= seen:
        return
    for key in obj:
        if key not in seen:
            seen.add(key)
            near = misspelt_key(key)
            if near is not None and not (near in obj and _suffixed_key(key.lower()) == near):  # gold_ids beside gold
                notes.append(f"{at(path, lineno, key)} is not a log key and was ignored (did you mean {near!r}?)")


def _iter_numbered(path: str | os.PathLike, known: Known, skip_invalid: bool,
                   report: dict, grouped: bool = False) -> Iterator[tuple[int, LogRecord]]:
    """The engine of :func:`iter_log`: yields ``(line number, record)``.

    ``grouped``: each user's records must be on consecutive lines (a user reappearing
    after another user's records is an error, even with ``skip_invalid``); repeated
    pairs are then tracked for the current user only, so memory does not grow with
    the number of records (only a set of finished user ids is kept). A memory whose
    text two records of a user give differently is an error (so is a call logged twice).
    """
    lookup = _known_lookup(known) if known is not None else None
    report.update(_new_report())
    keys_seen = set(LOG_KEYS)
    seen: dict[tuple[str, str], int] = {}
    texts: dict[tuple[str, str], tuple[str, int]] = {}     # (user, memory id) -> (text, first line)
    current: str | None = None
    finished: set[str] = set()
    for lineno, raw in _nonblank_lines(path):
        where = at(path, lineno)
        try:
            obj = _decode_line(raw, path, lineno)
            rec = validate_record(obj, where)
            if lookup is not None:
                _check_known(rec, lookup, where)
            pair = (rec.user_id, call_key(rec))
            if pair in seen:
                key, what = _call_name(rec)
                raise InputError(f"duplicate {what}, first logged at line {seen[pair]}",
                                 where=_key_where(where, key))
            carried = [((rec.user_id, mid), text) for mid, text in zip(rec.candidates, rec.candidate_texts or ())
                       if text is not None]
            for mem, text in carried:
                if mem in texts and texts[mem][0] != text:
                    raise InputError(f"memory {mem[1]!r} of user {rec.user_id!r} has a different text than at "
                                     f"{at(path, texts[mem][1])}", where=_key_where(where, "candidates"))
        except InputError as exc:
            if not skip_invalid:
                raise
            report["skipped"] += 1
            if len(report["first_errors"]) < MAX_FIRST_ERRORS:
                report["first_errors"].append(str(exc))
            continue
        if grouped and rec.user_id != current:
            if rec.user_id in finished:
                raise NotGroupedError(
                    f"records of user {rec.user_id!r} are not on consecutive lines "
                    "(sort the log by user_id to stream it by user)",
                    where=_key_where(where, "user_id"))
            if current is not None:
                finished.add(current)
            current = rec.user_id
            seen.clear()
            texts.clear()
        seen[pair] = lineno
        for mem, text in carried:
            texts.setdefault(mem, (text, lineno))
        _note_keys(obj, keys_seen, path, lineno, report["notes"])
        report["records"] += 1
        yield lineno, rec
    if report["records"] == 0:
        raise InputError(f"no records ({report['skipped']} invalid lines skipped; first: "
                         f"{report['first_errors'][0]})", where=str(path))


def iter_numbered(path: str | os.PathLike, *, known: Known = None, skip_invalid: bool = False,
                  report: dict | None = None, grouped: bool = False) -> Iterator[tuple[int, LogRecord]]:
    """:func:`iter_log` with each record's line number: yields ``(line, record)``, so a
    later check (e.g. of a key this module does not interpret) can name ``path:line``.
    ``grouped``: a user's records must be on consecutive lines (:class:`NotGroupedError`
    otherwise), and memory does not grow with the log."""
    yield from _iter_numbered(path, known, skip_invalid, report if report is not None else {}, grouped)


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


STDIN = "-"
"""The path :func:`json_lines` reads as standard input (shown as ``<stdin>``)."""


def source_name(path: str | os.PathLike) -> str:
    """How errors name ``path``: ``<stdin>`` for :data:`STDIN`, else the path as given."""
    return "<stdin>" if str(path) == STDIN else str(path)


def json_lines(path: str | os.PathLike, *, stdin: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line number, decoded JSON value)`` for every non-blank line of a JSONL file; with
    ``stdin``, of standard input when ``path`` is ``"-"`` (:data:`STDIN`: it can be read
    only once, so only a reader that goes through its input once takes it, as
    :func:`rmm_jax.data.calls.read_calls` does).

    The same decoding as the log reader: UTF-8 (a BOM on line 1 is allowed), a key
    repeated within an object is an error, and every problem raises
    :class:`InputError` naming ``path:line`` (``<stdin>:line``). An empty file raises "no records".
    """
    name = source_name(path) if stdin else str(path)
    for lineno, raw in _nonblank_lines(path, stdin=stdin and str(path) == STDIN):
        yield lineno, _decode_line(raw, name, lineno)


def _nonblank_lines(path: str | os.PathLike, *, stdin: bool = False) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of every non-blank line (of standard input if ``stdin``);
    an empty file is an error."""
    nonblank = 0
    with contextlib.nullcontext(sys.stdin.buffer) if stdin else _open_log(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                nonblank += 1
                yield lineno, raw
    if nonblank == 0:
        raise InputError("no records (the file is empty)", where=source_name(path) if stdin else str(path))


def iter_log(path: str | os.PathLike, *, known: Known = None, skip_invalid: bool = False,
             report: dict | None = None) -> Iterator[LogRecord]:
    """Stream the valid records of a citation log, one line at a time.

    Each line is decoded, validated (:func:`validate_record`), checked against
    ``known`` when given, and checked for a call logged twice (the same
    :func:`call_key` of the same user; the first occurrence wins). Without ``skip_invalid`` the first problem raises
    :class:`InputError` naming ``path:line``; with it, bad lines (invalid JSON or
    UTF-8 included) are counted and skipped. Blank lines are not records.

    ``known`` (optional) is an object with a ``users`` mapping
    ``user_id -> (query_ids, memory_ids)``, such a mapping itself, or a callable
    ``user_id -> (query_ids, memory_ids) | None`` (e.g. one that reads a user's ids
    from an embedding store); an unknown user, query or memory id is an error naming
    the line, the key and the id, unless the record carries its text (see
    :func:`_check_known`).

    ``report``, when given, is reset and updated in place with ``records`` (yielded so
    far), ``skipped``, ``first_errors`` (up to 5 messages) and ``notes``: one line per
    unknown key of the valid records that looks like a misspelt log key (module
    docstring, "Decisions"), naming the first line that has it. A file without a
    non-blank line, or whose lines were all skipped, raises ``InputError`` "no records"
    when the stream ends. Memory use: one line plus the seen calls.
    """
    for _, rec in _iter_numbered(path, known, skip_invalid,
                                 report if report is not None else {}):
        yield rec


def read_log(path: str | os.PathLike, *, known: Known = None,
             skip_invalid: bool = False) -> tuple[list[LogRecord], dict]:
    """Read a whole citation log: ``(records, report)``.

    ``report`` is ``{"records": n, "skipped": n, "first_errors": [<= 5 messages], "notes": [...]}``.
    See :func:`iter_log` for the checks and ``known``. A log with no valid record
    raises ``InputError`` "no records" even with ``skip_invalid``.
    """
    report = _new_report()
    records = list(iter_log(path, known=known, skip_invalid=skip_invalid, report=report))
    return records, report


def iter_user_chunks(path: str | os.PathLike, users_per_chunk: int, *, known: Known = None,
                     skip_invalid: bool = False,
                     report: dict | None = None) -> Iterator[list[LogRecord]]:
    """Stream a log as lists of records covering up to ``users_per_chunk`` users each.

    The log must hold each user's records on consecutive lines (sort it by
    ``user_id`` first otherwise); a user reappearing after another user's records
    raises :class:`InputError` naming the line. Records keep file order.
    """
    if isinstance(users_per_chunk, bool) or not isinstance(users_per_chunk, int) \
            or users_per_chunk < 1:
        raise InputError(f"must be a positive int, got {users_per_chunk!r}",
                         where="argument 'users_per_chunk'")
    chunk: list[LogRecord] = []
    users_in_chunk = 0
    current: str | None = None
    finished: set[str] = set()
    for lineno, rec in _iter_numbered(path, known, skip_invalid,
                                      report if report is not None else {}, grouped=True):
        if rec.user_id != current:
            if rec.user_id in finished:
                raise InputError(
                    f"records of user {rec.user_id!r} are not on consecutive lines "
                    "(sort the log by user_id to stream it by user)",
                    where=_key_where(at(path, lineno), "user_id"))
            if current is not None:
                finished.add(current)
            if users_in_chunk == users_per_chunk:
                yield chunk
                chunk, users_in_chunk = [], 0
            current = rec.user_id
            users_in_chunk += 1
        chunk.append(rec)
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------

def _json_line(rec: LogRecord | Mapping, where: str) -> tuple[LogRecord, str]:
    """Validate one record to write (a :class:`LogRecord` or its JSON object) and
    return it with its JSONL line."""
    if isinstance(rec, LogRecord):
        obj = record_to_json(rec)
    elif isinstance(rec, Mapping):
        obj = rec
    else:
        raise InputError(f"expected a LogRecord, got {type(rec).__name__}", where=where)
    rec = validate_record(obj, where)
    return rec, json.dumps(record_to_json(rec), allow_nan=False) + "\n"


def write_log(path: str | os.PathLike, records: Iterable[LogRecord]) -> int:
    """Atomically write ``records`` as JSONL; return the number written.

    Every record is re-validated first (``InputError`` naming ``record i`` - 0-based -
    and the key), including calls logged twice, so a written log
    always reads back. Nothing is written when a record is invalid.
    """
    lines: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, rec in enumerate(records):
        where = f"record {i}"
        rec, line = _json_line(rec, where)
        pair = (rec.user_id, call_key(rec))
        if pair in seen:
            key, what = _call_name(rec)
            raise InputError(f"duplicate {what}", where=_key_where(where, key))
        seen.add(pair)
        lines.append(line)
    with atomic_file(Path(path)) as f:
        f.writelines(lines)
    return len(lines)


class LogWriter:
    """Write a citation log chunk by chunk, atomically.

    Inside the ``with`` block, :meth:`write` validates each record (a :class:`LogRecord`
    or its JSON object, checked by :func:`validate_record`; an error names
    ``generated record i``, 0-based over the whole log) and appends its line to a
    temporary file next to ``path``. When the block ends without an exception the
    temporary file replaces ``path`` atomically; on an exception it is removed and
    ``path`` is untouched. ``count`` is the number of records written so far.

    Unlike :func:`write_log`, calls logged twice are not checked (that would keep every
    call's identity in memory); the caller writes each call once.

    Example::

        >>> with LogWriter("log.jsonl") as log:          # doctest: +SKIP
        ...     for chunk in chunks:
        ...         log.write(chunk)
    """

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.count = 0
        self._cm = None
        self._f = None

    def __enter__(self) -> "LogWriter":
        self._cm = atomic_file(Path(self.path))
        self._f = self._cm.__enter__()
        return self

    def write(self, records: Iterable[LogRecord | Mapping]) -> None:
        """Validate and append ``records`` (in order)."""
        if self._f is None:
            raise RuntimeError("LogWriter.write called outside its with-block")
        for r in records:
            _, line = _json_line(r, f"generated record {self.count}")
            self._f.write(line)
            self.count += 1

    __call__ = write

    def __exit__(self, *exc) -> bool | None:
        cm, self._cm, self._f = self._cm, None, None
        return cm.__exit__(*exc)
