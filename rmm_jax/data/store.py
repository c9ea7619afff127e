"""The embedding store: a dataset's memories and queries, embedded once, on disk.

Layout of a store directory (written whole by :func:`write_store` through
:func:`rmm_jax.persist.atomic.atomic_dir`, so a failure leaves no partial store; one
writer at a time, holding the lock file ``.NAME.lock`` beside it, :func:`store_writer`)::

    manifest.json    {"format": "rmm-jax-embedding-store", "version": 1, "model", "dim",
                      "granularity", "dataset", "spec",
                      "counts": {"users", "memories", "queries"}, "stats"}
    memories.npy     (N_mem, d) float32, all users concatenated
    queries.npy      (N_q, d) float32
    users.json       [{"id", "mem_start", "mem_end", "query_start", "query_end"}, ...]
    memories.jsonl   {"user", "id", "session_id", "timestamp", "turn_ids", "text"} per row
    queries.jsonl    {"user", "id", "text", "category", "date", "gold_turn_ids",
                      "gold_memory_ids", "abstention"} per row

``gold_memory_ids`` are the ids of that user's memories holding a gold turn
(:func:`rmm_jax.data.types.gold_matrix`).

:func:`open_store` validates a store and returns an :class:`EmbeddingStore`; its
``.user(id)`` gives one user's arrays (:class:`UserData`), the unit that retrieval,
reranking and the metrics work on.

Example::

    >>> store = open_store("store", expect_model="sentence-transformers/all-MiniLM-L6-v2")  # doctest: +SKIP
    >>> u = store.user(store.user_ids[0])                      # doctest: +SKIP
    >>> u.memory_emb.shape, u.gold.shape                       # doctest: +SKIP
    ((419, 384), (199, 419))
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import os
import shutil
import time
from pathlib import Path

import numpy as np

from rmm_jax.data.granularity import GRANULARITIES, build_memories
from rmm_jax.data.types import Dataset, MemoryUnit, User, gold_matrix
from rmm_jax.data.words import count
from rmm_jax.errors import InputError, at
from rmm_jax.persist.atomic import atomic_dir, fsync_files, leftovers, make_dirs
from rmm_jax.persist.lock import WriterLock

__all__ = ["FORMAT", "VERSION", "GRANULARITIES", "write_store", "open_store", "EmbeddingStore",
           "UserData"]

FORMAT = "rmm-jax-embedding-store"
VERSION = 1


# --------------------------------------------------------------------------- writing
@dataclasses.dataclass
class _Rows:
    """The metadata rows of a store being built, all users concatenated."""

    memories: list[dict] = dataclasses.field(default_factory=list)   # memories.jsonl
    queries: list[dict] = dataclasses.field(default_factory=list)    # queries.jsonl
    users: list[dict] = dataclasses.field(default_factory=list)      # users.json
    memories_per_user: list[int] = dataclasses.field(default_factory=list)
    valid: int = 0           # queries with a gold memory, not abstentions
    no_gold: int = 0         # queries without a gold memory, not abstentions
    abstention: int = 0


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise InputError(f"unknown granularity {granularity!r}; choose one of "
                         f"{', '.join(GRANULARITIES)}", arg="granularity")


def _check_user_ids(dataset: Dataset, where: str) -> None:
    seen = set()
    for u in dataset.users:
        if u.id in seen:
            raise InputError(f"duplicate user id {u.id!r} in dataset {dataset.name!r}", where=where)
        seen.add(u.id)


def _user_memories(user: User, granularity: str, embed_fn, where: str,
                   granularity_kwargs: dict) -> list[MemoryUnit]:
    """One user's memories at ``granularity``; memory and query ids must be unique."""
    mems = list(build_memories(user, granularity, embed_fn, **granularity_kwargs))
    ids = [m.id for m in mems]
    if len(set(ids)) != len(ids):
        raise InputError(f"duplicate memory ids for user {user.id!r}", where=where)
    qids = [q.id for q in user.queries]
    if len(set(qids)) != len(qids):
        raise InputError(f"duplicate query ids for user {user.id!r}", where=where)
    return mems


