"""Regenerate ``examples/calls.jsonl``: a tiny generator-call log over ``chat_history.jsonl``.

It plays a production system whose reranker is the base retriever: for each question,
the K most similar turns are retrieved (MiniLM cosine), M of them are shown by a
Plackett–Luce draw on ``cosine / TAU`` (Gumbel top-M), and the generator cites the
shown turns that hold the answer. Every record carries what ``rmm-jax embed log:`` and
``rmm-jax evaluate`` read: the query text, the candidates' texts, the behaviour's
``logits`` and ``log_prob``, the citations and, here, the gold ids.

    python examples/make_calls.py          # writes examples/calls.jsonl
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rmm_jax.data.citation_log import pl_log_prob, validate_record, write_log
from rmm_jax.data.embed import Embedder
from rmm_jax.data.jsonl import load_jsonl

HERE = Path(__file__).resolve().parent
K, M, TAU, SEED = 8, 3, 0.2, 0


def main() -> None:
    data = load_jsonl(HERE / "chat_history.jsonl")
    emb = Embedder(progress=False)
    rng = np.random.default_rng(SEED)
    records = []
    for user in data.users:
        turns = user.turns
        bank = emb.encode([t.text for t in turns])
        for n, q in enumerate(user.queries):
            cos = bank @ emb.encode([q.text])[0]
            cand = np.argsort(-cos, kind="stable")[:K]
            logits = [round(float(cos[j]) / TAU, 4) for j in cand]
            order = np.argsort(-(np.asarray(logits) + rng.gumbel(size=K)), kind="stable")[:M]
            shown = [turns[cand[p]].id for p in order]
            gold = set(q.gold_turn_ids)
            obj = {"user_id": user.id, "query_id": q.id, "query": q.text,
                   "timestamp": f"2024-06-{10 + n:02d}T12:00:00Z",
                   "candidates": [{"id": turns[j].id, "text": turns[j].text} for j in cand],
                   "selected": shown, "cited": [m for m in shown if m in gold],
                   "logits": logits, "log_prob": round(pl_log_prob(logits, [int(p) for p in order]), 6)}
            if gold:
                obj["gold"] = sorted(gold)
            records.append(validate_record(obj, f"{user.id}/{q.id}"))
    emb.close()
    n = write_log(HERE / "calls.jsonl", records)
    print(f"wrote {n} records to {HERE / 'calls.jsonl'}")


if __name__ == "__main__":
    main()
