"""Reading a citation log: streamed record by record, whole, or by users; each record
validated, checked against the store's ids, and checked for a call logged twice."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from typing import NamedTuple

from rmm_jax.data.citation_log._identity import _call_name, call_key
from rmm_jax.data.citation_log._keys import note_misspelt_keys
from rmm_jax.data.citation_log._known import Known, _check_known, _known_lookup
from rmm_jax.data.citation_log._record import validate_record
from rmm_jax.data.citation_log._schema import LOG_KEYS, LogRecord, _key_where
from rmm_jax.data.json_lines import MAX_FIRST_ERRORS, decode_line, nonblank_lines
from rmm_jax.data.words import count
from rmm_jax.deprecated import parameter as deprecated_parameter
from rmm_jax.errors import InputError, at


class NotGroupedError(InputError):
    """A streamed (grouped) log holds a user's records on non-consecutive lines."""


class ReadReport(NamedTuple):
    """What reading a log found: ``records`` (valid records read), ``skipped`` (invalid
    lines skipped with ``skip_invalid``), ``first_errors`` (the messages of the first
    :data:`~rmm_jax.data.json_lines.MAX_FIRST_ERRORS` skipped lines) and ``notes`` (one line
    per unknown key that looks like a misspelt log key). ``_asdict()`` is the dict that
    ``--json`` outputs write.

    >>> from rmm_jax.data.citation_log import ReadReport
    >>> ReadReport(3, 1, ["log.jsonl:2: invalid JSON"], []).skipped_line()
    'skipped 1 invalid records of 4; first: log.jsonl:2: invalid JSON'
    >>> ReadReport(3, 0, [], []).skipped_line() is None
    True
    """
    records: int
    skipped: int
    first_errors: list[str]
    notes: list[str]
    repeated: int = 0       # lines that repeat an earlier record exactly (a log delivered at least once): read once

    def skipped_line(self) -> str | None:
        """The line ``replay``, ``evaluate`` and ``cite-rates`` print when invalid records
        were skipped (None when none was)."""
        if not self.skipped:
            return None
        return (f"skipped {self.skipped} invalid records of {self.records + self.skipped}; "
                f"first: {self.first_errors[0]}")

    def __getitem__(self, key):
        if isinstance(key, str):            # the report was a dict: report["skipped"]
            warnings.warn(f"report[{key!r}] is deprecated: a log's read report is a ReadReport, use "
                          f"report.{key} (the old way goes in a later release)", DeprecationWarning, stacklevel=2)
            return getattr(self, key)
        return tuple.__getitem__(self, key)

    def __contains__(self, key) -> bool:
        if isinstance(key, str) and key in self._fields:   # `"skipped" in report` of the dict: False, silently
            warnings.warn(f"{key!r} in report is deprecated: a log's read report is a ReadReport, whose fields "
                          f"are always there (report.{key})", DeprecationWarning, stacklevel=2)
            return True
        return tuple.__contains__(self, key)


def _new_report() -> dict:
    return {"records": 0, "skipped": 0, "first_errors": [], "notes": [], "repeated": 0}


class LogReading(Iterator):
    """An iterator over a log's records (what :func:`iter_log`, :func:`iter_numbered` and
    :func:`iter_user_chunks` return) whose :attr:`report` is the :class:`ReadReport` of the
    lines read so far: complete once the iterator is exhausted."""

    def __init__(self, items: Iterator, counts: dict):
        self._items, self._counts = items, counts

    def __iter__(self) -> LogReading:
        return self

    def __next__(self):
        return next(self._items)

    @property
    def report(self) -> ReadReport:
        c = {**_new_report(), **self._counts}
        return ReadReport(c["records"], c["skipped"], list(c["first_errors"]), list(c["notes"]), c["repeated"])


def _counts(report: dict | None, name: str) -> dict:
    """The dict a reading counts in: a new one, or the caller's ``report`` (deprecated: the
    report was an out-parameter, filled in place; it still is, with a warning)."""
    if report is None:
        return _new_report()
    deprecated_parameter(name, "report", "read the returned iterator's .report, a ReadReport", stacklevel=4)
    return report


