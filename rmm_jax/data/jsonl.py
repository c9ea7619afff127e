"""Bring your own chats: chat histories (``jsonl:PATH``) as a :class:`~rmm_jax.data.types.Dataset`,
so that ``rmm-jax embed`` can build an embedding store from them. A team's generator-call
logs (``log:PATH``) are :mod:`rmm_jax.data.log_dataset`.

Chat histories: ``jsonl:PATH``
------------------------------
A UTF-8 JSONL file, one JSON object per line (blank lines skipped). A line is either
**one user** (key ``sessions``) or **one session** (key ``messages``); both shapes may be
mixed, and the lines of one user are merged in file order::

    {"user_id": "alice", "sessions": [
        {"session_id": "s1", "timestamp": "2024-05-01",
         "messages": [{"role": "user", "content": "I adopted a puppy named Max."},
                      {"role": "assistant", "content": "Congratulations!"}]}],
     "questions": [{"id": "q1", "question": "What is my dog called?", "gold_turn_ids": ["s1:0"]}]}
    {"user_id": "bob", "session_id": "s1", "messages": [{"role": "user", "content": "..."}]}

| key (per line)     | type             | required | meaning |
|--------------------|------------------|----------|---------|
| `user_id`          | string           | yes      | the user whose history this is |
| `sessions`         | list of sessions | one of   | per-user line: the user's sessions, in time order |
| `messages`         | list of messages | these    | per-session line: its turns (+ `session_id`, `timestamp`) |
| `questions`        | list of questions| no       | questions asked later, with optional gold |

| key (session)  | type                | required | meaning |
|----------------|---------------------|----------|---------|
| `messages`     | list of messages    | yes      | non-empty, in order |
| `session_id`   | string              | no       | default `session_<n>` (n: the user's sessions from 1); unique |
| `timestamp`    | string or number    | no       | free form, kept as text |

| key (message)  | type    | required | meaning |
|----------------|---------|----------|---------|
| `role`         | string  | yes      | OpenAI chat shape: `user`, `assistant`, `system`, `tool`, ... |
| `content`      | string, list of parts, or null | yes | the text (see below) |
| `name`         | string  | no       | speaker name; the embedded text is `"{name or role}: {content}"` |
| `id`           | string  | no       | turn id; default `"{session_id}:{i}"` (i from 0, see below); unique per user |

Messages as OpenAI's chat API writes them (``i`` in a default turn id is the message's
index in ``messages``, skipped messages included, so ids do not shift when some are
skipped):

* ``content`` may be a **list of parts** (``{"type": "text", "text": ...}``,
  ``{"type": "image_url", ...}``, ...). The text parts (:data:`TEXT_PARTS`: ``text`` as
  the chat API writes it, ``input_text`` and ``output_text`` as the Responses API does)
  are joined with a newline (:data:`PART_SEPARATOR`: parts are separate blocks, and a
  newline keeps them apart without gluing words); every other part (image, audio, file,
  refusal) has no text to embed and is dropped and counted (``non_text_parts``). A message with no text part at
  all (an image alone) is skipped and counted (``no_text``).
* ``content: null`` with ``tool_calls`` (or the older ``function_call``): an assistant
  message that only calls a tool. Skipped and counted (``tool_calls``). ``null`` without
  them is invalid (below).
* Roles ``system`` and ``developer`` (:data:`INSTRUCTION_ROLES`): instructions to the
  assistant, usually the same prompt at the head of every session. Left out of the memories
  and counted (``instructions``) unless ``keep_roles`` names them (``rmm-jax embed
  --keep-roles system,developer``): kept, a repeated system prompt would fill the memory bank
  with copies of itself and crowd out what the user said.
* Role ``tool`` (and the older ``function``): a tool's output, JSON or documents the
  assistant read, not something the user or the assistant said. Skipped and counted
  (``tool_results``), whatever its content: embedding them would fill the memory bank
  with tool dumps.
* **Invalid** messages: ``content: null`` without a tool call, empty content (nothing but
  whitespace, or no characters in its text parts) and content longer than
  :data:`MAX_MESSAGE_CHARS` = 16,000 characters
  (about 4,000 tokens, four pages: a pasted document, a log or base64 data, not a chat
  turn; the default embedding model reads only the first ~256 word pieces, about 1,000
  characters, of any text anyway). Each is an error naming ``file:line`` and the key;
  with ``skip_invalid`` (``rmm-jax embed --skip-invalid``) they are skipped and counted
  (``null_content``, ``empty``, ``too_long``) and the first few messages kept (``first_errors``).

The counts are ``Dataset.stats["skipped"]`` (in the store manifest, so in ``embed
--json``). A gold turn id that names a skipped message is dropped from its question and
counted (``gold_on_skipped``): it holds no text to retrieve. A session left with no
message is not a memory source (its id still counts for ``gold_session_ids``) and is
counted (``sessions_without_text``); a user left with none is an error, unless
``gold_elsewhere`` (``rmm-jax embed --into``): then the user is kept with no session, its
``file:line`` in ``Dataset.no_text``, for :func:`~rmm_jax.data.store.append_store` to judge
against the store (a user the store holds needs no new text; a new one does).

| key (question)      | type            | required | meaning |
|---------------------|-----------------|----------|---------|
| `question`          | string          | yes      | the question text, not empty or only whitespace |
| `id`                | string          | no       | default `q<n>` (n: the user's questions from 0); unique |
| `gold_turn_ids`     | list of string  | no       | turns that hold the answer |
| `gold_session_ids`  | list of string  | no       | sessions that hold the answer: all their turns count as gold |
| `answer`, `category`, `date` | any / string / string | no | kept in the store |
| `abstention`        | boolean         | no       | excluded from retrieval metrics |

Gold is the union of ``gold_turn_ids`` and the turns of ``gold_session_ids``; ids must
name turns or sessions of the same user (on any line), unless ``gold_elsewhere`` (``rmm-jax
embed --into``) keeps the others aside for the store to resolve: an earlier day's turns and
sessions (:func:`~rmm_jax.data.store.append_store`). A question without gold is
kept (it can be embedded, retrieved and logged) but metrics that need gold skip it;
``Dataset.stats["no_gold"]`` counts them and ``rmm-jax embed`` prints a note. Unknown
keys are ignored. Every problem is one :class:`~rmm_jax.errors.InputError` line naming
``file:line`` and the key, e.g. ``chats.jsonl:3: key 'sessions[0].messages[2].content':
expected a string, got a number``.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from rmm_jax.data.json_fields import expect, field, line_id, line_ids, line_object, line_stamp, scalar_text
from rmm_jax.data.json_lines import MAX_FIRST_ERRORS, json_lines
from rmm_jax.data.types import Dataset, Query, Session, Turn, User
from rmm_jax.deprecated import moved
from rmm_jax.errors import InputError, at

__all__ = ["INSTRUCTION_ROLES", "MAX_MESSAGE_CHARS", "PART_SEPARATOR", "TEXT_PARTS", "load_jsonl", "no_text_error"]

MAX_MESSAGE_CHARS = 16_000  # longer content is invalid (see the module docstring)
PART_SEPARATOR = "\n"       # joins the text parts of a list content
TEXT_PARTS = ("text", "input_text", "output_text")   # part types whose "text" is embedded (chat and Responses APIs)
TOOL_ROLES = ("tool", "function")
INSTRUCTION_ROLES = ("system", "developer")  # left out of memories unless kept (see the module docstring)
SKIP_COUNTS = ("tool_results", "tool_calls", "instructions", "no_text", "non_text_parts", "null_content", "empty",
               "too_long", "gold_on_skipped", "sessions_without_text")


# --------------------------------------------------------------------------- chat histories
class _UserDraft:
    """One user's sessions and questions while the file is read."""

    def __init__(self, uid: str, line: int):
        self.id = uid
        self.line = line                              # first line of the user
        self.sessions: list[Session] = []
        self.session_ids: set[str] = set()
        self.turn_where: dict[str, str] = {}          # turn id -> "file:line" of first use
        self.skipped_turns: set[str] = set()          # ids of skipped messages
        self.questions: list[tuple[dict, int, str]] = []  # (question object, line, key prefix)


