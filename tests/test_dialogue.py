"""Pretraining labels from a user's own dialogue (rmm_jax.data.dialogue): which turns pair up,
the stream they make (candidates from the other memories, the answer as gold), and
`rmm-jax pretrain --labels dialogue` end to end."""
from __future__ import annotations

import itertools
import json

import jax
import numpy as np
import pytest
from conftest import REPO, make_fake_store, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from rmm_jax import init_reranker
from rmm_jax.data.dialogue import dialogue_pairs
from rmm_jax.data.store import UserData, open_store
from rmm_jax.online.pretrain import PretrainConfig, pretrain
from rmm_jax.online.streams import dialogue_stream, load_dialogue_streams
from rmm_jax.persist.policy_store import PolicyStore

SPEAKERS = ("Ann", "Bob", "Cy")


@st.composite
def conversations(draw):
    """Turn rows: sessions in blocks, speakers and question marks at random, some without a
    speaker prefix."""
    n = draw(st.integers(0, 12))
    rows, session = [], 0
    for _ in range(n):
        session += draw(st.sampled_from([0, 0, 1]))
        who = draw(st.sampled_from(SPEAKERS + (None,)))
        body = draw(st.sampled_from(["Fine.", "Where?", "Is it? Yes.", "ok: sure", "Why not?"]))
        rows.append({"session_id": f"s{session}", "text": body if who is None else f"{who}: {body}"})
    return rows


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_pairs_are_exactly_the_asking_turns_answered_next_in_session_by_another_speaker(rows):
    def who(text):                                    # an independent reading of "Name: text"
        return text.split(": ")[0] if ": " in text and text.index(": ") > 0 else None
    expect = [(i, j) for i, j in itertools.pairwise(range(len(rows)))
              if "?" in rows[i]["text"] and rows[i]["session_id"] == rows[j]["session_id"]
              and who(rows[i]["text"]) and who(rows[j]["text"]) and who(rows[i]["text"]) != who(rows[j]["text"])]
    assert dialogue_pairs(rows).tolist() == [list(p) for p in expect]


def test_the_stream_ranks_the_other_memories_and_marks_the_answer():
    rng = np.random.default_rng(0)
    bank = rng.normal(size=(30, 8)).astype(np.float32)
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    user = UserData("u", bank, np.zeros((0, 8), np.float32), np.zeros((0, 30), bool),
                    tuple(f"m{i}" for i in range(30)), (), (), np.zeros(0, bool))
    pairs = np.array([[i, (i * 7 + 3) % 30] for i in range(0, 30, 3) if (i * 7 + 3) % 30 != i], np.int32)
    s = dialogue_stream(user, pairs, k=6)
    for r, (ask, ans) in enumerate(pairs):
        sims = bank @ bank[ask]
        others = [j for j in np.argsort(-sims, kind="stable") if j != ask][:6]     # brute force
        assert ask not in s.cand[r]
        assert sorted(s.cand[r].tolist()) == sorted(others)
        assert np.all(np.diff(sims[s.cand[r]]) <= 1e-6)                          # best first
        assert s.cand_gold[r].tolist() == (s.cand[r] == ans).tolist()
    np.testing.assert_array_equal(s.queries, bank[pairs[:, 0]])
    assert s.num_gold.tolist() == [1] * len(pairs) and s.valid.all()
    assert s.query_ids == tuple(f"m{i}" for i in pairs[:, 0])


def test_a_bank_smaller_than_k_masks_the_missing_candidates():
    bank = np.eye(3, dtype=np.float32)
    user = UserData("u", bank, np.zeros((0, 3), np.float32), np.zeros((0, 3), bool), ("a", "b", "c"), (), (),
                    np.zeros(0, bool))
    s = dialogue_stream(user, np.array([[0, 1]]), k=5)
    assert s.cand_mask.tolist() == [[True, True, False, False, False]]
    assert sorted(s.cand[0, :2].tolist()) == [1, 2] and s.cand_gold[0].sum() == 1


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("dlg") / "store", users=3, sessions=3, dim=32)


def test_a_store_gives_every_user_their_own_pairs(store):
    st_ = open_store(store)
    streams = load_dialogue_streams(st_, 10)
    assert [s.user_id for s in streams] == list(st_.user_ids)
    for s in streams:
        rows = st_.memory_rows(s.user_id)
        pairs = dialogue_pairs(rows)
        assert len(pairs) > 0 and s.query_ids == tuple(rows[i]["id"] for i in pairs[:, 0])
        assert all("?" in rows[i]["text"] for i in pairs[:, 0])


def test_the_pairs_are_learnable(store):
    streams = load_dialogue_streams(open_store(store), 10)
    start = init_reranker(jax.random.key(0), 32)
    _, history = pretrain(start, streams, [], PretrainConfig(m=3, epochs=8), seed=0)
    assert history["train_recall"][-1] > history["train_recall"][0] + 0.05, history["train_recall"]


def test_pretrain_labels_dialogue_runs_the_measured_recipe_and_records_it(store, tmp_path, capsys):
    """With no --epochs or --val-fraction, `pretrain --labels dialogue` trains exactly what
    learn_sweep.py's dialogue lever chose and measured: its epochs, no validation split."""
    chosen = json.loads((REPO / "benchmarks/results/learn_sweep_dialogue.json").read_text())["tuning"]["chosen_epochs"]
    out = tmp_path / "warm"
    code, stdout, err = run_cli(capsys, "pretrain", store, "--labels", "dialogue", "--out", out, "--k", 10, "--m", 3,
                                "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["epochs_run"] == chosen and summary["split"]["validation"] == []
    pol = PolicyStore.open(out)
    assert pol.meta["config"]["pretrain"]["labels"] == "dialogue"
    streams = load_dialogue_streams(open_store(store), 10)
    expect, _ = pretrain(init_reranker(jax.random.key(0), 32), streams, [], PretrainConfig(m=3, epochs=chosen),
                         seed=0)
    for a, b in zip(jax.tree.leaves(pol.shared_state().state.params), jax.tree.leaves(expect)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))      # the CLI trains what the library does


def test_gold_labels_keep_the_gold_recipe(store, tmp_path, capsys):
    code, stdout, err = run_cli(capsys, "pretrain", store, "--out", tmp_path / "gold", "--k", 10, "--m", 3,
                                "--epochs", 1, "--json")
    assert code == 0, err
    assert len(json.loads(stdout)["split"]["validation"]) == 1       # 0.2 of 3 users, at least one
    assert PolicyStore.open(tmp_path / "gold").meta["config"]["pretrain"]["labels"] == "gold"
