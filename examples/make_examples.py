"""Regenerate the example data of the README's walkthrough (deterministic, about a minute
the first time, seconds once the embedding cache holds the texts).

* ``chat_history.jsonl``: the chat histories of a few users with an assistant, in the
  OpenAI chat shape ``rmm-jax embed jsonl:`` reads, each user with questions asked later
  and the turns that answer them (``gold_turn_ids``). The conversations come from the
  built-in synthetic generator (:mod:`rmm_jax.data.synthetic`): persona facts (a pet, an
  allergy, a trip, a schedule that changes later) among small talk and near-miss
  statements about other people.
* ``calls_day1.jsonl``, ``calls_day2.jsonl``: two days of a production system's
  generator calls over those questions (each user's first questions on day 1, the rest on
  day 2). The system's reranker is the base retriever: for each question the K most
  similar turns are retrieved (MiniLM cosine), M of them are shown by a Plackett–Luce
  draw on ``cosine / TAU`` (Gumbel top-M), and the generator cites the shown turns that
  answer the question. Every record carries what ``embed log:``, ``replay`` and
  ``evaluate`` read: the query text, the candidates with their texts, the logging
  policy's ``logits`` and ``log_prob``, the citations and the gold ids.
* ``requests.jsonl``: new calls for ``rmm-jax rerank``: a known user's question with no
  candidates (the store's base retriever fetches them from the user's memories), and a
  new user's question with its own candidate texts (served by the shared part).

    python examples/make_examples.py            # writes the four files next to this script
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from rmm_jax.data import make_synthetic
from rmm_jax.data.citation_log import pl_log_prob, validate_record, write_log
from rmm_jax.data.embed import Embedder
from rmm_jax.data.jsonl import load_jsonl

HERE = Path(__file__).resolve().parent
USERS, SESSIONS, TURNS, SEED = 12, 10, 8, 0   # the synthetic generator's size and seed
K, M, TAU = 8, 3, 0.1                         # candidates, memories shown, the logging policy's temperature
DAYS = 3                                      # each user's questions, in order, split over three days of calls
REQUESTS = [  # for rmm-jax rerank: a known user's question over its memories, and a new user's own candidates
    {"call_id": "r1", "user_id": "user0", "query": "Which pet needs a sitter while I travel?"},
    {"call_id": "r2", "user_id": "user3", "query": "Can I order the seafood paella?"},
    {"call_id": "r3", "user_id": "newcomer", "query": "What is my dog called?",
     "candidate_texts": ["user: My sister moved to Lisbon.", "assistant: Congratulations on the puppy!",
                         "user: I adopted a puppy and named him Max.", "user: I am allergic to peanuts."]}]


def chat_lines(users: int, sessions: int, turns: int, seed: int) -> list[dict]:
    """One JSONL line per user: sessions of role/content messages and questions with gold."""
    lines = []
    for user in make_synthetic(users=users, sessions=sessions, turns=turns, seed=seed).users:
        new_id, out = {}, []
        for n, session in enumerate(user.sessions, 1):
            sid = f"s{n}"
            messages = []
            for i, t in enumerate(session.turns):
                new_id[t.id] = f"{sid}:{i}"
                role = "assistant" if t.speaker == "Assistant" else "user"
                messages.append({"role": role, "content": t.text.split(": ", 1)[1]})
            out.append({"session_id": sid, "timestamp": session.timestamp, "messages": messages})
        questions = [{"id": q.id, "question": q.text, "gold_turn_ids": [new_id[g] for g in q.gold_turn_ids],
                      "answer": q.answer, "category": q.category, "date": q.date} for q in user.queries]
        lines.append({"user_id": user.id, "sessions": out, "questions": questions})
    return lines


def call_logs(chats: Path, k: int, m: int, tau: float, seed: int, days: int) -> list[list]:
    """Each day's records of the production system described in the module docstring."""
    data = load_jsonl(chats)
    emb = Embedder(progress=False)
    rng = np.random.default_rng(seed)
    out = [[] for _ in range(days)]
    try:
        for user in data.users:
            turns = user.turns
            bank = emb.encode([t.text for t in turns])
            queries = emb.encode([q.text for q in user.queries])
            for n, (q, qv) in enumerate(zip(user.queries, queries)):
                cos = bank @ qv
                cand = np.argsort(-cos, kind="stable")[:k]
                logits = [round(float(cos[j]) / tau, 4) for j in cand]
                order = np.argsort(-(np.asarray(logits) + rng.gumbel(size=k)), kind="stable")[:m]
                shown = [turns[cand[p]].id for p in order]
                gold = set(q.gold_turn_ids)
                obj = {"user_id": user.id, "query_id": q.id, "query": q.text, "timestamp": q.date,
                       "candidates": [{"id": turns[j].id, "text": turns[j].text} for j in cand],
                       "selected": shown, "cited": [t for t in shown if t in gold],
                       "logits": logits, "log_prob": round(pl_log_prob(logits, [int(p) for p in order]), 6),
                       "gold": sorted(gold)}
                out[n * days // len(user.queries)].append(validate_record(obj, f"{user.id}/{q.id}"))
    finally:
        emb.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE, help="Directory to write the four files to.")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chats = args.out / "chat_history.jsonl"
    chats.write_text("".join(json.dumps(line) + "\n" for line in chat_lines(USERS, SESSIONS, TURNS, SEED)))
    for n, records in enumerate(call_logs(chats, K, M, TAU, SEED, DAYS), 1):
        print(f"wrote {write_log(args.out / f'calls_day{n}.jsonl', records)} records to calls_day{n}.jsonl")
    (args.out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    print(f"wrote {chats} and {args.out / 'requests.jsonl'}")


if __name__ == "__main__":
    main()
