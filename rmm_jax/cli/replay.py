"""``rmm-jax replay``: the online loop over every user against logged citations."""
from __future__ import annotations

from pathlib import Path

import click

from rmm_jax.cli.common import (
    MAX_PASSES,
    change_setting_option,
    check_rank_scope,
    checkpoint_options,
    config_dict,
    config_options,
    distributed_options,
    is_writer,
    k_m_from_log,
    k_m_without_log,
    learning_setting,
    note_read,
    note_setting,
    open_policies_for,
    start_distributed,
    users_per_chunk_option,
)
from rmm_jax.cli.main import cli
from rmm_jax.cli.online import (
    INIT_HELP,
    INITS,
    check_scope,
    check_start,
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
    TWICE,
    FloatRange,
    IntRange,
    as_options,
    cache_dir_option,
    check_input_file,
    check_output_file,
    count,
    emit_json,
    info,
    json_option,
    note_lines,
    quiet_option,
    users_option,
)
from rmm_jax.data.calls import check_out_apart
from rmm_jax.data.citation_log import ReadReport, is_empty_log, time_text
from rmm_jax.data.embed import embed_texts
from rmm_jax.data.log_vectors import known_ids
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.loop import make_run
from rmm_jax.online.session import rs_fresh
from rmm_jax.online.setting import SettingOptions
from rmm_jax.online.starts import LearnedCheck, check_learned
from rmm_jax.online.streams import log_chunks, log_shape, repeat_passes, scan_log
from rmm_jax.persist.learned_calls import WINDOW
from rmm_jax.persist.policy_rollback import StoreNotes, store_notes
from rmm_jax.persist.runstate import file_digest


def note_learned(learned: LearnedCheck, relearn: bool) -> dict:
    """Say on stderr which calls the policies learned already; the counts for ``--json``."""
    before = learned.known + learned.older
    if before and relearn:
        info(f"--relearn: learning {before} calls again that these policies have learned from already", must_read=True)
    elif before and learned.older:      # not learned: behind the time up to which their users have learned
        info(f"skipped {before} calls: {learned.known} learned already by these policies, {learned.older} older than "
             f"what their users have learned (at or before their horizon, {time_text(learned.horizon)}; --relearn "
             f"learns them); {learned.learn} calls to learn", must_read=True)
    elif before:
        info(f"skipped {before} calls learned already: {learned.known} by these policies, {learned.older} older than "
             f"what their users have learned (--relearn learns them again); {learned.learn} calls to learn",
             must_read=True)
    if learned.changed:
        info(f"skipped {count(learned.changed, 'call')} learned already with other content (--skip-invalid; "
             f"first: {learned.first_changed})", must_read=True)
    return {"learn": learned.learn, "learned_already": learned.known, "older": learned.older,
            "changed": learned.changed, "relearn": relearn}


def check_options(policies, st, given: SettingOptions, change: bool, resume: bool, plot_path):
    """The run's learning setting (:func:`learning_setting`), refused where replay cannot use it,
    its --plot path and the existing store's scope checked: what replay refuses before it reads
    any call, also on a quiet day."""
    ls = learning_setting(policies, given, change=change, resume=resume)
    if ls.setting.estimator.mode == "rmm":
        raise InputError("the paper preset's log-prob needs the sampled Gumbel noise, which logs do not "
                         "record; replay with --preset default", where="--preset")
    check_out_apart(plot_path, f"--plot {plot_path}", "-", [("STORE", st.path), ("--policies", policies)])
    check_output_file(plot_path, f"--plot {plot_path}")
    if Path(policies).exists():  # fail fast on a mismatched store, before the validation pass
        check_scope(open_policies_for(policies, st), ls.setting.layout, policies)
    return ls


def quiet_day(st, log_path, policies, init: str, relearn: bool, plot_path, as_json: bool) -> None:
    """An empty log (docs/lifecycle.md, "A quiet day"): nothing to learn, as for a log learned
    already; POLICIES is neither created nor changed, and no run-state is written. --json:
    the usual keys, with no setting (the log gives no --k, --m) and 0 calls. A run or a
    rollback that an earlier night left unfinished is not finished by it: the notes say so,
    as readers say."""
    notes = store_notes(open_policies_for(policies, st)) if Path(policies).exists() else StoreNotes()
    note_lines(notes.lines)         # a pending rollback, as readers say it: this run finishes nothing
    if plot_path:
        info(f"no plot: nothing was learned, so --plot {plot_path} was not written", must_read=True)
    calls = {"learn": 0, "learned_already": 0, "older": 0, "changed": 0, "relearn": relearn}
    what = "is unchanged" if Path(policies).exists() else "was not created"
    line = f"nothing to learn: {log_path} has no calls (the file is empty); {policies} {what}"
    if as_json:         # the line on stderr, as rerank --json says it served 0 calls
        info(line)
        emit_json({"policies": str(policies), "init": init, "setting": None, "config": None,
                   "log": {"path": str(log_path), **ReadReport(0, 0, [], [])._asdict(), "calls": calls},
                   "base": {}, "online": {"queries": 0, "calls": 0}, "plot": None})
    else:
        click.echo(line)


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--log", "log_path", required=True, type=click.Path(),
              help="Citation log (JSONL; schema in docs/own-data.md).")
