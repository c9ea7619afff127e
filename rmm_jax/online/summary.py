"""Prequential summaries: query-weighted means, per-user means and the learning curve.

Every report uses prequential evaluation (see :mod:`rmm_jax.online.loop`): for each query
in stream order, the deterministic top-M of the policy *before* the update that uses the
query. The base retriever and fixed policies are evaluated the same way, on the same
queries, so the rows of a table compare like with like.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rmm_jax.core import metrics
from rmm_jax.online.pretrain import eval_per_query
from rmm_jax.online.streams import Stream

CURVE_WINDOW = 25


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (shorter window at the start)."""
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


class _Curve:
    """Per position in a user's stream: the sum and count of a per-query value."""

    def __init__(self):
        self.sum, self.cnt = np.zeros(0), np.zeros(0)

    def add(self, values, counts) -> None:
        n = len(values)
        if n > self.sum.size:
            self.sum, self.cnt = np.pad(self.sum, (0, n - self.sum.size)), np.pad(self.cnt, (0, n - self.cnt.size))
        self.sum[:n] += values
        self.cnt[:n] += counts

    def result(self) -> list:
        return moving_average(self.sum / np.maximum(self.cnt, 1), CURVE_WINDOW).round(5).tolist()


class Summary:
    """Query-weighted overall means, per-user means and the learning curves, built one
    user at a time: memory holds one small row per user, not the per-query values.

    Two families of measures (docs/lifecycle.md, "Measures without gold"):

    * with gold: Recall@M and NDCG@M of the policy's top-M, over the queries with gold
      (``queries``), and ``shown_recall@M``, the Recall of what the calls showed (drawn
      or logged, :func:`rmm_jax.online.loop.shown_recall`) when given; left out of the
      result when no query has gold;
    * without gold, from the calls' citations (:func:`rmm_jax.online.loop.cited_counts`):
      ``cited_recall@M``, the mean over calls with a citation of the share of its cited
      memories in the top-M (``calls_cited``), and ``cite_rate``, the mean over calls
      that showed memories of cited / shown (``calls``); left out when no call showed one.
    """

    def __init__(self, m: int):
        self.m, self.per_user = m, {}
        self.sum_r = self.sum_n = self.sum_cr = self.sum_rate = 0.0
        self.sum_shown = 0.0
        self.count = self.calls = self.calls_cited = self.count_shown = 0
        self.curve, self.cited_curve = _Curve(), _Curve()

    def add(self, user_id: str, recall, ndcg, valid, cited=None, shown_recall=None) -> None:
        """Add one user's (T,) prequential values in stream order; only ``valid`` count.
        ``cited``: the user's gold-free counts ``(hit, n_cited, n_shown)``, each (T,);
        ``shown_recall``: (T,) the Recall of what each call showed."""
        v = np.asarray(valid, bool)
        r, n = np.asarray(recall, np.float64)[v], np.asarray(ndcg, np.float64)[v]
        m = self.m
        row = {"queries": int(r.size)}
        if r.size:
            row.update({f"recall@{m}": float(r.mean()), f"ndcg@{m}": float(n.mean())})
        self.sum_r += float(r.sum())
        self.sum_n += float(n.sum())
        self.count += int(r.size)
        self.curve.add(r, np.ones(r.size))
        if shown_recall is not None and r.size:
            sr = np.asarray(shown_recall, np.float64)[v]
            row[f"shown_recall@{m}"] = float(sr.mean())
            self.sum_shown += float(sr.sum())
            self.count_shown += int(sr.size)
        if cited is not None:
            hit, n_cited, n_shown = (np.asarray(x, np.float64) for x in cited)
            share = np.divide(hit, n_cited, out=np.zeros_like(hit), where=n_cited > 0)
            rate = np.divide(n_cited, n_shown, out=np.zeros_like(n_cited), where=n_shown > 0)
            has, shows = n_cited > 0, n_shown > 0
            row.update(calls=int(shows.sum()), calls_cited=int(has.sum()))
            if has.any():
                row[f"cited_recall@{m}"] = float(share[has].mean())
            if shows.any():
                row["cite_rate"] = float(rate[shows].mean())
            self.sum_cr += float(share[has].sum())
            self.sum_rate += float(rate[shows].sum())
            self.calls += int(shows.sum())
            self.calls_cited += int(has.sum())
            self.cited_curve.add(share[has], np.ones(int(has.sum())))   # over calls with a citation, as the value
        self.per_user[user_id] = row

    def result(self) -> dict:
        m, c = self.m, self.count
        out = {"queries": c, "per_user": self.per_user, "curve": self.curve.result()}
        if c:
            out.update({f"recall@{m}": self.sum_r / c, f"ndcg@{m}": self.sum_n / c})
        if self.count_shown and self.count_shown == c:     # over every query, or not at all
            out[f"shown_recall@{m}"] = self.sum_shown / self.count_shown
        if self.calls:
            out.update(calls=self.calls, calls_cited=self.calls_cited, cite_rate=self.sum_rate / self.calls,
                       cited_curve=self.cited_curve.result())
        if self.calls_cited:
            out[f"cited_recall@{m}"] = self.sum_cr / self.calls_cited
        return out


def base_values(s: Stream, m: int) -> tuple:
    """(Recall@m, NDCG@m) per query of the base retriever's own order."""
    rel = s.cand_gold[:, :m] & s.cand_mask[:, :m]
    return metrics.recall_at_k(rel, s.num_gold, m), metrics.ndcg_at_k(rel, s.num_gold, m)


def ceiling_values(s: Stream, m: int) -> tuple:
    """(Recall@m, NDCG@m) per query of the best order of the K candidates: every gold
    candidate first. No reranker of the retriever's candidates does better."""
    gold = s.cand_gold & s.cand_mask
    rel = np.take_along_axis(gold, np.argsort(~gold, axis=1, kind="stable"), axis=1)[:, :m]
    return metrics.recall_at_k(rel, s.num_gold, m), metrics.ndcg_at_k(rel, s.num_gold, m)


def base_summary(streams: Sequence[Stream], m: int, values=base_values) -> dict:
    """The base retriever's order (or the order ``values`` gives, e.g.
    :func:`ceiling_values`), evaluated like a policy (same metric, same queries)."""
    acc = Summary(m)
    for s in streams:
        acc.add(s.user_id, *values(s, m), s.valid)
    return acc.result()


def static_summary(streams: Sequence[Stream], params, m: int) -> dict:
    """A fixed policy (no online updates) evaluated like the online runs."""
    acc = Summary(m)
    for s in streams:
        data = {"q": s.queries, "m": s.bank[s.cand], "mask": s.cand_mask, "gold": s.cand_gold, "num_gold": s.num_gold}
        r, n = eval_per_query(params, data, m)
        acc.add(s.user_id, np.asarray(r), np.asarray(n), s.valid)
    return acc.result()
