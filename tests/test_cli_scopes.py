"""The three scopes from the command line: simulate, replay, pretrain, policies, and the
one-line refusals (bad --rank, a store of another scope)."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import make_fake_store, run_cli

from rmm_jax.online.serve import user_params
from rmm_jax.persist.policy_store import PolicyStore

SIM = ["--k", "8", "--m", "3", "--lr", "0.01", "--users-per-chunk", "2", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("scopes") / "store", users=3, dim=16)


@pytest.mark.parametrize("scope", ["shared", "hybrid"])
def test_simulate_log_then_replay_gives_identical_policies(capsys, tmp_path, store, scope):
    extra = ["--scope", scope, "--rank", "2"]
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "a", "--log-out",
                             tmp_path / "log.jsonl", *SIM, *extra, "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["layout"]["scope"] == scope
    code, _, err = run_cli(capsys, "replay", store, "--log", tmp_path / "log.jsonl", "--policies", tmp_path / "b",
                           *SIM, *extra, "--json")
    assert code == 0, err
    a, b = PolicyStore.open(tmp_path / "a"), PolicyStore.open(tmp_path / "b")
    assert a.meta["scope"] == scope and a.users() == b.users() and len(a.users()) == 3
    sa, sb = a.shared_state().state.params, b.shared_state().state.params
    for x, y in zip(*(np.concatenate([np.ravel(v) for v in jax.tree.leaves(t)]) for t in (sa, sb))):
        assert x == y
    ident = make_identity_check(sa)
    assert not ident                                              # the shared part learned
    for u in a.users():
        pa, pb = user_params(a, u), user_params(b, u)
        for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
            assert np.array_equal(np.asarray(x), np.asarray(y))
        if scope == "hybrid":
            lora = a.load(u).state.params["q_adapter"]["lora"]
            assert np.abs(np.asarray(lora["b"])).max() > 0           # each user's factors learned


def make_identity_check(params) -> bool:
    return all(float(np.abs(np.asarray(x)).max()) == 0 for x in jax.tree.leaves(params))


def test_a_store_of_another_scope_is_refused_and_nothing_is_written(capsys, tmp_path, store):
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--scope", "hybrid",
                           "--rank", "2")
    assert code == 0, err
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "p").rglob("*"))
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--scope", "user")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "--scope" in err and "hybrid" in err, err
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--scope", "hybrid",
                           "--rank", "3")
    assert code == 2 and "--rank" in err and err.strip().count("\n") == 0, err
    code, _, err = run_cli(capsys, "replay", store, "--log", tmp_path / "missing.jsonl", "--policies",
                           tmp_path / "p", *SIM, "--scope", "shared")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "p").rglob("*")) == before


@pytest.mark.parametrize("rank", ["0", "-1", "16", "99"])
def test_rank_out_of_range_is_one_line_and_writes_nothing(capsys, tmp_path, store, rank):
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--scope", "hybrid",
                             "--rank", rank)
    assert code == 2 and out == "" and "--rank" in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("scope", ["user", "shared", "hybrid"])
def test_pretrained_start_works_for_every_scope(capsys, tmp_path, store, scope):
    code, _, err = run_cli(capsys, "pretrain", store, "--out", tmp_path / "p", "--epochs", "2", "--k", "8", "--m",
                           "3", "--scope", scope, "--rank", "2", "--checkpoint-every", "0")
    assert code == 0, err
    pre = PolicyStore.open(tmp_path / "p").shared_state().state.params
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", "--init", "pretrained", *SIM,
                             "--scope", scope, "--rank", "2", "--json")
    assert code == 0, err
    ps = PolicyStore.open(tmp_path / "p")
    assert ps.meta["scope"] == scope
    u = ps.users()[0]
    if scope == "user":      # the user's policy started from the pretrained one and moved
        assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                       zip(jax.tree.leaves(user_params(ps, u)), jax.tree.leaves(pre)))
    else:                    # the shared part started from the pretrained one and moved
        assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                       zip(jax.tree.leaves(ps.shared_state().state.params), jax.tree.leaves(pre)))
