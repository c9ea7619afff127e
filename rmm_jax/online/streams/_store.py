"""Streams from an embedding store: each user's questions with the retriever's top-K
(:func:`load_streams`, :func:`store_chunks`: simulate, pretrain), the users' own dialogue
turns as questions (:func:`load_dialogue_streams`: ``pretrain --labels dialogue``), and the
answer support of the ``answer`` citation model (:func:`with_answer_support`)."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from rmm_jax.data.citations import answer_support
from rmm_jax.data.dialogue import dialogue_pairs
from rmm_jax.data.retrieval import retrieve_candidates, top_k
from rmm_jax.errors import InputError, named, option_of
from rmm_jax.online.cite_rates import check_log_inputs
from rmm_jax.online.streams._stream import Stream, take_queries


def stream_from_user(user, k: int) -> Stream:
    """Build a :class:`Stream` from a store's :class:`rmm_jax.data.store.UserData`."""
    cand, cand_mask = retrieve_candidates(user, k)
    gold = np.asarray(user.gold, bool)
    cand_gold = np.take_along_axis(gold, cand, axis=1) & cand_mask if gold.size else np.zeros(cand.shape, bool)
    return Stream(user_id=user.user_id, bank=np.asarray(user.memory_emb, np.float32),
                  queries=np.asarray(user.query_emb, np.float32), cand=cand, cand_mask=cand_mask,
                  cand_gold=cand_gold, num_gold=gold.sum(1).astype(np.int32), valid=np.asarray(user.valid),
                  memory_ids=tuple(user.memory_ids), query_ids=tuple(user.query_ids))


def check_users(store, users: Sequence[str] | None) -> list[str]:
    """The requested user ids (all of the store's when None); an unknown one is an error, and
    so are a path for ``store``, a str, an empty list and a repeated id for ``users``
    (:func:`rmm_jax.online.cite_rates.check_log_inputs`)."""
    check_log_inputs(store, users)
    ids = list(store.user_ids) if users is None else list(users)
    known = set(store.user_ids)
    unknown = [u for u in ids if u not in known]
    if unknown:
        raise InputError(f"unknown user id {unknown[0]!r} (the store has {len(store.user_ids)} users)",
                         arg="users")
    return ids


def load_streams(store, k: int, users: Sequence[str] | None = None) -> list[Stream]:
    """One :class:`Stream` per user of an embedding store (all users by default)."""
    return [stream_from_user(store.user(u), k) for u in check_users(store, users)]


def dialogue_stream(user, pairs: np.ndarray, k: int) -> Stream:
    """A user's dialogue pairs (:func:`rmm_jax.data.dialogue.dialogue_pairs`) as a labelled
    stream for pretraining, without gold: each asking turn's embedding is a query, its
    candidates are the base retriever's top ``k`` of the user's *other* memories (the asking
    turn itself is left out: no real question is in the bank), and the answering turn is its
    one gold memory. ``user``: a :class:`rmm_jax.data.store.UserData`.

    >>> import numpy as np
    >>> from rmm_jax.data.store import UserData
    >>> from rmm_jax.online.streams import dialogue_stream
    >>> bank = np.eye(4, dtype=np.float32); bank[1, 0] = bank[2, 3] = 0.5    # 0 and 1 near, 2 and 3 near
    >>> u = UserData("u", bank, np.zeros((0, 4), np.float32), np.zeros((0, 4), bool), ("a", "b", "c", "d"),
    ...              (), (), np.zeros(0, bool))
    >>> s = dialogue_stream(u, np.array([[0, 1], [3, 2]]), k=1)           # each turn is its own nearest
    >>> s.cand.tolist(), s.cand_gold.tolist(), s.query_ids
    ([[1], [2]], [[True], [True]], ('a', 'd'))
    """
    bank = np.asarray(user.memory_emb, np.float32)
    ask, ans = pairs[:, 0], pairs[:, 1]
    n, kk = len(pairs), min(k + 1, bank.shape[0])
    cand, mask = np.zeros((n, k), np.int32), np.zeros((n, k), bool)
    if n:
        _, top = top_k(bank[ask], bank, kk)
        for r, row in enumerate(np.asarray(top)):
            keep = row[row != ask[r]][:k]
            cand[r, :len(keep)], mask[r, :len(keep)] = keep, True
    return Stream(user_id=user.user_id, bank=bank, queries=bank[ask], cand=cand, cand_mask=mask,
                  cand_gold=(cand == ans[:, None]) & mask, num_gold=np.ones(n, np.int32), valid=np.ones(n, bool),
                  memory_ids=tuple(user.memory_ids), query_ids=tuple(user.memory_ids[i] for i in ask))


