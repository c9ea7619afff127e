"""Writing an embedding store whole: build a dataset's memories at a granularity, embed
them with its questions, and write the directory atomically (:func:`write_store`), under
the one writer's lock (:func:`store_writer`)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np

from rmm_jax.data.granularity import GRANULARITIES, build_memories
from rmm_jax.data.jsonl import no_text_error
from rmm_jax.data.store._format import FORMAT, VERSION
from rmm_jax.data.store._read import is_store
from rmm_jax.data.types import Dataset, MemoryUnit, User, gold_matrix
from rmm_jax.data.words import count
from rmm_jax.deprecated import renamed_argument
from rmm_jax.errors import InputError, named
from rmm_jax.persist.atomic import atomic_dir, fsync_files, leftovers, make_dirs, real_path
from rmm_jax.persist.lock import WriterLock


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


def check_store_path(path) -> None:
    """``path`` is replaced whole by :func:`write_store`, its old content deleted: refuse, before
    any work, anything there but an embedding store or an empty directory (a policy store,
    someone's files, a file), naming ``path`` (the CLI's ``--out``: :func:`rmm_jax.cli.shell.as_options`).
    Re-embedding into a store replaces it."""
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise InputError("exists and is not a directory; choose a new store path", arg=f"path {path}")
        occupied = p.is_dir() and any(p.iterdir())
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", arg=f"path {path}") from None
    if occupied and not is_store(p):
        raise InputError("already exists and is not empty, and is not an embedding store; choose a new store path",
                         arg=f"path {path}")


def _check_granularity_kwargs(granularity: str, granularity_kwargs: dict) -> None:
    """The thresholds (and any other option of :func:`~rmm_jax.data.granularity.build_memories`)
    shape segments only: given at another granularity, where nothing reads them, they are
    refused by name instead of ignored."""
    if granularity != "segment" and granularity_kwargs:
        name = next(iter(granularity_kwargs))
        raise InputError(f"only {named('granularity', 'segment')} reads it; this store builds {granularity} memories",
                         arg=name)


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
    (``gold_elsewhere``, for ``embed --into``) is the loader's own error, and so is a user it
    kept with no message with text (``no_text``)."""
    for uid, where in dataset.no_text.items():      # first, as load_jsonl without gold_elsewhere
        raise no_text_error(uid, where)
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


def _check_embedder(embedder) -> None:
    """``embedder`` has what a store write reads (``.encode``, ``.model_id``, ``.dim``): None or
    a model name was an AttributeError after the memories were built."""
    if not (callable(getattr(embedder, "encode", None)) and hasattr(embedder, "model_id")
            and hasattr(embedder, "dim")):
        raise InputError(f"expected an Embedder (.encode, .model_id, .dim), e.g. rmm_jax.data.embed.Embedder(model), "
                         f"got {type(embedder).__name__} {embedder!r}"[:200], arg="embedder")


def _check_dataset(dataset) -> None:
    """``dataset`` is a :class:`~rmm_jax.data.types.Dataset` (a SPEC str was an AttributeError)."""
    if not isinstance(dataset, Dataset):
        raise InputError(f"expected a Dataset, e.g. rmm_jax.data.load_spec(SPEC), got "
                         f"{type(dataset).__name__} {dataset!r}"[:200], arg="dataset")


def _assemble_arrays(mem_emb, qry_emb, rows: _Rows, model_id: str, dim: int,
                     dim_is: str = "embedder.dim") -> tuple[np.ndarray, np.ndarray]:
    """Check the embeddings are finite and ``(n, dim)`` (``dim_is``: where ``dim`` comes from,
    for the error), and return them float32."""
    for name, arr, n in (("memories", mem_emb, len(rows.memories)), ("queries", qry_emb, len(rows.queries))):
        shape = np.shape(arr)
        if n and shape != (n, dim):      # one of another size was "cannot reshape array of size 144 into (16, 8)"
            raise InputError(f"{name} embeddings from model {model_id!r} have shape {shape}, expected ({n}, {dim}) "
                             f"({n} texts, {dim_is} {dim})", arg="embedder")
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
    file beside it (``.NAME.lock``: the store directory itself is swapped whole), held by
    :func:`write_store` and :func:`append_store` from their first read to the rename, so two
    writers cannot both start from the old store and the second's rename lose the first's work
    (an ``embed --out`` that took the lock only to rename had replaced, minutes later, a store an
    ``embed --into`` grew meanwhile). A symbolic link's lock is its target's. Taking it removes
    what a killed writer left beside the store (``.NAME.tmp-*``, ``.NAME.old-*``); a second
    writer gets one line naming the first's pid."""
    p = real_path(path)               # one lock whichever name, the link's or its target's
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
    """Write the store directory at ``path`` whole, or nothing (the layout is in the package
    docstring, :mod:`rmm_jax.data.store`)."""
    with atomic_dir(path) as tmp:      # the caller holds the store's writer lock
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


def unanswered(dataset: Dataset) -> int:
    """How many of ``dataset``'s questions give no answer (none, or only whitespace): their
    :func:`answer_texts` entry is the question alone."""
    return sum(not (q.answer or "").strip() for u in dataset.users for q in u.queries)


def write_store(path, dataset: Dataset, granularity: str, embedder, *, spec: str | None = None,
                progress=None, answers: bool = False, log=None, **granularity_kwargs) -> dict:
    """Build memories at ``granularity``, embed memories and queries, write the store.

    Args:
      path: output directory (replaced atomically if it exists): a new path, an empty
        directory or an embedding store; anything else there is refused (:func:`check_store_path`).
      dataset: a :class:`~rmm_jax.data.types.Dataset`.
      granularity: one of :data:`~rmm_jax.data.granularity.GRANULARITIES`.
      embedder: an :class:`rmm_jax.data.embed.Embedder` (``.encode``, ``.model_id``, ``.dim``).
      spec: the dataset spec, recorded in the manifest.
      progress: optional ``callable(str)``, called as the write goes with a progress line (e.g.
        to print to stderr): what is to be embedded (users, memories, queries) once the memories
        are built, before the embedding, which may take minutes. The result is the manifest
        returned. ``log`` is its old name (deprecated).
      answers: also embed each question with its reference answer (:func:`answer_texts`)
        into ``answers.npy``, for the ``answer`` citation model.
      granularity_kwargs: passed to
        :func:`~rmm_jax.data.granularity.build_memories` (``segment_threshold``,
        ``merge_threshold``); only granularity ``segment`` takes them.

    Returns:
      The manifest written.

    Raises:
      InputError: naming the argument (``dataset`` not a Dataset, ``embedder`` without
        ``.encode``/``.model_id``/``.dim`` or giving embeddings of another shape than
        (texts, ``embedder.dim``), ``granularity``, ``path``), or the dataset's place.
    """
    _check_dataset(dataset)
    _check_embedder(embedder)
    _check_granularity(granularity)
    _check_granularity_kwargs(granularity, granularity_kwargs)
    check_store_path(path)
    say = renamed_argument("write_store", "log", "progress", log, progress) or (lambda msg: None)
    where = spec or "dataset"
    _check_user_ids(dataset, where)
    _check_gold_in_file(dataset)
    _check_not_empty(dataset, where)
    # held from the embedding to the rename: an append meanwhile would be lost (bad input is refused first)
    with store_writer(path):
        return _write_store(path, dataset, granularity, embedder, where, spec, say, answers, granularity_kwargs)


def _write_store(path, dataset: Dataset, granularity: str, embedder, where: str, spec: str | None, say,
                 answers: bool, granularity_kwargs: dict) -> dict:
    t0 = time.perf_counter()
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
