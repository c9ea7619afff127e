"""Rerank requests: a JSONL file of calls, one generator call per line (``rmm-jax rerank``).

Each line is an object:

===================  ========================================================================
key                  meaning
===================  ========================================================================
``user_id``          (required) the user whose policy ranks the call; a user of STORE when
                     ``query_id`` or ``candidates`` name STORE's queries or memories
``query``            the query text (embedded with STORE's model, through its disk cache),
``query_id``         and/or a query id: STORE's question when STORE holds it (then the text
                     is not needed), else the application's own id for the call's question
``candidates``       memory ids of that user in STORE, in your retriever's order, best first
                     (echoed: ``replay`` and ``evaluate`` read the first M as what the
                     retriever alone would have shown); an item may be ``{"id", "text"}``, as
                     a log writes it: STORE's memory when STORE holds the id (its text must
                     be STORE's), else the text embedded under your own id,
``candidate_texts``  or candidate memory texts (embedded; a text given twice, as a retriever
                     returns a thing the user said twice, is taken once, where it first
                     comes); neither: the base retriever's top-K of the user's memories in
                     STORE (``--k``)
``call_id``          (optional) a non-empty string naming the call, echoed in the output
``timestamp``        (optional) when the call was made (a string or a number, as in a
                     citation log), echoed in the output: replay orders what a policy has
                     learned by it (docs/reliability.md, "Exactly once"). Without one,
                     ``rerank`` writes the time it served the call
===================  ========================================================================

Other keys are ignored (an application may add its own, ``latency_ms``), as in a
citation log; one that looks like a misspelt request key (``qurey``, ``candidate_ids``)
is noted once per file, naming the first line that has it
(:func:`rmm_jax.data.citation_log.note_misspelt_keys`).

A call needs ``query`` or a ``query_id`` that STORE holds. Its identity is its
``call_id``, else its ``query_id``, else its ``query`` text, as in a citation log
(:func:`rmm_jax.data.citation_log.call_key`), and two calls of a user may not share it
(the served file is a log, which names each call once). A candidate given as text gets the id
``t:`` + the first 16 hex digits of the text's sha256 (:func:`text_id`), so the same text
has the same id in every call and the served line replays as a log record. Every
problem is one :class:`~rmm_jax.errors.InputError` naming ``file:line`` and the key,
raised before anything is embedded, ranked or written.

Examples:
  >>> import json, tempfile, pathlib
  >>> from rmm_jax.data.calls import read_calls, text_id
  >>> p = pathlib.Path(tempfile.mkdtemp()) / "calls.jsonl"
  >>> _ = p.write_text(json.dumps({"user_id": "u1", "query": "where do I live?"}) + "\\n")
  >>> [c.query_text for c in read_calls(p)]
  ['where do I live?']
  >>> text_id("user: I live in Lisbon.")
  't:e229215f0adbf3e0'
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rmm_jax.data.citation_log import (
    LOG_KEYS,
    call_key,
    check_timestamp,
    misspelt_key,
    note_misspelt_keys,
    timestamp_seconds,
)
from rmm_jax.data.embed import embed_texts
from rmm_jax.data.json_fields import json_type
from rmm_jax.data.json_lines import STDIN, decode_line, nonblank_lines, source_name
from rmm_jax.data.log_vectors import StoreMemories
from rmm_jax.data.retrieval import top_k
from rmm_jax.data.words import count
from rmm_jax.errors import InputError, at, check_int, named, short
from rmm_jax.persist.learned_calls import WINDOW


class Call(NamedTuple):
    line: int
    user_id: str
    call_id: str | None = None
    query_text: str | None = None
    query_id: str | None = None
    candidates: tuple[str, ...] | None = None        # memory ids
    candidate_texts: tuple[str, ...] | None = None
    timestamp: str | int | float | None = None
    carried: tuple[str | None, ...] | None = None     # with ``candidates``: each id's text ({"id", "text"}), or None


KEYS = ("user_id", "query", "query_id", "candidates", "candidate_texts", "call_id", "timestamp")


def text_id(text: str) -> str:
    """The memory id of a candidate given as text (module docstring)."""
    return "t:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _got(value) -> str:
    """What a request's value is, for an error: an empty or blank string said so ("got a
    string" under "expected a non-empty string" read as a contradiction)."""
    return ("an empty string" if not value else "a blank string") if isinstance(value, str) else json_type(value)


