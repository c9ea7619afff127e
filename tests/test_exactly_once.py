"""Exactly once: a policy store remembers the calls each policy learned from, in the user's
row (rmm_jax.persist.learned_calls), so replay learns every logged call once.

Replaying a log again learns nothing and says so; a log that mixes old and new calls learns
the new ones, in order (bit for bit the policies of replaying only the new ones); a call
learned with other content is a one-line error naming its line, and --relearn learns it
again; --resume after a finished run retrains nothing. A run killed anywhere (in process:
an exception where a SIGKILL would land, test_resume.py kills real processes) and run
again, with or without --resume, gives bit for bit the policies of one uninterrupted run,
in every scope: between a chunk's shared part and its users, between a chunk's save and its
checkpoint, mid-chunk, and between the last save and the run-state's removal.
"""
from __future__ import annotations

import json
import os
import shutil
import socket

import jax
import numpy as np
import pytest
from conftest import make_fake_store, run_cli

from rmm_jax.cli import replay as replay_cli
from rmm_jax.cli.main import main
from rmm_jax.core.config import Layout, describe
from rmm_jax.data.log_vectors import known_ids
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError, worded
from rmm_jax.online import loop, sinks, starts
from rmm_jax.online.starts import check_learned
from rmm_jax.online.streams import scan_log
from rmm_jax.persist import runstate
from rmm_jax.persist.policy_store import PolicyStore

RUN = ["--k", "8", "--m", "3", "--lr", "0.01", "--users-per-chunk", "2", "--checkpoint-every", "2"]
PROGRAMS: dict = {}


@pytest.fixture(autouse=True)
def one_program_per_setting(monkeypatch):
    """The CLI builds (and traces) a new program per command; these tests run dozens of
    replays of a few settings in one process, so they share one program per setting
    (make_run is pure: the program depends on the setting only)."""
    def make_run(*setting):
        key = json.dumps(describe(*setting), sort_keys=True)
        if key not in PROGRAMS:
            PROGRAMS[key] = loop.make_run(*setting)
        return PROGRAMS[key]

    monkeypatch.setattr(replay_cli, "make_run", make_run)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("once") / "store", users=4, sessions=6, dim=16)


