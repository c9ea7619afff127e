"""The dataset model: users with dialogue turns and questions, and memory units.

Gold labels live at turn level (``Query.gold_turn_ids``) and are mapped onto any memory
granularity: a memory unit is relevant to a query when it contains at least one gold
turn (:func:`gold_matrix`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Turn:
    id: str                      # unique within the user, e.g. "D1:3"
    session_id: str              # e.g. "session_1"
    speaker: str
    text: str                    # what is embedded (speaker name and image caption included)
    timestamp: str | None = None  # session date/time as given by the dataset


@dataclasses.dataclass(frozen=True)
class Session:
    id: str
    timestamp: str | None
    turns: tuple[Turn, ...]


@dataclasses.dataclass(frozen=True)
class Query:
    id: str                          # unique within the user
    text: str
    gold_turn_ids: tuple[str, ...]   # turn-level evidence
    category: str = ""               # dataset category, e.g. "1".."5" or "temporal-reasoning"
    date: str | None = None
    answer: str | None = None
    abstention: bool = False         # excluded from retrieval metrics when True
    gold_session_ids: tuple[str, ...] = ()  # session-level gold where the dataset gives it


@dataclasses.dataclass(frozen=True)
class User:
    id: str
    sessions: tuple[Session, ...]
    queries: tuple[Query, ...]

    @property
    def turns(self) -> tuple[Turn, ...]:
        return tuple(t for s in self.sessions for t in s.turns)


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str                       # "locomo", "longmemeval", "synthetic"
    users: tuple[User, ...]
    stats: dict = dataclasses.field(default_factory=dict)  # e.g. skipped questions
    # where each session and question came from, for errors found after loading (`embed --into`):
    # {(user id, "session", id) or (user id, "question", id): "file:line: key 'k'"}; loaders
    # without line numbers leave it empty
    where: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # gold a question names outside its own file, kept aside by a loader asked to
    # (`load_jsonl(..., gold_elsewhere=True)`, for `embed --into`, which looks the ids up in the
    # store): {(user id, question id): (("turn" or "session", id, "file:line: key 'k'"), ...)};
    # empty otherwise, and a store is written only from a dataset where it is empty
    gold_elsewhere: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # users with no message with text in the file, kept (with no session) by a loader asked to
    # (`load_jsonl(..., gold_elsewhere=True)`, for `embed --into`: a user the store holds needs
    # none today, a new one is refused or skipped there): {user id: "file:line: key 'user_id'"}
    no_text: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class MemoryUnit:
    id: str
    text: str
    session_id: str
    timestamp: str | None
    turn_ids: tuple[str, ...]       # source turns (all of them, after merges)


def gold_matrix(queries: Sequence[Query], memories: Sequence[MemoryUnit]) -> np.ndarray:
    """Boolean (num_queries, num_memories): memory j contains a gold turn of query i."""
    index: dict[str, list[int]] = {}
    for j, mem in enumerate(memories):
        for t in mem.turn_ids:
            index.setdefault(t, []).append(j)
    gold = np.zeros((len(queries), len(memories)), dtype=bool)
    for i, q in enumerate(queries):
        for t in q.gold_turn_ids:
            for j in index.get(t, ()):
                gold[i, j] = True
    return gold
