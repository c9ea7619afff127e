"""Format-1 policy stores: their ``index.json``, read as index records, and the migration to
format 2 (``index.sqlite``).

Format 1 kept one ``STORE/index.json`` (``{next_version, users: {user: [{version, chunk,
row, saved_at}, ...]}}``) and wrote ``gens/vN/rows.json`` snapshots
(:mod:`rmm_jax.persist.policy_snapshot` still reads those). Such a store opens and loads as
it is: a reader builds its index in memory from :func:`index_records`. The first writer
migrates it in three steps, each safe to repeat after a kill:

1. ``index.sqlite`` is built from :func:`index_records` and renamed into place (the store);
2. :func:`finish_migration`: the header gets ``format_version`` 2;
3. ``index.json`` is deleted.

After step 1 readers use ``index.sqlite``; until step 3 :func:`index_records` still answers
(the store rebuilds from it only when ``index.sqlite`` is missing or corrupt). Old
snapshots stay readable until garbage-collected.
"""
from __future__ import annotations

import json
from pathlib import Path

from rmm_jax.persist.atomic import write_json

INDEX_FILE = "index.json"


def index_records(store: Path, header: dict) -> tuple[list[tuple], int] | None:
    """``(records, next_version)`` from a format-1 store's ``index.json``: records are
    ``(user, version, chunk number, row, saved_at, shared_version=None)`` as
    :meth:`rmm_jax.persist.policy_index.PolicyIndex.build` takes them. None when the store is
    not format 1 or its ``index.json`` is missing or does not parse (then the snapshots are
    the source)."""
    if header.get("format_version") != 1:
        return None
    try:
        idx = json.loads((store / INDEX_FILE).read_text())
        records = [(u, int(e["version"]), int(str(e["chunk"])[1:]), int(e["row"]), e.get("saved_at"), None)
                   for u, es in idx["users"].items() for e in es]
        return records, int(idx.get("next_version", 1))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def index_mtime(store: Path) -> int | None:
    """Modification time (ns) of ``index.json``, None if absent: a reader's cache key."""
    try:
        return (store / INDEX_FILE).stat().st_mtime_ns
    except OSError:
        return None


def finish_migration(store: Path, header_file: Path, header: dict, *, format_version: int,
                     chunk_bytes: int) -> dict:
    """Steps 2 and 3 once ``index.sqlite`` is in place (call under the writer's lock):
    header to ``format_version`` (with ``chunk_bytes``, which format 1 lacked), then
    ``index.json`` deleted. Returns the header now on disk."""
    if header.get("format_version") != format_version:
        header = {**header, "format_version": format_version, "chunk_bytes": header.get("chunk_bytes", chunk_bytes)}
        write_json(header_file, header)
    (store / INDEX_FILE).unlink(missing_ok=True)
    return header
