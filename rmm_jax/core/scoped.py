"""One update of many users whose policies share a part: scopes ``shared`` and ``hybrid``.

A user's reranker is ``merge_params(shared, local_u)`` (:func:`rmm_jax.core.reranker.merge_params`):

    shared   every user's local part is empty: one reranker φ for all;
    hybrid   φ_u = (W_q, W_m) shared + (A_q^u, B_q^u, A_m^u, B_m^u) per user, the low-rank
             residual K^u = K + A^u B^uᵀ of each adapter.

One step of U users, each with a batch of B queries (:class:`rmm_jax.core.types.Batch`),
is REINFORCE (Williams, 1992) as in :func:`rmm_jax.core.update.make_apply_update`, with
the gradients split by owner:

    L_u      = the user's batch loss (:func:`rmm_jax.core.update.reranker_reinforce_loss`),
    g_shared = (1/U_a) Σ_u ∇_shared L_u     over the U_a users with a real query in the batch,
    g_u      = ∇_{local_u} L_u               each user's factors learn from that user only.

The shared gradient is the mean of the users' batch gradients, so a step has the scale of
one user's update whatever the number of users run side by side, and ``lr`` means the
same in every scope. All of it comes from one backward pass of Σ_u L_u: the shared
gradient is a contraction over the users axis that XLA computes as one matmul (and, when
the users axis is sharded over devices or hosts, reduces with a collective); the U
per-user d×d gradients are never built. The shared optimiser steps once per batch; each
user's optimiser steps on its own factors. A batch where no user has a real query leaves
the shared state unchanged (an Adam step on a zero gradient would still move it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from rmm_jax.core.losses import citation_rewards
from rmm_jax.core.reranker import dim_of, init_lowrank, merge_params
from rmm_jax.core.types import Batch, SharedState, UserState
from rmm_jax.core.update import (
    Config,
    baseline_for,
    importance_weights,
    init_learner_state,
    make_optimizer,
    reranker_reinforce_loss,
)

LOWRANK_KEY = 0x10CA1  # folded into a user's key for its low-rank initialisation


def split_params(params, key, cfg: Config):
    """``(shared, local)`` parts of a starting policy ``params`` for one user.

    ``user``: ``({}, params)``; ``shared``: ``(params, {})``; ``hybrid``: ``(params,``
    :func:`rmm_jax.core.reranker.init_lowrank` ``)`` with a key derived from ``key``, so the
    user scores exactly as ``params`` until it learns.

    Examples:
      >>> import jax, rmm_jax as rj
      >>> from rmm_jax.core.scoped import split_params
      >>> p = rj.init_reranker(jax.random.key(0), 4)
      >>> shared, local = split_params(p, jax.random.key(1), rj.Config(scope="hybrid", rank=2))
      >>> sorted(shared["q_adapter"]), sorted(local["q_adapter"]), local["q_adapter"]["lora"]["a"].shape
      (['W'], ['lora'], (4, 2))
    """
    if cfg.scope == "user":
        return {}, params
    if cfg.scope == "shared":
        return params, {}
    return params, init_lowrank(jax.random.fold_in(key, LOWRANK_KEY), dim_of(params), cfg.rank)


def init_shared_state(params, cfg: Config, optimizer: optax.GradientTransformation | None = None) -> SharedState:
    """The shared part of ``params`` with a fresh optimiser state (empty trees in scope ``user``)."""
    shared, _ = split_params(params, jax.random.key(0), cfg)
    return SharedState(shared, (optimizer or make_optimizer(cfg)).init(shared))


def init_local_state(params, key, cfg: Config, optimizer: optax.GradientTransformation | None = None) -> UserState:
    """A new user's own part: local params (see :func:`split_params`), their optimiser
    state and the learner state. In scope ``user`` this is
    :func:`rmm_jax.core.update.init_user_state`."""
    _, local = split_params(params, key, cfg)
    return UserState(local, (optimizer or make_optimizer(cfg)).init(local), init_learner_state(key, cfg))


def _where(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def make_apply_scoped_update(cfg: Config, optimizer: optax.GradientTransformation | None = None):
    """Build ``apply(shared, users, batch) -> (shared, users, metrics)``: one step of U users.

    ``shared`` is a :class:`SharedState`; ``users`` a :class:`UserState` and ``batch`` a
    :class:`Batch` with ``scores``, both with a leading users axis U. ``metrics`` holds
    per-user (U,) loss, reward, baseline, cite_rate and weight.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> from rmm_jax.core.scoped import init_local_state, init_shared_state, make_apply_scoped_update
      >>> cfg = rj.Config(k=3, m=2, scope="shared")
      >>> p = rj.init_reranker(jax.random.key(0), 4)
      >>> shared = init_shared_state(p, cfg)
      >>> users = jax.vmap(lambda k: init_local_state(p, k, cfg))(jax.random.split(jax.random.key(1), 2))
      >>> q, m = jnp.ones((2, 1, 4)), jnp.broadcast_to(jnp.eye(3, 4), (2, 1, 3, 4))
      >>> b = rj.Batch(q=q, m=m, mask=jnp.ones((2, 1, 3), bool), valid=jnp.array([[True], [False]]),
      ...              selected=jnp.array([[[0, 2]], [[1, 0]]]), cited=jnp.array([[[True, False]], [[True, True]]]),
      ...              gumbel=jnp.zeros((2, 1, 3)), logged_log_prob=jnp.zeros((2, 1)),
      ...              has_logged=jnp.zeros((2, 1), bool), scores=rj.score_batch(p, q[0], m[0])[None].repeat(2, 0))
      >>> new_shared, new_users, metrics = make_apply_scoped_update(cfg)(shared, users, b)
      >>> new_users.learner_state.step.tolist(), metrics["cite_rate"].tolist()   # user 1 had no real query
      ([1, 1], [0.5, 0.0])
    """
    opt = optimizer or make_optimizer(cfg)

    def prepare(learner_state, batch: Batch):
        filled = (batch.selected >= 0) & batch.valid[:, None]
        rewards = citation_rewards(batch.cited, filled, cfg.reward)
        b, new_baseline = baseline_for(cfg, learner_state, rewards, filled)
        weights = importance_weights(cfg, batch.scores, batch)
        n = jnp.maximum(jnp.sum(filled), 1)
        stats = {"reward": jnp.sum(rewards) / n, "baseline": jnp.mean(b),
                 "cite_rate": jnp.sum(batch.cited & filled) / n, "weight": jnp.mean(weights)}
        return jax.lax.stop_gradient(b), new_baseline, weights, stats

    def apply(shared: SharedState, users: UserState, batch: Batch):
        if batch.scores is None:
            raise ValueError("scores: the scoped update needs the batch's current scores")
        b, new_baseline, weights, stats = jax.vmap(prepare)(users.learner_state, batch)

        def total(shared_params, local_params):
            per_user = jax.vmap(lambda lp, bt, bb, w: reranker_reinforce_loss(
                merge_params(shared_params, lp), bt, bb, w, cfg))(local_params, batch, b, weights)
            return jnp.sum(per_user), per_user

        (_, losses), (g_shared, g_local) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(
            shared.params, users.params)
        n_active = jnp.sum(jnp.any(batch.valid, axis=-1))
        g_shared = jax.tree.map(lambda g: g / jnp.maximum(n_active, 1).astype(g.dtype), g_shared)
        upd, opt_state = opt.update(g_shared, shared.opt_state, shared.params)
        shared = _where(n_active > 0, SharedState(optax.apply_updates(shared.params, upd), opt_state), shared)
        n_users = users.learner_state.step.shape[0]
        upd, local_opt = jax.vmap(opt.update, axis_size=n_users)(g_local, users.opt_state, users.params)
        learner = users.learner_state._replace(baseline=new_baseline, step=users.learner_state.step + 1)
        users = UserState(optax.apply_updates(users.params, upd), local_opt, learner)
        return shared, users, {"loss": losses, **stats}

    return apply
