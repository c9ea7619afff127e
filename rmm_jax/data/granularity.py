"""Memory granularity: turn, session, or topic segment (Prospective Reflection without an LLM).

RMM's *Prospective Reflection* turns each finished session into topic-based memories
and folds them into the memory bank. With an LLM the extraction prompt asks the model to
read one session and list the topics discussed, each as a short summary written from the
user's perspective together with references to the turns it came from (dropping turns
with no lasting content); a second step then shows the new memory next to the most
similar existing memories and the LLM decides to *add* it as a new entry or *merge* it
into an existing one (rewriting the merged summary).

This module reproduces that pipeline without an LLM (nothing here needs a network):

(i)  **segmentation** (TextTiling-style): within one session, a turn joins the current
     segment while the cosine similarity between its embedding and the renormalised
     *mean of the current segment's turn embeddings* is at least ``segment_threshold``;
     otherwise it starts a new segment. Comparing with the segment mean rather than the
     previous turn keeps one short reply ("haha, yes!") from cutting a topic in two.
(ii) **add / merge**: segments are processed in time order; a segment's embedding is the
     renormalised mean of its turn embeddings. If its cosine with the most similar
     existing memory exceeds ``merge_threshold`` it is merged into it (text appended,
     source turns unioned, the memory's embedding recomputed as the renormalised mean of
     all its turn embeddings and its session/timestamp set to the latest contribution);
     otherwise it becomes a new memory ``seg{n}``.

``topic_extractor`` is the hook for an LLM extractor: ``(Session) -> list[Topic]``. Its
topics replace step (i) (memory text = the topic summary; the embedding is still the
mean of the cited turns, so add/merge behaves the same). Every turn ends up in exactly
one memory: a turn cited by several topics stays with the first; turns no topic cites
are kept as their own segments of consecutive turns (raw text), so no gold turn is lost.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from rmm_jax.data.types import MemoryUnit, Session, Turn, User
from rmm_jax.errors import InputError

#: Memory granularities, in the order the CLI lists them.
GRANULARITIES = ("turn", "session", "segment")
#: The granularity ``rmm-jax embed`` uses unless told otherwise.
DEFAULT_GRANULARITY = "turn"
#: Step (i): a turn joins the current segment while its cosine to the segment mean is >= this.
DEFAULT_SEGMENT_THRESHOLD = 0.5
#: Step (ii): a segment merges into the most similar memory when their cosine exceeds this.
DEFAULT_MERGE_THRESHOLD = 0.85
EmbedFn = Callable[[list[str]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Topic:
    """One extracted topic: a summary and the ids of the session turns it came from."""

    summary: str
    turn_ids: tuple[str, ...]


@dataclasses.dataclass
class Segment:
    """A contiguous piece of one session (or one extracted topic) before add / merge."""

    text: str
    session: Session
    turn_ids: list[str]


def check_threshold(name: str, value) -> float:
    """A cosine threshold must be a finite number in [-1, 1]."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"must be a number in [-1, 1], got {value!r}", arg=name) from None
    if not (math.isfinite(v) and -1.0 <= v <= 1.0):
        raise InputError(f"must be a number in [-1, 1], got {value!r}", arg=name)
    return v


def _normalize(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norm, 1e-12)).astype(np.float32)


def embed_turns(turns: Sequence[Turn], embed_fn: EmbedFn) -> np.ndarray:
    """Embed all turn texts in one batch; check the shape and renormalise rows."""
    if embed_fn is None:
        raise InputError("granularity 'segment' needs an embedding function", where="embed_fn")
    emb = np.asarray(embed_fn([t.text for t in turns]), dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] != len(turns):
        raise InputError(f"must return an array of shape ({len(turns)}, d), got {emb.shape}", where="embed_fn")
    if not np.all(np.isfinite(emb)):
        raise InputError("returned non-finite values", where="embed_fn")
    return _normalize(emb)


def split_session(session: Session, emb: np.ndarray, threshold: float) -> list[list[int]]:
    """Step (i): positions of each topic segment's turns within ``session``.

    ``emb`` holds the session's turn embeddings (rows L2-normalised). A turn continues
    the current segment while its cosine with the segment's renormalised mean embedding
    is >= ``threshold``.
    """
    segments: list[list[int]] = []
    total = None
    for i in range(len(session.turns)):
        if segments:
            mean = total / max(np.linalg.norm(total), 1e-12)
            if float(emb[i] @ mean) >= threshold:
                segments[-1].append(i)
                total = total + emb[i]
                continue
        segments.append([i])
        total = emb[i].astype(np.float64)
    return segments


def _topic_segments(session: Session, topics: Sequence[Topic], claimed: set[str]) -> list[Segment]:
    """Segments from an extractor's topics, plus runs of turns no topic cites."""
    ids = {t.id for t in session.turns}
    out: list[Segment] = []
    for k, topic in enumerate(topics):
        if not isinstance(topic, Topic):
            raise InputError(f"must return Topic objects, got {type(topic).__name__}",
                             where=f"topic_extractor: session {session.id!r} topic {k}")
        unknown = [t for t in topic.turn_ids if t not in ids]
        if unknown:
            raise InputError(f"cites turns not in the session: {', '.join(map(str, unknown))}",
                             where=f"topic_extractor: session {session.id!r} topic {k}")
        fresh = [t for t in dict.fromkeys(topic.turn_ids) if t not in claimed]
        if fresh:
            claimed.update(fresh)
            out.append(Segment(topic.summary, session, fresh))
    run: list[Turn] = []
    for turn in list(session.turns) + [None]:
        if turn is not None and turn.id not in claimed:
            run.append(turn)
        elif run:
            claimed.update(t.id for t in run)
            out.append(Segment("\n".join(t.text for t in run), session, [t.id for t in run]))
            run = []
    return out


