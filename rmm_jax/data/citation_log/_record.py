"""One record: a decoded JSON value checked against the schema into a :class:`LogRecord`
(:func:`validate_record`), a :class:`LogRecord` back to its JSON object (:func:`record_to_json`), and
the one builder of the records a run or a server writes (:func:`call_record`)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rmm_jax.data.citation_log._keys import misspelt_key
from rmm_jax.data.citation_log._plackett_luce import pl_log_prob, pl_tolerance
from rmm_jax.data.citation_log._schema import LOG_KEYS, REQUIRED_KEYS, LogRecord, _key_where, _type_name
from rmm_jax.data.citation_log._time import check_timestamp
from rmm_jax.errors import InputError


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


def _version(value: Any, where: str, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"must be an integer >= 1 or null, got {value!r}", where=_key_where(where, key))
    return value


def validate_record(obj: Any, where: str = "<record>", *, served: bool = False,
                    now: float | None = None) -> LogRecord:
    """Check one decoded JSON value against the schema and return a :class:`LogRecord`.

    ``where`` locates the record in messages, usually ``at(path, line)``; errors read
    ``{where}: key 'k': ...``. Raises :class:`InputError` for: not an object, a missing
    required key, no identity (none of ``call_id``, ``query_id``, ``query``), a wrong
    type, an empty ``candidates``/``selected``, a ``query`` or candidate text that is
    empty or only whitespace (embedded, it would match nothing), duplicate ids, ``selected`` outside
    ``candidates``, ``cited`` outside ``selected``, and a non-finite or positive
    ``log_prob``. Unknown keys are ignored. ``served``: a served record, which has no
    ``cited`` yet (``cited`` is then ``()``). ``now``: the time a ``timestamp`` may not lie
    more than a day after (:func:`check_timestamp`; None: the clock's, read for this record;
    a reader of many records reads the clock once and passes it).
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
    timestamp = check_timestamp(obj.get("timestamp"), where, now)
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
                     versions_logged=all(k in obj for k in versions), **versions)


def call_record(user_id: str, candidates: Sequence[str], selected: Sequence[str], *, cited: Sequence[str] = (),
                query_id: str | None = None, call_id: str | None = None, query_text: str | None = None,
                candidate_texts: Sequence[str | None] | None = None, log_prob=None, logits=None,
                timestamp: str | int | float | None = None, policy_version: int | None = None,
                shared_version: int | None = None) -> LogRecord:
    """The :class:`LogRecord` of one generator call as a run or a server chose it: what
    ``simulate --log-out`` (:func:`rmm_jax.online.streams.log_records`) and ``rerank``
    (:func:`rmm_jax.online.serve.serve_calls`) write, built one way. Id lists become tuples,
    ``log_prob`` a float and ``logits`` floats rounded to 6 decimals (None: absent). Only
    its shape is checked here (an ``InputError`` names ``candidates``, ``selected`` or
    ``cited`` given as one str, and ``candidate_texts`` of another length than
    ``candidates``, which :func:`record_to_json` would cut short); the rest is
    :func:`validate_record`'s, of its :func:`record_to_json`.

    >>> from rmm_jax.data.citation_log import call_record, record_to_json
    >>> rec = call_record("u1", ["m3", "m1", "m9"], ["m1", "m3"], cited=["m1"], query_id="q7", log_prob=-1.2)
    >>> list(record_to_json(rec))
    ['user_id', 'query_id', 'candidates', 'selected', 'cited', 'log_prob']
    >>> rec.selected, rec.log_prob
    (('m1', 'm3'), -1.2)
    """
    for name, ids in (("candidates", candidates), ("selected", selected), ("cited", cited),
                      ("candidate_texts", candidate_texts)):
        if isinstance(ids, (str, bytes)):
            raise InputError(f"must be a list of ids (or texts), not one str, got {ids!r:.60}", arg=name)
    candidates = tuple(candidates)
    if candidate_texts is not None and len(candidate_texts) != len(candidates):
        raise InputError(f"has {len(candidate_texts)} texts for {len(candidates)} candidates: one per candidate "
                         "(None for one without a text)", arg="candidate_texts")
    return LogRecord(user_id=user_id, query_id=query_id, call_id=call_id, query_text=query_text,
                     candidates=candidates, selected=tuple(selected), cited=tuple(cited),
                     candidate_texts=None if candidate_texts is None else tuple(candidate_texts),
                     log_prob=None if log_prob is None else float(log_prob),
                     logits=None if logits is None else tuple(round(float(x), 6) for x in logits),
                     timestamp=timestamp, policy_version=policy_version, shared_version=shared_version)


def record_to_json(rec: LogRecord, *, served: bool = False) -> dict:
    """The JSON object for ``rec`` (absent optional keys are omitted; ``served``: without
    ``cited``, and with ``policy_version``/``shared_version`` even when null, as they are
    when the record carried them)."""
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
        if value is not None or served or rec.versions_logged:
            out[key] = value
    return out
