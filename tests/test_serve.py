"""Serving stored policies: ``Reranker`` and ``rmm-jax rerank``.

The ranking is the core scorer's deterministic top-M with the policy a load pairs (in
hybrid, the user's factors with exactly the shared version they were trained against),
every call gets one output line in input order, texts go through the embedder, and a bad
call is one error line naming file:line with nothing written.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import shutil
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FakeEmbedder, make_fake_store, run_cli
from helpers import assert_f32_close, f32_error, needs_proc_fd, open_fds, params_of, save_seeds, state_of

import rmm_jax as rj
from rmm_jax.data import embed as embed_mod
from rmm_jax.data.calls import Call
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.serve import Reranker, call_keys, load_policy, serve_calls
from rmm_jax.online.streams import user_key, user_keys
from rmm_jax.persist.policy_store import PolicyStore

SIM = ["--k", "8", "--m", "3", "--lr", "0.05", "--users-per-chunk", "2", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A store and, per scope, a policy store trained on it by two simulate runs."""
    from conftest import main
    tmp = tmp_path_factory.mktemp("serve")
    store = make_fake_store(tmp / "store", users=3, dim=16)
    pol = {}
    for scope in ("user", "hybrid"):
        pol[scope] = tmp / f"pol-{scope}"
        for again in ([], ["--relearn"]):        # the second run learns the same questions again
            main(["simulate", str(store), "--policies", str(pol[scope]), *SIM, "--scope", scope,
                  *(["--rank", "2"] if scope == "hybrid" else []), *again])
    return store, pol


def core_top(params, q, cands, m):
    s = np.asarray(rj.score(params, jnp.asarray(q), jnp.asarray(cands)))
    return np.argsort(-s, kind="stable")[:m].tolist(), s


@pytest.mark.parametrize("scope", ["user", "hybrid"])
def test_rank_is_the_paired_policys_top_m(env, scope):
    store, pol = env
    ps = PolicyStore.open(pol[scope])
    u = ps.users()[0]
    saved = ps.load(u)
    want_params = saved.state.params if scope == "user" else rj.merge_params(
        ps.shared_state(saved.shared_version).state.params, saved.state.params)
    if scope == "hybrid":              # a newer shared version exists: the pair is not the newest one
        assert saved.shared_version < ps.shared_state().version
    user = open_store(store).user(u)
    q, cands = user.query_emb[:5], user.memory_emb[:9]
    got = Reranker.open(pol[scope]).rank(u, q, cands, 3)
    for i in range(5):
        top, s = core_top(want_params, q[i], cands, 3)
        assert got.selected[i].tolist() == top
        assert_f32_close(got.scores[i], s, 2 * f32_error(rj.score, want_params, q[i], cands))   # both float32
    assert load_policy(ps, u).version == saved.version


def test_rerank_cli_writes_one_line_per_call_in_order(capsys, tmp_path, env, monkeypatch):
    store, pol = env
    st = open_store(store)
    user = st.user("user1")
    calls = [{"call_id": "a", "user_id": "user1", "query_id": user.query_ids[2]},
             {"call_id": "b", "user_id": "user1", "query_id": user.query_ids[0],
              "candidates": list(user.memory_ids[:6])},
             {"call_id": "c", "user_id": "someone-new", "query": "where is my passport",
              "candidate_texts": ["passport in the drawer", "my cat is called Tom", "flight on Monday"]},
             *({"call_id": f"r{j}", "user_id": "user1", "query_id": user.query_ids[j]} for j in (3, 4, 5))]
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16))
    code, _, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", tmp_path / "calls.jsonl",
                           "--m", "2", "--k", "8", "--out", tmp_path / "out.jsonl")
    assert code == 0, err
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["call_id"] for o in out] == ["a", "b", "c", "r3", "r4", "r5"]
    rr = Reranker.open(pol["user"])
    params = rr.policy("user1").params
    # a and r3..r5 (one user's queries, retrieved together): the base retriever's top 8 of
    # the user's memories, best first, against float64 scores within the float32 dot
    # product's bound (gamma_d * sum |q_i m_i| a side), then reranked
    mem = np.asarray(user.memory_emb, np.float64)
    row_of = {m: j for j, m in enumerate(user.memory_ids)}
    gamma = mem.shape[1] * 2.0**-24 / (1 - mem.shape[1] * 2.0**-24)
    for o, r in zip([out[0], *out[3:]], (2, 3, 4, 5)):
        q = np.asarray(user.query_emb[r], np.float64)
        exact, bound = mem @ q, gamma * (np.abs(mem) @ np.abs(q))
        got = [row_of[c] for c in o["candidates"]]
        rest = np.setdiff1d(np.arange(len(mem)), got)
        assert len(got) == 8 and (exact[got, None] + bound[got, None] + bound[rest] >= exact[rest]).all()
        assert all(exact[a] + bound[a] + bound[b] >= exact[b] for a, b in zip(got, got[1:]))      # best first
        top, _ = core_top(params, user.query_emb[r], user.memory_emb[got], 2)
        assert o["selected"] == [user.memory_ids[got[p]] for p in top] and o["positions"] == top
    # b: the listed candidates
    top, s = core_top(params, user.query_emb[0], user.memory_emb[:6], 2)
    assert out[1]["selected"] == [user.memory_ids[p] for p in top]
    # both float32, and the CLI writes scores rounded to 6 decimals
    bound = 2 * f32_error(rj.score, params, user.query_emb[0], user.memory_emb[:6])[top] + 0.5e-6
    assert_f32_close(out[1]["scores"], s[top], bound)
    assert out[1]["policy_version"] == PolicyStore.open(pol["user"]).load("user1").version
    # c: a new user, served the shared part, on embedded texts
    fake = FakeEmbedder(16)
    shared = PolicyStore.open(pol["user"]).shared_state().state.params
    top, _ = core_top(shared, fake.encode([calls[2]["query"]])[0], fake.encode(calls[2]["candidate_texts"]), 2)
    texts = calls[2]["candidate_texts"]
    assert [c["text"] for c in out[2]["candidates"]] == texts and out[2]["policy_version"] is None
    assert out[2]["selected"] == [out[2]["candidates"][p]["id"] for p in top]


def test_rerank_skip_invalid_serves_the_valid_calls_as_a_file_of_them_alone(capsys, tmp_path, env, monkeypatch):
    """One bad request (a user STORE lacks, a timestamp in the future, a line that is not JSON, a
    call repeating another's identity, an unknown memory id) failed the whole morning's file.
    With --skip-invalid each is left out and counted, and the served lines are bit for bit those
    of the file without them (drawn with --explore: each call's noise is its own); without it
    the first is still the one-line error, and nothing is written."""
    store, pol = env
    user = open_store(store).user("user1")
    good = [{"call_id": f"g{j}", "user_id": "user1", "query_id": user.query_ids[j]} for j in range(4)]
    bad = ['{"call_id": "x1", "user_id": "ghost", "query": "who am I"}',
           '{"call_id": "x2", "user_id": "user1", "query": "later", "timestamp": "2999-01-01T00:00:00Z"}',
           'not json',
           json.dumps(good[0]),
           json.dumps({"call_id": "x3", "user_id": "user1", "query": "q", "candidates": ["no-such-memory"]})]
    # x3 again, valid: the identity of a call left out is free (it was skipped as "the same call")
    again = {"call_id": "x3", "user_id": "user1", "query_id": user.query_ids[4]}
    lines = [json.dumps(good[0]), bad[0], json.dumps(good[1]), bad[1], bad[2], json.dumps(good[2]), bad[3],
             bad[4], json.dumps(again), json.dumps(good[3])]
    (tmp_path / "mixed.jsonl").write_text("".join(x + "\n" for x in lines))
    good = [*good[:3], again, good[3]]
    (tmp_path / "good.jsonl").write_text("".join(json.dumps(c) + "\n" for c in good))
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16))
    args = ("rerank", store, "--policies", pol["user"], "--m", "2", "--k", "8", "--explore")
    code, _, err = run_cli(capsys, *args, "--calls", tmp_path / "mixed.jsonl", "--out", tmp_path / "no.jsonl")
    assert code == 2 and "mixed.jsonl:4" in err and not (tmp_path / "no.jsonl").exists()   # read before resolved
    code, out, err = run_cli(capsys, *args, "--calls", tmp_path / "mixed.jsonl", "--out", tmp_path / "m.jsonl",
                             "--skip-invalid", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["calls"] == 5 and doc["skipped"] == 5 and doc["first_errors"][0].startswith(f"{tmp_path}/mixed.jsonl:2:")
    assert "skipped 5 invalid records of 10; first: " in err
    code, _, err = run_cli(capsys, *args, "--calls", tmp_path / "good.jsonl", "--out", tmp_path / "g.jsonl")
    assert code == 0, err
    strip = lambda path: [{k: v for k, v in json.loads(x).items() if k != "timestamp"}     # noqa: E731 (served at)
                          for x in path.read_text().splitlines()]
    assert strip(tmp_path / "m.jsonl") == strip(tmp_path / "g.jsonl")


def test_rerank_explore_keeps_a_served_record_of_the_same_calls(capsys, tmp_path, env, monkeypatch):
    """A morning's rerank --explore run again after the night replaced served.jsonl, what the
    generator had been shown and the application cites against, with a draw of the new
    policies, without a word (and the next replay refused the log). A run that would write
    another record of a call the file holds (another draw, here another --seed; or the file
    without the citations the application added) is refused now, one line naming --out, the file
    unchanged. The same run again writes the same records (a retried job: allowed), and another
    day's calls, or a ranking without --explore, replace the file as before."""
    store, pol = env
    user = open_store(store).user("user1")
    day = lambda js: "".join(json.dumps({"call_id": f"c{j}", "user_id": "user1", "query_id": user.query_ids[j]})
                             + "\n" for j in js)                                      # noqa: E731
    (tmp_path / "day1.jsonl").write_text(day(range(3)))
    (tmp_path / "day2.jsonl").write_text(day(range(3, 6)))
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16))
    served = tmp_path / "served.jsonl"
    args = ("rerank", store, "--policies", pol["user"], "--m", "2", "--k", "8", "--out", served)
    code, _, err = run_cli(capsys, *args, "--calls", tmp_path / "day1.jsonl", "--explore")
    assert code == 0, err
    code, _, err = run_cli(capsys, *args, "--calls", tmp_path / "day1.jsonl", "--explore")    # retried: the same
    assert code == 0, err
    records = [json.loads(x) for x in served.read_text().splitlines()]
    cited = "".join(json.dumps({**r, "cited": r["selected"][:1]}) + "\n" for r in records)
    (tmp_path / "unknown.jsonl").write_text("".join(                         # every call left out: by STORE
        json.dumps({"call_id": f"c{j}", "user_id": "user1", "query": "q", "candidates": ["no-such-memory"]}) + "\n"
        for j in range(3)))
    (tmp_path / "malformed.jsonl").write_text("".join(                       # or as it is read
        json.dumps({"call_id": f"c{j}", "user_id": "user1", "query": "q", "candidates": 5}) + "\n" for j in range(3)))
    keyed = "".join(json.dumps({**r, "latency_ms": 12}) + "\n" for r in records)      # a key of the application's
    shown = "".join(json.dumps(r) + "\n" for r in records)                     # served, nothing added yet
    # what the refusal says the file holds: what the application added to it, by name, or what the policies of
    # that time drew (it said "and what your application added" of a file nobody had added to)
    added = lambda *keys: f"what the generator was shown, and the {', '.join(keys)} your application added to it"  # noqa
    for change, calls, content, says in (
            ((), "day1", cited, added("'cited'")), (("--seed", "1"), "day1", cited, added("'cited'")),
            (("--skip-invalid",), "unknown", cited, added("'cited'")),
            (("--skip-invalid",), "malformed", cited, added("'cited'")),
            ((), "day1", keyed, added("'latency_ms'")),
            (("--seed", "1"), "day1", shown, "what the generator was shown, drawn then by the policies of that time")):
        served.write_text(content + '{"user_id": ["a list"]}\n{"truncated by a cras')   # and lines of no record
        before = served.read_bytes()
        code, _, err = run_cli(capsys, *args, "--calls", tmp_path / f"{calls}.jsonl", "--explore", *change)
        last = err.splitlines()[-1]
        # every served record carries what the application added; another draw at --seed 1 may match one record
        n = "3 calls" if content is not shown else ("2 calls", "3 calls")
        assert code == 2 and last.startswith(tuple(f"error: --out {served}: holds another record of {x}"
                                                   for x in ([n] if isinstance(n, str) else n))), err
        assert f"{says})" in last, last
        assert "Traceback" not in err and served.read_bytes() == before
    for more in (("--calls", tmp_path / "day2.jsonl", "--explore"), ("--calls", tmp_path / "day1.jsonl")):
        code, _, err = run_cli(capsys, *args, *more)
        assert code == 0, err
        assert served.read_bytes() != before
    # the file holds a plain ranking now: its positions and scores are rerank's, not the application's
    code, _, err = run_cli(capsys, *args, "--calls", tmp_path / "day1.jsonl", "--explore")
    assert code == 2 and "(line 1: a ranking of an earlier rerank without --explore)" in err, err


