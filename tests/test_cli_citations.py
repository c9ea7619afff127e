"""`simulate --citations`: the models reach the loop, `answer` reads only the answer
embeddings the store holds, and misuse is one line with nothing written."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import FakeEmbedder, run_cli

from rmm_jax.data import make_synthetic
from rmm_jax.data.citations import answer_support
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


def test_answer_embeddings_are_question_plus_answer_in_store_order(stores):
    root, ds = stores
    st = open_store(root / "answers")
    want = FakeEmbedder(16).encode(answer_texts(ds))
    assert np.allclose(np.asarray(st.answer_emb), want)
    assert open_store(root / "plain").answer_emb is None
    assert any(q.answer for u in ds.users for q in u.queries)       # the answers are really there


def test_answer_support_never_reads_gold(stores):
    root, _ = stores
    st = open_store(root / "answers")
    uid = st.user_ids[0]
    s = stream_from_user(st.user(uid), 8)
    a = with_answer_support(s, st.user_answers(uid)).cite_gold
    flipped = dataclasses.replace(s, cand_gold=~s.cand_gold)
    assert np.array_equal(a, with_answer_support(flipped, st.user_answers(uid)).cite_gold)
    assert np.array_equal(a, answer_support(np.asarray(st.user_answers(uid)), s.bank, s.cand, s.cand_mask))


@pytest.mark.parametrize("model", ["oracle", "position", "answer"])
def test_each_model_runs_from_the_command_line(capsys, tmp_path, stores, model):
    root, _ = stores
    code, out, err = run_cli(capsys, "simulate", root / "answers", "--policies", tmp_path / "p", "--citations",
                             model, *SIM)
    assert code == 0, err
    assert json.loads(out)["citations"]["model"] == model


@pytest.mark.parametrize("args, where", [
    (["--citations", "answer"], "answers"),                     # the plain store holds no answer embeddings
    (["--citations", "position", "--precision", "0.9"], "--citations"),
])
def test_misuse_is_one_line_and_writes_nothing(capsys, tmp_path, stores, args, where):
    root, _ = stores
    code, out, err = run_cli(capsys, "simulate", root / "plain", "--policies", tmp_path / "p", *args, *SIM)
    assert code == 2 and out == "" and where in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "p").exists()
