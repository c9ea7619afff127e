"""Every command fed malformed input: exit 2, ONE line on stderr naming the file:line, the
JSON key or the option, no traceback, and nothing created or changed on disk.

Driven in-process through ``rmm_jax.cli.main.main`` (what the console script calls), plus a few
cases through the real ``rmm-jax`` script in a subprocess. Decisions pinned here:

* click usage errors (a bad option value, a missing argument) are one ``error: ...``
  line too, exit 2 (``rmm_jax.cli.main.main``);
* a policy store made for another embedding model (``meta.config.model``) is rejected
  even when the dim matches (``--policies``); a store of another model is rejected by
  ``retrieve --expect-model``;
* ``--k`` larger than a user's bank is an error for ``retrieve`` (without
  ``--pad-short-banks``); the online commands pad short banks with masked candidates;
* ``replay --skip-invalid`` succeeds (exit 0) and reports the count of skipped records
  (JSON ``log.skipped``; its one info line on stderr is legitimate on success).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, make_fake_store, run_cli
from fake_embedder import FakeEmbedder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmm_jax import init_reranker
from rmm_jax.cli.common import k_m_from_log
from rmm_jax.core.config import Layout
from rmm_jax.data import make_synthetic
from rmm_jax.data.log_vectors import known_ids
from rmm_jax.data.store import open_store, write_store
from rmm_jax.errors import InputError
from rmm_jax.online.streams import log_shape, scan_log
from rmm_jax.persist.policy_store import PolicyStore

K, M = 10, 3


# --------------------------------------------------------------------------- helpers


cli = run_cli


def snapshot(root: Path) -> dict:
    """Every file and directory under ``root``: (size, mtime, sha256) or 'dir'."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            st_ = os.stat(p)
            with open(p, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            snap[os.path.relpath(p, root)] = (st_.st_size, st_.st_mtime_ns, digest)
    return snap


def assert_one_line_error(code, err, names, expect_code=2):
    assert code == expect_code, (code, err)
    assert "Traceback" not in err, err
    lines = err.splitlines()  # splits on \r too: a progress bar before the error shows up here
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    assert lines[0].startswith("error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])


def jl(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One tree holding every input; each case snapshots all of it before and after."""
    root = tmp_path_factory.mktemp("bad")
    e = {"root": root}
    e["store"] = make_fake_store(root / "store", users=3, sessions=4, dim=32)
    e["store16"] = make_fake_store(root / "store16", users=2, sessions=2, dim=16)
    e["segment_store"] = root / "segment_store"     # memories of whole topics: no dialogue pairs
    write_store(e["segment_store"], make_synthetic(users=2, sessions=2, turns=8, seed=0), "segment", FakeEmbedder(32),
                spec="synthetic:users=2,sessions=2,turns=8,seed=0")
    e["chats_store"] = root / "chats_store"         # chat histories only: no questions, so no gold
    chats = make_synthetic(users=2, sessions=2, turns=8, seed=0)
    chats = dataclasses.replace(chats, users=tuple(dataclasses.replace(u, queries=()) for u in chats.users))
    write_store(e["chats_store"], chats, "turn", FakeEmbedder(32), spec="chats")
    e["nogold_store"] = root / "nogold_store"       # questions, none with gold
    nogold = make_synthetic(users=2, sessions=2, turns=8, seed=0)
    nogold = dataclasses.replace(nogold, users=tuple(
        dataclasses.replace(u, queries=tuple(dataclasses.replace(q, gold_turn_ids=()) for q in u.queries))
        for u in nogold.users))
    write_store(e["nogold_store"], nogold, "turn", FakeEmbedder(32), spec="nogold")
    # a store whose memories hold NaN (shape and dtype intact)
    e["nan_store"] = root / "nan_store"
    shutil.copytree(e["store"], e["nan_store"])
    arr = np.load(e["nan_store"] / "memories.npy", mmap_mode="r+")
    arr[3, 5] = np.nan
    arr.flush()
    del arr
    # policy stores: dim 16, and dim 32 made for another embedding model
    p16 = init_reranker(jax.random.key(0), 16)
    e["pol16"] = root / "pol16"
    PolicyStore.create(e["pol16"], {"kind": "linear", "dim": 16, "hidden": None,
                                    "config": {"pretrained": True, "model": "fake/bow-16"}}, p16)
    e["pol_model"] = root / "pol_model"
    PolicyStore.create(e["pol_model"], {"kind": "linear", "dim": 32, "hidden": None,
                                        "config": {"pretrained": True, "model": "other/model-32"}},
                       init_reranker(jax.random.key(0), 32))
    e["pol_existing"] = root / "pol_existing"
    PolicyStore.create(e["pol_existing"], {"kind": "linear", "dim": 32, "hidden": None,
                                           "config": {"pretrained": True, "model": "fake/bow-32"}},
                       init_reranker(jax.random.key(0), 32))
    # logs
    s = open_store(e["store"])
    e["open_store"] = s
    u = s.user(s.user_ids[0])
    e["user"] = u
    good = [{"user_id": u.user_id, "query_id": q, "candidates": list(u.memory_ids[:K]),
             "selected": list(u.memory_ids[:M]), "cited": [u.memory_ids[0]]} for q in u.query_ids[:6]]
    e["good"] = good
    g0, g1 = good[0], good[1]
    logs = {
        "empty": "",
        "blank_only": "\n\n",
        "invalid_json": '{"user_id": "x", \n',
        "not_object": jl([1, 2]),
        "wrong_type": jl({**g0, "user_id": 7}),
        "wrong_type_list": jl({**g0, "candidates": "m1"}),
        "missing_key": jl({k: v for k, v in g0.items() if k != "cited"}),
        "unknown_user": jl(g0, {**g1, "user_id": "nobody"}),
        "unknown_query": jl({**g0, "query_id": "no-such-query"}),
        "unknown_memory": jl({**g0, "candidates": g0["candidates"][:-1] + ["no-such-memory"]}),
        # a stored memory with another text: the store's memory would be used, the text ignored
        "store_text_differs": jl({**g0, "log_prob": -2.0}, {**g1, "log_prob": -2.0, "candidates": [
            {"id": g1["candidates"][0], "text": "not the store's text"}, *g1["candidates"][1:]]}),
        "duplicate_query": jl(g0, g1, {**g0, "cited": []}),      # other content (a repeat is read once)
        "cited_outside_selected": jl({**g0, "cited": [g0["candidates"][-1]]}),
        "selected_outside_candidates": jl({**g0, "selected": g0["selected"] + ["zz"]}),
        "positive_log_prob": jl({**g0, "log_prob": 0.5}),
        "nan_log_prob": jl(g0) + json.dumps({**g1, "log_prob": float("nan")}) + "\n",
        "too_many_candidates": jl({**g0, "candidates": list(u.memory_ids[:K + 1])}),
        "too_many_selected": jl({**g0, "selected": list(u.memory_ids[:M + 1])}),
        "huge_timestamp": jl(g0, {**g1, "timestamp": 10**400}),
        "calls_huge_timestamp": jl({"user_id": u.user_id, "query_id": u.query_ids[0], "timestamp": -10**400}),
        "calls_good": jl({"user_id": u.user_id, "query_id": u.query_ids[0]}),
        # a lone UTF-16 surrogate escape (an emoji cut in half): Python's json reads it, UTF-8 cannot hold it
        "lone_surrogate": jl(g0) + json.dumps({**g1, "query": "my dog \ud83d"}) + "\n",
        "chats_lone_surrogate": jl({"user_id": "a", "messages": [{"role": "user", "content": "hi \ud83d"}]}),
        # texts with nothing in them were embedded as a question or a memory that matches nothing
        "blank_query": jl(g0, {**g1, "query": "  "}),
        "blank_candidate_text": jl(g0, {**g1, "candidates": [{"id": "new-mem", "text": " "}, *g1["candidates"][1:]]}),
        "text_log": jl({"user_id": "a", "query": "tea?", "candidates": ["m1"], "selected": ["m1"], "cited": []}),
        "text_log_blank_candidate": jl({"user_id": "a", "query": "tea?", "candidates": [{"id": "m1", "text": "tea"}],
                                        "selected": ["m1"], "cited": []},
                                       {"user_id": "a", "query": "coffee?", "candidates": [{"id": "m2", "text": ""}],
                                        "selected": ["m2"], "cited": []}),
        "memories_blank_text": jl({"user_id": "a", "id": "m1", "text": "\t"}),
    }
    ld = root / "logs"
    ld.mkdir()
    for name, text in logs.items():
        (ld / f"{name}.jsonl").write_text(text)
    (ld / "good.jsonl").write_text(jl(*good))
    (ld / "mixed.jsonl").write_text(jl(g0, {**g1, "cited": ["zz"]}, good[2], "{oops", good[3]))
    e["logs"] = ld
    (root / "surrogate_locomo.json").write_text(json.dumps({"qa": [], "session_1": [
        {"speaker": "A", "dia_id": "D1:1", "text": "cut \udc00 here"}]}))
    (root / "a_file.txt").write_text("not a directory\n")
    e["file"] = root / "a_file.txt"
    return e


# --------------------------------------------------------------------------- cases


def cases():
    """(id, argv builder, names that must appear in the error line)."""
    S = lambda e: e["store"]
    L = lambda e, n: e["logs"] / f"{n}.jsonl"
    new_pol = lambda e: e["root"] / "new_pol"     # must never appear
    rp = lambda e, log, *more: ["replay", S(e), "--log", L(e, log), "--policies", new_pol(e), "--k", K, "--m", M,
                                *more]
    sim = lambda e, *more: ["simulate", S(e), "--policies", new_pol(e), "--k", K, "--m", M,
                            "--log-out", e["root"] / "new_log.jsonl", *more]
    pre = lambda e, *more: ["pretrain", S(e), "--out", new_pol(e), "--k", K, "--m", M, *more]
    c = []
    # ---- citation logs through replay
    c += [
        # (an empty log is a day without calls, not bad input: tests/test_exactly_once.py, test_ope.py)
        ("log-invalid-json", lambda e: rp(e, "invalid_json"), lambda e: [f"{L(e, 'invalid_json')}:1", "invalid JSON"]),
        ("log-not-object", lambda e: rp(e, "not_object"), lambda e: [f"{L(e, 'not_object')}:1"]),
        ("log-wrong-type", lambda e: rp(e, "wrong_type"), lambda e: [f"{L(e, 'wrong_type')}:1", "'user_id'"]),
        ("log-wrong-type-list", lambda e: rp(e, "wrong_type_list"), lambda e: [":1", "'candidates'"]),
        ("log-missing-key", lambda e: rp(e, "missing_key"), lambda e: [f"{L(e, 'missing_key')}:1", "'cited'"]),
        ("log-unknown-user", lambda e: rp(e, "unknown_user"), lambda e: [f"{L(e, 'unknown_user')}:2", "'user_id'",
                                                                          "nobody"]),
        ("log-unknown-query", lambda e: rp(e, "unknown_query"), lambda e: [":1", "'query_id'", "no-such-query"]),
        ("log-unknown-memory", lambda e: rp(e, "unknown_memory"), lambda e: [":1", "'candidates'", "no-such-memory"]),
        ("log-store-text-differs", lambda e: rp(e, "store_text_differs"),
         lambda e: [f"{L(e, 'store_text_differs')}:2", "'candidates'", repr(e["user"].memory_ids[0]),
                    "differs from the store's memory"]),
        ("evaluate-store-text-differs", lambda e: ["evaluate", S(e), "--log", L(e, "store_text_differs"),
                                                   "--policies", e["pol_existing"]],
         lambda e: [f"{L(e, 'store_text_differs')}:2", "'candidates'", repr(e["user"].memory_ids[0]),
                    "differs from the store's memory"]),
        ("log-duplicate-query", lambda e: rp(e, "duplicate_query"), lambda e: [f"{L(e, 'duplicate_query')}:3",
                                                                                "'query_id'", "line 1"]),
        ("log-cited-outside-selected", lambda e: rp(e, "cited_outside_selected"), lambda e: [":1", "'cited'"]),
        ("log-selected-outside-candidates", lambda e: rp(e, "selected_outside_candidates"),
         lambda e: [":1", "'selected'"]),
        ("log-positive-log-prob", lambda e: rp(e, "positive_log_prob"), lambda e: [":1", "'log_prob'"]),
        ("log-nan-log-prob", lambda e: rp(e, "nan_log_prob"), lambda e: [":2", "'log_prob'"]),
        ("log-lone-surrogate", lambda e: rp(e, "lone_surrogate"),
         lambda e: [f"{L(e, 'lone_surrogate')}:2", "lone surrogate \\ud83d"]),
        ("log-blank-query", lambda e: rp(e, "blank_query"), lambda e: [f"{L(e, 'blank_query')}:2", "'query'",
                                                                        "empty"]),
        ("log-blank-candidate-text", lambda e: rp(e, "blank_candidate_text"),
         lambda e: [f"{L(e, 'blank_candidate_text')}:2", "'candidates'", "item 0 'text' is empty"]),
        ("evaluate-blank-candidate-text", lambda e: ["evaluate", S(e), "--log", L(e, "blank_candidate_text"),
                                                     "--policies", e["pol_existing"]],
         lambda e: [f"{L(e, 'blank_candidate_text')}:2", "'candidates'", "empty"]),
        ("log-huge-timestamp", lambda e: rp(e, "huge_timestamp"), lambda e: [":2", "'timestamp'", "finite"]),
        ("rerank-huge-timestamp", lambda e: ["rerank", S(e), "--calls", L(e, "calls_huge_timestamp"), "--out",
                                             e["root"] / "new_served.jsonl"],
         lambda e: [f"{L(e, 'calls_huge_timestamp')}:1", "'timestamp'"]),
        ("rerank-policy-other-model", lambda e: ["rerank", S(e), "--policies", e["pol_model"], "--calls",
                                                 L(e, "calls_good"), "--out", e["root"] / "new_served.jsonl"],
         lambda e: ["--policies", "other/model-32"]),
        ("evaluate-negative-seed", lambda e: ["evaluate", S(e), "--log", L(e, "good"), "--policies", e["pol_existing"],
                                              "--seed", -1], lambda e: ["--seed"]),
        # the "--k --m from LOG" note waits for the log to be read: before, each of these printed it first
        ("evaluate-log-without-log-prob", lambda e: ["evaluate", S(e), "--log", L(e, "good"), "--policies",
                                                     e["pol_existing"]], lambda e: [f"{L(e, 'good')}:1", "'log_prob'"]),
        ("evaluate-policies-missing", lambda e: ["evaluate", S(e), "--log", L(e, "good"), "--policies",
                                                 e["root"] / "nopol"], lambda e: ["nopol"]),
        ("evaluate-clip-below-1", lambda e: ["evaluate", S(e), "--log", L(e, "good"), "--policies", e["pol_existing"],
                                             "--clip", 0.5], lambda e: ["--clip"]),
        # too few resamples for a 95% interval: 0 gave point "intervals" that the verdict read as a gain above 0
        ("evaluate-bootstrap-0", lambda e: ["evaluate", S(e), "--log", L(e, "good"), "--policies", e["pol_existing"],
                                            "--bootstrap", 0], lambda e: ["--bootstrap", ">= 40"]),
        ("cite-rates-bootstrap-1", lambda e: ["cite-rates", S(e), "--log", L(e, "good"), "--bootstrap", 1],
         lambda e: ["--bootstrap", ">= 40"]),
        # 1e11 resamples ran for minutes into gigabytes: a typo, refused before the log is read
        ("evaluate-bootstrap-huge", lambda e: ["evaluate", S(e), "--log", L(e, "good"), "--policies",
                                               e["pol_existing"], "--bootstrap", 10**11],
         lambda e: ["--bootstrap", "<= 100000"]),
        ("cite-rates-bootstrap-huge", lambda e: ["cite-rates", S(e), "--log", L(e, "good"), "--bootstrap", 10**11],
         lambda e: ["--bootstrap", "<= 100000"]),
        ("log-more-candidates-than-k", lambda e: rp(e, "too_many_candidates"), lambda e: ["--k", "too_many"]),
        ("log-more-selected-than-m", lambda e: rp(e, "too_many_selected"), lambda e: ["--m", "too_many"]),
        ("log-is-directory", lambda e: ["replay", S(e), "--log", e["logs"], "--policies", new_pol(e)],
         lambda e: [str(e["logs"]), "directory"]),
        ("log-missing", lambda e: ["replay", S(e), "--log", e["root"] / "nope.jsonl", "--policies", new_pol(e)],
         lambda e: ["nope.jsonl", "not found"]),
        ("replay-store-is-file", lambda e: ["replay", e["file"], "--log", L(e, "good"), "--policies", new_pol(e)],
         lambda e: [str(e["file"])]),
        ("replay-nan-store", lambda e: ["replay", e["nan_store"], "--log", L(e, "good"), "--policies", new_pol(e),
                                        "--k", K, "--m", M], lambda e: ["memories.npy", "NaN"]),
        ("replay-policy-dim", lambda e: rp(e, "good")[:4] + ["--policies", e["pol16"], "--k", K, "--m", M],
         lambda e: [str(e["pol16"]), "dim 16", "32"]),
        ("replay-policy-other-model", lambda e: rp(e, "good")[:4] + ["--policies", e["pol_model"], "--k", K,
                                                                     "--m", M], lambda e: ["--policies",
                                                                                           "other/model-32"]),
        ("replay-clip", lambda e: rp(e, "good", "--clip", "0.5"), lambda e: ["--clip"]),
        ("replay-paper-preset", lambda e: rp(e, "good", "--preset", "paper"), lambda e: ["--preset"]),
        # --k and --m left out: the "--k --m from LOG" note waits until the log has been read
        ("replay-clip-k-m-from-log", lambda e: rp(e, "good")[:-4] + ["--clip", "0.5"],
         lambda e: ["--clip"]),
        ("replay-paper-preset-k-m-from-log", lambda e: rp(e, "good")[:-4] + ["--preset", "paper"],
         lambda e: ["--preset"]),
        ("replay-users-per-chunk", lambda e: rp(e, "good", "--users-per-chunk", 0), lambda e: ["--users-per-chunk"]),
        ("replay-checkpoint-every", lambda e: rp(e, "good", "--scope", "hybrid", "--checkpoint-every", -1),
         lambda e: ["--checkpoint-every"]),      # it created the policy store, pinned to hybrid, before refusing
    ]
    # ---- K, M, tau, lr out of range: every online command
    for opt, val, name in [("--k", 0, "--k"), ("--m", 0, "--m"), ("--m", K + 1, "--m"), ("--tau", 0, "--tau"),
                           ("--tau", -1, "--tau"), ("--tau", "nan", "--tau"), ("--tau", "1e-45", "--tau"),
                           ("--lr", 0, "--lr"), ("--lr", "inf", "--lr"), ("--lr", "1e300", "--lr"),
                           ("--tau", "1e300", "--tau"),     # finite in float64, inf in float32: NaN policies saved
                           ("--lr", -1, "--lr"), ("--batch", 0, "--batch"), ("--k", "abc", "--k"),
                           ("--batch", 100_000, "--batch"),      # the stream padded to it: out of memory, killed
                           ("--k", 10**20, "--k"), ("--k", 2**31, "--k")]:    # NumPy tracebacks; int32 indices
        c.append((f"replay{opt}={val}", lambda e, o=opt, v=val: rp(e, "good", o, v), lambda e, n=name: [n]))
        c.append((f"simulate{opt}={val}", lambda e, o=opt, v=val: sim(e, o, v), lambda e, n=name: [n]))
        c.append((f"demo{opt}={val}", lambda e, o=opt, v=val: ["demo", "--out", e["root"] / "demo", "--k", K, o, v],
                  lambda e, n=name: [n]))
    c.append(("pretrain--k=1e20", lambda e: pre(e, "--k", 10**20), lambda e: ["--k"]))
    # ---- a step size in float32's range that diverges: NaN policies were saved with exit 0
    c += [
        # checkpointed after every batch: the run-state held the diverged states, and the same command
        # with a smaller --lr was told to --resume them
        ("replay-lr-diverges", lambda e: rp(e, "good", "--lr", "3e38", "--batch", 1, "--checkpoint-every", 1),
         lambda e: ["--lr", "diverged"]),
        # a plot written into a store it reads would overwrite that store's files
        ("evaluate-plot-in-policies", lambda e: ["evaluate", S(e), "--log", L(e, "good"), "--policies",
                                                 e["pol_existing"], "--plot", e["pol_existing"] / "x.png"],
         lambda e: ["--plot", "lies in --policies"]),
        ("replay-plot-in-store", lambda e: rp(e, "good", "--plot", S(e) / "x.png"),
         lambda e: ["--plot", "lies in STORE"]),
        ("replay-passes-huge", lambda e: rp(e, "good", "--passes", 10 ** 9), lambda e: ["--passes"]),  # repeated: OOM
        ("simulate-lr-diverges", lambda e: sim(e, "--lr", "3e38", "--batch", 1, "--checkpoint-every", 1),
         lambda e: ["--lr", "diverged"]),
    ]
    # ---- simulate
    c += [
        ("simulate-precision", lambda e: sim(e, "--precision", 1.5), lambda e: ["--precision"]),
        ("simulate-precision-0", lambda e: sim(e, "--precision", 0), lambda e: ["--precision"]),
        ("simulate-recall", lambda e: sim(e, "--recall", -0.1), lambda e: ["--recall"]),
        ("simulate-unknown-user", lambda e: sim(e, "--users", "nobody"), lambda e: ["--users", "nobody"]),
        ("simulate-resume-finished", lambda e: ["simulate", e["store"], "--policies", e["pol_existing"], "--resume"],
         lambda e: ["--resume", "no checkpoint"]),     # it used to simulate the whole run again, learning twice
        ("simulate-user-twice", lambda e: sim(e, "--users", f"{e['user'].user_id},{e['user'].user_id}"),
         lambda e: ["--users", "twice"]),
        ("pretrain-user-twice", lambda e: pre(e, "--users", f"{e['user'].user_id},{e['user'].user_id}"),
         lambda e: ["--users", "twice"]),
        ("simulate-users-per-chunk", lambda e: sim(e, "--users-per-chunk", 0), lambda e: ["--users-per-chunk"]),
        ("simulate-checkpoint-every", lambda e: sim(e, "--checkpoint-every", -1), lambda e: ["--checkpoint-every"]),
        ("simulate-seed-beyond-a-key", lambda e: sim(e, "--seed", 2**63), lambda e: ["--seed"]),
        ("simulate-log-out-dir", lambda e: sim(e)[:-2] + ["--log-out", e["logs"]], lambda e: ["--log-out"]),
        ("simulate-store-missing", lambda e: ["simulate", e["root"] / "nostore", "--policies", new_pol(e)],
         lambda e: ["nostore"]),
        ("simulate-store-is-file", lambda e: ["simulate", e["file"], "--policies", new_pol(e)],
         lambda e: [str(e["file"])]),
        ("simulate-nan-store", lambda e: ["simulate", e["nan_store"], "--policies", new_pol(e)],
         lambda e: ["memories.npy", "NaN"]),
        ("simulate-policy-dim", lambda e: ["simulate", e["store"], "--policies", e["pol16"]],
         lambda e: [str(e["pol16"]), "dim 16"]),
        ("simulate-store16-vs-policy32", lambda e: ["simulate", e["store16"], "--policies", e["pol_existing"]],
         lambda e: [str(e["pol_existing"]), "dim 32", "expected 16"]),
        ("simulate-policy-other-model", lambda e: ["simulate", e["store"], "--policies", e["pol_model"], "--init",
                                                   "pretrained"], lambda e: ["--policies", "other/model-32"]),
        ("simulate-pretrained-missing", lambda e: sim(e, "--init", "pretrained"), lambda e: ["--policies"]),
        ("simulate-kind-mismatch", lambda e: ["simulate", e["store"], "--policies", e["pol_existing"], "--kind",
                                              "mlp"], lambda e: ["--kind"]),
        ("simulate-store-not-store-dir", lambda e: ["simulate", e["logs"], "--policies", new_pol(e)],
         lambda e: [str(e["logs"]), "manifest.json"]),
    ]
    # ---- pretrain
    c += [
        ("pretrain-lr-0", lambda e: pre(e, "--lr", 0), lambda e: ["--lr"]),
        ("pretrain-lr-neg", lambda e: pre(e, "--lr", -1), lambda e: ["--lr"]),
        ("pretrain-temperature", lambda e: pre(e, "--temperature", 0), lambda e: ["--temperature"]),
        ("pretrain-temperature-tiny", lambda e: pre(e, "--temperature", "1e-45"), lambda e: ["--temperature"]),
        ("pretrain-lr-inf", lambda e: pre(e, "--lr", "inf"), lambda e: ["--lr"]),
        ("pretrain-weight-decay-nan", lambda e: pre(e, "--weight-decay", "nan"), lambda e: ["--weight-decay"]),
        ("pretrain-weight-decay-neg", lambda e: pre(e, "--weight-decay", -1), lambda e: ["--weight-decay"]),
        ("pretrain-hidden-linear", lambda e: pre(e, "--hidden", 8), lambda e: ["--hidden", "mlp"]),
        ("pretrain-mlp-hidden-0", lambda e: pre(e, "--kind", "mlp", "--hidden", 0), lambda e: ["--hidden"]),
        ("pretrain-k-0", lambda e: pre(e, "--k", 0), lambda e: ["--k: must be >= 1, got 0"]),
        # each says its range: it was "--m: out of range: 9", not that --m may not pass --k
        ("pretrain-m-gt-k", lambda e: pre(e, "--m", K + 1), lambda e: [f"--m: must be in [1, --k={K}], got {K + 1}"]),
        ("pretrain-epochs", lambda e: pre(e, "--epochs", 0), lambda e: ["--epochs: must be >= 1, got 0"]),
        ("pretrain-val-fraction", lambda e: pre(e, "--val-fraction", 1.0),
         lambda e: ["--val-fraction: must be in [0, 1), got 1.0"]),
        # 0.9 of 3 users holds out all 3: it was "no training query has a gold memory ... --labels dialogue"
        ("pretrain-val-fraction-holds-out-everyone", lambda e: pre(e, "--val-fraction", 0.9),
         lambda e: ["--val-fraction", "none to train on"]),
        ("pretrain-unknown-user", lambda e: pre(e, "--users", "nobody"), lambda e: ["--users"]),
        ("pretrain-out-exists", lambda e: ["pretrain", e["store"], "--out", e["pol_existing"], "--epochs", 1],
         lambda e: ["--out", str(e["pol_existing"])]),
        ("pretrain-store-is-file", lambda e: ["pretrain", e["file"], "--out", new_pol(e)],
         lambda e: [str(e["file"])]),
        ("pretrain-dialogue-segment-store", lambda e: ["pretrain", e["segment_store"], "--labels", "dialogue",
                                                       "--out", new_pol(e), "--k", K, "--m", M],
         lambda e: [str(e["segment_store"]), "single turns"]),
        ("pretrain-labels-unknown", lambda e: pre(e, "--labels", "citations"), lambda e: ["--labels"]),
        ("pretrain-gold-without-gold", lambda e: ["pretrain", e["nogold_store"], "--out", new_pol(e), "--k", K,
                                                  "--m", M],
         lambda e: [str(e["nogold_store"]), "no query of the store's users has a gold memory", "--labels dialogue"]),
        # with --resume the run-state's "no checkpoint; starting from the beginning" came first: two lines
        ("pretrain-gold-without-gold-resume", lambda e: ["pretrain", e["nogold_store"], "--out", new_pol(e), "--k", K,
                                                         "--m", M, "--resume"],
         lambda e: [str(e["nogold_store"]), "no query of the store's users has a gold memory"]),
        # a store of chats without questions said "no training query has a gold memory", as if gold were missing
        ("pretrain-gold-without-questions", lambda e: ["pretrain", e["chats_store"], "--out", new_pol(e), "--k", K,
                                                       "--m", M],
         lambda e: [str(e["chats_store"]), "the store's users (", ") have no questions", "--labels dialogue"]),
        ("pretrain-nan-store", lambda e: ["pretrain", e["nan_store"], "--out", new_pol(e)],
         lambda e: ["memories.npy", "NaN"]),
    ]
    # ---- retrieve
    c += [
        ("retrieve-k-0", lambda e: ["retrieve", e["store"], "--k", 0], lambda e: ["--k"]),
        ("retrieve-k-bigger-than-bank", lambda e: ["retrieve", e["store"], "--k", 10_000], lambda e: ["--k", "bank"]),
        ("retrieve-other-model", lambda e: ["retrieve", e["store"], "--expect-model", "other/model"],
         lambda e: [str(e["store"]), "other/model"]),
        ("retrieve-nan-store", lambda e: ["retrieve", e["nan_store"]], lambda e: ["memories.npy", "NaN"]),
        ("retrieve-store-missing", lambda e: ["retrieve", e["root"] / "nostore"], lambda e: ["nostore"]),
        ("retrieve-store-is-file", lambda e: ["retrieve", e["file"]], lambda e: [str(e["file"])]),
        # a store with nothing to measure printed a table of dashes and exited 0
        ("retrieve-no-questions", lambda e: ["retrieve", e["chats_store"], "--k", K],
         lambda e: [str(e["chats_store"]), "holds no questions: nothing to measure"]),
        ("retrieve-no-gold", lambda e: ["retrieve", e["nogold_store"], "--k", K],
         lambda e: [str(e["nogold_store"]), "has no question with a gold memory", "without one)"]),
    ]
    # ---- embed
    out = lambda e: e["root"] / "new_store"
    c += [
        ("embed-unknown-spec", lambda e: ["embed", "nosuch:x", "--out", out(e)], lambda e: ["SPEC", "nosuch"]),
        ("embed-empty-spec", lambda e: ["embed", "", "--out", out(e)], lambda e: ["SPEC"]),
        ("embed-synthetic-users-0", lambda e: ["embed", "synthetic:users=0", "--out", out(e)],
         lambda e: ["synthetic spec", "users"]),
        ("embed-synthetic-unknown-key", lambda e: ["embed", "synthetic:colour=3", "--out", out(e)],
         lambda e: ["synthetic spec", "colour"]),
        ("embed-synthetic-not-int", lambda e: ["embed", "synthetic:users=two", "--out", out(e)],
         lambda e: ["synthetic spec", "users"]),
        ("embed-synthetic-no-equals", lambda e: ["embed", "synthetic:users", "--out", out(e)],
         lambda e: ["synthetic spec"]),
        ("embed-locomo-missing", lambda e: ["embed", f"locomo:{e['root'] / 'nope'}", "--out", out(e)],
         lambda e: ["nope"]),
        # an empty file stays an error where emptiness is one: chats to embed, a log to embed memories from
        ("embed-jsonl-empty", lambda e: ["embed", f"jsonl:{L(e, 'empty')}", "--out", out(e)],
         lambda e: [str(L(e, "empty")), "no records (the file is empty)"]),
        ("embed-log-blank-only", lambda e: ["embed", f"log:{L(e, 'blank_only')}", "--out", out(e)],
         lambda e: [str(L(e, "blank_only")), "no records (the file is empty)"]),
        ("embed-jsonl-lone-surrogate", lambda e: ["embed", f"jsonl:{L(e, 'chats_lone_surrogate')}", "--out", out(e)],
         lambda e: [f"{L(e, 'chats_lone_surrogate')}:1", "lone surrogate \\ud83d"]),
        ("embed-log-blank-candidate-text", lambda e: ["embed", f"log:{L(e, 'text_log_blank_candidate')}", "--out",
                                                      out(e)],
         lambda e: [f"{L(e, 'text_log_blank_candidate')}:2", "'candidates'", "empty"]),
        ("embed-log-memories-blank-text",
         lambda e: ["embed", f"log:{L(e, 'text_log')},memories={L(e, 'memories_blank_text')}", "--out", out(e)],
         lambda e: [f"{L(e, 'memories_blank_text')}:1", "'text'", "empty"]),
        ("embed-locomo-lone-surrogate",
         lambda e: ["embed", f"locomo:{e['root'] / 'surrogate_locomo.json'}", "--out", out(e)],
         lambda e: ["surrogate_locomo.json", "lone surrogate \\udc00"]),
        ("embed-locomo-path-missing", lambda e: ["embed", "locomo:", "--out", out(e)], lambda e: ["SPEC"]),
        ("embed-out-is-file", lambda e: ["embed", "synthetic:users=1", "--out", e["file"]],
         lambda e: ["--out"]),
        ("embed-bad-granularity", lambda e: ["embed", "synthetic:users=1", "--out", out(e), "--granularity", "x"],
         lambda e: ["--granularity"]),
        # NaN passes click's range: it was refused once the data and the model had loaded, after their lines
        ("embed-segment-threshold-nan", lambda e: ["embed", "synthetic:users=1", "--out", out(e), "--granularity",
                                                   "segment", "--segment-threshold", "nan"],
         lambda e: ["--segment-threshold", "[-1, 1]"]),
        ("embed-merge-threshold-nan", lambda e: ["embed", "synthetic:users=1", "--out", out(e), "--granularity",
                                                 "segment", "--merge-threshold", "nan"],
         lambda e: ["--merge-threshold", "[-1, 1]"]),
        # --out replaces an embedding store, never another directory (before the model loads)
        ("embed-out-policy-store", lambda e: ["embed", "synthetic:users=1", "--out", e["pol_existing"]],
         lambda e: [f"--out {e['pol_existing']}", "not an embedding store"]),
        ("embed-out-other-files", lambda e: ["embed", "synthetic:users=1", "--out", e["logs"]],
         lambda e: [f"--out {e['logs']}", "not empty"]),
    ]
    # ---- policies
    c += [
        ("policies-list-missing", lambda e: ["policies", "list", e["root"] / "nopol"], lambda e: ["nopol"]),
        ("policies-list-file", lambda e: ["policies", "list", e["file"]], lambda e: [str(e["file"])]),
        ("policies-list-store-dir", lambda e: ["policies", "list", e["store"]], lambda e: [str(e["store"])]),
        ("policies-show-unknown-user", lambda e: ["policies", "show", e["pol_existing"], "nobody"],
         lambda e: ["nobody", str(e["pol_existing"])]),
        ("policies-export-unknown-user", lambda e: ["policies", "export", e["pol_existing"], "nobody", "--out",
                                                    e["root"] / "x.npz"], lambda e: ["nobody"]),
        ("policies-export-missing-out", lambda e: ["policies", "export", e["pol_existing"], "u"],
         lambda e: ["--out"]),
        ("policies-rollback-missing", lambda e: ["policies", "rollback", e["root"] / "nopol"], lambda e: ["nopol"]),
        ("policies-rollback-nothing-saved", lambda e: ["policies", "rollback", e["pol_existing"]],
         lambda e: [str(e["pol_existing"]), "nothing to roll back"]),
        ("policies-rollback-negative-to", lambda e: ["policies", "rollback", e["pol_existing"], "--to", -1],
         lambda e: ["--to", ">= 0"]),
    ]
    # ---- demo
    c += [
        ("demo-users", lambda e: ["demo", "--out", e["root"] / "demo", "--users", 2], lambda e: ["--users"]),
        ("demo-out-is-file", lambda e: ["demo", "--out", e["file"]], lambda e: ["--out"]),
        # were "[1/3] embedding ..." and then an error naming the synthetic spec
        ("demo-sessions-0", lambda e: ["demo", "--out", e["root"] / "demo", "--sessions", 0], lambda e: ["--sessions"]),
        ("demo-turns-negative", lambda e: ["demo", "--out", e["root"] / "demo", "--turns", -1], lambda e: ["--turns"]),
        ("demo-rank-beyond-dim", lambda e: ["demo", "--out", e["root"] / "demo", "--users", 4, "--sessions", 2,
                                            "--turns", 4, "--scope", "hybrid", "--rank", 400],
         lambda e: ["--rank"]),
    ]
    # ---- the CLI itself
    c += [
        ("unknown-command", lambda e: ["frobnicate"], lambda e: ["frobnicate"]),
        ("unknown-option", lambda e: ["retrieve", e["store"], "--frob"], lambda e: ["--frob"]),
        ("missing-argument", lambda e: ["retrieve"], lambda e: ["STORE"]),
        ("missing-required-option", lambda e: ["replay", e["store"], "--log", L(e, "good")],
         lambda e: ["--policies"]),
    ]
    return c


CASES = cases()


@pytest.mark.parametrize("argv,names", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_bad_input_fails_with_one_line_and_touches_nothing(env, capsys, argv, names):
    before = snapshot(env["root"])
    code, out, err = cli(capsys, *argv(env))
    assert_one_line_error(code, err, names(env))
    after = snapshot(env["root"])
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                             if before.get(k) != after.get(k)}


def test_case_ids_are_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


def test_skip_invalid_counts_and_succeeds(env, capsys, tmp_path):
    log = env["logs"] / "mixed.jsonl"   # 3 valid lines, 2 invalid (line 2: cited, line 4: JSON)
    code, out, err = cli(capsys, "replay", env["store"], "--log", log, "--policies", tmp_path / "pol",
                         "--k", K, "--m", M, "--skip-invalid", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["log"]["records"] == 3 and doc["log"]["skipped"] == 2
    assert any(f"{log}:2" in m for m in doc["log"]["first_errors"])
    assert doc["online"]["queries"] <= 3
    # the one info line is the count (progress bars are cleared: no other text remains)
    info = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and "%|" not in ln]
    assert info and info[-1].startswith("skipped 2 invalid records of 5"), err
    assert "Traceback" not in err
    # evaluate skips and counts them the same way
    logged = tmp_path / "logged.jsonl"
    logged.write_text("".join(json.dumps({**r, "log_prob": -2.0}) + "\n" for r in env["good"][:3]) + "{\n")
    code, _, err = cli(capsys, "evaluate", env["store"], "--log", logged, "--policies", tmp_path / "pol", "--k", K,
                       "--m", M, "--skip-invalid", "--allow-unreliable")
    assert code == 0 and "skipped 1 invalid records of 4; first: " in err and "Traceback" not in err, err
    # without --skip-invalid the same log fails on line 2 and writes nothing
    code, _, err = cli(capsys, "replay", env["store"], "--log", log, "--policies", tmp_path / "pol2",
                       "--k", K, "--m", M)
    assert_one_line_error(code, err, [f"{log}:2", "'cited'"])
    assert not (tmp_path / "pol2").exists()


def test_skip_invalid_with_no_valid_record_fails(env, capsys, tmp_path):
    code, _, err = cli(capsys, "replay", env["store"], "--log", env["logs"] / "unknown_query.jsonl",
                       "--policies", tmp_path / "pol", "--k", K, "--m", M, "--skip-invalid")
    assert_one_line_error(code, err, ["unknown_query.jsonl", "no records"])
    assert not (tmp_path / "pol").exists()


@pytest.mark.parametrize("argv,names", [
    pytest.param(lambda e: ["replay", e["store"], "--log", e["logs"] / "duplicate_query.jsonl", "--policies",
                            e["root"] / "new_pol"],
                 lambda e: ["duplicate_query.jsonl:3", "'query_id'"], id="replay-log"),
    pytest.param(lambda e: ["simulate", e["store"], "--policies", e["root"] / "new_pol", "--tau", "0"],
                 lambda e: ["--tau"], id="simulate-tau"),
    pytest.param(lambda e: ["embed", "synthetic:users=0", "--out", e["root"] / "new_store"],
                 lambda e: ["synthetic spec"], id="embed-spec"),
    pytest.param(lambda e: ["retrieve", e["store"], "--k", "x"], lambda e: ["--k"], id="usage-error"),
])
def test_console_script_behaves_the_same(env, argv, names):
    exe = REPO / ".venv" / "bin" / "rmm-jax"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "rmm_jax.cli.main"]
    before = snapshot(env["root"])
    r = subprocess.run(cmd + [str(a) for a in argv(env)], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert_one_line_error(r.returncode, r.stderr, names(env))
    assert r.stdout == ""
    assert snapshot(env["root"]) == before


PIPE_CLOSED_LINE = "error: stdout: its reader closed the pipe before everything was written\n"


def rmm_jax_cmd() -> list[str]:
    exe = REPO / ".venv" / "bin" / "rmm-jax"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "rmm_jax.cli.main"]


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("argv", [
    pytest.param(lambda e: ["--help"], id="help"),
    pytest.param(lambda e: ["policies", "list", e["pol16"]], id="policies-list"),
])
def test_stdout_whose_reader_left_is_one_error_line(env, argv, unbuffered):
    """`rmm-jax ... | head` with the reader gone: click exited 1 (or 0) without a word; it is the
    line a FIFO --out gives, status 2, and nothing else (no "Exception ignored" at the exit)."""
    r, w = os.pipe()
    os.close(r)                       # the reader is gone before the first write: deterministic
    try:
        p = subprocess.run(rmm_jax_cmd() + [str(a) for a in argv(env)], stdout=w, stderr=subprocess.PIPE,
                           text=True, cwd=REPO, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (2, PIPE_CLOSED_LINE)


def test_a_closed_stdout_is_no_traceback():
    """Run with stdout closed (`>&-`: Python's sys.stdout is None), a verb that prints nothing
    there finished its work and then raised AttributeError on the final flush; exit 0 as before."""
    r = subprocess.run(["bash", "-c", 'exec "$@" >&-', "closed", *rmm_jax_cmd(), "--version"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_served_lines_cut_by_their_reader_are_an_error_line(env, tmp_path):
    """rerank's served lines into a reader that stops after the first (`| head -1`): with
    PYTHONUNBUFFERED the write the pipe took only part of lost the rest and exited 0."""
    u = env["open_store"].user(env["open_store"].user_ids[0])
    calls = tmp_path / "calls.jsonl"
    calls.write_text(jl(*[{"user_id": u.user_id, "query_id": u.query_ids[i % len(u.query_ids)], "call_id": f"c{i}"}
                          for i in range(600)]))
    p = subprocess.Popen(rmm_jax_cmd() + ["rerank", str(env["store"]), "--calls", str(calls), "--explore"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 2, err
    assert first and json.loads(first)["user_id"] == u.user_id, err
    assert err.splitlines()[-1] + "\n" == PIPE_CLOSED_LINE and "Exception ignored" not in err


# --------------------------------------------------------------------------- property-based


MUTATIONS = ("drop_key", "wrong_type", "ghost_user", "ghost_query", "ghost_memory", "selected_outside",
             "cited_outside", "dup_id", "empty_candidates", "log_prob_positive", "log_prob_nan", "truncated",
             "not_object", "dup_pair", "too_many_candidates", "too_many_selected")


@st.composite
def valid_record(draw, env):
    s = env["open_store"]
    uid = draw(st.sampled_from(s.user_ids))
    u = s.user(uid)
    qid = draw(st.sampled_from(u.query_ids))
    cand = draw(st.lists(st.sampled_from(u.memory_ids), min_size=1, max_size=K, unique=True))
    sel = draw(st.lists(st.sampled_from(cand), min_size=1, max_size=min(M, len(cand)), unique=True))
    cited = draw(st.lists(st.sampled_from(sel), max_size=len(sel), unique=True))
    rec = {"user_id": uid, "query_id": qid, "candidates": cand, "selected": sel, "cited": cited}
    if draw(st.booleans()):
        rec["log_prob"] = draw(st.floats(-50, 0))
    if draw(st.booleans()):
        rec["timestamp"] = draw(st.one_of(st.text(max_size=5), st.integers(0, 10**9)))
    if draw(st.booleans()):
        rec["extra"] = "ignored"
    return rec


def mutate(draw, rec, env, kind):
    """Return (lines, bad line number) for a record broken in one way that is always invalid."""
    rec = json.loads(json.dumps(rec))
    u = env["open_store"].user(rec["user_id"])
    if kind == "drop_key":
        del rec[draw(st.sampled_from(["user_id", "query_id", "candidates", "selected", "cited"]))]
    elif kind == "wrong_type":
        key = draw(st.sampled_from(["user_id", "query_id", "candidates", "selected", "cited", "log_prob"]))
        rec[key] = draw(st.sampled_from([7, True, {"a": 1}, [1]] if key != "log_prob" else ["x", True, [0]]))
        if key in ("user_id", "query_id") and rec[key] == [1]:
            rec[key] = 3.5
    elif kind == "ghost_user":
        rec["user_id"] = "ghost-user"
    elif kind == "ghost_query":
        rec["query_id"] = "ghost-query"
    elif kind == "ghost_memory":
        rec["candidates"] = rec["candidates"][:-1] + ["ghost-memory"] if len(rec["candidates"]) > len(
            rec["selected"]) else rec["candidates"] + ["ghost-memory"]
        rec["candidates"] = rec["candidates"][:K]
        if "ghost-memory" not in rec["candidates"]:
            rec["candidates"][-1] = "ghost-memory"
            rec["selected"] = [x for x in rec["selected"] if x in rec["candidates"]] or [rec["candidates"][0]]
            rec["cited"] = [x for x in rec["cited"] if x in rec["selected"]]
    elif kind == "selected_outside":
        rec["selected"] = rec["selected"][:M - 1] + ["not-a-candidate"]
    elif kind == "cited_outside":
        rec["cited"] = rec["cited"] + ["not-selected"]
    elif kind == "dup_id":
        key = draw(st.sampled_from(["candidates", "selected"]))
        rec[key] = rec[key][:1] * 2
    elif kind == "empty_candidates":
        rec["candidates"] = []
    elif kind == "log_prob_positive":
        rec["log_prob"] = draw(st.floats(1e-6, 1e6))
    elif kind == "log_prob_nan":
        rec["log_prob"] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    elif kind == "truncated":
        line = json.dumps(rec)
        return [line[:draw(st.integers(1, len(line) - 1))]], 1
    elif kind == "not_object":
        return [json.dumps(draw(st.sampled_from([[rec], "x", 3, None])))], 1
    elif kind == "dup_pair":          # the same call with other content (an exact repeat is read once)
        other = {**rec, "cited": [] if rec["cited"] else rec["selected"][:1]}
        return [json.dumps(rec), json.dumps(other)], 2
    elif kind == "too_many_candidates":
        extra = [m for m in u.memory_ids if m not in rec["candidates"]]
        rec["candidates"] = rec["candidates"] + extra[:K + 1 - len(rec["candidates"])]
        return [json.dumps(rec)], None   # a --k limit, named by option rather than line
    elif kind == "too_many_selected":
        extra = [m for m in rec["candidates"] if m not in rec["selected"]]
        rec["candidates"] = rec["candidates"] + [m for m in u.memory_ids if m not in rec["candidates"]][:M]
        rec["candidates"] = rec["candidates"][:K]
        extra = [m for m in rec["candidates"] if m not in rec["selected"]]
        rec["selected"] = rec["selected"] + extra[:M + 1 - len(rec["selected"])]
        return [json.dumps(rec)], None
    return [json.dumps(rec, allow_nan=True)], 1


_counter = [0]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_records_through_replay(env, capsys, data):
    """Valid records are accepted by the validation pass replay runs first (the same
    scan_log and known_ids); malformed ones make `rmm-jax replay` exit 2 with one line
    naming the file and line (or --k/--m), creating nothing. Never a crash."""
    rec = data.draw(valid_record(env))
    kind = data.draw(st.sampled_from((None,) * 4 + MUTATIONS))
    _counter[0] += 1
    log = env["root"] / "hyp" / f"log{_counter[0]}.jsonl"
    log.parent.mkdir(exist_ok=True)
    pol = env["root"] / "hyp" / "pol"
    if kind is None:
        log.write_text(json.dumps(rec) + "\n")
        rep = scan_log(log, Layout(k=K, m=M), known=known_ids(env["open_store"]))
        assert rep.read.records == 1 and rep.users == 1 and rep.read.skipped == 0
    else:
        lines, bad = mutate(data.draw, rec, env, kind)
        log.write_text("\n".join(lines) + "\n")
        code, out, err = cli(capsys, "replay", env["store"], "--log", log, "--policies", pol, "--k", K, "--m", M)
        names = [f"{log}:{bad}"] if bad else [str(log)]
        assert_one_line_error(code, err, names)
        assert out == "" and not pol.exists()
    log.unlink()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_valid_logs_replay_end_to_end(env, capsys, data):
    """A few random valid logs run the whole replay (each call compiles once)."""
    recs, seen = [], set()
    for _ in range(data.draw(st.integers(1, 6))):
        r = data.draw(valid_record(env))
        if (r["user_id"], r["query_id"]) not in seen:
            seen.add((r["user_id"], r["query_id"]))
            recs.append(r)
    recs.sort(key=lambda r: r["user_id"])
    _counter[0] += 1
    d = env["root"] / "hyp_ok" / str(_counter[0])
    d.mkdir(parents=True)
    (d / "log.jsonl").write_text(jl(*recs))
    # the log's own K and M: random records need not agree on them, so they are given
    k, m = max(len(r["candidates"]) for r in recs), max(len(r["selected"]) for r in recs)
    code, out, err = cli(capsys, "replay", env["store"], "--log", d / "log.jsonl", "--policies", d / "pol",
                         "--k", k, "--m", m, "--json", "--users-per-chunk", 2)
    assert code == 0, err
    assert "Traceback" not in err
    doc = json.loads(out)
    assert doc["log"]["records"] == len(recs) and doc["log"]["skipped"] == 0
    shutil.rmtree(d)


# --------------------------------------------------------------------------- read-only outputs


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` and everything under it unwritable for this process while inside: chmod a-w, and
    as root (which ignores modes) ``chattr +i`` too. Skips where neither makes it read-only."""
    paths = [path, *path.rglob("*")]
    modes = {p: p.stat().st_mode & 0o7777 for p in paths}
    for p in paths:
        os.chmod(p, modes[p] & ~0o222)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "-R", "+i", str(path)],
                                                     capture_output=True).returncode == 0
    try:
        try:
            (path / ".probe").touch()
        except OSError:
            pass
        else:
            (path / ".probe").unlink()
            pytest.skip(f"cannot make {path} read-only here (root without chattr +i?)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-R", "-i", str(path)], check=True)
        for p in reversed(paths):
            os.chmod(p, modes[p])


@pytest.fixture
def model_starts(monkeypatch):
    """``embed`` with a model-free embedder of the test stores' model (so a check it skips fails
    as the real work would); the list records each start, and stays empty when ``embed``
    refuses before any work."""
    import rmm_jax.cli.embed as embed_cli
    starts = []
    monkeypatch.setattr(embed_cli, "Embedder", lambda *a, **k: starts.append(a) or FakeEmbedder(32))
    return starts


def good_log(e) -> Path:
    return e["logs"] / "good.jsonl"


GROWN = "synthetic:users=4,sessions=4,turns=8,seed=0"   # env["store"] and one more user: something to append

READ_ONLY_CASES = {   # what each verb writes, under ro/ (read-only) or as the read-only policy store ro/pol
    "simulate-policies": (lambda e, ro, w: ["simulate", e["store"], "--policies", ro / "pol", "--k", K, "--m", M],
                          lambda ro: [str(ro / "pol")]),
    "replay-policies": (lambda e, ro, w: ["replay", e["store"], "--log", good_log(e), "--policies", ro / "pol",
                                          "--k", K, "--m", M], lambda ro: [str(ro / "pol")]),
    "simulate-new-policies": (lambda e, ro, w: ["simulate", e["store"], "--policies", ro / "new", "--k", K,
                                                "--m", M], lambda ro: [str(ro / "new"), "--policies"]),
    "simulate-log-out": (lambda e, ro, w: ["simulate", e["store"], "--policies", w / "p", "--k", K, "--m", M,
                                           "--log-out", ro / "log.jsonl"], lambda ro: ["--log-out", str(ro)]),
    "replay-plot": (lambda e, ro, w: ["replay", e["store"], "--log", good_log(e), "--policies", w / "p", "--k", K,
                                      "--m", M, "--plot", ro / "c.png"], lambda ro: ["--plot", str(ro)]),
    "pretrain-out": (lambda e, ro, w: ["pretrain", e["store"], "--out", ro / "new"], lambda ro: ["--out", str(ro)]),
    "pretrain-plot": (lambda e, ro, w: ["pretrain", e["store"], "--out", w / "new", "--plot", ro / "e.png"],
                      lambda ro: ["--plot", str(ro)]),
    "embed-out": (lambda e, ro, w: ["embed", "synthetic:users=2", "--out", ro / "store"],
                  lambda ro: ["--out", str(ro)]),
    "embed-into": (lambda e, ro, w: ["embed", GROWN, "--into", ro / "emb"],
                   lambda ro: ["--into", str(ro)]),
    "rerank-out": (lambda e, ro, w: ["rerank", e["store"], "--policies", ro / "pol", "--calls", w / "calls.jsonl",
                                     "--out", ro / "ranked.jsonl"], lambda ro: ["--out", str(ro)]),
    "evaluate-plot": (lambda e, ro, w: ["evaluate", e["store"], "--log", good_log(e), "--policies", ro / "pol",
                                        "--k", K, "--m", M, "--plot", ro / "o.png"], lambda ro: ["--plot", str(ro)]),
    "export-out": (lambda e, ro, w: ["policies", "export", ro / "pol", "u", "--out", ro / "u.npz"],
                   lambda ro: ["--out", str(ro)]),
}


@pytest.mark.parametrize("case", list(READ_ONLY_CASES))
def test_a_read_only_output_is_one_line_before_any_work_and_leaves_nothing(env, capsys, tmp_path, case, model_starts):
    """A policy store, output directory or file that cannot take new files: one line naming it,
    exit 2, and nothing written anywhere (no run-state claiming an interrupted run, no
    temporaries, no half-created store)."""
    argv, names = READ_ONLY_CASES[case]
    ro, w = tmp_path / "ro", tmp_path / "w"
    ro.mkdir()
    w.mkdir()
    shutil.copytree(env["pol_existing"], ro / "pol")
    shutil.copytree(env["store"], ro / "emb")
    (w / "calls.jsonl").write_text(jl({"user_id": env["user"].user_id, "query_id": env["user"].query_ids[0]}))
    before = snapshot(tmp_path)
    with read_only(ro):
        code, _, err = cli(capsys, *argv(env, ro, w))
    assert_one_line_error(code, err, names(ro) + ["cannot write"])
    assert snapshot(tmp_path) == before and model_starts == []


def test_a_read_only_file_beside_a_file_output_does_not_block_it(env, capsys, tmp_path):
    """A file output is renamed into its directory and touches no other file there: a read-only
    archived log beside it (``chattr +i``, or mode 444 for another user) refused every
    ``--out`` in that directory, "cannot write: old_served.jsonl: not writable", exit 2."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "archive.jsonl").write_text("{}\n")
    (tmp_path / "calls.jsonl").write_text(jl({"user_id": env["user"].user_id, "query_id": env["user"].query_ids[0]}))
    with read_only(out / "archive.jsonl"):
        if os.access(out / "archive.jsonl", os.W_OK):     # read_only's own probe is of a directory
            pytest.skip("cannot make a file read-only here (root without chattr +i?)")
        code, _, err = cli(capsys, "rerank", env["store"], "--policies", env["pol_existing"], "--calls",
                           tmp_path / "calls.jsonl", "--out", out / "ranked.jsonl", "--k", K, "--m", M)
    assert code == 0, err
    assert len((out / "ranked.jsonl").read_text().splitlines()) == 1
    with read_only(out / "ranked.jsonl"):             # the output itself read-only: refused before any work
        before = (out / "ranked.jsonl").read_bytes()
        code, _, err = cli(capsys, "rerank", env["store"], "--policies", env["pol_existing"], "--calls",
                           tmp_path / "calls.jsonl", "--out", out / "ranked.jsonl", "--k", K, "--m", M)
        assert_one_line_error(code, err, [f"--out {out / 'ranked.jsonl'}", "not writable"])
        assert (out / "ranked.jsonl").read_bytes() == before


def test_a_read_only_file_system_is_the_machines_failure_exit_1(env, capsys, tmp_path, monkeypatch):
    """A read-only mount is the machine's doing, as a full disk is (docs/reliability.md: exit
    status 1, one line naming the output); it exited 2, bad input, so a cron wrapper took an
    infrastructure fault for bad data. A permission the operator set stays 2 (the tests above)."""
    import rmm_jax.persist.atomic as atomic

    def read_only_fs(prefix, parent):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(parent))

    monkeypatch.setattr(atomic, "temp_file", read_only_fs)
    (tmp_path / "calls.jsonl").write_text(jl({"user_id": env["user"].user_id, "query_id": env["user"].query_ids[0]}))
    code, _, err = cli(capsys, "rerank", env["store"], "--policies", env["pol_existing"], "--calls",
                       tmp_path / "calls.jsonl", "--out", tmp_path / "o" / "ranked.jsonl", "--k", K, "--m", M)
    assert_one_line_error(code, err, ["--out", "cannot write", "Read-only file system"], expect_code=1)


@pytest.mark.parametrize("opt", ["--into", "--out"])
def test_embed_refuses_a_store_it_cannot_replace_before_any_work(env, capsys, tmp_path, opt, model_starts):
    """The store is swapped for a new one and deleted: one that cannot be (immutable, read-only),
    in a directory that can take new files, is one line naming the option before the model
    loads, not a traceback from the swap after the embedding work."""
    store = tmp_path / "w" / "store"
    shutil.copytree(env["store"], store)
    before = snapshot(tmp_path)
    with read_only(store):
        code, _, err = cli(capsys, "embed", GROWN, opt, store)
    assert_one_line_error(code, err, [f"{opt} {store}", "cannot write"])
    assert snapshot(tmp_path) == before and model_starts == []


@pytest.mark.parametrize("opt,where", [("--out", "empty"), ("--out", "store"), ("--into", "store"),
                                       ("--out", "store/sub")])
def test_embed_refuses_the_current_directory(env, capsys, tmp_path, monkeypatch, opt, where, model_starts):
    """A rename cannot move '.' (EBUSY), and replacing a directory that holds the shell's would
    leave it in the deleted old store: `--out .` (an empty directory or a store) and `--into .`
    are one line naming the option, with nothing written."""
    shutil.copytree(env["store"], tmp_path / "store")
    (tmp_path / "store" / "sub").mkdir()
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / where)
    target = "." if where != "store/sub" else ".."
    before = snapshot(tmp_path)
    code, _, err = cli(capsys, "embed", GROWN, opt, target)
    assert_one_line_error(code, err, [f"{opt} {target}", "current directory"])
    assert snapshot(tmp_path) == before and model_starts == []


def test_embed_into_on_a_full_disk_is_one_line_exit_1_and_the_store_as_it_was(env, capsys, tmp_path, monkeypatch,
                                                                              model_starts):
    """`embed --into` grows the store through mapped files; on a full tmpfs a sparse mapped file
    died of SIGBUS ("Bus error", exit 135, its temporary directory left behind). The files'
    blocks are reserved first: the reservation's ENOSPC is one line naming --into, exit 1
    (the machine's failure, not bad input), nothing left beside the store, the store as it was."""
    from rmm_jax.data.store import _append
    store = tmp_path / "w" / "store"
    shutil.copytree(env["store"], store)
    before = snapshot(tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(_append.os, "posix_fallocate", full, raising=False)
    code, _, err = cli(capsys, "embed", GROWN, "--into", store)
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"error: --into {store}: no space left on device", err
    after = {k: v for k, v in snapshot(tmp_path).items() if not k.endswith(".store.lock")}   # the writers' lock file
    assert model_starts and after == before


def test_a_short_write_of_numpy_is_a_full_disk(env, capsys, tmp_path, monkeypatch):
    """numpy's np.save reports a full disk as `OSError: N requested and M written` with no errno:
    it was a traceback from `embed --out`; now one line naming --out, exit 1, and no store."""
    import numpy as np

    from rmm_jax.data.store import _write
    real = np.save

    def short(path, arr, *a, **k):
        if str(path).endswith("queries.npy"):
            raise OSError(f"{arr.nbytes} requested and {arr.nbytes // 3} written")
        return real(path, arr, *a, **k)
    monkeypatch.setattr(_write.np, "save", short)
    out = tmp_path / "new"
    code, _, err = cli(capsys, "embed", "synthetic:users=2", "--out", out)
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"error: --out {out}: the file system took only part of a write (no space left " \
                                   "on device?)", err
    assert not out.exists() and not list(tmp_path.glob(".new.tmp-*"))


def test_embed_into_a_store_without_answers_refuses_answers(env, capsys, tmp_path, model_starts):
    """`embed --into STORE --answers` on a store embedded without --answers cannot give its old
    questions answer embeddings (their answers are not in the store): one line naming --answers,
    not an append that exits 0 and leaves the store without the answers.npy the user asked for."""
    store = tmp_path / "store"
    shutil.copytree(env["store"], store)
    before = snapshot(tmp_path)
    code, _, err = cli(capsys, "embed", GROWN, "--into", store, "--answers")
    assert_one_line_error(code, err, ["--answers", str(store), "--out STORE --answers"])
    assert snapshot(tmp_path) == before and model_starts == []


def test_embed_into_with_another_model_is_refused_before_it_loads(env, capsys, tmp_path, model_starts):
    """`embed --into STORE --model OTHER` loaded OTHER (seconds; offline, a 'cannot load' error
    that sent the user to fetch a model the store then refused) before the store's model was
    compared: now one line naming --model and both models, before any work."""
    store = tmp_path / "store"
    shutil.copytree(env["store"], store)
    before = snapshot(tmp_path)
    code, _, err = cli(capsys, "embed", GROWN, "--into", store, "--model", "other/model")
    assert_one_line_error(code, err, ["--model", str(store), "'fake/bow-32'", "'other/model'"])
    assert snapshot(tmp_path) == before and model_starts == []


@pytest.mark.parametrize("verb", ["pretrain", "rollback"])
def test_a_path_spelt_like_an_argument_is_not_reported_as_its_option(env, capsys, tmp_path, monkeypatch, verb):
    """cli.shell.as_options rewrote every error whose location was the name of an argument it
    maps: a store at the relative path `users` (pretrain maps its `users` argument) said
    "--users: dialogue labels need ...", a policy store at `to` (policies rollback maps `to`)
    "--to: holds no user version", sending the user to an option they never gave. Only the
    API's argument errors (InputError(arg=...)) become options; a path stays the path."""
    monkeypatch.chdir(tmp_path)
    if verb == "pretrain":
        shutil.copytree(env["segment_store"], tmp_path / "users")
        argv = ["pretrain", "users", "--out", "new_pol", "--k", K, "--m", M, "--labels", "dialogue"]
        want = "error: users: dialogue labels need a store of single turns"
    else:
        shutil.copytree(env["pol_existing"], tmp_path / "to")
        argv = ["policies", "rollback", "to", "--dry-run"]
        want = "error: to: holds no user version"
    before = snapshot(tmp_path)
    code, _, err = cli(capsys, *argv)
    assert_one_line_error(code, err, [])
    assert err.startswith(want), err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_simulate_refuses_log_out_dash(env, capsys, tmp_path, monkeypatch, json_flag):
    """`simulate --log-out -` ran the whole simulation and wrote the log to a file named `-`
    where the user meant stdout, which carries the run's summary (or --json): one line naming
    --log-out, before any work, nothing written (rerank --out -, whose default is stdout, writes
    there: tests/test_serve.py)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "simulate", env["store"], "--policies", "pol", "--k", K, "--m", M,
                         "--log-out", "-", *json_flag)
    assert_one_line_error(code, err, ["--log-out -", "stdout"])
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("verb", ["embed", "pretrain"])
def test_a_store_directory_out_refuses_dash(env, capsys, tmp_path, monkeypatch, verb):
    """`embed --out -` and `pretrain --out -` made a directory named `-` where a user means
    stdout: one line naming --out, before any work (the model, the data, the training),
    nothing written."""
    monkeypatch.chdir(tmp_path)
    argv = (["embed", "synthetic:users=2", "--out", "-"] if verb == "embed" else
            ["pretrain", env["store"], "--out", "-", "--k", K, "--m", M])
    code, out, err = cli(capsys, *argv)
    assert_one_line_error(code, err, ["--out -", "not stdout"])
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("verb", ["replay", "evaluate", "cite-rates"])
def test_a_log_given_as_dash_is_one_line_saying_it_needs_a_file(env, capsys, tmp_path, monkeypatch, verb):
    """`--log -` was "-: file not found", as if the user had a file named `-`: replay and
    evaluate read a log more than once (checked whole first), so standard input cannot serve;
    they say so, naming --log, before any work, nothing written (rerank --calls - reads stdin)."""
    monkeypatch.chdir(tmp_path)
    more = {"replay": ["--policies", "pol"], "evaluate": ["--policies", "pol"], "cite-rates": []}[verb]
    code, out, err = cli(capsys, verb, env["store"], "--log", "-", *more)
    assert_one_line_error(code, err, ["--log -", "not standard input"] + (["more than once"] if more else []))
    assert out == "" and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- a full disk, a file-size limit


def size_limited(kib: int, *argv) -> list[str]:
    """``argv`` run under ``ulimit -f`` (files it writes may not grow past ``kib`` KiB), a write
    past it failing with EFBIG (SIGXFSZ ignored) instead of killing it. A shell sets both
    (a preexec_fn would fork this multithreaded process)."""
    return ["bash", "-c", f'trap "" XFSZ; ulimit -f {kib}; exec "$@"', "size-limited", *map(str, argv)]


def test_a_full_disk_in_a_run_is_one_line_naming_the_policies_and_the_resume(env, capsys, tmp_path, monkeypatch):
    """No space left while a run saves its second users chunk (the first saved and
    checkpointed): was an OSError traceback. One line naming --policies and the cause, exit 1,
    and the resume hint a stop by SIGTERM prints; --resume then finishes the run."""
    from rmm_jax.persist import policy_store
    real, saves = policy_store.write_snapshot, []

    def full(*a, **k):
        saves.append(1)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)
    pol = tmp_path / "p"
    run = ["simulate", env["store"], "--policies", pol, "--k", K, "--m", M, "--users-per-chunk", "1",
           "--plot", tmp_path / "c.png"]           # a second output, written only at the end: not named
    with monkeypatch.context() as m:
        m.setattr(policy_store, "write_snapshot", full)
        code, _, err = cli(capsys, *run)
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"error: --policies {pol}: no space left on device; interrupted; resume with " \
                                   "--resume", err
    code, _, err = cli(capsys, *run, "--resume")
    assert code == 0 and "resuming from" in err, err


def test_a_file_size_limit_is_one_line_naming_the_output(env, capsys, tmp_path):
    """`policies export --out` past the process's file-size limit (ulimit -f): was
    `OSError: [Errno 27] File too large` and a traceback; one line naming --out and the
    limit, exit 1."""
    pol = tmp_path / "p"
    code, _, err = cli(capsys, "simulate", env["store"], "--policies", pol, "--k", K, "--m", M)
    assert code == 0, err
    out = tmp_path / "u.npz"
    r = subprocess.run(size_limited(1, sys.executable, "-m", "rmm_jax.cli.main", "policies", "export", pol,
                                    env["user"].user_id, "--out", out), capture_output=True, text=True, cwd=REPO,
                       timeout=300)
    assert_one_line_error(r.returncode, r.stderr, [f"error: --out {out}: file too large for this process's limit "
                                                   "(ulimit -f)"], expect_code=1)
    assert not out.exists()


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_served_lines_into_a_full_file_name_stdout(env, tmp_path, unbuffered):
    """rerank's served lines redirected into a file past the file-size limit (`> served.jsonl`
    on a full disk): exited 0 with the log cut mid-record (no flush, no check), later one line
    naming no output ("error: writing: ..."). One line naming stdout, exit 1."""
    u = env["open_store"].user(env["open_store"].user_ids[0])
    calls = tmp_path / "calls.jsonl"
    calls.write_text(jl(*[{"user_id": u.user_id, "query_id": u.query_ids[i % len(u.query_ids)], "call_id": f"c{i}"}
                          for i in range(600)]))
    served = tmp_path / "served.jsonl"
    with open(served, "wb") as out:
        r = subprocess.run(size_limited(16, *rmm_jax_cmd(), "rerank", env["store"], "--calls", calls, "--explore"),
                           stdout=out, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300,
                           env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == "error: stdout: file too large for this process's limit (ulimit -f)", r.stderr
    assert 0 < served.stat().st_size <= 16 * 1024


def test_a_full_embedding_cache_says_so_not_that_no_transaction_is_active(tmp_path):
    """A put into the embedding cache past the file-size limit: SQLite rolled the write back
    itself and put()'s own ROLLBACK then raised `cannot rollback - no transaction is active`,
    hiding why. Now one InputError naming the cache and the limit."""
    script = ("import numpy as np, pathlib, sys\n"
              "from rmm_jax.data.embed import _Cache\n"
              "from rmm_jax.errors import InputError\n"
              "c = _Cache(pathlib.Path(sys.argv[1]), 'fake/m', 64)\n"
              "try:\n"
              "    c.put([str(i) for i in range(2000)], np.ones((2000, 64), np.float32))\n"
              "except InputError as e:\n"
              "    print(e)\n")
    r = subprocess.run(size_limited(64, sys.executable, "-c", script, tmp_path / "cache"), capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{tmp_path / 'cache' / 'embeddings.sqlite'}: cannot write the embedding cache: file " \
                               "too large for this process's limit (ulimit -f)", r.stdout


# --------------------------------------------------------------------------- K and M from the log


def test_log_shape_agreement(tmp_path):
    """K and M are the log's most candidates and selected; a record listing fewer candidates
    agrees when its user's bank holds no more, one showing fewer memories when it lists no more."""
    banks = {"a": [f"m{i}" for i in range(10)], "b": [f"m{i}" for i in range(5)], "c": ["m0", "m1"]}
    known = lambda u: (frozenset(f"q{i}" for i in range(9)), frozenset(banks[u])) if u in banks else None
    rec = lambda u, q, n, s: {"user_id": u, "query_id": f"q{q}", "candidates": banks[u][:n],
                              "selected": banks[u][:s], "cited": []}
    log = tmp_path / "log.jsonl"
    log.write_text(jl(rec("a", 0, 8, 3), rec("b", 1, 5, 3), rec("c", 2, 2, 2), rec("a", 3, 8, 3)))
    assert log_shape(log, known) == (8, 3, 1, 1, None, None, False, False)   # b, c: whole banks; c: all it lists
    # every record lists its user's whole bank (and shows all it lists): any larger --k (--m) agrees
    log.write_text(jl(rec("b", 1, 5, 3), rec("c", 2, 2, 2)))
    shape = log_shape(log, known)
    assert shape == (5, 3, 1, 1, None, None, True, False)
    assert k_m_from_log(20, None, shape, log, notes=[]) == (20, 3)
    with pytest.raises(InputError, match=r"^--m 4: contradicts the log"):
        k_m_from_log(20, 4, shape, log, notes=[])
    log.write_text(jl(rec("c", 2, 2, 2)))
    assert k_m_from_log(20, 5, log_shape(log, known), log, notes=[]) == (20, 5)
    carried = {**rec("b", 1, 4, 3), "candidates": [*banks["b"][:4], {"id": "new", "text": "a memory the store lacks"}]}
    log.write_text(jl(carried))                  # as many candidates as b's bank, one of them not b's: not whole
    assert not log_shape(log, known).whole_banks
    with pytest.raises(InputError, match=r"^--k 1: contradicts the log"):        # fewer: never
        k_m_from_log(1, 2, log_shape(log, known), log, notes=[])
    # a user the store lacks brings its texts: its bank is unknown, so fewer candidates agree
    new = {"user_id": "z", "query": "a new question", "candidates": [{"id": f"t{i}", "text": f"memory {i}"}
                                                                      for i in range(4)],
           "selected": ["t0", "t1", "t2"], "cited": ["t0"]}
    log.write_text(jl(rec("a", 0, 8, 3), new))
    assert log_shape(log, known)[:6] == (8, 3, 1, 1, None, None)
    log.write_text(jl(rec("a", 0, 8, 3), rec("a", 1, 8, 3)))
    with pytest.raises(InputError, match=r"^--k 20: contradicts the log: .* lists 8 candidates per call"):
        k_m_from_log(20, 3, log_shape(log, known), log, notes=[])      # a lists 8 of its 10: K was 8
    log.write_text(jl(rec("a", 0, 8, 3), rec("a", 1, 6, 3), rec("a", 2, 8, 2)))
    shape = log_shape(log, known)
    assert shape[:4] == (8, 3, 1, 1)
    assert shape.k_apart == "line 2 lists 6 candidates of the 10 memories of user 'a'"
    assert shape.m_apart == "line 3 shows 2 memories of its 8 candidates"
    # several records disagree: the error names the first (line 2), not the one listing fewest (line 3)
    log.write_text(jl(rec("a", 0, 10, 3), rec("a", 1, 6, 2), rec("a", 2, 3, 1)))
    shape = log_shape(log, known)
    assert shape.k_apart == "line 2 lists 6 candidates of the 10 memories of user 'a'"
    assert shape.m_apart == "line 2 shows 2 memories of its 6 candidates"


def test_log_shape_takes_a_record_listing_the_whole_bank_its_user_had_when_served(tmp_path):
    """Serve (user 'c' holds 2 memories: its calls list both), grow c's bank (embed --into
    appends after its old memories), replay: the day's log was refused ("line 2 lists 2
    candidates of the 4 memories of user 'c'; pass --k"). A record listing the user's first
    memories in store order listed its whole bank then; one listing fewer than an earlier record
    of its user did, or other memories than the first, is still cut short."""
    from rmm_jax.data.log_vectors import StoreMemories

    banks = {"a": [f"a{i}" for i in range(10)], "c": ["c0", "c1", "c2", "c3"]}     # c: 2 memories at serve time
    known = lambda u: (frozenset(f"q{i}" for i in range(9)), StoreMemories(None, u, banks[u]))
    rec = lambda u, q, cands: {"user_id": u, "query_id": f"q{q}", "candidates": cands, "selected": cands[:2],
                               "cited": []}
    log = tmp_path / "log.jsonl"
    log.write_text(jl(rec("a", 0, banks["a"][:8]), rec("c", 1, ["c1", "c0"]), rec("c", 2, ["c0", "c1"])))
    assert log_shape(log, known) == (8, 2, 1, 1, None, None, False, False)
    log.write_text(jl(rec("a", 0, banks["a"][:8]), rec("c", 1, ["c0", "c2"])))           # not its first memories
    assert log_shape(log, known).k_apart == "line 2 lists 2 candidates of the 4 memories of user 'c'"
    log.write_text(jl(rec("a", 0, banks["a"][:8]), rec("c", 1, banks["c"][:3]), rec("c", 2, ["c0", "c1"])))
    assert log_shape(log, known).k_apart == "line 3 lists 2 candidates of the 4 memories of user 'c'"


def test_replay_and_evaluate_take_k_and_m_from_the_log_and_refuse_a_contradiction(env, capsys, tmp_path):
    """The good log lists 10 candidates and shows 3 on every record: --k 20 or --m 5 contradict it
    (one line naming the option and the log, nothing written); a log whose records disagree needs
    the option, and names the record that differs."""
    log = good_log(env)
    for verb, more in (("replay", ["--policies", tmp_path / "p"]), ("evaluate", ["--policies", env["pol_existing"]])):
        for opt, val, says in (("--m", 5, "shows 3 memories per call"), ("--k", 20, "lists 10 candidates per call")):
            code, _, err = cli(capsys, verb, env["store"], "--log", log, *more, opt, val)
            assert_one_line_error(code, err, [f"{opt} {val}", "contradicts the log", str(log), says])
    short = tmp_path / "short.jsonl"
    g = env["good"]
    short.write_text(jl(g[0], {**g[1], "selected": g[1]["selected"][:2], "cited": g[1]["cited"][:1]}))
    code, _, err = cli(capsys, "replay", env["store"], "--log", short, "--policies", tmp_path / "p")
    assert_one_line_error(code, err, ["--m", "disagree", "line 2 shows 2 memories of its 10 candidates", "pass --m"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.jsonl"]          # nothing written



@pytest.mark.parametrize("layout, hint", [(None, ""), ("setting", " (a Setting: pass its .layout)")])
def test_scan_log_names_a_layout_that_is_not_one(tmp_path, layout, hint):
    from rmm_jax import preset
    from rmm_jax.errors import InputError
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"user_id": "u1", "query_id": "q", "candidates": ["a", "b"], "selected": ["a"],
                               "cited": []}) + "\n")
    with pytest.raises(InputError) as e:     # AttributeError 'k' before
        scan_log(log, preset("default", k=8, m=3) if layout == "setting" else layout)
    assert str(e.value).startswith(f"layout: must be a Layout{hint}, got "), str(e.value)