def test_rerank_takes_candidates_as_a_log_writes_them_and_keeps_their_ids(capsys, tmp_path, env, monkeypatch):
    """A team with its own retriever has memory ids and texts; rerank refused candidates given as
    {"id", "text"} objects, the form its own served lines (and every log) carry, so the ids became
    "t:" + sha256 of the texts. Each object is STORE's memory when STORE holds the id (its text must
    be STORE's), else its text embedded under the team's id, as replay and evaluate resolve a log:
    the served file replays, and evaluate of the identity reranker at the draw's temperature finds
    every weight 1 (the draw's vectors are the ones they read). A held id with another text, or an
    id STORE lacks given without a text, is one line naming the call."""
    from rmm_jax.core.reranker import init_reranker
    from rmm_jax.persist.policy_store import PolicyStore

    store, _ = env
    st = open_store(store)
    user = st.user("user1")
    text_of = {str(r["id"]): r["text"] for r in st.memory_rows("user1")}
    held = list(user.memory_ids[:3])
    calls = [{"call_id": "a", "user_id": "user1", "query_id": user.query_ids[0],
              "candidates": [{"id": held[0], "text": text_of[held[0]]}, held[1], held[2],
                             {"id": "crm-17", "text": "the team's own memory about a passport"},
                             {"id": "crm-18", "text": "another of its memories, about a cat"}]},
             {"call_id": "b", "user_id": "someone-new", "query": "where is my passport",
              "candidates": [{"id": "crm-1", "text": "passport in the drawer"},
                             {"id": "crm-2", "text": "my cat is called Tom"},
                             {"id": "crm-3", "text": "flight on Monday"}]}]
    req = tmp_path / "calls.jsonl"
    req.write_text("".join(json.dumps(c) + "\n" for c in calls))
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16))
    served = tmp_path / "served.jsonl"
    code, _, err = run_cli(capsys, "rerank", store, "--calls", req, "--m", 2, "--explore", "--draw-tau", 0.2,
                           "--out", served)
    assert code == 0, err
    out = [json.loads(line) for line in served.read_text().splitlines()]
    ids = [[c["id"] if isinstance(c, dict) else c for c in o["candidates"]] for o in out]
    assert ids == [[held[0], held[1], held[2], "crm-17", "crm-18"], ["crm-1", "crm-2", "crm-3"]]
    assert out[0]["candidates"][1] == held[1] and out[0]["candidates"][3]["text"].startswith("the team's own")
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({**o, "cited": o["selected"][:1]}) + "\n" for o in out))
    code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p", "-q")
    assert code == 0, err
    ident = tmp_path / "identity"
    PolicyStore.create(ident, {"kind": "linear", "dim": st.dim, "hidden": None,
                               "config": {"pretrained": False, "model": st.model}}, init_reranker(jax.random.key(0),
                                                                                                  st.dim))
    code, rep, err = run_cli(capsys, "evaluate", store, "--log", log, "--policies", ident, "--draw-tau", 0.2,
                             "--json", "--allow-unreliable", "--min-ess", 0, "--bootstrap", 40)
    assert code == 0, err
    for metric in ("cited", "cite_rate"):
        est = json.loads(rep)["estimates"][metric]["ips"]
        assert est["weight_mean"] == pytest.approx(1.0, abs=1e-3), (metric, est)   # the logits' 6 decimals
    for bad, says in ((dict(calls[0], candidates=[{"id": held[0], "text": "not the store's text"}, held[1]]),
                       f"memory {held[0]!r} of user 'user1' is given with another text than STORE's"),
                      (dict(calls[0], candidates=[held[0], "crm-99"]),
                       "unknown memory id 'crm-99' for user 'user1' (give it with its text"),
                      (dict(calls[0], candidates=[{"id": "crm-5", "text": "x"}, {"id": "crm-5", "text": "x"}]),
                       "lists a candidate twice"),
                      (dict(calls[0], candidates=[{"id": "crm-5"}]), "item 0: 'text' must be a non-empty string, "
                                                                       "got null"),
                      (dict(calls[0], candidates=[{"id": 5, "text": "x"}]), "item 0: 'id' must be a non-empty "
                                                                            "string, got a number"),
                      (dict(calls[0], candidates=[["crm-5"]]), "item 0: expected an id (a non-empty string) or an "
                                                               "{\"id\", \"text\"} object, got a list"),
                      (dict(calls[0], candidates=[]), "expected a non-empty list of ids (or {\"id\", \"text\"} "
                                                      "objects), got an empty list")):
        req.write_text(json.dumps(bad) + "\n")
        code, stdout, err = run_cli(capsys, "rerank", store, "--calls", req, "--m", 2, "--out", tmp_path / "x.jsonl")
        assert (code, stdout) == (2, "") and says in err and err.count("\n") == 1, err
        assert f"{req}:1: key 'candidates'" in err and not (tmp_path / "x.jsonl").exists()
    # one id with two texts in one file: its served lines would be refused as a log
    req.write_text(json.dumps(calls[0]) + "\n" + json.dumps(dict(calls[0], call_id="a2", candidates=[
        {"id": "crm-17", "text": "a third text"}, held[1]])) + "\n")
    code, stdout, err = run_cli(capsys, "rerank", store, "--calls", req, "--m", 2, "--out", tmp_path / "x.jsonl")
    assert (code, stdout) == (2, "") and err == (f"error: {req}:2: key 'candidates': memory 'crm-17' of user 'user1' "
                                                 "has another text than at line 1\n"), err
    # a candidate_texts call's id ("t:" + sha256) is an id like any other: given again with another text, refused
    from rmm_jax.data.calls import Call, prepare_calls, text_id
    req.write_text(json.dumps({"call_id": "t1", "user_id": "user1", "query": "q", "candidate_texts": ["X one"]})
                   + "\n" + json.dumps({"call_id": "t2", "user_id": "user1", "query": "q",
                                        "candidates": [{"id": text_id("X one"), "text": "Y two"}]}) + "\n")
    code, stdout, err = run_cli(capsys, "rerank", store, "--calls", req, "--m", 1, "--out", tmp_path / "x.jsonl")
    assert code == 2 and err.startswith(f"error: {req}:2: key 'candidates': memory {text_id('X one')!r} of user "
                                        "'user1' has another text than at line 1"), err
    # and from Python: prepare_calls checks what read_calls read (a served file replay would refuse)
    two = [Call(i, "user1", call_id=f"p{i}", query_text="q", candidates=("crm-1",), carried=(text,))
           for i, text in ((1, "text A"), (2, "text B"))]
    with pytest.raises(InputError, match=r"^calls.jsonl:2: key 'candidates': memory 'crm-1' of user 'user1' has "
                                         r"another text than at line 1$"):
        prepare_calls(st, two, "calls.jsonl", 5, 1)
    for bad, says in ((Call(1, "user1", query_text="q", carried=("t",)), "carried: needs candidates"),
                      (Call(1, "user1", query_text="q", candidates=("a", "b"), carried=("t",)),
                       "carried: expected one non-empty text \\(or None\\) for each of the 2 candidates")):
        with pytest.raises(InputError, match=rf"^calls 0: {says}"):
            prepare_calls(st, [bad], "calls.jsonl", 5, 1)


