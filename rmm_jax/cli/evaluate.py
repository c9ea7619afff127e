"""``rmm-jax evaluate``: off-policy estimates of a policy store's value from a citation log."""
from __future__ import annotations

import math
from pathlib import Path

import click

from rmm_jax.cli.common import (
    DEFAULTS,
    check_tau_option,
    k_m_from_log,
    k_m_without_log,
    note_read,
    open_policies_for,
)
from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import (
    SEED,
    TWICE,
    as_options,
    cache_dir_option,
    check_input_file,
    check_output_file,
    count,
    emit_json,
    info,
    json_option,
    note_lines,
    png_option,
    quiet_option,
    users_option,
)
from rmm_jax.core.config import Layout
from rmm_jax.data.calls import check_out_apart
from rmm_jax.data.citation_log import ReadReport, is_empty_log
from rmm_jax.data.log_vectors import known_ids
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.ope import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_EXACT_LIMIT,
    DEFAULT_MC_SAMPLES,
    DEFAULT_MIN_ESS,
    Target,
    check_report_options,
    decision,
    empty_report,
    evaluate_log,
    signed,
)
from rmm_jax.online.plot import plot_estimates
from rmm_jax.online.serve import behaviour_tau
from rmm_jax.online.stats import MAX_RESAMPLES, MIN_RESAMPLES
from rmm_jax.online.streams import log_shape
from rmm_jax.persist.policy_rollback import newest_run, store_notes

# evaluate_log's arguments that are this command's options: their errors name the option
OPTIONS = ("clip", "bootstrap", "min_ess", "users", "cache_dir")
LABELS = {"cited": "cited memories per call", "cite_rate": "cite rate of the shown memories",
          "recall": "Recall@M of the shown memories (calls with gold)"}
EXIT_UNRELIABLE = 3


def _row(name: str, est: dict) -> str:
    ess = f"{est['ess']:8.1f}" if est.get("ess") is not None else f"{'-':>8}"
    if est["value"] is None:
        return f"  {name:<10} unreliable ({est['reason']})"
    lo, hi = est["ci95"]
    cut = "*" if est.get("ci95_clipped") else " "
    gain = ""
    if est.get("gain") is not None:
        g = est["gain"]
        gain = f"  {signed(g['value'], 8)} [{signed(g['ci95'][0], 8)}, {signed(g['ci95'][1], 8)}]"
    return f"  {name:<10} {est['value']:8.4f}  [{lo:8.4f}, {hi:8.4f}]{cut} {ess}{gain}"


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--log", "log_path", required=True, type=click.Path(),
              help="Citation log (JSONL) whose records carry the logging policy's log_prob (and, for rips/iips, "
                   "logits).")
@click.option("--policies", required=True, type=click.Path(), help="Policy store holding the target policy.")
@users_option("Only these users' calls")
@click.option("--draw-tau", "--tau", "tau", type=float, default=None,
              show_default="the learning setting POLICIES records, else " f"{DEFAULTS.estimator.tau}",
              help="Target policy's sampling temperature: the draw's, what replay and simulate call --draw-tau "
                   "(their --tau, the loss's, when none is given). --tau is the same option.")
@click.option("--k", type=int, default=None, show_default="the log's", help="Candidates per call (K).")
@click.option("--m", type=int, default=None, show_default="the log's", help="Memories shown per call (M).")
@click.option("--clip", type=float, default=None, show_default="no clipping",
              help="Cap every importance weight at this (>= 1; inf: none, as replay's --clip takes it); reported as a "
                   "bias warning.")
@click.option("--min-ess", type=float, default=DEFAULT_MIN_ESS,
              help="An estimate whose weights have a smaller effective sample size is unreliable (0: no check).")
@click.option("--allow-unreliable", is_flag=True,
              help=f"Exit 0 even when an estimate is unreliable (otherwise exit {EXIT_UNRELIABLE}).")
@click.option("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP,
              help=f"Bootstrap resamples for the 95% intervals (at least {MIN_RESAMPLES}, at most {MAX_RESAMPLES:,}).")
@click.option("--exact-limit", type=int, default=DEFAULT_EXACT_LIMIT,
              help="Per-slot marginals (iips, recall direct) are exact when they need at most this many "
                   "candidate sets, Monte Carlo otherwise.")
@click.option("--mc-samples", type=int, default=DEFAULT_MC_SAMPLES, help="Samples per call for Monte Carlo marginals.")
@click.option("--seed", type=SEED, default=0, help="Seed of the bootstrap and the Monte Carlo marginals.")
@click.option("--skip-invalid", is_flag=True, help="Skip and count invalid records instead of failing.")
@png_option("Also write a PNG: per metric, every estimate with its 95% interval, the logged value as a reference "
            "line, each unreliable estimate as a hatched column labelled 'unreliable', with no value; below, each "
            "estimate's paired gain over the logging policy; the verdict in the title.")