def _list_type(value) -> str:
    """What a value given for a non-empty list is (``an empty list``: ``[]`` was "a list")."""
    return "an empty list" if value == [] else json_type(value)


def _strings(value, path, line, key, *, once: bool = False) -> tuple[str, ...]:
    """A request's non-empty list of non-empty strings. A repeated one is refused, or with
    ``once`` (candidate texts: a user may say the same thing twice) taken where it first comes."""
    if not isinstance(value, list) or not value:
        raise InputError(f"expected a non-empty list of strings, got {_list_type(value)}", where=at(path, line, key))
    for v in value:
        if not isinstance(v, str) or not v.strip():
            raise InputError(f"expected non-empty strings, got {_got(v)}", where=at(path, line, key))
    if len(set(value)) != len(value):
        if not once:
            raise InputError("lists a candidate twice", where=at(path, line, key))
        value = list(dict.fromkeys(value))
    return tuple(value)


def _candidate_items(value, path, line) -> tuple[tuple[str, ...], tuple[str | None, ...] | None]:
    """A request's ``candidates``: ids, or ``{"id", "text"}`` objects as a log writes them (mixed
    allowed; an object's other keys are ignored, as a log's) -> (ids, texts or None: each id's
    text, None for an id alone). An id listed twice is refused."""
    if not isinstance(value, list) or not value:
        raise InputError(f"expected a non-empty list of ids (or {{\"id\", \"text\"}} objects), got "
                         f"{_list_type(value)}", where=at(path, line, "candidates"))
    ids, texts = [], []
    for i, item in enumerate(value):
        if not isinstance(item, (str, dict)):
            raise InputError(f"item {i}: expected an id (a non-empty string) or an {{\"id\", \"text\"}} object, got "
                             f"{_got(item)}", where=at(path, line, "candidates"))
        mid, text = (item.get("id"), item.get("text")) if isinstance(item, dict) else (item, None)
        for name, v in (("id", mid), ("text", text)) if isinstance(item, dict) else (("id", mid),):
            if not isinstance(v, str) or not v.strip():        # other keys of the object are ignored, as a log's
                raise InputError(f"item {i}: {name!r} must be a non-empty string, got {_got(v)}",
                                 where=at(path, line, "candidates"))
        ids.append(mid)
        texts.append(text)
    if len(set(ids)) != len(ids):
        raise InputError("lists a candidate twice", where=at(path, line, "candidates"))
    return tuple(ids), (tuple(texts) if any(t is not None for t in texts) else None)


def read_calls(path: str | os.PathLike, notes: list | None = None, *, skipped: list | None = None) -> list[Call]:
    """Every call of a calls file (``"-"``: standard input, named ``<stdin>`` in errors),
    checked (module docstring). ``notes``, when given, gets one line per unknown key that
    looks like a misspelt request key (the others are ignored without a word), and one
    counting the calls whose ``candidate_texts`` repeat a text (each taken once). Two calls of a user with the
    same identity are refused, with or without ``--explore``: each served line is a log
    record, and a log that names a call twice is refused by ``replay`` and ``evaluate``. An empty
    file (0 bytes, or blank lines only) holds no calls: a day without traffic, not an error.
    ``skipped``, when given (``rerank --skip-invalid``), takes the :class:`Skipped` of each
    invalid request, which is left out instead of failing the file; a call repeating another's
    identity is then left to :func:`prepare_calls`, which leaves out the later of the calls it
    keeps (an earlier one it cannot resolve does not take the identity)."""
    calls = []
    first: dict[tuple[str, str], int] = {}
    seen, notes = set(KEYS), [] if notes is None else notes
    repeats = 0                                   # calls whose candidate_texts repeat a text
    free: list[int] = []                          # lines whose timestamp is free text (replay cannot order it)
    now = time.time()                             # one clock read per file: no timestamp may lie a day after it
    name = source_name(path)                      # "-" is standard input: <stdin>:line
    # a day without calls: none (docs/lifecycle.md)
    for line, raw in nonblank_lines(path, stdin=str(path) == STDIN, allow_empty=True):
        obj = None
        try:
            obj = decode_line(raw, name, line)
            call, stamp_free, repeated = _read_call(obj, name, line, now, seen, notes)
            key = (call.user_id, call_key(call))
            if key in first and skipped is None:      # skipping: over the calls prepare_calls keeps
                raise _repeat(call, first[key], name)
        except InputError as e:
            if skipped is None:
                raise
            skipped.append(Skipped(line, str(e), _identity(obj) if isinstance(obj, dict) else None))
            continue
        first.setdefault(key, line)
        repeats += repeated
        free += [line] if stamp_free else []
        calls.append(call)
    path = name
    if repeats:
        notes.append(f"{count(repeats, 'call')} of {path} {'lists' if repeats == 1 else 'list'} a candidate text "
                     "more than once: served with each text once, where it first comes")
    if free:   # echoed as given: past the calls a policy remembers, replay tells a learned call by its time
        notes.append(f"{count(len(free), 'call')} of {path} (first: line {free[0]}) "
                     f"{'has' if len(free) == 1 else 'have'} a timestamp that is neither ISO 8601 nor a number, "
                     f"written as given: replay cannot order it, so once a policy has learned more than the last "
                     f"{WINDOW} calls it remembers, a log replayed again learns such calls again (docs/reliability.md, "
                     "\"Exactly once\"); give ISO 8601 (2024-06-03T09:00:00Z) or seconds")
    return calls