@pytest.mark.parametrize("explore", [False, True])
def test_rerank_stamps_a_call_without_a_timestamp_with_the_time_it_served_it(capsys, tmp_path, env, monkeypatch,
                                                                            explore):
    """A policy recognises a call it learned before by its timestamp once the call has left
    its window, so every served line needs one: a request's own is kept, and one without
    gets the serve time, ISO 8601 UTC that timestamp_seconds reads, the run's start plus one
    microsecond per line before it (a run's calls keep their order, whatever the users)."""
    from rmm_jax.cli import rerank as rerank_cli
    from rmm_jax.data.citation_log import timestamp_seconds, validate_record
    store, pol = env
    start = 1_714_555_800_000_000                                  # 2024-05-01T09:30:00Z
    monkeypatch.setattr(rerank_cli, "serve_clock", lambda: start)
    calls = [{"call_id": "a", "user_id": "user1", "query_id": "q0"},
             {"call_id": "b", "user_id": "user0", "query_id": "q1", "timestamp": "2023-07-10T09:00:00"},
             {"call_id": "c", "user_id": "user1", "query_id": "q1", "timestamp": None},
             {"call_id": "d", "user_id": "user0", "query_id": "q0", "timestamp": 17},
             {"call_id": "e", "user_id": "user0", "query_id": "q2"}]
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    code, _, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", tmp_path / "calls.jsonl",
                           "--m", "2", "--k", "8", "--out", tmp_path / "out.jsonl", *(["--explore"] if explore else []))
    assert code == 0, err
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["timestamp"] for o in out] == ["2024-05-01T09:30:00.000000Z", "2023-07-10T09:00:00",
                                             "2024-05-01T09:30:00.000002Z", 17, "2024-05-01T09:30:00.000004Z"]
    served = [timestamp_seconds(out[i]["timestamp"]) for i in (0, 2, 4)]
    assert served == [1_714_555_800.0, 1_714_555_800.000002, 1_714_555_800.000004]
    for o in out:
        validate_record(o, served=True)


def test_m_above_k_names_k_for_a_call_the_retriever_fills(capsys, tmp_path, env):
    """A call without candidates gets the retriever's top --k: --m above it said only "this
    call's 3 candidates", which sent the user to look at a call that lists none."""
    store, pol = env
    (tmp_path / "calls.jsonl").write_text(json.dumps({"user_id": "user0", "query_id": "q0"}) + "\n")
    code, out, err = run_cli(capsys, "rerank", store, "--calls", tmp_path / "calls.jsonl", "--k", 3, "--m", 5,
                             "--out", tmp_path / "out.jsonl")
    assert code == 2 and out == "" and not (tmp_path / "out.jsonl").exists(), err
    assert err.strip().splitlines()[-1].endswith("calls.jsonl:1: --m 5 is more than this call's 3 candidates "
                                                 "(the retriever's top --k 3)"), err


def test_rerank_out_dash_is_stdout(capsys, tmp_path, env, monkeypatch):
    """`rerank --out -` wrote a file named `-`; a user means stdout, rerank's output without
    --out: the same lines, and no file."""
    store, pol = env
    calls = tmp_path / "calls.jsonl"
    calls.write_text(json.dumps({"user_id": "user0", "query_id": "q0"}) + "\n")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    outs = []
    for more in ((), ("--out", "-")):
        code, out, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", calls, "--k", 5,
                                 "--m", 3, *more)
        assert code == 0, err
        outs.append([{k: v for k, v in json.loads(line).items() if k != "timestamp"} for line in out.splitlines()])
    assert len(outs[1]) == 1 and outs[1] == outs[0]
    assert list((tmp_path / "cwd").iterdir()) == []


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["0 bytes", "blank lines"])
def test_a_day_without_requests_serves_nothing_and_exits_0(capsys, tmp_path, env, text):
    """An empty requests file (a day without traffic, normal for a scheduled job) was
    "no records (the file is empty)", exit 2: it serves 0 calls, writes an empty --out
    (replacing the last day's, atomically) or nothing on stdout, and says why."""
    store, pol = env
    calls = tmp_path / "calls.jsonl"
    calls.write_text(text)
    out_file = tmp_path / "served.jsonl"
    out_file.write_text("yesterday\n")
    code, out, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", calls, "--explore",
                             "--out", out_file, "--json")
    assert code == 0, err
    assert out_file.read_bytes() == b"" and sorted(p.name for p in tmp_path.iterdir()) == ["calls.jsonl",
                                                                                           "served.jsonl"]
    assert json.loads(out)["calls"] == 0 and "served 0 calls (the requests file is empty)" in err
    code, out, err = run_cli(capsys, "rerank", store, "--calls", calls)
    assert (code, out) == (0, ""), err
    assert err.strip().splitlines()[-1] == "ranked 0 calls (the requests file is empty)"


def test_rerank_notes_a_k_beyond_the_users_banks_as_simulate_does(capsys, tmp_path, env):
    """rerank --k 100 on banks of fewer memories ranked every memory without a word, where
    simulate and pretrain note it (and retrieve refuses it): the same note, for the users whose
    calls the retriever fills; a call that lists its candidates is not sized by --k."""
    from rmm_jax.data.store import open_store

    store, pol = env
    sizes = open_store(store).bank_sizes
    calls = tmp_path / "calls.jsonl"
    for recs, noted in (([{"user_id": "user0", "query_id": "q0"}, {"user_id": "user1", "query_id": "q1"}], True),
                        ([{"user_id": "user0", "query_id": "q0", "candidates": ["D1:1", "D1:2", "D1:3"]}], False)):
        calls.write_text("".join(json.dumps(r) + "\n" for r in recs))
        k = max(sizes.values()) + 1
        code, _, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", calls, "--k", k,
                               "--m", 2, "--out", tmp_path / "o.jsonl")
        assert code == 0, err
        note = (f"note: --k {k} is more than the memory bank of 2 of 2 users (the largest of those holds "
                f"{max(sizes['user0'], sizes['user1'])}): their queries rank every memory they hold")
        assert (note in err.splitlines()) is noted, err


def test_rerank_names_its_draw_temperature_as_draw_tau_however_it_was_spelt(capsys, tmp_path, env):
    """rerank's --draw-tau (also spelt --tau) was refused as "--tau: must be > 0", an option the
    user may not have typed; its errors name --draw-tau."""
    store, pol = env
    calls = tmp_path / "calls.jsonl"
    calls.write_text(json.dumps({"user_id": "user0", "query_id": "q0"}) + "\n")
    for spelt in ("--draw-tau", "--tau"):
        for value, more, says in ((0, ["--explore"], "must be > 0, got 0.0"),
                                  (0.5, [], "only --explore samples; the deterministic top-M has no temperature")):
            code, out, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", calls, spelt,
                                     value, "--k", 5, "--m", 2, *more)
            assert (code, out, err) == (2, "", f"error: --draw-tau: {says}\n"), err


def test_rerank_calls_dash_reads_standard_input(capsys, tmp_path, env, monkeypatch):
    """`rerank --calls -` was "-: file not found": a pipeline that hands rerank its requests
    on stdin gets the lines it gets from the same file, and a bad line is named <stdin>:line."""
    import io

    store, pol = env
    recs = [{"user_id": "user0", "query_id": "q0", "timestamp": "2024-01-01T00:00:00"},
            {"user_id": "user1", "query_id": "q1", "call_id": "c1", "timestamp": "2024-01-01T00:00:01"}]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    calls = tmp_path / "calls.jsonl"
    calls.write_text(text)
    outs = []
    for path in (calls, "-"):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
        code, out, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", path, "--k", 5,
                                 "--m", 3, "--explore")
        assert code == 0, err
        outs.append(out)
    assert outs[1] == outs[0] and len(outs[0].splitlines()) == 2
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((text + '{"user_id": "user0"}\n').encode())))
    code, out, err = run_cli(capsys, "rerank", store, "--calls", "-")
    assert (code, out) == (2, "") and err.strip().count("\n") == 0 and "<stdin>:3: needs 'query'" in err, err


def test_a_request_without_its_query_names_a_misspelt_key_it_holds(tmp_path):
    """A request whose 'query' is misspelt ('qurey') was refused for lacking it, with no word
    of the key it holds (an optional key misspelt is noted with 'did you mean'); a key that is a
    request key ('user_id', close to 'query_id') is not taken for a misspelling."""
    from rmm_jax.data.calls import read_calls

    path = tmp_path / "calls.jsonl"
    for obj, hint in (({"user_id": "u", "qurey": "what is my job?"}, " (did you mean 'query' for 'qurey'?)"),
                      ({"user_id": "u", "querry_id": "q0"}, " (did you mean 'query_id' for 'querry_id'?)"),
                      ({"user_id": "u"}, "")):
        path.write_text(json.dumps(obj) + "\n")
        with pytest.raises(InputError) as e:
            read_calls(path)
        assert str(e.value) == f"{path}:1: needs 'query' (text) or a 'query_id' of STORE{hint}"


def test_an_empty_or_blank_request_string_is_said_to_be_so(tmp_path):
    """An empty query read "expected a non-empty string, got a string"."""
    from rmm_jax.data.calls import read_calls

    path = tmp_path / "calls.jsonl"
    for obj, key, got in (({"user_id": "u", "query": ""}, "query", "an empty string"),
                          ({"user_id": " ", "query": "q"}, "user_id", "a blank string"),
                          ({"user_id": "u", "query": "q", "candidate_texts": ["a", ""]}, "candidate_texts",
                           "an empty string"),
                          ({"user_id": "u", "query": "q", "call_id": 3}, "call_id", "a number")):
        path.write_text(json.dumps(obj) + "\n")
        with pytest.raises(InputError) as e:
            read_calls(path)
        want = "non-empty strings" if key == "candidate_texts" else "a non-empty string"
        assert str(e.value) == f"{path}:1: key {key!r}: expected {want}, got {got}"


def test_prepare_calls_names_its_arguments_to_a_python_caller(tmp_path, env):
    """prepare_calls(..., k=3, m=5) said "--m 5 ... (the retriever's top --k 3)", the options of
    rmm-jax rerank, to a Python caller who passed k and m: it names them as arguments (the CLI
    passes its options, the test above)."""
    from rmm_jax.data.calls import prepare_calls, read_calls

    store, _ = env
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps({"user_id": "user0", "query_id": "q0"}) + "\n")
    with pytest.raises(InputError) as e:
        prepare_calls(open_store(store), read_calls(path), path, 3, 5)
    assert str(e.value) == f"{path}:1: m=5 is more than this call's 3 candidates (the retriever's top k=3)"