@pytest.fixture(scope="module")
def logged(store, tmp_path_factory):
    """A simulated log of every user, as records in log order."""
    tmp = tmp_path_factory.mktemp("log")
    main(["simulate", str(store), "--policies", str(tmp / "p"), "--log-out", str(tmp / "log.jsonl"), *RUN])
    return [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def states(path) -> dict:
    """Every user's saved state and learned calls as flat arrays, and the shared part a run continues from."""
    ps = PolicyStore.open(path)
    got = ps.load_batch(ps.users())
    out = {u: [np.asarray(x[i]) for x in jax.tree.leaves((got.state, got.learned))] for i, u in enumerate(got.users)}
    out["<shared>"] = [np.asarray(x) for x in jax.tree.leaves(ps.shared_state(ps.learned_shared_version()).state)]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert len(a[k]) == len(b[k]) and all(np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
                                              for x, y in zip(a[k], b[k])), k


def replay(capsys, store, log, pol, *extra):
    return run_cli(capsys, "replay", store, "--log", log, "--policies", pol, *RUN, *extra)


def test_a_log_replayed_again_learns_nothing_and_says_how_many_it_skipped(capsys, tmp_path, store, logged):
    log = write(tmp_path / "day.jsonl", logged)
    code, out, err = replay(capsys, store, log, tmp_path / "p", "--scope", "hybrid", "--rank", "2", "--json")
    assert code == 0, err
    first = json.loads(out)["log"]["calls"]              # the first night into a new store says so too
    assert first == {"learn": len(logged), "learned_already": 0, "older": 0, "changed": 0, "relearn": False}, first
    one = logged[0]["user_id"]                           # and counts only the users it replays
    code, out, err = replay(capsys, store, log, tmp_path / "one", "--users", one, "--json")
    assert code == 0 and json.loads(out)["log"]["calls"]["learn"] == sum(r["user_id"] == one for r in logged), err
    before = states(tmp_path / "p")
    versions = PolicyStore.open(tmp_path / "p").next_version()
    code, out, err = replay(capsys, store, log, tmp_path / "p", "--json")
    assert code == 0, err
    assert f"skipped {len(logged)} calls learned already: {len(logged)} by these policies" in err, err
    calls = json.loads(out)["log"]["calls"]
    assert calls == {"learn": 0, "learned_already": len(logged), "older": 0, "changed": 0, "relearn": False}
    assert PolicyStore.open(tmp_path / "p").next_version() == versions      # nothing saved
    assert_same(before, states(tmp_path / "p"))
    # --resume without a checkpoint after a finished run: nothing retrained either
    code, out, err = replay(capsys, store, log, tmp_path / "p", "--resume")
    assert code == 0 and "no checkpoint" in err and "nothing to learn" in out, err
    assert PolicyStore.open(tmp_path / "p").next_version() == versions
    # --relearn is the explicit opt-in: it learns every call again
    code, _, err = replay(capsys, store, log, tmp_path / "p", "--relearn")
    assert code == 0 and f"--relearn: learning {len(logged)} calls again" in err, err
    with pytest.raises(AssertionError):
        assert_same(before, states(tmp_path / "p"))


def tree(path) -> dict:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("text", ["", "\n \t\n"], ids=["0 bytes", "blank lines"])
def test_an_empty_log_is_a_quiet_day_with_nothing_to_learn(capsys, tmp_path, store, logged, text):
    """A day without calls was "no records (the file is empty)", exit 2, failing the nightly
    job as bad input. It has nothing to learn, as a log learned already: exit 0, the policy
    store unchanged (no new version), no run-state left beside it, none created."""
    pol = tmp_path / "policies" / "p"         # its directory holds the store and what a run leaves beside it
    code, _, err = replay(capsys, store, write(tmp_path / "day1.jsonl", logged), pol)
    assert code == 0, err
    before, versions = tree(pol.parent), PolicyStore.open(pol).next_version()
    empty = tmp_path / "quiet.jsonl"
    empty.write_text(text)
    code, out, err = replay(capsys, store, empty, pol, "--json")
    assert code == 0 and err.startswith("nothing to learn: ") and "has no calls (the file is empty)" in err, err
    doc = json.loads(out)
    assert doc["log"]["calls"] == {"learn": 0, "learned_already": 0, "older": 0, "changed": 0, "relearn": False}
    assert doc["log"]["records"] == 0 and doc["online"] == {"queries": 0, "calls": 0}
    code, out, err = replay(capsys, store, empty, pol)
    assert code == 0 and out.startswith("nothing to learn: ") and "has no calls (the file is empty)" in out, err
    assert PolicyStore.open(pol).next_version() == versions and tree(pol.parent) == before
    assert not runstate.RunState.path_for(pol).exists()
    code, out, err = replay(capsys, store, empty, pol.parent / "new")     # a first night without calls
    assert code == 0 and "was not created" in out, err
    assert tree(pol.parent) == before


def test_a_quiet_day_refuses_the_options_a_day_with_calls_refuses(capsys, tmp_path, store, logged):
    """An empty log skipped the option checks: `--k 3 --m 5`, refused on a day with calls
    (the log contradicts it, and m > k is no layout), exited 0 with "nothing to learn",
    as did --preset paper (whose log-prob logs cannot give), a --plot that is no .png, a
    --rank the embedding cannot hold and --init pretrained with no pretrained store, so a
    nightly job's bad options went unnoticed until a day with calls. Now the same one line
    and exit 2, and nothing written."""
    pol = tmp_path / "policies" / "p"
    code, _, err = replay(capsys, store, write(tmp_path / "day1.jsonl", logged), pol)
    assert code == 0, err
    before = tree(pol.parent)
    empty = tmp_path / "quiet.jsonl"
    empty.write_text("")
    for targets, extra, line in (((pol, pol.parent / "new"), ("--k", "3", "--m", "5"),
                                  "error: --m: must be an int in [1, k=3], got 5"),
                                 ((pol.parent / "new",), ("--preset", "paper"), "error: --preset: the paper preset's "
                                  "log-prob needs the sampled Gumbel noise, which logs do not record; replay with "
                                  "--preset default"),
                                 ((pol,), ("--preset", "paper"), "error: --preset: paper would change the learning "
                                  f"setting policy store {pol} records (preset default; loss, offset, reference, "
                                  "reward, baseline, mode, tau, noise, optimizer change with it); leave the option "
                                  "out to continue with it, or add --change-setting"),
                                 ((pol, pol.parent / "new"), ("--plot", str(tmp_path / "curve.txt")),
                                  f"error: --plot: must name a .png file, got {str(tmp_path / 'curve.txt')!r}"),
                                 ((pol.parent / "new",), ("--scope", "hybrid", "--rank", "16"),
                                  "error: --rank: must be in [1, d=16), got 16"),
                                 ((pol.parent / "new",), ("--init", "pretrained"), f"error: --policies "
                                  f"{pol.parent / 'new'}: does not exist; run `rmm-jax pretrain` first or use --init "
                                  "identity (--init pretrained)"),
                                 ((pol,), ("--init", "pretrained"), f"error: --policies {pol}: holds no pretrained "
                                  "parameters; run `rmm-jax pretrain` or use --init identity")):
        for target in targets:
            code, out, err = replay(capsys, store, empty, target, *extra)
            assert (code, out, err.strip()) == (2, "", line), (extra, err)
            assert tree(pol.parent) == before
    code, out, err = replay(capsys, store, empty, pol, "--k", "40", "--m", "30")   # a day with such calls runs
    assert code == 0 and "nothing to learn" in out, err


def test_a_call_learned_with_other_content_is_an_error_naming_its_line(capsys, tmp_path, store, logged):
    log = write(tmp_path / "day.jsonl", logged)
    code, _, err = replay(capsys, store, log, tmp_path / "p")
    assert code == 0, err
    edited = [dict(r) for r in logged]
    edited[5]["cited"] = [] if edited[5]["cited"] else edited[5]["selected"][:1]
    edited[7]["gold"] = edited[7]["selected"][:1]          # gold is not what learning reads: not a rewrite
    write(log, edited)
    before = states(tmp_path / "p")
    code, _, err = replay(capsys, store, log, tmp_path / "p")
    assert code == 2, err
    assert err.strip().splitlines() == [f"error: {log}:6: user {logged[5]['user_id']!r}: this call was learned with "
                                        "other content (every log key but gold, timestamp, policy_version, "
                                        "shared_version is read: a log_prob rounded or a text re-spaced since is "
                                        "other content): the log was rewritten after it was learned, or it is "
                                        "another call under the same name (give each call its own call_id); "
                                        "--relearn learns the log's calls again"], err
    assert_same(before, states(tmp_path / "p"))
    # a layout whose K or M the log's records exceed: from Python, the layout's k= and m=
    with pytest.raises(InputError, match=r"^[^\n]*: record for user .* candidates, more than k=4$"):
        scan_log(log, Layout(k=4, m=3), known=known_ids(open_store(str(store))))
    with pytest.raises(InputError, match=r"^[^\n]*: record for user .* memories, more than --m 2$"):
        with worded({"k": "--k", "m": "--m"}):   # as the CLI's replay (as_options) words them
            scan_log(log, Layout(k=8, m=2), known=known_ids(open_store(str(store))))
    # the API names its argument: a Python caller has no --relearn
    st = open_store(str(store))
    calls = scan_log(log, Layout(k=8, m=3), known=known_ids(st), calls=True).calls
    with pytest.raises(InputError, match=r"^[^\n]*:6: user .*its own call_id\); relearn=True learns the log's calls "
                                         r"again$"):
        check_learned(calls, PolicyStore.open(tmp_path / "p"), log, before=None)
    code, _, err = replay(capsys, store, log, tmp_path / "p", "--relearn")
    assert code == 0, err


def test_skip_invalid_leaves_out_a_call_learned_with_other_content_and_learns_the_rest(capsys, tmp_path, store,
                                                                                        logged):
    """One call of an earlier night re-logged with other citations, in the next night's log:
    the night was refused whole, and --skip-invalid did not skip it (--relearn learns every
    call of the log again). With --skip-invalid it is left out and counted, one line names it,
    and the policies end bit for bit as a replay of the night with that call as it was learned,
    which is left out as learned already (the same streams, so the same compiled shapes)."""
    half = len(logged) // 2
    first, second = logged[:half], logged[half:]
    for name in ("p", "ref"):
        code, _, err = replay(capsys, store, write(tmp_path / "night1.jsonl", first), tmp_path / name)
        assert code == 0, err
    changed = dict(first[3])
    changed["cited"] = [] if changed["cited"] else changed["selected"][:1]
    night2 = write(tmp_path / "night2.jsonl", [*second[:5], changed, *second[5:]])
    code, _, err = replay(capsys, store, night2, tmp_path / "p")
    assert code == 2 and "this call was learned with other content" in err, err
    code, out, err = replay(capsys, store, night2, tmp_path / "p", "--skip-invalid", "--json")
    assert code == 0, err
    assert "skipped 1 call learned already with other content (--skip-invalid; first: " in err and ":6: user" in err
    calls = json.loads(out)["log"]["calls"]
    assert calls["changed"] == 1 and calls["learn"] == len(second) and calls["learned_already"] == 0, calls
    code, _, err = replay(capsys, store, write(tmp_path / "night2_ref.jsonl", [*second[:5], first[3], *second[5:]]),
                          tmp_path / "ref")
    assert code == 0, err
    assert_same(states(tmp_path / "ref"), states(tmp_path / "p"))


def test_a_call_learned_with_other_content_is_one_line_with_k_and_m_from_the_log(capsys, tmp_path, store,
                                                                                  logged):
    """Left to the log (the docs' way), --k and --m came with a note (as a new question's text
    came with an 'embedded' line) printed before the exactly-once check refused the rewritten
    call: two lines on stderr for one bad input."""
    log = learned_then_edited(capsys, tmp_path, store, logged)
    before = states(tmp_path / "p")
    run = [a for i, a in enumerate(RUN) if RUN[i] not in ("--k", "--m") and RUN[i - 1] not in ("--k", "--m")]
    code, _, err = run_cli(capsys, "replay", store, "--log", log, "--policies", tmp_path / "p", *run)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {log}:6: user {logged[5]['user_id']!r}: this call was learned with other content "
                          "(every log key but gold, timestamp, policy_version, shared_version is read: a log_prob "
                          "rounded or a text re-spaced since is other content)")
    assert_same(before, states(tmp_path / "p"))


