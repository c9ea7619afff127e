"""Policies that live on: a run over a store that holds policies continues from them.

Replaying the first half of a log and then the second half gives, bit for bit, the policies
of replaying the whole log once, in every scope (users split at a batch boundary; with a
shared part, the halves split at a users chunk so that the order of updates is the same);
two simulate runs over disjoint query ranges equal one run over both; new users start from
the store's shared part; --init identity starts over; --keep bounds the versions kept; a
store trained with another optimiser is refused in one line.
"""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from conftest import make_fake_store, run_cli

from rmm_jax.data.store import open_store
from rmm_jax.persist.policy_store import PolicyStore

SIM = ["--k", "8", "--m", "3", "--lr", "0.01", "--users-per-chunk", "2", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_fake_store(tmp_path_factory.mktemp("continue") / "store", users=4, sessions=6, dim=16)


def states(path) -> dict:
    """Every user's saved state as flat arrays, and the shared part's."""
    ps = PolicyStore.open(path)
    got = ps.load_batch(ps.users())
    out = {u: [np.asarray(x[i]) for x in jax.tree.leaves(got.state)] for i, u in enumerate(got.users)}
    out["<shared>"] = [np.asarray(x) for x in jax.tree.leaves(ps.shared_state().state)]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert len(a[k]) == len(b[k]) and all(np.array_equal(x, y) for x, y in zip(a[k], b[k])), k


def write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def logged(store, tmp_path_factory):
    """A simulated log of every user (user scope), read back as records in log order."""
    tmp = tmp_path_factory.mktemp("log")
    code, _, err = run_cli_plain("simulate", store, "--policies", tmp / "p", "--log-out", tmp / "log.jsonl", *SIM)
    assert code == 0, err
    return [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]


def run_cli_plain(*args):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "rmm_jax.cli.main", *map(str, args)], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("scope", ["user", "shared", "hybrid"])
def test_replaying_half_then_half_equals_replaying_the_whole_log(capsys, tmp_path, store, logged, scope):
    users = list(dict.fromkeys(r["user_id"] for r in logged))
    if scope == "user":     # each user's first two batches, then the rest
        seen: dict = {}
        first = []
        for r in logged:
            seen[r["user_id"]] = seen.get(r["user_id"], 0) + 1
            first.append(seen[r["user_id"]] <= 8)
    else:                   # the first users chunk, then the second: the same order of updates
        first = [r["user_id"] in users[:2] for r in logged]
    write(tmp_path / "a.jsonl", [r for r, f in zip(logged, first) if f])
    write(tmp_path / "b.jsonl", [r for r, f in zip(logged, first) if not f])
    write(tmp_path / "all.jsonl", logged)
    extra = ["--scope", scope, *(["--rank", "2"] if scope == "hybrid" else [])]
    for log, pol in (("a", "halves"), ("b", "halves"), ("all", "whole")):
        code, _, err = run_cli(capsys, "replay", store, "--log", tmp_path / f"{log}.jsonl", "--policies",
                               tmp_path / pol, *SIM, *extra)
        assert code == 0, err
        # the second half says it continued the store: its users (user scope), or its shared part (new users)
        assert ("continued" in err or f"new users in {tmp_path / pol} from the store's shared version" in err) \
            == (log == "b"), err
        assert (f"created {tmp_path / pol}: a new policy store (scope {scope}" in err) == (log != "b"), err
    assert_same(states(tmp_path / "halves"), states(tmp_path / "whole"))
    # the second half did continue: starting over from identity gives other policies
    code, _, err = run_cli(capsys, "replay", store, "--log", tmp_path / "b.jsonl", "--policies", tmp_path / "halves",
                           "--init", "identity", *SIM, *extra)
    assert code == 0, err
    with pytest.raises(AssertionError):
        assert_same(states(tmp_path / "halves"), states(tmp_path / "whole"))


