"""`simulate --citations`: the models reach the loop and cite as they should (on the same
selections, position cites a subset of what oracle cites, fading with the slot; oracle at
its class rates, the two false-citation rates each on its own calls; answer exactly the
shown memories that support the answer, whatever the gold labels say), `answer` reads
only the answer embeddings the store holds, and misuse is one line with nothing written."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import FakeEmbedder, run_cli

from rmm_jax.data import make_synthetic
from rmm_jax.data.citations import ANSWER_TOP_C, P_OTHER, P_USEFUL, POSITION_DECAY, SPURIOUS, answer_support
from rmm_jax.data.store import answer_texts, open_store, write_store
from rmm_jax.online.streams import stream_from_user, with_answer_support

SIM = ["--k", "8", "--m", "3", "--users-per-chunk", "2", "--checkpoint-every", "0", "--json"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("cit")
    ds = make_synthetic(users=2, sessions=3, turns=6, seed=1)
    write_store(root / "plain", ds, "turn", FakeEmbedder(16))
    write_store(root / "answers", ds, "turn", FakeEmbedder(16), answers=True)
    return root, ds


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A larger store (108 queries) with answers, and the same store with every query's
    gold evidence moved to another turn of its user (texts, answers and embeddings unchanged)."""
    root = tmp_path_factory.mktemp("cit_big")
    ds = make_synthetic(users=4, sessions=8, turns=8, seed=1)
    write_store(root / "gold", ds, "turn", FakeEmbedder(16), answers=True)
    users = []
    for u in ds.users:
        turns = [t.id for sess in u.sessions for t in sess.turns]
        moved = [dataclasses.replace(q, gold_turn_ids=tuple(turns[(turns.index(g) + len(turns) // 2) % len(turns)]
                                                           for g in q.gold_turn_ids)) for q in u.queries]
        users.append(dataclasses.replace(u, queries=tuple(moved) if isinstance(u.queries, tuple) else moved))
    write_store(root / "scrambled", dataclasses.replace(ds, users=users), "turn", FakeEmbedder(16), answers=True)
    return root


# A learning rate that moves no score in float32 (q + Wq rounds to q): every model then sees
# the same selections, drawn with the same keys, and their citations can be compared slot by slot.
FROZEN = ["--k", "10", "--m", "5", "--lr", "1e-30", "--users-per-chunk", "4", "--checkpoint-every", "0", "--json"]


def simulate_log(capsys, store, policies, log, model, args) -> list[dict]:
    code, out, err = run_cli(capsys, "simulate", store, "--policies", policies, "--citations", model,
                             "--log-out", log, *args)
    assert code == 0, err
    assert json.loads(out)["citations"]["model"] == model
    return [json.loads(line) for line in open(log) if line.strip()]


def cited_slots(records) -> np.ndarray:
    """(records, M) bool: whether the memory in each display slot was cited."""
    m = max(len(r["selected"]) for r in records)
    out = np.zeros((len(records), m), bool)
    for i, r in enumerate(records):
        for j, mem in enumerate(r["selected"]):
            out[i, j] = mem in r["cited"]
    return out


def gold_slots(store, records) -> tuple[np.ndarray, np.ndarray]:
    """(records, M) bool: whether each shown memory is gold, and whether the slot is filled."""
    st = open_store(store)
    users = {u: st.user(u) for u in {r["user_id"] for r in records}}
    m = max(len(r["selected"]) for r in records)
    gold, filled = np.zeros((len(records), m), bool), np.zeros((len(records), m), bool)
    for i, r in enumerate(records):
        u = users[r["user_id"]]
        t = list(u.query_ids).index(r["query_id"])
        ids = list(u.memory_ids)
        for j, mem in enumerate(r["selected"]):
            gold[i, j], filled[i, j] = bool(u.gold[t, ids.index(mem)]), True
    return gold, filled


def near(observed: np.ndarray, p: float) -> bool:
    """``observed`` (bools) has mean within 4 binomial standard errors of ``p``."""
    n = observed.size
    return n > 0 and abs(observed.mean() - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-9


def test_models_cite_differently_on_the_same_selections(capsys, tmp_path, big):
    logs = {m: simulate_log(capsys, big / "gold", tmp_path / m, tmp_path / f"{m}.jsonl", m, FROZEN)
            for m in ("oracle", "position", "answer")}
    key = lambda r: (r["user_id"], r["query_id"], tuple(r["selected"]))
    assert [key(r) for r in logs["oracle"]] == [key(r) for r in logs["position"]] == [key(r) for r in logs["answer"]]
    assert len(logs["oracle"]) == 108
    oracle, position, answer = (cited_slots(logs[m]) for m in ("oracle", "position", "answer"))
    gold, filled = gold_slots(big / "gold", logs["oracle"])

    # oracle: the class rates, each false-citation rate on its own calls: a memory that is not
    # useful is cited at P_OTHER beside a useful one, and every memory of a call that shows
    # nothing useful at SPURIOUS
    with_gold = gold.any(1, keepdims=True)
    assert near(oracle[gold], P_USEFUL)
    assert near(oracle[filled & ~gold & with_gold], P_OTHER)
    assert near(oracle[filled & ~with_gold], SPURIOUS)
    assert gold.sum() >= 25 and (filled & ~gold & with_gold).sum() >= 60 and (filled & ~with_gold).sum() >= 200

    # position: the same uniforms against rate·decay^j, so a subset of oracle's citations, the
    # same at slot 0, and of oracle's citations at slot j a share decay^j survives.
    assert not (position & ~oracle).any()
    assert np.array_equal(position[:, 0], oracle[:, 0])
    for j in range(1, oracle.shape[1]):
        assert near(position[:, j][oracle[:, j]], POSITION_DECAY ** j), j
    kept = position[:, 1:][oracle[:, 1:]].mean()
    assert kept < 0.9 and position.sum() < oracle.sum()

    # answer: exactly the shown memories that support the reference answer (computed here from the
    # store's answer embeddings), at most top_c per call, and nothing like oracle's pattern.
    st = open_store(big / "gold")
    for i, r in enumerate(logs["answer"]):
        s = stream_from_user(st.user(r["user_id"]), 10)
        t = s.query_ids.index(r["query_id"])
        sup = answer_support(np.asarray(st.user_answers(s.user_id)), s.bank, s.cand, s.cand_mask)[t]
        supported = {s.memory_ids[c] for c, ok in zip(s.cand[t], sup) if ok}
        assert set(r["cited"]) == supported & set(r["selected"]), r
    assert answer.sum(1).max() <= ANSWER_TOP_C and answer.sum() >= 20
    assert (oracle.sum(1) > ANSWER_TOP_C).sum() >= 5 and not np.array_equal(answer, oracle)


def test_answer_citations_never_read_gold(capsys, tmp_path, big):
    # the scramble moved the gold labels (so the oracle would cite differently) ...
    for u in open_store(big / "gold").user_ids:
        assert not np.array_equal(open_store(big / "gold").user(u).gold, open_store(big / "scrambled").user(u).gold)
    # ... and with learning on (updates follow the citations) answer's run is the same, record for record
    args = [a if a != "1e-30" else "0.01" for a in FROZEN]
    a, b = (simulate_log(capsys, big / st, tmp_path / st, tmp_path / f"{st}.jsonl", "answer", args)
            for st in ("gold", "scrambled"))
    assert [(r["selected"], r["cited"], r["log_prob"]) for r in a] == \
        [(r["selected"], r["cited"], r["log_prob"]) for r in b]
    assert sum(len(r["cited"]) for r in a) > 20


def test_answer_embeddings_are_question_plus_answer_in_store_order(stores):
    root, ds = stores
    st = open_store(root / "answers")
    want = FakeEmbedder(16).encode(answer_texts(ds))
    assert np.array_equal(np.asarray(st.answer_emb), want)            # the embedder's float32 rows, stored as they are
    assert open_store(root / "plain").answer_emb is None
    assert any(q.answer for u in ds.users for q in u.queries)       # the answers are really there


def test_answers_of_an_unknown_user_are_the_one_line_error_naming_the_store(stores):
    """st.user_answers("nobody") was a KeyError; user(), memory_rows() and query_count() say
    "unknown user id" naming the store."""
    from rmm_jax.errors import InputError

    root, _ = stores
    st = open_store(root / "answers")
    with pytest.raises(InputError, match=r"answers: unknown user id 'nobody' \(store has 2 users"):
        st.user_answers("nobody")
    assert st.user_answers(st.user_ids[0]).shape[0] == st.query_count(st.user_ids[0])


def test_answer_support_never_reads_gold(stores):
    root, _ = stores
    st = open_store(root / "answers")
    uid = st.user_ids[0]
    s = stream_from_user(st.user(uid), 8)
    a = with_answer_support(s, st.user_answers(uid)).cite_gold
    flipped = dataclasses.replace(s, cand_gold=~s.cand_gold)
    assert np.array_equal(a, with_answer_support(flipped, st.user_answers(uid)).cite_gold)
    assert np.array_equal(a, answer_support(np.asarray(st.user_answers(uid)), s.bank, s.cand, s.cand_mask))


@pytest.mark.parametrize("args, where", [
    (["--citations", "answer"], "answers"),                     # the plain store holds no answer embeddings
    (["--citations", "position", "--precision", "0.9"], "--citations"),
])
def test_misuse_is_one_line_and_writes_nothing(capsys, tmp_path, stores, args, where):
    root, _ = stores
    code, out, err = run_cli(capsys, "simulate", root / "plain", "--policies", tmp_path / "p", *args, *SIM)
    assert code == 2 and out == "" and where in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "p").exists()
