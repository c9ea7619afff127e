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
from rmm_jax.errors import InputError
from rmm_jax.online.driver import ChunkDone, ChunkSkipped, Resume, SegmentDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.streams import log_records
from rmm_jax.online.summary import Summary, base_values
from rmm_jax.persist.policy_store import PolicyStore

INITS = ("identity", "pretrained")  # every user's starting policy: the base retriever, or the store's shared params


def scope_meta(cfg) -> dict:
    """What a policy store records about who learns from whose citations."""
    return {"scope": cfg.scope, **({"rank": cfg.rank} if cfg.scope == "hybrid" else {})}


def check_scope(ps, cfg, path) -> None:
    """A store holds policies of one scope (and rank); another is refused before any work."""
    held = {"scope": ps.meta.get("scope") or "user", "rank": ps.meta.get("rank")}
    if held["scope"] != cfg.scope:
        raise InputError(f"policy store {path} holds '{held['scope']}'-scope policies, not '{cfg.scope}' "
                         f"(use --scope {held['scope']} or a new --policies)", where="--scope")
    if cfg.scope == "hybrid" and held["rank"] != cfg.rank:
        raise InputError(f"policy store {path} holds rank-{held['rank']} residuals, not rank {cfg.rank}",
                         where="--rank")


def open_or_create_policies(path, st, cfg, init: str, seed: int, *, writer: bool = True):
    """The policy store at ``path`` (created with identity shared params if absent) and the
    starting params (``pretrained``: the store's shared params). In scopes ``shared`` and
    ``hybrid`` these are the shared part, which online runs update after every users chunk,
    so ``pretrained`` continues from the newest shared part. A process that is not the
    writer (``jax.process_index() > 0``) gets ``(None, params)`` and creates nothing."""
    check_rank(cfg, st.dim)
    p = Path(path)
    if not writer:
        if init == "identity":
            return None, init_reranker(jax.random.key(seed), st.dim, cfg.kind, cfg.hidden)
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
        meta = {"kind": cfg.kind, "dim": st.dim, "hidden": cfg.hidden, **scope_meta(cfg),
                "config": {"pretrained": False, "model": st.model}}
        ps = PolicyStore.create(p, meta, init_reranker(jax.random.key(seed), st.dim, cfg.kind, cfg.hidden))
    check_scope(ps, cfg, path)
    if ps.meta.get("kind") != cfg.kind:
        raise InputError(f"policy store holds '{ps.meta.get('kind')}' rerankers, not '{cfg.kind}'", where="--kind")
    if init == "pretrained":
        if not ps.meta.get("config", {}).get("pretrained"):
            raise InputError("holds no pretrained parameters; run `rmm-jax pretrain` or use --init identity",
                             where=f"--policies {path}")
        params = ps.shared_state().state.params
    else:
        params = init_reranker(jax.random.key(seed), st.dim, cfg.kind, cfg.hidden)
    return ps, params


def resume_point(rs) -> Resume | None:
    """The :class:`Resume` of the run-state's restored checkpoint (None: start afresh)."""
    ck = rs.restored if rs is not None else None
    if ck is None:
        return None
    m, t = ck.meta, ck.trees
    resume = Resume(m["chunks_done"], m["segments_done"], t["states"], t["outputs"], t["shared"])
    rs.notify(f"resuming from {ck.path.name}: {resume.chunks_done} users chunks done"
              + (f", users chunk {resume.chunks_done + 1} at segment {resume.segments_done}"
                 if resume.segments_done else ""))
    return resume


def checkpoint(rs, resume: Resume) -> None:
    if rs is None:
        return
    rs.save({"chunks_done": resume.chunks_done, "segments_done": resume.segments_done},
            {"states": resume.states, "outputs": resume.outputs, "shared": resume.shared})


def run_and_save(chunks, n_users: int, params, cfg, ps, rs, *, cite_fn, seed: int, users_per_chunk: int,
                 checkpoint_every: int, log=None, desc: str, mesh=None) -> tuple[dict, dict]:
    """Drive ``chunks`` through the online loop and keep what each event carries.

    Every completed users chunk: its policies go to ``ps`` (in scopes ``shared``/``hybrid``
    the shared part as a new shared version, then the users' own parts paired with it), its per-query outputs to the
    run-state ``rs`` (written once), its log records to ``log`` (simulate), then a
    checkpoint. Every ``checkpoint_every`` batches inside a chunk: a checkpoint. After a
    checkpoint that follows SIGINT/SIGTERM the run stops (:class:`Interrupted`). ``mesh``
    shards the users axis (:mod:`rmm_jax.online.sharding`); under ``jax.distributed`` every
    process runs this loop and only process 0 (``ps`` and ``rs`` given) writes.
    Returns ``(online summary, base retriever summary)``.
    """
    online, base = Summary(cfg.m), Summary(cfg.m)

    def finish(streams, outputs):
        for s in streams:
            out = outputs[s.user_id]
            base.add(s.user_id, *base_values(s, cfg.m), s.valid)
            online.add(s.user_id, out["recall"], out["ndcg"], s.valid)
        if log is not None and ps is not None:
            log.write([r for s in streams for r in log_records(s, *(outputs[s.user_id][k]
                                                                   for k in ("selected", "cited", "log_prob")))])
        bar.update(len(streams))

    events = drive(chunks, params, cfg, make_run(cfg, cite_fn), seed=seed, users_per_chunk=users_per_chunk,
                   segment_batches=checkpoint_every or None, resume=resume_point(rs), mesh=mesh)
    with ps.writer() if ps is not None else contextlib.nullcontext(), StopSignals() as stop, \
            progress_bar(n_users, desc) as bar:
        for event in events:
            match event:
                case SegmentDone():
                    checkpoint(rs, event.resume())
                case ChunkSkipped(chunk=i, streams=streams):
                    finish(streams, rs.load_done(i))
                    continue
                case ChunkDone(chunk=i, streams=streams, states=states, outputs=outputs) if ps is None:
                    finish(streams, outputs)
                case ChunkDone(chunk=i, streams=streams, states=states, outputs=outputs):
                    shared_version = ps.save_shared(event.shared, {"source": "online"}) if cfg.scope != "user" else None
                    ps.save([s.user_id for s in streams], states, [
                        {"queries_seen": int(s.queries.shape[0]), f"prequential_recall@{cfg.m}":
                         float(outputs[s.user_id]["recall"][s.valid].mean()) if s.valid.any() else None}
                        for s in streams], shared_version=shared_version)
                    finish(streams, outputs)
                    if rs is not None:
                        rs.save_done(i, outputs)
                    checkpoint(rs, event.resume())
            stop.check()
    if not online.per_user:
        raise InputError("no users to run", where="users")
    return online.result(), base.result()


def online_options(opts: dict, **more) -> dict:
    """The options of an online run, by option name, for the run-state fingerprint."""
    return {**{f"--{k.replace('_', '-')}": v for k, v in opts.items()}, **more}


def report(summary, base, cfg, extra, as_json):
    m = cfg.m
    out = {**extra, "config": config_dict(cfg), "base": {k: base[k] for k in (f"recall@{m}", f"ndcg@{m}", "queries")},
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
