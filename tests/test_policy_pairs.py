"""Versions that stay consistent: user versions paired with the shared version they were
trained against, shared pruning that keeps what users need, the batch load a run continues
from, ``keep``, ``policies show`` reporting what loads, and warnings as one line each."""
from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import jax
import numpy as np
import pytest
from helpers import TESTS_DIR, info_of, learner_of, params_of, save_seeds, stacked, state_of

from rmm_jax.cli import policies as policies_cli
from rmm_jax.cli.main import cli, main
from rmm_jax.core import reranker
from rmm_jax.core.types import SharedState, UserState
from rmm_jax.errors import InputError
from rmm_jax.online.serve import user_params
from rmm_jax.persist import policy_restore, policy_shared
from rmm_jax.persist.policy_index import PolicyIndex
from rmm_jax.persist.policy_store import DEFAULT_KEEP, PolicyRestoreWarning, PolicyStore, Skip

ROOT = Path(__file__).resolve().parents[1]
D, RANK = 8, 2
META = {"kind": "linear", "dim": D, "hidden": None, "config": {}}
HYBRID = {**META, "scope": "hybrid", "rank": RANK}


def assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def factors_of(seed) -> UserState:
    """A hybrid user's state: low-rank factors (as ``init_lowrank`` shapes them) and a learner state."""
    rng = np.random.default_rng(seed)
    one = lambda: {"lora": {f: rng.standard_normal((D, RANK)).astype(np.float32) for f in "ab"}}  # noqa: E731
    return UserState({"m_adapter": one(), "q_adapter": one()}, None, learner_of(seed))


def save_factors(st: PolicyStore, seeds: dict[str, int], shared_version: int, **kw) -> int:
    return st.save(list(seeds), stacked([factors_of(s) for s in seeds.values()]), [info_of(s) for s in seeds.values()],
                   shared_version=shared_version, **kw)