@pytest.mark.parametrize("calls, k, m, want", [
    # one Call, not a list: an AttributeError ("'int' object has no attribute 'query_id'")
    (Call(1, "user0", query_text="hi"), 8, 3, "calls: must be a list of Call (rmm_jax.data.calls.read_calls), got "
                                                "one Call (pass [call])"),
    ((Call(1, "user0", query_text="hi") for _ in range(1)), 8, 3, "calls: must be a list of Call"),
    ([("user0", "hi")], 8, 3, "calls: must be a list of Call"),
    # a str as candidates was split into letters: "unknown memory id 's'"
    ([Call(1, "user0", query_text="hi", candidates="D1:1")], 8, 3,
     "calls 0: candidates: expected a non-empty list of strings, got str 'D1:1'"),
    ([Call(1, "user0", query_text="hi", candidate_texts="a memory")], 8, 3,
     "calls 0: candidate_texts: expected a non-empty list of strings, got str 'a memory'"),
    ([Call(1, "user0", query_text="hi", candidates=())], 8, 3, "calls 0: candidates: expected a non-empty list"),
    ([Call(1, "user0", query_text="hi", candidates=("D1:1", "D1:1"))], 8, 3, "calls 0: candidates: lists a candidate "
                                                                             "twice"),
    ([Call(1, "user0", query_text="hi", candidate_texts=("a", ""))], 8, 3, "calls 0: candidate_texts: expected "
                                                                           "non-empty strings, got str ''"),
    ([Call(1, "user0", query_text="hi", candidates=("D1:1",), candidate_texts=("a",))], 8, 3,
     "calls 0: give candidates (memory ids) or candidate_texts, not both"),
    # an empty query was embedded and served (read_calls refuses it)
    ([Call(1, "user0", query_id="q0"), Call(2, "user0", query_text="")], 8, 3,
     "calls 1: query_text: expected a non-empty string, got str ''"),
    ([Call(1, "user0", query_text="  ")], 8, 3, "calls 0: query_text: expected a non-empty string"),
    ([Call(1, "user0")], 8, 3, "calls 0: needs a query_text, or a query_id of STORE"),
    ([Call(1, 0, query_text="hi")], 8, 3, "calls 0: user_id: expected a non-empty string, got int 0"),
    ([Call(1, "user0", call_id=7, query_text="hi")], 8, 3, "calls 0: call_id: expected a non-empty string, got int 7"),
    # a text said twice was logged twice (read_calls keeps a file's repeated text once); a bad time went on the record
    ([Call(1, "user0", query_text="hi", candidate_texts=("a", "a"))], 8, 3, "calls 0: candidate_texts: lists a text "
                                                                           "twice"),
    ([Call(1, "user0", query_text="hi", timestamp=float("nan"))], 8, 3, "calls 0: key 'timestamp'"),
    ([Call(1, "user0", query_text="hi", timestamp=1735689600000)], 8, 3, "calls 0: key 'timestamp': its time "
                                                                         "1735689600000"),
    ([Call(1, "user0", query_text="hi")], "8", 3, "k: must be an int >= 1, got str '8'"),
    ([Call(1, "user0", query_text="hi")], 8, 0, "m: must be an int >= 1, got int 0"),
])
def test_prepare_calls_refuses_a_python_caller_s_bad_calls_by_name_before_any_work(env, monkeypatch, calls, k, m,
                                                                                   want):
    """A Python caller's own Calls skip read_calls' checks: one Call for a list was an
    AttributeError, a str of candidates was split into letters, an empty query was embedded
    and served. Each is one InputError naming calls (and which call and field), k or m,
    before anything is embedded."""
    from rmm_jax.data.calls import prepare_calls

    monkeypatch.setattr(embed_mod, "Embedder", lambda *a, **kw: pytest.fail("embedded before the calls were checked"))
    with pytest.raises(InputError) as e:
        prepare_calls(open_store(env[0]), calls, "request", k, m)
    assert str(e.value).startswith(want), str(e.value)


def test_prepare_calls_loads_the_embedding_model_once_per_process(tmp_path, env, monkeypatch):
    """A service calling prepare_calls per request loaded the embedding model again for every
    request with a new query text (~0.2 s each; a cached text took 2 ms): each call's Embedder
    loaded its own. Every Embedder of a model now takes the one this process loaded."""
    from rmm_jax.data.calls import Call, prepare_calls

    class Model:                                  # what SentenceTransformer gives, without torch
        def get_embedding_dimension(self):
            return 16

        def encode(self, texts, **kw):
            return FakeEmbedder(16).encode(texts)

    loads = []
    monkeypatch.setattr(embed_mod.Embedder, "_load", lambda self, load_from, given: loads.append(given) or Model())
    monkeypatch.setenv(embed_mod.CACHE_ENV, str(tmp_path / "cache"))
    st = open_store(env[0])
    for i in range(3):                            # three requests, each with a text nobody embedded
        (p,) = prepare_calls(st, [Call(1, "user0", call_id=f"c{i}", query_text=f"a new question {i}")], "request", 8, 3)
        np.testing.assert_allclose(p.query, FakeEmbedder(16).encode([f"a new question {i}"])[0], rtol=1e-6)
    assert loads == [st.model]


@pytest.mark.parametrize("line, where", [
    ({"user_id": "user0", "query_id": "q1", "candidates": ["nope"]}, "key 'candidates'"),
    ({"user_id": "user0", "query_id": "q999", "call_id": 7}, "key 'call_id'"),
    ({"user_id": "user0"}, "needs 'query'"),
    ({"user_id": "nobody", "query_id": "q0"}, "key 'user_id'"),
    # a user neither STORE nor the call covers: the line did not say a call can bring its candidates
    ({"user_id": "nobody", "query": "what is my name?"}, "key 'user_id': user 'nobody' is not in STORE"),
    ({"user_id": "nobody", "query": "what is my name?"}, "(needed for 'the retrieved candidates'); a call for a "
                                                         "user STORE lacks gives its candidates as texts in "
                                                         "'candidate_texts'"),
    ({"user_id": "nobody", "query": "what is my name?", "candidates": ["m1"]}, "(needed for 'candidates'); a call "
                                                                               "for a user STORE lacks gives its "
                                                                               "candidates as texts in "
                                                                               "'candidate_texts'"),
    # the id itself, as replay and evaluate name it: the line said only "unknown query id for user 'user0'"
    ({"user_id": "user0", "query_id": "q999"}, "key 'query_id': unknown query id 'q999' for user 'user0'"),
    ({"user_id": "user0", "query_id": "q0", "candidates": ["D1:1", "D1:1"]}, "twice"),
    # the call of line 1 again: only --explore refused it, and the ranked file was a log replay refuses
    ({"user_id": "user0", "query_id": "q0"}, "key 'query_id': the same call as line 1"),
])
def test_a_bad_call_is_one_line_naming_the_line_and_nothing_is_written(capsys, tmp_path, env, line, where):
    store, pol = env
    good = {"user_id": "user0", "query_id": "q0"}
    (tmp_path / "calls.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    code, out, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", tmp_path / "calls.jsonl",
                             "--out", tmp_path / "out.jsonl")
    assert code == 2 and not (tmp_path / "out.jsonl").exists() and out == "", (err, out)
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "calls.jsonl:2" in last and where in last, err


def test_the_cache_keeps_the_most_recently_used_users(env):
    _, pol = env
    rr = Reranker.open(pol["user"], cache_users=2)
    for u in ("user0", "user1", "user0", "user2"):
        rr.policy(u)
    assert list(rr._cache) == ["user0", "user2"]
    p0 = rr.policy("user0").params
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p0),
                                                    jax.tree.leaves(load_policy(rr.store, "user0").params)))


META8 = {"kind": "linear", "dim": 8, "hidden": None}


def policy_store(path, seeds: dict) -> PolicyStore:
    """A user-scope store (d=8) holding users ``{user: seed}`` (``state_of(seed)``) as version 1."""
    st = PolicyStore.create(path, META8, params_of(0))
    save_seeds(st, seeds)
    return st


