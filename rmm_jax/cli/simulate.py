"""``rmm-jax simulate``: the online loop over every user against simulated citations."""
from __future__ import annotations

import contextlib
from pathlib import Path

import click

from rmm_jax.cli.common import (
    change_setting_option,
    check_rank_scope,
    checkpoint_options,
    config_dict,
    config_options,
    distributed_options,
    is_writer,
    learning_setting,
    note_setting,
    short_bank_note,
    start_distributed,
    users_per_chunk_option,
)
from rmm_jax.cli.main import cli
from rmm_jax.cli.online import (
    INIT_HELP,
    INITS,
    continue_note,
    keep_option,
    online_options,
    open_policies,
    plot_option,
    report,
    resolve_init,
    run_and_save,
    save_plot,
    saving_run,
    setting_report,
    stored_kind,
    stored_scope,
)
from rmm_jax.cli.shell import (
    as_options,
    check_output_file,
    count,
    info,
    json_option,
    quiet_option,
    users_option,
)
from rmm_jax.data import citations as cm
from rmm_jax.data.calls import check_out_apart
from rmm_jax.data.citation_log import LogWriter
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.loop import make_run
from rmm_jax.online.session import learned_nothing, rs_fresh
from rmm_jax.online.setting import SettingOptions
from rmm_jax.online.starts import check_simulated
from rmm_jax.online.streams import check_users, store_chunks
from rmm_jax.persist.policy_store import PolicyStore
from rmm_jax.persist.runstate import RunState, file_digest

CITATION_MODELS = tuple(m for m in cm.CITATION_MODELS if m != "precision_recall")   # that one: --precision/--recall


def parse_range(text: str | None) -> tuple[int, int | None]:
    """``START:END`` -> ``(start, end)``; either side may be empty (0, the end)."""
    if text is None:
        return 0, None
    a, sep, b = text.partition(":")
    try:
        start, stop = int(a) if a.strip() else 0, int(b) if b.strip() else None
    except ValueError:
        start = stop = -1
    if not sep or start < 0 or (stop is not None and stop <= start):
        raise InputError(f"expected START:END with 0 <= START < END, got {text!r}", where="--queries")
    return start, stop


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--policies", required=True, type=click.Path(), help="Policy store (created if absent).")
@click.option("--init", "init", type=click.Choice(INITS), default=None,
              show_default="continue if --policies exists, else identity",
              help=INIT_HELP)
@keep_option
@config_options
@change_setting_option
@click.option("--citations", type=click.Choice(CITATION_MODELS), default="oracle", show_default=True,
              help="Simulated generator: oracle cites gold memories at the paper's per-class judge rates "
                   f"(useful {cm.P_USEFUL}, not useful {cm.P_OTHER}, spurious {cm.SPURIOUS}); position adds a "
                   f"decay {cm.POSITION_DECAY}^slot; answer cites the shown memory most similar to the question "
                   "plus its reference answer, never reading gold (needs a store made with `embed --answers`). "
                   "docs/citations.md.")
@click.option("--precision", type=float, default=None,
              help=f"Instead: the precision/recall simulator with this precision [{DEFAULT_PRECISION} when only "
                   "--recall is given].")
@click.option("--recall", "cite_recall", type=float, default=None,
              help=f"Instead: the precision/recall simulator with this recall [{DEFAULT_RECALL}].")
@users_option("Only these users")
@click.option("--queries", "query_range", default=None, metavar="START:END",
              help="Only each user's queries START..END-1 in stream order (either end may be left out): a "
                   "later run over the next range continues where this one stopped.")
@click.option("--relearn", is_flag=True,
              help="Learn the --queries range also where the policies learned those questions in an earlier "
                   "simulate run. Without it such a run is refused: each version records the questions its "
                   "simulate runs learned from.")
@users_per_chunk_option
@click.option("--log-out", type=click.Path(), default=None,
              help="Write the generated citation log (JSONL) to this file; not - (stdout carries the summary).")
@distributed_options
@checkpoint_options(16, "updates (batches)")
@plot_option
@quiet_option
@json_option("the run's summary", "policies, init, setting, config, citations, base (the base retriever on the "
             "same queries, per_user among them), online (the run's prequential measures, per_user among them), "
             "curve and cited_curve (learning curves, when measured), plot (the --plot PNG written, or null)")