def _add_user_rows(rows: _Rows, user: User, mems: list[MemoryUnit], bank: list[MemoryUnit] | None = None) -> None:
    """Append one user's memory, query and user rows (with gold memory ids) to ``rows``.
    ``bank``: the memories gold is looked up in (default ``mems``; a store append gives
    the user's old memories and the new ones)."""
    bank = mems if bank is None else bank
    gold = gold_matrix(user.queries, bank) if bank and user.queries else \
        np.zeros((len(user.queries), len(bank)), bool)
    ids = [m.id for m in bank]
    m0, q0 = len(rows.memories), len(rows.queries)
    for m in mems:
        rows.memories.append({"user": user.id, "id": m.id, "session_id": m.session_id,
                              "timestamp": m.timestamp, "turn_ids": list(m.turn_ids),
                              "text": m.text})
    for i, q in enumerate(user.queries):
        g = [ids[j] for j in np.flatnonzero(gold[i])]
        rows.queries.append({"user": user.id, "id": q.id, "text": q.text, "category": q.category,
                             "date": q.date, "gold_turn_ids": list(q.gold_turn_ids),
                             "gold_memory_ids": g, "abstention": bool(q.abstention)})
        if q.abstention:
            rows.abstention += 1
        elif not g:
            rows.no_gold += 1
        else:
            rows.valid += 1
    rows.users.append({"id": user.id, "mem_start": m0, "mem_end": len(rows.memories),
                       "query_start": q0, "query_end": len(rows.queries)})
    rows.memories_per_user.append(len(mems))


def _unknown_gold(user_id: str, entry: tuple[str, str, str], why: str = "") -> InputError:
    """The error of one gold id a question names outside its file (an entry of
    :attr:`~rmm_jax.data.types.Dataset.gold_elsewhere`: kind, id, file:line and key) that
    nothing resolves: the ``jsonl:`` loader's own line, plus ``why`` in parentheses."""
    kind, name, where = entry
    return InputError(f"unknown {kind} id {name!r} for user {user_id!r}" + (f" ({why})" if why else ""), where=where)


def _check_gold_in_file(dataset: Dataset) -> None:
    """A new store has nothing but ``dataset`` to resolve gold in: gold a loader kept aside
    (``gold_elsewhere``, for ``embed --into``) is the loader's own error."""
    for (uid, _), entries in dataset.gold_elsewhere.items():
        raise _unknown_gold(uid, entries[0])


def _check_not_empty(dataset: Dataset, where: str) -> None:
    """A store needs users, and each user memories to retrieve from: an empty dataset, or a
    user without a turn (a conversation with no session), is refused in one line instead of
    a store that every later verb finds empty."""
    if not dataset.users:
        raise InputError("holds no users: nothing to embed", where=where)
    bare = next((u.id for u in dataset.users if not any(s.turns for s in u.sessions)), None)
    if bare is not None:
        raise InputError(f"user {bare!r} has no turn to embed (no session with a message): a user needs "
                         "memories to retrieve from", where=where)


def _build_rows(dataset: Dataset, granularity: str, embed_fn, where: str,
                granularity_kwargs: dict) -> _Rows:
    """Build every user's memories and the rows describing them."""
    rows = _Rows()
    for u in dataset.users:
        _add_user_rows(rows, u, _user_memories(u, granularity, embed_fn, where, granularity_kwargs))
    return rows


def _embed_rows(embedder, rows: _Rows) -> tuple:
    """Embed the memory texts, then the query texts (as the embedder returns them)."""
    mem_emb = embedder.encode([r["text"] for r in rows.memories], desc="memories")
    qry_emb = embedder.encode([r["text"] for r in rows.queries], desc="queries")
    return mem_emb, qry_emb


