"""PolicyStore: round trips, batched layout, versions, corruption, locking, kills, CLI."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import (
    TESTS_DIR,
    assert_f32_close,
    f32_error,
    info_of,
    needs_proc_fd,
    open_fds,
    params_of,
    save_seeds,
    stacked,
    state_for,
    state_of,
)

import rmm_jax as R
from rmm_jax.cli.main import main
from rmm_jax.cli.policies import export_params
from rmm_jax.core.types import LearnerState, SharedState, UserState
from rmm_jax.errors import InputError
from rmm_jax.online.serve import Reranker
from rmm_jax.persist.codec import decode_tree
from rmm_jax.persist.policy_index import PolicyIndex
from rmm_jax.persist.policy_snapshot import read_chunk, verify_snapshot
from rmm_jax.persist.policy_store import PolicyRestoreWarning, PolicyStore, Saved

ROOT = Path(__file__).resolve().parents[1]
D = 8
# Subprocesses (writers, killed writers) import helpers too.
SUBPROCESS_ENV = {**os.environ,
                  "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}


META = {"kind": "linear", "dim": D, "hidden": None, "config": {"lr": 1e-3, "embedding_model": "test"}}


def new_store(tmp_path, name="store", **kw) -> PolicyStore:
    return PolicyStore.create(tmp_path / name, META, params_of(0), **kw)


def assert_same(a, b):
    """Same tree structure (incl. NamedTuple types), same dtypes, bit-identical values."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def assert_policy(pol: Saved, ref: UserState, info: dict | None = None):
    """A loaded policy holds exactly ``ref`` (and ``info``, by default the seed's)."""
    assert_same(pol.state.params, ref.params)
    assert_same(pol.state.opt_state, ref.opt_state)
    assert_same(pol.state.learner_state, ref.learner_state)
    if info is not None:
        assert pol.info == info


def save_one(st: PolicyStore, uid: str, state: UserState, info: dict | None = None, **kw) -> int:
    return st.save([uid], stacked([state]), [info or {}], **kw)


def versions(st: PolicyStore, uid: str) -> list[int]:
    return [e.version for e in st.entries(uid)]


def biggest_file(snap: Path) -> Path:
    files = [p for p in snap.rglob("*") if p.is_file() and p.name != "CHECKSUMS.json"]
    return max(files, key=lambda p: p.stat().st_size)


def chunk_metas(snap: Path) -> dict[str, dict]:
    """chunk.json of every chunk of a snapshot, by chunk name."""
    return {d.name: json.loads((d / "chunk.json").read_text()) for d in sorted(snap.iterdir())}


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_round_trip_bit_identical_and_optax_keeps_working(tmp_path, kind):
    meta = {**META, "kind": kind, "hidden": 16 if kind == "mlp" else None}
    PolicyStore.create(tmp_path / "s", meta, params_of(0, kind))
    st = PolicyStore.open(tmp_path / "s", expect_dim=D)
    refs = {f"u{i}": state_of(i, kind) for i in range(3)}
    st.save(list(refs), stacked(list(refs.values())), [info_of(i) for i in range(3)])
    st2 = PolicyStore.open(tmp_path / "s")
    assert st2.meta == meta and st2.users() == ["u0", "u1", "u2"]
    for i, (uid, ref) in enumerate(refs.items()):
        pol = st2.load(uid)
        assert_policy(pol, ref, info_of(i))
        assert type(pol.state.opt_state[0]) is type(ref.opt_state[0])  # ScaleByAdamState
        assert type(pol.state) is UserState and type(pol.state.learner_state) is LearnerState
        assert pol.skipped == () and pol.version == 1 and pol.shared_version is None
    # optax keeps using the restored state: same update as with the original
    opt = optax.adam(1e-3)
    g = params_of(99, kind)
    pol = st2.load("u1").state
    u_ref, s_ref = opt.update(g, refs["u1"].opt_state, refs["u1"].params)
    u_new, s_new = opt.update(g, pol.opt_state, pol.params)
    assert_same(u_ref, u_new)
    assert_same(s_ref, s_new)
    assert_same(st2.shared_state().state.params, params_of(0, kind))


def test_real_reranker_params_and_typed_key(tmp_path):
    st = new_store(tmp_path)
    params = R.init_reranker(jax.random.PRNGKey(1), D)
    opt_state = R.adam(1e-3).init(params)
    learner = R.init_learner_state(jax.random.PRNGKey(2), R.Estimator())
    assert isinstance(learner, LearnerState)
    typed = learner._replace(key=jax.random.key(5))
    save_one(st, "a", UserState(params, opt_state, learner))
    save_one(st, "t", UserState(params, None, typed))
    metas = chunk_metas(st.path / "gens" / "v00000001")
    assert {c["spec"]["learner_state"]["cls"] for c in metas.values()} == {"rmm_jax.core.types:LearnerState"}
    pol = PolicyStore.open(st.path).load("a").state
    assert_same(pol.params, params)
    assert_same(pol.opt_state, opt_state)
    assert_same(pol.learner_state, learner)
    key = PolicyStore.open(st.path).load("t").state.learner_state.key
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(typed.key))


def test_legacy_dict_learner_state_loads_as_learner_state(tmp_path):
    """Stores written before LearnerState existed hold {baseline, key, step} dicts."""
    st = new_store(tmp_path)
    ref = state_of(3)
    save_one(st, "old", ref._replace(learner_state=dict(ref.learner_state._asdict())))
    save_one(st, "new", state_of(4))
    spec = lambda v: chunk_metas(st.path / "gens" / f"v{v:08d}")["c0000"]["spec"]["learner_state"]  # noqa: E731
    assert spec(1)["t"] == "dict" and spec(1)["k"] == ["baseline", "key", "step"]
    assert spec(2)["t"] == "nt"
    pol = PolicyStore.open(st.path).load("old")
    assert type(pol.state.learner_state) is LearnerState
    assert_policy(pol, ref)
    batch = st.load_batch(["old", "new"])                 # both forms stack into one LearnerState
    assert type(batch.state.learner_state) is LearnerState and batch.versions == [1, 2]
    assert batch.state.learner_state.step.tolist() == [3, 4]
    assert_same(jax.tree_util.tree_map(lambda a: a[1], batch.state), state_of(4))


