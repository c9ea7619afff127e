"""The report ``rmm-jax evaluate`` prints: every metric by every estimator the log supports,
each judged and reported (:func:`evaluate_calls`, :func:`evaluate_log`), the gold-free
cited-recall, and the ship verdict (:mod:`rmm_jax.online.ope`'s docstring, "The verdict")."""
from __future__ import annotations

import math
import sys
from typing import NamedTuple, Sequence

import numpy as np
from tqdm.auto import tqdm

from rmm_jax.core import checks
from rmm_jax.core.scope import Scope
from rmm_jax.data.citation_log import ReadReport
from rmm_jax.data.embed import bar_disable
from rmm_jax.data.log_vectors import known_ids
from rmm_jax.errors import InputError, named
from rmm_jax.online.ope._calls import (
    AGREE_LIMIT,
    METRICS,
    Calls,
    Target,
    call_problems,
    check_target,
    load_calls,
    rounding_bound,
    slot_rewards,
)
from rmm_jax.online.ope._estimators import (
    DEFAULT_BOOTSTRAP,
    ESTIMATORS,
    SLATE_ONLY,
    _estimate,
    _weight_mean_allowance,
    ess_below,
    estimator_weights,
    heavy_tailed,
    report_entry,
    verdict,
)
from rmm_jax.online.ope._marginals import (
    DEFAULT_EXACT_LIMIT,
    DEFAULT_MC_SAMPLES,
    _prefix_log_probs,
    _slot_marginals,
    check_marginal_options,
)
from rmm_jax.online.starts import check_learned
from rmm_jax.online.stats import check_resamples
from rmm_jax.online.streams import scan_log

DEFAULT_MIN_ESS = 30.0               # see "Reliability" in the package docstring
SHIP_METRIC, SHIP_ESTIMATOR = "cite_rate", "snips"   # see "The verdict" in the package docstring


