"""A chunk of user rows (store format 3): each user's whole saved state is one contiguous,
separately checksummed byte range, so loading a user reads and verifies that user's bytes
and nothing else.

Layout of one chunk::

    c0000/
      chunk.json      {format: "rmm-jax-policy-rows", version, chunk, saved_at, shared_version,
                       users: [U ids] (absent for the shared part), info: [U dicts] (shared: one dict),
                       spec: {part: codec spec}, parts: [part names, in row order], rows: U,
                       row_stride, row_bytes, row_sha256: [U hex digests]}
      rows.bin        U rows of row_stride bytes; row r, at offset r·row_stride, holds every leaf of
                      every part (parts in ``parts`` order, leaves in spec order) in C order, each
                      leaf aligned to its item size
      CHECKSUMS.json  sha256 of chunk.json, written last

Verification has two steps. ``chunk.json`` (a few KB: ids, infos, specs, one digest per
row) is checked against ``CHECKSUMS.json``; then every row that is read is checked against
its digest before it is used. A flipped bit or a truncated file damages the rows it
touches and no others; a damaged row is reported (``rows.bin: sha256 mismatch``) and its
user falls back to an older version (:mod:`rmm_jax.persist.policy_restore`).

**Why rows, not one ``.npz`` per chunk (format 2).** A format-2 load hashed and parsed
the whole chunk (8 MB for 56 hybrid users at d = 384) to use one user's 147 KB: 23 ms a
cold user (``benchmarks/results/serve.json`` at commit c655ff9). Reading one row is one
``pread`` of the row and one sha256 of it. Writing costs the same as before: the chunk's
arrays are copied once into rows and hashed once.

The parts are whatever the caller names (today a user's ``params``, ``opt_state`` and
``learner_state``; the shared part's ``params`` and ``opt_state``): a part added later is
one more entry of ``parts``, saved in the same row, in the same atomic step.

Examples:
  >>> import tempfile, numpy as np
  >>> from pathlib import Path
  >>> from rmm_jax.persist.codec import encode_tree
  >>> from rmm_jax.persist.policy_rows import read_meta, read_rows, split_rows, write_rows
  >>> spec, leaves = encode_tree({"w": np.arange(6.0).reshape(3, 2), "n": np.arange(3)}, batch=3)
  >>> d = Path(tempfile.mkdtemp()) / "c0000"
  >>> write_rows(d, {"users": ["a", "b", "c"]}, {"params": spec}, {"params": leaves}, 3)
  >>> meta = read_meta(d)
  >>> buf, bad = read_rows(d, meta, [2])
  >>> split_rows(buf, meta)["params"][1].tolist(), bad
  ([[4.0, 5.0]], {})
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from rmm_jax.persist import checksums
from rmm_jax.persist.codec import leaf_specs

CHUNK_FILE = "chunk.json"
ROWS_FILE = "rows.bin"
ROWS_FORMAT = "rmm-jax-policy-rows"
STRIDE_ALIGN = 16          # every row starts at a multiple of the largest item size


class Slot(NamedTuple):
    """Where one leaf lies in a row."""
    part: str
    index: int          # leaf index within the part
    dtype: np.dtype
    shape: tuple
    offset: int
    nbytes: int


def row_slots(specs: dict, parts: Sequence[str]) -> tuple[list[Slot], int]:
    """The leaves' places in a row, and the row stride (bytes)."""
    slots, at = [], 0
    for p in parts:
        for i, s in enumerate(leaf_specs(specs[p])):
            dt = np.dtype(s["dtype"])
            at = -(-at // dt.itemsize) * dt.itemsize
            nbytes = math.prod(s["shape"]) * dt.itemsize
            slots.append(Slot(p, i, dt, tuple(s["shape"]), at, nbytes))
            at += nbytes
    return slots, -(-at // STRIDE_ALIGN) * STRIDE_ALIGN


def _digest(row) -> str:
    return hashlib.sha256(row).hexdigest()


def write_rows(dest: Path, meta: dict, specs: dict, leaves: dict[str, list[np.ndarray]], n: int) -> None:
    """Write chunk dir ``dest`` (which must not exist): ``n`` rows holding ``leaves[part]``
    (each leaf with a leading axis of ``n``, in spec order), ``chunk.json`` (``meta`` plus
    the layout and digests), then CHECKSUMS.json. Everything is fsynced."""
    parts = list(specs)
    slots, stride = row_slots(specs, parts)
    buf = np.zeros((n, stride), np.uint8)
    for sl in slots:
        a = np.ascontiguousarray(leaves[sl.part][sl.index])
        buf[:, sl.offset:sl.offset + sl.nbytes] = a.reshape(n, -1).view(np.uint8)
    dest.mkdir()
    with open(dest / ROWS_FILE, "xb") as f:
        f.write(buf.data)
        f.flush()
        os.fsync(f.fileno())
    doc = {"format": ROWS_FORMAT, **meta, "spec": specs, "parts": parts, "rows": n, "row_stride": stride,
           "row_bytes": sum(sl.nbytes for sl in slots), "row_sha256": [_digest(r) for r in buf]}
    (dest / CHUNK_FILE).write_text(json.dumps(doc, sort_keys=True))
    checksums.write_checksums(dest, listed=[CHUNK_FILE])


def is_rows(meta: dict) -> bool:
    """Whether chunk metadata describes a rows chunk (format 3)."""
    return meta.get("format") == ROWS_FORMAT


def read_meta(chunk_dir: Path) -> dict | str:
    """The chunk's metadata verified against its CHECKSUMS.json, or why it is unusable
    (any chunk format: format 2's CHECKSUMS.json also lists its ``arrays.npz``, which is
    then hashed too)."""
    if not chunk_dir.is_dir():
        return "missing"
    reason = checksums.verify(chunk_dir, lambda files: list(files) if CHUNK_FILE in files
                              else f"checksums list no {CHUNK_FILE}", "incomplete (no checksum file)")
    if reason is not None:
        return reason
    try:
        return json.loads((chunk_dir / CHUNK_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {CHUNK_FILE} ({type(e).__name__})"


def read_rows(chunk_dir: Path, meta: dict, rows: Sequence[int]) -> tuple[np.ndarray, dict[int, str]]:
    """Rows ``rows`` of a rows chunk, as ``(len(rows), row_stride)`` bytes, and the reason
    each damaged one is unusable (``{position in rows: reason}``; its bytes are not to be
    used). Consecutive rows are read in one call."""
    stride, digests = int(meta["row_stride"]), meta["row_sha256"]
    buf = np.zeros((len(rows), stride), np.uint8)
    bad: dict[int, str] = {}
    try:
        f = open(chunk_dir / ROWS_FILE, "rb", buffering=0)
    except OSError:
        return buf, {i: f"{ROWS_FILE}: missing or unreadable" for i in range(len(rows))}
    with f:
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            f.seek(rows[i] * stride)
            got = f.readinto(memoryview(buf[i:j]).cast("B")) if stride else 0    # rows of no bytes: an empty tree
            for k in range(i, j):
                if got < (k - i + 1) * stride:
                    bad[k] = f"{ROWS_FILE}: short"
                elif _digest(buf[k]) != digests[rows[k]]:
                    bad[k] = f"{ROWS_FILE}: sha256 mismatch"
            i = j
    return buf, bad


def split_rows(buf: np.ndarray, meta: dict) -> dict[str, list[np.ndarray]]:
    """The leaves of every part from rows ``buf`` (``(n, row_stride)`` bytes), each with a
    leading axis of n (views of ``buf`` where the bytes allow)."""
    slots, _ = row_slots(meta["spec"], meta["parts"])
    out: dict[str, list[np.ndarray]] = {p: [] for p in meta["parts"]}
    n = buf.shape[0]
    for sl in slots:
        raw = buf[:, sl.offset:sl.offset + sl.nbytes]
        out[sl.part].append((raw if n == 1 else np.ascontiguousarray(raw)).view(sl.dtype).reshape((n, *sl.shape)))
    return out


def verify_rows(chunk_dir: Path, meta: dict) -> str | None:
    """None if the rows file has every row and each matches its digest, else the reason."""
    try:
        size = (chunk_dir / ROWS_FILE).stat().st_size
    except OSError:
        return f"{ROWS_FILE}: missing or unreadable"
    if size != int(meta["rows"]) * int(meta["row_stride"]):
        return f"{ROWS_FILE}: {size} bytes, expected {int(meta['rows']) * int(meta['row_stride'])}"
    _, bad = read_rows(chunk_dir, meta, range(int(meta["rows"])))
    return next(iter(bad.values()), None)
