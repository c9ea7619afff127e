"""``rmm-jax evaluate``: off-policy estimates of a policy store's value from a citation log."""
from __future__ import annotations

import click

from rmm_jax.cli.common import DEFAULTS, emit_json, info
from rmm_jax.cli.main import cli
from rmm_jax.core.config import Layout
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.ope import DEFAULT_BOOTSTRAP, DEFAULT_EXACT_LIMIT, DEFAULT_MC_SAMPLES, Target, evaluate_log
from rmm_jax.persist.policy_store import PolicyStore

LABELS = {"cited": "cited memories per call", "cite_rate": "cite rate of the shown memories",
          "recall": "Recall@M of the shown memories (calls with gold)"}


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--log", "log_path", required=True, type=click.Path(),
              help="Citation log (JSONL) whose records carry the logging policy's log_prob (and, for rips/iips, "
                   "logits).")
@click.option("--policies", required=True, type=click.Path(), help="Policy store holding the target policy.")
@click.option("--user", "users", multiple=True, help="Only this user's calls (repeat for several; default: all).")
@click.option("--tau", type=float, default=DEFAULTS.estimator.tau, help="Target policy's sampling temperature.")
@click.option("--k", type=int, default=DEFAULTS.layout.k, help="Most candidates a record may list.")
@click.option("--m", type=int, default=DEFAULTS.layout.m, help="Most memories a record may show.")
@click.option("--clip", type=float, default=None, show_default="no clipping",
              help="Cap every importance weight at this (>= 1); reported as a bias warning.")
@click.option("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP, help="Bootstrap resamples for the 95% intervals.")
@click.option("--exact-limit", type=int, default=DEFAULT_EXACT_LIMIT,
              help="Per-slot marginals (iips, recall direct) are exact when they need at most this many "
                   "candidate sets, Monte Carlo otherwise.")
@click.option("--mc-samples", type=int, default=DEFAULT_MC_SAMPLES, help="Samples per call for Monte Carlo marginals.")
@click.option("--seed", type=int, default=0, help="Seed of the bootstrap and the Monte Carlo marginals.")
@click.option("--skip-invalid", is_flag=True, help="Skip and count invalid records instead of failing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout.")
def evaluate(store, log_path, policies, users, tau, k, m, clip, bootstrap, exact_limit, mc_samples, seed,
             skip_invalid, as_json):
    """Estimate, from logged calls, what the policies in POLICIES would get: off-policy evaluation.

    Every record's selection was drawn by the logging policy with probability
    exp(log_prob). Reweighting the logged citations by target/logging probabilities
    (the target samples Plackett–Luce on its scores / --tau, like `simulate`) estimates
    the target's cited memories per call, cite rate and, where STORE has gold,
    Recall@M. Estimators: ips, snips; with per-candidate `logits` in the log also rips
    (reward-interaction), snrips and iips (independent, per-slot marginals). Each comes
    with a bootstrap 95% interval and its effective sample size (ESS); `logged` is the
    logging policy's own value. Nothing is written.

    \b
    Example:
      rmm-jax evaluate stores/calls --log examples/calls.jsonl --policies policies --json
    """
    if not tau > 0 or tau == float("inf"):
        raise InputError(f"must be > 0, got {tau}", where="--tau")
    for name, v in (("--exact-limit", exact_limit), ("--mc-samples", mc_samples)):
        if v < 1:
            raise InputError(f"must be >= 1, got {v}", where=name)
    try:
        Layout(k=k, m=m)
        cfg = Target(k, m, tau)
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise InputError(msg or str(e), where=f"--{name}") from None
    st = open_store(store)
    ps = PolicyStore.open(policies, expect_dim=st.dim)
    made_for = (ps.meta.get("config") or {}).get("model")
    if made_for and made_for != st.model:
        raise InputError(f"policy store was made for embedding model {made_for!r}, STORE uses {st.model!r}",
                         where=f"--policies {policies}")
    rep = evaluate_log(st, log_path, ps, cfg, users=list(users) or None, clip=clip, bootstrap=bootstrap, seed=seed,
                       exact_limit=exact_limit, mc_samples=mc_samples, skip_invalid=skip_invalid)
    rep = {"store": str(store), "policies": str(policies), **rep}
    log = rep["log"]
    if log.get("skipped"):
        info(f"skipped {log['skipped']} invalid records of {log['records'] + log['skipped']}; "
             f"first: {log['first_errors'][0]}")
    for w in rep["warnings"]:
        info(f"warning: {w}")
    if as_json:
        emit_json(rep)
        return
    marg = rep["marginals"]
    how = (f"exact, {marg['subsets']} sets" if marg["method"] == "exact"
           else f"Monte Carlo, {marg['samples']} samples per call")
    click.echo(f"Off-policy estimates for {policies} from {rep['calls']} calls of {rep['users']} users "
               f"(target tau {tau:g}; slot marginals {how}):")
    for metric, per in rep["estimates"].items():
        click.echo(f"\n{LABELS[metric]}")
        click.echo(f"  {'estimator':<10} {'value':>8}  {'95% interval':>19}  {'ESS':>8}")
        for name, est in per.items():
            lo, hi = est["ci95"]
            ess = f"{est['ess']:8.1f}" if "ess" in est else f"{'-':>8}"
            click.echo(f"  {name:<10} {est['value']:8.4f}  [{lo:8.4f}, {hi:8.4f}]  {ess}")
    click.echo("\n(logged: the logging policy's own value; direct: the target's exact expected Recall@M "
               "from the gold labels)" if "recall" in rep["estimates"] else "\n(logged: the logging policy's value)")
    for note in rep["notes"]:
        click.echo(f"note: {note}")
