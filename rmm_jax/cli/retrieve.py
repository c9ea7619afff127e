"""``rmm-jax retrieve``: quality of the fixed dense retriever on an embedding store."""
from __future__ import annotations

import time

import click
import numpy as np

from rmm_jax.cli.main import cli
from rmm_jax.cli.shell import IntRange, count, emit_json, json_option
from rmm_jax.core import metrics as M
from rmm_jax.core.config import Layout
from rmm_jax.data.retrieval import retrieve_candidates
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError


def metric_names(k: int) -> list[str]:
    """Columns reported for a cut-off ``k``: Recall@{5,10,20} up to k (and @k), all@k,
    NDCG@min(10,k), MRR."""
    cuts = sorted({c for c in (5, 10, 20) if c <= k} | {k})
    return ([f"recall@{c}" for c in cuts] + [f"recall_all@{k}", f"ndcg@{min(10, k)}", "mrr"])


def evaluate_store(store, k: int, *, pad_short_banks: bool = False) -> dict:
    """Dense retrieval of the top ``k`` memories for every question of every user.

    Returns ``{"overall", "per_user", "per_category", "counts", "k", ...}`` where each block
    maps metric names (see :func:`metric_names`) to means over the valid questions
    (>= 1 gold memory and not an abstention question) plus ``"n"``.
    """
    if not pad_short_banks:               # a user without questions retrieves nothing: its bank may be short
        for uid, n_m in store.bank_sizes.items():
            if k > n_m and store.query_count(uid):
                raise InputError(f"k={k} is larger than the memory bank of user {uid!r} "
                                 f"({n_m} memories); use a smaller --k or --pad-short-banks",
                                 where="--k")
    rels, golds, valid, users, cats = [], [], [], [], []
    n_abst = n_nogold = 0
    for u in store.iter_users():
        n_q = u.query_emb.shape[0]
        if n_q == 0:
            continue
        idx, mask = retrieve_candidates(u, k)
        rel = np.zeros((n_q, k), bool) if u.gold.shape[1] == 0 else \
            np.take_along_axis(u.gold, idx, axis=1) & mask
        rels.append(rel)
        golds.append(u.num_gold)
        valid.append(u.valid)
        users.extend([u.user_id] * n_q)
        cats.extend(c or "(none)" for c in u.categories)
        n_abst += int(u.abstention.sum())
        n_nogold += int(((u.num_gold == 0) & ~u.abstention).sum())
    names = metric_names(k)
    if rels:
        rel = np.concatenate(rels)
        ng = np.concatenate(golds)
        ok = np.concatenate(valid)
    else:
        rel, ng, ok = np.zeros((0, k), bool), np.zeros((0,), np.int32), np.zeros((0,), bool)
    per_q = {}
    for name in names:
        if name.startswith("recall_all@"):
            per_q[name] = M.recall_all_at_k(rel, ng, k)
        elif name.startswith("recall@"):
            per_q[name] = M.recall_at_k(rel, ng, int(name.split("@")[1]))
        elif name.startswith("ndcg@"):
            per_q[name] = M.ndcg_at_k(rel, ng, int(name.split("@")[1]))
        else:
            per_q[name] = M.mrr(rel)
    per_q = {n: np.asarray(v) for n, v in per_q.items()}
    s = M.summarize(per_q, ok, {"user": np.array(users, dtype=object).astype(str),
                                "category": np.array(cats, dtype=object).astype(str)})
    for uid in store.user_ids:  # users without questions still get a row
        s["per_user"].setdefault(uid, {**{n: None for n in names}, "n": 0})
    c = store.manifest["counts"]
    return {
        "store": str(store.path), "model": store.model, "granularity": store.granularity, "k": k,
        "metrics": names,
        "overall": s["overall"], "per_user": s["per_user"],
        "per_category": dict(sorted(s["per_category"].items(), key=lambda kv: _cat_key(kv[0]))),
        "counts": {"users": c["users"], "memories": c["memories"], "queries": c["queries"],
                   "valid_queries": int(ok.sum()), "abstention_queries": n_abst,
                   "queries_without_gold_memory": n_nogold},
    }


def _cat_key(c: str):
    return (0, int(c), "") if c.isdigit() else (1, 0, c)


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
               f"{c['memories']} memories, {c['users']} users")
    click.echo("")
    rows = dict(res["per_user"])
    rows["overall"] = res["overall"]
    for line in _table("user", rows, names):
        click.echo(line)
    click.echo("")
    for line in _table("category", res["per_category"], names):
        click.echo(line)
    click.echo(f"({res['seconds']:.1f}s)", err=True)