def leaf_bytes(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_refresh_serves_a_store_deleted_and_made_again(tmp_path):
    # docs/lifecycle.md: "delete the directory to start afresh". The rebuilt store repeated the old one's newest
    # version (1), setting and rollbacks: refresh() returned False and the service kept the deleted store's policies
    path = tmp_path / "pol"
    policy_store(path, {"a": 1})
    rr = Reranker.open(path)
    assert leaf_bytes(rr.policy("a").params) == leaf_bytes(state_of(1).params)
    shutil.rmtree(path)
    policy_store(path, {"a": 2, "b": 3})
    assert rr.refresh() is True
    assert rr.policy("a").version == 1 and leaf_bytes(rr.policy("a").params) == leaf_bytes(state_of(2).params)
    assert rr.policy("b").version == 1                  # the new store's user, not the old store's shared part
    assert rr.refresh() is False


def test_a_reranker_opened_before_its_store_exists_serves_the_store_once_refresh_finds_it(tmp_path):
    # A service started before the first night served Reranker(None, dim=d) and refresh() returned False forever:
    # the store the first replay wrote was never served. Reranker.open(path, dim=d) serves the identity until then.
    path = tmp_path / "pol"
    with pytest.raises(InputError, match="no such policy store$"):
        Reranker.open(path)                             # without dim a missing store is refused, as before
    rr = Reranker.open(path, dim=8)
    q, c = np.eye(8, dtype=np.float32)[0], np.eye(8, dtype=np.float32)[:3]
    assert rr.store is None and rr.policy("a").version is None and rr.rank("a", q, c, 1).selected.tolist() == [[0]]
    assert rr.refresh() is False
    policy_store(path, {"a": 2})                        # the first night
    assert rr.refresh() is True and rr.store is not None
    assert rr.policy("a").version == 1 and leaf_bytes(rr.policy("a").params) == leaf_bytes(state_of(2).params)
    assert rr.refresh() is False
    other = tmp_path / "other"
    rr = Reranker.open(other, dim=4)
    policy_store(other, {"a": 2})
    with pytest.raises(InputError, match="policy store has dim 8, expected 4"):
        rr.refresh()
    assert rr.store is None                              # still the identity of its dim
    assert Reranker.open(path, dim=8).policy("a").version == 1      # a store that exists: served at once


def test_a_reranker_opened_on_an_empty_directory_serves_the_identity_until_the_store_is_made_in_it(tmp_path):
    # A deploy that made the store's directory first (a volume) could not start: Reranker.open(path, dim=d) refused
    # the empty directory ("not a policy store (no policy_store.json)"), though PolicyStore.create makes the store in
    # it; and a directory made after start made every refresh() raise until the first replay.
    path = tmp_path / "pol"
    path.mkdir()
    rr = Reranker.open(path, dim=8)
    q, c = np.eye(8, dtype=np.float32)[0], np.eye(8, dtype=np.float32)[:3]
    assert rr.store is None and rr.rank("a", q, c, 1).selected.tolist() == [[0]]
    assert rr.refresh() is False
    policy_store(path, {"a": 2})                        # the first night writes into the directory
    assert rr.refresh() is True and rr.policy("a").version == 1
    later = tmp_path / "later"
    rr = Reranker.open(later, dim=8)
    later.mkdir()                                       # the directory appears after the service started
    assert rr.refresh() is False and rr.store is None
    policy_store(later, {"a": 2})
    assert rr.refresh() is True and rr.policy("a").version == 1
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("")
    with pytest.raises(InputError, match="policy_store.json"):      # a directory holding something else: refused
        Reranker.open(tmp_path / "junk", dim=8)


class PausingDict(collections.OrderedDict):
    """A cache that pauses a lookup in thread ``pause_in`` that finds its user, until ``go`` is set."""
    pause_in: threading.Thread | None = None

    def get(self, key, default=None):
        got = super().get(key, default)
        if got is not None and threading.current_thread() is self.pause_in:
            self.paused.set()
            self.go.wait(0.5)          # the other thread's call runs meanwhile (unless a lock holds it)
        return got


def test_threads_sharing_a_reranker_never_see_a_user_evicted_between_lookup_and_use(tmp_path):
    # A Reranker shared by threads raised a bare KeyError (~1 run in 3 of the auditor's 8 threads): between
    # `_cache.get` and `move_to_end` another thread evicted the user. A paused lookup makes the race certain.
    policy_store(tmp_path / "pol", {"a": 1, "b": 2, "c": 3})
    rr = Reranker.open(tmp_path / "pol", cache_users=2)
    cache = rr._cache = PausingDict()
    cache.paused, cache.go = threading.Event(), threading.Event()
    rr.policy("a"), rr.policy("b")
    errors = []

    def serve_a():
        try:
            assert rr.policy("a").version == 1
        except Exception as e:          # noqa: BLE001 - the test reports it
            errors.append(e)
    t = cache.pause_in = threading.Thread(target=serve_a)
    t.start()
    assert cache.paused.wait(5)
    other = threading.Thread(target=rr.policy, args=("c",))     # evicts the least recently used user: "a"
    other.start()
    other.join(0.2)
    cache.go.set()
    t.join(5), other.join(5)
    assert errors == [] and list(rr._cache) == ["a", "c"]

    # and many threads at a tiny switch interval: every result the one a Reranker of its own gives
    rr, alone = Reranker.open(tmp_path / "pol", cache_users=2), Reranker.open(tmp_path / "pol")
    q, c = np.eye(8, dtype=np.float32)[:2], np.eye(8, dtype=np.float32)
    want = {u: alone.rank(u, q, c, 3).selected.tolist() for u in "abc"}
    wrong = []

    def work(i):
        try:
            for j in range(200):
                u = "abc"[(i + j) % 3]
                if rr.rank(u, q, c, 3).selected.tolist() != want[u]:
                    wrong.append(u)
                if j % 50 == i:
                    rr.refresh()
        except Exception as e:          # noqa: BLE001 - the test reports it
            wrong.append(repr(e))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


def test_a_refresh_during_a_load_keeps_the_old_store_s_policy_out_of_the_new_cache(tmp_path, monkeypatch):
    # A thread loading a user from the store a concurrent refresh() replaced put that (old) policy into the new
    # cache: the user was served yesterday's policy until evicted.
    import rmm_jax.online.serve as serve_mod
    st = policy_store(tmp_path / "pol", {"a": 1})
    rr = Reranker.open(tmp_path / "pol")
    loading, go = threading.Event(), threading.Event()
    real = serve_mod.load_policy

    def slow_load(*a, **kw):
        got = real(*a, **kw)
        if threading.current_thread() is not threading.main_thread():
            loading.set()
            go.wait(5)
        return got
    monkeypatch.setattr(serve_mod, "load_policy", slow_load)
    served = []
    t = threading.Thread(target=lambda: served.append(rr.policy("a").version))
    t.start()
    assert loading.wait(5)
    save_seeds(st, {"a": 5})                           # the night's version 2
    assert rr.refresh() is True
    go.set()
    t.join(5)
    assert served == [1]                               # the call began before the refresh: the old store's
    assert rr.policy("a").version == 2                 # ... but the cache holds the new store's


@pytest.mark.parametrize("explore", [False, True])
def test_a_refresh_between_a_batch_s_lookup_and_its_draw_logs_the_policy_that_drew(tmp_path, monkeypatch, explore):
    # serve_calls looked the policy up for the record (policy_version, served_by) and rank/sample looked it up again
    # for the draw: a refresh() in between (here the identity-to-store switch, then a night's new version) logged
    # "identity" (or version 1) for scores and log_prob that the store's policy (or version 2) gave.
    from rmm_jax.data.calls import Call, Prepared
    from rmm_jax.online.serve import serve_calls
    path = tmp_path / "pol"
    rr = Reranker.open(path, dim=8)
    q, c = np.eye(8, dtype=np.float32)[0], np.eye(8, dtype=np.float32)[:3] + 0.1
    calls = [Prepared(Call(1, "a", call_id="c1"), q, c, ["m1", "m2", "m3"], None)]
    real = rr._padded
    night = []

    def refreshing_padded(*a, **kw):           # the inputs are checked after the lookup: a refresh lands then
        if night:
            night.pop()()
            assert rr.refresh() is True
        return real(*a, **kw)
    monkeypatch.setattr(rr, "_padded", refreshing_padded)

    def serve(reranker):
        [[got]] = serve_calls(reranker, calls, 2, explore=explore, seed=3, tau=0.5, now=0)
        return got, (got.record.log_prob, got.record.logits) if explore else got.scores

    identity = serve(Reranker(None, dim=8))[1]
    night.append(lambda: policy_store(path, {"a": 2}))
    got, drawn = serve(rr)
    assert (got.served_by, got.record.policy_version, drawn) == ("identity", None, identity)
    version1 = serve(Reranker.open(path))[1]
    assert version1 != identity
    st = PolicyStore.open(path)
    night.append(lambda: save_seeds(st, {"a": 5}))
    got, drawn = serve(rr)
    assert (got.served_by, got.record.policy_version, drawn) == ("own_policy", 1, version1)
    got, drawn = serve(rr)                      # the next batch: the refreshed store's version
    assert got.record.policy_version == 2 and drawn == serve(Reranker.open(path))[1] != version1
    st.close()


@needs_proc_fd
def test_refresh_leaves_no_store_open_behind(tmp_path):
    # Every refresh() opened a PolicyStore (changed or not) and left the old one, its SQLite descriptor and memory,
    # to the cyclic garbage collector: "fds before 7 after 200 unchanged refresh() 207 after gc.collect() 7".
    st = policy_store(tmp_path / "pol", {"a": 1})
    rr = Reranker.open(tmp_path / "pol")
    rr.policy("a")
    gc.collect()
    gc.disable()
    try:
        before = open_fds()
        for _ in range(100):
            assert rr.refresh() is False
        assert open_fds() == before
        for seed in range(2, 12):                          # each night a new version: the store is replaced
            save_seeds(st, {"a": seed})
            assert rr.refresh() is True and rr.policy("a").version == seed
        assert open_fds() == before
    finally:
        gc.enable()


def test_non_finite_embeddings_are_refused_naming_the_argument(env):
    """NaN or inf ranked silently as positions -1; now one InputError naming the argument (and
    the query and candidate); masked padding may hold anything."""
    from rmm_jax.errors import InputError

    store, pol = env
    rr = Reranker.open(pol["user"])
    u = open_store(store).user("user0")
    q, c = np.array(u.query_emb[:2]), np.array(u.memory_emb[:5])
    bad_q = q.copy()
    bad_q[1, 3] = np.nan
    with pytest.raises(InputError, match=r"^query_emb: holds NaN or inf \(query 1\)$"):
        rr.rank("user0", bad_q, c, 2)
    bad_c = c.copy()
    bad_c[2, 0] = np.inf
    with pytest.raises(InputError, match=r"^candidate_embs: holds NaN or inf \(candidate 2\)$"):
        rr.rank("user0", q[0], bad_c, 2)
    bad_c[2] = np.nan                                       # masked: padding, not ranked
    got = rr.rank("user0", q[0], bad_c, 2, mask=np.arange(5) != 2)
    assert (got.selected >= 0).all() and 2 not in got.selected



def test_sample_of_no_queries_is_empty_as_rank_of_none_is(tmp_path):
    """Reranker.sample with n = 0 was a raw vmap size error (the keys were padded with a copy of
    the first, of which there is none), while rank returned empty arrays. Its result is a Sample
    of n = 0 rows with the shapes and dtypes a batch of n rows has, for shared and per-query
    candidates, the identity reranker and a stored policy."""
    rr_store = Reranker.open(policy_store(tmp_path / "pol", {"u": 1}).path)
    for rr in (Reranker(None, dim=8), rr_store):
        c = np.eye(5, 8) * np.arange(1, 6)[:, None]
        for cands, mask in ((c, None), (np.zeros((0, 5, 8)), np.zeros((0, 5), bool)), (c, np.ones(5, bool))):
            got = rr.sample("u", np.zeros((0, 8)), cands, 3, keys=jax.random.split(jax.random.key(0), 0), tau=0.5,
                            mask=mask)
            some = rr.sample("u", np.ones((2, 8)), np.broadcast_to(c, (2, 5, 8)), 3,
                             keys=jax.random.split(jax.random.key(0), 2), tau=0.5)
            assert [(a.shape[1:], a.dtype) for a in got] == [(a.shape[1:], a.dtype) for a in some]
            assert [a.shape[0] for a in got] == [0] * 4
            assert rr.rank("u", np.zeros((0, 8)), cands, 3, mask=mask).selected.shape == got.selected.shape


def test_a_numpy_integer_m_serves_as_the_int_and_a_bool_is_refused():
    """m=np.int64(3) was refused as "must be in [1, K=6], got np.int64(3)"."""
    from rmm_jax.errors import InputError

    rr = Reranker(None, dim=4)
    q, c = np.ones(4), np.eye(6, 4) * np.arange(1, 7)[:, None]
    want = rr.rank("u", q, c, 3)
    for m in (np.int64(3), np.int32(3)):
        got = rr.rank("u", q, c, m)
        assert got.selected.tolist() == want.selected.tolist() == [[3, 2, 1]]
        keys = jax.random.split(jax.random.key(0), 1)
        assert rr.sample("u", q, c, m, keys=keys, tau=1.0).selected.tolist() == \
            rr.sample("u", q, c, 3, keys=keys, tau=1.0).selected.tolist()
    with pytest.raises(InputError, match=r"^m:"):
        rr.rank("u", q, c, True)


def test_a_mask_of_another_shape_or_dtype_is_refused_naming_it():
    """A (7,) mask for 6 candidates was a NumPy broadcasting error; a float mask was cast to
    bool, so 0.3 counted as a real candidate."""
    from rmm_jax.errors import InputError

    rr = Reranker(None, dim=4)
    q, c = np.ones(4), np.eye(6, 4)
    for mask in (np.ones(7, bool), np.full(6, 0.3), np.ones((2, 6), bool), np.ones(6, np.int64)):
        with pytest.raises(InputError, match=r"^mask: expected a bool array of shape \(6,\) or \(1, 6\)"):
            rr.rank("u", q, c, 3, mask=mask)
    assert rr.rank("u", q, c, 3, mask=[True] * 5 + [False]).selected.tolist() == [[0, 1, 2]]
    assert rr.rank("u", np.ones((2, 4)), c, 3, mask=np.ones((2, 6), bool)).selected.shape == (2, 3)


def test_the_reranker_names_a_key_a_dim_or_a_cache_size_of_the_wrong_kind():
    from rmm_jax.errors import InputError
    rr = Reranker(None, dim=2)
    q, c = np.array([1.0, 0.0]), np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    # seeds, or raw uint32 key data, where typed keys belong: a TypeError from jax.random, or "expected 1 keys"
    for keys in (np.arange(1), jax.random.PRNGKey(0)[None]):
        with pytest.raises(InputError, match=r"^keys: expected 1 typed PRNG keys"):
            rr.sample("u1", q, c, 2, keys=keys, tau=1.0)
    for kw, where in (({"dim": 2.5}, "dim"), ({"dim": 2, "cache_users": "3"}, "cache_users"),
                      ({"dim": 2, "cache_users": 2.5}, "cache_users")):
        with pytest.raises(InputError, match=rf"^{where}: must be an int >= 1"):   # 2.5 was taken as d = 2
            Reranker(None, **kw)


def test_a_dim_that_disagrees_with_the_policy_store_or_the_calls_is_refused_by_name(env):
    """Reranker(store, dim=16) on a store of another dim served the store's dim without a word;
    calls prepared on an embedding store of another dimension failed naming ``query_emb``, no
    argument of serve_calls; PolicyStore.open(path, expect_dim="384") said "has dim 384,
    expected 384"."""
    from rmm_jax.data.calls import Call, Prepared
    from rmm_jax.errors import InputError
    from rmm_jax.persist.policy_store import PolicyStore

    _, pol = env
    ps = PolicyStore.open(pol["user"])
    d = ps.meta_info().dim
    with pytest.raises(InputError, match=rf"^dim: is {d + 1}, the policy store's is {d}$"):
        Reranker(ps, dim=d + 1)
    assert Reranker(ps, dim=d).dim == d
    with pytest.raises(InputError, match=rf"^expect_dim: must be an int \(the embedding dimension\), got str '{d}'$"):
        PolicyStore.open(pol["user"], expect_dim=str(d))
    for q_dim, c_dim in ((d - 1, d), (d, d - 1)):
        call = Prepared(Call(1, "user0", call_id="c1"), np.ones(q_dim, np.float32), np.eye(3, c_dim, dtype=np.float32),
                        ["a", "b", "c"], None)
        with pytest.raises(InputError, match=rf"^prepared_calls 0: call c1 is embedded in {d - 1} dimensions, the "
                                             rf"reranker's are {d} "):
            list(serve_calls(Reranker(ps), [call], 2, now=1_700_000_000_000_000))


@pytest.mark.parametrize("call, arg", [
    (lambda: call_keys(0, 7, ["call:c1"]), "user_id"),
    (lambda: call_keys(0, None, ["call:c1"]), "user_id"),
    (lambda: call_keys(0, "u1", [3]), "calls"),
    (lambda: call_keys(0, "u1", "call:c1"), "calls"),         # a str: one key per letter
    (lambda: user_key(0, 7), "user_id"),
    (lambda: user_keys(0, ["a", b"b"]), "user_id"),
])
def test_a_user_or_call_id_that_is_not_a_str_is_one_input_error(call, arg):
    # an int user id was AttributeError 'int' object has no attribute 'encode'
    with pytest.raises(InputError, match=rf"^{arg}: must be"):
        call()


def test_a_store_that_is_not_a_policy_store_or_a_user_id_that_is_not_a_str_is_refused_by_name(env, tmp_path):
    """Reranker(path) was an AttributeError ('str' object has no attribute 'meta'), and so
    was an embedding store; rank(7, ...) looked the int up as given and never found user
    "7"'s policy."""
    store, pol = env
    for wrong in (str(pol["user"]), pol["user"], open_store(store)):
        with pytest.raises(InputError, match=r"^store: expected a PolicyStore or None, got .*Reranker\.open\(path\)"):
            Reranker(wrong)
    q, c = np.ones(16), np.eye(4, 16)
    for rr in (Reranker.open(pol["user"]), Reranker(None, dim=16)):
        for user in (7, None, ["user0"]):
            with pytest.raises(InputError, match=r"^user_id: must be a str, got "):
                rr.rank(user, q, c, 2)
        with pytest.raises(InputError, match=r"^user_id: must be a str, got int 7$"):
            rr.sample(7, q, c, 2, keys=call_keys(0, "7", ["c"]))
    assert Reranker.open(pol["user"]).rank("user0", q, c, 2).selected.shape == (1, 2)


def test_load_policy_refuses_a_path_with_reranker_s_message(env):
    """load_policy("policies", "user0"), a path where it takes an opened PolicyStore, was an
    AttributeError ('str' object has no attribute 'meta')."""
    _, pol = env
    for wrong in (str(pol["user"]), pol["user"], None):
        with pytest.raises(InputError, match=r"^store: expected a PolicyStore, got .*; PolicyStore\.open\(path\) opens "
                                             r"a policy store by its path$"):
            load_policy(wrong, "user0")
    assert load_policy(PolicyStore.open(pol["user"]), "user0").version is not None


def test_load_policies_and_batch_policies_refuse_a_str_of_user_ids_by_name(tmp_path):
    """load_policies(store, "user5") read the str as the users 'u', 's', 'e', 'r', '5' (list()
    hid it from load_batch's check), five policies of the shared start; batch_policies alike.
    Refused by name as load_batch refuses it; a list (or any iterable) of the ids is served."""
    from rmm_jax.online.serve import batch_policies, load_policies

    st = policy_store(tmp_path / "pol", {"user5": 1})
    with pytest.raises(InputError, match=r"^user_ids: expected a list of user ids, got the string 'user5'$"):
        load_policies(st, "user5")
    with pytest.raises(InputError, match=r"^user_ids: expected a list of user ids, got the string 'user5'$"):
        batch_policies(st, st.load_batch(["user5"]), "user5")
    want = load_policy(st, "user5")
    for ids in (["user5"], ("user5",), iter(["user5"])):
        (got,) = load_policies(st, ids)
        assert got.version == want.version and leaf_bytes(got.params) == leaf_bytes(want.params)


def test_behaviour_tau_refuses_a_path_by_name(tmp_path):
    """behaviour_tau("policies"), a path where it takes a PolicyStore, was an AttributeError
    ('str' object has no attribute '_header'); None is the default estimator's tau."""
    from rmm_jax.core.config import Estimator
    from rmm_jax.online.serve import behaviour_tau

    ps = PolicyStore.create(tmp_path / "pol", {"kind": "linear", "dim": 4, "hidden": None},
                            rj.init_reranker(jax.random.key(0), 4))
    for wrong in (str(ps.path), ps.path, 0.5):
        with pytest.raises(InputError, match=r"^store: expected a policy store, PolicyStore\.open\(path\), got "):
            behaviour_tau(wrong)
    assert behaviour_tau(ps) == behaviour_tau(None) == Estimator().sample_tau


def test_an_int_or_bool_embedding_is_refused_naming_it_as_the_core_refuses_it():
    """q.astype(np.int32) (all zeros) or a bool candidate bank was ranked and sampled without
    a word; the core's check_float refuses them ("expected a floating dtype, got int32")."""
    rr = Reranker(None, dim=2)
    q, c = np.array([0.6, 0.8]), np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    keys = jax.random.split(jax.random.key(0), 1)
    for args, where, got in (((q.astype(np.int32), c), "query_emb", "int32"),
                             ((q, c.astype(bool)), "candidate_embs", "bool"),
                             (([1, 0], c), "query_emb", r"int64 \(from a list of ints\)")):
        with pytest.raises(InputError, match=rf"^{where}: expected a floating dtype, got {got}$"):
            rr.rank("u1", *args, 2)
        with pytest.raises(InputError, match=rf"^{where}: expected a floating dtype, got {got}$"):
            rr.sample("u1", *args, 2, keys=keys, tau=1.0)
    assert rr.rank("u1", q.astype(np.float64), c.astype(np.float16), 2).selected.tolist() == [[2, 1]]


def test_embeddings_keys_or_a_seed_that_are_not_numbers_are_one_input_error():
    """A str query was NumPy's ValueError ("could not convert string to float"), a ragged
    candidate list its "inhomogeneous shape" one, a complex query lost its imaginary part with
    only a ComplexWarning; keys="x" and call_keys(seed="0") were TypeErrors from JAX, a seed
    past 64 bits an OverflowError."""
    rr = Reranker(None, dim=2)
    q, c = np.array([1.0, 0.0]), np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    for args, where in (((("hello"), c), "query_emb"), ((q.astype(complex), c), "query_emb"),
                        ((np.array(["a", "b"]), c), "query_emb"), ((None, c), "query_emb"),
                        ((q, [[1.0, 0.0], [0.0]]), "candidate_embs"), ((q, c.astype(complex)), "candidate_embs")):
        with pytest.raises(InputError, match=rf"^{where}: expected an array of real numbers, got "):
            rr.rank("u1", *args, 2)
    with pytest.raises(InputError, match=r"^keys: expected 1 typed PRNG keys"):
        rr.sample("u1", q, c, 2, keys="x", tau=1.0)
    for seed in ("0", 2 ** 70, 1.5, None):
        with pytest.raises(InputError, match=r"^seed: must be an int in \[-2\*\*63, 2\*\*63\), got "):
            call_keys(seed, "u1", ["c1"])
    # what worked still does: lists, float64, NumPy integer seeds (int and bool embeddings are
    # refused: test_an_int_or_bool_embedding_is_refused_naming_it_as_the_core_refuses_it)
    assert rr.rank("u1", q.tolist(), c.tolist(), 2).selected.tolist() == [[0, 2]]
    assert rr.rank("u1", np.array([1, 0], np.float64), c, 2).selected.tolist() == [[0, 2]]
    assert (jax.random.key_data(call_keys(np.int64(3), "u1", ["c1"])) ==
            jax.random.key_data(call_keys(3, "u1", ["c1"]))).all()


def test_finite_embeddings_whose_scores_overflow_are_refused_not_ranked_as_minus_one():
    """Entries of 1e20 are finite, so the NaN check let them through, but q·m = 4e40 is inf in
    float32: rank returned [[-1, -1]] without a word, and sample scores of inf."""
    rr = Reranker(None, dim=4)
    q, c = np.full(4, 1e20), np.full((5, 4), 1e20)
    with pytest.raises(InputError, match=r"^query_emb, candidate_embs: the score of query 0, candidate 0 overflows"):
        rr.rank("u1", q, c, 2)
    with pytest.raises(InputError, match=r"^query_emb, candidate_embs: the score of query 0, candidate 0 overflows"):
        rr.sample("u1", q, c, 2, keys=call_keys(0, "u1", ["c1"]), tau=1.0)
    mask = np.array([True, False, False, False, False])              # masked candidates may hold anything
    c[1:] = 1e20
    c[0] = 1.0
    assert rr.rank("u1", np.ones(4), c, 1, mask=mask).selected.tolist() == [[0]]


@pytest.mark.parametrize("explore", [False, True])
def test_a_call_with_fewer_candidates_than_m_is_served_all_of_them_and_its_log_reads_back(capsys, tmp_path, env,
                                                                                           monkeypatch, explore):
    """A call listing 2 candidates (ids or texts) under --m 3 refused the whole batch ("--m 3 is
    more than this call's 2 candidates"), nothing served for anyone, while the log reader takes
    a record showing all of its candidates when it lists fewer than M. Such a call selects all
    of them in the policy's order (with --explore a draw of all of them, whose log_prob is the
    Plackett-Luce probability of the full order: the last draw has probability 1), one note
    counts them, and the served file with `cited` added reads back as a log of M = 3."""
    from rmm_jax.data.citation_log import pl_log_prob, read_log
    from rmm_jax.data.log_vectors import known_ids
    from rmm_jax.online.streams import log_shape

    store, pol = env
    user = open_store(store).user("user0")
    calls = [{"call_id": "ids", "user_id": "user0", "query_id": user.query_ids[0],
              "candidates": list(user.memory_ids[3:5])},
             {"call_id": "texts", "user_id": "someone-new", "query": "where is my passport",
              "candidate_texts": ["passport in the drawer", "my cat is called Tom"]},
             {"call_id": "full", "user_id": "user0", "query_id": user.query_ids[1]}]
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16))
    code, out, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", tmp_path / "calls.jsonl",
                             "--m", "3", "--k", "8", "--out", tmp_path / "out.jsonl",
                             *(["--explore"] if explore else []))
    assert code == 0 and out == "", err
    assert "2 calls with fewer than --m 3 candidates: served with all of them selected" in err, err
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    ids = [[c if isinstance(c, str) else c["id"] for c in o["candidates"]] for o in got]
    assert [len(o["selected"]) for o in got] == [2, 2, 3]
    assert sorted(got[0]["selected"]) == sorted(ids[0]) and sorted(got[1]["selected"]) == sorted(ids[1])
    if explore:
        for o, c in zip(got[:2], ids[:2]):
            order = [c.index(x) for x in o["selected"]]
            assert o["log_prob"] == pytest.approx(pl_log_prob(o["logits"], order), abs=1e-4)
            assert o["log_prob"] == pytest.approx(pl_log_prob(o["logits"], order[:1]), abs=1e-4)   # last draw: P = 1
    else:
        params = Reranker.open(pol["user"]).policy("user0").params
        top, _ = core_top(params, user.query_emb[0], user.memory_emb[3:5], 2)
        assert got[0]["positions"] == top and got[0]["selected"] == [ids[0][p] for p in top]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({**o, "cited": o["selected"][:1]}) + "\n" for o in got))
    st = open_store(store)
    records, report = read_log(log, known=known_ids(st))
    assert [r.call_id for r in records] == ["ids", "texts", "full"] and report.skipped == 0
    assert [len(r.selected) for r in records] == [2, 2, 3]
    shape = log_shape(log, known_ids(st))
    assert (shape.m, shape.m_apart) == (3, None)


