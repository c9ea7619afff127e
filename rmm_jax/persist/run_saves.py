"""What a run already saved to a policy store, so a resumed run saves each users chunk once.

A run that continues a store starts each user from its newest version older than the
version number the run began at (``before``); a run saves its chunks as versions from
``first_version`` on. A run interrupted after saving a chunk's users and before its
checkpoint (a full disk, a kill) does that chunk again when resumed: :func:`chunk_saves`
says that the store holds this run's save of those users already (so it is not saved a
second time), and what each user's count of learned queries continues from (the version
the run started it from, not the one this run saved).

Examples:
  >>> from rmm_jax.persist.run_saves import chunk_saves
  >>> class Empty:
  ...     path = "."
  ...     def listing(self, users):
  ...         return iter(())
  >>> chunk_saves(Empty(), ["u0"], before=3, first_version=3)
  ChunkSaves(saved=False, infos={})
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

from rmm_jax.persist.policy_report import entry_info


class ChunkSaves(NamedTuple):
    """``saved``: every user of the chunk has a version this run saved (the chunk was saved
    before the run was interrupted); ``infos``: each stored user's info of the version the
    run continues it from (none for a user new to the store)."""
    saved: bool
    infos: dict


def chunk_saves(store, users: Sequence[str], *, before: int | None, first_version: int | None) -> ChunkSaves:
    """:class:`ChunkSaves` of ``users`` in ``store`` (one index query): the run continues
    users from their versions older than ``before`` (None: from their newest), and saves its
    own from ``first_version`` (None: not known, nothing counts as saved)."""
    gens, metas = Path(store.path) / "gens", {}
    infos, saved = {}, bool(users) and first_version is not None
    listed = {u: (entries, info) for u, entries, info in store.listing(list(users))}
    for u in users:
        entries, newest = listed.get(u, ([], {}))
        if first_version is not None and not any(e.version >= first_version for e in entries):
            saved = False
        older = entries if before is None else [e for e in entries if e.version < before]
        if older:
            infos[u] = newest if older[-1] is entries[-1] else entry_info(gens, older[-1], metas)
    return ChunkSaves(saved, infos)
