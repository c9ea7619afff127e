"""Which saved versions a policy store holds, and which go: the index with its fallback
and rebuild, what a killed writer left, and garbage collection.

The index (:mod:`rmm_jax.persist.policy_index`) is the truth about versions. When
``index.sqlite`` is missing or corrupt it is rebuilt from the snapshots' ``chunk.json``
files (or a format-1 store's ``index.json``, :mod:`rmm_jax.persist.policy_format1`): in
memory by a reader (:class:`IndexReader`, which never writes), on disk by the writer
(:func:`writer_index`). Directories are deleted only after the commit that stops
referencing them (:func:`drop_unindexed`, :func:`prune_shared`).
"""
from __future__ import annotations

import contextlib
import shutil
import threading
import weakref
from pathlib import Path

from rmm_jax.errors import InputError
from rmm_jax.persist import policy_format1
from rmm_jax.persist.atomic import leftovers, remove_dir
from rmm_jax.persist.policy_header import FORMAT_VERSION, STORE_FILE, write_header
from rmm_jax.persist.policy_index import HotJournal, IndexUnavailable, PolicyIndex
from rmm_jax.persist.policy_snapshot import snapshot_dirs, snapshot_records, vname

INDEX_DB = "index.sqlite"


def version_span(versions) -> str:
    """Sorted version numbers as messages name them: ``v3``, or ``v3-v7`` for several.

    Examples:
      >>> from rmm_jax.persist.policy_versions import version_span
      >>> version_span([3]), version_span([3, 5, 7])
      ('v3', 'v3-v7')
    """
    return f"v{versions[0]}" if len(versions) == 1 else f"v{versions[0]}-v{versions[-1]}"


def build_index(store: Path, header: dict, keep: int, path: Path | None) -> PolicyIndex:
    """An index of store ``store`` from its format-1 ``index.json`` or else from its
    snapshots, at ``path`` (replacing the file) or in memory (None)."""
    snaps = snapshot_dirs(store / "gens")
    top = (snaps[-1][0] + 1) if snaps else 1
    legacy = policy_format1.index_records(store, header)
    if legacy is not None:
        return PolicyIndex.build(path, legacy[0], keep=keep, next_version=max(legacy[1], top))
    return PolicyIndex.build(path, snapshot_records(store / "gens"), keep=keep, next_version=top)


class _Connection:
    """One thread's read-only connection to index.sqlite. Its thread uses it under
    :attr:`lock`; any thread may :meth:`close` it (under the same lock, so never mid-query)."""

    def __init__(self, key: tuple, idx: PolicyIndex):
        self.key, self.idx, self.closed = key, idx, False
        self.lock = threading.RLock()
        self.owner = weakref.ref(threading.current_thread())

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                self.idx.close()

    def orphaned(self) -> bool:
        """Whether the thread that opened it has ended (nothing will use it again)."""
        owner = self.owner()
        return owner is None or not owner.is_alive()


def _close_all(conns: list, lock: threading.Lock) -> None:
    """Close every connection in ``conns`` (a reader's record) and forget them."""
    with lock:
        taken, conns[:] = list(conns), []
    for c in taken:
        c.close()


class IndexReader:
    """Read-only queries on a store's index; an index rebuilt in memory while the file is
    missing or corrupt, cached until the snapshots or ``index.json`` change.

    The read-only connection stays open between queries (opening one costs more than an
    indexed lookup), one per thread, for as long as the file is the same file: a rebuild
    replaces it under a new inode, and the next query opens that. An open connection
    sees every commit (SQLite checks at the start of each read). The reader records every
    connection it opens: :meth:`close` closes them all, whichever thread opened them, and so
    does dropping the reader (a finalizer: an ``sqlite3.Connection`` sits in a reference
    cycle with its statement cache, so without it only the cyclic collector would)."""

    def __init__(self, store: Path):
        self.store = store
        self._fallback: tuple[object, PolicyIndex] | None = None
        self._open = threading.local()
        self._conns: list[_Connection] = []
        self._conns_lock = threading.Lock()
        weakref.finalize(self, _close_all, self._conns, self._conns_lock)

    def query(self, fn, header: dict, keep: int):
        """``fn(index)`` on index.sqlite, or on the in-memory rebuild. A connection opened before a
        writer was killed inside a commit meets its hot journal (:class:`HotJournal`): it is
        opened again, which reads the last commit, not rebuilt from the snapshots."""
        try:
            while True:
                conn = self._connection()
                with conn.lock:
                    if not conn.closed:
                        try:
                            return fn(conn.idx)
                        except HotJournal:
                            conn.close()        # below: opened again, from a rolled-back copy
                            self._close()
                            continue
                # closed by close() from another thread meanwhile: open it again
        except IndexUnavailable:
            self._close()
            if not self.store.is_dir():     # was answered from no snapshots: "no saved policy ... (known users: 0)"
                raise InputError("the policy store's directory is gone (deleted or moved since it was opened)",
                                 where=str(self.store)) from None
            return fn(self._rebuilt(header, keep))

    def close(self) -> None:
        """Close every thread's connection (a thread mid-query finishes it first). Idempotent;
        the reader stays usable: a later query opens a connection again."""
        _close_all(self._conns, self._conns_lock)

    def _connection(self) -> _Connection:
        path = self.store / INDEX_DB
        try:
            st = path.stat()
        except OSError:
            raise IndexUnavailable(f"{path}: missing") from None
        held = getattr(self._open, "held", None)
        if held is not None and not held.closed and held.key == (st.st_dev, st.st_ino) and not held.idx.stale():
            return held
        self._close()
        conn = _Connection((st.st_dev, st.st_ino), PolicyIndex.open(path, any_thread=True))
        with self._conns_lock:
            ended = [c for c in self._conns if c.orphaned()]
            self._conns[:] = [c for c in self._conns if c not in ended] + [conn]
        for c in ended:
            c.close()
        self._open.held = conn
        return conn

    def _close(self) -> None:
        """Close this thread's connection."""
        held = getattr(self._open, "held", None)
        if held is not None:
            self._open.held = None
            with self._conns_lock:
                if held in self._conns:
                    self._conns.remove(held)
            held.close()

    def _rebuilt(self, header: dict, keep: int) -> PolicyIndex:
        gens = self.store / "gens"
        key = (policy_format1.index_mtime(self.store), tuple(sorted(p.name for p in gens.iterdir()))
               if gens.is_dir() else ())
        if self._fallback is None or self._fallback[0] != key:
            if self._fallback is not None:
                self._fallback[1].close()
            self._fallback = (key, build_index(self.store, header, keep, None))
        return self._fallback[1]


