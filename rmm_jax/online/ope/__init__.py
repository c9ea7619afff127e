"""Off-policy evaluation (OPE): what a reranker policy would get, estimated from logged calls.

A logged generator call i shows an ordered selection a_i = (a_i1, …, a_iM) of the K
candidates, drawn by the logging (behaviour) policy μ, and records which shown memories
the generator cited. The slot reward r_ij is 1 when slot j was cited; the call's reward
is R_i = Σ_j r_ij (the cited count), R_i / M_i (the cite rate of the shown memories) or,
where the store has gold, Recall@M = Σ_j gold(a_ij) / |gold_i|. The target policy π is a
stored reranker sampling Plackett–Luce on its scores s/τ, like the online loop
(:func:`rmm_jax.core.sampling.gumbel_top_m`), over the same K logged candidates and
showing as many memories as the logged call did. Its value V(π) = E_x E_{a~π}[R] is
estimated from n calls logged by μ:

* **IPS** (Horvitz & Thompson 1952): V̂ = (1/n) Σ_i w_i R_i with w_i = π(a_i)/μ(a_i), the
  exact PL probabilities of the whole ordered selection (π via
  :func:`rmm_jax.core.sampling.selection_log_prob` at τ; μ from the record's
  ``log_prob``). Unbiased for any reward.
* **SNIPS** (Swaminathan & Joachims, NeurIPS 2015): Σ_i w_i R_i / Σ_i w_i. Biased
  O(1/n), much lower variance.
* **RIPS**, reward-interaction IPS (McInerney et al., KDD 2020): V̂ = (1/n) Σ_i Σ_j
  w_i,1:j r_ij with the prefix ratio w_i,1:j = π(a_i1..a_ij)/μ(a_i1..a_ij). Under PL the
  prefix probability is closed form, Π_{l≤j} exp(z_{a_l}) / Σ_{k not drawn before l}
  exp(z_k) (:func:`rmm_jax.core.sampling.selection_log_probs`, cumulated). Unbiased when
  the reward of slot j depends only on the memories in slots 1..j (a cascade).
  **SNRIPS** normalises every slot by Σ_i w_i,1:j instead of n.
* **IIPS**, independent IPS (Li et al., WSDM 2018): V̂ = (1/n) Σ_i Σ_j
  [π_j(a_ij)/μ_j(a_ij)] r_ij with the per-slot marginals π_j(a) = P(a is drawn j-th).
  Unbiased when slot j's reward depends only on the memory in slot j. PL gives no
  closed form for the marginals; :func:`slot_marginals` computes them exactly by
  dynamic programming over the sets of memories drawn before slot j (P(S) =
  Σ_{b∈S} P(S∖b)·e^{z_b}/Σ_{k∉S∖b} e^{z_k}, Σ_{j<M} C(K, j) sets) when that count is at
  most ``exact_limit``, and by Rao–Blackwellised Monte Carlo otherwise (the average over
  sampled prefixes of e^{z_a}/Σ_{k not drawn} e^{z_k}; a ratio of two such estimates is
  consistent, not unbiased). The report says which.

RIPS, SNRIPS and IIPS need μ's per-draw probabilities, so the log must carry the
behaviour's ``logits`` (:mod:`rmm_jax.data.citation_log`); with ``log_prob`` only, IPS
and SNIPS are reported and the others are skipped with a note. Slot-wise estimators
carry a bias when citations interact across slots: the oracle citation model
(:func:`rmm_jax.data.citations.oracle_cite`) cites a shown non-gold memory with a
probability that depends on how many gold memories the whole selection holds.
``benchmarks/ope_validation.py`` measures this.

Every estimate comes with a nonparametric bootstrap 95% interval (percentile, calls
resampled with replacement; Efron & Tibshirani 1993) and Kish's effective sample size
ESS = (Σ w)² / Σ w² of its weights (the smallest over slots for the slot estimators).
With ``clip``, every weight is capped at ``clip``: lower variance, but biased (towards
the logging policy's value for IPS), which the report states as a warning. For Recall@M
the target's expected value is also computed exactly, with no logged reward at all:
Σ_a P_π(a shown) gold(a)/|gold| from the same marginals (``direct``).

Reliability
-----------
An estimate that cannot be trusted is reported as **unreliable**, with no number (value
``None``) and the reasons (:func:`verdict`); ``rmm-jax evaluate`` then exits 3. The
checks:

* **Weights overflow.** exp(log π/μ) is beyond float64 when the log-ratio exceeds
  log(max float64) ≈ 709.8 (:data:`LOG_FLOAT_MAX`), or a behaviour slot marginal
  underflows to 0; a non-finite weight, or a weighted sum that overflows, also counts.
  Nothing is computed with such weights, and no NumPy warning escapes (``np.errstate``).
* **The target's scores are not finite** (a diverged or corrupt policy).
* **Low effective sample size**: Kish's ESS of the weights (after ``clip``) below
  ``min_ess``, :data:`DEFAULT_MIN_ESS` = 30 by default. ESS is the number of equally
  weighted calls the estimate is worth; below about 30 the bootstrap percentile interval
  (and the normal approximation that underlies any 95% interval) is not trustworthy, and
  a handful of calls decide the estimate. The threshold is absolute, not a fraction of
  n: what matters for the interval is how many calls the estimate effectively rests on,
  so an on-policy log of fewer than 30 calls is flagged too (``min_ess=0`` turns the
  check off).
* **Weights that do not average 1.** For any target, E_μ[π(a)/μ(a)] = Σ_a π(a) = 1
  when μ gives every selection π can make a positive probability, and the same holds for
  each slot of the prefix and marginal ratios. The mean (unclipped) weight is flagged when it is
  further from 1 than both 0.1 (:data:`WEIGHT_MEAN_TOL`) and 3.29 standard errors
  (:data:`WEIGHT_MEAN_Z`, a two-sided 0.1% test, so a correct log is almost never
  flagged). It catches ``log_prob`` values that are not the logging policy's
  probabilities of one normalised policy (a deterministic logger that writes 0, a
  probability at another temperature, a missing normaliser) and a log that does not
  cover the target.
* **Out of range.** The estimand, V = (1/n) Σ_i E_{a~π}[R_i] on the logged calls, lies
  in [mean_i low_i, mean_i high_i], each call's range over all selections of its shown
  count (:func:`slot_rewards`): cited [0, M_i], cite rate [0, 1], Recall@M
  [max(0, M_i − (K_i − G_i))/N_i, min(M_i, G_i)/N_i]. IPS can leave this range in finite
  samples (weights need not sum to n); such a value is no estimate of the metric.
  Values within :data:`RANGE_TOL` of the range (float rounding) are clamped.

What is checkable about ``log_prob`` itself: under Plackett–Luce with finite logits
every ordered selection of distinct candidates has a probability in (0, 1), and any
value in (−∞, 0] is some policy's log-probability of it, so a single record can only be
wrong by being > 0 or not finite, by disagreeing with its own ``logits``, or by showing
a memory that is not a candidate or twice. The log reader refuses all of these as bad
input naming ``file:line`` (:func:`rmm_jax.data.citation_log.validate_record`);
:func:`call_problems` checks them again for calls built without it. Across records,
the weights' mean is the check.

Intervals are intersected with the metric's range (``ci95_clipped`` says when that cut
them). The estimand always lies in its range, so the cut interval covers it exactly as
often as the bootstrap interval did; it is still the interval of the unclipped
estimator, not of a clipped one.

The verdict
-----------
Two intervals, the target's and the logging policy's, can overlap while the target is
better on every call: both vary with the same calls. So every estimate also carries its
**gain** over the logging policy, V̂(π) − V(μ) on the same calls, with a **paired**
bootstrap interval: each resample of the calls gives both values (the estimator on the
resample, and the logged mean on the same resample), and the interval is the percentile
interval of their difference (:func:`estimate` with ``logged``). ``direct`` (Recall@M)
has one too. :func:`ship_verdict` turns it into a decision: ship when the SNIPS estimate
of the cite rate (:data:`SHIP_ESTIMATOR`, :data:`SHIP_METRIC`) is reliable and its gain's
interval lies above 0. The cite rate needs no gold; SNIPS needs only ``log_prob``, has far
less variance than IPS, and is the estimator ``benchmarks/ope_validation.py`` validates
under both fixed and adaptive logging (95% coverage 0.93 and 1.0 on cited memories); the
slate estimators are narrower but assume how citations depend on the slots.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import checks, reranker
from rmm_jax.core.config import Layout
from rmm_jax.core.executables import aot
from rmm_jax.core.sampling import selection_log_probs, top_m
from rmm_jax.core.scope import Scope
from rmm_jax.data.citation_log import iter_numbered, pl_log_prob
from rmm_jax.data.embed import embed_texts
from rmm_jax.data.log_vectors import known_ids, resolve_calls, unseen_texts
from rmm_jax.errors import InputError, at, named
from rmm_jax.online.cite_rates import check_log_inputs
from rmm_jax.online.serve import user_params
from rmm_jax.online.stats import check_resamples
from rmm_jax.online.streams import check_limits
from rmm_jax.persist.policy_rollback import check_store

__all__ = [
    "Calls", "DEFAULT_MIN_ESS", "Target", "ESTIMATORS", "METRICS", "MetricRewards", "call_problems", "estimate",
    "cited_recall", "estimator_weights", "evaluate_calls", "evaluate_log", "load_calls", "prefix_log_probs",
    "report_entry", "ship_verdict", "shown_set_probs", "slot_marginals", "slot_marginals_exact", "slot_marginals_mc",
    "slot_rewards", "subset_count", "unreliable", "verdict",
]

ESTIMATORS = ("ips", "snips", "rips", "snrips", "iips")
SLATE_ONLY = ("ips", "snips")        # need only the behaviour's log-probability of the whole selection
METRICS = ("cited", "cite_rate", "recall")
DEFAULT_BOOTSTRAP = 1000
DEFAULT_EXACT_LIMIT = 100_000
DEFAULT_MC_SAMPLES = 4096
DEFAULT_MIN_ESS = 30.0               # see "Reliability" above
SHIP_METRIC, SHIP_ESTIMATOR = "cite_rate", "snips"   # see "The verdict" above
WEIGHT_MEAN_Z = 3.29                 # two-sided 0.1% normal quantile
WEIGHT_MEAN_TOL = 0.1                # a weight mean within 1 ± 0.1 is never flagged
RANGE_TOL = 1e-4                     # of a metric's range: float rounding, clamped
LOG_FLOAT_MAX = float(np.log(np.finfo(np.float64).max))   # 709.78: exp overflows above
_CHUNK = 64                          # calls per compiled scoring call (fixed: one compile per K, M)


# --------------------------------------------------------------------------- PL slot marginals
def subset_count(k: int, m: int) -> int:
    """Sets the exact marginals enumerate: Σ_{j<m} C(k, j)."""
    return sum(math.comb(k, j) for j in range(m))


@functools.lru_cache(maxsize=8)
def _subsets(k: int, m: int):
    """Per level j < m: (members (C_j, k) bool, parents (C_j, j) int, removed (C_j, j) int)."""
    levels = [(np.zeros((1, k), bool), np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64))]
    prev = {(): 0}
    for j in range(1, m):
        combos = list(itertools.combinations(range(k), j))
        members = np.zeros((len(combos), k), bool)
        parents = np.zeros((len(combos), j), np.int64)
        removed = np.zeros((len(combos), j), np.int64)
        index = {}
        for c, combo in enumerate(combos):
            index[combo] = c
            members[c, list(combo)] = True
            for p in range(j):
                parents[c, p] = prev[combo[:p] + combo[p + 1:]]
                removed[c, p] = combo[p]
        levels.append((members, parents, removed))
        prev = index
    return levels


def _weights(logits, mask) -> np.ndarray:
    z = np.where(mask, np.asarray(logits, np.float64), -np.inf)
    top = np.max(np.where(mask, z, -np.inf), axis=-1, keepdims=True)
    return np.where(mask, np.exp(z - np.where(np.isfinite(top), top, 0.0)), 0.0)


def _set_levels(logits, mask, levels: int):
    """The subset dynamic programme: per level j < ``levels``, yields ``(j, members (C_j, K),
    prob (n, C_j), rest (n, C_j))``: P(the first j draws are the set S) and the weight
    Σ_{k∉S} w_k still to draw from, with w = exp(logits) (0 where masked)."""
    logits = np.atleast_2d(np.asarray(logits, np.float64))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    n, k = logits.shape
    w = _weights(logits, mask)
    prob = np.ones((n, 1))
    structure = _subsets(k, levels)
    for j, (members, _, _) in enumerate(structure):
        rest = w @ (~members).T.astype(np.float64)
        yield j, members, prob, rest, w
        if j + 1 < levels:
            ratio = np.divide(prob, rest, out=np.zeros_like(prob), where=rest > 0)
            _, parents, removed = structure[j + 1]
            prob = np.zeros((n, parents.shape[0]))
            for p in range(parents.shape[1]):
                prob += ratio[:, parents[:, p]] * w[:, removed[:, p]]


def slot_marginals_exact(logits, mask, m: int, *, block: int = 2048) -> np.ndarray:
    """Exact per-slot marginals of Plackett–Luce(softmax(logits)): ``(n, m, K)`` float64,
    ``[i, j, a]`` = P(candidate a is drawn j-th) for call i (0 for masked candidates).

    Dynamic programming over the sets S of candidates drawn before slot j:
    P(S) = Σ_{b∈S} P(S∖b) · w_b / Σ_{k∉S∖b} w_k and P_j(a) = Σ_{|S|=j, a∉S} P(S) · w_a /
    Σ_{k∉S} w_k, with w = exp(logits). Cost Σ_{j<m} C(K, j) sets (:func:`subset_count`),
    run ``block`` calls at a time: a level holds (calls × sets) float64 arrays, 3.9 GB each
    for 100,000 calls at K = 20, M = 5 without blocks.
    """
    logits = np.atleast_2d(np.asarray(logits, np.float64))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    out = np.zeros((logits.shape[0], m, logits.shape[1]))
    for lo in range(0, logits.shape[0], block):
        rows = slice(lo, lo + block)
        for j, members, prob, rest, w in _set_levels(logits[rows], mask[rows], m):
            ratio = np.divide(prob, rest, out=np.zeros_like(prob), where=rest > 0)
            out[rows, j, :] = w * (ratio @ (~members).astype(np.float64))
    return out


def shown_set_probs(logits, mask, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``(members (C, K) bool, probs (n, C))``: the probability that the first ``m`` PL draws
    are exactly the set ``members[c]``, in any order, for every set of ``m`` candidates
    (the same dynamic programme as :func:`slot_marginals_exact`, one level further; cost
    C(K, m) sets). The exact expectation of any reward that depends on the shown set only,
    e.g. an oracle citation model's expected cited count."""
    *_, (_, members, prob, _, _) = _set_levels(logits, mask, m + 1)
    return members, prob


