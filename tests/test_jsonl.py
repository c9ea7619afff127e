"""Bring your own data: ``jsonl:`` chat histories and ``log:`` generator-call logs.

Loader happy paths on the small schema examples (``tests/fixtures``), every bad record as one ``file:line: key``
error (exit 2, nothing written), text-carrying log records, and the README walkthrough end
to end through the CLI: ``embed log:`` (through the embedding cache) → ``replay`` →
``evaluate`` with no dataset, and a chat-history store that replays the same log.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import pytest
from conftest import REPO, FakeEmbedder, run_cli, use_fake_embedder

from rmm_jax.core.reranker import init_reranker
from rmm_jax.data import load_spec
from rmm_jax.data.citation_log import LogRecord, pl_log_prob, pl_tolerance, read_log, record_to_json, validate_record
from rmm_jax.data.jsonl import MAX_MESSAGE_CHARS, PART_SEPARATOR, load_jsonl
from rmm_jax.data.log_dataset import load_log_dataset
from rmm_jax.data.log_vectors import known_ids, resolve_calls, unseen_texts
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.persist.policy_store import PolicyStore

EXAMPLES, FIXTURES = REPO / "examples", REPO / "tests" / "fixtures"
CHATS, CALLS = FIXTURES / "chat_history.jsonl", FIXTURES / "calls.jsonl"   # every schema variant, 12 calls
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


def jl(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


# --------------------------------------------------------------------------- chat histories
def test_example_chat_history():
    ds = load_spec(f"jsonl:{CHATS}")
    assert ds.name == "jsonl" and [u.id for u in ds.users] == ["alice", "bob"]
    alice, bob = ds.users
    assert [s.id for s in alice.sessions] == ["s1", "s2", "s3"] and len(alice.turns) == 18
    assert [s.id for s in bob.sessions] == ["s1", "s2"] and len(bob.turns) == 8  # two per-session lines, merged
    t = alice.turns[0]
    assert (t.id, t.session_id, t.speaker, t.timestamp) == ("s1:0", "s1", "user", "2024-05-01 09:12")
    assert t.text == "user: I just adopted a golden retriever puppy and named him Max."
    q = {q.id: q for q in alice.queries}
    assert q["q1"].gold_turn_ids == ("s1:0",) and q["q3"].answer == "peanuts"
    assert q["q6"].gold_turn_ids == tuple(f"s3:{i}" for i in range(6)) and q["q6"].gold_session_ids == ("s3",)
    assert q["q8"].gold_turn_ids == ()
    assert [q.id for q in bob.queries] == ["q1", "q2", "q3", "q4"]
    skipped = {"tool_results": 0, "tool_calls": 0, "instructions": 0, "no_text": 0, "non_text_parts": 0,
               "null_content": 0, "empty": 0, "too_long": 0, "gold_on_skipped": 0, "sessions_without_text": 0,
               "first_errors": []}
    assert ds.stats == {"lines": 3, "sessions": 5, "turns": 26, "questions": 12, "no_gold": 1, "abstention": 0,
                        "skipped": skipped}


def test_defaults_names_and_union_gold(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(jl(
        {"user_id": "u", "messages": [{"role": "user", "content": "hi", "name": "Ann"},
                                      {"role": "assistant", "content": "hello", "id": "t-x"}],
         "questions": [{"question": "who?", "gold_turn_ids": ["session_1:0"], "gold_session_ids": ["session_2"]},
                       {"question": "what?", "abstention": True, "category": 3, "date": 20240101}]},
        "",
        {"user_id": "u", "timestamp": 1714550400, "messages": [{"role": "user", "content": "again"}]}))
    (u,) = load_jsonl(path).users
    assert [s.id for s in u.sessions] == ["session_1", "session_2"] and u.sessions[1].timestamp == "1714550400"
    assert [t.id for t in u.turns] == ["session_1:0", "t-x", "session_2:0"]
    assert u.turns[0].text == "Ann: hi" and u.turns[1].text == "assistant: hello"
    q0, q1 = u.queries
    assert (q0.id, q1.id) == ("q0", "q1")
    assert q0.gold_turn_ids == ("session_1:0", "session_2:0")  # the session's turns, after the named turn
    assert q1.abstention and q1.category == "3" and q1.date == "20240101"


GOOD = {"user_id": "u", "messages": [{"role": "user", "content": "hello"}]}
BAD_LINES = [
    ("[1, 2]", None, "expected a JSON object"),
    ('{"user_id": "u", ', None, "invalid JSON"),
    ({"messages": GOOD["messages"]}, "user_id", "missing key"),
    ({"user_id": "", "messages": GOOD["messages"]}, "user_id", "non-empty"),
    ({"user_id": "u"}, "messages", "either a user"),
    ({"user_id": "u", "sessions": [], "messages": []}, "sessions", "not both"),
    ({"user_id": "u", "messages": []}, "messages", "non-empty"),
    ({"user_id": "u", "messages": [{"role": "user", "content": 3}]}, "messages[0].content", "expected a string"),
    ({"user_id": "u", "messages": [{"content": "x"}]}, "messages[0].role", "missing key"),
    ({"user_id": "u", "messages": ["x"]}, "messages[0]", "expected an object"),
    ({"user_id": "u", "sessions": [{"messages": [{"role": "user", "content": "a", "name": 1}]}]},
     "sessions[0].messages[0].name", "expected a string"),
    ({"user_id": "u", "sessions": {"a": 1}}, "sessions", "expected a list"),
    ({"user_id": "u", "session_id": "session_1", "messages": GOOD["messages"]}, "session_id", "duplicate session"),
    ({"user_id": "u", "messages": [{"role": "user", "content": "a", "id": "session_1:0"}]}, "messages[0].id",
     "duplicate turn id"),
    ({"user_id": "u", "messages": GOOD["messages"], "timestamp": [1]}, "timestamp", "expected a string or a number"),
    ({"user_id": "u", "messages": GOOD["messages"], "timestamp": float("nan")}, "timestamp", "must be finite"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"id": "q"}]}, "questions[0].question",
     "missing key"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?", "gold_turn_ids": ["nope"]}]},
     "questions[0].gold_turn_ids[0]", "unknown turn id 'nope'"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?", "gold_session_ids": ["s9"]}]},
     "questions[0].gold_session_ids[0]", "unknown session id 's9'"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?", "gold_turn_ids": "x"}]},
     "questions[0].gold_turn_ids", "expected a list"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?", "id": "a"},
                                                                  {"question": "!", "id": "a"}]},
     "questions[1].id", "duplicate question id"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?", "abstention": "no"}]},
     "questions[0].abstention", "expected a boolean"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?"}, {"question": ""}]},
     "questions[1].question", "empty question"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": " \n\t"}]},
     "questions[0].question", "empty question"),
    # an id or category may be an integer, not 1.5 (which was "expected a string or a number, got a number")
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?", "id": 1.5}]},
     "questions[0].id", "expected a string or an integer, got a number"),
    ({"user_id": "u", "messages": GOOD["messages"], "questions": [{"question": "?", "category": 2.5}]},
     "questions[0].category", "expected a string or an integer, got a number"),
]


@pytest.mark.parametrize("line,key,fragment", BAD_LINES)
def test_bad_chat_lines_name_file_line_and_key(tmp_path, line, key, fragment):
    path = tmp_path / "chats.jsonl"
    path.write_text(jl(GOOD, line))
    with pytest.raises(InputError) as e:
        load_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2") and fragment in msg and "\n" not in msg, msg
    if key is not None:
        assert f"key '{key}'" in msg, msg


# --------------------------------------------------------------------------- OpenAI message shapes
def user_line(*messages, questions=()):
    return {"user_id": "u", "session_id": "s", "messages": list(messages), "questions": list(questions)}


def load_one(tmp_path, *messages, questions=(), skip_invalid=False, keep_roles=()):
    path = tmp_path / "chats.jsonl"
    path.write_text(jl(user_line(*messages, questions=questions)))
    ds = load_jsonl(path, skip_invalid=skip_invalid, keep_roles=keep_roles)
    return ds.users[0], ds.stats


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_content_parts_text_joined_other_parts_counted(tmp_path):
    parts = [{"type": "text", "text": "Look at my dog."}, IMAGE, {"type": "text", "text": "His name is Max."},
             {"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}}]
    u, stats = load_one(tmp_path, {"role": "user", "content": parts},
                        {"role": "user", "content": [IMAGE]},                   # an image alone: no text
                        {"role": "assistant", "content": "Cute!"})
    assert [t.id for t in u.turns] == ["s:0", "s:2"]                        # ids keep the message index
    assert u.turns[0].text == "user: Look at my dog." + PART_SEPARATOR + "His name is Max."
    assert PART_SEPARATOR == "\n"
    assert stats["skipped"]["non_text_parts"] == 3 and stats["skipped"]["no_text"] == 1
    assert stats["turns"] == 2


def test_responses_api_text_parts_are_text(tmp_path):
    """The Responses API writes a message's text as ``input_text`` (user) and ``output_text``
    (assistant) parts: they were dropped and counted as images, audio or files, so a user's
    facts left the store (silently under -q). They are text, joined as ``text`` parts are; a
    refusal part is still no memory."""
    refusal = {"type": "refusal", "refusal": "I can't help with that."}
    said = [{"type": "input_text", "text": "I live in Oslo."}, IMAGE, {"type": "input_text", "text": "Near the fjord."}]
    u, stats = load_one(tmp_path, {"role": "user", "content": said},
                        {"role": "assistant", "content": [{"type": "output_text", "text": "Nice city!",
                                                           "annotations": []}, refusal]},
                        {"role": "assistant", "content": [refusal]})
    assert [t.text for t in u.turns] == ["user: I live in Oslo." + PART_SEPARATOR + "Near the fjord.",
                                         "assistant: Nice city!"]
    assert stats["skipped"]["non_text_parts"] == 3 and stats["skipped"]["no_text"] == 1


def test_tool_calls_and_tool_results_skipped_and_counted(tmp_path):
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": "{}"}}
    result = {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}
    old_result = {"role": "function", "name": "weather", "content": '{"temp": 21}'}
    both = {"role": "assistant", "content": "Let me check.", "tool_calls": call["tool_calls"]}
    u, stats = load_one(tmp_path, {"role": "user", "content": "Weather?"}, call, result, legacy, old_result, both,
                        {"role": "assistant", "content": "It is 21 degrees."},
                        questions=[{"question": "temp?", "gold_turn_ids": ["s:2", "s:6"]},
                                   {"question": "tool?", "gold_turn_ids": ["s:1"]}])
    assert [t.id for t in u.turns] == ["s:0", "s:5", "s:6"] and u.turns[1].text == "assistant: Let me check."
    sk = stats["skipped"]
    assert (sk["tool_calls"], sk["tool_results"], sk["gold_on_skipped"]) == (2, 2, 2)
    assert u.queries[0].gold_turn_ids == ("s:6",) and u.queries[1].gold_turn_ids == ()
    assert stats["no_gold"] == 1


@pytest.mark.parametrize("msg", [{"role": "assistant", "content": None}, {"role": "user", "content": None},
                                 {"role": "assistant", "content": None, "tool_calls": []}])
def test_null_content_without_a_tool_call_is_refused_or_skipped_and_counted(tmp_path, msg):
    """Invalid like empty content: an error naming file:line and the key, or with skip_invalid
    skipped and counted (it was fatal even with --skip-invalid)."""
    with pytest.raises(InputError) as e:
        load_one(tmp_path, {"role": "user", "content": "first"}, msg)
    err = str(e.value)
    assert err.startswith(f"{tmp_path / 'chats.jsonl'}:1: key 'messages[1].content'") and "no 'tool_calls'" in err
    u, stats = load_one(tmp_path, {"role": "user", "content": "first"}, msg, {"role": "user", "content": "third"},
                        skip_invalid=True)
    assert [t.id for t in u.turns] == ["s:0", "s:2"]
    assert stats["skipped"]["null_content"] == 1 and stats["skipped"]["first_errors"] == [err]


def test_system_and_developer_messages_are_left_out_unless_kept(tmp_path):
    """Instructions are not memories: a system prompt repeated in every session would fill the
    bank. Left out and counted by default (gold naming one is dropped and counted); kept on
    request; a user with nothing else is an error."""
    system = {"role": "system", "content": "You are a helpful assistant."}
    developer = {"role": "developer", "content": "Answer briefly."}
    gold = [{"question": "what am I?", "gold_turn_ids": ["s:0", "s:2"]}]
    u, stats = load_one(tmp_path, system, developer, {"role": "user", "content": "I like tea."}, questions=gold)
    assert [t.id for t in u.turns] == ["s:2"] and u.turns[0].text == "user: I like tea."
    assert stats["skipped"]["instructions"] == 2 and stats["skipped"]["gold_on_skipped"] == 1
    assert u.queries[0].gold_turn_ids == ("s:2",)
    u, stats = load_one(tmp_path, system, developer, {"role": "user", "content": "I like tea."}, questions=gold,
                        keep_roles=("system",))
    assert [t.text for t in u.turns] == ["system: You are a helpful assistant.", "user: I like tea."]
    assert stats["skipped"]["instructions"] == 1 and u.queries[0].gold_turn_ids == ("s:0", "s:2")
    with pytest.raises(InputError, match="has no message with text.*system or developer"):
        load_one(tmp_path, system)
    with pytest.raises(InputError, match="unknown role 'user'"):
        load_one(tmp_path, system, keep_roles=("user",))


BAD_MESSAGES = [
    ({"role": "user", "content": [{"text": "a"}]}, "messages[0].content[0].type", "missing key"),
    ({"role": "user", "content": ["a"]}, "messages[0].content[0]", "expected an object"),
    ({"role": "user", "content": [{"type": "text", "text": 3}]}, "messages[0].content[0].text", "expected a string"),
    ({"role": "user", "content": {"type": "text"}}, "messages[0].content", "expected a string or a list"),
]


@pytest.mark.parametrize("msg,key,fragment", BAD_MESSAGES)
def test_malformed_openai_messages_one_line(tmp_path, msg, key, fragment):
    with pytest.raises(InputError) as e:
        load_one(tmp_path, msg, {"role": "user", "content": "ok"}, skip_invalid=True)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'chats.jsonl'}:1: key '{key}'") and fragment in msg and "\n" not in msg


INVALID = [("empty", ""), ("empty", "  \n\t "), ("empty", []), ("empty", [{"type": "text", "text": " "}]),
           ("too_long", "x" * (MAX_MESSAGE_CHARS + 1)),
           ("too_long", [{"type": "text", "text": "x" * MAX_MESSAGE_CHARS}, {"type": "text", "text": "y"}])]


@pytest.mark.parametrize("kind,content", INVALID)
def test_empty_and_too_long_refused_or_skipped(tmp_path, kind, content):
    bad = {"role": "user", "content": content}
    with pytest.raises(InputError) as e:
        load_one(tmp_path, {"role": "user", "content": "first"}, bad)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'chats.jsonl'}:1: key 'messages[1].content'") and "\n" not in msg
    assert ("empty content" if kind == "empty" else f"more than {MAX_MESSAGE_CHARS}") in msg
    u, stats = load_one(tmp_path, {"role": "user", "content": "first"}, bad, {"role": "user", "content": "third"},
                        skip_invalid=True)
    assert [t.id for t in u.turns] == ["s:0", "s:2"]
    assert stats["skipped"][kind] == 1 and stats["skipped"]["first_errors"] == [msg]


def test_message_at_the_limit_is_kept(tmp_path):
    u, stats = load_one(tmp_path, {"role": "user", "content": "x" * MAX_MESSAGE_CHARS})
    assert len(u.turns) == 1 and stats["skipped"]["too_long"] == 0


def test_user_with_nothing_left_is_an_error_and_empty_sessions_dropped(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(jl({"user_id": "u", "messages": [{"role": "user", "content": "hi"}]},
                       {"user_id": "u", "session_id": "tools", "messages": [{"role": "tool", "content": "{}"}]},
                       {"user_id": "v", "messages": [{"role": "tool", "content": "{}"}]}))
    with pytest.raises(InputError, match=r"c\.jsonl:3: key 'user_id': user 'v' has no message with text"):
        load_jsonl(path)
    path.write_text(jl({"user_id": "u", "messages": [{"role": "user", "content": "hi"}]},
                       {"user_id": "u", "session_id": "tools", "messages": [{"role": "tool", "content": "{}"}],
                        "questions": [{"question": "?", "gold_session_ids": ["tools"]}]}))
    ds = load_jsonl(path)
    (u,) = ds.users
    assert [s.id for s in u.sessions] == ["session_1"] and ds.stats["sessions"] == 1
    assert u.queries[0].gold_turn_ids == () and ds.stats["no_gold"] == 1


@pytest.fixture
def fake_model(monkeypatch):
    """``embed`` with a bag-of-words embedder standing in for the model."""
    from conftest import FakeEmbedder

    import rmm_jax.cli.embed as embed_cli

    class Fake(FakeEmbedder):
        def __init__(self, *a, **k):
            super().__init__(16)
            self.cache_dir, self.texts_embedded = None, 0
    monkeypatch.setattr(embed_cli, "Embedder", Fake)


def test_embed_answers_notes_how_many_questions_have_no_answer(capsys, tmp_path, fake_model):
    """``--answers`` embeds a question without an answer as the question alone: said on stderr
    with the count (it was silent), once, and not on stdout (--json stays one object)."""
    questions = [q for u in load_jsonl(CHATS).users for q in u.queries]
    n = sum(not q.answer for q in questions)
    assert 1 < n < len(questions)
    code, out, err = run_cli(capsys, "embed", f"jsonl:{CHATS}", "--out", tmp_path / "a", "--answers", "--json")
    assert code == 0 and json.loads(out)["answers"] is True, err
    notes = [ln for ln in err.splitlines() if "--answers" in ln]
    assert notes == [f"note: --answers: {n} of {len(questions)} questions have no answer; their answer "
                     "embeddings are of the questions alone"], err
    one = tmp_path / "one.jsonl"
    one.write_text(jl(user_line({"role": "user", "content": "I like tea."}, questions=[{"question": "drink?"}])))
    code, out, err = run_cli(capsys, "embed", f"jsonl:{one}", "--out", tmp_path / "b", "--answers")
    assert code == 0 and "note: --answers: 1 of 1 question has no answer; its answer embedding is of the " \
                         "question alone\n" in err, err
    code, out, err = run_cli(capsys, "embed", f"jsonl:{CHATS}", "--out", tmp_path / "c")
    assert code == 0 and "--answers" not in err     # no answers asked for: nothing to say


def test_embed_out_over_a_store_says_what_it_replaced(capsys, tmp_path, fake_model):
    """``--out`` over an existing store replaces it: said on stderr with the old store's counts
    (it was silent); --json's stdout stays one object; a new path replaces nothing."""
    out = tmp_path / "store"
    code, _, err = run_cli(capsys, "embed", f"jsonl:{CHATS}", "--out", out)
    assert code == 0 and "replaced" not in err, err
    old = open_store(out).manifest["counts"]
    one = tmp_path / "one.jsonl"
    one.write_text(jl(user_line({"role": "user", "content": "I like tea."})))
    code, stdout, err = run_cli(capsys, "embed", f"jsonl:{one}", "--out", out, "--json")
    assert code == 0 and json.loads(stdout)["counts"]["users"] == 1, err
    assert [ln for ln in err.splitlines() if "replaced" in ln] == [
        f"replaced {out} (was {old['users']} users, {old['memories']} memories)"], err
    code, stdout, err = run_cli(capsys, "embed", f"jsonl:{one}", "--out", out)
    assert code == 0 and f"replaced {out} (was 1 user, 1 memory)\n" in err, err