def learned_then_edited(capsys, tmp_path, store, logged):
    """A day's log replayed into tmp_path/p, then rewritten: its 6th call cites otherwise."""
    log = write(tmp_path / "day.jsonl", logged)
    assert replay(capsys, store, log, tmp_path / "p")[0] == 0
    edited = [dict(r) for r in logged]
    edited[5]["cited"] = [] if edited[5]["cited"] else edited[5]["selected"][:1]
    return write(log, edited)


@pytest.mark.parametrize("keep", ["1", "7"])
def test_a_replay_refused_for_its_log_leaves_the_store_byte_identical_whatever_its_keep(capsys, tmp_path, store,
                                                                                       logged, keep):
    """A replay refused for a call learned with other content, given --keep: taking the store's
    writer lock to say it was busy before any note recorded --keep in the store's header (3 -> 1
    or 7), so the next night, without --keep, pruned versions `policies rollback` needed. The
    refused run now only probes the lock: every file of the store is as it was."""
    log = learned_then_edited(capsys, tmp_path, store, logged)
    before = tree(tmp_path / "p")
    code, _, err = replay(capsys, store, log, tmp_path / "p", "--keep", keep)
    assert code == 2 and "this call was learned with other content" in err, err
    assert tree(tmp_path / "p") == before


class Killed(BaseException):
    """Where a SIGKILL would stop the process (not an Exception: nothing handles it)."""


def kill(monkeypatch, owner, name, at: int, after: bool = False):
    """Raise :class:`Killed` at the ``at``-th call of ``owner.name`` (before it runs, or after)."""
    real, calls = getattr(owner, name), []

    def wrapped(*a, **kw):
        calls.append(1)
        if len(calls) == at and not after:
            raise Killed
        out = real(*a, **kw)
        if len(calls) == at and after:
            raise Killed
        return out

    monkeypatch.setattr(owner, name, wrapped)


def killed_run(capsys, monkeypatch, store, log, pol, where, *extra):
    with monkeypatch.context() as m:
        kill(m, *where)
        with pytest.raises(Killed):
            replay(capsys, store, log, pol, *extra)
    capsys.readouterr()


SHARED_THEN_USERS = (PolicyStore, "save", 2)                # chunk 2's shared part saved, its users not
SAVED_NOT_CHECKPOINTED = (sinks.RunStateSink, "chunk", 1)   # chunk 1 saved, its checkpoint not written
MID_CHUNK = (sinks.RunStateSink, "segment", 1, True)        # after a checkpoint inside chunk 1
BEFORE_REMOVAL = (runstate.RunState, "finish", 1)           # every chunk saved, the run-state still there


def each_users_first(records, n: int) -> list[bool]:
    """Per record: whether it is among its user's first ``n`` (a day 1 of the log)."""
    seen: dict = {}
    first = []
    for r in records:
        seen[r["user_id"]] = seen.get(r["user_id"], 0) + 1
        first.append(seen[r["user_id"]] <= n)
    return first