class Skipped(NamedTuple):
    """A request ``rerank --skip-invalid`` left out: its line, its one-line error and, where its
    ids could be read, its ``(user_id, call_key)`` identity (None: none), which a served record of
    it in ``--out`` is found by (:func:`check_not_served`)."""
    line: int
    error: str
    identity: tuple[str, str] | None


def _repeat(call: Call, first: int, path) -> InputError:
    """The one-line error of a call whose identity an earlier one (line ``first``) has."""
    what = "call_id" if call.call_id is not None else "query_id" if call.query_id is not None else "query"
    return InputError(f"the same call as line {first} (give each call its own call_id: a log names each call once)",
                      where=at(path, call.line, what))


def _read_call(obj, path: str, line: int, now: float, seen: set, notes: list) -> tuple[Call, bool, bool]:
    """One request of :func:`read_calls`: ``(call, whether its timestamp is free text, whether
    its candidate_texts repeat a text)``, or its one-line InputError."""
    if not isinstance(obj, dict):
        raise InputError(f"expected an object, got {json_type(obj)}", where=at(path, line))
    note_misspelt_keys(obj, seen, path, line, notes, keys=KEYS, kind="request")
    for key in ("user_id", "query", "query_id", "call_id"):
        if (key in obj or key == "user_id") and (not isinstance(obj.get(key), str) or not obj[key].strip()):
            raise InputError(f"expected a non-empty string, got {_got(obj.get(key))}", where=at(path, line, key))
    stamp = check_timestamp(obj.get("timestamp"), at(path, line), now)
    free = isinstance(stamp, str) and math.isnan(timestamp_seconds(stamp))
    if "query" not in obj and "query_id" not in obj:
        near = [f"{m!r} for {k!r}" for k in obj if k not in KEYS for m in (misspelt_key(k, ("query", "query_id")),)
                if m]
        raise InputError("needs 'query' (text) or a 'query_id' of STORE"
                         + (f" (did you mean {near[0]}?)" if near else ""), where=at(path, line))
    if "candidates" in obj and "candidate_texts" in obj:
        raise InputError("give 'candidates' (memory ids) or 'candidate_texts', not both", where=at(path, line))
    ids, carried = _candidate_items(obj["candidates"], path, line) if "candidates" in obj else (None, None)
    call = Call(line, obj["user_id"], obj.get("call_id"), obj.get("query"), obj.get("query_id"), ids,
                _strings(obj["candidate_texts"], path, line, "candidate_texts", once=True)
                if "candidate_texts" in obj else None, stamp, carried)
    repeated = call.candidate_texts is not None and len(call.candidate_texts) < len(obj["candidate_texts"])
    return call, free, repeated


