"""Rolling a policy store back (rmm_jax.persist.policy_rollback): in every scope the store
loads exactly what it loaded before the runs it forgets; a refusal changes no byte; a
rollback killed at any step is finished by the next writer."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_cli
from helpers import TESTS_DIR as TESTS
from helpers import info_of, params_of, stacked, state_for, state_of

from rmm_jax.core.config import preset
from rmm_jax.core.types import SharedState
from rmm_jax.errors import InputError
from rmm_jax.persist import policy_rollback, policy_snapshot
from rmm_jax.persist.policy_rollback import PENDING, plan, rollback
from rmm_jax.persist.policy_setting import read_setting, write_setting
from rmm_jax.persist.policy_store import PolicyStore

D = 8
META = {"kind": "linear", "dim": D, "hidden": None}
SCOPES = {"user": META, "shared": {**META, "scope": "shared"}, "hybrid": {**META, "scope": "hybrid", "rank": 2}}
S1, S2 = {"preset": "default", "lr": 1e-4}, {"preset": "default", "lr": 3e-4}


def run(st: PolicyStore, chunks: list[dict], shared_seed: int, setting_before=S1, record_run=True) -> list[int]:
    """One online run as the CLI saves it: per chunk of users ``{user: seed}``, a shared
    version first (scopes with one), then the chunk's users, each version recording the run."""
    first = st.next_version()
    versions = []
    for i, seeds in enumerate(chunks):
        sv = st.save_shared(SharedState(params_of(shared_seed + i), None), {"source": "online"}) if st.paired \
            else None
        run_rec = {"first_version": first, "setting_before": setting_before} if record_run else None
        versions.append(st.save(list(seeds), stacked([state_for(s, st.scope.name) for s in seeds.values()]),
                                [info_of(s) for s in seeds.values()], shared_version=sv, run=run_rec))
    return versions


def loads(path: Path) -> dict:
    """Everything a reader gets from the store: each user's loaded version, state and info
    (bytes), the shared part serving and continuing use, the header's setting."""
    st = PolicyStore.open(path)
    out = {"users": {}, "setting": read_setting(st), "header_mark": st._header.get(PENDING)}
    for u in st.users():
        got = st.load(u)
        leaves = jax.tree_util.tree_leaves(got.state)
        out["users"][u] = (got.version, got.shared_version, got.info, [np.asarray(x).tobytes() for x in leaves])
    lv = st.learned_shared_version()
    out["shared"] = None if lv is None else [np.asarray(x).tobytes()
                                             for x in jax.tree_util.tree_leaves(st.shared_state(lv).state)]
    return out


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


def two_runs(tmp_path, scope, keep=3):
    st = PolicyStore.create(tmp_path / "store", SCOPES[scope], params_of(0), keep=keep)
    run(st, [{"a": 1}, {"b": 2}], shared_seed=100)
    write_setting(st, S1)
    before = loads(st.path)
    second = run(st, [{"a": 11, "c": 13}, {"b": 12}], shared_seed=200)
    write_setting(st, S2)
    return st, before, second


@pytest.mark.parametrize("scope", list(SCOPES))
def test_undoing_the_newest_run_loads_exactly_what_loaded_before_it(tmp_path, scope):
    st, before, second = two_runs(tmp_path, scope)
    shared_before = set(st.shared_versions())
    assert loads(st.path) != before
    dry = plan(st)
    assert dry.versions == tuple(second) and loads(st.path)["setting"] == S2   # a plan changes nothing
    r = rollback(st)
    assert r == dry and r.to == second[0] - 1 and r.removed == ("c",) and r.users == ("a", "b")
    assert loads(st.path) == before                   # states, infos, versions, shared part, setting
    assert r.setting == S1 and r.setting_known
    if scope == "user":
        assert r.shared == ()
    else:                                             # the run's shared versions went with it
        assert set(r.shared) and set(r.shared).isdisjoint(st.shared_versions())
        assert set(st.shared_versions()) <= shared_before
    assert not (st.path / "gens" / f"v{second[0]:08d}").exists()
    assert st.save(["a"], stacked([state_for(5, st.scope.name)]), [info_of(5)],
                   shared_version=st.learned_shared_version()) > second[-1]   # no number handed out twice


