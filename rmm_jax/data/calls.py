"""Rerank requests: a JSONL file of calls, one generator call per line (``rmm-jax rerank``).

Each line is an object:

===================  ========================================================================
key                  meaning
===================  ========================================================================
``user_id``          (required) the user whose policy ranks the call; a user of STORE when
                     ``query_id`` or ``candidates`` name STORE's queries or memories
``query``            the query text (embedded with STORE's model, through its disk cache),
``query_id``         or a query of that user in STORE (exactly one of the two)
``candidates``       memory ids of that user in STORE, in any order,
``candidate_texts``  or candidate memory texts (embedded); neither: the base retriever's
                     top-K of the user's memories in STORE (``--k``)
``call_id``          (optional) echoed in the output
===================  ========================================================================

Every problem is one :class:`~rmm_jax.errors.InputError` naming ``file:line`` and the key,
raised before anything is embedded, ranked or written.

Examples:
  >>> import json, tempfile, pathlib
  >>> p = pathlib.Path(tempfile.mkdtemp()) / "calls.jsonl"
  >>> _ = p.write_text(json.dumps({"user_id": "u1", "query": "where do I live?"}) + "\\n")
  >>> [c.query_text for c in read_calls(p)]
  ['where do I live?']
"""
from __future__ import annotations

import os
from typing import NamedTuple

from rmm_jax.data.citation_log import json_lines
from rmm_jax.data.json_fields import json_type
from rmm_jax.errors import InputError, at


class Call(NamedTuple):
    line: int
    user_id: str
    call_id: object = None
    query_text: str | None = None
    query_id: str | None = None
    candidates: tuple[str, ...] | None = None        # memory ids
    candidate_texts: tuple[str, ...] | None = None


KEYS = ("user_id", "query", "query_id", "candidates", "candidate_texts", "call_id")


def _strings(value, path, line, key) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise InputError(f"expected a non-empty list of strings, got {json_type(value)}", where=at(path, line, key))
    for v in value:
        if not isinstance(v, str) or not v.strip():
            raise InputError(f"expected non-empty strings, got {json_type(v)}", where=at(path, line, key))
    if len(set(value)) != len(value):
        raise InputError("lists a candidate twice", where=at(path, line, key))
    return tuple(value)


def read_calls(path: str | os.PathLike) -> list[Call]:
    """Every call of a calls file, checked (module docstring)."""
    calls = []
    for line, obj in json_lines(path):
        if not isinstance(obj, dict):
            raise InputError(f"expected an object, got {json_type(obj)}", where=at(path, line))
        unknown = sorted(set(obj) - set(KEYS))
        if unknown:
            raise InputError(f"unknown key (expected some of {', '.join(KEYS)})", where=at(path, line, unknown[0]))
        uid = obj.get("user_id")
        if not isinstance(uid, str) or not uid:
            raise InputError(f"expected a non-empty string, got {json_type(uid)}", where=at(path, line, "user_id"))
        if ("query" in obj) == ("query_id" in obj):
            raise InputError("needs exactly one of 'query' (text) and 'query_id'", where=at(path, line))
        for key in ("query", "query_id"):
            if key in obj and (not isinstance(obj[key], str) or not obj[key].strip()):
                raise InputError(f"expected a non-empty string, got {json_type(obj[key])}", where=at(path, line, key))
        if "candidates" in obj and "candidate_texts" in obj:
            raise InputError("give 'candidates' (memory ids) or 'candidate_texts', not both", where=at(path, line))
        calls.append(Call(line, uid, obj.get("call_id"), obj.get("query"), obj.get("query_id"),
                          _strings(obj["candidates"], path, line, "candidates") if "candidates" in obj else None,
                          _strings(obj["candidate_texts"], path, line, "candidate_texts")
                          if "candidate_texts" in obj else None))
    return calls