def test_embed_skip_invalid_counts_on_stderr_and_json(capsys, tmp_path, fake_model):
    """Through the CLI: without --skip-invalid the first invalid message is the one-line error
    and nothing is written; with it the counts are on stderr and in the manifest."""
    path = tmp_path / "chats.jsonl"
    path.write_text(jl(user_line({"role": "user", "content": [{"type": "text", "text": "I like tea."}, IMAGE]},
                                 {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
                                 {"role": "tool", "content": "{}"},
                                 {"role": "user", "content": ""},
                                 {"role": "user", "content": "y" * (MAX_MESSAGE_CHARS + 5)},
                                 {"role": "assistant", "content": "Noted."},
                                 questions=[{"question": "drink?", "gold_turn_ids": ["s:0"]}])))
    code, out, err = run_cli(capsys, "embed", f"jsonl:{path}", "--out", tmp_path / "a")
    one_line_error(code, out, err, "chats.jsonl:1", "'messages[3].content'", "empty content")
    assert not (tmp_path / "a").exists()
    code, out, err = run_cli(capsys, "embed", f"jsonl:{path}", "--out", tmp_path / "a", "--skip-invalid", "--json")
    assert code == 0, err
    sk = json.loads(out)["stats"]["skipped"]
    assert {k: v for k, v in sk.items() if v and k != "first_errors"} == {
        "tool_results": 1, "tool_calls": 1, "non_text_parts": 1, "empty": 1, "too_long": 1}
    assert len(sk["first_errors"]) == 2 and json.loads(out)["counts"]["memories"] == 2
    (line,) = [ln for ln in err.splitlines() if ln.startswith("skipped ")]
    assert line.startswith("skipped 4 messages (1 tool result, 1 tool-call-only, 1 empty, 1 over 16000 characters)")
    assert "1 non-text content part (images" in line          # one part, in the singular (count())
    assert "first invalid: " in line and "messages[3].content" in line
    code, out, err = run_cli(capsys, "embed", "synthetic:users=2", "--out", tmp_path / "b", "--skip-invalid")
    one_line_error(code, out, err, "--skip-invalid", "jsonl")


def test_embed_notes_the_texts_the_model_cut(capsys, tmp_path, monkeypatch):
    """A message longer than the model reads was embedded from its beginning, silently: the
    note counts the texts cut, on stderr (--out and --into), and says nothing when none was."""
    from conftest import FakeEmbedder

    import rmm_jax.cli.embed as embed_cli
    monkeypatch.setattr(embed_cli, "Embedder", lambda *a, **k: FakeEmbedder(16, max_tokens=5))
    path = tmp_path / "chats.jsonl"
    path.write_text(jl(user_line({"role": "user", "content": "one two three"},
                                 {"role": "user", "content": "one two three four five six seven"})))
    code, out, err = run_cli(capsys, "embed", f"jsonl:{path}", "--out", tmp_path / "a")
    assert code == 0, err
    assert ("note: 1 of 2 texts embedded was longer than model fake/bow-16 reads (5 word pieces, about 20 "
            "characters) and embedded from the beginning only") in err and "'Long messages'" in err
    day = tmp_path / "day.jsonl"
    day.write_text(jl({**user_line({"role": "user", "content": "a b c d e f"}), "session_id": "s2"}))
    code, out, err = run_cli(capsys, "embed", f"jsonl:{day}", "--into", tmp_path / "a")
    assert code == 0 and "note: 1 of 1 text embedded was longer than model" in err, err
    day.write_text(jl({**user_line({"role": "user", "content": "short"}), "session_id": "s3"}))
    code, out, err = run_cli(capsys, "embed", f"jsonl:{day}", "--into", tmp_path / "a")
    assert code == 0 and "longer than model" not in err, err


def test_embed_keep_roles(capsys, tmp_path, fake_model):
    """System prompts are left out and counted (stderr and manifest) unless --keep-roles names them."""
    path = tmp_path / "chats.jsonl"
    prompt = {"role": "system", "content": "You are a helpful assistant."}
    path.write_text(jl(*[{**user_line(prompt, {"role": "user", "content": f"Fact {i}."}), "session_id": f"s{i}"}
                         for i in range(3)]))
    code, out, err = run_cli(capsys, "embed", f"jsonl:{path}", "--out", tmp_path / "a", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["counts"]["memories"] == 3 and rep["stats"]["skipped"]["instructions"] == 3
    assert "skipped 3 messages (3 system/developer); --keep-roles system,developer keeps system/developer messages" \
        in err
    code, out, err = run_cli(capsys, "embed", f"jsonl:{path}", "--out", tmp_path / "b", "--json",
                             "--keep-roles", "system,developer")
    assert code == 0, err
    assert json.loads(out)["counts"]["memories"] == 6 and json.loads(out)["stats"]["skipped"]["instructions"] == 0
    code, out, err = run_cli(capsys, "embed", f"jsonl:{path}", "--out", tmp_path / "c", "--keep-roles", "user")
    one_line_error(code, out, err, "--keep-roles", "'user'")
    code, out, err = run_cli(capsys, "embed", "synthetic:users=2", "--out", tmp_path / "c", "--keep-roles", "system")
    one_line_error(code, out, err, "--keep-roles", "jsonl")
    assert not (tmp_path / "c").exists()


def test_embed_counts_one_text_in_the_singular(capsys, tmp_path, fake_model):
    """The stderr notes of `embed --out` and `embed --into` read "1 text embedded", not "1 texts"."""
    day1, day2 = tmp_path / "day1.jsonl", tmp_path / "day2.jsonl"
    day1.write_text(jl({**GOOD, "session_id": "s1"}))
    day2.write_text(jl({**GOOD, "session_id": "s2", "messages": [{"role": "user", "content": "bye"}]}))
    for args in (["--out", tmp_path / "store"], ["--into", tmp_path / "store"]):
        code, _, err = run_cli(capsys, "embed", f"jsonl:{day1 if args[0] == '--out' else day2}", *args)
        assert code == 0, err
        (note,) = [ln for ln in err.splitlines() if "embedded" in ln]
        assert "(1 text embedded" in note, note


def test_empty_and_missing_chat_files(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="no records"):
        load_jsonl(tmp_path / "e.jsonl")
    with pytest.raises(InputError, match="file not found"):
        load_spec(f"jsonl:{tmp_path / 'nope.jsonl'}")


# --------------------------------------------------------------------------- logs that carry text
CALL = {"user_id": "u", "query_id": "q1", "query": "where is Lena?",
        "candidates": [{"id": "m1", "text": "Lena moved to Lisbon."}, {"id": "m2", "text": "I like tea."}],
        "selected": ["m1"], "cited": ["m1"], "gold": ["m1"]}


def test_text_records_round_trip_and_old_records_unchanged():
    rec = validate_record(CALL)
    assert rec.candidates == ("m1", "m2") and rec.candidate_texts == ("Lena moved to Lisbon.", "I like tea.")
    assert rec.query_text == "where is Lena?" and rec.gold == ("m1",) and rec.logits is None
    assert validate_record(record_to_json(rec)) == rec
    mixed = validate_record({**CALL, "candidates": ["m1", {"id": "m2", "text": "t"}]})
    assert mixed.candidate_texts == (None, "t") and record_to_json(mixed)["candidates"] == ["m1", {"id": "m2",
                                                                                                  "text": "t"}]
    old = {"user_id": "u", "query_id": "q", "candidates": ["a", "b"], "selected": ["b"], "cited": []}
    assert validate_record(old) == LogRecord("u", "q", ("a", "b"), ("b",), ()) and record_to_json(
        validate_record(old)) == old


@pytest.mark.parametrize("change,key,fragment", [
    ({"candidates": [{"text": "x"}]}, "candidates", "without 'id'"),
    ({"candidates": [{"id": "m1", "text": 5}]}, "candidates", "'text' must be a string"),
    ({"candidates": [{"id": "m1", "text": "a"}, "m1"]}, "candidates", "duplicate id 'm1'"),
    ({"query": 3}, "query", "must be a string"),
    ({"gold": "m1"}, "gold", "list of strings"),
    ({"logits": [1.0]}, "logits", "one logit per candidate"),
    ({"logits": [1.0, "a"]}, "logits", "item 1 must be a number"),
    ({"logits": [1.0, 1e400]}, "logits", "finite"),
    ({"logits": [1.0, 1e39]}, "logits", "finite in float32"),      # a float64, inf once read as float32
    ({"logits": [0.0, 0.0], "log_prob": -0.1}, "log_prob", "not the Plackett–Luce log-probability"),
])
def test_bad_text_records(change, key, fragment):
    with pytest.raises(InputError) as e:
        validate_record({**CALL, **change}, "calls.jsonl:7")
    msg = str(e.value)
    assert msg.startswith(f"calls.jsonl:7: key '{key}'") and fragment in msg, msg


def test_logits_and_log_prob_agree():
    logits = [2.0, -1.0]
    rec = validate_record({**CALL, "logits": logits, "log_prob": pl_log_prob(logits, [0]) + 5e-4})
    assert rec.logits == (2.0, -1.0)


def test_a_float32_producers_log_prob_is_accepted_at_any_temperature_and_a_wrong_order_is_not():
    """The log_prob a producer computes in float32 (rmm-jax's own sampler: ``rerank --explore``)
    agrees with the float64 check within pl_tolerance's float32 bound, also at the logits of
    τ = 1e-5, where it errs by more than the 1e-3 floor (rerank refused its own output there);
    the same draws in another order are still refused."""
    import jax.numpy as jnp
    import numpy as np

    from rmm_jax.core.sampling import selection_log_prob
    rng = np.random.default_rng(0)
    k, m, worst, refused = 20, 5, 0.0, 0
    for scale in (1.0, 1e2, 1e4, 1e5, 1e6):
        for _ in range(10):
            z = (rng.standard_normal(k) * scale).astype(np.float32)
            order = np.argsort(-(z.astype(np.float64) / scale + rng.gumbel(size=k)))[:m]    # a Gumbel top-M draw
            lp32 = float(selection_log_prob(jnp.asarray(z), jnp.asarray(order, jnp.int32), 1.0))
            worst = max(worst, abs(lp32 - pl_log_prob(z, order)))
            ids = [f"m{i}" for i in range(k)]
            rec = {"user_id": "u", "query_id": "q", "candidates": ids, "selected": [ids[i] for i in order],
                   "cited": [], "logits": [float(x) for x in z], "log_prob": lp32}
            assert validate_record(rec, "log.jsonl:1").log_prob == lp32
            other = (order[1], order[0], *order[2:])
            if abs(pl_log_prob(z, other) - lp32) > 2 * pl_tolerance(z, m, lp32):   # a detectable mistake
                refused += 1
                with pytest.raises(InputError, match="not the Plackett–Luce"):
                    validate_record({**rec, "selected": [ids[i] for i in other]}, "log.jsonl:1")
    assert worst > 1e-3, worst             # the case the 1e-3 floor alone refused
    assert refused >= 20, refused          # a swap of two draws that both trail the largest logit
                                           # barely moves log P: only the others are checked


def test_example_log_dataset():
    ds = load_spec(f"log:{CALLS}")
    assert ds.name == "log" and [u.id for u in ds.users] == ["alice", "bob"]
    records, _ = read_log(CALLS)
    alice = ds.users[0]
    assert [q.id for q in alice.queries] == [r.query_id for r in records if r.user_id == "alice"]
    chats = {t.id: t.text for u in load_jsonl(CHATS).users if u.id == "alice" for t in u.turns}
    for t in alice.turns:  # memories keep the logged ids and texts (the chat history's turns here)
        assert chats[t.id] == t.text and t.session_id == "log"
    assert ds.stats["records"] == 12 and ds.stats["no_gold"] == 1 and ds.stats["memories"] == 26


def test_log_with_a_memories_file(tmp_path):
    mems = tmp_path / "mems.jsonl"
    mems.write_text(jl({"user_id": "u", "id": "m1", "text": "Lena moved to Lisbon.", "session_id": "s1",
                        "timestamp": "2024-01-01"},
                       {"user_id": "u", "id": "m2", "text": "I like tea."},
                       {"user_id": "u", "id": "m3", "text": "never retrieved"}))
    calls = tmp_path / "calls.jsonl"
    calls.write_text(jl({**CALL, "candidates": ["m2", "m1"]}))
    (u,) = load_spec(f"log:{calls},memories={mems}").users
    assert [t.id for t in u.turns] == ["m1", "m2", "m3"] and [s.id for s in u.sessions] == ["s1", "log"]
    assert u.sessions[0].timestamp == "2024-01-01" and u.queries[0].gold_turn_ids == ("m1",)


@pytest.mark.parametrize("case", ["no_query", "blank_query", "no_text", "conflict", "mem_missing_text", "mem_conflict",
                                  "bad_json"])
def test_bad_log_datasets_name_file_line_and_key(tmp_path, case):
    calls, mems = tmp_path / "calls.jsonl", tmp_path / "mems.jsonl"
    second = {**CALL, "query_id": "q2"}
    mem_lines = [{"user_id": "u", "id": "m9", "text": "x"}]
    where, key, fragment = calls, None, ""
    if case == "no_query":
        del second["query"]
        key, fragment = "query", "query text"
    elif case == "blank_query":        # its query_id names the call, so the log itself accepts it
        second["query"] = " \n"
        key, fragment = "query", "empty query text"
    elif case == "no_text":
        second["candidates"] = ["m1", "m5"]
        key, fragment = "candidates", "no text for memory 'm5'"
    elif case == "conflict":
        second["candidates"] = [{"id": "m1", "text": "Lena moved to Porto."}]
        second["selected"], second["cited"] = ["m1"], []
        key, fragment = "candidates", f"different text than at {calls}:1"
    elif case == "mem_missing_text":
        mem_lines.append({"user_id": "u", "id": "m8"})
        where, key, fragment = mems, "text", "missing key"
    elif case == "mem_conflict":
        mem_lines.append({"user_id": "u", "id": "m9", "text": "y"})
        where, key, fragment = mems, "text", "different text"
    else:
        second = '{"user_id": "u",'
        fragment = "invalid JSON"
    calls.write_text(jl(CALL, second))
    mems.write_text(jl(*mem_lines))
    with pytest.raises(InputError) as e:
        load_log_dataset(calls, mems)
    msg = str(e.value)
    assert msg.startswith(f"{where}:2") and fragment in msg, msg
    if key:
        assert f"key '{key}'" in msg, msg


def test_gold_that_no_record_carries_is_dropped_and_counted(tmp_path, capsys, fake_model):
    """A gold memory that was never retrieved has no text in the log: the store cannot hold it,
    so it leaves its question's gold, counted with where it was; a question left with no gold
    counts as one. With the memory's text in a memories file it stays."""
    calls = tmp_path / "calls.jsonl"
    calls.write_text(jl({**CALL, "gold": ["m1", "zz"]}, {**CALL, "query_id": "q2", "gold": ["zz", "yy"]}))
    ds = load_log_dataset(calls)
    (u,) = ds.users
    assert [q.gold_turn_ids for q in u.queries] == [("m1",), ()] and "zz" not in [t.id for t in u.turns]
    assert ds.stats["gold_without_text"] == 3 and ds.stats["no_gold"] == 1
    assert ds.stats["gold_without_text_first"] == [f"{calls}:1: key 'gold[1]': 'zz'", f"{calls}:2: key 'gold[0]': 'zz'",
                                                   f"{calls}:2: key 'gold[1]': 'yy'"]
    mems = tmp_path / "mems.jsonl"
    mems.write_text(jl({"user_id": "u", "id": "zz", "text": "Lena's flat is in Alfama."}))
    ds = load_log_dataset(calls, mems)
    assert ds.stats["gold_without_text"] == 1 and ds.users[0].queries[0].gold_turn_ids == ("m1", "zz")   # yy still
    code, out, err = run_cli(capsys, "embed", f"log:{calls}", "--out", tmp_path / "store", "--json")
    assert code == 0 and json.loads(out)["stats"]["gold_without_text"] == 3, err      # in the manifest
    assert "dropped 3 gold ids naming memories no record carries" in err and "calls.jsonl:1: key 'gold[1]'" in err
    assert "Give their texts with log:CALLS,memories=MEMS" in err
    # memories=MEMS given: the hint says to add the missing texts to that file, not to give one
    code, out, err = run_cli(capsys, "embed", f"log:{calls},memories={mems}", "--out", tmp_path / "store2")
    assert code == 0 and "dropped 1 gold id naming a memory no record carries" in err, err     # "1 gold ids" was
    assert f"Add their texts to {mems} to keep them" in err, err
    assert "Give their texts with" not in err


def test_a_store_built_from_a_log_replays_that_log_despite_gold_never_retrieved(tmp_path, capsys, monkeypatch):
    """``embed log:`` drops a gold id that no record carries; replaying and evaluating the same
    log on that store refused it ("unknown memory id ... neither in the store nor a candidate"),
    though the ids are kept as logged so that the log replays. Where the store holds the
    question its gold counts; elsewhere Recall leaves out the ids no bank holds (neither the
    store nor any record of the user), counted in one note, and a call left with no gold does
    not count for Recall. A gold id that another record of the user lists stays gold: it is in
    the bank (a review found a first form of the fix dropping it, per record). The records
    keep their gold as logged, for cite-rates, which needs no bank."""
    use_fake_embedder(monkeypatch)
    calls, store, pol = tmp_path / "calls.jsonl", tmp_path / "store", tmp_path / "pol"
    by_call = {k: v for k, v in CALL.items() if k != "query_id"} | {"log_prob": -0.5}
    ww = {"id": "ww", "text": "Lena has a cat."}
    calls.write_text(jl({**CALL, "gold": ["m1", "zz"], "log_prob": -0.5},   # the store holds q1
                        {**by_call, "call_id": "c2", "query": "what do I drink?", "gold": ["m2", "yy"]},
                        {**by_call, "call_id": "c3", "query": "who is Lena?", "gold": ["yy"]},
                        {**by_call, "call_id": "c4", "query": "does Lena have a pet?", "gold": ["ww"]},
                        {**by_call, "call_id": "c5", "query": "a cat?", "candidates": [*CALL["candidates"], ww],
                         "gold": ["ww"]}))
    code, out, err = run_cli(capsys, "embed", f"log:{calls}", "--out", store, "--json")
    assert code == 0 and json.loads(out)["stats"]["gold_without_text"] == 3, err
    st = open_store(store)
    recs, report = read_log(calls, known=known_ids(st))
    assert [r.gold for r in recs] == [("m1", "zz"), ("m2", "yy"), ("yy",), ("ww",), ("ww",)]    # as logged
    assert report.notes == [f"{calls}: 2 gold ids name no memory of the store or of any record of its user (first: "
                            "line 2, 'yy' of user 'u'): Recall leaves them out, as no bank holds a gold memory never "
                            "retrieved (cite-rates counts such a call as one with gold)"]
    for known in (known_ids(st), None):     # read with the store or without: resolved the same way
        raw, _ = read_log(calls, known=known)
        texts = [t for r in raw for t in unseen_texts(r, known_ids(st)("u"))]
        c = resolve_calls(st, "u", raw, dict(zip(texts, FakeEmbedder(st.dim).encode(texts))), 3, 1)
        assert c.num_gold.tolist() == [1, 1, 0, 1, 1] and c.valid.tolist() == [True, True, False, True, True]
        assert "zz" not in c.memory_ids and "yy" not in c.memory_ids and "ww" in c.memory_ids
    code, out, err = run_cli(capsys, "replay", store, "--log", calls, "--policies", pol, "--json")
    assert code == 0, err
    assert [x for x in err.splitlines() if "no memory of the store" in x] == [f"note: {report.notes[0]}"]
    code, out, err = run_cli(capsys, "evaluate", store, "--log", calls, "--policies", pol, "--json",
                             "--allow-unreliable", "--bootstrap", 40)
    assert code == 0, err
    assert json.loads(out)["estimates"]["recall"]["logged"]["n"] == 4      # c3 has no gold left


def test_embed_log_notes_each_misspelt_key_once(tmp_path, capsys, fake_model):
    calls = tmp_path / "calls.jsonl"
    calls.write_text(jl({**CALL, "answer": "Lisbon"}, {**CALL, "query_id": "q2", "gold_ids": ["m1"], "golds": ["m1"]},
                        {**CALL, "query_id": "q3", "golds": ["m2"]}))
    assert load_log_dataset(calls).stats["notes"] == [
        f"{calls}:2: key 'golds' is not a log key and was ignored (did you mean 'gold'?)"]
    code, out, err = run_cli(capsys, "embed", f"log:{calls}", "--out", tmp_path / "store")
    assert code == 0, err
    assert [x for x in err.splitlines() if "is not a log key" in x] == [
        f"note: {calls}:2: key 'golds' is not a log key and was ignored (did you mean 'gold'?)"], err


def test_rerank_logs_name_each_question_by_its_call(tmp_path, capsys, fake_model):
    """`rmm-jax rerank` writes calls with a call_id and the query text but no query_id: each is a
    question named by its call_id (a query_id still names it first, the text when it has
    neither), with texts in the log or in a memories file. Two calls that name one question
    are one line naming the second's file:line, before the model."""
    texts = {"m1": "Lena moved to Lisbon.", "m2": "I like tea."}
    served = lambda cid, q, **more: {"user_id": "olga", "call_id": cid, "query": q, "candidates": ["m1", "m2"],
                                     "selected": ["m1"], "cited": ["m1"], **more}
    recs = [served("c1", "where is Lena?"), served("c2", "what do I drink?", gold=["m2"]),
            served("c3", "where is Lena now?", query_id="q7"), served(None, "tea or coffee?")]
    mems, ids_log, text_log = tmp_path / "mems.jsonl", tmp_path / "ids.jsonl", tmp_path / "texts.jsonl"
    mems.write_text(jl(*({"user_id": "olga", "id": m, "text": t} for m, t in texts.items())))
    ids_log.write_text(jl(*recs))
    text_log.write_text(jl(*({**r, "candidates": [{"id": m, "text": t} for m, t in texts.items()]} for r in recs)))
    for spec in (f"log:{text_log}", f"log:{ids_log},memories={mems}"):
        (u,) = load_spec(spec).users
        assert [q.id for q in u.queries] == ["c1", "c2", "q7", "tea or coffee?"]
        assert [q.text for q in u.queries] == [r["query"] for r in recs] and u.queries[1].gold_turn_ids == ("m2",)
        code, out, err = run_cli(capsys, "embed", spec, "--out", tmp_path / "store", "--json")
        assert code == 0, err
        assert json.loads(out)["counts"] == {"users": 1, "memories": 2, "queries": 4}
        assert list(open_store(tmp_path / "store").user("olga").query_ids) == [q.id for q in u.queries]
    ids_log.write_text(jl(recs[2], served("c4", "where is Lena today?", query_id="q7")))
    code, out, err = run_cli(capsys, "embed", f"log:{ids_log},memories={mems}", "--out", tmp_path / "dup")
    one_line_error(code, out, err, f"{ids_log}:2: key 'query_id'", "duplicate question 'q7'", "first logged at line 1")
    assert not (tmp_path / "dup").exists()


def test_bad_log_spec():
    with pytest.raises(InputError, match="expected log:CALLS"):
        load_spec("log:calls.jsonl,memories=")


def test_an_unknown_log_option_is_named_as_one_and_a_file_named_with_a_comma_still_loads(tmp_path, capsys):
    """``log:CALLS,foo=bar`` was reported as a missing file ``CALLS,foo=bar``."""
    for spec in (f"log:{CALLS},foo=bar", f"log:{CALLS},foo=bar,memories={CALLS}", f"log:{CALLS},memories={CALLS},x=1"):
        key = spec.rpartition(",")[2].partition("=")[0] if spec.endswith("x=1") else "foo"
        with pytest.raises(InputError, match=rf"^SPEC '{re.escape(spec)}': unknown option '{key}' "
                                             r"\(expected memories=MEMS.jsonl\)$"):
            load_spec(spec)
    code, out, err = run_cli(capsys, "embed", f"log:{CALLS},foo=bar", "--out", tmp_path / "s")
    assert (code, out, err) == (2, "", f"error: SPEC 'log:{CALLS},foo=bar': unknown option 'foo' "
                                       "(expected memories=MEMS.jsonl)\n")
    odd = tmp_path / "calls,day=1.jsonl"          # a file whose name looks like an option: read, as before
    odd.write_bytes(CALLS.read_bytes())
    assert [u.id for u in load_spec(f"log:{odd}").users] == ["alice", "bob"]


# --------------------------------------------------------------------------- through the CLI
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jsonl-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch, cache_dir):
    monkeypatch.setenv("RMM_JAX_CACHE", str(cache_dir))


def one_line_error(code, out, err, *names):
    assert code == 2 and out == "", (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], (name, lines[0])


def test_embed_chat_history_notes_missing_gold(capsys, tmp_path):
    code, out, err = run_cli(capsys, "embed", f"jsonl:{CHATS}", "--out", tmp_path / "s", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["dataset"] == "jsonl" and rep["counts"] == {"users": 2, "memories": 26, "queries": 12}
    assert "note: 1 of 12 questions have no gold ids" in err
    code, out, err = run_cli(capsys, "retrieve", tmp_path / "s", "--k", 5, "--json")
    assert code == 0 and json.loads(out)["counts"]["valid_queries"] == 11


def test_embed_bad_chat_history_writes_nothing(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jl(GOOD, {"user_id": "u", "messages": [{"role": "user", "content": None}]}))
    code, out, err = run_cli(capsys, "embed", f"jsonl:{bad}", "--out", tmp_path / "out" / "s", "--quiet")
    one_line_error(code, out, err, "bad.jsonl:2", "'messages[0].content'")
    assert not (tmp_path / "out").exists()
    code, out, err = run_cli(capsys, "embed", f"log:{CALLS}", "--out", tmp_path / "s2", "--granularity", "session")
    one_line_error(code, out, err, "--granularity")
    assert not (tmp_path / "s2").exists()


def test_cache_dir_roots_every_verb_that_embeds(capsys, tmp_path, monkeypatch):
    """rerank, replay and evaluate embed the texts a store lacks (a day's new questions), and
    only embed took --cache-dir: a team keeping its cache elsewhere had to set $RMM_JAX_CACHE.
    Each takes it now, over the variable (whose root here cannot be made); one that cannot be
    made is one line naming it, and writes nothing."""
    from rmm_jax.data.embed import model_slug

    store = tmp_path / "chats"
    code, _, err = run_cli(capsys, "embed", f"jsonl:{CHATS}", "--out", store, "-q")
    assert code == 0, err
    recs = [json.loads(line) for line in CALLS.read_text().splitlines()]
    for r in recs:                                # questions the store has never seen
        r["query_id"], r["query"] = "new-" + r["query_id"], r["query"] + " Asked again on day two."
    log, calls = tmp_path / "day2.jsonl", tmp_path / "calls.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    calls.write_text("".join(json.dumps({"user_id": r["user_id"], "query": r["query"],
                                         "candidate_texts": [c["text"] for c in r["candidates"]]}) + "\n"
                             for r in recs))
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("RMM_JAX_CACHE", str(tmp_path / "afile" / "env-cache"))
    bad, own, pol = tmp_path / "afile" / "cache", tmp_path / "own", tmp_path / "policies"
    verbs = (["rerank", store, "--calls", calls, "--out", tmp_path / "served.jsonl"],
             ["replay", store, "--log", log, "--policies", pol],
             ["evaluate", store, "--log", log, "--policies", pol, "--allow-unreliable"])
    for argv in verbs:
        code, out, err = run_cli(capsys, *argv, "--cache-dir", bad, "-q")
        one_line_error(code, out, err, f"--cache-dir {bad}: cannot write")
        assert (tmp_path / "served.jsonl").exists() == (argv[0] != "rerank") and pol.exists() == (argv[0] == "evaluate")
        code, out, err = run_cli(capsys, *argv, "--cache-dir", own, "-q")
        assert code == 0, err
        assert (own / model_slug(MODEL_ID)).is_dir()
    served = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    assert [s["query"] for s in served] == [r["query"] for r in recs]