@click.option("--policies", required=True, type=click.Path(), help="Policy store (created if absent).")
@click.option("--init", "init", type=click.Choice(INITS), default=None,
              show_default="continue if --policies exists, else identity",
              help=INIT_HELP)
@keep_option
@config_options(from_log=True)
@change_setting_option
@click.option("--clip", type=FloatRange(min=1), default=5.0, help="Importance-ratio ceiling for off-policy records "
              "(inf: none).")
@click.option("--passes", type=IntRange(min=1, max=MAX_PASSES), default=1,
              help="Passes over each user's records: every pass updates (later ones importance-weighted against "
                   "the logged policy); the report scores the first, prequentially. Under --preset realistic two or "
                   "three gained +0.02 to +0.03 Recall@5 on LoCoMo 26+30; under the default (lr 3e-4) not "
                   "measured, and at lr 3e-4 against the best score more passes overfit (docs/method.md).")
@click.option("--skip-invalid", is_flag=True,
              help="Skip and count invalid records instead of failing, and calls these policies learned with "
                   "other content (a call re-logged with other citations), which are otherwise refused.")
@click.option("--relearn", is_flag=True,
              help="Learn every call of the log, also those the policies have learned from already. Without it "
                   "each call is learned once: calls learned already are skipped and counted, and one learned "
                   "with other content is an error (docs/reliability.md, \"Exactly once\").")
@users_option("Only these users' records")
@users_per_chunk_option
@distributed_options
@checkpoint_options(16, "updates (batches)")
@plot_option
@cache_dir_option
@quiet_option
@json_option("the run's summary", "policies, init, setting, config, log (the log read: path, calls, skipped, "
             "...), base (the base retriever on the same calls, per_user among them), online (the run's "
             "prequential measures, per_user among them), curve and cited_curve (learning curves, when measured), "
             "plot (the --plot PNG written, or null)")
