"""The estimators (IPS, SNIPS, RIPS, SNRIPS, IIPS) from per-slot weights and rewards, their
bootstrap intervals and paired gains, and the reliability checks of one estimate
(:mod:`rmm_jax.online.ope`'s docstring, "Reliability")."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from rmm_jax.core import checks
from rmm_jax.errors import InputError, check_int

ESTIMATORS = ("ips", "snips", "rips", "snrips", "iips")
SLATE_ONLY = ("ips", "snips")        # need only the behaviour's log-probability of the whole selection
DEFAULT_BOOTSTRAP = 1000
WEIGHT_MEAN_Z = 3.29                 # two-sided 0.1% normal quantile
WEIGHT_MEAN_TOL = 0.1                # a weight mean within 1 ± 0.1 is never flagged
HEAVY_TAIL_ESS = 0.1                 # weights whose ESS is below this share of the calls: a few calls carry them
RANGE_TOL = 1e-4                     # of a metric's range: float rounding, clamped


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


def heavy_tailed(est: dict) -> bool:
    """Whether an estimate's weights average below 1 with a few calls carrying them (ESS below
    :data:`HEAVY_TAIL_ESS` of the calls): what a target far from the logging policy gives on a
    correct log. Its selections are rare there, so E[π/μ] = 1 rests on rare calls with huge
    weights that a log of n calls seldom holds; the sample mean of such heavy-tailed weights
    falls below 1. A wrong ``log_prob`` can look the same: the log's ``logits`` tell them apart."""
    mean, ess, n = est.get("weight_mean"), est.get("ess"), est.get("n", 0)
    return mean is not None and ess is not None and mean < 1.0 and ess < HEAVY_TAIL_ESS * n


def _weight_mean_allowance(se):
    return np.maximum(WEIGHT_MEAN_TOL, WEIGHT_MEAN_Z * se)


def _check_estimator(name, arg: str = "name") -> None:
    """``InputError`` naming ``arg`` unless ``name`` is one of :data:`ESTIMATORS`."""
    if name not in ESTIMATORS:
        raise InputError(f"unknown estimator {name!r}; one of {', '.join(ESTIMATORS)}", arg=arg)


