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

This module also holds the small JSON helpers shared by the other loaders, so every
bad file becomes one :class:`~rmm_jax.errors.InputError` line naming file and key.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from rmm_jax.data.types import Dataset, Query, Session, Turn, User
from rmm_jax.errors import InputError, at

_SESSION_KEY = re.compile(r"session_(\d+)")
_EVIDENCE_SPLIT = re.compile(r"[;,\s]+")
# Captions in the release already read "a photo of ..." (sometimes "a photography of").
_CAPTION_HAS_NOUN = re.compile(r"^(a|an)\s+(photo|photograph|photography|picture|image)\b", re.I)


# --------------------------------------------------------------------------- JSON helpers
def read_json(path: str | Path) -> Any:
    """Parse one JSON file; every failure is an InputError naming the file (and line)."""
    path = Path(path)
    if not path.exists():
        raise InputError("no such file", where=at(path))
    if path.is_dir():
        raise InputError("is a directory, expected a JSON file", where=at(path))
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read file ({e.strerror})", where=at(path)) from None
    if not raw.strip():
        raise InputError("empty file, expected JSON", where=at(path))
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start})", where=at(path)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg} (column {e.colno})", where=at(path, e.lineno)) from None
    except RecursionError:
        raise InputError("invalid JSON: nested too deeply", where=at(path)) from None


_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "a boolean"}


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def expect(value: Any, kind: type | tuple[type, ...], path: Path, key: str) -> Any:
    """Return ``value`` if it has JSON type ``kind``; else InputError naming file and key."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise InputError(f"expected {want}, got {json_type(value)}", where=at(path, key=key))
    return value


def field(obj: dict, name: str, kind: type | tuple[type, ...], path: Path, prefix: str = "") -> Any:
    """``obj[name]`` checked for presence and type; ``prefix`` locates ``obj`` in the file."""
    key = f"{prefix}.{name}" if prefix else name
    if name not in obj:
        raise InputError("missing key", where=at(path, key=key))
    return expect(obj[name], kind, path, key)


def scalar_text(value: Any) -> str | None:
    """An answer as text: strings kept, numbers formatted, null -> None."""
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value)


# --------------------------------------------------------------------------- LoCoMo
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
