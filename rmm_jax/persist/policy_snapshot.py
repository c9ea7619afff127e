"""The policy store's snapshots on disk: one directory per saved version, made of chunks
that are each verified and read on their own.

Layout (store format 2)::

    gens/v00000007/              one save call (a "version")
      c0000/                     one chunk: U users of one tree structure, rows 0..U-1
        chunk.json               {format, version, chunk, saved_at, shared_version, users: [U ids],
                                  info: [U dicts], spec: {params|opt_state|learner_state: codec spec},
                                  row_bytes, array_bytes}
        arrays.npz               uncompressed; member "<part>.<i:06d>" = leaf i of the part, shape (U, ...)
        CHECKSUMS.json           sha256 of chunk.json and arrays.npz, written last
      c0001/ ...
    shared/v00000002/c0000/      the shared state, same files: parts params and opt_state without a
                                 users axis, chunk.json's info is one dict, users is absent

Loading a user reads, hashes and parses only its chunk: ``chunk.json`` lists the chunk's
users and infos, the checksums list the chunk's files. Nothing per snapshot grows with the
size of a save (format 1 had one ``rows.json`` with every user of the save and one
``CHECKSUMS.json`` with every file of the snapshot). Completeness: the store writes a
snapshot in a temp dir and renames it into place, and commits it to the index only after
that (:mod:`rmm_jax.persist.policy_index`).

**Why one .npz per chunk, not an orbax checkpoint (format 1).** Measured on the 2-core
development machine, busy with other jobs (load ~6), for one chunk of 56 hybrid-sized
users (8.3 MB, 16 leaves) including checksums and fsync: orbax 170-270 ms to save and
30-60 ms to verify + restore; one ``.npy`` per leaf 80-120 ms / 17-32 ms; one ``.npz``
50 ms / 26 ms (one file to fsync instead of orbax's 13 or 16 ``.npy``). For 100,000 such
users (~1,800 chunks) orbax alone would add 4-6 minutes on that machine; with ``.npz`` the
whole save took 143 s (``benchmarks/results/store_scale.json``). So the arrays are a plain
uncompressed ``.npz``: self-describing (``numpy.load`` reads it, no pickle), written once,
covered by the chunk's checksums. Nothing orbax adds is used here (sharded arrays, async
saves, partial restores); ``bfloat16`` leaves come back through the spec's dtype. Chunks
are sized by bytes (:func:`users_per_chunk`), so the file count is proportional to bytes,
not users.

Format 1 (read only): ``gens/vN/rows.json`` (``{chunks: {c0000: {users, spec}}, info:
{user: {...}}}``), the chunks' orbax checkpoints directly in ``c0000/``
(:func:`save_chunk`/:func:`load_chunk`; orbax is imported only for these), one
``CHECKSUMS.json`` per snapshot. :func:`read_chunk` and :func:`read_shared` return the same
metadata shape for both formats.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from rmm_jax.persist import checksums
from rmm_jax.persist.atomic import write_json
from rmm_jax.persist.codec import leaf_specs

CHUNK_FILE = "chunk.json"
ARRAYS_FILE = "arrays.npz"
ROWS_FILE = "rows.json"          # format 1
CHUNK_FORMAT = "rmm-jax-policy-chunk"
USER_PARTS = ("params", "opt_state", "learner_state")
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
    return (snap / ROWS_FILE).is_file()


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


# --------------------------------------------------------------------------- arrays


def save_arrays(dest: Path, parts: dict[str, list[np.ndarray]]) -> None:
    """Write the leaves of every part into one uncompressed ``.npz`` at ``dest`` (not
    fsynced: the checksum pass does that)."""
    with open(dest, "xb") as f:
        np.savez(f, **{f"{p}.{i:06d}": np.ascontiguousarray(a) for p, ls in parts.items() for i, a in enumerate(ls)})


def load_arrays(src: Path, counts: dict[str, int]) -> dict[str, list[np.ndarray]]:
    """Read ``counts[part]`` leaves per part from a :func:`save_arrays` file."""
    with np.load(src, allow_pickle=False) as z:
        return {p: [z[f"{p}.{i:06d}"] for i in range(n)] for p, n in counts.items()}


def save_chunk(dest: Path, parts: dict[str, list[np.ndarray]]) -> None:
    """Format 1: write one orbax checkpoint ``{part: {"l000000": leaf, ...}}`` at ``dest``."""
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


# --------------------------------------------------------------------------- chunks


def write_chunk(dest: Path, meta: dict, parts: dict[str, list[np.ndarray]]) -> None:
    """Write chunk dir ``dest``: the arrays, ``chunk.json`` (``meta`` plus array_bytes),
    then CHECKSUMS.json (sha256 of both, files fsynced) last."""
    dest.mkdir()
    save_arrays(dest / ARRAYS_FILE, parts)
    write_json(dest / CHUNK_FILE, {"format": CHUNK_FORMAT, **meta, "array_bytes": (dest / ARRAYS_FILE).stat().st_size})
    checksums.write_checksums(dest)


def verify_chunk(chunk_dir: Path) -> str | None:
    """None if every file of the chunk matches its checksum, else a one-line reason."""
    def select(files):
        return list(files) if CHUNK_FILE in files else f"checksums list no {CHUNK_FILE}"

    if not chunk_dir.is_dir():
        return "missing"
    return checksums.verify(chunk_dir, select, "incomplete (no checksum file)")


def verify_snapshot(snap: Path, chunk: str | None = None) -> str | None:
    """Verify chunk ``chunk`` of snapshot ``snap`` (every chunk if None), either format.
    Returns None when good, else a one-line reason."""
    if is_legacy(snap):
        def select(files):
            wanted = [r for r in files if chunk is None or r == ROWS_FILE or r.startswith(chunk + "/")]
            if ROWS_FILE not in wanted or (chunk is not None and len(wanted) < 2):
                return f"checksums list no files for {chunk or ROWS_FILE}"
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
        rows = json.loads((snap / ROWS_FILE).read_text())
        c = rows["chunks"][chunk]
        info = rows.get("info", {})
        return {"version": rows.get("version"), "saved_at": rows.get("saved_at"), "users": c["users"],
                "spec": c["spec"], "info": [info.get(u, {}) for u in c["users"]]}
    return json.loads((snap / chunk / CHUNK_FILE).read_text())


def read_chunk(snap: Path, chunk: str) -> tuple[dict, dict[str, list[np.ndarray]]] | str:
    """``(meta, leaves per part)`` of a verified chunk, or the reason it is unusable."""
    reason = verify_snapshot(snap, chunk)
    if reason is not None:
        return reason
    try:
        meta = read_chunk_meta(snap, chunk)
        counts = _counts(meta["spec"], USER_PARTS)
        leaves = (load_chunk(snap / chunk, counts) if is_legacy(snap)
                  else load_arrays(snap / chunk / ARRAYS_FILE, counts))
        return meta, _reshaped(leaves, meta["spec"], (len(meta["users"]),))
    except Exception as e:  # noqa: BLE001 - any read failure = bad version
        return f"restore failed ({type(e).__name__}: {e})"


def chunk_array_bytes(snap: Path, chunk: str) -> int:
    """On-disk bytes of the chunk's array files."""
    if is_legacy(snap):
        return dir_bytes(snap / chunk)
    try:
        return (snap / chunk / ARRAYS_FILE).stat().st_size
    except OSError:
        return 0


