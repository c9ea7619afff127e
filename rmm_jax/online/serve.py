"""Serving: rank memories for a user's queries with the policy a store holds for them.

:class:`Reranker` is the scoring half of the online program without the update: it loads a
user's policy from a :class:`rmm_jax.persist.policy_store.PolicyStore` (in scope ``hybrid``
the user's factors with exactly the shared version they were trained against), keeps the
most recently used users' policies on the device, and returns the deterministic top-M of
the reranker's scores s_i = q'ᵀm_i' (RMM, Tan et al., ACL 2025, §4.2) for a batch of
queries in one jitted call. A user the store does not hold is served the store's shared
part, the policy a run would start them from. Nothing is written.

Examples:
  >>> import numpy as np, jax, rmm_jax as rj                                       # doctest: +SKIP
  >>> rr = Reranker.open("policies")                                               # doctest: +SKIP
  >>> got = rr.rank("user7", q, cands, m=5)         # q (d,) or (n, d); cands (K, d) or (n, K, d)   # doctest: +SKIP
  >>> got.selected, got.scores                       # (n, 5) positions in cands, best first; (n, K)  # doctest: +SKIP
"""
from __future__ import annotations

import collections
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import reranker
from rmm_jax.core.sampling import top_m
from rmm_jax.core.scope import Scope
from rmm_jax.errors import InputError
from rmm_jax.online.streams import bucket
from rmm_jax.persist.policy_store import PolicyStore

DEFAULT_CACHE_USERS = 1024


class Ranking(NamedTuple):
    """The reranked candidates of n queries: ``selected`` (n, m) positions in the candidate
    list, best first (−1 where fewer than m candidates are valid); ``scores`` (n, K), −inf
    at masked candidates."""
    selected: np.ndarray
    scores: np.ndarray


class Policy(NamedTuple):
    """The policy a user is served: its params and where they come from (``version`` None:
    a user the store does not hold, served the shared part)."""
    params: Any
    version: int | None
    shared_version: int | None


def user_params(store: PolicyStore, user_id: str, *, fallback_to_shared: bool = False):
    """The reranker params that score ``user_id``'s queries, as device arrays (see
    :func:`load_policy`)."""
    return load_policy(store, user_id, fallback_to_shared=fallback_to_shared).params


def load_policy(store: PolicyStore, user_id: str, *, fallback_to_shared: bool = True) -> Policy:
    """The policy ``user_id`` is served, whatever the store's scope
    (:class:`rmm_jax.core.scope.Scope`): its own full params; the newest shared part when users
    have no params of their own; or its own low-rank factors merged with exactly the shared
    version they were trained against (:meth:`PolicyStore.load`; an older store that did not
    record it pairs with the newest). A user the store does not
    hold gets the newest shared part with ``fallback_to_shared`` (what a run would start it
    from), else an error."""
    scope = Scope.from_meta(store.meta)
    if not store.has_user(user_id):
        if not fallback_to_shared:
            store.load(user_id)                                          # the one-line error
        shared = store.shared_state()
        return Policy(_device(shared.state.params), None, shared.version)
    saved = store.load(user_id)
    if scope.local_is_full:
        return Policy(_device(saved.state.params), saved.version, None)
    if not scope.has_local:                    # one policy for everyone: the newest
        shared = store.shared_state()
        return Policy(_device(shared.state.params), saved.version, shared.version)
    shared = store.shared_state(saved.shared_version) if saved.shared_version is not None else store.shared_state()
    return Policy(_device(scope.merge(shared.state.params, saved.state.params)), saved.version, shared.version)


def _device(params):
    # Device arrays throughout: with numpy inputs some ops would run in numpy instead of XLA.
    return jax.tree.map(jnp.asarray, params)


@functools.partial(jax.jit, static_argnames=("m",))
def _rank(params, q, cands, mask, m: int):
    scores = reranker.score_batch(params, q, cands, mask)
    return jax.vmap(lambda s, mk: top_m(s, m, mk))(scores, mask), scores


class Reranker:
    """Serve a policy store's policies (module docstring). ``cache_users``: how many users'
    policies stay on the device (least recently used dropped first)."""

    def __init__(self, store: PolicyStore, *, cache_users: int = DEFAULT_CACHE_USERS):
        if cache_users < 1:
            raise InputError(f"must be >= 1, got {cache_users}", where="cache_users")
        self.store, self.cache_users = store, cache_users
        self._cache: collections.OrderedDict[str, Policy] = collections.OrderedDict()
        self.dim = int(store.meta["dim"])

    @classmethod
    def open(cls, path, *, cache_users: int = DEFAULT_CACHE_USERS) -> "Reranker":
        return cls(PolicyStore.open(path), cache_users=cache_users)

    def policy(self, user_id: str) -> Policy:
        """The policy ``user_id`` is served (cached)."""
        got = self._cache.get(user_id)
        if got is None:
            got = self._cache[user_id] = load_policy(self.store, user_id)
            if len(self._cache) > self.cache_users:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(user_id)
        return got

    def rank(self, user_id: str, query_emb, candidate_embs, m: int, mask=None) -> Ranking:
        """Deterministic top-``m`` of ``user_id``'s policy for one query or a batch.

        ``query_emb`` (d,) or (n, d); ``candidate_embs`` (K, d), shared by every query, or
        (n, K, d); ``mask`` (K,) or (n, K) bool, False at padding. Shapes are padded to
        buckets, so batches of nearby sizes share one compiled program."""
        q = np.asarray(query_emb, np.float32)
        one = q.ndim == 1
        q = q[None] if one else q
        c = np.asarray(candidate_embs, np.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise InputError(f"expected shape (d,) or (n, d) with d={self.dim}, got {np.shape(query_emb)}",
                             where="query_emb")
        n = q.shape[0]
        if c.ndim == 2:
            c = np.broadcast_to(c, (n,) + c.shape)
        if c.ndim != 3 or c.shape[0] != n or c.shape[2] != self.dim:
            raise InputError(f"expected shape (K, {self.dim}) or ({n}, K, {self.dim}), got {np.shape(candidate_embs)}",
                             where="candidate_embs")
        k = c.shape[1]
        mk = np.ones((n, k), bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), (n, k))
        if not isinstance(m, int) or not 1 <= m <= k:
            raise InputError(f"must be in [1, K={k}], got {m!r}", where="m")
        # NaN or inf would rank as garbage (positions -1), silently: refused, masked padding aside
        for name, bad in (("query_emb", ~np.isfinite(q).all(-1)), ("candidate_embs", ~np.isfinite(c).all(-1) & mk)):
            if bad.any():
                i, *j = np.argwhere(bad)[0].tolist()
                place = ([] if one else [f"query {i}"]) + [f"candidate {x}" for x in j]
                raise InputError("holds NaN or inf" + (f" ({', '.join(place)})" if place else ""), where=name)
        nb, kb = bucket(n, 1), bucket(k, 1)
        qp = np.zeros((nb, self.dim), np.float32)
        qp[:n] = q
        cp = np.zeros((nb, kb, self.dim), np.float32)
        cp[:n, :k] = c
        mp = np.zeros((nb, kb), bool)
        mp[:n, :k] = mk
        sel, scores = jax.device_get(_rank(self.policy(user_id).params, qp, cp, mp, m=m))
        return Ranking(np.asarray(sel[:n]), np.asarray(scores[:n, :k]))