@pytest.mark.parametrize("recorded", [True, False])
@pytest.mark.parametrize("scope", ["shared", "hybrid"])
def test_a_shared_version_number_is_never_handed_out_again_after_a_rollback(tmp_path, scope, recorded):
    """After a rollback deleted the run's shared versions, the next save_shared took the number
    of a deleted one again: two served lines saying shared_version 3 were drawn by different
    shared parts. The next shared version is above every number issued before, as user
    versions are, also in a store whose index recorded none (an older rmm-jax wrote it): the
    rollback reserves the numbers it deletes."""
    import sqlite3

    st, _, second = two_runs(tmp_path, scope)
    issued = set(st.shared_versions())
    if not recorded:
        with sqlite3.connect(st.path / "index.sqlite") as db:
            db.execute("DELETE FROM kv WHERE key = 'next_shared'")
    r = rollback(st)
    assert r.shared and set(r.shared) <= issued
    nxt = st.save_shared(SharedState(params_of(300), None), {"source": "online"})
    assert nxt > max(issued)
    rollback(st, to=st.save(["a"], stacked([state_for(7, st.scope.name)]), [info_of(7)], shared_version=nxt) - 1)
    assert st.save_shared(SharedState(params_of(301), None), {"source": "online"}) > nxt


def test_each_rollback_undoes_one_more_run_and_to_goes_back_to_any_version(tmp_path):
    st, before, second = two_runs(tmp_path, "hybrid")
    third = run(st, [{"a": 21}], shared_seed=300, setting_before=S2)
    rollback(st)
    assert [e.version for e in st.entries("a")] == [1, second[0]]
    rollback(st)
    assert loads(st.path) == before
    st2, _, second2 = two_runs(tmp_path / "again", "user")
    r = rollback(st2, to=np.int64(second2[0]))       # mid-run: only its second save goes (a NumPy int too)
    assert r.versions == (second2[1],) and r.users == ("b",) and r.removed == () and type(r.to) is int
    assert third[0] > second[-1]


def test_a_path_for_the_store_is_refused_by_name_and_nothing_changes(tmp_path):
    """rollback("policies"), as `rmm-jax policies rollback P` takes the store, was an
    AttributeError ('str' object has no attribute '_header'); so were plan and newest_run."""
    st, _, _ = two_runs(tmp_path, "user")
    before = loads(st.path)
    for call in (rollback, plan, policy_rollback.newest_run):
        for wrong in (str(st.path), st.path):
            with pytest.raises(InputError, match=r"^store: expected a policy store, PolicyStore\.open\(path\), got "):
                call(wrong)
    assert loads(st.path) == before


def test_a_bad_to_is_refused_naming_the_argument(tmp_path):
    """plan(store, to="1") said "--to: must be a version >= 0", the CLI's option, from Python;
    the CLI's own error (tests/test_bad_input.py) still says --to."""
    st, _, _ = two_runs(tmp_path, "user")
    before = loads(st.path)
    for call in (rollback, plan):
        for wrong in ("1", -1, 1.0, True):
            with pytest.raises(InputError, match=r"^to: must be a version >= 0, got "):
                call(st, to=wrong)
    assert loads(st.path) == before


def test_a_user_whose_state_at_that_point_is_no_longer_kept_is_refused_and_nothing_changes(tmp_path, capsys):
    """From Python the store's setting is ``keep=1`` (the CLI's ``--keep 1`` is no argument of
    the API); the CLI names its option."""
    st, _, _ = two_runs(tmp_path, "hybrid", keep=1)   # keep 1: a's and b's first versions are gone
    digest = tree_digest(st.path)
    with pytest.raises(InputError, match=r"cannot roll back to v2: user 'a' keeps no version at or below it, and "
                                         r"its versions before v3 are no longer kept \(keep=1\) \(and 1 more"):
        rollback(st)
    code, _, err = run_cli(capsys, "policies", "rollback", st.path)
    assert code == 2 and err.strip().splitlines() == [
        f"error: {st.path}: cannot roll back to v2: user 'a' keeps no version at or below it, and its versions "
        "before v3 are no longer kept (--keep 1) (and 1 more users)"], err
    assert tree_digest(st.path) == digest


