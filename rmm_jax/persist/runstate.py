"""Crash-safe, resumable runs: a run-state checkpoint next to the policy store.

``simulate``, ``replay`` and ``pretrain`` save their progress periodically (every
``--checkpoint-every`` updates or epochs) and when they get SIGINT/SIGTERM, into
``<policies>.runstate/`` (``<out>.runstate/`` for pretrain)::

    POLICIES.runstate/
      .lock                 flock'ed by the running process (a second run fails fast)
      done/c000003.npz      per-query outputs of completed users chunk 3 (written once)
      s00000007/            one checkpoint (the last KEEP=2 are kept)
        meta.json           command, fingerprint of inputs and options, progress, tree specs
        arrays.npz          every array (states, outputs so far), uncompressed; a checkpoint of
                            format 1 held an orbax checkpoint in arrays/ instead (still read)
        CHECKSUMS.json      sha256 of every file above + a hash of itself, written LAST

A checkpoint is written into ``.tmp-*`` and renamed into place after its checksums, so
it is complete or absent. Loading verifies the checksums; a damaged newest checkpoint
is skipped (and reported) for the previous one. ``--resume`` refuses a checkpoint whose
fingerprint (command, input digests, options, initial params, versions) differs from
the current invocation, naming every differing option (an input file by the path it was
read from, recorded beside the fingerprint, and its digest); so does the refusal of a run
without ``--resume``. On success the directory is removed.

What a checkpoint holds is enough to continue bit-identically: for an online run, how
many users chunks are complete (their policies are in the policy store, their
per-query outputs in ``done/cNNNNNN.npz``, written once when the chunk completes, for
the summary and, for simulate, the log records), and for the chunk in progress the
stacked per-user ``(params, opt_state, learner_state)``, the segment reached and its
outputs so far. Segments are calls of one compiled program over a range of batches (see
:func:`rmm_jax.online.driver.drive`), so a resumed run makes the same calls on the same
inputs as an uninterrupted one. For pretrain: the epoch, params, optimiser state, best
params and the early-stopping history.

This module only saves and restores what it is handed; the caller (the CLI, reading the
events of :func:`rmm_jax.online.driver.drive`) decides when.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from rmm_jax.errors import Busy, InputError, named, option_of
from rmm_jax.persist import checksums
from rmm_jax.persist.atomic import atomic_file, fsync_dir, real_path, remove_dir, temp_dir, write_json
from rmm_jax.persist.checksums import CHECKSUM_FILE
from rmm_jax.persist.codec import decode_tree, encode_tree, leaf_specs
from rmm_jax.persist.lock import WriterLock, live_holder
from rmm_jax.version import __version__

FORMAT = "rmm-jax-run-state"
FORMAT_VERSION = 2              # 2: arrays.npz; 1: an orbax checkpoint in arrays/
READS_FORMAT_VERSIONS = (1, 2)
SUFFIX = ".runstate"
KEEP = 2
META_FILE = "meta.json"
ARRAYS_FILE = "arrays.npz"
ARRAYS_DIR = "arrays"             # format 1: an orbax checkpoint
LOCK_FILE = ".lock"
DONE_DIR = "done"


# --------------------------------------------------------------------------- fingerprints


def file_digest(*paths) -> str:
    """sha256 over the files (directories: every regular file below, by relative name)."""
    h = hashlib.sha256()
    for p in map(Path, paths):
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for f in files:
            h.update((f.relative_to(p).as_posix() if p.is_dir() else f.name).encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def versions() -> dict:
    return {"rmm-jax version": __version__, "jax version": jax.__version__, "backend": jax.default_backend()}


_ABSENT = object()


def _is_digest(v) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _show(v, path: str | None = None) -> str:
    """A fingerprint value as a message shows it; a file's digest with the ``path`` it was
    read from (when the run recorded it)."""
    if v is None or v is _ABSENT:       # an option left out (None) or unknown to the other run
        return "not given"
    if _is_digest(v):
        return f"{path} [sha256 {v[:12]}…]" if path else f"sha256 {v[:12]}… [path not recorded]"
    return json.dumps(v)


def fingerprint_diffs(saved: dict, now: dict, saved_paths: dict | None = None,
                      now_paths: dict | None = None, prefix: str = "") -> list[str]:
    """Every key (option) whose value differs, as ``KEY (VALUE there, VALUE now)``; the
    ``*_paths`` name the files whose digests the fingerprints hold (option -> path). A
    setting derived from the options (a dict: ``config``) is left out when an option differs,
    else named by its differing leaves (``config.optimizer.lr``)."""
    saved_paths, now_paths = saved_paths or {}, now_paths or {}
    keys = [k for k in list(now) + [k for k in saved if k not in now] if saved.get(k, _ABSENT) != now.get(k, _ABSENT)]
    options = any(k.startswith("--") for k in keys)
    diffs = []
    for key in keys:
        a, b = saved.get(key, _ABSENT), now.get(key, _ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):     # a setting derived from the options (config)
            if not options:                                # which differ: they are named; else its leaves
                diffs += fingerprint_diffs(a, b, prefix=f"{prefix}{key}.")
            continue
        diffs.append(f"{prefix}{key} ({_show(a, saved_paths.get(key))} there, {_show(b, now_paths.get(key))} now)")
    return diffs


def check_fingerprint(saved: dict, now: dict, where: Path, saved_paths: dict | None = None,
                      now_paths: dict | None = None) -> None:
    """InputError naming every key (option) whose value differs, in one line (one: named as
    its location)."""
    diffs = fingerprint_diffs(saved, now, saved_paths, now_paths)
    if len(diffs) == 1:
        key, _, shown = diffs[0].partition(" ")
        raise InputError(f"differs from the interrupted run {shown}; resume with the same value, or remove {where} "
                         "to start over", where=key)
    if diffs:
        raise InputError(f"{len(diffs)} options differ from the interrupted run: {', '.join(diffs)}; resume with "
                         f"the same values, or remove {where} to start over", where=str(where))


# --------------------------------------------------------------------------- checkpoints


@dataclasses.dataclass
class Checkpoint:
    step: int
    path: Path
    meta: dict              # the caller's JSON progress
    trees: dict             # name -> pytree (numpy leaves)


def _read_arrays(snap: Path, counts: dict[str, int], format_version: int) -> dict[str, list[np.ndarray]]:
    """``counts[name]`` leaves per tree of a checkpoint: from ``arrays.npz``, or from the
    orbax checkpoint in ``arrays/`` of a format-1 checkpoint (orbax imported only then)."""
    if format_version >= 2:
        with np.load(snap / ARRAYS_FILE, allow_pickle=False) as z:
            return {n: [z[f"{n}.{i:06d}"] for i in range(c)] for n, c in counts.items()}
    import orbax.checkpoint as ocp

    args = {n: {f"l{i:06d}": ocp.RestoreArgs(restore_type=np.ndarray) for i in range(c)}
            for n, c in counts.items() if c}
    got = ocp.PyTreeCheckpointer().restore((snap / ARRAYS_DIR).resolve(),
                                           args=ocp.args.PyTreeRestore(restore_args=args))
    return {n: [got[n][f"l{i:06d}"] for i in range(c)] for n, c in counts.items() if c}


def _verify(snap: Path) -> str | None:
    """None if every file matches CHECKSUMS.json (and nothing listed is missing)."""
    return checksums.verify(snap, lambda files: list(files) if META_FILE in files
                            else f"{CHECKSUM_FILE} lists no {META_FILE}", f"no {CHECKSUM_FILE}")


class RunState:
    """The run-state directory of one policy store (or pretrain output); see the module
    docstring. Make with :meth:`begin`; use as a context manager (releases the lock)."""

    def __init__(self, path: Path, command: str, fingerprint: dict, paths: dict | None = None):
        self.path = Path(path)
        self.command = command
        self.fingerprint = json.loads(json.dumps(fingerprint))
        self.paths = {k: os.path.abspath(v) for k, v in (paths or {}).items()}   # the files its digests are of
        self.notes: list[str] = []               # begin(): what the caller tells the user, in order
        self.restored: Checkpoint | None = None
        self.interrupted: dict | None = None     # begin(): the progress meta of a run started again
        self.saved = 0
        self._superseded: list[Path] = []        # an interrupted run's checkpoints this one started again
        self._restart: Callable[[dict], bool] | None = None     # begin()'s: which interrupted runs start again
        self._writer = WriterLock(self.path / LOCK_FILE, self._in_use_error, command or None)   # named to readers

    @staticmethod
    def path_for(target) -> Path:
        t = real_path(target)          # a link's run-state is its target's: readers by either name see it
        return t.parent / (t.name + SUFFIX)

    @classmethod
    def interrupted_fingerprint(cls, target) -> dict | None:
        """The fingerprint of the newest checkpoint an interrupted run of ``target`` left
        (unverified; None if there is none), e.g. to resolve an option's default as that run
        did before the checkpoint is restored and checked."""
        doc = cls.interrupted_run(target)
        return None if doc is None else doc["fingerprint"]

    @classmethod
    def interrupted_run(cls, target) -> dict | None:
        """The ``meta.json`` of the newest checkpoint a run of ``target`` left (its ``command``,
        ``fingerprint`` and progress ``meta``; unverified; None if there is none), read without
        the lock: for a reader to say what an unfinished run wrote."""
        return cls._interrupted(cls.path_for(target))

    @classmethod
    def running(cls, target) -> dict | None:
        """The lock record (``pid``, ``host``, ``since``, ``command``) of the run that holds
        ``target``'s run-state now (None: none), read without taking the lock
        (:func:`rmm_jax.persist.lock.live_holder`)."""
        return live_holder(cls.path_for(target) / LOCK_FILE)

    @classmethod
    def interrupted_meta(cls, target) -> dict | None:
        """The progress meta of the newest checkpoint an interrupted run of ``target`` left
        (what :meth:`save` was given; unverified; None if there is none)."""
        doc = cls.interrupted_run(target)
        return None if doc is None else doc["meta"]

    @classmethod
    def interrupted_command(cls, target) -> str | None:
        """The command of the run whose checkpoints ``target``'s run-state holds (None: no
        interrupted run), e.g. for ``policies rollback`` to refuse until it is resumed.
        Raises the one-line "in use by pid N" InputError while that run is still running."""
        rs = cls(cls.path_for(target), "", {})
        if not rs._snapshots():
            return None
        try:
            with rs._writer.hold():
                return rs._command_of(rs._snapshots()) if rs._snapshots() else None
        except FileNotFoundError:       # the run finished meanwhile and removed it
            return None

    @classmethod
    def create_locked(cls, target, create: Callable[[], Any]):
        """``create()`` the new store ``target`` holding its run-state's lock, the lock every
        run on ``target`` takes: while another run holds it, or when ``target`` appeared since
        the caller saw it absent (another run created it and has not yet begun its run-state),
        the one-line "in use by pid N" InputError, naming that run, and nothing is created
        (not "already exists; choose a new path": such runs continue an existing store). The
        lock is released after ``create``, its file kept; the caller's :meth:`begin` takes it
        again (and :meth:`finish` or :meth:`close` remove the run-state directory)."""
        rs = cls(cls.path_for(target), "", {})
        rs.path.mkdir(parents=True, exist_ok=True)
        last = rs._writer.holder()          # read before taking the lock, which records this process
        rs._writer.acquire()
        try:
            if Path(target).exists():       # created meanwhile, by the run that last held the lock
                raise rs._in_use_error(last)
            return create()
        finally:       # the lock file stays (its record names this run to one that comes in the gap)
            rs._writer.release()

    @classmethod
    def _interrupted(cls, path: Path) -> dict | None:
        """The ``meta.json`` of the newest checkpoint under ``path`` that parses (unverified)."""
        for _, snap in reversed(cls(path, "", {})._snapshots()):
            try:
                doc = json.loads((snap / META_FILE).read_text())
                if isinstance(doc.get("fingerprint"), dict) and isinstance(doc.get("meta"), dict):
                    return doc
            except (OSError, ValueError, AttributeError):
                continue
        return None

    @classmethod
    def begin(cls, target, command: str, fingerprint: dict, *, resume: bool,
              restart: Callable[[dict], bool] | None = None, paths: dict | None = None) -> "RunState":
        """Lock the run-state of ``target``; with ``resume`` restore its newest good
        checkpoint (checked against ``fingerprint``) into :attr:`restored`. Without
        ``resume`` an unfinished run-state is an error, unless it holds a ``command`` run
        whose fingerprint ``restart`` accepts: that run's state is then removed at this run's
        first :meth:`save` (a run that fails before, e.g. refused as busy, leaves it as it was;
        with a note) and this run starts afresh (``replay``: the policy store remembers the calls
        each saved policy learned, so starting again learns nothing twice), keeping the
        interrupted run's progress meta in :attr:`interrupted` (what it began from).
        The notes (a damaged checkpoint skipped, a run started again, nothing to resume) are in
        :attr:`notes`, for the caller to show once the run starts (after the locks that can still
        refuse it as busy: a refused run starts nothing again). The errors and notes name ``resume`` as
        :func:`rmm_jax.errors.named` does (``resume=True``; the CLI's ``--resume``).
        ``paths`` (option -> path) names the input files whose digests ``fingerprint``
        holds: recorded with each checkpoint, for the messages to name the files."""
        rs = cls(cls.path_for(target), command, fingerprint, paths)
        rs._restart = restart
        resume_as = named("resume", True)           # resume=True, or the CLI's --resume
        rs._lock()
        try:
            snaps = rs._snapshots()
            old = cls._interrupted(rs.path) if snaps and not resume else None
            left_by = rs._command_of(snaps) if old is not None else None
            if old is not None and restart is not None and left_by == command and restart(old["fingerprint"]):
                rs.notes.append(f"an interrupted `{command}` run of the same input left {rs.path}; starting it again "
                                "(what it saved is remembered in the policy store and not learned twice)")
                rs.interrupted = old["meta"]
                rs._superseded = [*(q for _, q in snaps), rs.path / DONE_DIR]     # removed at this run's first save
                snaps = []
            if snaps and not resume:
                differs, options_differ = rs._differences(old)
                how = f"{resume_as} with its values of those options" if options_differ else resume_as
                raise InputError(f"an interrupted `{left_by or rs._command_of(snaps)}` run left its state here"
                                 f"{differs}; pass {how} to continue it, or remove {rs.path} "
                                 "to start over", where=str(rs.path))
            if resume:
                if snaps:
                    rs.restored = rs._load(snaps)
                else:
                    rs.notes.append(f"{resume_as}: no checkpoint in {rs.path}; starting from the beginning")
        except BaseException:
            rs.close()
            raise
        return rs

    def _differences(self, old: dict | None) -> tuple[str, bool]:
        """For the refusal of a run-state left by ``old`` (its newest checkpoint's meta.json;
        None: none readable): the files it read and how its options differ from this run's,
        and whether any option differs."""
        if old is None:
            return "", False
        fp, paths, same = old["fingerprint"], old.get("paths") or {}, old.get("command") == self.command
        diffs = fingerprint_diffs(fp, self.fingerprint, paths, self.paths) if same else []
        read = [f"{k} {_show(v, paths.get(k))}" for k, v in fp.items()      # the files it read, unless a diff names it
                if k.startswith("--") and _is_digest(v) and not any(d.startswith(f"{k} (") for d in diffs)]
        return ((f": it read {', '.join(read)}" if read else "")
                + ("" if not same else f"; options that differ from this command: {', '.join(diffs)}" if diffs
                   else "; its options are this command's")), bool(diffs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- locking

    def _lock(self) -> None:
        for p in self.path.parent.glob(f".{self.path.name}.old-*"):   # what a kill left of a finish()
            shutil.rmtree(p, ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)
        self._writer.acquire()
        for p in self.path.iterdir():  # leftovers of a killed writer
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)

    def _in_use_error(self, holder: dict) -> Busy:
        return Busy(f"in use by pid {holder.get('pid', '?')} (another run on the same policies is "
                          "running; retry when it ends)", where=str(self.path))

    def _drop_superseded(self) -> None:
        """Remove what the interrupted run this one started again left (:meth:`begin`), before
        this run's first checkpoint or completed chunk's outputs are written."""
        for p in self._superseded:
            shutil.rmtree(p, ignore_errors=True)
        self._superseded = []

    def close(self) -> None:
        """Release the lock; an empty run-state directory (nothing saved) is removed, and one
        holding only the checkpoints of an interrupted run this one started again is kept."""
        if not self._writer.held:
            return
        if self.path.is_dir() and not self._snapshots():
            shutil.rmtree(self.path, ignore_errors=True)
        self._writer.release()

    def finish(self) -> None:
        """The run completed: remove the run-state directory whole (renamed aside first, so a
        kill part-way leaves no half-deleted run-state for ``--resume`` or ``policies
        rollback`` to find) and release the lock."""
        remove_dir(self.path)
        self.close()

    # ---- completed chunks' outputs (written once each, not in every checkpoint)

    def _done_path(self, chunk: int) -> Path:
        return self.path / DONE_DIR / f"c{chunk:06d}.npz"

    def save_done(self, chunk: int, outputs: dict) -> None:
        """Store completed chunk ``chunk``'s per-user outputs ``{user: {key: (T, ...)}}``."""
        self._drop_superseded()
        users = list(outputs)
        keys = sorted(outputs[users[0]]) if users else []
        arrays = {f"k_{k}": np.concatenate([outputs[u][k] for u in users]) for k in keys}
        lengths = np.array([len(outputs[u][keys[0]]) for u in users] if keys else [], np.int64)
        with atomic_file(self._done_path(chunk), "wb") as f:
            np.savez(f, users=np.array(users, dtype=str), lengths=lengths, **arrays)

    def load_done(self, chunk: int) -> dict:
        """The outputs :meth:`save_done` stored for ``chunk``."""
        path = self._done_path(chunk)
        try:
            with np.load(path, allow_pickle=False) as z:
                users, lengths = z["users"].tolist(), z["lengths"]
                arrays = {k[2:]: z[k] for k in z.files if k.startswith("k_")}
        except Exception as e:  # noqa: BLE001 - a missing or damaged file cannot be resumed
            raise InputError(f"cannot read the outputs of completed users chunk {chunk} ({type(e).__name__}: {e}); "
                             f"remove {self.path} to start over", where=str(path)) from None
        out, lo = {}, 0
        for u, t in zip(users, lengths):
            out[u] = {k: a[lo:lo + t] for k, a in arrays.items()}
            lo += int(t)
        return out

    # ---- snapshots

    def _snapshots(self) -> list[tuple[int, Path]]:
        out = []
        if self.path.is_dir():
            for p in self.path.iterdir():
                if p.name.startswith("s") and p.name[1:].isdigit():
                    out.append((int(p.name[1:]), p))
        return sorted(out)

    def _command_of(self, snaps) -> str:
        for _, p in reversed(snaps):
            try:
                return json.loads((p / META_FILE).read_text())["command"]
            except Exception:  # noqa: BLE001 - damaged: say something generic
                continue
        return "unknown"

    def save(self, meta: dict, trees: dict[str, Any]) -> Path:
        """Write a checkpoint of ``meta`` (JSON) and ``trees`` (pytrees); atomic; keeps the
        newest :data:`KEEP`."""
        self._drop_superseded()
        snaps = self._snapshots()
        step = (snaps[-1][0] + 1) if snaps else 1
        specs, arrays = {}, {}
        for name, tree in trees.items():
            specs[name], leaves = encode_tree(tree, where=f"run-state {name}")
            arrays.update({f"{name}.{i:06d}": np.ascontiguousarray(a) for i, a in enumerate(leaves)})
        tmp = temp_dir(".tmp-", self.path)
        try:
            if arrays:                  # one file: an orbax checkpoint took ~0.2 s a save and 0.4 s to import
                with open(tmp / ARRAYS_FILE, "xb") as f:
                    np.savez(f, **arrays)
            write_json(tmp / META_FILE, {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                                         "command": self.command, "fingerprint": self.fingerprint,
                                         "paths": self.paths,
                                         "meta": meta, "specs": specs})
            checksums.write_checksums(tmp)
            dest = self.path / f"s{step:08d}"
            os.rename(tmp, dest)
            fsync_dir(self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, old in self._snapshots()[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        self.saved += 1
        return dest

    def _load(self, snaps) -> Checkpoint:
        skipped = []
        for step, snap in reversed(snaps):
            reason = _verify(snap)
            if reason is None:
                try:
                    ck = self._read(step, snap)
                except InputError:
                    raise
                except Exception as e:  # noqa: BLE001 - any read failure = damaged checkpoint
                    reason = f"unreadable ({type(e).__name__}: {e})"
                else:
                    if skipped:
                        self.notes.append(f"{self.path}: checkpoint {skipped[-1][0]} is damaged ("
                                          + "; ".join(f"{s}: {r}" for s, r in skipped)
                                          + f"); resuming from the previous good one, {snap.name}")
                    return ck
            skipped.append((snap.name, reason))
        raise InputError("no usable checkpoint (" + "; ".join(f"{s}: {r}" for s, r in skipped)
                         + f"); remove {self.path} to start over", where=str(self.path))

    def _read(self, step: int, snap: Path) -> Checkpoint:
        doc = json.loads((snap / META_FILE).read_text())
        if doc.get("format") != FORMAT or doc.get("format_version") not in READS_FORMAT_VERSIONS:
            raise ValueError(f"not a {FORMAT} checkpoint of format {READS_FORMAT_VERSIONS}")
        if doc["command"] != self.command:
            option = option_of("resume")             # read within begin(), under its caller's wording
            how = (f"`{doc['command']} {option}`" if option
                   else f"a `{doc['command']}` run with {named('resume', True)}")
            raise InputError(f"holds an interrupted `{doc['command']}` run, not `{self.command}`; finish it "
                             f"with {how}, or remove {self.path}", where=str(self.path))
        try:
            check_fingerprint(doc["fingerprint"], self.fingerprint, self.path, doc.get("paths"), self.paths)
        except InputError as e:      # a run begin() would start again: say so (its store grew since, say)
            if self._restart is None or not self._restart(doc["fingerprint"]):
                raise
            raise InputError(f"{e.message}; or run it again without {named('resume', True)}: it starts again, and "
                             "what it saved is remembered (not learned twice)", where=e.where) from None
        counts = {name: len(leaf_specs(spec)) for name, spec in doc["specs"].items()}
        arrays = _read_arrays(snap, counts, doc["format_version"]) if any(counts.values()) else {}
        trees = {}
        for n, spec in doc["specs"].items():  # orbax gave 0-d arrays back as (1,); .npy ml_dtypes as raw bytes
            leaves = []
            for i, ls in enumerate(leaf_specs(spec)):
                a = np.asarray(arrays[n][i])
                if str(a.dtype) != ls["dtype"] and a.dtype.kind == "V":
                    a = a.view(np.dtype(ls["dtype"]))
                if str(a.dtype) != ls["dtype"]:
                    raise ValueError(f"{n} leaf {i}: dtype {a.dtype}, expected {ls['dtype']}")
                leaves.append(a.reshape(ls["shape"]))
            trees[n] = decode_tree(spec, leaves)
        return Checkpoint(step, snap, doc["meta"], trees)
