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


class Summary:
    """Query-weighted overall means, per-user means and the learning curve, built one
    user at a time: memory holds one small row per user, not the per-query values."""

    def __init__(self, m: int):
        self.m, self.per_user = m, {}
        self.sum_r = self.sum_n = 0.0
        self.count = 0
        self.pos_sum, self.pos_cnt = np.zeros(0), np.zeros(0)

    def add(self, user_id: str, recall, ndcg, valid) -> None:
        """Add one user's (T,) prequential values in stream order; only ``valid`` count."""
        v = np.asarray(valid, bool)
        r, n = np.asarray(recall, np.float64)[v], np.asarray(ndcg, np.float64)[v]
        m = self.m
        self.per_user[user_id] = {f"recall@{m}": float(r.mean()) if r.size else None,
                                  f"ndcg@{m}": float(n.mean()) if n.size else None, "queries": int(r.size)}
        self.sum_r += float(r.sum())
        self.sum_n += float(n.sum())
        self.count += int(r.size)
        if r.size > self.pos_sum.size:
            grow = r.size - self.pos_sum.size
            self.pos_sum, self.pos_cnt = np.pad(self.pos_sum, (0, grow)), np.pad(self.pos_cnt, (0, grow))
        self.pos_sum[:r.size] += r
        self.pos_cnt[:r.size] += 1

    def result(self) -> dict:
        m, c = self.m, self.count
        curve = self.pos_sum / np.maximum(self.pos_cnt, 1)
        return {f"recall@{m}": self.sum_r / c if c else None, f"ndcg@{m}": self.sum_n / c if c else None,
                "queries": c, "per_user": self.per_user,
                "curve": moving_average(curve, CURVE_WINDOW).round(5).tolist()}


def base_values(s: Stream, m: int) -> tuple:
    """(Recall@m, NDCG@m) per query of the base retriever's own order."""
    rel = s.cand_gold[:, :m] & s.cand_mask[:, :m]
    return metrics.recall_at_k(rel, s.num_gold, m), metrics.ndcg_at_k(rel, s.num_gold, m)


def base_summary(streams: Sequence[Stream], m: int) -> dict:
    """The base retriever's order, evaluated like a policy (same metric, same queries)."""
    acc = Summary(m)
    for s in streams:
        acc.add(s.user_id, *base_values(s, m), s.valid)
    return acc.result()


def static_summary(streams: Sequence[Stream], params, m: int) -> dict:
    """A fixed policy (no online updates) evaluated like the online runs."""
    acc = Summary(m)
    for s in streams:
        data = {"q": s.queries, "m": s.bank[s.cand], "mask": s.cand_mask, "gold": s.cand_gold, "num_gold": s.num_gold}
        r, n = eval_per_query(params, data, m)
        acc.add(s.user_id, np.asarray(r), np.asarray(n), s.valid)
    return acc.result()
