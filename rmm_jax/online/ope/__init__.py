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
  flagged). Over fewer than ``min_ess`` calls the tail of large weights is seldom sampled
  and the standard error is as untrustworthy as the bootstrap interval (16 calls of a
  correct log averaged 0.78, s.e. 0.06; the same policies on 2,400 calls 0.994): a mean
  below 1 is then said to be undecidable from sampling (the ESS withholds the estimate
  already). Unsampled large weights only pull the mean down, so one far above 1 is flagged
  however few the calls. It catches ``log_prob`` values that are not the logging policy's
  probabilities of one normalised policy (a deterministic logger that writes 0, a
  probability at another temperature, a missing normaliser) and a log that does not
  cover the target.
* **Out of range.** The estimand, V = (1/n) Σ_i E_{a~π}[R_i] on the logged calls, lies
  in [mean_i low_i, mean_i high_i], each call's range over all selections of its shown
  count (:func:`slot_rewards`): cited [0, M_i], cite rate [0, 1], Recall@M
  [max(0, M_i − (K_i − G_i))/N_i, min(M_i, G_i)/N_i]. IPS can leave this range in finite
  samples (weights need not sum to n); such a value is no estimate of the metric.
  Values within :data:`RANGE_TOL` of the range (float rounding) are clamped. SNIPS is not
  checked: a weighted mean of the calls' rewards, it always lies in the same weighted mean
  of their ranges, and beyond the estimand's range it is sampling (its weights favouring
  calls with a higher ceiling), not a broken log; it is clamped to the estimand's range.
  (SNRIPS, a sum of per-slot weighted means, can leave the range, and is checked.)

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
interval lies above 0 (``worse`` when it is reliable and lies below 0, the one verdict that
shows the target worse; none when the target's own versions served every logged call, so
the log compares it with itself, or when it gives every call, logged without version keys, the
logged probabilities to float32 rounding: :func:`rounding_bound`, :func:`agrees_to_rounding`). The cite rate needs no
gold; SNIPS needs only ``log_prob``, has far less variance than IPS, and is the estimator
``benchmarks/ope_validation.py`` validates under both fixed and adaptive logging (95% coverage
0.93 and 1.0 on cited memories); the slate estimators are narrower but assume how citations
depend on the slots.

One concern per private module: ``_marginals`` (Plackett–Luce slot marginals and prefix
probabilities), ``_estimators`` (the estimators and the checks on one estimate), ``_calls``
(logged calls against a store and the target's policies), ``_report`` (the report and its
verdict); ``_chunks`` fixes the calls per compiled program.
"""
from __future__ import annotations

from rmm_jax.online.ope._calls import (
    AGREE_LIMIT,
    F32_UNIT,
    LOG_FLOAT_MAX,
    METRICS,
    ROUNDING_LAMBDA,
    Calls,
    MetricRewards,
    Target,
    call_problems,
    check_inputs,
    check_target,
    load_calls,
    rounding_bound,
    slot_rewards,
)
from rmm_jax.online.ope._estimators import (
    DEFAULT_BOOTSTRAP,
    ESTIMATORS,
    HEAVY_TAIL_ESS,
    RANGE_TOL,
    SLATE_ONLY,
    WEIGHT_MEAN_TOL,
    WEIGHT_MEAN_Z,
    ess_below,
    estimate,
    estimator_weights,
    heavy_tailed,
    report_entry,
    verdict,
)
from rmm_jax.online.ope._marginals import (
    DEFAULT_EXACT_LIMIT,
    DEFAULT_MC_SAMPLES,
    check_marginal_options,
    prefix_log_probs,
    shown_set_probs,
    slot_marginals,
    slot_marginals_exact,
    slot_marginals_mc,
    subset_count,
)
from rmm_jax.online.ope._report import (
    DEFAULT_MIN_ESS,
    SHIP_ESTIMATOR,
    SHIP_METRIC,
    LogCause,
    agrees_to_rounding,
    check_report_options,
    cited_recall,
    decision,
    empty_report,
    evaluate_calls,
    evaluate_log,
    learned_calls,
    log_cause,
    low_ess_advice,
    rounding_gain,
    ship_verdict,
    signed,
    unreliable,
)

__all__ = [
    "ess_below",
    "Calls", "DEFAULT_MIN_ESS", "Target", "ESTIMATORS", "METRICS", "MetricRewards", "call_problems", "estimate",
    "cited_recall", "decision", "estimator_weights", "empty_report", "evaluate_calls", "evaluate_log", "load_calls",
    "prefix_log_probs",
    "report_entry", "ship_verdict", "shown_set_probs", "slot_marginals", "slot_marginals_exact", "slot_marginals_mc",
    "slot_rewards", "subset_count", "unreliable", "verdict", "agrees_to_rounding", "rounding_bound",
    "rounding_gain", "F32_UNIT", "AGREE_LIMIT", "ROUNDING_LAMBDA",
    # constants and checks the CLI and the docstrings name
    "DEFAULT_BOOTSTRAP", "DEFAULT_EXACT_LIMIT", "DEFAULT_MC_SAMPLES", "LOG_FLOAT_MAX", "RANGE_TOL", "SHIP_ESTIMATOR",
    "SHIP_METRIC", "SLATE_ONLY", "WEIGHT_MEAN_TOL", "WEIGHT_MEAN_Z", "HEAVY_TAIL_ESS", "heavy_tailed", "check_inputs",
    "check_marginal_options",
    "check_report_options", "check_target", "learned_calls", "log_cause", "low_ess_advice", "LogCause", "signed",
]
