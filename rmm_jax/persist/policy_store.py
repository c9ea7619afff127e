"""Per-user reranker policies on disk: a versioned, crash-safe, locked policy store that
scales to 100,000s of users.

Every user of an agent has a small reranker policy, a :class:`rmm_jax.core.types.UserState`
(params, optimiser state, learner state) adapted online. The online learner produces these
for many users at once, with a leading *users* axis on every leaf (``vmap``), so the store
saves and loads stacked states: :meth:`PolicyStore.save` cuts one into chunks of users,
each a self-contained directory in which every user's state is one separately checksummed
row (:mod:`rmm_jax.persist.policy_snapshot`, :mod:`rmm_jax.persist.policy_rows`), and a
SQLite index maps ``user_id -> versions`` (:mod:`rmm_jax.persist.policy_index`).
:meth:`PolicyStore.load_batch` reads many users back stacked, each chunk once;
:meth:`PolicyStore.load` reads one user's row. Scoring a query with a stored user's policy
is :class:`rmm_jax.online.serve.Reranker`.

This module is the store's face: creating and opening, the writer's lock, and the methods
users call, each handing its work to the part that owns it: the checks of their arguments
(:mod:`~rmm_jax.persist.policy_checks`), the header (:mod:`~rmm_jax.persist.policy_header`),
the chunks on disk (:mod:`~rmm_jax.persist.policy_snapshot`, :mod:`~rmm_jax.persist.policy_rows`),
which version loads (:mod:`~rmm_jax.persist.policy_restore`), the index with its repair,
commits and garbage collection (:mod:`~rmm_jax.persist.policy_versions`), the shared part
(:mod:`~rmm_jax.persist.policy_shared`) and the listings and sizes ``rmm-jax policies``
prints (:mod:`~rmm_jax.persist.policy_report`).

On-disk layout (``STORE`` is the directory given to :meth:`PolicyStore.create`)::

    STORE/
      policy_store.json        format marker + meta {kind, dim, hidden, scope, rank, config} + settings
      index.sqlite             user -> versions, version -> shared version (policy_index.py)
      .lock                    flock'ed by the one writer (persist/lock.py; pid/host inside, advisory)
      shared/v00000001/c0000/  the shared part: params, optimiser state, info; one copy per version
      gens/v00000007/c0000/    one save call = one version; one chunk = chunk.json + rows.bin +
                               CHECKSUMS.json for its users only (policy_rows.py)

**Versions.** Each user keeps its newest ``keep`` versions (default :data:`DEFAULT_KEEP`; set
at :meth:`PolicyStore.create` or :meth:`PolicyStore.open`, stored in the header by the next
writer). **Scopes** (``meta["scope"]``; absent means ``"user"``): ``user``, each user has a
full policy; ``shared``, one policy for everyone (:meth:`PolicyStore.save_shared`, once per
shared version) and per-user learner states only (params/opt_state may be ``{}``);
``hybrid``, the shared params plus each user's low-rank factors of rank ``meta["rank"]``.
In ``shared`` and ``hybrid`` every saved user version records the shared version it was
trained against, and a load pairs them exactly (:mod:`rmm_jax.persist.policy_restore`): the
user's newest version whose row verifies AND whose shared version loads, never factors
with another shared version. So the shared versions a kept user version references are
never pruned, nor is the store's start (:meth:`PolicyStore.start_shared_version`, the
version it was created or pretrained with); of the others the newest ``keep`` stay. An
online run saves a shared version per users chunk (its users pair with it), so a store
keeps about ``keep`` x users / users per chunk shared versions when every run saves every
user, and up to ``keep`` x users (and the start) when each run saves a few, each the shared
part's full size (:meth:`PolicyStore.shared_total_bytes`; ``rmm-jax policies show`` prints it).

**Scale.** Looking up or saving one user touches nothing that grows with the number of
users: a load is one indexed SQLite query, one chunk's ``chunk.json`` (verified against its
``CHECKSUMS.json``) and the user's own row (verified against its digest), a save of U users
writes U users' rows and one O(U) transaction. Chunks are
sized by bytes (``chunk_bytes``, default 8 MiB: 2 users of a full d=384 policy, ~56 hybrid
low-rank users, up to :data:`MAX_CHUNK_USERS` tiny shared-scope learner states);
``chunk_size`` (users per chunk) overrides it.

**Crash safety.** Every version directory is written by :func:`rmm_jax.persist.atomic.atomic_dir`
(a hidden temp dir renamed into place after every chunk's ``CHECKSUMS.json``); only then is a
user version committed to the index, in one transaction that also trims each saved user to
``keep`` versions and drops the versions nobody keeps. Directories are deleted only after
the commit that stops referencing them. A kill at any point leaves either no new version or
a complete one. Leftovers (temp dirs, a snapshot renamed but never committed, a dropped
version not yet deleted) are removed by the next writer. A missing or corrupt
``index.sqlite`` is rebuilt from the snapshots' ``chunk.json`` files (in memory by a reader,
on disk by the next writer). Stores of formats 1 (``index.json``, orbax chunks) and 2
(``arrays.npz`` chunks) open as they are; their first writer migrates the index
(:mod:`rmm_jax.persist.policy_format1`) and writes new versions as rows, and their old
snapshots stay readable until garbage-collected.

**Restores.** A load verifies the checksums of what it reads, before it uses it: each user's
row has its own digest, so a damaged row costs that user its version and no other user
theirs. A damaged version is skipped for the previous one, reported in the result's
``skipped`` and by a
:class:`PolicyRestoreWarning`. Not orbax's CheckpointManager: it verifies no content
checksums, does not fall back past a damaged step and keeps N steps, not N per user.

Pytrees are stored structure-agnostically with :mod:`rmm_jax.persist.codec` (NamedTuples such
as optax's ``ScaleByAdamState`` and :class:`rmm_jax.core.types.LearnerState` are re-imported
by name), so a restored Adam state has the same tree type and optax keeps using it.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import os
import weakref
from pathlib import Path
from typing import Iterator, Sequence

from rmm_jax.core.checks import is_int, is_real, short
from rmm_jax.core.scope import Scope
from rmm_jax.core.types import SharedState, UserState
from rmm_jax.errors import InputError
from rmm_jax.persist import policy_report, policy_rollback
from rmm_jax.persist.atomic import atomic_dir
from rmm_jax.persist.learned_calls import LearnedCalls
from rmm_jax.persist.lock import WriterLock
from rmm_jax.persist.policy_checks import (
    as_path,
    check_create,
    check_keep,
    check_save,
    check_save_shared,
    check_user_ids,
    check_version,
    json_dict,
)
from rmm_jax.persist.policy_header import (  # noqa: F401 - the format constants, re-exported (were defined here)
    FORMAT,
    FORMAT_VERSION,
    READS_FORMAT_VERSIONS,
    STORE_FILE,
    new_header,
    read_header,
    write_header,
)
from rmm_jax.persist.policy_index import Entry, PolicyIndex, Save
from rmm_jax.persist.policy_meta import PolicyMeta
from rmm_jax.persist.policy_restore import Saved, SavedBatch, SavedShared, candidates, one_user, restore_batch
from rmm_jax.persist.policy_shared import SharedParts
from rmm_jax.persist.policy_snapshot import encode_users, vname, write_snapshot
from rmm_jax.persist.policy_versions import (
    INDEX_DB,
    IndexReader,
    build_index,
    commit_save,
    next_version,
    previous_versions,
    prune_shared,
    repair,
    writer_index,
)
from rmm_jax.persist.rollback import PolicyRestoreWarning, Skip

__all__ = ["PolicyStore", "PolicyMeta", "Saved", "SavedBatch", "SavedShared", "Skip", "Entry", "Save",
           "PolicyRestoreWarning", "DEFAULT_KEEP"]

LOCK_FILE = ".lock"
DEFAULT_KEEP = 3
DEFAULT_CHUNK_BYTES = 8 << 20  # 4-16 MB per chunk: the file count stays proportional to bytes
MAX_CHUNK_USERS = 4096         # bounds the chunk.json a load parses when states are tiny


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _open_dir(path: Path) -> int:
    """A descriptor of store directory ``path``; the InputError :func:`read_header` gives
    when it is none (missing, not a directory)."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        read_header(path)                       # says why, in one line
        raise InputError(f"cannot open the policy store's directory: {e.strerror}", where=str(path)) from None


