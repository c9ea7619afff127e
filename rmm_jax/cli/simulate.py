"""``rmm-jax simulate`` and ``rmm-jax replay``: the online loop over every user."""
from __future__ import annotations

from pathlib import Path

import click
import jax

from rmm_jax.cli.common import (begin_run_state, checkpoint_options, config_dict, config_options, emit_json, info,
                        make_config, open_store, progress_bar)
from rmm_jax.cli.main import cli
from rmm_jax.errors import InputError


def open_or_create_policies(path, st, cfg, init: str, seed: int):
    """The policy store at ``path`` (created with identity shared params if absent) and the
    initial params for every user (``pretrained``: the store's shared params)."""
    from rmm_jax import init_reranker
    from rmm_jax.persist.policy_store import PolicyStore

    p = Path(path)
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
        meta = {"kind": cfg.kind, "dim": st.dim, "hidden": cfg.hidden, "config": {"pretrained": False, "model": st.model}}
        ps = PolicyStore.create(p, meta, init_reranker(jax.random.key(seed), st.dim, cfg.kind, cfg.hidden))
    if ps.meta.get("kind") != cfg.kind:
        raise InputError(f"policy store holds '{ps.meta.get('kind')}' rerankers, not '{cfg.kind}'", where="--kind")
    if init == "pretrained":
        if not ps.meta.get("config", {}).get("pretrained"):
            raise InputError("holds no pretrained parameters; run `rmm-jax pretrain` or use --init identity",
                             where=f"--policies {path}")
        params = ps.shared_params()
    else:
        params = init_reranker(jax.random.key(seed), st.dim, cfg.kind, cfg.hidden)
    return ps, params


def run_and_save(chunks, n_users, params, cfg, ps, *, cite_fn, seed, users_per_chunk, on_records, desc,
                 run_state=None, checkpoint_every=0):
    """Run ``chunks`` (an iterable of stream lists, one chunk of users in memory at a
    time) and save every chunk's policies; returns (online summary, base summary).
    With ``run_state`` the run is checkpointed and resumable (:mod:`rmm_jax.persist.runstate`)."""
    from rmm_jax.persist import runstate as checkpoint
    from rmm_jax.online import jobs

    bar = progress_bar(n_users, desc)
    try:
        with ps.writer():
            save = lambda ids, states, infos: ps.save_batch(ids, states, infos)
            kw = dict(seed=seed, cite_fn=cite_fn, users_per_chunk=users_per_chunk, on_chunk=save,
                      on_records=on_records, progress=bar.update)
            if run_state is None:
                return jobs.run_chunks(chunks, params, cfg, **kw)
            return checkpoint.run_chunks(run_state, chunks, params, cfg, segment_batches=checkpoint_every, **kw)
    finally:
        bar.close()


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


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--policies", required=True, type=click.Path(), help="Policy store (created if absent).")
@click.option("--init", "init", type=click.Choice(["pretrained", "identity"]), default="identity",
              help="Every user's starting policy: the store's pretrained shared params, or the base retriever.")
@config_options
@click.option("--precision", type=float, default=0.876, help="Simulated citation precision.")
@click.option("--recall", "cite_recall", type=float, default=0.858, help="Simulated citation recall.")
@click.option("--users", default=None, help="Comma-separated user ids (default: all).")
@click.option("--users-per-chunk", type=int, default=8, help="Users run side by side per compiled call.")
@click.option("--log-out", type=click.Path(), default=None, help="Write the generated citation log (JSONL).")
@checkpoint_options(16, "updates (batches)")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def simulate(store, policies, init, precision, cite_recall, users, users_per_chunk, log_out, checkpoint_every,
             resume, as_json, **opts):
    """Run the online loop on STORE against simulated (oracle) citations.

    Each user's query stream runs in order: the reranker picks M of the K retrieved
    memories (Gumbel top-M), the simulated generator cites the gold ones with the given
    precision/recall, and the policy is updated by REINFORCE every --batch queries.
    Per-user policies are saved to --policies. Reported: prequential Recall@M.

    \b
    Example:
      rmm-jax simulate store --policies policies --init pretrained --log-out log.jsonl
    """
    import contextlib

    from rmm_jax.online.jobs import LogAppender, oracle, store_chunks

    cfg = make_config(**opts)
    if users_per_chunk < 1:
        raise InputError(f"must be >= 1, got {users_per_chunk}", where="--users-per-chunk")
    # Rates are checked here, before any work (and progress output), not inside the run.
    if not 0.0 < precision <= 1.0:
        raise InputError(f"must be in (0, 1], got {precision}", where="--precision")
    if not 0.0 <= cite_recall <= 1.0:
        raise InputError(f"must be in [0, 1], got {cite_recall}", where="--recall")
    if log_out and Path(log_out).is_dir():
        raise InputError("is a directory, expected a JSONL file path", where=f"--log-out {log_out}")
    cite = oracle(precision, cite_recall)
    st = open_store(store)
    n_users, chunks = store_chunks(st, cfg.k, users.split(",") if users else None, users_per_chunk)
    ps, params = open_or_create_policies(policies, st, cfg, init, opts["seed"])
    from rmm_jax.persist.runstate import file_digest, tree_digest

    options = online_options(opts, **{"--init": init, "--precision": precision, "--recall": cite_recall,
                                      "--users": users, "--users-per-chunk": users_per_chunk,
                                      "--checkpoint-every": checkpoint_every})
    with begin_run_state(policies, "simulate", options, resume=resume, checkpoint_every=checkpoint_every,
                         inputs={"STORE": file_digest(store), "initial params": tree_digest(params),
                                 "config": config_dict(cfg)}) as rs:
        # The log is appended chunk by chunk to a temp file, renamed into place at the end.
        with (LogAppender(log_out) if log_out else contextlib.nullcontext()) as log:
            summary, base = run_and_save(chunks, n_users, params, cfg, ps, cite_fn=cite, seed=opts["seed"],
                                         users_per_chunk=users_per_chunk, on_records=log, desc="simulate",
                                         run_state=rs, checkpoint_every=checkpoint_every)
        rs.finish()
    if log_out:
        info(f"wrote {log.count} log records to {log_out}")
    report(summary, base, cfg, {"policies": str(policies), "init": init}, as_json)


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--log", "log_path", required=True, type=click.Path(), help="Citation log (JSONL; schema in README).")
@click.option("--policies", required=True, type=click.Path(), help="Policy store (created if absent).")
@click.option("--init", "init", type=click.Choice(["pretrained", "identity"]), default="identity",
              help="Every user's starting policy.")