def test_walkthrough_log_to_store_replay_evaluate(capsys, tmp_path, cache_dir):
    """A generator-call log alone → a store (embedded through the cache) → replay → evaluate."""
    store, own = tmp_path / "calls_store", ["--cache-dir", tmp_path / "own-cache"]
    code, out, err = run_cli(capsys, "embed", f"log:{CALLS}", "--out", store, "--json", *own)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["model"] == MODEL_ID and rep["counts"] == {"users": 2, "memories": 26, "queries": 12}
    assert rep["texts_embedded"] == 26 + 12
    code, out, _ = run_cli(capsys, "embed", f"log:{CALLS}", "--out", store, "--json", *own)
    assert code == 0 and json.loads(out)["texts_embedded"] == 0  # the same cache: nothing embedded twice
    # the chat history holds the same turn and question texts: embedding it costs nothing either
    code, out, _ = run_cli(capsys, "embed", f"jsonl:{CHATS}", "--out", tmp_path / "chats", "--json", *own)
    assert code == 0 and json.loads(out)["texts_embedded"] == 0
    st = open_store(store)
    assert set(st.user("alice").memory_ids) >= {"s1:0", "s3:5"}
    # replay with no dataset: the log's ids are the store's
    pol = tmp_path / "policies"
    code, out, err = run_cli(capsys, "replay", store, "--log", CALLS, "--policies", pol, "--json")
    assert code == 0, err
    assert json.loads(out)["log"]["records"] == 12
    # K and M are the log's (8 candidates, 3 shown on every record), so Recall is Recall@3
    assert {k: json.loads(out)["config"]["layout"][k] for k in "km"} == {"k": 8, "m": 3}
    assert "recall@3" in json.loads(out)["online"] and f"--k 8 --m 3 from {CALLS}" in err
    # evaluate: the logging policy was the base retriever at tau 0.2, so an identity target at
    # tau 0.2 has weights ~1 and every estimate is the logged value (logits rounded to 1e-4);
    # 12 calls are worth an ESS of 12, below the default --min-ess 30
    ident = tmp_path / "identity"
    PolicyStore.create(ident, {"kind": "linear", "dim": st.dim, "hidden": None,
                               "config": {"pretrained": False, "model": st.model}}, init_reranker(jax.random.key(0),
                                                                                                  st.dim))
    code, out, err = run_cli(capsys, "evaluate", store, "--log", CALLS, "--policies", ident, "--k", 8, "--m", 3,
                             "--tau", 0.2, "--json", "--bootstrap", 100, "--min-ess", 10)
    assert code == 0, err
    rep = json.loads(out)
    logged = rep["estimates"]["cited"]["logged"]["value"]
    for name in ("ips", "snips", "rips", "snrips", "iips"):      # 2e-2: the logits' rounding, not float32's
        assert rep["estimates"]["cited"][name]["value"] == pytest.approx(logged, rel=2e-2), name
    assert rep["estimates"]["recall"]["ips"]["n"] == 11  # q8 has no gold
    # the replayed policies evaluate too (own policy per user)
    code, out, err = run_cli(capsys, "evaluate", store, "--log", CALLS, "--policies", pol,
                             "--json", "--bootstrap", 100, "--allow-unreliable")
    assert code == 0, err
    assert json.loads(out)["users_on_shared_params"] == 0