def _assemble_arrays(mem_emb, qry_emb, rows: _Rows, model_id: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Check the embeddings are finite and shape them ``(n, dim)`` float32."""
    for name, arr in (("memories", mem_emb), ("queries", qry_emb)):
        if not np.isfinite(np.asarray(arr)).all():
            raise InputError(f"NaN/Inf in {name} embeddings from model {model_id!r}", arg="embedder")
    return (np.asarray(mem_emb, np.float32).reshape(len(rows.memories), dim),
            np.asarray(qry_emb, np.float32).reshape(len(rows.queries), dim))


def _manifest(dataset: Dataset, granularity: str, model_id: str, dim: int, spec: str | None,
              rows: _Rows, granularity_kwargs: dict, seconds: dict) -> dict:
    """The manifest: format, model, counts, and the dataset's stats plus the store's own."""
    counts = rows.memories_per_user
    stats = dict(dataset.stats)
    stats.update({
        "valid_queries": rows.valid,
        "queries_without_gold_memory": rows.no_gold,
        "abstention_queries": rows.abstention,
        "memories_per_user": {"min": int(min(counts, default=0)),
                              "max": int(max(counts, default=0)),
                              "mean": float(np.mean(counts)) if counts else 0.0},
        "granularity_options": dict(granularity_kwargs),
        "seconds": seconds,
    })
    return {
        "format": FORMAT, "version": VERSION, "model": model_id, "dim": dim,
        "granularity": granularity, "dataset": dataset.name, "spec": spec,
        "counts": {"users": len(dataset.users), "memories": len(rows.memories),
                   "queries": len(rows.queries)},
        "stats": _jsonable(stats),
    }


def _write_jsonl(path: Path, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False))
            f.write("\n")


@contextlib.contextmanager
def store_writer(path):
    """``with store_writer(path):`` the one writer of the embedding store at ``path``: a lock
    file beside it (``.NAME.lock``: the store directory itself is swapped whole), so two
    ``embed --into`` runs cannot both grow the old store and the second's rename lose the
    first's additions. Taking it removes what a killed writer left beside the store
    (``.NAME.tmp-*``, ``.NAME.old-*``); a second writer gets one line naming the first's pid."""
    p = Path(path)
    make_dirs(p.parent)
    lock = WriterLock(p.parent / f".{p.name}.lock", lambda holder: InputError(
        f"in use by pid {holder.get('pid', '?')} (another embed is writing this store; retry when it ends)",
        where=str(p)))
    with lock.hold():
        for q in leftovers(p.parent):
            if q.name.startswith((f".{p.name}.tmp-", f".{p.name}.old-")):
                shutil.rmtree(q, ignore_errors=True) if q.is_dir() else q.unlink(missing_ok=True)
        yield


def _write_files(path, mem_emb: np.ndarray, qry_emb: np.ndarray, rows: _Rows,
                 manifest: dict, ans_emb: np.ndarray | None = None) -> None:
    """Write the store directory at ``path`` whole, or nothing (see the module docstring)."""
    with store_writer(path), atomic_dir(path) as tmp:
        np.save(tmp / "memories.npy", mem_emb)
        np.save(tmp / "queries.npy", qry_emb)
        if ans_emb is not None:
            np.save(tmp / "answers.npy", ans_emb)
        (tmp / "users.json").write_text(json.dumps(rows.users, indent=1) + "\n")
        _write_jsonl(tmp / "memories.jsonl", rows.memories)
        _write_jsonl(tmp / "queries.jsonl", rows.queries)
        # manifest last: a directory with a manifest is complete
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        fsync_files(tmp)


def answer_texts(dataset: Dataset) -> list[str]:
    """Per query, in store order: the question followed by its reference answer (the
    simulated response of the ``answer`` citation model; just the question when the
    dataset gives no answer)."""
    return [f"{q.text} {q.answer or ''}".strip() for u in dataset.users for q in u.queries]


def write_store(path, dataset: Dataset, granularity: str, embedder, *, spec: str | None = None,
                log=None, answers: bool = False, **granularity_kwargs) -> dict:
    """Build memories at ``granularity``, embed memories and queries, write the store.

    Args:
      path: output directory (replaced atomically if it exists).
      dataset: a :class:`~rmm_jax.data.types.Dataset`.
      granularity: one of :data:`~rmm_jax.data.granularity.GRANULARITIES`.
      embedder: an :class:`rmm_jax.data.embed.Embedder` (``.encode``, ``.model_id``, ``.dim``).
      spec: the dataset spec, recorded in the manifest.
      log: optional ``callable(str)`` for progress lines (e.g. to stderr).
      answers: also embed each question with its reference answer (:func:`answer_texts`)
        into ``answers.npy``, for the ``answer`` citation model.
      granularity_kwargs: passed to
        :func:`~rmm_jax.data.granularity.build_memories` (``segment_threshold``,
        ``merge_threshold``).

    Returns:
      The manifest written.
    """
    _check_granularity(granularity)
    say = log or (lambda msg: None)
    where = spec or "dataset"
    t0 = time.perf_counter()
    _check_user_ids(dataset, where)
    _check_gold_in_file(dataset)
    _check_not_empty(dataset, where)
    embed_fn = embedder.encode if granularity == "segment" else None
    rows = _build_rows(dataset, granularity, embed_fn, where, granularity_kwargs)
    t_build = time.perf_counter() - t0
    say(f"{count(len(dataset.users), 'user')}, {count(len(rows.memories), granularity + ' memory')}, "
        f"{count(len(rows.queries), 'query')} ({t_build:.1f}s to build)")

    t1 = time.perf_counter()
    mem_emb, qry_emb = _embed_rows(embedder, rows)
    t_embed = time.perf_counter() - t1
    dim = int(embedder.dim)
    mem_emb, qry_emb = _assemble_arrays(mem_emb, qry_emb, rows, embedder.model_id, dim)
    ans_emb = None
    if answers:
        _, ans_emb = _assemble_arrays(mem_emb, embedder.encode(answer_texts(dataset), desc="answers"), rows,
                                      embedder.model_id, dim)
    manifest = _manifest(dataset, granularity, embedder.model_id, dim, spec, rows,
                         granularity_kwargs,
                         {"build": round(t_build, 3), "embed": round(t_embed, 3)})
    if answers:
        manifest["answers"] = True
    _write_files(path, mem_emb, qry_emb, rows, manifest, ans_emb)
    return manifest


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


# --------------------------------------------------------------------------- reading
def _parse_row(line, path, ln: int, keys) -> dict:
    """One JSONL row (str or bytes) that must be an object holding ``keys``."""
    try:
        r = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg}", where=at(path, ln)) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start})", where=at(path, ln)) from None
    if not isinstance(r, dict):
        raise InputError("expected a JSON object", where=at(path, ln))
    for k in keys:
        if k not in r:
            raise InputError("missing key", where=at(path, ln, k))
    return r