@functools.partial(jax.jit, static_argnames=("m", "samples"))
def _mc_marginals(logits, mask, key, m: int, samples: int):
    def one(z, mk, key):
        g = jax.random.gumbel(key, (samples,) + z.shape, jnp.float32)
        zz = jnp.where(mk, z, -jnp.inf)
        order = jax.vmap(lambda gg: top_m(zz + gg, m, mk))(g)            # (S, m)
        w = jnp.where(mk, jnp.exp(z - jnp.max(zz)), 0.0)
        hit = (order[:, :, None] == jnp.arange(z.shape[0])) & (order[:, :, None] >= 0)  # (S, m, K)
        before = jnp.cumsum(hit, axis=1) - hit                           # drawn before slot j
        left = w[None, None, :] * (before == 0)
        rest = left.sum(-1, keepdims=True)
        return jnp.mean(jnp.where(rest > 0, left / jnp.where(rest > 0, rest, 1.0), 0.0), axis=0)
    keys = jax.random.split(key, logits.shape[0])
    return jax.vmap(one)(logits, mask, keys)


def slot_marginals_mc(logits, mask, m: int, *, samples: int = DEFAULT_MC_SAMPLES, seed: int = 0) -> np.ndarray:
    """Monte Carlo per-slot marginals, same layout as :func:`slot_marginals_exact`.

    Rao–Blackwellised: for ``samples`` prefixes drawn by Gumbel-top-M, P_j(a) is
    estimated by the mean of 1[a not drawn before j] · w_a / Σ_{k not drawn before j} w_k,
    an unbiased estimate that is positive for every candidate still available (so a
    behaviour marginal in a denominator is never 0).
    """
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    out = []
    key = jax.random.key(seed)
    for s in range(0, logits.shape[0], _CHUNK):
        part = slice(s, s + _CHUNK)
        z, mk = _pad_rows(logits[part], _CHUNK), _pad_rows(mask[part], _CHUNK)
        res = _mc_marginals(jnp.asarray(z), jnp.asarray(mk), jax.random.fold_in(key, s), m=m, samples=samples)
        out.append(np.asarray(res, np.float64)[:logits[part].shape[0]])
    return np.concatenate(out) if out else np.zeros((0, m, logits.shape[1]))


