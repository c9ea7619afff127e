"""LoCoMo loader (Maharana et al., ACL 2024): long two-speaker conversations with QA.

Two layouts are read:

* per-conversation files (``26.json``): a JSON object with ``speaker_a``, ``speaker_b``,
  ``session_N`` (list of turns), ``session_N_date_time`` and ``qa``; the user id is the
  file stem (``"26"``);
* the single-file release (``locomo10.json``): a JSON list of samples, each with
  ``sample_id`` (used verbatim as the user id), ``conversation`` (the speaker and session
  keys above) and ``qa``.

``path`` may be a file or a directory; a directory is read file by file in name order
(``*.json`` only, so a ``NOTICE`` next to the data is ignored), and each file may use
either layout.

Questions keep turn-level evidence (LoCoMo ``dia_id`` values). Evidence that does not
name a turn is dropped; a question left without any evidence is skipped and counted in
``Dataset.stats["skipped_unresolved"]``. Adversarial questions (category 5) are kept.

Every bad file becomes one :class:`~rmm_jax.errors.InputError` line naming file and key
(through :mod:`rmm_jax.data.json_fields`).
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from rmm_jax.data.json_fields import expect, field, read_json, scalar_text
from rmm_jax.data.types import Dataset, Query, Session, Turn, User
from rmm_jax.errors import InputError, at

_SESSION_KEY = re.compile(r"session_(\d+)")
_EVIDENCE_SPLIT = re.compile(r"[;,\s]+")
# Captions in the release already read "a photo of ..." (sometimes "a photography of").
_CAPTION_HAS_NOUN = re.compile(r"^(a|an)\s+(photo|photograph|photography|picture|image)\b", re.I)


def turn_text(speaker: str, text: str, caption: str | None) -> str:
    """Embedded text of a turn: ``"speaker: text"`` plus the shared image's caption.

    The caption is kept verbatim; ``[shares a photo of ...]`` is written only when the
    caption does not already start with "a photo/picture/image of".
    """
    out = f"{speaker}: {text}"
    if caption:
        caption = caption.strip()
        out += f" [shares {caption}]" if _CAPTION_HAS_NOUN.match(caption) else f" [shares a photo of {caption}]"
    return out


def _sessions(conv: dict, path: Path, prefix: str) -> tuple[Session, ...]:
    """All ``session_N`` lists of one conversation, in numeric order of N."""
    numbered = sorted((int(m.group(1)), k) for k in conv if (m := _SESSION_KEY.fullmatch(k)))
    sessions, seen = [], set()
    for _, key in numbered:
        loc = f"{prefix}{key}"
        turns_json = expect(conv[key], list, path, loc)
        date_key = f"{key}_date_time"
        date = conv.get(date_key)
        if date is not None:
            date = expect(date, str, path, f"{prefix}{date_key}")
        turns = []
        for i, t in enumerate(turns_json):
            tloc = f"{loc}[{i}]"
            expect(t, dict, path, tloc)
            speaker = field(t, "speaker", str, path, tloc)
            dia_id = field(t, "dia_id", str, path, tloc).strip()
            text = field(t, "text", str, path, tloc)
            caption = t.get("blip_caption")
            if caption is not None:
                caption = expect(caption, str, path, f"{tloc}.blip_caption")
            if dia_id in seen:
                raise InputError(f"duplicate dia_id {dia_id!r}", where=at(path, key=f"{tloc}.dia_id"))
            seen.add(dia_id)
            turns.append(Turn(dia_id, key, speaker, turn_text(speaker, text, caption), date))
        sessions.append(Session(key, date, tuple(turns)))
    return tuple(sessions)


def split_evidence(entries: list, path: Path, key: str) -> list[str]:
    """Evidence ids, with junk like ``"D8:6; D9:17"`` split on ';' / ',' / whitespace."""
    out = []
    for i, e in enumerate(entries):
        expect(e, str, path, f"{key}[{i}]")
        out.extend(p for p in _EVIDENCE_SPLIT.split(e) if p)
    return out


def _queries(qa: list, turn_ids: set[str], path: Path, prefix: str, stats: dict) -> tuple[Query, ...]:
    """Questions with resolvable evidence; ``q{i}`` is the i-th entry of the ``qa`` list."""
    queries = []
    for i, q in enumerate(qa):
        loc = f"{prefix}qa[{i}]"
        expect(q, dict, path, loc)
        question = field(q, "question", str, path, loc)
        evidence = split_evidence(field(q, "evidence", list, path, loc), path, f"{loc}.evidence")
        category = q.get("category")
        category = "" if category is None else str(expect(category, (int, str), path, f"{loc}.category"))
        answer = q.get("answer", q.get("adversarial_answer"))
        gold = tuple(dict.fromkeys(e for e in evidence if e in turn_ids))
        stats["dropped_evidence"] += len(evidence) - sum(e in turn_ids for e in evidence)
        if not gold:
            stats["skipped_unresolved"] += 1
            continue
        queries.append(Query(f"q{i}", question, gold, category=category, answer=scalar_text(answer)))
    return tuple(queries)


def _user(user_id: str, conv: dict, qa: list, path: Path, conv_prefix: str, qa_prefix: str,
          stats: dict) -> User:
    """One conversation: ``conv`` holds the sessions, ``qa`` its questions."""
    sessions = _sessions(conv, path, conv_prefix)
    turn_ids = {t.id for s in sessions for t in s.turns}
    return User(user_id, sessions, _queries(qa, turn_ids, path, qa_prefix, stats))


def _users_from_file(path: Path, stats: dict) -> list[User]:
    """One user (per-conversation layout) or several (locomo10.json layout)."""
    data = read_json(path)
    if isinstance(data, dict):
        qa = field(data, "qa", list, path)
        return [_user(path.stem, data, qa, path, "", "", stats)]
    expect(data, (dict, list), path, "(top level)")
    users = []
    for i, sample in enumerate(data):
        loc = f"[{i}]"
        expect(sample, dict, path, loc)
        sid = field(sample, "sample_id", (str, int), path, loc)
        conv = field(sample, "conversation", dict, path, loc)
        qa = field(sample, "qa", list, path, loc)
        users.append(_user(str(sid), conv, qa, path, f"{loc}.conversation.", f"{loc}.", stats))
    return users


def load_locomo(path: str | Path) -> Dataset:
    """Load LoCoMo from a file or a directory of files (see the module docstring).

    ``Dataset.stats``: ``questions`` (kept), ``per_category`` (kept, by category),
    ``skipped_unresolved`` (questions without resolvable evidence) and
    ``dropped_evidence`` (evidence ids that named no turn).
    """
    path = Path(path)
    if not path.exists():
        raise InputError("no such file or directory", where=at(path))
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file())
        if not files:
            raise InputError("directory holds no .json files", where=at(path))
    else:
        files = [path]
    stats = {"skipped_unresolved": 0, "dropped_evidence": 0}
    users: list[User] = []
    where: dict[str, Path] = {}
    for f in files:
        for u in _users_from_file(f, stats):
            if u.id in where:
                raise InputError(f"user id {u.id!r} already loaded from {where[u.id]}", where=at(f))
            where[u.id] = f
            users.append(u)
    per_cat = Counter(q.category for u in users for q in u.queries)
    stats["questions"] = sum(per_cat.values())
    stats["per_category"] = dict(sorted(per_cat.items()))
    return Dataset("locomo", tuple(users), stats)