def check_out_apart(out, where: str, calls, dirs=()) -> None:
    """Refuse (one :class:`~rmm_jax.errors.InputError` at ``where``) an output file ``out``
    that is the requests file ``calls`` (the same file by :func:`os.path.samefile`: another
    spelling of the path or a link to it counts), which writing would replace, or that lies
    in a directory of ``dirs`` (``(name, path)`` pairs: the embedding store, the policy
    store), whose files it would overwrite. ``out`` None or ``calls`` ``"-"``: nothing to
    compare. Cheap: a stat or two, so it runs before any work."""
    if out is None:
        return
    o = Path(out)
    if str(calls) != "-" and o.exists() and Path(calls).exists() and os.path.samefile(o, calls):
        raise InputError(f"is the requests file --calls {calls}: writing it would replace the calls it serves; "
                         "give another path", where=where)
    real = o.resolve()
    for name, d in dirs:
        if d is not None and Path(d).is_dir() and (real == Path(d).resolve() or Path(d).resolve() in real.parents):
            raise InputError(f"lies in {name} {d}: writing it would overwrite that store's files; give a path "
                             "outside it", where=where)


_SERVED_KEYS = frozenset(LOG_KEYS) - {"cited", "gold"}      # what rerank writes; the rest, the application added


def check_not_served(out, where: str, asked, served: Sequence[dict]) -> None:
    """Refuse (one :class:`~rmm_jax.errors.InputError` at ``where``) to replace an output file
    ``out`` that holds a record of a requested call (``asked``: the ``(user_id, call_key)`` of
    every request read, kept or left out; :func:`rmm_jax.data.citation_log.call_key`) other
    than the one about to be written in ``served`` (the served lines, as dicts; none for a call
    left out): any key but the ``timestamp`` a call without its own is stamped with.
    ``rerank --explore`` run again after the night replaced what the generator had been shown,
    which the application cites against (and the citations, gold or keys of its own it had
    added), with a draw of the new policies, and the next replay refused the log ("learned with
    other content"). The same run again, by the same policies, writes the same records: allowed.
    Lines of ``out`` that are not records (not JSON, not an object with string ids) are passed
    over; a file that holds no record of these calls is replaced as any output is."""
    if out is None or not Path(out).is_file() or not asked:
        return
    asked = set(asked)
    new = {key: rec for rec in served for key in [_identity(rec)] if key is not None}
    content = lambda rec: {k: v for k, v in rec.items() if k != "timestamp"}     # noqa: E731  (served at)
    other = []
    try:
        for line, raw in nonblank_lines(out, allow_empty=True):
            try:
                rec = decode_line(raw, str(out), line)
            except InputError:
                continue
            key = _identity(rec) if isinstance(rec, dict) else None
            if key in asked and (key not in new or content(new[key]) != content(rec)):
                other.append((line, sorted(set(rec) - _SERVED_KEYS)))
    except (InputError, OSError):        # a file that cannot be read: its write fails, one line, as any
        return
    if other:
        line, added = other[0]
        ranked = {"positions", "scores"} & set(added)           # what a rerank without --explore writes
        added = [k for k in added if k not in ranked]
        what = (f"what the generator was shown, and the {', '.join(map(repr, added))} your application added to it"
                if added else "a ranking of an earlier rerank without --explore" if ranked
                else "what the generator was shown, drawn then by the policies of that time")
        raise InputError(f"holds another record of {count(len(other), 'call')} of these requests (line {line}: "
                         f"{what}); serving them again would replace that record. Write the served lines to another "
                         "file, or move this one away first", where=where)


def _identity(rec: dict) -> tuple[str, str] | None:
    """``(user_id, call_key)`` of a record as JSON, None unless its ids are strings."""
    ids = [rec.get(k) for k in ("user_id", "call_id", "query", "query_id")]
    if not isinstance(ids[0], str) or not all(v is None or isinstance(v, str) for v in ids[1:]):
        return None
    return ids[0], call_key(Call(0, *ids))


class Prepared(NamedTuple):
    """A call ready to rank: its query (d,) and candidates (K, d) embeddings, the
    candidates' ids and, for candidates given as text, their texts (else None)."""
    call: Call
    query: np.ndarray
    cands: np.ndarray
    ids: list
    texts: list | None