class _Skips:
    """What :func:`load_jsonl` skipped: counts per kind and the first invalid messages."""

    def __init__(self, skip_invalid: bool, keep_roles: tuple[str, ...] = ()):
        self.skip_invalid = skip_invalid
        self.keep_roles = keep_roles
        self.counts = dict.fromkeys(SKIP_COUNTS, 0)
        self.first_errors: list[str] = []

    def invalid(self, kind: str, err: InputError) -> None:
        """Count an invalid message, or raise ``err`` without ``skip_invalid``."""
        if not self.skip_invalid:
            raise err
        self.counts[kind] += 1
        if len(self.first_errors) < MAX_FIRST_ERRORS:
            self.first_errors.append(str(err))

    def report(self) -> dict:
        return {**self.counts, "first_errors": list(self.first_errors)}


def _message_text(msg: dict, path, line: int, tloc: str, skips: _Skips) -> str | None:
    """The text of one message, or None when it is skipped (counted in ``skips``)."""
    role = line_id(field(msg, "role", str, path, tloc, line=line), path, line, f"{tloc}.role")
    if role in TOOL_ROLES:
        skips.counts["tool_results"] += 1
        return None
    if role in INSTRUCTION_ROLES and role not in skips.keep_roles:
        skips.counts["instructions"] += 1
        return None
    if "content" not in msg:
        raise InputError("missing key", where=at(path, line, f"{tloc}.content"))
    content, key = msg["content"], f"{tloc}.content"
    if content is None:
        if msg.get("tool_calls") or msg.get("function_call"):
            skips.counts["tool_calls"] += 1
            return None
        skips.invalid("null_content", InputError("is null and the message has no 'tool_calls' (nothing to embed)",
                                                 where=at(path, line, key)))
        return None
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            ploc = f"{key}[{j}]"
            expect(part, dict, path, ploc, line)
            kind = line_id(field(part, "type", str, path, ploc, line=line), path, line, f"{ploc}.type")
            if kind in TEXT_PARTS:
                texts.append(field(part, "text", str, path, ploc, line=line))
            else:
                skips.counts["non_text_parts"] += 1
        if content and not texts:
            skips.counts["no_text"] += 1
            return None
        text = PART_SEPARATOR.join(texts)
    else:
        text = expect(content, (str, list), path, key, line)
    if not text.strip():
        skips.invalid("empty", InputError("empty content (no text to embed)", where=at(path, line, key)))
        return None
    if len(text) > MAX_MESSAGE_CHARS:
        skips.invalid("too_long", InputError(f"content has {len(text)} characters, more than {MAX_MESSAGE_CHARS} "
                                             "(a document or data, not a chat turn)", where=at(path, line, key)))
        return None
    return text


