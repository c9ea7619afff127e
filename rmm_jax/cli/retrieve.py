"""``rmm-jax retrieve``: quality of the fixed dense retriever on an embedding store."""
from __future__ import annotations

import time

import click

from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import IntRange, as_options, count, emit_json, info, json_option, quiet_option
from rmm_jax.core.config import Layout
from rmm_jax.data.retrieval import evaluate_store
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError


def _fmt(v) -> str:
    return "     -" if v is None else f"{v:6.3f}"


def _table(title: str, rows: dict, names: list[str]) -> list[str]:
    width = max([len(title)] + [len(str(r)) for r in rows])
    head = f"{title:<{width}}  {'n':>5}  " + "  ".join(f"{n:>{max(6, len(n))}}" for n in names)
    lines = [head, "-" * len(head)]
    for label, m in rows.items():
        lines.append(f"{label:<{width}}  {m['n']:>5}  " + "  ".join(
            f"{_fmt(m[n]):>{max(6, len(n))}}" for n in names))
    return lines


@cli.command()
@click.argument("store", type=click.Path())
@click.option("--k", "k", type=IntRange(min=1), default=Layout().k,
              help="Memories retrieved per question (the list every metric is cut at).")
@click.option("--pad-short-banks", is_flag=True,
              help="Allow users with fewer than k memories (their lists are shorter) "
                   "instead of failing.")
@click.option("--expect-model", default=None,
              help="Fail unless the store was embedded with this model id.")
@quiet_option
@json_option("the metrics", "store, model, granularity, k, metrics (their names), overall, per_user, "
             "per_category, counts, seconds")
def retrieve(store, k, pad_short_banks, expect_model, as_json):
    """Evaluate the base dense retriever on an embedding STORE.

    Every question retrieves its top-k memories by dot product (exact, in JAX). Reported
    per user, per category and overall: Recall@5/10/20 (those <= k, plus @k), Recall_all@k
    (every gold memory found), NDCG@10 and MRR. Means are over the valid questions: at
    least one gold memory and not an abstention question.

    \b
    Examples:
      rmm-jax retrieve stores/synthetic --k 20
      rmm-jax retrieve stores/synthetic --k 20 --json
    """
    t0 = time.perf_counter()
    st = open_store(store, expect_model=expect_model)
    with as_options("k", "pad_short_banks"):      # the API names its arguments, the CLI its options
        res = evaluate_store(st, k, pad_short_banks=pad_short_banks)
    c = res["counts"]
    if c["valid_queries"] == 0:          # a table of dashes measured nothing: say why, in one line
        why = ("holds no questions" if c["queries"] == 0 else
               f"has no question with a gold memory (of its {count(c['queries'], 'question')}, "
               f"{c['abstention_queries']} abstention, {c['queries_without_gold_memory']} without one)")
        raise InputError(f"{why}: nothing to measure the retriever against (a chat history's questions name "
                         "their gold_turn_ids, docs/own-data.md)", where=store)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    if as_json:
        emit_json(res, indent=None, sort_keys=False)
        return
    names = res["metrics"]
    click.echo(f"store {res['store']}: model {res['model']}, granularity {res['granularity']}, "
               f"k={k}")
    click.echo(f"{c['valid_queries']} valid questions of {c['queries']} ({c['abstention_queries']} "
               f"abstention, {c['queries_without_gold_memory']} without a gold memory), "
               f"{count(c['memories'], 'memory')}, {count(c['users'], 'user')}")
    click.echo("")
    rows = dict(res["per_user"])
    rows["overall"] = res["overall"]
    for line in _table("user", rows, names):
        click.echo(line)
    click.echo("")
    for line in _table("category", res["per_category"], names):
        click.echo(line)
    info(f"({res['seconds']:.1f}s)")
