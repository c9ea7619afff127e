"""JSONL files read line by line, as every reader of them decodes them (citation logs, chat
histories, ``rerank``'s requests, a log's memories file): UTF-8, no key repeated within an
object, every problem an :class:`~rmm_jax.errors.InputError` naming ``path:line``; standard
input too."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from rmm_jax.data.json_fields import check_surrogates
from rmm_jax.errors import InputError, at


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def decode_line(raw: bytes, path: str | os.PathLike, lineno: int) -> Any:
    """One raw line's JSON value (UTF-8, a BOM allowed on line 1, no key repeated within an
    object); a problem is an :class:`InputError` naming ``path:lineno``."""
    where = at(path, lineno)
    try:
        text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"invalid UTF-8 ({exc.reason} at byte {exc.start})", where=where) from None
    text = text.removesuffix("\n").removesuffix("\r")   # the terminator: an error at the end is on this line
    try:
        value = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateKey as exc:
        raise InputError("key repeated within one JSON object",
                         where=at(path, lineno, exc.key)) from None
    except json.JSONDecodeError as exc:
        what = exc.msg.removesuffix(" at")      # "Unterminated string starting at": the column follows
        raise InputError(f"invalid JSON ({what} at column {exc.colno})", where=where) from None
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


MAX_FIRST_ERRORS = 5
"""How many problems a reader that skips invalid lines lists by ``file:line`` (the rest it counts)."""

STDIN = "-"
"""The path :func:`json_lines` reads as standard input (shown as ``<stdin>``)."""


def source_name(path: str | os.PathLike) -> str:
    """How errors name ``path``: ``<stdin>`` for :data:`STDIN`, else the path as given."""
    return "<stdin>" if str(path) == STDIN else str(path)


def json_lines(path: str | os.PathLike, *, stdin: bool = False,
               allow_empty: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line number, decoded JSON value)`` for every non-blank line of a JSONL file; with
    ``stdin``, of standard input when ``path`` is ``"-"`` (:data:`STDIN`: it can be read
    only once, so only a reader that goes through its input once takes it, as
    :func:`rmm_jax.data.calls.read_calls` does).

    The same decoding as the log reader: UTF-8 (a BOM on line 1 is allowed), a key
    repeated within an object is an error, and every problem raises
    :class:`InputError` naming ``path:line`` (``<stdin>:line``). An empty file (0 bytes, or
    blank lines only) raises "no records", unless ``allow_empty`` (:func:`nonblank_lines`).
    """
    name = source_name(path) if stdin else str(path)
    for lineno, raw in nonblank_lines(path, stdin=stdin and str(path) == STDIN, allow_empty=allow_empty):
        yield lineno, decode_line(raw, name, lineno)


def nonblank_lines(path: str | os.PathLike, *, stdin: bool = False,
                   allow_empty: bool = False) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of every non-blank line (of standard input if ``stdin``).
    An empty file (0 bytes, or blank lines only) is an error, "no records", where emptiness
    is one (an embedding store's chats, a dataset, pretrain data); with ``allow_empty`` it
    yields nothing: a day's calls or citation log, where a day without traffic is normal
    (docs/lifecycle.md, "A quiet day")."""
    nonblank = 0
    with contextlib.nullcontext(sys.stdin.buffer) if stdin else _open_log(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                nonblank += 1
                yield lineno, raw
    if nonblank == 0 and not allow_empty:
        raise InputError("no records (the file is empty)", where=source_name(path) if stdin else str(path))