def slot_marginals(logits, mask, m: int, *, exact_limit: int = DEFAULT_EXACT_LIMIT,
                   samples: int = DEFAULT_MC_SAMPLES, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Per-slot PL marginals, exact when ``subset_count(K, m) <= exact_limit``, else Monte
    Carlo: ``(marginals (n, m, K), {"method", "subsets" or "samples"})``."""
    k = np.shape(logits)[-1]
    count = subset_count(k, m)
    if count <= exact_limit:
        return slot_marginals_exact(logits, mask, m), {"method": "exact", "subsets": count}
    return (slot_marginals_mc(logits, mask, m, samples=samples, seed=seed),
            {"method": "monte_carlo", "samples": samples, "subsets_needed_for_exact": count})


def prefix_log_probs(logits, selected, mask=None) -> np.ndarray:
    """log P(a_1..a_j) for every prefix of an ordered selection under PL(softmax(logits)):
    the cumulative sum of :func:`rmm_jax.core.sampling.selection_log_probs` (τ = 1),
    ``(n, M)``; unfilled slots (−1) repeat the last prefix."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))          # NumPy: an eager jnp op is a program to load
    selected = np.atleast_2d(np.asarray(selected, np.int32))
    mask = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), logits.shape)
    return np.cumsum(np.asarray(_per_draw(logits, selected, mask), np.float64), axis=1)


@aot
def _per_draw(logits, selected, mask):
    return jax.vmap(lambda z, s, mk: selection_log_probs(z, s, 1.0, mask=mk))(logits, selected, mask)