@cache_dir_option
@quiet_option
@json_option("the report", "store, policies, log, users, calls, k, m, tau, clip, min_ess, bootstrap, seed, "
             "estimators, estimates (per metric, per estimator), ranges, marginals, cited_recall, unreliable, "
             "users_on_shared_params, learned_calls (how many of the calls the policies learned from), notes, "
             "warnings, verdict (with log_problem: why the log cannot judge the policies, or null; worse; "
             "self_served and served_by_target: the calls POLICIES served itself), pending_rollback (null, or the "
             "note that an interrupted rollback of POLICIES is pending: the versions it forgets were evaluated), "
             "unfinished_run (null, or the run that has not finished writing POLICIES, whose mix of versions was "
             "evaluated: command, state, note), plot (the --plot PNG written, or null)")
def evaluate(store, log_path, policies, users, tau, k, m, clip, min_ess, allow_unreliable, bootstrap, exact_limit,
             mc_samples, seed, skip_invalid, plot_path, cache_dir, as_json):
    """Estimate, from logged calls, what the policies in POLICIES would get: off-policy evaluation.

    Every record's selection was drawn by the logging policy with probability
    exp(log_prob). Reweighting the logged citations by target/logging probabilities
    (the target samples Plackett–Luce on its scores / --draw-tau, like `simulate`) estimates
    the target's cited memories per call, cite rate and, where STORE has gold,
    Recall@M. Estimators: ips, snips; with per-candidate `logits` in the log also rips
    (reward-interaction), snrips and iips (independent, per-slot marginals). Each comes
    with a bootstrap 95% interval and its effective sample size (ESS); `logged` is the
    logging policy's own value. A query or memory that STORE lacks is embedded from the
    record's text with STORE's model through the embedding cache (--cache-dir);
    nothing is written but that cache and --plot. --k and --m default to the log's:
    every record lists K candidates (or all of its user's memories, when fewer) and
    shows M memories (or all its candidates, when fewer); given, they must agree with it.

    An estimate is UNRELIABLE, printed as `unreliable (reason)` with no number
    (`"value": null` and a `"reason"` in --json), when:

    \b
      - its importance weights overflow float64 (log(target/logging) > 709.8)
        or are not finite (the target's scores are not finite);
      - its ESS is below --min-ess (30: below about 30 equally weighted
        calls the bootstrap interval is not trustworthy and a few calls
        decide the estimate; an on-policy log of fewer calls is flagged too);
      - its weights average far from 1 (beyond 0.1 and 3.29 standard
        errors; over fewer than --min-ess calls a mean below 1 is said to be
        undecidable from sampling): E[target/logging] = 1 whenever the log covers the target,
        so log_prob is not the logging policy's probability (a deterministic
        logger writing 0, a wrong temperature) or the log misses selections
        the target makes (a target far from the logging policy: the message
        names both, and how to tell them apart);
      - its value lies outside the metric's range on these calls: cited in
        [0, mean shown], cite rate in [0, 1], Recall@M between the least and
        the most any selection of the candidates gets (IPS can leave the
        range in finite samples; then it is no estimate of the metric).

    A log_prob > 0 or not finite, one that disagrees with the record's logits,
    or a selection no policy can draw is bad input (error naming file:line;
    --skip-invalid skips such records). Intervals are intersected with the
    metric's range (marked `*`, "ci95_clipped" in --json): the metric always
    lies in its range, so the cut interval covers it as often as the bootstrap
    interval did. It is still the interval of the unclipped estimator.

    \b
    Exit status: 0; 2 bad input; 3 some estimate is unreliable (the report is
    printed in full first; --allow-unreliable exits 0). A low ESS also prints one
    warning line on stderr suggesting --clip where a clip can lift it (an ESS is at
    most the number of calls, and at --clip 1 at its largest), else saying the
    target's selections are rare in the log. Where the log itself is why the
    verdict's estimate is unreliable (its log_prob is not the logging policy's
    probability, or it holds fewer calls than --min-ess), the warning says the log
    cannot judge the policies and what to fix in it, and no rollback is suggested.
    A rollback is suggested only when the verdict's estimate is reliable and its gain's
    interval lies below 0 ("worse" in --json): one that contains 0 shows the policies
    neither better nor worse, and keeping them is the team's call.
    Evaluating on calls the policies learned from prints a note that counts them
    ("learned_calls" in --json): such an estimate can be optimistic.

    Without gold, beside the estimates: the target's cited-recall@M on the logged calls
    (the share of each call's cited memories in its deterministic top-M) against the
    retriever's first M, with the paired gain ("cited_recall" in --json).

    Every estimate also has its GAIN over the logging policy on the same calls, with a
    paired bootstrap interval (the per-call difference resampled together), which is
    what decides a release: two overlapping intervals can hide a gain on every call.
    The last line is the verdict ("verdict" in --json, "ship": true or false): ship
    when the SNIPS estimate of the cite rate is reliable and its gain's 95% interval
    lies above 0. A nightly job that ships on it reads `.verdict.ship` from --json;
    one with another rule reads `.estimates.METRIC.ESTIMATOR.gain` (value, ci95) and
    `.reliable`. When every logged call was served by the very versions POLICIES
    loads (each record's policy_version and shared_version, as `rerank` logs them),
    the log compares the policies with themselves: the verdict is "none"
    ("self_served" in --json, "served_by_target" counts such calls; when only some
    are, a note counts them). The check is by version number: the log does not name
    the policy store that served it. A call without the keys counts when POLICIES gives
    it the logged probabilities to float32 rounding (every weight 1 within float32's
    error bound; docs/ope.md).

    \b
    Examples:
      rmm-jax evaluate stores/mine --log examples/calls_day2.jsonl --policies policies --plot day2_ope.png
      rmm-jax evaluate stores/mine --log examples/calls_day2.jsonl --policies policies --json --bootstrap 1000
    """
    check_input_file(log_path, f"--log {log_path}", TWICE)
    check_tau_option(tau, "--draw-tau")
    for name, v in (("--exact-limit", exact_limit), ("--mc-samples", mc_samples)):
        if v < 1:
            raise InputError(f"must be >= 1, got {v}", where=name)
    if clip is not None and not clip >= 1.0:       # the API's "must be a finite number" read wrong beside inf
        raise InputError(f"must be >= 1 (inf: no clipping), got {clip}", where="--clip")
    clip = None if clip == math.inf else clip      # replay's "none", which evaluate refused as not finite
    with as_options(*OPTIONS):
        check_report_options(clip=clip, bootstrap=bootstrap, min_ess=min_ess)
    check_out_apart(plot_path, f"--plot {plot_path}", "-", [("STORE", store), ("--policies", policies)])
    if plot_path and Path(plot_path).exists() and Path(log_path).exists() and Path(plot_path).samefile(log_path):
        raise InputError(f"is the log --log {log_path}: writing the plot would replace it; give another path",
                         where=f"--plot {plot_path}")
    check_output_file(plot_path, f"--plot {plot_path}")
    st = open_store(store)
    if is_empty_log(log_path):       # a day without calls: nothing to judge (not bad input)
        _target(*k_m_without_log(k, m), tau)     # but its options are checked, as on a day with calls
        return quiet_day(store, log_path, policies, open_policies_for(policies, st),
                         dict(tau=tau, k=k, m=m, clip=clip, min_ess=min_ess, bootstrap=bootstrap, seed=seed,
                              plot_path=plot_path), as_json)
    k_m_note: list[str] = []         # printed once the log has been read: bad input is one line
    k, m = k_m_from_log(k, m, log_shape(log_path, known_ids(st), skip_invalid=skip_invalid), log_path,
                        notes=k_m_note)
    ps = open_policies_for(policies, st)
    tau = behaviour_tau(ps) if tau is None else tau
    cfg = _target(k, m, tau)
    with as_options(*OPTIONS, "k", "m"):          # its warnings name --k, --m, --clip, --min-ess
        rep = evaluate_log(st, log_path, ps, cfg, users=users, clip=clip, bootstrap=bootstrap, seed=seed,
                           exact_limit=exact_limit, mc_samples=mc_samples, skip_invalid=skip_invalid,
                           min_ess=min_ess, cache_dir=cache_dir, progress=True)
    notes = store_notes(ps)
    rep = {"store": str(store), "policies": str(policies), **rep, **notes.doc()}
    log = rep["log"]
    for note in k_m_note:
        info(note)
    note_read(ReadReport(*(log[f] for f in ReadReport._fields)),    # log also holds its path; unknown keys
              [rep["learned_calls"]["note"], *notes.lines])        # pending: before a rollback
    for w in rep["warnings"]:
        info(f"warning: {w}")
    if plot_path is not None:
        plot_estimates(rep["estimates"], rep["ranges"], plot_path, labels=LABELS, verdict=rep["verdict"],
                       title=f"off-policy estimates for {policies} ({rep['calls']} calls, target tau {tau:g})")
        info(f"wrote {plot_path}")
    if as_json:
        emit_json({**rep, "plot": str(plot_path) if plot_path is not None else None})
    else:
        _print_table(rep, policies, tau)
    v = rep["verdict"]
    # a rollback only for a reliable estimate below the logged value (docs/lifecycle.md); not when the log
    # failed (the warning says what to fix), nor when it served these policies (the verdict says so)
    hint = rollback_hint(ps, policies) if v["worse"] else None
    if hint:
        info(hint, must_read=True)
    if rep["unreliable"]:
        n_est = sum(len(per) for per in rep["estimates"].values())
        info(f"{len(rep['unreliable'])} of {n_est} estimates are unreliable"
             + ("" if allow_unreliable else f"; exit status {EXIT_UNRELIABLE} (--allow-unreliable: 0)"), must_read=True)
        if not allow_unreliable:
            click.get_current_context().exit(EXIT_UNRELIABLE)