def test_a_call_whose_candidate_texts_repeat_a_text_is_served_with_each_text_once(capsys, tmp_path, env,
                                                                                   monkeypatch):
    """An app's retriever returned the same text twice (the user said it twice): the whole batch
    was refused ("key 'candidate_texts': lists a candidate twice"), nothing served. The call is
    served with each text once, where it first comes, a note counts such calls, and the served
    line reads back as a log record and replays. A memory id listed twice is still refused
    (test_a_bad_call_is_one_line_naming_the_line_and_nothing_is_written)."""
    from rmm_jax.data.calls import text_id
    from rmm_jax.data.citation_log import read_log
    from rmm_jax.data.log_vectors import known_ids

    store, _ = env
    texts = ["user: I live in Rome.", "user: I like jazz.", "user: I live in Rome.", "user: My car is old."]
    calls = [{"call_id": "dup", "user_id": "someone-new", "query": "where do I live?", "candidate_texts": texts},
             {"call_id": "ok", "user_id": "user0", "query_id": open_store(store).user("user0").query_ids[0]}]
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16))
    code, out, err = run_cli(capsys, "rerank", store, "--calls", tmp_path / "calls.jsonl", "--m", "2", "--k", "4",
                             "--explore", "--out", tmp_path / "out.jsonl")
    assert code == 0 and out == "", err
    assert "1 call of" in err and "lists a candidate text more than once: served with each text once" in err, err
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    once = list(dict.fromkeys(texts))
    assert got[0]["candidates"] == [{"id": text_id(t), "text": t} for t in once]
    assert len(got[0]["logits"]) == 3 and len(got[0]["selected"]) == 2
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({**o, "cited": o["selected"][:1]}) + "\n" for o in got))
    records, report = read_log(log, known=known_ids(open_store(store)))
    assert [r.call_id for r in records] == ["dup", "ok"] and report.skipped == 0
    assert list(records[0].candidates) == [text_id(t) for t in once]
    code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p")
    assert code == 0, err


