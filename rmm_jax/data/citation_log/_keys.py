"""Unknown keys that look like misspelt log keys: found, and noted once per log
(:mod:`rmm_jax.data.citation_log`, "Decisions")."""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from rmm_jax.data.citation_log._schema import LOG_KEYS
from rmm_jax.errors import at

#: An unknown key this close to a log key (difflib's ratio, lower case) is noted as a likely misspelling.
CLOSE_KEY = 0.8
#: A log key with one of these appended (``gold_ids``, ``query_text``) is noted as the log key.
KEY_SUFFIXES = ("_ids", "_id", "_texts", "_text")


def misspelt_key(key: str, keys: Sequence[str] = LOG_KEYS) -> str | None:
    """The log key (or one of ``keys``) an unknown ``key`` is likely a misspelling of, else None: the closest
    with a difflib ratio of at least :data:`CLOSE_KEY` to ``key`` in lower case (a key
    that differs by case, one swapped, missing or extra letter, or ``-`` for ``_``).

    A swap of two adjacent letters counts whatever the ratio, which is below the cutoff for
    a short key (``glod`` to ``gold``: 0.75). So does a log key, or a misspelling of one, with
    a suffix of :data:`KEY_SUFFIXES` appended (``gold_ids`` to ``gold``: 0.67).

    >>> from rmm_jax.data.citation_log import misspelt_key
    >>> misspelt_key("timestmap"), misspelt_key("log_porb"), misspelt_key("Cited"), misspelt_key("answer")
    ('timestamp', 'log_prob', 'cited', None)
    >>> misspelt_key("glod"), misspelt_key("Gold"), misspelt_key("lgoits")
    ('gold', 'gold', 'logits')
    >>> misspelt_key("gold_ids"), misspelt_key("query_text"), misspelt_key("candidate_ids"), misspelt_key("user")
    ('gold', 'query', 'candidates', None)
    """
    low = key.lower()
    return _close_key(low, keys) or _suffixed_key(low, keys)


def _close_key(low: str, keys: Sequence[str] = LOG_KEYS) -> str | None:
    """The key of ``keys`` within a difflib ratio of :data:`CLOSE_KEY`, or one swap, of ``low``."""
    near = difflib.get_close_matches(low, keys, n=1, cutoff=CLOSE_KEY)
    if near:
        return near[0]
    return next((k for k in keys if len(k) == len(low) and _one_swap(low, k)), None)


def _suffixed_key(low: str, keys: Sequence[str] = LOG_KEYS) -> str | None:
    """The key of ``keys`` ``low`` is (up to a misspelling) with a suffix of :data:`KEY_SUFFIXES` appended."""
    for suffix in KEY_SUFFIXES:
        stem = low.removesuffix(suffix)
        if stem != low and stem:
            return stem if stem in keys else _close_key(stem, keys)
    return None


def _one_swap(a: str, b: str) -> bool:
    """``a`` is ``b`` with two adjacent characters swapped (equal lengths)."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]


def note_misspelt_keys(obj: Mapping, seen: set, path, lineno: int, notes: list, *,
                       keys: Sequence[str] = LOG_KEYS, kind: str = "log") -> None:
    """Note each key of ``obj`` not seen before in this file that looks like a misspelt key
    of ``keys`` (:func:`misspelt_key`; ``kind`` names them in the note: "not a log key").
    ``seen`` starts as ``keys``, so a line with only those, or with extra keys seen on
    earlier lines, costs one subset test. Also the rerank requests' reader
    (:func:`rmm_jax.data.calls.read_calls`), with the request keys."""
    if obj.keys() <= seen:
        return
    for key in obj:
        if key not in seen:
            seen.add(key)
            near = misspelt_key(key, keys)
            if near is not None and not (near in obj and _suffixed_key(key.lower(), keys) == near):  # gold_ids, gold
                notes.append(f"{at(path, lineno, key)} is not a {kind} key and was ignored (did you mean {near!r}?)")