def test_simulating_two_query_ranges_equals_one_run(capsys, tmp_path, store):
    for rng, pol in (("0:12", "two"), ("12:", "two"), (None, "one")):
        code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / pol, *SIM,
                               *(["--queries", rng] if rng else []))
        assert code == 0, err
        continuing = [ln for ln in err.splitlines() if ln.startswith("continued")]
        created = [ln for ln in err.splitlines() if ln.startswith("created")]   # a mistyped --policies shows
        assert created == ([] if rng == "12:" else [
            f"created {tmp_path / pol}: a new policy store (scope user, linear reranker); its 4 users started "
            "from the identity reranker (the retriever's order)"]), err
        if rng == "12:":     # the second day says it continued, and from what: chunks of 2 saved v1 and v2
            assert continuing == [f"continued {tmp_path / 'two'}: 4 of 4 users from their saved versions v1-v2, "
                                  "0 new users from the store's shared version v1"], err
        else:
            assert continuing == [], err
    assert_same(states(tmp_path / "two"), states(tmp_path / "one"))
    two = PolicyStore.open(tmp_path / "two")
    assert all(len(two.entries(u)) == 2 for u in two.users())          # each user saved once per run
    # `policies list`: the queries learned from count every run, as the learner step does
    rows = {}
    for pol in ("one", "two"):
        code, out, _ = run_cli(capsys, "policies", "list", tmp_path / pol, "--json")
        rows[pol] = {r["user"]: r for r in json.loads(out)["users"]}
    for u, r in rows["two"].items():
        total = rows["one"][u]["queries_learned"]
        assert (r["queries_learned"], r["queries_last_run"]) == (total, total - 12) and total > 12, r
    code, out, _ = run_cli(capsys, "policies", "list", tmp_path / "two")
    assert "queries learned" in out.splitlines()[1] and "last run" in out.splitlines()[1]


def test_simulating_questions_learned_already_is_refused_unless_relearn(capsys, tmp_path, store):
    """Nothing learned twice: a second simulate over questions the policies learned (here 8:12
    of 0:12) once ran, learning them again. Each version records the ranges its simulate runs
    learned; an overlapping run is one line naming --queries, and writes nothing."""
    pol = tmp_path / "p"
    code, _, err = run_cli(capsys, "simulate", store, "--policies", pol, *SIM, "--queries", ":12")
    assert code == 0, err
    info = {u: PolicyStore.open(pol).load(u).info for u in PolicyStore.open(pol).users()}
    assert all(i["simulated_queries"] == [[0, 12]] for i in info.values()), info
    files = sorted((p.relative_to(pol), p.stat().st_mtime_ns) for p in pol.rglob("*") if p.is_file())
    code, out, err = run_cli(capsys, "simulate", store, "--policies", pol, *SIM, "--queries", "8:")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --queries: the policy of user 'user0' has learned 4 of its questions 8:") \
        and "(it learned 0:12); from question 12 on every user's are new: give --queries from 12 on; or " \
            "--relearn learns these again" in err, err
    # --queries left out: the whole stream; the line names the store, and still where the new questions start
    code, out, err = run_cli(capsys, "simulate", store, "--policies", pol, *SIM)
    assert code == 2 and err.startswith(f"error: --policies {pol}: the policy of user 'user0' has learned 12 of "
                                        "its questions 0:") and "give --queries from 12 on" in err, err
    assert sorted((p.relative_to(pol), p.stat().st_mtime_ns) for p in pol.rglob("*") if p.is_file()) == files
    # the rest of the questions is new: learned, and the record grows to cover every question
    code, _, err = run_cli(capsys, "simulate", store, "--policies", pol, *SIM, "--queries", "12:")
    assert code == 0, err
    ps = PolicyStore.open(pol)
    n = {u: open_store(store).query_count(u) for u in ps.users()}
    assert all(ps.load(u).info["simulated_queries"] == [[0, n[u]]] for u in ps.users())
    # --relearn learns them again and says how many; starting afresh (--init identity) is not learning twice
    code, _, err = run_cli(capsys, "simulate", store, "--policies", pol, *SIM, "--queries", "8:", "--relearn")
    again = sum(n[u] - 8 for u in n)
    assert code == 0 and f"--relearn: learned {again} questions again that these policies had learned" in err, err
    assert all(PolicyStore.open(pol).load(u).info["queries_learned"] == n[u] + n[u] - 8 for u in n)
    code, _, err = run_cli(capsys, "simulate", store, "--policies", pol, *SIM, "--queries", "8:", "--init",
                           "identity")
    assert code == 0, err
    assert all(PolicyStore.open(pol).load(u).info["simulated_queries"] == [[8, n[u]]] for u in n)


