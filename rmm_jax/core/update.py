"""One online update for every scope: U users' batches in, the shared part and each user's
own part updated.

A user's reranker is ``scope.merge(shared, local_u)`` (:mod:`rmm_jax.core.scope`). One step of
U users, each with a batch of B queries (:class:`rmm_jax.core.types.Batch`, users axis
first), is REINFORCE (Williams, 1992) as in RMM's Retrospective Reflection (Tan et al., ACL
2025, §4.2), with the gradients split by owner:

    L_u      = −Σ_b w_ub Σ_j sg[A_ubj] log π_ubj      (:func:`rmm_jax.core.losses.reinforce_loss`)
    g_shared = (1/U_a) Σ_u ∇_shared L_u     over the U_a users with a real query in the batch,
    g_u      = ∇_{local_u} L_u               each user's own part learns from that user only,

    Δ_shared = √min(U_a, 100) · opt(g_shared),        Δ_u = opt(g_u).

**The shared step grows as √U_a, up to 10 times a user's.** The shared gradient is the mean
over users, a batch U_a times as large as one user's, and Adam normalises any gradient to
steps of about ``lr``: with
one step of ``lr`` per batch of users, a shared part that sees U_a users' citations could move
no further than one user's own part, and on the synthetic populations it learned no more
than each user alone (docs/scopes.md). The square-root scaling rule for adaptive optimisers
(Malladi et al., NeurIPS 2022: a κ-fold batch takes a √κ-fold Adam step) gives the mean of
U_a users' gradients a √U_a-fold step: a direction the users agree on moves √U_a times as far,
while the noise of the mean, √U_a times smaller, moves as far as one user's. For U_a = 1 the
update is exactly the user's own. (The scaling multiplies the optimiser's update, which is
linear in ``lr`` for Adam and SGD; ``lr`` still means one user's step.) Past
:data:`SHARED_STEP_MAX_USERS` = 100 users the step stops growing: at √900 = 30 times a user's
step, a shared part learned from 900 synthetic users served a newcomer's first 20 queries
+0.015 (n.s.) better than a fresh policy, against +0.163 at 10 times; the ceiling was chosen
on one synthetic population (the best of 5, 10, 15, 20 and 30 times) and held on another
(+0.156 at 10 times, +0.008 at 30; ``benchmarks/sharing.py`` part ``step``, docs/scopes.md).
After 300 and after 600 users 10 times was again the best of 5, 10, √300 and √600 times.
Scope ``user`` has an empty shared part, so g_shared is empty and each user's whole reranker is its own part;
``shared`` has empty local parts. A batch where no user has a real query leaves the shared
state unchanged (an Adam step on a zero gradient would still move it).

**The linear kind never builds a d×d gradient per user.** The loss is differentiated with
respect to the scores the batch already carries (one forward per step), and the chain rule
through s_bk = m_bk · (q'_b + M_m q'_b), q'_b = q_b + q_b M_q (flax kernels; in hybrid
M = K + A Bᵀ) is closed form: with u_b = Σ_k ∂L/∂s_bk m_bk and w_b = u_b + u_b M_m,

    ∂L/∂M_m = Σ_b u_b ⊗ q'_b,   ∂L/∂M_q = Σ_b q_b ⊗ w_b,
    ∂L/∂A = (∂L/∂M) B,          ∂L/∂B = (∂L/∂M)ᵀ A           (hybrid's per-user factors),

rank-B factors (:func:`linear_factors`). A user's own full kernels (scope ``user``) take
them straight into the optimiser's elementwise update
(:attr:`rmm_jax.core.optim.Optimizer.step_factors`); the shared kernels take the mean over
users as one contraction of all users' factors (one matmul; XLA reduces it over devices
when the users axis is sharded). The ``mlp`` kind uses autodiff of Σ_u L_u.

Everything is a pure function of arrays, built once by :func:`make_update`; it runs under
``jit``, ``vmap`` and ``lax`` loops without Python in the loop.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import optax

from rmm_jax.core import checks
from rmm_jax.core.config import Estimator, Layout
from rmm_jax.core.losses import citation_logistic_loss, citation_pairwise_loss, citation_rewards, reinforce_loss
from rmm_jax.core.optim import step_dense_or_factors
from rmm_jax.core.reranker import score_batch
from rmm_jax.core.sampling import selection_log_prob, shifted, top_m, valid_mask
from rmm_jax.core.types import Batch, LearnerState, QueryBatch, SharedState, UserState

SHARED_STEP_MAX_USERS = 100
"""The shared step grows as √U_a up to this many users with a query in the batch, then stays at
√100 = 10 times one user's step (module docstring)."""


