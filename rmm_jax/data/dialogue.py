"""Questions a user's own conversation asks and answers: labels for pretraining without gold.

In a conversation a turn that asks is most often answered by the next turn, spoken by the
other person ("How was the trip?" / "Great, we hiked in the Alps"). Those pairs are a
question and the memory that answers it, the relation a reranker is trained to find, and
they come from the memory bank alone: no gold, no log, no generator. Retrieval has used
such pairs as self-supervision before (the Inverse Cloze Task of Lee et al., ACL 2019,
takes a sentence as the query for its own passage; conversational response selection,
Henderson et al., ACL 2019, the next turn as the answer to its context).

A pair ``(i, j)`` of a user's turn-level memories, in store order, is kept when

* memory ``i``'s text holds a question mark;
* ``j = i + 1`` is in the same session;
* the two turns have different speakers (the text before the first ``": "``, which is how
  every store writes a turn: ``"{speaker}: {text}"``).

Only a store of single turns has them (``embed --granularity turn``, the default); a
segment or a session merges the question with its answer.

Examples:
  >>> from rmm_jax.data.dialogue import dialogue_pairs
  >>> rows = [{"session_id": "s1", "text": "Ann: Where did you go?"},
  ...         {"session_id": "s1", "text": "Bob: To Lisbon, with my sister."},
  ...         {"session_id": "s1", "text": "Bob: Have you been?"},
  ...         {"session_id": "s1", "text": "Bob: It is lovely."},
  ...         {"session_id": "s1", "text": "Ann: Is it far?"},
  ...         {"session_id": "s2", "text": "Bob: Two hours by plane."}]
  >>> dialogue_pairs(rows).tolist()
  [[0, 1]]
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

SEP = ": "


def speaker(text: str) -> str | None:
    """The speaker a turn's text names (before the first ``": "``), or None.

    >>> from rmm_jax.data.dialogue import speaker
    >>> speaker("Ann: Is it far?"), speaker("no speaker here")
    ('Ann', None)
    """
    head, sep, _ = text.partition(SEP)
    return head if sep and head else None


def dialogue_pairs(rows: Sequence[dict]) -> np.ndarray:
    """``(P, 2)`` int32 pairs ``(asking memory, answering memory)`` of one user's turn-level
    memory rows (``session_id`` and ``text``, in store order), by the module's rule."""
    pairs = []
    for i in range(len(rows) - 1):
        ask, ans = rows[i], rows[i + 1]
        if "?" not in ask["text"] or ask.get("session_id") != ans.get("session_id"):
            continue
        a, b = speaker(ask["text"]), speaker(ans["text"])
        if a is not None and b is not None and a != b:
            pairs.append((i, i + 1))
    return np.asarray(pairs, np.int32).reshape(-1, 2)
