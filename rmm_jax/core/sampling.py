"""Stochastic top-M selection and the log-probability of an ordered selection.

Gumbel-top-M (Kool, van Hoof & Welling, ICML 2019, "Stochastic Beams and Where to Find
Them"): with g_i ~ Gumbel(0, 1) i.i.d., the indices of the M largest s_i/τ + g_i are an
ordered sample without replacement from the Plackett–Luce distribution of softmax(s/τ):

    P(i_1, …, i_M) = Π_j exp(s_{i_j}/τ) / Σ_{k ∉ {i_1..i_{j−1}}} exp(s_k/τ).

RMM (Tan et al., ACL 2025, §4.2) samples this way and writes the log-probability as a sum
of per-item log-softmaxes of the perturbed scores, Σ_{i∈sel} log softmax((s + g)/τ)_i.
That is a surrogate, not the probability of the sample; mode ``plackett_luce`` is exact.

Conventions: a selection is an (M,) int32 vector of candidate indices in draw order;
slots that could not be filled (fewer than M valid candidates) hold −1 and contribute
nothing; any other index must be in [0, K) and appear once (checked on concrete arrays
only: under ``jit`` or ``vmap`` it is traced, and the gather clamps it). Masked candidates
(mask False, or a score of −inf) are never drawn and receive zero gradient; a NaN or +inf
score is refused (when concrete), not taken as masked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import checks

# Finite stand-in for −inf on masked logits: logsumexp stays finite and gradients NaN-free.
NEG = -1e30
MODES = ("plackett_luce", "rmm")


def valid_mask(scores, mask=None):
    """Candidates that may be drawn: unmasked and with a finite score (−inf: masked; +inf and
    NaN are refused by the public functions' checks when concrete, :func:`checks.check_scores`)."""
    v = jnp.isfinite(scores)
    return v if mask is None else v & mask


def shifted(scores, valid):
    """``scores`` less the largest valid one, a constant (no gradient): Plackett–Luce and softmax
    probabilities are the same, and s/τ no longer rounds at the scale of s. Scores near 1e4 at
    τ = 0.01 are 1e6 apart from 0, where float32's step is 0.0625: a selection's log-probability
    was 0.0625 nats off, and the Gumbel noise rounded to steps of 1/16 drew tied candidates
    0.403 and 0.391 (0.397 each). All invalid: unshifted.

    Examples:
      >>> import jax.numpy as jnp
      >>> from rmm_jax.core.sampling import shifted
      >>> shifted(jnp.array([1e4, 1e4 - 1.0, -jnp.inf]), jnp.array([True, True, False])).tolist()
      [0.0, -1.0, -inf]
    """
    top = jnp.max(jnp.where(valid, scores, -jnp.inf))
    return scores - jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))


def check_picks(scores, selected, mask=None) -> None:
    """``ValueError`` naming ``selected`` when a filled entry (>= 0) of the selections
    (..., M) picks a candidate of ``scores`` (..., K) that is masked or scores −inf: no draw
    selects it, and its log-probability is the −1e30 stand-in (a loss of 1e30, or a finite,
    wrong one), no error. Checked when all three are concrete, on the whole batch: a loss
    vmaps over its queries, where they are traced. The indices are in range
    (:func:`checks.check_selected` first)."""
    if not (checks.is_concrete(scores) and checks.is_concrete(selected) and checks.is_concrete(mask)):
        return
    v = np.isfinite(np.asarray(scores))            # valid_mask in NumPy: an eager jnp op is a program to load
    v = v if mask is None else v & np.asarray(mask, bool)
    sel = np.asarray(selected)
    bad = np.argwhere((sel >= 0) & ~np.take_along_axis(v, np.maximum(sel, 0), axis=-1))
    if len(bad):
        at = tuple(bad[0].tolist())
        row = f" (row {', '.join(map(str, at[:-1]))})" if sel.ndim > 1 else ""
        checks.require(False, "selected", f"candidate {int(sel[at])}{row} is masked or its score is not finite: "
                                          "no draw selects it")


