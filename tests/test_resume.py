"""Crash-safe, resumable, deterministic runs (rmm_jax.persist.runstate).

Real subprocesses of ``python -m rmm_jax.cli.main`` are killed (SIGKILL at random times and
right after a mid-chunk checkpoint, SIGTERM) and resumed with ``--resume`` until they
complete; the final per-user policies (params, opt_state, learner_state) and the
``--log-out`` file are bit-identical to an uninterrupted run. Pretrain likewise. A
damaged newest checkpoint falls back to the previous one (with a message naming it),
none left is a clear error, and ``--resume`` with other options names the option.

Subprocesses share a persistent JAX compilation cache (same compiled programs, less
time); everything runs on a d=32 fake store with 6 users.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, USER_XLA_FLAGS, make_fake_store

from rmm_jax.cli.signals import MESSAGE
from rmm_jax.errors import InputError
from rmm_jax.persist import checksums
from rmm_jax.persist.policy_store import PolicyStore
from rmm_jax.persist.runstate import RunState

SIM = ["--k", "10", "--m", "3", "--users-per-chunk", "2", "--checkpoint-every", "2", "--seed", "3"]
PRE = ["--k", "10", "--m", "3", "--epochs", "14", "--patience", "100", "--seed", "1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    store = make_fake_store(d / "store", users=6, sessions=6, turns=8)
    cache = d / "jax-cache"
    e = {**os.environ, "XLA_FLAGS": USER_XLA_FLAGS, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return {"dir": d, "store": str(store), "env": e}


def start(env, args, err: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rmm_jax.cli.main", *args], cwd=REPO, env=env["env"],
                            stdout=subprocess.DEVNULL, stderr=open(err, "w"))


def run(env, args, name: str) -> tuple[int, str]:
    err = env["dir"] / f"{name}.err"
    p = start(env, args, err)
    rc = p.wait(timeout=120)
    return rc, err.read_text()


def newest_meta(runstate: Path) -> dict | None:
    """meta.json of the newest complete checkpoint (renamed into place = complete)."""
    try:
        snaps = sorted(p for p in runstate.iterdir() if p.name.startswith("s") and p.name[1:].isdigit())
        return json.loads((snaps[-1] / "meta.json").read_text())["meta"] if snaps else None
    except (OSError, ValueError, KeyError):
        return None


def wait_for(p: subprocess.Popen, cond, timeout=60.0) -> bool:
    """Poll until ``cond()``; False if the process ended first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if p.poll() is not None:
            return False
        time.sleep(0.005)
    raise TimeoutError


def assert_same_policies(a: Path, b: Path) -> None:
    sa, sb = PolicyStore.open(a), PolicyStore.open(b)
    assert sa.users() == sb.users() and len(sa.users()) == 6
    for u in sa.users():
        pa, pb = sa.load(u).state, sb.load(u).state
        for part in ("params", "opt_state", "learner_state"):
            ta, tb = getattr(pa, part), getattr(pb, part)
            assert jax.tree.structure(ta) == jax.tree.structure(tb), (u, part)
            for x, y in zip(jax.tree.leaves(ta), jax.tree.leaves(tb)):
                x, y = np.asarray(x), np.asarray(y)
                assert x.dtype == y.dtype and np.array_equal(x, y), (u, part)


@pytest.fixture(scope="module")
def reference(env):
    """An uninterrupted simulate run: policies, log and its duration."""
    d = env["dir"]
    t0 = time.monotonic()
    rc, err = run(env, ["simulate", env["store"], "--policies", str(d / "ref"), "--log-out",
                        str(d / "ref.jsonl"), *SIM], "ref")
    assert rc == 0, err
    assert not (d / "ref.runstate").exists()  # removed on success
    return {"policies": d / "ref", "log": d / "ref.jsonl", "seconds": time.monotonic() - t0}


def test_sigkill_at_random_points_then_resume_is_bit_identical(env, reference):
    d = env["dir"]
    pol, log = d / "killed", d / "killed.jsonl"
    args = ["simulate", env["store"], "--policies", str(pol), "--log-out", str(log), *SIM]
    rs_dir = RunState.path_for(pol)
    # 1) a kill right after a checkpoint in the middle of a users chunk (not chunk 0)
    p = start(env, args, d / "k0.err")
    mid = lambda: (m := newest_meta(rs_dir)) is not None and m["chunks_done"] >= 1 and m["segments_done"] >= 1
    assert wait_for(p, mid), (d / "k0.err").read_text()
    p.send_signal(signal.SIGKILL)
    p.wait()
    # 2) kills at random times: after start (uniform over the first 60% of an uninterrupted
    #    run's duration: a resumed run has less left to do), and at random moments within
    #    0.3 s after a resumed run's next checkpoint (mid-segment, mid-checkpoint or
    #    mid-policy-save); then a run to the end
    rng = np.random.default_rng(20250711)
    plan = [("start", rng.uniform(0.0, 0.6 * reference["seconds"])),
            ("after-checkpoint", rng.uniform(0.0, 0.3)), ("after-checkpoint", rng.uniform(0.0, 0.3)), None]
    messages, kills = [], 1
    for i, step in enumerate(plan):
        err = d / f"k{i + 1}.err"
        before = max((q.name for q in rs_dir.glob("s*")), default="")
        p = start(env, [*args, "--resume"], err)
        if step is not None:
            if step[0] == "after-checkpoint":
                wait_for(p, lambda: max((q.name for q in rs_dir.glob("s*")), default="") > before)
            try:
                p.wait(timeout=step[1])
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills += 1
                messages.append(err.read_text())
                continue
        rc = p.wait(timeout=120)
        messages.append(err.read_text())
        assert rc == 0, messages[-1]
        break
    else:
        pytest.fail("never completed")
    assert any("resuming from s" in m and "segment" in m for m in messages), messages
    assert_same_policies(reference["policies"], pol)
    assert log.read_bytes() == reference["log"].read_bytes()
    assert not rs_dir.exists()
    print(f"kills: {kills}; plan {plan[:-1]}; uninterrupted {reference['seconds']:.1f}s")