def _target(k: int, m: int, tau: float | None) -> Target:
    """The target of ``--k``, ``--m``, ``--tau`` (None: the default, for the checks alone);
    a bad one is the one line naming its option."""
    try:
        Layout(k=k, m=m)
        return Target(k, m, DEFAULTS.estimator.tau if tau is None else tau)
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise InputError(msg or str(e), where=f"--{name}") from None


def quiet_day(store, log_path, policies, ps, opts: dict, as_json: bool) -> None:
    """An empty log (docs/lifecycle.md, "A quiet day"): no calls to judge, verdict none, exit
    0; --json has the report's usual keys with 0 calls and no estimates. ``opts``: the verb's
    options (tau, k, m, clip, min_ess, bootstrap, seed, plot_path)."""
    why = f"{log_path} has no calls to judge: the file is empty"
    notes = store_notes(ps)
    tau = behaviour_tau(ps) if opts["tau"] is None else opts["tau"]
    rep = {"store": str(store), "policies": str(policies),
           **empty_report(log_path, why, tau=tau, **{k: opts[k] for k in ("k", "m", "clip", "min_ess", "bootstrap",
                                                                           "seed")}),
           **notes.doc()}
    note_lines(notes.lines)
    if opts["plot_path"] is not None:
        info(f"no plot: {why}, so --plot {opts['plot_path']} was not written", must_read=True)
    if as_json:         # the line on stderr, as rerank --json says it served 0 calls
        info(f"verdict: none ({why})")
        emit_json({**rep, "plot": None})
    else:
        click.echo(f"verdict: none ({why})")