# --------------------------------------------------------------------------- estimators
def estimator_weights(name: str, *, log_ratio, prefix_log_ratio=None, marginal_ratio=None) -> np.ndarray:
    """Per-slot weights ``(n, M)`` of an estimator (before clipping).

    ``log_ratio`` (n,): log π(a)/μ(a) of the whole selection (ips, snips);
    ``prefix_log_ratio`` (n, M): of each prefix (rips, snrips); ``marginal_ratio``
    (n, M): π_j(a_j)/μ_j(a_j) (iips). A log-ratio beyond :data:`LOG_FLOAT_MAX` gives an
    infinite weight, silently (:func:`verdict` reports it).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        if name in SLATE_ONLY:
            lr = np.asarray(log_ratio, np.float64)
            m = 1 if prefix_log_ratio is None else np.shape(prefix_log_ratio)[1]
            return np.repeat(np.exp(lr)[:, None], m, axis=1)
        if name in ("rips", "snrips"):
            return np.exp(np.asarray(prefix_log_ratio, np.float64))
    if name == "iips":
        return np.asarray(marginal_ratio, np.float64)
    raise InputError(f"unknown estimator {name!r}; one of {', '.join(ESTIMATORS)}", where="estimator")


def _values(weights, rewards, counts, self_normalized: bool, slate: bool) -> np.ndarray:
    """Estimates for each row of ``counts`` (B, n): how often each call is in the resample."""
    wr = weights * rewards                                               # (n, M)
    num = counts @ wr                                                    # (B, M)
    if not self_normalized:
        return num.sum(1) / counts.sum(1)
    if slate:
        den = counts @ weights[:, 0]                                     # (B,)
        return np.divide(num.sum(1), den, out=np.zeros_like(den), where=den > 0)
    den = counts @ weights                                               # (B, M)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0).sum(1)


def _kish(cols) -> float:
    """Kish's ESS (Σw)²/Σw², the smallest over columns; each column scaled by its maximum
    first, so that weights near the float range do not overflow the squares."""
    top = cols.max(0)
    s = cols / np.where(top > 0, top, 1.0)
    sums, sq = s.sum(0), (s ** 2).sum(0)
    return float(np.divide(sums ** 2, sq, out=np.zeros_like(sums), where=sq > 0).min())


def _weight_mean(cols) -> tuple[float, float]:
    """``(mean, standard error)`` of the column whose mean departs most from 1 beyond
    :func:`_weight_mean_allowance` (see :func:`verdict`)."""
    n = cols.shape[0]
    mean = cols.mean(0)
    se = cols.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full_like(mean, np.inf)
    excess = np.abs(mean - 1.0) - _weight_mean_allowance(se)
    j = int(np.argmax(np.where(np.isnan(excess), np.inf, excess)))
    return float(mean[j]), float(se[j])


def _weight_mean_allowance(se):
    return np.maximum(WEIGHT_MEAN_TOL, WEIGHT_MEAN_Z * se)


def estimate(name: str, weights, rewards, *, clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP,
             seed: int = 0, level: float = 0.95, logged=None) -> dict:
    """One estimate from per-slot ``weights`` and ``rewards`` (n, M): the raw numbers that
    :func:`verdict` judges and :func:`report_entry` reports.

    ``name`` picks the normalisation: ``ips``, ``rips``, ``iips`` divide by n, ``snips``
    by Σ_i w_i and ``snrips`` by Σ_i w_ij per slot. ``weights`` of ``ips``/``snips`` are
    the slate weight repeated over the slots (:func:`estimator_weights`).

    Returns ``value``, the bootstrap ``ci95``, the standard error ``se``, Kish's ``ess``
    of the (clipped) weights, the smallest over slots; ``n``; ``nonfinite``, the calls
    with a weight that is not finite; ``weight_mean`` and ``weight_mean_se`` of the
    unclipped weights (the slot furthest from 1); and with ``clip`` how many weights it
    capped. Everything is computed under ``np.errstate``: an overflow makes a number
    non-finite (``value`` is ``nan`` when a weight is not finite), never a warning.

    ``logged`` (n,): the logging policy's value on each call; then ``gain`` is the
    estimate minus the logging policy's value on the same calls, with a **paired**
    bootstrap interval: every resample of calls gives both values, and the interval is
    that of their difference (``value``, ``ci95``, ``se``).
    """
    w = np.asarray(weights, np.float64)
    r = np.asarray(rewards, np.float64)
    n = r.shape[0]
    if n == 0:
        raise InputError("no calls to estimate from", where="log")
    self_norm, slate = name in ("snips", "snrips"), name in SLATE_ONLY
    q = (1 - level) / 2, (1 + level) / 2
    with np.errstate(all="ignore"):
        cols = w[:, :1] if slate else w
        mean, mean_se = _weight_mean(cols)
        out = {"n": n, "nonfinite": int((~np.isfinite(cols)).any(1).sum()), "weight_mean": mean,
               "weight_mean_se": mean_se}
        if clip is not None:
            out["clipped"] = int((cols > clip).sum())
            w = np.minimum(w, clip)
            cols = w[:, :1] if slate else w
        if not np.isfinite(w).all():
            nan = {"value": math.nan, "ci95": [math.nan, math.nan], "se": None}
            return {**nan, "ess": math.nan, **out, **({"gain": nan} if logged is not None else {})}
        value = float(_values(w, r, np.ones((1, n)), self_norm, slate)[0])
        rng = np.random.default_rng(seed)
        boot, boot_logged = [], []
        step = max(1, 4_000_000 // max(n, 1))
        for s in range(0, bootstrap, step):
            b = min(step, bootstrap - s)
            draws = rng.integers(0, n, size=(b, n)) + (np.arange(b) * n)[:, None]
            counts = np.bincount(draws.ravel(), minlength=b * n).reshape(b, n).astype(np.float64)
            boot.append(_values(w, r, counts, self_norm, slate))
            if logged is not None:
                boot_logged.append(counts @ np.asarray(logged, np.float64) / counts.sum(1))
        boot = np.concatenate(boot) if boot else np.zeros(0)
        lo, hi = np.quantile(boot, q) if boot.size else (value, value)
        se = float(boot.std(ddof=1)) if boot.size > 1 else None
        ess = _kish(cols)
        if logged is not None:
            diff = value - float(np.mean(logged))
            d = boot - np.concatenate(boot_logged) if boot.size else np.zeros(0)
            glo, ghi = np.quantile(d, q) if d.size else (diff, diff)
            out["gain"] = {"value": diff, "ci95": [float(glo), float(ghi)],
                           "se": float(d.std(ddof=1)) if d.size > 1 else None}
    return {"value": value, "ci95": [float(lo), float(hi)], "se": se, "ess": ess, **out}


def verdict(est: dict, *, value_range: tuple[float, float] | None = None, min_ess: float = 0.0,
            problems: Sequence[str] = ()) -> list[str]:
    """Why the estimate :func:`estimate` returned is unreliable: one short reason per
    failed check (empty: reliable). See "Reliability" in the module docstring.

    ``problems``: reasons found upstream in the calls themselves (:func:`call_problems`);
    ``value_range``: the estimand's range (:func:`reward_ranges`); ``min_ess``: the
    smallest acceptable ESS (0: no check).
    """
    reasons = list(problems)
    n, value, (lo, hi) = est["n"], est["value"], est["ci95"]
    if est.get("nonfinite"):
        if not problems:
            reasons.append(f"importance weights overflow: not finite on {est['nonfinite']} of {n} calls")
        return reasons
    if not (math.isfinite(value) and math.isfinite(lo) and math.isfinite(hi)):
        return reasons + ["not finite: the weighted sums overflow float64"]
    ess = est.get("ess")
    if ess is not None and ess < min_ess:
        reasons.append(f"ESS {ess:.1f} of {n} calls < {min_ess:g}")
    mean, se = est.get("weight_mean"), est.get("weight_mean_se")
    if mean is not None and abs(mean - 1.0) > _weight_mean_allowance(se):
        reasons.append(f"weights average {mean:.3g} (s.e. {se:.2g}), not 1: log_prob is not the logging policy's "
                       "probability, or the log does not cover the target")
    if value_range is not None:
        a, b = value_range
        tol = RANGE_TOL * max(b - a, 1.0)
        if not a - tol <= value <= b + tol:
            reasons.append(f"{value:.4g} is outside the metric's range [{a:.4g}, {b:.4g}]")
    return reasons


def report_entry(est: dict, reasons: Sequence[str], value_range: tuple[float, float] | None = None) -> dict:
    """The report's row for one estimate: strict-JSON numbers only (``None`` for what is
    not finite). Unreliable (``reasons``): ``value``, ``ci95`` and ``se`` are ``None``,
    ``reason`` says why; ``ess`` and ``weight_mean`` stay, as diagnostics of the weights.
    Reliable: ``value`` is within ``value_range`` (rounding beyond it, at most
    :data:`RANGE_TOL` of the range, is clamped) and ``ci95`` is the bootstrap interval
    intersected with the range, ``ci95_clipped`` saying whether that cut it."""
    fin = lambda x: float(x) if x is not None and math.isfinite(x) else None  # noqa: E731
    out = {"n": int(est["n"]), "reliable": not reasons}
    for key in ("se", "ess", "weight_mean", "weight_mean_se"):
        if key in est:
            out[key] = fin(est[key])
    if "clipped" in est:
        out["clipped"] = int(est["clipped"])
    if reasons:      # the standard error of a number that is no estimate means nothing either
        gain = {"gain": None} if "gain" in est else {}
        return {**out, "value": None, "ci95": None, "se": None, "reason": "; ".join(reasons), **gain}
    if "gain" in est:
        g = est["gain"]
        out["gain"] = {"value": float(g["value"]), "ci95": [float(x) for x in g["ci95"]], "se": fin(g["se"])}
    value, (lo, hi) = float(est["value"]), est["ci95"]
    cut = False
    if value_range is not None:
        a, b = value_range
        tol = RANGE_TOL * max(b - a, 1.0)
        cut = bool(lo < a - tol or hi > b + tol)
        value, lo, hi = (float(min(max(x, a), b)) for x in (value, lo, hi))
    return {**out, "value": value, "ci95": [float(lo), float(hi)], "ci95_clipped": cut}


# --------------------------------------------------------------------------- logged calls
@dataclasses.dataclass
class Calls:
    """Logged calls as padded arrays: n calls, K candidate slots, M selection slots."""
    user_ids: list[str]
    query_ids: list[str]               # call_key of each call
    target_logits: np.ndarray          # (n, K) float32: target scores / τ (0 where masked)
    behaviour_logits: np.ndarray | None  # (n, K) float32 from the log's 'logits'; None: not on every record
    mask: np.ndarray                   # (n, K) bool
    selected: np.ndarray               # (n, M) int32 positions in the candidates, −1 unfilled
    cited: np.ndarray                  # (n, M) bool
    log_prob: np.ndarray               # (n,) float64: the behaviour's log P(selected)
    cand_gold: np.ndarray              # (n, K) bool
    num_gold: np.ndarray               # (n,) int32 gold memories in the user's whole bank
    valid: np.ndarray                  # (n,) bool: has gold, not an abstention question
    own_policy: dict                   # user id -> True when the policy store holds the user's own params

    @property
    def filled(self) -> np.ndarray:
        return self.selected >= 0

    @property
    def shown(self) -> np.ndarray:
        return self.filled.sum(1)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    if x.shape[0] == rows:
        return x
    pad = np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad])


class Target(NamedTuple):
    """The target policy's sampling: at most ``k`` candidates and ``m`` shown, temperature ``tau``."""
    k: int
    m: int
    tau: float