def test_sigterm_checkpoints_then_options_are_checked_and_a_damaged_checkpoint_falls_back(env, reference):
    d = env["dir"]
    pol, log = d / "term", d / "term.jsonl"
    args = ["simulate", env["store"], "--policies", str(pol), "--log-out", str(log), *SIM]
    rs_dir = RunState.path_for(pol)
    err = d / "t0.err"
    p = start(env, args, err)
    # two checkpoints exist and the run is in users chunk 2 (so a fallback still has progress)
    assert wait_for(p, lambda: (m := newest_meta(rs_dir)) is not None and m["chunks_done"] >= 1
                    and len([q for q in rs_dir.iterdir() if q.name.startswith("s")]) == 2), err.read_text()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=60)
    text = err.read_text()
    assert rc == 128 + signal.SIGTERM, text
    assert text.strip().splitlines()[-1].endswith(MESSAGE)
    snaps = sorted(q for q in rs_dir.iterdir() if q.name.startswith("s"))
    assert len(snaps) == 2 and not log.exists()

    # without --resume: refused, nothing changes
    rc, text = run(env, args, "t1")
    assert rc == 2 and "--resume" in text and "remove" in text, text
    # --resume with another option: the option is named
    rc, text = run(env, [*args, "--resume", "--lr", "0.01"], "t2")
    assert rc == 2 and text.strip().splitlines()[-1].startswith("error: --lr: differs from the interrupted run"), text
    # --resume without the log the interrupted run was writing: refused, not silently dropped
    no_log = [a for a in args if a not in ("--log-out", str(log))]
    rc, text = run(env, [*no_log, "--resume"], "t3")
    assert rc == 2 and text.strip().splitlines()[-1].startswith("error: --log-out: differs from the interrupted run"), \
        text

    # damage the newest checkpoint: flip bytes in its arrays -> the previous one is used
    victim = snaps[-1] / "arrays.npz"
    b = bytearray(victim.read_bytes())
    b[len(b) // 2] ^= 0xFF
    victim.write_bytes(bytes(b))
    rc, text = run(env, [*args, "--resume"], "t4")
    assert rc == 0, text
    assert f"checkpoint {snaps[-1].name} is damaged" in text and f"previous good one, {snaps[0].name}" in text, text
    assert_same_policies(reference["policies"], pol)
    assert log.read_bytes() == reference["log"].read_bytes()
    assert not rs_dir.exists()


def test_a_continued_run_killed_mid_way_resumes_where_it_started(env):
    """The second of two runs over a store (--queries 0:12, then 12:, continuing) is killed
    after it has saved a users chunk; --resume starts every user from the version it had
    before that run, so the result equals the uninterrupted pair of runs."""
    d = env["dir"]
    for pol, kill in ((d / "cont-ref", False), (d / "cont-kill", True)):
        first = ["simulate", env["store"], "--policies", str(pol), *SIM, "--queries", "0:12"]
        rc, err = run(env, first, f"{pol.name}-1")
        assert rc == 0, err
        second = ["simulate", env["store"], "--policies", str(pol), *SIM, "--queries", "12:"]
        if not kill:
            rc, err = run(env, second, f"{pol.name}-2")
            assert rc == 0, err
            continue
        p = start(env, second, d / "ck.err")
        rs_dir = RunState.path_for(pol)
        assert wait_for(p, lambda: (m := newest_meta(rs_dir)) is not None and m["chunks_done"] >= 1
                        and m["segments_done"] >= 1), (d / "ck.err").read_text()
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert newest_meta(rs_dir)["before"] is not None          # the run continued from the store
        rc, err = run(env, [*second, "--resume"], "ck-resume")
        assert rc == 0 and "resuming from" in err, err
    assert_same_policies(d / "cont-ref", d / "cont-kill")


def test_damaged_checkpoints_in_process(tmp_path):
    fp = {"--lr": 0.1}
    rs = RunState.begin(tmp_path / "pol", "simulate", fp, resume=False)
    with rs:
        for i in range(3):
            rs.save({"i": i}, {"x": {"a": np.arange(1000, dtype=np.float32) + i, "k": np.array([i, 7], np.uint32),
                                     "count": np.array(i, np.int32)}})  # a 0-d leaf (Adam's count)
    snaps = sorted((tmp_path / "pol.runstate").glob("s*"))
    assert [s.name for s in snaps] == ["s00000002", "s00000003"]  # the last two are kept
    with RunState.begin(tmp_path / "pol", "simulate", fp, resume=True) as rs:
        assert rs.restored.meta == {"i": 2} and rs.restored.trees["x"]["a"][0] == 2.0
        assert rs.restored.trees["x"]["k"].dtype == np.uint32
        assert rs.restored.trees["x"]["count"].shape == () and rs.restored.trees["x"]["count"] == 2
    # truncate a file of the newest: the previous is used, and the user is told which
    f = snaps[1] / "arrays.npz"
    f.write_bytes(f.read_bytes()[:50])
    notes = []
    with RunState.begin(tmp_path / "pol", "simulate", fp, resume=True, notify=notes.append) as rs:
        assert rs.restored.meta == {"i": 1}
    assert "s00000003 is damaged" in notes[0] and "sha256 mismatch" in notes[0] and "s00000002" in notes[0]
    # damage the other one too (its meta.json): none left -> a clear error
    m = snaps[0] / "meta.json"
    m.write_text(m.read_text().replace('"i": 1', '"i": 5'))
    with pytest.raises(InputError, match="no usable checkpoint .*s00000003.*s00000002.*remove"):
        RunState.begin(tmp_path / "pol", "simulate", fp, resume=True)
    # another command's run-state, or another fingerprint, is refused
    (tmp_path / "pol.runstate").rename(tmp_path / "old.runstate")
    with RunState.begin(tmp_path / "pol", "replay", fp, resume=False) as rs:
        rs.save({}, {})
    with pytest.raises(InputError, match="`replay` run"):
        RunState.begin(tmp_path / "pol", "simulate", fp, resume=True)
    with pytest.raises(InputError, match="--lr: differs"):
        RunState.begin(tmp_path / "pol", "replay", {"--lr": 0.2}, resume=True)


def test_a_checkpoint_of_format_1_still_resumes(tmp_path):
    """Checkpoints written before arrays.npz held an orbax checkpoint in arrays/."""
    import orbax.checkpoint as ocp

    fp = {"--lr": 0.1}
    x = {"a": np.arange(5, dtype=np.float32), "count": np.array(3, np.int32)}
    with RunState.begin(tmp_path / "pol", "simulate", fp, resume=False) as rs:
        snap = rs.save({"i": 4}, {"x": x})
    (snap / "arrays.npz").unlink()
    (snap / "CHECKSUMS.json").unlink()
    ocp.PyTreeCheckpointer().save((snap / "arrays").resolve(), {"x": {"l000000": x["a"], "l000001": x["count"]}})
    doc = json.loads((snap / "meta.json").read_text())
    (snap / "meta.json").write_text(json.dumps({**doc, "format_version": 1}))
    checksums.write_checksums(snap)
    with RunState.begin(tmp_path / "pol", "simulate", fp, resume=True) as rs:
        got = rs.restored.trees["x"]
    assert rs.restored.meta == {"i": 4} and got["a"].tolist() == [0, 1, 2, 3, 4]
    assert got["count"].shape == () and got["count"].dtype == np.int32 and got["count"] == 3


def test_checkpoint_interval_does_not_change_results(env, reference):
    """--checkpoint-every only changes how each stream's scan is cut into compiled
    calls (and the padding): 0 (one scan per users chunk) gives the same bits."""
    d = env["dir"]
    sim = [*SIM]
    sim[sim.index("--checkpoint-every") + 1] = "0"
    rc, text = run(env, ["simulate", env["store"], "--policies", str(d / "whole"), "--log-out",
                         str(d / "whole.jsonl"), *sim], "whole")
    assert rc == 0, text
    assert_same_policies(reference["policies"], d / "whole")
    assert (d / "whole.jsonl").read_bytes() == reference["log"].read_bytes()


def test_pretrain_killed_and_resumed_equals_uninterrupted(env):
    d = env["dir"]
    rc, text = run(env, ["pretrain", env["store"], "--out", str(d / "pre-ref"), *PRE], "p0")
    assert rc == 0, text
    args = ["pretrain", env["store"], "--out", str(d / "pre"), *PRE]
    rs_dir = RunState.path_for(d / "pre")
    p = start(env, args, d / "p1.err")
    assert wait_for(p, lambda: (m := newest_meta(rs_dir)) is not None and m["epoch"] >= 3), \
        (d / "p1.err").read_text()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (d / "pre").exists()
    rc, text = run(env, [*args, "--resume"], "p2")
    assert rc == 0 and "resuming from s" in text, text
    a = PolicyStore.open(d / "pre-ref").shared_state().state.params
    b = PolicyStore.open(d / "pre").shared_state().state.params
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
    assert not rs_dir.exists()
