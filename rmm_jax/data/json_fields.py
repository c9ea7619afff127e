"""Checked reads of JSON data files, shared by the dataset loaders.

Every problem becomes one :class:`~rmm_jax.errors.InputError` line naming the file and,
where there is one, the line or the key (e.g. ``26.json: key 'qa[3].evidence':
expected a list, got a string``).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from rmm_jax.errors import InputError, at

__all__ = ["check_surrogates", "expect", "field", "json_type", "line_id", "line_ids", "line_object", "line_stamp",
           "read_json", "scalar_text"]

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "a boolean",
               float: "a number"}


def read_json(path: str | Path) -> Any:
    """Parse one JSON file; every failure is an InputError naming the file (and line)."""
    path = Path(path)
    if not path.exists():
        raise InputError("no such file", where=at(path))
    if path.is_dir():
        raise InputError("is a directory, expected a JSON file", where=at(path))
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read file ({e.strerror})", where=at(path)) from None
    if not raw.strip():
        raise InputError("empty file, expected JSON", where=at(path))
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start})", where=at(path)) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg} (column {e.colno})", where=at(path, e.lineno)) from None
    except RecursionError:
        raise InputError("invalid JSON: nested too deeply", where=at(path)) from None
    check_surrogates(text, value, at(path))
    return value


def check_surrogates(text: str, value: Any, where: str) -> None:
    """Refuse a lone UTF-16 surrogate escape (``"\\ud83d"`` without its pair, e.g. a string cut
    inside an emoji) in JSON ``text`` decoded as ``value``: Python's ``json`` accepts it, but the
    string is not text (it cannot be encoded as UTF-8, so hashing, embedding or writing it
    fails later). A pair (``"\\ud83d\\ude00"``) decodes to one character and passes. Only
    text holding such an escape is walked, so the check costs a regular-expression scan."""
    if not _SURROGATE_ESCAPE.search(text):
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"invalid JSON: a lone surrogate \\u{ord(e.object[e.start]):04x} is not text "
                         "(a string cut inside an emoji or another character?)", where=where) from None


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def expect(value: Any, kind: type | tuple[type, ...], path: Path, key: str, line: int | None = None) -> Any:
    """Return ``value`` if it has JSON type ``kind``; else InputError naming file (and
    ``line``, for a JSONL file) and key. ``int`` alone is "an integer" (1.5 is a number it is
    not); ``int`` with ``float`` is "a number"."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds if not (k is int and float in kinds))
        raise InputError(f"expected {want}, got {json_type(value)}", where=at(path, line, key))
    return value


def field(obj: dict, name: str, kind: type | tuple[type, ...], path: Path, prefix: str = "", *,
          line: int | None = None, required: bool = True, default=None) -> Any:
    """``obj[name]`` checked for presence and type; ``prefix`` locates ``obj`` in the file,
    ``line`` in a JSONL file. Not ``required``: absent or ``null``, it is ``default``."""
    key = f"{prefix}.{name}" if prefix else name
    if name not in obj or (obj[name] is None and not required):
        if required:
            raise InputError("missing key", where=at(path, line, key))
        return default
    return expect(obj[name], kind, path, key, line)


def scalar_text(value: Any) -> str | None:
    """An answer as text: strings kept, numbers formatted, null -> None."""
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value)


# --------------------------------------------------------------------------- one JSONL line's object
def line_object(obj: Any, path, line: int) -> dict:
    """A JSONL line's value, which must be an object."""
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {json_type(obj)}", where=at(path, line))
    return obj


def line_id(value: Any, path, line: int, key: str) -> str:
    """An id: a non-empty string."""
    value = expect(value, str, path, key, line)
    if not value:
        raise InputError("must be a non-empty string", where=at(path, line, key))
    return value


def line_ids(obj: dict, key: str, path, line: int, loc: str) -> tuple[str, ...]:
    """An optional list of distinct ids (empty when absent)."""
    full = f"{loc}.{key}"
    items = field(obj, key, list, path, loc, line=line, required=False, default=[])
    out = tuple(line_id(v, path, line, f"{full}[{i}]") for i, v in enumerate(items))
    if len(set(out)) != len(out):
        dup = next(v for v in out if out.count(v) > 1)
        raise InputError(f"duplicate id {dup!r}", where=at(path, line, full))
    return out


def line_stamp(obj: dict, key: str, path, line: int, loc: str) -> str | None:
    """An optional timestamp (string or number), kept as text; a number must be finite (NaN was
    kept as the text "nan", where a log's timestamp refuses it)."""
    value = field(obj, key, (str, int, float), path, loc, line=line, required=False)
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"must be finite, got {value}", where=at(path, line, f"{loc}.{key}" if loc else key))
    return None if value is None else str(value)
