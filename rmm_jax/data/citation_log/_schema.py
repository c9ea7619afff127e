"""The citation log's keys and :class:`LogRecord`, the record they decode to, with how
messages name a key and a value's type (:mod:`rmm_jax.data.citation_log`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

REQUIRED_KEYS = ("user_id", "candidates", "selected", "cited")
OPTIONAL_KEYS = ("call_id", "query_id", "log_prob", "timestamp", "query", "gold", "logits", "policy_version",
                 "shared_version")
LOG_KEYS = REQUIRED_KEYS + OPTIONAL_KEYS


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One generator call. Id lists are tuples; ``selected`` is in display order.
    ``query_id``, ``call_id`` and ``query_text`` may be None, not all three."""

    user_id: str
    query_id: str | None
    candidates: tuple[str, ...]
    selected: tuple[str, ...]
    cited: tuple[str, ...]
    log_prob: float | None = None
    timestamp: str | int | float | None = None
    query_text: str | None = None                           # key 'query'
    candidate_texts: tuple[str | None, ...] | None = None   # per candidate; None: ids only
    gold: tuple[str, ...] | None = None
    logits: tuple[float, ...] | None = None
    call_id: str | None = None
    policy_version: int | None = None
    shared_version: int | None = None
    versions_logged: bool = False     # the record carries both version keys (null included): who served it


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _key_where(where: str, key: str) -> str:
    return f"{where}: key '{key}'"
