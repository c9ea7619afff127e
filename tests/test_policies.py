"""PolicyStore: round trips, batched layout, versions, corruption, locking, kills, CLI."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import TESTS_DIR, learner_of, params_of, state_of

import rmm_jax as R
from rmm_jax.cli.main import main
from rmm_jax.core import reranker
from rmm_jax.core.types import LearnerState
from rmm_jax.errors import InputError
from rmm_jax.online.scoring import score_query
from rmm_jax.persist.codec import decode_tree, leaf_specs
from rmm_jax.persist.policy_index import PolicyIndex
from rmm_jax.persist.policy_snapshot import load_arrays
from rmm_jax.persist.policy_store import PolicyRestoreWarning, PolicyStore, UserPolicy, verify_snapshot

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


def assert_policy(pol: UserPolicy, ref: UserPolicy):
    assert_same(pol.params, ref.params)
    assert_same(pol.opt_state, ref.opt_state)
    assert_same(pol.learner_state, ref.learner_state)
    assert pol.info == ref.info


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
    st.save_users(refs)
    st2 = PolicyStore.open(tmp_path / "s")
    assert st2.meta == meta and st2.users() == ["u0", "u1", "u2"]
    for uid, ref in refs.items():
        pol = st2.load_user(uid)
        assert_policy(pol, ref)
        assert type(pol.opt_state[0]) is type(ref.opt_state[0])  # ScaleByAdamState
        assert st2.last_restore_report["skipped"] == [] and pol.version == 1
    # optax keeps using the restored state: same update as with the original
    opt = optax.adam(1e-3)
    g = params_of(99, kind)
    pol = st2.load_user("u1")
    u_ref, s_ref = opt.update(g, refs["u1"].opt_state, refs["u1"].params)
    u_new, s_new = opt.update(g, pol.opt_state, pol.params)
    assert_same(u_ref, u_new)
    assert_same(s_ref, s_new)
    assert_same(st2.shared_params(), params_of(0, kind))


def test_real_reranker_params_and_typed_key(tmp_path):
    st = new_store(tmp_path)
    params = R.init_reranker(jax.random.PRNGKey(1), D)
    opt_state = R.adam(1e-3).init(params)
    learner = R.init_learner_state(jax.random.PRNGKey(2), R.Estimator())
    assert isinstance(learner, LearnerState)
    typed = learner._replace(key=jax.random.key(5))
    st.save_users({"a": UserPolicy(params, opt_state, learner, {}), "t": UserPolicy(params, None, typed, {})})
    metas = chunk_metas(st.path / "gens" / "v00000001")
    assert {c["spec"]["learner_state"]["cls"] for c in metas.values()} == {"rmm_jax.core.types:LearnerState"}
    pol = PolicyStore.open(st.path).load_user("a")
    assert_same(pol.params, params)
    assert_same(pol.opt_state, opt_state)
    assert_same(pol.learner_state, learner)
    key = PolicyStore.open(st.path).load_user("t").learner_state.key
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(typed.key))


def test_legacy_dict_learner_state_loads_as_learner_state(tmp_path):
    """Stores written before LearnerState existed hold {baseline, key, step} dicts."""
    st = new_store(tmp_path)
    ref = state_of(3)
    old = dict(ref.learner_state._asdict())
    st.save_users({"old": UserPolicy(ref.params, ref.opt_state, old, ref.info),
                   "new": state_of(4)})
    specs = {c["users"][0]: c["spec"]["learner_state"] for c in chunk_metas(st.path / "gens" / "v00000001").values()}
    assert specs["old"]["t"] == "dict" and specs["old"]["k"] == ["baseline", "key", "step"]
    assert specs["new"]["t"] == "nt"
    pol = PolicyStore.open(st.path).load_user("old")
    assert type(pol.learner_state) is LearnerState
    assert_policy(pol, ref)
    batch = st.load_batch(["old", "new"])                 # both forms stack into one LearnerState
    assert type(batch.learner_state) is LearnerState
    assert batch.learner_state.step.tolist() == [3, 4]
    tpl = UserPolicy(ref.params, ref.opt_state, learner_of(0))
    assert_same(st.load_user("old", template=tpl).learner_state, ref.learner_state)


def test_mixed_structures_in_one_save(tmp_path):
    st = new_store(tmp_path)
    refs = {"lin": state_of(1, "linear"), "deep": state_of(2, "mlp")}
    st.save_users(refs)
    for uid, ref in refs.items():
        assert_policy(st.load_user(uid), ref)


# ----------------------------------------------------------------------------- batched layout

def test_save_batch_then_per_user_rows(tmp_path):
    st = new_store(tmp_path)
    uids = [f"user_{i}" for i in range(5)]
    refs = [state_of(10 + i) for i in range(5)]
    stack = lambda *xs: np.stack(xs)  # noqa: E731
    stacked = UserPolicy(*(jax.tree_util.tree_map(stack, *[getattr(r, p) for r in refs])
                           for p in ("params", "opt_state", "learner_state")))
    v = st.save_batch(uids, stacked, [r.info for r in refs], chunk_size=2)
    snap = st.path / "gens" / f"v{v:08d}"
    assert sorted(p.name for p in snap.iterdir() if p.is_dir()) == ["c0000", "c0001", "c0002"]
    entries = {u: st.version_entries(u)[-1] for u in uids}
    assert (entries["user_3"]["chunk"], entries["user_3"]["row"]) == ("c0001", 1)
    st2 = PolicyStore.open(st.path)
    for uid, ref in zip(uids, refs):
        assert_policy(st2.load_user(uid), ref)
    back = st2.load_batch(uids)
    assert_same(back.params, stacked.params)
    assert_same(back.opt_state, stacked.opt_state)
    assert back.info == [r.info for r in refs]
    with pytest.raises(InputError, match="leading users axis"):
        st.save_batch(uids[:4], stacked)


def test_versions_kept_is_n(tmp_path):
    st = new_store(tmp_path, keep_versions=3)
    for i in range(5):
        st.save_users({"u": state_of(i), "w": state_of(100 + i)} if i == 0 else {"u": state_of(i)})
    assert st.versions("u") == [3, 4, 5]
    assert st.versions("w") == [1]           # w's only version is kept ...
    assert sorted(p.name for p in (st.path / "gens").iterdir()) == \
        ["v00000001", "v00000003", "v00000004", "v00000005"]   # ... v2 is gone
    assert_policy(st.load_user("u"), state_of(4))
    assert_policy(st.load_user("u", version=3), state_of(2))
    assert_policy(st.load_user("w"), state_of(100))


def test_index_rebuilt_when_corrupt(tmp_path):
    st = new_store(tmp_path)
    st.save_users({"u": state_of(1)})
    st.save_users({"u": state_of(2)})
    (st.path / "index.sqlite").write_bytes(b"{ broken" * 100)
    assert st.versions("u") == [1, 2]
    assert_policy(st.load_user("u"), state_of(2))
    assert st.save_users({"u": state_of(3)}) == 3
    assert PolicyIndex.open(st.path / "index.sqlite").entries("u")[-1].version == 3


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
        st.save_users({"u": state_of(i)})
    snap = st.path / "gens" / "v00000003"
    target = snap / "c0000" / "CHECKSUMS.json" if how == "drop_checksums" else biggest_file(snap)
    _corrupt(target, how)
    assert verify_snapshot(snap, "c0000") is not None
    st2 = PolicyStore.open(st.path)
    with pytest.warns(PolicyRestoreWarning, match="restored version 2"):
        pol = st2.load_user("u")
    assert pol.version == 2
    assert_policy(pol, state_of(1))
    rep = st2.last_restore_report
    assert rep["version"] == 2 and [s["version"] for s in rep["skipped"]] == [3]


def test_corrupt_small_files_and_all_bad(tmp_path):
    st = new_store(tmp_path)
    for i in range(2):
        st.save_users({"u": state_of(i)})
    _corrupt(st.path / "gens" / "v00000002" / "c0000" / "chunk.json", "flip")
    with pytest.warns(PolicyRestoreWarning):
        assert st.load_user("u").version == 1
    _corrupt(biggest_file(st.path / "gens" / "v00000001"), "truncate")
    with pytest.raises(InputError) as ei:
        st.load_user("u")
    msg = str(ei.value)
    assert "'u'" in msg and str(st.path) in msg and "v2" in msg and "v1" in msg and "\n" not in msg


def test_shared_params_versions_and_corruption(tmp_path):
    st = new_store(tmp_path)
    assert st.set_shared(params_of(7)) == 2
    assert_same(st.shared_params(), params_of(7))
    _corrupt(biggest_file(st.path / "shared" / "v00000002"), "flip")
    with pytest.warns(PolicyRestoreWarning):
        assert_same(st.shared_params(), params_of(0))


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
        st.load_user("ghost")


# ----------------------------------------------------------------------------- lock

WRITER_SRC = textwrap.dedent('''
    import sys
    import numpy as np
    from rmm_jax.errors import InputError
    from rmm_jax.persist.policy_store import PolicyStore, UserPolicy
    try:
        PolicyStore.open(sys.argv[1]).save_users({"sub": UserPolicy({"w": np.arange(4.0)}, None, None, {"n": 5})})
    except InputError as e:
        print(e); sys.exit(3)
    print("saved")
''')


def _run_writer(path):
    return subprocess.run([sys.executable, "-c", WRITER_SRC, str(path)], capture_output=True, text=True,
                          cwd=ROOT, env=SUBPROCESS_ENV, timeout=60)


def test_second_writer_gets_lock_error_then_succeeds(tmp_path):
    st = new_store(tmp_path)
    with st.writer():
        st.save_users({"u": state_of(1)})          # re-entrant inside the writer
        r = _run_writer(st.path)
        assert r.returncode == 3, r.stderr
        line = r.stdout.strip()
        assert line == (f"policy store {st.path} is locked by pid {os.getpid()} on host "
                        f"{os.uname().nodename} (another writer is running; retry when it ends)")
        other = PolicyStore.open(st.path)           # same process, other handle: also locked out
        with pytest.raises(InputError, match="is locked by pid"):
            other.set_shared(params_of(1))
    r = _run_writer(st.path)
    assert r.returncode == 0 and r.stdout.strip() == "saved", r.stderr
    sub = st.load_user("sub")
    assert_same(sub.params, {"w": np.arange(4.0)})
    assert sub.opt_state is None and sub.info == {"n": 5}


# ----------------------------------------------------------------------------- killed writers

KILL_SRC = textwrap.dedent('''
    import sys
    from helpers import state_of
    from rmm_jax.persist.policy_store import PolicyStore
    st = PolicyStore.open(sys.argv[1])
    start = int(sys.argv[2])
    for i in range(start, start + 10_000):
        users = {f"u{r}": state_of(i * 10 + r) for r in range(3)}
        if i % 2:
            st.save_users(users, chunk_size=2)
        else:
            st.set_shared(users["u0"].params)
        if i == start + 1:
            print("ready", flush=True)   # warmed up (imports, jit): the kill lands in steady state
''')


def _check_every_verifying_version(st: PolicyStore):
    """Every snapshot on disk that verifies holds exactly the states it claims."""
    n_ok = 0
    for snap in sorted((st.path / "gens").glob("v*")):
        for chunk in sorted(snap.iterdir()):
            if verify_snapshot(snap, chunk.name) is not None:
                continue
            c = json.loads((chunk / "chunk.json").read_text())
            counts = {p: len(leaf_specs(c["spec"][p])) for p in ("params", "opt_state", "learner_state")}
            leaves = load_arrays(chunk / "arrays.npz", counts)
            for row, uid in enumerate(c["users"]):
                ref = state_of(c["info"][row]["seed"])
                got = [decode_tree(c["spec"][p], [a[row] for a in leaves[p]])
                       for p in ("params", "opt_state", "learner_state")]
                assert_policy(UserPolicy(*got, c["info"][row]), ref)
                n_ok += 1
    # i * 10 for every i a writer may reach
    known = {params_of(s)["q_adapter"]["W"]["kernel"].tobytes() for s in range(0, 20_000, 10)}
    for snap in sorted((st.path / "shared").glob("v*")):
        if verify_snapshot(snap) is None:
            leaves = load_arrays(snap / "c0000" / "arrays.npz", {"params": 2})["params"]  # m_adapter, q_adapter
            assert leaves[1].tobytes() in known
            n_ok += 1
    return n_ok


def test_sigkill_mid_save_never_leaves_wrong_verifying_version(tmp_path):
    st = new_store(tmp_path)
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
        users = st.users()
        for uid in users:                            # indexed newest versions load
            pol = st.load_user(uid)
            assert_policy(pol, state_of(pol.info["seed"]))
    assert total > 0
    with st.writer():                                # the next writer clears leftovers
        pass
    assert not list((st.path / "gens").glob(".tmp-*")) and not list((st.path / "shared").glob(".tmp-*"))


# ----------------------------------------------------------------------------- scoring / export

def test_score_query_uses_core_scorer(tmp_path, monkeypatch):
    st = new_store(tmp_path)
    params = R.init_reranker(jax.random.PRNGKey(0), D)
    params = jax.tree_util.tree_map(lambda a: a + 0.1, params)
    opt = optax.adam(1e-3)
    st.save_users({"u": UserPolicy(params, opt.init(params), {"step": np.int32(0)}, {})})
    rng = np.random.default_rng(0)
    q, m = rng.standard_normal(D).astype(np.float32), rng.standard_normal((5, D)).astype(np.float32)
    mask = np.array([1, 1, 0, 1, 1], bool)
    got = score_query(st.path, "u", q, m, mask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(R.score(params, *map(jax.numpy.asarray, (q, m, mask)))))
    calls = []
    monkeypatch.setattr(reranker, "score", lambda p, q, m, mask=None: calls.append(p) or np.zeros(len(m)))
    score_query(st.path, "new_user", q, m, fallback_to_shared=True)
    assert_same(calls[0], params_of(0))
    with pytest.raises(InputError, match="dim 8, expected 4"):
        score_query(st.path, "u", q[:4], m[:, :4])
    with pytest.raises(InputError, match="candidate_embs"):
        score_query(st.path, "u", q, m[:, :4])


def test_export_user_npz_and_json(tmp_path):
    st = new_store(tmp_path)
    ref = state_of(3)
    st.save_users({"u": ref})
    doc = st.export_user("u", tmp_path / "out" / "u.npz")
    with np.load(tmp_path / "out" / "u.npz", allow_pickle=False) as z:
        assert set(z.files) == {"q_adapter/W/kernel", "m_adapter/W/kernel", "__meta__"}
        assert np.array_equal(z["q_adapter/W/kernel"], ref.params["q_adapter"]["W"]["kernel"])
        assert json.loads(str(z["__meta__"]))["meta"] == META
    side = json.loads((tmp_path / "out" / "u.json").read_text())
    assert side == json.loads(json.dumps(doc)) and side["version"] == 1
    with pytest.raises(InputError, match="must end in .npz"):
        st.export_user("u", tmp_path / "u.bin")


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
    st.save_users({"alice": state_of(4), "bob": state_of(6)})
    st.save_users({"alice": state_of(5)})
    code, out, _ = _cli(["policies", "list", str(st.path), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["n_users"] == 2
    assert doc["users"][0]["user"] == "alice" and doc["users"][0]["versions"] == [1, 2]
    assert doc["users"][0]["queries_seen"] == 5 and doc["users"][0]["last_update"]
    code, out, _ = _cli(["policies", "list", str(st.path)], capsys)
    assert code == 0 and "alice" in out and "1,2" in out
    code, out, err = _cli(["policies", "show", str(st.path), "bob", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["restored_version"] == 1 and doc["info"]["queries_seen"] == 6
    k = np.linalg.norm(state_of(6).params["q_adapter"]["W"]["kernel"].astype(np.float64))
    leaf = {x["path"]: x for x in doc["params"]}["q_adapter/W/kernel"]
    assert leaf["shape"] == [D, D] and leaf["norm"] == pytest.approx(k)
    assert "loading" in err
    on_disk = (st.path / "gens" / "v00000001" / "c0000" / "arrays.npz").stat().st_size  # alice and bob share it
    assert doc["bytes"]["user"] == {"version": 1, "chunk": "c0000", "row": 1, "users_in_chunk": 2,
                                    "chunk_bytes": on_disk, "bytes": round(on_disk / 2), "array_bytes": 1556}
    shared = st.path / "shared" / "v00000001" / "c0000" / "arrays.npz"
    assert doc["bytes"]["shared"] == {"version": 1, "array_bytes": 2 * D * D * 4, "bytes": shared.stat().st_size}
    assert doc["scope"] == "user"
    code, out, _ = _cli(["policies", "show", str(st.path), "bob"], capsys)
    assert code == 0 and "q_adapter/W/kernel" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("bytes on disk:"))
    assert "(v1 c0000 row 1, 1/2 of " in line and "; shared " in line and "once for all users" in line
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
