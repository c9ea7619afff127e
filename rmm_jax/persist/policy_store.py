"""Per-user reranker policies on disk: a versioned, crash-safe, locked policy store that
scales to 100,000s of users.

Every user of an agent has a small reranker policy (params + optimiser state + learner
state) adapted online. The online learner produces these for many users at once, with a
leading *users* axis on every leaf (``vmap``), so the store's primary write path is
:meth:`PolicyStore.save_batch`: the stacked arrays are cut into chunks of users, each
chunk is one self-contained, checksummed directory (:mod:`rmm_jax.persist.policy_snapshot`),
and a SQLite index maps ``user_id -> (version, chunk, row)``
(:mod:`rmm_jax.persist.policy_index`). The per-user API (:meth:`PolicyStore.save_users`,
:meth:`PolicyStore.load_user`) sits on top of it. Scoring a query with a stored user's
policy is :func:`rmm_jax.online.scoring.score_query`.

On-disk layout (``STORE`` is the directory given to :meth:`PolicyStore.create`)::

    STORE/
      policy_store.json        format marker + meta {kind, dim, hidden, scope, rank, config} + settings
      index.sqlite             user -> versions (policy_index.py); -wal/-shm side files while in use
      .lock                    flock'ed by the one writer (persist/lock.py; pid/host inside, advisory)
      shared/v00000001/c0000/  the shared state: params, optimiser state, info; one copy per version
      gens/v00000007/c0000/    one save call = one version; one chunk = chunk.json + arrays.npz +
                               CHECKSUMS.json for its users only (policy_snapshot.py)

**Scale.** Looking up or saving one user touches nothing that grows with the number of
users: a load is one indexed SQLite query plus one chunk (its ``chunk.json``, checksums
and arrays), a save of U users writes U users' chunks and one O(U) transaction. Chunks
are sized by bytes (``chunk_bytes``, default 8 MiB: 2 users of a full d=384 policy, ~56
hybrid low-rank users, up to :data:`MAX_CHUNK_USERS` tiny shared-scope learner states);
``chunk_size`` (users per chunk) overrides it.

**Crash safety.** A snapshot is written into ``gens/.tmp-*`` and renamed into place
after every chunk's ``CHECKSUMS.json`` is written; only then is the version committed to
the index, in one transaction that also trims each saved user to ``keep_versions`` and
drops the versions nobody keeps (an indexed query). A kill at any point leaves either no
new version or a complete one. Leftovers (temp dirs, a snapshot renamed but never
committed, a dropped version not yet deleted) are removed by the next writer, which
deletes every snapshot dir the index does not list. A missing or corrupt
``index.sqlite`` is rebuilt from the snapshots' ``chunk.json`` files (in memory by a
reader, on disk by the next writer).

**Restores.** Loading verifies the checksums of the chunk it reads; a truncated or
corrupted version is skipped and the previous one is used, which is reported in
:attr:`PolicyStore.last_restore_report`, in :attr:`UserPolicy.version` and by a
:class:`PolicyRestoreWarning`. Not orbax's CheckpointManager (here or for run-state
snapshots): it verifies no content checksums and does not fall back past a damaged step
(and keeps N steps, not N per user).

**Scopes** (``meta["scope"]``; absent means ``"user"``). ``user``: each user has a full
policy. ``shared``: one policy for everyone, kept with its optimiser state by
:meth:`PolicyStore.set_shared` once per version; per-user entries hold only the learner
state (params and opt_state may be ``{}``). ``hybrid``: the shared params plus each user's
low-rank factors of rank ``meta["rank"]`` and their optimiser state. The store does not
interpret params; these shapes only change how many users fit a chunk.

Pytrees are stored structure-agnostically with :mod:`rmm_jax.persist.codec`: leaves in
JAX order, the structure as a JSON *spec* in ``chunk.json`` (NamedTuples such as optax's
``ScaleByAdamState`` and :class:`rmm_jax.core.types.LearnerState` are re-imported by
name), so a restored Adam state has the same tree type and optax can keep using it. A
``template`` pytree may be passed to restore into any other structure. Stores written
before ``LearnerState`` existed hold the learner state as a dict ``{baseline, key,
step}``; it is loaded as a ``LearnerState``.

**Format 1** stores (``index.json`` + one ``rows.json`` per snapshot) open and load as
they are; the first writer migrates the index to SQLite (index.sqlite in place, then the
header's format_version 2, then index.json deleted; each step safe to repeat) and writes
new versions in format 2. Old snapshots stay readable until garbage-collected.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import jax
import numpy as np

from rmm_jax.core.types import LearnerState
from rmm_jax.errors import InputError
from rmm_jax.persist.atomic import atomic_dir, atomic_file, fsync_dir, write_json
from rmm_jax.persist.codec import decode_tree, encode_tree, leaf_specs, unflatten_like
from rmm_jax.persist.lock import WriterLock
from rmm_jax.persist.policy_index import Entry, IndexUnavailable, PolicyIndex
from rmm_jax.persist.policy_snapshot import (
    SHARED_PARTS,
    USER_PARTS,
    chunk_array_bytes,
    cname,
    load_chunk,
    read_chunk,
    read_chunk_meta,
    read_shared,
    row_bytes,
    save_chunk,
    shared_meta,
    snapshot_dirs,
    snapshot_records,
    users_per_chunk,
    verify_snapshot,
    vname,
    write_chunk,
    write_shared,
)

__all__ = ["PolicyStore", "UserPolicy", "SharedSnapshot", "PolicyRestoreWarning", "verify_snapshot",
           "load_chunk", "save_chunk", "SCOPES"]

FORMAT = "rmm-jax-policy-store"
FORMAT_VERSION = 2
READS_FORMAT_VERSIONS = (1, 2)
STORE_FILE = "policy_store.json"
INDEX_DB = "index.sqlite"
INDEX_FILE = "index.json"  # format 1
LOCK_FILE = ".lock"
PARTS = USER_PARTS
KINDS = ("linear", "mlp")
SCOPES = ("user", "shared", "hybrid")
DEFAULT_KEEP = 3
DEFAULT_CHUNK_BYTES = 8 << 20  # 4-16 MB per chunk: one load reads and hashes ~8 MB
MAX_CHUNK_USERS = 4096         # bounds the chunk.json a load parses when states are tiny


class PolicyRestoreWarning(UserWarning):
    """A newer version failed verification and an older one was restored."""


@dataclasses.dataclass
class UserPolicy:
    """One user's policy: params, optimiser state, learner state and JSON ``info``.

    ``version`` is set on load: the store version that was actually restored.
    """

    params: Any
    opt_state: Any = None
    learner_state: Any = None
    info: dict = dataclasses.field(default_factory=dict)
    version: int | None = None


class SharedSnapshot(NamedTuple):
    """The shared state of a store: params, optimiser state (None if not saved), the
    shared version restored and its JSON info."""

    params: Any
    opt_state: Any
    version: int
    info: dict


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _is_legacy_learner_state(spec: dict) -> bool:
    """A learner state saved before :class:`LearnerState` existed: a dict {baseline, key, step}."""
    return spec["t"] == "dict" and spec["k"] == sorted(LearnerState._fields)


def _entry_dict(e: Entry) -> dict:
    return {"version": e.version, "chunk": cname(e.chunk), "row": e.row, "saved_at": e.saved_at}


def _json_dict(obj, what: str, where: str) -> dict:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise InputError(f"{what} must be a dict, got {type(obj).__name__}", where=where)
    try:
        json.dumps(obj)
    except (TypeError, ValueError) as e:
        raise InputError(f"{what} is not JSON-serialisable ({e})", where=where) from None
    return obj


def _is_pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


# --------------------------------------------------------------------------- the store


class PolicyStore:
    """A directory of per-user reranker policies (see the module docstring for layout).

    Open with :meth:`open`, make with :meth:`create`. Readers need no lock; every write
    runs inside :meth:`writer`, which holds an exclusive ``flock`` on ``STORE/.lock``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._header = self._read_header()
        self.meta: dict = self._header["meta"]
        self.keep_versions: int = int(self._header.get("keep_versions", DEFAULT_KEEP))
        cs = self._header.get("chunk_size")
        self.chunk_size: int | None = None if cs is None else int(cs)
        self.chunk_bytes: int = int(self._header.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        self.last_restore_report: dict | None = None
        self.restore_reports: dict[str, dict] = {}
        self._lock = WriterLock(self.path / LOCK_FILE, self._locked_error)
        self._fallback: tuple[Any, PolicyIndex] | None = None

    @property
    def scope(self) -> str:
        """``meta["scope"]``: ``user`` (the default), ``shared`` or ``hybrid``."""
        return self.meta.get("scope", "user")

    # ---- create / open

    @staticmethod
    def _check_meta(meta: dict, where: str) -> dict:
        if not isinstance(meta, dict):
            raise InputError("meta must be a dict with kind, dim, hidden, config", where=where)
        for key in ("kind", "dim", "hidden"):
            if key not in meta:
                raise InputError(f"meta is missing key '{key}'", where=where)
        if meta["kind"] not in KINDS:
            raise InputError(f"meta kind {meta['kind']!r} is not one of {KINDS}", where=f"{where}: key 'kind'")
        if not _is_pos_int(meta["dim"]):
            raise InputError(f"meta dim must be a positive int, got {meta['dim']!r}", where=f"{where}: key 'dim'")
        h = meta["hidden"]
        if h is not None and not _is_pos_int(h):
            raise InputError(f"meta hidden must be a positive int or None, got {h!r}", where=f"{where}: key 'hidden'")
        scope = meta.get("scope", "user")
        if scope not in SCOPES:
            raise InputError(f"meta scope {scope!r} is not one of {SCOPES}", where=f"{where}: key 'scope'")
        if "rank" in meta:
            if scope != "hybrid":
                raise InputError(f"meta rank is only for scope 'hybrid', not {scope!r}", where=f"{where}: key 'rank'")
            if not _is_pos_int(meta["rank"]):
                raise InputError(f"meta rank must be a positive int, got {meta['rank']!r}",
                                 where=f"{where}: key 'rank'")
        elif scope == "hybrid":
            raise InputError("meta scope 'hybrid' needs a rank (a positive int)", where=f"{where}: key 'rank'")
        meta = {**meta, "config": dict(meta.get("config") or {})}
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise InputError(f"meta is not JSON-serialisable ({e})", where=where) from None
        return meta

    @classmethod
    def create(cls, path, meta: dict, shared_params, *, keep_versions: int = DEFAULT_KEEP,
               chunk_size: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               shared_opt_state=None, shared_info: dict | None = None) -> "PolicyStore":
        """Make a new store at ``path`` (must not exist or be empty) holding ``meta`` and
        the shared state (params, optionally its optimiser state and info) as shared
        version 1. Chunks hold about ``chunk_bytes`` of arrays, or exactly ``chunk_size``
        users if given. The whole directory appears atomically."""
        path = Path(path)
        meta = cls._check_meta(meta, str(path))
        shared_info = _json_dict(shared_info, "shared info", str(path))
        if keep_versions < 1 or (chunk_size is not None and chunk_size < 1) or chunk_bytes < 1:
            raise InputError("keep_versions, chunk_size and chunk_bytes must be >= 1", where=str(path))
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise InputError("already exists and is not empty; choose a new policy store path", where=str(path))
        if path.exists():
            path.rmdir()
        with atomic_dir(path) as tmp:
            write_json(tmp / STORE_FILE, {"format": FORMAT, "format_version": FORMAT_VERSION, "meta": meta,
                                          "keep_versions": keep_versions, "chunk_size": chunk_size,
                                          "chunk_bytes": chunk_bytes, "created_at": _now()})
            PolicyIndex.create(tmp / INDEX_DB).close()
            cls._write_shared_snapshot(tmp / "shared", 1, shared_params, shared_opt_state, shared_info)
        return cls(path)

    @classmethod
    def open(cls, path, expect_dim: int | None = None) -> "PolicyStore":
        """Open an existing store; with ``expect_dim`` check the embedding dimension."""
        store = cls(path)
        if expect_dim is not None and store.meta["dim"] != expect_dim:
            raise InputError(f"policy store has dim {store.meta['dim']}, expected {expect_dim} "
                             "(made for another embedding model?)", where=str(path))
        return store

    def _read_header(self) -> dict:
        where = str(self.path)
        if not self.path.exists():
            raise InputError("no such policy store", where=where)
        if not self.path.is_dir():
            raise InputError("not a policy store (not a directory)", where=where)
        f = self.path / STORE_FILE
        try:
            header = json.loads(f.read_text())
        except FileNotFoundError:
            raise InputError(f"not a policy store (no {STORE_FILE})", where=where) from None
        except (OSError, ValueError) as e:
            raise InputError(f"unreadable {STORE_FILE} ({e})", where=str(f)) from None
        if not isinstance(header, dict) or header.get("format") != FORMAT or "meta" not in header:
            raise InputError(f"not a policy store ({STORE_FILE} has no format {FORMAT!r})", where=str(f))
        if header.get("format_version") not in READS_FORMAT_VERSIONS:
            raise InputError(f"format_version {header.get('format_version')} is not supported "
                             f"(this rmm-jax reads {', '.join(map(str, READS_FORMAT_VERSIONS))})", where=str(f))
        return header

    # ---- locking

    @contextlib.contextmanager
    def writer(self, wait: float = 0.0):
        """Hold the store's write lock (re-entrant in this object).

        Raises InputError naming the holder's pid and host if another process (or
        another PolicyStore object) holds it, after waiting up to ``wait`` seconds. The
        lock is released when the holder exits or dies, so a stale ``.lock`` file is
        harmless. The outermost hold first repairs what a killed writer left: temp dirs,
        a missing or corrupt index, a format-1 index (migrated), unindexed snapshots.
        """
        with self._lock.hold(wait) as outermost:
            if outermost:
                self._cleanup_temp()
                self._repair_index()
            yield self

    def _locked_error(self, holder: dict) -> InputError:
        err = InputError(f"policy store {self.path} is locked by pid {holder.get('pid', '?')} on host "
                         f"{holder.get('host', '?')} (another writer is running; retry when it ends)")
        err.where = str(self.path)
        return err

    def _cleanup_temp(self) -> None:
        """Remove temp dirs and index builds left by killed writers (only under the lock)."""
        for sub in ("gens", "shared"):
            d = self.path / sub
            if d.is_dir():
                for p in d.iterdir():
                    if p.name.startswith(".tmp-"):
                        shutil.rmtree(p, ignore_errors=True)
        for p in self.path.glob(f".{INDEX_DB}.tmp-*"):
            p.unlink(missing_ok=True)

    # ---- index

    def _query(self, fn):
        """``fn(index)`` on index.sqlite (read-only); if it is missing or corrupt, on an
        index read from index.json (format 1) or rebuilt from the snapshots, in memory."""
        try:
            with PolicyIndex.open(self.path / INDEX_DB) as idx:
                return fn(idx)
        except IndexUnavailable:
            return fn(self._fallback_index())

    def _fallback_index(self) -> PolicyIndex:
        """The in-memory index of a store without a usable index.sqlite, cached until the
        snapshots or index.json change."""
        legacy = self.path / INDEX_FILE
        gens = self.path / "gens"
        key = (legacy.stat().st_mtime_ns if legacy.exists() else None,
               tuple(sorted(p.name for p in gens.iterdir())) if gens.is_dir() else ())
        if self._fallback is None or self._fallback[0] != key:
            if self._fallback is not None:
                self._fallback[1].close()
            self._fallback = (key, self._build_index(None))
        return self._fallback[1]

    def _legacy_index(self) -> dict | None:
        """index.json of a format-1 store, if it is there and parses."""
        try:
            if json.loads((self.path / STORE_FILE).read_text()).get("format_version") != 1:
                return None
            idx = json.loads((self.path / INDEX_FILE).read_text())
        except (OSError, ValueError, AttributeError):
            return None
        return idx if isinstance(idx, dict) and isinstance(idx.get("users"), dict) else None

    def _build_index(self, path: Path | None) -> PolicyIndex:
        """An index from index.json (format 1) or else from the snapshots, at ``path``
        (replacing the file) or in memory."""
        legacy = self._legacy_index()
        snaps = snapshot_dirs(self.path / "gens")
        top = (snaps[-1][0] + 1) if snaps else 1
        if legacy is not None:
            try:
                records = [(u, int(e["version"]), int(str(e["chunk"])[1:]), int(e["row"]), e.get("saved_at"))
                           for u, es in legacy["users"].items() for e in es]
                return PolicyIndex.build(path, records, keep=self.keep_versions,
                                         next_version=max(int(legacy.get("next_version", 1)), top))
            except (KeyError, ValueError, TypeError, AttributeError):
                pass
        return PolicyIndex.build(path, snapshot_records(self.path / "gens"), keep=self.keep_versions,
                                 next_version=top)

    @contextlib.contextmanager
    def _writer_index(self, rebuild: bool = False):
        """The writable index (under the lock), rebuilt first if missing or corrupt (or if
        ``rebuild``)."""
        idx = None
        if not rebuild:
            with contextlib.suppress(IndexUnavailable):
                idx = PolicyIndex.open(self.path / INDEX_DB, readonly=False)
        if idx is None:
            idx = self._build_index(self.path / INDEX_DB)
        try:
            yield idx
        finally:
            idx.close()

    def _repair_index(self) -> None:
        """Under the lock: a usable index.sqlite (migrated or rebuilt), format 2 in the
        header, and no snapshot dir the index does not list."""
        try:
            with self._writer_index() as idx:
                self._finish_migration()
                self._remove_unindexed(idx)
        except IndexUnavailable:  # opened, but corrupt further in
            with self._writer_index(rebuild=True) as idx:
                self._finish_migration()
                self._remove_unindexed(idx)

    def _finish_migration(self) -> None:
        """Once index.sqlite is in place: header to format 2, then index.json goes."""
        if self._header.get("format_version") != FORMAT_VERSION:
            self._header = {**self._header, "format_version": FORMAT_VERSION,
                            "chunk_bytes": self._header.get("chunk_bytes", DEFAULT_CHUNK_BYTES)}
            write_json(self.path / STORE_FILE, self._header)
        (self.path / INDEX_FILE).unlink(missing_ok=True)

    def _remove_unindexed(self, idx: PolicyIndex) -> None:
        """Delete snapshot dirs the index does not list (killed saves, dropped versions)."""
        live = set(idx.live_versions())
        for v, snap in snapshot_dirs(self.path / "gens"):
            if v not in live:
                shutil.rmtree(snap, ignore_errors=True)

    def _entries(self, user_id: str) -> list[Entry]:
        return self._query(lambda idx: idx.entries(user_id))

    def users(self) -> list[str]:
        """User ids that have at least one saved version, sorted."""
        return self._query(lambda idx: idx.users())

    def n_users(self) -> int:
        """How many users have at least one saved version."""
        return self._query(lambda idx: idx.n_users())

    def has_user(self, user_id: str) -> bool:
        """Whether ``user_id`` has a saved version (one indexed lookup)."""
        return self._query(lambda idx: idx.has_user(user_id))

    def versions(self, user_id: str) -> list[int]:
        """Saved version numbers of ``user_id``, oldest first ([] if unknown)."""
        return [e.version for e in self._entries(user_id)]

    def version_entries(self, user_id: str) -> list[dict]:
        """Index entries ``{version, chunk, row, saved_at}`` of ``user_id``, oldest first."""
        return [_entry_dict(e) for e in self._entries(user_id)]

    def _pick(self, user_id: str, version: int | None) -> Entry:
        entries = self._entries(user_id)
        if version is not None:
            entries = [e for e in entries if e.version == version]
        if not entries:
            raise InputError(f"no saved policy for user {user_id!r}" + (f" version {version}" if version else ""),
                             where=str(self.path))
        return entries[-1]

    def info(self, user_id: str, version: int | None = None) -> dict:
        """The JSON info recorded with a user's version (newest if None), unverified."""
        e = self._pick(user_id, version)
        try:
            meta = read_chunk_meta(self.path / "gens" / vname(e.version), cname(e.chunk))
            return dict(meta["info"][e.row])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return {}

    def listing(self) -> Iterator[dict]:
        """``{user, versions: [entry dicts], info}`` for every user, sorted by user; the
        info is the newest version's (unverified). Each chunk.json is read once."""
        metas: dict[tuple[int, int], Any] = {}

        def info_of(e: Entry) -> dict:
            key = (e.version, e.chunk)
            if key not in metas:
                try:
                    metas[key] = read_chunk_meta(self.path / "gens" / vname(e.version), cname(e.chunk))["info"]
                except (OSError, ValueError, KeyError, TypeError):
                    metas[key] = None
            try:
                return dict(metas[key][e.row])
            except (TypeError, IndexError, ValueError):
                return {}

        def rows(idx):
            user, entries = None, []
            for uid, e in idx.all_entries():
                if uid != user and entries:
                    yield {"user": user, "versions": [_entry_dict(x) for x in entries], "info": info_of(entries[-1])}
                    entries = []
                user = uid
                entries.append(e)
            if entries:
                yield {"user": user, "versions": [_entry_dict(x) for x in entries], "info": info_of(entries[-1])}

        yield from self._query(lambda idx: list(rows(idx)))

    # ---- bytes

    def user_bytes(self, user_id: str, version: int | None = None) -> dict:
        """On-disk size of ``user_id``'s newest entry (or ``version``): its row's share of
        its chunk's array files. Returns ``{version, chunk, row, users_in_chunk,
        chunk_bytes, bytes, array_bytes}`` (``array_bytes``: the row's raw array bytes)."""
        e = self._pick(user_id, version)
        snap = self.path / "gens" / vname(e.version)
        try:
            meta = read_chunk_meta(snap, cname(e.chunk))
            n = len(meta["users"])
            raw = row_bytes(meta["spec"])
        except (OSError, ValueError, KeyError, TypeError) as ex:
            raise InputError(f"cannot read chunk {cname(e.chunk)} of version {e.version} ({type(ex).__name__})",
                             where=str(snap)) from None
        total = chunk_array_bytes(snap, cname(e.chunk))
        return {"version": e.version, "chunk": cname(e.chunk), "row": e.row, "users_in_chunk": n,
                "chunk_bytes": total, "bytes": round(total / max(n, 1)), "array_bytes": raw}

    def shared_bytes(self) -> dict:
        """On-disk size of the newest shared version: ``{version, bytes, array_bytes}``
        (``array_bytes``: raw params + optimiser-state bytes)."""
        snaps = snapshot_dirs(self.path / "shared")
        if not snaps:
            raise InputError("no shared version", where=str(self.path))
        v, snap = snaps[-1]
        try:
            raw = row_bytes(shared_meta(snap)["spec"])
        except (OSError, ValueError, KeyError, TypeError):
            raw = None
        return {"version": v, "bytes": chunk_array_bytes(snap, cname(0)), "array_bytes": raw}

    # ---- shared state

    @staticmethod
    def _write_shared_snapshot(root: Path, version: int, params, opt_state=None, info: dict | None = None) -> None:
        specs, parts = {}, {}
        for p, tree in zip(SHARED_PARTS, (params, opt_state)):
            specs[p], parts[p] = encode_tree(jax.device_get(tree), where=f"shared {p}")
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{vname(version)}-", dir=root))
        try:
            write_shared(tmp, {"version": version, "saved_at": _now(), "spec": specs, "info": info or {},
                               "row_bytes": row_bytes(specs)}, parts)
            fsync_dir(tmp)
            os.rename(tmp, root / vname(version))
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def set_shared(self, params, opt_state=None, info: dict | None = None) -> int:
        """Store a new shared version (e.g. after pretraining, or the shared policy of a
        ``shared``/``hybrid`` run): params, optionally its optimiser state (an optax state
        of NamedTuples is fine) and a JSON ``info`` dict. Returns the shared version."""
        info = _json_dict(info, "shared info", "set_shared: info")
        with self.writer():
            root = self.path / "shared"
            snaps = snapshot_dirs(root)
            version = (snaps[-1][0] + 1) if snaps else 1
            self._write_shared_snapshot(root, version, params, opt_state, info)
            for _, old in snapshot_dirs(root)[:-self.keep_versions]:
                shutil.rmtree(old, ignore_errors=True)
            return version

    def shared_state(self, template: SharedSnapshot | None = None) -> SharedSnapshot:
        """The newest shared version that verifies (older ones used with a warning):
        params, optimiser state (None if none was saved), version and info.
        ``template`` (a SharedSnapshot; its params/opt_state may be None) restores into
        other tree types."""
        skipped = []
        for v, snap in reversed(snapshot_dirs(self.path / "shared")):
            got = read_shared(snap)
            if isinstance(got, str):
                skipped.append({"version": v, "reason": got})
                continue
            meta, leaves = got
            try:
                trees = []
                for i, p in enumerate(SHARED_PARTS):
                    tpl = None if template is None else template[i]
                    trees.append(decode_tree(meta["spec"][p], leaves[p]) if tpl is None
                                 else unflatten_like(tpl, leaves[p], f"{self.path}: shared {p}"))
            except InputError:
                raise
            except Exception as e:  # noqa: BLE001 - any decode failure = bad version
                skipped.append({"version": v, "reason": f"restore failed ({type(e).__name__}: {e})"})
                continue
            self._report_restore("<shared>", v, skipped)
            return SharedSnapshot(trees[0], trees[1], v, dict(meta.get("info") or {}))
        raise InputError("no readable shared params version" + self._skipped_text(skipped), where=str(self.path))

    def shared_params(self, template=None):
        """The newest shared params that verify (older ones used with a warning)."""
        return self.shared_state(None if template is None else SharedSnapshot(template, None, 0, {})).params

    # ---- saving users

    def save_users(self, states: dict[str, UserPolicy], *, chunk_size: int | None = None) -> int:
        """Save several users' (unstacked) policies as one new version; returns it.

        Users with the same tree structure and shapes are stacked and written through
        the batched layout; different structures go into different chunks.
        """
        groups: dict[str, tuple[dict, list[str], list[dict[str, list]], list[dict]]] = {}
        for uid, st in states.items():
            if not isinstance(st, UserPolicy):
                raise InputError(f"expected a UserPolicy, got {type(st).__name__}", where=f"user {uid!r}")
            specs, leaves = {}, {}
            for p in PARTS:
                specs[p], leaves[p] = encode_tree(jax.device_get(getattr(st, p)), where=f"user {uid!r} {p}")
            g = groups.setdefault(json.dumps(specs, sort_keys=True), (specs, [], [], []))
            g[1].append(uid), g[2].append(leaves), g[3].append(st.info)
        batches = []
        for specs, uids, leaves, infos in groups.values():
            stacked = {p: [np.stack([lv[p][i] for lv in leaves]) for i in range(len(leaves[0][p]))]
                       for p in PARTS}
            batches.append((uids, specs, stacked, infos))
        return self._save(batches, chunk_size)

    def save_batch(self, user_ids: Sequence[str], stacked_state, infos: Sequence[dict] | None = None, *,
                   chunk_size: int | None = None) -> int:
        """Save many users from ONE stacked state (every leaf has a leading users axis,
        as produced under ``vmap``); returns the new version number.

        ``stacked_state`` is a :class:`UserPolicy` (its ``info`` ignored) or a
        ``(params, opt_state, learner_state)`` tuple; ``infos`` aligns with ``user_ids``.
        Any part may be an empty tree (``{}``/None), e.g. params in ``shared`` scope.
        """
        user_ids = list(user_ids)
        if isinstance(stacked_state, UserPolicy):
            trees = (stacked_state.params, stacked_state.opt_state, stacked_state.learner_state)
        elif isinstance(stacked_state, (tuple, list)) and len(stacked_state) == 3:
            trees = tuple(stacked_state)
        else:
            raise InputError("stacked_state must be a UserPolicy or (params, opt_state, learner_state)",
                             where="save_batch")
        infos = [{} for _ in user_ids] if infos is None else list(infos)
        if len(infos) != len(user_ids):
            raise InputError(f"{len(infos)} infos for {len(user_ids)} users", where="save_batch: infos")
        trees = jax.device_get(trees)
        specs, stacked = {}, {}
        for p, t in zip(PARTS, trees):
            specs[p], stacked[p] = encode_tree(t, batch=len(user_ids), where=f"save_batch {p}")
        return self._save([(user_ids, specs, stacked, infos)], chunk_size)

    @staticmethod
    def _check_users(batches) -> None:
        seen = set()
        for uids, _, _, infos in batches:
            for uid, info in zip(uids, infos):
                if not isinstance(uid, str) or not uid:
                    raise InputError(f"user id must be a non-empty string, got {uid!r}", where="user_ids")
                if uid in seen:
                    raise InputError(f"user {uid!r} appears twice in one save", where="user_ids")
                seen.add(uid)
                _json_dict(info, "info", f"user {uid!r} info")

    def _save(self, batches, chunk_size: int | None) -> int:
        """Write ``[(user_ids, specs, stacked leaves per part, infos)]`` as one version."""
        self._check_users(batches)
        if not any(b[0] for b in batches):
            raise InputError("nothing to save (no users)", where="save")
        if chunk_size is not None and chunk_size < 1:
            raise InputError(f"chunk_size must be >= 1, got {chunk_size}", where="save")
        with self.writer(), self._writer_index() as idx:
            gens = self.path / "gens"
            gens.mkdir(exist_ok=True)
            existing = snapshot_dirs(gens)
            version = max(idx.next_version(), (existing[-1][0] + 1) if existing else 1)
            saved_at = _now()
            placed = self._write_snapshot(gens, version, saved_at, batches, chunk_size or self.chunk_size)
            try:
                dead = idx.commit_version(version, saved_at, placed, keep=self.keep_versions)
            except IndexUnavailable:  # corrupt under us: rebuild from the snapshots, the new one included
                idx.close()
                with contextlib.closing(self._build_index(self.path / INDEX_DB)) as rebuilt:
                    live = set(rebuilt.live_versions())
                dead = [v for v, _ in snapshot_dirs(gens) if v not in live]
            for v in dead:
                shutil.rmtree(gens / vname(v), ignore_errors=True)
            return version

    def _write_snapshot(self, gens: Path, version: int, saved_at: str, batches, size: int | None):
        """Write the chunks into a temp dir and rename it into place; returns the
        ``(user, chunk number, row)`` placements. Explicit ``size``: that many users per
        chunk; else by bytes, in equal chunks."""
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{vname(version)}-", dir=gens))
        try:
            n, placed = 0, []
            for uids, specs, stacked, infos in batches:
                if size:
                    cuts = list(range(0, len(uids), size)) + [len(uids)]
                else:
                    per = users_per_chunk(specs, self.chunk_bytes, MAX_CHUNK_USERS)
                    k = -(-len(uids) // per)
                    cuts = [round(i * len(uids) / k) for i in range(k + 1)]
                for lo, hi in zip(cuts[:-1], cuts[1:]):
                    write_chunk(tmp / cname(n), {"version": version, "chunk": cname(n), "saved_at": saved_at,
                                                 "users": uids[lo:hi], "info": infos[lo:hi], "spec": specs,
                                                 "row_bytes": row_bytes(specs)},
                                {p: [a[lo:hi] for a in stacked[p]] for p in PARTS})
                    placed += [(uid, n, row) for row, uid in enumerate(uids[lo:hi])]
                    n += 1
            fsync_dir(tmp)
            os.rename(tmp, gens / vname(version))
            fsync_dir(gens)
            return placed
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # ---- loading users

    def load_user(self, user_id: str, *, version: int | None = None, template: UserPolicy | None = None
                  ) -> UserPolicy:
        """Restore ``user_id``'s newest version that verifies (or exactly ``version``).

        Skipped (corrupt/truncated/missing) versions are listed in
        :attr:`last_restore_report` and raise a :class:`PolicyRestoreWarning`; if none is
        left an InputError names the user and the store. ``template`` (a UserPolicy of
        example pytrees) restores into other tree types.
        """
        return self.load_users([user_id], version=version, template=template)[user_id]

    def load_users(self, user_ids: Iterable[str], *, version: int | None = None,
                   template: UserPolicy | None = None) -> dict[str, UserPolicy]:
        """Restore several users; each chunk is verified and read once per call."""
        user_ids = list(user_ids)
        cache: dict[tuple[int, int], Any] = {}
        out, reports = {}, {}
        index = self._query(lambda idx: {u: idx.entries(u) for u in user_ids})
        for uid in user_ids:
            pol, report = self._load_one(uid, index[uid], version, template, cache)
            if pol is None:  # a writer may have replaced versions meanwhile: re-read once
                fresh = self._entries(uid)
                if fresh != index[uid]:
                    pol, report = self._load_one(uid, fresh, version, template, cache)
            if pol is None:
                raise InputError(f"no good saved version for user {uid!r}" + self._skipped_text(report["skipped"]),
                                 where=str(self.path))
            out[uid], reports[uid] = pol, report
        self.restore_reports = reports
        return out

    def load_batch(self, user_ids: Sequence[str], **kw) -> UserPolicy:
        """Load users and stack them (leading users axis); ``info`` is a list."""
        pols = self.load_users(user_ids, **kw)
        ps = [pols[u] for u in user_ids]
        stack = lambda *xs: np.stack(xs)  # noqa: E731
        return UserPolicy(jax.tree_util.tree_map(stack, *[p.params for p in ps]),
                          jax.tree_util.tree_map(stack, *[p.opt_state for p in ps]),
                          jax.tree_util.tree_map(stack, *[p.learner_state for p in ps]),
                          [p.info for p in ps], None)

    def _load_one(self, uid, entries: list[Entry], version, template, cache):
        if not entries:
            raise InputError(f"no saved policy for user {uid!r} (known users: {self.n_users()})",
                             where=str(self.path))
        if version is not None:
            entries = [e for e in entries if e.version == version]
            if not entries:
                raise InputError(f"user {uid!r} has no version {version} (has {self.versions(uid)})",
                                 where=str(self.path))
        skipped = []
        for e in reversed(entries):
            key = (e.version, e.chunk)
            if key not in cache:
                cache[key] = read_chunk(self.path / "gens" / vname(e.version), cname(e.chunk))
            got = cache[key]
            if isinstance(got, str):
                skipped.append({"version": e.version, "reason": got})
                continue
            meta, leaves = got
            try:
                pol = self._row_policy(meta, e, uid, leaves, template)
            except InputError:
                raise
            except Exception as ex:  # noqa: BLE001 - e.g. chunk.json disagrees with the index
                skipped.append({"version": e.version, "reason": f"bad row ({type(ex).__name__}: {ex})"})
                continue
            return pol, self._report_restore(uid, e.version, skipped)
        return None, {"user": uid, "version": None, "skipped": skipped}

    def _row_policy(self, meta: dict, entry: Entry, uid: str, leaves, template) -> UserPolicy:
        row = entry.row
        if meta["users"][row] != uid:
            raise ValueError(f"row {row} holds {meta['users'][row]!r}")
        trees = []
        for p in PARTS:
            ls = [np.array(a[row]) for a in leaves[p]]
            where = f"{self.path}: user {uid!r} {p}"
            if p == "learner_state" and _is_legacy_learner_state(meta["spec"][p]):
                tree = LearnerState(**decode_tree(meta["spec"][p], ls))
                trees.append(tree if template is None else
                             unflatten_like(template.learner_state, jax.tree_util.tree_leaves(tree), where))
            elif template is not None:
                trees.append(unflatten_like(getattr(template, p), ls, where))
            else:
                trees.append(decode_tree(meta["spec"][p], ls))
        return UserPolicy(*trees, info=dict(meta["info"][row] or {}), version=entry.version)

    def _report_restore(self, who: str, version: int, skipped: list) -> dict:
        report = {"user": who, "version": version, "skipped": skipped, "store": str(self.path)}
        self.last_restore_report = report
        if skipped:
            warnings.warn(f"{self.path}: {who}: restored version {version}, skipped"
                          + self._skipped_text(skipped), PolicyRestoreWarning, stacklevel=4)
        return report

    @staticmethod
    def _skipped_text(skipped: list) -> str:
        return "".join(f"; v{s['version']}: {s['reason']}" for s in skipped)

    # ---- export

    def export_user(self, user_id: str, out_path, *, version: int | None = None) -> dict:
        """Write ``user_id``'s params as one ``.npz`` (keys: leaf paths joined by "/")
        plus ``<out>.json`` (meta, version, info, shapes); both atomically. Returns the
        JSON written."""
        out = Path(out_path)
        if out.suffix != ".npz":
            raise InputError("export file must end in .npz", where=str(out))
        pol = self.load_user(user_id, version=version)
        spec, leaves = encode_tree(pol.params, where=f"user {user_id!r} params")
        arrays = {s["path"]: leaves[s["i"]] for s in leaf_specs(spec)}
        doc = {"store": str(self.path), "user": user_id, "version": pol.version, "meta": self.meta,
               "info": pol.info, "shapes": {k: list(v.shape) for k, v in arrays.items()},
               "dtypes": {k: str(v.dtype) for k, v in arrays.items()}}
        with atomic_file(out, "wb") as f:
            np.savez(f, **arrays, __meta__=np.array(json.dumps(doc, sort_keys=True)))
        write_json(out.with_suffix(".json"), doc)
        return doc

