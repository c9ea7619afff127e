"""The production day (docs/lifecycle.md): logs as production writes them (new question texts,
no gold), memory banks that grow, measures without gold, the same learner when a store
continues, serving that explores, and a verdict from evaluate.

Everything runs on a fake store and FakeEmbedder (no model): the real model's texts go
through the same function (``rmm_jax.data.embed.embed_texts``), patched here.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, FakeEmbedder, make_fake_store, run_cli
from helpers import needs_proc_fd, open_fds

import rmm_jax as rj
from rmm_jax.cli.evaluate import rollback_hint
from rmm_jax.core.types import Batch
from rmm_jax.core.update import importance_weights
from rmm_jax.data import embed as embed_mod
from rmm_jax.data import load_spec
from rmm_jax.data.citation_log import pl_log_prob, read_log, timestamp_seconds, validate_record
from rmm_jax.data.store import append_store, open_store, write_store
from rmm_jax.errors import InputError
from rmm_jax.online.driver import ChunkDone, SegmentDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.ope import Calls, cited_recall, estimate
from rmm_jax.online.serve import Reranker, call_keys
from rmm_jax.online.streams import streams_from_log
from rmm_jax.persist.policy_store import PolicyStore

DIM = 16
ONLINE = ["--k", "8", "--m", "3", "--users-per-chunk", "2", "--checkpoint-every", "0"]


@pytest.fixture(autouse=True)
def fake_model(monkeypatch):
    """Texts a store lacks are embedded by FakeEmbedder (the store's model is fake too).
    The CLI's embed verb is imported first: imported while the patch is on, it would keep
    the fake for every later test of its worker (it binds Embedder at import)."""
    import rmm_jax.cli.embed  # noqa: F401
    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: FakeEmbedder(DIM))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("prod") / "store", users=3, sessions=4, dim=DIM)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def production_log(store, tmp_path, *, seed=0):
    """A day as production writes it: every call a new question text under a call_id, no
    gold, one candidate the store lacks carried as text; selections and citations drawn
    at random, with the logging policy's logits and log_prob."""
    st, rng, rows = open_store(store), np.random.default_rng(seed), []
    for uid in st.user_ids:
        u = st.user(uid)
        for i in range(9):
            cands = [{"id": m} for m in rng.choice(u.memory_ids, 7, replace=False)] + \
                [{"id": f"new-{uid}-{i}", "text": f"today {uid} said something new {i}"}]
            ids = [c["id"] for c in cands]
            logits = rng.normal(size=8).round(4)
            sel = [int(j) for j in rng.permutation(8)[:3]]
            cands = [c["id"] if "text" not in c else c for c in cands]
            rows.append({"user_id": uid, "call_id": f"{uid}-c{i}", "query": f"{uid} asks new question {i}",
                         "candidates": cands, "selected": [ids[j] for j in sel],
                         "cited": [ids[j] for j in sel if rng.random() < 0.5],
                         "logits": logits.tolist(), "log_prob": pl_log_prob(logits, sel)})
    return write_jsonl(tmp_path / f"day{seed}.jsonl", rows)


# --------------------------------------------------------------------------- logs as production writes them


def test_replay_learns_from_new_question_texts_without_gold_and_reports_measures_that_need_none(
        capsys, tmp_path, store):
    log = production_log(store, tmp_path)
    code, out, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p", *ONLINE,
                             "--json", "--plot", tmp_path / "day.png")
    assert code == 0, err
    doc = json.loads(out)
    results = json.dumps([doc["online"], doc["base"], doc["cited_curve"]])
    assert "null" not in results and doc["online"]["queries"] == 0 and "recall@3" not in doc["online"]
    calls_cited = sum(1 for line in log.read_text().splitlines() if json.loads(line)["cited"])
    assert doc["online"]["calls"] == 27 and doc["online"]["calls_cited"] == calls_cited
    assert 0 <= doc["online"]["cited_recall@3"] <= 1 and 0 <= doc["base"]["cited_recall@3"] <= 1
    # 27 new questions and 27 new memories, embedded once before the run
    assert (tmp_path / "day.png").stat().st_size > 1000 and "embedded 54 texts the store lacks" in err
    code, out, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p2", *ONLINE)
    assert code == 0, err
    assert "Recall@3 is not measured" in out and "overall" in out


def test_replay_says_which_of_the_texts_the_store_lacks_came_from_the_cache(capsys, tmp_path, store, monkeypatch):
    """A rerun finds every text the store lacks in the embedding cache: it said "embedded 54
    texts" all the same. An embedder that caches as Embedder does (a text embedded once is
    not embedded again) stands in for the model."""
    seen: set[str] = set()

    class Caching(FakeEmbedder):
        def encode(self, texts, desc=""):
            self.texts_embedded += len(set(texts) - seen)
            seen.update(texts)
            return FakeEmbedder(self.dim).encode(texts)

    monkeypatch.setattr(embed_mod, "Embedder", lambda model, progress=False, **kw: Caching(DIM))
    log = production_log(store, tmp_path)
    lacks = "54 texts the store lacks (queries and memories the log carries as text)"
    for run, said in ((1, f"embedded {lacks}\n"), (2, f"{lacks}: 54 from the embedding cache, 0 embedded\n")):
        code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / f"p{run}", *ONLINE)
        assert code == 0 and said in err and err.count("texts the store lacks") == 1, err


def test_a_record_the_store_cannot_resolve_says_what_to_add(capsys, tmp_path, store):
    rec = {"user_id": "user0", "query_id": "prod-0", "candidates": ["D1:1", "D1:2"], "selected": ["D1:1"],
           "cited": []}
    code, _, err = run_cli(capsys, "replay", store, "--log", write_jsonl(tmp_path / "l.jsonl", [rec]),
                           "--policies", tmp_path / "p", *ONLINE)
    assert code == 2 and "l.jsonl:1: key 'query_id': unknown query id 'prod-0'" in err and "'query'" in err


def test_gold_free_cited_recall_is_the_brute_force_share_before_each_update(tmp_path, store):
    """Per call, the loop's counts equal NumPy's: the cited memories among the top-M of the
    policy as it stood before the batch that uses the call (the states after each
    one-batch segment), and among the retriever's first M candidates."""
    records, _ = read_log(production_log(store, tmp_path, seed=1), known=None)
    st = open_store(store)
    vectors = {t: FakeEmbedder(DIM).encode([t])[0] for r in records
               for t in [r.query_text, *(x for x in r.candidate_texts or () if x)]}
    setting = rj.preset("default", k=8, m=3, batch=4, lr=0.05)
    streams = streams_from_log(st, records, setting.layout, vectors=vectors)
    params0 = rj.init_reranker(jax.random.key(0), DIM)
    states, done = [], None
    for ev in drive([streams], make_run(*setting), params0, users_per_chunk=3, segment_batches=1):
        if isinstance(ev, SegmentDone):
            states.append(ev.states.users.params)
        elif isinstance(ev, ChunkDone):
            done = ev
    assert len(states) >= 2          # the policy moved between batches
    for u, s in enumerate(streams):
        out = done.outputs[s.user_id]
        for t in range(s.queries.shape[0]):
            b = t // setting.layout.batch
            p = params0 if b == 0 else jax.tree.map(lambda x: np.asarray(x[u], np.float64), states[b - 1])
            kq, km = (np.asarray(p[a]["W"]["kernel"], np.float64) for a in ("q_adapter", "m_adapter"))
            q, m = s.queries[t].astype(np.float64), s.bank[s.cand[t]].astype(np.float64)
            scores = (m + m @ km) @ (q + q @ kq)
            top = set(np.argsort(-scores, kind="stable")[:3].tolist())
            cited = {int(s.selected[t, j]) for j in range(3) if s.cited[t, j] and s.selected[t, j] >= 0}
            assert out["n_cited"][t] == len(cited) and out["n_shown"][t] == 3
            assert out["hit"][t] == len(cited & top), (s.user_id, t)
            assert out["hit_base"][t] == len(cited & {0, 1, 2})


# --------------------------------------------------------------------------- continue means the same learner


def test_a_continued_run_keeps_the_recorded_setting_and_a_change_is_explicit(capsys, tmp_path, store):
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries"]
    code, _, err = run_cli(capsys, *sim, ":4", "--preset", "reinforce")     # not the default preset's learner
    assert code == 0, err
    code, out, err = run_cli(capsys, *sim, "4:8", "--json")            # no --preset: the store's setting
    assert code == 0, err
    cfg = json.loads(out)["config"]
    assert (cfg["estimator"]["loss"], cfg["optimizer"]["lr"]) == ("reinforce", 3e-4)
    assert "continuing with the learning setting" in err and "loss reinforce, offset 0.0, reference best" in err
    code, out, err = run_cli(capsys, *sim, "8:12", "--lr", "1e-4")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == (f"error: --lr: 0.0001 would change the learning setting policy store "
                                            f"{pol} records (lr 0.0003); leave the option out to continue with it, "
                                            "or add --change-setting")
    code, _, err = run_cli(capsys, *sim, "8:12", "--preset", "default")
    assert code == 2 and "--preset: default would change" in err
    assert "(preset reinforce; loss, offset, reference change" in err
    code, out, err = run_cli(capsys, *sim, "8:12", "--lr", "1e-4", "--change-setting", "--json")
    assert code == 0, err
    assert "changed (--change-setting): lr 0.0003 -> 0.0001" in err
    assert json.loads(out)["setting"]["changed"] == [{"field": "lr", "from": 3e-4, "to": 1e-4}]
    header = json.loads((pol / "policy_store.json").read_text())
    assert header["setting"]["optimizer"]["lr"] == 1e-4 and header["setting"]["estimator"]["loss"] == "reinforce"


