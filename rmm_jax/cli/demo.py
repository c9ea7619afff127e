"""``rmm-jax demo``: the whole method end to end on the built-in synthetic users."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from rmm_jax.cli.common import check_rank, config_dict, config_options, make_setting, short_bank_note
from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import IntRange, check_writable, emit_json, info, json_option, quiet_option
from rmm_jax.data import load_spec
from rmm_jax.data.embed import Embedder
from rmm_jax.data.store import open_store, write_store
from rmm_jax.errors import InputError, worded
from rmm_jax.online.compare import compare
from rmm_jax.online.plot import plot_curves
from rmm_jax.online.pretrain import PretrainConfig
from rmm_jax.online.setting import SettingOptions
from rmm_jax.online.streams import load_streams
from rmm_jax.persist.atomic import write_json


def print_table(rows: dict, m: int, title: str) -> None:
    """Rows × (overall Recall@m, NDCG@m, delta vs base) as a plain table."""
    click.echo(title)
    base = rows["base"][f"recall@{m}"]
    click.echo(f"  {'row':<16} {'Recall@' + str(m):>9} {'NDCG@' + str(m):>8} {'vs base':>8}")
    for name, s in rows.items():
        if name.startswith("_"):
            continue
        r = s[f"recall@{m}"]
        click.echo(f"  {name:<16} {r:>9.4f} {s[f'ndcg@{m}']:>8.4f} {r - base:>+8.4f}")


def room(rows: dict, m: int) -> float:
    """What online learning after pretraining could add at most: no reranker of the retriever's
    K candidates passes the ceiling, so pretrain+online can gain at most ceiling − pretrain."""
    return rows["ceiling"][f"recall@{m}"] - rows["pretrain"][f"recall@{m}"]


def room_line(rows: dict, m: int) -> str:
    return (f"room above pretraining: {room(rows, m):.4f} Recall@{m} (ceiling minus pretrain), the most that online "
            "learning after it could add here")


#: what a demo writes in its --out: a directory holding anything else is someone's, not a demo's
DEMO_FILES = ("store", "summary.json", "learning_curve.png")


def check_demo_dir(out) -> None:
    """Refuse an ``--out`` that holds files no demo wrote (`demo --out examples` put a store,
    summary.json and learning_curve.png among the user's files, replacing a summary.json of
    theirs): a new or empty directory, or an earlier demo's, whose summary.json names its spec."""
    path = Path(out)
    if not path.is_dir():
        return
    others = sorted(p.name for p in path.iterdir() if p.name not in DEMO_FILES and not p.name.startswith("."))
    summary = path / "summary.json"
    try:
        ours = not summary.exists() or "spec" in json.loads(summary.read_text())
    except (OSError, ValueError, TypeError):
        ours = False
    if others or not ours:
        what = f"{others[0]!r}" + (f" and {len(others) - 1} more" if len(others) > 1 else "") if others else \
            "a summary.json that is not a demo's"
        raise InputError(f"holds {what}, which no demo wrote: give a new or empty directory, or an earlier demo's "
                         "--out", where=f"--out {out}")


@cli.command()
@click.option("--out", default="runs/demo", type=click.Path(file_okay=False),
              help="Working directory: the embedding store (store/, reused by a re-run), summary.json and "
                   "learning_curve.png.")
@click.option("--users", type=IntRange(min=4), default=16, help="Synthetic users (half pretrain, half online).")
@click.option("--sessions", type=IntRange(min=1), default=16, help="Sessions per user.")
@click.option("--turns", type=IntRange(min=1), default=10, help="Turns per session.")
@config_options(new_store=True)
@quiet_option
@json_option("the summary (as OUT/summary.json)", "rows (base, pretrain, online, pretrain+online, ceiling, "
             "_pretrain), room_above_pretraining (ceiling minus pretrain, Recall@M), config, spec, seconds, plot")
def demo(out, users, sessions, turns, as_json, **opts):
    """Run the whole method on built-in synthetic users: embed → pretrain → simulate.

    Synthetic users with persona facts (allergies, pets, trips, schedule changes that
    supersede earlier facts) spread over sessions; later questions need those facts.
    Half the users pretrain the shared reranker; on the other half the online loop
    runs against simulated citations. Prints base vs pretrain vs online vs both
    (prequential Recall@M), and the ceiling: the best order of the retriever's K
    candidates (every gold one first), which no reranker of them can pass; the last
    line says how much room pretraining leaves below it. Writes
    OUT/learning_curve.png and OUT/summary.json.
    Re-runs reuse the embedding store.

    \b
    Example:
      rmm-jax demo --out runs/demo
    """
    setting = make_setting(**SettingOptions.of(opts)._asdict())
    check_writable(out, f"--out {out}", depth=1)
    check_demo_dir(out)
    k, m = setting.layout.k, setting.layout.m
    t0 = time.perf_counter()
    spec = f"synthetic:users={users},sessions={sessions},turns={turns},seed={opts['seed']}"
    out = Path(out)
    store_path = out / "store"
    try:
        st = open_store(store_path)
        reuse = st.manifest.get("spec") == spec
    except InputError:
        reuse = False
    if not reuse:
        with worded({"cache_dir": "$RMM_JAX_CACHE"}):   # demo has no --cache-dir: the variable sets its root
            emb = Embedder()
        try:
            check_rank(setting.layout, emb.dim)   # a --rank the embedding cannot hold: one line, before any work
            info(f"[1/3] embedding {spec}")
            write_store(store_path, load_spec(spec), "turn", emb, spec=spec)
        finally:
            emb.close()
        st = open_store(store_path)
    else:
        check_rank(setting.layout, st.dim)
        info(f"[1/3] reusing embedding store {store_path}")
    streams = load_streams(st, k)
    short = short_bank_note(st, k)
    if short:
        info(short)
    half = len(streams) // 2
    train, evaluate = streams[:half], streams[half:]
    info(f"[2/3] pretraining on {len(train)} users; [3/3] online loop on {len(evaluate)} other users")
    rows = compare(train, evaluate, setting, PretrainConfig(m=m), seed=opts["seed"],
                        progress=lambda r: info(f"      row: {r}"))
    curves = {name: s["curve"] for name, s in rows.items() if not name.startswith("_") and name != "ceiling"}
    base_r = rows["base"][f"recall@{m}"]
    plot_curves(curves, out / "learning_curve.png",
                title=f"Prequential Recall@{m} on {len(evaluate)} held-out synthetic users (moving average)",
                ylabel=f"Recall@{m}", reference="base",
                notes={n: f"{rows[n][f'recall@{m}'] - base_r:+.3f} vs base" for n in curves if n != "base"})
    summary = {"rows": {n: {k: v for k, v in s.items() if k != "curve"} for n, s in rows.items()},
               "room_above_pretraining": room(rows, m),
               "config": config_dict(setting), "spec": spec, "seconds": round(time.perf_counter() - t0, 1),
               "plot": str(out / "learning_curve.png")}
    write_json(out / "summary.json", summary)
    if as_json:
        emit_json(summary)
    else:
        print_table(rows, m, f"Prequential Recall@{m} on {len(evaluate)} held-out synthetic users "
                             f"(K={k}, M={m}, preset {opts['preset']}):")
        click.echo(room_line(rows, m))
        click.echo(f"learning curve: {out / 'learning_curve.png'}   summary: {out / 'summary.json'}")