def check_target(cfg) -> None:
    """``InputError`` naming the field unless ``cfg`` is a :class:`Target` the CLI would take
    (``--k``, ``--m``, ``--tau``): called from Python, ``Target(k, m, tau=0)`` (or -1, or NaN)
    gave a whole report of estimates from s/0 with only a RuntimeWarning, ``m > k`` was a
    ValueError from the selection check, a tuple an AttributeError."""
    if not isinstance(cfg, Target):
        raise InputError(f"expected a Target(k, m, tau), got {checks.short(cfg)}", where="cfg")
    try:
        Layout(k=cfg.k, m=cfg.m)
        checks.check_tau(cfg.tau)
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise InputError(msg, where=f"cfg.{name}") from None


def check_inputs(store, policies, users) -> None:
    """The arguments :func:`load_calls` takes by type, each refused by name: a path for
    ``store`` or ``policies`` was an AttributeError ('str' object has no attribute
    'user_ids'), and a str ``users`` was read letter by letter (\"unknown user id 'a'\")."""
    check_log_inputs(store, users)
    check_store(policies, where="policies")


@aot
def _score_chunk(params, q, m, mask):
    return jax.vmap(reranker.score, in_axes=(None, 0, 0, 0))(params, q, m, mask)


def load_calls(store, log_path, policies, cfg: Target, *, users: Sequence[str] | None = None,
               skip_invalid: bool = False, report: dict | None = None) -> Calls:
    """Read a log against an embedding store and score every call with the target policy.

    Each record is validated (schema, ids known to ``store`` or carried as text, the
    ``cfg.k``/``cfg.m`` limits: :func:`rmm_jax.online.streams.check_limits`)
    and must carry the behaviour's ``log_prob`` or ``logits``.
    Queries and memories the store lacks are embedded from the records' texts
    (:mod:`rmm_jax.data.log_vectors`, the store's model through the embedding cache).
    Every user's target params come from :func:`rmm_jax.online.serve.user_params` (the
    shared params for users without their own), scored with
    :func:`rmm_jax.core.reranker.score`.
    """
    check_target(cfg)
    check_inputs(store, policies, users)
    known = known_ids(store)
    wanted = None if not users else set(users)
    by_user: dict[str, list] = {}
    texts: dict[str, None] = {}
    report = {} if report is None else report
    for line, rec in iter_numbered(log_path, known=known, skip_invalid=skip_invalid, report=report):
        check_limits(rec, cfg, log_path)
        if rec.log_prob is None and rec.logits is None:
            near = [n for n in report.get("notes", ()) if n.endswith(("'log_prob'?)", "'logits'?)"))]
            raise InputError("missing: off-policy evaluation needs the logging policy's log_prob (or logits) "
                             "on every record" + (f"; note: {near[0]}" if near else ""),
                             where=at(log_path, line, "log_prob"))
        if wanted is None or rec.user_id in wanted:
            by_user.setdefault(rec.user_id, []).append(rec)
            texts.update(dict.fromkeys(unseen_texts(rec, known(rec.user_id))))
    missing = sorted((wanted or set()) - set(by_user))
    if missing:
        u = missing[0]
        raise InputError(f"user {u!r} has no record in {log_path}" if store.has_user(u) else
                         f"unknown user id {u!r} (not in STORE, no record in {log_path})", arg="users")
    vectors = embed_texts(list(texts), store.model, progress=True, desc="new texts")
    has_policy = set(policies.users())
    rows: dict[str, list] = {key: [] for key in ("uid", "qid", "t", "b", "mask", "sel", "cited", "lp", "cg", "ng",
                                                 "valid")}
    all_logits = all(r.logits is not None for recs in by_user.values() for r in recs)
    for uid, recs in by_user.items():
        c = resolve_calls(store, uid, recs, vectors, cfg.k, cfg.m)
        params = user_params(policies, uid, fallback_to_shared=uid not in has_policy)
        n = len(recs)
        scores = []
        for s in range(0, n, _CHUNK):
            part = slice(s, s + _CHUNK)
            rows_here = c.queries[part].shape[0]
            q = _pad_rows(c.queries[part], _CHUNK)
            mm = _pad_rows(c.bank[c.cand[part]], _CHUNK)
            mk = _pad_rows(c.cand_mask[part], _CHUNK)
            mk[rows_here:, 0] = True  # padded rows: one valid slot keeps the scores finite
            scores.append(np.asarray(_score_chunk(params, q, mm, mk))
                          [:rows_here])
        scores = np.concatenate(scores).astype(np.float32)
        lp = [r.log_prob if r.log_prob is not None else
              pl_log_prob(r.logits, [p for p in c.selected[i] if p >= 0]) for i, r in enumerate(recs)]
        rows["uid"] += [uid] * n
        rows["qid"] += list(c.call_keys)
        rows["t"].append(np.where(c.cand_mask, scores / cfg.tau, 0.0).astype(np.float32))
        rows["b"].append(c.logits)
        rows["mask"].append(c.cand_mask)
        rows["sel"].append(c.selected)
        rows["cited"].append(c.cited)
        rows["lp"].append(np.asarray(lp, np.float64))
        rows["cg"].append(c.cand_gold)
        rows["ng"].append(c.num_gold)
        rows["valid"].append(c.valid)
    cat = lambda key: np.concatenate(rows[key])
    return Calls(user_ids=rows["uid"], query_ids=rows["qid"], target_logits=cat("t"),
                 behaviour_logits=cat("b") if all_logits else None, mask=cat("mask"), selected=cat("sel"),
                 cited=cat("cited"), log_prob=cat("lp"), cand_gold=cat("cg"), num_gold=cat("ng"),
                 valid=cat("valid"), own_policy={u: u in has_policy for u in by_user})