def test_an_explicit_preset_is_that_preset_as_it_is_now(capsys, tmp_path, store):
    """A store whose record says ``default`` but holds other values (a change of its own, or the
    default of an older version): left out, the recorded values go on; ``--preset default``
    asks for today's default, which is refused as a change unless ``--change-setting``."""
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries"]
    code, _, err = run_cli(capsys, *sim, ":4", "--lr", "1e-3")                 # recorded: default at 1e-3
    assert code == 0, err
    code, out, err = run_cli(capsys, *sim, "4:8", "--json")
    assert code == 0 and json.loads(out)["config"]["optimizer"]["lr"] == 1e-3, err
    code, out, err = run_cli(capsys, *sim, "8:12", "--preset", "default")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == (f"error: --preset: default would change the learning setting policy store "
                                            f"{pol} records (preset default as it was then: lr 0.001); leave the "
                                            "option out to continue with it, or add --change-setting")
    code, out, err = run_cli(capsys, *sim, "8:12", "--preset", "default", "--change-setting", "--json")
    assert code == 0, err
    assert json.loads(out)["setting"]["changed"] == [{"field": "lr", "from": 1e-3, "to": 3e-4}]


def test_a_store_trained_under_the_default_before_anchored_keeps_its_learner(capsys, tmp_path, store):
    """A store an older version recorded as ``default`` holds that default's values (the loss against
    the policy's best score, lr 1e-4, today's ``realistic``): continued without --preset it learns
    exactly as before (the same parameters as a run under ``realistic``, and says so); --preset
    default asks to move it to the anchored default and names each field that would change."""
    old, ref = tmp_path / "old", tmp_path / "ref"
    sim = lambda pol, *a: run_cli(capsys, "simulate", store, "--policies", pol, *ONLINE, *a)  # noqa: E731
    for pol in (old, ref):
        code, _, err = sim(pol, "--queries", ":4", "--preset", "realistic")
        assert code == 0, err
    header = json.loads((old / "policy_store.json").read_text())
    assert header["setting"]["preset"] == "realistic"
    header["setting"]["preset"] = "default"                        # what the older version wrote,
    for field in ("reference", "draw_tau"):                           # before either field existed
        del header["setting"]["estimator"][field]
    (old / "policy_store.json").write_text(json.dumps(header))
    code, out, err = sim(old, "--queries", "4:8", "--json")
    assert code == 0, err
    cfg = json.loads(out)["config"]
    assert (cfg["estimator"]["reference"], cfg["estimator"]["offset"], cfg["optimizer"]["lr"]) == ("best", 0.0, 1e-4)
    assert "continuing with the learning setting" in err and "reference best" in err
    code, _, err = sim(ref, "--queries", "4:8")
    assert code == 0, err
    a, b = store_loads(old), store_loads(ref)
    assert a.pop("setting")["preset"] == "default" and b.pop("setting")["preset"] == "realistic" and a == b
    code, _, err = sim(old, "--queries", "8:12", "--preset", "anchored")    # the default's other name: a change too
    assert code == 2 and "--preset: anchored would change" in err
    assert "(preset default as it was then: offset 0.0, reference best, lr 0.0001)" in err
    code, out, err = sim(old, "--queries", "8:12", "--preset", "default")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].endswith(
        "records (preset default as it was then: offset 0.0, reference best, lr 0.0001); leave the option out to "
        "continue with it, or add --change-setting")


def test_two_names_of_one_preset_are_no_change_of_setting(capsys, tmp_path, store):
    """A store recorded under ``anchored`` continued with ``--preset default`` (the same fields under
    another name) is neither refused nor re-recorded, and says nothing about a change."""
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries"]
    code, _, err = run_cli(capsys, *sim, ":4", "--preset", "anchored")
    assert code == 0, err
    code, _, err = run_cli(capsys, *sim, "4:8", "--preset", "default")
    assert code == 0, err
    assert "would change" not in err and "changed (--change-setting)" not in err and "continuing with" not in err
    assert json.loads((pol / "policy_store.json").read_text())["setting"]["preset"] == "anchored"
    code, _, err = run_cli(capsys, *sim, "8:12", "--preset", "realistic")     # other fields: still refused
    assert code == 2 and "--preset: realistic would change" in err


def test_judge_rates_are_options_the_store_records(capsys, tmp_path, store):
    """--p-useful/--p-other reach the logistic loss's correction, are recorded with the
    setting, and a bad pair is one line naming the option, before anything is written."""
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries"]
    code, out, err = run_cli(capsys, *sim, ":4", "--p-other", "0.95", "--p-useful", "0.9")
    assert code == 2 and out == "" and not pol.exists() and not pol.with_name("p.runstate").exists()
    assert err.strip().splitlines()[-1] == "error: --p-other: must be in [0, p_useful=0.9), got 0.95"
    code, out, err = run_cli(capsys, *sim, ":4", "--p-useful", "0.8", "--p-other", "0.05", "--json")
    assert code == 0, err
    assert {k: json.loads(out)["config"]["estimator"][k] for k in ("p_useful", "p_other")} == \
        {"p_useful": 0.8, "p_other": 0.05}
    header = json.loads((pol / "policy_store.json").read_text())
    assert (header["setting"]["estimator"]["p_useful"], header["setting"]["estimator"]["p_other"]) == (0.8, 0.05)
    code, out, err = run_cli(capsys, *sim, "4:8", "--p-other", "0.1")
    assert code == 2 and "error: --p-other: 0.1 would change the learning setting" in err