def shared_step_multiple(n_active):
    """The shared part's step as a multiple of one user's, for ``n_active`` users with a query
    in the batch: √min(U_a, 100).

    Examples:
        >>> from rmm_jax.core.update import shared_step_multiple
        >>> [float(shared_step_multiple(u)) for u in (1, 4, 100, 900)]
        [1.0, 2.0, 10.0, 10.0]
    """
    return jnp.sqrt(jnp.minimum(jnp.asarray(n_active, jnp.float32), SHARED_STEP_MAX_USERS))

CiteFn = Callable  # (key, is_gold (M,) bool, filled (M,) bool) -> cited (M,) bool


# --------------------------------------------------------------------------- state


def init_learner_state(key, estimator: Estimator) -> LearnerState:
    """The learner state of a new user: b₀, step 0 and the user's PRNG key data.

    Examples:
      >>> import jax, rmm_jax as rj
      >>> ls = rj.init_learner_state(jax.random.key(1), rj.preset("paper").estimator)
      >>> float(ls.baseline), int(ls.step), ls.key.shape, ls.key.dtype      # paper: constant b = 0.5
      (0.5, 0, (2,), dtype('uint32'))
    """
    checks.check_key(key)
    return LearnerState(
        baseline=jnp.asarray(estimator.baseline_value if estimator.baseline != "batch_mean" else 0.0, jnp.float32),
        step=jnp.asarray(0, jnp.int32),
        key=jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)


def init_shared(params, layout: Layout, optimizer) -> SharedState:
    """The shared part of a starting policy ``params`` with a fresh optimiser state
    (empty trees in scope ``user``).

    Examples:
      >>> import jax, rmm_jax as rj
      >>> lay, est, opt = rj.preset("default", scope="shared")
      >>> st = rj.init_shared(rj.init_reranker(jax.random.key(0), 4), lay, opt)
      >>> st.params["q_adapter"]["W"]["kernel"].shape, int(st.opt_state[0].count)
      ((4, 4), 0)
      >>> rj.init_shared(rj.init_reranker(jax.random.key(0), 4), rj.preset().layout, opt).params   # scope user
      {}
    """
    shared = layout.scope.shared_part(params)
    return SharedState(shared, optimizer.init(shared))


def init_user(params, key, layout: Layout, estimator: Estimator, optimizer) -> UserState:
    """A new user's own part of a starting policy ``params`` (:meth:`Scope.split`), its
    optimiser state and its learner state.

    Examples:
      >>> import jax, rmm_jax as rj
      >>> lay, est, opt = rj.preset("default", k=3, m=2)
      >>> st = rj.init_user(rj.init_reranker(jax.random.key(0), 4), jax.random.key(1), lay, est, opt)
      >>> int(st.learner_state.step), st.params["q_adapter"]["W"]["kernel"].shape
      (0, (4, 4))
    """
    checks.check_key(key)
    _, local = layout.scope.split(params, key)
    return UserState(local, optimizer.init(local), init_learner_state(key, estimator))


# --------------------------------------------------------------------------- the estimate


def baseline_for(estimator: Estimator, learner_state: LearnerState, rewards, filled):
    """The baseline b for this batch and the next learner state's baseline.

    constant: b = baseline_value. batch_mean: b = mean reward of the batch's shown
    memories. running_mean: b = EMA before this batch; EMA ← ema·EMA + (1−ema)·batch mean.
    query_mean: b = mean reward of the memories shown for the same query (B, 1), so a
    query where nothing or everything was cited carries no update; it depends on the
    sampled selection, so the estimate is no longer unbiased.
    """
    n = jnp.sum(filled)
    batch_mean = jnp.where(n > 0, jnp.sum(jnp.where(filled, rewards, 0.0)) / jnp.maximum(n, 1), 0.0)
    if estimator.baseline == "constant":
        return jnp.float32(estimator.baseline_value), learner_state.baseline
    if estimator.baseline == "batch_mean":
        return batch_mean, learner_state.baseline
    if estimator.baseline == "query_mean":
        nq = jnp.sum(filled, axis=-1, keepdims=True)
        return jnp.sum(jnp.where(filled, rewards, 0.0), axis=-1, keepdims=True) / jnp.maximum(nq, 1), \
            learner_state.baseline
    ema = learner_state.baseline
    return ema, jnp.where(n > 0, estimator.ema * ema + (1 - estimator.ema) * batch_mean, ema)


