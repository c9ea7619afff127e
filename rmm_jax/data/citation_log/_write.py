"""Writing a citation log atomically: whole (:func:`write_log`) or chunk by chunk
(:class:`LogWriter`), every record re-validated first."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from rmm_jax.data.citation_log._identity import _call_name, call_key
from rmm_jax.data.citation_log._record import record_to_json, validate_record
from rmm_jax.data.citation_log._schema import LogRecord, _key_where
from rmm_jax.errors import InputError
from rmm_jax.persist.atomic import atomic_file


def _json_line(rec: LogRecord | Mapping, where: str, now: float | None = None) -> tuple[LogRecord, str]:
    """Validate one record to write (a :class:`LogRecord` or its JSON object; ``now``, the
    clock read once for the records written together) and return it with its JSONL line."""
    if isinstance(rec, LogRecord):
        obj = record_to_json(rec)
    elif isinstance(rec, Mapping):
        obj = rec
    else:
        raise InputError(f"expected a LogRecord, got {type(rec).__name__}", where=where)
    rec = validate_record(obj, where, now=now)
    return rec, json.dumps(record_to_json(rec), allow_nan=False) + "\n"


def _check_many(records, arg: str) -> None:
    """``records`` is a list (an iterable) of records, not one: a single :class:`LogRecord`
    was "'LogRecord' object is not iterable", a single dict (or a str) was read key by key
    ("record 0: expected a LogRecord, got str")."""
    if isinstance(records, (LogRecord, Mapping, str, bytes)):
        raise InputError(f"expected a list of records, got one {type(records).__name__}; pass a list of "
                         "records ([record] for one)", arg=arg)


def _check_file_path(path) -> None:
    """A log is written beside ``path`` and renamed onto it: a directory there was an
    IsADirectoryError from the rename, after the work."""
    if Path(path).is_dir():
        raise InputError("is a directory; give the log's file path", arg=f"path {path}")


def write_log(path: str | os.PathLike, records: Iterable[LogRecord]) -> int:
    """Atomically write ``records`` as JSONL; return the number written.

    Every record is re-validated first (``InputError`` naming ``record i`` - 0-based -
    and the key), including calls logged twice, so a written log
    always reads back. Nothing is written when a record is invalid, when ``records`` is
    empty (a log without a record does not read back) or a single record rather than a
    list of them, or when ``path`` is a directory.
    """
    _check_many(records, "records")
    _check_file_path(path)
    lines: list[str] = []
    seen: set[tuple[str, str]] = set()
    now = time.time()
    for i, rec in enumerate(records):
        where = f"record {i}"
        rec, line = _json_line(rec, where, now)
        pair = (rec.user_id, call_key(rec))
        if pair in seen:
            key, what = _call_name(rec)
            raise InputError(f"duplicate {what}", where=_key_where(where, key))
        seen.add(pair)
        lines.append(line)
    if not lines:
        raise InputError("holds no record; a log needs at least one (read_log refuses an empty file)",
                         arg="records")
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

        >>> from rmm_jax.data.citation_log import LogWriter  # doctest: +SKIP
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
        _check_file_path(self.path)
        self._cm = atomic_file(Path(self.path))
        self._f = self._cm.__enter__()
        return self

    def write(self, records: Iterable[LogRecord | Mapping]) -> None:
        """Validate and append ``records`` (in order)."""
        if self._f is None:
            raise RuntimeError("LogWriter.write called outside its with-block")
        _check_many(records, "records")
        now = time.time()
        for r in records:
            _, line = _json_line(r, f"generated record {self.count}", now)
            self._f.write(line)
            self.count += 1

    __call__ = write

    def __exit__(self, *exc) -> bool | None:
        cm, self._cm, self._f = self._cm, None, None
        return cm.__exit__(*exc)
