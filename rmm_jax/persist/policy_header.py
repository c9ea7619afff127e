"""A policy store's header, ``STORE/policy_store.json``: the format marker, the policies'
``meta`` (:class:`~rmm_jax.persist.policy_meta.PolicyMeta` as a dict) and the store's
settings (``keep_versions``, ``chunk_size``, ``chunk_bytes``; a rollback's marks and the
run setting are added by :mod:`~rmm_jax.persist.policy_rollback` and
:mod:`~rmm_jax.persist.policy_setting`).

A store is recognised by its header alone: :func:`read_header` refuses a directory without
one, another format or a format version this rmm-jax does not read, each with a one-line
InputError naming the store (or the file).

Examples:
  >>> import json, tempfile
  >>> from pathlib import Path
  >>> from rmm_jax.persist.policy_header import STORE_FILE, new_header, read_header
  >>> d = Path(tempfile.mkdtemp())
  >>> _ = (d / STORE_FILE).write_text(json.dumps(new_header({"kind": "linear"}, 3, None, 1024, "T")))
  >>> read_header(d)["keep_versions"], read_header(d)["format_version"]
  (3, 3)
  >>> read_header(d / "nowhere")
  Traceback (most recent call last):
  ...
  rmm_jax.errors.InputError: .../nowhere: no such policy store
"""
from __future__ import annotations

import json
from pathlib import Path

from rmm_jax.errors import InputError
from rmm_jax.persist.atomic import write_json

FORMAT = "rmm-jax-policy-store"
FORMAT_VERSION = 3             # 3: user rows (policy_rows.py); 2: arrays.npz chunks; 1: index.json, orbax chunks
READS_FORMAT_VERSIONS = (1, 2, 3)
STORE_FILE = "policy_store.json"


def new_header(meta: dict, keep: int, chunk_size: int | None, chunk_bytes: int, created_at: str) -> dict:
    """The header of a new store of the current format."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "meta": meta, "keep_versions": keep,
            "chunk_size": chunk_size, "chunk_bytes": chunk_bytes, "created_at": created_at}


def read_header(store: Path) -> dict:
    """The header of store directory ``store``, or an InputError saying why it is none."""
    where = str(store)
    if not store.exists():
        raise InputError("no such policy store", where=where)
    if not store.is_dir():
        raise InputError("not a policy store (not a directory)", where=where)
    f = store / STORE_FILE
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


def write_header(store: Path, header: dict) -> None:
    """Replace store ``store``'s header with ``header`` (atomically; under the writer's lock)."""
    write_json(store / STORE_FILE, header)