class MetricRewards(NamedTuple):
    """One metric's slot rewards on the calls it is defined for, with the exact range of
    each call's expected reward over every policy that shows as many memories."""
    rewards: np.ndarray                # (n', M) slot rewards
    rows: np.ndarray                   # (n',) the calls used (recall: calls with gold)
    low: np.ndarray                    # (n',) the least expected reward any policy can get on each call
    high: np.ndarray                   # (n',) the most

    @property
    def value_range(self) -> tuple[float, float]:
        """The estimand's range: the mean over the calls of each call's range."""
        return float(self.low.mean()), float(self.high.mean())


def slot_rewards(calls: Calls) -> dict[str, MetricRewards]:
    """Per metric, its :class:`MetricRewards`; recall only on valid calls.

    Ranges (M_i shown, K_i candidates, G_i of them gold, N_i gold in the bank): cited
    [0, M_i] (the generator may cite none or all); cite rate [0, 1]; Recall@M
    [max(0, M_i − (K_i − G_i)) / N_i, min(M_i, G_i) / N_i], which any selection of M_i
    of the candidates attains (recall does not depend on the generator).
    """
    filled = calls.filled
    cited = (calls.cited & filled).astype(np.float64)
    shown = np.maximum(calls.shown, 1)
    everyone = np.arange(len(cited))
    zero = np.zeros(len(cited))
    out = {"cited": MetricRewards(cited, everyone, zero, shown.astype(np.float64)),
           "cite_rate": MetricRewards(cited / shown[:, None], everyone, zero, np.ones(len(cited)))}
    rows = np.flatnonzero(calls.valid)
    if rows.size:
        gold = np.take_along_axis(calls.cand_gold, np.maximum(calls.selected, 0), 1) & filled
        n_gold = np.maximum(calls.num_gold, 1).astype(np.float64)
        g, k = calls.cand_gold.sum(1), calls.mask.sum(1)
        low, high = np.maximum(0, calls.shown - (k - g)) / n_gold, np.minimum(calls.shown, g) / n_gold
        out["recall"] = MetricRewards((gold / n_gold[:, None])[rows], rows, low[rows], high[rows])
    return out