def test_users_of_different_structures_load_alone_not_stacked(tmp_path):
    st = new_store(tmp_path)
    refs = {"lin": state_of(1, "linear"), "deep": state_of(2, "mlp")}
    for uid, ref in refs.items():
        save_one(st, uid, ref)
    for uid, ref in refs.items():
        assert_policy(st.load(uid), ref)
    with pytest.raises(InputError) as ei:
        st.load_batch(["lin", "deep"])
    msg = str(ei.value)
    assert "'lin' (v1) and 'deep' (v2)" in msg and "different structures" in msg and "\n" not in msg


# ----------------------------------------------------------------------------- batched layout

def test_save_batch_then_per_user_rows(tmp_path):
    st = new_store(tmp_path)
    uids = [f"user_{i}" for i in range(5)]
    refs = [state_of(10 + i) for i in range(5)]
    both = stacked(refs)
    v = st.save(uids, both, [info_of(10 + i) for i in range(5)], chunk_size=2)
    snap = st.path / "gens" / f"v{v:08d}"
    assert sorted(p.name for p in snap.iterdir() if p.is_dir()) == ["c0000", "c0001", "c0002"]
    e = st.entries("user_3")[-1]
    assert (e.chunk, e.row) == (1, 1)
    st2 = PolicyStore.open(st.path)
    for i, (uid, ref) in enumerate(zip(uids, refs)):
        assert_policy(st2.load(uid), ref, info_of(10 + i))
    back = st2.load_batch(uids[::-1] + ["nobody"])        # any order; unknown users are listed, not loaded
    assert back.users == uids[::-1] and back.missing == ["nobody"] and back.versions == [1] * 5
    assert_same(back.state, stacked(refs[::-1]))
    assert back.infos == [info_of(10 + i) for i in range(5)][::-1] and back.skipped == {}
    assert st2.load_batch(["nobody"]).state is None
    with pytest.raises(InputError, match="leading users axis"):
        st.save(uids[:4], both)
    with pytest.raises(InputError, match="^save: state must be a UserState"):
        st.save(uids, tuple(both))


def test_versions_kept_is_n(tmp_path):
    st = new_store(tmp_path, keep=3)
    for i in range(5):
        save_seeds(st, {"u": i, "w": 100 + i} if i == 0 else {"u": i})
    assert versions(st, "u") == [3, 4, 5]
    assert versions(st, "w") == [1]           # w's only version is kept ...
    assert sorted(p.name for p in (st.path / "gens").iterdir()) == \
        ["v00000001", "v00000003", "v00000004", "v00000005"]   # ... v2 is gone
    assert_policy(st.load("u"), state_of(4))
    assert_policy(st.load("u", version=3), state_of(2))
    assert_policy(st.load("w"), state_of(100))
    with pytest.raises(InputError, match=r"user 'u' has no version 1 \(has \[3, 4, 5\]\)"):
        st.load("u", version=1)


def test_a_version_or_user_id_of_the_wrong_type_is_refused_by_name(tmp_path):
    """load("u", version="3") said "user 'u' has no version 3 (has [3])", version=True loaded
    v1, shared_state("1") was a ValueError from a format code, before="2" a TypeError from <,
    and load_batch([7]) a KeyError '7' where the store held user "7"."""
    st = new_store(tmp_path)
    save_seeds(st, {"u": 1, "7": 2})
    for call, where in ((lambda v: st.load("u", version=v), "version"), (lambda v: st.shared_state(v), "version"),
                        (lambda v: st.user_bytes("u", v), "version"), (lambda v: st.shared_bytes(v), "version"),
                        (lambda v: st.load_batch(["u"], before=v), "before")):
        for v in ("1", 1.0, True, 0, -1):
            with pytest.raises(InputError, match=rf"^{where}: must be a positive int \(a version number\), got "):
                call(v)
    assert st.load("u", version=np.int64(1)).version == 1 and st.shared_state(np.int32(1)).version == 1
    for ids in ([7], ["u", None], [["u"]]):
        with pytest.raises(InputError, match=r"^users: user ids are str, got "):
            st.load_batch(ids)
    assert st.load_batch(["7", "v"]).missing == ["v"]


def test_loading_before_a_version_starts_users_first_saved_since_afresh(tmp_path):
    """A resumed run loads every user as it was when the run began (versions before v2 here):
    a user first saved since was new then (missing, not an error); one whose older versions
    were all pruned since is an error."""
    st = new_store(tmp_path, keep=2)
    save_seeds(st, {"u": 1})                   # v1, before the run
    save_seeds(st, {"u": 2})                   # v2, v3: the run (u saved twice: killed and resumed)
    save_seeds(st, {"u": 4, "w": 5})
    got = st.load_batch(["w"], before=2)
    assert got.users == [] and got.missing == ["w"]
    with pytest.raises(InputError, match=r"user 'u' keeps no version older than v2 \(has \[2, 3\]; pruned"):
        st.load_batch(["u"], before=2)


def test_index_rebuilt_when_corrupt(tmp_path):
    st = new_store(tmp_path)
    save_seeds(st, {"u": 1})
    save_seeds(st, {"u": 2})
    (st.path / "index.sqlite").write_bytes(b"{ broken" * 100)
    assert versions(st, "u") == [1, 2]
    assert_policy(st.load("u"), state_of(2))
    assert save_seeds(st, {"u": 3}) == 3
    assert PolicyIndex.open(st.path / "index.sqlite").entries(["u"])["u"][-1].version == 3