def damage(path: Path) -> None:
    """Flip a byte in the middle of every row of every chunk under ``path`` (every user's
    checksum, and the shared part's, will not match)."""
    for rows in path.rglob("rows.bin"):
        stride = json.loads((rows.parent / "chunk.json").read_text())["row_stride"]
        data = bytearray(rows.read_bytes())
        for at in range(stride // 2, len(data), stride):
            data[at] ^= 0xFF
        rows.write_bytes(bytes(data))


def two_rounds(tmp_path) -> PolicyStore:
    """A hybrid store: shared v2 with users a, b trained against it (user v1), then shared
    v3 with a, b trained against it (user v2)."""
    st = PolicyStore.create(tmp_path / "hy", HYBRID, params_of(0))
    for r in (1, 2):
        sv = st.save_shared(SharedState(params_of(r), None), {"round": r})
        save_factors(st, {"a": 10 * r, "b": 10 * r + 1}, sv)
    return st


def gens(st, v) -> Path:
    return st.path / "gens" / f"v{v:08d}"


def shared_dir(st, v) -> Path:
    return st.path / "shared" / f"v{v:08d}"


# ----------------------------------------------------------------------------- pairs


def test_hybrid_user_loads_with_exactly_the_shared_version_it_was_trained_against(tmp_path):
    st = two_rounds(tmp_path)
    got = st.load("a")
    assert (got.version, got.shared_version, got.skipped) == (2, 3, ())
    damage(gens(st, 2))                                  # user v2 is gone: v1 loads, with shared v2 (not v3)
    fresh = PolicyStore.open(st.path)
    with pytest.warns(PolicyRestoreWarning, match=r"user 'a': restored v1, v2 is damaged \("):
        got = fresh.load("a")
    assert (got.version, got.shared_version) == (1, 2)
    assert_same(got.state, factors_of(10))
    assert_same(fresh.shared_state(got.shared_version).state.params, params_of(1))
    with pytest.warns(PolicyRestoreWarning):              # serving merges the pair, not the newest shared part
        merged = user_params(fresh, "a")
    assert_same(jax.device_get(merged), jax.device_get(reranker.merge_params(params_of(1), factors_of(10).params)))
    assert not np.array_equal(np.asarray(merged["q_adapter"]["W"]["kernel"]), params_of(2)["q_adapter"]["W"]["kernel"])


@pytest.mark.parametrize("how", ["damaged", "missing"])
def test_a_shared_version_that_does_not_load_moves_the_user_back_or_is_refused_in_one_line(tmp_path, how):
    st = two_rounds(tmp_path)

    def spoil(v):
        damage(shared_dir(st, v)) if how == "damaged" else __import__("shutil").rmtree(shared_dir(st, v))

    spoil(3)
    fresh = PolicyStore.open(st.path)
    with pytest.warns(PolicyRestoreWarning, match=rf"user 'a': restored v1, v2 needs shared v3, which is {how}"):
        got = fresh.load("a")
    assert (got.version, got.shared_version) == (1, 2) and got.skipped[0].version == 2
    assert_same(got.state, factors_of(10))
    spoil(2)
    with pytest.raises(InputError) as ei:
        PolicyStore.open(st.path).load("b")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{st.path}: no good saved version for user 'b': ")
    assert f"v2 needs shared v3, which is {how}" in msg and f"v1 needs shared v2, which is {how}" in msg
    with pytest.raises(InputError, match="v1 needs shared v2"):          # an exact version: no fallback
        PolicyStore.open(st.path).load("b", version=1)


def test_scope_user_is_not_paired(tmp_path):
    st = PolicyStore.create(tmp_path / "u", META, params_of(0))
    save_seeds(st, {"a": 1})
    damage(shared_dir(st, 1))                            # the pretrained start is not needed to load a user
    got = PolicyStore.open(st.path).load("a")
    assert got.version == 1 and got.shared_version is None and got.skipped == ()


def test_save_needs_an_existing_shared_version_in_paired_scopes(tmp_path):
    st = PolicyStore.create(tmp_path / "hy", HYBRID, params_of(0))
    with pytest.raises(InputError, match="^save: a save in scope 'hybrid' needs shared_version"):
        save_factors(st, {"a": 1}, None)
    with pytest.raises(InputError, match=r"shared version 7 does not exist \(on disk: \[1\]\)"):
        save_factors(st, {"a": 1}, 7)
    assert st.users() == [] and not (st.path / "gens").exists()


def test_pruning_never_removes_a_shared_version_a_kept_user_version_needs(tmp_path):
    """keep=1 and many shared saves; users saved in random subsets. After every save the
    shared versions on disk are exactly the newest one and those kept user versions
    reference, and every user loads with the shared part it was trained against."""
    st = PolicyStore.create(tmp_path / "hy", HYBRID, params_of(0), keep=1)
    rng = random.Random(3)
    users = [f"u{i}" for i in range(6)]
    trained_with: dict[str, tuple[int, int]] = {}         # user -> (seed, shared round)
    for r in range(1, 25):
        sv = st.save_shared(SharedState(params_of(100 + r), None), {"round": r})
        if rng.random() < 0.3:
            continue                                      # a shared save without user saves
        chosen = rng.sample(users, rng.randint(1, 3))
        save_factors(st, {u: 1000 * r + i for i, u in enumerate(chosen)}, sv)
        trained_with.update({u: (1000 * r + i, sv) for i, u in enumerate(chosen)})
        refs = {st.entries(u)[-1].shared_version for u in trained_with}
        assert set(st.shared_versions()) == refs | {sv}
    reader = PolicyStore.open(st.path)
    batch = reader.load_batch(users)
    assert batch.users == sorted(trained_with, key=users.index)
    for i, u in enumerate(batch.users):
        seed, sv = trained_with[u]
        assert batch.shared_versions[i] == sv and batch.infos[i] == info_of(seed)
        assert_same(jax.tree_util.tree_map(lambda a, i=i: a[i], batch.state), factors_of(seed))
        shared = reader.shared_state(sv)
        assert_same(shared.state.params, params_of(100 + shared.info["round"]))


@pytest.mark.parametrize("keep", [1, 3])
def test_a_killed_runs_shared_save_is_not_what_the_next_run_learns_from(tmp_path, keep):
    """An online run saves a chunk's shared part, then its users. Killed between the two in
    its first chunk, it leaves a shared version no user version references. The next run
    must start from the shared part the store was created (or pretrained) with, and pruning
    must keep that part, even at keep=1, and a new user is served it. Once users are saved,
    it is their shared version."""
    st = PolicyStore.create(tmp_path / "hy", HYBRID, params_of(0), keep=keep)
    assert st.learned_shared_version() == 1
    pre = st.save_shared(SharedState(params_of(1), None), {"source": "pretrain"})
    for seed in (2, 3):                          # two runs killed after their first shared save
        st.save_shared(SharedState(params_of(seed), None), {"source": "online"})
        again = PolicyStore.open(st.path)
        assert again.learned_shared_version() == pre
        assert_same(again.shared_state(again.learned_shared_version()).state.params, params_of(1))
        assert_same(user_params(again, "newcomer", fallback_to_shared=True), params_of(1))   # and serves
    with st.writer():                            # a writer's repair keeps it too
        pass
    assert pre in st.shared_versions()
    sv = st.save_shared(SharedState(params_of(4), None), {"source": "online"})
    save_factors(st, {"a": 5}, sv)
    st.save_shared(SharedState(params_of(6), None), {"source": "online"})   # killed again, users exist
    assert PolicyStore.open(st.path).learned_shared_version() == sv


# ----------------------------------------------------------------------------- the batch load


def test_load_batch_reads_each_chunk_once_and_falls_back_per_user(tmp_path, monkeypatch):
    st = two_rounds(tmp_path)
    save_factors(st, {f"c{i}": 500 + i for i in range(6)}, 3, chunk_size=2)    # user v3: three chunks
    damage(gens(st, 3) / "c0001")                       # c2, c3 fall back ... to nothing: they are new
    calls = []
    real = policy_restore.read_chunk
    monkeypatch.setattr(policy_restore, "read_chunk",
                        lambda snap, c, rows: calls.append((snap.name, c)) or real(snap, c, rows))
    with pytest.raises(InputError, match=r"user 'c2': v3 is damaged \(.*\) \(and 1 more users\)"):
        PolicyStore.open(st.path).load_batch(["c0", "c2", "c3"])
    calls.clear()
    checked = []
    verify = policy_shared.verify_snapshot
    monkeypatch.setattr(policy_shared, "verify_snapshot", lambda snap, c: checked.append(snap.name) or verify(snap, c))
    ids = ["c5", "a", "ghost", "c0", "b", "c1", "c4"]
    got = PolicyStore.open(st.path).load_batch(ids)
    assert sorted(calls) == sorted(set(calls)) == [("v00000002", "c0000"), ("v00000003", "c0000"),
                                                   ("v00000003", "c0002")]
    assert checked == ["v00000003"]                     # the shared version 6 users need: verified once
    assert got.users == ["c5", "a", "c0", "b", "c1", "c4"] and got.missing == ["ghost"]
    assert got.versions == [3, 2, 3, 2, 3, 3] and got.shared_versions == [3] * 6 and got.skipped == {}
    for i, u in enumerate(got.users):
        one = PolicyStore.open(st.path).load(u)
        assert_same(jax.tree_util.tree_map(lambda a, i=i: a[i], got.state), one.state)
        assert got.infos[i] == one.info
    damage(gens(st, 2))                                 # a, b: v2 damaged, v1 in another chunk
    calls.clear()
    with pytest.warns(PolicyRestoreWarning) as rec:
        got = PolicyStore.open(st.path).load_batch(["a", "b", "c0"])
    assert len(rec) == 2 and calls.count(("v00000002", "c0000")) == 1 and calls.count(("v00000001", "c0000")) == 1
    assert got.versions == [1, 1, 3] and got.shared_versions == [2, 2, 3]
    assert got.skipped == {u: (Skip(2, got.skipped[u][0].reason),) for u in ("a", "b")}
    assert_same(got.state, stacked([factors_of(10), factors_of(11), factors_of(500)]))


# ----------------------------------------------------------------------------- keep and the index


def test_keep_is_a_store_setting_changed_at_open_or_create(tmp_path):
    assert DEFAULT_KEEP == 3
    st = PolicyStore.create(tmp_path / "s", META, params_of(0), keep=2)
    header = lambda: json.loads((st.path / "policy_store.json").read_text())["keep_versions"]  # noqa: E731
    assert header() == 2 and PolicyStore.open(st.path).keep == 2
    for i in range(3):
        save_seeds(st, {"u": i})
    assert [e.version for e in st.entries("u")] == [2, 3]
    wider = PolicyStore.open(st.path, keep=4)
    assert header() == 2                                 # a reader changes nothing ...
    for i in range(3, 7):
        save_seeds(wider, {"u": i})
    assert header() == 4 and PolicyStore.open(st.path).keep == 4      # ... the writer stores it
    assert [e.version for e in wider.entries("u")] == [4, 5, 6, 7]
    save_seeds(PolicyStore.open(st.path, keep=1), {"u": 9})
    assert [e.version for e in st.entries("u")] == [8] and sorted(p.name for p in gens(st, 1).parent.iterdir()) \
        == ["v00000008"]


def test_schema1_index_is_read_as_unpaired_and_upgraded_by_the_first_writer(tmp_path):
    st = PolicyStore.create(tmp_path / "s", META, params_of(0))
    save_seeds(st, {"a": 1, "b": 2})
    save_seeds(st, {"a": 3})
    db = st.path / "index.sqlite"
    with PolicyIndex.open(db) as idx:                   # rewrite it as schema 1 wrote it
        rows = [(u, e.version, e.chunk, e.row) for u, e in idx.all_entries()]
        saves = [(s.version, s.saved_at) for s in idx.saves()]
    db.unlink()
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE kv(key TEXT PRIMARY KEY, value) WITHOUT ROWID;"
                      "CREATE TABLE versions(version INTEGER PRIMARY KEY, saved_at TEXT);"
                      "CREATE TABLE entries(user TEXT NOT NULL, version INTEGER NOT NULL, chunk INTEGER NOT NULL, "
                      "row INTEGER NOT NULL, PRIMARY KEY (user, version)) WITHOUT ROWID;"
                      "INSERT INTO kv VALUES ('schema', 1), ('next_version', 3);")
    con.executemany("INSERT INTO versions VALUES (?, ?)", saves)
    con.executemany("INSERT INTO entries VALUES (?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    before = db.read_bytes()
    reader = PolicyStore.open(st.path)
    assert [e.version for e in reader.entries("a")] == [1, 2] and reader.entries("a")[0].shared_version is None
    assert reader.load("b").info == info_of(2) and db.read_bytes() == before       # read as is
    assert save_seeds(st, {"b": 4}) == 3                # the writer upgrades it in place
    with PolicyIndex.open(db) as idx:
        assert idx._one("SELECT value FROM kv WHERE key = 'schema'") == 2
        assert [(s.version, s.users) for s in idx.saves()] == [(1, 2), (2, 1), (3, 1)]


# ----------------------------------------------------------------------------- policies show


def _cli(argv, capsys):
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_policies_show_reports_what_loads(tmp_path, capsys):
    st = two_rounds(tmp_path)
    save_factors(st, {"c": 30}, 3)
    damage(shared_dir(st, 3))                           # a, b: back to v1 with shared v2; c: refused
    code, out, err = _cli(["policies", "show", st.path, "--users", "a,b", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    fresh = PolicyStore.open(st.path)
    with pytest.warns(PolicyRestoreWarning):
        loads = fresh.load_batch(["a", "b"])
    for d, u, v, sv in zip(doc["users"], loads.users, loads.versions, loads.shared_versions):
        assert (d["user"], d["version"], d["shared_version"]) == (u, v, sv) == (u, 1, 2)
        assert [(s["version"], s["reason"]) for s in d["skipped"]] == [tuple(s) for s in loads.skipped[u]]
        assert d["skipped"][0]["reason"].startswith("needs shared v3, which is damaged")
        assert d["bytes"]["user"]["version"] == 1 and d["bytes"]["shared"]["version"] == 2
    store = doc["store"]
    assert store["keep"] == 3 and store["scope"] == "hybrid" and store["n_users"] == 3
    assert store["shared"]["loads"] == 2 and [s["version"] for s in store["shared"]["skipped"]] == [3]
    assert [(r["version"], r["newest"], r["start"], r["used_by"]) for r in store["shared"]["versions"]] == \
        [(1, True, False, []), (2, True, False, [1]), (3, True, True, [2, 3])]    # v3: the newest no online run saved
    assert [(v["version"], v["shared_version"], v["users"]) for v in store["versions"]] == [(1, 2, 2), (2, 3, 2),
                                                                                          (3, 3, 1)]
    code, out, err = _cli(["policies", "show", st.path, "a"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert "user a: v1 loads, with shared v2" in lines
    assert any(ln.startswith("  skipped v2: needs shared v3, which is damaged") for ln in lines)
    assert any(ln.startswith("shared: v2 loads; on disk: v1 (one of the newest 3), "
                             "v2 (one of the newest 3, used by user versions 1), v3 (the store's start, one of")
               for ln in lines)
    code, out, err = _cli(["policies", "show", st.path], capsys)       # the store alone: nothing to refuse
    assert code == 0 and "user versions kept: v1 (2 users, shared v2)" in out
    assert not any(ln.startswith("user ") and " loads" in ln for ln in out.splitlines())
    code, out, err = _cli(["policies", "show", st.path, "--users", "a,c"], capsys)
    assert code == 2 and out == "" and err.splitlines()[-1].startswith("error: ")
    assert "user 'c': v3 needs shared v3, which is damaged" in err.splitlines()[-1]
    code, out, err = _cli(["policies", "show", st.path, "--users", "a,,b"], capsys)
    assert code == 2 and "--users: empty user id" in err


# ----------------------------------------------------------------------------- warnings as lines


def test_policies_show_counts_every_shared_version_a_run_keeps(tmp_path, capsys):
    # A run in scope hybrid saves one shared version per users chunk, and each stays while a kept
    # user version pairs with it: 2 nights of 3 chunks keep 6 (+ the start), not one "once for all users".
    st = PolicyStore.create(tmp_path / "hy", HYBRID, params_of(0))
    for night in range(2):
        for chunk in range(3):
            sv = st.save_shared(SharedState(params_of(10 * night + chunk + 1), None), {"source": "online"})
            save_factors(st, {f"u{2 * chunk}": 100 * night + chunk, f"u{2 * chunk + 1}": 100 * night + chunk + 50}, sv)
    on_disk = st.shared_versions()
    assert len(on_disk) == 7
    total = sum(p.stat().st_size for v in on_disk for p in shared_dir(st, v).rglob("*") if p.is_file())
    code, out, err = _cli(["policies", "show", st.path, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["store"]["shared"]["bytes"] == total
    code, out, err = _cli(["policies", "show", st.path, "u0"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    size = policies_cli._size(total)
    assert f"shared bytes on disk: {size} in 7 versions (a run saves one per users chunk, kept while a kept " \
           "user version pairs with it: about 3 x users / --users-per-chunk when every run saves every user, up " \
           "to 3 x users and the start when each run saves a few)" in lines
    line = next(ln for ln in lines if ln.startswith("bytes on disk:"))
    assert "once for all users" not in line
    assert line.endswith(f"; shared {policies_cli._size(st.shared_bytes(5)['bytes'])} (v5, one of 7 shared versions "
                         f"on disk, {size} in all)")
    assert st.shared_total_bytes() == total > 6 * st.shared_bytes()["bytes"]


def many_users_rolled_back(tmp_path, n) -> PolicyStore:
    st = PolicyStore.create(tmp_path / f"many{n}", META, params_of(0))
    for r in range(2):
        st.save([f"u{i}" for i in range(n)], stacked([state_of(r)] * n), chunk_size=8)
    for c in (gens(st, 2)).iterdir():
        damage(c)
    return st


def _no_python_warning_format(err: str) -> None:
    assert "warnings.warn(" not in err and "UserWarning" not in err and "PolicyRestoreWarning" not in err
    assert ".py:" not in err and "Warning:" not in err.replace("RuntimeWarning:", "")


def test_a_rollback_for_many_users_is_one_line(tmp_path, capsys):
    st = many_users_rolled_back(tmp_path, 40)
    users = ",".join(f"u{i}" for i in range(40))
    code, out, err = _cli(["policies", "show", st.path, "--users", users, "--json"], capsys)
    assert code == 0 and len(json.loads(out)["users"]) == 40
    warn = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert warn == [f"warning: {st.path}: 40 users restored an older version (v2 is damaged (rows.bin: sha256 "
                    "mismatch)); first: 'u0'"]
    _no_python_warning_format(err)
    code, out, err = _cli(["policies", "show", st.path, "--users", "u3,u5"], capsys)   # few: a line each
    assert [ln for ln in err.splitlines() if ln.startswith("warning:")] == [
        f"warning: {st.path}: user '{u}': restored v1, v2 is damaged (rows.bin: sha256 mismatch)"
        for u in ("u3", "u5")]


def test_numpy_runtime_warnings_are_one_line_without_source(capsys):
    @cli.command("divide-by-zero")
    def divide_by_zero():
        for _ in range(3):
            np.float64(1.0) / np.zeros(1)
            with np.errstate(invalid="warn"):
                np.zeros(1) / np.zeros(1)
        click.echo("done")

    try:
        code, out, err = _cli(["divide-by-zero"], capsys)
    finally:
        cli.commands.pop("divide-by-zero")
    assert code == 0 and out == "done\n"
    assert err.splitlines() == ["warning: RuntimeWarning: divide by zero encountered in divide",
                                "warning: RuntimeWarning: invalid value encountered in divide"]


def test_warning_lines_in_a_real_process(tmp_path):
    """The same through ``python -m rmm_jax.cli.main``: stderr is the summary line and the
    progress line, nothing of Python's warning format."""
    st = many_users_rolled_back(tmp_path, 12)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(TESTS_DIR)]))}
    r = subprocess.run([sys.executable, "-m", "rmm_jax.cli.main", "policies", "show", str(st.path), "--users",
                        ",".join(f"u{i}" for i in range(12)), "--json"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.splitlines() == [f"loading 12 user(s) from {st.path} ...",
                                     f"warning: {st.path}: 12 users restored an older version (v2 is damaged "
                                     "(rows.bin: sha256 mismatch)); first: 'u0'"]
