"""The policy store's snapshots on disk: one directory per saved version, made of chunks
that are each verified and read on their own.

Layout (store format 3)::

    gens/v00000007/              one save call (a "version")
      c0000/                     one chunk: U users of one tree structure, rows 0..U-1, as user rows
                                 (chunk.json, rows.bin, CHECKSUMS.json: :mod:`rmm_jax.persist.policy_rows`)
      c0001/ ...
    shared/v00000002/c0000/      the shared state: the same files, one row of parts params and
                                 opt_state, chunk.json's info is one dict, users is absent

Loading a user reads, verifies and parses its chunk's ``chunk.json`` and its own row.
Nothing per snapshot grows with the size of a save. Completeness: the store writes a
snapshot in a temp dir and renames it into place, and commits it to the index only after
that (:mod:`rmm_jax.persist.policy_index`). Chunks are sized by bytes
(:func:`users_per_chunk`), so the file count is proportional to bytes, not users.

Older formats are read, never written. Format 2: ``chunk.json`` (the same metadata without
the row layout), ``arrays.npz`` (uncompressed; member ``"<part>.<i:06d>"`` = leaf i of the
part, shape (U, ...)) and a ``CHECKSUMS.json`` of both, so a load hashed the whole chunk.
Format 1: ``gens/vN/rows.json`` (``{chunks: {c0000: {users, spec}}, info: {user: {...}}}``),
the chunks' orbax checkpoints directly in ``c0000/`` (:func:`save_chunk`/:func:`load_chunk`;
orbax is imported only for these), one ``CHECKSUMS.json`` per snapshot. :func:`read_chunk`
and :func:`read_shared` read every format and return the same shapes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from rmm_jax.persist import checksums
from rmm_jax.persist.atomic import atomic_dir
from rmm_jax.persist.codec import encode_tree, leaf_specs
from rmm_jax.persist.policy_rows import (
    CHUNK_FILE,
    ROWS_FILE,
    is_rows,
    read_meta,
    read_rows,
    split_rows,
    verify_rows,
    write_rows,
)

ARRAYS_FILE = "arrays.npz"       # format 2
LEGACY_FILE = "rows.json"        # format 1
USER_PARTS = ("params", "opt_state", "learner_state")
LEARNED_PART = "learned"         # a user's row also holds the calls its policy learned from (learned_calls.py)
SHARED_PARTS = ("params", "opt_state")


def vname(v: int) -> str:
    return f"v{v:08d}"


def cname(n: int) -> str:
    return f"c{n:04d}"


def snapshot_dirs(root: Path) -> list[tuple[int, Path]]:
    """Snapshot dirs ``v00000001`` under ``root``, oldest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("v") and p.name[1:].isdigit():
                out.append((int(p.name[1:]), p))
    return sorted(out)


