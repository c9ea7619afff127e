"""atomic_dir / atomic_file: the whole output or none, never an overwrite that was not asked
for, and what a killed writer leaves is found by leftovers()."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rmm_jax.errors import InputError
from rmm_jax.persist.atomic import atomic_dir, atomic_file, leftovers, make_dirs, process_umask, remove_dir

ROOT = Path(__file__).resolve().parents[1]


def test_atomic_dir_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "a" / "b" / "out"                 # parents are made
    with atomic_dir(target) as tmp:
        (tmp / "x").write_text("1")
        assert not target.exists()
    assert (target / "x").read_text() == "1" and leftovers(target.parent) == []
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:   # a failure keeps the old one
        (tmp / "x").write_text("2")
        raise RuntimeError("boom")
    assert (target / "x").read_text() == "1" and leftovers(target.parent) == []
    with atomic_dir(target) as tmp:                       # overwrite (the default) replaces it
        (tmp / "y").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["y"] and leftovers(target.parent) == []


def test_atomic_dir_without_overwrite_never_replaces(tmp_path):
    target = tmp_path / "v1"
    target.mkdir()
    (target / "keep").write_text("old")
    ran = []
    with pytest.raises(FileExistsError), atomic_dir(target, overwrite=False):
        ran.append(1)                                     # refused before any work
    assert ran == []
    other = tmp_path / "v2"
    with pytest.raises(FileExistsError), atomic_dir(other, overwrite=False) as tmp:
        (tmp / "new").write_text("new")
        other.mkdir()                                     # appears while we write
        (other / "theirs").write_text("theirs")
    assert sorted(p.name for p in other.iterdir()) == ["theirs"] and leftovers(tmp_path) == []
    assert (target / "keep").read_text() == "old"


def test_make_dirs_and_leftovers(tmp_path):
    make_dirs(tmp_path / "p" / "q")
    make_dirs(tmp_path / "p" / "q")                       # idempotent
    assert (tmp_path / "p" / "q").is_dir()
    for name in (".v00000002.tmp-abc", ".index.sqlite.tmp-12", ".x.old-7", ".lock", "v00000001", ".hidden"):
        (tmp_path / name).mkdir()
    assert sorted(p.name for p in leftovers(tmp_path)) == [".index.sqlite.tmp-12", ".v00000002.tmp-abc", ".x.old-7"]
    assert leftovers(tmp_path / "nope") == []


def test_atomic_file_keeps_the_old_content_on_failure(tmp_path):
    f = tmp_path / "f.json"
    with atomic_file(f) as out:
        out.write("one")
    with pytest.raises(RuntimeError), atomic_file(f) as out:
        out.write("two")
        raise RuntimeError("boom")
    assert f.read_text() == "one" and leftovers(tmp_path) == []


KILLED = textwrap.dedent('''
    import importlib.util, os, signal, sys
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("atomic", sys.argv[2])   # not the whole package: fast
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    with atomic.atomic_dir(Path(sys.argv[1])) as tmp:
        (tmp / "half").write_text("x")
        os.kill(os.getpid(), signal.SIGKILL)
''')


def test_a_named_pipe_or_device_is_written_into_and_a_link_stays_a_link(tmp_path):
    # `--out /dev/null` replaced /dev/null with a plain file for the whole machine: a FIFO
    # stands in for it here (replacing the real one in a test run on old code would do the same)
    import stat
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with atomic_file(fifo) as f:
            f.write("served\n")
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
        assert os.read(reader, 100) == b"served\n"
    finally:
        os.close(reader)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)      # a reader that goes away (`| head -c 100`)
    with pytest.raises(InputError, match=r"out\.fifo: its reader closed the pipe before everything was written"):
        with atomic_file(fifo) as f:
            f.write("x" * 100)
            f.flush()
            os.read(reader, 10)
            os.close(reader)
            f.write("x" * 1_000_000)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    with atomic_file(link) as f:
        f.write("new")
    assert link.is_symlink() and real.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "out.fifo", "real.json"]


def test_a_kill_inside_leaves_no_target_and_a_leftover_to_remove(tmp_path):
    target = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", KILLED, str(target), str(ROOT / "rmm_jax" / "persist" / "atomic.py")],
                       cwd=tmp_path, capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert not target.exists()
    assert [p.name.startswith(".out.tmp-") for p in leftovers(tmp_path)] == [True]


@pytest.fixture
def umask():
    """Set the process umask for a test (``umask(0o022)``), restored afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def modes(root: Path) -> set[tuple[str, int]]:
    """('d' or 'f', permission bits) of ``root`` and everything under it."""
    paths = [root, *root.rglob("*")]
    return {("d" if p.is_dir() else "f", p.stat().st_mode & 0o777) for p in paths}


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_outputs_take_the_users_umask_not_tempfiles_private_modes(tmp_path, umask, mask):
    umask(mask)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x").write_text("1")
    with atomic_file(tmp_path / "file.json") as f:
        f.write("{}")
    assert modes(tmp_path / "out") == {("d", 0o777 & ~mask), ("f", 0o666 & ~mask)}
    assert modes(tmp_path / "file.json") == {("f", 0o666 & ~mask)}
    assert process_umask() == mask