def _check_scores(scores, mask, m=None, selected=None):
    checks.check_rank(scores, 1, "scores")
    checks.check_float(scores, "scores")
    checks.check_scores(scores)
    checks.check_mask(mask, scores.shape)
    k = scores.shape[0]
    if m is not None:
        checks.require(checks.is_int(m) and 1 <= m <= k, "m", f"must be an int in [1, K={k}], got {m!r}")
    if selected is not None:
        checks.check_rank(selected, 1, "selected")
        checks.check_int(selected, "selected")
        checks.require(selected.shape[0] <= k, "selected", f"length {selected.shape[0]} exceeds K={k}")
        checks.check_selected(selected, k)
        if checks.is_concrete(selected):      # also under jax.grad of the scores
            sel = np.asarray(selected)
            # a draw's order: [1, -1, 0] was read as the draws 1 then 0, the -1 skipped (a loss's selection may
            # hold -1 anywhere: a slot it leaves out)
            checks.require(not (sel[1:] >= 0)[sel[:-1] < 0].any(), "selected",
                           "an unfilled slot (-1) comes before a filled one: unfilled slots end a draw")
            check_picks(scores, selected, mask)        # a masked or -inf pick: -1e30, no error


def _check_gumbel(gumbel, scores):
    """Noise of the scores' shape: a (1,) or (K, 1) one broadcast silently to a wrong draw; finite
    when concrete: a NaN was drawn first (gumbel [0, nan, 0, 0] drew [1, 0] from scores
    [3, 1, 0, -1]), as an inf would be."""
    checks.check_rank(gumbel, scores.ndim, "gumbel")
    checks.require(gumbel.shape == scores.shape, "gumbel", f"expected shape {scores.shape}, got {gumbel.shape}")
    checks.check_float(gumbel, "gumbel")
    checks.check_finite(gumbel, "gumbel")


def top_m(logits, m: int, mask=None):
    """Deterministic ordered top-M of the valid logits; unfilled slots are −1.

    Args:
      logits: (K,) float, no NaN or +inf (checked when concrete); −inf or masked: never selected.
      m: static int, 1 ≤ m ≤ K. mask: optional (K,) bool.

    Returns:
      (M,) int32 indices of the M largest valid logits, largest first.

    Examples:
      >>> import jax.numpy as jnp, rmm_jax as rj
      >>> logits = jnp.array([0.1, 3.0, -2.0, 1.5])
      >>> rj.top_m(logits, 3).tolist()
      [1, 3, 0]
      >>> rj.top_m(logits, 3, mask=jnp.array([True, False, False, True])).tolist()  # 2 valid
      [3, 0, -1]
    """
    checks.check_rank(logits, 1, "logits")
    checks.check_float(logits, "logits")       # ints were ranked as they were, unlike every other scores input
    checks.check_scores(logits, "logits")      # NaN or +inf was taken as masked; either is a bug upstream
    k = logits.shape[0]
    checks.require(checks.is_int(m) and 1 <= m <= k, "m", f"must be an int in [1, K={k}], got {m!r}")
    checks.check_mask(mask, logits.shape)
    return _top_m(logits, int(m), valid_mask(logits, mask))


def _top_m(logits, m: int, valid):
    """:func:`top_m` of checked logits among ``valid``."""
    _, idx = jax.lax.top_k(jnp.where(valid, logits, -jnp.inf), m)
    return jnp.where(valid[idx], idx, -1).astype(jnp.int32)


def gumbel_top_m(key, scores, m: int, tau, mask=None, *, gumbel=None):
    """Draw an ordered selection of M candidates from Plackett–Luce(softmax(s/τ)).

    i_1..i_M = top-M of (s/τ + g), g ~ Gumbel(0, 1) i.i.d. (Kool et al., 2019), s taken
    less its largest valid score (:func:`shifted`: the same distribution, without rounding s/τ).

    Args:
      key: PRNG key (ignored when ``gumbel`` is given).
      scores: (K,) float scores, no NaN or +inf (checked when concrete); −inf: masked.
      m: number of memories to select, 1 ≤ m ≤ K.
      tau: temperature, >= :data:`rmm_jax.core.checks.TAU_MIN` (1e-6) and finite.
      mask: optional (K,) bool of valid candidates.
      gumbel: optional (K,) precomputed Gumbel noise (to reuse it in the `rmm` log-prob), finite.

    Returns:
      (M,) int32 candidate indices in draw order; −1 where fewer than M are valid.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> scores = jnp.array([2.0, -1.0, 0.5, 1.0])
      >>> sel = rj.gumbel_top_m(jax.random.key(0), scores, 2, tau=0.5)
      >>> sel.shape, sel.dtype, len(set(sel.tolist()))       # 2 distinct candidates
      ((2,), dtype('int32'), 2)
      >>> rj.gumbel_top_m(None, scores, 3, 1.0, gumbel=jnp.zeros(4)).tolist()  # no noise: top-M
      [0, 3, 2]
      >>> few = jnp.array([True, False, False, True])         # fewer valid than M
      >>> sorted(rj.gumbel_top_m(jax.random.key(1), scores, 3, 1.0, mask=few).tolist())
      [-1, 0, 3]
    """
    _check_scores(scores, mask, m=m)
    checks.check_tau(tau)
    if gumbel is None:
        checks.check_key(key)
    else:
        _check_gumbel(gumbel, scores)
    m = int(m)
    if gumbel is None:
        gumbel = jax.random.gumbel(key, scores.shape, scores.dtype)
    valid = valid_mask(scores, mask)
    return _top_m(shifted(scores, valid) / tau + gumbel, m, valid)     # scores checked above


