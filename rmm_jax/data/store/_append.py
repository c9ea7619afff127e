"""Growing an embedding store by a day's sessions and users (:func:`append_store`); what is
new and what stays is the package docstring's "Growing a store" (:mod:`rmm_jax.data.store`)."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from pathlib import Path

import numpy as np

from rmm_jax.data.granularity import build_memories
from rmm_jax.data.json_lines import MAX_FIRST_ERRORS
from rmm_jax.data.jsonl import no_text_error
from rmm_jax.data.store._read import open_store, read_rows
from rmm_jax.data.store._write import (
    _add_user_rows,
    _assemble_arrays,
    _check_dataset,
    _check_embedder,
    _check_user_ids,
    _jsonable,
    _Rows,
    _unknown_gold,
    answer_texts,
    store_writer,
)
from rmm_jax.data.types import Dataset, MemoryUnit, User, gold_matrix
from rmm_jax.data.words import count
from rmm_jax.deprecated import renamed_argument
from rmm_jax.errors import InputError
from rmm_jax.persist.atomic import atomic_dir, fsync_files

__all__ = ["APPENDABLE", "append_store"]

APPENDABLE = ("turn", "session")


@dataclasses.dataclass
class _Growth:
    """What one user of the dataset adds: its new memories and questions (with gold over
    ``bank``, the user's whole bank after the append)."""
    user: User
    memories: list[MemoryUnit]
    bank: list[MemoryUnit]


def _stored_units(rows: list[dict]) -> list[MemoryUnit]:
    return [MemoryUnit(str(r["id"]), r["text"], str(r.get("session_id")), r.get("timestamp"),
                       tuple(r.get("turn_ids") or ())) for r in rows]


def _gold_in_store(user: User, old_mems: list[dict], aside: dict, store) -> User:
    """``user`` with each question's gold ids that its file does not hold (``aside``:
    ``Dataset.gold_elsewhere``) resolved in the store's memories of the user (``old_mems``) and
    added after the file's gold: a turn id is gold when a memory lists it in ``turn_ids``, a
    session id names every turn of its memories. An id the store does not hold either is one
    line naming its file:line (``store``: the store's path, named in it)."""
    if not any((user.id, q.id) in aside for q in user.queries):
        return user
    turns: set[str] = set()
    sessions: dict[str, list[str]] = {}
    for r in old_mems:
        ids = [str(t) for t in r.get("turn_ids") or ()]
        turns.update(ids)
        sessions.setdefault(str(r.get("session_id")), []).extend(ids)
    queries = []
    for q in user.queries:
        extra = []
        for kind, name, where in aside.get((user.id, q.id), ()):
            if name not in (turns if kind == "turn" else sessions):
                raise _unknown_gold(user.id, (kind, name, where), f"neither this file nor STORE {store} holds it")
            extra += [name] if kind == "turn" else sessions[name]
        queries.append(dataclasses.replace(q, gold_turn_ids=tuple(dict.fromkeys(q.gold_turn_ids + tuple(extra))))
                       if extra else q)
    return dataclasses.replace(user, queries=tuple(queries))


def _grow_user(user: User, mems: list[MemoryUnit], old_mems: list[dict], old_queries: list[dict], where: str,
               counts: dict, located: dict) -> _Growth:
    """The new memories and questions of ``user`` against what the store holds of it. An
    error names the file:line of the session or question (``located``: ``Dataset.where``),
    else ``where`` (the spec). Gold from the store is resolved already (:func:`_gold_in_store`).

    A session or question the store holds is skipped only when it is the same: a session's
    memories (ids, texts, timestamps), a question's text, gold and abstention. The store keeps
    what it holds, so a repeat with other content would be dropped without a word (a date
    corrected, gold relabelled): it is an error instead, as a new text is."""
    def loc(kind: str, name: str) -> str:
        return located.get((user.id, kind, name), where)

    stored: dict[str, list] = {}
    for r in old_mems:
        stored.setdefault(str(r.get("session_id")), []).append((str(r["id"]), r["text"], r.get("timestamp")))
    by_session: dict[str, list[MemoryUnit]] = {}
    for mem in mems:
        by_session.setdefault(mem.session_id, []).append(mem)
    held_ids = {str(r["id"]) for r in old_mems}
    new: list[MemoryUnit] = []
    for sid, units in by_session.items():
        if sid in stored:
            if [(u.id, u.text) for u in units] != [m[:2] for m in stored[sid]]:
                raise InputError(f"session {sid!r} of user {user.id!r} is already in the store with other content "
                                 "(give every new session its own session_id)", where=loc("session", sid))
            stamps = [(u.timestamp, m[2]) for u, m in zip(units, stored[sid]) if u.timestamp != m[2]]
            if stamps:
                raise InputError(f"session {sid!r} of user {user.id!r} is already in the store with another "
                                 f"timestamp ({_stamp(stamps[0][1])} there, {_stamp(stamps[0][0])} here; give every "
                                 "new session its own session_id)", where=loc("session", sid))
            counts["sessions_repeated"] += 1
            continue
        clash = [u.id for u in units if u.id in held_ids]
        if clash:
            raise InputError(f"memory id {clash[0]!r} of user {user.id!r} (session {sid!r}) is already in the "
                             "store, in another session", where=loc("session", sid))
        counts["sessions"] += 1
        new += units
    held_q = {str(r["id"]): r for r in old_queries}
    bank = _stored_units(old_mems) + new
    queries = []
    for q in user.queries:
        if q.id in held_q:
            other = _other_in_question(q, held_q[q.id], bank)
            if other:
                raise InputError(f"question {q.id!r} of user {user.id!r} is already in the store with {other}",
                                 where=loc("question", q.id))
            counts["queries_repeated"] += 1
        else:
            queries.append(q)
    return _Growth(dataclasses.replace(user, queries=tuple(queries)), new, bank)


def _other_in_question(q, row: dict, bank: list[MemoryUnit]) -> str | None:
    """What the store's question ``row`` holds otherwise than ``q``, in words (None: the same
    question): its text, its abstention, its gold. Gold is compared as the turns it names, in
    any order (a store written without ``gold_turn_ids``: as the memories they make gold over
    ``bank``, the user's whole bank after the append)."""
    if row["text"] != q.text:
        return "another text"
    held = bool(row.get("abstention", False))
    if held != bool(q.abstention):
        return f"abstention {str(held).lower()}, not {str(not held).lower()} (give a changed question its own id)"
    if "gold_turn_ids" in row:
        held_gold, gold = [str(t) for t in row["gold_turn_ids"] or ()], list(q.gold_turn_ids)
    else:
        marks = gold_matrix((q,), bank)[0] if bank else ()
        held_gold, gold = [str(m) for m in row["gold_memory_ids"]], [m.id for m, g in zip(bank, marks) if g]
    if set(held_gold) == set(gold):
        return None
    return f"other gold ({_ids(held_gold)} there, {_ids(gold)} here; give a changed question its own id)"


def _ids(ids: list[str]) -> str:
    """A few ids for a one-line message: ``s1:0, s1:1`` (the first 3, then how many more), or ``none``."""
    more = f" and {len(ids) - 3} more" if len(ids) > 3 else ""
    return ", ".join(ids[:3]) + more if ids else "none"


def check_model(st, path, model_id: str, where: str = "model_id") -> None:
    """Refuse to append with another model than the store's (``st``, open at ``path``), as one
    line naming ``where``: the argument that gave the model (``rmm-jax embed``: ``--model``)."""
    if model_id != st.model:
        raise InputError(f"STORE {path} was embedded with model {st.model!r}, not {model_id!r}: a store "
                         "holds one embedding space", arg=where)


def append_store(path, dataset: Dataset, embedder, *, spec: str | None = None, progress=None,
                 skip_invalid: bool = False, log=None) -> dict:
    """Append ``dataset``'s new users, sessions and questions to the store at ``path`` (the
    package docstring's "Growing a store"), embedding only their texts with ``embedder`` (its
    ``model_id`` must be the store's). Returns ``{"manifest", "added"}``: the new manifest and what
    was added or skipped (``users``, ``sessions``, ``sessions_repeated``, ``memories``,
    ``queries``, ``queries_repeated``, ``users_without_text``, and, for a dataset whose loader
    skips messages (``jsonl:``), its ``skipped`` counts). The store's writer lock (:func:`store_writer`) is
    held from reading the store to renaming the grown one into place.

    The manifest's ``stats.appends`` gets one entry a grown store: ``spec``, these counts and
    ``seconds``. Its totals stay the store's: ``valid_queries``, ``queries_without_gold_memory``,
    ``abstention_queries`` and ``memories_per_user``, and, where the first build's dataset
    counted them, ``memories``, ``sessions``, ``turns``, ``questions``, ``no_gold`` and
    ``abstention`` grow by what the append added, ``lines`` by the file's lines, and
    ``skipped`` by the file's counts (``first_errors`` keeps the first few). A file that adds
    nothing (a day read again) leaves the store and its manifest as they were, so its skips
    are not counted twice. The first build's other counts (a ``locomo:`` store's
    ``per_category``, a ``log:`` store's ``records``) describe that build alone.

    A question's gold may name turns and sessions of its user that the store holds and
    ``dataset`` does not (``dataset.gold_elsewhere``, from ``load_jsonl(...,
    gold_elsewhere=True)``): they become its ``gold_memory_ids`` as the dataset's own do. An id
    the store does not hold for that user, or any such id of a user the store does not hold,
    is an error naming its file:line and key, before anything is embedded or written.

    A user with no message with text in the file (``dataset.no_text``, from ``load_jsonl(...,
    gold_elsewhere=True)``: a chat opened and abandoned, only a system prompt or an image) adds
    no memory; one the store holds is appended its questions as any other. A new one has
    nothing to retrieve from: an error naming its file:line, or, with ``skip_invalid``, left
    out with its questions and counted (``users_without_text``).

    ``progress`` (optional ``callable(str)``, e.g. to print to stderr) is called as the append
    goes with one progress line: what is new and what the store already holds, before the new
    texts are embedded (the result is what it returns). ``log`` is its old name (deprecated)."""
    progress = renamed_argument("append_store", "log", "progress", log, progress)
    _check_dataset(dataset)
    _check_embedder(embedder)
    if not Path(path).is_dir():
        return _append(path, dataset, embedder, spec, progress, skip_invalid)       # open_store's one-line error
    with store_writer(path):
        return _append(path, dataset, embedder, spec, progress, skip_invalid)


def _append(path, dataset: Dataset, embedder, spec: str | None, progress, skip_invalid: bool) -> dict:
    t0 = time.perf_counter()
    with open_store(path) as st:              # its files closed once the grown store is in place
        return _append_to(st, path, dataset, embedder, spec, progress, skip_invalid, t0)


def _append_to(st, path, dataset: Dataset, embedder, spec: str | None, progress, skip_invalid: bool,
               t0: float) -> dict:
    say = progress or (lambda msg: None)
    where = spec or "dataset"
    check_model(st, path, embedder.model_id, where="embedder")
    if st.granularity not in APPENDABLE:
        raise InputError(f"STORE {path} has {st.granularity!r} memories; appending keeps old memories as they are, "
                         f"which only {' and '.join(APPENDABLE)} granularity do", arg="path")
    if dataset.name == "log":
        raise InputError("a log's memories need no store append: replay and evaluate embed what the store lacks "
                         "from the records' texts", where=where)
    _check_user_ids(dataset, where)
    aside = dataset.gold_elsewhere
    counts = dict.fromkeys(("users", "sessions", "sessions_repeated", "memories", "queries", "queries_repeated",
                            "users_without_text"), 0)
    if "skipped" in dataset.stats:          # jsonl: the messages and parts the loader left out of this file
        counts["skipped"] = dataset.stats["skipped"]
    c = st.manifest["counts"]
    growth: dict[str, _Growth] = {}
    first_no_text = ""
    for u in dataset.users:
        mems = build_memories(u, st.granularity)
        if st.has_user(u.id):
            r = st._by_id[u.id]
            old_m = st._row_slice("memories.jsonl", c["memories"], ("user", "id", "text"), r["mem_start"],
                                  r["mem_end"])
            old_q = st._row_slice("queries.jsonl", c["queries"], ("user", "id", "text", "gold_memory_ids"),
                                  r["query_start"], r["query_end"])
            g = _grow_user(_gold_in_store(u, old_m, aside, path), mems, old_m, old_q, where, counts,
                           dataset.where)
        elif u.id in dataset.no_text:               # new, and nothing of it to retrieve from
            if not skip_invalid:
                raise no_text_error(u.id, dataset.no_text[u.id], f", and STORE {path} holds no user {u.id!r}: a new "
                                    "user needs memories to retrieve from (--skip-invalid skips it)")
            first_no_text = first_no_text or dataset.no_text[u.id]
            counts["users_without_text"] += 1
            continue
        else:
            for q in u.queries:                     # a new user's gold is in its file (load_jsonl's rule)
                for entry in aside.get((u.id, q.id), ())[:1]:
                    raise _unknown_gold(u.id, entry, f"this file holds no such {entry[0]}, and STORE {path} holds "
                                                     f"no user {u.id!r}")
            g = _Growth(u, mems, mems)
            if g.user.queries and not g.memories:   # as write_store refuses it: nothing to retrieve from
                raise InputError(f"user {u.id!r} has no turn to embed (no session with a message): a user needs "
                                 "memories to retrieve from", where=where)
            if g.memories or g.user.queries:        # a user with neither is not added, so not counted
                counts["users"] += 1
                counts["sessions"] += len({m.session_id for m in mems})
        if g.memories or g.user.queries:
            growth[u.id] = g
    rows = _Rows()                       # the new rows only, users in store order, then new users
    order = [uid for uid in st.user_ids if uid in growth] + [u.id for u in dataset.users
                                                             if u.id in growth and not st.has_user(u.id)]
    spans = {}
    for uid in order:
        g = growth[uid]
        m0, q0 = len(rows.memories), len(rows.queries)
        _add_user_rows(rows, g.user, g.memories, bank=g.bank)
        spans[uid] = (m0, len(rows.memories), q0, len(rows.queries))
    counts["memories"], counts["queries"] = len(rows.memories), len(rows.queries)
    say(f"new: {count(counts['users'], 'user')}, {count(counts['sessions'], 'session')} "
        f"({count(counts['memories'], 'memory')}), {count(counts['queries'], 'question')}; already in the store: "
        f"{count(counts['sessions_repeated'], 'session')}, {count(counts['queries_repeated'], 'question')}")
    if counts["users_without_text"]:          # what --skip-invalid dropped: a note, read under --quiet too
        say(f"note: skipped {count(counts['users_without_text'], 'new user')} with no message with text (first: "
            f"{first_no_text})")
    if not order:
        return {"manifest": st.manifest, "added": counts}
    mem_emb, qry_emb = _assemble_arrays(embedder.encode([r["text"] for r in rows.memories], desc="new memories"),
                                        embedder.encode([r["text"] for r in rows.queries], desc="new questions"),
                                        rows, st.model, st.dim, "the store's dim")
    ans_emb = None
    if st.answer_emb is not None:
        texts = answer_texts(Dataset(dataset.name, tuple(growth[uid].user for uid in order)))
        _, ans_emb = _assemble_arrays(mem_emb, embedder.encode(texts, desc="new answers"), rows, st.model, st.dim,
                                      "the store's dim")
    manifest = _write_grown(st, rows, spans, mem_emb, qry_emb, ans_emb, order, spec, counts,
                            round(time.perf_counter() - t0, 3), dataset.stats.get("lines"))
    return {"manifest": manifest, "added": counts}


def _copy_lines(st, name: str, offsets: np.ndarray, start: int, end: int, dst) -> None:
    dst.write(st._files.read(name, int(offsets[start]), int(offsets[end])))


def _put(out, at: int, old, o0: int, o1: int, new, n0: int, n1: int, fd: int | None = None) -> int:
    """Rows ``o0:o1`` of ``old`` (bit for bit; read from ``fd``, the store's open file of it),
    then ``n0:n1`` of ``new``, into ``out`` from row ``at``; returns the next free row."""
    out[at:at + o1 - o0] = read_rows(old, o0, o1, fd)
    at += o1 - o0
    out[at:at + n1 - n0] = new[n0:n1]
    return at + n1 - n0


def _reserved_memmap(path: Path, shape: tuple[int, int]) -> np.memmap:
    """A new float32 ``.npy`` file of ``shape``, mapped for writing, its blocks reserved on
    disk first: a sparse mapped file on a full disk dies of SIGBUS at the first page written
    (``Bus error``, no message, the temporary directory left behind), where a reservation
    raises ENOSPC, which the caller's ``atomic_dir`` cleans up and the CLI words in one line.
    A system or file system that cannot reserve (macOS; EOPNOTSUPP, EINVAL) is written as before."""
    out = np.lib.format.open_memmap(path, "w+", np.float32, shape)
    if not hasattr(os, "posix_fallocate"):      # macOS: no reservation
        return out
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)
    return out