def is_legacy(snap: Path) -> bool:
    """A format-1 snapshot (one rows.json and one checksum file for the whole snapshot)."""
    return (snap / LEGACY_FILE).is_file()


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (0 if absent)."""
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += (Path(root) / n).stat().st_size
            except OSError:
                pass
    return total


def row_bytes(specs: dict) -> int:
    """Array bytes of one row (one user) of a chunk with these part specs."""
    return sum(int(np.prod(s["shape"], dtype=np.int64)) * np.dtype(s["dtype"]).itemsize
               for spec in specs.values() for s in leaf_specs(spec))


def users_per_chunk(specs: dict, chunk_bytes: int, max_users: int) -> int:
    """Users per chunk so that a chunk holds about ``chunk_bytes`` of arrays (at least 1,
    at most ``max_users``, which bounds the chunk.json a load parses)."""
    return int(max(1, min(max_users, chunk_bytes // max(row_bytes(specs), 1))))


def encode_users(state, learned, n: int) -> tuple[dict, dict]:
    """The specs and leaves (each with a leading axis of ``n`` users) of a stacked
    :class:`~rmm_jax.core.types.UserState`'s parts and, unless ``learned`` is None, of the
    stacked calls the users learned from (:data:`LEARNED_PART`)."""
    specs, stacked = {}, {}
    for p, t in zip(USER_PARTS, jax.device_get(tuple(state))):
        specs[p], stacked[p] = encode_tree(t, batch=n, where=f"save {p}")
    if learned is not None:       # rows without it: learned from no call (and no bytes spent on saying so)
        specs[LEARNED_PART], stacked[LEARNED_PART] = encode_tree(learned, batch=n, where="save learned")
    return specs, stacked


def write_snapshot(dest: Path, head: dict, uids: list[str], specs: dict, stacked: dict, infos: list[dict],
                   previous: list[int | None] | None, size: int | None, chunk_bytes: int,
                   max_users: int) -> list[tuple[str, int, int]]:
    """Write snapshot ``dest`` (atomically): chunks of ``size`` users, else of about
    ``chunk_bytes`` each (at most ``max_users``), in equal chunks; each chunk's
    ``chunk.json`` holds ``head``, its users, their ``infos`` and their ``previous``
    versions (None: not known, not listed). Returns the ``(user, chunk, row)`` placements."""
    per = size or users_per_chunk(specs, chunk_bytes, max_users)
    if size:
        cuts = list(range(0, len(uids), size)) + [len(uids)]
    else:
        k = -(-len(uids) // per)
        cuts = [round(i * len(uids) / k) for i in range(k + 1)]
    placed = []
    with atomic_dir(dest, overwrite=False) as tmp:
        for n, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
            write_rows(tmp / cname(n), {**head, "chunk": cname(n), "users": uids[lo:hi], "info": infos[lo:hi],
                                        **({} if previous is None else {"previous": previous[lo:hi]})},
                       specs, {p: [a[lo:hi] for a in stacked[p]] for p in specs}, hi - lo)
            placed += [(uid, n, row) for row, uid in enumerate(uids[lo:hi])]
    return placed


# --------------------------------------------------------------------------- older formats' arrays


def load_arrays(src: Path, counts: dict[str, int]) -> dict[str, list[np.ndarray]]:
    """Format 2: ``counts[part]`` leaves per part from a chunk's ``arrays.npz``."""
    with np.load(src, allow_pickle=False) as z:
        return {p: [z[f"{p}.{i:06d}"] for i in range(n)] for p, n in counts.items()}


def save_chunk(dest: Path, parts: dict[str, list[np.ndarray]]) -> None:
    """Format 1: write one orbax checkpoint ``{part: {"l000000": leaf, ...}}`` at ``dest``
    (what format-1 stores hold; tests build such stores with it)."""
    import orbax.checkpoint as ocp

    tree = {p: {f"l{i:06d}": np.ascontiguousarray(a) for i, a in enumerate(ls)}
            for p, ls in parts.items() if ls}
    if not tree:
        dest.mkdir()
        return
    ocp.PyTreeCheckpointer().save(dest.resolve(), tree)


def load_chunk(src: Path, counts: dict[str, int]) -> dict[str, list[np.ndarray]]:
    """Format 1: read a chunk written by :func:`save_chunk` back as numpy leaves per part."""
    import orbax.checkpoint as ocp

    want = {p: n for p, n in counts.items() if n}
    if not want:
        return {p: [] for p in counts}
    args = {p: {f"l{i:06d}": ocp.RestoreArgs(restore_type=np.ndarray) for i in range(n)}
            for p, n in want.items()}
    tree = ocp.PyTreeCheckpointer().restore(src.resolve(), args=ocp.args.PyTreeRestore(restore_args=args))
    return {p: [np.asarray(tree[p][f"l{i:06d}"]) for i in range(want.get(p, 0))] for p in counts}


def _counts(specs: dict, parts) -> dict[str, int]:
    return {p: len(leaf_specs(specs[p])) if p in specs else 0 for p in parts}