def load_dialogue_streams(store, k: int, users: Sequence[str] | None = None) -> list[Stream]:
    """:func:`dialogue_stream` of every user of an embedding store (all by default) whose
    memories hold a dialogue pair; a store that is not of single turns, or holds no pair, is
    refused in one line."""
    ids = check_users(store, users)
    if store.granularity not in (None, "turn"):
        raise InputError(f"dialogue labels need a store of single turns, not {store.granularity!r} memories: "
                         "a segment or session holds the question with its answer (embed again with "
                         "--granularity turn)", where=str(store.path))
    out = []
    for u in ids:
        pairs = dialogue_pairs(store.memory_rows(u))
        if len(pairs):
            out.append(dialogue_stream(store.user(u), pairs, k))
    if not out:
        raise InputError("no memory asks a question that the next turn of its session answers, so there is "
                         "nothing to pretrain on", where=str(store.path))
    return out


def with_answer_support(stream: Stream, qa_emb) -> Stream:
    """The stream with ``cite_gold`` = the candidates that support each query's reference
    answer (:func:`rmm_jax.data.citations.answer_support`; never reads gold), for the
    label-free ``answer`` citation model. ``qa_emb``: (T, d) question + answer embeddings."""
    return dataclasses.replace(stream, cite_gold=answer_support(np.asarray(qa_emb), stream.bank, stream.cand,
                                                                stream.cand_mask))


def store_chunks(store, k: int, users: Sequence[str] | None, users_per_chunk: int, *,
                 answers: bool = False, queries: tuple[int, int | None] = (0, None)) -> tuple[list[str], Iterator]:
    """``(user ids, chunks)``: streams of a store's users (all by default; the ids are those
    the chunks hold), built ``users_per_chunk`` at a time, so memory holds one chunk. ``answers``: each stream
    carries answer support as ``cite_gold`` (:func:`with_answer_support`). ``queries``:
    only each user's queries in that ``(start, stop)`` range (:func:`take_queries`); users
    with none are left out; a range that holds no user's question is refused, naming it as
    the argument (``queries=(1000, None)``) or as the option that gave it ("that --queries
    range": :func:`rmm_jax.errors.named`)."""
    ids = check_users(store, users)
    if answers and store.answer_emb is None:
        store.user_answers(ids[0] if ids else "")          # the one-line error naming the store
    counts = [store.query_count(u) for u in ids]
    if not any(len(range(n)[slice(*queries)]) for n in counts):     # before anything is written
        held = "the store holds no questions for " + ("these users" if users else "any user")
        option = option_of("queries")
        given = f"that {option} range" if option else named("queries", tuple(queries))
        most = f" (the users hold at most {max(counts)} questions, from 0)" if any(counts) else ""
        raise InputError(held if not any(counts) else f"no user has a question in {given}{most}",
                         where=str(store.path))

    def build(u):
        s = stream_from_user(store.user(u), k)
        s = with_answer_support(s, store.user_answers(u)) if answers else s
        return s if queries == (0, None) else take_queries(s, slice(*queries))

    held = [u for u, n in zip(ids, counts) if len(range(n)[slice(*queries)])]   # users with a question in range

    def gen():
        chunk = []
        for u in held:
            chunk.append(build(u))
            if len(chunk) == users_per_chunk:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    return held, gen()