def _session(obj: dict, draft: _UserDraft, path, line: int, loc: str, skips: _Skips) -> Session:
    n = len(draft.sessions) + 1
    sid = field(obj, "session_id", str, path, loc, line=line, required=False)
    sid = f"session_{n}" if sid is None else line_id(sid, path, line, f"{loc}.session_id" if loc else "session_id")
    if sid in draft.session_ids:
        raise InputError(f"duplicate session id {sid!r} for user {draft.id!r}",
                         where=at(path, line, f"{loc}.session_id" if loc else "session_id"))
    stamp = line_stamp(obj, "timestamp", path, line, loc)
    mloc = f"{loc}.messages" if loc else "messages"
    messages = field(obj, "messages", list, path, loc, line=line)
    if not messages:
        raise InputError("must be a non-empty list", where=at(path, line, mloc))
    turns = []
    for i, msg in enumerate(messages):
        tloc = f"{mloc}[{i}]"
        expect(msg, dict, path, tloc, line)
        content = _message_text(msg, path, line, tloc, skips)
        role = msg["role"]
        name = field(msg, "name", str, path, tloc, line=line, required=False)
        tid = field(msg, "id", str, path, tloc, line=line, required=False)
        tid = f"{sid}:{i}" if tid is None else line_id(tid, path, line, f"{tloc}.id")
        if tid in draft.turn_where or tid in draft.skipped_turns:
            first = f" (first at {draft.turn_where[tid]})" if tid in draft.turn_where else ""
            raise InputError(f"duplicate turn id {tid!r} for user {draft.id!r}{first}",
                             where=at(path, line, f"{tloc}.id"))
        if content is None:
            draft.skipped_turns.add(tid)
            continue
        draft.turn_where[tid] = at(path, line)
        turns.append(Turn(tid, sid, name or role, f"{name or role}: {content}", stamp))
    draft.session_ids.add(sid)
    return Session(sid, stamp, tuple(turns))


