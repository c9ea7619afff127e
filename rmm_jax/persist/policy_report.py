"""What a policy store holds, as a person reads it: users with their versions and newest
info, and bytes on disk per user and for the shared part (``rmm-jax policies``). Nothing
here verifies or decodes a policy; loading is :mod:`rmm_jax.persist.policy_restore`'s job.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from rmm_jax.errors import InputError
from rmm_jax.persist.policy_index import Entry, PolicyIndex
from rmm_jax.persist.policy_snapshot import (
    chunk_array_bytes,
    cname,
    dir_bytes,
    read_chunk_meta,
    row_bytes,
    shared_meta,
    vname,
)


def listing(idx: PolicyIndex, gens: Path,
            users: Sequence[str] | None = None) -> Iterator[tuple[str, list[Entry], dict]]:
    """``(user, entries, info)`` for every user of index ``idx`` (sorted) or for the stored
    ones of ``users`` (in that order); the info is the newest version's (unverified). Each
    chunk.json is read once."""
    metas: dict[tuple[int, int], list | None] = {}
    if users is not None:
        found = idx.entries(users)
        yield from ((u, found[u], entry_info(gens, found[u][-1], metas)) for u in users if found[u])
        return
    user, entries = None, []
    for uid, e in idx.all_entries():
        if uid != user and entries:
            yield user, entries, entry_info(gens, entries[-1], metas)
            entries = []
        user = uid
        entries.append(e)
    if entries:
        yield user, entries, entry_info(gens, entries[-1], metas)


def entry_info(gens: Path, e: Entry, metas: dict | None = None) -> dict:
    """The info saved with entry ``e`` (unverified; {} when unreadable). ``metas``: the chunks'
    info lists read so far, by (version, chunk), so each chunk.json is read once."""
    metas = {} if metas is None else metas
    key = (e.version, e.chunk)
    if key not in metas:
        try:
            metas[key] = read_chunk_meta(gens / vname(e.version), cname(e.chunk))["info"]
        except (OSError, ValueError, KeyError, TypeError):
            metas[key] = None
    try:
        return dict(metas[key][e.row])
    except (TypeError, IndexError, ValueError):
        return {}


def user_bytes(gens: Path, user_id: str, entries: list[Entry], version: int | None = None) -> dict:
    """On-disk size of ``user_id``'s newest of its ``entries`` (or its ``version``): its
    row's share of its chunk's array file. Returns ``{version, chunk, row, users_in_chunk,
    chunk_bytes, bytes, array_bytes}`` (``array_bytes``: the row's raw array bytes)."""
    es = [e for e in entries if version is None or e.version == version]
    if not es:
        raise InputError(f"no saved policy for user {user_id!r}" + (f" version {version}" if version else ""),
                         where=str(gens.parent))
    e = es[-1]
    snap = gens / vname(e.version)
    try:
        meta = read_chunk_meta(snap, cname(e.chunk))
        n, raw = len(meta["users"]), row_bytes(meta["spec"])
    except (OSError, ValueError, KeyError, TypeError) as ex:
        raise InputError(f"cannot read chunk {cname(e.chunk)} of version {e.version} ({type(ex).__name__})",
                         where=str(snap)) from None
    total = chunk_array_bytes(snap, cname(e.chunk))
    return {"version": e.version, "chunk": cname(e.chunk), "row": e.row, "users_in_chunk": n,
            "chunk_bytes": total, "bytes": round(total / max(n, 1)), "array_bytes": raw}


def shared_bytes(root: Path, versions: list[int], version: int | None = None) -> dict:
    """On-disk size of the newest of shared ``versions`` under ``root`` (or ``version``):
    ``{version, bytes, array_bytes}`` (``array_bytes``: raw params + optimiser-state bytes)."""
    vs = [v for v in versions if version is None or v == version]
    if not vs:
        raise InputError(f"no shared version {version or ''}".rstrip(), where=str(root.parent))
    version = vs[-1]
    snap = root / vname(version)
    try:
        raw = row_bytes(shared_meta(snap)["spec"])
    except (OSError, ValueError, KeyError, TypeError):
        raw = None
    return {"version": version, "bytes": chunk_array_bytes(snap, cname(0)), "array_bytes": raw}


def shared_total_bytes(root: Path, versions: list[int]) -> int:
    """On-disk bytes of every one of shared ``versions`` under ``root``, together (each
    version's whole directory). In scopes with a shared part an online run saves one
    version per users chunk, and each stays while a kept user version pairs with it, so
    this is about users / users per chunk x keep times one version's size, not one's."""
    return sum(dir_bytes(root / vname(v)) for v in versions)