@pytest.mark.parametrize("scope,plan", [
    ("hybrid", [(MID_CHUNK, ()), (SHARED_THEN_USERS, ("--resume",)), (BEFORE_REMOVAL, ()), (None, ("--resume",))]),
    ("hybrid", [(SAVED_NOT_CHECKPOINTED, ()), (None, ())]),
    ("shared", [(SHARED_THEN_USERS, ()), (None, ())]),
    ("user", [(SAVED_NOT_CHECKPOINTED, ()), (BEFORE_REMOVAL, ("--resume",)), (None, ())]),
])
def test_a_mixed_log_killed_anywhere_and_run_again_learns_the_new_calls_once(capsys, monkeypatch, tmp_path, store,
                                                                              logged, scope, plan):
    """Day 2's log repeats day 1's calls (each user's first 8) and adds new ones. It learns
    only the new ones, in order: bit for bit the policies of replaying only those; and so
    does a day-2 run killed at the plan's points in turn, each time run again with or
    without --resume."""
    first = each_users_first(logged, 8)
    day1 = write(tmp_path / "day1.jsonl", [r for r, f in zip(logged, first) if f])
    new = write(tmp_path / "new.jsonl", [r for r, f in zip(logged, first) if not f])
    day2 = write(tmp_path / "day2.jsonl", logged)
    code, _, err = replay(capsys, store, day1, tmp_path / "ref", "--scope", scope,
                          *(["--rank", "2"] if scope == "hybrid" else []))
    assert code == 0, err
    shutil.copytree(tmp_path / "ref", tmp_path / "killed")
    code, _, err = replay(capsys, store, new, tmp_path / "ref")
    assert code == 0, err
    for where, how in plan:
        if where is None:
            code, _, err = replay(capsys, store, day2, tmp_path / "killed", *how)
            assert code == 0, err
        else:
            killed_run(capsys, monkeypatch, store, day2, tmp_path / "killed", where, *how)
    assert not runstate.RunState.path_for(tmp_path / "killed").exists()
    assert_same(states(tmp_path / "ref"), states(tmp_path / "killed"))


@pytest.mark.parametrize("how", ["appended", "interleaved"])
def test_a_log_delivered_twice_is_learned_once_and_says_so(capsys, tmp_path, store, logged, how):
    """A day's log appended to itself (a log shipped at least once) was refused as a whole,
    "duplicate call_id ..., first logged at line 1", by replay and evaluate alike. Each line
    that repeats a record exactly is read once: the policies are bit for bit the single log's,
    the run notes the repeats (and --json counts them), and evaluate judges the same calls."""
    once = write(tmp_path / "once.jsonl", logged)
    twice = write(tmp_path / "twice.jsonl", logged + logged if how == "appended" else
                  [r for r in logged for _ in (0, 1)])
    code, _, err = replay(capsys, store, once, tmp_path / "p1")
    assert code == 0, err
    code, out, err = replay(capsys, store, twice, tmp_path / "p2", "--json")
    assert code == 0, err
    n = len(logged)
    assert json.loads(out)["log"]["repeated"] == n and json.loads(out)["log"]["records"] == n
    assert f"note: {n} lines of {twice} repeat an earlier record exactly (first: line " in err, err
    assert_same(states(tmp_path / "p1"), states(tmp_path / "p2"))
    reports = []
    for log in (once, twice):
        code, out, err = run_cli(capsys, "evaluate", store, "--log", log, "--policies", tmp_path / "p1", "--json",
                                 "--allow-unreliable", "--bootstrap", 50)
        assert code == 0, err
        reports.append({k: v for k, v in json.loads(out).items() if k not in ("log", "notes")})
    assert reports[0] == reports[1]


def test_a_log_with_more_untimed_calls_than_a_policy_remembers_says_so(capsys, tmp_path, store, logged):
    """A policy remembers its last WINDOW calls and recognises older ones by timestamp, so a
    user's calls beyond WINDOW without timestamps would be learned again if the log were
    replayed again. The run says so (which user, what to do); with timestamps it does not,
    and replaying that log again learns nothing."""
    from rmm_jax.persist.learned_calls import WINDOW
    mine = [r for r in logged if r["user_id"] == logged[0]["user_id"]]
    many = [{**mine[i % len(mine)], "call_id": f"c{i}"} for i in range(WINDOW + 8)]
    stamped = [{**r, "timestamp": 1_700_000_000 + i} for i, r in enumerate(many)]
    # a timestamp in free text is none replay can order (it was said "without a timestamp" of calls that had one)
    free = [{**r, "timestamp": f"06/03/2024 09:{i // 60 % 60:02d}:{i % 60:02d}"} for i, r in enumerate(many)]
    for records, name, warned in ((many, "untimed", True), (free, "free", True), (stamped, "stamped", False)):
        log = write(tmp_path / f"{name}.jsonl", records)
        code, _, err = replay(capsys, store, log, tmp_path / name)
        assert code == 0, err
        assert (f"user {logged[0]['user_id']!r} has more than {WINDOW} calls without a timestamp replay can order "
                "(a number of seconds or ISO 8601; free text is none)" in err) is warned, err
    code, out, err = replay(capsys, store, tmp_path / "stamped.jsonl", tmp_path / "stamped", "--json")
    assert code == 0 and json.loads(out)["log"]["calls"]["learn"] == 0, err
    for name in ("untimed", "free"):
        code, out, err = replay(capsys, store, tmp_path / f"{name}.jsonl", tmp_path / name, "--json")
        assert code == 0 and json.loads(out)["log"]["calls"]["learn"] == 8, err    # what the note warned of


def test_rerank_notes_a_request_timestamp_in_free_text_which_it_writes_as_given(tmp_path):
    """rerank echoed a request's '06/03/2024 09:00' into the log without a word, and replay,
    which cannot order free text, later learned such calls again past the window. Reading the
    requests notes them once (how many, the first line, what to give); ISO 8601 and numbers are
    not noted."""
    from rmm_jax.data.calls import read_calls
    from rmm_jax.persist.learned_calls import WINDOW

    path = tmp_path / "calls.jsonl"
    stamps = ["2024-06-03T09:00:00Z", "06/03/2024 09:01", 1_717_405_260, "Mon, 03 Jun 2024 09:02:00 GMT",
              "2024-06-03 09:03"]
    path.write_text("".join(json.dumps({"user_id": "u", "call_id": f"c{i}", "query": "q", "timestamp": t}) + "\n"
                            for i, t in enumerate(stamps)))
    notes: list[str] = []
    calls = read_calls(path, notes)
    assert [c.timestamp for c in calls] == stamps
    assert notes == [f"2 calls of {path} (first: line 2) have a timestamp that is neither ISO 8601 nor a number, "
                     f"written as given: replay cannot order it, so once a policy has learned more than the last "
                     f"{WINDOW} calls it remembers, a log replayed again learns such calls again (docs/reliability.md, "
                     '"Exactly once"); give ISO 8601 (2024-06-03T09:00:00Z) or seconds']


