"""Per-user reranker policies on disk: a versioned, crash-safe, locked policy store.

Every user of an agent has a small reranker policy (params + optimiser state + learner
state) adapted online. The online learner produces these for many users at once, with a
leading *users* axis on every leaf (``vmap``), so the store's primary write path is
:meth:`PolicyStore.save_batch`: the stacked arrays are cut into chunks of users and each
chunk is written as ONE orbax-checkpoint; an index maps ``user_id -> (version, chunk, row)``.
The per-user API (:meth:`PolicyStore.save_users`, :meth:`PolicyStore.load_user`) sits on
top of it. Scoring a query with a stored user's policy is
:func:`rmm_jax.online.scoring.score_query`.

On-disk layout (``STORE`` is the directory given to :meth:`PolicyStore.create`)::

    STORE/
      policy_store.json        format marker + meta {kind, dim, hidden, config} + settings
      index.json               user -> [{version, chunk, row, saved_at}, ...] (oldest first)
      .lock                    flock'ed by the one writer (persist/lock.py; pid/host inside, advisory)
      shared/v00000001/        shared (pretrained) params, same snapshot format as below
      gens/v00000007/          one snapshot = one save call (a "version")
        rows.json              {version, saved_at, chunks: {c0000: {users, spec}}, info: {user: {...}}}
        c0000/                 orbax checkpoint of {"params"|"opt_state"|"learner_state":
                               {"l000000": array(U, ...), ...}} for the chunk's U users
        c0001/ ...
        CHECKSUMS.json         sha256 of every file above + a hash of itself, written LAST

Crash safety: a snapshot is written into ``gens/.tmp-*`` and renamed into place only
after ``CHECKSUMS.json`` is written, then ``index.json`` is replaced atomically. A kill at
any point leaves either no new version or a complete one; leftovers (temp dirs, complete
but unindexed snapshots) are removed by the next writer. Loading verifies the checksums of
the rows and chunk it reads; a truncated or corrupted version is skipped and the previous
one is used, which is reported in :attr:`PolicyStore.last_restore_report`, in
:attr:`UserPolicy.version` and by a :class:`PolicyRestoreWarning`.
Not orbax's CheckpointManager (here or for run-state snapshots): it verifies no content
checksums and does not fall back past a damaged step (and keeps N steps, not N per user).

Pytrees are stored structure-agnostically with :mod:`rmm_jax.persist.codec`: leaves in
JAX order, the structure as a JSON *spec* in ``rows.json`` (NamedTuples such as optax's
``ScaleByAdamState`` and :class:`rmm_jax.core.types.LearnerState` are re-imported by
name), so a restored Adam state has the same tree type and optax can keep using it. A
``template`` pytree may be passed to restore into any other structure. Stores written
before ``LearnerState`` existed hold the learner state as a dict ``{baseline, key,
step}``; it is loaded as a ``LearnerState``.
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
from typing import Any, Iterable, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from rmm_jax.core.types import LearnerState
from rmm_jax.errors import InputError
from rmm_jax.persist import checksums
from rmm_jax.persist.atomic import atomic_dir, atomic_file, fsync_dir, write_json
from rmm_jax.persist.codec import decode_tree, encode_tree, leaf_specs, unflatten_like
from rmm_jax.persist.lock import WriterLock

FORMAT = "rmm-jax-policy-store"
FORMAT_VERSION = 1
STORE_FILE = "policy_store.json"
INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
ROWS_FILE = "rows.json"
PARTS = ("params", "opt_state", "learner_state")
KINDS = ("linear", "mlp")
DEFAULT_KEEP = 3
DEFAULT_CHUNK = 16  # 16 users x ~3.5 MB (d=384, Adam) ~ 56 MB read per load_user


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


# --------------------------------------------------------------------------- snapshots


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def verify_snapshot(snap: Path, chunk: str | None = None) -> str | None:
    """Check ``rows.json`` and the files of ``chunk`` (all files if None) against
    CHECKSUMS.json. Returns None when good, else a one-line reason."""
    def select(files):
        wanted = [r for r in files if chunk is None or r == ROWS_FILE or r.startswith(chunk + "/")]
        if ROWS_FILE not in wanted or (chunk is not None and len(wanted) < 2):
            return f"checksums list no files for {chunk or ROWS_FILE}"
        return wanted

    return checksums.verify(snap, select, "incomplete version (no checksum file)")


def save_chunk(dest: Path, parts: dict[str, list[np.ndarray]]) -> None:
    """Write one orbax checkpoint ``{part: {"l000000": leaf, ...}}`` at ``dest``."""
    tree = {p: {f"l{i:06d}": np.ascontiguousarray(a) for i, a in enumerate(ls)}
            for p, ls in parts.items() if ls}
    if not tree:
        dest.mkdir()
        return
    ocp.PyTreeCheckpointer().save(dest.resolve(), tree)


def load_chunk(src: Path, counts: dict[str, int]) -> dict[str, list[np.ndarray]]:
    """Read a chunk written by :func:`save_chunk` back as numpy leaves per part."""
    want = {p: n for p, n in counts.items() if n}
    if not want:
        return {p: [] for p in counts}
    args = {p: {f"l{i:06d}": ocp.RestoreArgs(restore_type=np.ndarray) for i in range(n)}
            for p, n in want.items()}
    tree = ocp.PyTreeCheckpointer().restore(src.resolve(), args=ocp.args.PyTreeRestore(restore_args=args))
    return {p: [np.asarray(tree[p][f"l{i:06d}"]) for i in range(want.get(p, 0))] for p in counts}


def _is_legacy_learner_state(spec: dict) -> bool:
    """A learner state saved before :class:`LearnerState` existed: a dict {baseline, key, step}."""
    return spec["t"] == "dict" and spec["k"] == sorted(LearnerState._fields)


def _snapshot_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking snapshot dirs ``v00000001`` under ``root``, oldest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("v") and p.name[1:].isdigit():
                out.append((int(p.name[1:]), p))
    return sorted(out)


def _vname(v: int) -> str:
    return f"v{v:08d}"


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
        self.chunk_size: int = int(self._header.get("chunk_size", DEFAULT_CHUNK))
        self.last_restore_report: dict | None = None
        self.restore_reports: dict[str, dict] = {}
        self._lock = WriterLock(self.path / LOCK_FILE, self._locked_error)

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
        if not isinstance(meta["dim"], int) or isinstance(meta["dim"], bool) or meta["dim"] <= 0:
            raise InputError(f"meta dim must be a positive int, got {meta['dim']!r}", where=f"{where}: key 'dim'")
        h = meta["hidden"]
        if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h <= 0):
            raise InputError(f"meta hidden must be a positive int or None, got {h!r}", where=f"{where}: key 'hidden'")
        meta = {**meta, "config": dict(meta.get("config") or {})}
        try:
            json.dumps(meta)
        except TypeError as e:
            raise InputError(f"meta is not JSON-serialisable ({e})", where=where) from None
        return meta

    @classmethod
    def create(cls, path, meta: dict, shared_params, *, keep_versions: int = DEFAULT_KEEP,
               chunk_size: int = DEFAULT_CHUNK) -> "PolicyStore":
        """Make a new store at ``path`` (must not exist or be empty) holding ``meta`` and
        the shared params as version 1. The whole directory appears atomically."""
        path = Path(path)
        meta = cls._check_meta(meta, str(path))
        if keep_versions < 1 or chunk_size < 1:
            raise InputError("keep_versions and chunk_size must be >= 1", where=str(path))
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise InputError("already exists and is not empty; choose a new policy store path", where=str(path))
        if path.exists():
            path.rmdir()
        with atomic_dir(path) as tmp:
            write_json(tmp / STORE_FILE, {"format": FORMAT, "format_version": FORMAT_VERSION, "meta": meta,
                                          "keep_versions": keep_versions, "chunk_size": chunk_size,
                                          "created_at": _now()})
            write_json(tmp / INDEX_FILE, {"next_version": 1, "users": {}})
            cls._write_shared_snapshot(tmp / "shared", 1, shared_params)
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
        if header.get("format_version") != FORMAT_VERSION:
            raise InputError(f"format_version {header.get('format_version')} is not supported "
                             f"(this rmm-jax reads {FORMAT_VERSION})", where=str(f))
        return header

    # ---- locking

    @contextlib.contextmanager
    def writer(self, wait: float = 0.0):
        """Hold the store's write lock (re-entrant in this object).

        Raises InputError naming the holder's pid and host if another process (or
        another PolicyStore object) holds it, after waiting up to ``wait`` seconds. The
        lock is released when the holder exits or dies, so a stale ``.lock`` file is
        harmless.
        """
        with self._lock.hold(wait) as outermost:
            if outermost:
                self._cleanup_temp()
            yield self

    def _locked_error(self, holder: dict) -> InputError:
        err = InputError(f"policy store {self.path} is locked by pid {holder.get('pid', '?')} on host "
                         f"{holder.get('host', '?')} (another writer is running; retry when it ends)")
        err.where = str(self.path)
        return err

    def _cleanup_temp(self) -> None:
        """Remove temp dirs left by killed writers (only called under the lock)."""
        for sub in ("gens", "shared"):
            d = self.path / sub
            if d.is_dir():
                for p in d.iterdir():
                    if p.name.startswith(".tmp-"):
                        shutil.rmtree(p, ignore_errors=True)

    # ---- index

    def _read_index(self) -> dict:
        """index.json, or (if missing/corrupt) an index rebuilt from the snapshots' rows."""
        try:
            idx = json.loads((self.path / INDEX_FILE).read_text())
            if isinstance(idx, dict) and isinstance(idx.get("users"), dict):
                return idx
        except (OSError, ValueError):
            pass
        return self._rebuild_index()

    def _rebuild_index(self) -> dict:
        users: dict[str, list] = {}
        snaps = _snapshot_dirs(self.path / "gens")
        for v, snap in snaps:
            try:
                rows = json.loads((snap / ROWS_FILE).read_text())
            except (OSError, ValueError):
                continue
            for chunk, c in rows.get("chunks", {}).items():
                for row, uid in enumerate(c["users"]):
                    users.setdefault(uid, []).append({"version": v, "chunk": chunk, "row": row,
                                                      "saved_at": rows.get("saved_at")})
        users = {u: sorted(e, key=lambda x: x["version"])[-self.keep_versions:] for u, e in users.items()}
        return {"next_version": (snaps[-1][0] + 1) if snaps else 1, "users": users, "rebuilt": True}

    def users(self) -> list[str]:
        """User ids that have at least one saved version, sorted."""
        return sorted(self._read_index()["users"])

    def versions(self, user_id: str) -> list[int]:
        """Saved version numbers of ``user_id``, oldest first ([] if unknown)."""
        return [e["version"] for e in self._read_index()["users"].get(user_id, [])]

    def version_entries(self, user_id: str) -> list[dict]:
        """Index entries ``{version, chunk, row, saved_at}`` of ``user_id``, oldest first."""
        return list(self._read_index()["users"].get(user_id, []))

    def info(self, user_id: str, version: int | None = None) -> dict:
        """The JSON info recorded with a user's version (newest if None), unverified."""
        entries = self.version_entries(user_id)
        if version is not None:
            entries = [e for e in entries if e["version"] == version]
        if not entries:
            raise InputError(f"no saved policy for user {user_id!r}" + (f" version {version}" if version else ""),
                             where=str(self.path))
        try:
            rows = json.loads((self.path / "gens" / _vname(entries[-1]["version"]) / ROWS_FILE).read_text())
            return rows["info"].get(user_id, {})
        except (OSError, ValueError, KeyError):
            return {}

    # ---- shared params

    @staticmethod
    def _write_shared_snapshot(root: Path, version: int, params) -> None:
        spec, leaves = encode_tree(params, where="shared_params")
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{_vname(version)}-", dir=root))
        try:
            write_json(tmp / ROWS_FILE, {"version": version, "saved_at": _now(),
                                         "chunks": {"c0000": {"users": [], "spec": {"params": spec}}}})
            save_chunk(tmp / "c0000", {"params": leaves})
            checksums.write_checksums(tmp)
            os.rename(tmp, root / _vname(version))
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def set_shared(self, params) -> int:
        """Replace the shared params (e.g. after pretraining) with a new version; returns it."""
        with self.writer():
            root = self.path / "shared"
            snaps = _snapshot_dirs(root)
            version = (snaps[-1][0] + 1) if snaps else 1
            self._write_shared_snapshot(root, version, params)
            for _, old in _snapshot_dirs(root)[:-self.keep_versions]:
                shutil.rmtree(old, ignore_errors=True)
            return version

    def shared_params(self, template=None):
        """The newest shared params that verify (older ones used with a warning)."""
        skipped = []
        for v, snap in reversed(_snapshot_dirs(self.path / "shared")):
            reason = verify_snapshot(snap, "c0000")
            if reason is None:
                try:
                    spec = json.loads((snap / ROWS_FILE).read_text())["chunks"]["c0000"]["spec"]["params"]
                    leaves = load_chunk(snap / "c0000", {"params": len(leaf_specs(spec))})["params"]
                    tree = (decode_tree(spec, leaves) if template is None
                            else unflatten_like(template, leaves, f"{self.path}: shared params"))
                except InputError:
                    raise
                except Exception as e:  # noqa: BLE001 - any read failure = bad version
                    reason = f"restore failed ({type(e).__name__}: {e})"
                else:
                    self._report_restore("<shared>", v, skipped)
                    return tree
            skipped.append({"version": v, "reason": reason})
        raise InputError("no readable shared params version" + self._skipped_text(skipped), where=str(self.path))

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
                specs[p], leaves[p] = encode_tree(getattr(st, p), where=f"user {uid!r} {p}")
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
                try:
                    json.dumps(info)
                except TypeError as e:
                    raise InputError(f"info is not JSON-serialisable ({e})", where=f"user {uid!r} info") from None

    def _save(self, batches, chunk_size: int | None) -> int:
        """Write ``[(user_ids, specs, stacked leaves per part, infos)]`` as one version."""
        self._check_users(batches)
        if not any(b[0] for b in batches):
            raise InputError("nothing to save (no users)", where="save")
        size = int(chunk_size or self.chunk_size)
        with self.writer():
            index = self._read_index()
            gens = self.path / "gens"
            gens.mkdir(exist_ok=True)
            existing = _snapshot_dirs(gens)
            version = max(int(index.get("next_version", 1)), (existing[-1][0] + 1) if existing else 1)
            saved_at = _now()
            placed = self._write_snapshot(gens, version, saved_at, batches, size)
            for uid, chunk, row in placed:
                entries = index["users"].setdefault(uid, [])
                entries.append({"version": version, "chunk": chunk, "row": row, "saved_at": saved_at})
                del entries[:-self.keep_versions]
            index["next_version"] = version + 1
            index.pop("rebuilt", None)
            write_json(self.path / INDEX_FILE, index)
            self._gc(index)
            return version

    def _write_snapshot(self, gens: Path, version: int, saved_at: str, batches, size: int):
        """Write chunks + rows.json + CHECKSUMS.json into a temp dir, rename into place."""
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{_vname(version)}-", dir=gens))
        try:
            chunks, info, placed = {}, {}, []
            for uids, specs, stacked, infos in batches:
                for lo in range(0, len(uids), size):
                    name = f"c{len(chunks):04d}"
                    part = {p: [a[lo:lo + size] for a in stacked[p]] for p in PARTS}
                    save_chunk(tmp / name, part)
                    chunks[name] = {"users": uids[lo:lo + size], "spec": specs}
                    for row, uid in enumerate(uids[lo:lo + size]):
                        placed.append((uid, name, row))
                        info[uid] = infos[lo + row]
            write_json(tmp / ROWS_FILE, {"version": version, "saved_at": saved_at, "chunks": chunks, "info": info})
            checksums.write_checksums(tmp)
            os.rename(tmp, gens / _vname(version))
            fsync_dir(gens)
            return placed
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _gc(self, index: dict) -> None:
        """Delete snapshots no user keeps any more (including unindexed leftovers)."""
        live = {e["version"] for entries in index["users"].values() for e in entries}
        for v, snap in _snapshot_dirs(self.path / "gens"):
            if v not in live:
                shutil.rmtree(snap, ignore_errors=True)

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
        cache: dict[tuple[int, str], Any] = {}
        out, reports = {}, {}
        index = self._read_index()
        for uid in user_ids:
            pol, report = self._load_one(index, uid, version, template, cache)
            if pol is None:  # a writer may have replaced versions meanwhile: re-read once
                fresh = self._read_index()
                if fresh["users"].get(uid) != index["users"].get(uid):
                    index = fresh
                    pol, report = self._load_one(index, uid, version, template, cache)
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

    def _load_one(self, index, uid, version, template, cache):
        entries = index["users"].get(uid)
        if not entries:
            raise InputError(f"no saved policy for user {uid!r} (known users: {len(index['users'])})",
                             where=str(self.path))
        if version is not None:
            entries = [e for e in entries if e["version"] == version]
            if not entries:
                raise InputError(f"user {uid!r} has no version {version} (has {self.versions(uid)})",
                                 where=str(self.path))
        skipped = []
        for e in reversed(entries):
            got = self._chunk(e["version"], e["chunk"], cache)
            if isinstance(got, str):
                skipped.append({"version": e["version"], "reason": got})
                continue
            rows, leaves = got
            try:
                pol = self._row_policy(rows, e, uid, leaves, template)
            except InputError:
                raise
            except Exception as ex:  # noqa: BLE001 - e.g. rows.json disagrees with the index
                skipped.append({"version": e["version"], "reason": f"bad row ({type(ex).__name__}: {ex})"})
                continue
            return pol, self._report_restore(uid, e["version"], skipped)
        return None, {"user": uid, "version": None, "skipped": skipped}

    def _chunk(self, version: int, chunk: str, cache):
        """Verified ``(rows, leaves per part)`` of a chunk, or a reason string."""
        key = (version, chunk)
        if key not in cache:
            snap = self.path / "gens" / _vname(version)
            reason = verify_snapshot(snap, chunk)
            if reason is None:
                try:
                    rows = json.loads((snap / ROWS_FILE).read_text())
                    specs = rows["chunks"][chunk]["spec"]
                    counts = {p: len(leaf_specs(specs[p])) for p in PARTS}
                    cache[key] = (rows, load_chunk(snap / chunk, counts))
                except Exception as e:  # noqa: BLE001 - any read failure = bad version
                    cache[key] = f"restore failed ({type(e).__name__}: {e})"
            else:
                cache[key] = reason
        return cache[key]

    def _row_policy(self, rows, entry, uid, leaves, template) -> UserPolicy:
        c = rows["chunks"][entry["chunk"]]
        row = entry["row"]
        if c["users"][row] != uid:
            raise ValueError(f"row {row} holds {c['users'][row]!r}")
        trees = []
        for p in PARTS:
            ls = [np.array(a[row]) for a in leaves[p]]
            where = f"{self.path}: user {uid!r} {p}"
            if p == "learner_state" and _is_legacy_learner_state(c["spec"][p]):
                tree = LearnerState(**decode_tree(c["spec"][p], ls))
                trees.append(tree if template is None else
                             unflatten_like(template.learner_state, jax.tree_util.tree_leaves(tree), where))
            elif template is not None:
                trees.append(unflatten_like(getattr(template, p), ls, where))
            else:
                trees.append(decode_tree(c["spec"][p], ls))
        return UserPolicy(*trees, info=dict(rows.get("info", {}).get(uid, {})), version=entry["version"])

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
