"""Bring your own logs: a generator-call log that carries text (``log:PATH[,memories=MEMS]``)
as a :class:`~rmm_jax.data.types.Dataset`, so that ``rmm-jax embed`` can build an embedding
store from the calls a team has served. Chat histories are :mod:`rmm_jax.data.jsonl`.

A citation log (:mod:`rmm_jax.data.citation_log`) whose records carry text: the query
text (key ``query``) and the candidates' texts (``candidates`` as ``{"id", "text"}``
objects), or texts from a separate memories file ``MEMS``, one JSON object per line::

    {"user_id": "alice", "id": "s1:0", "text": "user: I adopted a puppy named Max.",
     "session_id": "s1", "timestamp": "2024-05-01"}

(``session_id`` and ``timestamp`` optional). Each user's memory bank is the memories of
the memories file, then every candidate of the log, in order of first appearance; each
logged call becomes one query and, when the record has ``gold``, those memories as gold.
The query is named by the record's ``query_id``, else its ``call_id`` (what ``rmm-jax
rerank`` writes), else its ``query`` text; two calls of a user that name the same query are
an error naming the second's ``file:line``. The memory ids are kept as logged, so the same
log replays on the store (``rmm-jax replay STORE --log PATH``). A memory whose text differs
between two places, a call without ``query`` text (or with only whitespace) and a
candidate or a memories-file line without text (or with only whitespace) are errors
naming ``file:line`` and the key.

A gold id that names a memory no record carries (the gold was never retrieved, so the log
has no text for it) cannot be a memory of the store: it is dropped from its question's gold
and counted (``Dataset.stats["gold_without_text"]``, with the first few as ``file:line``
in ``gold_without_text_first``). Recall on the store then counts only the gold it holds, and
a question left with none is a question without gold (``no_gold``). Give those memories'
texts in the memories file to keep them.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from rmm_jax.data.citation_log import iter_numbered
from rmm_jax.data.json_fields import field, line_id, line_object, line_stamp
from rmm_jax.data.json_lines import MAX_FIRST_ERRORS, json_lines
from rmm_jax.data.types import Dataset, Query, Session, Turn, User
from rmm_jax.errors import InputError, at

__all__ = ["load_log_dataset", "parse_log_spec"]

LOG_SESSION = "log"  # the session of log memories that name none


def parse_log_spec(rest: str) -> tuple[str, str | None]:
    """``CALLS[,memories=MEMS]`` -> ``(calls path, memories path or None)``. A path that does not
    exist and ends in ``,KEY=VALUE`` is a mistyped option, refused as one (not as a missing file);
    a file whose name holds such a comma is still read when it exists.

    >>> from rmm_jax.data.log_dataset import parse_log_spec
    >>> parse_log_spec("calls.jsonl,memories=mems.jsonl")
    ('calls.jsonl', 'mems.jsonl')
    >>> parse_log_spec("calls.jsonl,foo=bar")
    Traceback (most recent call last):
    rmm_jax.errors.InputError: SPEC 'log:calls.jsonl,foo=bar': unknown option 'foo' (expected memories=MEMS.jsonl)
    """
    head, sep, tail = rest.rpartition(",memories=")
    if sep and (not head or not tail):
        raise InputError("expected log:CALLS.jsonl[,memories=MEMORIES.jsonl]", where=f"SPEC 'log:{rest}'")
    paths = (head, tail) if sep else (rest, None)
    for path in paths:
        option = re.search(r",([A-Za-z_][\w-]*)=", path or "")
        if option and not Path(path).exists():
            key = option.group(1)
            why = "memories= is given twice" if key == "memories" else \
                f"unknown option {key!r} (expected memories=MEMS.jsonl)"
            raise InputError(why, where=f"SPEC 'log:{rest}'")
    return paths


class _Bank:
    """One user's memories: id -> (text, session, timestamp), with where each text came from."""

    def __init__(self):
        self.rows: dict[str, tuple[str, str, str | None]] = {}
        self.where: dict[str, str] = {}

    def add(self, mid: str, text: str, session: str, stamp: str | None, where: str, user: str, key: str) -> None:
        if mid in self.rows:
            if self.rows[mid][0] != text:
                raise InputError(f"memory {mid!r} of user {user!r} has a different text than at "
                                 f"{self.where[mid]}", where=f"{where}: key '{key}'")
            return
        self.rows[mid] = (text, session, stamp)
        self.where[mid] = where