def test_new_users_start_from_the_shared_part_and_keep_bounds_versions(capsys, tmp_path, store):
    ps_path = tmp_path / "p"
    code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, "--users", "user0,user1", *SIM,
                           "--scope", "shared", "--keep", "1")
    assert code == 0, err
    shared_after_first = states(ps_path)["<shared>"]
    code, out, err = run_cli(capsys, "simulate", store, "--policies", ps_path, "--users", "user2", *SIM, "--json")
    assert code == 0, err
    assert f"started 1 new user in {ps_path} from the store's shared version v2: it holds no saved policy of " \
           "this run's users" in err, err
    assert json.loads(out)["init"] == "continue" and json.loads(out)["config"]["layout"]["scope"] == "shared"
    # user2 was new: its first queries were scored with the shared part the first run left
    code, out2, _ = run_cli(capsys, "simulate", store, "--policies", tmp_path / "fresh", "--users", "user2", *SIM,
                            "--scope", "shared", "--json")
    assert json.loads(out)["online"]["per_user"]["user2"] != json.loads(out2)["online"]["per_user"]["user2"]
    assert not all(np.array_equal(a, b) for a, b in zip(shared_after_first, states(ps_path)["<shared>"]))
    ps = PolicyStore.open(ps_path)
    assert all(len(ps.entries(u)) == 1 for u in ps.users())          # --keep 1


@pytest.mark.parametrize("scope", ["user", "shared"])
def test_new_users_started_by_init_say_where_and_whether_the_shared_part_restarts(capsys, tmp_path, store, scope):
    """New users started by --init identity in a store that holds other users: the run said
    nothing. In scope user the line says where they started (routine: -q drops it). With a
    shared part the run starts it over too (its shared part after the run is a fresh store's,
    bit for bit), which -q keeps, with how to continue it instead."""
    ps_path = tmp_path / "p"
    code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, "--users", "user0,user1", *SIM,
                           "--scope", scope)
    assert code == 0, err
    for quiet in ((), ("-q",)):
        path = tmp_path / f"copy{len(quiet)}"
        shutil.copytree(ps_path, path)
        code, _, err = run_cli(capsys, "simulate", store, "--policies", path, "--users", "user2", *SIM,
                               "--init", "identity", *quiet)
        assert code == 0, err
        line = (f"started 1 new user in {path} from the identity reranker, the retriever's order (--init identity)"
                + ("; the shared part starts there too, not from the one the store's users left: leave out --init "
                   "to continue it" if scope == "shared" else ""))
        assert (line in err.splitlines()) is (scope == "shared" or not quiet), err
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "fresh", "--users", "user2", *SIM,
                           "--scope", scope)
    assert code == 0, err
    if scope == "shared":          # what the line says: the shared part is the one a fresh store learns
        assert_same({"<shared>": states(path)["<shared>"]}, {"<shared>": states(tmp_path / "fresh")["<shared>"]})


def test_lowering_keep_says_what_it_deletes_and_that_rollback_cannot_undo_at_one(capsys, tmp_path, store):
    ps_path = tmp_path / "p"
    for relearn in ([], ["--relearn"]):            # each run after the first learns the same questions again
        code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, *SIM, *relearn)   # kept at 3
        assert code == 0 and "--keep" not in err, err
    code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, *SIM, "--keep", "3", "--relearn")
    assert code == 0 and "--keep" not in err, err                 # not lowered: nothing to say
    code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, *SIM, "--keep", "2", "--relearn")
    assert code == 0 and "note: --keep 2 lowers the 3 versions per user" in err and "rollback" not in err, err
    assert all(len(PolicyStore.open(ps_path).entries(u)) == 2 for u in PolicyStore.open(ps_path).users())
    code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, *SIM, "--keep", "1", "--relearn")
    assert code == 0 and "--keep 1 lowers the 2" in err and "`policies rollback` cannot undo this run" in err, err
    code, _, err = run_cli(capsys, "policies", "rollback", ps_path)
    assert code != 0 and err.strip().count("\n") == 0, err       # as the note said


def test_a_store_created_at_keep_one_says_each_later_run_cannot_be_rolled_back(capsys, tmp_path, store):
    """Only a lowering of --keep said so: a store created at --keep 1 replaced every user's
    version on each later run without a word, and the rollback that undid it then refused."""
    ps_path = tmp_path / "p"
    code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, *SIM, "--keep", "1")
    assert code == 0 and "rollback" not in err, err                # a new store: its users can be rolled back
    code, _, err = run_cli(capsys, "simulate", store, "--policies", ps_path, *SIM, "--relearn")
    assert code == 0 and f"note: {ps_path} keeps 1 version per user" in err and "cannot undo it" in err, err
    code, _, err = run_cli(capsys, "policies", "rollback", ps_path)
    assert code != 0 and err.strip().count("\n") == 0, err       # as the note said
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "q", *SIM, "--keep", "2")
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "q", *SIM, "--relearn")
    assert code == 0 and "keeps 1" not in err and "rollback" not in err, err