def _as_spec(a: np.ndarray, s: dict, lead: tuple[int, ...]) -> np.ndarray:
    """A leaf in its spec's shape (behind ``lead``) and dtype: orbax gives 0-d arrays back as
    (1,), ``.npy`` gives ml_dtypes (bfloat16, ...) back as raw void bytes."""
    a = np.asarray(a)
    if str(a.dtype) != s["dtype"]:
        a = a.view(np.dtype(s["dtype"]))
    return a.reshape(lead + tuple(s["shape"]))


def _reshaped(leaves: dict[str, list[np.ndarray]], specs: dict, lead: tuple[int, ...]) -> dict:
    return {p: [_as_spec(a, s, lead) for a, s in zip(ls, leaf_specs(specs[p]))] if ls else ls
            for p, ls in leaves.items()}


def _whole_chunk(snap: Path, chunk: str, meta: dict, parts) -> dict[str, list[np.ndarray]]:
    """Every row of a verified format-1 or format-2 chunk, leaves per part."""
    counts = _counts(meta["spec"], parts)
    leaves = (load_chunk(snap / chunk, counts) if is_legacy(snap)
              else load_arrays(snap / chunk / ARRAYS_FILE, counts))
    n = len(meta["users"]) if "users" in meta else 1          # the shared part: one row without a users axis
    return _reshaped(leaves, meta["spec"], (n,))


# --------------------------------------------------------------------------- chunks


def verify_chunk(chunk_dir: Path) -> str | None:
    """None if the whole chunk verifies (every row of a rows chunk), else a one-line reason."""
    meta = read_meta(chunk_dir)
    if isinstance(meta, str):
        return meta
    return verify_rows(chunk_dir, meta) if is_rows(meta) else None


def verify_snapshot(snap: Path, chunk: str | None = None) -> str | None:
    """Verify chunk ``chunk`` of snapshot ``snap`` (every chunk if None), any format.
    Returns None when good, else a one-line reason."""
    if is_legacy(snap):
        def select(files):
            wanted = [r for r in files if chunk is None or r == LEGACY_FILE or r.startswith(chunk + "/")]
            if LEGACY_FILE not in wanted or (chunk is not None and len(wanted) < 2):
                return f"checksums list no files for {chunk or LEGACY_FILE}"
            return wanted

        return checksums.verify(snap, select, "incomplete (no checksum file)")
    if chunk is not None:
        return verify_chunk(snap / chunk)
    names = sorted(p.name for p in snap.iterdir() if p.is_dir()) if snap.is_dir() else []
    if not names:
        return "no chunks"
    for name in names:
        reason = verify_chunk(snap / name)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def read_chunk_meta(snap: Path, chunk: str) -> dict:
    """The chunk's metadata, unverified: ``{users, info: [per row], spec, saved_at}``
    (format 1 is converted to this shape). Raises OSError/ValueError/KeyError."""
    if is_legacy(snap):
        rows = json.loads((snap / LEGACY_FILE).read_text())
        c = rows["chunks"][chunk]
        info = rows.get("info", {})
        return {"version": rows.get("version"), "saved_at": rows.get("saved_at"), "users": c["users"],
                "spec": c["spec"], "info": [info.get(u, {}) for u in c["users"]]}
    return json.loads((snap / chunk / CHUNK_FILE).read_text())


