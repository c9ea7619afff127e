"""Counts in words, for the notes and progress lines of every layer: ``1 user``, ``2 users``.

It lives in the data layer, the lowest that writes such lines (``write_store``'s "3 users,
..."), so that the CLI (:mod:`rmm_jax.cli.shell` re-exports it) and the data layer share
one rule without the data layer importing the CLI (tests/test_layering.py).
"""
from __future__ import annotations


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (an s added; a final consonant + y
    becomes ies), so that a note reads "1 text embedded", not "1 texts".

    >>> from rmm_jax.data.words import count
    >>> count(1, "text"), count(0, "text"), count(54, "text"), count(1, "query"), count(3, "turn memory")
    ('1 text', '0 texts', '54 texts', '1 query', '3 turn memories')
    """
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else f"{n} {noun}s"