def evaluate_calls(calls: Calls, cfg: Target, *, clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP,
                   seed: int = 0, exact_limit: int = DEFAULT_EXACT_LIMIT, mc_samples: int = DEFAULT_MC_SAMPLES,
                   min_ess: float = DEFAULT_MIN_ESS, progress: bool = False) -> dict:
    """The estimates of every metric by every estimator that the log supports (see the
    package docstring), the logging policy's own logged value and, for Recall@M, the
    exact expected value of the target (``direct``), each judged (:func:`verdict`) and
    reported (:func:`report_entry`); ``ranges``: each metric's range. ``progress``: a bar on
    stderr while it is a terminal, over the metrics' bootstrapped estimates."""
    check_target(cfg)
    check_marginal_options(exact_limit=exact_limit, samples=mc_samples, seed=seed, samples_arg="mc_samples")
    m = calls.selected.shape[1]
    with np.errstate(all="ignore"):
        target_prefix = _prefix_log_probs(calls.target_logits, calls.selected, calls.mask)      # (n, M)
        log_ratio = target_prefix[:, -1] - calls.log_prob
        notes, names = [], list(SLATE_ONLY)
        t_marg, info = _slot_marginals(calls.target_logits, calls.mask, m, exact_limit=exact_limit,
                                      samples=mc_samples, seed=seed)
        kw = {"log_ratio": log_ratio}
        problem_kw: dict = {"log_ratio": log_ratio}
        if calls.behaviour_logits is not None:
            b_prefix = _prefix_log_probs(calls.behaviour_logits, calls.selected, calls.mask)
            b_marg, _ = _slot_marginals(calls.behaviour_logits, calls.mask, m, exact_limit=exact_limit,
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
        rewards = slot_rewards(calls)
        bar = tqdm(total=len(rewards) * (len(names) + 1), desc="estimating", unit="estimate", file=sys.stderr,
                   disable=bar_disable(progress), leave=False)
        for metric, mr in rewards.items():
            span = mr.value_range
            problems = call_problems(calls, mr.rows, **problem_kw)
            logged = mr.rewards.sum(1)
            per = {"logged": _plain_mean(mr.rewards, bootstrap, seed, span)}
            for name in names:
                est = _estimate(name, weights[name][mr.rows], mr.rewards, clip=clip, bootstrap=bootstrap, seed=seed,
                               logged=logged)
                # SNIPS, a weighted mean of the calls' rewards, lies in the same weighted mean of their
                # ranges whatever its weights: no range check can fail (beyond the estimand's range it
                # is sampling, the weights favouring calls with a higher ceiling); it is clamped below
                judged = None if name == "snips" else span
                per[name] = report_entry(est, verdict(est, value_range=judged, min_ess=min_ess,
                                                      problems=problems[name]), span)
                bar.update(1)
            if metric == "recall":
                incl = (t_marg * (np.arange(m)[None, :, None] < calls.shown[:, None, None])).sum(1)   # (n, K)
                direct = (incl * calls.cand_gold).sum(1) / np.maximum(calls.num_gold, 1)
                per["direct"] = _plain_mean(direct[mr.rows][:, None], bootstrap, seed, span, problems["direct"],
                                            logged=logged)
            out[metric] = per
            ranges[metric] = list(span)
            bar.update(1)
        bar.close()
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
    est = _estimate("ips", np.ones((rewards.shape[0], 1)), rewards.sum(1, keepdims=True), bootstrap=bootstrap,
                   seed=seed, logged=logged)
    res = report_entry(est, verdict(est, value_range=value_range, problems=problems), value_range)
    for key in ("ess", "ess_max", "weight_mean", "weight_mean_se"):
        res.pop(key)
    return res


def signed(x: float, width: int = 0, digits: int = 4, *, tiny: bool = False) -> str:
    """``x`` with its sign (``+0.0123``, ``-0.0123``), right-aligned in ``width``; a number
    that rounds to zero prints with none (``0.0000``, never ``-0.0000`` nor ``+0.0000``),
    or with ``tiny`` (where its sign decides, as the verdict's interval), as ``+2.1e-09``."""
    text = f"{x:+.{digits}f}"
    if float(text) == 0:
        text = f"{x:+.1e}" if tiny and x != 0 else f"{0.0:.{digits}f}"
    return text.rjust(width)


def ship_verdict(estimates: dict, metric: str = SHIP_METRIC, estimator: str = SHIP_ESTIMATOR) -> dict:
    """Whether to ship the target policy, from an :func:`evaluate_calls` report's
    ``estimates`` (package docstring, "The verdict"): ship when the ``estimator``'s estimate
    of ``metric`` is reliable and the 95% interval of its paired gain over the logging
    policy lies above 0. Returns ``{"ship", "reliable", "worse", "metric", "estimator", "gain",
    "reason"}``;
    ``worse``: the estimate is reliable and the interval lies below 0, the one verdict that
    shows the target worse than the logging policy (docs/lifecycle.md, "When it says no:
    roll back"); an interval that contains 0 shows it neither better nor worse.

    Raises ``InputError`` naming ``estimates`` when it is not a report's ``estimates`` (the
    whole report: pass ``report["estimates"]``), ``metric`` or ``estimator`` when the
    estimates hold no such entry (with the ones they hold)."""
    _check_verdict_args(estimates, metric, estimator)
    est = estimates[metric][estimator]
    out = {"metric": metric, "estimator": estimator, "gain": est.get("gain")}
    if not est["reliable"]:
        return {**out, "ship": False, "reliable": False, "worse": False,
                "reason": f"no reliable estimate: {est['reason']}"}
    g = est["gain"]
    lo, hi = g["ci95"]
    where = "lies above 0" if lo > 0 else ("lies below 0" if hi < 0 else "contains 0")
    return {**out, "ship": bool(lo > 0), "reliable": True, "worse": bool(hi < 0),
            "reason": f"gain {signed(g['value'])} in {metric}, 95% interval [{signed(lo, tiny=True)}, "
                      f"{signed(hi, tiny=True)}] {where}"}


def decision(v: dict) -> str:
    """The verdict's decision in words, as ``rmm-jax evaluate`` and its plot print it."""
    if v.get("self_served"):
        return "none"
    if v["ship"]:
        return "ship"
    if v.get("log_problem"):
        return "do not ship: the log cannot judge these policies"
    if v["reliable"] and not v["worse"]:        # the interval contains 0: no rollback proposed
        return ("do not ship: not shown better, nor worse; `rerank` serves them already when a replay made them "
                "current: keeping them or `rmm-jax policies rollback` is the team's call")
    return "do not ship"


def agrees_to_rounding(calls: Calls, bound: np.ndarray | None = None) -> np.ndarray:
    """(n,) bool: the calls on which the target gives the logged selection the logging
    policy's probability to float32 rounding, every prefix too when the log has ``logits``
    (:func:`rmm_jax.online.ope._calls.rounding_bound`). Never where the bound δ exceeds
    :data:`~rmm_jax.online.ope._calls.AGREE_LIMIT` (there rounding cannot be told from a policy
    change), nor where it is not finite. Numbers only: :func:`evaluate_log` counts it as
    served by the target only on calls logged without ``policy_version``/``shared_version``
    (with them, the versions decide). ``bound``: :func:`rounding_bound`'s, when the caller
    has it."""
    bound = rounding_bound(calls) if bound is None else bound
    with np.errstate(all="ignore"):
        target = _prefix_log_probs(calls.target_logits, calls.selected, calls.mask)
        ok = (np.abs(target[:, -1] - calls.log_prob) <= bound) & (bound <= AGREE_LIMIT)
        if calls.behaviour_logits is not None:
            behaviour = _prefix_log_probs(calls.behaviour_logits, calls.selected, calls.mask)
            ok &= (np.abs(target - behaviour) <= bound[:, None]).all(1)
    return ok


def rounding_gain(calls: Calls, value_range, bound: np.ndarray | None = None) -> float:
    """The most float32 rounding can move a self-normalised estimate, and so its gain, on
    ``calls``: with every log-ratio off by at most δ (:func:`~rmm_jax.online.ope._calls.rounding_bound`),
    each normalised weight p_i = w_i/Σw moves by a factor within e^{±2δ}, so Σ p_i R_i moves by
    |Σ (p'_i − p_i)(R_i − c)| <= (e^{2δ} − 1)·(b − a)/2 with c the middle of the rewards'
    range [a, b] (Σ p'_i = Σ p_i = 1); the same on every bootstrap resample. ``bound``:
    :func:`rounding_bound`'s, when the caller has it."""
    lo, hi = value_range
    bound = rounding_bound(calls) if bound is None else bound
    return float(np.expm1(2 * np.max(bound, initial=0.0)) * (hi - lo) / 2)


def _self_served(v: dict, n: int, why: str = "versions") -> dict:
    """The verdict on a log whose every call the target served: every weight is 1 and every
    gain 0 by construction, so no decision. ``why``: ``versions`` (each call's logged versions
    are the ones the target loads), else the line that says the target and the logging policy
    agree to float32 rounding."""
    said = (f"POLICIES served all {n} of these calls (each logged policy_version and shared_version is the one it "
            "loads)" if why == "versions" else why)
    return {**v, "ship": False, "worse": False, "self_served": True,
            "reason": f"{said}, so the log cannot compare it with itself: evaluate a newer version on "
                      "this log, or this version on a log it did not serve"}


def _check_verdict_args(estimates, metric, estimator) -> None:
    if not isinstance(estimates, dict):
        raise InputError(f"expected the 'estimates' of an evaluate_log report (a dict), got "
                         f"{checks.short(estimates)}", arg="estimates")
    if "estimates" in estimates:
        raise InputError("got the whole report: pass report['estimates']", arg="estimates")
    if metric not in estimates:
        held = ", ".join(map(repr, estimates)) or "none"
        what = "unknown metric" if metric not in METRICS else "no estimates of"
        raise InputError(f"{what} {metric!r}; estimates holds {held}", arg="metric")
    per = estimates[metric]
    judged = [name for name, est in per.items() if isinstance(est, dict) and "gain" in est and "reliable" in est]
    if estimator not in judged:
        what = "unknown estimator" if estimator not in ESTIMATORS + ("direct",) else f"no gain of {metric} by"
        raise InputError(f"{what} {estimator!r}; one of {', '.join(judged) or 'none'}", arg="estimator")


class LogCause(NamedTuple):
    """Why the log itself keeps an estimate from judging the target (:func:`log_cause`):
    ``why``, and what to do about the log (``fix``)."""
    why: str
    fix: str


def log_cause(est: dict, min_ess: float, *, logits_checked: bool = False) -> LogCause | None:
    """Why the log, not the target policy, makes the report entry ``est`` unreliable (None:
    it is reliable, or the log is not why): it holds fewer calls than ``min_ess`` (an ESS is at
    most the number of calls; over so few, weights that average below 1 cannot be told from
    sampling, and the fix says to check the log_prob too), or its weights do not average 1 (the
    log's ``log_prob`` is not the logging policy's probability, or it misses selections the
    target makes).
    Neither a clip nor another policy changes either. A target whose selections the log
    rarely shows (``ess_max``, the ESS at a clip of 1, below ``min_ess`` on enough calls) is
    the target's divergence, not the log's fault: not a cause here (see :func:`low_ess_advice`).
    Weights that average below 1 with a few calls carrying them
    (:func:`~rmm_jax.online.ope._estimators.heavy_tailed`), or on a self-consistent log
    (``logits_checked``), are named first as what they most likely are, a target far from the
    logging policy on a correct log, with how to tell it from a wrong ``log_prob``. Below 1
    otherwise, both causes are named, with the same way to tell them apart: a correct log of
    48 calls judging a target two days on averaged 0.56 at an ESS of 34 (no tail drawn at
    all), and the message blamed its ``log_prob`` alone. ``logits_checked``: every record
    carries ``logits`` and its ``log_prob`` is their Plackett–Luce probability
    (:func:`load_calls` refuses one that is not), so the log is self-consistent."""
    if est.get("reliable", True):
        return None
    n = est["n"]
    mean, se = est.get("weight_mean"), est.get("weight_mean_se")
    off = mean is not None and se is not None and abs(mean - 1.0) > _weight_mean_allowance(se)
    # first: over fewer calls a mean below 1 cannot tell a wrong log_prob from sampling (large weights not drawn
    # yet pull it below 1, never above: a mean far above 1 is the log's log_prob however few the calls)
    if n < min_ess and not (off and mean > 1.0):
        return LogCause(f"the log has too few calls: {n} of them, and the ESS (at most the number of calls) cannot "
                        f"reach {named('min_ess')} {min_ess:g}"
                        + (f"; its weights average {mean:.3g}, not 1, which so few calls cannot tell from sampling "
                           "(large weights not drawn yet)" if off else ""),
                        ("log more calls" if off else f"log more calls (or lower {named('min_ess')})")
                        + ("; and check that each record's log_prob is the probability the logging policy drew its "
                           "selection with (a log_prob that is not the logging policy's probability keeps the "
                           "weights from averaging 1 however many calls)" if off else ""))
    if off:
        tell = ("to tell the two apart, check that each record's log_prob is the probability the logging policy "
                "drew its selection with (rerank --explore writes it so, with its logits); if it is, the log is right "
                "and these policies are too far from the ones that served it: evaluate them on a log served by "
                "policies closer to them (a later day's), or log with more exploration")
        if mean < 1.0 and (heavy_tailed(est) or logits_checked):
            carried = f", and a few calls carry them (ESS {est['ess']:.1f} of {est['n']})" if heavy_tailed(est) else ""
            other = ("; every record's log_prob is the Plackett–Luce probability of its logits, so the log is "
                     "wrong only if those logits are not the logging policy's (another temperature)" if logits_checked
                     else "; or the log's log_prob is not the logging policy's probability")
            return LogCause(f"the importance weights average {mean:.3g}, not 1{carried}: the target has likely drifted "
                            "far from the logging policy, so the log rarely shows the selections it makes (their "
                            f"large weights, seldom drawn, leave the mean over a log this size below 1){other}", tell)
        if mean < 1.0:      # both causes look the same here: a correct log of a drifted target, or a wrong log_prob
            return LogCause(f"the importance weights average {mean:.3g}, not 1: the log's log_prob is not the logging "
                            "policy's probability, or the target has drifted from the logging policy onto selections "
                            "this log has not drawn yet (their large weights, unsampled, pull the mean below 1)", tell)
        return LogCause(f"the importance weights average {mean:.3g}, not 1: the log's log_prob is not the logging "
                        "policy's probability (selections the log misses only pull the mean below 1)",
                        "log each call's log_prob as the probability the logging policy drew its selection with")
    return None


def low_ess_advice(est: dict, min_ess: float, clip: float | None) -> str:
    """What to do about an estimate whose ESS is below ``min_ess`` on enough calls: a lower
    (or any) clip when one can lift it (``ess_max``, the ESS at a clip of 1, reaches
    ``min_ess``), else say no clip can: the target's selections are rare in the log."""
    best, n = est.get("ess_max"), est["n"]
    if best is not None and best < min_ess:
        return (f"the target's selections are rare in this log: at any {named('clip')} the ESS is at most {best:.1f} "
                f"of {n} calls; log more calls (rerank --explore), or do not ship")
    fix = (f"a lower {named('clip')}" if clip is not None else      # clip=10, or the CLI's --clip 10
           f"{named('clip')} (e.g. {named('clip', 10)}: biased, lower variance)")
    return f"the target differs from the logging policy, so a few calls carry most of the weight: try {fix} or log " \
           "more calls"


def learned_calls(store, log_path, policies, cfg: Target, *, users: Sequence[str] | None = None,
                  skip_invalid: bool = False) -> dict:
    """How many of the log's calls (those of ``users``) the policies in ``policies`` have
    learned from, as the policy store remembers them (:func:`rmm_jax.online.starts.check_learned`):
    ``{"calls", "learned", "older", "note"}``; ``older``: calls older than what a user's policy
    remembers (learned and forgotten, or never learned: it cannot tell); ``note``: the line
    that says an estimate on learned calls, or on older ones (the policies learned from them or
    from later calls), can be optimistic (None: none was learned and none is older).
    Reads the log and the users' states; :func:`evaluate_log` takes the count :func:`load_calls`
    made as it read both (``Calls.learned``)."""
    scan = scan_log(log_path, cfg, known=known_ids(store), skip_invalid=skip_invalid, users=users, calls=True)
    calls = scan.calls or {}
    return _learned(check_learned(calls, policies, log_path, before=None, relearn=True, questions=store)  # count
                    if calls else None)


def _learned(got) -> dict:
    """:func:`learned_calls`' dict of a :class:`~rmm_jax.online.starts.LearnedCheck` (None: no
    call), from :func:`check_learned` or ``Calls.learned``."""
    total, learned, older = (int(got.learn), int(got.known), int(got.older)) if got else (0, 0, 0)
    if learned and not older:
        note = (f"the policies learned from {learned} of these {total} calls: an estimate on the calls they learned "
                "from can be optimistic; evaluate on a later day's log")
    elif older:
        said = f"the policies learned from {learned} of these {total} calls and " if learned else ""
        note = (f"{said}{older} of these {total} calls are older than what the policies have learned (learned and "
                "forgotten, or followed by calls they learned from): an estimate on calls they learned from, or on "
                "calls before them, can be optimistic; evaluate on a later day's log")
    else:
        note = None
    return {"calls": total, "learned": learned, "older": older, "note": note}


def unreliable(report: dict) -> list[tuple[str, str, str]]:
    """``(metric, estimator, reason)`` of every unreliable estimate in an
    :func:`evaluate_log` report."""
    return [(metric, name, est["reason"]) for metric, per in report["estimates"].items()
            for name, est in per.items() if not est["reliable"]]


def check_report_options(*, clip: float | None, bootstrap: int, min_ess: float, seed: int = 0,
                         exact_limit: int = DEFAULT_EXACT_LIMIT, mc_samples: int = DEFAULT_MC_SAMPLES) -> None:
    """The options of :func:`evaluate_log`'s report, each refused as one line naming the
    argument: ``rmm-jax evaluate`` checks them before it reads the log, and names its
    option (``--min-ess``) instead (:func:`rmm_jax.cli.common.as_options`). ``seed``,
    ``exact_limit`` and ``mc_samples`` as :func:`slot_marginals` takes them (ints; the
    counts >= 1, as the CLI's ``--exact-limit`` and ``--mc-samples``)."""
    if clip is not None and not (clip >= 1.0 and math.isfinite(clip)):
        raise InputError(f"must be a finite number >= 1, got {clip}", arg="clip")
    check_resamples(bootstrap)
    if not (min_ess >= 0 and math.isfinite(min_ess)):
        raise InputError(f"must be a finite number >= 0, got {min_ess}", arg="min_ess")
    check_marginal_options(exact_limit=exact_limit, samples=mc_samples, seed=seed, samples_arg="mc_samples")


def empty_report(log_path, reason: str, *, tau: float, k: int, m: int, clip: float | None, min_ess: float,
                 bootstrap: int, seed: int) -> dict:
    """The report of :func:`evaluate_log` on a log without calls (a quiet day): its usual keys,
    with 0 calls, no estimate, and the verdict none for ``reason``."""
    return {"calls": 0, "users": 0, "users_on_shared_params": 0, "tau": tau, "k": k, "m": m, "clip": clip,
            "min_ess": min_ess, "bootstrap": bootstrap, "seed": seed,
            "log": {"path": str(log_path), **ReadReport(0, 0, [], [])._asdict()}, "warnings": [], "unreliable": [],
            "learned_calls": {"calls": 0, "learned": 0, "older": 0, "note": None}, "estimates": {}, "estimators": [],
            "ranges": {}, "marginals": {}, "notes": [], "cited_recall": None,
            "verdict": {"ship": False, "reliable": False, "worse": False, "metric": SHIP_METRIC,
                        "estimator": SHIP_ESTIMATOR, "gain": None, "reason": reason, "log_problem": None,
                        "served_by_target": 0, "self_served": False}}


def evaluate_log(store, log_path, policies, cfg: Target, *, users: Sequence[str] | None = None,
                 clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                 exact_limit: int = DEFAULT_EXACT_LIMIT, mc_samples: int = DEFAULT_MC_SAMPLES,
                 skip_invalid: bool = False, min_ess: float = DEFAULT_MIN_ESS, cache_dir=None,
                 progress: bool = False) -> dict:
    """Off-policy estimates of the policies in ``policies`` (a
    :class:`~rmm_jax.persist.policy_store.PolicyStore`) from the calls logged in
    ``log_path`` on ``store`` (an embedding store): the report ``rmm-jax evaluate`` prints.

    ``unreliable`` lists ``{"metric", "estimator", "reason"}`` of every unreliable
    estimate; ``warnings`` holds at most one line about low ESS (with what to do) and
    one about clipping. When the log itself keeps the verdict's estimate unreliable
    (:func:`log_cause`: its log_prob is not the logging policy's, or it holds fewer calls
    than ``min_ess``), ``verdict["log_problem"]`` says why and, instead of the
    ESS line, a warning says the log cannot judge the policies and what to fix in it (no
    clip, no rollback). ``verdict["served_by_target"]``: how many calls the target's own
    versions served (:func:`load_calls`), or, on a call logged without version keys, the target
    gives the logged probabilities to float32 rounding (:func:`agrees_to_rounding`; a call with
    one candidate does not count; a note counts the calls without version keys whose rounding
    bound is too large to tell rounding from a change of policy);
    when it served them all, ``verdict["self_served"]`` is true and the verdict neither ships
    nor turns the target down (``worse`` false): the log cannot compare it with itself.
    ``learned_calls``: how many of the calls the policies learned from
    (:func:`learned_calls`). The warnings and errors name ``clip``, ``min_ess`` and the layout's
    ``k``/``m`` as arguments (``clip=10``; from ``rmm-jax evaluate`` as its options, ``--clip 10``:
    :func:`rmm_jax.errors.named`). ``cache_dir``: the root of the embedding cache through which the
    log's texts are embedded (:func:`load_calls`). ``progress``: bars on stderr while it is a terminal
    (``rmm-jax evaluate``'s, none under ``--quiet``), over the texts embedded, the users scored
    and the estimates."""
    check_report_options(clip=clip, bootstrap=bootstrap, min_ess=min_ess, seed=seed, exact_limit=exact_limit,
                         mc_samples=mc_samples)
    calls = load_calls(store, log_path, policies, cfg, users=users, skip_invalid=skip_invalid, cache_dir=cache_dir,
                       progress=progress)
    res = evaluate_calls(calls, cfg, clip=clip, bootstrap=bootstrap, seed=seed, exact_limit=exact_limit,
                         mc_samples=mc_samples, min_ess=min_ess, progress=progress)
    scope = Scope.from_meta(getattr(policies, "meta", None) or {})
    shared = [] if not scope.has_local else sorted(u for u, own in calls.own_policy.items() if not own)
    if shared:
        res["notes"].append(f"{len(shared)} of {len(calls.own_policy)} users have no policy of their own in "
                            f"POLICIES: scored with its shared params")
    warnings = []
    res["verdict"] = ship_verdict(res["estimates"])
    checked = calls.behaviour_logits is not None
    cause = log_cause(res["estimates"][SHIP_METRIC][SHIP_ESTIMATOR], min_ess, logits_checked=checked)
    res["verdict"]["log_problem"] = cause.why if cause else None
    bound = rounding_bound(calls)
    n_calls = len(calls.user_ids)
    # a record's versions decide whether the target served it; rounding is evidence only without them
    unversioned = ~calls.versions_logged if calls.versions_logged is not None else np.ones(n_calls, bool)
    agree = agrees_to_rounding(calls, bound) & unversioned
    certain = calls.mask.sum(1) < 2           # one candidate: any policy shows it, with weight 1
    coarse = unversioned & ~certain & ~(bound <= AGREE_LIMIT)
    by_versions = int(calls.served_by_target.sum())
    served = int((calls.served_by_target | (agree & ~certain)).sum())
    res["verdict"].update(served_by_target=served, self_served=False)
    if n_calls and by_versions == n_calls:
        res["verdict"] = _self_served(res["verdict"], n_calls)
    elif n_calls and agree.all() and not certain.all():
        tol = rounding_gain(calls, res["ranges"][SHIP_METRIC], bound)
        res["verdict"] = _self_served(res["verdict"], n_calls, f"the target and the logging policy agree to float32 "
                                      f"rounding on all {n_calls} of these calls (every importance weight is 1 within "
                                      f"float32's error bound, so any gain lies within ±{tol:.1g}): POLICIES served "
                                      "them, or it draws exactly as what served them did (a uniform draw at a large "
                                      "--draw-tau, or the same params)")
    elif n_calls and served == n_calls:
        res["verdict"] = _self_served(res["verdict"], n_calls, f"POLICIES served all {n_calls} of these calls (by "
                                      "their logged versions, or to float32 rounding of the logged probabilities)")
    if coarse.any():
        res["notes"].append(f"on {int(coarse.sum())} of these {n_calls} calls, logged without policy_version and "
                            "shared_version, float32 rounding of the target's scores could move a log-probability by "
                            f"up to {float(np.max(bound[coarse])):.2g} nats (its scores are large), beyond the "
                            f"{AGREE_LIMIT:g} within which rounding can be told from a change of policy: they count "
                            "as not served by POLICIES")
    if served and served < n_calls:
        res["notes"].append(f"POLICIES served {served} of these {n_calls} calls itself (their logged "
                            "policy_version and shared_version are the ones it loads, or it gives them the logged "
                            "probabilities to float32 rounding): on those the estimate compares it with itself")
    low = [(est["ess"], est["n"], metric, name) for metric, per in res["estimates"].items()
           for name, est in per.items() if est.get("ess") is not None and est["ess"] < min_ess]
    if cause:           # no clip, and no rollback: the log is what fails, the policies are not judged
        warnings.append(f"the log cannot judge these policies ({SHIP_ESTIMATOR} on {SHIP_METRIC}): {cause.why}. "
                        f"Neither {named('clip')} nor a rollback helps: {cause.fix}")
    elif low:
        ess, n, metric, name = min(low)
        low_cause = log_cause(res["estimates"][metric][name], min_ess, logits_checked=checked)
        advice = (f"{low_cause.why}: {low_cause.fix}" if low_cause else
                  low_ess_advice(res["estimates"][metric][name], min_ess, clip))
        warnings.append(f"effective sample size below {min_ess:g} for {len(low)} estimates (lowest "
                        f"{ess_below(ess, min_ess)} of {n} calls, {name} on {metric}); {advice}")
    if clip is not None:
        n_clipped = {name: est.get("clipped", 0) for name, est in next(iter(res["estimates"].values())).items()
                     if name not in ("logged", "direct")}
        counts = ", ".join(f"{k}: {v}" for k, v in n_clipped.items())
        warnings.append(f"importance weights clipped at {clip:g} (weights capped, cited metric: {counts}): "
                        "clipped estimates are biased, towards the logging policy's value for ips")
    bad = [{"metric": metric, "estimator": name, "reason": reason} for metric, name, reason in unreliable(res)]
    learned = _learned(calls.learned)    # counted as load_calls read the log and the states: each read once
    return {"calls": int(len(calls.user_ids)), "users": len(calls.own_policy), "users_on_shared_params": len(shared),
            "tau": cfg.tau, "k": cfg.k, "m": cfg.m, "clip": clip, "min_ess": min_ess, "bootstrap": bootstrap,
            "seed": seed, "log": {"path": str(log_path), **calls.read._asdict()}, "warnings": warnings,
            "unreliable": bad, "learned_calls": learned, **res}