class _Users:
    """STORE's users, read once each, with their memory and query indices."""

    def __init__(self, st, calls_path):
        self.st, self.path, self.cache, self.texts = st, calls_path, {}, {}

    def get(self, call, key):
        if call.user_id not in self.cache:
            if not self.st.has_user(call.user_id):
                hint = ("; a call for a user STORE lacks gives its candidates as texts in 'candidate_texts', or "
                        "as {\"id\", \"text\"} objects in 'candidates'"
                        if key in ("candidates", "the retrieved candidates") else "")
                raise InputError(f"user {call.user_id!r} is not in STORE {self.st.path} (needed for '{key}'){hint}",
                                 where=at(self.path, call.line, "user_id"))
            u = self.st.user(call.user_id)
            self.cache[call.user_id] = (u, {m: j for j, m in enumerate(u.memory_ids)},
                                        {q: i for i, q in enumerate(u.query_ids)})
        return self.cache[call.user_id]

    def memories(self, call) -> StoreMemories:
        """The call's user's memory ids in STORE, each mapped to STORE's text of it (read once, when asked)."""
        if call.user_id not in self.texts:
            u, m_index, _ = self.get(call, "candidates")
            self.texts[call.user_id] = StoreMemories(self.st, call.user_id, list(m_index))
        return self.texts[call.user_id]

    def held_query(self, call) -> int | None:
        """The row of the call's ``query_id`` in STORE, None when STORE lacks it."""
        if call.query_id is None or not self.st.has_user(call.user_id):
            return None
        return self.get(call, "query_id")[2].get(call.query_id)


def _retrieve(users: _Users, calls: list[Call], queries: list, k: int) -> list[list[int] | None]:
    """The base retriever's top ``k`` memory rows for each call that lists no candidates
    (None for the others): one :func:`~rmm_jax.data.retrieval.top_k` per user over all of
    that user's queries, padded to a power of two (a call at a time cost a dispatch each)."""
    by_user: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        if c.candidates is None and c.candidate_texts is None:
            by_user.setdefault(c.user_id, []).append(i)
    out: list[list[int] | None] = [None] * len(calls)
    for rows in by_user.values():
        bank = users.get(calls[rows[0]], "the retrieved candidates")[0].memory_emb
        qs = np.zeros((1 << (len(rows) - 1).bit_length(), bank.shape[1]), np.float32)
        qs[:len(rows)] = [queries[i] for i in rows]
        idx = top_k(qs, bank, min(k, len(bank)))[1]
        for j, i in enumerate(rows):
            out[i] = idx[j].tolist()
    return out


def _check_calls(calls, k, m) -> None:
    """:func:`prepare_calls`'s ``calls``, ``k`` and ``m`` from a Python caller, each refused by
    name before any work, as :func:`read_calls` refuses a line: ``calls`` a list of
    :class:`Call` (not one), each with a non-empty ``user_id``, a non-empty ``query_text``
    and/or ``query_id`` (``call_id`` None or non-empty), and ``candidates`` or
    ``candidate_texts`` (not both), each None or a non-empty list of non-empty strings (not
    one string, whose letters were taken as ids), each id or text listed once, a ``timestamp``
    as a log's (:func:`rmm_jax.data.citation_log.check_timestamp`), ``carried`` None or one text
    (or None) per id of ``candidates``; ``k`` and ``m`` ints >= 1."""
    if isinstance(calls, Call) or isinstance(calls, str) or not isinstance(calls, Sequence) or any(
            not isinstance(c, Call) for c in calls):
        got = "one Call (pass [call])" if isinstance(calls, Call) else short(calls)
        raise InputError(f"must be a list of Call (rmm_jax.data.calls.read_calls), got {got}", arg="calls")
    check_int(k, "k", 1)
    check_int(m, "m", 1)
    now = time.time()                   # one clock read: no timestamp may lie a day after it
    for i, c in enumerate(calls):
        where = f"calls {i}"
        for field in ("user_id", "query_text", "query_id", "call_id"):
            v = getattr(c, field)
            if (v is not None or field == "user_id") and (not isinstance(v, str) or not v.strip()):
                raise InputError(f"{field}: expected a non-empty string, got {short(v)}", arg=where)
        if c.query_text is None and c.query_id is None:
            raise InputError("needs a query_text, or a query_id of STORE", arg=where)
        if c.candidates is not None and c.candidate_texts is not None:
            raise InputError("give candidates (memory ids) or candidate_texts, not both", arg=where)
        for field in ("candidates", "candidate_texts"):
            v = getattr(c, field)
            if v is None:
                continue
            if isinstance(v, str) or not isinstance(v, Sequence) or not v:
                raise InputError(f"{field}: expected a non-empty list of strings, got {short(v)}", arg=where)
            for x in v:
                if not isinstance(x, str) or not x.strip():
                    raise InputError(f"{field}: expected non-empty strings, got {short(x)}", arg=where)
            if len(set(v)) != len(v):         # read_calls keeps a file's repeated text once; a Call says it once
                raise InputError(f"{field}: lists a {'candidate' if field == 'candidates' else 'text'} twice",
                                 arg=where)
        if c.carried is not None:
            if c.candidates is None:
                raise InputError("carried: needs candidates, the ids its texts go with", arg=where)
            texts_ok = all(t is None or (isinstance(t, str) and t.strip()) for t in c.carried) \
                if isinstance(c.carried, Sequence) and not isinstance(c.carried, str) else False
            if not texts_ok or len(c.carried) != len(c.candidates):
                raise InputError(f"carried: expected one non-empty text (or None) for each of the {len(c.candidates)} "
                                 f"candidates, got {short(c.carried)}", arg=where)
        if c.timestamp is not None:
            check_timestamp(c.timestamp, where, now)