def test_a_store_trained_with_another_optimiser_is_refused_in_one_line(capsys, tmp_path, store):
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM)
    assert code == 0, err
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--preset", "paper")
    assert code == 2 and err.strip().count("\n") == 0 and "--preset: paper would change" in err, err
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *SIM, "--preset", "paper",
                           "--change-setting", "--relearn")     # asked for: saved Adam states cannot go on with SGD
    assert code == 2 and err.strip().count("\n") == 1 and "--policies" in err and "optimiser" in err, err


def test_continue_needs_a_store(capsys, tmp_path, store):
    code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "none", *SIM, "--init", "continue")
    assert code == 2 and "does not exist" in err and not (tmp_path / "none").exists(), err


def test_the_refusal_says_where_new_questions_start_and_when_users_stopped_apart():
    from rmm_jax.errors import InputError
    from rmm_jax.online.starts import check_simulated

    class Store:                        # a learned 0:8, b 0:6 and 10:12, c nothing
        def listing(self, ids):
            infos = {"a": [[0, 8]], "b": [[0, 6], [10, 12]], "c": []}
            return [(u, [], {"simulated_queries": infos[u]}) for u in ids]

    counts = {"a": 20, "b": 20, "c": 20}
    with pytest.raises(InputError) as e:
        check_simulated(Store(), counts, (4, None))
    assert "from question 12 on every user's are new" in str(e.value)             # past b's 10:12, not 8
    assert "users stopped at different questions (a at 8, b at 12): run them apart with users" in str(e.value)
    with pytest.raises(InputError) as e:
        check_simulated(Store(), {"a": 20}, (2, 6))
    assert "every question of this user in that range is learned" in str(e.value)
    assert "apart" not in str(e.value) and "from question" not in str(e.value)
    assert check_simulated(Store(), counts, (12, None)) == 0 and check_simulated(Store(), counts, (8, 10)) == 0
    assert check_simulated(Store(), counts, (0, None), relearn=True) == 8 + 8


def test_a_queries_range_only_some_users_reach_is_noted_and_counts_them(capsys, tmp_path):
    """--queries 200:260 on five LoCoMo users ran the two with that many questions and said
    'its 5 users started from the identity reranker'; an empty range named no bound."""
    import dataclasses

    from conftest import FakeEmbedder

    from rmm_jax.data import make_synthetic
    from rmm_jax.data.store import write_store

    ds = make_synthetic(users=3, sessions=6, turns=8, seed=0)
    short = dataclasses.replace(ds.users[2], queries=ds.users[2].queries[:3])      # user2 holds 3 questions
    ds = dataclasses.replace(ds, users=(*ds.users[:2], short))
    write_store(tmp_path / "st", ds, "turn", FakeEmbedder(16))
    n = min(len(u.queries) for u in ds.users[:2])
    code, _, err = run_cli(capsys, "simulate", tmp_path / "st", "--policies", tmp_path / "p", *SIM, "--queries", "3:")
    assert code == 0, err
    assert "note: 1 of 3 users hold no question in --queries 3: and were not run" in err.splitlines(), err
    assert "its 2 users started from the identity reranker" in err, err
    assert sorted(PolicyStore.open(tmp_path / "p").users()) == ["user0", "user1"]
    code, _, err = run_cli(capsys, "simulate", tmp_path / "st", "--policies", tmp_path / "q", *SIM, "--queries",
                           f"{max(len(u.queries) for u in ds.users)}:")
    most = max(len(u.queries) for u in ds.users)
    assert code == 2 and f"no user has a question in that --queries range (the users hold at most {most} " \
                         "questions, from 0)" in err, err
    assert n > 3