def snapshot_records(gens: Path):
    """``(user, version, chunk number, row, saved_at, shared_version)`` of every readable
    chunk of every snapshot under ``gens`` (unverified): what an index rebuild starts from."""
    for v, snap in snapshot_dirs(gens):
        if is_legacy(snap):
            try:
                rows = json.loads((snap / ROWS_FILE).read_text())
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


def write_shared(snap: Path, meta: dict, parts: dict[str, list[np.ndarray]]) -> None:
    """Write the shared state's one chunk into (empty) snapshot dir ``snap``."""
    write_chunk(snap / cname(0), meta, parts)


def read_shared(snap: Path) -> tuple[dict, dict[str, list[np.ndarray]]] | str:
    """``(meta {spec: {params, opt_state}, info}, leaves per part)`` of a verified shared
    snapshot (either format), or the reason it is unusable."""
    reason = verify_snapshot(snap, cname(0))
    if reason is not None:
        return reason
    try:
        meta = shared_meta(snap)
        counts = _counts(meta["spec"], SHARED_PARTS)
        leaves = (load_chunk(snap / cname(0), counts) if is_legacy(snap)
                  else load_arrays(snap / cname(0) / ARRAYS_FILE, counts))
        return meta, _reshaped(leaves, meta["spec"], ())
    except Exception as e:  # noqa: BLE001 - any read failure = bad version
        return f"restore failed ({type(e).__name__}: {e})"


def shared_meta(snap: Path) -> dict:
    """The shared snapshot's metadata, unverified (either format)."""
    if is_legacy(snap):
        rows = json.loads((snap / ROWS_FILE).read_text())
        return {"spec": {"params": rows["chunks"][cname(0)]["spec"]["params"], "opt_state": {"t": "none"}},
                "info": {}, "saved_at": rows.get("saved_at")}
    return json.loads((snap / cname(0) / CHUNK_FILE).read_text())
