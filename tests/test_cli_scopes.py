"""The three scopes from the command line: simulate, replay, pretrain, policies, and the
one-line refusals (bad --rank, a store of another scope)."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_fake_store, run_cli
from helpers import assert_f32_close, f32_error

import rmm_jax as rj
from rmm_jax.data.store import open_store
from rmm_jax.online.serve import user_params
from rmm_jax.online.streams import stream_from_user
from rmm_jax.persist.policy_store import PolicyStore
from rmm_jax.persist.runstate import RunState

SIM = ["--k", "8", "--m", "3", "--lr", "0.01", "--users-per-chunk", "2", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("scopes") / "store", users=3, dim=16)


@pytest.mark.user_xla_flags
@pytest.mark.parametrize("scope", ["shared", "hybrid"])
def test_simulate_log_then_replay_gives_identical_policies(capsys, tmp_path, store, scope):
    extra = ["--scope", scope, *(["--rank", "2"] if scope == "hybrid" else [])]
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


def rank_of(scope: str) -> list[str]:
    """``--rank 2`` for hybrid, nothing for the scopes without a per-user rank."""
    return ["--rank", "2"] if scope == "hybrid" else []


def make_identity_check(params) -> bool:
    return all(float(np.abs(np.asarray(x)).max()) == 0 for x in jax.tree.leaves(params))


def test_a_store_of_another_scope_is_refused_and_nothing_is_written(capsys, tmp_path, store):
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--scope", "hybrid",
                           "--rank", "2", "--log-out", tmp_path / "day.jsonl")
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
    for verb in ("simulate", "replay"):     # the option given is named, not the store's scope (once --scope)
        more = ["--log", tmp_path / "day.jsonl"] if verb == "replay" else []
        code, _, err = run_cli(capsys, verb, store, *more, "--policies", tmp_path / "p", *SIM, "--kind", "mlp")
        assert code == 2 and err.startswith("error: --kind mlp: ") and err.strip().count("\n") == 0, err
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "p").rglob("*")) == before


@pytest.mark.parametrize("rank", ["0", "-1", "16", "99"])
def test_rank_out_of_range_is_one_line_and_writes_nothing(capsys, tmp_path, store, rank):
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--scope", "hybrid",
                             "--rank", rank)
    assert code == 2 and out == "" and "--rank" in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("verb", ["simulate", "pretrain", "replay"])
@pytest.mark.parametrize("scope", [None, "user", "shared"])
def test_rank_without_hybrid_is_one_line_and_writes_nothing(capsys, tmp_path, store, verb, scope):
    # --rank sizes hybrid's per-user part; with any other scope it would be silently ignored.
    given = ["--scope", scope] if scope else []
    more = {"simulate": ["--policies", tmp_path / "p"], "pretrain": ["--out", tmp_path / "p"],
            "replay": ["--policies", tmp_path / "p", "--log", tmp_path / "missing.jsonl"]}[verb]
    code, out, err = run_cli(capsys, verb, store, *more, "--k", "8", "--m", "3", *given, "--rank", "2")
    assert code == 2 and out == "" and err.strip().count("\n") == 0, err
    assert "--rank 2" in err and "hybrid" in err and (scope or "user") in err, err
    assert not (tmp_path / "p").exists()


def test_rank_without_scope_on_a_user_store_is_refused(capsys, tmp_path, store):
    # Left out, --scope is the store's: a user store with --rank is refused as --scope user is.
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM)
    assert code == 0, err
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "p").rglob("*"))
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--rank", "2")
    assert code == 2 and out == "" and "--rank" in err and "scope is user" in err and err.count("\n") == 1, err
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "p").rglob("*")) == before


def first_batch_log_probs(store, log, params, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the first ``n`` records of a simulate log (the first user's first batch, chosen
    before any update): the logged behaviour log-probability of each selection, the exact
    Plackett–Luce log-probability of that selection under ``params`` at the default preset's
    τ, and the float32 error bound of the latter (f32_error)."""
    records = [json.loads(line) for line in open(log) if line.strip()][:n]
    st = open_store(store)
    s = stream_from_user(st.user(records[0]["user_id"]), 8)
    tau = rj.preset("default").estimator.sample_tau
    logged, recomputed, bounds = [], [], []
    for r in records:
        assert r["user_id"] == s.user_id
        t = s.query_ids.index(r["query_id"])
        cand = [s.memory_ids[j] for j, ok in zip(s.cand[t], s.cand_mask[t]) if ok]
        assert r["candidates"] == cand                      # the log and this stream agree on the candidates
        sel = jnp.asarray([cand.index(x) for x in r["selected"]])
        mask = jnp.asarray(s.cand_mask[t])
        log_prob = lambda p, q, m: rj.selection_log_prob(rj.score(p, q, m, mask), sel, tau, mask=mask)
        args = (params, jnp.asarray(s.queries[t]), jnp.asarray(s.bank[s.cand[t]]))
        recomputed.append(float(log_prob(*args)))
        bounds.append(float(f32_error(log_prob, *args)))
        logged.append(r["log_prob"])
    return np.asarray(logged), np.asarray(recomputed), np.asarray(bounds)