def _locked_error(path: Path, holder: dict) -> InputError:
    """The busy error of the store at ``path`` whose lock ``holder`` (its record) holds."""
    err = InputError(f"policy store {path} is locked by pid {holder.get('pid', '?')} on host "
                     f"{holder.get('host', '?')} (another writer is running; retry when it ends)")
    err.where = str(path)
    return err


# --------------------------------------------------------------------------- the store


class PolicyStore:
    """A directory of per-user reranker policies (see the module docstring).

    Open with :meth:`open`, make with :meth:`create`. Readers need no lock; every write
    runs inside :meth:`writer`, which holds an exclusive ``flock`` on ``STORE/.lock``.
    """

    def __init__(self, path: str | os.PathLike, *, keep: int | None = None):
        self.path = as_path(path)
        # the directory held open: its identity cannot be another's (a directory deleted and made again may reuse
        # the inode number of a closed one), so replaced() tells a rebuilt store from this one
        dir_fd = _open_dir(self.path)
        self._close_dir = weakref.finalize(self, os.close, dir_fd)       # by close() or garbage collection
        st = os.fstat(dir_fd)
        self._identity = (st.st_dev, st.st_ino)
        self._header = read_header(self.path)
        self.meta: dict = self._header["meta"]
        stored = int(self._header.get("keep_versions", DEFAULT_KEEP))
        self.keep: int = stored if keep is None else check_keep(keep, str(self.path))
        cs = self._header.get("chunk_size")
        self.chunk_size: int | None = None if cs is None else int(cs)
        self.chunk_bytes: int = int(self._header.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        # not a bound method: the cycle store -> lock -> store kept every store (its index connection, its
        # directory) for the cyclic garbage collector
        self._lock = WriterLock(self.path / LOCK_FILE, functools.partial(_locked_error, self.path))
        self._index = IndexReader(self.path)
        self._shared = SharedParts(self.path / "shared", str(self.path))

    @property
    def scope(self) -> Scope:
        """The :class:`rmm_jax.core.scope.Scope` the store's metadata records."""
        return Scope.from_meta(self.meta)

    def meta_info(self) -> PolicyMeta:
        """The store's metadata, typed (:attr:`meta` is the dict on disk)."""
        return PolicyMeta.from_dict(self.meta)

    @property
    def paired(self) -> bool:
        """Whether user versions are paired with the shared version they were trained
        against (scopes with a shared part)."""
        return self.scope.has_shared

    # ---- create / open

    @classmethod
    def create(cls, path, meta: PolicyMeta | dict, shared_params, *, keep: int = DEFAULT_KEEP,
               chunk_size: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, shared_opt_state=None,
               shared_info: dict | None = None) -> "PolicyStore":
        """Make a new store at ``path`` (must not exist or be empty) holding ``meta`` (a
        :class:`PolicyMeta`, or its dict as :meth:`PolicyMeta.to_dict` writes it) and the
        shared state (params, optionally its optimiser state and info) as shared version 1.
        Each user keeps ``keep`` versions. Chunks hold about ``chunk_bytes`` of arrays, or
        exactly ``chunk_size`` users if given. The whole directory appears atomically."""
        path = as_path(path)
        meta, shared_info = check_create(path, meta, shared_params, keep, chunk_size, chunk_bytes, shared_info)
        if path.exists():
            path.rmdir()
        with atomic_dir(path, overwrite=False) as tmp:
            write_header(tmp, new_header(meta, keep, chunk_size, chunk_bytes, _now()))
            PolicyIndex.create(tmp / INDEX_DB).close()
            SharedParts.write(tmp / "shared", 1, SharedState(shared_params, shared_opt_state), shared_info, _now())
        return cls(path)

    @classmethod
    def open(cls, path, expect_dim: int | None = None, *, keep: int | None = None) -> "PolicyStore":
        """Open an existing store; with ``expect_dim`` check the embedding dimension. With
        ``keep`` this store keeps that many versions per user from its next write on (the
        writer stores the setting); None keeps the store's setting."""
        if expect_dim is not None and not is_int(expect_dim):    # "384" read "has dim 384, expected 384"
            raise InputError(f"must be an int (the embedding dimension), got {short(expect_dim)}", arg="expect_dim")
        store = cls(path, keep=keep)
        if expect_dim is not None and store.meta["dim"] != expect_dim:
            raise InputError(f"policy store has dim {store.meta['dim']}, expected {expect_dim} "
                             "(made for another embedding model?)", where=str(path))
        return store

    # ---- the writer

    @contextlib.contextmanager
    def writer(self, wait: float = 0.0):
        """Hold the store's write lock (re-entrant in this object).

        Raises InputError naming the holder's pid and host if another process (or another
        PolicyStore object) holds it, after waiting up to ``wait`` seconds (a number >= 0). The lock is
        released when the holder exits or dies, so a stale ``.lock`` file is harmless. The
        outermost hold first repairs what a killed writer left (temp dirs, a missing or
        corrupt index, a format-1 index, unindexed snapshots), stores this object's
        ``keep`` in the header and marks the store as written in the current format.
        """
        if not (is_real(wait) and wait >= 0):     # "1" was a TypeError from a comparison, -1 taken
            raise InputError(f"must be a number of seconds >= 0, got {short(wait)}", arg="wait")
        with self._lock.hold(wait) as outermost:
            if outermost:
                self._repair()
            yield self

    def check_not_busy(self) -> None:
        """Raise the busy error :meth:`writer` would if another writer holds the store now,
        without taking its lock (taking it repairs the store and records this object's
        ``keep``: a run refused later, for its input, must leave the store as it was)."""
        self._lock.check_free()

    def replaced(self) -> bool:
        """Whether :attr:`path` no longer names the directory this object opened: the store was
        deleted and made again (docs/lifecycle.md: "delete the directory to start afresh"),
        or another directory was renamed over it, or it is gone. One ``stat``. This object
        holds its directory open until :meth:`close`, so a new directory cannot take its
        inode number; after :meth:`close` it may, unseen."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._identity

    def close(self) -> None:
        """Release what this object holds open: its index connections (every thread's) and
        its directory's descriptor. Idempotent. Not needed for correctness (garbage
        collection releases them too), but a long-lived process that replaces its store
        objects (:meth:`rmm_jax.online.serve.Reranker.refresh`) frees them at once. The
        object stays usable: a later read reopens the index, so a thread still reading it
        finishes its read (:meth:`replaced` can then no longer tell a rebuilt store)."""
        old, self._index = self._index, IndexReader(self.path)
        old.close()             # every thread's connection (one mid-query finishes it first)
        self._close_dir()

    def _repair(self) -> None:
        """Under the lock: no leftovers of killed writers, a usable index.sqlite (migrated
        or rebuilt), the header current, no snapshot dir the index does not list, no shared
        version left that pruning would remove."""
        self._header = repair(self.path, self._header, self.keep, self.chunk_bytes)
        self._prune_shared()
        policy_rollback.finish(self)            # a rollback a kill interrupted

    def _write_header(self, header: dict) -> None:
        """Replace ``policy_store.json`` with ``header`` (atomically; under the writer's lock)."""
        write_header(self.path, header)
        self._header = header

    def _forget_shared_cache(self) -> None:
        """Forget what this object read of the shared versions (after some were deleted)."""
        self._shared = SharedParts(self.path / "shared", str(self.path))

    def _prune_shared(self) -> None:
        keep = {self.learned_shared_version(), self.start_shared_version()} - {None}
        refs = self._query(lambda idx: idx.shared_refs())
        prune_shared(self.path / "shared", refs | keep, self.keep)

    # ---- the index

    def _query(self, fn):
        """``fn(index)`` on index.sqlite (read-only), or on an index rebuilt in memory."""
        return self._index.query(fn, self._header, self.keep)

    def _build_index(self, path: Path | None) -> PolicyIndex:
        """An index from index.json (format 1) or else from the snapshots, at ``path`` or in memory."""
        return build_index(self.path, self._header, self.keep, path)

    def users(self) -> list[str]:
        """User ids that have at least one saved version, sorted."""
        return self._query(lambda idx: idx.users())

    def n_users(self) -> int:
        """How many users have at least one saved version."""
        return self._query(lambda idx: idx.n_users())

    def has_user(self, user_id: str) -> bool:
        """Whether ``user_id`` has a saved version (one indexed lookup)."""
        return self._query(lambda idx: idx.has_user(user_id))

    def entries(self, user_id: str) -> list[Entry]:
        """``user_id``'s kept versions, oldest first ([] if unknown): version, chunk, row,
        saved_at and the shared version each was trained against."""
        return self._query(lambda idx: idx.entries([user_id]))[user_id]

    def saves(self) -> list[Save]:
        """Every kept user version: saved_at, shared version, how many users keep it."""
        return self._query(lambda idx: idx.saves())

    def newest_version(self) -> int | None:
        """The newest user version any user keeps (None: none); one indexed query. It differs
        after every save (numbers are never reused); a rollback of the newest run brings it
        back to its value before that run (:func:`rmm_jax.persist.policy_rollback.rollbacks`
        counts rollbacks)."""
        return self._query(lambda idx: idx.newest_version())

    def next_version(self) -> int:
        """The version number the next :meth:`save` will take (every saved one is below it)."""
        return next_version(self.path / "gens", self._query(lambda idx: idx.next_version()))

    def listing(self, users: Sequence[str] | None = None) -> Iterator[tuple[str, list[Entry], dict]]:
        """``(user, entries, info)`` for every user (sorted) or for the stored ones of
        ``users`` (in that order); the info is the newest version's (unverified)."""
        yield from self._query(lambda idx: list(policy_report.listing(idx, self.path / "gens", users)))

    # ---- bytes

    def user_bytes(self, user_id: str, version: int | None = None) -> dict:
        """On-disk size of ``user_id``'s newest entry (or ``version``): its row's share of
        its chunk's array file (:func:`rmm_jax.persist.policy_report.user_bytes`)."""
        version = check_version(version)
        return policy_report.user_bytes(self.path / "gens", user_id, self.entries(user_id), version)

    def shared_bytes(self, version: int | None = None) -> dict:
        """On-disk size of the newest shared version (or ``version``): ``{version, bytes,
        array_bytes}`` (``array_bytes``: raw params + optimiser-state bytes)."""
        version = check_version(version)
        return policy_report.shared_bytes(self.path / "shared", self.shared_versions(), version)

    def shared_total_bytes(self) -> int:
        """On-disk size of every shared version on disk together: in scopes ``shared`` and
        ``hybrid`` an online run saves one per users chunk, kept while a kept user version
        pairs with it (:func:`rmm_jax.persist.policy_report.shared_total_bytes`)."""
        return policy_report.shared_total_bytes(self.path / "shared", self.shared_versions())

    # ---- the shared part

    def shared_versions(self) -> list[int]:
        """Shared versions on disk, ascending (whether they load or not)."""
        return self._shared.versions()

    def save_shared(self, state: SharedState, info: dict | None = None) -> int:
        """Store ``state`` (params and optimiser state; an optax state of NamedTuples is
        fine, None if there is none) as a new shared version with a JSON ``info`` dict;
        returns the version. Pass it as ``shared_version`` when saving the users trained
        against it. Shared versions beyond the newest ``keep`` that no kept user version
        references are pruned, except the store's start. ``info`` ``{"source": "online"}``
        marks a version an online run saved (:class:`rmm_jax.online.sinks.PolicySink`):
        the start is the newest version without it."""
        info = check_save_shared(state, info, self.meta)
        with self.writer(), writer_index(self.path, self._header, self.keep) as idx:
            version = self._shared.add(idx, state, info, _now())
            self._prune_shared()
            return version

    def start_shared_version(self) -> int | None:
        """The newest shared version that no online run saved: the one the store was created
        or pretrained with, where ``--init pretrained`` starts and a rollback past every user
        version returns to. Never pruned. None: none on disk (a store whose online runs
        pruned it, before this was kept)."""
        return next((v for v in reversed(self.shared_versions()) if self._shared.online(v) is False), None)

    def learned_shared_version(self) -> int | None:
        """The shared version the newest user version was trained against: the shared part
        as the last saved users left it. A newer shared version is not yet part of what the
        users learned: a run killed between saving a chunk's shared part and its users
        leaves one behind, so a run that continues takes the shared part from here (and
        gives the policies of an uninterrupted run). With no user version yet, it is the
        newest shared version no online run saved (the one the store was created or
        pretrained with; never pruned while so). None: not paired, or no such version."""
        if not self.paired:
            return None
        last = self._query(lambda idx: idx.last_shared())
        if last is not None or self.n_users():
            return last
        return self._shared.newest_not_online()

    def shared_state(self, version: int | None = None) -> SavedShared:
        """Shared ``version``, or the newest shared version that loads (older ones used with
        a :class:`PolicyRestoreWarning`): its state, info, version and the versions skipped.
        The arrays are shared with later calls: read-only."""
        return self._shared.state(check_version(version))

    # ---- users

    def save(self, user_ids: Sequence[str], state: UserState, infos: Sequence[dict] | None = None, *,
             shared_version: int | None = None, chunk_size: int | None = None,
             learned: LearnedCalls | None = None, run: dict | None = None) -> int:
        """Save many users from ONE stacked :class:`UserState` (every leaf has a leading
        users axis, as the online loop produces them) as a new version; returns it.

        ``infos`` (JSON dicts) align with ``user_ids``. Any part may be an empty tree
        (``{}``/None), e.g. params in ``shared`` scope. ``shared_version``: the shared
        version these states were trained against (:meth:`save_shared`'s result); required
        in scopes ``shared`` and ``hybrid``, where a load pairs them. ``learned``: the calls
        each of these policies has learned from, stacked likewise
        (:mod:`rmm_jax.persist.learned_calls`; None: none, and the rows hold no record), saved
        in each user's row, so in the same atomic step as the state. ``run``: a JSON dict the
        run that saves records in the version (the CLI's runs: where the run began, what it
        found, :mod:`rmm_jax.persist.policy_rollback`). Each saved user then keeps its newest
        ``keep`` versions; the version records, per user, the one it had before (None: none).
        """
        user_ids, infos = check_save(user_ids, state, infos, chunk_size, scope=self.scope,
                                     shared_version=shared_version, meta=self.meta)
        specs, stacked = encode_users(state, learned, len(user_ids))
        with self.writer(), writer_index(self.path, self._header, self.keep) as idx:
            if shared_version is not None and shared_version not in self.shared_versions():
                raise InputError(f"shared version {shared_version} does not exist (on disk: "
                                 f"{self.shared_versions()})", where=str(self.path))
            gens = self.path / "gens"
            version = next_version(gens, idx.next_version())
            saved_at = _now()
            head = {"version": version, "saved_at": saved_at, "shared_version": shared_version,
                    **({"run": json_dict(run, "run", "save: run")} if run is not None else {})}
            placed = write_snapshot(gens / vname(version), head, user_ids, specs, stacked, infos,
                                    previous_versions(idx, user_ids), chunk_size or self.chunk_size,
                                    self.chunk_bytes, MAX_CHUNK_USERS)
            commit_save(self.path, self._header, self.keep, idx, version, saved_at, placed, shared_version)
            self._prune_shared()
            return version

    def load(self, user_id: str, *, version: int | None = None) -> Saved:
        """Restore ``user_id``'s newest version that loads (or exactly ``version``).

        In scopes ``shared``/``hybrid`` a version loads only together with the shared
        version it was trained against (``Saved.shared_version``; read it with
        :meth:`shared_state`). Skipped versions are in ``Saved.skipped`` and raise a
        :class:`PolicyRestoreWarning`; if none loads, an InputError names the user, each
        version and why (the shared version it needs, if that is the problem).
        """
        check_user_ids([user_id], arg="user_id")     # was named "users", load_batch's argument
        return one_user(self._load([user_id], version, missing_ok=False))

    def load_batch(self, user_ids: Sequence[str], *, before: int | None = None) -> SavedBatch:
        """Restore every stored one of ``user_ids`` (newest version that loads, as
        :meth:`load`), stacked on a leading users axis; the others are listed in
        ``missing``. Each chunk is verified and read once (again only for a fallback).
        This is how a run continues from a store: ``users`` resume from ``state``, trained
        against ``shared_versions``; ``missing`` users start afresh. ``before``: only
        versions older than it (:meth:`next_version` when the run began), so a resumed run
        starts every user where the interrupted one did, whatever it saved since (a user
        first saved since is missing); a user whose every such version was pruned is an error."""
        return self._load(user_ids, None, missing_ok=True, before=before)

    def _load(self, user_ids: Sequence[str], version: int | None, *, missing_ok: bool,
              before: int | None = None) -> SavedBatch:
        ids = check_user_ids(user_ids)
        version, before = check_version(version), check_version(before, "before")
        if len(set(ids)) != len(ids):
            raise InputError(f"user {next(u for u in ids if ids.count(u) > 1)!r} is requested twice", arg="users")

        def entries():
            return candidates(self._query(lambda idx: idx.entries(ids)), ids, version=version, before=before,
                              keep=self.keep, where=str(self.path))

        found = entries()
        missing = [u for u in ids if not found[u]]
        if missing and not missing_ok:
            raise InputError(f"no saved policy for user {missing[0]!r} (known users: {self.n_users()})",
                             where=str(self.path))
        return restore_batch(self.path / "gens", [u for u in ids if found[u]], found, missing, entries,
                             shared_problem=self._shared.problem if self.paired else None, stacklevel=3)