def test_rerank_notes_the_candidate_texts_the_model_cut(capsys, tmp_path, env, monkeypatch):
    """embed notes the texts its model read only the beginning of; rerank embedded a long
    candidate text the same way without a word (its fact past the cut is never retrieved)."""
    store, _ = env
    texts = ["user: I like jazz.", "user: " + "and then " * 20 + "I moved to Rome."]
    (tmp_path / "calls.jsonl").write_text(json.dumps({"call_id": "c", "user_id": "someone-new",
                                                      "query": "where do I live?", "candidate_texts": texts}) + "\n")
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16, max_tokens=8))
    code, out, err = run_cli(capsys, "rerank", store, "--calls", tmp_path / "calls.jsonl", "--m", "1")
    assert code == 0, err
    assert "note: 1 of 3 texts embedded was longer than model fake/bow-16 reads (8 word pieces" in err, err


def test_rerank_shows_the_new_texts_bar_and_says_how_many_texts_the_store_lacks(capsys, tmp_path, env, monkeypatch):
    """rerank embedded the day's new request texts (7-10 s every day) with no bar and no line,
    where replay and evaluate show a ``new texts`` bar and say how many texts the store lacks."""
    store, _ = env
    made = []

    class Seen(FakeEmbedder):
        def encode(self, texts, desc=""):
            made[-1]["desc"] = desc
            return super().encode(texts, desc)

    def embedder(model, progress=False, **kw):
        made.append({"progress": progress})
        return Seen(16)

    (tmp_path / "calls.jsonl").write_text(json.dumps({"call_id": "c", "user_id": "someone-new", "query": "where?",
                                                      "candidate_texts": ["user: jazz", "user: Rome"]}) + "\n")
    monkeypatch.setattr(embed_mod, "Embedder", embedder)
    code, _, err = run_cli(capsys, "rerank", store, "--calls", tmp_path / "calls.jsonl", "--m", "1")
    assert code == 0, err
    assert made == [{"progress": True, "desc": "new texts"}]          # the bar replay and evaluate show
    assert "embedded 3 texts the store lacks (queries and candidates the calls carry as text)" in err, err