def test_stores_take_the_users_umask(tmp_path, umask):
    """An embedding store and a policy store written under umask 002 are group-readable and
    group-writable throughout, as a serving account in the group needs."""
    import jax
    from conftest import make_fake_store

    from rmm_jax.core.reranker import init_reranker
    from rmm_jax.persist.policy_store import PolicyStore

    umask(0o002)
    make_fake_store(tmp_path / "store", users=2, dim=8)
    PolicyStore.create(tmp_path / "pol", {"kind": "linear", "dim": 8, "hidden": None, "config": {}},
                       init_reranker(jax.random.key(0), 8))
    for root in (tmp_path / "store", tmp_path / "pol"):
        assert modes(root) <= {("d", 0o775), ("f", 0o664)}, (root, modes(root))
class Crash(BaseException):
    """A kill at this point (nothing after it runs)."""


def test_replacing_a_directory_leaves_it_whole_whenever_a_kill_lands(tmp_path, monkeypatch):
    """A kill after any file-system step of replacing an existing directory leaves the old
    copy or the new one at its name, never no directory (two plain renames leave a moment
    without one); what remains aside is a leftover the next writer removes."""
    import os
    import shutil

    from rmm_jax.persist import atomic

    steps = [(os, "replace"), (os, "rename"), (shutil, "rmtree"), (atomic, "exchange")]
    crashed_at = []
    for n in range(1, 10):
        target = tmp_path / f"t{n}"
        target.mkdir()
        (target / "f").write_text("old")
        calls = []
        with monkeypatch.context() as m:
            for owner, name in steps:
                def step(*a, _real=getattr(owner, name), **kw):
                    out = _real(*a, **kw)
                    calls.append(1)
                    if len(calls) == n:
                        raise Crash
                    return out
                m.setattr(owner, name, step)
            try:
                with atomic_dir(target) as tmp:
                    calls.clear()
                    (tmp / "f").write_text("new")
            except Crash:
                crashed_at.append(n)
        assert (target / "f").read_text() in ("old", "new"), n
        for p in leftovers(tmp_path):
            shutil.rmtree(p)
        if n > len(crashed_at):
            break
    assert crashed_at and (target / "f").read_text() == "new"


def test_where_the_system_cannot_swap_two_renames_replace_the_directory(tmp_path, monkeypatch):
    from rmm_jax.persist import atomic

    monkeypatch.setattr(atomic, "_renameat2", lambda: None)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "f").write_text("old")
    with atomic_dir(tmp_path / "t") as tmp:
        (tmp / "f").write_text("new")
    assert (tmp_path / "t" / "f").read_text() == "new" and not leftovers(tmp_path)
    assert atomic.exchange(tmp_path / "t", tmp_path / "u") is False