def test_rerank_stamps_what_it_serves_so_a_log_of_many_untimed_requests_is_learned_once(capsys, tmp_path, store):
    """A log built from rerank's served lines is recognised by timestamp past the window: the
    requests carry no timestamp, rerank stamps each with the time it served it, so replay
    does not warn of untimed calls and replaying the log again learns none of them."""
    from rmm_jax.data.store import open_store
    from rmm_jax.persist.learned_calls import WINDOW
    user = open_store(store).user("user0")
    calls = [{"call_id": f"c{i}", "user_id": "user0", "query_id": user.query_ids[i % len(user.query_ids)]}
             for i in range(WINDOW + 8)]
    code, _, err = run_cli(capsys, "rerank", store, "--calls", write(tmp_path / "requests.jsonl", calls), "--explore",
                           "--k", "8", "--m", "3", "--out", tmp_path / "served.jsonl")
    assert code == 0, err
    served = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    log = write(tmp_path / "day.jsonl", [{**s, "cited": s["selected"][:1]} for s in served])
    code, _, err = replay(capsys, store, log, tmp_path / "p")
    assert code == 0 and "without a timestamp" not in err, err
    code, out, err = replay(capsys, store, log, tmp_path / "p", "--json")
    calls = json.loads(out)["log"]["calls"]
    assert code == 0 and calls["learn"] == 0 and calls["learned_already"] + calls["older"] == WINDOW + 8, (calls, err)


def test_a_day_replayed_after_a_killed_rollback_of_it_is_learned_once(capsys, monkeypatch, tmp_path, store, logged):
    """`policies rollback` killed right after it marked itself in the header, then the user
    replays the rolled-back day to learn it again: the replay read the un-rolled-back index,
    skipped every call as learned already and wrote nothing (so nothing finished the
    rollback); the next day's run then finished it and said it continued from the forgotten
    versions: that day was learned by no policy. The run finishes the rollback before it
    decides what is learned, and ends bit for bit where day 1 then day 2 end."""
    from rmm_jax.persist import policy_rollback

    first = each_users_first(logged, 8)
    day1 = write(tmp_path / "day1.jsonl", [r for r, f in zip(logged, first) if f])
    day2 = write(tmp_path / "day2.jsonl", [r for r, f in zip(logged, first) if not f])
    for pol, days in (("ref", (day1, day2)), ("p", (day1, day2))):
        for day in days:
            code, _, err = replay(capsys, store, day, tmp_path / pol)
            assert code == 0, err

    def killed(*a, **k):
        raise KeyboardInterrupt("killed after the mark")
    with monkeypatch.context() as m:
        m.setattr(policy_rollback, "writer_index", killed)
        with pytest.raises(KeyboardInterrupt):
            policy_rollback.rollback(PolicyStore.open(tmp_path / "p"))
    assert PolicyStore.open(tmp_path / "p")._header.get(policy_rollback.PENDING)["versions"] == [3, 4]
    code, _, err = run_cli(capsys, "policies", "list", tmp_path / "p")     # a reader: it says what it shows
    assert code == 0 and f"note: a rollback of {tmp_path / 'p'} to v2 was interrupted: this shows the store as it " \
                         "was before it (v3-v4 and the calls they learned still count)" in err, err
    # every reader says so, and its --json carries it: show, export, rerank (it serves v3-v4), evaluate
    pending = f"a rollback of {tmp_path / 'p'} to v2 was interrupted"
    code, out, _ = run_cli(capsys, "policies", "list", tmp_path / "p", "--json")
    assert code == 0 and json.loads(out)["pending_rollback"].startswith(pending)
    code, out, err = run_cli(capsys, "policies", "show", tmp_path / "p", "--json")
    assert code == 0 and json.loads(out)["pending_rollback"].startswith(pending) and f"note: {pending}" in err, err
    code, _, err = run_cli(capsys, "policies", "export", tmp_path / "p", logged[0]["user_id"], "--out",
                           tmp_path / "u.npz")
    assert code == 0 and f"note: {pending}" in err, err
    req = write(tmp_path / "req.jsonl", [{"call_id": "r0", "user_id": logged[0]["user_id"],
                                           "query_id": logged[0]["query_id"]}])
    code, out, err = run_cli(capsys, "rerank", store, "--policies", tmp_path / "p", "--calls", req, "--k", "8",
                             "--m", "3", "--out", tmp_path / "served.jsonl", "--json")
    assert code == 0 and json.loads(out)["pending_rollback"].startswith(pending) and f"note: {pending}" in err, err
    code, out, err = run_cli(capsys, "evaluate", store, "--log", day2, "--policies", tmp_path / "p", "--json",
                             "--allow-unreliable")
    assert code in (0, 3) and json.loads(out)["pending_rollback"].startswith(pending), err
    assert policy_rollback.PENDING in PolicyStore.open(tmp_path / "p")._header     # readers wrote nothing
    code, out, err = replay(capsys, store, day2, tmp_path / "p", "--json")
    assert code == 0, err
    assert f"finished the interrupted rollback of {tmp_path / 'p'} to v2 first: v3-v4 forgotten" in err, err
    assert f"continued {tmp_path / 'p'}: 4 of 4 users from their saved versions v1-v2," in err, err
    assert json.loads(out)["log"]["calls"] == {"learn": len(day2.read_text().splitlines()), "learned_already": 0,
                                               "older": 0, "changed": 0, "relearn": False}
    assert policy_rollback.PENDING not in PolicyStore.open(tmp_path / "p")._header
    assert_same(states(tmp_path / "ref"), states(tmp_path / "p"))