@pytest.mark.parametrize("scope", ["user", "shared", "hybrid"])
def test_pretrained_start_works_for_every_scope(capsys, tmp_path, store, scope):
    # No validation users: the last trained epoch is kept (early stopping could keep the
    # untrained start, which is identity, and then nothing here could tell the two apart).
    code, _, err = run_cli(capsys, "pretrain", store, "--out", tmp_path / "p", "--epochs", "2", "--k", "8", "--m",
                           "3", "--scope", scope, *rank_of(scope), "--checkpoint-every", "0", "--val-fraction", "0")
    assert code == 0, err
    pre = PolicyStore.open(tmp_path / "p").shared_state().state.params
    assert not make_identity_check(pre)
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", "--init", "pretrained", *SIM,
                             "--scope", scope, *rank_of(scope), "--log-out", tmp_path / "log.jsonl", "--json")
    assert code == 0, err
    # The first batch of the first user was drawn before any update, by the starting policy:
    # its logged behaviour log-probabilities are those of the pretrained reranker (a new
    # user's hybrid residual is zero), not those of the identity a run that ignored
    # --init pretrained would have started from.
    batch = rj.preset("default").layout.batch
    logged, under_pre, bound = first_batch_log_probs(store, tmp_path / "log.jsonl", pre, batch)
    _, under_identity, _ = first_batch_log_probs(store, tmp_path / "log.jsonl",
                                                 rj.init_reranker(jax.random.key(0), 16), batch)
    assert len(logged) == batch
    assert_f32_close(logged, under_pre, 2 * bound)             # the loop's float32 and this one's
    assert np.abs(logged - under_identity).max() > 0.05
    ps = PolicyStore.open(tmp_path / "p")
    assert ps.meta["scope"] == scope
    u = ps.users()[0]
    if scope == "user":      # the user's policy started from the pretrained one and moved
        assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                       zip(jax.tree.leaves(user_params(ps, u)), jax.tree.leaves(pre)))
    else:                    # the shared part started from the pretrained one and moved
        assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                       zip(jax.tree.leaves(ps.shared_state().state.params), jax.tree.leaves(pre)))


def failing_drive(after: int, error=MemoryError):
    """``drive`` that raises ``error`` once ``after`` events have passed (the run fails at run time)."""
    from rmm_jax.online import session as online  # where the run calls drive

    real = online.drive

    def drive(*a, **k):
        for i, event in enumerate(real(*a, **k)):
            if i >= after:
                raise error("out of memory (simulated)")
            yield event
    return drive


@pytest.mark.parametrize("verb", ["simulate", "replay"])
def test_a_run_that_fails_before_saving_leaves_no_new_policy_store(capsys, tmp_path, store, monkeypatch, verb):
    # The store the run created held only its scope, kind and identity shared part; left
    # behind, it refused the next run's --scope and read as a store to continue.
    from rmm_jax.online import session as online  # where the run calls drive
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "ref", *SIM, "--log-out",
                           tmp_path / "log.jsonl")
    assert code == 0, err
    args = {"simulate": ["simulate", store], "replay": ["replay", store, "--log", tmp_path / "log.jsonl"]}[verb]
    monkeypatch.setattr(online, "drive", failing_drive(0))
    code, out, err = run_cli(capsys, *args, "--policies", tmp_path / "p", *SIM, "--scope", "shared")
    assert code != 0 and "out of memory" in err and out == "", err
    assert not (tmp_path / "p").exists() and not list(tmp_path.glob(".p*"))     # nothing, no leftover
    monkeypatch.undo()
    code, _, err = run_cli(capsys, *args, "--policies", tmp_path / "p", *SIM, "--scope", "user")
    assert code == 0, err