class _ArgumentsDisagree(InputError):
    """``k`` < ``m`` on a call the retriever fills: the arguments, not the call, are wrong
    (never skipped)."""


def _texts_given(c: Call, said: dict, path) -> dict:
    """The ``(user, memory id) -> (text, line)`` a call gives with its candidates, each id's
    text the one earlier calls gave it (``said``): one id, one text, or the served file is
    refused as a log."""
    given = list(zip(c.candidates, c.carried)) if c.carried is not None else \
        [(text_id(t), t) for t in c.candidate_texts or ()]
    out: dict = {}
    for mid, text in given:
        if text is None:
            continue
        first = said.get((c.user_id, mid)) or out.get((c.user_id, mid)) or (text, c.line)
        if first[0] != text:
            raise InputError(f"memory {mid!r} of user {c.user_id!r} has another text than at line {first[1]}",
                             where=at(path, c.line, "candidates" if c.carried is not None else "candidate_texts"))
        out.setdefault((c.user_id, mid), first)
    return out


def _call_texts(store, users: "_Users", c: Call, k: int, m: int, path) -> list[str]:
    """The texts a call needs embedded (its query's, where STORE lacks it; its candidates'
    that STORE does not hold), once it resolves against STORE, else its one-line InputError."""
    texts: list[str] = []
    held = users.held_query(c)
    if held is None and c.query_text is None:
        users.get(c, "query_id")               # an unknown user: the one-line error
        raise InputError(f"unknown query id {c.query_id!r} for user {c.user_id!r} (give the call's text in "
                         "'query')",
                         where=at(path, c.line, "query_id"))
    texts += [c.query_text] if held is None else []
    if c.candidate_texts is not None:
        n = len(c.candidate_texts)
        texts += c.candidate_texts
    elif c.candidates is not None:  # ids or {"id", "text"}: STORE's memory where it holds the id, else the text
        n = len(c.candidates)
        carried = c.carried or (None,) * n
        # an id without a text needs STORE's user: for one STORE lacks, the one-line error with its hint
        stored = users.memories(c) if None in carried or store.has_user(c.user_id) else {}
        for mid, text in zip(c.candidates, carried):
            if mid in stored and text is not None and text != stored[mid]:
                raise InputError(f"memory {mid!r} of user {c.user_id!r} is given with another text than STORE's",
                                 where=at(path, c.line, "candidates"))
            if mid not in stored and text is None:
                raise InputError(f"unknown memory id {mid!r} for user {c.user_id!r} (give it with its text, "
                                 "{\"id\", \"text\"})", where=at(path, c.line, "candidates"))
            texts += [text] if mid not in stored else []
    else:
        n = min(k, len(users.get(c, "the retrieved candidates")[0].memory_ids))
    if m > n == k and c.candidates is None and c.candidate_texts is None:
        # k < m makes every retrieved call short: the arguments disagree, named as such. A call
        # that lists fewer than m, or whose user holds fewer, is served with all its candidates
        raise _ArgumentsDisagree(f"{named('m', m)} is more than this call's {n} candidates "
                                 f"(the retriever's top {named('k', k)})", where=at(path, c.line))
    return texts