def _iter_numbered(path: str | os.PathLike, known: Known, skip_invalid: bool,
                   report: dict, grouped: bool = False) -> Iterator[tuple[int, LogRecord]]:
    """The engine of :func:`iter_log`: yields ``(line number, record)``.

    ``grouped``: each user's records must be on consecutive lines (a user reappearing
    after another user's records is an error, even with ``skip_invalid``); repeated
    pairs are then tracked for the current user only, so memory does not grow with
    the number of records (only a set of finished user ids is kept). A memory whose
    text two records of a user give differently is an error (so is a call logged twice with
    other content). A line that repeats an earlier record of the call exactly (the same JSON
    object: a log delivered at least once, a day's file appended twice) is read once: counted
    in ``repeated`` and noted, not an error. Against ``known``, a gold id that neither the
    store nor any record of its user carries is no error either: the record keeps it as
    logged (``cite-rates`` counts the call as one with gold), one note at the end counts such
    ids, and Recall leaves them out (:func:`rmm_jax.data.log_vectors.resolve_calls`: no bank
    holds a gold memory never retrieved, and ``embed log:`` dropped it from the store it built).
    """
    if not isinstance(path, (str, bytes, os.PathLike)):   # None was a TypeError from open(), an int read as an fd
        raise InputError(f"expected the log's path (a str or os.PathLike), got {type(path).__name__} {path!r}"[:160],
                         arg="path")
    lookup = _known_lookup(known) if known is not None else None
    report.update(_new_report())
    keys_seen = set(LOG_KEYS)
    seen: dict[tuple[str, str], tuple[int, bytes]] = {}    # a call -> (its line, its record's digest)
    first_repeat: tuple[int, int] | None = None
    unheld = _UnheldGold()
    texts: dict[tuple[str, str], tuple[str, int]] = {}     # (user, memory id) -> (text, first line)
    current: str | None = None
    finished: set[str] = set()
    now = time.time()           # one clock read per read of the log: no timestamp may lie a day after it
    for lineno, raw in nonblank_lines(path):
        where = at(path, lineno)
        try:
            obj = decode_line(raw, path, lineno)
            rec = validate_record(obj, where, now=now)
            left_out = _check_known(rec, lookup, where) if lookup is not None else ()
            pair, digest = (rec.user_id, call_key(rec)), _digest(obj)
            if pair in seen and seen[pair][1] == digest:      # the same record again: read once
                report["repeated"] += 1
                first_repeat = first_repeat or (lineno, seen[pair][0])
                continue
            if pair in seen:
                key, what = _call_name(rec)
                raise InputError(f"duplicate {what}, first logged at line {seen[pair][0]} with other content",
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
                unheld.finish(current)              # grouped: what a user's records list, held for it alone
            current = rec.user_id
            seen.clear()
            texts.clear()
        seen[pair] = (lineno, digest)
        for mem, text in carried:
            texts.setdefault(mem, (text, lineno))
        note_misspelt_keys(obj, keys_seen, path, lineno, report["notes"])
        report["records"] += 1
        if lookup is not None:
            unheld.add(rec, lineno, left_out)
        yield lineno, rec
    if report["records"] == 0:
        raise InputError(f"no records ({report['skipped']} invalid lines skipped; first: "
                         f"{report['first_errors'][0]})", where=str(path))
    if first_repeat is not None:
        n = report["repeated"]
        report["notes"].append(f"{n} line{'s' if n > 1 else ''} of {path} repeat{'' if n > 1 else 's'} an earlier "
                               f"record exactly (first: line {first_repeat[0]}, as line {first_repeat[1]}): each "
                               "call is read once (if they were separate calls, give each its own call_id)")
    unheld.finish_all()
    if unheld.count:
        line, user, g = unheld.first
        n = unheld.count
        report["notes"].append(f"{path}: {count(n, 'gold id')} name{'s' if n == 1 else ''} no memory of the store or "
                               f"of any record of its user (first: line {line}, {g!r} of user {user!r}): Recall "
                               f"leaves {'it' if n == 1 else 'them'} out, as no bank holds a gold memory never "
                               "retrieved (cite-rates counts such a call as one with gold)")


class _UnheldGold:
    """The gold ids that neither the store nor their record holds, counted once no record of
    their user lists them (another record may: then the id is in the user's bank). Held per
    user until :meth:`finish`: a grouped read finishes each user as the next begins, so its
    memory stays one user's (a review found every user's candidate ids held to the end)."""

    def __init__(self):
        self.listed: dict[str, set[str]] = {}           # user -> every candidate id its records list
        self.pending: dict[str, list[tuple[int, str]]] = {}   # user -> (line, gold id) the store and record lack
        self.count = 0
        self.first: tuple[int, str, str] | None = None  # (line, user, gold id) of the first counted

    def add(self, rec: LogRecord, line: int, left_out) -> None:
        self.listed.setdefault(rec.user_id, set()).update(rec.candidates)
        if left_out:
            self.pending.setdefault(rec.user_id, []).extend((line, g) for g in left_out)

    def finish_all(self) -> None:
        """Finish every user still held (the end of the read)."""
        for user in list(self.listed):
            self.finish(user)

    def finish(self, user: str) -> None:
        listed = self.listed.pop(user, set())
        for line, g in self.pending.pop(user, ()):
            if g not in listed:
                self.count += 1
                if self.first is None or line < self.first[0]:
                    self.first = (line, user, g)


def _digest(obj) -> bytes:
    """A record's JSON object, canonically: two lines that decode to the same object (a line
    delivered twice, or written again with its keys in another order) have the same digest."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:16]


def is_empty_log(path: str | os.PathLike) -> bool:
    """Whether the log at ``path`` has no non-blank line (0 bytes, or blank lines only): a day
    without calls, which ``replay`` and ``evaluate`` take as nothing to learn or judge
    (docs/lifecycle.md, "A quiet day") where the readers above raise "no records". Reads
    up to the first non-blank line; a missing or unreadable file raises as they do."""
    with contextlib.closing(nonblank_lines(path, allow_empty=True)) as lines:
        return next(lines, None) is None


def iter_numbered(path: str | os.PathLike, *, known: Known = None, skip_invalid: bool = False,
                  report: dict | None = None, grouped: bool = False) -> LogReading:
    """:func:`iter_log` with each record's line number: yields ``(line, record)``, so a
    later check (e.g. of a key this package does not interpret) can name ``path:line``.
    ``grouped``: a user's records must be on consecutive lines (:class:`NotGroupedError`
    otherwise), and memory does not grow with the log. Its ``.report``: as :func:`iter_log`'s."""
    counts = _counts(report, "iter_numbered")
    return LogReading(_iter_numbered(path, known, skip_invalid, counts, grouped), counts)