@contextlib.contextmanager
def writer_index(store: Path, header: dict, keep: int, rebuild: bool = False):
    """The writable index (call under the writer's lock), rebuilt first if missing or
    corrupt (or if ``rebuild``)."""
    idx = None
    if not rebuild:
        with contextlib.suppress(IndexUnavailable):
            idx = PolicyIndex.open(store / INDEX_DB, readonly=False)
    if idx is None:
        idx = build_index(store, header, keep, store / INDEX_DB)
    try:
        yield idx
    finally:
        idx.close()


def live_versions(store: Path, header: dict, keep: int) -> set[int]:
    """The versions the (writable, repaired if need be) index keeps."""
    try:
        with writer_index(store, header, keep) as idx:
            return set(idx.live_versions())
    except IndexUnavailable:  # opened, but corrupt further in
        with writer_index(store, header, keep, rebuild=True) as idx:
            return set(idx.live_versions())


def remove_leftovers(store: Path) -> None:
    """Temp dirs and files that killed writers left (call under the writer's lock)."""
    for sub in (store, store / "gens", store / "shared"):
        for p in leftovers(sub):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def repair(store: Path, header: dict, keep: int, chunk_bytes: int) -> dict:
    """What a killed writer left, repaired (call under the writer's lock): no leftovers, a
    usable index.sqlite (migrated or rebuilt), the header current (format, ``keep``), no
    snapshot dir the index does not list. Returns the header now on disk."""
    remove_leftovers(store)
    live = live_versions(store, header, keep)
    header = policy_format1.finish_migration(store, store / STORE_FILE, header,
                                             format_version=FORMAT_VERSION, chunk_bytes=chunk_bytes)
    if header.get("keep_versions") != keep:
        header = {**header, "keep_versions": keep}
        write_header(store, header)
    drop_unindexed(store, header, keep, live)
    return header


def drop_unindexed(store: Path, header: dict, keep: int, live: set[int]) -> None:
    """Delete the snapshots under ``STORE/gens`` that no kept user version is in, after
    raising the index's next_version above them all. A number that a killed writer's
    snapshot took is never reused: a run notes :func:`next_version` before it repairs the
    store (its ``before``, which a resume keeps), and every version it saves must be at or
    above it, or the resumed run would count its own saves as learned before it began."""
    gens = store / "gens"
    with writer_index(store, header, keep) as idx:
        idx.reserve(next_version(gens, idx.next_version()))
    for v, snap in snapshot_dirs(gens):
        if v not in live:
            shutil.rmtree(snap, ignore_errors=True)


def previous_versions(idx: PolicyIndex, user_ids: list[str]) -> list[int | None] | None:
    """Each user's newest kept version before a save (None: none), or None when the index
    is corrupt further in (not recorded then: a rollback refuses to drop such users)."""
    try:
        had = {u: es[-1].version for u, es in idx.entries(user_ids).items() if es}
    except IndexUnavailable:
        return None
    return [had.get(u) for u in user_ids]


def commit_save(store: Path, header: dict, keep: int, idx: PolicyIndex, version: int, saved_at: str,
                placed: list[tuple[str, int, int]], shared_version: int | None) -> None:
    """Commit the written snapshot ``version`` (its users' ``placed`` rows) to the writer's
    index ``idx``, trimming each of its users to ``keep`` versions, then delete the
    snapshots nobody keeps. An index found corrupt under the commit is rebuilt from the
    snapshots, the new one included."""
    gens = store / "gens"
    try:
        dead = idx.commit_version(version, saved_at, placed, keep=keep, shared_version=shared_version)
    except IndexUnavailable:
        idx.close()
        with contextlib.closing(build_index(store, header, keep, store / INDEX_DB)) as rebuilt:
            live = set(rebuilt.live_versions())
        dead = [v for v, _ in snapshot_dirs(gens) if v not in live]
    for v in dead:
        shutil.rmtree(gens / vname(v), ignore_errors=True)


def prune_shared(shared: Path, refs: set[int], keep: int) -> None:
    """Delete the shared versions under ``shared`` that are neither among the newest
    ``keep`` nor referenced (``refs``, read from the committed index)."""
    for v, snap in snapshot_dirs(shared)[:-keep]:
        if v not in refs:
            remove_dir(snap)          # whole: a half-deleted version would read as one that is not online


def next_version(gens: Path, indexed_next: int) -> int:
    """The number the next save takes: above the index's and above every snapshot on disk."""
    existing = snapshot_dirs(gens)
    return max(indexed_next, (existing[-1][0] + 1) if existing else 1)