@dataclasses.dataclass(frozen=True)
class UserData:
    """One user's slice of a store.

    ``gold[i, j]`` is True when memory ``j`` holds a gold turn of query ``i``. A query
    counts for retrieval metrics when ``valid[i]``: at least one gold memory and not an
    abstention question.
    """
    user_id: str
    memory_emb: np.ndarray      # (n_m, d) float32
    query_emb: np.ndarray       # (n_q, d) float32
    gold: np.ndarray            # (n_q, n_m) bool
    memory_ids: tuple[str, ...]
    query_ids: tuple[str, ...]
    categories: tuple[str, ...]
    abstention: np.ndarray      # (n_q,) bool

    @property
    def num_gold(self) -> np.ndarray:
        return self.gold.sum(axis=1).astype(np.int32)

    @property
    def valid(self) -> np.ndarray:
        return (self.num_gold > 0) & ~self.abstention


class EmbeddingStore:
    """A validated store directory; use :func:`open_store`."""

    def __init__(self, path: Path, manifest: dict, users: list[dict], memory_emb, query_emb, answer_emb=None):
        self.path = path
        self.manifest = manifest
        self.dim = int(manifest["dim"])
        self.model = manifest["model"]
        self.granularity = manifest.get("granularity")
        self._users = users
        self._by_id = {u["id"]: u for u in users}
        self.user_ids = tuple(u["id"] for u in users)
        self.memory_emb = memory_emb
        self.query_emb = query_emb
        self.answer_emb = answer_emb        # (N_q, d) question + answer embeddings, or None
        self._mem_meta = None
        self._qry_meta = None
        self._offsets_cache: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        c = self.manifest["counts"]
        return (f"EmbeddingStore({str(self.path)!r}, model={self.model!r}, dim={self.dim}, "
                f"granularity={self.granularity!r}, users={c['users']}, "
                f"memories={c['memories']}, queries={c['queries']})")

    def has_user(self, user_id) -> bool:
        return str(user_id) in self._by_id

    @property
    def bank_sizes(self) -> dict[str, int]:
        """Number of memories of each user, without reading the metadata files."""
        return {u["id"]: u["mem_end"] - u["mem_start"] for u in self._users}

    def _jsonl(self, name: str, n: int, keys: tuple[str, ...]) -> list[dict]:
        p = self.path / name
        if not p.is_file():
            raise InputError("missing file of the embedding store", where=at(p))
        rows = []
        with open(p, "rb") as f:          # bytes: a line that is not UTF-8 is _parse_row's one-line error
            for ln, line in enumerate(f, 1):
                rows.append(_parse_row(line, p, ln, keys))
        if len(rows) != n:
            raise InputError(f"{len(rows)} rows but the manifest counts {n}", where=at(p))
        return rows

    def _line_offsets(self, name: str, n: int) -> np.ndarray:
        """Byte offset of every row of a JSONL file (plus the end): 8 bytes per row, so
        :meth:`user` reads one user's rows without holding every row in memory."""
        if name not in self._offsets_cache:
            p = self.path / name
            if not p.is_file():
                raise InputError("missing file of the embedding store", where=at(p))
            offs, pos = [0], 0
            with open(p, "rb") as f:
                for line in f:
                    pos += len(line)
                    offs.append(pos)
            if len(offs) - 1 != n:
                raise InputError(f"{len(offs) - 1} rows but the manifest counts {n}", where=at(p))
            self._offsets_cache[name] = np.asarray(offs, np.int64)
        return self._offsets_cache[name]

    def _row_slice(self, name: str, n: int, keys: tuple[str, ...], start: int, end: int) -> list[dict]:
        """Rows ``start:end`` of a JSONL file, validated like :meth:`_jsonl`."""
        offs = self._line_offsets(name, n)
        p = self.path / name
        with open(p, "rb") as f:
            f.seek(int(offs[start]))
            blob = f.read(int(offs[end] - offs[start]))
        rows = []
        for i, line in enumerate(blob.splitlines(keepends=True)[:end - start]):
            ln = start + i + 1
            rows.append(_parse_row(line, p, ln, keys))
        return rows

    @property
    def memories(self) -> list[dict]:
        """Rows of ``memories.jsonl`` (parsed on first use)."""
        if self._mem_meta is None:
            self._mem_meta = self._jsonl("memories.jsonl", self.manifest["counts"]["memories"],
                                         ("user", "id", "text"))
        return self._mem_meta

    @property
    def queries(self) -> list[dict]:
        """Rows of ``queries.jsonl`` (parsed on first use)."""
        if self._qry_meta is None:
            self._qry_meta = self._jsonl("queries.jsonl", self.manifest["counts"]["queries"],
                                         ("user", "id", "text", "gold_memory_ids"))
        return self._qry_meta

    def query_count(self, user_id) -> int:
        """How many questions the store holds for one user (from ``users.json``; nothing read)."""
        u = self._by_id.get(str(user_id))
        if u is None:
            self.user(user_id)                         # the one-line error naming the store
        return u["query_end"] - u["query_start"]

    def _memory_slice(self, start: int, end: int) -> list[dict]:
        if self._mem_meta is not None:
            return self._mem_meta[start:end]
        return self._row_slice("memories.jsonl", self.manifest["counts"]["memories"], ("user", "id", "text"),
                               start, end)

    def memory_rows(self, user_id) -> list[dict]:
        """One user's rows of ``memories.jsonl`` (id, session, text, ...), in bank order."""
        if str(user_id) not in self._by_id:
            self.user(user_id)                         # the one-line error naming the store
        u = self._by_id[str(user_id)]
        return self._memory_slice(u["mem_start"], u["mem_end"])

    def user(self, user_id) -> UserData:
        """One user's embeddings, gold matrix and ids."""
        uid = str(user_id)
        if uid not in self._by_id:
            shown = ", ".join(self.user_ids[:5]) + (" ..." if len(self.user_ids) > 5 else "")
            raise InputError(f"unknown user id {uid!r} (store has {len(self.user_ids)} users: "
                             f"{shown})", where=str(self.path))
        u = self._by_id[uid]
        ms, me, qs, qe = u["mem_start"], u["mem_end"], u["query_start"], u["query_end"]
        c = self.manifest["counts"]
        # Only this user's rows are read (unless the whole lists were loaded already).
        mems = self._memory_slice(ms, me)
        qrys = self._qry_meta[qs:qe] if self._qry_meta is not None else \
            self._row_slice("queries.jsonl", c["queries"], ("user", "id", "text", "gold_memory_ids"), qs, qe)
        qpath = self.path / "queries.jsonl"
        for off, r in enumerate(mems):
            if str(r["user"]) != uid:
                raise InputError(f"row belongs to user {r['user']!r}, users.json says {uid!r}",
                                 where=at(self.path / "memories.jsonl", ms + off + 1))
        mem_ids = tuple(str(r["id"]) for r in mems)
        col = {m: j for j, m in enumerate(mem_ids)}
        gold = np.zeros((len(qrys), len(mems)), bool)
        for i, r in enumerate(qrys):
            if str(r["user"]) != uid:
                raise InputError(f"row belongs to user {r['user']!r}, users.json says {uid!r}",
                                 where=at(qpath, qs + i + 1))
            g = r["gold_memory_ids"]
            if not isinstance(g, list):
                raise InputError("expected a list", where=at(qpath, qs + i + 1, "gold_memory_ids"))
            for m in g:
                if m not in col:
                    raise InputError(f"unknown memory id {m!r} for user {uid!r}",
                                     where=at(qpath, qs + i + 1, "gold_memory_ids"))
                gold[i, col[m]] = True
        return UserData(
            user_id=uid,
            memory_emb=read_rows(self.memory_emb, ms, me),
            query_emb=read_rows(self.query_emb, qs, qe),
            gold=gold,
            memory_ids=mem_ids,
            query_ids=tuple(str(r["id"]) for r in qrys),
            categories=tuple(str(r.get("category") or "") for r in qrys),
            abstention=np.array([bool(r.get("abstention", False)) for r in qrys], bool),
        )

    def user_answers(self, user_id) -> np.ndarray:
        """One user's question + answer embeddings (n_q, d), for the ``answer`` citation model.
        An unknown user is the one-line error of :meth:`user` (it was a KeyError)."""
        if self.answer_emb is None:
            raise InputError("store holds no answer embeddings; rebuild it with `rmm-jax embed ... --answers`",
                             where=str(self.path))
        if str(user_id) not in self._by_id:
            self.user(user_id)                         # the one-line error naming the store
        u = self._by_id[str(user_id)]
        return read_rows(self.answer_emb, u["query_start"], u["query_end"])

    def iter_users(self):
        """Iterate over :class:`UserData` of every user, in store order."""
        for uid in self.user_ids:
            yield self.user(uid)


