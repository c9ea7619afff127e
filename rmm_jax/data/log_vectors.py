"""A log's calls against an embedding store: the arrays that ``replay`` and ``evaluate`` read.

A citation-log record (:mod:`rmm_jax.data.citation_log`) names its query and its
candidates by id and may carry their texts. Production logs ask questions the store has
never seen and may show memories it lacks, so a record is resolved against the store
one piece at a time, the store first:

* **the query**: the store's question when the store holds the record's ``query_id`` for
  that user; otherwise the record's ``query`` text, embedded;
* **a candidate**: the store's memory when it holds the id; otherwise the candidate's
  text (``{"id", "text"}``), embedded. A user's bank is the store's memories followed by
  the carried ones, in order of first appearance in the log (a user the store lacks has
  only carried ones);
* **gold**: the store's gold memories for a question it holds; otherwise the record's
  ``gold`` (none: the call does not count for Recall), less the ids the user's bank lacks
  (neither the store nor any of these records holds them: a gold memory never retrieved
  has no text, and ``embed log:`` dropped it too). An abstention question of the store
  never counts.

Texts are embedded with the store's model through the embedding cache
(:func:`rmm_jax.data.embed.embed_texts`, the function ``rerank`` uses too), all of a
log's new texts at once, before any work: :func:`unseen_texts` lists what one record
needs, :func:`resolve_calls` builds one user's arrays from the records and the vectors.
The online loop and the estimators see only these arrays.

Examples:
  >>> import numpy as np
  >>> from rmm_jax.data.citation_log import validate_record
  >>> from rmm_jax.data.log_vectors import unseen_texts
  >>> rec = validate_record({"user_id": "u1", "call_id": "c1", "query": "where is my passport?",
  ...                        "candidates": [{"id": "m1", "text": "passport in the drawer"}],
  ...                        "selected": ["m1"], "cited": ["m1"]})
  >>> unseen_texts(rec, None)           # a user the store lacks: everything is text
  ['where is my passport?', 'passport in the drawer']
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from rmm_jax.data.citation_log import LogRecord, call_key

__all__ = ["StoreMemories", "UserCalls", "known_ids", "resolve_calls", "unseen_texts"]


class StoreMemories(Mapping):
    """One user's memory ids in a store, each mapped to the store's text of it. The texts
    are read the first time one is asked for (a record that carries a text for a memory the
    store holds), so checking ids costs what a set of them does."""

    def __init__(self, store, user_id: str, ids: Sequence[str]):
        self._store, self._user, self._ids, self._texts = store, user_id, frozenset(ids), None
        self._order = tuple(ids)

    def first(self, n: int) -> frozenset:
        """The ids of the user's first ``n`` memories in store order: its whole bank when it
        held ``n`` (a grown store keeps a user's old memories first and appends the new ones)."""
        return frozenset(self._order[:n])

    def __contains__(self, mid) -> bool:
        return mid in self._ids

    def __getitem__(self, mid) -> str:
        if mid not in self._ids:
            raise KeyError(mid)
        if self._texts is None:
            self._texts = {str(r["id"]): r["text"] for r in self._store.memory_rows(self._user)}
        return self._texts[mid]

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def known_ids(store, cache_users: int = 4) -> Callable:
    """A ``known=`` lookup for :mod:`rmm_jax.data.citation_log` that reads one user's ids
    at a time: ``user_id -> (query_ids, memory_ids) | None``, ``memory_ids`` a
    :class:`StoreMemories` (a mapping of each id to the store's text of it, so a record that
    carries another text for a memory the store holds is an error). A streamed log holds
    each user's records on consecutive lines, so a small cache suffices."""
    users = frozenset(store.user_ids)

    @functools.lru_cache(maxsize=cache_users)
    def lookup(uid: str):
        if uid not in users:
            return None
        u = store.user(uid)
        return frozenset(u.query_ids), StoreMemories(store, uid, u.memory_ids)

    return lookup


def unseen_texts(rec: LogRecord, entry) -> list[str]:
    """The texts of ``rec`` that the store lacks: its ``query`` when the store does not hold
    its ``query_id``, and the carried texts of candidates whose ids the store does not
    hold. ``entry``: the user's ``(query_ids, memory_ids)`` in the store, None when the
    store lacks the user (:func:`known_ids` gives it)."""
    query_ids, memory_ids = entry if entry is not None else ((), ())
    out = [rec.query_text] if rec.query_id not in query_ids and rec.query_text is not None else []
    texts = rec.candidate_texts or (None,) * len(rec.candidates)
    return out + [t for mid, t in zip(rec.candidates, texts) if t is not None and mid not in memory_ids]


@dataclasses.dataclass(frozen=True)
class UserCalls:
    """One user's logged calls resolved against a store (module docstring), T calls in
    log order, K candidate slots, M selection slots, N memories in the bank."""
    user_id: str
    bank: np.ndarray              # (N, d) float32: the store's memories, then the carried ones
    memory_ids: tuple             # (N,)
    call_keys: tuple              # (T,) :func:`rmm_jax.data.citation_log.call_key`
    queries: np.ndarray           # (T, d) float32
    cand: np.ndarray              # (T, K) int32 rows of ``bank``, in retriever order
    cand_mask: np.ndarray         # (T, K) bool
    selected: np.ndarray          # (T, M) int32 positions in ``cand``, −1 unfilled
    cited: np.ndarray             # (T, M) bool, per selected slot
    log_prob: np.ndarray          # (T,) float64, 0 where the record has none
    has_log_prob: np.ndarray      # (T,) bool
    logits: np.ndarray            # (T, K) float32, 0 where the record has none
    has_logits: np.ndarray        # (T,) bool
    cand_gold: np.ndarray         # (T, K) bool
    num_gold: np.ndarray          # (T,) int32 gold memories in the whole bank
    valid: np.ndarray             # (T,) bool: counts for Recall (has gold, not an abstention)


def resolve_calls(store, user_id: str, records: Sequence[LogRecord], vectors: Mapping[str, np.ndarray], k: int,
                  m: int) -> UserCalls:
    """One user's :class:`UserCalls` from its ``records`` (validated against ``store``, at
    most ``k`` candidates and ``m`` selected each) and ``vectors``, the embeddings of the
    texts :func:`unseen_texts` listed (``text -> (d,)``)."""
    held = store.has_user(user_id)
    user = store.user(user_id) if held else None
    memory_ids = list(user.memory_ids) if held else []
    mem_index = {mid: j for j, mid in enumerate(memory_ids)}
    q_index = {qid: i for i, qid in enumerate(user.query_ids)} if held else {}
    carried: list[np.ndarray] = []
    t = len(records)
    queries = np.zeros((t, store.dim), np.float32)
    cand, cmask = np.zeros((t, k), np.int32), np.zeros((t, k), bool)
    sel, cited = np.full((t, m), -1, np.int32), np.zeros((t, m), bool)
    lp, has_lp = np.zeros(t, np.float64), np.zeros(t, bool)
    logits, has_logits = np.zeros((t, k), np.float32), np.zeros(t, bool)
    store_rows = np.full(t, -1, np.int64)          # the store's question of each call, −1: none
    for i, r in enumerate(records):
        texts = r.candidate_texts or (None,) * len(r.candidates)
        for mid, text in zip(r.candidates, texts):
            if mid not in mem_index:
                mem_index[mid] = len(memory_ids)
                memory_ids.append(mid)
                carried.append(vectors[text])
        if r.query_id in q_index:
            store_rows[i] = q_index[r.query_id]
            queries[i] = user.query_emb[store_rows[i]]
        else:
            queries[i] = vectors[r.query_text]
        n = len(r.candidates)
        cand[i, :n] = [mem_index[c] for c in r.candidates]
        cmask[i, :n] = True
        pos = {c: p for p, c in enumerate(r.candidates)}
        sel[i, :len(r.selected)] = [pos[x] for x in r.selected]
        cited[i, :len(r.selected)] = [x in set(r.cited) for x in r.selected]
        if r.log_prob is not None:
            lp[i], has_lp[i] = r.log_prob, True
        if r.logits is not None:
            logits[i, :n], has_logits[i] = r.logits, True
    n_bank = len(memory_ids)
    bank = np.zeros((n_bank, store.dim), np.float32)
    n_store = user.memory_emb.shape[0] if held else 0
    if held:
        bank[:n_store] = user.memory_emb
    if carried:
        bank[n_store:] = np.stack(carried)
    gold = np.zeros((t, n_bank), bool)
    valid = np.zeros(t, bool)
    for i, r in enumerate(records):
        if store_rows[i] >= 0:
            gold[i, :n_store] = user.gold[store_rows[i]]
            valid[i] = not user.abstention[store_rows[i]]
        else:
            gold[i, [mem_index[g] for g in r.gold or () if g in mem_index]] = True    # the bank's; never retrieved: out
            valid[i] = True
    num_gold = gold.sum(1).astype(np.int32)
    return UserCalls(
        user_id=user_id, bank=bank, memory_ids=tuple(memory_ids), call_keys=tuple(call_key(r) for r in records),
        queries=queries, cand=cand, cand_mask=cmask, selected=sel, cited=cited, log_prob=lp, has_log_prob=has_lp,
        logits=logits, has_logits=has_logits, cand_gold=np.take_along_axis(gold, cand, axis=1) & cmask,
        num_gold=num_gold, valid=valid & (num_gold > 0))
