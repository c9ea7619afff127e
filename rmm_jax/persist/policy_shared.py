"""The shared part of a policy store: one snapshot per shared version under ``STORE/shared``,
each the single row of a rows chunk (:mod:`rmm_jax.persist.policy_rows`).

A shared version never changes once written, so a :class:`SharedParts` object verifies
each version at most once and keeps the newest few it restored (read-only: they are
handed to every caller). Which shared versions may be pruned is the index's answer (the
ones no kept user version references, :func:`rmm_jax.persist.policy_versions.prune_shared`).
"""
from __future__ import annotations

import collections
import threading
import warnings
from pathlib import Path

import jax
import numpy as np

from rmm_jax.core.types import SharedState
from rmm_jax.errors import InputError
from rmm_jax.persist.atomic import atomic_dir
from rmm_jax.persist.codec import encode_tree
from rmm_jax.persist.policy_restore import SavedShared, problem, restore_shared
from rmm_jax.persist.policy_snapshot import (
    SHARED_PARTS,
    cname,
    shared_meta,
    snapshot_dirs,
    verify_snapshot,
    vname,
    write_shared,
)
from rmm_jax.persist.rollback import PolicyRestoreWarning, Skip, skips_text

SHARED_CACHE = 4               # restored shared versions an object keeps (they never change)


def _read_only(tree):
    """``tree`` with its numpy leaves made read-only (a cached shared state is handed out
    to every caller; nobody may change it in place)."""
    def freeze(a):
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
        return a
    return jax.tree_util.tree_map(freeze, tree)


class SharedParts:
    """The shared versions under ``root`` (``STORE/shared``); ``where`` names the store in errors."""

    def __init__(self, root: Path, where: str):
        self.root, self.where = root, where
        self._restored: collections.OrderedDict[int, SavedShared] = collections.OrderedDict()
        self._checked: dict[int, str | None] = {}
        self._online: dict[int, bool] = {}
        self._lock = threading.Lock()       # around _restored: get() may be called from several threads

    def versions(self) -> list[int]:
        """Shared versions on disk, ascending (whether they load or not)."""
        return [v for v, _ in snapshot_dirs(self.root)]

    @staticmethod
    def write(root: Path, version: int, state: SharedState, info: dict, saved_at: str) -> None:
        """Write ``state`` as shared version ``version`` under ``root`` (atomically)."""
        specs, leaves = {}, {}
        for p, tree in zip(SHARED_PARTS, jax.device_get(tuple(state))):
            specs[p], leaves[p] = encode_tree(tree, where=f"shared {p}")
        with atomic_dir(root / vname(version), overwrite=False) as tmp:
            write_shared(tmp, {"version": version, "saved_at": saved_at, "info": info}, specs, leaves)

    def add(self, idx, state: SharedState, info: dict, saved_at: str) -> int:
        """Write ``state`` as a new shared version (call under the writer's lock, ``idx`` the
        writer's index); returns its number: above every number handed out, those a
        rollback deleted included (the index's ``next_shared``)."""
        version = max([*self.versions(), *idx.shared_refs(), idx.next_shared() - 1, 0]) + 1
        idx.reserve_shared(version + 1)     # first: a kill after it skips a number, never reuses one
        self.write(self.root, version, state, info, saved_at)
        return version

    def get(self, version: int) -> SavedShared | str:
        """Shared ``version`` restored, or why it does not load (cached). Thread-safe: the
        cache is used under a small lock, the disk read outside it (two threads may both
        read a version; both get the one object cached first)."""
        with self._lock:
            hit = self._restored.get(version)
            if hit is not None:
                self._restored.move_to_end(version)
                return hit
        got = restore_shared(self.root / vname(version))
        if isinstance(got, str):
            self._checked[version] = problem(got)
            return got
        saved = SavedShared(_read_only(got[0]), got[1], version)
        with self._lock:
            self._checked[version] = None
            saved = self._restored.setdefault(version, saved)
            self._restored.move_to_end(version)
            while len(self._restored) > SHARED_CACHE:
                self._restored.popitem(last=False)
        return saved

    def online(self, version: int) -> bool | None:
        """Whether an online run saved shared ``version`` (its info says ``source: online``),
        from its metadata, unverified; None when that cannot be read (a damaged version is
        neither)."""
        if version not in self._online:
            try:
                info = shared_meta(self.root / vname(version)).get("info") or {}
                self._online[version] = info.get("source") == "online"
            except (OSError, ValueError, KeyError, AttributeError):
                return None
        return self._online[version]

    def newest_not_online(self) -> int | None:
        """The newest version that loads and that no online run saved (its info's ``source``
        is not ``online``); None: no such version."""
        for v in reversed(self.versions()):
            got = self.get(v)
            if not isinstance(got, str) and got.info.get("source") != "online":
                return v
        return None

    def problem(self, version: int) -> str | None:
        """What is wrong with ``version`` (``missing``, ``damaged (...)``; None: it
        verifies). Checked once per object, by checksums, without decoding it."""
        if version not in self._checked:
            reason = verify_snapshot(self.root / vname(version), cname(0))
            self._checked[version] = None if reason is None else problem(reason)
        return self._checked[version]

    def state(self, version: int | None = None, stacklevel: int = 3) -> SavedShared:
        """Shared ``version``, or the newest that loads (older ones used with a
        :class:`PolicyRestoreWarning`): its state, info, version and the versions skipped."""
        if version is not None:
            got = self.get(version)
            if isinstance(got, str):
                raise InputError(f"shared version {version} is {problem(got)}", where=self.where)
            return got
        skipped = []
        for v in reversed(self.versions()):
            got = self.get(v)
            if isinstance(got, str):
                skipped.append(Skip(v, f"is {problem(got)}"))
                continue
            if skipped:
                warnings.warn(PolicyRestoreWarning(self.where, None, v, skipped), stacklevel=stacklevel)
            return got._replace(skipped=tuple(skipped))
        raise InputError("no shared version loads" + (f": {skips_text(skipped)}" if skipped else ""),
                         where=self.where)