def test_a_second_run_creating_the_same_store_is_told_it_is_in_use(tmp_path, store):
    """Two runs on one new --policies: the second, which saw no store, got "already exists and
    is not empty; choose a new policy store path" when the first created it meanwhile (simulate
    continues an existing store: wrong advice). The store is created under the run-state lock:
    while another run holds it, or when the store appeared since, the lock's "in use by pid N"."""
    import os

    from rmm_jax.cli.common import make_setting
    from rmm_jax.cli.online import open_policies
    from rmm_jax.errors import InputError
    from rmm_jax.persist.runstate import RunState

    st = open_store(store)
    layout = make_setting("default", 8, 3, None, None, None, None, None, None, "linear").layout
    p = tmp_path / "p"
    with RunState.begin(p, "simulate", {}, resume=False):      # the other run, before its store is written
        with pytest.raises(InputError, match=rf"p\.runstate: in use by pid {os.getpid()} \(another run"):
            open_policies(p, st, layout, "identity", 0, keep=None)
    assert not p.exists()
    assert open_policies(p, st, layout, "identity", 0, keep=None).n_users() == 0    # free: created
    made = []
    # the store appeared after this run looked (its creator has released the lock, not yet retaken it)
    with pytest.raises(InputError, match=rf"p\.runstate: in use by pid {os.getpid()} \(another run"):
        RunState.create_locked(p, lambda: made.append("again"))
    assert made == []


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_a_store_left_by_a_run_killed_before_its_first_checkpoint_is_resumed_from_the_beginning(capsys, tmp_path,
                                                                                                store, command):
    """A run SIGKILLed after it created its policy store and before its first checkpoint
    leaves an empty store beside a run-state holding only its lock. `simulate --resume` was
    refused ("no checkpoint of these policies to resume ... continues them on questions they
    have not learned"), and a plain run said "continued P: 0 of 4 users from their saved
    versions". Such a store learned nothing: --resume starts from the beginning, as with no
    store, the note says the users started new, and both end as one uninterrupted run."""
    from rmm_jax.core.config import preset
    from rmm_jax.online.session import create_policies, identity_params
    from rmm_jax.persist.runstate import RunState

    st = open_store(store)
    layout = preset("default", k=8, m=3).layout
    extra = []
    if command == "replay":
        code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "src", *SIM,
                               "--log-out", tmp_path / "log.jsonl")
        assert code == 0, err
        extra = ["--log", tmp_path / "log.jsonl"]
    code, _, err = run_cli(capsys, command, store, *extra, "--policies", tmp_path / "fresh", *SIM)
    assert code == 0, err
    for how in (["--resume"], []):
        pol = tmp_path / f"killed{len(how)}"
        create_policies(pol, layout, st.dim, identity_params(st.dim, layout, 0),
                        config={"pretrained": False, "model": st.model})
        RunState.path_for(pol).mkdir()
        (RunState.path_for(pol) / ".lock").touch()
        code, _, err = run_cli(capsys, command, store, *extra, "--policies", pol, *SIM, *how)
        assert code == 0, err
        assert ("--resume: no checkpoint in" in err) == bool(how), err
        assert f"started 4 new users in {pol} from the store's shared version v1: it holds no saved user yet" in err
        assert "continued" not in err, err
        assert_same(states(tmp_path / "fresh"), states(pol))


def test_resolve_setting_takes_no_record_yet_and_a_kind_left_to_the_preset():
    from rmm_jax import preset
    from rmm_jax.core.config import setting_record
    from rmm_jax.online.setting import SettingOptions, resolve_setting
    ls = resolve_setting(None, SettingOptions("reinforce", 8, 3, lr=2e-4), set())   # AttributeError before
    assert (ls.preset, ls.recorded, ls.changes, ls.to_record) == ("reinforce", None, [], True)
    assert ls.record == setting_record("reinforce", preset("reinforce", k=8, m=3, lr=2e-4))
    assert resolve_setting(None, SettingOptions("default", 8, 3), set()).setting.layout.kind == \
        preset("default", k=8, m=3).layout.kind                                     # kind None: ValueError before


@pytest.mark.parametrize("given, explicit, where", [
    (None, "draw_tau", "explicit: must be a set of field names"),      # marked tau explicit by substring
    ({"preset": "default", "k": 8, "m": 3}, {"lr"}, "given: must be a SettingOptions"),   # AttributeError
])
def test_resolve_setting_refuses_a_str_explicit_or_a_dict_given_naming_it(given, explicit, where):
    from rmm_jax import preset
    from rmm_jax.core.config import setting_record
    from rmm_jax.errors import InputError
    from rmm_jax.online.setting import SettingOptions, resolve_setting
    given = SettingOptions("default", 8, 3, kind="linear", draw_tau=0.5) if given is None else given
    with pytest.raises(InputError) as e:
        resolve_setting(setting_record("reinforce", preset("reinforce")), given, explicit)
    assert str(e.value).startswith(where), str(e.value)