def _stamp(value) -> str:
    """A session's timestamp in a message: its repr, or ``none`` (Python's ``None`` read as code)."""
    return "none" if value is None else repr(value)


def _add_totals(stats: dict, rows: _Rows, counts: dict, lines: int | None) -> None:
    """The first build's dataset counts in ``stats`` (a manifest's), grown by one append: what
    it added to the store (``rows``, ``counts``), the lines its file had and what its loader
    skipped. A count the first build's dataset had not is left out (a ``locomo:`` store has
    no ``turns``), except ``skipped``, which the first append from a ``jsonl:`` file starts."""
    grown = {"memories": len(rows.memories), "sessions": counts["sessions"],
             "turns": sum(len(r["turn_ids"]) for r in rows.memories),
             "questions": counts["queries"], "no_gold": rows.no_gold, "abstention": rows.abstention,
             "lines": lines or 0}
    for key, add in grown.items():
        if isinstance(stats.get(key), int):
            stats[key] += add
    if "skipped" in counts:
        old = stats.get("skipped") or {}
        new = counts["skipped"]
        stats["skipped"] = {**{k: old.get(k, 0) + v for k, v in new.items() if k != "first_errors"},
                            "first_errors": [*old.get("first_errors", []), *new["first_errors"]][:MAX_FIRST_ERRORS]}


