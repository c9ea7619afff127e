"""Logged citations: the JSONL schema for real generator calls.

A citation log is a UTF-8 JSONL file with one JSON object per generator call, in any
order. Blank lines are skipped; line numbers in error messages count every physical
line (``\\n``), blank ones included, starting at 1.

| key          | type                  | required | meaning / constraints                                         |
|--------------|-----------------------|----------|---------------------------------------------------------------|
| `user_id`    | string (non-empty)    | yes      | the user whose memory bank was searched                       |
| `query_id`   | string (non-empty)    | yes      | the query; each (`user_id`, `query_id`) pair is logged once    |
| `candidates` | list of string        | yes      | the K memory ids the retriever returned, in retriever order; non-empty, unique |
| `selected`   | list of string        | yes      | the M memory ids shown to the generator, in display order (position 1 first); non-empty, unique, each in `candidates` |
| `cited`      | list of string        | yes      | memory ids the generator cited; may be empty; unique, each in `selected` |
| `log_prob`   | number or null        | no       | log-probability of `selected` under the policy that logged it; finite, `<= 0` (integers accepted) |
| `timestamp`  | string, number, null  | no       | when the call happened (free form; numbers must be finite)    |

Example line::

    {"user_id": "u1", "query_id": "q7", "candidates": ["m3", "m1", "m9"],
     "selected": ["m1", "m3"], "cited": ["m1"], "log_prob": -1.2}

Decisions:

* ``true``/``false`` are not numbers (``log_prob: true`` is a type error).
* ``null`` for an optional key means "absent"; :func:`write_log` and :class:`LogWriter`
  omit absent keys.
* Numeric ``timestamp`` values must be finite.
* Memory, user and query ids must be non-empty strings.
* Unknown extra keys are **allowed and ignored** (forward compatibility: a logger may
  add e.g. ``"answer"``); they are not kept in :class:`LogRecord`. A key repeated
  inside any JSON object on a line is an error (JSON parsers silently keep the last).

Every problem raises :class:`~rmm_jax.errors.InputError` with a one-line message that
starts ``path:line`` and names the key, e.g.
``logs.jsonl:12: key 'cited': id 'm4' is not in 'selected'``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rmm_jax.errors import InputError, at
from rmm_jax.persist.atomic import atomic_file

__all__ = [
    "LogRecord",
    "LogWriter",
    "iter_log",
    "iter_user_chunks",
    "read_log",
    "record_to_json",
    "validate_record",
    "write_log",
]

REQUIRED_KEYS = ("user_id", "query_id", "candidates", "selected", "cited")
OPTIONAL_KEYS = ("log_prob", "timestamp")
MAX_FIRST_ERRORS = 5


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One generator call. Id lists are tuples; ``selected`` is in display order."""

    user_id: str
    query_id: str
    candidates: tuple[str, ...]
    selected: tuple[str, ...]
    cited: tuple[str, ...]
    log_prob: float | None = None
    timestamp: str | int | float | None = None


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


def _timestamp(value: Any, where: str) -> str | int | float | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"must be a string or a number, got {_type_name(value)}",
                         where=_key_where(where, "timestamp"))
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"must be finite, got {value!r}", where=_key_where(where, "timestamp"))
    return value


def validate_record(obj: Any, where: str = "<record>") -> LogRecord:
    """Check one decoded JSON value against the schema and return a :class:`LogRecord`.

    ``where`` locates the record in messages, usually ``at(path, line)``; errors read
    ``{where}: key 'k': ...``. Raises :class:`InputError` for: not an object, a missing
    required key, a wrong type, an empty ``candidates``/``selected``, duplicate ids,
    ``selected`` outside ``candidates``, ``cited`` outside ``selected``, and a
    non-finite or positive ``log_prob``. Unknown keys are ignored.
    """
    if not isinstance(obj, Mapping):
        raise InputError(f"expected a JSON object, got {_type_name(obj)}", where=where)
    for key in REQUIRED_KEYS:
        if key not in obj:
            raise InputError("missing required key", where=_key_where(where, key))
    user_id = _id(obj["user_id"], where, "user_id", "user_id")
    query_id = _id(obj["query_id"], where, "query_id", "query_id")
    candidates = _id_list(obj["candidates"], where, "candidates", allow_empty=False)
    selected = _id_list(obj["selected"], where, "selected", allow_empty=False)
    cited = _id_list(obj["cited"], where, "cited", allow_empty=True)
    log_prob = _log_prob(obj.get("log_prob"), where)
    timestamp = _timestamp(obj.get("timestamp"), where)
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
    return LogRecord(user_id=user_id, query_id=query_id, candidates=candidates,
                     selected=selected, cited=cited, log_prob=log_prob, timestamp=timestamp)


def record_to_json(rec: LogRecord) -> dict:
    """The JSON object for ``rec`` (absent optional keys are omitted)."""
    out: dict[str, Any] = {
        "user_id": rec.user_id,
        "query_id": rec.query_id,
        "candidates": list(rec.candidates),
        "selected": list(rec.selected),
        "cited": list(rec.cited),
    }
    if rec.log_prob is not None:
        out["log_prob"] = rec.log_prob
    if rec.timestamp is not None:
        out["timestamp"] = rec.timestamp
    return out


# ---------------------------------------------------------------------------
# Known ids
# ---------------------------------------------------------------------------

