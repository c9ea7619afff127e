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
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, USER_XLA_FLAGS, make_fake_store, run_cli
from helpers import TESTS_DIR

from rmm_jax.cli.signals import MESSAGE
from rmm_jax.errors import InputError, worded
from rmm_jax.persist import checksums
from rmm_jax.persist.policy_rollback import rollback
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


# The child reports where it is: it runs the CLI with ``drive`` and ``RunState.finish``
# wrapped, appending "TIME start" when the run's loop begins, the kind of each event once
# the run has handled it (saved, logged, checkpointed), and "TIME finishing" just before the
# run-state is removed; with PAUSE = finish it then sleeps, so a kill lands between the
# last save and the run-state's removal.
CHILD = textwrap.dedent("""
    import sys, time
    from rmm_jax.online import session as online   # where the run calls drive
    from rmm_jax.persist import runstate

    where, pause, args = sys.argv[1], sys.argv[2], sys.argv[3:]

    def mark(what):
        with open(where, "a") as f:
            f.write(f"{time.monotonic():.6f} {what}\\n")

    drive, finish = online.drive, runstate.RunState.finish

    def marked_drive(*a, **kw):
        mark("start")
        for event in drive(*a, **kw):
            yield event
            mark(type(event).__name__)

    def marked_finish(self):
        mark("finishing")
        if pause == "finish":
            time.sleep(300)
        finish(self)

    online.drive, runstate.RunState.finish = marked_drive, marked_finish
    from rmm_jax.cli.main import main
    main(args)
""")
TRAINING = ("start", "SegmentDone", "ChunkDone", "ChunkSkipped")


def start(env, args, err: Path, where: Path | None = None, pause: str = "-") -> subprocess.Popen:
    cmd = ["-m", "rmm_jax.cli.main", *args] if where is None else ["-c", CHILD, str(where), pause, *args]
    return subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=env["env"], stdout=subprocess.DEVNULL,
                            stderr=open(err, "w"))


def run(env, args, name: str) -> tuple[int, str]:
    err = env["dir"] / f"{name}.err"
    p = start(env, args, err)
    rc = p.wait(timeout=120)
    return rc, err.read_text()


def marks(where: Path) -> list[tuple[float, str]]:
    if not where.exists():
        return []
    return [(float(t), w) for t, w in (line.split(" ", 1) for line in where.read_text().splitlines())]


def loop_profile(env, args, name: str) -> tuple[int, float]:
    """An uninterrupted run of ``args`` through the child: how many events its loop had, and
    the median time between two (the first ones include compiling)."""
    where = env["dir"] / f"{name}.where"
    p = start(env, args, env["dir"] / f"{name}.err", where)
    assert p.wait(timeout=120) == 0, (env["dir"] / f"{name}.err").read_text()
    times = [t for t, w in marks(where) if w in TRAINING[1:]]
    return len(times), float(np.median(np.diff(times)))


