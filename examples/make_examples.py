"""Regenerate the example data of the README's walkthrough as a production system writes it
(deterministic; about a minute the first time, less once the embedding cache holds the texts).

* ``chat_history.jsonl``: the chat histories of 12 users with an assistant, in the OpenAI
  chat shape ``rmm-jax embed jsonl:`` reads, sessions only (no questions, no gold). The
  conversations come from the built-in synthetic generator (:mod:`rmm_jax.data.synthetic`):
  persona facts (a pet, an allergy, a trip, a schedule that changes later) among small talk
  and near-miss statements about other people.
* ``requests_day1.jsonl``, ``requests_day2.jsonl``: each day's calls of the assistant, one
  new question text per line with its ``call_id`` and ``timestamp`` (each user's later
  questions, the first half on day 1, the rest on day 2). Day 2 also has a user the store
  has never seen (``newcomer``), who brings its own candidate texts.
* ``calls_day1.jsonl``, ``calls_day2.jsonl``: each day's log. The system serves every
  request with ``rmm-jax rerank --explore`` from the policies of that morning (none on day 1:
  the retriever's own scores), exactly as the README's commands do, and the application
  adds the memories its generator ``cited``: here, the shown ones that answer the question
  (the generator's judgement, which this script knows from the synthetic conversations).
  Overnight ``rmm-jax replay`` learns from the day's log. The logs hold no gold.

    python examples/make_examples.py            # writes the five files next to this script
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rmm_jax.cli.main import main as rmm_jax
from rmm_jax.data import make_synthetic
from rmm_jax.data.calls import text_id

HERE = Path(__file__).resolve().parent
USERS, SESSIONS, TURNS, SEED = 12, 10, 8, 0   # the synthetic generator's size and seed
DAYS = 2                                      # each user's questions, in order, split over two days of calls
NEWCOMER = {"call_id": "newcomer-1", "user_id": "newcomer", "query": "What is my dog called?",
            "candidate_texts": ["user: My sister moved to Lisbon.", "assistant: Congratulations on the puppy!",
                                "user: I adopted a puppy and named him Max.", "user: I am allergic to peanuts.",
                                "user: My dog hates the rain.", "assistant: What a lovely name for a cat!"]}
NEWCOMER_ANSWER = "user: I adopted a puppy and named him Max."


def conversations(users: int, sessions: int, turns: int, seed: int) -> tuple[list[dict], dict]:
    """One chat-history line per user (sessions only), and per user its questions in order,
    each ``(text, the ids of the turns that answer it)``."""
    lines, questions = [], {}
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
        lines.append({"user_id": user.id, "sessions": out})
        questions[user.id] = [(q.text, [new_id[g] for g in q.gold_turn_ids]) for q in user.queries]
    return lines, questions


def requests(questions: dict, days: int) -> list[list[dict]]:
    """Each day's requests: every user's questions in order, split over ``days``, each with
    its call id and the time it was asked; the newcomer on the last day."""
    out = [[] for _ in range(days)]
    for uid, qs in questions.items():
        for n, (text, _) in enumerate(qs):
            day = n * days // len(qs)
            out[day].append({"call_id": f"{uid}-q{n}", "user_id": uid, "query": text,
                             "timestamp": f"2023-07-{10 + day:02d}T09:{n:02d}:00"})
    out[-1].append({**NEWCOMER, "timestamp": f"2023-07-{9 + days:02d}T10:00:00"})
    return out


def answers(questions: dict) -> dict[str, set]:
    """Per call id, the memory ids that answer its question (what the generator would cite)."""
    out = {f"{uid}-q{n}": set(gold) for uid, qs in questions.items() for n, (_, gold) in enumerate(qs)}
    out[NEWCOMER["call_id"]] = {text_id(NEWCOMER_ANSWER)}
    return out


def cite(served: Path, answer: dict[str, set]) -> list[dict]:
    """The application's log: each served line with the shown memories that answer it as ``cited``."""
    out = []
    for line in served.read_text().splitlines():
        rec = json.loads(line)
        rec["cited"] = [m for m in rec["selected"] if m in answer[rec["call_id"]]]
        out.append(rec)
    return out


def run(*args) -> None:
    """One ``rmm-jax`` command, in process (what the README runs in a shell)."""
    try:
        rmm_jax([str(a) for a in args])
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE, help="Directory to write the files to.")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines, questions = conversations(USERS, SESSIONS, TURNS, SEED)
    chats = args.out / "chat_history.jsonl"
    chats.write_text("".join(json.dumps(line) + "\n" for line in lines))
    answer = answers(questions)
    with tempfile.TemporaryDirectory() as work:
        store, policies = Path(work) / "stores" / "mine", Path(work) / "policies"
        run("embed", f"jsonl:{chats}", "--out", store)
        for day, reqs in enumerate(requests(questions, DAYS), 1):
            req = args.out / f"requests_day{day}.jsonl"
            req.write_text("".join(json.dumps(r) + "\n" for r in reqs))
            served = Path(work) / f"served_day{day}.jsonl"
            run("rerank", store, "--policies", policies, "--calls", req, "--explore", "--out", served)
            log = args.out / f"calls_day{day}.jsonl"
            log.write_text("".join(json.dumps(r) + "\n" for r in cite(served, answer)))
            run("replay", store, "--log", log, "--policies", policies, *(("--scope", "hybrid") if day == 1 else ()))
            print(f"wrote {req.name} and {log.name}: {len(reqs)} calls")
    print(f"wrote {chats}")


if __name__ == "__main__":
    main()