def _question(q: dict, n: int, draft: _UserDraft, sessions: dict[str, Session], path, line: int, loc: str,
              seen: set[str], skips: _Skips, elsewhere: list | None = None) -> Query:
    """One question. A gold id the file does not hold is an error, or, given ``elsewhere``
    (``gold_elsewhere``), appended to it as ``(kind, id, file:line: key)``."""
    def unknown(kind: str, name: str, key: str) -> None:
        if elsewhere is None:
            raise InputError(f"unknown {kind} id {name!r} for user {draft.id!r}", where=at(path, line, key))
        elsewhere.append((kind, name, at(path, line, key)))

    text = field(q, "question", str, path, loc, line=line)
    if not text.strip():
        raise InputError("empty question (no text to embed)", where=at(path, line, f"{loc}.question"))
    qid = field(q, "id", (str, int), path, loc, line=line, required=False)
    qid = f"q{n}" if qid is None else (str(qid) if not isinstance(qid, str) else line_id(qid, path, line, f"{loc}.id"))
    if qid in seen:
        raise InputError(f"duplicate question id {qid!r} for user {draft.id!r}", where=at(path, line, f"{loc}.id"))
    seen.add(qid)
    gold_turns = []
    for j, t in enumerate(line_ids(q, "gold_turn_ids", path, line, loc)):
        if t in draft.skipped_turns:
            skips.counts["gold_on_skipped"] += 1
        elif t not in draft.turn_where:
            unknown("turn", t, f"{loc}.gold_turn_ids[{j}]")
        else:
            gold_turns.append(t)
    gold_sessions = line_ids(q, "gold_session_ids", path, line, loc)
    for j, s in enumerate(gold_sessions):
        if s not in sessions:
            unknown("session", s, f"{loc}.gold_session_ids[{j}]")
        else:
            gold_turns.extend(t.id for t in sessions[s].turns)
    abstention = field(q, "abstention", bool, path, loc, line=line, required=False, default=False)
    return Query(qid, text, tuple(dict.fromkeys(gold_turns)),
                 category=str(field(q, "category", (str, int), path, loc, line=line, required=False, default="")),
                 date=line_stamp(q, "date", path, line, loc), answer=scalar_text(q.get("answer")),
                 abstention=abstention, gold_session_ids=gold_sessions)


def no_text_error(user_id: str, where: str, why: str = "") -> InputError:
    """The error of a user none of whose messages has text (``where``: its first line's
    ``file:line: key 'user_id'``), plus ``why``."""
    return InputError(f"user {user_id!r} has no message with text (every one was skipped: tool results, tool calls, "
                      f"system or developer messages, images or invalid){why}", where=where)


