"""What ``simulate`` and ``replay`` share: their options (``--init``, ``--keep``, ``--plot``),
opening the policy store they write with its checks and notes, the run of
:mod:`rmm_jax.online.session` with a progress bar and SIGINT/SIGTERM, and the report."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import NamedTuple

import click

from rmm_jax.cli.common import (
    DEFAULTS,
    DISTRIBUTED_OPTIONS,
    begin_run_state_if_single,
    check_rank,
    check_store_writable,
    config_dict,
    open_policies_for,
    progress_bar,
)
from rmm_jax.cli.shell import IntRange, as_options, count, emit_json, info, png_option
from rmm_jax.cli.signals import StopSignals
from rmm_jax.core.scope import Scope
from rmm_jax.errors import Diverged, InputError
from rmm_jax.online import session
from rmm_jax.online.plot import plot_learning
from rmm_jax.online.session import Start, create_policies, identity_params, learned_nothing
from rmm_jax.online.setting import SettingOptions
from rmm_jax.online.sinks import resume_note
from rmm_jax.persist.atomic import remove_dir
from rmm_jax.persist.policy_setting import write_setting
from rmm_jax.persist.policy_store import DEFAULT_KEEP, PolicyStore
from rmm_jax.persist.policy_versions import version_span
from rmm_jax.persist.runstate import RunState

INITS = tuple(sorted(session.INITS))     # continue, identity, pretrained: the choices, as --help lists them
INIT_HELP = ("Where the run starts. continue (the default when --policies exists): every user the store holds "
             "resumes from its latest good version (params, optimiser state, baseline, step, key), the shared "
             "part from the version the last saved users were trained against, and new users start from that "
             "shared part. identity: everyone starts from the base retriever; pretrained: from the store's "
             "pretrained shared params.")


def stored_scope(path, scope: str | None, rank: int | None) -> tuple[str | None, int | None]:
    """``--scope``/``--rank`` as given, or, when not given, as the existing store at ``path`` records."""
    p = Path(path)
    if scope is not None or not p.exists():
        return scope, rank
    held = Scope.from_meta(PolicyStore.open(p).meta)
    return held.name, rank if rank is not None else held.rank


def stored_kind(path, kind: str | None, hidden: int | None) -> tuple[str, int | None]:
    """The reranker's kind and the `mlp` kind's ``hidden`` width, each as given, else as the
    existing store at ``path`` records it (``simulate`` and ``replay`` have no ``--hidden``), else
    ``linear``. A run on an `mlp` store without ``--kind`` was refused ("holds 'mlp' rerankers,
    not 'linear'"), and one started afresh there (``--init identity``) built its reranker at the
    default width d and saved it beside a shared part of the store's width."""
    p = Path(path)
    meta = PolicyStore.open(p).meta_info() if p.exists() and (kind is None or (kind == "mlp" and hidden is None)) \
        else None
    kind = kind or (meta.kind if meta is not None else DEFAULTS.layout.kind)
    if hidden is None and kind == "mlp" and meta is not None and meta.kind == "mlp":
        hidden = meta.hidden
    return kind, hidden


def check_scope(ps, layout, path) -> None:
    """A store holds policies of one scope (and rank); another is refused before any work."""
    bad = layout.scope.mismatch(Scope.from_meta(ps.meta))
    if bad:
        raise InputError(f"policy store {path} {bad[1]}", where=bad[0])


def resolve_init(path, init: str | None, as_interrupted: bool = False) -> str:
    """``--init`` as given, else, ``as_interrupted``, as the interrupted run at ``path``
    resolved it (``--resume``; and ``simulate`` always, which never starts an interrupted run
    again: the same command run again after Ctrl-C resolves it the same though that run
    created the store, and is told to ``--resume``, not that its ``--init`` differs), else
    ``continue`` when the policy store exists, ``identity`` when not. (``replay`` run again
    without ``--resume`` starts its interrupted night again, continuing what it saved.)"""
    if init:
        return init
    before = RunState.interrupted_fingerprint(path) if as_interrupted else None
    if before and before.get("--init") in INITS:
        return before["--init"]
    return "continue" if Path(path).exists() else "identity"


def check_start(path, st, layout, init: str) -> None:
    """What a run refuses of its start before it writes or says anything, also on a quiet day
    (an empty log): a ``--rank`` the embedding cannot hold, ``--init pretrained`` or
    ``continue`` without a policy store at ``path``, a store of another reranker kind, and
    ``--init pretrained`` on a store that holds no pretrained parameters."""
    check_rank(layout, st.dim)
    p = Path(path)
    if not p.exists():
        if init in ("pretrained", "continue"):
            raise InputError(f"does not exist; run `rmm-jax pretrain` first or use --init identity (--init {init})",
                             where=f"--policies {path}")
        return
    meta = open_policies_for(p, st).meta_info()
    if meta.kind != layout.kind:
        raise InputError(f"policy store holds '{meta.kind}' rerankers, not '{layout.kind}'", where="--kind")
    if init == "pretrained" and not meta.pretrained:
        raise InputError("holds no pretrained parameters; run `rmm-jax pretrain` or use --init identity",
                         where=f"--policies {path}")


def open_policies(path, st, layout, init: str, seed: int, *, keep: int | None, writer: bool = True):
    """The policy store at ``path``, created (with the identity reranker as its shared part)
    when absent; checked against the run's scope, kind and embedding model (:func:`check_start`).
    A process that is not the writer (``jax.process_index() > 0``) opens but never creates
    (None if absent)."""
    check_start(path, st, layout, init)
    p = Path(path)
    if writer:
        check_store_writable(p, f"--policies {path}")
    if not p.exists():
        if not writer:
            return None
        # under the run-state lock: a run that created it meanwhile is named ("in use by pid N")
        return RunState.create_locked(p, lambda: create_policies(
            p, layout, st.dim, identity_params(st.dim, layout, seed), config={"pretrained": False, "model": st.model},
            keep=keep))
    stored_keep = PolicyStore.open(p).keep if writer and keep is not None else None
    ps = open_policies_for(p, st, keep=keep)
    check_scope(ps, layout, path)
    if stored_keep is not None and keep < stored_keep:
        info(f"note: --keep {keep} lowers the {stored_keep} versions per user {path} kept: each user's older "
             "versions are deleted as this run saves"
             + ("; `policies rollback` cannot undo this run" if keep == 1 else ""))
    elif writer and ps.keep == 1 and ps.n_users():
        info(f"note: {path} keeps 1 version per user, so this run deletes each saved user's previous one: "
             "`policies rollback` cannot undo it")
    return ps


@contextlib.contextmanager
def removed_if_unused(path, created: bool):
    """A policy store that the run ``created`` (``open_policies`` found none) is removed
    whole if the run fails (an error, out of memory, Ctrl-C) before saving
    anything in it: no user version, no shared version past the first, and a run-state
    whose checkpoints hold only the start (nothing to resume), which goes first. Left, the
    store would fix the failed run's scope and kind for every later run, and ``--init``
    would read it as a store to continue."""
    try:
        yield
    except BaseException:
        p = Path(path)
        if created and p.is_dir():
            progress = RunState.interrupted_meta(p) or {}
            try:
                unused = learned_nothing(PolicyStore.open(p))
            except Exception:  # noqa: BLE001 - an unreadable new store is not the user's data either
                unused = True
            if unused and not progress.get("chunks_done") and not progress.get("segments_done"):
                remove_dir(RunState.path_for(p))        # first: a kill between leaves the store as before
                remove_dir(p)
        raise


@contextlib.contextmanager
def saving_run(command: str, policies, ps, st, ls, init: str, seed: int, *, created: bool, writer: bool,
               options: dict, inputs: dict, resume: bool, checkpoint_every: int, restart_same: tuple[str, ...] = (),
               paths: dict | None = None):
    """What ``simulate`` and ``replay`` do around their run, in this order: a store the run
    ``created`` removed if it fails before saving (:func:`removed_if_unused`), the run-state
    locked (restored with ``--resume``; :func:`rmm_jax.cli.common.begin_run_state_if_single`),
    the run's :class:`rmm_jax.online.session.Start` planned and yielded with the run-state;
    after the body, only when it succeeds, the learning setting ``ls`` recorded in the store
    (when it is to be and this process writes) and the run-state finished. The run-state's
    notes are printed once no other writer holds the store (:meth:`PolicyStore.check_not_busy`)."""
    with (removed_if_unused(policies, created),    # entered first: it sees what the run-state leaves
          begin_run_state_if_single(policies, command, options, resume=resume, checkpoint_every=checkpoint_every,
                                    inputs=inputs, restart_same=restart_same, paths=paths, say_notes=False) as rs):
        with as_options("policies"):                    # its errors name --policies
            start = session.plan_start(ps, st, ls.setting.layout, init, seed, rs, writer=writer)
        if writer and ps is not None:   # a run refused as busy (exit 75) starts nothing and says only that;
            ps.check_not_busy()         # a probe: a hold would record --keep in a store a refused run must not change
        for note in rs.notes if rs is not None else ():     # e.g. an interrupted run started again
            info(note, must_read=True)
        if start.rolled_back is not None:
            info(rolled_back_note(policies, start.rolled_back), must_read=True)
        try:
            yield rs, start
        except Diverged:                 # its checkpoints hold non-finite states: nothing to resume
            if rs is not None:
                rs.finish()
            raise
        if ls.to_record and writer:      # after the run (a run that fails records nothing), before its end
            write_setting(ps, ls.record)
        if rs is not None:
            rs.finish()


def keep_option(f):
    """``--keep N``: versions kept per user (and the shared versions those need)."""
    return click.option("--keep", type=IntRange(min=1), default=None,
                        show_default=f"the store's; {DEFAULT_KEEP} for a new store",
                        help="Versions kept per user (what `policies rollback` can return to; lowering it deletes "
                             "older ones as the run saves); a shared version stays while a kept user version needs "
                             "it.")(f)


def plot_option(f):
    """``--plot FILE.png``: the run's prequential learning curve beside the base retriever's."""
    return png_option("Also write a PNG: the prequential learning curves (moving average of the per-call value "
                      "over the call's position in its user's stream) beside the base retriever's on the same "
                      "calls: Recall@M when calls have gold, cited-recall@M when they have citations.")(f)


def save_plot(result, setting, path, verb: str) -> None:
    """Write ``--plot``: the learning curve of ``result`` (see :func:`plot_option`)."""
    m, scope = setting.layout.m, setting.layout.scope
    plot_learning(result.summary, result.base, path, m=m, label=f"{verb}, scope {scope.name}",
                  title=f"{verb}: prequential measures of {len(result.summary['per_user'])} users")
    info(f"wrote {path}")


def rolled_back_note(policies, r) -> str:
    """The stderr line of a run that first finished the rollback ``r`` a kill had interrupted."""
    return (f"finished the interrupted rollback of {policies} to v{r.to} first: {version_span(r.versions)} forgotten, "
            "so this run continues from the versions it kept and learns the calls those forgotten ones had learned")


class StartNote(NamedTuple):
    """:func:`continue_note`'s line, and whether it is routine (``-q`` drops it): a night that
    continued its users, or new users started where ``--init`` says in a store that holds none
    of them; not a store created, users started afresh over their saved policies, or a shared
    part started again (always printed)."""
    text: str
    routine: bool = False

    def say(self) -> None:
        info(self.text, must_read=not self.routine)


def continue_note(ps, start: Start, user_ids, *, afresh: str | None = None,
                  created: bool = False) -> StartNote | None:
    """The stderr line of a run that continued a policy store: how many of its users continued
    from their saved versions (which), and where the others started; None when nobody continues.
    Made before the run saves anything, printed after it (an error stays one line). ``afresh``:
    the ``--init`` (``identity``, ``pretrained``) a fresh run was given, which starts its users
    there. A store that holds some of them says so: their new versions forget what the saved
    ones learned, which a nightly job that keeps the first night's ``--init`` would do every
    night. Otherwise the line says where they started. A store the run ``created`` says so: a
    mistyped ``--policies`` otherwise starts every user afresh without a word."""
    if ps is None:
        return None
    user_ids = list(user_ids)
    if created:
        scope = ps.meta.get("scope", "user")
        return StartNote(f"created {ps.path}: a new policy store (scope {scope}, {ps.meta['kind']} reranker); its "
                         f"{count(len(user_ids), 'user')} started from the identity reranker (the retriever's order)")
    if start.before is None:
        if not afresh:
            return None
        held = sum(bool(entries) for _, entries, _ in ps.listing(user_ids))
        if held:
            return StartNote(
                f"started {held} of {len(user_ids)} users afresh although {ps.path} holds their saved policies "
                "(--init): their new versions do not continue what those learned; leave out --init to continue them")
        source = "its pretrained reranker" if afresh == "pretrained" else "the identity reranker, the retriever's order"
        restarted = ps.scope.has_shared and bool(ps.n_users())     # its shared part as the saved users left it
        return StartNote(f"started {count(len(user_ids), 'new user')} in {ps.path} from {source} (--init {afresh})"
                         + ("; the shared part starts there too, not from the one the store's users left: leave out "
                            "--init to continue it" if restarted else ""), routine=not restarted)
    held = {}
    for u, entries, _ in ps.listing(user_ids):
        older = [e.version for e in entries if e.version < start.before]
        if older:
            held[u] = max(older)
    source = "shared part" if start.shared_version is None else f"shared version v{start.shared_version}"
    if not held:        # nobody continued: a store that holds other users, or none (a run killed before it saved)
        return StartNote(f"started {count(len(user_ids), 'new user')} in {ps.path} from the store's {source}: it holds "
                         + ("no saved user yet" if not ps.n_users() else "no saved policy of this run's users"))
    vs = sorted(set(held.values()))
    span = f" {version_span(vs)}" if vs else ""
    new = len(user_ids) - len(held)
    return StartNote(f"continued {ps.path}: {len(held)} of {len(user_ids)} users from their saved versions{span}, "
                     f"{new} new user{'s' if new != 1 else ''} from the store's {source}", routine=True)


def run_and_save(chunks, n_users: int, program, start: Start, ps, rs, *, desc: str, **kw):
    """The run of :func:`rmm_jax.online.session.open_run`, this function owning its loop: a
    progress bar of ``n_users`` on stderr (``desc``), stopped after a checkpoint that follows
    SIGINT/SIGTERM, its errors as the options that give what they are about: ``--policies``
    (saved states that do not fit), ``--log`` (a call that changed since it was learned),
    ``--resume``."""
    with StopSignals() as stop, progress_bar(n_users, desc) as bar, \
            as_options("resume", "policies", chunks="log"):
        if (note := resume_note(rs)) is not None:      # where a resumed run starts, as it starts
            info(note)
        with session.open_run(chunks, program, start, ps, rs, **kw) as run:
            for done in run:
                bar.update(done)
                stop.check()         # after the event: its policies saved, its checkpoint taken
        return run.result()


def online_options(opts: dict, given: SettingOptions, **more) -> dict:
    """The options of an online run, by option name, for the run-state fingerprint: those
    of click's ``opts`` in its order (the first that differs is the one named), the setting
    options' values as the run resolved them (``given``), the :data:`DISTRIBUTED_OPTIONS`
    left out (a run over several processes is not resumed), then ``more``."""
    return {**{f"--{k.replace('_', '-')}": getattr(given, k) if k in SettingOptions._fields else v
               for k, v in opts.items() if k not in DISTRIBUTED_OPTIONS}, **more}


def setting_report(ls) -> dict:
    """The ``setting`` of a run's JSON report: the preset, whether the store recorded a
    setting before this run, and what ``--change-setting`` changed."""
    return {"preset": ls.preset, "recorded_before": ls.recorded is not None,
            "changed": [{"field": f, "from": a, "to": b} for f, a, b in ls.changes]}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(result, setting, extra, as_json):
    """Print the run's summary: ``--json``, or a table of prequential Recall@M per user
    (when some call has gold) and one of the gold-free measures (docs/lifecycle.md,
    "Measures without gold"): each measure is left out, never printed as null, when no
    call supports it. ``result`` None: the run had nothing to learn."""
    if result is None:          # nothing to learn (every call was learned already, or is older than that)
        older = ((extra.get("log") or {}).get("calls") or {}).get("older")
        if as_json:
            emit_json({**extra, "config": config_dict(setting), "base": {}, "online": {"queries": 0, "calls": 0}})
        elif older:                 # not learned: behind the time up to which their users have learned
            rest = ", the others learned already" if (extra["log"]["calls"].get("learned_already")) else ""
            click.echo(f"nothing to learn: {count(older, 'call')} of the log older than what their users have "
                       f"learned{rest} (--relearn learns them)")
        else:
            click.echo("nothing to learn: these policies have learned from every call already")
        return
    summary, base, m = result.summary, result.base, setting.layout.m
    rec, cr = f"recall@{m}", f"cited_recall@{m}"
    curves = ("curve", "cited_curve")
    keys = (rec, f"ndcg@{m}", "queries", cr)      # the base's measures, overall and per user (the table's base)
    out = {**extra, "config": config_dict(setting),
           "base": {**{k: base[k] for k in keys if k in base},
                    "per_user": {u: {k: row[k] for k in keys if k in row} for u, row in base["per_user"].items()}},
           "online": {k: v for k, v in summary.items() if k not in curves},
           **{k: summary[k] for k in curves if k in summary}}
    if as_json:
        emit_json(out)
        return
    if rec in summary:
        sr = f"shown_recall@{m}"
        shown = f"  {'shown R@' + str(m):>9}" if sr in summary else ""
        click.echo(f"{'user':>12}  {'queries':>7}  {'base R@' + str(m):>9}  {'online R@' + str(m):>10}  {'delta':>7}"
                   + shown)
        for uid, row in summary["per_user"].items():
            if rec not in row:
                continue
            b, o = base["per_user"][uid][rec], row[rec]
            click.echo(f"{uid:>12}  {row['queries']:>7}  {b:>9.4f}  {o:>10.4f}  {o - b:>+7.4f}"
                       + (f"  {row[sr]:>9.4f}" if shown else ""))
        b, o = base[rec], summary[rec]
        click.echo(f"{'overall':>12}  {summary['queries']:>7}  {b:>9.4f}  {o:>10.4f}  {o - b:>+7.4f}"
                   + (f"  {summary[sr]:>9.4f}" if shown else ""))
        click.echo(f"(prequential Recall@{m}: each query scored before any update that uses it"
                   + (f"; shown R@{m}: the Recall of the {m} memories each call showed the generator, "
                      + ("as the log records them" if "log" in extra else "drawn by the exploring policy")
                      if shown else "") + ")")
    else:
        click.echo(f"(no call has gold memories: Recall@{m} is not measured; the measures below need none)")
    if "cite_rate" not in summary:
        return
    head = f"{'user':>12}  {'calls':>7}  {'cite rate':>9}  {'base cR@' + str(m):>10}  {'online cR@' + str(m):>11}"
    click.echo("\n" + head + f"  {'delta':>7}")
    for uid, row in summary["per_user"].items():
        if not row.get("calls"):
            continue
        b, o = base["per_user"][uid].get(cr), row.get(cr)
        click.echo(f"{uid:>12}  {row['calls']:>7}  {row['cite_rate']:>9.4f}  {_fmt(b, '>10.4f')}  "
                   f"{_fmt(o, '>11.4f')}  {_fmt(None if o is None else o - b, '>+7.4f')}")
    b, o = base.get(cr), summary.get(cr)
    click.echo(f"{'overall':>12}  {summary['calls']:>7}  {summary['cite_rate']:>9.4f}  {_fmt(b, '>10.4f')}  "
               f"{_fmt(o, '>11.4f')}  {_fmt(None if o is None else o - b, '>+7.4f')}")
    click.echo(f"(cited-recall@{m}, cR: the share of a call's cited memories in the top-{m}, before any update that "
               f"uses the call, over the {summary['calls_cited']} calls with a citation; cite rate: cited / shown)")