def replay(store, log_path, policies, init, keep, change_setting, clip, passes, skip_invalid, relearn, users,
           users_per_chunk, checkpoint_every, resume, plot_path, cache_dir, as_json, **opts):
    """Replay logged citations from a real (or simulated) generator through the learner.

    Every record's logged selection and citations drive an update (--preset's loss), in
    log order per user, once: the policy store remembers the calls each policy has learned
    from, so replaying a log again learns nothing (the skipped calls are counted), a log
    that mixes old and new calls learns the new ones, and a run killed anywhere and
    started again, with or without --resume, ends where one uninterrupted run would.
    A query or memory that STORE lacks is embedded from the text the
    record carries (`query`, candidates as {"id", "text"}), with STORE's model through
    the embedding cache (--cache-dir); so a day's log of new questions replays as it is. Where a
    record carries the behaviour policy's log_prob and the replaying policy differs,
    the update is importance-weighted (ratio clipped at --clip). Replaying a
    `simulate --log-out` log with the same options and seed reproduces its per-user
    policies bit for bit. --k and --m default to the log's: every record lists K
    candidates (or all of its user's memories, when fewer) and shows M memories (or all
    its candidates, when fewer); given, they must agree with it. An empty log (a day
    without calls) has nothing to learn: exit 0, POLICIES unchanged.

    \b
    Examples:
      rmm-jax replay stores/mine --log examples/calls_day1.jsonl --policies policies --scope hybrid
      rmm-jax replay stores/mine --log examples/calls_day2.jsonl --policies policies --plot day2.png
    """
    check_input_file(log_path, f"--log {log_path}", TWICE)
    given = SettingOptions.of({**opts, "clip": clip})
    scope, rank = stored_scope(policies, given.scope, given.rank)
    kind, hidden = stored_kind(policies, given.kind, given.hidden)
    given = given._replace(kind=kind, hidden=hidden)
    check_rank_scope(scope, rank)
    st = open_store(store)
    if is_empty_log(log_path):      # a day without calls: nothing to learn, nothing written (not bad input),
        k, m = k_m_without_log(given.k, given.m)          # but the options are checked as on a day with calls
        ls = check_options(policies, st, given._replace(k=k, m=m, scope=scope, rank=rank), change_setting, resume,
                           plot_path)
        init = resolve_init(policies, init, as_interrupted=resume)
        check_start(policies, st, ls.setting.layout, init)
        return quiet_day(st, log_path, policies, init, relearn, plot_path, as_json)
    known = known_ids(st)
    k_m_note: list[str] = []         # printed once the log's calls are checked: bad input is one line
    k, m = k_m_from_log(given.k, given.m, log_shape(log_path, known, skip_invalid=skip_invalid), log_path,
                        notes=k_m_note)
    ls = check_options(policies, st, given._replace(k=k, m=m, scope=scope, rank=rank), change_setting, resume,
                       plot_path)
    setting = ls.setting
    scope, rank = setting.layout.scope   # as resolved: the run-state fingerprint compares them
    given = given._replace(k=k, m=m, scope=scope, rank=rank)
    afresh = init in ("identity", "pretrained") and not resume    # given: a note if it drops saved users
    # before the processes meet (process 0 may create the store)
    init = resolve_init(policies, init, as_interrupted=resume)
    mesh = start_distributed(opts, users_per_chunk=users_per_chunk, resume=resume)
    writer = is_writer()
    # Pass 1 validates the whole log (bounded memory) so that nothing is written for a
    # bad one; pass 2 streams it users_per_chunk users at a time.
    continues = init == "continue" and Path(policies).exists()    # only a continued policy has learned calls
    with as_options("users", "k", "m"):      # the API names its arguments, the CLI its options
        scan = scan_log(log_path, setting.layout, known=known, skip_invalid=skip_invalid, users=users,
                        calls=continues)
    grouped, n_users, texts, calls = scan.grouped, scan.users, scan.texts, scan.calls
    user_ids, untimed, replayed = scan.user_ids, scan.untimed_over_window, scan.replayed
    rep = scan.read._asdict()       # the --json `log`: the read report, and the calls learned
    with as_options("cache_dir"):            # what STORE lacks, before any write
        vectors = embed_texts(texts, st.model, cache_dir=cache_dir, progress=True, desc="new texts")
    if vectors:
        k_m_note.append(vectors.lacks_note("queries and memories the log carries as text"))
    if vectors.truncated:
        k_m_note.append(f"note: {vectors.truncated}")
    created = writer and not Path(policies).exists()
    ps = open_policies(policies, st, setting.layout, init, opts["seed"], keep=keep, writer=writer)
    chunks = ([repeat_passes(s, passes) for s in c] for c in
              log_chunks(st, log_path, setting.layout, users_per_chunk, grouped=grouped, known=known,
                         skip_invalid=skip_invalid, users=users, vectors=vectors))   # checked by scan_log
    options = online_options(opts, given, **{"--init": init, "--clip": clip, "--passes": passes,
                                      "--skip-invalid": skip_invalid, "--relearn": relearn, "--users": users,
                                      "--users-per-chunk": users_per_chunk, "--checkpoint-every": checkpoint_every})
    inputs = {"STORE": file_digest(store), "--log": file_digest(log_path), "config": config_dict(setting)}
    with saving_run("replay", policies, ps, st, ls, init, opts["seed"], created=created, writer=writer,
                    options=options, inputs=inputs, resume=resume, checkpoint_every=checkpoint_every,
                    restart_same=("--log",), paths={"STORE": store, "--log": log_path}) as (rs, start):
        with as_options("relearn"):
            learned = check_learned(calls, ps, log_path, before=start.before, relearn=relearn,
                                    questions=st, skip_changed=skip_invalid) if calls else None
        for line in k_m_note:      # after the last check of the log's calls: bad input is one line
            info(line)
        note_setting(ls, given, policies)
        # every night's --json has log.calls: a run that starts afresh learns every valid record
        rep["calls"] = note_learned(learned if learned is not None else LearnedCheck(replayed, 0, 0), relearn)
        note = continue_note(ps, start, user_ids, afresh=init if afresh and rs_fresh(rs) else None,
                             created=created) if writer else None
        result = None
        if learned is None or learned.learn:
            result = run_and_save(chunks, n_users, make_run(*setting), start, ps, rs, seed=opts["seed"],
                                  users_per_chunk=users_per_chunk, checkpoint_every=checkpoint_every,
                                  desc="replay", mesh=mesh, writer=writer, relearn=relearn, questions=st,
                                  simulated=learned.simulated if learned is not None else None,
                                  skip_changed=skip_invalid)
    if note:
        note.say()
    if untimed:
        who = f"user {untimed[0]!r} has" if len(untimed) == 1 else f"{len(untimed)} users (first: {untimed[0]!r}) have"
        info(f"{who} more than {WINDOW} calls without a timestamp replay can order (a number of seconds or ISO "
             f"8601; free text is none) in this log: a policy remembers its last {WINDOW} calls and recognises "
             "older ones by their timestamps, so a replay of this log after this one learns their earlier calls "
             "again (and this one did, if the log was replayed before); give each call such a timestamp "
             "(`rmm-jax rerank` writes one on every call it serves without one)", must_read=True)
    note_read(scan.read)                         # invalid records skipped; unknown keys that look misspelt
    plotted = bool(plot_path and writer and result is not None)
    if plotted:
        save_plot(result, setting, plot_path, "replay")
    elif plot_path and writer:
        info(f"no plot: nothing was learned, so --plot {plot_path} was not written", must_read=True)
    report(result, setting, {"policies": str(policies), "init": init, "setting": setting_report(ls),
                             "log": {"path": str(log_path), **rep}, "plot": str(plot_path) if plotted else None},
           as_json)
