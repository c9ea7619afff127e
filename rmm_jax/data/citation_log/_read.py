"""Reading a citation log: streamed record by record, whole, or by users; each record
validated, checked against the store's ids, and checked for a call logged twice."""
from __future__ import annotations

import os
from collections.abc import Iterator

from rmm_jax.data.citation_log._identity import _call_name, call_key
from rmm_jax.data.citation_log._keys import note_misspelt_keys
from rmm_jax.data.citation_log._known import Known, _check_known, _known_lookup
from rmm_jax.data.citation_log._record import validate_record
from rmm_jax.data.citation_log._schema import LOG_KEYS, LogRecord, _key_where
from rmm_jax.data.json_lines import MAX_FIRST_ERRORS, decode_line, nonblank_lines
from rmm_jax.errors import InputError, at


class NotGroupedError(InputError):
    """A streamed (grouped) log holds a user's records on non-consecutive lines."""


def _new_report() -> dict:
    return {"records": 0, "skipped": 0, "first_errors": [], "notes": []}


def _iter_numbered(path: str | os.PathLike, known: Known, skip_invalid: bool,
                   report: dict, grouped: bool = False) -> Iterator[tuple[int, LogRecord]]:
    """The engine of :func:`iter_log`: yields ``(line number, record)``.

    ``grouped``: each user's records must be on consecutive lines (a user reappearing
    after another user's records is an error, even with ``skip_invalid``); repeated
    pairs are then tracked for the current user only, so memory does not grow with
    the number of records (only a set of finished user ids is kept). A memory whose
    text two records of a user give differently is an error (so is a call logged twice).
    """
    if not isinstance(path, (str, bytes, os.PathLike)):   # None was a TypeError from open(), an int read as an fd
        raise InputError(f"expected the log's path (a str or os.PathLike), got {type(path).__name__} {path!r}"[:160],
                         arg="path")
    lookup = _known_lookup(known) if known is not None else None
    report.update(_new_report())
    keys_seen = set(LOG_KEYS)
    seen: dict[tuple[str, str], int] = {}
    texts: dict[tuple[str, str], tuple[str, int]] = {}     # (user, memory id) -> (text, first line)
    current: str | None = None
    finished: set[str] = set()
    for lineno, raw in nonblank_lines(path):
        where = at(path, lineno)
        try:
            obj = decode_line(raw, path, lineno)
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
        note_misspelt_keys(obj, keys_seen, path, lineno, report["notes"])
        report["records"] += 1
        yield lineno, rec
    if report["records"] == 0:
        raise InputError(f"no records ({report['skipped']} invalid lines skipped; first: "
                         f"{report['first_errors'][0]})", where=str(path))


def iter_numbered(path: str | os.PathLike, *, known: Known = None, skip_invalid: bool = False,
                  report: dict | None = None, grouped: bool = False) -> Iterator[tuple[int, LogRecord]]:
    """:func:`iter_log` with each record's line number: yields ``(line, record)``, so a
    later check (e.g. of a key this package does not interpret) can name ``path:line``.
    ``grouped``: a user's records must be on consecutive lines (:class:`NotGroupedError`
    otherwise), and memory does not grow with the log."""
    yield from _iter_numbered(path, known, skip_invalid, report if report is not None else {}, grouped)


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
    unknown key of the valid records that looks like a misspelt log key (package
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
    raises ``InputError`` "no records" even with ``skip_invalid``; a ``path`` that is not a
    str or ``os.PathLike`` (None) raises one naming ``path``.
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