def call_problems(calls: Calls, rows, *, log_ratio, prefix_log_ratio=None, marginals=None) -> dict[str, list[str]]:
    """Per estimator (and ``direct``), the reasons found in the calls ``rows`` themselves
    that make its weights meaningless: the target's scores not finite, a selection no
    Plackett–Luce policy can draw, a ``log_prob`` that is not a log-probability, and
    log-ratios beyond float64 (``exp`` overflows above :data:`LOG_FLOAT_MAX`).
    ``marginals``: ``(target, behaviour)`` per-slot marginals of the shown memories (n, M)."""
    rows = np.asarray(rows)
    n = rows.size

    def on(flags, text: str) -> list[str]:
        k = int(np.asarray(flags)[rows].sum())
        return [f"{text} on {k} of {n} calls"] if k else []

    def overflow(lr, text: str) -> list[str]:
        over = (np.asarray(lr) > LOG_FLOAT_MAX).reshape(len(lr), -1).any(1)
        top = float(np.max(np.asarray(lr)[rows])) if over[rows].any() else 0.0
        return on(over, f"weights overflow: {text} up to {top:.4g}, beyond float64's {LOG_FLOAT_MAX:.1f},")

    mask, sel = calls.mask, calls.selected
    filled = sel >= 0
    target_bad = ~np.where(mask, np.isfinite(calls.target_logits), True).all(1)
    ordered = np.sort(sel, axis=1)
    impossible = ((filled & ~np.take_along_axis(mask, np.maximum(sel, 0), 1)).any(1)
                  | ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1))
    common = (on(target_bad, "the target policy's scores are not finite")
              + on(impossible, "the logged selection is impossible under any Plackett–Luce policy over its "
                               "candidates (a shown memory that is not a candidate, or shown twice)"))
    lp = np.asarray(calls.log_prob, np.float64)
    slate = (common + on(~(np.isfinite(lp) & (lp <= 0)), "log_prob is not a log-probability (> 0 or not finite)")
             + overflow(log_ratio, "log(π/μ)"))
    out = {"direct": on(target_bad, "the target policy's scores are not finite"), "ips": slate, "snips": slate}
    if prefix_log_ratio is not None:
        out["rips"] = out["snrips"] = common + overflow(prefix_log_ratio, "prefix log(π/μ)")
    if marginals is not None:
        pt, pb = marginals
        out["iips"] = common + on((filled & (pb <= 0) & (pt > 0)).any(1),
                                  "weights overflow: the logging policy's per-slot marginal of a shown memory "
                                  "underflows to 0")
    return out


def evaluate_calls(calls: Calls, cfg: Target, *, clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP,
                   seed: int = 0, exact_limit: int = DEFAULT_EXACT_LIMIT, mc_samples: int = DEFAULT_MC_SAMPLES,
                   min_ess: float = DEFAULT_MIN_ESS) -> dict:
    """The estimates of every metric by every estimator that the log supports (see the
    module docstring), the logging policy's own logged value and, for Recall@M, the
    exact expected value of the target (``direct``), each judged (:func:`verdict`) and
    reported (:func:`report_entry`); ``ranges``: each metric's range."""
    check_target(cfg)
    m = calls.selected.shape[1]
    with np.errstate(all="ignore"):
        target_prefix = prefix_log_probs(calls.target_logits, calls.selected, calls.mask)      # (n, M)
        log_ratio = target_prefix[:, -1] - calls.log_prob
        notes, names = [], list(SLATE_ONLY)
        t_marg, info = slot_marginals(calls.target_logits, calls.mask, m, exact_limit=exact_limit,
                                      samples=mc_samples, seed=seed)
        kw = {"log_ratio": log_ratio}
        problem_kw: dict = {"log_ratio": log_ratio}
        if calls.behaviour_logits is not None:
            b_prefix = prefix_log_probs(calls.behaviour_logits, calls.selected, calls.mask)
            b_marg, _ = slot_marginals(calls.behaviour_logits, calls.mask, m, exact_limit=exact_limit,
                                       samples=mc_samples, seed=seed + 1)
            idx = np.maximum(calls.selected, 0)[:, :, None]
            pt = np.take_along_axis(t_marg, idx, 2)[:, :, 0]
            pb = np.take_along_axis(b_marg, idx, 2)[:, :, 0]
            kw["prefix_log_ratio"] = target_prefix - b_prefix
            kw["marginal_ratio"] = np.where(calls.filled, pt / pb, 1.0)    # pb = 0: inf or nan, reported
            problem_kw.update(prefix_log_ratio=kw["prefix_log_ratio"], marginals=(pt, pb))
            names += ["rips", "snrips", "iips"]
        else:
            kw["prefix_log_ratio"] = np.zeros_like(target_prefix)
            notes.append("rips, snrips and iips skipped: they need the logging policy's per-candidate 'logits' on "
                         "every record (ips and snips need only 'log_prob')")
        weights = {name: estimator_weights(name, **kw) for name in names}
        out: dict = {}
        ranges: dict = {}
        for metric, mr in slot_rewards(calls).items():
            span = mr.value_range
            problems = call_problems(calls, mr.rows, **problem_kw)
            logged = mr.rewards.sum(1)
            per = {"logged": _plain_mean(mr.rewards, bootstrap, seed, span)}
            for name in names:
                est = estimate(name, weights[name][mr.rows], mr.rewards, clip=clip, bootstrap=bootstrap, seed=seed,
                               logged=logged)
                per[name] = report_entry(est, verdict(est, value_range=span, min_ess=min_ess,
                                                      problems=problems[name]), span)
            if metric == "recall":
                incl = (t_marg * (np.arange(m)[None, :, None] < calls.shown[:, None, None])).sum(1)   # (n, K)
                direct = (incl * calls.cand_gold).sum(1) / np.maximum(calls.num_gold, 1)
                per["direct"] = _plain_mean(direct[mr.rows][:, None], bootstrap, seed, span, problems["direct"],
                                            logged=logged)
            out[metric] = per
            ranges[metric] = list(span)
    if "recall" not in out:
        notes.append("recall skipped: no logged call has gold memories in STORE")
    return {"estimates": out, "estimators": names, "ranges": ranges, "marginals": info, "notes": notes,
            **cited_recall(calls, bootstrap=bootstrap, seed=seed)}