def read_rows(mm: np.memmap, start: int, end: int) -> np.ndarray:
    """Rows ``start:end`` of a memory-mapped ``.npy`` array, read with ``pread``.

    Touching the memory map would make its pages resident in this process, so reading
    every user once would grow the RSS by the whole store; read pages stay in the
    kernel's page cache instead and memory stays bounded with the number of users.
    """
    if not isinstance(mm, np.memmap) or mm.filename is None:
        return np.asarray(mm[start:end])
    width = int(np.prod(mm.shape[1:], dtype=np.int64))
    row = width * mm.dtype.itemsize
    with open(mm.filename, "rb") as f:
        buf = os.pread(f.fileno(), (end - start) * row, mm.offset + start * row)
    return np.frombuffer(buf, mm.dtype).reshape((end - start,) + mm.shape[1:])


def _load_npy(path: Path, rows: int, dim: int, name: str):
    if not path.is_file():
        raise InputError("missing file of the embedding store", where=at(path))
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise InputError(f"not a readable .npy array ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})",
                         where=at(path)) from None
    if arr.dtype != np.float32:
        raise InputError(f"dtype {arr.dtype}, expected float32", where=at(path))
    if arr.shape != (rows, dim):
        raise InputError(f"shape {arr.shape} does not match the manifest ({rows} {name}, dim {dim})",
                         where=at(path))
    step = max(1, (1 << 24) // max(dim, 1))
    for s in range(0, rows, step):
        block = read_rows(arr, s, min(rows, s + step))
        ok = np.isfinite(block).all(axis=1)
        if not ok.all():
            bad = s + int(np.flatnonzero(~ok)[0])
            raise InputError(f"NaN/Inf in the embeddings (row {bad}, and maybe others); "
                             f"re-run `rmm-jax embed`", where=at(path))
    return arr


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_store(path) -> bool:
    """Whether directory ``path`` holds an embedding store: a ``manifest.json`` of this format
    (any version, valid or not). ``embed --out`` replaces only such a directory (or an empty
    one): anything else there, a policy store or someone's files, is not its to delete."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def open_store(path, expect_model: str | None = None, expect_dim: int | None = None) -> EmbeddingStore:
    """Open and validate an embedding store.

    Checks: the manifest exists and parses, its format and version, that the arrays are
    float32 with the manifest's counts and dim, finite values, that ``users.json``
    tiles the rows, and optionally the model and dim the caller expects. Every failure
    is an :class:`InputError` naming the file (or the store and the mismatch).
    """
    # by name: None was Path's TypeError, expect_dim="abc" int()'s ValueError (after the manifest);
    # written out, not core.checks: `embed` reads stores without importing JAX
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"expected the store's directory (a str or Path), got {type(path).__name__} {path!r}"[:100],
                         arg="path")
    if expect_dim is not None and not (isinstance(expect_dim, numbers.Integral)
                                       and not isinstance(expect_dim, (bool, np.bool_)) and expect_dim >= 1):
        raise InputError(f"must be an int >= 1 or None, got {type(expect_dim).__name__} {expect_dim!r}"[:80],
                         where="expect_dim")
    root = Path(path)
    if not root.exists():
        raise InputError("no such embedding store (create one with `rmm-jax embed`)", where=at(root))
    if not root.is_dir():
        raise InputError("not an embedding store directory", where=at(root))
    mpath = root / "manifest.json"
    if not mpath.is_file():
        raise InputError("missing manifest.json: not an embedding store (or an incomplete one)",
                         where=at(root))
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg}", where=at(mpath, e.lineno)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read manifest ({e})", where=at(mpath)) from None
    if not isinstance(manifest, dict):
        raise InputError("expected a JSON object", where=at(mpath))
    if manifest.get("format") != FORMAT:
        raise InputError(f"format {manifest.get('format')!r}, expected {FORMAT!r}",
                         where=at(mpath, key="format"))
    if manifest.get("version") != VERSION:
        raise InputError(f"unsupported store version {manifest.get('version')!r} (this rmm-jax "
                         f"reads version {VERSION})", where=at(mpath, key="version"))
    for key in ("model", "dim", "counts"):
        if key not in manifest:
            raise InputError("missing key", where=at(mpath, key=key))
    dim = manifest["dim"]
    if not _nonneg_int(dim) or dim == 0:
        raise InputError(f"dim must be a positive integer, got {dim!r}", where=at(mpath, key="dim"))
    counts = manifest["counts"]
    if not isinstance(counts, dict):
        raise InputError("expected an object", where=at(mpath, key="counts"))
    for key in ("users", "memories", "queries"):
        if not _nonneg_int(counts.get(key)):
            raise InputError(f"expected a non-negative integer, got {counts.get(key)!r}",
                             where=at(mpath, key=f"counts.{key}"))
    if expect_model is not None and manifest["model"] != expect_model:
        raise InputError(f"store was embedded with model {manifest['model']!r}, expected "
                         f"{expect_model!r}", where=at(root))
    if expect_dim is not None and dim != int(expect_dim):
        raise InputError(f"store has embedding dim {dim}, expected {expect_dim}", where=at(root))

    upath = root / "users.json"
    if not upath.is_file():
        raise InputError("missing file of the embedding store", where=at(upath))
    try:
        users = json.loads(upath.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg}", where=at(upath, e.lineno)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read ({e})", where=at(upath)) from None
    if not isinstance(users, list) or len(users) != counts["users"]:
        raise InputError(f"expected a list of {counts['users']} users", where=at(upath))
    m_end = q_end = 0
    seen = set()
    for i, u in enumerate(users):
        if not isinstance(u, dict):
            raise InputError("expected an object", where=at(upath, key=f"[{i}]"))
        for key in ("id", "mem_start", "mem_end", "query_start", "query_end"):
            if key not in u:
                raise InputError("missing key", where=at(upath, key=f"[{i}].{key}"))
        u["id"] = str(u["id"])
        if u["id"] in seen:
            raise InputError(f"duplicate user id {u['id']!r}", where=at(upath, key=f"[{i}].id"))
        seen.add(u["id"])
        if (u["mem_start"] != m_end or u["query_start"] != q_end
                or not _nonneg_int(u["mem_end"]) or not _nonneg_int(u["query_end"])
                or u["mem_end"] < u["mem_start"] or u["query_end"] < u["query_start"]):
            raise InputError("row ranges do not tile the arrays in order",
                             where=at(upath, key=f"[{i}]"))
        m_end, q_end = u["mem_end"], u["query_end"]
    if m_end != counts["memories"] or q_end != counts["queries"]:
        raise InputError(f"users cover {m_end} memories / {q_end} queries, the manifest counts "
                         f"{counts['memories']} / {counts['queries']}", where=at(upath))

    mem = _load_npy(root / "memories.npy", counts["memories"], dim, "memories")
    qry = _load_npy(root / "queries.npy", counts["queries"], dim, "queries")
    ans = _load_npy(root / "answers.npy", counts["queries"], dim, "answers") if manifest.get("answers") else None
    return EmbeddingStore(root, manifest, users, mem, qry, ans)
