"""The scalable policy store: SQLite index, per-chunk snapshots, format-1 stores, scopes,
the shared state with its optimiser, and bytes per user."""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import TESTS_DIR, info_of, learner_of, params_of, save_seeds, stacked, state_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from rmm_jax.core.types import LearnerState, SharedState, UserState
from rmm_jax.errors import InputError
from rmm_jax.persist import checksums
from rmm_jax.persist.atomic import write_json
from rmm_jax.persist.codec import encode_tree
from rmm_jax.persist.policy_index import IndexUnavailable, PolicyIndex
from rmm_jax.persist.policy_snapshot import dir_bytes, save_chunk, verify_snapshot
from rmm_jax.persist.policy_store import MAX_CHUNK_USERS, PolicyRestoreWarning, PolicyStore, Saved, SavedShared

ROOT = Path(__file__).resolve().parents[1]
D = 8
META = {"kind": "linear", "dim": D, "hidden": None, "config": {"embedding_model": "test"}}
PARTS = ("params", "opt_state", "learner_state")
SUBPROCESS_ENV = {**os.environ,
                  "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}


def new_store(tmp_path, name="store", meta=META, **kw) -> PolicyStore:
    return PolicyStore.create(tmp_path / name, meta, params_of(0), **kw)


def assert_same(a, b):
    """Same tree structure (incl. NamedTuple types), same dtypes, bit-identical values."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def assert_policy(pol: Saved, ref: UserState, info: dict | None = None):
    assert_same(pol.state, ref)
    if info is not None:
        assert pol.info == info


def versions(st: PolicyStore, uid: str) -> list[int]:
    return [e.version for e in st.entries(uid)]


def lookups(st: PolicyStore) -> dict:
    """Everything the index answers, per user."""
    return {u: st.entries(u) for u in st.users()}


def gens_versions(st: PolicyStore) -> set[int]:
    return {int(p.name[1:]) for p in (st.path / "gens").iterdir() if p.name.startswith("v")}


def tree_files(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- crash between snapshot and commit

def test_failure_between_snapshot_and_commit_leaves_old_index_and_is_cleaned(tmp_path, monkeypatch):
    st = new_store(tmp_path)
    save_seeds(st, {"u": 1})

    def boom(*a, **k):
        raise RuntimeError("killed before commit")

    with monkeypatch.context() as m:
        m.setattr(PolicyIndex, "commit_version", boom)
        with pytest.raises(RuntimeError, match="killed before commit"):
            save_seeds(st, {"u": 2, "new": 3})
    snap = st.path / "gens" / "v00000002"
    assert verify_snapshot(snap) is None              # complete on disk ...
    other = PolicyStore.open(st.path)
    assert versions(other, "u") == [1] and not other.has_user("new")   # ... but never committed
    assert_policy(other.load("u"), state_of(1))
    assert other.next_version() == 3                  # what a run notes as its `before`
    assert save_seeds(other, {"u": 4}) == 3  # the next writer removed it; its number is not reused
    assert_policy(other.load("u"), state_of(4))
    assert gens_versions(other) == {1, 3} and not other.has_user("new")
    assert versions(other, "u") == [1, 3]


KILL_BEFORE_COMMIT = textwrap.dedent('''
    import os, signal, sys
    from helpers import save_seeds
    from rmm_jax.persist.policy_index import PolicyIndex
    from rmm_jax.persist.policy_store import PolicyStore
    PolicyIndex.commit_version = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    save_seeds(PolicyStore.open(sys.argv[1]), {"u": 2, "new": 3})
''')


def killed_second_save(tmp_path, script: str) -> tuple[PolicyStore, dict]:
    """A store that saved user u (seed 1), and its lookups then; ``script`` saving into it again is
    SIGKILLed (a kill before or inside the save's commit)."""
    st = new_store(tmp_path)
    save_seeds(st, {"u": 1})
    before = lookups(st)
    r = subprocess.run([sys.executable, "-c", script, str(st.path)], cwd=ROOT, env=SUBPROCESS_ENV,
                       capture_output=True, timeout=120)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    return st, before


def test_sigkill_between_snapshot_and_commit(tmp_path):
    st, before = killed_second_save(tmp_path, KILL_BEFORE_COMMIT)
    assert verify_snapshot(st.path / "gens" / "v00000002") is None
    assert lookups(PolicyStore.open(st.path)) == before
    assert_policy(PolicyStore.open(st.path).load("u"), state_of(1))
    before = st.next_version()                        # a run notes it, then repairs under the lock
    assert before == 3
    with st.writer():
        pass
    assert gens_versions(st) == {1}
    assert st.next_version() == before                # the removed snapshot's number stays taken
    assert save_seeds(st, {"new": 5}) == before
    # a resumed run reads versions older than `before`: none of what it saved since
    assert st.load_batch(["u", "new"], before=before).missing == ["new"]


# Kills the process at the COMMIT of its save's index transaction, with SQLite's page cache at one
# page so the transaction has spilt into the database file: a hot rollback journal is left.
KILL_IN_COMMIT = textwrap.dedent('''
    import sys
    from helpers import die_inside_commit, save_seeds
    from rmm_jax.persist.policy_store import PolicyStore
    die_inside_commit(1)
    save_seeds(PolicyStore.open(sys.argv[1]), {f"n{i}": 3 for i in range(300)} | {"u": 2})
''')


def test_a_kill_inside_the_index_commit_is_read_as_the_last_commit_without_touching_the_store(tmp_path):
    """Killed inside its COMMIT, a save leaves a hot journal, which a read-only connection may
    not roll back. Readers then see the last committed state, from a private copy rolled back,
    and leave the store's files byte for byte; a reader held open sees the writer's repair and
    next save. Before, readers rebuilt the index from the snapshot directories, which hold the
    killed save's complete snapshot: a replay run again counted its calls as learned, and its
    writer then dropped the version, so those calls were learned twice (and a reader's view was
    never rolled back)."""
    st, before = killed_second_save(tmp_path, KILL_IN_COMMIT)
    journal = st.path / "index.sqlite-journal"
    assert journal.exists() and verify_snapshot(st.path / "gens" / "v00000002") is None   # complete, uncommitted
    files = {p.name: p.read_bytes() for p in (st.path / "index.sqlite", journal)}
    assert lookups(st) == before and st.users() == ["u"]     # a reader open (and read) before the kill
    reader = PolicyStore.open(st.path)                      # and one opened after it
    assert lookups(reader) == before and reader.users() == ["u"]
    assert_policy(reader.load("u"), state_of(1))
    assert {p.name: p.read_bytes() for p in (st.path / "index.sqlite", journal)} == files
    with st.writer():                                   # the writer rolls the journal back in place
        pass
    assert not journal.exists() and gens_versions(st) == {1}
    version = save_seeds(st, {"new": 5})
    assert reader.users() == ["new", "u"] and lookups(reader)["new"][0][0] == version   # reopened, not the copy
    assert_policy(reader.load("new"), state_of(5))


# ----------------------------------------------------------------------------- rebuild

@pytest.mark.parametrize("how", ["delete", "garbage", "truncate", "other_schema"])
def test_rebuild_after_losing_index_gives_same_lookups(tmp_path, how):
    st = new_store(tmp_path, keep=2)
    for i in range(4):
        save_seeds(st, {f"u{j}": 10 * i + j for j in range(i + 1)}, chunk_size=2)
    before = lookups(st)
    db = st.path / "index.sqlite"
    if how == "delete":
        db.unlink()
    elif how == "garbage":
        db.write_bytes(os.urandom(db.stat().st_size))
    elif how == "truncate":
        with open(db, "r+b") as f:
            f.truncate(100)
    else:
        db.unlink()
        PolicyIndex.create(db).close()
        with PolicyIndex.open(db, readonly=False) as idx:
            idx._run("UPDATE kv SET value = 99 WHERE key = 'schema'")
    reader = PolicyStore.open(st.path)                  # no lock: rebuilt in memory, file untouched
    assert lookups(reader) == before
    assert_policy(reader.load("u3"), state_of(33))
    if how != "delete":
        with pytest.raises(IndexUnavailable):
            PolicyIndex.open(db)
    with st.writer():                                   # the writer rebuilds the file
        pass
    with PolicyIndex.open(db) as idx:
        assert idx.next_version() == 5
    assert lookups(PolicyStore.open(st.path)) == before
    assert save_seeds(st, {"u0": 99}) == 5
    assert versions(st, "u0") == [4, 5]


def test_corrupt_index_during_a_save_is_rebuilt_with_the_new_version(tmp_path, monkeypatch):
    st = new_store(tmp_path)
    save_seeds(st, {"a": 1})

    def corrupt(self, *a, **k):
        raise IndexUnavailable("database disk image is malformed")

    monkeypatch.setattr(PolicyIndex, "commit_version", corrupt)
    assert save_seeds(st, {"a": 2, "b": 3}) == 2
    monkeypatch.undo()
    assert versions(st, "a") == [1, 2] and versions(st, "b") == [2]
    assert_policy(st.load("b"), state_of(3))


def test_index_corrupt_past_its_header_is_rebuilt_by_the_next_writer(tmp_path, monkeypatch):
    st = new_store(tmp_path)
    save_seeds(st, {"a": 1, "b": 2})
    save_seeds(st, {"a": 3})
    before = lookups(st)
    real = PolicyIndex.live_versions
    calls = []

    def malformed_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise IndexUnavailable("database disk image is malformed")
        return real(self)

    monkeypatch.setattr(PolicyIndex, "live_versions", malformed_once)
    with st.writer():
        pass
    assert len(calls) == 2 and lookups(st) == before and gens_versions(st) == {1, 2}


# ----------------------------------------------------------------------------- GC

def test_gc_keeps_exactly_the_referenced_versions(tmp_path):
    st = new_store(tmp_path, keep=2)
    saves = [["a", "b"], ["a"], ["a"], ["b", "c"], ["c"], ["c"]]
    for i, users in enumerate(saves):
        save_seeds(st, {u: i * 10 + k for k, u in enumerate(users)})
    # a: v2 v3; b: v1 v4; c: v5 v6 -> v1..v6 all referenced except none dropped? b keeps v1
    assert versions(st, "a") == [2, 3] and versions(st, "b") == [1, 4] and versions(st, "c") == [5, 6]
    assert gens_versions(st) == {1, 2, 3, 4, 5, 6}
    save_seeds(st, {"b": 70})                  # b drops v1; nobody else holds it
    assert gens_versions(st) == {2, 3, 4, 5, 6, 7}
    save_seeds(st, {"a": 80, "c": 81})   # a drops v2, c drops v5
    assert gens_versions(st) == {3, 4, 6, 7, 8}
    with PolicyIndex.open(st.path / "index.sqlite") as idx:
        assert idx.live_versions() == [3, 4, 6, 7, 8]
        assert idx.version_users(8) == 2 and idx.version_users(3) == 1


# ----------------------------------------------------------------------------- property: index == brute force

USERS = [f"u{i}" for i in range(6)]


@settings(max_examples=60, deadline=None)
@given(keep=hst.integers(1, 3),
       saves=hst.lists(hst.tuples(hst.sets(hst.sampled_from(USERS), min_size=1), hst.integers(1, 4),
                                  hst.integers(0, 2), hst.none() | hst.integers(1, 5)), min_size=1, max_size=12))
def test_index_answers_like_a_dict(keep, saves):
    idx = PolicyIndex.create(None)
    model: dict[str, list[tuple]] = {}
    shared_of: dict[int, int | None] = {}
    live: set[int] = set()
    records = []
    version = 0
    for users, per, gap, shared in saves:
        version += 1 + gap                               # gaps: saves that were killed before commit
        shared_of[version] = shared
        placed = [(u, j // per, j % per) for j, u in enumerate(sorted(users))]
        records += [(u, version, c, r, f"t{version}", shared) for u, c, r in placed]
        dead = idx.commit_version(version, f"t{version}", placed, keep=keep, shared_version=shared)
        for u, c, r in placed:
            model[u] = (model.get(u, []) + [(version, c, r)])[-keep:]
        referenced = {e[0] for es in model.values() for e in es}
        assert dead == sorted((live | {version}) - referenced)
        live = referenced
        assert idx.live_versions() == sorted(referenced)
        assert idx.users() == sorted(model) and idx.n_users() == len(model)
        assert idx.next_version() == version + 1
        assert idx.shared_refs() == {shared_of[v] for v in referenced} - {None}
        assert idx.saves() == [(v, f"t{v}", shared_of[v], sum(any(e[0] == v for e in es) for es in model.values()))
                               for v in sorted(referenced)]
        got = idx.entries(USERS)
        for u in USERS:
            assert [(e.version, e.chunk, e.row) for e in got[u]] == model.get(u, [])
            assert all(e.saved_at == f"t{e.version}" and e.shared_version == shared_of[e.version] for e in got[u])
            assert idx.has_user(u) == (u in model)
    with pytest.raises(ValueError, match="below next_version"):
        idx.commit_version(version, "t", [("u0", 0, 0)], keep=keep)
    rebuilt = PolicyIndex.build(None, records, keep=keep)      # a rebuild from every snapshot agrees
    assert list(rebuilt.all_entries()) == list(idx.all_entries())
    assert rebuilt.live_versions() == idx.live_versions() and rebuilt.next_version() == version + 1
    assert rebuilt.saves() == idx.saves()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=hst.integers(1, 3), saves=hst.lists(hst.sets(hst.sampled_from(USERS[:4]), min_size=1),
                                                 min_size=1, max_size=5))
def test_store_matches_brute_force_over_random_saves(tmp_path_factory, keep, saves):
    st = new_store(tmp_path_factory.mktemp("prop"), keep=keep)
    model: dict[str, list[int]] = {}
    newest: dict[str, int] = {}
    for i, users in enumerate(saves):
        us = sorted(users)
        v = st.save(us, UserState({"w": np.tile(np.arange(3, dtype=np.float32) + 10 * i, (len(us), 1))}, None, None),
                    [{"i": i}] * len(us), chunk_size=2)
        assert v == i + 1
        for u in users:
            model[u] = (model.get(u, []) + [v])[-keep:]
            newest[u] = i
    assert st.users() == sorted(model)
    assert {u: versions(st, u) for u in model} == model
    assert gens_versions(st) == {v for vs in model.values() for v in vs}
    for u, i in newest.items():
        pol = st.load(u)
        assert pol.info == {"i": i} and pol.state.params["w"].tolist() == [10 * i, 10 * i + 1, 10 * i + 2]


# ----------------------------------------------------------------------------- format-1 stores

def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_format1_store(path: Path, shared, saves: list[dict[str, int]], *, keep=3, chunk_size=16):
    """A store exactly as rmm-jax format 1 wrote it: index.json, one rows.json and one
    CHECKSUMS.json per snapshot, orbax checkpoints directly in cNNNN/. ``saves``: one
    ``{user: seed}`` per save (``state_of(seed)``, ``info_of(seed)``)."""
    path.mkdir()
    write_json(path / "policy_store.json", {"format": "rmm-jax-policy-store", "format_version": 1, "meta": META,
                                            "keep_versions": keep, "chunk_size": chunk_size, "created_at": _now()})
    snap = path / "shared" / "v00000001"
    snap.mkdir(parents=True)
    spec, leaves = encode_tree(shared)
    write_json(snap / "rows.json", {"version": 1, "saved_at": _now(),
                                    "chunks": {"c0000": {"users": [], "spec": {"params": spec}}}})
    save_chunk(snap / "c0000", {"params": leaves})
    checksums.write_checksums(snap)
    index = {"next_version": 1, "users": {}}
    for v, seeds in enumerate(saves, 1):
        states = {u: state_of(seed) for u, seed in seeds.items()}
        snap = path / "gens" / f"v{v:08d}"
        snap.mkdir(parents=True)
        uids = list(states)
        enc = {u: {p: encode_tree(getattr(states[u], p)) for p in PARTS} for u in uids}
        specs = {p: enc[uids[0]][p][0] for p in PARTS}
        chunks, info = {}, {}
        for n, lo in enumerate(range(0, len(uids), chunk_size)):
            part_uids = uids[lo:lo + chunk_size]
            save_chunk(snap / f"c{n:04d}", {p: [np.stack([enc[u][p][1][i] for u in part_uids])
                                                 for i in range(len(enc[uids[0]][p][1]))] for p in PARTS})
            chunks[f"c{n:04d}"] = {"users": part_uids, "spec": specs}
            for row, u in enumerate(part_uids):
                entries = index["users"].setdefault(u, [])
                entries.append({"version": v, "chunk": f"c{n:04d}", "row": row, "saved_at": _now()})
                del entries[:-keep]
                info[u] = info_of(seeds[u])
        write_json(snap / "rows.json", {"version": v, "saved_at": _now(), "chunks": chunks, "info": info})
        checksums.write_checksums(snap)
        index["next_version"] = v + 1
    write_json(path / "index.json", index)


def test_format1_store_loads_then_migrates_on_first_write(tmp_path):
    path = tmp_path / "old"
    saves = [{"a": 1, "b": 2, "c": 3}, {"a": 4}]
    write_format1_store(path, params_of(7), saves, keep=2, chunk_size=2)
    before = tree_files(path)
    st = PolicyStore.open(path)
    assert st.users() == ["a", "b", "c"] and versions(st, "a") == [1, 2] and st.n_users() == 3
    assert st.entries("c")[-1].chunk == 1 and st.entries("c")[-1].shared_version is None
    assert_policy(st.load("a"), state_of(4), info_of(4))
    assert_policy(st.load("a", version=1), state_of(1), info_of(1))
    assert_policy(st.load("c"), state_of(3))
    assert_same(st.shared_state().state.params, params_of(7))
    assert st.shared_state().state.opt_state is None
    assert st.load_batch(["b", "zz"]).infos == [info_of(2)] and st.user_bytes("c")["users_in_chunk"] == 1
    assert st.shared_bytes()["bytes"] == dir_bytes(path / "shared" / "v00000001" / "c0000")
    assert tree_files(path) == before                   # reading a format-1 store writes nothing
    assert save_seeds(st, {"a": 5, "d": 6}) == 3    # first write migrates
    assert not (path / "index.json").exists() and (path / "index.sqlite").exists()
    assert json.loads((path / "policy_store.json").read_text())["format_version"] == 3
    assert (path / "gens" / "v00000003" / "c0000" / "rows.bin").exists()
    st2 = PolicyStore.open(path)
    assert versions(st2, "a") == [2, 3] and versions(st2, "b") == [1]
    assert_policy(st2.load("a", version=2), state_of(4))       # old snapshot, new index
    assert_policy(st2.load("b"), state_of(2))
    assert_policy(st2.load("d"), state_of(6))
    save_seeds(st2, {"b": 8, "c": 9})
    save_seeds(st2, {"b": 10, "c": 11})
    assert gens_versions(st2) == {2, 3, 4, 5}           # v1 (format 1) collected once unreferenced


def test_format1_migration_interrupted_is_finished_by_next_writer(tmp_path):
    path = tmp_path / "old"
    write_format1_store(path, params_of(7), [{"a": 1}])
    st = PolicyStore.open(path)
    st._build_index(path / "index.sqlite").close()      # killed right after the index went into place
    assert (path / "index.json").exists()
    assert json.loads((path / "policy_store.json").read_text())["format_version"] == 1
    assert_policy(PolicyStore.open(path).load("a"), state_of(1))
    with st.writer():
        pass
    assert not (path / "index.json").exists()
    assert json.loads((path / "policy_store.json").read_text())["format_version"] == 3
    assert_policy(PolicyStore.open(path).load("a"), state_of(1))


def _format2_chunk(dest: Path, meta: dict, parts: dict) -> None:
    """One chunk exactly as rmm-jax format 2 wrote it: arrays.npz, chunk.json, CHECKSUMS.json of both."""
    dest.mkdir(parents=True)
    with open(dest / "arrays.npz", "xb") as f:
        np.savez(f, **{f"{p}.{i:06d}": np.ascontiguousarray(a) for p, ls in parts.items() for i, a in enumerate(ls)})
    write_json(dest / "chunk.json", {"format": "rmm-jax-policy-chunk", **meta,
                                     "array_bytes": (dest / "arrays.npz").stat().st_size})
    checksums.write_checksums(dest)


def write_format2_store(path: Path, shared, saves: list[dict[str, int]], *, keep=3):
    """A store as rmm-jax format 2 wrote it: index.sqlite, arrays.npz chunks (one per save)."""
    path.mkdir()
    write_json(path / "policy_store.json", {"format": "rmm-jax-policy-store", "format_version": 2, "meta": META,
                                            "keep_versions": keep, "chunk_size": None, "chunk_bytes": 8 << 20,
                                            "created_at": _now()})
    specs, leaves = zip(*(encode_tree(t) for t in (shared, None)))
    _format2_chunk(path / "shared" / "v00000001" / "c0000",
                   {"version": 1, "saved_at": _now(), "spec": dict(zip(("params", "opt_state"), specs)), "info": {}},
                   dict(zip(("params", "opt_state"), leaves)))
    with PolicyIndex.create(path / "index.sqlite") as idx:
        for v, seeds in enumerate(saves, 1):
            uids = list(seeds)
            both = stacked([state_of(seeds[u]) for u in uids])
            enc = {p: encode_tree(getattr(both, p), batch=len(uids)) for p in PARTS}
            _format2_chunk(path / "gens" / f"v{v:08d}" / "c0000",
                           {"version": v, "saved_at": _now(), "shared_version": None, "chunk": "c0000",
                            "users": uids, "info": [info_of(seeds[u]) for u in uids],
                            "spec": {p: enc[p][0] for p in PARTS}}, {p: enc[p][1] for p in PARTS})
            idx.commit_version(v, _now(), [(u, 0, r) for r, u in enumerate(uids)], keep=keep)


def test_format2_store_loads_and_its_first_writer_writes_rows(tmp_path):
    path = tmp_path / "v2store"
    write_format2_store(path, params_of(7), [{"a": 1, "b": 2}, {"a": 3}])
    before = tree_files(path)
    st = PolicyStore.open(path)
    assert_policy(st.load("a"), state_of(3), info_of(3))
    assert_policy(st.load("b"), state_of(2), info_of(2))
    back = st.load_batch(["b", "a"])
    assert back.versions == [1, 2]
    assert_same(back.state, stacked([state_of(2), state_of(3)]))
    assert_same(st.shared_state().state.params, params_of(7))
    assert st.user_bytes("b")["chunk_bytes"] == (path / "gens" / "v00000001" / "c0000" / "arrays.npz").stat().st_size
    assert tree_files(path) == before                   # reading writes nothing
    assert save_seeds(st, {"b": 4}) == 3
    assert json.loads((path / "policy_store.json").read_text())["format_version"] == 3
    assert (path / "gens" / "v00000003" / "c0000" / "rows.bin").is_file()
    st2 = PolicyStore.open(path)
    assert_policy(st2.load("b"), state_of(4))
    assert_policy(st2.load("b", version=1), state_of(2))  # the old chunk, beside the new rows
    assert st2.load_batch(["a", "b"]).learned.count.tolist() == [0, 0]   # old rows remember no learned call
    npz = path / "gens" / "v00000002" / "c0000" / "arrays.npz"
    npz.write_bytes(npz.read_bytes()[:-8])                # a damaged old chunk is still caught
    with pytest.warns(PolicyRestoreWarning, match=r"restored v1, v2 is damaged \(arrays.npz: sha256 mismatch\)"):
        assert_policy(PolicyStore.open(path).load("a"), state_of(1))


def test_newer_format_is_refused(tmp_path):
    st = new_store(tmp_path)
    header = json.loads((st.path / "policy_store.json").read_text())
    (st.path / "policy_store.json").write_text(json.dumps({**header, "format_version": 4}))
    with pytest.raises(InputError, match="format_version 4 is not supported"):
        PolicyStore.open(st.path)


# ----------------------------------------------------------------------------- scopes and meta

SHARED_META = {**META, "scope": "shared"}


def learners(n, seed=0) -> LearnerState:
    return LearnerState(baseline=np.arange(n, dtype=np.float32) / 7 + seed, step=np.arange(n, dtype=np.int32) + seed,
                        key=np.stack([np.asarray(jax.random.key_data(jax.random.PRNGKey(seed + i)))
                                      for i in range(n)]))


def test_shared_scope_empty_trees_round_trip_bit_identically(tmp_path):
    st = new_store(tmp_path, meta=SHARED_META)
    assert st.scope.name == "shared" and st.meta["scope"] == "shared"
    n = 5000                                             # tiny rows: capped at MAX_CHUNK_USERS per chunk
    uids = [f"user_{i:05d}" for i in range(n)]
    ls = learners(n, 3)
    v = st.save(uids, UserState({}, {}, ls), [{"i": i} for i in range(n)], shared_version=1)
    assert sorted(p.name for p in (st.path / "gens" / f"v{v:08d}").iterdir()) == ["c0000", "c0001"]
    assert n / 2 <= MAX_CHUNK_USERS and st.entries("user_02500")[-1].chunk == 1
    st2 = PolicyStore.open(st.path)
    for i in (0, 2499, 2500, 4999):
        pol = st2.load(uids[i])
        assert pol.state.params == {} and pol.state.opt_state == {} and pol.info == {"i": i}
        assert pol.shared_version == 1
        assert_same(pol.state.learner_state, jax.tree_util.tree_map(lambda a, i=i: a[i], ls))
    back = st2.load_batch(uids[:3])
    assert back.state.params == {} and back.state.opt_state == {} and back.shared_versions == [1, 1, 1]
    assert_same(back.state.learner_state, jax.tree_util.tree_map(lambda a: a[:3], ls))
    ub = st2.user_bytes(uids[7])
    assert ub["array_bytes"] == 4 + 4 + 8 and ub["users_in_chunk"] == 2500
    st2.save(["x"], stacked([UserState({}, None, learner_of(1))]), shared_version=1)   # None and {} alike
    pol = st2.load("x")
    assert pol.state.params == {} and pol.state.opt_state is None
    assert_same(pol.state.learner_state, learner_of(1))
    with pytest.raises(InputError, match="^save: a save in scope 'shared' needs shared_version"):
        st2.save(["x"], stacked([UserState({}, None, learner_of(1))]))


def test_bfloat16_and_scalar_leaves_round_trip(tmp_path):
    """.npy holds ml_dtypes as raw bytes and the shared state has 0-d leaves: both come back as saved."""
    st = new_store(tmp_path)
    w = (np.arange(12, dtype=np.float32) / 3).astype(jax.numpy.bfloat16).reshape(3, 4)
    ref = UserState({"w": w, "s": np.float32(2.5)}, None, learner_of(2))
    st.save(["b"], stacked([ref]))
    assert_policy(PolicyStore.open(st.path).load("b"), ref)
    st.save_shared(SharedState({"w": w}, {"count": np.int32(7)}))
    got = PolicyStore.open(st.path).shared_state()
    assert_same(got.state.params, {"w": w})
    assert_same(got.state.opt_state, {"count": np.int32(7)})


def test_chunks_are_sized_by_bytes_unless_chunk_size_is_given(tmp_path):
    st = new_store(tmp_path, chunk_bytes=64 << 10)       # 64 KiB chunks; a d=8 policy row is 1556 B
    refs = [state_of(i) for i in range(100)]
    st.save([f"u{i}" for i in range(100)], stacked(refs), [info_of(i) for i in range(100)])
    sizes = [len(json.loads((c / "chunk.json").read_text())["users"])
             for c in sorted((st.path / "gens" / "v00000001").iterdir())]
    assert sizes == [33, 34, 33]                         # 65536 // 1556 = 42 per chunk: 3 equal chunks
    st.save([f"u{i}" for i in range(7)], stacked(refs[:7]), chunk_size=3)
    sizes = [len(json.loads((c / "chunk.json").read_text())["users"])
             for c in sorted((st.path / "gens" / "v00000002").iterdir())]
    assert sizes == [3, 3, 1]
    assert_policy(st.load("u99"), refs[99])


@pytest.mark.parametrize("bad,needle", [
    ({"scope": "global"}, "meta scope must be one of ('user', 'shared', 'hybrid'), got 'global'"),
    ({"scope": "hybrid"}, "needs a rank"),
    ({"scope": "hybrid", "rank": 0}, "meta rank must be >= 1, got 0"),
    ({"scope": "hybrid", "rank": True}, "meta rank must be >= 1, got True"),
    ({"scope": "hybrid", "rank": "8"}, "meta rank must be >= 1, got '8'"),
    ({"rank": 8}, "rank is only for scope 'hybrid', not 'user'"),
    ({"scope": "shared", "rank": 8}, "rank is only for scope 'hybrid', not 'shared'"),
])
def test_meta_scope_and_rank_errors_are_one_line(tmp_path, bad, needle):
    with pytest.raises(InputError) as ei:
        PolicyStore.create(tmp_path / "s", {**META, **bad}, params_of(0))
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg and msg.startswith(str(tmp_path / "s"))
    key = "rank" if "rank" in needle else "scope"
    assert f"key '{key}'" in msg
    assert not (tmp_path / "s").exists()


def test_hybrid_meta_is_kept(tmp_path):
    st = new_store(tmp_path, meta={**META, "scope": "hybrid", "rank": 4})
    assert PolicyStore.open(st.path).meta["rank"] == 4 and st.scope.name == "hybrid"
    assert new_store(tmp_path, "plain").scope.name == "user"


# ----------------------------------------------------------------------------- shared state with optimiser

def test_shared_state_with_adam_state_and_info(tmp_path):
    st = new_store(tmp_path, meta=SHARED_META, keep=2)
    s1 = st.shared_state()
    assert isinstance(s1, SavedShared) and s1.version == 1 and s1.state.opt_state is None and s1.info == {}
    p = params_of(5)
    opt = optax.adam(1e-3)
    _, o = opt.update(params_of(6), opt.init(p), p)
    assert st.save_shared(SharedState(p, o), {"epoch": 3}) == 2
    got = PolicyStore.open(st.path).shared_state()
    assert got.version == 2 and got.info == {"epoch": 3} and got.skipped == ()
    assert_same(got.state.params, p)
    assert_same(got.state.opt_state, o)
    assert type(got.state.opt_state[0]) is type(o[0])   # ScaleByAdamState: optax keeps using it
    assert_same(opt.update(params_of(7), got.state.opt_state, got.state.params), opt.update(params_of(7), o, p))
    assert_same(st.shared_state(1).state.params, params_of(0))
    with pytest.raises(ValueError, match="read-only"):   # handed out to every caller: nobody changes it
        got.state.params["q_adapter"]["W"]["kernel"][0, 0] = 1.0
    # stored once per version, never per user
    st.save(["a", "b"], UserState({}, {}, learners(2)), shared_version=2)
    chunk = json.loads((st.path / "gens" / "v00000001" / "c0000" / "chunk.json").read_text())
    assert chunk["spec"]["params"] == chunk["spec"]["opt_state"] == {"t": "dict", "k": [], "c": []}
    assert st.user_bytes("a")["array_bytes"] == 16
    sb = st.shared_bytes()
    assert sb["version"] == 2 and sb["array_bytes"] == 3 * 2 * D * D * 4 + 4
    assert sb["bytes"] == (st.path / "shared" / "v00000002" / "c0000" / "rows.bin").stat().st_size
    st.save_shared(SharedState(params_of(8), None))
    st.save_shared(SharedState(params_of(9), None))  # keep=2: v3, v4 newest; v1 goes, v2 stays (a and b need it)
    assert st.shared_versions() == [2, 3, 4]
    with pytest.raises(InputError, match="shared info is not JSON-serialisable"):
        st.save_shared(SharedState(p, None), {"x": object()})
    with pytest.raises(InputError, match="expected a SharedState"):
        st.save_shared(p)


def test_damaged_shared_version_falls_back_with_its_optimiser_state(tmp_path):
    st = new_store(tmp_path)
    p, o = params_of(1), optax.adam(1e-3).init(params_of(1))
    st.save_shared(SharedState(p, o), {"v": 2})
    st.save_shared(SharedState(params_of(2), None), {"v": 3})
    victim = st.path / "shared" / "v00000003" / "c0000" / "rows.bin"
    victim.write_bytes(victim.read_bytes()[:-8])
    with pytest.warns(PolicyRestoreWarning, match="restored v2, v3 is damaged"):
        got = st.shared_state()
    assert got.version == 2 and got.info == {"v": 2}
    assert_same(got.state.opt_state, o)


# ----------------------------------------------------------------------------- per-chunk reads and bytes

def test_load_reads_only_its_own_chunk(tmp_path):
    st = new_store(tmp_path)
    refs = [state_of(i) for i in range(6)]
    st.save([f"u{i}" for i in range(6)], stacked(refs), [info_of(i) for i in range(6)], chunk_size=2)
    snap = st.path / "gens" / "v00000001"
    for name in ("c0000", "c0002"):                     # wreck every other chunk completely
        (snap / name / "chunk.json").write_text("{")
        (snap / name / "CHECKSUMS.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_policy(st.load("u2"), refs[2])
        assert_policy(st.load("u3"), refs[3])
    with pytest.raises(InputError, match=r"no good saved version for user 'u0': v1 is damaged \(incomplete"):
        st.load("u0")
    with pytest.raises(InputError, match="user 'u0'"):   # a batch refuses too, naming the user
        st.load_batch(["u2", "u0"])


def test_user_bytes_is_the_rows_share_of_its_chunk(tmp_path):
    st = new_store(tmp_path)
    refs = [state_of(i) for i in range(3)]
    st.save(["a", "b", "c"], stacked(refs), chunk_size=2)
    st.save(["c"], stacked(refs[2:]))
    size = (st.path / "gens" / "v00000001" / "c0000" / "rows.bin").stat().st_size
    raw = 2 * 64 * 4 * 3 + 4 + 4 + 4 + 8              # params, Adam's mu and nu, count; baseline, step, key
    ub = st.user_bytes("b")
    assert ub == {"version": 1, "chunk": "c0000", "row": 1, "users_in_chunk": 2, "chunk_bytes": size,
                  "bytes": round(size / 2), "array_bytes": raw}
    assert size == 2 * (-(-raw // 16) * 16)              # a row is its arrays, rounded up to 16 bytes
    assert st.user_bytes("c")["version"] == 2 and st.user_bytes("c", version=1)["users_in_chunk"] == 1
    assert ub["bytes"] >= ub["array_bytes"]
    with pytest.raises(InputError, match="no saved policy for user 'zed'"):
        st.user_bytes("zed")


def test_a_reader_follows_an_index_that_was_rebuilt_under_it(tmp_path):
    st = new_store(tmp_path)
    save_seeds(st, {"a": 1})
    reader = PolicyStore.open(st.path)
    assert versions(reader, "a") == [1]                  # its connection is open now
    st._build_index(st.path / "index.sqlite").close()   # a writer's rebuild: a new file in its place
    save_seeds(st, {"a": 2, "b": 3})
    assert versions(reader, "a") == [1, 2] and reader.has_user("b")
    assert_policy(reader.load("b"), state_of(3))


def test_readers_need_no_lock_and_see_committed_state(tmp_path):
    st = new_store(tmp_path)
    save_seeds(st, {"a": 1})
    with st.writer():                                   # a writer holds the lock ...
        reader = PolicyStore.open(st.path)
        assert_policy(reader.load("a"), state_of(1))   # ... readers carry on
        save_seeds(st, {"a": 2})
        assert versions(reader, "a") == [1, 2]
        assert_policy(reader.load("a"), state_of(2))


def test_an_index_busy_past_the_timeout_is_busy_exit_75(tmp_path, monkeypatch):
    """Another process holding the index's write transaction past the timeout: was a plain
    InputError (the CLI's 2, bad input); it is Busy (75: retry), naming the index."""
    import sqlite3

    from rmm_jax.errors import Busy
    from rmm_jax.persist import policy_index
    st = new_store(tmp_path)
    st.save(["u"], stacked([state_of(1)]))
    monkeypatch.setattr(policy_index, "BUSY_TIMEOUT_S", 0.2)
    other = sqlite3.connect(str(st.path / "index.sqlite"), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(Busy, match="policy index is busy for more than 0 s") as e:
            st.save(["u"], stacked([state_of(2)]))
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert e.value.exit_code == 75 and "index.sqlite" in str(e.value)
    st.save(["u"], stacked([state_of(2)]))                   # the writer gone, the retry saves
    assert versions(st, "u") == [1, 2]