def test_the_pairwise_loss_learns_and_refuses_judge_rates_in_one_line(capsys, tmp_path, store):
    """--loss pairwise runs and is recorded (over a preset read against the best score: the default's
    retriever anchor is the logistic loss's); with judge rates (given, or from --preset calibrated)
    it is one line naming --loss, before anything is written."""
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries", ":4", "--loss", "pairwise", "--preset",
           "realistic"]
    for extra in (["--p-useful", "0.9", "--p-other", "0.1"], ["--preset", "calibrated"]):
        code, out, err = run_cli(capsys, *sim, *extra)
        assert code == 2 and out == "" and not pol.exists() and not pol.with_name("p.runstate").exists()
        assert err.strip().splitlines()[-1] == (
            "error: --loss: the pairwise loss takes no judge rates or offset (--p-useful, --p-other, --offset; "
            "--preset calibrated sets the rates and offset): drop them, or use --loss logistic")
    for extra in ([], ["--preset", "anchored"]):        # the default and its earlier name
        code, out, err = run_cli(capsys, "simulate", store, "--policies", pol, *ONLINE, "--queries", ":4", *extra,
                                 "--loss", "reinforce")
        assert code == 2 and out == "" and not pol.exists()
        assert err.strip().splitlines()[-1] == (
            "error: --loss: the default preset (and 'anchored') reads the logistic loss against the retriever's "
            "best score: leave --loss out (logistic), or use another --preset (realistic, reinforce)")
    # from Python the same check names the fields a caller passes, not the CLI's options
    from rmm_jax.core.config import preset

    for kw in (dict(p_useful=0.9, p_other=0.1), dict(offset=-1.0)):
        with pytest.raises(ValueError, match=r"^loss: the pairwise loss takes no judge rates or offset \(p_useful, "
                                             r"p_other, offset; preset 'calibrated' sets them\): drop them, or use "
                                             r"loss='logistic'$"):
            preset("realistic", loss="pairwise", **kw)
    code, out, err = run_cli(capsys, *sim, "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["estimator"]["loss"] == "pairwise"
    assert json.loads((pol / "policy_store.json").read_text())["setting"]["estimator"]["loss"] == "pairwise"


def test_a_draw_temperature_is_an_option_the_store_records_and_serving_draws_at(capsys, tmp_path, store):
    """--draw-tau reaches the estimator, is recorded with the setting, and is the temperature
    `rerank --explore` draws at by default on that store; a bad value is one line naming it, and
    another value on that store is a change of setting, refused without --change-setting."""
    from rmm_jax.online.serve import behaviour_tau
    from rmm_jax.persist.policy_store import PolicyStore

    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries", ":4"]
    code, out, err = run_cli(capsys, *sim, "--draw-tau", "0")
    assert code == 2 and out == "" and not pol.exists() and not pol.with_name("p.runstate").exists()
    assert err.strip().splitlines()[-1] == "error: --draw-tau: must be > 0, got 0.0"
    code, out, err = run_cli(capsys, *sim, "--draw-tau", "0.02", "--json")
    assert code == 0, err
    est = json.loads(out)["config"]["estimator"]
    assert (est["draw_tau"], est["tau"]) == (0.02, rj.preset("default").estimator.tau)
    assert json.loads((pol / "policy_store.json").read_text())["setting"]["estimator"]["draw_tau"] == 0.02
    assert behaviour_tau(PolicyStore.open(pol)) == 0.02
    code, out, err = run_cli(capsys, "simulate", store, "--policies", pol, *ONLINE, "--queries", "4:8",
                             "--draw-tau", "0.05")
    assert code == 2 and "error: --draw-tau: 0.05 would change the learning setting" in err
    # a store that draws at the loss's tau (none recorded): a draw temperature is a change too, not
    # used for one run and dropped (it was: the record kept None and the next run drew at tau)
    tau_store = tmp_path / "t"
    at_tau = ["simulate", store, "--policies", tau_store, *ONLINE, "--queries"]
    assert run_cli(capsys, *at_tau, ":4")[0] == 0
    code, out, err = run_cli(capsys, *at_tau, "4:8", "--draw-tau", "0.02")
    assert code == 2 and out == "" and err.strip().splitlines()[-1] == (
        f"error: --draw-tau: 0.02 would change the learning setting policy store {tau_store} records (draw_tau none "
        "(the loss's tau)); leave the option out to continue with it, or add --change-setting")
    assert behaviour_tau(PolicyStore.open(tau_store)) == rj.preset("default").estimator.tau
    code, out, err = run_cli(capsys, *at_tau, "4:8", "--draw-tau", "0.02", "--change-setting", "--json")
    assert code == 0, err
    assert "draw_tau none (the loss's tau) -> 0.02" in err and behaviour_tau(PolicyStore.open(tau_store)) == 0.02


def test_an_offset_is_an_option_the_store_records_and_a_loss_without_one_refuses_it(capsys, tmp_path, store):
    """--offset reaches the logistic loss, is recorded with the setting and continued with when
    left out; another value is a change of setting, refused without --change-setting; with a loss
    that reads no offset it is one line naming --offset, before anything is written."""
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries"]
    code, out, err = run_cli(capsys, *sim, ":4", "--preset", "realistic", "--loss", "reinforce", "--offset", "1")
    assert code == 2 and out == "" and not pol.exists() and not pol.with_name("p.runstate").exists()
    assert err.strip().splitlines()[-1] == ("error: --offset 1: only the logistic loss reads an offset (the logit of a "
                                            "memory scored at its anchor); this run's loss is 'reinforce'")
    # a preset's own offset under another loss is not the user's: calibrated (offset -1) with REINFORCE runs
    code, out, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "q", *ONLINE, "--queries", ":4",
                             "--preset", "calibrated", "--loss", "reinforce", "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["estimator"]["loss"] == "reinforce"
    code, out, err = run_cli(capsys, *sim, ":4", "--offset", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["estimator"]["offset"] == 0.0 != rj.preset("default").estimator.offset
    assert json.loads((pol / "policy_store.json").read_text())["setting"]["estimator"]["offset"] == 0.0
    code, out, err = run_cli(capsys, *sim, "4:8", "--json")      # left out: the recorded offset
    assert code == 0, err
    assert json.loads(out)["config"]["estimator"]["offset"] == 0.0
    code, out, err = run_cli(capsys, *sim, "8:12", "--offset", "2")
    assert code == 2 and "error: --offset: 2.0 would change the learning setting" in err


def test_a_store_learning_with_reinforce_continues_when_only_the_loss_is_given_again(capsys, tmp_path, store):
    """A store recorded under `--preset realistic --loss reinforce`, continued with `--loss reinforce`
    and no --preset: the recorded setting goes on (the options alone, over today's default, name no
    setting, and the note that says what is continued must not fail on them)."""
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries"]
    code, out, err = run_cli(capsys, *sim, ":4", "--preset", "realistic", "--loss", "reinforce")
    assert code == 0, err
    code, out, err = run_cli(capsys, *sim, "4:8", "--loss", "reinforce", "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["estimator"]["loss"] == "reinforce"
    assert "continuing with the learning setting" in err and "preset realistic" in err, err


def test_a_query_range_that_holds_no_question_writes_nothing(capsys, tmp_path, store):
    pol = tmp_path / "p"
    code, out, err = run_cli(capsys, "simulate", store, "--policies", pol, *ONLINE, "--queries", "1000:")
    assert code == 2 and out == "" and not pol.exists() and not pol.with_name("p.runstate").exists()
    from rmm_jax.data.store import open_store as _open
    most = max(_open(store).query_count(u) for u in _open(store).user_ids)
    assert err.strip().splitlines()[-1] == (f"error: {store}: no user has a question in that --queries range "
                                            f"(the users hold at most {most} questions, from 0)")
    # the API names its argument: a Python caller passes queries=, it has no --queries
    from rmm_jax.data.store import open_store
    from rmm_jax.errors import InputError
    from rmm_jax.online.streams import store_chunks

    with pytest.raises(InputError, match=r"^[^\n]*: no user has a question in queries=\(1000, None\) "
                                         r"\(the users hold at most \d+ questions, from 0\)$"):
        store_chunks(open_store(store), 8, None, 2, queries=(1000, None))


# --------------------------------------------------------------------------- serving that explores


def served(capsys, tmp_path, store, *extra, name="served.jsonl"):
    st = open_store(store)
    calls = [{"call_id": f"r{i}", "user_id": uid, "query": f"{uid} wants to know thing {i}"}
             for i, uid in enumerate(st.user_ids * 4)]
    calls.append({"call_id": "t1", "user_id": "user0", "query": "a text-only call",
                  "candidate_texts": ["alpha beta", "beta gamma", "gamma delta", "delta alpha"]})
    calls.append({"user_id": "user1", "query_id": st.user("user1").query_ids[0]})
    path = write_jsonl(tmp_path / "calls.jsonl", calls)
    code, _, err = run_cli(capsys, "rerank", store, "--calls", path, "--m", "3", "--k", "8", "--explore",
                           "--out", tmp_path / name, *extra)
    assert code == 0, err
    return [json.loads(x) for x in (tmp_path / name).read_text().splitlines()], err


def test_served_lines_are_log_records_that_replay_and_evaluate_read_once_cited_is_added(capsys, tmp_path, store):
    lines, err = served(capsys, tmp_path, store)
    assert "serving the identity reranker" in err
    for line in lines:
        rec = validate_record(line, served=True)
        assert "cited" not in line and line["policy_version"] is None and rec.logits is not None
        assert abs(pl_log_prob(rec.logits, [rec.candidates.index(x) for x in rec.selected]) - rec.log_prob) < 1e-4
    assert lines[-2]["candidates"][0] == {"id": lines[-2]["candidates"][0]["id"], "text": "alpha beta"}
    rng = np.random.default_rng(0)
    log = write_jsonl(tmp_path / "day.jsonl", [{**x, "cited": [s for s in x["selected"] if rng.random() < 0.5]}
                                               for x in lines])
    code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p", *ONLINE)
    assert code == 0, err
    code, out, err = run_cli(capsys, "evaluate", store, "--log", log, "--policies", tmp_path / "p", "--k", "8",
                             "--m", "3", "--min-ess", "0", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["verdict"]["metric"] == "cite_rate" and isinstance(rep["verdict"]["ship"], bool)
    gain = rep["estimates"]["cite_rate"]["snips"]["gain"]
    assert gain["ci95"][0] <= gain["value"] <= gain["ci95"][1]


def test_evaluate_on_the_log_its_own_versions_served_gives_no_verdict_and_no_rollback(capsys, tmp_path, store):
    """The day rerank served with POLICIES' own versions (policy_version and shared_version on
    every line), evaluated with the same POLICIES: every weight is 1 and the gain 0 by
    construction. Before: 'do not ship (... [-5.1e-08, +4.4e-08] contains 0)' and a rollback
    hint whose dry run removes every user's policy. Now: no verdict, saying so, and no hint.
    The same log without its version keys: the policies' probabilities agree with the logged
    ones to float32 rounding, no verdict either. Once the night's replay has saved newer
    versions, the same log judges them."""
    pol = tmp_path / "p"
    code, _, err = run_cli(capsys, "replay", store, *ONLINE, "--scope", "hybrid", "--rank", "2", "--log",
                           production_log(store, tmp_path, seed=1), "--policies", pol)
    assert code == 0, err
    lines, _ = served(capsys, tmp_path, store, "--policies", pol)
    assert all(x["policy_version"] is not None and x["shared_version"] is not None for x in lines)
    rng = np.random.default_rng(0)
    log = write_jsonl(tmp_path / "day2.jsonl", [{**x, "cited": [s for s in x["selected"] if rng.random() < 0.5]}
                                                for x in lines])
    ev = ["evaluate", store, "--log", log, "--policies", pol, "--k", "8", "--m", "3", "--min-ess", "0",
          "--bootstrap", "50"]
    code, out, err = run_cli(capsys, *ev, "--json")
    assert code == 0, err
    v = json.loads(out)["verdict"]
    assert v["self_served"] and v["served_by_target"] == len(lines) and not v["ship"] and not v["worse"], v
    code, out, err = run_cli(capsys, *ev)
    assert code == 0 and "rollback" not in err, err
    assert out.splitlines()[-1].startswith(f"verdict: none (snips on cite_rate: POLICIES served all {len(lines)} "
                                           "of these calls"), out
    # the same day without the version keys (an application's own log): float32 rounding alone decided
    # (before: 'ship (... [+2.2e-09, +3.1e-08] lies above 0)' or 'do not ship (... [-3.1e-08, -1.2e-09] lies
    # below 0)' and a rollback hint, by the seed of the citations); now the probabilities agree to float32
    unversioned = write_jsonl(tmp_path / "own.jsonl", [{k: x[k] for k in x if not k.endswith("_version")}
                                                       for x in map(json.loads, log.read_text().splitlines())])
    code, out, err = run_cli(capsys, *ev, "--json", "--log", unversioned)
    v = json.loads(out)["verdict"]
    assert code == 0 and v["self_served"] and v["served_by_target"] == len(lines) and not v["ship"], v
    code, out, err = run_cli(capsys, *ev, "--log", unversioned)
    assert code == 0 and "rollback" not in err, err
    assert out.splitlines()[-1].startswith("verdict: none (snips on cite_rate: the target and the logging policy "
                                           f"agree to float32 rounding on all {len(lines)} of these calls"), out
    code, _, err = run_cli(capsys, "replay", store, *ONLINE, "--log", log, "--policies", pol)
    assert code == 0, err
    code, out, err = run_cli(capsys, *ev, "--json")
    v = json.loads(out)["verdict"]
    assert not v["self_served"] and v["served_by_target"] < len(lines), v


def test_replay_and_evaluate_note_each_misspelt_key_once_on_stderr(capsys, tmp_path, store):
    """A log's unknown keys are ignored; one that looks like a misspelt log key gets ONE note
    line per key (not per line) from replay and evaluate, naming the first line that has
    it; a logger's own keys get none."""
    lines, _ = served(capsys, tmp_path, store)
    extra = {"answer": "...", "model": "gpt-x", "latency_ms": 812}
    log = write_jsonl(tmp_path / "day.jsonl", [
        {**x, "cited": x["selected"][:1], **extra, **({"timestmap": "2024-05-01", "log_porb": -1.0} if i >= 2 else {})}
        for i, x in enumerate(lines)])
    want = [f"note: {log}:3: key 'timestmap' is not a log key and was ignored (did you mean 'timestamp'?)",
            f"note: {log}:3: key 'log_porb' is not a log key and was ignored (did you mean 'log_prob'?)"]
    for argv in (["replay", store, "--log", log, "--policies", tmp_path / "p", *ONLINE],
                 ["evaluate", store, "--log", log, "--policies", tmp_path / "p", "--k", "8", "--m", "3",
                  "--min-ess", "0", "--allow-unreliable"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        noted = [x for x in err.splitlines() if x.startswith("note: ") and "is not a log key" in x]
        assert noted == want, err


def test_evaluate_missing_log_prob_names_the_misspelt_key_it_has(capsys, tmp_path, store):
    """evaluate stops at the first record without log_prob or logits, before the notes are
    printed: when the log holds a misspelt log_prob, the one error line names it."""
    lines, _ = served(capsys, tmp_path, store)
    good = write_jsonl(tmp_path / "good.jsonl", [{**x, "cited": x["selected"][:1]} for x in lines])
    code, _, err = run_cli(capsys, "replay", store, "--log", good, "--policies", tmp_path / "p", *ONLINE)
    assert code == 0, err
    log = write_jsonl(tmp_path / "day.jsonl", [
        {**{k: v for k, v in x.items() if k not in ("log_prob", "logits")}, "log_porb": x["log_prob"],
         "cited": x["selected"][:1]} for x in lines])
    code, out, err = run_cli(capsys, "evaluate", store, "--log", log, "--policies", tmp_path / "p",
                             "--k", "8", "--m", "3")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {log}:1: key 'log_prob': missing: "), err
    assert err.rstrip().endswith("key 'log_porb' is not a log key and was ignored (did you mean 'log_prob'?)"), err


def test_explore_reproduces_with_its_seed_and_differs_with_another(capsys, tmp_path, store):
    a, _ = served(capsys, tmp_path, store, name="a.jsonl")
    b, _ = served(capsys, tmp_path, store, name="b.jsonl")
    c, _ = served(capsys, tmp_path, store, "--seed", "1", name="c.jsonl")
    unstamped = lambda lines: [{k: v for k, v in x.items() if k != "timestamp"} for x in lines]
    assert unstamped(a) == unstamped(b)           # the draw depends on the seed and the call, not on the time
    # the requests have no timestamp: each line has the time it was served, b's after a's
    ta, tb = ([timestamp_seconds(x["timestamp"]) for x in lines] for lines in (a, b))
    assert np.isfinite(ta + tb).all() and ta == sorted(set(ta)) and max(ta) < min(tb), (ta, tb)
    assert [x["selected"] for x in a] != [x["selected"] for x in c]
    assert [x["logits"] for x in a] == [x["logits"] for x in c]


def test_explore_draws_match_the_plackett_luce_probabilities_it_logs():
    """30,000 draws of one call (K=4, M=2): every ordered pair's frequency lies within 4.5
    standard errors of exp(log_prob) it logs, and those are the exact PL probabilities."""
    rr = Reranker(None, dim=3)
    q = np.array([1.0, 0.0, 0.0], np.float32)
    cands = np.array([[1.0, 0, 0], [0.6, 0.8, 0], [0, 1.0, 0], [-0.5, 0, 0.866]], np.float32)
    n = 30_000
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(n))
    got = rr.sample("u", np.repeat(q[None], n, 0), cands, 2, keys=keys, tau=0.5)
    pairs, counts = np.unique(got.selected, axis=0, return_counts=True)
    logits = cands @ q / 0.5
    assert len(pairs) == 12
    for pair, count in zip(pairs, counts):
        p = np.exp(pl_log_prob(logits, pair.tolist()))
        logged = got.log_prob[(got.selected == pair).all(1)]
        # float32 log-prob: M log-sum-exps over K logits, each term at most max|logit| + log K;
        # gamma_n (Higham) with a generous n = 8 K M operations bounds its absolute error
        n_ops, eps = 8 * 4 * 2, np.finfo(np.float32).eps / 2
        bound = n_ops * eps / (1 - n_ops * eps) * 2 * (np.abs(logits).max() + np.log(4))
        np.testing.assert_array_less(np.abs(logged - np.log(p)), bound)
        assert abs(count / n - p) <= 4.5 * np.sqrt(p * (1 - p) / n), (pair, count / n, p)


def test_explore_before_any_policy_is_on_policy_for_an_identity_replay(capsys, tmp_path, store):
    """The identity reranker's served log_prob is what replay computes from the identity
    policy: every importance ratio is exactly 1."""
    lines, _ = served(capsys, tmp_path, store)
    path = write_jsonl(tmp_path / "day.jsonl", [{**x, "cited": x["selected"][:1]} for x in lines])
    records, _ = read_log(path)
    st = open_store(store)
    vectors = {t: FakeEmbedder(DIM).encode([t])[0] for r in records
               for t in [r.query_text, *(x for x in r.candidate_texts or () if x)] if t}
    setting = rj.preset("default", k=8, m=3)
    params = rj.init_reranker(jax.random.key(0), DIM)
    for s in streams_from_log(st, records, setting.layout, vectors=vectors):
        m = s.bank[s.cand]
        scores = rj.score_batch(params, jnp.asarray(s.queries), jnp.asarray(m), jnp.asarray(s.cand_mask))
        batch = Batch(q=s.queries, m=m, mask=s.cand_mask, valid=np.ones(len(s.queries), bool), selected=s.selected,
                      cited=s.cited, gumbel=jnp.zeros_like(scores), logged_log_prob=s.logged_log_prob,
                      has_logged=s.has_logged, scores=scores)
        assert s.has_logged.all()
        assert np.all(np.asarray(importance_weights(setting.estimator, scores, batch)) == 1.0)


def test_sample_keys_derive_from_seed_user_and_call():
    def by_hand(seed, user, call):          # the documented derivation, one fold at a time
        h = hashlib.sha256(call.encode()).digest()
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(user.encode()) & 0x7FFFFFFF)
        for i in (0, 4):
            key = jax.random.fold_in(key, int.from_bytes(h[i:i + 4], "little") & 0x7FFFFFFF)
        return jax.random.key_data(key).tolist()

    cases = [(0, "u1", "call:c1"), (1, "u1", "call:c1"), (0, "u2", "call:c1"), (0, "u1", "call:c2"),
             (2**40 + 3, "u1", "call:c1")]
    got = [jax.random.key_data(call_keys(s, u, [c, "call:other"])[0]).tolist() for s, u, c in cases]
    assert got == [by_hand(*c) for c in cases]
    assert len({tuple(g) for g in got}) == 5
    both = call_keys(0, "u1", ["call:c1", "call:c2"])
    assert jax.random.key_data(both).tolist() == [by_hand(0, "u1", "call:c1"), by_hand(0, "u1", "call:c2")]


# --------------------------------------------------------------------------- the verdict


@pytest.mark.parametrize("name", ["ips", "snips"])
def test_the_gain_interval_is_a_paired_bootstrap_of_the_per_call_difference(name):
    rng = np.random.default_rng(3)
    n, boots = 40, 300
    w, r = rng.gamma(2.0, 0.5, n), (rng.random(n) < 0.4).astype(float)
    est = estimate(name, w[:, None], r[:, None], bootstrap=boots, seed=5, logged=r)
    draws = np.random.default_rng(5).integers(0, n, size=(boots, n))
    value = (lambda i: (w[i] * r[i]).mean()) if name == "ips" else (lambda i: (w[i] * r[i]).sum() / w[i].sum())
    diffs = np.array([value(i) - r[i].mean() for i in draws])
    np.testing.assert_allclose(est["gain"]["ci95"], np.quantile(diffs, [0.025, 0.975]), rtol=1e-12)
    np.testing.assert_allclose(est["gain"]["value"], value(np.arange(n)) - r.mean(), rtol=1e-12)


def store_loads(path) -> dict:
    """What a reader of policy store ``path`` loads: per user its state and learned calls
    (bytes), the shared part that serves (its state and info: not its number, which a store
    that rolled a run back has handed out and does not reuse), and the learning setting."""
    ps = PolicyStore.open(path)
    out = {u: [np.asarray(x).tobytes() for x in jax.tree.leaves((got.state, got.learned))]
           for u in ps.users() for got in [ps.load(u)]}
    shared = ps.shared_state(ps.learned_shared_version())
    out["shared"] = [np.asarray(x).tobytes() for x in jax.tree.leaves((shared.state, shared.info))]
    out["setting"] = json.loads((path / "policy_store.json").read_text()).get("setting")
    return out


def test_not_shipping_a_night_rolls_it_back_and_the_next_replay_ends_as_if_it_never_ran(capsys, tmp_path, store):
    """evaluate says no: `policies rollback` undoes the night's replay (its step size changed
    with --change-setting), so the store loads what it did before, bit for bit, setting
    included; replaying the day again learns each of its calls once more, and ends with the
    policies of a store that never ran the rolled-back night."""
    pol, ref = tmp_path / "p", tmp_path / "ref"
    day1 = production_log(store, tmp_path, seed=1)
    day2 = write_jsonl(tmp_path / "day2.jsonl", [{**r, "call_id": r["call_id"] + "-day2"} for r in map(
        json.loads, production_log(store, tmp_path, seed=2).read_text().splitlines())])
    replay = ["replay", store, *ONLINE, "--scope", "hybrid", "--rank", "2", "--log"]
    for p in (pol, ref):
        assert run_cli(capsys, *replay, day1, "--policies", p)[0] == 0
    before = store_loads(pol)
    code, _, err = run_cli(capsys, *replay, day2, "--policies", pol, "--lr", "0.05", "--change-setting")
    assert code == 0, err
    assert store_loads(pol) != before
    code, out, err = run_cli(capsys, "evaluate", store, "--log", day2, "--policies", pol, "--json",
                             "--allow-unreliable", "--bootstrap", "50", "--min-ess", "5")   # 27 calls: below 30
    v = json.loads(out)["verdict"]
    assert code == 0 and not v["ship"], err
    # the verdict's estimate is not reliable and below the logged value: no rollback hint (docs/lifecycle.md);
    # rolling back is the team's call here (the changed setting), and rollback_hint is tested below
    assert not v["worse"] and "policies rollback" not in err, err
    files = sorted(str(f) for f in pol.rglob("*"))
    code, out, err = run_cli(capsys, "policies", "rollback", pol, "--dry-run", "--json")
    assert code == 0 and sorted(str(f) for f in pol.rglob("*")) == files, err
    dry = json.loads(out)
    assert not dry["done"] and dry["users"] == ["user0", "user1", "user2"] and dry["removed"] == []
    code, out, err = run_cli(capsys, "policies", "rollback", pol)
    assert code == 0, err
    assert out.splitlines()[0] == (f"rolled back {pol} to v{dry['to']}: forgot v{dry['versions'][0]}-"
                                   f"v{dry['versions'][-1]}; 3 users back at an earlier version, 0 new since "
                                   f"v{dry['to']} removed")
    assert store_loads(pol) == before
    for p in (pol, ref):
        code, out, err = run_cli(capsys, *replay, day2, "--policies", p, "--json")
        assert code == 0, err
        assert json.loads(out)["log"]["calls"]["learn"] == 27
    assert store_loads(pol) == store_loads(ref)
    learned = [PolicyStore.open(p).learned_shared_version() for p in (pol, ref)]
    assert learned[0] > learned[1]          # the rolled-back night's shared number is not handed out again
    assert rollback_hint(PolicyStore.create(tmp_path / "empty", {"kind": "linear", "dim": DIM, "hidden": None}, {}),
                         "empty") is None                          # no run saved it: no hint
    code, out, err = run_cli(capsys, "policies", "rollback", pol, "--to", "999")
    assert code == 2 and out == "" and err.strip().splitlines() == [
        f"error: {pol}: nothing to roll back: v999 is not below the newest user version (v{dry['versions'][-1] + 2})"]



def test_evaluate_notes_the_calls_the_policies_learned_and_blames_a_broken_log_without_a_rollback(
        capsys, tmp_path, store):
    """Evaluating on the very log the policies just learned from: one stderr note (and
    ``learned_calls`` in --json) counts the calls they learned from, as the policy store
    remembers them; a later day's log has none. A log whose log_prob are all 0 (its
    propensities are wrong) is not the policies' fault: no `policies rollback` hint, no
    --clip, a warning that the log cannot judge them."""
    pol = tmp_path / "p"
    day1, day2 = production_log(store, tmp_path, seed=1), production_log(store, tmp_path, seed=2)
    day2 = write_jsonl(tmp_path / "day2b.jsonl", [{**r, "call_id": r["call_id"] + "-day2"} for r in map(
        json.loads, day2.read_text().splitlines())])
    code, _, err = run_cli(capsys, "replay", store, *ONLINE, "--log", day1, "--policies", pol)
    assert code == 0, err
    ev = ["evaluate", store, "--policies", pol, "--k", "8", "--m", "3", "--bootstrap", "50", "--allow-unreliable"]
    n = len(day1.read_text().splitlines())
    code, out, err = run_cli(capsys, *ev, "--log", day1, "--json")
    assert code == 0, err
    assert (f"note: the policies learned from {n} of these {n} calls: an estimate on the calls they learned from "
            "can be optimistic; evaluate on a later day's log") in err.splitlines()
    learned = json.loads(out)["learned_calls"]
    assert (learned["calls"], learned["learned"], learned["older"]) == (n, n, 0)
    code, out, err = run_cli(capsys, *ev, "--log", day2, "--json")
    assert code == 0 and "learned from" not in err, err
    assert json.loads(out)["learned_calls"] == {"calls": n, "learned": 0, "older": 0, "note": None}
    code, out, err = run_cli(capsys, *ev, "--log", day1, "--users", "user0", "--json")
    assert json.loads(out)["learned_calls"]["learned"] == n // 3
    broken = write_jsonl(tmp_path / "lp0.jsonl", [{**{k: v for k, v in r.items() if k != "logits"}, "log_prob": 0.0}
                                                  for r in map(json.loads, day2.read_text().splitlines())])
    code, out, err = run_cli(capsys, *ev, "--log", broken)
    assert code == 0 and "verdict: do not ship: the log cannot judge these policies" in out, out
    # 27 calls, fewer than --min-ess: the log's size first, with its log_prob to check (weights far from 1)
    assert "check that each record's log_prob is the probability the logging policy drew its selection with" in err
    assert "try --clip" not in err
    assert "rollback" not in err.replace("Neither --clip nor a rollback helps", ""), err
    assert rollback_hint(PolicyStore.open(pol), pol) is not None       # a run saved these: the hint was withheld


# --------------------------------------------------------------------------- memory banks grow


def session(sid, texts, date):
    return {"session_id": sid, "timestamp": date, "messages": [{"role": "user", "content": t} for t in texts]}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


class CountingEmbedder(FakeEmbedder):
    def __init__(self, dim=DIM):
        super().__init__(dim)
        self.texts = []

    def encode(self, texts, desc=""):
        self.texts += list(texts)
        return super().encode(texts, desc)


@pytest.fixture
def days(tmp_path):
    d1 = [{"user_id": "a", "sessions": [session("s1", ["I adopted a puppy named Max", "hello"], "2024-05-01")],
           "questions": [{"id": "q1", "question": "dog name?", "gold_turn_ids": ["s1:0"]}]},
          {"user_id": "b", "sessions": [session("s1", ["My sister moved to Lisbon"], "2024-05-01")]}]
    d2 = [{"user_id": "a", "sessions": [session("s1", ["I adopted a puppy named Max", "hello"], "2024-05-01"),
                                        session("s2", ["I started piano lessons"], "2024-05-02")],
           "questions": [{"id": "q2", "question": "which lessons?", "gold_turn_ids": ["s2:0"]}]},
          {"user_id": "c", "sessions": [session("s1", ["a new user arrives"], "2024-05-02")]}]
    store = tmp_path / "store"
    write_store(store, load_spec(f"jsonl:{write_jsonl(tmp_path / 'd1.jsonl', d1)}"), "turn", FakeEmbedder(DIM))
    return store, f"jsonl:{write_jsonl(tmp_path / 'd2.jsonl', d2)}", d2


def test_append_embeds_only_new_texts_and_keeps_every_existing_row(days):
    store, spec, _ = days
    before = open_store(store)
    old = {u: before.user(u) for u in before.user_ids}
    emb = CountingEmbedder()
    res = append_store(store, load_spec(spec), emb, spec=spec)
    assert sorted(emb.texts) == sorted(["user: I started piano lessons", "user: a new user arrives", "which lessons?"])
    assert res["added"] == {"users": 1, "sessions": 2, "sessions_repeated": 1, "memories": 2, "queries": 1,
                            "queries_repeated": 0, "users_without_text": 0,
                            "skipped": load_spec(spec).stats["skipped"]}
    st = open_store(store)
    assert st.user_ids == ("a", "b", "c")
    for uid, u in old.items():
        new = st.user(uid)
        n, nq = len(u.memory_ids), len(u.query_ids)
        assert new.memory_ids[:n] == u.memory_ids and new.query_ids[:nq] == u.query_ids
        assert new.memory_emb[:n].tobytes() == u.memory_emb.tobytes()
        assert new.query_emb[:nq].tobytes() == u.query_emb.tobytes()
    a = st.user("a")
    assert a.memory_ids == ("s1:0", "s1:1", "s2:0") and a.gold[1].tolist() == [False, False, True]
    emb = CountingEmbedder()
    again = append_store(store, load_spec(spec), emb, spec=spec)       # the same day twice: nothing new
    assert emb.texts == [] and again["added"]["sessions_repeated"] == 3 and again["added"]["queries_repeated"] == 1


def test_append_counts_its_skips_and_keeps_the_manifest_totals_the_stores(tmp_path, days):
    """After an append the manifest's stats were the first build's: ``skipped`` all zero
    though the day's file skipped messages (said on stderr), ``sessions``, ``turns`` and
    ``questions`` stale, and the ``appends`` entry without the skips. Each append's entry and
    ``added`` carry its file's skips; the totals add them up and count the grown store."""
    store, _, d2 = days
    d2[0]["sessions"][1]["messages"] += [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": [{"type": "text", "text": "and chess"}, IMAGE]}]
    d2[0]["questions"].append({"id": "q3", "question": "anything?"})
    spec = f"jsonl:{write_jsonl(tmp_path / 'd2.jsonl', d2)}"
    day1, day2 = open_store(store).manifest["stats"], load_spec(spec, gold_elsewhere=True).stats
    assert day2["skipped"]["instructions"] == 1 and day2["skipped"]["non_text_parts"] == 1
    res = append_store(store, load_spec(spec, gold_elsewhere=True), FakeEmbedder(DIM), spec=spec)
    st = open_store(store)
    stats = st.manifest["stats"]
    assert stats == res["manifest"]["stats"] and res["added"]["skipped"] == day2["skipped"]
    assert stats["appends"][-1]["skipped"] == day2["skipped"]
    assert stats["skipped"] == {k: day1["skipped"][k] + day2["skipped"][k] for k in day2["skipped"]
                                if k != "first_errors"} | {"first_errors": []}
    assert stats["questions"] == len(st.queries) == 3
    assert stats["turns"] == sum(len(r["turn_ids"]) for r in st.memories) == 6
    assert stats["sessions"] == len({(r["user"], r["session_id"]) for r in st.memories}) == 4
    assert stats["no_gold"] == day1["no_gold"] + 1 and stats["lines"] == day1["lines"] + day2["lines"]
    assert stats.get("memories", len(st.memories)) == len(st.memories)
    # the same day again adds nothing: the manifest, and its skip counts, stay as they were
    again = append_store(store, load_spec(spec, gold_elsewhere=True), FakeEmbedder(DIM), spec=spec)
    assert open_store(store).manifest["stats"] == stats and again["manifest"]["stats"] == stats


def earlier_day(tmp_path, name, questions, user="a"):
    """A day-2 file with a new session s2 for ``user`` whose ``questions`` may name day 1's turns."""
    rows = [{"user_id": user, "sessions": [session("s2", ["I started piano lessons"], "2024-05-02")],
             "questions": questions}]
    return f"jsonl:{write_jsonl(tmp_path / name, rows)}"


def test_a_question_about_an_earlier_day_gets_its_gold_from_the_store(tmp_path, days):
    # A day file's question could name only its own file's turns: gold on day 1's memories,
    # already in the store, was refused as "unknown turn id", so the question went without it.
    from rmm_jax.data.retrieval import evaluate_store
    store, _, _ = days
    spec = earlier_day(tmp_path, "day2.jsonl", [
        {"id": "q2", "question": "my dog and my lessons?", "gold_turn_ids": ["s1:0", "s2:0"]},
        {"id": "q3", "question": "what did we say on day one?", "gold_session_ids": ["s1"]}])
    before = open_store(store).user("a")
    ds = load_spec(spec, gold_elsewhere=True)
    assert ds.stats["no_gold"] == 0
    res = append_store(store, ds, FakeEmbedder(DIM), spec=spec)
    assert res["added"]["queries"] == 2 and res["added"]["memories"] == 1
    st = open_store(store)
    a = st.user("a")
    assert a.memory_ids == ("s1:0", "s1:1", "s2:0") and a.query_ids == ("q1", "q2", "q3")
    assert a.gold.tolist() == [[True, False, False], [True, False, True], [True, True, False]]
    assert a.memory_emb[:2].tobytes() == before.memory_emb.tobytes()
    rows = {r["id"]: r for r in st.queries}
    assert rows["q2"]["gold_memory_ids"] == ["s1:0", "s2:0"] and rows["q3"]["gold_memory_ids"] == ["s1:0", "s1:1"]
    assert evaluate_store(st, 3)["per_user"]["a"] == {**evaluate_store(st, 3)["per_user"]["a"], "n": 3,
                                                      "recall@3": 1.0}
    files = {p.name: p.read_bytes() for p in store.iterdir()}
    again = append_store(store, load_spec(spec, gold_elsewhere=True), FakeEmbedder(DIM), spec=spec)
    assert again["added"]["queries_repeated"] == 2 and again["added"]["sessions_repeated"] == 1
    assert {p.name: p.read_bytes() for p in store.iterdir()} == files          # the same day twice: nothing


def test_an_earlier_days_gold_at_session_granularity_is_its_session_memory(tmp_path):
    d1 = [{"user_id": "a", "sessions": [session("s1", ["I adopted a puppy named Max", "hello"], "2024-05-01")]}]
    store = tmp_path / "store"
    write_store(store, load_spec(f"jsonl:{write_jsonl(tmp_path / 'd1.jsonl', d1)}"), "session", FakeEmbedder(DIM))
    spec = earlier_day(tmp_path, "day2.jsonl", [{"id": "q1", "question": "hello?", "gold_turn_ids": ["s1:1"]},
                                                {"id": "q2", "question": "all?", "gold_session_ids": ["s1", "s2"]}])
    append_store(store, load_spec(spec, gold_elsewhere=True), FakeEmbedder(DIM), spec=spec)
    a = open_store(store).user("a")
    assert a.memory_ids == ("s1", "s2") and a.gold.tolist() == [[True, False], [True, True]]


@pytest.mark.parametrize("gold,key,msg,strict", [
    ({"gold_turn_ids": ["s1:0", "s1:7"]}, "gold_turn_ids[1]", "unknown turn id 's1:7'",
     "gold_turn_ids[0]': unknown turn id 's1:0'"),
    ({"gold_session_ids": ["s2", "s9"]}, "gold_session_ids[1]", "unknown session id 's9'",
     "gold_session_ids[1]': unknown session id 's9'")])
def test_gold_neither_the_file_nor_the_store_holds_is_one_line_and_nothing_is_written(tmp_path, days, gold, key,
                                                                                      msg, strict):
    store, _, _ = days
    path = tmp_path / "day2.jsonl"
    spec = earlier_day(tmp_path, path.name, [{"id": "q2", "question": "which lessons?", "gold_turn_ids": ["s2:0"]},
                                             {"id": "q3", "question": "and what else?", **gold}])
    files = {p.name: p.read_bytes() for p in store.iterdir()}
    beside = sorted(p.name for p in store.parent.iterdir())
    with pytest.raises(InputError) as e:
        append_store(store, load_spec(spec, gold_elsewhere=True), FakeEmbedder(DIM), spec=spec)
    assert str(e.value) == (f"{path}:1: key 'questions[1].{key}': {msg} for user 'a' (neither this file nor STORE "
                            f"{store} holds it)")
    assert {p.name: p.read_bytes() for p in store.iterdir()} == files
    assert sorted(p.name for p in store.parent.iterdir()) == beside            # no temporary left either
    with pytest.raises(InputError) as e:          # a new store (embed --out) holds nothing else: the file's rule
        load_spec(spec)
    assert str(e.value) == f"{path}:1: key 'questions[1].{strict} for user 'a'"


def test_a_new_users_gold_and_a_new_store_keep_the_files_rule(tmp_path, days):
    store, _, _ = days
    path = tmp_path / "day2.jsonl"
    spec = earlier_day(tmp_path, path.name, [{"id": "q1", "question": "my dog?", "gold_turn_ids": ["s1:0"]}],
                       user="newcomer")
    files = {p.name: p.read_bytes() for p in store.iterdir()}
    ds = load_spec(spec, gold_elsewhere=True)
    with pytest.raises(InputError) as e:
        append_store(store, ds, FakeEmbedder(DIM), spec=spec)
    assert str(e.value) == (f"{path}:1: key 'questions[0].gold_turn_ids[0]': unknown turn id 's1:0' for user "
                            f"'newcomer' (this file holds no such turn, and STORE {store} holds no user 'newcomer')")
    assert {p.name: p.read_bytes() for p in store.iterdir()} == files
    with pytest.raises(InputError, match=rf"^{path}:1: key 'questions\[0\].gold_turn_ids\[0\]': unknown turn id "
                                         r"'s1:0' for user 'newcomer'$"):
        load_spec(spec)                                    # the default: the file's own turns
    with pytest.raises(InputError, match=rf"^{path}:1: key 'questions\[0\].gold_turn_ids\[0\]': unknown turn id "
                                         r"'s1:0' for user 'newcomer'$"):
        write_store(tmp_path / "new", ds, "turn", FakeEmbedder(DIM))   # gold kept aside has no store to be in
    assert not (tmp_path / "new").exists()


def test_append_counts_only_the_users_it_adds(days):
    # A new user with no memory and no question adds nothing to the store: it was counted as
    # added (added.users 1, "+1 user") while the store stayed as it was.
    from rmm_jax.data.types import Dataset, User
    store, _, _ = days
    res = append_store(store, Dataset("jsonl", (User("empty", (), ()),)), FakeEmbedder(DIM), spec="test")
    assert res["added"]["users"] == 0 and res["added"]["sessions"] == 0
    assert open_store(store).user_ids == ("a", "b")
    # a new user with a question but no memory is refused, as write_store refuses it
    from rmm_jax.data.types import Query
    asks = User("asker", (), (Query("q1", "where?", ()),))
    with pytest.raises(InputError, match="user 'asker' has no turn to embed"):
        append_store(store, Dataset("jsonl", (asks,)), FakeEmbedder(DIM), spec="test")
    assert open_store(store).user_ids == ("a", "b")


def test_append_a_day_whose_sessions_have_no_text(days, tmp_path):
    # A day in which user a opened a chat and left it (only a system prompt) was refused whole,
    # "user 'a' has no message with text", though the store holds a's memories; --skip-invalid
    # did not help. Such a session adds nothing; a user the store holds is fine (its question
    # about an earlier day is appended); a NEW user with no text is one line naming its
    # file:line, or skipped and counted with skip_invalid.
    store, _, _ = days
    prompt, image = ({"role": "system", "content": "You are helpful."},
                     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]})
    day = write_jsonl(tmp_path / "d3.jsonl", [
        {"user_id": "a", "session_id": "s9", "messages": [prompt],
         "questions": [{"id": "q9", "question": "dog?", "gold_turn_ids": ["s1:0"]}]},
        {"user_id": "b", "session_id": "s9", "messages": [image]},
        {"user_id": "c", "session_id": "s1", "messages": [prompt, image]},
        {"user_id": "d", "session_id": "s1", "messages": [{"role": "user", "content": "I moved to Porto."}]}])
    ds = load_spec(f"jsonl:{day}", gold_elsewhere=True)
    assert ds.stats["skipped"]["sessions_without_text"] == 3 and set(ds.no_text) == {"a", "b", "c"}
    before = open_store(store).manifest
    with pytest.raises(InputError) as e:
        append_store(store, ds, FakeEmbedder(DIM), spec="day")
    assert str(e.value).startswith(f"{day}:3: key 'user_id': user 'c' has no message with text")
    assert f"STORE {store} holds no user 'c'" in str(e.value) and "--skip-invalid" in str(e.value)
    assert open_store(store).manifest == before
    said = []
    res = append_store(store, ds, FakeEmbedder(DIM), spec="day", skip_invalid=True, progress=said.append)
    assert {k: res["added"][k] for k in ("users", "sessions", "memories", "queries", "users_without_text")} == \
        {"users": 1, "sessions": 1, "memories": 1, "queries": 1, "users_without_text": 1}
    # what --skip-invalid dropped is a note of its own (shown under --quiet), naming the file and line
    assert [ln for ln in said if "no message with text" in ln] == [
        f"note: skipped 1 new user with no message with text (first: {day}:3: key 'user_id')"], said
    st = open_store(store)
    assert st.user_ids == ("a", "b", "d")
    q9 = next(r for r in map(json.loads, open(store / "queries.jsonl")) if r["id"] == "q9")
    assert q9["gold_memory_ids"] == ["s1:0"]
    with pytest.raises(InputError, match=r"d3\.jsonl:1: key 'user_id': user 'a' has no message with text"):
        write_store(tmp_path / "new", ds, "turn", FakeEmbedder(DIM))        # a new store: only the file counts


def test_one_embed_writes_a_store_at_a_time_and_clears_what_a_killed_one_left(days):
    # Two appends at once each grew the old store, and the second rename dropped the
    # first's additions without a word; a killed append's copy beside the store stayed.
    from rmm_jax.data.store import store_writer
    store, spec, _ = days
    left = store.parent / f".{store.name}.tmp-killed"
    with store_writer(store):                              # another writer holds the store, then is killed
        left.mkdir()
        (left / "memories.npy").write_bytes(b"half")
        with pytest.raises(InputError, match=rf"^{store}: in use by pid {os.getpid()} \(another embed"):
            append_store(store, load_spec(spec), FakeEmbedder(DIM), spec=spec)
        with pytest.raises(InputError, match="in use by pid"):
            write_store(store, load_spec(spec), "turn", FakeEmbedder(DIM))
    assert open_store(store).user_ids == ("a", "b") and left.exists()      # nothing written meanwhile
    res = append_store(store, load_spec(spec), FakeEmbedder(DIM), spec=spec)
    assert res["added"]["users"] == 1 and not left.exists()
    assert not [p.name for p in store.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_append_refuses_a_changed_session_and_another_model(tmp_path, days):
    store, _, d2 = days
    d2[0]["sessions"][0]["messages"][0]["content"] = "I adopted a kitten"
    spec = f"jsonl:{write_jsonl(tmp_path / 'bad.jsonl', d2)}"
    bad = tmp_path / "bad.jsonl"
    with pytest.raises(InputError, match=rf"^{bad}:1: key 'sessions\[0\]': session 's1' of user 'a' is already in "
                                         "the store with other content"):   # the file:line of that session
        append_store(store, load_spec(spec), FakeEmbedder(DIM), spec=spec)
    d2[0]["sessions"][0]["messages"][0]["content"] = "I adopted a puppy named Max"    # as stored; line 3 asks
    d2.append({"user_id": "a", "session_id": "s9", "messages": [{"role": "user", "content": "hello again"}],
               "questions": [{"id": "q1", "question": "another text for q1", "gold_turn_ids": ["s9:0"]}]})
    spec = f"jsonl:{write_jsonl(bad, d2)}"
    with pytest.raises(InputError, match=rf"^{bad}:3: key 'questions\[0\]': question 'q1' of user 'a' is already in "
                                         "the store with another text"):
        append_store(store, load_spec(spec), FakeEmbedder(DIM), spec=spec)
    with pytest.raises(InputError, match="^embedder: STORE .* was embedded with model 'fake/bow-16', not 'fake/bow-8'"):
        append_store(store, load_spec(spec), FakeEmbedder(8), spec=spec)


@pytest.mark.parametrize("change, key, words", [
    ({"gold_turn_ids": ["s1:1"]}, "questions[0]", "question 'q1' of user 'a' is already in the store with other gold "
                                                  "(s1:0 there, s1:1 here; give a changed question its own id)"),
    ({"gold_turn_ids": ["s1:0", "s1:1"]}, "questions[0]", "with other gold (s1:0 there, s1:0, s1:1 here"),
    ({"gold_turn_ids": [], "abstention": True}, "questions[0]", "question 'q1' of user 'a' is already in the store "
                                                                "with abstention false, not true"),
    ({"timestamp": "2024-05-03"}, "sessions[0]", "session 's1' of user 'a' is already in the store with another "
                                                 "timestamp ('2024-05-01' there, '2024-05-03' here")])
def test_append_refuses_a_repeat_with_other_gold_abstention_or_timestamp(tmp_path, days, change, key, words):
    """Day 1's question or session sent again with the same text but other gold, abstention or
    timestamp counted as a repeat, and the store kept day 1's without a word; it is an error
    naming its file:line, as another text is, before anything is written. The same line is
    still a repeat."""
    store, _, _ = days
    q1 = {"id": "q1", "question": "dog name?", "gold_turn_ids": ["s1:0"]}
    s1 = session("s1", ["I adopted a puppy named Max", "hello"], "2024-05-01")
    line = {"user_id": "a", "sessions": [s1], "questions": [q1]}
    changed = {**line, "sessions": [{**s1, **change}] if key == "sessions[0]" else [s1],
               "questions": [{**q1, **change}] if key == "questions[0]" else [q1]}
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    bad = write_jsonl(tmp_path / "bad.jsonl", [changed])
    with pytest.raises(InputError) as e:
        append_store(store, load_spec(f"jsonl:{bad}", gold_elsewhere=True), FakeEmbedder(DIM), spec=f"jsonl:{bad}")
    assert str(e.value).startswith(f"{bad}:1: key '{key}': ") and words in str(e.value), str(e.value)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    same = write_jsonl(tmp_path / "same.jsonl", [line])
    again = append_store(store, load_spec(f"jsonl:{same}", gold_elsewhere=True), FakeEmbedder(DIM), spec="same")
    assert (again["added"]["queries_repeated"], again["added"]["sessions_repeated"]) == (1, 1)


def test_a_kill_mid_append_leaves_the_old_store(tmp_path, days):
    store, spec, _ = days
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    child = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from conftest import FakeEmbedder
        import rmm_jax.data.store._append as sa
        from rmm_jax.data import load_spec
        real = sa._put
        def slow(*a):
            print("writing", flush=True)
            time.sleep(60)
        sa._put = slow
        sa.append_store({str(store)!r}, load_spec({spec!r}), FakeEmbedder({DIM}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.stdout.readline().strip() == "writing"          # inside the new store's temporary directory
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    assert open_store(store).user_ids == ("a", "b")


def store_view(st):
    """What a reader gets of a store: its users' rows and embeddings and the metadata rows."""
    view = {"users": st.user_ids, "memories": st.memories, "queries": st.queries}
    for u in st.user_ids:
        d = st.user(u)
        view[u] = (d.memory_ids, d.query_ids, d.gold.tolist(), d.memory_emb.tobytes(), d.query_emb.tobytes())
    return view


def held_files(root) -> list[str]:
    """The descriptors (/proc/self/fd) and maps (/proc/self/maps) of this process naming a file under ``root``."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:                              # the listing's own descriptor, closed since
            pass
    with open("/proc/self/maps") as f:
        names += [line.split(None, 5)[-1].strip() for line in f if len(line.split(None, 5)) == 6]
    return [n for n in names if n.startswith(str(root))]


@needs_proc_fd
def test_a_held_store_reads_the_version_it_opened_after_an_append(days):
    # A server holding an open store (docs/lifecycle.md, Serve) read its files by name, lazily: after the night's
    # `embed --into` renamed the grown store into place, `memories.jsonl: 1032 rows but the manifest counts 960`,
    # or "row belongs to user 'a'" (the old file's offsets into the new one).
    store, spec, _ = days
    fds = open_fds()
    st = open_store(store)
    held = open_fds() - fds
    assert held <= 8 + 3                             # its directory and files, the arrays' maps: not per user
    st.user("a")
    before = store_view(open_store(store))
    append_store(store, load_spec(spec), FakeEmbedder(DIM), spec=spec)
    assert store_view(st) == before                  # the version it opened, bit for bit
    assert st.refresh() is True                      # the server's call after the nightly job
    assert st.user_ids == ("a", "b", "c") and store_view(st) == store_view(open_store(store))
    assert st.refresh() is False                     # nothing new since
    assert open_fds() - fds == held                  # the replaced version's files are closed
    assert not [n for n in held_files(store.parent) if "(deleted)" in n]     # ... and unmapped: their space is freed
    st.close()
    # close() closed the store's descriptors but its maps (memory_emb, ...) kept theirs: memories.npy (deleted)
    # stayed in /proc/self/fd and /proc/self/maps, its disk space held while the closed store object lived
    assert held_files(store.parent) == []
    with pytest.raises(InputError, match="store is closed$"):
        st.user("a")
    with pytest.raises(InputError, match="store is closed$"):
        st.memory_emb
    del st
    assert open_fds() == fds
    with open_store(store) as st:
        st.user("c")
    del st
    for _ in range(20):                              # a store no longer referenced closes its files
        open_store(store).user("a")
    assert open_fds() == fds


def test_a_store_opened_during_an_append_is_the_old_one_whole(days, monkeypatch):
    # open_store read manifest.json, users.json and the arrays by name one after another: an append renaming
    # the grown store into place between them gave "expected a list of 2 users" (users.json of the new one).
    import types

    import rmm_jax.data.store._read as store_read
    store, spec, _ = days
    old = store_view(open_store(store))
    appended = []

    def loads(text, *a, **kw):                       # the first file the opening parses: the append renames now
        if not appended:
            appended.append(spec)                    # the append's own opening parses as usual
            append_store(store, load_spec(spec), FakeEmbedder(DIM), spec=spec)
        return json.loads(text, *a, **kw)
    monkeypatch.setattr(store_read, "json", types.SimpleNamespace(loads=loads, JSONDecodeError=json.JSONDecodeError))
    st = open_store(store)
    assert appended and store_view(st) == old
    monkeypatch.undo()
    assert open_store(store).user_ids == ("a", "b", "c")


def test_readers_racing_appends_see_one_version_each(tmp_path, days):
    # The nightly `embed --into` beside a server's reads: 11 of 1079 reads failed ("invalid JSON: Unterminated
    # string", "row belongs to user 'user0'") as a reader mixed the files of two versions.
    import threading
    store, _, _ = days
    held = open_store(store)
    versions = [store_view(open_store(store))]
    seen, errors, done = [], [], threading.Event()

    def reader():
        while not done.is_set() or len(seen) < 3:
            try:
                seen.append(store_view(open_store(store)))
                assert store_view(held) == versions[0]
            except Exception as e:               # noqa: BLE001 - every error is the finding
                errors.append(repr(e))
                return
    t = threading.Thread(target=reader)
    t.start()
    try:
        for d in range(3, 9):
            rows = [{"user_id": "a", "sessions": [session(f"s{d}", [f"day {d} news"], "2024-05-03")]},
                    {"user_id": f"n{d}", "sessions": [session("s1", [f"hello from {d}"], "2024-05-03")]}]
            spec = f"jsonl:{write_jsonl(tmp_path / f'day{d}.jsonl', rows)}"
            append_store(store, load_spec(spec), FakeEmbedder(DIM), spec=spec)
            versions.append(store_view(open_store(store)))
    finally:
        done.set()
        t.join()
    assert errors == []
    assert all(v in versions for v in seen)


def test_a_store_opened_between_the_two_renames_of_an_append_is_the_new_one(days, monkeypatch):
    # Where the system cannot swap two directories in one step (macOS, some file systems), the append renames the
    # old store aside, then the grown one in: an open_store between the two said "no such embedding store".
    import threading

    import rmm_jax.persist.atomic as atomic
    store, spec, _ = days
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    aside, go, real = threading.Event(), threading.Event(), os.replace

    def replace(src, dst, *a, **kw):
        real(src, dst, *a, **kw)
        if ".old-" in os.fspath(dst):                # the old store is aside: STORE is missing until the next
            aside.set()
            go.wait(10)
    monkeypatch.setattr(os, "replace", replace)
    append = threading.Thread(target=append_store, args=(store, load_spec(spec), FakeEmbedder(DIM)),
                              kwargs={"spec": spec})
    append.start()
    try:
        assert aside.wait(10) and not store.exists()
        threading.Timer(0.2, go.set).start()         # the second rename, while the open waits
        st = open_store(store)
    finally:
        go.set()
        append.join()
    assert st.user_ids == ("a", "b", "c")


def test_evaluate_reports_the_targets_cited_recall_beside_the_retrievers():
    """Brute force over random calls: the share of each call's cited memories in the
    target's top-M (M = the call's shown count) and in the retriever's first M."""
    rng = np.random.default_rng(0)
    n, k, m = 30, 6, 3
    mask = np.ones((n, k), bool)
    mask[::4, 5] = False
    logits = rng.normal(size=(n, k)).astype(np.float32)
    selected = np.stack([rng.permutation(5)[:m] for _ in range(n)]).astype(np.int32)
    selected[::5, 2] = -1
    cited = rng.random((n, m)) < 0.5
    calls = Calls(user_ids=["u"] * n, query_ids=[f"q{i}" for i in range(n)], target_logits=logits,
                  behaviour_logits=None, mask=mask, selected=selected, cited=cited, log_prob=np.zeros(n),
                  cand_gold=np.zeros((n, k), bool), num_gold=np.zeros(n, np.int32), valid=np.zeros(n, bool),
                  own_policy={"u": True})
    got = cited_recall(calls, bootstrap=50)["cited_recall"]
    target, base = [], []
    for i in range(n):
        c = {int(selected[i, j]) for j in range(m) if cited[i, j] and selected[i, j] >= 0}
        if not c:
            continue
        shown = int((selected[i] >= 0).sum())
        top = set(np.argsort(-np.where(mask[i], logits[i], -np.inf), kind="stable")[:shown].tolist())
        target.append(len(c & top) / len(c))
        base.append(len(c & set(range(shown))) / len(c))
    assert got["calls"] == len(target)
    np.testing.assert_allclose([got["target"]["value"], got["retriever"]["value"], got["target"]["gain"]["value"]],
                               [np.mean(target), np.mean(base), np.mean(target) - np.mean(base)], rtol=1e-12)


def test_a_run_that_diverges_on_a_store_leaves_it_as_it_was_and_runs_again_with_a_smaller_step(capsys, tmp_path,
                                                                                                store):
    """A step size that makes the policies non-finite (given with --change-setting), checkpointed
    after every batch: one line naming --lr, the store's files as they were (its setting too),
    and no run-state left (it held the diverged states, and the same command with a smaller
    --lr was told to --resume them); run again without it, the store learns."""
    import hashlib as _h

    from rmm_jax.persist.runstate import RunState
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries"]
    assert run_cli(capsys, *sim, ":4")[0] == 0

    def files():
        return {str(p.relative_to(pol)): _h.sha256(p.read_bytes()).hexdigest() for p in sorted(pol.rglob("*"))
                if p.is_file() and p.name != ".lock"}
    before = files()
    code, out, err = run_cli(capsys, *sim, "4:", "--lr", "3e38", "--change-setting", "--checkpoint-every", "1")
    assert code == 2 and out == "" and err.strip().splitlines()[-1].startswith("error: --lr: the learning diverged:")
    assert files() == before and not RunState.path_for(pol).exists()
    code, out, err = run_cli(capsys, *sim, "4:", "--checkpoint-every", "1")
    assert code == 0, err
    assert json.loads((pol / "policy_store.json").read_text())["setting"]["optimizer"]["lr"] != 3e38


def test_the_divergence_bound_is_the_float64_norms_of_each_row_with_non_finite_rows_marked():
    """sinks._row_bounds against an independent float64 computation (math.fsum of the
    squares, exact for float32 entries): per user row, whether every leaf is finite and
    log Π (1 + ‖leaf‖); rows past _BOUND_ROWS, NaN and inf rows, float64 entries whose
    squares overflow (a bound of inf), bfloat16 leaves, and the shared part (n None)."""
    import math

    import ml_dtypes

    from rmm_jax.online.sinks import _BOUND_ROWS, _row_bounds

    rng = np.random.default_rng(0)
    u = _BOUND_ROWS + 5
    tree = {"a": (rng.standard_normal((u + 2, 6, 7)) * 10).astype(np.float32),
            "b": rng.standard_normal((u + 2, 5)).astype(np.float32),
            "c": rng.standard_normal((u + 2, 3)).astype(ml_dtypes.bfloat16),
            "d": rng.standard_normal((u + 2, 4)) * 1e3}                 # float64
    tree["a"][3, 2, 2], tree["b"][_BOUND_ROWS + 1, 0], tree["d"][7, 1] = np.nan, np.inf, 1e200
    finite, log_bound = _row_bounds(tree, u)

    def want(rows):
        total, ok = 0.0, True
        for leaf in rows:
            v = np.asarray(leaf, np.float64).ravel()
            if not np.isfinite(v).all():
                ok = False
                continue
            with np.errstate(over="ignore"):
                total += math.log1p(math.sqrt(math.fsum(v * v)))
        return ok, total

    for i in range(u):
        ok, bound = want([tree[k][i] for k in "abcd"])
        assert finite[i] == ok and (bound == log_bound[i] == math.inf or abs(bound - log_bound[i]) <= 1e-12 * bound), i
    assert not finite[3] and not finite[_BOUND_ROWS + 1] and finite[7] and log_bound[7] == math.inf
    ok, bound = want([tree[k][:2] for k in "abc"])                     # one row: the whole tree
    f1, b1 = _row_bounds({k: tree[k][:2] for k in "abc"}, None)
    assert f1.tolist() == [ok] and abs(b1[0] - bound) <= 1e-12 * bound


@pytest.mark.parametrize("lr, more", [("1e30", ()), ("1e20", ()), ("1e12", ("--scope", "hybrid", "--rank", "2")),
                                      ("1e8", ("--kind", "mlp"))])
def test_a_step_that_leaves_finite_params_too_large_to_score_is_a_divergence(capsys, tmp_path, store, lr, more):
    """--lr 1e30 left every parameter finite (about 1e33) and every score NaN: the policies were
    saved, the run failed on its own log record ("key 'selected': must be a non-empty list",
    exit 2) with its run-state left to resume the same, and rerank blamed the embeddings. A
    parameter past sqrt(float32 max) / its width, where a score overflows, is a divergence too:
    one line naming --lr, nothing saved, no run-state. An mlp or hybrid's factors overflow with every
    entry far smaller: the bound is the product of the leaves' norms."""
    from rmm_jax.persist.runstate import RunState
    pol = tmp_path / "p"
    code, out, err = run_cli(capsys, "simulate", store, "--policies", pol, *ONLINE, "--lr", lr, "--batch", "1",
                             *more, "--log-out", tmp_path / "log.jsonl")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: --lr: the learning diverged:"), err
    assert "so large its scores overflow float32" in err
    assert not (tmp_path / "log.jsonl").exists() and not RunState.path_for(pol).exists()
    assert not pol.exists() or PolicyStore.open(pol).n_users() == 0


def test_a_divergence_after_saved_chunks_says_how_to_undo_them():
    """Users chunks a run saved before a later chunk diverged keep their versions (learned at the
    diverging setting): the one line says so and names the rollback that undoes them; a first
    chunk's divergence says nothing of the kind. Only non-finite rows count (a finite shared part,
    a finite user beside a NaN one)."""
    from types import SimpleNamespace as NS

    from rmm_jax.errors import Diverged
    from rmm_jax.online.sinks import check_finite_chunk

    params = {"W": np.array([[1.0, 2.0], [np.nan, 0.0]], np.float32)}      # user u1's row is NaN
    event = NS(streams=[NS(user_id="u0"), NS(user_id="u1")], states=NS(params=params), shared=NS(params={}))
    program = NS(optimizer=NS(lr=3e38), estimator=NS(tau=0.1, loss="logistic"))
    with pytest.raises(Diverged) as first:
        check_finite_chunk(event, program, 0, "P")
    with pytest.raises(Diverged) as later:
        check_finite_chunk(event, program, 2, "P")
    assert "the policy of user 'u1' is not finite" in str(first.value) and "rollback" not in str(first.value)
    assert "users chunks this run saved before it (2)" in str(later.value)
    assert "`rmm-jax policies rollback P` undoes them" in str(later.value) and later.value.where == "--lr"
    check_finite_chunk(NS(streams=event.streams, states=NS(params={"W": np.ones((2, 2), np.float32)}),
                          shared=NS(params={"S": np.zeros(3, np.float32)})), program, 2, "P")      # finite: passes


def test_a_mistyped_policy_store_on_rerank_names_the_one_beside_it(capsys, tmp_path, store):
    """`rerank --policies polices` beside a store named `policies` served the retriever with a line
    that reads like day 1's: it names the store it likely meant (still exit 0: day 1 has none); a
    missing store with nothing like it beside it says only that there is none."""
    pol = tmp_path / "policies"
    assert run_cli(capsys, "simulate", store, "--policies", pol, *ONLINE, "--queries", ":4")[0] == 0
    _, err = served(capsys, tmp_path, store, "--policies", tmp_path / "polices")
    assert f"no policy store at {tmp_path / 'polices'} (did you mean {pol}?): serving the identity reranker" in err
    _, err = served(capsys, tmp_path, store, "--policies", tmp_path / "elsewhere", name="b.jsonl")
    assert f"no policy store at {tmp_path / 'elsewhere'}: serving the identity reranker" in err


def test_a_change_of_setting_refused_later_is_not_said_to_have_happened(capsys, tmp_path, store):
    """A simulate run given --change-setting but refused afterwards (its questions learned
    already) printed "learning setting of P changed (--change-setting): ..." before its error,
    though nothing changed: the refusal is the only line, and the store records the old setting."""
    pol = tmp_path / "p"
    sim = ["simulate", store, "--policies", pol, *ONLINE, "--queries", ":4"]
    assert run_cli(capsys, *sim)[0] == 0
    code, out, err = run_cli(capsys, *sim, "--lr", "1e-3", "--change-setting")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "changed" not in err, err
    assert "is learned" in err and json.loads((pol / "policy_store.json").read_text())["setting"]["optimizer"]["lr"] \
        == rj.preset("default").optimizer.lr
