"""Checksummed directories: a ``CHECKSUMS.json`` written last makes a snapshot verifiable.

Used by the policy store and the run-state checkpoints. The file lists the sha256 of
every other file and a hash of that list itself; a snapshot verifies only if the list is
intact and every file it names matches. A snapshot whose checksum file is missing was
never finished.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

from rmm_jax.persist.atomic import atomic_file, fsync_dir

CHECKSUM_FILE = "CHECKSUMS.json"


def sha256(path: Path, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _self_hash(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_checksums(snap: Path, listed: Sequence[str] | None = None) -> None:
    """Hash (and fsync) every file of ``snap``, or only the ``listed`` ones (relative
    paths; the caller fsyncs the rest, which it verifies some other way); write
    CHECKSUMS.json last."""
    if listed is None:
        listed = [(Path(root) / n).relative_to(snap).as_posix() for root, _, names in os.walk(snap) for n in names]
    files = {rel: sha256(snap / rel, fsync=True) for rel in listed}
    for root, _, _ in os.walk(snap):
        fsync_dir(Path(root))
    with atomic_file(snap / CHECKSUM_FILE) as f:
        json.dump({"algorithm": "sha256", "files": files, "self": _self_hash(files)}, f, sort_keys=True)


def verify(snap: Path, select: Callable[[dict], list[str] | str], missing: str) -> str | None:
    """None if the files ``select(listed files)`` picks match their checksums, else a
    one-line reason. ``select`` may return a reason string instead (e.g. a required
    file is not listed); ``missing`` is the reason when there is no checksum file."""
    try:
        sums = json.loads((snap / CHECKSUM_FILE).read_text())
        files = sums["files"]
        if sums.get("self") != _self_hash(files):
            return f"{CHECKSUM_FILE} does not match its own hash"
    except FileNotFoundError:
        return missing
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {CHECKSUM_FILE} ({type(e).__name__})"
    wanted = select(files)
    if isinstance(wanted, str):
        return wanted
    for rel in sorted(wanted):
        try:
            if sha256(snap / rel) != files[rel]:
                return f"{rel}: sha256 mismatch"
        except OSError:
            return f"{rel}: missing or unreadable"
    return None