def iter_log(path: str | os.PathLike, *, known: Known = None, skip_invalid: bool = False,
             report: dict | None = None) -> LogReading:
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

    The returned iterator's ``.report`` is a :class:`ReadReport` of the lines read so far:
    ``records`` (yielded so far), ``skipped``, ``first_errors`` (up to 5 messages) and
    ``notes``: one line per unknown key of the valid records that looks like a misspelt log
    key (package docstring, "Decisions"), naming the first line that has it. (``report``, a
    dict filled in place with the same keys, is deprecated.) A file without a
    non-blank line, or whose lines were all skipped, raises ``InputError`` "no records"
    when the stream ends. Memory use: one line plus the seen calls.
    """
    counts = _counts(report, "iter_log")
    return LogReading((rec for _, rec in _iter_numbered(path, known, skip_invalid, counts)), counts)


def read_log(path: str | os.PathLike, *, known: Known = None,
             skip_invalid: bool = False) -> tuple[list[LogRecord], ReadReport]:
    """Read a whole citation log: ``(records, report)``, ``report`` a :class:`ReadReport`.

    See :func:`iter_log` for the checks and ``known``. A log with no valid record
    raises ``InputError`` "no records" even with ``skip_invalid``; a ``path`` that is not a
    str or ``os.PathLike`` (None) raises one naming ``path``.
    """
    reading = iter_log(path, known=known, skip_invalid=skip_invalid)
    records = list(reading)
    return records, reading.report


def iter_user_chunks(path: str | os.PathLike, users_per_chunk: int, *, known: Known = None,
                     skip_invalid: bool = False,
                     report: dict | None = None) -> LogReading:
    """Stream a log as lists of records covering up to ``users_per_chunk`` users each.

    The log must hold each user's records on consecutive lines (sort it by
    ``user_id`` first otherwise); a user reappearing after another user's records
    raises :class:`InputError` naming the line. Records keep file order. Its ``.report``:
    as :func:`iter_log`'s.
    """
    counts = _counts(report, "iter_user_chunks")
    return LogReading(_user_chunks(path, users_per_chunk, known, skip_invalid, counts), counts)


def _user_chunks(path, users_per_chunk: int, known: Known, skip_invalid: bool,
                 counts: dict) -> Iterator[list[LogRecord]]:
    """The engine of :func:`iter_user_chunks`."""
    if isinstance(users_per_chunk, bool) or not isinstance(users_per_chunk, int) \
            or users_per_chunk < 1:
        raise InputError(f"must be a positive int, got {users_per_chunk!r}",
                         where="argument 'users_per_chunk'")
    chunk: list[LogRecord] = []
    users_in_chunk = 0
    current: str | None = None
    finished: set[str] = set()
    for lineno, rec in _iter_numbered(path, known, skip_invalid, counts, grouped=True):
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
