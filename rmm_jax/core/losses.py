"""Losses: REINFORCE from citations (online) and listwise or pointwise cross-entropy (offline).

REINFORCE (Williams, 1992) as used by RMM's Retrospective Reflection (Tan et al., ACL 2025,
§4.2): the generator cites some of the M memories it was shown; each shown memory gets a
reward r_j (cited or not) and the policy moves along (r − b) ∇ log π.

Credit assignment (``credit``), for an ordered selection i_1..i_M with per-draw
log-probabilities log π_j (see :mod:`rmm_jax.core.sampling`) and advantages a_j = r_j − b:

* ``item`` (the default, as in :class:`rmm_jax.Estimator`): A_j = a_j, per-memory credit.
  Biased under Plackett–Luce sampling: it ignores that drawing i_j removes it from the
  later draws (``tests/test_core_losses.py`` measures the bias against the exact
  gradient), but its variance is much lower, and it learned fastest on LoCoMo (docs/method.md,
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
import numpy as np

from rmm_jax.core import checks
from rmm_jax.core.sampling import NEG, check_picks, selection_log_probs, shifted, valid_mask

REWARDS = ("pm1", "binary")
BASELINES = ("constant", "batch_mean", "running_mean", "query_mean")
CREDITS = ("item", "reward_to_go", "selection")
LOSSES = ("reinforce", "logistic", "pairwise")
REFERENCES = ("best", "retriever")   # the logistic loss's anchor: the query's best current score, or the retriever's


def citation_rewards(cited, filled, mapping: str = "binary", p_useful: float = 1.0, p_other: float = 0.0):
    """Per-shown-memory rewards: ``binary`` 1 cited / 0 not; ``pm1`` +1 / −1 (paper); each
    corrected for a judge that cites a useful memory with probability ``p_useful`` and any
    other with ``p_other`` (the defaults 1 and 0 are a perfect judge: no correction).

    With c ∈ {0, 1} the citation and y ∈ {0, 1} whether the memory was useful,
    E[c | y] = p_other + (p_useful − p_other)·y, so

        binary:  r = (c − p_other) / (p_useful − p_other),      E[r | y] = y
        pm1:     r = 2·(c − p_other) / (p_useful − p_other) − 1, E[r | y] = 2y − 1

    are unbiased for the usefulness indicator (binary) and for ±1 (pm1). A reward affine in
    c changes a REINFORCE step only by a scale 1/(p_useful − p_other) and, for a constant
    baseline b, by moving b to p_other + b·(p_useful − p_other): with ``batch_mean`` or
    ``query_mean`` (shift-invariant) and Adam (scale-invariant) it leaves the update as it was.
    It matters for SGD, for a constant baseline, and for reading ``reward`` on the usefulness
    scale. The estimate is unbiased only where the judge's rates hold: the class-calibrated
    simulator (:func:`rmm_jax.data.citations.oracle`) cites a call with nothing useful at its
    ``spurious`` rate, which its defaults set equal to ``p_other``.

    Args:
      cited: (..., M) bool. filled: (..., M) bool, slots that held a memory.
      p_useful, p_other: the judge's rates, 0 <= p_other < p_useful <= 1.
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
      >>> [round(x, 4) for x in rj.citation_rewards(cited, filled, "binary", 0.9, 0.2).tolist()]  # (c − .2)/.7
      [1.1429, -0.2857, 0.0]
      >>> [round(x, 4) for x in rj.citation_rewards(cited, filled, "pm1", 0.9, 0.2).tolist()]     # 2(c − .2)/.7 − 1
      [1.2857, -1.5714, 0.0]
    """
    checks.require(mapping in REWARDS, "reward", f"must be one of {REWARDS}, got {mapping!r}")
    check_judge_rates(p_useful, p_other)
    checks.check_mask(cited, np.shape(cited), "cited")      # a float cited was a citation wherever it was not 0
    checks.check_mask(filled, cited.shape, "filled")
    y = (jnp.where(cited, 1.0, 0.0) - p_other) / (p_useful - p_other)     # unbiased for usefulness
    r = 2.0 * y - 1.0 if mapping == "pm1" else y
    return jnp.where(filled, r, 0.0).astype(jnp.float32)


def _call_contract(scores, selected, slots, name: str, weights, mask=None):
    """The per-call losses' contract: ``scores`` (B, K) float without NaN or +inf (−inf:
    masked), ``selected`` (B, M) int, each filled entry a candidate that is neither masked nor
    −inf (one a draw can select), ``slots`` (the rewards or citations, named ``name``) shaped
    as ``selected``, ``mask`` (B, K) bool or None, ``weights`` (B,) or None (ones). Returns
    the weights.

    The scores' values and the selected indices are checked here, on the whole batch, where
    they are concrete: the losses vmap over the queries, where they are traced (a masked pick
    was a loss of 1e30, or a finite, wrong one, with no error)."""
    checks.check_rank(scores, 2, "scores")
    checks.check_float(scores, "scores")
    checks.check_scores(scores)
    checks.check_rank(selected, 2, "selected")
    checks.check_int(selected, "selected")
    checks.require(selected.shape[0] == scores.shape[0], "selected",
                   f"shape {selected.shape} does not match scores {scores.shape} in B")
    if name == "cited":
        checks.check_mask(slots, selected.shape, name)
    else:
        checks.require(checks.is_array(slots) and slots.shape == selected.shape, name,
                       f"expected an array (numpy or jax) of shape {selected.shape} (as selected), "
                       f"got {checks.short(slots)}")
        checks.check_no_nan(slots, name)
    checks.check_selected(selected, scores.shape[1])
    checks.check_mask(mask, scores.shape)
    check_picks(scores, selected, mask)
    b = scores.shape[0]
    weights = jnp.ones((b,), jnp.float32) if weights is None else weights
    checks.require(checks.is_array(weights) and weights.shape == (b,), "weights",
                   f"expected an array (numpy or jax) of shape ({b},), got {checks.short(weights)}")
    checks.check_no_nan(weights, "weights")
    return weights


def check_judge_rates(p_useful: float, p_other: float) -> None:
    """``ValueError`` naming the field unless 0 <= p_other < p_useful <= 1 (a judge that cites
    useful memories more often than others; otherwise no correction exists)."""
    real = checks.is_real                      # before the comparisons: a string was a TypeError from `<`
    checks.require(real(p_useful) and 0.0 < p_useful <= 1.0, "p_useful", f"must be in (0, 1], got {p_useful!r}")
    checks.require(real(p_other) and 0.0 <= p_other < p_useful, "p_other",
                   f"must be in [0, p_useful={p_useful}), got {p_other!r}")


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
    checks.require(checks.is_array(rewards), "rewards",
                   f"expected an array (numpy or jax), got {checks.short(rewards)}")
    checks.check_mask(filled, rewards.shape, "filled")
    bs = np.shape(baseline)
    checks.require(len(bs) <= rewards.ndim and all(x in (1, y) for x, y in zip(bs[::-1], rewards.shape[::-1])),
                   "baseline", f"shape {bs} does not broadcast to the rewards' {rewards.shape}")
    checks.check_no_nan(baseline, "baseline")      # as the rewards: a NaN b made every advantage NaN
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
      scores: (B, K) reranker scores (differentiable), no NaN or +inf; −inf: masked.
      selected: (B, M) int32 ordered selections, −1 for unfilled slots; each a valid candidate.
      rewards: (B, M) per-shown-memory rewards (:func:`citation_rewards`).
      baseline: scalar or broadcastable to (B, M); treated as a constant.
      tau: temperature, >= :data:`rmm_jax.core.checks.TAU_MIN` (1e-6) and finite.
      mode: ``plackett_luce`` (exact log-prob) or ``rmm`` (paper; needs ``gumbel``).
      credit: ``item`` | ``reward_to_go`` | ``selection``.
      gumbel: (B, K) sampled noise on the score scale, for ``rmm``; finite.
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
    weights = _call_contract(scores, selected, rewards, "rewards", weights, mask)
    checks.check_tau(tau)
    checks.require(mode != "rmm" or gumbel is not None, "gumbel", "mode 'rmm' needs the sampled Gumbel noise")
    if gumbel is not None:
        checks.check_rank(gumbel, 2, "gumbel")
        checks.require(gumbel.shape == scores.shape, "gumbel", f"expected shape {scores.shape}, got {gumbel.shape}")
        checks.check_finite(gumbel, "gumbel")      # checked per query under vmap, where it is traced
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


def citation_logistic_loss(scores, selected, cited, tau, *, offset=0.0, p_useful=1.0, p_other=0.0, mask=None,
                           weights=None, reference=None):
    """Pointwise logistic regression of citations on the shown memories' scores, corrected
    for the judge's rates (the ``logistic`` estimator).

    Each shown memory j of query b is a labelled example: cited or not. Its usefulness
    logit is the score relative to the query's best candidate, and a citation follows the
    judge's rates (forward loss correction for class-conditional label noise: Natarajan et
    al., NeurIPS 2013; Patrini et al., CVPR 2017):

        u_bj = (s_{b,i_j} − sg[max_k s_bk]) / τ + offset,
        P_bj = P(cite) = p_other + (p_useful − p_other)·σ(u_bj),
        L = −Σ_b w_b Σ_j [c_bj log P_bj + (1 − c_bj) log(1 − P_bj)].

    With ``p_useful`` = 1, ``p_other`` = 0 it is plain binary cross-entropy on the logits u
    (what Vowpal Wabbit's ``--loss_function logistic`` fits per shown memory). The loss is
    proper for usefulness: if a memory is useful with probability η and the judge cites at
    those rates, E_c[L] is smallest at σ(u) = η. A memory that was not shown gets no
    gradient, and the anchor max_k s_bk is a constant, so the loss moves the shown
    memories' scores only, each against its own label: a cited memory rises by
    ∝ (1 − P)·…, an uncited one falls by ∝ P·…, until its predicted citation rate matches
    what it gets. ``offset`` places the best candidate's logit: memories the judge cites
    less often than σ(offset) (plain) are pushed below the best.

    The best candidate itself is the exception: its logit is ``offset`` whatever its score, so
    its gradient never vanishes. Cited in more than a share σ(offset) of its calls, it rises
    without end (and an uncited best falls until another is best): under Adam, whose steps
    keep their size as a gradient shrinks, the scores' scale grows with the number of
    updates, and the draw stops exploring. A ``reference`` anchors the logits elsewhere:
    given the per-query constant r_b (the base retriever's best score: ``Estimator(reference=
    "retriever")``), u_bj = (s_{b,i_j} − r_b)/τ + offset for every shown memory, the best
    included, so each score settles where its predicted rate meets its citation rate. At the
    start (scores equal to the retriever's) both anchors give the same logits and gradient.

    Args:
      scores: (B, K) reranker scores (differentiable), no NaN or +inf; −inf: masked.
        selected: (B, M) int32 positions of valid candidates, −1 unfilled. cited: (B, M) bool.
        tau: logit scale > 0.
      offset: the logit of a memory scored at the anchor. p_useful, p_other: the judge's rates
        (:func:`check_judge_rates`). mask: (B, K) bool valid candidates. weights: (B,)
        per-query weights (importance ratios; 0 drops a padded query). reference: (B,)
        per-query anchors, held constant; None: the best valid current score (stop-gradient).

    Returns:
      Scalar loss.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> scores = jnp.array([[0.3, 0.2, 0.0]])            # memory 0 is the best candidate
      >>> selected, cited = jnp.array([[0, 2]]), jnp.array([[False, True]])
      >>> loss = lambda s: rj.citation_logistic_loss(s, selected, cited, 0.1)
      >>> round(float(loss(scores)), 4)                     # −log(1 − σ(0)) − log σ(−3)
      3.7417
      >>> [round(x, 3) for x in jax.grad(loss)(scores)[0].tolist()]  # (σ(u) − c)/τ on the shown only
      [5.0, 0.0, -9.526]
      >>> up = jnp.array([[0.5, 0.2, 0.0]])                 # the best one raised: its logit stays 0 ...
      >>> round(float(jax.grad(loss)(up)[0, 0]), 3)
      5.0
      >>> fixed = lambda s: rj.citation_logistic_loss(s, selected, cited, 0.1, reference=jnp.array([0.3]))
      >>> round(float(jax.grad(fixed)(up)[0, 0]), 3)          # ... against a fixed anchor it is σ(2)/τ
      8.808
    """
    weights = _call_contract(scores, selected, cited, "cited", weights, mask)
    checks.check_tau(tau)
    check_judge_rates(p_useful, p_other)
    valid = valid_mask(scores, mask)
    finite = jnp.where(valid, scores, 0.0)                  # masked (−inf) slots out before any arithmetic
    if reference is None:
        top = jnp.max(jnp.where(valid, scores, NEG), axis=-1, keepdims=True)
        top = jnp.where(jnp.any(valid, axis=-1, keepdims=True), top, 0.0)
    else:
        checks.require(jnp.shape(reference) == scores.shape[:1], "reference",
                       f"one anchor per query: expected shape {scores.shape[:1]}, got {jnp.shape(reference)}")
        checks.check_finite(reference, "reference")
        top = jnp.asarray(reference, scores.dtype)[:, None]
    top = jax.lax.stop_gradient(top)
    filled = selected >= 0
    u = (jnp.take_along_axis(finite, jnp.maximum(selected, 0), axis=-1) - top) / tau + offset
    u = jnp.where(filled, u, 0.0)
    gap = p_useful - p_other
    # log P and log(1 − P), stable for any u: P = p_other + gap·σ(u), 1 − P = (1 − p_useful) + gap·σ(−u)
    log_p = jnp.logaddexp(jnp.log(jnp.float32(p_other)), jnp.log(jnp.float32(gap)) + jax.nn.log_sigmoid(u))
    log_q = jnp.logaddexp(jnp.log(jnp.float32(1.0 - p_useful)), jnp.log(jnp.float32(gap)) + jax.nn.log_sigmoid(-u))
    per = jnp.where(filled, jnp.where(cited, log_p, log_q), 0.0)
    return -jnp.sum(jax.lax.stop_gradient(weights) * jnp.sum(per, axis=-1))


def citation_pairwise_loss(scores, selected, cited, tau, *, mask=None, weights=None):
    """Pairwise logistic loss of each cited shown memory over each uncited one of the same call
    (the ``pairwise`` estimator): the citations as preferences within a call, not as labels.

        P_b = {(i, j): shown memories of query b, i cited, j not},
        L = Σ_b w_b · (1/|P_b|) Σ_{(i,j)∈P_b} log(1 + exp(−(s_{b,i} − s_{b,j}) / τ)).

    The clicked-over-skipped preferences of implicit feedback (Joachims, KDD 2002) with
    Bayesian Personalised Ranking's logistic loss (Rendle et al., UAI 2009). Each call's
    pairs are averaged, so every call with a pair weighs the same. Adding a constant to a
    call's scores leaves its loss unchanged, and a call that cites all or none of its shown
    memories has no pair and no gradient: unlike :func:`citation_logistic_loss`, it never
    pushes a call's shown memories down together because none was cited. It takes no judge
    rates: a false citation swaps the pair it is in, which lowers the gradient's size but
    keeps its sign on average wherever useful memories are cited more often than others.

    Args:
      scores: (B, K) reranker scores (differentiable), no NaN or +inf; −inf: masked.
        selected: (B, M) int32 positions of valid candidates, −1 unfilled. cited: (B, M) bool.
        tau: logit scale > 0.
      mask: (B, K) bool valid candidates. weights: (B,) per-query weights (importance ratios;
        0 drops a padded query).

    Returns:
      Scalar loss.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> scores = jnp.array([[0.5, 0.25, 0.0]])
      >>> selected, cited = jnp.array([[0, 2]]), jnp.array([[False, True]])
      >>> loss = lambda s: rj.citation_pairwise_loss(s, selected, cited, 0.125)
      >>> round(float(loss(scores)), 4)                      # log(1 + exp(4)): memory 2 over memory 0
      4.0181
      >>> [round(x, 3) for x in jax.grad(loss)(scores)[0].tolist()]   # ±σ(4)/τ on the pair only
      [7.856, 0.0, -7.856]
      >>> float(loss(scores + 2.0)) == float(loss(scores))   # a call's level does not matter
      True
    """
    weights = _call_contract(scores, selected, cited, "cited", weights, mask)
    checks.check_tau(tau)
    finite = jnp.where(valid_mask(scores, mask), scores, 0.0)       # masked (−inf) slots out before any arithmetic
    filled = selected >= 0
    shown = jnp.take_along_axis(finite, jnp.maximum(selected, 0), axis=-1)    # (B, M)
    pair = (filled & cited)[:, :, None] & (filled & ~cited)[:, None, :]      # (B, M, M): i cited, j not
    margin = (shown[:, :, None] - shown[:, None, :]) / tau
    n = jnp.sum(pair, axis=(1, 2))
    per = jnp.sum(jnp.where(pair, jax.nn.softplus(-margin), 0.0), axis=(1, 2)) / jnp.maximum(n, 1)
    return jnp.sum(jax.lax.stop_gradient(weights) * per)


def _gold_contract(scores, gold, mask):
    """The offline losses' contract: ``scores`` (B, K) float without NaN or +inf (checked
    when concrete; −inf: masked), ``gold`` and ``mask`` (B, K) bool."""
    checks.check_rank(scores, 2, "scores")
    checks.check_float(scores, "scores")
    checks.check_scores(scores)
    checks.check_mask(gold, scores.shape, "gold")
    checks.check_mask(mask, scores.shape)


def listwise_loss(scores, gold, mask=None, tau=1.0):
    """Supervised listwise loss for offline pretraining (ListNet-style, Cao et al., 2007).

        L_b = −Σ_i y_bi log softmax(s_b/τ)_i,   y_b = gold_b / Σ_i gold_bi  (valid slots only)

    averaged over the queries that have at least one valid gold candidate (others carry
    no signal and are excluded).

    Args:
      scores: (B, K). gold: (B, K) bool. mask: (B, K) bool valid candidates. tau: temperature > 0.

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
    _gold_contract(scores, gold, mask)
    checks.check_tau(tau)
    valid = valid_mask(scores, mask)
    g = (gold & valid).astype(jnp.float32)
    n = jnp.sum(g, axis=-1)
    y = g / jnp.maximum(n, 1.0)[:, None]
    logp = jax.nn.log_softmax(jnp.where(valid, jax.vmap(shifted)(scores, valid) / tau, NEG), axis=-1)
    per_query = -jnp.sum(jnp.where(valid, y * logp, 0.0), axis=-1)
    has = n > 0
    return jnp.sum(jnp.where(has, per_query, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def pointwise_loss(scores, gold, mask=None, tau=1.0, *, balanced: bool = False):
    """Supervised pointwise loss for offline pretraining: every valid candidate one logistic
    example, gold or not (what a pointwise learner such as Vowpal Wabbit's ``--loss_function
    logistic`` fits), averaged over the queries with a valid gold candidate as
    :func:`listwise_loss` averages.

    It is :func:`citation_logistic_loss` with all K candidates shown and the gold ones cited,
    so its logits are anchored at the query's best candidate: u_bi = (s_bi − max_k s_bk)/τ.
    ``balanced`` weighs a query's gold examples as much as its others together (each gold one
    by n_other / n_gold).

    Args:
      scores: (B, K). gold: (B, K) bool. mask: (B, K) bool valid candidates. tau: logit scale > 0.

    Examples:
      >>> import jax.numpy as jnp, rmm_jax as rj
      >>> s, g = jnp.array([[0.3, 0.2, 0.0]]), jnp.array([[False, False, True]])
      >>> shown = rj.citation_logistic_loss(s, jnp.array([[0, 1, 2]]), g, 0.1)
      >>> float(rj.pointwise_loss(s, g, tau=0.1)) == float(shown)
      True
      >>> one = lambda sel, c: float(rj.citation_logistic_loss(s, jnp.array([sel]), jnp.array([c]), 0.1))
      >>> bool(jnp.isclose(rj.pointwise_loss(s, g, tau=0.1, balanced=True),   # the gold one counts twice
      ...                  2 * one([2], [True]) + one([0, 1], [False, False])))
      True
    """
    _gold_contract(scores, gold, mask)
    checks.check_tau(tau)
    valid = valid_mask(scores, mask)
    pos, neg = gold & valid, ~gold & valid
    has = jnp.any(pos, axis=-1)
    per_query = has / jnp.maximum(jnp.sum(has), 1)
    slots = jnp.arange(scores.shape[-1], dtype=jnp.int32)[None, :]
    if not balanced:
        return citation_logistic_loss(scores, jnp.where(valid, slots, -1), pos, tau, mask=valid, weights=per_query)
    n_pos, n_neg = jnp.sum(pos, axis=-1), jnp.sum(neg, axis=-1)
    up = citation_logistic_loss(scores, jnp.where(pos, slots, -1), pos, tau, mask=valid,
                                weights=per_query * n_neg / jnp.maximum(n_pos, 1))
    return up + citation_logistic_loss(scores, jnp.where(neg, slots, -1), pos, tau, mask=valid, weights=per_query)