def test_versions_that_do_not_say_what_they_replaced_or_which_run_saved_them_are_refused(tmp_path, monkeypatch,
                                                                                          capsys):
    st = PolicyStore.create(tmp_path / "store", META, params_of(0))
    run(st, [{"a": 1}], shared_seed=0)
    real = policy_snapshot.write_rows
    monkeypatch.setattr(policy_snapshot, "write_rows",  # what an rmm-jax before the record wrote
                        lambda dest, meta, *a: real(dest, {k: v for k, v in meta.items() if k != "previous"}, *a))
    run(st, [{"b": 2}], shared_seed=0, record_run=False)
    with pytest.raises(InputError, match=r"its newest version v2 does not record the run that saved it .*: "
                                         r"give to=VERSION$"):      # the API's argument, not the CLI's --to
        rollback(st)
    code, _, err = run_cli(capsys, "policies", "rollback", st.path, "--dry-run")
    assert code == 2 and err.strip().splitlines()[-1].endswith("not by a run of the CLI): give --to VERSION"), err
    with pytest.raises(InputError, match=r"user 'b' keeps no version at or below it, and its oldest kept version, "
                                         r"v2, does not record whether it replaced one"):
        rollback(st, to=1)
    with pytest.raises(InputError, match=r"nothing to roll back: v2 is not below the newest user version \(v2\)"):
        rollback(st, to=2)


def test_a_run_that_does_not_say_which_setting_it_found_leaves_the_setting(tmp_path):
    st = PolicyStore.create(tmp_path / "store", META, params_of(0))
    run(st, [{"a": 1}], shared_seed=0)
    write_setting(st, S1)
    st.save(["a"], stacked([state_of(2)]), [info_of(2)], run={"first_version": 2})
    write_setting(st, S2)
    r = rollback(st)
    assert not r.setting_known and read_setting(PolicyStore.open(st.path)) == S2


def test_the_cli_says_it_is_rolling_back_before_the_work_and_nothing_before_a_refusal(tmp_path, capsys, monkeypatch):
    """On a large store `policies rollback` printed nothing for 4-6 s, where the other
    policies subcommands say what they load; a refusal stays one line."""
    from rmm_jax.persist import policy_rollback

    st, _, _ = two_runs(tmp_path, "user")
    said_before_work = []
    real = policy_rollback.finish
    monkeypatch.setattr(policy_rollback, "finish", lambda store: said_before_work.append(
        capsys.readouterr().err) or real(store))
    code, out, err = run_cli(capsys, "policies", "rollback", st.path, "--to", "0")
    assert code == 2 and len(err.strip().splitlines()) == 1 and said_before_work == [], err
    code, out, err = run_cli(capsys, "policies", "rollback", st.path)
    assert code == 0 and said_before_work[0] == f"rolling back {st.path} to v2 ...\n", (said_before_work, err)
    assert out.startswith(f"rolled back {st.path} to v2")


@pytest.mark.parametrize("finisher", ["a writer", "rollback again"])
@pytest.mark.parametrize("step", ["after the mark", "after the index", "after the shared versions"])
def test_a_rollback_killed_at_any_step_is_finished_by_the_next_writer(tmp_path, monkeypatch, step, finisher):
    """Each step of finish() fails in turn (as a kill there would stop it): readers still load
    a whole store, and the next writer ends where an uninterrupted rollback ends. Running the
    rollback again finishes it and undoes nothing more."""
    want_st, want_before, _ = two_runs(tmp_path / "want", "hybrid")
    rollback(want_st)
    want = loads(want_st.path)
    st, before, _ = two_runs(tmp_path / "got", "hybrid")
    after_run = loads(st.path)

    def boom(*a, **k):
        raise KeyboardInterrupt("killed")
    target = {"after the mark": (policy_rollback, "writer_index"),
              "after the index": (policy_rollback, "drop_unindexed"),
              "after the shared versions": (PolicyStore, "_forget_shared_cache")}[step]
    with monkeypatch.context() as m:
        m.setattr(*target, boom)
        with pytest.raises(KeyboardInterrupt):
            rollback(st)
    seen = loads(st.path)                             # a reader, before any writer repairs
    assert seen["header_mark"] is not None
    assert {k: v for k, v in seen.items() if k != "header_mark"} in (
        {k: v for k, v in after_run.items() if k != "header_mark"},
        {k: v for k, v in before.items() if k != "header_mark"} | {"setting": S2})
    with pytest.raises(InputError, match=r"a rollback to v2 was interrupted: `rmm-jax policies rollback .*` finishes"):
        plan(PolicyStore.open(st.path))
    if finisher == "a writer":
        with PolicyStore.open(st.path).writer():      # the next writer, whatever it came to do
            pass
    else:
        again = rollback(PolicyStore.open(st.path))
        assert again.interrupted and again.to == 2 and again.versions == (3, 4)
    assert loads(st.path) == want == before


