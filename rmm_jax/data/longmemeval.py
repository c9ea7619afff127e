"""LongMemEval loader (Wu et al., ICLR 2025): ``longmemeval_{s,m,oracle}.json``.

The file is a JSON list of instances. Each instance is one user with one question and
its own haystack of chat sessions::

    {"question_id", "question_type", "question", "answer", "question_date",
     "haystack_session_ids": [...], "haystack_dates": [...],
     "haystack_sessions": [[{"role": "user"|"assistant", "content": str,
                             "has_answer": true (optional)}, ...], ...],
     "answer_session_ids": [...]}

Turn ids are ``f"{session_id}:{turn_index}"`` and turn text is ``f"{role}: {content}"``.
Gold labels:

* ``gold_level="turn"``: the turns marked ``has_answer``;
* ``gold_level="session"``: every turn of the answer sessions, so that
  :func:`~rmm_jax.data.types.gold_matrix` gives session-level gold at any granularity.

``gold_session_ids`` is always the answer sessions that appear in the haystack.
Abstention questions (id ending ``_abs``) get ``abstention=True``.

The whole file is parsed in memory, which suits ``_s`` and ``_oracle``; ``_m``
(about 2.7 GB) needs a machine with ample RAM.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from rmm_jax.data.json_fields import expect, field, read_json, scalar_text
from rmm_jax.data.types import Dataset, Query, Session, Turn, User
from rmm_jax.errors import InputError, at

GOLD_LEVELS = ("turn", "session")
DEFAULT_GOLD_LEVEL = "turn"


def _sessions(inst: dict, path: Path, loc: str) -> tuple[Session, ...]:
    """The haystack of one instance, sessions in file order."""
    ids = field(inst, "haystack_session_ids", list, path, loc)
    dates = field(inst, "haystack_dates", list, path, loc)
    bodies = field(inst, "haystack_sessions", list, path, loc)
    if not len(ids) == len(dates) == len(bodies):
        raise InputError(
            f"haystack_session_ids, haystack_dates and haystack_sessions differ in length "
            f"({len(ids)}, {len(dates)}, {len(bodies)})", where=at(path, key=f"{loc}.haystack_sessions"))
    sessions, seen = [], set()
    for j, (sid, date, body) in enumerate(zip(ids, dates, bodies)):
        sid = str(expect(sid, (str, int), path, f"{loc}.haystack_session_ids[{j}]"))
        date = None if date is None else expect(date, str, path, f"{loc}.haystack_dates[{j}]")
        if sid in seen:
            raise InputError(f"duplicate session id {sid!r}", where=at(path, key=f"{loc}.haystack_session_ids[{j}]"))
        seen.add(sid)
        turns = []
        for k, t in enumerate(expect(body, list, path, f"{loc}.haystack_sessions[{j}]")):
            tloc = f"{loc}.haystack_sessions[{j}][{k}]"
            expect(t, dict, path, tloc)
            role = field(t, "role", str, path, tloc)
            content = field(t, "content", str, path, tloc)
            turns.append(Turn(f"{sid}:{k}", sid, role, f"{role}: {content}", date))
        sessions.append(Session(sid, date, tuple(turns)))
    return tuple(sessions)


def _answer_turns(inst: dict, path: Path, loc: str) -> set[tuple[int, int]]:
    """(session index, turn index) of every turn with a true ``has_answer``."""
    out = set()
    for j, body in enumerate(inst["haystack_sessions"]):
        for k, t in enumerate(body):
            flag = t.get("has_answer", False)
            if expect(flag, bool, path, f"{loc}.haystack_sessions[{j}][{k}].has_answer"):
                out.add((j, k))
    return out


def _user(inst: dict, path: Path, loc: str, gold_level: str, stats: Counter) -> User:
    """One instance: its own user holding one query."""
    qid = str(field(inst, "question_id", (str, int), path, loc))
    qtype = field(inst, "question_type", str, path, loc)
    question = field(inst, "question", str, path, loc)
    if "answer" not in inst:
        raise InputError("missing key", where=at(path, key=f"{loc}.answer"))
    qdate = inst.get("question_date")
    qdate = None if qdate is None else expect(qdate, str, path, f"{loc}.question_date")
    sessions = _sessions(inst, path, loc)
    answer_ids = field(inst, "answer_session_ids", list, path, loc)
    answer_ids = [str(expect(a, (str, int), path, f"{loc}.answer_session_ids[{i}]")) for i, a in enumerate(answer_ids)]
    known = {s.id for s in sessions}
    gold_sessions = tuple(dict.fromkeys(a for a in answer_ids if a in known))
    stats["unresolved_answer_sessions"] += len(set(answer_ids) - known)
    if gold_level == "session":
        gold_turns = tuple(t.id for s in sessions if s.id in gold_sessions for t in s.turns)
    else:
        marked = _answer_turns(inst, path, loc)
        gold_turns = tuple(t.id for j, s in enumerate(sessions) for k, t in enumerate(s.turns) if (j, k) in marked)
    abstention = qid.endswith("_abs")
    stats["abstention"] += abstention
    stats["no_gold"] += not gold_turns
    query = Query("q0", question, gold_turns, category=qtype, date=qdate,
                  answer=scalar_text(inst["answer"]), abstention=abstention, gold_session_ids=gold_sessions)
    return User(qid, sessions, (query,))


def load_longmemeval(path: str | Path, gold_level: str = DEFAULT_GOLD_LEVEL) -> Dataset:
    """Load a LongMemEval file; one user per instance (see the module docstring).

    ``Dataset.stats``: ``questions``, ``per_category`` (by question_type), ``abstention``,
    ``no_gold`` (queries with no gold turn at this level), ``unresolved_answer_sessions``
    and ``gold_level``.
    """
    if gold_level not in GOLD_LEVELS:
        raise InputError(f"gold_level must be one of {', '.join(GOLD_LEVELS)}, got {gold_level!r}",
                         where="gold_level")
    path = Path(path)
    data = expect(read_json(path), list, path, "(top level)")
    stats: Counter = Counter(abstention=0, no_gold=0, unresolved_answer_sessions=0)
    users, seen = [], set()
    for i, inst in enumerate(data):
        loc = f"[{i}]"
        user = _user(expect(inst, dict, path, loc), path, loc, gold_level, stats)
        if user.id in seen:
            raise InputError(f"duplicate question_id {user.id!r}", where=at(path, key=f"{loc}.question_id"))
        seen.add(user.id)
        users.append(user)
    per_cat = Counter(u.queries[0].category for u in users)
    out = dict(stats)
    out.update(questions=len(users), per_category=dict(sorted(per_cat.items())), gold_level=gold_level)
    return Dataset("longmemeval", tuple(users), out)