def _write_grown(st, rows: _Rows, spans: dict, mem_emb, qry_emb, ans_emb, order: list, spec, counts: dict,
                 seconds: float, lines: int | None = None) -> dict:
    """Write the grown store next to ``st`` and rename it into place: per user, its old rows
    (copied, bit for bit) then its new ones; new users last. The manifest's stats record the
    append (``appends``) and grow its totals (:func:`_add_totals`; ``lines``: the file's)."""
    c = st.manifest["counts"]
    n_mem, n_q = c["memories"] + len(rows.memories), c["queries"] + len(rows.queries)
    old_users = {u["id"]: u for u in st._users}
    none = {"mem_start": 0, "mem_end": 0, "query_start": 0, "query_end": 0}
    all_ids = list(st.user_ids) + [uid for uid in order if uid not in old_users]
    moffs, qoffs = st._line_offsets("memories.jsonl", c["memories"]), st._line_offsets("queries.jsonl", c["queries"])
    users_out, m_at, q_at = [], 0, 0
    with atomic_dir(st.path) as tmp:
        out_m = _reserved_memmap(tmp / "memories.npy", (n_mem, st.dim))
        out_q = _reserved_memmap(tmp / "queries.npy", (n_q, st.dim))
        out_a = None if ans_emb is None else _reserved_memmap(tmp / "answers.npy", (n_q, st.dim))
        with open(tmp / "memories.jsonl", "wb") as fm, open(tmp / "queries.jsonl", "wb") as fq:
            for uid in all_ids:
                old = old_users.get(uid, none)
                nm0, nm1, nq0, nq1 = spans.get(uid, (0, 0, 0, 0))
                m_end = _put(out_m, m_at, st.memory_emb, old["mem_start"], old["mem_end"], mem_emb, nm0, nm1,
                             st._files.fd("memories.npy"))
                q_end = _put(out_q, q_at, st.query_emb, old["query_start"], old["query_end"], qry_emb, nq0, nq1,
                             st._files.fd("queries.npy"))
                if out_a is not None:
                    _put(out_a, q_at, st.answer_emb, old["query_start"], old["query_end"], ans_emb, nq0, nq1,
                         st._files.fd("answers.npy"))
                _copy_lines(st, "memories.jsonl", moffs, old["mem_start"], old["mem_end"], fm)
                _copy_lines(st, "queries.jsonl", qoffs, old["query_start"], old["query_end"], fq)
                fm.writelines((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in rows.memories[nm0:nm1])
                fq.writelines((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in rows.queries[nq0:nq1])
                users_out.append({"id": uid, "mem_start": m_at, "mem_end": m_end, "query_start": q_at,
                                  "query_end": q_end})
                m_at, q_at = m_end, q_end
        for out in (out_m, out_q, out_a):
            if out is not None:
                out.flush()
        del out_m, out_q, out_a
        (tmp / "users.json").write_text(json.dumps(users_out, indent=1) + "\n")
        sizes = [u["mem_end"] - u["mem_start"] for u in users_out]
        stats = dict(st.manifest.get("stats") or {})
        for key, add in (("valid_queries", rows.valid), ("queries_without_gold_memory", rows.no_gold),
                         ("abstention_queries", rows.abstention)):
            stats[key] = stats.get(key, 0) + add
        stats["memories_per_user"] = {"min": int(min(sizes, default=0)), "max": int(max(sizes, default=0)),
                                      "mean": float(np.mean(sizes)) if sizes else 0.0}
        stats["appends"] = [*stats.get("appends", []), {"spec": spec, **counts, "seconds": seconds}]
        _add_totals(stats, rows, counts, lines)
        manifest = {**st.manifest, "counts": {"users": len(users_out), "memories": n_mem, "queries": n_q},
                    "stats": _jsonable(stats)}
        # manifest last: a directory with a manifest is complete
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        fsync_files(tmp)
    return manifest