def test_store_notes_are_what_every_reader_says_and_carries_in_its_json(tmp_path, monkeypatch):
    """store_notes: the one read of a store's notes for its readers (rerank, evaluate, policies
    list/show/export, a quiet replay), which each assembled by hand: the note lines in order
    (the pending rollback, then the unfinished run) and the two --json keys, null where none."""
    st, _, _ = two_runs(tmp_path / "p", "user")
    clean = policy_rollback.store_notes(st)
    assert clean == (None, None) and clean.lines == []
    assert list(clean.doc().items()) == [("unfinished_run", None), ("pending_rollback", None)]
    with monkeypatch.context() as m:
        m.setattr(policy_rollback, "writer_index", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            rollback(st)
    notes = policy_rollback.store_notes(PolicyStore.open(st.path))
    pending = policy_rollback.pending_note(PolicyStore.open(st.path))
    assert pending and notes == (pending, None) and notes.lines == [pending]
    assert notes.doc() == {"unfinished_run": None, "pending_rollback": pending}


# SIGKILLs itself at the N-th directory the rollback deletes (N > 0), or as it writes the
# header that ends it (N = 0): no finally block runs, the lock dies with the process.
KILL_IN_ROLLBACK = textwrap.dedent("""
    import os, shutil, signal, sys
    from rmm_jax.persist.policy_store import PolicyStore
    from rmm_jax.persist.policy_rollback import rollback
    n, calls = int(sys.argv[2]), [0]
    rmtree, write_header = shutil.rmtree, PolicyStore._write_header

    def dying_rmtree(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return rmtree(*a, **k)

    def dying_header(self, header):
        if n == 0 and "rollback" not in header:
            os.kill(os.getpid(), signal.SIGKILL)
        return write_header(self, header)

    shutil.rmtree, PolicyStore._write_header = dying_rmtree, dying_header
    rollback(PolicyStore.open(sys.argv[1]))
""")


@pytest.mark.parametrize("kill_at", [0, 1, 2, 3, 4])
def test_a_rollback_sigkilled_anywhere_is_finished_by_the_next_writer(tmp_path, kill_at):
    """A real SIGKILL (no cleanup, the lock released by the kernel) at each deletion of a
    rollback, and at its last header write: a reader loads a whole store, old or new, and
    the next writer ends where an uninterrupted rollback ends."""
    st, before, _ = two_runs(tmp_path, "hybrid")
    after_run = loads(st.path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", KILL_IN_ROLLBACK, str(st.path), str(kill_at)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    seen = loads(st.path)
    strip = lambda d: {k: v for k, v in d.items() if k not in ("header_mark", "setting")}  # noqa: E731
    assert seen["header_mark"] is not None and strip(seen) in (strip(after_run), strip(before))
    with PolicyStore.open(st.path).writer():
        pass
    assert loads(st.path) == before


def test_the_start_is_never_pruned_and_is_where_a_rollback_past_every_user_and_init_pretrained_go(tmp_path):
    """The shared version a store starts from (created or pretrained with) outlives any number
    of online shared versions, even at keep 1: `--init pretrained` starts there, not from what
    online runs trained, and rolling back every user version serves it again. A store whose
    start older code pruned refuses both in one line."""
    from rmm_jax.online.session import plan_start
    st = PolicyStore.create(tmp_path / "store", SCOPES["hybrid"], params_of(0), keep=1)
    for night in range(4):
        run(st, [{"a": 10 * night + 1}], shared_seed=100 * night)
    assert st.start_shared_version() == 1 and st.shared_versions() == [1, 5]   # online v2-v4 pruned, not v1
    lay = preset("default", scope="hybrid", rank=2).layout
    start = plan_start(st, None, lay, "pretrained", 0).params
    assert tree_bytes(start) == tree_bytes(params_of(0))
    assert tree_bytes(start) != tree_bytes(st.shared_state().state.params)     # the newest is an online one
    with pytest.raises(InputError, match=r"keeps no version at or below it, and its versions before v4"):
        rollback(st, to=0)                            # keep 1: a's first nights are gone
    st2 = PolicyStore.create(tmp_path / "store2", SCOPES["hybrid"], params_of(0))
    run(st2, [{"a": 1}, {"b": 2}], shared_seed=100)
    meta = st2.path / "shared" / "v00000003" / "c0000" / "chunk.json"
    good = meta.read_bytes()
    meta.write_text("{half")                           # an online version whose metadata cannot be read
    assert PolicyStore.open(st2.path).start_shared_version() == 1             # is not taken for the start
    meta.write_bytes(good)
    with pytest.raises(InputError, match=r"^to: no user version would remain: v0 is below the oldest version the "
                                         r"store keeps, v1, the oldest it can go back to \(to undo every run, roll "
                                         r"back without to, run by run; to start afresh, delete "):
        rollback(st2, to=0)                            # named: below every listed version, refused
    r = rollback(st2)                                  # undoing its one run goes past every user version
    assert r.removed == ("a", "b") and st2.users() == [] and set(r.shared) == {2, 3}
    assert st2.shared_versions() == [1] and st2.learned_shared_version() == 1
    st3 = PolicyStore.create(tmp_path / "store3", SCOPES["hybrid"], params_of(0))
    run(st3, [{"a": 1}], shared_seed=100)
    shutil.rmtree(st3.path / "shared" / "v00000001")   # what an rmm-jax that pruned the start left
    st3 = PolicyStore.open(st3.path)
    with pytest.raises(InputError, match=r"no user version would remain, and the shared version the store started "
                                         r"from is no longer kept"):
        rollback(st3)
    with pytest.raises(InputError, match=r"its pretrained parameters are no longer kept"):
        plan_start(st3, None, lay, "pretrained", 0)


def tree_bytes(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_a_long_lived_reranker_serves_what_the_store_holds_after_refresh(tmp_path):
    """A Reranker caches the policies it loaded: refresh() after a night's run or a rollback
    drops them when the store changed, and only then; each user is then served the version
    the store holds now, and the τ of the setting it records."""
    from rmm_jax.online.serve import Reranker
    st = PolicyStore.create(tmp_path / "store", META, params_of(0))
    run(st, [{"a": 1}], shared_seed=0)
    write_setting(st, {"estimator": {"tau": 0.1, "noise": "tempered"}})
    rr = Reranker.open(st.path)
    assert rr.policy("a").version == 1 and not rr.refresh()          # nothing changed: kept
    run(st, [{"a": 2}], shared_seed=0, setting_before={"estimator": {"tau": 0.1, "noise": "tempered"}})
    write_setting(st, {"estimator": {"tau": 0.3, "noise": "tempered"}})
    assert rr.policy("a").version == 1                               # the cached policy, until told
    assert rr.refresh() and rr.policy("a").version == 2 and rr.tau == 0.3
    assert tree_bytes(rr.policy("a").params) == tree_bytes(state_of(2).params)
    rollback(PolicyStore.open(st.path))
    assert rr.refresh() and rr.policy("a").version == 1 and rr.tau == 0.1 and not rr.refresh()
    # a Reranker that served a night's policy without a refresh, then the night is undone under
    # the same setting: the newest version is what the Reranker first saw, and still it reloads
    run(st, [{"a": 3}], shared_seed=0, setting_before={"estimator": {"tau": 0.1, "noise": "tempered"}})
    assert rr.policy("a").version == 1
    rr._cache.clear()                                               # as a server that evicted "a"
    assert rr.policy("a").version == 3
    rollback(PolicyStore.open(st.path))
    assert rr.refresh() and rr.policy("a").version == 1 and not rr.refresh()


def test_the_cli_words_a_gone_to_an_interrupted_run_and_what_to_learn_again_truthfully(tmp_path, capsys):
    """`--to 2 --dry-run` when v2 had been rolled back itself said "would roll back to v2:
    forgets v4-v5" of a store that then holds v1 as its newest: it says so. A dry run was
    refused while an interrupted run's state exists: it reports, with a note that the
    rollback itself is refused. After a rollback, "replay their log" fits a replay but not a
    simulate run: both are named."""
    from rmm_jax.persist.runstate import RunState

    st = PolicyStore.create(tmp_path / "pq", META, params_of(0))
    run(st, [{"a": 1}], shared_seed=100)                       # v1
    run(st, [{"a": 2}], shared_seed=200)                       # v2
    rollback(st)                                               # back to v1: v2 forgotten
    later = run(st, [{"a": 3}], shared_seed=300) + run(st, [{"a": 4}], shared_seed=400)
    assert later == [3, 4]
    rs = RunState.begin(st.path, "simulate", {}, resume=False)
    rs.save({}, {"x": np.arange(2)})
    rs.close()                                                 # an interrupted simulate run
    before = tree_digest(st.path)
    code, out, err = run_cli(capsys, "policies", "rollback", st.path, "--to", "2", "--dry-run")
    assert code == 0, err
    assert out.splitlines()[0] == (f"would roll back {st.path} to v2 (it keeps no v2: the newest version at or below "
                                   "it, v1, is the newest then): forgets v3-v4; 1 user back at an earlier version, "
                                   "0 new since v2 removed")
    assert "rollback itself is refused while an interrupted `simulate` run's state is in" in err
    assert "--resume" in err and tree_digest(st.path) == before
    code, _, err = run_cli(capsys, "policies", "rollback", st.path, "--to", "2")
    assert code == 2 and "interrupted `simulate` run" in err and tree_digest(st.path) == before
    shutil.rmtree(RunState.path_for(st.path))
    code, out, err = run_cli(capsys, "policies", "rollback", st.path, "--to", "2")
    assert code == 0, err
    assert "the newest version at or below it, v1, is the newest now): forgot v3-v4" in out.splitlines()[0]
    assert out.splitlines()[-1] == ("the calls the forgotten versions learned from can be learned again: replay their "
                                    "log, or simulate their questions again")
    assert [e.version for e in PolicyStore.open(st.path).entries("a")] == [1]
    # --to 0 emptied the store (every user version forgotten) and exited 0; v0 is no version
    # `policies show` lists: refused in one line naming --to and the oldest version it can go to
    before = tree_digest(st.path)
    for dry in ((), ("--dry-run",)):
        code, out, err = run_cli(capsys, "policies", "rollback", st.path, "--to", "0", *dry)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert "--to: no user version would remain: v0 is below the oldest version the store keeps, v1" in err, err
        assert f"delete {st.path} to start afresh" not in err and f"delete {st.path})" in err, err
    assert tree_digest(st.path) == before


def test_undoing_the_newest_run_names_the_version_it_went_back_to(capsys, tmp_path):
    """A plain rollback (no --to) after a run that followed an earlier rollback said "rolled
    back to v2 (it keeps no v2: the newest version at or below it, v1, is the newest now)":
    nobody asked for v2 (the run's start, forgotten by the first rollback). It names v1, in its
    dry run, its progress line and its report; --to 2 still explains its v2."""
    st = PolicyStore.create(tmp_path / "p", META, params_of(0))
    run(st, [{"a": 1}], shared_seed=100)                       # v1
    run(st, [{"a": 2}], shared_seed=200)                       # v2
    rollback(st)                                               # back to v1: v2 forgotten
    assert run(st, [{"a": 3}], shared_seed=300) == [3]
    code, out, _ = run_cli(capsys, "policies", "rollback", st.path, "--dry-run")
    assert code == 0 and out.splitlines()[0].startswith(f"would roll back {st.path} to v1: forgets v3;"), out
    code, out, _ = run_cli(capsys, "policies", "rollback", st.path, "--to", "2", "--dry-run")
    assert code == 0 and out.splitlines()[0].startswith(f"would roll back {st.path} to v2 (it keeps no v2"), out
    code, out, err = run_cli(capsys, "policies", "rollback", st.path)
    assert code == 0 and out.splitlines()[0].startswith(f"rolled back {st.path} to v1: forgot v3;"), out
    assert f"rolling back {st.path} to v1 ..." in err, err