def simulate(store, policies, init, keep, change_setting, citations, precision, cite_recall, users, query_range,
             relearn, users_per_chunk, log_out, checkpoint_every, resume, plot_path, as_json, **opts):
    """Run the online loop on STORE against simulated citations.

    Each user's query stream runs in order: the reranker picks M of the K retrieved
    memories (Gumbel top-M), the simulated generator (--citations) cites some of them, and
    the policy is updated from the citations every --batch queries (--preset: by default
    they are labels of the shown memories; reinforce and paper take a REINFORCE step).
    Policies are saved to --policies (per user, and the shared part in scopes
    shared/hybrid). Reported: prequential Recall@M, shown recall and the gold-free measures.

    \b
    Examples:
      rmm-jax simulate stores/synthetic --policies pretrained --init pretrained --log-out simulated.jsonl
      rmm-jax simulate stores/synthetic --policies simulated --plot curve.png
    """
    given = SettingOptions.of(opts)
    scope, rank = stored_scope(policies, given.scope, given.rank)
    kind, hidden = stored_kind(policies, given.kind, given.hidden)
    given = given._replace(kind=kind, hidden=hidden)
    check_rank_scope(scope, rank)
    ls = learning_setting(policies, given._replace(scope=scope, rank=rank), change=change_setting, resume=resume)
    setting = ls.setting
    scope, rank = setting.layout.scope   # as resolved: the run-state fingerprint compares them
    given = given._replace(scope=scope, rank=rank)
    # Rates are checked here, before any work (and progress output), not inside the run.
    overridden = precision is not None or cite_recall is not None
    precision = DEFAULT_PRECISION if precision is None else precision
    cite_recall = DEFAULT_RECALL if cite_recall is None else cite_recall
    if not 0.0 < precision <= 1.0:
        raise InputError(f"must be in (0, 1], got {precision}", where="--precision")
    if not 0.0 <= cite_recall <= 1.0:
        raise InputError(f"must be in [0, 1], got {cite_recall}", where="--recall")
    with as_options("precision", "recall", name="citations"):   # the rates apply to the oracle only: --citations
        cite = cm.citation_model(citations, **({"precision": precision, "recall": cite_recall} if overridden else {}))
    if log_out and Path(log_out).is_dir():
        raise InputError("is a directory, expected a JSONL file path", where=f"--log-out {log_out}")
    check_output_file(log_out, f"--log-out {log_out}")
    for path, opt in ((log_out, "--log-out"), (plot_path, "--plot")):    # neither inside a store it reads
        check_out_apart(path, f"{opt} {path}", "-", [("STORE", store), ("--policies", policies)])
    check_output_file(plot_path, f"--plot {plot_path}")
    left = RunState.path_for(policies).is_dir()   # a run-state without a checkpoint: a run killed before the first
    if resume and Path(policies).exists() and RunState.interrupted_command(policies) is None \
            and not (left and learned_nothing(PolicyStore.open(policies))):   # that: from the beginning, as no store
        raise InputError("no checkpoint of these policies to resume (the last run finished, or stopped before its "
                         "first checkpoint); without --resume, simulate continues them on questions they have not "
                         "learned (--queries), or on the same ones with --relearn",
                         where="--resume")
    afresh = init in ("identity", "pretrained") and not resume    # given: a note if it drops saved users
    # before the processes meet (process 0 may create the store)
    init = resolve_init(policies, init, as_interrupted=True)
    mesh = start_distributed(opts, users_per_chunk=users_per_chunk, resume=resume)
    writer = is_writer()
    st = open_store(store)
    with as_options("users", "queries"):     # the API names its arguments, the CLI its options
        queries = parse_range(query_range)
        run_ids, chunks = store_chunks(st, setting.layout.k, users, users_per_chunk,
                                       answers=citations == "answer", queries=queries)   # those with a question
    asked = check_users(st, users)
    created = writer and not Path(policies).exists()
    ps = open_policies(policies, st, setting.layout, init, opts["seed"], keep=keep, writer=writer)
    options = online_options(opts, given, **{"--init": init, "--citations": citations,
                                      "--precision": precision if overridden else None,
                                      "--recall": cite_recall if overridden else None,
                                      "--users": users, "--queries": query_range, "--relearn": relearn,
                                      "--log-out": log_out,
                                      "--users-per-chunk": users_per_chunk,
                                      "--checkpoint-every": checkpoint_every})
    inputs = {"STORE": file_digest(store), "config": config_dict(setting)}
    with saving_run("simulate", policies, ps, st, ls, init, opts["seed"], created=created, writer=writer,
                    options=options, inputs=inputs, resume=resume, checkpoint_every=checkpoint_every) as (rs, start):
        # The log is appended chunk by chunk to a temp file, renamed into place at the end.
        with (LogWriter(log_out) if log_out and writer else contextlib.nullcontext()) as log:
            again = 0
            if start.before is not None and rs_fresh(rs):    # a resumed run's own versions are not earlier runs
                try:
                    with as_options("queries", "relearn", "users"):
                        again = check_simulated(ps, {u: st.query_count(u) for u in run_ids},
                                                queries, relearn=relearn)
                except InputError as e:         # --queries left out: the whole stream, which --policies learned
                    if query_range or e.where != "--queries":
                        raise
                    raise InputError(e.message, where=f"--policies {policies}") from None
            note_setting(ls, given, policies)      # after the last refusal: a refused run changed nothing
            note = continue_note(ps, start, run_ids, afresh=init if afresh and rs_fresh(rs) else None,
                                 created=created) if writer else None
            result = run_and_save(chunks, len(run_ids), make_run(*setting, cite_fn=cite), start, ps, rs,
                                  seed=opts["seed"], users_per_chunk=users_per_chunk, writer=writer,
                                  checkpoint_every=checkpoint_every, log=log, desc="simulate", mesh=mesh,
                                  first_query=queries[0])
    if note:
        note.say()
    if again:
        info(f"--relearn: learned {count(again, 'question')} again that these policies had learned in an earlier "
             "simulate run", must_read=True)
    if len(run_ids) < len(asked) and writer:
        info(f"note: {len(asked) - len(run_ids)} of {count(len(asked), 'user')} hold no question in --queries "
             f"{query_range} and were not run")
    short = short_bank_note(st, setting.layout.k, run_ids if len(run_ids) < len(st.user_ids) else None)
    if short and writer:
        info(short)
    if log_out and writer:
        info(f"wrote {log.count} log records to {log_out}")
    if plot_path and writer:
        save_plot(result, setting, plot_path, "simulate")
    report(result, setting, {"policies": str(policies), "init": init, "setting": setting_report(ls),
                             "plot": str(plot_path) if plot_path and writer else None,
                                "citations": {"model": "precision/recall" if overridden else citations,
                                              **({"precision": precision, "recall": cite_recall} if overridden
                                                 else {})}}, as_json)