# ----------------------------------------------------------------------------- corruption

def _corrupt(path: Path, how: str):
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif how == "flip":
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            b = f.read(4)
            f.seek(path.stat().st_size // 2)
            f.write(bytes(x ^ 0xFF for x in b))
    elif how == "drop_checksums":
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "flip", "drop_checksums"])
def test_corrupt_newest_version_falls_back_and_reports(tmp_path, how):
    st = new_store(tmp_path)
    for i in range(3):
        save_seeds(st, {"u": i})
    snap = st.path / "gens" / "v00000003"
    target = snap / "c0000" / "CHECKSUMS.json" if how == "drop_checksums" else biggest_file(snap)
    _corrupt(target, how)
    assert verify_snapshot(snap, "c0000") is not None
    st2 = PolicyStore.open(st.path)
    with pytest.warns(PolicyRestoreWarning, match=r"store: user 'u': restored v2, v3 is damaged \(") as rec:
        pol = st2.load("u")
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    assert pol.version == 2
    assert_policy(pol, state_of(1), info_of(1))
    assert [s.version for s in pol.skipped] == [3] and pol.skipped[0].reason.startswith("is damaged (")


def test_a_damaged_row_costs_only_its_user_its_version(tmp_path):
    st = new_store(tmp_path)
    uids = [f"u{i}" for i in range(4)]
    st.save(uids, stacked([state_of(i) for i in range(4)]), [info_of(i) for i in range(4)])
    st.save(uids, stacked([state_of(10 + i) for i in range(4)]), [info_of(10 + i) for i in range(4)])
    chunk = st.path / "gens" / "v00000002" / "c0000"
    stride = json.loads((chunk / "chunk.json").read_text())["row_stride"]
    with open(chunk / "rows.bin", "r+b") as f:          # one bit of u2's row, after its chunk was verified
        f.seek(2 * stride + stride // 3)
        b = f.read(1)
        f.seek(2 * stride + stride // 3)
        f.write(bytes([b[0] ^ 1]))
    assert verify_snapshot(chunk.parent, "c0000") == "rows.bin: sha256 mismatch"
    reader = PolicyStore.open(st.path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # the other users of the chunk load quietly
        for i in (0, 1, 3):
            assert_policy(reader.load(f"u{i}"), state_of(10 + i), info_of(10 + i))
    with pytest.warns(PolicyRestoreWarning, match=r"user 'u2': restored v1, v2 is damaged \(rows.bin: sha256"):
        assert_policy(reader.load("u2"), state_of(2), info_of(2))
    with pytest.warns(PolicyRestoreWarning):
        back = reader.load_batch(uids)
    assert back.versions == [2, 2, 1, 2] and list(back.skipped) == ["u2"]
    assert_same(back.state, stacked([state_of(10), state_of(11), state_of(2), state_of(13)]))


def test_corrupt_small_files_and_all_bad(tmp_path):
    st = new_store(tmp_path)
    for i in range(2):
        save_seeds(st, {"u": i})
    _corrupt(st.path / "gens" / "v00000002" / "c0000" / "chunk.json", "flip")
    with pytest.warns(PolicyRestoreWarning):
        assert st.load("u").version == 1
    _corrupt(biggest_file(st.path / "gens" / "v00000001"), "truncate")
    with pytest.raises(InputError) as ei:
        st.load("u")
    msg = str(ei.value)
    assert "'u'" in msg and str(st.path) in msg and "v2" in msg and "v1" in msg and "\n" not in msg


def test_shared_params_versions_and_corruption(tmp_path):
    st = new_store(tmp_path)
    assert st.save_shared(SharedState(params_of(7), None)) == 2
    assert_same(st.shared_state().state.params, params_of(7))
    _corrupt(biggest_file(st.path / "shared" / "v00000002"), "flip")
    st = PolicyStore.open(st.path)                     # a fresh reader (an object caches what it verified)
    with pytest.warns(PolicyRestoreWarning, match=r"store: shared: restored v1, v2 is damaged"):
        got = st.shared_state()
    assert_same(got.state.params, params_of(0))
    assert got.version == 1 and [s.version for s in got.skipped] == [2]
    with pytest.raises(InputError, match=r"store: shared version 2 is damaged \("):
        st.shared_state(2)


def test_a_shared_part_of_no_arrays_saves_verifies_and_pairs(tmp_path):
    """A hybrid store created with empty shared params ({}: rows of 0 bytes) loads its users:
    verifying the shared version reads no bytes and checks the digest of nothing (it used to
    fail on a zero-length read buffer)."""
    st = PolicyStore.create(tmp_path / "store", {**META, "scope": "hybrid", "rank": 2}, {})
    assert st.shared_state().state.params == {}
    save_one(st, "u", state_for(3, "hybrid"), shared_version=1)
    assert_policy(PolicyStore.open(st.path).load("u"), state_for(3, "hybrid"))
    assert verify_snapshot(st.path / "shared" / "v00000001", "c0000") is None


# ----------------------------------------------------------------------------- open / create errors

def test_open_errors_name_path_and_mismatch(tmp_path):
    st = new_store(tmp_path)
    with pytest.raises(InputError, match=r"store: policy store has dim 8, expected 384"):
        PolicyStore.open(st.path, expect_dim=384)
    with pytest.raises(InputError, match="no such policy store"):
        PolicyStore.open(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    with pytest.raises(InputError, match=r"plain: not a policy store"):
        PolicyStore.open(tmp_path / "plain")
    with pytest.raises(InputError, match="already exists"):
        new_store(tmp_path)
    with pytest.raises(InputError, match="kind"):
        PolicyStore.create(tmp_path / "x", {**META, "kind": "cnn"}, params_of(0))
    with pytest.raises(InputError, match="no saved policy for user 'ghost'"):
        st.load("ghost")
    with pytest.raises(InputError, match="keep must be a positive int"):
        PolicyStore.open(st.path, keep=0)


def test_a_path_that_is_not_a_path_is_refused_naming_it(tmp_path):
    """PolicyStore.open(None) (and PolicyStore(None), PolicyStore.create(None, ...)) was
    Path's TypeError ("expected str, bytes or os.PathLike object, not NoneType")."""
    for call in (PolicyStore.open, PolicyStore, lambda p: PolicyStore.create(p, META, params_of(0))):
        for wrong in (None, 3, [str(tmp_path)]):
            with pytest.raises(InputError, match=r"^path: expected the store's directory \(a str or Path\), got "):
                call(wrong)
    assert list(tmp_path.iterdir()) == []


def test_params_of_another_kind_or_hidden_width_than_the_meta_are_refused_before_anything_is_written(tmp_path):
    """PolicyStore.create took linear params in an `mlp` store (and the reverse), found
    only when serving; an `mlp` store of hidden 16 took params of hidden 4."""
    import jax

    import rmm_jax as rj
    from rmm_jax.persist.policy_meta import PolicyMeta
    linear, mlp4 = rj.init_reranker(jax.random.key(0), 8), rj.init_reranker(jax.random.key(0), 8, "mlp", 4)
    for meta, params, msg in ((PolicyMeta("mlp", 8, hidden=16), linear, "are of the linear kind .*meta kind is mlp"),
                              (PolicyMeta("linear", 8), mlp4, "are of the mlp kind .*meta kind is linear"),
                              (PolicyMeta("mlp", 8, hidden=16), mlp4, r"have hidden width 4 .*meta hidden is 16")):
        with pytest.raises(InputError, match=rf"^shared_params: params {msg}$"):
            PolicyStore.create(tmp_path / "x", meta, params)
    assert list(tmp_path.iterdir()) == []
    st = PolicyStore.create(tmp_path / "ok", PolicyMeta("mlp", 8, hidden=4), mlp4)
    with pytest.raises(InputError, match=r"^state: params are of the linear kind"):
        st.save_shared(SharedState(linear, None))


def test_params_of_another_embedding_size_are_refused_before_anything_is_written(tmp_path):
    """create, save and save_shared took params of another dim than the store's meta dim
    (a dim-16 policy in a dim-384 store), found only when serving ("q: dimension 384 does
    not match the reranker's 16"); create took shared params None, and serving failed
    deep inside. Each is now one line naming the argument, and nothing is written."""
    for kind in ("linear", "mlp"):
        meta = {**META, "kind": kind, "dim": 16, "hidden": 16}
        with pytest.raises(InputError, match=r"^shared_params: params are for embedding size 8 \(.*\), "
                                             r"the store's meta dim is 16$"):
            PolicyStore.create(tmp_path / "x", meta, params_of(0, kind))
    for wrong in (None, np.zeros(8), [params_of(0)]):
        with pytest.raises(InputError, match=r"^shared_params: expected a reranker's params \(init_reranker\), got "):
            PolicyStore.create(tmp_path / "x", META, wrong)
    assert list(tmp_path.iterdir()) == []
    st = new_store(tmp_path)
    save_seeds(st, {"u": 1})
    before = sorted(p.relative_to(st.path) for p in st.path.rglob("*"))
    small = stacked([state_of(2, d=4)])
    lowrank = UserState({"q_adapter": {"lora": {"a": np.zeros((1, 4, 2)), "b": np.zeros((1, 4, 2))}}}, {}, {})
    for state in (small, lowrank):
        with pytest.raises(InputError, match=r"^state: params are for embedding size 4 \(._adapter/.* has shape "
                                             r"\(1, 4, .\)\), the store's meta dim is 8$"):
            st.save(["x"], state)
    with pytest.raises(InputError, match=r"^state: params are for embedding size 4 .* meta dim is 8$"):
        st.save_shared(SharedState(params_of(0, d=4), None))
    assert sorted(p.relative_to(st.path) for p in st.path.rglob("*") if p.name != ".lock") == \
        [p for p in before if p.name != ".lock"]
    assert st.users() == ["u"] and st.shared_versions() == [1]
    st.save(["empty"], UserState({}, {}, {}))         # what is there is checked: nothing is there


def test_a_save_holds_what_the_stores_scope_keeps_per_user(tmp_path):
    """A whole reranker saved in a hybrid store was stored and served as the shared part alone
    (the merge keeps the shared kernel; scores [0.354 0.354 0.354 0.354] where the user's own
    gave [0.308 0.260 0.921 0.543]), and low-rank factors saved in a user store failed at every
    load. A save holds what its scope keeps per user, or is refused naming ``state`` with
    nothing written; factors of another rank than a hybrid store's too."""
    stores = {scope: PolicyStore.create(tmp_path / scope, {**META, **({"scope": scope} if scope != "user" else {}),
                                                          **({"rank": 2} if scope == "hybrid" else {})},
                                        params_of(0))
              for scope in ("user", "shared", "hybrid")}
    wrong = {"user": [("hybrid", r"scope 'user' keeps no low-rank factors \(m_adapter/lora/a\)")],
             "shared": [("user", r"scope 'shared' keeps no params per user \(the shared part is save_shared's\), "
                                 r"not a reranker's own params \(m_adapter/W/kernel\)"),
                        ("hybrid", r"scope 'shared' keeps no low-rank factors")],
             "hybrid": [("user", r"scope 'hybrid' keeps each user's low-rank factors \(rmm_jax.init_lowrank\), not a "
                                 r"reranker's own params \(m_adapter/W/kernel\)")]}
    for scope, st in stores.items():
        before = sorted(p.relative_to(st.path) for p in st.path.rglob("*") if p.name != ".lock")
        for other, msg in wrong[scope]:
            with pytest.raises(InputError, match=rf"^state: {msg}"):
                st.save(["x"], stacked([state_for(1, other)]), shared_version=1 if st.paired else None)
        if scope == "hybrid":
            with pytest.raises(InputError, match=r"^state: low-rank factors of rank 3 \(m_adapter/lora/a has shape "
                                                 r"\(1, 8, 3\)\), the store's rank is 2$"):
                st.save(["x"], stacked([state_for(1, "hybrid", rank=3)]), shared_version=1)
        assert sorted(p.relative_to(st.path) for p in st.path.rglob("*") if p.name != ".lock") == before
        v = st.save(["x"], stacked([state_for(1, scope)]), shared_version=1 if st.paired else None)
        assert_policy(PolicyStore.open(st.path).load("x", version=v), state_for(1, scope))


def test_load_wait_and_a_deleted_directory_are_named(tmp_path):
    """load(0) said "users: user ids are str" (load_batch's argument); writer(wait="1") was a
    TypeError from a comparison and wait=-1 was taken; a store whose directory was deleted
    after opening answered "no saved policy for user 'u' (known users: 0)" and users() == []."""
    st = new_store(tmp_path)
    save_seeds(st, {"u": 1})
    with pytest.raises(InputError, match=r"^user_id: user ids are str, got int 0$"):
        st.load(0)
    for wrong in ("1", -1, None, float("nan")):
        with pytest.raises(InputError, match=r"^wait: must be a number of seconds >= 0, got "):
            with st.writer(wait=wrong):
                pass
    with st.writer(wait=0.5):
        pass
    gone = PolicyStore.open(st.path)
    shutil.rmtree(st.path)
    for call in (lambda: gone.load("u"), gone.users, lambda: gone.load_batch(["u"]), st.users):
        with pytest.raises(InputError, match=r"store: the policy store's directory is gone \(deleted or moved since "
                                             r"it was opened\)$"):
            call()


# ----------------------------------------------------------------------------- lock

WRITER_SRC = textwrap.dedent('''
    import sys
    import numpy as np
    from rmm_jax.errors import InputError
    from rmm_jax.core.types import UserState
    from rmm_jax.persist.policy_store import PolicyStore
    try:
        PolicyStore.open(sys.argv[1]).save(["sub"], UserState({"w": np.arange(4.0)[None]}, None, None), [{"n": 5}])
    except InputError as e:
        print(e); sys.exit(3)
    print("saved")
''')


def _run_writer(path):
    return subprocess.run([sys.executable, "-c", WRITER_SRC, str(path)], capture_output=True, text=True,
                          cwd=ROOT, env=SUBPROCESS_ENV, timeout=60)


@needs_proc_fd
def test_close_releases_the_store_and_a_dropped_store_needs_no_garbage_collector(tmp_path):
    # A PolicyStore had no close() and a cycle (store -> its WriterLock -> the bound _locked_error): each store a
    # long-lived Reranker replaced kept its SQLite descriptor and memory until the cyclic collector ran.
    import gc
    import weakref

    save_seeds(new_store(tmp_path), {"a": 1})
    gc.collect()
    gc.disable()
    try:
        before = open_fds()
        st = PolicyStore.open(tmp_path / "store")
        assert st.users() == ["a"] and open_fds() > before
        st.close()
        st.close()                                        # idempotent
        assert open_fds() == before
        assert st.load("a").version == 1                  # still usable: the index is opened again
        st.close()
        assert open_fds() == before
        dropped = PolicyStore.open(tmp_path / "store")
        assert dropped.newest_version() == 1 and open_fds() > before   # it has read: its index connection is open
        gone = weakref.ref(dropped)
        del dropped
        assert gone() is None                             # freed when dropped: no cycle holds it
        assert open_fds() == before                            # and so is its connection (sqlite3's own cycle aside)
    finally:
        gc.enable()


@needs_proc_fd
def test_stores_that_read_and_are_dropped_leave_no_descriptors_without_the_garbage_collector(tmp_path):
    # An sqlite3.Connection is in a reference cycle with its statement cache (Python 3.11): a dropped store that
    # had read kept its index.sqlite descriptor until the cyclic collector ran, one per store, per thread.
    import gc

    save_seeds(new_store(tmp_path), {"a": 1})
    path = tmp_path / "store"
    gc.collect()
    gc.disable()
    try:
        PolicyStore.open(path).newest_version()           # warm up whatever imports/caches open once
        before = open_fds()
        for _ in range(20):
            assert PolicyStore.open(path).newest_version() == 1
        for _ in range(20):
            assert PolicyStore.open(path).load("a").version == 1
        for _ in range(5):
            with PolicyStore.open(path).writer():
                pass
        assert open_fds() == before
    finally:
        gc.enable()


@needs_proc_fd
def test_close_closes_the_index_connections_other_threads_opened(tmp_path):
    # close() closed only the calling thread's connection; the other threads' stayed open until collected.
    import threading

    save_seeds(new_store(tmp_path), {"a": 1})
    st = PolicyStore.open(tmp_path / "store")
    before = open_fds()
    go, done = threading.Event(), []

    def reader():
        done.append(st.newest_version())
        go.wait(10)                                       # alive (its connection held) while the main thread closes
        done.append(st.load("a").version)                 # still usable afterwards: opened again
    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    while len(done) < 3:
        time.sleep(0.01)
    assert open_fds() == before + 3
    st.close()
    assert open_fds() == before - 1                        # every thread's connection and the directory's descriptor
    go.set()
    for t in threads:
        t.join()
    assert done == [1, 1, 1, 1, 1, 1]
    st.close()
    assert open_fds() == before - 1


def test_replaced_tells_a_store_deleted_and_made_again(tmp_path):
    # "delete the directory to start afresh": the new directory may get the deleted one's inode number; a store
    # holds its directory open, so it cannot while the store is open
    st = new_store(tmp_path)
    assert st.replaced() is False
    shutil.rmtree(st.path)
    assert st.replaced() is True
    new_store(tmp_path)
    assert st.replaced() is True and PolicyStore.open(st.path).replaced() is False


def test_second_writer_gets_lock_error_then_succeeds(tmp_path):
    st = new_store(tmp_path)
    with st.writer():
        save_seeds(st, {"u": 1})                   # re-entrant inside the writer
        r = _run_writer(st.path)
        assert r.returncode == 3, r.stderr
        line = r.stdout.strip()
        assert line == (f"policy store {st.path} is locked by pid {os.getpid()} on host "
                        f"{os.uname().nodename} (another writer is running; retry when it ends)")
        other = PolicyStore.open(st.path)           # same process, other handle: also locked out
        with pytest.raises(InputError, match="is locked by pid"):
            other.save_shared(SharedState(params_of(1), None))
    r = _run_writer(st.path)
    assert r.returncode == 0 and r.stdout.strip() == "saved", r.stderr
    sub = st.load("sub")
    assert_same(sub.state.params, {"w": np.arange(4.0)})
    assert sub.state.opt_state is None and sub.info == {"n": 5}


HOLD_SRC = textwrap.dedent('''
    import sys, time
    from rmm_jax.persist.policy_store import PolicyStore
    with PolicyStore.open(sys.argv[1]).writer():
        print("held", flush=True)
        time.sleep(120)
''')


def test_a_lock_record_whose_pid_is_another_process_now_is_no_running_writer(tmp_path):
    """A lock record without "released" (a SIGKILLed writer's; every store last written before
    that mark) whose pid the system has given to an unrelated live process made every reader
    say "a writer (pid N) is writing" and unfinished_run "running": live_holder trusted the
    pid. Whether the lock is held now decides: a live unrelated pid holding no lock is no
    writer; a live process holding the lock is. A reader's probe (flock has no query: a
    shared lock dropped at once) never makes a writer fail: writers retry for GRACE seconds."""
    import threading

    from rmm_jax.persist import lock as lock_mod
    from rmm_jax.persist.policy_rollback import unfinished_run

    st = new_store(tmp_path)
    lock = st.path / ".lock"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])     # got the old writer's pid
    try:
        lock.write_text(json.dumps({"pid": other.pid, "host": os.uname().nodename,
                                    "since": "2026-12-01T02:00:00+00:00"}))
        assert lock_mod.live_holder(lock) is None
        assert unfinished_run(PolicyStore.open(st.path)) is None
    finally:
        other.kill()
        other.wait()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SRC, str(st.path)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env=SUBPROCESS_ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_mod.held(lock) is True and lock_mod.live_holder(lock)["pid"] == holder.pid
        got = unfinished_run(PolicyStore.open(st.path))
        assert (got["state"], got["pid"]) == ("running", holder.pid), got
    finally:
        holder.kill()
        holder.wait()
    assert "released" not in json.loads(lock.read_text())          # SIGKILLed: its record stays, its lock is gone
    assert lock_mod.held(lock) is False and lock_mod.live_holder(lock) is None
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            lock_mod.held(lock)
    t = threading.Thread(target=probe)
    t.start()
    try:
        for _ in range(300):                                           # a writer beside a reader probing: never busy
            with PolicyStore.open(st.path).writer():
                pass
    finally:
        stop.set()
        t.join()


# ----------------------------------------------------------------------------- killed writers

KILL_SRC = textwrap.dedent('''
    import sys
    from helpers import params_of, save_seeds
    from rmm_jax.core.types import SharedState
    from rmm_jax.persist.policy_store import PolicyStore
    st = PolicyStore.open(sys.argv[1])
    start = int(sys.argv[2])
    for i in range(start, start + 10_000):
        sv = st.save_shared(SharedState(params_of(i * 10), None), {"i": i})
        users = {"u0": i * 10} if i % 2 else {f"u{r}": i * 10 + r for r in range(3)}
        save_seeds(st, users, shared_version=sv, chunk_size=2)
        if i == start + 1:
            print("ready", flush=True)   # warmed up (imports, jit): the kill lands in steady state
''')
HYBRID = {**META, "scope": "hybrid", "rank": 2}


def _check_every_verifying_version(st: PolicyStore):
    """Every snapshot on disk that verifies holds exactly the states it claims."""
    n_ok = 0
    for snap in sorted((st.path / "gens").glob("v*")):
        for chunk in sorted(snap.iterdir()):
            if verify_snapshot(snap, chunk.name) is not None:
                continue
            c = json.loads((chunk / "chunk.json").read_text())
            _, leaves, bad = read_chunk(snap, chunk.name, range(len(c["users"])))
            assert bad == {}
            for row, uid in enumerate(c["users"]):
                got = [decode_tree(c["spec"][p], [a[row] for a in leaves[p]])
                       for p in ("params", "opt_state", "learner_state")]
                assert_policy(Saved(UserState(*got), c["info"][row], 0, None),
                              state_for(c["info"][row]["seed"], st.scope.name))
                n_ok += 1
    for snap in sorted((st.path / "shared").glob("v*")):
        if verify_snapshot(snap) is None:
            i = json.loads((snap / "c0000" / "chunk.json").read_text())["info"].get("i", 0)
            assert_same(PolicyStore.open(st.path).shared_state(int(snap.name[1:])).state.params, params_of(i * 10))
            n_ok += 1
    return n_ok


def test_sigkill_mid_save_never_leaves_wrong_or_unpaired_versions(tmp_path):
    """Kills during hybrid saves (shared version, then users paired with it; keep=1, so
    pruning runs on every save): every version that verifies is right, every user loads
    with exactly the shared version it was trained with, and nothing it needs is pruned."""
    st = PolicyStore.create(tmp_path / "store", HYBRID, params_of(0), keep=1)
    rng = random.Random(1234)
    total = 0
    for round_ in range(3):
        p = subprocess.Popen([sys.executable, "-c", KILL_SRC, str(st.path), str(round_ * 40)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                             env=SUBPROCESS_ENV)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.8))
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        total += _check_every_verifying_version(st)
        reader = PolicyStore.open(st.path)
        assert reader.users() == ["u0", "u1", "u2"]
        for uid in reader.users():                   # indexed newest versions load, paired exactly
            pol = reader.load(uid)
            assert pol.skipped == () and len(reader.entries(uid)) == 1
            assert_policy(pol, state_for(pol.info["seed"], "hybrid"))
            shared = reader.shared_state(pol.shared_version)
            assert shared.info["i"] == pol.info["seed"] // 10
            assert_same(shared.state.params, params_of(shared.info["i"] * 10))
    assert total > 0
    with st.writer():                                # the next writer clears leftovers
        pass
    assert not list((st.path / "gens").glob(".*")) and not list((st.path / "shared").glob(".*"))
    refs = {e.shared_version for u in st.users() for e in st.entries(u)}
    assert set(st.shared_versions()) == refs | {max(st.shared_versions())}   # keep=1: newest + referenced


# ----------------------------------------------------------------------------- scoring / export

def test_reranker_ranks_with_the_stored_policy_and_new_users_get_the_shared_part(tmp_path):
    st = new_store(tmp_path)
    params = R.init_reranker(jax.random.PRNGKey(0), D)
    params = jax.tree_util.tree_map(lambda a: a + 0.1, params)
    opt = optax.adam(1e-3)
    save_one(st, "u", UserState(params, opt.init(params), {"step": np.int32(0)}))
    rng = np.random.default_rng(0)
    q, m = rng.standard_normal((3, D)).astype(np.float32), rng.standard_normal((3, 5, D)).astype(np.float32)
    mask = np.array([1, 1, 0, 1, 1], bool)
    rr = Reranker.open(st.path, cache_users=1)
    got = rr.rank("u", q, m, 2, mask)
    for i in range(3):                                  # the core scorer, and its deterministic top-2
        want = np.asarray(R.score(params, *map(jax.numpy.asarray, (q[i], m[i], mask))))
        assert_f32_close(got.scores[i], want, 2 * f32_error(R.score, params, q[i], m[i], mask))   # both float32
        assert got.selected[i].tolist() == np.argsort(-np.where(mask, want, -np.inf))[:2].tolist()
    assert rr.policy("u").version == 1
    new = rr.rank("new_user", q[0], m[0], 2)                  # served the shared part (here: params_of(0))
    assert_f32_close(new.scores[0], R.score(params_of(0), jax.numpy.asarray(q[0]), jax.numpy.asarray(m[0])),
                     2 * f32_error(R.score, params_of(0), q[0], m[0]))
    assert rr.policy("new_user").version is None and list(rr._cache) == ["new_user"]    # LRU of one
    with pytest.raises(InputError, match="query_emb"):
        rr.rank("u", q[:, :4], m, 2)
    with pytest.raises(InputError, match="candidate_embs"):
        rr.rank("u", q, m[:, :, :4], 2)
    with pytest.raises(InputError, match="^m"):
        rr.rank("u", q, m, 6)


def test_export_user_npz_and_json(tmp_path):
    st = new_store(tmp_path)
    ref = state_of(3)
    save_seeds(st, {"u": 3})
    save_seeds(st, {"u": 4})
    doc = export_params(st, "u", tmp_path / "out" / "u.npz", version=1)
    with np.load(tmp_path / "out" / "u.npz", allow_pickle=False) as z:
        assert set(z.files) == {"q_adapter/W/kernel", "m_adapter/W/kernel", "__meta__"}
        assert np.array_equal(z["q_adapter/W/kernel"], ref.params["q_adapter"]["W"]["kernel"])
        assert json.loads(str(z["__meta__"]))["meta"] == META
    side = json.loads((tmp_path / "out" / "u.json").read_text())
    assert side == json.loads(json.dumps(doc)) and side["version"] == 1 and side["info"] == info_of(3)


# ----------------------------------------------------------------------------- CLI

def _cli(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_list_show_export_and_errors(tmp_path, capsys):
    st = new_store(tmp_path)
    save_seeds(st, {"alice": 4, "bob": 6})
    save_seeds(st, {"alice": 5})
    code, out, _ = _cli(["policies", "list", str(st.path), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["n_users"] == 2
    assert doc["users"][0]["user"] == "alice" and doc["users"][0]["versions"] == [1, 2]
    # info_of() records only queries_seen, as stores did before queries_learned: it counts for both
    assert doc["users"][0]["queries_learned"] == doc["users"][0]["queries_last_run"] == 5
    assert doc["users"][0]["last_update"]
    code, out, _ = _cli(["policies", "list", str(st.path)], capsys)
    assert code == 0 and "alice" in out and "1,2" in out
    code, out, _ = _cli(["policies", "list", str(st.path), "--users", "bob", "--json"], capsys)
    assert code == 0 and [r["user"] for r in json.loads(out)["users"]] == ["bob"]
    code, out, err = _cli(["policies", "show", str(st.path), "bob", "--json"], capsys)
    whole = json.loads(out)
    assert whole["store"]["n_users"] == 2 and whole["store"]["shared"]["loads"] == 1 and len(whole["users"]) == 1
    doc = whole["users"][0]
    assert code == 0 and doc["version"] == 1 and doc["shared_version"] is None and doc["info"]["queries_seen"] == 6
    k = np.linalg.norm(state_of(6).params["q_adapter"]["W"]["kernel"].astype(np.float64))
    leaf = {x["path"]: x for x in doc["params"]}["q_adapter/W/kernel"]
    assert leaf["shape"] == [D, D] and leaf["norm"] == pytest.approx(k)      # float64 norms on both sides
    assert "loading" in err
    on_disk = (st.path / "gens" / "v00000001" / "c0000" / "rows.bin").stat().st_size  # alice and bob share it
    assert doc["bytes"]["user"] == {"version": 1, "chunk": "c0000", "row": 1, "users_in_chunk": 2,
                                    "chunk_bytes": on_disk, "bytes": round(on_disk / 2), "array_bytes": 1556}
    shared = st.path / "shared" / "v00000001" / "c0000" / "rows.bin"
    assert doc["bytes"]["shared"] == {"version": 1, "array_bytes": 2 * D * D * 4, "bytes": shared.stat().st_size}
    assert whole["store"]["scope"] == "user" and whole["store"]["keep"] == 3
    code, out, _ = _cli(["policies", "show", str(st.path), "bob"], capsys)
    assert code == 0 and "q_adapter/W/kernel" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("bytes on disk:"))
    assert "(v1 c0000 row 1, 1/2 of " in line and "; shared " in line
    assert line.endswith("(v1, the store's only shared version)")       # not "once for all users"
    code, _, err = _cli(["policies", "export", str(st.path), "alice", "--out", str(tmp_path / "a.npz")], capsys)
    assert code == 0 and (tmp_path / "a.npz").exists() and (tmp_path / "a.json").exists()
    for argv, needle in [(["policies", "list", str(tmp_path / "nope")], "no such policy store"),
                         (["policies", "show", str(st.path), "carol"], "no saved policy for user 'carol'"),
                         (["policies", "export", str(st.path), "alice", "--out", str(tmp_path / "a.txt")],
                          "must end in .npz")]:
        code, out, err = _cli(argv, capsys)
        last = err.rstrip("\n").split("\n")[-1]    # progress lines may precede the error
        assert code == 2 and out == "" and last.startswith("error: ") and needle in last
        assert [ln for ln in err.splitlines() if ln.startswith("error")] == [last]
    code, out, _ = _cli(["policies", "--help"], capsys)
    assert code == 0 and "export" in out and "Examples" in out


def test_cli_export_to_a_directory_is_one_line_and_writes_nothing(tmp_path, capsys):
    """--out naming a directory, or FILE.npz whose FILE.json beside it is one: the .npz was
    written, then a rename failed with an IsADirectoryError traceback, leaving half the export."""
    st = new_store(tmp_path)
    save_seeds(st, {"alice": 4})
    (tmp_path / "dir.npz").mkdir()
    (tmp_path / "side.json").mkdir()
    for out, named in [(tmp_path / "dir.npz", tmp_path / "dir.npz"), (tmp_path / "side.npz", tmp_path / "side.json")]:
        code, out_text, err = _cli(["policies", "export", str(st.path), "alice", "--out", str(out)], capsys)
        assert code == 2 and out_text == "" and len(err.splitlines()) == 1, err
        assert err.startswith(f"error: --out {out}: ") and f"({named}) is a directory" in err, err
    assert not (tmp_path / "side.npz").exists() and not list(tmp_path.glob(".*.tmp-*"))
    assert not any((tmp_path / "dir.npz").iterdir()) and not any((tmp_path / "side.json").iterdir())


def test_cli_export_refuses_a_path_in_the_store_and_a_missing_version_in_one_line(tmp_path, capsys):
    """--out inside STORE wrote its .json over policy_store.json (P/policy_store.npz), and the
    store no longer opened; an unknown --version printed a progress line before its error."""
    st = new_store(tmp_path)
    save_seeds(st, {"alice": 4})
    meta = (st.path / "policy_store.json").read_bytes()
    for out, version, needles in [(st.path / "policy_store.npz", [], ["--out", "inside policy store"]),
                                  (st.path / "gens" / ".." / "a.npz", [], ["--out", "inside policy store"]),
                                  (tmp_path / "a.npz", ["--version", "7"], ["alice", "no version 7"])]:
        code, out_text, err = _cli(["policies", "export", str(st.path), "alice", "--out", str(out), *version], capsys)
        assert code == 2 and out_text == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert all(n in err for n in needles), err
        assert not out.exists()
    assert (st.path / "policy_store.json").read_bytes() == meta
    assert PolicyStore.open(st.path).load("alice").version == 1


def test_shared_parts_get_is_safe_from_many_threads(tmp_path, monkeypatch):
    # SharedParts.get looked a version up, then reordered/returned it from its LRU: another thread evicting it in
    # between raised KeyError (the Reranker held its global lock around every shared read to avoid that).
    import collections
    import threading

    from rmm_jax.persist import policy_shared

    def restore(path):
        time.sleep(0)                                     # a thread switch where the disk read would be
        return {"params": path.name}, {}
    monkeypatch.setattr(policy_shared, "restore_shared", restore)
    monkeypatch.setattr(policy_shared, "_read_only", lambda state: state)
    monkeypatch.setattr(policy_shared, "SHARED_CACHE", 1)

    class Slow(collections.OrderedDict):                  # widens the window between a lookup and its use
        def __contains__(self, key):
            found = super().__contains__(key)
            time.sleep(0.0005)
            return found

        def get(self, key, default=None):
            found = super().get(key, default)
            time.sleep(0.0005)
            return found
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    parts = policy_shared.SharedParts(tmp_path, "store")
    parts._restored = Slow()
    errors = []

    def work(k):
        try:
            for i in range(300):
                v = 1 + (i // 2 + k) % 2
                assert parts.get(v).version == v
        except Exception as e:  # noqa: BLE001 - any failure in a thread fails the test
            errors.append(e)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