def test_chat_history_store_replays_the_same_log(capsys, tmp_path):
    """Turn ids of the chat history are the log's memory ids, and its question ids the log's
    query ids: the log replays on the chat-history store as well."""
    store = tmp_path / "mine"
    code, _, err = run_cli(capsys, "embed", f"jsonl:{CHATS}", "--out", store, "--quiet")
    assert code == 0, err
    code, out, err = run_cli(capsys, "replay", store, "--log", CALLS, "--policies", tmp_path / "p", "--k", 8,
                             "--m", 3, "--json")
    assert code == 0, err


def test_fixtures_are_current():
    """tests/fixtures/calls.jsonl reads back, and its records agree with the chat history."""
    records, report = read_log(CALLS)
    assert report.records == 12 and report.skipped == 0
    users = {u.id: u for u in load_jsonl(CHATS).users}
    for r in records:
        turns = {t.id: t.text for t in users[r.user_id].turns}
        assert r.query_text == next(q.text for q in users[r.user_id].queries if q.id == r.query_id)
        assert all(turns[c] == t for c, t in zip(r.candidates, r.candidate_texts))
        assert r.logits is not None and r.log_prob is not None
    assert Path(FIXTURES / "make_calls.py").is_file()


def test_examples_are_current():
    """The walkthrough's examples (examples/make_examples.py) as production writes them: the
    chat histories and each day's requests are the script's; each day's log is, call for
    call, what rerank --explore served for its requests (new question texts, a propensity
    with every selection, no gold), with cited = the shown memories that answer the call."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_examples", EXAMPLES / "make_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines, questions = mod.conversations(mod.USERS, mod.SESSIONS, mod.TURNS, mod.SEED)
    assert (EXAMPLES / "chat_history.jsonl").read_text() == "".join(json.dumps(x) + "\n" for x in lines)
    answer = mod.answers(questions)
    for day, reqs in enumerate(mod.requests(questions, mod.DAYS), 1):
        got = [json.loads(x) for x in (EXAMPLES / f"requests_day{day}.jsonl").read_text().splitlines()]
        assert got == reqs
        records, report = read_log(EXAMPLES / f"calls_day{day}.jsonl")
        assert report.skipped == 0 and len(records) == len(reqs)
        for r, q in zip(records, reqs):
            assert (r.call_id, r.user_id, r.query_text, r.timestamp) == (q["call_id"], q["user_id"], q["query"],
                                                                        q["timestamp"])
            assert r.gold is None and r.log_prob is not None and r.logits is not None
            assert r.log_prob == pytest.approx(pl_log_prob(r.logits, [r.candidates.index(t) for t in r.selected]),
                                               abs=1e-4)
            assert list(r.cited) == [m for m in r.selected if m in answer[r.call_id]]
            assert (r.policy_version is None) == (day == 1 or r.user_id == "newcomer")
