"""Serving: score a new query with a stored user's policy, in one call.

:func:`score_query` loads the user's newest good policy from a policy store
(:mod:`rmm_jax.persist.policy_store`) and scores the candidates with the core reranker
(:func:`rmm_jax.core.reranker.score`). It lives here, not in :mod:`rmm_jax.persist`, because the
persistence layer does not import the reranker.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import reranker
from rmm_jax.errors import InputError
from rmm_jax.persist.policy_store import PolicyStore


def user_params(store: PolicyStore, user_id: str, *, fallback_to_shared: bool = False):
    """The reranker params that score ``user_id``'s queries, as device arrays.

    The one way to read a usable policy out of a store, whatever its scope (see
    :data:`rmm_jax.core.update.SCOPES`): ``user``, the user's own params; ``shared``, the
    store's newest shared params; ``hybrid``, the user's low-rank residual merged
    (:func:`rmm_jax.core.reranker.merge_params`) with exactly the shared version it was
    trained against (:meth:`PolicyStore.load`). With ``fallback_to_shared`` a user without
    saved state gets the newest shared params instead of an error.
    """
    scope = store.meta.get("scope") or "user"
    if scope == "shared" or (fallback_to_shared and not store.has_user(user_id)):
        params = store.shared_state().state.params   # a new user of a hybrid store: its residual is zero
    elif scope == "hybrid":
        saved = store.load(user_id)
        params = reranker.merge_params(store.shared_state(saved.shared_version).state.params, saved.state.params)
    else:
        params = store.load(user_id).state.params
    # Device arrays throughout: with numpy inputs some ops would run in numpy instead of XLA.
    return jax.tree_util.tree_map(jnp.asarray, params)


def score_query(store_path, user_id: str, query_emb, candidate_embs, mask=None, *,
                fallback_to_shared: bool = False):
    """Load ``user_id``'s policy from the store and score candidates: ``(K,)`` scores.

    One call from a saved store to reranker scores, via ``rmm_jax.core.reranker.score(params, q, m,
    mask)``. With ``fallback_to_shared`` a user without saved state is scored with the
    shared (pretrained) params instead of raising.
    """
    q = np.asarray(query_emb)
    m = np.asarray(candidate_embs)
    if q.ndim != 1:
        raise InputError(f"query_emb must have shape (d,), got {q.shape}", where="query_emb")
    if m.ndim != 2 or m.shape[1] != q.shape[0]:
        raise InputError(f"candidate_embs must have shape (K, {q.shape[0]}), got {m.shape}", where="candidate_embs")
    if mask is not None and np.shape(mask) != (m.shape[0],):
        raise InputError(f"mask must have shape ({m.shape[0]},), got {np.shape(mask)}", where="mask")
    store = PolicyStore.open(store_path, expect_dim=q.shape[0])
    params = user_params(store, user_id, fallback_to_shared=fallback_to_shared)
    return reranker.score(params, jnp.asarray(q), jnp.asarray(m), mask=None if mask is None else jnp.asarray(mask))