def load_jsonl(path: str | Path, *, skip_invalid: bool = False, keep_roles: tuple[str, ...] = (),
               gold_elsewhere: bool = False) -> Dataset:
    """Load a chat-history JSONL file (schema in the module docstring).

    ``Dataset.stats``: ``lines``, ``sessions``, ``turns``, ``questions``, ``no_gold``
    (questions without gold, skipped by metrics that need it), ``abstention`` and
    ``skipped`` (messages and parts skipped, per kind, and ``first_errors``).
    ``skip_invalid``: skip and count invalid messages (null, empty or too long) instead of
    raising. ``keep_roles``: roles of :data:`INSTRUCTION_ROLES` to keep as memories.
    ``gold_elsewhere``: a gold turn or session id that no line of the file holds for the
    question's user is kept aside in ``Dataset.gold_elsewhere`` with its ``file:line`` and key,
    and a user with no message with text is kept (no session) and named in ``Dataset.no_text``,
    not refused: a day file appended to a store (``rmm-jax embed --into``) may name an earlier
    day's turns, and :func:`~rmm_jax.data.store.append_store` looks them up in the store
    (a question with only such gold does not count in ``no_gold``), and a user the store holds
    may open a session today and say nothing in it. Without it (the default, and ``embed
    --out``), such an id, or such a user, is an error.
    """
    path = Path(path)
    bad = [r for r in keep_roles if r not in INSTRUCTION_ROLES]
    if bad:
        raise InputError(f"unknown role {bad[0]!r}: only {', '.join(INSTRUCTION_ROLES)} are left out by default",
                         arg="keep_roles")
    skips = _Skips(skip_invalid, tuple(keep_roles))
    drafts: dict[str, _UserDraft] = {}
    where: dict[tuple[str, str, str], str] = {}
    elsewhere: dict[tuple[str, str], tuple] = {}
    lines = 0
    for line, obj in json_lines(path):
        lines += 1
        line_object(obj, path, line)
        uid = line_id(field(obj, "user_id", str, path, "", line=line), path, line, "user_id")
        has_sessions, has_messages = "sessions" in obj, "messages" in obj
        if has_sessions == has_messages:
            raise InputError("a line holds either a user ('sessions') or one session ('messages')"
                             + (", not both" if has_sessions else ""),
                             where=at(path, line, "sessions" if has_sessions else "messages"))
        draft = drafts.setdefault(uid, _UserDraft(uid, line))
        if has_sessions:
            for j, s in enumerate(field(obj, "sessions", list, path, "", line=line)):
                draft.sessions.append(_session(expect(s, dict, path, f"sessions[{j}]", line), draft, path, line,
                                               f"sessions[{j}]", skips))
                where[(uid, "session", draft.sessions[-1].id)] = at(path, line, f"sessions[{j}]")
        else:
            draft.sessions.append(_session(obj, draft, path, line, "", skips))
            where[(uid, "session", draft.sessions[-1].id)] = at(path, line)
        for j, q in enumerate(field(obj, "questions", list, path, "", line=line, required=False, default=[])):
            draft.questions.append((expect(q, dict, path, f"questions[{j}]", line), line, f"questions[{j}]"))
    users, stats = [], Counter(lines=lines, sessions=0, turns=0, questions=0, no_gold=0, abstention=0)
    no_text: dict[str, str] = {}
    for draft in drafts.values():
        if not draft.turn_where:
            if not gold_elsewhere:
                raise no_text_error(draft.id, at(path, draft.line, "user_id"))
            no_text[draft.id] = at(path, draft.line, "user_id")      # the store judges it (append_store)
        skips.counts["sessions_without_text"] += sum(1 for s in draft.sessions if not s.turns)
        sessions = {s.id: s for s in draft.sessions}
        seen: set[str] = set()
        queries, aside = [], []
        for n, (q, line, loc) in enumerate(draft.questions):
            aside.append([] if gold_elsewhere else None)
            queries.append(_question(q, n, draft, sessions, path, line, loc, seen, skips, aside[-1]))
        elsewhere.update(((draft.id, q.id), tuple(a)) for q, a in zip(queries, aside) if a)
        where.update(((draft.id, "question", q.id), at(path, line, loc))
                     for q, (_, line, loc) in zip(queries, draft.questions))
        users.append(User(draft.id, tuple(s for s in draft.sessions if s.turns), tuple(queries)))
        stats["sessions"] += sum(1 for s in draft.sessions if s.turns)
        stats["turns"] += sum(len(s.turns) for s in draft.sessions)
        stats["questions"] += len(queries)
        stats["no_gold"] += sum(1 for q in queries
                                if not q.gold_turn_ids and not q.abstention and (draft.id, q.id) not in elsewhere)
        stats["abstention"] += sum(1 for q in queries if q.abstention)
    return Dataset("jsonl", tuple(users), {**stats, "skipped": skips.report()}, where, gold_elsewhere=elsewhere,
                   no_text=no_text)


# moved to rmm_jax.data.log_dataset (the log: loader); the old path warns
__getattr__ = moved(__name__, dict.fromkeys(("load_log_dataset", "parse_log_spec"), "rmm_jax.data.log_dataset"))
