"""``rmm-jax cite-rates``: a generator's citation rates against gold, from its citation log."""
from __future__ import annotations

import click

from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import (
    SEED,
    as_options,
    check_input_file,
    count,
    emit_json,
    info,
    json_option,
    note_lines,
    quiet_option,
    users_option,
)
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.cite_rates import ADVISE_FROM, count_calls
from rmm_jax.online.cite_rates import cite_rates as measure
from rmm_jax.online.stats import MAX_RESAMPLES, MIN_RESAMPLES, check_resamples

ROWS = (("p_useful", "P(cite | a gold memory is shown)"), ("p_other", "P(cite | another memory is shown)"),
        ("p_other_when_gold_shown", "  in calls that show a gold one"),
        ("p_cite_when_no_gold_shown", "  in calls that show none"))


@cli.command("cite-rates")
@click.argument("store", type=click.Path())
@click.option("--log", "log_path", required=True, type=click.Path(),
              help="Citation log (JSONL) of your generator; calls count where STORE holds their question's gold "
                   "or the record carries `gold`.")
@users_option("Only these users' calls")
@click.option("--bootstrap", type=int, default=2000,
              help=f"Bootstrap resamples (users, then calls) for the intervals (at least {MIN_RESAMPLES}, "
                   f"at most {MAX_RESAMPLES:,}).")
@click.option("--seed", type=SEED, default=0, help="Seed of the bootstrap.")
@click.option("--skip-invalid", is_flag=True, help="Skip and count invalid records instead of failing.")
@quiet_option
@json_option("the rates", "store, log, users, calls, calls_with_gold, p_useful, p_other, "
             "p_other_when_gold_shown, p_cite_when_no_gold_shown (each {value, lo, hi, shown, cited}), apart, "
             "advice, options, level, resamples, resampled")
def cite_rates(store, log_path, users, bootstrap, seed, skip_invalid, as_json):
    """Measure how your generator cites: the --p-useful and --p-other to learn with.

    On the calls of the log that have gold, every shown memory is a trial:
    P(cite | useful) is the share of the shown gold memories that were cited,
    P(cite | not useful) the share of the other shown memories. Each comes with a 95%
    bootstrap interval (users, then calls, resampled), each bound at least as wide as
    the exact binomial (Clopper-Pearson) one, so 7 of 7 cited reads [0.5904, 1], not
    [1, 1]. The last line says what to do with the rates: when the two intervals are
    apart and the generator cites other memories often (P(cite | useful) at least 0.65 and
    P(cite | not useful) at least 0.25, where correcting the default paid on the LoCoMo grid's
    tuning conversations 26 and 30, docs/citations.md; on 41-43 it did not, at 0.3), the
    options that correct the default's logistic loss for them,
    to give to `replay` or `simulate` as they are; elsewhere, that no correction is advised
    and why. With --json, `.advice` says which
    (correct, uncorrected, uninformative, unmeasured, overlap) and `.options` holds the options (null
    unless the advice is correct). Nothing is written.

    \b
    Examples:
      rmm-jax cite-rates stores/synthetic --log simulated.jsonl
      rmm-jax cite-rates stores/synthetic --log simulated.jsonl --users user0,user1 --json
    """
    check_input_file(log_path, f"--log {log_path}")
    check_resamples(bootstrap, where="--bootstrap")
    st = open_store(store)
    with as_options("users"):        # the API names its argument, the CLI its option
        counts = count_calls(st, log_path, users=users, skip_invalid=skip_invalid)
    read = counts.read
    if read.skipped:
        info(read.skipped_line(), must_read=True)
    if counts.users.size == 0:      # a misspelt `gold` is the likely cause: its note goes on the error's line
        near = [n for n in read.notes if n.endswith("'gold'?)")]
        raise InputError(f"none of its {count(counts.calls, 'call')} has gold (STORE's, for a question it holds, "
                         "or the record's `gold`): nothing to measure the citations against"
                         + (f"; note: {near[0]}" if near else ""), where=log_path)
    note_lines(read.notes)           # unknown keys that look misspelt
    rates = measure(counts, n_boot=bootstrap, seed=seed)
    if as_json:
        emit_json({"store": str(store), "log": str(log_path), **rates})
        return
    verb = "has" if rates["calls_with_gold"] == 1 else "have"
    click.echo(f"{rates['calls_with_gold']} of {count(rates['calls'], 'call')} {verb} gold "
               f"({count(rates['users'], 'user')}); "
               f"95% intervals over {', then '.join(f'{level}s' for level in rates['resampled'])}:")
    click.echo(f"  {'':<36}{'rate':>8}  {'95% interval':>18}  {'cited / shown':>15}")
    for key, label in ROWS:
        r = rates[key]
        if r["value"] is None:
            click.echo(f"  {label:<36}{'-':>8}  {'':>18}  {'0 / 0':>15}")
            continue
        tally = f"{r['cited']} / {r['shown']}"
        click.echo(f"  {label:<36}{r['value']:>8.4f}  [{r['lo']:.4f}, {r['hi']:.4f}]  {tally:>15}")
    click.echo(ADVICE_LINES[rates["advice"]].format(options=rates["options"], useful=ADVISE_FROM["p_useful"],
                                                    other=ADVISE_FROM["p_other"]))


ADVICE_LINES = {
    "correct": "to correct the default's logistic loss for them: {options}",
    "uncorrected": "no correction is advised: on the LoCoMo grid's tuning conversations correcting the default "
                   "gained in every cell only where P(cite | useful) >= {useful} and P(cite | not useful) >= {other} "
                   "(docs/citations.md)",
    "uninformative": "this generator cites other memories at least as often as gold ones: its citations say nothing "
                     "about usefulness that a correction could recover",
    "overlap": "the two rates' intervals overlap: the citations do not yet tell gold memories from others, so no "
               "correction is advised (more calls with gold narrow the intervals)",
    "unmeasured": "one rate is not measured (no memory of its kind was shown: 0 / 0), so no correction is advised "
                  "(calls that show both gold and other memories measure it)",
}
