"""Streams: each user's queries in order, with their retrieved candidates, on the host.

The online data flow is dataset → embedding store → **streams** → compiled loop. A
:class:`Stream` is one user's unpadded arrays; :func:`pad_streams` stacks a chunk of
them into the fixed-shape :class:`ChunkData` the compiled loop takes. Streams come from
an embedding store (:func:`store_chunks`, :func:`load_streams`: simulate, pretrain) or
from a citation log (:func:`log_chunks`, :func:`streams_from_log`: replay), and a run's
per-query outputs go back to log records with :func:`log_records`.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Iterator, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from rmm_jax.core.config import Layout
from rmm_jax.data.citation_log import LogRecord, NotGroupedError, call_key, iter_numbered, iter_user_chunks, read_log
from rmm_jax.data.citations import answer_support
from rmm_jax.data.log_vectors import resolve_calls, unseen_texts
from rmm_jax.data.retrieval import retrieve_candidates
from rmm_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class Stream:
    """One user's online stream on host memory (unpadded).

    ``cand`` indexes ``bank``; ``selected`` indexes positions within ``cand`` (replay only).
    """
    user_id: str
    bank: np.ndarray           # (N, d) float32 memory embeddings
    queries: np.ndarray        # (T, d) float32, in stream order
    cand: np.ndarray           # (T, K) int32 base-retriever candidates, best first
    cand_mask: np.ndarray      # (T, K) bool
    cand_gold: np.ndarray      # (T, K) bool
    num_gold: np.ndarray       # (T,) int32 gold memories in the whole bank
    valid: np.ndarray          # (T,) bool: counts in metrics (has gold, not abstention)
    memory_ids: tuple = ()
    query_ids: tuple = ()
    selected: np.ndarray | None = None         # (T, M) int32 positions in cand, -1 unfilled
    cited: np.ndarray | None = None            # (T, M) bool
    logged_log_prob: np.ndarray | None = None  # (T,) float32
    has_logged: np.ndarray | None = None       # (T,) bool
    present: np.ndarray | None = None          # (T,) bool: query takes part in updates
    cite_gold: np.ndarray | None = None        # (T, K) bool: what a citation model treats as useful
                                               # (e.g. answer support); None: the gold labels


class ChunkData(NamedTuple):
    """A chunk of streams padded to fixed shapes, users axis first: the compiled loop's input.

    U users (padded to the chunk size), T = B·n_batches queries (padded), N memories.
    The replay fields are None for a simulated run.
    """
    bank: np.ndarray                 # (U, N, d) float32
    q: np.ndarray                    # (U, T, d) float32
    cand: np.ndarray                 # (U, T, K) int32
    mask: np.ndarray                 # (U, T, K) bool
    gold: np.ndarray                 # (U, T, K) bool
    num_gold: np.ndarray             # (U, T) int32
    eval: np.ndarray                 # (U, T) bool: counts in the prequential metrics
    present: np.ndarray              # (U, T) bool: takes part in updates
    selected: np.ndarray | None = None         # (U, T, M) int32
    cited: np.ndarray | None = None            # (U, T, M) bool
    logged_log_prob: np.ndarray | None = None  # (U, T) float32
    has_logged: np.ndarray | None = None       # (U, T) bool
    cite_gold: np.ndarray | None = None        # (U, T, K) bool: useful to the citation model; None: gold


def user_key(seed: int, user_id: str):
    """Per-user PRNG key from the run seed and a stable hash of the user id.

    Depends on the user, not on its position in a chunk, so chunking, sharding and
    resuming never change a user's random stream.
    """
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(user_id.encode()) & 0x7FFFFFFF)


def user_keys(seed: int, user_ids: Sequence[str]):
    """``user_key(seed, u)`` for every id of ``user_ids``, stacked, in one jitted call (a
    chunk's keys would otherwise cost two dispatches per user).

    >>> import jax
    >>> k = user_keys(3, ["a", "b"])
    >>> bool((jax.random.key_data(k[1]) == jax.random.key_data(user_key(3, "b"))).all())
    True
    """
    hashes = np.array([zlib.crc32(u.encode()) & 0x7FFFFFFF for u in user_ids], np.uint32)
    return _fold_all(jax.random.key(seed), hashes)


@jax.jit
def _fold_all(key, hashes):
    return jax.vmap(lambda h: jax.random.fold_in(key, h))(hashes)


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest size ≥ max(n, minimum) of the form j·2^e with j ∈ {4..7}: four buckets
    per octave, so padding wastes at most 25% while lengths inside a bucket share one
    compiled program."""
    n = max(int(n), minimum, 1)
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def stream_batches(streams: Sequence[Stream], layout: Layout) -> int:
    """Padded number of batches of a chunk of streams (see :func:`pad_streams`)."""
    return bucket(max(-(-s.queries.shape[0] // layout.batch) for s in streams), 4)


def pad_streams(streams: Sequence[Stream], layout: Layout, users_per_chunk: int, *,
                batches_multiple: int = 1) -> ChunkData:
    """Stack streams into a :class:`ChunkData` of fixed shapes.

    The replay fields are filled when the streams carry logged selections (from a log).
    Users are padded to ``users_per_chunk`` (dummy users have no valid query), stream
    length to B·bucket(⌈T/B⌉) (rounded to a multiple of ``batches_multiple`` batches) and
    the bank to bucket(N).
    """
    assert 1 <= len(streams) <= users_per_chunk
    d = streams[0].bank.shape[1]
    k, b = layout.k, layout.batch
    n_batches = stream_batches(streams, layout)
    n_batches = -(-n_batches // batches_multiple) * batches_multiple
    t, n = n_batches * b, bucket(max(s.bank.shape[0] for s in streams), 32)
    u = users_per_chunk
    replay = streams[0].selected is not None
    own_cite = any(s.cite_gold is not None for s in streams)
    out = {"bank": np.zeros((u, n, d), np.float32), "q": np.zeros((u, t, d), np.float32),
           "cand": np.zeros((u, t, k), np.int32), "mask": np.zeros((u, t, k), bool),
           "gold": np.zeros((u, t, k), bool), "num_gold": np.zeros((u, t), np.int32),
           "eval": np.zeros((u, t), bool), "present": np.zeros((u, t), bool)}
    if replay:
        out.update(selected=np.full((u, t, layout.m), -1, np.int32), cited=np.zeros((u, t, layout.m), bool),
                   logged_log_prob=np.zeros((u, t), np.float32), has_logged=np.zeros((u, t), bool))
    if own_cite:
        out["cite_gold"] = np.zeros((u, t, k), bool)
    for i, s in enumerate(streams):
        nq, nm = s.queries.shape[0], s.bank.shape[0]
        if s.cand.shape[1] != k:
            raise ValueError(f"k: stream of user {s.user_id} has {s.cand.shape[1]} candidates, config k={k}")
        out["bank"][i, :nm] = s.bank
        out["q"][i, :nq] = s.queries
        out["cand"][i, :nq] = s.cand
        out["mask"][i, :nq] = s.cand_mask
        out["gold"][i, :nq] = s.cand_gold
        out["num_gold"][i, :nq] = s.num_gold
        out["eval"][i, :nq] = s.valid
        out["present"][i, :nq] = True if s.present is None else s.present
        if replay:
            out["selected"][i, :nq] = s.selected
            out["cited"][i, :nq] = s.cited
            out["logged_log_prob"][i, :nq] = s.logged_log_prob
            out["has_logged"][i, :nq] = s.has_logged
        if own_cite:
            out["cite_gold"][i, :nq] = s.cand_gold if s.cite_gold is None else s.cite_gold
    return ChunkData(**out)


# --------------------------------------------------------------------------- from a store


def stream_from_user(user, k: int) -> Stream:
    """Build a :class:`Stream` from a store's :class:`rmm_jax.data.store.UserData`."""
    cand, cand_mask = retrieve_candidates(user, k)
    gold = np.asarray(user.gold, bool)
    cand_gold = np.take_along_axis(gold, cand, axis=1) & cand_mask if gold.size else np.zeros(cand.shape, bool)
    return Stream(user_id=user.user_id, bank=np.asarray(user.memory_emb, np.float32),
                  queries=np.asarray(user.query_emb, np.float32), cand=cand, cand_mask=cand_mask,
                  cand_gold=cand_gold, num_gold=gold.sum(1).astype(np.int32), valid=np.asarray(user.valid),
                  memory_ids=tuple(user.memory_ids), query_ids=tuple(user.query_ids))


def query_range(stream: Stream, start: int, stop: int | None) -> Stream:
    """The stream's queries ``start .. stop−1`` in stream order (memories unchanged): a later
    run continues a user's stream where an earlier one stopped (``simulate --queries``)."""
    cut = slice(start, stop)
    opt = lambda x: None if x is None else x[cut]
    return dataclasses.replace(
        stream, queries=stream.queries[cut], cand=stream.cand[cut], cand_mask=stream.cand_mask[cut],
        cand_gold=stream.cand_gold[cut], num_gold=stream.num_gold[cut], valid=stream.valid[cut],
        query_ids=tuple(stream.query_ids[cut]) if stream.query_ids else (), selected=opt(stream.selected),
        cited=opt(stream.cited), logged_log_prob=opt(stream.logged_log_prob), has_logged=opt(stream.has_logged),
        present=opt(stream.present), cite_gold=opt(stream.cite_gold))


def check_users(store, users: Sequence[str] | None) -> list[str]:
    """The requested user ids (all of the store's by default); an unknown one is an error."""
    ids = list(store.user_ids) if not users else list(users)
    known = set(store.user_ids)
    unknown = [u for u in ids if u not in known]
    if unknown:
        raise InputError(f"unknown user id {unknown[0]!r} (the store has {len(store.user_ids)} users)",
                         where="--users")
    return ids


def load_streams(store, k: int, users: Sequence[str] | None = None) -> list[Stream]:
    """One :class:`Stream` per user of an embedding store (all users by default)."""
    return [stream_from_user(store.user(u), k) for u in check_users(store, users)]


def repeat_passes(stream: Stream, passes: int) -> Stream:
    """The stream's queries ``passes`` times over, in order (``replay --passes``): every pass
    updates; only the first counts in the prequential metrics (later passes have seen the
    queries' citations), so ``valid`` is False on the copies.

    >>> import numpy as np
    >>> s = Stream("u", np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32), np.zeros((2, 1), np.int32),
    ...            np.ones((2, 1), bool), np.ones((2, 1), bool), np.ones(2, np.int32), np.array([True, False]),
    ...            query_ids=("a", "b"))
    >>> r = repeat_passes(s, 3)
    >>> r.valid.tolist(), r.present.tolist(), r.query_ids
    ([True, False, False, False, False, False], [True, True, True, True, True, True], ('a', 'b', 'a', 'b', 'a', 'b'))
    """
    if passes == 1:
        return stream
    t = stream.queries.shape[0]
    rep = lambda x: None if x is None else np.concatenate([x] * passes)  # noqa: E731
    return dataclasses.replace(
        stream, queries=rep(stream.queries), cand=rep(stream.cand), cand_mask=rep(stream.cand_mask),
        cand_gold=rep(stream.cand_gold), num_gold=rep(stream.num_gold),
        valid=np.concatenate([stream.valid, np.zeros(t * (passes - 1), bool)]),
        query_ids=tuple(stream.query_ids) * passes, selected=rep(stream.selected), cited=rep(stream.cited),
        logged_log_prob=rep(stream.logged_log_prob), has_logged=rep(stream.has_logged),
        present=rep(np.ones(t, bool) if stream.present is None else stream.present), cite_gold=rep(stream.cite_gold))


def with_answer_support(stream: Stream, qa_emb) -> Stream:
    """The stream with ``cite_gold`` = the candidates that support each query's reference
    answer (:func:`rmm_jax.data.citations.answer_support`; never reads gold), for the
    label-free ``answer`` citation model. ``qa_emb``: (T, d) question + answer embeddings."""
    return dataclasses.replace(stream, cite_gold=answer_support(np.asarray(qa_emb), stream.bank, stream.cand,
                                                                stream.cand_mask))


def store_chunks(store, k: int, users: Sequence[str] | None, users_per_chunk: int, *,
                 answers: bool = False, queries: tuple[int, int | None] = (0, None)) -> tuple[int, Iterator]:
    """``(number of users, chunks)``: streams of a store's users (all by default), built
    ``users_per_chunk`` at a time, so memory holds one chunk. ``answers``: each stream
    carries answer support as ``cite_gold`` (:func:`with_answer_support`). ``queries``:
    only each user's queries in that ``(start, stop)`` range (:func:`query_range`); users
    with none are left out."""
    ids = check_users(store, users)
    if answers and store.answer_emb is None:
        store.user_answers(ids[0] if ids else "")          # the one-line error naming the store

    def build(u):
        s = stream_from_user(store.user(u), k)
        s = with_answer_support(s, store.user_answers(u)) if answers else s
        return s if queries == (0, None) else query_range(s, *queries)

    def gen():
        chunk = []
        for u in ids:
            s = build(u)
            if s.queries.shape[0]:
                chunk.append(s)
            if len(chunk) == users_per_chunk:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    return len(ids), gen()


# --------------------------------------------------------------------------- from a citation log


def check_limits(rec: LogRecord, layout: Layout, log_path) -> None:
    """A record may list at most ``layout.k`` candidates and select at most ``layout.m``."""
    if len(rec.candidates) > layout.k:
        raise InputError(f"record for user {rec.user_id!r}, {call_key(rec)} has {len(rec.candidates)} "
                         f"candidates, more than --k {layout.k}", where=str(log_path))
    if len(rec.selected) > layout.m:
        raise InputError(f"record for user {rec.user_id!r}, {call_key(rec)} selected {len(rec.selected)} "
                         f"memories, more than --m {layout.m}", where=str(log_path))


class LogShape(NamedTuple):
    """The K and M of a log: its records' most candidates and most selected memories, each
    with the first line that has it. ``k_apart``/``m_apart`` name a record that disagrees
    (None when every record agrees, see :func:`log_shape`)."""
    k: int
    m: int
    k_line: int
    m_line: int
    k_apart: str | None
    m_apart: str | None


def log_shape(log_path, known, *, skip_invalid: bool = False) -> LogShape:
    """What a log says of K and M, in one bounded-memory pass (``known``: :func:`known_ids`).

    The records agree on K when each lists K candidates, or every memory of its user when the
    user's bank holds fewer than K; on M when each shows M memories, or all its candidates when
    it lists fewer than M. Logged by a retriever of top-K and a policy showing M, every record
    agrees; a record that lists fewer (a truncated retrieval, a slate cut short) disagrees."""
    first_k: dict[int, int] = {}          # n candidates -> first line listing that many
    first_m: dict[int, int] = {}          # n selected -> first line showing that many
    short_k: dict[int, str] = {}          # n candidates -> a record listing fewer than its user's bank
    short_m: dict[int, str] = {}          # n selected -> a record showing fewer than its candidates
    for line, r in iter_numbered(log_path, known=known, skip_invalid=skip_invalid):
        ids = known(r.user_id)                  # None: a user the store lacks (the log carries its texts)
        nk, nm, bank = len(r.candidates), len(r.selected), (len(ids[1]) if ids else None)
        first_k.setdefault(nk, line)
        first_m.setdefault(nm, line)
        if bank is not None and nk < bank:
            short_k.setdefault(nk, f"line {line} lists {nk} candidates of user {r.user_id!r}'s {bank} memories")
        if nm < nk:
            short_m.setdefault(nm, f"line {line} shows {nm} memories of its {nk} candidates")
    k, m = max(first_k), max(first_m)
    apart = lambda short, top: next((why for n, why in sorted(short.items()) if n < top), None)
    return LogShape(k, m, first_k[k], first_m[m], apart(short_k, k), apart(short_m, m))


def streams_from_log(store, records: Sequence[LogRecord], layout: Layout, log_path: str = "log",
                     vectors: Mapping[str, np.ndarray] | None = None) -> list[Stream]:
    """Replay streams: per user, the logged calls in log order with their logged
    candidates, selections and citations, resolved against the store
    (:func:`rmm_jax.data.log_vectors.resolve_calls`: what the store lacks comes from
    ``vectors``, the embeddings of the log's unseen texts, :func:`scan_log`)."""
    by_user: dict[str, list] = {}
    for rec in records:
        check_limits(rec, layout, log_path)
        by_user.setdefault(rec.user_id, []).append(rec)
    streams = []
    for uid, recs in by_user.items():
        c = resolve_calls(store, uid, recs, vectors or {}, layout.k, layout.m)
        streams.append(Stream(
            user_id=uid, bank=c.bank, queries=c.queries, cand=c.cand, cand_mask=c.cand_mask, cand_gold=c.cand_gold,
            num_gold=c.num_gold, valid=c.valid, memory_ids=c.memory_ids, query_ids=c.call_keys,
            selected=c.selected, cited=c.cited, logged_log_prob=c.log_prob.astype(np.float32),
            has_logged=c.has_log_prob))
    return streams


def scan_log(log_path, layout: Layout, *, known=None, skip_invalid: bool = False,
             users: Sequence[str] | None = None) -> dict:
    """Validation pass over a whole log before any work, in bounded memory.

    Checks every record (schema, ``known`` ids, repeated calls, the ``--k``/``--m``
    limits) and returns the read report plus ``"users"`` (how many will be replayed:
    all, or those of ``users``, each of which must have a record), ``"user_ids"`` (which)
    and ``"grouped"``: False
    when a user's records are not on consecutive lines (such a log cannot be streamed by
    user; :func:`log_chunks` reads it whole), and ``"texts"``: the distinct texts of the
    replayed records that the store lacks (:func:`rmm_jax.data.log_vectors.unseen_texts`),
    to embed before the run."""
    report: dict = {}
    seen: set[str] = set()
    texts: dict[str, None] = {}
    keep = (lambda u: True) if not users else frozenset(users).__contains__

    def note(r):
        check_limits(r, layout, log_path)
        if keep(r.user_id):
            texts.update(dict.fromkeys(unseen_texts(r, known(r.user_id) if known is not None else None)))

    try:
        for recs in iter_user_chunks(log_path, 1, known=known, skip_invalid=skip_invalid, report=report):
            for r in recs:
                note(r)
            seen.add(recs[0].user_id)
        grouped = True
    except NotGroupedError:
        texts.clear()
        records, report = read_log(log_path, known=known, skip_invalid=skip_invalid)
        for r in records:
            note(r)
        seen, grouped = {r.user_id for r in records}, False
    missing = [u for u in users or () if u not in seen]
    if missing:
        raise InputError(f"user {missing[0]!r} has no record in {log_path}", where="--users")
    ids = list(users) if users else sorted(seen)
    return {**report, "users": len(ids), "user_ids": ids, "grouped": grouped, "texts": list(texts)}


def log_chunks(store, log_path, layout: Layout, users_per_chunk: int, *, grouped: bool, known=None,
               skip_invalid: bool = False, users: Sequence[str] | None = None,
               vectors: Mapping[str, np.ndarray] | None = None) -> Iterator[list[Stream]]:
    """Replay streams from a log, ``users_per_chunk`` users at a time (only ``users``' when given).

    ``grouped`` (see :func:`scan_log`): each user's records are on consecutive lines, so
    the log is streamed and memory holds one chunk; otherwise it is read whole (sort it
    by user_id to stream it). ``vectors``: the embeddings of the texts the store lacks."""
    keep = (lambda u: True) if not users else frozenset(users).__contains__
    if grouped:
        chunk: list[Stream] = []
        for recs in iter_user_chunks(log_path, 1, known=known, skip_invalid=skip_invalid):
            if keep(recs[0].user_id):
                chunk += streams_from_log(store, recs, layout, str(log_path), vectors)
            if len(chunk) == users_per_chunk:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
        return
    records, _ = read_log(log_path, known=known, skip_invalid=skip_invalid)
    streams = streams_from_log(store, [r for r in records if keep(r.user_id)], layout, str(log_path), vectors)
    for i in range(0, len(streams), users_per_chunk):
        yield streams[i:i + users_per_chunk]


def log_records(s: Stream, selected, cited, log_prob) -> list[dict]:
    """Citation-log records of one simulated stream: the run's selections (positions in
    ``s.cand``), citations and behaviour log-probs mapped back to memory ids."""
    out = []
    for t, qid in enumerate(s.query_ids):
        cand_ids = [s.memory_ids[j] for j, ok in zip(s.cand[t], s.cand_mask[t]) if ok]
        sel = [int(p) for p in selected[t] if p >= 0]
        out.append({"user_id": s.user_id, "query_id": qid, "candidates": cand_ids,
                    "selected": [s.memory_ids[s.cand[t][p]] for p in sel],
                    "cited": [s.memory_ids[s.cand[t][p]] for p, c in zip(sel, cited[t]) if c],
                    "log_prob": float(log_prob[t])})
    return out