def cited_recall(calls: Calls, *, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> dict:
    """The gold-free cited-recall of the logged calls (docs/lifecycle.md, "Measures without
    gold"): over the calls with a citation, the share of the cited memories that the
    target's deterministic top-M (M: the call's shown count) holds, and that the
    retriever's first M candidates hold, with the target's paired gain over the retriever.
    ``{"cited_recall": {"calls", "target", "retriever"}}`` (each a value with its bootstrap
    interval; ``target`` with its ``gain``), or ``{}`` when no call has a citation."""
    cited = calls.cited & calls.filled
    n_cited = cited.sum(1)
    rows = np.flatnonzero(n_cited > 0)
    if not rows.size:
        return {}
    pos = np.where(cited, calls.selected, -1)[rows]                             # cited positions
    order = np.argsort(-np.where(calls.mask, calls.target_logits, -np.inf)[rows], axis=1, kind="stable")
    rank = np.argsort(order, axis=1)                                              # each candidate's rank
    shown = calls.shown[rows][:, None]
    in_top = (pos >= 0) & (np.take_along_axis(rank, np.maximum(pos, 0), 1) < shown)
    in_base = (pos >= 0) & (pos < shown)
    share = lambda hit: hit.sum(1) / n_cited[rows]                                # noqa: E731
    span = (0.0, 1.0)
    retriever = _plain_mean(share(in_base)[:, None], bootstrap, seed, span)
    target = _plain_mean(share(in_top)[:, None], bootstrap, seed, span, logged=share(in_base))
    return {"cited_recall": {"calls": int(rows.size), "target": target, "retriever": retriever}}


def _plain_mean(rewards, bootstrap: int, seed: int, value_range, problems: Sequence[str] = (), logged=None) -> dict:
    """The plain mean of per-call values (summed over slots) with its bootstrap interval:
    the logging policy's own value (``logged``) or the target's exact one (``direct``,
    with its paired gain over the ``logged`` per-call values)."""
    est = estimate("ips", np.ones((rewards.shape[0], 1)), rewards.sum(1, keepdims=True), bootstrap=bootstrap,
                   seed=seed, logged=logged)
    res = report_entry(est, verdict(est, value_range=value_range, problems=problems), value_range)
    for key in ("ess", "weight_mean", "weight_mean_se"):
        res.pop(key)
    return res


def ship_verdict(estimates: dict, metric: str = SHIP_METRIC, estimator: str = SHIP_ESTIMATOR) -> dict:
    """Whether to ship the target policy, from an :func:`evaluate_calls` report's
    ``estimates`` (module docstring, "The verdict"): ship when the ``estimator``'s estimate
    of ``metric`` is reliable and the 95% interval of its paired gain over the logging
    policy lies above 0. Returns ``{"ship", "metric", "estimator", "gain", "reason"}``."""
    est = estimates[metric][estimator]
    out = {"metric": metric, "estimator": estimator, "gain": est.get("gain")}
    if not est["reliable"]:
        return {**out, "ship": False, "reason": f"no reliable estimate: {est['reason']}"}
    g = est["gain"]
    lo, hi = g["ci95"]
    where = "lies above 0" if lo > 0 else ("lies below 0" if hi < 0 else "contains 0")
    return {**out, "ship": bool(lo > 0),
            "reason": f"gain {g['value']:+.4f} in {metric}, 95% interval [{lo:+.4f}, {hi:+.4f}] {where}"}


def unreliable(report: dict) -> list[tuple[str, str, str]]:
    """``(metric, estimator, reason)`` of every unreliable estimate in an
    :func:`evaluate_log` report."""
    return [(metric, name, est["reason"]) for metric, per in report["estimates"].items()
            for name, est in per.items() if not est["reliable"]]


def check_report_options(*, clip: float | None, bootstrap: int, min_ess: float) -> None:
    """The options of :func:`evaluate_log`'s report, each refused as one line naming the
    argument: ``rmm-jax evaluate`` checks them before it reads the log, and names its
    option (``--min-ess``) instead (:func:`rmm_jax.cli.common.as_options`)."""
    if clip is not None and not (clip >= 1.0 and math.isfinite(clip)):
        raise InputError(f"must be a finite number >= 1, got {clip}", arg="clip")
    check_resamples(bootstrap)
    if not (min_ess >= 0 and math.isfinite(min_ess)):
        raise InputError(f"must be a finite number >= 0, got {min_ess}", arg="min_ess")


def evaluate_log(store, log_path, policies, cfg: Target, *, users: Sequence[str] | None = None,
                 clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                 exact_limit: int = DEFAULT_EXACT_LIMIT, mc_samples: int = DEFAULT_MC_SAMPLES,
                 skip_invalid: bool = False, min_ess: float = DEFAULT_MIN_ESS) -> dict:
    """Off-policy estimates of the policies in ``policies`` (a
    :class:`~rmm_jax.persist.policy_store.PolicyStore`) from the calls logged in
    ``log_path`` on ``store`` (an embedding store): the report ``rmm-jax evaluate`` prints.

    ``unreliable`` lists ``{"metric", "estimator", "reason"}`` of every unreliable
    estimate; ``warnings`` holds at most one line about low ESS (with what to do) and
    one about clipping. The warnings and errors name ``clip``, ``min_ess`` and the layout's
    ``k``/``m`` as arguments (``clip=10``; from ``rmm-jax evaluate`` as its options, ``--clip 10``:
    :func:`rmm_jax.errors.named`)."""
    check_report_options(clip=clip, bootstrap=bootstrap, min_ess=min_ess)
    read: dict = {}
    calls = load_calls(store, log_path, policies, cfg, users=users, skip_invalid=skip_invalid, report=read)
    res = evaluate_calls(calls, cfg, clip=clip, bootstrap=bootstrap, seed=seed, exact_limit=exact_limit,
                         mc_samples=mc_samples, min_ess=min_ess)
    scope = Scope.from_meta(getattr(policies, "meta", None) or {})
    shared = [] if not scope.has_local else sorted(u for u, own in calls.own_policy.items() if not own)
    if shared:
        res["notes"].append(f"{len(shared)} of {len(calls.own_policy)} users have no policy of their own in "
                            f"POLICIES: scored with its shared params")
    warnings = []
    low = [(est["ess"], est["n"], metric, name) for metric, per in res["estimates"].items()
           for name, est in per.items() if est.get("ess") is not None and est["ess"] < min_ess]
    if low:
        ess, n, metric, name = min(low)
        fix = (f"a lower {named('clip')}" if clip is not None else      # clip=10, or the CLI's --clip 10
               f"{named('clip')} (e.g. {named('clip', 10)}: biased, lower variance)")
        advice = (f"the log has too few calls: log more calls (or lower {named('min_ess')})" if ess > 0.9 * n else
                  f"the target differs from the logging policy, so a few calls carry most of the weight: try {fix} "
                  "or log more calls")
        warnings.append(f"effective sample size below {min_ess:g} for {len(low)} estimates (lowest {ess:.1f} of "
                        f"{n} calls, {name} on {metric}); {advice}")
    if clip is not None:
        n_clipped = {name: est.get("clipped", 0) for name, est in next(iter(res["estimates"].values())).items()
                     if name not in ("logged", "direct")}
        counts = ", ".join(f"{k}: {v}" for k, v in n_clipped.items())
        warnings.append(f"importance weights clipped at {clip:g} (weights capped, cited metric: {counts}): "
                        "clipped estimates are biased, towards the logging policy's value for ips")
    bad = [{"metric": metric, "estimator": name, "reason": reason} for metric, name, reason in unreliable(res)]
    res["verdict"] = ship_verdict(res["estimates"])
    return {"calls": int(len(calls.user_ids)), "users": len(calls.own_policy), "users_on_shared_params": len(shared),
            "tau": cfg.tau, "k": cfg.k, "m": cfg.m, "clip": clip, "min_ess": min_ess, "bootstrap": bootstrap,
            "seed": seed, "log": {"path": str(log_path), **{k: v for k, v in read.items()}}, "warnings": warnings,
            "unreliable": bad, **res}