def test_remove_dir_is_whole_or_not_at_all_and_a_killed_one_is_a_leftover(tmp_path):
    """remove_dir renames the directory aside before deleting it: a missing path is fine, and
    a deletion stopped after the rename leaves no half directory under the old name, only a
    leftover the next writer removes."""
    d = tmp_path / "v00000002"
    (d / "c0000").mkdir(parents=True)
    (d / "c0000" / "chunk.json").write_text("{}")
    remove_dir(d)
    assert not d.exists() and leftovers(tmp_path) == []
    remove_dir(d)                                    # already gone
    (d / "c0000").mkdir(parents=True)
    real, shutil.rmtree = shutil.rmtree, lambda *a, **k: None   # "killed" between the rename and the delete
    try:
        remove_dir(d)
    finally:
        shutil.rmtree = real
    assert not d.exists() and [p.name for p in leftovers(tmp_path)] == [f".v00000002.old-{os.getpid()}"]


def test_write_problem_probes_the_output_and_below_it_never_its_siblings(tmp_path, monkeypatch):
    """A new --policies DIR is checked in its nearest existing ancestor only: probing that
    ancestor's other directories (depth 1) wrote probe files into unrelated siblings and
    refused a run beside a read-only one. An existing DIR is probed with what lies below it.
    A directory that cannot be listed is one reason, not a traceback."""
    import rmm_jax.persist.atomic as atomic
    (tmp_path / "sibling" / "deep").mkdir(parents=True)
    (tmp_path / "out" / "sub").mkdir(parents=True)
    probed = []
    real = atomic.temp_file
    monkeypatch.setattr(atomic, "temp_file", lambda prefix, d: probed.append(Path(d)) or real(prefix, d))
    assert atomic.write_problem(tmp_path / "new" / "store", depth=1) is None
    assert probed == [tmp_path]
    probed.clear()
    assert atomic.write_problem(tmp_path / "out", depth=1) is None
    assert sorted(probed) == [tmp_path / "out", tmp_path / "out" / "sub"]

    def unlistable(self):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(atomic.Path, "iterdir", unlistable)
    assert atomic.write_problem(tmp_path / "out", depth=1) == f"{tmp_path / 'out'}: Permission denied"


def _fsync_probe(monkeypatch, root: Path) -> tuple[set, list]:
    """Watch every rename, replace and atomic exchange: each file being moved (a file, or every
    file under a directory) must have been fsynced since its last change; files are matched by
    inode and size, since their paths change as they move. Returns (synced, unsynced paths)."""
    from rmm_jax.persist import atomic
    synced, unsynced = set(), []
    real = {name: getattr(os, name) for name in ("fsync", "rename", "replace")}
    real_exchange = atomic.exchange

    def fsync(fd):
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino, st.st_size))
        return real["fsync"](fd)

    def check(src):
        # Only the run's outputs under ``root``: the compiled-program cache (core/executables.py)
        # checks each entry's sha256 before loading it and compiles a damaged one again.
        if not Path(src).resolve().is_relative_to(Path(root).resolve()):
            return
        files = [src] if os.path.isfile(src) else [os.path.join(r, n) for r, _, ns in os.walk(src) for n in ns]
        for f in files:
            st = os.stat(f)
            # SQLite fsyncs the index itself (synchronous = FULL, policy_index.py), out of
            # sight of os.fsync; a lock file holds nothing to keep.
            if (st.st_dev, st.st_ino, st.st_size) not in synced and Path(f).name not in ("index.sqlite", ".lock"):
                unsynced.append(os.path.relpath(f, root))

    def moving(name):
        def move(src, dst, *a, **k):
            check(src)
            return real[name](src, dst, *a, **k)
        return move

    def exchange(a, b):                  # atomic_dir swaps the new directory (a) with the old one
        check(a)
        return real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", moving("rename"))
    monkeypatch.setattr(os, "replace", moving("replace"))
    monkeypatch.setattr(atomic, "exchange", exchange)
    return synced, unsynced