@config_options
@click.option("--clip", type=float, default=5.0, help="Importance-ratio ceiling for off-policy records.")
@click.option("--skip-invalid", is_flag=True, help="Skip and count invalid records instead of failing.")
@click.option("--users-per-chunk", type=int, default=8, help="Users run side by side per compiled call.")
@checkpoint_options(16, "updates (batches)")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def replay(store, log_path, policies, init, clip, skip_invalid, users_per_chunk, checkpoint_every, resume, as_json,
           **opts):
    """Replay logged citations from a real (or simulated) generator through the learner.

    Every record's logged selection and citations drive a REINFORCE update, in log
    order per user. Where a record carries the behaviour policy's log_prob and the
    replaying policy differs, the update is importance-weighted (ratio clipped at
    --clip). Replaying a `simulate --log-out` log with the same options and seed
    reproduces its per-user policies bit for bit.

    \b
    Example:
      rmm-jax replay store --log log.jsonl --policies policies2
    """
    import dataclasses

    from rmm_jax.online.jobs import known_ids, replay_chunks, scan_log, streams_from_log
    from rmm_jax.data.citation_log import read_log

    cfg = make_config(**opts)
    if cfg.mode == "rmm":
        raise InputError("the paper preset's log-prob needs the sampled Gumbel noise, which logs do not "
                         "record; replay with --preset default", where="--preset")
    try:
        cfg = dataclasses.replace(cfg, clip=clip)
    except ValueError as e:
        raise InputError(str(e).partition(": ")[2], where="--clip") from None
    if users_per_chunk < 1:
        raise InputError(f"must be >= 1, got {users_per_chunk}", where="--users-per-chunk")
    st = open_store(store)
    if Path(policies).exists():  # fail fast on a mismatched store, before reading the log
        from rmm_jax.persist.policy_store import PolicyStore

        PolicyStore.open(policies, expect_dim=st.dim)
    known = known_ids(st)
    # Pass 1 validates the whole log (bounded memory) so that nothing is written for a
    # bad one; pass 2 streams it users_per_chunk users at a time.
    rep = scan_log(log_path, cfg, known=known, skip_invalid=skip_invalid)
    grouped, n_users = rep.pop("grouped"), rep.pop("users")
    ps, params = open_or_create_policies(policies, st, cfg, init, opts["seed"])
    if grouped:
        chunks = replay_chunks(st, log_path, cfg, users_per_chunk, known, skip_invalid)
    else:  # a user's records are spread over the log: read it whole (sort by user_id to stream)
        records, _ = read_log(log_path, known=known, skip_invalid=skip_invalid)
        streams = streams_from_log(st, records, cfg, str(log_path))
        chunks = (streams[i:i + users_per_chunk] for i in range(0, len(streams), users_per_chunk))
    from rmm_jax.persist.runstate import file_digest, tree_digest

    options = online_options(opts, **{"--init": init, "--clip": clip, "--skip-invalid": skip_invalid,
                                      "--users-per-chunk": users_per_chunk, "--checkpoint-every": checkpoint_every})
    with begin_run_state(policies, "replay", options, resume=resume, checkpoint_every=checkpoint_every,
                         inputs={"STORE": file_digest(store), "--log": file_digest(log_path),
                                 "initial params": tree_digest(params), "config": config_dict(cfg)}) as rs:
        summary, base = run_and_save(chunks, n_users, params, cfg, ps, cite_fn=None, seed=opts["seed"],
                                     users_per_chunk=users_per_chunk, on_records=None, desc="replay",
                                     run_state=rs, checkpoint_every=checkpoint_every)
        rs.finish()
    if rep.get("skipped"):
        info(f"skipped {rep['skipped']} invalid records of {rep['records'] + rep['skipped']}; "
             f"first: {rep['first_errors'][0]}")
    report(summary, base, cfg,
           {"policies": str(policies), "init": init, "log": {"path": str(log_path), **rep}}, as_json)