def _segments(user: User, emb_of: dict[str, np.ndarray], threshold: float,
              topic_extractor) -> list[Segment]:
    """All segments of a user, sessions in order."""
    out: list[Segment] = []
    claimed: set[str] = set()
    for s in user.sessions:
        if not s.turns:
            continue
        if topic_extractor is not None:
            out.extend(_topic_segments(s, list(topic_extractor(s)), claimed))
            continue
        emb = np.stack([emb_of[t.id] for t in s.turns])
        for pos in split_session(s, emb, threshold):
            turns = [s.turns[i] for i in pos]
            out.append(Segment("\n".join(t.text for t in turns), s, [t.id for t in turns]))
    return out


def add_or_merge(segments: Sequence[Segment], emb_of: dict[str, np.ndarray],
                 merge_threshold: float) -> list[MemoryUnit]:
    """Step (ii): fold segments, in order, into a memory bank by add / merge.

    Linear in the number of segments for a bank of fixed size: the bank grows by doubling
    and each memory keeps the float64 sum of its turn embeddings, so a merge renormalises
    that sum (the mean's direction) instead of re-averaging every turn it holds.
    """
    texts: list[str] = []
    turn_ids: list[list[str]] = []
    held: list[set[str]] = []
    latest: list[Session] = []
    dim = next(iter(emb_of.values())).shape[0] if emb_of else 0
    bank = np.zeros((8, dim), np.float32)     # rows [0, n) are the memories' unit embeddings
    sums = np.zeros((8, dim), np.float64)     # and their turns' embedding sums
    n = 0
    for seg in segments:
        total = np.sum([emb_of[t] for t in seg.turn_ids], axis=0, dtype=np.float64)
        e = _normalize(total)
        sims = np.clip(bank[:n] @ e, -1.0, 1.0)
        if n and float(sims.max()) > merge_threshold:
            j = int(sims.argmax())
            texts[j] += "\n" + seg.text
            for t in seg.turn_ids:
                if t not in held[j]:
                    held[j].add(t)
                    turn_ids[j].append(t)
                    sums[j] += emb_of[t]
            latest[j] = seg.session
            bank[j] = _normalize(sums[j])
            continue
        if n == len(bank):
            bank = np.concatenate([bank, np.zeros_like(bank)])
            sums = np.concatenate([sums, np.zeros_like(sums)])
        bank[n], sums[n] = e, total
        texts.append(seg.text)
        turn_ids.append(list(dict.fromkeys(seg.turn_ids)))
        held.append(set(seg.turn_ids))
        latest.append(seg.session)
        n += 1
    return [MemoryUnit(f"seg{k}", texts[k], latest[k].id, latest[k].timestamp, tuple(turn_ids[k]))
            for k in range(n)]


def build_memories(user: User, granularity: str, embed_fn: EmbedFn | None = None, *,
                   segment_threshold: float = DEFAULT_SEGMENT_THRESHOLD,
                   merge_threshold: float = DEFAULT_MERGE_THRESHOLD,
                   topic_extractor: Callable[[Session], list[Topic]] | None = None) -> list[MemoryUnit]:
    """The memory units of one user at ``granularity`` ("turn", "session" or "segment").

    ``embed_fn(list[str]) -> (n, d)`` float array of L2-normalised embeddings is needed
    only for "segment" (see the module docstring for the segment algorithm). Every turn
    of the user lands in exactly one memory, and each memory keeps all its source turn
    ids, so :func:`~rmm_jax.data.types.gold_matrix` maps turn gold onto any granularity.
    """
    if granularity not in GRANULARITIES:
        raise InputError(f"must be one of {', '.join(GRANULARITIES)}, got {granularity!r}", arg="granularity")
    segment_threshold = check_threshold("segment_threshold", segment_threshold)
    merge_threshold = check_threshold("merge_threshold", merge_threshold)
    if granularity == "turn":
        return [MemoryUnit(t.id, t.text, t.session_id, t.timestamp, (t.id,)) for t in user.turns]
    if granularity == "session":
        return [MemoryUnit(s.id, "\n".join(t.text for t in s.turns), s.id, s.timestamp,
                           tuple(t.id for t in s.turns)) for s in user.sessions if s.turns]
    if topic_extractor is not None and not callable(topic_extractor):
        raise InputError("must be callable", where="topic_extractor")
    turns = user.turns
    if not turns:
        return []
    emb = embed_turns(turns, embed_fn)
    emb_of = {t.id: emb[i] for i, t in enumerate(turns)}
    return add_or_merge(_segments(user, emb_of, segment_threshold, topic_extractor), emb_of, merge_threshold)