def test_a_user_holding_fewer_memories_than_m_is_served_all_of_them(capsys, tmp_path, monkeypatch):
    """A user whose bank holds 2 memories, under the default --m 5 and --k: the whole batch was
    refused ("--m 5 is more than this call's 2 candidates (user 'user0' holds 2 memories)");
    --k above the bank was cut to it without a word. The call is served its user's memories."""
    store = make_fake_store(tmp_path / "small", users=1, sessions=1, turns=2, dim=16)
    user = open_store(store).user("user0")
    assert len(user.memory_ids) < 5
    (tmp_path / "calls.jsonl").write_text(json.dumps({"call_id": "c1", "user_id": "user0",
                                                      "query": "what is my dog called?"}) + "\n")
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(16))
    code, out, err = run_cli(capsys, "rerank", store, "--calls", tmp_path / "calls.jsonl", "--explore")
    assert code == 0, err
    (o,) = [json.loads(line) for line in out.splitlines()]
    assert sorted(o["selected"]) == sorted(o["candidates"]) == sorted(user.memory_ids)
    assert "1 call with fewer than --m 5 candidates" in err, err


def test_a_request_s_unknown_keys_are_ignored_and_a_misspelt_one_is_noted_once(capsys, tmp_path, env):
    """`rerank --calls` refused any extra key ("key 'latency_ms': unknown key"), while a log's
    other keys are ignored and a misspelt log key is noted: a request's are ignored the same
    way (the served lines are those of the requests without them), and a key that looks like
    a misspelt request key gets one note naming its first line and the key it is likely."""
    store, pol = env
    calls = tmp_path / "calls.jsonl"
    plain = [{"call_id": "a", "user_id": "user0", "query_id": "q0", "timestamp": 1},
             {"call_id": "b", "user_id": "user1", "query_id": "q1", "timestamp": 2},
             {"call_id": "c", "user_id": "user0", "query_id": "q2", "timestamp": 3}]
    extra = [{**plain[0], "latency_ms": 5}, {**plain[1], "candidate_ids": ["x"], "model": "m"},
             {**plain[2], "candidate_ids": ["y"], "latency_ms": 7}]
    outs = []
    for recs in (plain, extra):
        calls.write_text("".join(json.dumps(r) + "\n" for r in recs))
        code, out, err = run_cli(capsys, "rerank", store, "--policies", pol["user"], "--calls", calls,
                                 "--k", 5, "--m", 3)
        assert code == 0, err
        outs.append((out, [line for line in err.splitlines() if line.startswith("note:")]))
    assert outs[1][0] == outs[0][0] and len(outs[0][0].splitlines()) == 3
    assert outs[0][1] == []
    assert outs[1][1] == [f"note: {calls}:2: key 'candidate_ids' is not a request key and was ignored "
                          "(did you mean 'candidates'?)"]


@pytest.mark.parametrize("case", ["calls", "calls-spelt-otherwise", "calls-link", "in-store"])
def test_rerank_refuses_an_out_that_is_its_calls_or_inside_its_store(capsys, tmp_path, monkeypatch, case):
    """`rerank --calls F --out F` served the calls and wrote the served lines over F, exit 0:
    the requests were gone. --out naming the requests file (by another spelling of the path,
    or a link to it), or a path inside STORE, is one line naming --out, before any work:
    nothing written, the requests and the store as they were."""

    store = make_fake_store(tmp_path / "st", users=1, sessions=1, turns=2, dim=16)
    calls = tmp_path / "calls.jsonl"
    text = json.dumps({"call_id": "c1", "user_id": "user0", "query_id": "q0"}) + "\n"
    calls.write_text(text)
    (tmp_path / "sub").mkdir()
    if case == "calls-link":
        os.symlink(calls, tmp_path / "sub" / "link.jsonl")
    out = {"calls": calls, "calls-spelt-otherwise": tmp_path / "sub" / ".." / "calls.jsonl",
           "calls-link": tmp_path / "sub" / "link.jsonl", "in-store": store / "served.jsonl"}[case]
    files = lambda: sorted((p.relative_to(tmp_path), p.lstat().st_mtime_ns) for p in tmp_path.rglob("*")
                           if not p.is_dir())
    before = files()
    code, stdout, err = run_cli(capsys, "rerank", store, "--calls", calls, "--out", out)
    assert (code, stdout) == (2, "") and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    want = "lies in STORE" if case == "in-store" else f"is the requests file --calls {calls}"
    assert line.startswith(f"error: --out {out}: {want}"), line
    assert calls.read_text() == text
    assert files() == before


def _one_call(**kw):
    from rmm_jax.data.calls import Call, Prepared
    c = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32)
    p = Prepared(Call(1, "u1", call_id="c1"), np.array([1.0, 0.0], np.float32), c, ["m1", "m2", "m3"], None)
    return p._replace(**kw)


@pytest.mark.parametrize("calls, m, now, where", [
    (None, 2, 1_714_555_800.5, "now: must be an int of microseconds"),   # time.time() stamped 1970 silently
    (None, 2, 1_714_555_800, "now: must be an int of microseconds"),     # seconds, not microseconds
    (None, 2, None, "now: must be an int of microseconds"),
    (None, "2", 0, "m: must be an int >= 1"),
    (None, None, 0, "m: must be an int >= 1"),
    ("one", 2, 0, "prepared_calls: must be a list of Prepared"),
    ([_one_call(ids=["m1"])], 2, 0, "prepared_calls 0: call c1 has 1 ids for 3 candidates"),
    ([_one_call(cands=np.zeros((0, 2), np.float32), ids=[])], 2, 0, "prepared_calls 0: call c1 has no candidates"),
])
def test_serve_calls_names_a_bad_now_m_or_call(calls, m, now, where):
    from rmm_jax.online.serve import serve_calls
    calls = [_one_call()] if calls is None else _one_call() if calls == "one" else calls
    with pytest.raises(InputError) as e:
        list(serve_calls(Reranker(None, dim=2), calls, m, now=now))
    assert str(e.value).startswith(where), str(e.value)


def _random_calls(n_calls: int, k: int, dim: int, seed: int = 0):
    from rmm_jax.data.calls import Call, Prepared
    rng = np.random.default_rng(seed)
    unit = lambda a: (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)     # noqa: E731
    return [Prepared(Call(i, f"u{i % 3}", call_id=f"c{i}"), unit(rng.normal(size=dim)), unit(rng.normal(size=(k, dim))),
                     [f"m{j}" for j in range(k)], None) for i in range(n_calls)]


def test_an_exploring_serve_warns_exactly_when_its_median_draw_repeats_more_often_than_not():
    """The warning's rule, against the probabilities the served records carry: the median
    call drew its selection with probability >= 1/2. The temperatures span draws from
    deterministic to near uniform, and both sides of the rule must be taken."""
    import warnings

    from rmm_jax.online.serve import ExplorationWarning, serve_calls
    calls, sides = _random_calls(24, k=6, dim=4), set()
    for tau in (1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.3, 3.0):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            served = [s for batch in serve_calls(Reranker(None, dim=4), calls, 2, explore=True, tau=tau, now=0)
                      for s in batch]
        p = np.median(np.exp([s.record.log_prob for s in served]))
        ours = [w for w in seen if issubclass(w.category, ExplorationWarning)]
        assert len(ours) == (1 if p >= 0.5 else 0), (tau, p, [str(w.message) for w in seen])
        if ours:
            assert f"probability {p:.2f} (24 calls)" in str(ours[0].message)
        sides.add(bool(ours))
    assert sides == {True, False}
    with warnings.catch_warnings():      # fewer draws than EXPLORATION_CALLS: no median is judged
        warnings.simplefilter("error", ExplorationWarning)
        assert len([s for b in serve_calls(Reranker(None, dim=4), calls[:19], 2, explore=True, tau=1e-4, now=0)
                    for s in b]) == 19


def test_the_exploration_warning_names_the_default_only_where_the_scores_can_grow(capsys, tmp_path, env):
    """The warning's cure: a larger --tau always; the move to the default preset only for policies
    that learn against the best current score (realistic), not for the identity reranker nor for
    policies already under the default (whose scores stay bounded)."""
    from conftest import main
    store, pol = env
    real = tmp_path / "real"
    main(["simulate", str(store), "--policies", str(real), *SIM, "--preset", "realistic"])
    calls = tmp_path / "calls.jsonl"
    st = open_store(store)
    calls.write_text("".join(json.dumps({"user_id": u, "query_id": q, "call_id": f"{u}-{q}"}) + "\n"
                             for u in st.user_ids for q in st.user(u).query_ids[:8]))
    for i, (policies, named) in enumerate(((tmp_path / "none", False), (pol["user"], False), (real, True))):
        code, _, err = run_cli(capsys, "rerank", store, "--policies", policies, "--calls", calls, "--k", 8, "--m", 3,
                               "--explore", "--tau", "1e-5", "--out", tmp_path / f"out{i}.jsonl")   # one per policy
        assert code == 0, err
        line = next(ln for ln in err.splitlines() if "barely explored" in ln)
        assert "draw at a larger tau (rerank --draw-tau)" in line
        assert ("--preset default --change-setting" in line) == named, (policies, line)


def test_a_call_that_shows_every_candidate_is_not_counted_as_a_draw_that_does_not_explore():
    import warnings

    from rmm_jax.online.serve import ExplorationWarning, serve_calls
    calls = _random_calls(24, k=2, dim=4)                 # 2 candidates, m 2: all shown, nothing to explore
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExplorationWarning)
        assert len([s for b in serve_calls(Reranker(None, dim=4), calls, 2, explore=True, tau=1e-4, now=0)
                    for s in b]) == 24


def test_rerank_says_in_one_warning_line_that_its_draw_barely_explored(capsys, tmp_path, env):
    store, _ = env
    calls = tmp_path / "calls.jsonl"
    st = open_store(store)
    calls.write_text("".join(json.dumps({"user_id": u, "query_id": q, "call_id": f"{u}-{q}"}) + "\n"
                             for u in st.user_ids for q in st.user(u).query_ids[:8]))
    for tau, warned in (("1e-5", True), ("100", False)):
        code, out, err = run_cli(capsys, "rerank", store, "--policies", tmp_path / "none", "--calls", calls, "--k", 8,
                                 "--m", 3, "--explore", "--tau", tau, "--out", tmp_path / f"out{tau}.jsonl")
        assert code == 0, err
        lines = [ln for ln in err.splitlines() if "barely explored" in ln]
        assert len(lines) == (1 if warned else 0), err
        if warned:
            assert lines[0].startswith("warning: the exploring draw barely explored: the median call drew its 3 "
                                       "memories"), lines[0]
