"""The ranking metrics of rmm_jax.core.metrics against an independent IR evaluator.

``ir-measures`` (MacAvaney et al., ECIR 2022) computes R@k, nDCG@k and RR with
``pytrec_eval``, the Python binding of NIST's trec_eval: a C implementation written
independently of ours. Random runs with distinct scores (trec_eval breaks ties by doc
id), gold sets that include documents the run never retrieved (so recall's denominator
is the whole gold set), and cut-offs shorter and longer than the list.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_f32_close, f32_error

from rmm_jax.core import metrics

ir_measures = pytest.importorskip("ir_measures")
from ir_measures import RR, Qrel, R, ScoredDoc, nDCG  # noqa: E402

CUTOFFS = (1, 3, 5, 10, 20, 25)


def random_runs(seed: int, n_queries: int = 40, length: int = 20, n_docs: int = 60):
    """(rel (Q, L) bool in rank order, num_gold (Q,), qrels, run) for random queries."""
    rng = np.random.default_rng(seed)
    rel = np.zeros((n_queries, length), bool)
    num_gold = np.zeros(n_queries, np.int64)
    qrels, run = [], []
    for i in range(n_queries):
        qid = f"q{i}"
        docs = rng.permutation(n_docs)
        ranked = docs[:length]
        scores = np.sort(rng.uniform(0, 1, length))[::-1] + np.arange(length)[::-1] * 1e-3  # distinct, descending
        gold = set(rng.choice(n_docs, size=int(rng.integers(1, 8)), replace=False).tolist())
        if i % 5 == 0:  # some queries retrieve none of their gold
            gold = set(docs[length:length + 3].tolist())
        num_gold[i] = len(gold)
        rel[i] = [d in gold for d in ranked]
        qrels += [Qrel(qid, f"d{d}", 1) for d in sorted(gold)]
        run += [ScoredDoc(qid, f"d{d}", float(s)) for d, s in zip(ranked, scores)]
    return rel, num_gold, qrels, run


def reference(qrels, run, measures) -> dict:
    out: dict = {}
    for m in ir_measures.iter_calc(measures, qrels, run):
        out.setdefault(str(m.measure), {})[m.query_id] = m.value
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recall_ndcg_mrr_match_trec_eval(seed):
    rel, num_gold, qrels, run = random_runs(seed)
    measures = [R @ k for k in CUTOFFS] + [nDCG @ k for k in CUTOFFS] + [RR]
    ref = reference(qrels, run, measures)
    qids = [f"q{i}" for i in range(rel.shape[0])]
    assert rel.any() and (~rel.any(1)).any()  # both kinds of query are present
    # ours are float32, trec_eval's float64: within our float32 bounds
    for k in CUTOFFS:
        for f, measure in ((metrics.recall_at_k, R @ k), (metrics.ndcg_at_k, nDCG @ k)):
            assert_f32_close(f(rel, num_gold, k), [ref[str(measure)][q] for q in qids],
                             f32_error(lambda r, g: f(r, g, k), rel, num_gold), err_msg=str(measure))
    assert_f32_close(metrics.mrr(rel), [ref[str(RR)][q] for q in qids], f32_error(metrics.mrr, rel))


def test_the_crosscheck_can_fail():
    """The comparison discriminates: a recall with the wrong denominator (retrieved gold
    only) disagrees with trec_eval on the queries whose gold was partly missed."""
    rel, num_gold, qrels, run = random_runs(3)
    ref = reference(qrels, run, [R @ 10])
    wrong = np.asarray(metrics.recall_at_k(rel, np.maximum(rel.sum(1), 1), 10))
    got = np.array([ref[str(R @ 10)][f"q{i}"] for i in range(rel.shape[0])])
    assert np.abs(wrong - got).max() > 0.1