def _real_array(x, arg: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "biuf":
        raise InputError(f"expected a real array, got {checks.short(x)}", arg=arg)
    return a.astype(np.float64)


def _check_estimate_args(name, weights, rewards, *, clip, bootstrap, seed, level, logged) -> None:
    """``InputError`` naming the argument of :func:`estimate` that is wrong
    (a 1-D ``weights`` was an IndexError deep inside, an unknown ``name`` another)."""
    _check_estimator(name)
    w = _real_array(weights, "weights")
    if w.ndim != 2:
        raise InputError(f"expected a 2-D array (n calls, M slots), got shape {w.shape}", arg="weights")
    r = _real_array(rewards, "rewards")
    if r.ndim != 2 or r.shape[0] != w.shape[0] or w.shape[1] not in (1, r.shape[1]):
        raise InputError(f"expected shape (n calls, M slots) with weights of shape (n, M) or (n, 1), got {r.shape} "
                         f"with weights {w.shape}", arg="rewards")
    if (w < 0).any():       # NaN and inf pass: an overflow is reported (nonfinite), not refused
        raise InputError(f"importance weights must be >= 0, got {w[w < 0][0]:g}", arg="weights")
    if not np.isfinite(r).all():
        raise InputError("contains NaN or Inf", arg="rewards")
    if clip is not None and not (checks.is_real(clip) and clip > 0):
        raise InputError(f"must be a finite number > 0, got {checks.short(clip)}", arg="clip")
    check_int(bootstrap, "bootstrap", 0)
    check_int(seed, "seed", 0, 2**63)
    if not (checks.is_real(level) and 0 < level < 1):
        raise InputError(f"must be a number in (0, 1), got {checks.short(level)}", arg="level")
    if logged is not None:
        lg = _real_array(logged, "logged")
        if lg.shape != r.shape[:1]:
            raise InputError(f"expected shape ({r.shape[0]},) (one value per call), got {lg.shape}", arg="logged")
        if not np.isfinite(lg).all():
            raise InputError("contains NaN or Inf", arg="logged")


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
    capped. ``ess_max``: the ESS the weights clipped at 1 have, the largest any ``clip`` >= 1
    gives (clipping lower never lowers Kish's ESS), at most n: below the ESS the report
    demands, no clip helps. Everything is computed under ``np.errstate``: an overflow makes a number
    non-finite (``value`` is ``nan`` when a weight is not finite), never a warning.

    ``logged`` (n,): the logging policy's value on each call; then ``gain`` is the
    estimate minus the logging policy's value on the same calls, with a **paired**
    bootstrap interval: every resample of calls gives both values, and the interval is
    that of their difference (``value``, ``ci95``, ``se``).

    Raises ``InputError`` naming the argument: an unknown ``name`` (with the valid ones),
    ``rewards`` not 2-D or not finite, ``weights`` not (n, M) or (n, 1), or negative (NaN and
    inf weights are reported, as above, not refused), ``logged`` not (n,).
    """
    _check_estimate_args(name, weights, rewards, clip=clip, bootstrap=bootstrap, seed=seed, level=level,
                         logged=logged)
    return _estimate(name, weights, rewards, clip=clip, bootstrap=bootstrap, seed=seed, level=level, logged=logged)


def _estimate(name: str, weights, rewards, *, clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP,
              seed: int = 0, level: float = 0.95, logged=None) -> dict:
    """:func:`estimate` without its checks: the report's own weights and rewards, whose
    rewards are NaN where the target's scores are (``direct``; reported as unreliable)."""
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
               "weight_mean_se": mean_se, "ess_max": _kish(np.minimum(cols, 1.0))}
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


def ess_below(ess: float, bound: float) -> str:
    """An ESS below ``bound`` to one decimal, as a line that says it is below shows it: rounded
    down where rounding to nearest would reach the bound (29.96 read "ESS 30.0 of 36 calls < 30").

    >>> from rmm_jax.online.ope import ess_below
    >>> ess_below(29.96, 30), ess_below(29.94, 30), ess_below(47.99999999, 48.5)
    ('29.9', '29.9', '48.0')
    """
    shown = f"{ess:.1f}"
    return shown if float(shown) < bound else f"{math.floor(ess * 10) / 10:.1f}"


def verdict(est: dict, *, value_range: tuple[float, float] | None = None, min_ess: float = 0.0,
            problems: Sequence[str] = ()) -> list[str]:
    """Why the estimate :func:`estimate` returned is unreliable: one short reason per
    failed check (empty: reliable). See "Reliability" in the package docstring.

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
        reasons.append(f"ESS {ess_below(ess, min_ess)} of {n} calls < {min_ess:g}")
    mean, se = est.get("weight_mean"), est.get("weight_mean_se")
    # Below min_ess calls the weights' standard error is no more trustworthy than the bootstrap:
    # 16 calls of a correct log whose target drifted average 0.78 (s.e. 0.06) where the tail of
    # large weights is not sampled yet (the same policies on 2,400 calls: 0.994); the ESS reason
    # withholds the estimate already, and this one says it cannot tell the two apart
    # (large weights not drawn yet pull the mean below 1, never above it: above, the check stands)
    if mean is not None and n < min_ess and mean < 1.0 and abs(mean - 1.0) > _weight_mean_allowance(se):
        reasons.append(f"weights average {mean:.3g} (s.e. {se:.2g}) over only {n} calls: too few to tell large "
                       "weights not sampled yet from a log_prob that is not the logging policy's probability")
    elif mean is not None and abs(mean - 1.0) > _weight_mean_allowance(se):
        reasons.append(f"weights average {mean:.3g} (s.e. {se:.2g}), not 1: " + (
            f"a few calls carry them (ESS {ess:.1f} of {n}): the target has likely drifted far from the logging "
            "policy (heavy-tailed weights, whose mean over few calls falls below 1), or log_prob is not the logging "
            "policy's probability" if heavy_tailed(est) else
            "log_prob is not the logging policy's probability" + (
                " (a log that does not cover the target only pulls the mean below 1)" if mean > 1.0 else
                ", or the target has drifted onto selections this log has not drawn yet (their large weights, "
                "unsampled, pull the mean below 1)")))
    if value_range is not None:
        a, b = value_range
        tol = RANGE_TOL * max(b - a, 1.0)
        if not a - tol <= value <= b + tol:
            reasons.append(f"{value:.4g} is outside the metric's range [{a:.4g}, {b:.4g}]")
    return reasons


def report_entry(est: dict, reasons: Sequence[str], value_range: tuple[float, float] | None = None) -> dict:
    """The report's row for one estimate: strict-JSON numbers only (``None`` for what is
    not finite). Unreliable (``reasons``): ``value``, ``ci95`` and ``se`` are ``None``,
    ``reason`` says why; ``ess``, ``ess_max`` (:func:`estimate`'s) and ``weight_mean`` stay,
    as diagnostics of the weights.
    Reliable: ``value`` is within ``value_range`` (rounding beyond it, at most
    :data:`RANGE_TOL` of the range, is clamped) and ``ci95`` is the bootstrap interval
    intersected with the range, ``ci95_clipped`` saying whether that cut it."""
    fin = lambda x: float(x) if x is not None and math.isfinite(x) else None  # noqa: E731
    out = {"n": int(est["n"]), "reliable": not reasons}
    for key in ("se", "ess", "ess_max", "weight_mean", "weight_mean_se"):
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