Known = Any  # object with .users, a Mapping, or a callable; see _known_lookup


def _known_lookup(known: Known) -> Callable[[str], Any]:
    """Normalise ``known`` to ``user_id -> (query_ids, memory_ids) | None``.

    Accepted: an object with a ``users`` mapping ``user_id -> (query_ids, memory_ids)``,
    such a mapping itself, or a callable taking a user id and returning the pair or
    ``None`` for an unknown user (an embedding store has no ``users`` mapping: wrap it
    in a callable that reads one user's ids at a time).
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
    entry = lookup(rec.user_id)
    if entry is None:
        raise InputError(f"unknown user id {rec.user_id!r}", where=_key_where(where, "user_id"))
    query_ids, memory_ids = entry
    if rec.query_id not in query_ids:
        raise InputError(f"unknown query id {rec.query_id!r} for user {rec.user_id!r}",
                         where=_key_where(where, "query_id"))
    for mid in rec.candidates:  # selected and cited are subsets of candidates
        if mid not in memory_ids:
            raise InputError(f"unknown memory id {mid!r} for user {rec.user_id!r}",
                             where=_key_where(where, "candidates"))


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
        return json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateKey as exc:
        raise InputError("key repeated within one JSON object",
                         where=_key_where(where, exc.key)) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON ({exc.msg} at column {exc.colno})", where=where) from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer with too many digits
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"invalid JSON ({msg})", where=where) from None


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
    return {"records": 0, "skipped": 0, "first_errors": []}


def _iter_numbered(path: str | os.PathLike, known: Known, skip_invalid: bool,
                   report: dict, grouped: bool = False) -> Iterator[tuple[int, LogRecord]]:
    """The engine of :func:`iter_log`: yields ``(line number, record)``.

    ``grouped``: each user's records must be on consecutive lines (a user reappearing
    after another user's records is an error, even with ``skip_invalid``); repeated
    pairs are then tracked for the current user only, so memory does not grow with
    the number of records (only a set of finished user ids is kept).
    """
    lookup = _known_lookup(known) if known is not None else None
    report.update(_new_report())
    seen: dict[tuple[str, str], int] = {}
    current: str | None = None
    finished: set[str] = set()
    nonblank = 0
    with _open_log(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            nonblank += 1
            where = at(path, lineno)
            try:
                rec = validate_record(_decode_line(raw, path, lineno), where)
                if lookup is not None:
                    _check_known(rec, lookup, where)
                pair = (rec.user_id, rec.query_id)
                if pair in seen:
                    raise InputError(
                        f"duplicate (user_id, query_id) ({rec.user_id!r}, {rec.query_id!r}), "
                        f"first logged at line {seen[pair]}", where=_key_where(where, "query_id"))
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
            seen[pair] = lineno
            report["records"] += 1
            yield lineno, rec
    if nonblank == 0:
        raise InputError("no records (the file is empty)", where=str(path))
    if report["records"] == 0:
        raise InputError(f"no records ({report['skipped']} invalid lines skipped; first: "
                         f"{report['first_errors'][0]})", where=str(path))


def iter_log(path: str | os.PathLike, *, known: Known = None, skip_invalid: bool = False,
             report: dict | None = None) -> Iterator[LogRecord]:
    """Stream the valid records of a citation log, one line at a time.

    Each line is decoded, validated (:func:`validate_record`), checked against
    ``known`` when given, and checked for a repeated ``(user_id, query_id)`` pair
    (the first occurrence wins). Without ``skip_invalid`` the first problem raises
    :class:`InputError` naming ``path:line``; with it, bad lines (invalid JSON or
    UTF-8 included) are counted and skipped. Blank lines are not records.

    ``known`` (optional) is an object with a ``users`` mapping
    ``user_id -> (query_ids, memory_ids)``, such a mapping itself, or a callable
    ``user_id -> (query_ids, memory_ids) | None`` (e.g. one that reads a user's ids
    from an embedding store); an unknown user, query or memory id is an error naming
    the line, the key and the id.

    ``report``, when given, is reset and updated in place with ``records`` (yielded so
    far), ``skipped`` and ``first_errors`` (up to 5 messages). A file without a
    non-blank line, or whose lines were all skipped, raises ``InputError`` "no records"
    when the stream ends. Memory use: one line plus the seen (user_id, query_id) pairs.
    """
    for _, rec in _iter_numbered(path, known, skip_invalid,
                                 report if report is not None else {}):
        yield rec


def read_log(path: str | os.PathLike, *, known: Known = None,
             skip_invalid: bool = False) -> tuple[list[LogRecord], dict]:
    """Read a whole citation log: ``(records, report)``.

    ``report`` is ``{"records": n, "skipped": n, "first_errors": [<= 5 messages]}``.
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
    and the key), including repeated ``(user_id, query_id)`` pairs, so a written log
    always reads back. Nothing is written when a record is invalid.
    """
    lines: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, rec in enumerate(records):
        where = f"record {i}"
        rec, line = _json_line(rec, where)
        pair = (rec.user_id, rec.query_id)
        if pair in seen:
            raise InputError(f"duplicate (user_id, query_id) ({rec.user_id!r}, {rec.query_id!r})",
                             where=_key_where(where, "query_id"))
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

    Unlike :func:`write_log`, repeated ``(user_id, query_id)`` pairs are not checked
    (that would keep every pair in memory); the caller writes each query once.

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