def test_every_file_a_run_moves_into_place_was_fsynced_first(capsys, tmp_path, monkeypatch):
    # A rename is durable only for data already on disk: after a power cut, a checkpoint or a
    # policy version whose name survived but whose bytes did not would fail its checksums and
    # send a resume (or a load) back a version.
    from conftest import make_fake_store, run_cli
    store = make_fake_store(tmp_path / "store", users=3, dim=16)
    synced, unsynced = _fsync_probe(monkeypatch, tmp_path)
    small = ["--k", "8", "--m", "3", "--checkpoint-every", "1"]
    for again in ([], ["--relearn"]):           # a new policy store, then new versions in it
        code, _, err = run_cli(capsys, "simulate", store, "--policies", tmp_path / "p", *small, "--users-per-chunk",
                               "1", "--log-out", tmp_path / "log.jsonl", "--json", *again)
        assert code == 0, err
    code, _, err = run_cli(capsys, "replay", store, "--policies", tmp_path / "r", "--log", tmp_path / "log.jsonl")
    assert code == 0, err
    code, _, err = run_cli(capsys, "pretrain", store, "--out", tmp_path / "pre", "--epochs", "2", *small)
    assert code == 0, err
    assert not unsynced, sorted(set(unsynced))
    assert len(synced) > 10              # the probe saw the writers' fsyncs


def test_every_file_of_an_embedding_store_was_fsynced_before_its_rename(tmp_path, monkeypatch):
    # embed --out (new, and replacing a store) and embed --into: a power cut after the rename
    # must not leave a store whose manifest names arrays that never reached the disk.
    from conftest import FakeEmbedder

    from rmm_jax.data import load_spec
    from rmm_jax.data.store import append_store, write_store
    synced, unsynced = _fsync_probe(monkeypatch, tmp_path)
    store = tmp_path / "store"
    write_store(store, load_spec("synthetic:users=2,sessions=2"), "turn", FakeEmbedder(8), answers=True)
    write_store(store, load_spec("synthetic:users=2,sessions=2"), "turn", FakeEmbedder(8), answers=True)
    res = append_store(store, load_spec("synthetic:users=3,sessions=2"), FakeEmbedder(8))
    assert res["added"]["users"] == 1
    assert not unsynced, sorted(set(unsynced))
    assert len(synced) >= 3 * 7          # the seven files of each of the three stores


KILLED_FILE = textwrap.dedent('''
    import importlib.util, os, signal, sys
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("atomic", sys.argv[2])
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    with atomic.atomic_file(Path(sys.argv[1])) as f:
        os.kill(os.getpid(), signal.SIGKILL)
''')


def test_writing_in_a_directory_again_removes_the_temps_killed_writers_left_and_nothing_else(tmp_path, monkeypatch):
    """A run killed while writing `--log-out pk.jsonl` left `.pk.jsonl.tmp-XXXX` (0 bytes),
    which the resumed run that wrote pk.jsonl kept beside it. The temp names its writer; a
    process's first write in a directory removes the temps there whose writer is gone (of
    any output), and only those: not a live writer's, another host's, nor another naming.
    Later writes in that directory list it no more (a run-state's chunks: once, not per write)."""
    import rmm_jax.persist.atomic as atomic
    from rmm_jax.persist.atomic import _owner_prefix

    target = tmp_path / "pk.jsonl"
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", KILLED_FILE, str(target),
                            str(ROOT / "rmm_jax" / "persist" / "atomic.py")], capture_output=True, timeout=120)
        assert r.returncode == -signal.SIGKILL
    killed = sorted(p.name for p in tmp_path.glob(".pk.jsonl.tmp-*"))
    assert len(killed) == 1         # the second killed writer removed the first's
    dead = int(killed[0][len(".pk.jsonl.tmp-"):].split("@")[0])
    gone = _owner_prefix(tmp_path / "other.jsonl", dead) + "x"                 # another output's dead writer
    keep = [".pk.jsonl.tmp-abc", _owner_prefix(target) + "live", ".pk.jsonl.tmp-" + f"{dead}@00000000-x",
            "pk.jsonl.tmp-1@x-y"]
    for name in [*keep, gone]:
        (tmp_path / name).write_text("")
    with atomic_file(target) as f:
        f.write("done\n")
    assert target.read_text() == "done\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "pk.jsonl") == sorted(keep)
    listed = []
    monkeypatch.setattr(atomic, "remove_stale_temps", lambda d: listed.append(d))
    for i in range(3):
        with atomic_file(tmp_path / f"c{i}.npz", "wb") as f:
            f.write(b"x")
    assert listed == []                                   # this process swept tmp_path already