def estimator_rewards(estimator: Estimator, cited, filled):
    """The estimator's per-shown-memory rewards (:func:`rmm_jax.core.losses.citation_rewards`
    with its ``reward`` and judge rates)."""
    return citation_rewards(cited, filled, estimator.reward, estimator.p_useful, estimator.p_other)


def importance_weights(estimator: Estimator, scores, batch: Batch):
    """Per-query weights: 0 for padding; clip(π/μ) where a behaviour log-prob μ is logged.

    π is the exact Plackett–Luce probability of the logged selection under the current
    ``scores`` (B, K). A ratio within ``on_policy_tol`` of 1 in log space is exactly 1:
    the replaying policy is the one that logged the data (keeps on-policy replay
    bit-identical).
    """
    lp = jax.vmap(lambda s, sel, mk: selection_log_prob(s, sel, estimator.sample_tau, "plackett_luce", None, mk))(
        scores, batch.selected, batch.mask)
    diff = lp - batch.logged_log_prob
    ratio = jnp.where(jnp.abs(diff) <= estimator.on_policy_tol, 1.0,
                      jnp.exp(jnp.minimum(diff, jnp.log(estimator.clip))))
    ratio = jnp.where(batch.has_logged, ratio, 1.0)
    return jax.lax.stop_gradient(jnp.where(batch.valid, ratio, 0.0))


def scores_loss(estimator: Estimator, scores, batch: Batch, baseline, weights):
    """One user's batch loss as a function of its scores (B, K): REINFORCE on the citation
    rewards, or (``loss="logistic"``) the citations as labels of the shown memories
    (:func:`rmm_jax.core.losses.citation_logistic_loss`; no baseline or credit), or
    (``loss="pairwise"``) as preferences of the cited over the uncited shown memories
    (:func:`rmm_jax.core.losses.citation_pairwise_loss`; no baseline, credit or judge rates)."""
    if estimator.loss == "pairwise":
        return citation_pairwise_loss(scores, batch.selected, batch.cited, estimator.tau, mask=batch.mask,
                                      weights=weights)
    if estimator.loss == "logistic":
        return citation_logistic_loss(scores, batch.selected, batch.cited, estimator.tau, offset=estimator.offset,
                                      p_useful=estimator.p_useful, p_other=estimator.p_other, mask=batch.mask,
                                      weights=weights, reference=retriever_best(estimator, batch))
    rewards = estimator_rewards(estimator, batch.cited, batch.selected >= 0)
    return reinforce_loss(scores, batch.selected, rewards, baseline, estimator.loss_tau, mode=estimator.mode,
                          credit=estimator.credit, gumbel=batch.gumbel, mask=batch.mask, weights=weights)


def retriever_best(estimator: Estimator, batch: Batch):
    """Each query's best base-retriever score max_k qᵀm_k (B,), the logistic loss's anchor
    under ``reference="retriever"``; None (the best current score) otherwise."""
    if estimator.reference != "retriever":
        return None
    base = jnp.einsum("bd,bkd->bk", batch.q, batch.m)
    best = jnp.max(jnp.where(batch.mask, base, -jnp.inf), axis=-1)
    return jnp.where(jnp.isfinite(best), best, 0.0)


def reranker_reinforce_loss(params, batch: Batch, baseline, weights, estimator: Estimator):
    """:func:`scores_loss` on the reranker's scores of ``batch`` (the autodiff path)."""
    return scores_loss(estimator, score_batch(params, batch.q, batch.m, batch.mask), batch, baseline, weights)