def selection_log_probs(scores, selected, tau, mode: str = "plackett_luce", gumbel=None, mask=None):
    """Per-draw log-probabilities of an ordered selection, shape (M,); 0 at unfilled slots.

    ``plackett_luce`` (exact): log π_j = s_{i_j}/τ − logsumexp_{k ∈ R_j} s_k/τ, where R_j
      are the valid candidates not drawn before step j. Σ_j log π_j = log P(selection).
    ``rmm`` (RMM paper): log π_j = log softmax((s + g)/τ)_{i_j} with the sampled Gumbel
      noise g (on the score scale; pass τ·g for noise drawn on the s/τ scale), treated as
      a constant.

    Examples:
      >>> import jax.numpy as jnp, rmm_jax as rj
      >>> scores = jnp.log(jnp.array([1.0, 2.0, 1.0]))     # softmax = (1/4, 1/2, 1/4)
      >>> lp = rj.selection_log_probs(scores, jnp.array([1, 0, -1]), 1.0)
      >>> [round(x, 6) for x in jnp.exp(lp).tolist()]       # 1/2, then (1/4)/(1/2); unfilled: 1
      [0.5, 0.5, 1.0]
    """
    checks.require(mode in MODES, "mode", f"must be one of {MODES}, got {mode!r}")
    checks.require(mode != "rmm" or gumbel is not None, "gumbel", "mode 'rmm' needs the sampled Gumbel noise")
    _check_scores(scores, mask, selected=selected)
    checks.check_tau(tau)
    valid = valid_mask(scores, mask)
    filled = selected >= 0
    idx = jnp.where(filled, selected, 0)
    if mode == "rmm":
        _check_gumbel(gumbel, scores)
        z = jnp.where(valid, (shifted(scores, valid) + jax.lax.stop_gradient(gumbel)) / tau, NEG)
        lp = jax.nn.log_softmax(z)[idx]
    else:
        z = jnp.where(valid, shifted(scores, valid) / tau, NEG)
        onehot = (idx[:, None] == jnp.arange(scores.shape[0])[None, :]) & filled[:, None]
        drawn_before = jnp.cumsum(onehot, axis=0) - onehot
        remaining = valid[None, :] & (drawn_before == 0)
        lp = z[idx] - jax.nn.logsumexp(jnp.where(remaining, z[None, :], NEG), axis=1)
    return jnp.where(filled, lp, 0.0)


def selection_log_prob(scores, selected, tau, mode: str = "plackett_luce", gumbel=None, mask=None):
    """log P(selection | scores): the sum of :func:`selection_log_probs` (a scalar).

    Examples:
      >>> import jax.numpy as jnp, rmm_jax as rj
      >>> scores = jnp.log(jnp.array([1.0, 2.0, 1.0]))     # softmax = (1/4, 1/2, 1/4)
      >>> sel = jnp.array([1, 0], jnp.int32)                # P = 1/2 · (1/4)/(1/2) = 1/4
      >>> round(float(jnp.exp(rj.selection_log_prob(scores, sel, 1.0))), 6)
      0.25
      >>> # the paper's surrogate with zero noise: softmax(s)_1 · softmax(s)_0 = 1/8
      >>> g = jnp.zeros(3)
      >>> round(float(jnp.exp(rj.selection_log_prob(scores, sel, 1.0, mode="rmm", gumbel=g))), 6)
      0.125
    """
    return jnp.sum(selection_log_probs(scores, selected, tau, mode, gumbel, mask))
