"""Losses: REINFORCE from citations (online) and listwise cross-entropy (offline).

REINFORCE (Williams, 1992) as used by RMM's Retrospective Reflection (Tan et al., ACL 2025,
§4.2): the generator cites some of the M memories it was shown; each shown memory gets a
reward r_j (cited or not) and the policy moves along (r − b) ∇ log π.

Credit assignment (``credit``), for an ordered selection i_1..i_M with per-draw
log-probabilities log π_j (see :mod:`rmm_jax.core.sampling`) and advantages a_j = r_j − b:

* ``item`` (the default, as in :class:`rmm_jax.Estimator`): A_j = a_j, per-memory credit.
  Biased under Plackett–Luce sampling: it ignores that drawing i_j removes it from the
  later draws (``tests/test_core_losses.py`` measures the bias against the exact
  gradient), but its variance is much lower, and it learned fastest on LoCoMo (README,
  "Choosing the defaults").
* ``reward_to_go``: A_j = Σ_{k ≥ j} a_k. Draw j changes which memories can be drawn
  later, so it is credited with its own and all later rewards. Unbiased for the
  gradient of E[Σ_j r_j] under the Plackett–Luce policy, and of lower variance than
  ``selection`` (earlier rewards do not depend on draw j, so dropping them removes noise
  without bias).
* ``selection``: A_j = Σ_k a_k, i.e. (R − b·M) ∇ log P(selection): the textbook estimator
  for the whole selection. Unbiased.

The loss is L = −Σ_b w_b Σ_j stop_gradient(A_bj) log π_bj, so −∇L is the REINFORCE
estimate summed over the queries of a batch; w_b are importance weights (1 on-policy,
0 for padding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rmm_jax.core import checks
from rmm_jax.core.sampling import NEG, selection_log_probs, valid_mask

REWARDS = ("pm1", "binary")
BASELINES = ("constant", "batch_mean", "running_mean", "query_mean")
CREDITS = ("item", "reward_to_go", "selection")


def citation_rewards(cited, filled, mapping: str = "binary"):
    """Per-shown-memory rewards: ``pm1`` +1 cited / −1 not (paper); ``binary`` 1 / 0.

    Args:
      cited: (..., M) bool. filled: (..., M) bool, slots that held a memory.
    Returns:
      (..., M) float32, zero at unfilled slots.

    Examples:
      >>> import jax.numpy as jnp, rmm_jax as rj
      >>> cited = jnp.array([True, False, False])
      >>> filled = jnp.array([True, True, False])         # the third slot held no memory
      >>> rj.citation_rewards(cited, filled, "binary").tolist()
      [1.0, 0.0, 0.0]
      >>> rj.citation_rewards(cited, filled, "pm1").tolist()
      [1.0, -1.0, 0.0]
    """
    checks.require(mapping in REWARDS, "reward", f"must be one of {REWARDS}, got {mapping!r}")
    r = jnp.where(cited, 1.0, -1.0 if mapping == "pm1" else 0.0)
    return jnp.where(filled, r, 0.0).astype(jnp.float32)


def advantages(rewards, baseline, filled, credit: str = "item"):
    """Advantages A (..., M) for :data:`CREDITS` (module docstring); zero at unfilled slots.

    With a_j = r_j − b: ``item`` A_j = a_j, ``reward_to_go`` A_j = Σ_{k ≥ j} a_k,
    ``selection`` A_j = Σ_k a_k.

    Examples:
      >>> import jax.numpy as jnp, rmm_jax as rj
      >>> r = jnp.array([1.0, 1.0, 0.0, 1.0])
      >>> filled = jnp.array([True, True, True, False])   # a = (0.5, 0.5, -0.5, ·)
      >>> rj.advantages(r, 0.5, filled, "item").tolist()
      [0.5, 0.5, -0.5, 0.0]
      >>> rj.advantages(r, 0.5, filled, "reward_to_go").tolist()
      [0.5, 0.0, -0.5, 0.0]
      >>> rj.advantages(r, 0.5, filled, "selection").tolist()
      [0.5, 0.5, 0.5, 0.0]
    """
    checks.require(credit in CREDITS, "credit", f"must be one of {CREDITS}, got {credit!r}")
    a = jnp.where(filled, rewards - baseline, 0.0)
    if credit == "reward_to_go":
        a = jnp.flip(jnp.cumsum(jnp.flip(a, -1), axis=-1), -1)
    elif credit == "selection":
        a = jnp.broadcast_to(jnp.sum(a, axis=-1, keepdims=True), a.shape)
    return jnp.where(filled, a, 0.0)


def reinforce_loss(scores, selected, rewards, baseline, tau, *, mode="plackett_luce",
                   credit="item", gumbel=None, mask=None, weights=None):
    """REINFORCE surrogate loss over a batch of queries.

        L = −Σ_b w_b Σ_j sg[A_bj] · log π_bj,    A from :func:`advantages`.

    Args:
      scores: (B, K) reranker scores (differentiable).
      selected: (B, M) int32 ordered selections, −1 for unfilled slots.
      rewards: (B, M) per-shown-memory rewards (:func:`citation_rewards`).
      baseline: scalar or broadcastable to (B, M); treated as a constant.
      tau: temperature > 0.
      mode: ``plackett_luce`` (exact log-prob) or ``rmm`` (paper; needs ``gumbel``).
      credit: ``item`` | ``reward_to_go`` | ``selection``.
      gumbel: (B, K) sampled noise on the score scale, for ``rmm``.
      mask: (B, K) bool valid candidates.
      weights: (B,) per-query weights (importance ratios; 0 drops a padded query).

    Returns:
      Scalar loss whose negative gradient is the REINFORCE estimate.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> scores = jnp.zeros((1, 3))                       # one query, uniform over K = 3
      >>> selected = jnp.array([[0, 1]], jnp.int32)         # drew memory 0, then 1
      >>> rewards = jnp.array([[1.0, 0.0]])                 # memory 0 was cited, 1 was not
      >>> loss = lambda s: rj.reinforce_loss(s, selected, rewards, 0.5, 1.0, credit="item")
      >>> round(float(loss(scores)), 4)                     # −(0.5 log 1/3 − 0.5 log 1/2)
      0.2027
      >>> [round(x, 4) for x in jax.grad(loss)(scores)[0].tolist()]  # descent raises s_0
      [-0.3333, 0.4167, -0.0833]
    """
    checks.check_rank(scores, 2, "scores")
    checks.check_rank(selected, 2, "selected")
    checks.require(rewards.shape == selected.shape, "rewards",
                    f"shape {rewards.shape} does not match selected {selected.shape}")
    b = scores.shape[0]
    weights = jnp.ones((b,), jnp.float32) if weights is None else weights
    checks.require(jnp.shape(weights) == (b,), "weights", f"expected shape ({b},), got {jnp.shape(weights)}")
    filled = selected >= 0
    adv = jax.lax.stop_gradient(advantages(rewards, baseline, filled, credit))
    w = jax.lax.stop_gradient(weights)
    if mask is None:
        mask = jnp.ones(scores.shape, bool)
    if gumbel is None:
        gumbel = jnp.zeros_like(scores)
    lp = jax.vmap(lambda s, sel, g, mk: selection_log_probs(s, sel, tau, mode, g, mk))(
        scores, selected, gumbel, mask)
    return -jnp.sum(w[:, None] * adv * lp)


def listwise_loss(scores, gold, mask=None, tau=1.0):
    """Supervised listwise loss for offline pretraining (ListNet-style, Cao et al., 2007).

        L_b = −Σ_i y_bi log softmax(s_b/τ)_i,   y_b = gold_b / Σ_i gold_bi  (valid slots only)

    averaged over the queries that have at least one valid gold candidate (others carry
    no signal and are excluded).

    Args:
      scores: (B, K). gold: (B, K) bool. mask: (B, K) bool valid candidates.

    Examples:
      >>> import jax.numpy as jnp, rmm_jax as rj
      >>> scores = jnp.zeros((1, 4))
      >>> round(float(rj.listwise_loss(scores, jnp.array([[True, False, False, False]]))), 4)
      1.3863
      >>> # two gold of four, uniform scores: −(½ log ¼ + ½ log ¼) = log 4 as well
      >>> round(float(rj.listwise_loss(scores, jnp.array([[True, True, False, False]]))), 4)
      1.3863
      >>> round(float(rj.listwise_loss(jnp.array([[2.0, 0.0]]), jnp.array([[True, False]]))), 4)
      0.1269
    """
    checks.check_rank(scores, 2, "scores")
    checks.require(gold.shape == scores.shape, "gold", f"shape {gold.shape} does not match scores {scores.shape}")
    valid = valid_mask(scores, mask)
    g = (gold & valid).astype(jnp.float32)
    n = jnp.sum(g, axis=-1)
    y = g / jnp.maximum(n, 1.0)[:, None]
    logp = jax.nn.log_softmax(jnp.where(valid, scores / tau, NEG), axis=-1)
    per_query = -jnp.sum(jnp.where(valid, y * logp, 0.0), axis=-1)
    has = n > 0
    return jnp.sum(jnp.where(has, per_query, 0.0)) / jnp.maximum(jnp.sum(has), 1)