def test_a_failed_run_keeps_a_store_it_saved_in_or_did_not_create(capsys, tmp_path, store, monkeypatch):
    from rmm_jax.online import session as online  # where the run calls drive
    # users chunks of 2 over 3 users: the first chunk is saved before the failure
    monkeypatch.setattr(online, "drive", failing_drive(10 ** 9))
    events = sum(1 for _ in run_events(store, tmp_path))
    monkeypatch.setattr(online, "drive", failing_drive(events - 1))
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM)
    assert code != 0 and "out of memory" in err
    assert PolicyStore.open(tmp_path / "p").users()            # what it saved stays
    monkeypatch.setattr(online, "drive", failing_drive(0))
    def files():                         # the store's data (a lock file's time changes as it is taken)
        return sorted((p.relative_to(tmp_path), p.read_bytes()) for p in (tmp_path / "p").rglob("*")
                      if p.is_file() and p.name != ".lock")
    before = files()
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--resume")
    assert code != 0 and "out of memory" in err          # a store the run did not create is never removed
    assert files() == before
    # A new store whose run failed after a checkpoint inside its first users chunk: nothing
    # saved in the store yet, but the run-state holds work that --resume continues.
    more = ["--checkpoint-every", "1", "--users-per-chunk", "3"]
    monkeypatch.undo()
    first = next(i for i, e in enumerate(run_events(store, tmp_path, *more)) if type(e).__name__ == "SegmentDone")
    monkeypatch.setattr(online, "drive", failing_drive(first + 1))
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "q", *SIM, *more)
    assert code != 0 and "out of memory" in err
    assert (tmp_path / "q").is_dir() and RunState.interrupted_meta(tmp_path / "q")["segments_done"] >= 1
    monkeypatch.undo()
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "q", *SIM, *more, "--resume")
    assert code == 0, err


def run_events(store, tmp_path, *more):
    """The events of a whole simulate run of ``store`` with SIM and ``more`` (seen by a drive that passes them on)."""
    from rmm_jax.online import session as online  # where the run calls drive
    seen = []
    real = online.drive

    def drive(*a, **k):
        for event in real(*a, **k):
            seen.append(event)
            yield event
    online.drive, keep = drive, online.drive
    try:
        from conftest import main
        main(["simulate", str(store), "--policies", str(tmp_path / "count"), *SIM, *map(str, more)])
        shutil.rmtree(tmp_path / "count")
    finally:
        online.drive = keep
    return seen


@pytest.mark.parametrize("verb", ["simulate", "pretrain"])
def test_a_k_beyond_some_banks_is_noted_with_how_many(capsys, tmp_path, store, verb):
    """retrieve refuses a --k above a bank; the learners ran it without a word, and recorded k
    as given. The note counts the short banks among the users run, from the store's sizes."""
    sizes = open_store(store).bank_sizes
    k = sorted(sizes.values())[1] + 1                 # more than the two smallest banks hold
    short = sorted(n for n in sizes.values() if n < k)
    more = [*SIM, "--policies", tmp_path / "p"] if verb == "simulate" else ["--m", "3", "--out", tmp_path / "p",
                                                                            "--epochs", "1"]
    for given, want in ((k, short), (min(sizes.values()), [])):
        code, _, err = run_cli(capsys, verb, store, *more, "--k", str(given))
        assert code == 0, err
        notes = [ln for ln in err.splitlines() if "is more than the memory bank" in ln]
        assert notes == ([f"note: --k {given} is more than the memory bank of {len(want)} of {len(sizes)} users "
                          f"(the largest of those holds {max(want)}): their queries rank every memory they hold"]
                         if want else []), err
        shutil.rmtree(tmp_path / "p")
    code, _, err = run_cli(capsys, verb, store, *more, "--k", str(k), "--users", "user0,user1")   # those run
    assert f"is more than the memory bank of 2 of 2 users (the largest of those holds {sizes['user0']})" in err, err