def test_a_second_writer_exits_75_busy_not_2_bad_input(env, capsys, tmp_path):
    """A second writer of a policy store (its lock, or its run-state's, held by a running
    replay) or of an embedding store got its one line "in use by pid N ... retry when it ends"
    with exit 2, the status of bad input, so a cron wrapper could not tell "busy, retry" from
    bad input. Lock conflicts are :class:`rmm_jax.errors.Busy` and exit 75 (EX_TEMPFAIL);
    bad input still exits 2."""
    from rmm_jax.data.store._write import store_writer
    from rmm_jax.errors import EXIT_BUSY, Busy
    from rmm_jax.persist.runstate import RunState

    assert EXIT_BUSY == 75
    pol, pol2 = tmp_path / "pol", tmp_path / "pol2"
    shutil.copytree(env["pol_existing"], pol)
    shutil.copytree(env["pol_existing"], pol2)
    args = ("replay", env["store"], "--log", env["logs"] / "good.jsonl", "--policies", pol, "--k", K, "--m", M)
    with RunState.begin(pol, "replay", {}, resume=False):   # another run on the same policies
        code, out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, [f"{RunState.path_for(pol)}: in use by pid {os.getpid()}"], expect_code=75)
    with PolicyStore.open(pol2).writer():                   # another process writing the store
        code, out, err = run_cli(capsys, *args[:5], pol2, *args[6:])
    assert_one_line_error(code, err, [f"policy store {pol2} is locked by pid {os.getpid()}", "retry when it ends"],
                          expect_code=75)
    assert not RunState.path_for(pol2).exists()         # refused as busy, it left no run-state (75: nothing written)
    code, out, err = run_cli(capsys, *args[:3], env["logs"] / "missing_key.jsonl", *args[4:])
    assert_one_line_error(code, err, ["missing_key.jsonl:1"], expect_code=2)      # bad input: 2, as before
    with store_writer(tmp_path / "emb"):                    # another embed writing the embedding store
        with pytest.raises(Busy, match=r"in use by pid \d+ \(another embed"), store_writer(tmp_path / "emb"):
            pass