def test_replaying_a_simulate_log_out_into_its_policies_learns_nothing_twice(capsys, monkeypatch, tmp_path, store,
                                                                           logged):
    """`simulate --queries :8 --log-out s.jsonl` then `replay --log s.jsonl` into the same
    policies learned every call a second time (learn 32, learned_already 0; `policies list`
    went from 8 learned to 16) and evaluate said nothing of it. The questions a user's simulate
    runs learned (each version's simulated_queries) count as learned calls: skipped and
    counted, relearned only with --relearn; a log with newer calls learns just those, bit for
    bit as a log of only those; evaluate's note counts them. A replay looks up each user's
    simulated questions once (its check before the run and the run itself both used them)."""
    pol = tmp_path / "p"
    code, _, err = run_cli(capsys, "simulate", store, "--policies", pol, "--queries", ":8", "--log-out",
                           tmp_path / "s.jsonl", *RUN)
    assert code == 0, err
    sim = tmp_path / "s.jsonl"
    n = len(sim.read_text().splitlines())
    assert n == 32
    code, out, err = replay(capsys, store, sim, pol, "--json")
    assert code == 0, err
    assert json.loads(out)["log"]["calls"] == {"learn": 0, "learned_already": n, "older": 0, "changed": 0,
                                               "relearn": False}, err
    assert f"skipped {n} calls learned already: {n} by these policies" in err, err
    code, out, err = run_cli(capsys, "evaluate", store, "--log", sim, "--policies", pol, "--allow-unreliable")
    assert code == 0 and f"note: the policies learned from {n} of these {n} calls" in err, err
    shutil.copytree(pol, tmp_path / "only_new")
    newer = set(map(json.dumps, logged)) - set(sim.read_text().splitlines())
    only_new = write(tmp_path / "new.jsonl", [r for r in logged if json.dumps(r) in newer])
    looked_up = []
    real_keys = starts.simulated_keys
    monkeypatch.setattr(starts, "simulated_keys", lambda q, u, info: looked_up.append(u) or real_keys(q, u, info))
    code, out, err = replay(capsys, store, write(tmp_path / "all.jsonl", logged), pol, "--json")
    monkeypatch.setattr(starts, "simulated_keys", real_keys)
    assert code == 0, err
    assert looked_up and len(looked_up) == len(set(looked_up)), looked_up
    calls = json.loads(out)["log"]["calls"]
    assert (calls["learn"], calls["learned_already"]) == (len(logged) - n, n), (calls, err)
    code, _, err = replay(capsys, store, only_new, tmp_path / "only_new")
    assert code == 0, err
    assert_same(states(tmp_path / "only_new"), states(pol))
    code, _, err = replay(capsys, store, sim, pol, "--relearn")
    assert code == 0 and f"--relearn: learning {n} calls again" in err, err
    # served calls (rerank stamps each with its time) of the same questions are new citations: learned
    served = [{**json.loads(line), "timestamp": 1.7e9 + i} for i, line in enumerate(sim.read_text().splitlines())]
    code, out, err = replay(capsys, store, write(tmp_path / "served.jsonl", served), tmp_path / "only_new", "--json")
    assert code == 0 and json.loads(out)["log"]["calls"]["learn"] == n, err


def listed(path) -> dict:
    """Every user's kept versions and queries learned (newest), as `policies list` shows them."""
    return {u: ([e.version for e in entries], sinks.queries_learned(info))
            for u, entries, info in PolicyStore.open(path).listing()}


@pytest.mark.parametrize("failure", [Killed, OSError])
def test_a_resumed_run_interrupted_between_a_chunks_save_and_its_checkpoint_saves_it_once(
        capsys, monkeypatch, tmp_path, store, logged, failure):
    """A day-2 replay whose checkpoint after chunk 1's save failed (a full disk: OSError; a
    SIGKILL at that point), then `replay --resume`: the resumed run did chunk 1 again and
    saved its users a second time (versions 1,3,4 where one run keeps 1,3; the newest
    version's queries_learned counted day 2 twice, from the row this run had saved). It ends
    with the versions, counts and params of one uninterrupted run."""
    first = each_users_first(logged, 8)
    day1 = write(tmp_path / "day1.jsonl", [r for r, f in zip(logged, first) if f])
    day2 = write(tmp_path / "day2.jsonl", [r for r, f in zip(logged, first) if not f])
    code, _, err = replay(capsys, store, day1, tmp_path / "ref", "--scope", "hybrid", "--rank", "2")
    assert code == 0, err
    shutil.copytree(tmp_path / "ref", tmp_path / "p")
    code, _, err = replay(capsys, store, day2, tmp_path / "ref")
    assert code == 0, err
    real, calls = sinks.RunStateSink.chunk, []

    def full(self, event):
        calls.append(1)
        if len(calls) == 1:
            raise failure(28, "No space left on device") if failure is OSError else failure()
        return real(self, event)
    with monkeypatch.context() as m:
        m.setattr(sinks.RunStateSink, "chunk", full)
        try:
            replay(capsys, store, day2, tmp_path / "p")
        except (Killed, OSError):
            pass
    capsys.readouterr()
    assert runstate.RunState.path_for(tmp_path / "p").exists()
    code, _, err = replay(capsys, store, day2, tmp_path / "p", "--resume")
    assert code == 0 and "resuming from" in err, err
    assert listed(tmp_path / "p") == listed(tmp_path / "ref")
    assert_same(states(tmp_path / "ref"), states(tmp_path / "p"))


def test_a_busy_refusal_after_a_killed_replay_starts_nothing_and_says_only_so(capsys, monkeypatch, tmp_path, store,
                                                                            logged):
    """A replay killed mid-run, then the same replay while another writer held the policy
    store's lock: it printed "an interrupted `replay` run of the same input left ...; starting
    it again" and the calls it would skip before its exit-75 busy line, though it started
    nothing. Now the busy line alone, and the killed run's state is left as it was; once the
    store is free, the same command starts it again and says so."""
    first = each_users_first(logged, 8)
    day1 = write(tmp_path / "day1.jsonl", [r for r, f in zip(logged, first) if f])
    day2 = write(tmp_path / "day2.jsonl", [r for r, f in zip(logged, first) if not f])
    pol = tmp_path / "p"
    assert replay(capsys, store, day1, pol)[0] == 0
    killed_run(capsys, monkeypatch, store, day2, pol, SAVED_NOT_CHECKPOINTED)
    rs = runstate.RunState.path_for(pol)
    left = {f: b for f, b in tree(rs).items() if f != ".lock"}       # the lock's record names its last holder
    with PolicyStore.open(pol).writer():              # another writer (a `policies rollback`, say) holds it
        code, out, err = replay(capsys, store, day2, pol)
    assert (code, out) == (75, "") and err == (f"error: policy store {pol} is locked by pid {os.getpid()} on host "
                                               f"{socket.gethostname()} (another writer is running; retry when it "
                                               "ends)\n"), err
    assert {f: b for f, b in tree(rs).items() if f != ".lock"} == left
    code, _, err = replay(capsys, store, day2, pol)
    assert code == 0 and err.startswith(f"an interrupted `replay` run of the same input left {rs}; starting it "
                                        "again"), err


