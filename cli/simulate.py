"""``rmm-jax simulate`` and ``rmm-jax replay``: the online loop over every user."""
from __future__ import annotations

from pathlib import Path

import click
import jax

from cli.common import (config_dict, config_options, emit_json, info, make_config, open_store,
                        progress_bar)
from cli.main import cli
from rmm_jax.errors import InputError


def open_or_create_policies(path, st, cfg, init: str, seed: int):
    """The policy store at ``path`` (created with identity shared params if absent) and the
    initial params for every user (``pretrained``: the store's shared params)."""
    from rmm_jax import init_reranker
    from rmm_jax.policies import PolicyStore

    p = Path(path)
    if p.exists():
        ps = PolicyStore.open(p, expect_dim=st.dim)
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


def run_and_save(streams, params, cfg, ps, *, cite_fn_args, seed, users_per_chunk, want_log, desc):
    from rmm_jax import jobs

    bar = progress_bar(len(streams), desc)
    with ps.writer():
        save = lambda ids, states, infos: ps.save_batch(ids, states, infos)
        if cite_fn_args is None:
            res = jobs.run_online(streams, params, cfg, seed=seed, users_per_chunk=users_per_chunk,
                                  on_chunk=save, progress=bar.update)
        else:
            res = jobs.simulate(streams, params, cfg, seed=seed, users_per_chunk=users_per_chunk,
                                want_log=want_log, on_chunk=save, progress=bar.update, **cite_fn_args)
    bar.close()
    return res


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
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def simulate(store, policies, init, precision, cite_recall, users, users_per_chunk, log_out, as_json, **opts):
    """Run the online loop on STORE against simulated (oracle) citations.

    Each user's query stream runs in order: the reranker picks M of the K retrieved
    memories (Gumbel top-M), the simulated generator cites the gold ones with the given
    precision/recall, and the policy is updated by REINFORCE every --batch queries.
    Per-user policies are saved to --policies. Reported: prequential Recall@M.

    \b
    Example:
      rmm-jax simulate store --policies policies --init pretrained --log-out log.jsonl
    """
    from rmm_jax.jobs import base_summary, load_streams
    from rmm_jax.logs import validate_record, write_log

    cfg = make_config(**opts)
    if users_per_chunk < 1:
        raise InputError(f"must be >= 1, got {users_per_chunk}", where="--users-per-chunk")
    st = open_store(store)
    streams = load_streams(st, cfg.k, users.split(",") if users else None)
    ps, params = open_or_create_policies(policies, st, cfg, init, opts["seed"])
    res = run_and_save(streams, params, cfg, ps, cite_fn_args=dict(precision=precision, recall=cite_recall),
                       seed=opts["seed"], users_per_chunk=users_per_chunk, want_log=log_out is not None,
                       desc="simulate")
    if log_out:
        write_log(log_out, [validate_record(r, "<generated>") for r in res.records])
        info(f"wrote {len(res.records)} log records to {log_out}")
    report(res.summary, base_summary(streams, cfg.m), cfg, {"policies": str(policies), "init": init}, as_json)


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
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def replay(store, log_path, policies, init, clip, skip_invalid, users_per_chunk, as_json, **opts):
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

    from rmm_jax.jobs import base_summary, streams_from_log
    from rmm_jax.logs import read_log

    cfg = make_config(**opts)
    if cfg.mode == "rmm":
        raise InputError("the paper preset's log-prob needs the sampled Gumbel noise, which logs do not "
                         "record; replay with --preset default", where="--preset")
    try:
        cfg = dataclasses.replace(cfg, clip=clip)
    except ValueError as e:
        raise InputError(str(e).partition(": ")[2], where="--clip") from None
    st = open_store(store)
    known = {u: (set(st.user(u).query_ids), set(st.user(u).memory_ids)) for u in st.user_ids}
    records, rep = read_log(log_path, known=known, skip_invalid=skip_invalid)
    if rep.get("skipped"):
        info(f"skipped {rep['skipped']} invalid records of {rep['records']}; first: {rep['first_errors'][0]}")
    if not records:
        raise InputError("no valid records", where=str(log_path))
    streams = streams_from_log(st, records, cfg, str(log_path))
    ps, params = open_or_create_policies(policies, st, cfg, init, opts["seed"])
    res = run_and_save(streams, params, cfg, ps, cite_fn_args=None, seed=opts["seed"],
                       users_per_chunk=users_per_chunk, want_log=False, desc="replay")
    report(res.summary, base_summary(streams, cfg.m), cfg,
           {"policies": str(policies), "init": init, "log": {"path": str(log_path), **rep}}, as_json)