def linear_factors(params, q, m, mask, dscores):
    """The linear reranker's gradient from ∂L/∂s (B, K), in closed form (module docstring).

    ``params`` is one user's merged reranker (kernels ``W`` and, in hybrid, ``lora``
    factors). Returns the gradient tree with a pair ``(x (B, d), y (B, d'))`` at each leaf,
    ∂L/∂leaf = Σ_b x_b ⊗ y_b: every leaf's gradient is rank B, kernels and low-rank factors
    alike, so it can enter an optimiser's elementwise update without being written out.
    """
    pq, pm = params["q_adapter"], params["m_adapter"]
    kq, km = pq["W"]["kernel"], pm["W"]["kernel"]
    lq, lm = pq.get("lora"), pm.get("lora")
    qp = q + q @ kq + (0.0 if lq is None else (q @ lq["a"]) @ lq["b"].T)
    # a padded slot may hold anything (score's contract), NaN included: 0 · NaN would be NaN
    u = jnp.einsum("bk,bkd->bd", jnp.where(mask, dscores, 0.0), jnp.where(mask[..., None], m, 0.0))
    w = u + u @ km + (0.0 if lm is None else (u @ lm["a"]) @ lm["b"].T)
    out = {"q_adapter": {"W": {"kernel": (q, w)}}, "m_adapter": {"W": {"kernel": (u, qp)}}}
    if lq is not None:   # ∂L/∂A = (∂L/∂K) B = Σ_b x_b ⊗ (y_b B), ∂L/∂B = (∂L/∂K)ᵀ A = Σ_b y_b ⊗ (x_b A)
        out["q_adapter"]["lora"] = {"a": (q, w @ lq["b"]), "b": (w, q @ lq["a"])}
        out["m_adapter"]["lora"] = {"a": (u, qp @ lm["b"]), "b": (qp, u @ lm["a"])}
    return out


def _split_factors(factors, shared_params):
    """``(shared part, local part)`` of a factored gradient tree, by the shared params' keys."""
    if not shared_params:
        return {}, factors
    shared = {a: {k: v for k, v in f.items() if k in shared_params[a]} for a, f in factors.items()}
    local = {a: {k: v for k, v in f.items() if k not in shared_params[a]} for a, f in factors.items()}
    return shared, {a: f for a, f in local.items() if f}