def test_calls_skipped_only_as_older_than_the_horizon_are_not_called_learned(capsys, tmp_path, store, logged):
    """Calls a policy has not learned, skipped because their time is at or before its horizon
    (the newest call it learned and forgot): replay said `nothing to learn: these policies
    have learned from every call already`, exit 0. It says they are older than what their
    users have learned, the horizon, and that --relearn learns them."""
    from rmm_jax.persist.learned_calls import WINDOW
    mine = [r for r in logged if r["user_id"] == logged[0]["user_id"]]
    day1 = write(tmp_path / "day1.jsonl", [{**mine[i % len(mine)], "call_id": f"c{i}",
                                            "timestamp": 1_700_000_000 + 60 * i} for i in range(WINDOW + 8)])
    late = write(tmp_path / "late.jsonl", [{**mine[i], "call_id": f"late{i}", "timestamp": 1_600_000_000 + i}
                                           for i in range(5)])
    code, _, err = replay(capsys, store, day1, tmp_path / "p")
    assert code == 0, err
    code, out, err = replay(capsys, store, late, tmp_path / "p")
    assert code == 0, err
    assert "skipped 5 calls: 0 learned already by these policies, 5 older than what their users have learned (at " \
           "or before their horizon, 2023-11-14T22:20:20Z; --relearn learns them); 0 calls to learn" in err, err
    assert out.strip() == "nothing to learn: 5 calls of the log older than what their users have learned " \
                          "(--relearn learns them)", out


def test_evaluate_notes_calls_older_than_what_the_policies_learned(capsys, tmp_path, store, logged):
    """Day 6 of a 70-night run: its calls have left the window of calls the policies remember,
    and the policies learned from them (or from calls after them). evaluate's note on learned
    calls disappeared (learned 0, older 96: no note, as if the estimate did not lean
    optimistic). Now the note says so for older calls too, as replay does ('older than what
    their users have learned'), in --json's learned_calls and on stderr."""
    from rmm_jax.persist.learned_calls import WINDOW
    mine = [r for r in logged if r["user_id"] == logged[0]["user_id"]]
    day1 = write(tmp_path / "day1.jsonl", [{**mine[i % len(mine)], "call_id": f"c{i}",
                                            "timestamp": 1_700_000_000 + 60 * i} for i in range(WINDOW + 8)])
    early = write(tmp_path / "early.jsonl", [json.loads(line) for line in day1.read_text().splitlines()[:5]])
    code, _, err = replay(capsys, store, day1, tmp_path / "p")
    assert code == 0, err
    ev = ["evaluate", store, "--policies", tmp_path / "p", "--k", "8", "--m", "3", "--bootstrap", "50",
          "--allow-unreliable"]
    note = ("5 of these 5 calls are older than what the policies have learned (learned and forgotten, or followed "
            "by calls they learned from): an estimate on calls they learned from, or on calls before them, can be "
            "optimistic; evaluate on a later day's log")
    code, out, err = run_cli(capsys, *ev, "--log", early, "--json")
    assert code == 0, err
    assert json.loads(out)["learned_calls"] == {"calls": 5, "learned": 0, "older": 5, "note": note}
    assert f"note: {note}" in err.splitlines(), err


def test_every_reader_says_a_killed_replay_left_the_store_half_learned(capsys, monkeypatch, tmp_path, store, logged):
    """The night's replay killed after its first chunk of users was saved (policies.runstate
    left behind): the morning's rerank served a mix of those users' new versions and the
    others' old ones, and evaluate judged that mix, without a word. Every reader that notes a
    pending rollback now also says which run is unfinished, how many users hold versions it
    wrote and how to finish it, and its --json carries it as unfinished_run (null when none)."""
    first = each_users_first(logged, 8)
    day1 = write(tmp_path / "day1.jsonl", [r for r, f in zip(logged, first) if f])
    day2 = write(tmp_path / "day2.jsonl", [r for r, f in zip(logged, first) if not f])
    pol = tmp_path / "p"
    assert replay(capsys, store, day1, pol)[0] == 0
    code, out, _ = run_cli(capsys, "policies", "list", pol, "--json")
    assert code == 0 and json.loads(out)["unfinished_run"] is None
    killed_run(capsys, monkeypatch, store, day2, pol, SAVED_NOT_CHECKPOINTED)   # chunk 1 (2 users) saved
    rs = runstate.RunState.path_for(pol)
    note = (f"note: an interrupted `replay` left {rs}: 2 users hold versions it wrote, v3 and later; the "
            f"others those before it; resume it with `rmm-jax replay ... --policies {pol} --resume` (its options), "
            f"or remove {rs} and undo what it saved with `rmm-jax policies rollback {pol}`\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    req = write(tmp_path / "req.jsonl", [{"call_id": "r0", "user_id": logged[0]["user_id"],
                                           "query_id": logged[0]["query_id"]}])
    for args in (("policies", "list", pol, "--json"), ("policies", "show", pol, "--json"),
                 ("rerank", store, "--policies", pol, "--calls", req, "--k", "8", "--m", "3", "--out",
                  tmp_path / "served.jsonl", "--json"),
                 ("evaluate", store, "--log", day2, "--policies", pol, "--json", "--allow-unreliable"),
                 ("evaluate", store, "--log", empty, "--policies", pol, "--json")):      # a quiet day too
        code, out, err = run_cli(capsys, *args)
        assert code == 0 and err.count(note) == 1, (args, err)
        got = json.loads(out)["unfinished_run"]
        assert (got["command"], got["state"], got["users"], got["first_version"]) == ("replay", "interrupted", 2, 3)
    code, _, err = replay(capsys, store, empty, pol)          # a quiet night finishes nothing: it says so
    assert code == 0 and err.count(note) == 1, err
    code, _, err = run_cli(capsys, "policies", "export", pol, logged[0]["user_id"], "--out", tmp_path / "u.npz")
    assert code == 0 and note in err, err
    assert rs.is_dir()                                                         # readers wrote nothing
    assert replay(capsys, store, day2, pol, "--resume")[0] == 0
    code, out, err = run_cli(capsys, "policies", "list", pol, "--json")
    assert code == 0 and json.loads(out)["unfinished_run"] is None and "interrupted" not in err, err