def read_chunk(snap: Path, chunk: str, rows: Sequence[int],
               parts=USER_PARTS) -> tuple[dict, dict[str, list[np.ndarray]], dict[int, str]] | str:
    """Rows ``rows`` of chunk ``chunk`` of snapshot ``snap``, any format: ``(meta, leaves
    per part with a leading axis of len(rows), {position in rows: reason} for damaged rows)``,
    or the reason the whole chunk is unusable. A rows chunk reads and verifies only the
    rows asked for; an older chunk is verified and read whole."""
    try:
        if is_legacy(snap):
            reason = verify_snapshot(snap, chunk)
            if reason is not None:
                return reason
            meta = read_chunk_meta(snap, chunk)
        else:
            meta = read_meta(snap / chunk)
            if isinstance(meta, str):
                return meta
        if is_rows(meta):
            buf, bad = read_rows(snap / chunk, meta, rows)
            return meta, split_rows(buf, meta), bad
        whole = _whole_chunk(snap, chunk, meta, parts)
        take = np.asarray(rows, np.int64)
        return meta, {p: [a[take] for a in ls] for p, ls in whole.items()}, {}
    except Exception as e:  # noqa: BLE001 - any read failure = bad version
        return f"restore failed ({type(e).__name__}: {e})"


def chunk_array_bytes(snap: Path, chunk: str) -> int:
    """On-disk bytes of the chunk's array files."""
    if is_legacy(snap):
        return dir_bytes(snap / chunk)
    for name in (ROWS_FILE, ARRAYS_FILE):
        try:
            return (snap / chunk / name).stat().st_size
        except OSError:
            pass
    return 0


def snapshot_records(gens: Path):
    """``(user, version, chunk number, row, saved_at, shared_version)`` of every readable
    chunk of every snapshot under ``gens`` (unverified): what an index rebuild starts from."""
    for v, snap in snapshot_dirs(gens):
        if is_legacy(snap):
            try:
                rows = json.loads((snap / LEGACY_FILE).read_text())
                chunks = [(name, c["users"], rows.get("saved_at"), None) for name, c in rows["chunks"].items()]
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        else:
            chunks = []
            for d in sorted(snap.iterdir()):
                try:
                    meta = json.loads((d / CHUNK_FILE).read_text())
                    chunks.append((d.name, meta["users"], meta.get("saved_at"), meta.get("shared_version")))
                except (OSError, ValueError, KeyError, TypeError):
                    continue
        for name, users, saved_at, shared in chunks:
            if not (name.startswith("c") and name[1:].isdigit()):
                continue
            for row, uid in enumerate(users):
                yield uid, v, int(name[1:]), row, saved_at, shared


# --------------------------------------------------------------------------- shared


def write_shared(snap: Path, meta: dict, specs: dict, leaves: dict[str, list[np.ndarray]]) -> None:
    """Write the shared state (leaves without a users axis) as the one row of the one
    chunk of (empty) snapshot dir ``snap``."""
    write_rows(snap / cname(0), meta, specs, {p: [a[None] for a in ls] for p, ls in leaves.items()}, 1)


def read_shared(snap: Path) -> tuple[dict, dict[str, list[np.ndarray]]] | str:
    """``(meta {spec: {params, opt_state}, info}, leaves per part)`` of a verified shared
    snapshot (any format), or the reason it is unusable."""
    if is_legacy(snap):
        reason = verify_snapshot(snap, cname(0))
        if reason is not None:
            return reason
        try:
            meta = shared_meta(snap)
            leaves = load_chunk(snap / cname(0), _counts(meta["spec"], SHARED_PARTS))
            return meta, _reshaped(leaves, meta["spec"], ())
        except Exception as e:  # noqa: BLE001 - any read failure = bad version
            return f"restore failed ({type(e).__name__}: {e})"
    got = read_chunk(snap, cname(0), [0], SHARED_PARTS)
    if isinstance(got, str):
        return got
    meta, leaves, bad = got
    if bad:
        return bad[0]
    return meta, {p: [a[0] for a in ls] for p, ls in leaves.items()}


def shared_meta(snap: Path) -> dict:
    """The shared snapshot's metadata, unverified (any format)."""
    if is_legacy(snap):
        rows = json.loads((snap / LEGACY_FILE).read_text())
        return {"spec": {"params": rows["chunks"][cname(0)]["spec"]["params"], "opt_state": {"t": "none"}},
                "info": {}, "saved_at": rows.get("saved_at")}
    return json.loads((snap / cname(0) / CHUNK_FILE).read_text())