def _where(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _policy_dim(shared_params, user_params) -> int | None:
    """The policy's embedding size d, read from the shape of the query adapter's kernel (the
    shared part's, or the users' own in scope ``user``); static, so free under jit."""
    for tree in (shared_params, user_params):
        adapter = tree.get("q_adapter") if isinstance(tree, Mapping) else None
        for name in ("W", "down"):
            if isinstance(adapter, Mapping) and name in adapter:
                return int(jnp.shape(adapter[name]["kernel"])[-1])
    return None


def check_batch(batch: Batch, n_users: int, dim: int | None = None) -> None:
    """The update's contract, with a leading users axis U = ``n_users`` on every leaf: ``q``
    (U, B, d) with d = ``dim`` (the policy's; None: not checked), ``m`` (U, B, K, d), ``mask``,
    ``gumbel``, ``scores`` (U, B, K), ``valid``,
    ``logged_log_prob``, ``has_logged`` (U, B), ``selected`` int and ``cited`` bool (U, B, M).
    Shapes and dtypes are static, so this holds under jit too; a wrong one was a chex
    AssertionError or a broadcasting error deep inside the step. Values (NaN in ``q``, NaN or
    +inf in ``scores``, ``selected`` beyond K or twice) are checked when concrete, i.e. when the update
    is called outside jit: the losses see them per user, under vmap, where they are traced."""
    checks.check_rank(batch.q, 3, "q")
    checks.check_rank(batch.m, 4, "m")
    checks.check_rank(batch.selected, 3, "selected")
    u, b, d = batch.q.shape
    k, m = batch.m.shape[2], batch.selected.shape[2]
    checks.require(u == n_users, "q", f"{u} users in the batch, {n_users} in the users' state")
    # before m's shape, which is read against q's d: a q of the wrong size blamed m
    checks.require(dim is None or d == dim, "q", f"embedding size {d}, the policy's is {dim} (shape {(u, b, d)})")
    want = {"m": (u, b, k, d), "mask": (u, b, k), "valid": (u, b), "selected": (u, b, m), "cited": (u, b, m),
            "gumbel": (u, b, k), "logged_log_prob": (u, b), "has_logged": (u, b), "scores": (u, b, k)}
    for name, shape in want.items():
        got = jnp.shape(getattr(batch, name))
        checks.require(got == shape, name, f"expected shape {shape} (U, B, K={k}, M={m}, d={d}), got {got}")
    checks.check_int(batch.selected, "selected")
    for name in ("mask", "valid", "cited", "has_logged"):
        got = jnp.result_type(getattr(batch, name))
        checks.require(got == jnp.bool_, name, f"expected dtype bool, got {got}")
    checks.check_no_nan(batch.q, "q")
    checks.check_scores(batch.scores)               # NaN, or +inf (an overflow the draws read as masked)
    checks.check_selected(batch.selected, k)


def make_update(layout: Layout, estimator: Estimator, optimizer):
    """Build ``apply(shared, users, batch) -> (shared, users, metrics)``: one step of U users.

    ``shared`` is a :class:`SharedState`; ``users`` a :class:`UserState` and ``batch`` a
    :class:`Batch` with ``scores`` (the users' current scores), both with a leading users
    axis U. ``metrics`` holds per-user (U,) loss, reward, baseline, cite_rate and weight.
    An argument of another type, or a batch that breaks :func:`check_batch`, is a
    ``ValueError`` naming it (checked when the update is called or traced, not in the step).

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> lay, est, opt = rj.preset("default", k=3, m=2, scope="shared")
      >>> p = rj.init_reranker(jax.random.key(0), 4)
      >>> shared = rj.init_shared(p, lay, opt)
      >>> users = jax.vmap(lambda k: rj.init_user(p, k, lay, est, opt))(jax.random.split(jax.random.key(1), 2))
      >>> q, m = jnp.ones((2, 1, 4)), jnp.broadcast_to(jnp.eye(3, 4), (2, 1, 3, 4))
      >>> b = rj.Batch(q=q, m=m, mask=jnp.ones((2, 1, 3), bool), valid=jnp.array([[True], [False]]),
      ...              selected=jnp.array([[[0, 2]], [[1, 0]]]), cited=jnp.array([[[True, False]], [[True, True]]]),
      ...              gumbel=jnp.zeros((2, 1, 3)), logged_log_prob=jnp.zeros((2, 1)),
      ...              has_logged=jnp.zeros((2, 1), bool), scores=rj.score_batch(p, q[0], m[0])[None].repeat(2, 0))
      >>> new_shared, new_users, metrics = rj.make_update(lay, est, opt)(shared, users, b)
      >>> new_users.learner_state.step.tolist(), metrics["cite_rate"].tolist()   # user 1 had no real query
      ([1, 1], [0.5, 0.0])
    """
    checks.require(isinstance(layout, Layout), "layout",
                   f"must be a Layout (rj.preset().layout), got {checks.short(layout)}")
    checks.require(isinstance(estimator, Estimator), "estimator",
                   f"must be an Estimator (rj.preset().estimator), got {checks.short(estimator)}")
    checks.require(callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)),
                   "optimizer",
                   f"must be an optax GradientTransformation (rj.adam(1e-4)), got {checks.short(optimizer)}")
    scope = layout.scope
    linear = layout.kind == "linear"

    def prepare(learner_state, batch: Batch):
        filled = (batch.selected >= 0) & batch.valid[:, None]
        rewards = estimator_rewards(estimator, batch.cited, filled)
        b, new_baseline = baseline_for(estimator, learner_state, rewards, filled)
        weights = importance_weights(estimator, batch.scores, batch)
        n = jnp.maximum(jnp.sum(filled), 1)
        stats = {"reward": jnp.sum(rewards) / n, "baseline": jnp.mean(b),
                 "cite_rate": jnp.sum(batch.cited & filled) / n, "weight": jnp.mean(weights)}
        return jax.lax.stop_gradient(b), new_baseline, weights, stats

    def linear_grads(shared_params, local_params, batch, b, weights):
        """(losses (U,), the shared part's dense gradient (the mean over active users of
        their rank-B gradients, one contraction), each user's own part as rank-B factors)."""
        def one(local, bt, bb, w):
            loss, ds = jax.value_and_grad(lambda s: scores_loss(estimator, s, bt, bb, w))(
                jax.lax.stop_gradient(bt.scores))
            return loss, linear_factors(scope.merge(shared_params, local), bt.q, bt.m, bt.mask, ds)

        losses, factors = jax.vmap(one)(local_params, batch, b, weights)
        shared_f, local_f = _split_factors(factors, shared_params)
        n_active = jnp.maximum(jnp.sum(jnp.any(batch.valid, axis=-1)), 1).astype(jnp.float32)
        g_shared = jax.tree.map(lambda xy: jnp.einsum("ubi,ubj->ij", *xy) / n_active, shared_f,
                                is_leaf=lambda v: isinstance(v, tuple))
        return losses, g_shared, local_f

    def autodiff_grads(shared_params, local_params, batch, b, weights):
        def total(sp, lp):
            per_user = jax.vmap(lambda l_, bt, bb, w: reranker_reinforce_loss(scope.merge(sp, l_), bt, bb, w,
                                                                               estimator))(lp, batch, b, weights)
            return jnp.sum(per_user), per_user

        (_, losses), (g_shared, g_local) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(
            shared_params, local_params)
        n_active = jnp.maximum(jnp.sum(jnp.any(batch.valid, axis=-1)), 1)
        return losses, jax.tree.map(lambda g: g / n_active.astype(g.dtype), g_shared), g_local

    def step_local(params, opt_state, grads):
        if linear:                                  # rank-B factors: into the optimiser's elementwise loop
            return step_dense_or_factors(optimizer, params, opt_state, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def apply(shared: SharedState, users: UserState, batch: Batch):
        # the types first (on the Python side: static under jit, nothing is added to the step):
        # swapped arguments were "'SharedState' object has no attribute 'learner_state'"
        for name, value, want, made_by in (("shared", shared, SharedState, "rj.init_shared"),
                                           ("users", users, UserState, "rj.init_user, vmapped over users"),
                                           ("batch", batch, Batch, "rj.Batch")):
            checks.require(isinstance(value, want), name, f"expected a {want.__name__} ({made_by}), "
                           f"got {type(value).__name__} (the update takes (shared, users, batch))")
        if batch.scores is None:
            raise ValueError("scores: the update needs the batch's current scores")
        check_batch(batch, users.learner_state.step.shape[0], _policy_dim(shared.params, users.params))
        b, new_baseline, weights, stats = jax.vmap(prepare)(users.learner_state, batch)
        grads = linear_grads if linear else autodiff_grads
        losses, g_shared, g_local = grads(shared.params, users.params, batch, b, weights)
        if scope.has_shared:
            upd, opt_state = optimizer.update(g_shared, shared.opt_state, shared.params)
            n_active = jnp.sum(jnp.any(batch.valid, axis=-1))
            upd = jax.tree.map(lambda u: u * shared_step_multiple(n_active).astype(u.dtype), upd)   # module docstring
            shared = _where(n_active > 0, SharedState(optax.apply_updates(shared.params, upd), opt_state), shared)
        n_users = users.learner_state.step.shape[0]
        params, opt_state = jax.vmap(step_local, axis_size=n_users)(users.params, users.opt_state, g_local)
        learner = users.learner_state._replace(baseline=new_baseline, step=users.learner_state.step + 1)
        return shared, UserState(params, opt_state, learner), {"loss": losses, **stats}

    return apply


# --------------------------------------------------------------------------- acting


def act(estimator: Estimator, m: int, scores, mask, key):
    """Sample ordered selections for a batch: Gumbel-top-M of s/τ' (Plackett–Luce at τ').

    τ' = ``estimator.sample_tau``: τ for tempered noise, 1 for the paper's unit noise (top-M
    of s + g). Args: scores (B,K) under the current policy; mask (B,K); key.
    Returns (selected (B,M) int32, gumbel on the score scale (B,K), exact behaviour
    log P(selection) (B,) under PL at τ').
    """
    chex.assert_rank([scores, mask], [2, 2])
    t = estimator.sample_tau
    g = jax.random.gumbel(key, scores.shape, scores.dtype)
    # less each query's best valid score (sampling.shifted): the same draw, without rounding s/τ'
    z = jax.vmap(lambda s, mk: shifted(s, valid_mask(s, mk)))(scores, mask) / t
    selected = jax.vmap(lambda z, mk: top_m(z, m, mk))(z + g, mask)
    logp = jax.vmap(lambda s, sel, mk: selection_log_prob(s, sel, t, "plackett_luce", None, mk))(
        scores, selected, mask)
    return selected, t * g, logp


def simulated_batch(estimator: Estimator, m: int, cite_fn: CiteFn, scores, queries: QueryBatch, key) -> Batch:
    """act → cite on queries with gold labels; returns the :class:`Batch` an update takes."""
    k_act, k_cite = jax.random.split(key)
    selected, gumbel, logp = act(estimator, m, scores, queries.mask, k_act)
    filled = (selected >= 0) & queries.valid[:, None]
    is_gold = jnp.take_along_axis(queries.gold, jnp.maximum(selected, 0), axis=1) & filled
    cited = jax.vmap(cite_fn)(jax.random.split(k_cite, selected.shape[0]), is_gold, filled)
    return Batch(q=queries.q, m=queries.m, mask=queries.mask, valid=queries.valid, selected=selected,
                 cited=cited, gumbel=gumbel, logged_log_prob=logp,
                 has_logged=jnp.zeros_like(queries.valid), scores=scores)