def _read_memories(path: Path, banks: dict[str, _Bank]) -> int:
    n = 0
    for line, obj in json_lines(path):
        line_object(obj, path, line)
        uid = line_id(field(obj, "user_id", str, path, "", line=line), path, line, "user_id")
        mid = line_id(field(obj, "id", str, path, "", line=line), path, line, "id")
        text = field(obj, "text", str, path, "", line=line)
        if not text.strip():     # as a chat message's: a memory with nothing to match
            raise InputError("empty memory text (or only whitespace)", where=at(path, line, "text"))
        session = field(obj, "session_id", str, path, "", line=line, required=False) or LOG_SESSION
        banks.setdefault(uid, _Bank()).add(mid, text, session, line_stamp(obj, "timestamp", path, line, ""),
                                           at(path, line), uid, "text")
        n += 1
    return n


def _question_name(rec) -> tuple[str, str]:
    """``(id, key)`` of the store question a logged call becomes: its ``query_id`` (so that the
    replay finds the question and its gold in the store), else its ``call_id`` (``rerank``'s
    logs have no query id), else its query text, the names the replay gives calls
    (:func:`rmm_jax.data.citation_log.call_key`)."""
    if rec.query_id is not None:
        return rec.query_id, "query_id"
    if rec.call_id is not None:
        return rec.call_id, "call_id"
    return rec.query_text, "query"


def _check_new_question(seen: dict, rec, path: Path, line: int) -> str:
    """The question id of the call at ``line``, refused when an earlier call of its user named it."""
    qid, key = _question_name(rec)
    first = seen.setdefault((rec.user_id, qid), line)
    if first != line:
        raise InputError(f"duplicate question {qid!r} of user {rec.user_id!r}, first logged at line {first}",
                         where=at(path, line, key))
    return qid


def load_log_dataset(path: str | Path, memories: str | Path | None = None) -> Dataset:
    """A dataset from a generator-call log that carries text (see the module docstring).

    Every record is validated as a citation-log record first
    (:func:`rmm_jax.data.citation_log.validate_record`). ``Dataset.stats``: ``records``,
    ``memories``, ``memories_from_file``, ``questions``, ``no_gold``, ``gold_without_text`` (gold
    ids dropped: no record carries their memory), ``gold_without_text_first`` and ``notes`` (the
    unknown keys that look like misspelt log keys, :func:`rmm_jax.data.citation_log.iter_log`).
    """
    path = Path(path)
    banks: dict[str, _Bank] = {}
    n_file = _read_memories(Path(memories), banks) if memories is not None else 0
    calls: dict[str, list[tuple[int, Any, str]]] = {}
    seen: dict[tuple[str, str], int] = {}
    records, reading = 0, iter_numbered(path)
    for line, rec in reading:
        records += 1
        where = at(path, line)
        if rec.query_text is None:
            raise InputError("missing: building a store from a log needs each call's query text",
                             where=at(path, line, "query"))
        qid = _check_new_question(seen, rec, path, line)
        bank = banks.setdefault(rec.user_id, _Bank())
        texts = rec.candidate_texts or (None,) * len(rec.candidates)
        for mid, text in zip(rec.candidates, texts):
            if text is not None:
                bank.add(mid, text, LOG_SESSION, None, where, rec.user_id, "candidates")
            elif mid not in bank.rows:
                raise InputError(f"no text for memory {mid!r} of user {rec.user_id!r} (give candidates as "
                                 f'{{"id", "text"}} objects or a memories file: log:PATH,memories=MEMS)',
                                 where=at(path, line, "candidates"))
        calls.setdefault(rec.user_id, []).append((line, rec, qid))
    users, stats = [], Counter(records=records, memories=0, memories_from_file=n_file, questions=0, no_gold=0,
                               gold_without_text=0)
    dropped_first: list[str] = []
    for uid, bank in banks.items():
        by_session: dict[str, list[Turn]] = {}
        for mid, (text, session, stamp) in bank.rows.items():
            by_session.setdefault(session, []).append(Turn(mid, session, "", text, stamp))
        sessions = tuple(Session(sid, turns[0].timestamp, tuple(turns)) for sid, turns in by_session.items())
        queries = []
        for line, rec, qid in calls.get(uid, []):
            gold = tuple(g for g in rec.gold or () if g in bank.rows)
            for j, g in enumerate(rec.gold or ()):
                if g not in bank.rows:          # no text anywhere: dropped and counted (module docstring)
                    stats["gold_without_text"] += 1
                    if len(dropped_first) < MAX_FIRST_ERRORS:
                        dropped_first.append(f"{at(path, line, f'gold[{j}]')}: {g!r}")
            queries.append(Query(qid, rec.query_text, gold,
                                 date=None if rec.timestamp is None else str(rec.timestamp)))
        users.append(User(uid, sessions, tuple(queries)))
        stats["memories"] += len(bank.rows)
        stats["questions"] += len(queries)
        stats["no_gold"] += sum(1 for q in queries if not q.gold_turn_ids)
    return Dataset("log", tuple(users), {**stats, "gold_without_text_first": dropped_first,
                                         "notes": reading.report.notes})
