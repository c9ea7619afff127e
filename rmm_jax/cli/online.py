"""What ``simulate`` and ``replay`` share: the policy store they write, the event loop
that saves, logs and checkpoints, and the report."""
from __future__ import annotations

import contextlib
from pathlib import Path

import click
import jax

from rmm_jax.cli.common import check_rank, config_dict, emit_json, progress_bar
from rmm_jax.cli.signals import StopSignals
from rmm_jax.core.reranker import init_reranker
from rmm_jax.core.scope import Scope
from rmm_jax.errors import InputError
from rmm_jax.online.driver import drive
from rmm_jax.online.run import Recorder
from rmm_jax.online.sinks import LogSink, PolicySink, RunStateSink, resume_point
from rmm_jax.persist.policy_store import PolicyStore

INITS = ("identity", "pretrained")  # every user's starting policy: the base retriever, or the store's shared params


def stored_scope(path, scope: str | None, rank: int | None) -> tuple[str | None, int | None]:
    """``--scope``/``--rank`` as given, or, when not given, as the existing store at ``path`` records."""
    p = Path(path)
    if scope is not None or not p.exists():
        return scope, rank
    held = Scope.from_meta(PolicyStore.open(p).meta)
    return held.name, rank if rank is not None else held.rank


def check_scope(ps, layout, path) -> None:
    """A store holds policies of one scope (and rank); another is refused before any work."""
    bad = layout.scope.mismatch(Scope.from_meta(ps.meta))
    if bad:
        raise InputError(f"policy store {path} {bad[1]}", where=bad[0])


def open_or_create_policies(path, st, layout, init: str, seed: int, *, writer: bool = True):
    """The policy store at ``path`` (created with identity shared params if absent) and the
    starting params (``pretrained``: the store's shared params). In scopes ``shared`` and
    ``hybrid`` these are the shared part, which online runs update after every users chunk,
    so ``pretrained`` continues from the newest shared part. A process that is not the
    writer (``jax.process_index() > 0``) gets ``(None, params)`` and creates nothing."""
    check_rank(layout, st.dim)
    p = Path(path)
    identity = lambda: init_reranker(jax.random.key(seed), st.dim, layout.kind, layout.hidden)
    if not writer:
        if init == "identity":
            return None, identity()
        return None, PolicyStore.open(p, expect_dim=st.dim).shared_state().state.params
    if p.exists():
        ps = PolicyStore.open(p, expect_dim=st.dim)
        made_for = (ps.meta.get("config") or {}).get("model")
        if made_for and made_for != st.model:  # same dim, another embedding space
            raise InputError(f"policy store was made for embedding model {made_for!r}, STORE uses {st.model!r}",
                             where=f"--policies {path}")
    else:
        if init == "pretrained":
            raise InputError("does not exist; run `rmm-jax pretrain` first or use --init identity",
                             where=f"--policies {path}")
        meta = {"kind": layout.kind, "dim": st.dim, "hidden": layout.hidden, **layout.scope.meta(),
                "config": {"pretrained": False, "model": st.model}}
        ps = PolicyStore.create(p, meta, identity())
    check_scope(ps, layout, path)
    if ps.meta.get("kind") != layout.kind:
        raise InputError(f"policy store holds '{ps.meta.get('kind')}' rerankers, not '{layout.kind}'", where="--kind")
    if init == "pretrained":
        if not ps.meta.get("config", {}).get("pretrained"):
            raise InputError("holds no pretrained parameters; run `rmm-jax pretrain` or use --init identity",
                             where=f"--policies {path}")
        return ps, ps.shared_state().state.params
    return ps, identity()


def run_and_save(chunks, n_users: int, program, params, ps, rs, *, seed: int, users_per_chunk: int,
                 checkpoint_every: int, log=None, desc: str, mesh=None):
    """Drive ``chunks`` through ``program`` and keep what each event carries: policies to
    ``ps``, log records to ``log`` (simulate), checkpoints and finished outputs to the
    run-state ``rs`` (:mod:`rmm_jax.online.sinks`); a progress bar on stderr. After a
    checkpoint that follows SIGINT/SIGTERM the run stops. Under ``jax.distributed`` every
    process runs this loop and only process 0 (``ps`` and ``rs`` given) writes. Returns
    the :class:`rmm_jax.online.run.OnlineResult` (summaries only)."""
    sinks = ([PolicySink(ps, program)] if ps is not None else []) \
        + ([LogSink(log)] if log is not None and ps is not None else []) \
        + ([RunStateSink(rs)] if rs is not None else [])
    recorder = Recorder(program.layout.m, sinks=sinks)
    events = drive(chunks, program, params, seed=seed, users_per_chunk=users_per_chunk,
                   segment_batches=checkpoint_every or None, resume=resume_point(rs), mesh=mesh)
    with ps.writer() if ps is not None else contextlib.nullcontext(), StopSignals() as stop, \
            progress_bar(n_users, desc) as bar:
        for event in events:
            bar.update(recorder.feed(event))
            stop.check()
    return recorder.result()


def online_options(opts: dict, **more) -> dict:
    """The options of an online run, by option name, for the run-state fingerprint."""
    return {**{f"--{k.replace('_', '-')}": v for k, v in opts.items()}, **more}


def report(result, setting, extra, as_json):
    summary, base, m = result.summary, result.base, setting.layout.m
    out = {**extra, "config": config_dict(setting),
           "base": {k: base[k] for k in (f"recall@{m}", f"ndcg@{m}", "queries")},
           "online": {k: v for k, v in summary.items() if k != "curve"}, "curve": summary["curve"]}
    if as_json:
        emit_json(out)
        return
    click.echo(f"{'user':>12}  {'queries':>7}  {'base R@' + str(m):>9}  {'online R@' + str(m):>10}  {'delta':>7}")
    for uid, row in summary["per_user"].items():
        b = base["per_user"][uid][f"recall@{m}"]
        o = row[f"recall@{m}"]
        if o is None:
            continue
        click.echo(f"{uid:>12}  {row['queries']:>7}  {b:>9.4f}  {o:>10.4f}  {o - b:>+7.4f}")
    b, o = base[f"recall@{m}"], summary[f"recall@{m}"]
    click.echo(f"{'overall':>12}  {summary['queries']:>7}  {b:>9.4f}  {o:>10.4f}  {o - b:>+7.4f}")
    click.echo(f"(prequential Recall@{m}: each query scored before any update that uses it)")