def random_kills(rng, profile, n: int) -> list:
    """``n`` random points of a loop: after a uniformly drawn number of its events (of the
    first half: a resumed run has fewer left), a uniform fraction of a typical event's time."""
    events, gap = profile
    return [("random", (int(rng.integers(0, events // 2 + 1)), float(rng.uniform(0, gap)))) for _ in range(n)]


def until_a_random_kill_lands_in_training(attempt, tries: int = 3) -> None:
    """Run ``attempt(i)`` (a kill plan on fresh outputs, which checks the outcome) until one of
    its random kills lands inside the loop. A replay's loop lasts a few hundred milliseconds
    after its first events, and a killer that the machine does not schedule in time (the suite
    runs several workers per core) kills it only once it is finishing: that run still checks
    the outcome, but not a kill inside the loop, so a new plan is drawn."""
    landed = []
    for i in range(tries):
        got = attempt(i)
        landed.append(got["landed"])
        if "training" in [w for k, w in got["landed"] if k == "random"]:
            return
    raise AssertionError(f"no random kill landed inside the loop in {tries} plans: {landed}")


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


def kill_plan(env, args, plan, name: str, final=("--resume",), until_done: bool = True) -> dict:
    """Run ``args`` through the child once per step of ``plan`` and SIGKILL it where the step
    says, then once more (with ``final``) to the end; returns the stderr of each run and where each kill landed
    (the last thing the child reported: "startup" before its loop began, "training" in it,
    "finishing" between the last save and the run-state's removal).

    A step is ``(extra args, when)``: ``("random", (k, seconds))``, that long after the child
    reports the k-th event of its loop (:func:`random_kills`); ``("finishing", None)``, once it
    reports it is finishing (it then waits there); ``(..., "mid-chunk")``: right after a
    checkpoint inside users chunk 2.
    A run that ends before its kill ends the plan when ``until_done`` (simulate: another run
    would learn again), otherwise the plan goes on (replay: another run learns nothing twice)."""
    rs_dir = RunState.path_for(Path(args[args.index("--policies") + 1]))
    landed, messages = [], []
    for i, (extra, (when, seconds)) in enumerate([*plan, (final, (None, None))]):
        where, err = env["dir"] / f"{name}{i}.where", env["dir"] / f"{name}{i}.err"
        p = start(env, [*args, *extra], err, where, pause="finish" if when == "finishing" else "-")
        if when is None:
            assert p.wait(timeout=120) == 0, err.read_text()
            messages.append(err.read_text())
            break
        if when == "mid-chunk":
            ok = wait_for(p, lambda: (m := newest_meta(rs_dir)) is not None and m["chunks_done"] >= 1
                          and m["segments_done"] >= 1)
        elif when == "finishing":
            ok = wait_for(p, lambda: any(w == "finishing" for _, w in marks(where)))
        else:
            ok = wait_for(p, lambda: len(marks(where)) > seconds[0])
            try:
                p.wait(timeout=seconds[1])
                ok = False
            except subprocess.TimeoutExpired:
                pass
        assert ok or p.poll() is not None, err.read_text()
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
            last = marks(where)[-1][1] if marks(where) else "startup"
            landed.append((when, "training" if last in TRAINING else last))
        else:          # it finished before the kill: the plan ends here
            assert p.returncode == 0, err.read_text()
        messages.append(err.read_text())
        if p.returncode == 0 and until_done:
            break
    print(f"{name}: kills landed {landed}")
    return {"landed": landed, "messages": messages}


def assert_same_policies(a: Path, b: Path) -> None:
    sa, sb = PolicyStore.open(a), PolicyStore.open(b)
    assert sa.users() == sb.users() and len(sa.users()) == 6
    for u in sa.users():
        pa, pb = sa.load(u), sb.load(u)
        for part in ("params", "opt_state", "learner_state"):
            ta, tb = getattr(pa.state, part), getattr(pb.state, part)
            assert jax.tree.structure(ta) == jax.tree.structure(tb), (u, part)
            for x, y in zip(jax.tree.leaves(ta), jax.tree.leaves(tb)):
                x, y = np.asarray(x), np.asarray(y)
                assert x.dtype == y.dtype and np.array_equal(x, y), (u, part)
        assert jax.tree.structure(pa.learned) == jax.tree.structure(pb.learned), u
        for x, y in zip(jax.tree.leaves(pa.learned), jax.tree.leaves(pb.learned)):
            assert np.array_equal(x, y, equal_nan=True), (u, "learned")
    if sa.paired:
        xa = sa.shared_state(sa.learned_shared_version()).state
        xb = sb.shared_state(sb.learned_shared_version()).state
        for x, y in zip(jax.tree.leaves(xa), jax.tree.leaves(xb)):
            assert np.array_equal(x, y), "shared"


@pytest.fixture(scope="module")
def reference(env):
    """An uninterrupted simulate run: policies, log and its loop's profile (:func:`loop_profile`)."""
    d = env["dir"]
    profile = loop_profile(env, ["simulate", env["store"], "--policies", str(d / "ref"), "--log-out",
                                 str(d / "ref.jsonl"), *SIM], "ref")
    assert not (d / "ref.runstate").exists()  # removed on success
    return {"policies": d / "ref", "log": d / "ref.jsonl", "profile": profile}


def test_sigkill_at_random_points_then_resume_is_bit_identical(env, reference):
    """simulate: killed right after a checkpoint inside users chunk 2, at a random point of
    its loop (:func:`random_kills`), and between its last save and the run-state's removal;
    resumed after each."""
    d, rng = env["dir"], np.random.default_rng(20250711)

    def attempt(i):
        pol, log = d / f"killed{i}", d / f"killed{i}.jsonl"
        args = ["simulate", env["store"], "--policies", str(pol), "--log-out", str(log), *SIM]
        kills = random_kills(rng, reference["profile"], 1)
        plan = [((), ("mid-chunk", None)), *((("--resume",), k) for k in kills), (("--resume",), ("finishing", None))]
        got = kill_plan(env, args, plan, f"sim{i}")
        assert any("resuming from s" in m and "segment" in m for m in got["messages"]), got["messages"]
        assert ("finishing", "finishing") in got["landed"], got["landed"]
        assert_same_policies(reference["policies"], pol)
        assert log.read_bytes() == reference["log"].read_bytes()
        assert not RunState.path_for(pol).exists()
        return got

    until_a_random_kill_lands_in_training(attempt)


def test_the_daily_replay_killed_anywhere_and_run_again_with_or_without_resume_is_bit_identical(env, reference):
    """replay (the daily job), scope hybrid: killed at random moments of its loop and between its
    last save and the run-state's removal, each time run again, with or without --resume; it ends
    with the policies of one uninterrupted replay, bit for bit (the store remembers what each saved
    policy learned, and the shared part continues from the version its users were trained against)."""
    d, rng = env["dir"], np.random.default_rng(7)
    args = ["replay", env["store"], "--log", str(reference["log"]), "--scope", "hybrid", "--rank", "2", *SIM]
    profile = loop_profile(env, [*args, "--policies", str(d / "rref")], "rref")

    def attempt(i):
        kills = random_kills(rng, profile, 2)
        plan = [((), kills[0]), ((), kills[1]), (("--resume",), ("finishing", None))]
        got = kill_plan(env, [*args, "--policies", str(d / f"rkilled{i}")], plan, f"replay{i}", final=(),
                        until_done=False)
        assert_same_policies(d / "rref", d / f"rkilled{i}")
        assert not RunState.path_for(d / f"rkilled{i}").exists()
        return got

    until_a_random_kill_lands_in_training(attempt)


# Runs the CLI and SIGKILLs itself inside the N-th commit of a policy version: the version's
# snapshot is on disk, complete, and the index does not list it.
KILL_AT_COMMIT = textwrap.dedent("""
    import os, signal, sys
    from rmm_jax.persist.policy_index import PolicyIndex
    commit, calls = PolicyIndex.commit_version, [0]

    def dying(self, *a, **k):
        calls[0] += 1
        if calls[0] == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(self, *a, **k)

    PolicyIndex.commit_version = dying
    from rmm_jax.cli.main import main
    main(sys.argv[2:])
""")


def test_a_replay_killed_before_a_commit_run_again_killed_and_resumed_is_bit_identical(env, reference):
    """The daily replay killed between a chunk's snapshot and its commit, run again without
    --resume (which repairs the store and removes that snapshot), killed mid-chunk, and
    resumed: it ends with the uninterrupted replay's policies. Before the repair kept the
    removed snapshot's version number taken, the second run saved its first chunk under that
    number, below the `before` it had noted, and the resumed run then counted those users as
    learned before it began: other chunks, and a KeyError."""
    d = env["dir"]
    args = ["replay", env["store"], "--log", str(reference["log"]), "--scope", "hybrid", "--rank", "2", *SIM]
    rc, err = run(env, [*args, "--policies", str(d / "cref")], "cref")
    assert rc == 0, err
    pol = d / "ckill"
    err_a = d / "ckill-a.err"
    a = subprocess.run([sys.executable, "-c", KILL_AT_COMMIT, "2", *args, "--policies", str(pol)], cwd=REPO,
                       env=env["env"], stdout=subprocess.DEVNULL, stderr=open(err_a, "w"), timeout=120)
    assert a.returncode == -signal.SIGKILL, err_a.read_text()
    store = PolicyStore.open(pol)
    on_disk = {int(p.name[1:]) for p in (pol / "gens").iterdir() if p.name.startswith("v")}
    listed = {e.version for u in store.users() for e in store.entries(u)}
    assert on_disk - listed, (on_disk, listed)                   # a complete snapshot the index does not list
    p = start(env, [*args, "--policies", str(pol)], d / "ckill-b.err")
    rs_dir = RunState.path_for(pol)
    # the interrupted run's state is removed and this run continues from the store (its own
    # checkpoints note `before`), killed inside its second users chunk
    assert wait_for(p, lambda: (m := newest_meta(rs_dir)) is not None and m.get("before") is not None
                    and m["chunks_done"] >= 1 and m["segments_done"] >= 1), (d / "ckill-b.err").read_text()
    p.send_signal(signal.SIGKILL)
    p.wait()
    rc, err = run(env, [*args, "--policies", str(pol), "--resume"], "ckill-c")

    assert rc == 0 and "resuming from" in err, err
    assert_same_policies(d / "cref", pol)
    assert not rs_dir.exists()


# As KILL_AT_COMMIT, but inside the index transaction, at its COMMIT, with SQLite's page cache at
# one page so the transaction has spilt into the database: a hot rollback journal is left.
KILL_IN_COMMIT = textwrap.dedent("""
    import sys
    from helpers import die_inside_commit
    die_inside_commit(int(sys.argv[1]))
    from rmm_jax.cli.main import main
    main(sys.argv[2:])
""")


def killed_replay(env, reference, script: str, n: int, tag: str) -> tuple[list, Path]:
    """The daily replay (scope hybrid) run once whole into ``{tag}ref`` and once by ``script``
    (a kill at the ``n``-th commit) into ``{tag}kill``, which it SIGKILLs: (its arguments, that store)."""
    d = env["dir"]
    args = ["replay", env["store"], "--log", str(reference["log"]), "--scope", "hybrid", "--rank", "2", *SIM]
    rc, err = run(env, [*args, "--policies", str(d / f"{tag}ref")], f"{tag}ref")
    assert rc == 0, err
    pol, log = d / f"{tag}kill", d / f"{tag}kill-a.err"
    tests_path = os.pathsep.join(filter(None, [str(TESTS_DIR), env["env"].get("PYTHONPATH")]))
    with open(log, "w") as e:
        a = subprocess.run([sys.executable, "-c", script, str(n), *args, "--policies", str(pol)], cwd=REPO,
                           env={**env["env"], "PYTHONPATH": tests_path}, stdout=subprocess.DEVNULL, stderr=e,
                           timeout=120)
    assert a.returncode == -signal.SIGKILL, log.read_text()
    return args, pol


def test_a_replay_killed_inside_an_index_commit_and_run_again_is_bit_identical(env, reference):
    """The daily replay killed inside the index commit of its second users chunk (a hot
    journal: the version's snapshot complete, its commit not), then run again without
    --resume: it ends with the uninterrupted replay's policies. Before, the run again read the
    store's index rebuilt from its snapshots (a read-only connection cannot roll a journal
    back), counted the killed version's calls as learned, and its writer then dropped that
    version: those calls were learned twice, and every policy differed."""
    d = env["dir"]
    args, pol = killed_replay(env, reference, KILL_IN_COMMIT, 2, "j")
    assert (pol / "index.sqlite-journal").exists()
    rc, err = run(env, [*args, "--policies", str(pol)], "jkill-b")
    assert rc == 0, err
    assert "continued" in err and "from their saved versions v1," in err, err   # the committed chunk only
    assert_same_policies(d / "jref", pol)


def test_a_replay_killed_before_its_first_commit_and_run_again_is_bit_identical(env, reference):
    """The daily replay into a new store, scope hybrid, killed between its first chunk's
    shared save and that chunk's commit, then run again without --resume: it ends with the
    uninterrupted replay's policies. Before the store told the created shared part from a
    killed run's (no user version records either), the second run began from the killed
    run's trained shared part, and its users differed by about 1e-5."""
    d = env["dir"]
    args, pol = killed_replay(env, reference, KILL_AT_COMMIT, 1, "f")
    store = PolicyStore.open(pol)
    assert store.users() == [] and len(store.shared_versions()) == 2      # created, and the killed chunk's
    rc, err = run(env, [*args, "--policies", str(pol)], "fkill-b")
    assert rc == 0, err
    assert_same_policies(d / "fref", pol)


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

    # without --resume, the same command: refused, nothing changes; told its options are the
    # interrupted run's (not that --init differs: that run created the store, and --init
    # left out resolved to identity there, as it does again here)
    rc, text = run(env, args, "t1")
    assert rc == 2 and text.strip().splitlines()[-1].endswith(
        "its options are this command's; pass --resume to continue it, or remove "
        f"{RunState.path_for(pol)} to start over"), text
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
    assert "afresh" not in text, text        # the users it holds are this run's own: nothing was dropped
    assert_same_policies(reference["policies"], pol)
    assert log.read_bytes() == reference["log"].read_bytes()
    assert not rs_dir.exists()


def test_a_continued_run_killed_mid_way_resumes_where_it_started(env):
    """The second of two runs over a store (--queries 0:12, then 12:, continuing) is killed
    after it has saved a users chunk; --resume starts every user from the version it had
    before that run, so the result equals the uninterrupted pair of runs. Rolling the newest
    run back then undoes it whole, the versions saved before the kill too: both stores load
    what the first run left."""
    d = env["dir"]
    rc, err = run(env, ["simulate", env["store"], "--policies", str(d / "cont-ref"), *SIM, "--queries", "0:12"],
                  "cont-1")
    assert rc == 0, err
    shutil.copytree(d / "cont-ref", d / "cont-kill")                 # the same first run, once
    shutil.copytree(d / "cont-ref", d / "cont-first")
    for pol, kill in ((d / "cont-ref", False), (d / "cont-kill", True)):
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
    for pol in ("cont-ref", "cont-kill"):
        undone = rollback(PolicyStore.open(d / pol))
        assert len(undone.versions) >= 2 and not undone.removed, undone     # every chunk of the second run
        assert_same_policies(d / "cont-first", d / pol)


def test_a_continued_replay_killed_and_run_again_is_one_run_and_a_relearn_is_resumed_not_repeated(env, reference):
    """Day 2's replay, continuing day 1's store, killed after it saved a users chunk:
    - `policies rollback` is refused while the run-state holds the interrupted run (a resume
      would go on from the versions it forgets), and nothing changes;
    - run again without --resume, it is one run with the killed one: rolling it back takes
      every user back to day 1. (The second start took a run record of its own, so the
      rollback undid only its versions, and the killed chunk's users kept day 2.)
    - with --relearn, running it again is refused in one line (started again, the killed
      chunk's users would learn day 2 twice); resumed, it ends as one uninterrupted run."""
    d = env["dir"]
    records = reference["log"].read_text().splitlines(keepends=True)
    counts: dict = {}
    day1 = []                                        # each user's first 6 calls; day 2 is the whole log
    for r in records:
        u = json.loads(r)["user_id"]
        counts[u] = counts.get(u, 0) + 1
        if counts[u] <= 6:
            day1.append(r)
    (d / "rb-day1.jsonl").write_text("".join(day1))
    replay = lambda pol, *more: ["replay", env["store"], "--log", str(more[0]), "--policies", str(d / pol),  # noqa: E731
                                 *SIM, *more[1:]]
    rc, err = run(env, replay("rb-day1", d / "rb-day1.jsonl"), "rb-day1")
    assert rc == 0, err
    for name in ("rb-kill", "rl-ref", "rl-kill"):
        shutil.copytree(d / "rb-day1", d / name)
    rc, err = run(env, replay("rl-ref", reference["log"], "--relearn"), "rl-ref")
    assert rc == 0, err

    def kill_in_second_chunk(pol, *more):
        p = start(env, replay(pol, reference["log"], *more), d / f"{pol}-k.err")
        rs_dir = RunState.path_for(d / pol)
        assert wait_for(p, lambda: (m := newest_meta(rs_dir)) is not None and m["chunks_done"] >= 1
                        and m["segments_done"] >= 1), (d / f"{pol}-k.err").read_text()
        p.send_signal(signal.SIGKILL)
        p.wait()

    kill_in_second_chunk("rb-kill")
    before = sorted((q.relative_to(d / "rb-kill"), q.read_bytes()) for q in (d / "rb-kill").rglob("*") if q.is_file())
    with pytest.raises(InputError, match="interrupted `replay` run .* --resume"):
        rollback(PolicyStore.open(d / "rb-kill"))
    assert sorted((q.relative_to(d / "rb-kill"), q.read_bytes())
                  for q in (d / "rb-kill").rglob("*") if q.is_file()) == before
    grown = d / "rb-store"                      # the store changed meanwhile (an embed --into): its digest differs
    shutil.copytree(env["store"], grown)
    (grown / "added-by-the-night.txt").write_text("x")
    rc, err = run(env, ["replay", str(grown), *replay("rb-kill", reference["log"], "--resume")[2:]], "rb-resume")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: STORE: differs from the interrupted run") \
        and err.strip().endswith("or run it again without --resume: it starts again, and what it saved is "
                                 "remembered (not learned twice)"), err
    rc, err = run(env, ["replay", str(grown), *replay("rb-kill", reference["log"])[2:]], "rb-again")
    assert rc == 0 and "starting it again" in err, err
    undone = rollback(PolicyStore.open(d / "rb-kill"))
    assert len(undone.versions) == 3 and len(undone.users) == 6, undone     # the killed chunk's version too
    assert_same_policies(d / "rb-day1", d / "rb-kill")

    kill_in_second_chunk("rl-kill", "--relearn")
    rc, err = run(env, replay("rl-kill", reference["log"], "--relearn"), "rl-again")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error:") and "--resume" in err, err
    rc, err = run(env, replay("rl-kill", reference["log"], "--relearn", "--resume"), "rl-resume")
    assert rc == 0 and "resuming from" in err, err
    assert_same_policies(d / "rl-ref", d / "rl-kill")


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
    with RunState.begin(tmp_path / "pol", "simulate", fp, resume=True) as rs:
        assert rs.restored.meta == {"i": 1}
    notes = rs.notes
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


def test_run_state_names_resume_as_its_caller_gives_it(tmp_path):
    """RunState.begin's errors and notes said "pass --resume", "--resume: no checkpoint" and
    "finish it with `replay --resume`", the CLI's option, to a Python caller of
    begin(resume=...): they name the argument, and the CLI's option within worded({"resume":
    "--resume"}) (cli.common.begin_run_state's as_options; the CLI tests pin its wording)."""
    with RunState.begin(tmp_path / "pol", "simulate", {}, resume=True) as rs:
        pass
    assert rs.notes == [f"resume=True: no checkpoint in {tmp_path / 'pol.runstate'}; starting from the beginning"]
    with RunState.begin(tmp_path / "pol", "replay", {}, resume=False) as rs:
        rs.save({}, {})
    for words, want in (({}, "pass resume=True to continue it"),
                        ({"resume": "--resume"}, "pass --resume to continue it")):
        with pytest.raises(InputError, match=want), worded(words):
            RunState.begin(tmp_path / "pol", "replay", {}, resume=False)
    for words, want in (({}, "finish it with a `replay` run with resume=True,"),
                        ({"resume": "--resume"}, "finish it with `replay --resume`,")):
        with pytest.raises(InputError, match=want), worded(words):
            RunState.begin(tmp_path / "pol", "simulate", {}, resume=True)


def test_a_run_state_killed_while_it_is_removed_is_gone_not_half_deleted(tmp_path, monkeypatch):
    """A finished run removes its run-state whole: a kill inside the deletion leaves no
    ``POLICIES.runstate`` with some checkpoints half gone (which ``--resume`` would read as
    damaged, and ``policies rollback`` as an interrupted run), only a hidden leftover that
    the next run-state of the same policies deletes."""
    import rmm_jax.persist.atomic as atomic

    class Killed(BaseException):
        pass

    def killed(path, ignore_errors=False):
        next(Path(path).rglob("arrays.npz")).unlink()      # part of the deletion done, then the kill
        raise Killed

    rs = RunState.begin(tmp_path / "pol", "replay", {}, resume=False)
    for i in range(2):
        rs.save({"i": i}, {"x": np.arange(3) + i})
    monkeypatch.setattr(atomic.shutil, "rmtree", killed)
    with pytest.raises(Killed):
        rs.finish()
    monkeypatch.undo()
    rs.close()
    assert not RunState.path_for(tmp_path / "pol").exists()
    assert RunState.interrupted_command(tmp_path / "pol") is None
    (left,) = tmp_path.glob(".pol.runstate.old-*")
    with RunState.begin(tmp_path / "pol", "replay", {}, resume=False):
        assert not left.exists()


def test_an_interrupted_run_is_told_from_a_running_one(tmp_path):
    """``policies rollback`` asks whether a run left its state: while that run still holds
    the run-state's lock the answer is the one-line "in use by pid" (not the advice to
    resume a run that is alive); once it is gone, the interrupted command."""
    rs = RunState.begin(tmp_path / "pol", "replay", {}, resume=False)
    rs.save({}, {"x": np.arange(2)})
    with pytest.raises(InputError, match=f"in use by pid {os.getpid()}"):
        RunState.interrupted_command(tmp_path / "pol")
    rs.close()
    assert RunState.interrupted_command(tmp_path / "pol") == "replay"
    shutil.rmtree(RunState.path_for(tmp_path / "pol"))
    assert RunState.interrupted_command(tmp_path / "pol") is None


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


def test_checkpoint_interval_does_not_change_results(env, reference, capsys):
    """--checkpoint-every only changes where each users chunk's loop is cut into calls of one
    compiled program. Under the user's XLA flags, 0 (one call per chunk) gives the bits of 2
    (the reference); at XLA's lowest optimisation (this process's flags, conftest), 1 and 3
    give the bits of 0 in scopes user and hybrid. That level rounds two programs of the
    same loop differently: when a segment's length was a shape, 1 and 3 moved params by up
    to 1e-7 there, and in hybrid changed what the log showed."""
    d = env["dir"]
    sim = [*SIM]
    sim[sim.index("--checkpoint-every") + 1] = "0"
    rc, text = run(env, ["simulate", env["store"], "--policies", str(d / "whole"), "--log-out",
                         str(d / "whole.jsonl"), *sim], "whole")
    assert rc == 0, text
    assert_same_policies(reference["policies"], d / "whole")
    assert (d / "whole.jsonl").read_bytes() == reference["log"].read_bytes()
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"], "conftest sets the lowest level"
    for scope in ("user", "hybrid"):
        for every in ("0", "1", "3"):
            sim = [*SIM, "--scope", scope]
            sim[sim.index("--checkpoint-every") + 1] = every
            name = f"lowest-{scope}-{every}"
            code, _, err = run_cli(capsys, "simulate", env["store"], "--policies", d / name, "--log-out",
                                   d / f"{name}.jsonl", *sim)
            assert code == 0, err
            if every != "0":
                assert_same_policies(d / f"lowest-{scope}-0", d / name)
                assert (d / f"{name}.jsonl").read_bytes() == (d / f"lowest-{scope}-0.jsonl").read_bytes(), name


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


def test_a_resume_mismatch_words_a_missing_value_as_not_given(tmp_path):
    """The options mismatch said `(null there, "x.jsonl" now)` of an option the interrupted
    run left out: a missing value (None, or a key one side lacks) reads "not given"."""
    with RunState.begin(tmp_path / "pol", "simulate", {"--log-out": None}, resume=False) as rs:
        rs.save({}, {})
    with pytest.raises(InputError, match=r'--log-out: differs from the interrupted run \(not given there, '
                                         r'"x.jsonl" now\)'):
        RunState.begin(tmp_path / "pol", "simulate", {"--log-out": "x.jsonl"}, resume=True)
    with pytest.raises(InputError, match=r'--plot: differs from the interrupted run \(not given there, '
                                         r'"p.png" now\)'):
        RunState.begin(tmp_path / "pol", "simulate", {"--log-out": None, "--plot": "p.png"}, resume=True)


def test_a_refused_run_names_the_interrupted_runs_log_and_every_differing_option(tmp_path):
    """After a killed night the next night's replay was refused with "an interrupted `replay`
    run left its state here; pass --resume ..." naming neither the interrupted run's log nor
    its options, and --resume then named one differing option at a time, the log as a bare
    sha256. The refusal names the log it read (its path; an older checkpoint's: its digest and
    that the path is not recorded) and every option that differs; --resume lists them all in
    one line."""
    d2, d3 = "a" * 64, "b" * 64
    day2, day3 = os.path.abspath("day2.jsonl"), os.path.abspath("day3.jsonl")
    with RunState.begin(tmp_path / "pol", "replay", {"--log": d2, "--users-per-chunk": 2, "--k": 8},
                        resume=False, paths={"--log": "day2.jsonl"}) as rs:
        rs.save({}, {})
    rs_dir = tmp_path / "pol.runstate"
    with pytest.raises(InputError) as e:            # the next night: another log, another chunk size
        RunState.begin(tmp_path / "pol", "replay", {"--log": d3, "--users-per-chunk": 8, "--k": 8}, resume=False,
                       paths={"--log": "day3.jsonl"})
    assert str(e.value) == (f"{rs_dir}: an interrupted `replay` run left its state here; options that differ from "
                            f"this command: --log ({day2} [sha256 aaaaaaaaaaaa…] there, {day3} [sha256 bbbbbbbbbbbb…] "
                            "now), --users-per-chunk (2 there, 8 now); pass resume=True with its values of those "
                            f"options to continue it, or remove {rs_dir} to start over")
    with pytest.raises(InputError) as e:            # its log, another chunk size: the log it read is named
        RunState.begin(tmp_path / "pol", "replay", {"--log": d2, "--users-per-chunk": 8, "--k": 8}, resume=False,
                       paths={"--log": "day2.jsonl"})
    assert str(e.value).startswith(f"{rs_dir}: an interrupted `replay` run left its state here: it read --log {day2} "
                                   "[sha256 aaaaaaaaaaaa…]; options that differ from this command: --users-per-chunk "
                                   "(2 there, 8 now); pass resume=True with its values of those options"), e.value
    with pytest.raises(InputError) as e:
        RunState.begin(tmp_path / "pol", "replay", {"--log": d3, "--users-per-chunk": 8, "--k": 8}, resume=True,
                       paths={"--log": "day3.jsonl"})
    assert str(e.value) == (f"{rs_dir}: 2 options differ from the interrupted run: --log ({day2} [sha256 "
                            f"aaaaaaaaaaaa…] there, {day3} [sha256 bbbbbbbbbbbb…] now), --users-per-chunk (2 there, 8 "
                            f"now); resume with the same values, or remove {rs_dir} to start over")
    for meta in rs_dir.glob("s*/meta.json"):        # a checkpoint of an older rmm-jax recorded no path
        meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "paths"}))
    with pytest.raises(InputError, match=r"it read --log sha256 aaaaaaaaaaaa… \[path not recorded\]; options"):
        RunState.begin(tmp_path / "pol", "replay", {"--log": d2, "--users-per-chunk": 8, "--k": 8}, resume=False)


def test_pretrain_resume_of_a_finished_run_says_there_is_nothing_to_resume(capsys, tmp_path):
    """`pretrain --resume` after the run finished said "--out pre1: already exists and is not
    empty; choose a new policy store path": one line now says there is nothing to resume
    (as simulate and replay say), and the store is left as it was."""
    store = make_fake_store(tmp_path / "store", users=4, sessions=4, turns=6, dim=16)
    args = ["pretrain", str(store), "--out", str(tmp_path / "pre1"), "--k", "8", "--m", "3", "--epochs", "2"]
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    before = sorted(p.name for p in (tmp_path / "pre1").rglob("*"))
    code, _, err = run_cli(capsys, *args, "--resume")
    assert code == 2 and err.strip().splitlines() == [
        f"error: --resume: no checkpoint of {tmp_path / 'pre1'} to resume (the run that wrote it finished); "
        "to pretrain again, leave out --resume and choose a new --out"], err
    assert sorted(p.name for p in (tmp_path / "pre1").rglob("*")) == before


def test_a_run_waiting_for_the_lock_as_the_holder_finishes_is_busy_not_a_traceback(tmp_path):
    """A second run's brief wait for the run-state's lock (lock.GRACE) overlapped the first
    run's finish(), which removes the run-state with its lock file: FileNotFoundError, a
    traceback and exit 1. It is Busy (exit 75: retry), or the lock when the first had ended."""
    import threading
    import time

    from rmm_jax.errors import Busy
    target, got = tmp_path / "pol", []
    for trial in range(10):
        first = RunState.begin(target, "replay", {"x": 1}, resume=False)

        def second():
            try:
                RunState.begin(target, "replay", {"x": 1}, resume=False).close()
                got.append("ran")
            except Busy as e:
                got.append("busy" if "in use by pid ?" not in str(e) else f"unnamed: {e}")   # names the holder
            except BaseException as e:    # noqa: BLE001 - what the test looks for
                got.append(repr(e))
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.03 + 0.01 * (trial % 5))
        first.save({}, {})
        first.finish()
        t.join()
    assert set(got) <= {"busy", "ran"} and "busy" in got, got