def test_a_replay_refused_as_busy_leaves_no_run_state_and_keeps_an_interrupted_ones(capsys, monkeypatch, tmp_path,
                                                                                   store, logged):
    """A replay refused as busy (another writer holds the store: exit 75, "retry when it
    ends") had begun its run-state and written its first checkpoint before it tried the
    store's lock: POLICIES.runstate stayed, readers called it an interrupted replay and
    `policies rollback` refused the store; and one that started an earlier killed run again
    (the same log) had removed that run's checkpoints. The store's lock is now taken before the
    first checkpoint, and a run started again removes the killed run's checkpoints only at its
    own first: a busy refusal leaves no run-state, and one a killed run left as it was, with or
    without --resume."""
    first = each_users_first(logged, 8)
    day1 = write(tmp_path / "day1.jsonl", [r for r, f in zip(logged, first) if f])
    day2 = write(tmp_path / "day2.jsonl", [r for r, f in zip(logged, first) if not f])
    pol = tmp_path / "p"
    rs = runstate.RunState.path_for(pol)
    assert replay(capsys, store, day1, pol)[0] == 0
    with PolicyStore.open(pol).writer():                 # another writer of the store
        code, _, err = replay(capsys, store, day2, pol)
    assert code == 75 and "retry when it ends" in err and not rs.exists(), err
    code, out, err = run_cli(capsys, "policies", "list", pol, "--json")
    assert code == 0 and json.loads(out)["unfinished_run"] is None, err
    killed_run(capsys, monkeypatch, store, day2, pol, SAVED_NOT_CHECKPOINTED)   # chunk 1 saved, its run-state left
    left = sorted((p.relative_to(rs), p.read_bytes() if p.is_file() else None) for p in rs.rglob("*"))
    for extra in ((), ("--resume",)):
        with PolicyStore.open(pol).writer():
            code, _, err = replay(capsys, store, day2, pol, *extra)
        assert code == 75 and "retry when it ends" in err, (extra, err)
        assert sorted((p.relative_to(rs), p.read_bytes() if p.is_file() else None) for p in rs.rglob("*")
                      if p.name != runstate.LOCK_FILE) == [x for x in left if x[0].name != runstate.LOCK_FILE], extra
    code, out, err = run_cli(capsys, "policies", "list", pol, "--json")
    assert code == 0 and json.loads(out)["unfinished_run"]["state"] == "interrupted", err
    assert replay(capsys, store, day2, pol, "--resume")[0] == 0 and not rs.exists()


def test_a_reader_overlapping_a_running_replay_says_what_it_reads(capsys, monkeypatch, tmp_path, store, logged):
    """The next day's rerank overlapped the night's replay (a slow cron job between two chunk
    commits) and served a mix of yesterday's and tonight's partial versions without a word.
    While a writer holds the run-state's lock (its record names pid and command; the reader
    takes no lock), every reader says so and its --json says running; once the lock is
    released, or its holder was killed (its record left, the pid gone), it is the
    interrupted run again."""
    import subprocess
    import sys

    from rmm_jax.persist.lock import WriterLock

    first = each_users_first(logged, 8)
    day1 = write(tmp_path / "day1.jsonl", [r for r, f in zip(logged, first) if f])
    day2 = write(tmp_path / "day2.jsonl", [r for r, f in zip(logged, first) if not f])
    pol = tmp_path / "p"
    assert replay(capsys, store, day1, pol)[0] == 0
    killed_run(capsys, monkeypatch, store, day2, pol, SAVED_NOT_CHECKPOINTED)   # chunk 1 (2 users) saved
    lock = runstate.RunState.path_for(pol) / runstate.LOCK_FILE
    writer = WriterLock(lock, lambda holder: InputError("busy"), "replay")     # the night's run, still writing
    req = write(tmp_path / "req.jsonl", [{"call_id": "r0", "user_id": logged[0]["user_id"],
                                           "query_id": logged[0]["query_id"]}])
    rerank = ("rerank", store, "--policies", pol, "--calls", req, "--k", "8", "--m", "3", "--out",
              tmp_path / "served.jsonl", "--json")
    with writer.hold():
        note = (f"note: a `replay` (pid {os.getpid()}) is writing {pol}: what this reads is the versions it has "
                "written so far (2 users hold versions it wrote, v3 and later) and the others' older ones; run it "
                "again after that run ends for one consistent set\n")
        for args in (rerank, ("policies", "list", pol, "--json"), ("policies", "show", pol, "--json"),
                     ("evaluate", store, "--log", day2, "--policies", pol, "--json", "--allow-unreliable")):
            code, out, err = run_cli(capsys, *args)
            got = json.loads(out)["unfinished_run"]
            assert code == 0 and err.count(note) == 1 and "interrupted `replay`" not in err, (args, err)
            assert (got["state"], got["command"], got["pid"]) == ("running", "replay", os.getpid())
    code, out, err = run_cli(capsys, *rerank)
    assert code == 0 and json.loads(out)["unfinished_run"]["state"] == "interrupted" and "is writing" not in err
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rec = json.loads(lock.read_text())
    lock.write_text(json.dumps({**{k: v for k, v in rec.items() if k != "released"}, "pid": int(dead.stdout)}))
    code, out, err = run_cli(capsys, *rerank)                                # a SIGKILL left its record
    assert code == 0 and json.loads(out)["unfinished_run"]["state"] == "interrupted" and "is writing" not in err