def rollback_hint(ps, policies) -> str | None:
    """How to undo these policies when a run saved them (None: no run did): for a verdict
    whose estimate is reliable and below the logged value."""
    try:
        first = newest_run(ps)
    except InputError:
        return None
    return (f"shown worse: `rmm-jax policies rollback {policies}` undoes the run that saved v{first} onwards "
            "(docs/lifecycle.md, \"When it says no: roll back\")")


def _print_table(rep: dict, policies, tau: float) -> None:
    marg = rep["marginals"]
    how = (f"exact, {marg['subsets']} sets" if marg["method"] == "exact"
           else f"Monte Carlo, {marg['samples']} samples per call")
    click.echo(f"Off-policy estimates for {policies} from {count(rep['calls'], 'call')} of "
               f"{count(rep['users'], 'user')} "
               f"(target tau {tau:g}; slot marginals {how}):")
    cut = False
    for metric, per in rep["estimates"].items():
        lo, hi = rep["ranges"][metric]
        click.echo(f"\n{LABELS[metric]} (range {lo:.4g} to {hi:.4g})")
        gain = "gain over logged, 95%"
        click.echo(f"  {'estimator':<10} {'value':>8}  {'95% interval':>19}   {'ESS':>8}  {gain:>30}")
        for name, est in per.items():
            click.echo(_row(name, est))
            cut = cut or bool(est.get("ci95_clipped"))
    exact = rep.get("marginals", {}).get("method", "exact") == "exact"
    direct = ("the target's exact expected Recall@M from the gold labels" if exact else
              "the target's expected Recall@M from the gold labels, over Monte Carlo slot marginals (--mc-samples; "
              "--exact-limit above their count makes them exact)")
    click.echo(f"\n(logged: the logging policy's own value; direct: {direct})" if "recall" in rep["estimates"]
               else "\n(logged: the logging policy's value)")
    if cut:
        click.echo("(*: interval cut at the metric's range)")
    click.echo("(gain: the estimate minus the logging policy's value on the same calls, paired bootstrap interval)")
    for note in rep["notes"]:
        click.echo(f"note: {note}")
    cr = rep.get("cited_recall")
    if cr:
        t, r, g = cr["target"], cr["retriever"], cr["target"]["gain"]
        click.echo(f"cited-recall@M on the {cr['calls']} calls with a citation (no gold needed): target "
                   f"{t['value']:.4f} [{t['ci95'][0]:.4f}, {t['ci95'][1]:.4f}], retriever {r['value']:.4f}; "
                   f"gain {signed(g['value'])} [{signed(g['ci95'][0])}, {signed(g['ci95'][1])}]")
    v = rep["verdict"]
    click.echo(f"\nverdict: {decision(v)} ({v['estimator']} on {v['metric']}: {v['reason']})")