def prepare_calls(store, calls: list[Call], path, k: int, m: int, notes: list | None = None,
                  routine: list | None = None, *, cache_dir=None, skipped: list | None = None) -> list[Prepared]:
    """Resolve every call against ``store`` (an embedding store): STORE's question when it
    holds the ``query_id``, else the ``query`` text; the listed candidates, the texts, or
    the base retriever's top ``k``. Every call is checked first (users, ids, ``k`` >= ``m``
    for a call the retriever fills); a call with fewer than ``m`` candidates (listed, or
    a user holding fewer) is prepared as it is, to be served with all of them. Then the
    texts are embedded with the store's model through the embedding cache
    (:func:`rmm_jax.data.embed.embed_texts`, rooted at ``cache_dir``), all at once. An error names ``k`` and
    ``m`` as arguments (``m=5``; from ``rmm-jax rerank`` ``--m 5``: :func:`rmm_jax.errors.named`).
    ``notes``, when given, gets the line saying how many texts the model cut
    (:func:`rmm_jax.data.embed.truncation_note`), and ``routine`` the one saying how many texts
    the store lacked (:meth:`rmm_jax.data.embed.EmbeddedTexts.lacks_note`, as ``replay`` says
    it: every day's new questions, nothing to look at; a ``new texts`` bar shows while they
    embed). ``calls`` is a list of :class:`Call` (from :func:`read_calls`, or a Python
    caller's own, whose fields are refused as a file's keys are: an InputError naming ``calls``
    and the call, before any work). ``skipped``, when given (``rerank --skip-invalid``), takes
    the :class:`Skipped` of each call that STORE cannot resolve (an unknown user, query or memory id,
    a text that contradicts STORE's or an earlier call's, a call repeating the identity of one it
    keeps), which is left out of what is returned instead of failing them all; arguments that
    disagree (``k`` < ``m``) still fail. Without it a repeated identity is refused, as a log
    names each call once."""
    _check_calls(calls, k, m)
    users = _Users(store, path)
    texts: list[str] = []
    said: dict[tuple[str, str], tuple[str, int]] = {}   # (user, memory id given with a text) -> (the text, its line)
    good, kept = [], {}
    for c in calls:
        try:
            if (c.user_id, call_key(c)) in kept:
                raise _repeat(c, kept[(c.user_id, call_key(c))], path)
            given = _texts_given(c, said, path)
            here = _call_texts(store, users, c, k, m, path)
        except InputError as e:
            if skipped is None or isinstance(e, _ArgumentsDisagree):
                raise
            skipped.append(Skipped(c.line, str(e), (c.user_id, call_key(c))))
            continue
        said.update(given)
        texts += here
        kept[(c.user_id, call_key(c))] = c.line
        good.append(c)
    calls = good
    vecs = embed_texts(texts, store.model, cache_dir=cache_dir, progress=True, desc="new texts")   # a bar, as replay
    if notes is not None and vecs.truncated:
        notes.append(vecs.truncated)
    lacks = vecs.lacks_note("queries and candidates the calls carry as text")
    if routine is not None and lacks:
        routine.append(lacks)
    queries = []
    for c in calls:
        row = users.held_query(c)
        queries.append(users.get(c, "query_id")[0].query_emb[row] if row is not None else vecs[c.query_text])
    retrieved = _retrieve(users, calls, queries, k)
    out = []
    for c, q, got in zip(calls, queries, retrieved):
        if c.candidate_texts is not None:
            out.append(Prepared(c, np.asarray(q, np.float32), np.stack([vecs[t] for t in c.candidate_texts]),
                                [text_id(t) for t in c.candidate_texts], list(c.candidate_texts)))
            continue
        if c.candidates is not None:
            u, m_index = users.get(c, "candidates")[:2] if store.has_user(c.user_id) else (None, {})
            rows = [u.memory_emb[m_index[x]] if x in m_index else vecs[t]
                    for x, t in zip(c.candidates, c.carried or (None,) * len(c.candidates))]
            out.append(Prepared(c, np.asarray(q, np.float32), np.asarray(np.stack(rows), np.float32),
                                list(c.candidates), list(c.carried) if c.carried is not None else None))
            continue
        u = users.get(c, "the retrieved candidates")[0]
        out.append(Prepared(c, np.asarray(q, np.float32), np.asarray(u.memory_emb[got], np.float32),
                            [u.memory_ids[j] for j in got], None))
    return out
