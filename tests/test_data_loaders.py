"""Dataset loaders (LoCoMo, LongMemEval), synthetic data and SPEC strings."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from conftest import locomo_dir

from rmm_jax.data import (
    Dataset,
    gold_matrix,
    load_locomo,
    load_longmemeval,
    load_spec,
    make_synthetic,
    parse_synthetic_spec,
)
from rmm_jax.data.synthetic import UPDATES
from rmm_jax.errors import InputError

FIXTURE = Path(__file__).parent / "fixtures" / "longmemeval_tiny.json"
SESSION_KEY = re.compile(r"session_\d+")


def _write(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=1))
    return path


def _tiny_conv() -> dict:
    """A two-session LoCoMo conversation with clean, junk and unresolvable evidence."""
    return {
        "speaker_a": "Ann", "speaker_b": "Bob",
        "session_1_date_time": "1:00 pm on 1 May, 2023",
        "session_1": [
            {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat."},
            {"speaker": "Bob", "dia_id": "D1:2", "text": "Look at this!", "blip_caption": "a photo of a red kite"},
        ],
        "session_2_date_time": "2:00 pm on 9 May, 2023",
        "session_2": [
            {"speaker": "Ann", "dia_id": "D2:1", "text": "The cat is called Tom."},
            {"speaker": "Bob", "dia_id": "D2:2", "text": "Nice name.", "blip_caption": "sunset over a lake"},
        ],
        "qa": [
            {"question": "What pet did Ann adopt?", "answer": "a cat", "evidence": ["D1:1"], "category": 1},
            {"question": "Unresolvable", "answer": "x", "evidence": ["D9:9"], "category": 2},
            {"question": "Partly resolvable", "answer": 3, "evidence": ["D9:9", "D2:1"], "category": 3},
            {"question": "Junk ids", "answer": "Tom", "evidence": ["D1:1; D2:1", " D2:2 ,D1:2"], "category": 4},
            {"question": "Adversarial", "adversarial_answer": "no", "evidence": ["D2:2"], "category": 5},
            {"question": "No evidence", "answer": "?", "evidence": [], "category": 3},
        ],
    }


# --------------------------------------------------------------------------- LoCoMo (real data)
@pytest.fixture(scope="module")
def locomo() -> tuple[Path, Dataset]:
    path = locomo_dir()
    return path, load_locomo(path)


def test_locomo_turn_counts_match_json(locomo):
    path, ds = locomo
    files = sorted(path.glob("*.json"))
    assert [u.id for u in ds.users] == [f.stem for f in files]
    for f, user in zip(files, ds.users):
        raw = json.loads(f.read_text())
        keys = sorted((k for k in raw if SESSION_KEY.fullmatch(k)), key=lambda k: int(k.split("_")[1]))
        assert [s.id for s in user.sessions] == keys
        assert len(user.turns) == sum(len(raw[k]) for k in keys)
        assert [t.id for t in user.turns] == [t["dia_id"] for k in keys for t in raw[k]]
        for s in user.sessions:
            assert s.timestamp == raw[f"{s.id}_date_time"]
            assert all(t.timestamp == s.timestamp and t.session_id == s.id for t in s.turns)


def test_locomo_captions_kept_in_text(locomo):
    path, ds = locomo
    raw = json.loads((path / f"{ds.users[0].id}.json").read_text())
    turns = {t.id: t for t in ds.users[0].turns}
    with_caption = [t for k in raw if SESSION_KEY.fullmatch(k) for t in raw[k] if t.get("blip_caption")]
    assert with_caption
    for rt in with_caption:
        text = turns[rt["dia_id"]].text
        assert text.startswith(f"{rt['speaker']}: {rt['text']} [shares ")
        assert rt["blip_caption"] in text


def test_locomo_questions_and_stats(locomo):
    path, ds = locomo
    total = sum(len(json.loads(f.read_text())["qa"]) for f in path.glob("*.json"))
    kept = sum(len(u.queries) for u in ds.users)
    assert ds.stats["questions"] == kept
    assert kept + ds.stats["skipped_unresolved"] == total
    assert ds.stats["skipped_unresolved"] > 0            # 26.json has questions without evidence
    assert sum(ds.stats["per_category"].values()) == kept
    assert ds.stats["per_category"].get("5", 0) > 0      # adversarial questions are kept
    for u in ds.users:
        ids = {t.id for t in u.turns}
        assert all(q.gold_turn_ids and set(q.gold_turn_ids) <= ids for q in u.queries)


def test_locomo_junk_evidence_is_split(locomo):
    path, ds = locomo
    raw = json.loads((path / "26.json").read_text()) if (path / "26.json").exists() else pytest.skip("no 26.json")
    junk = [i for i, q in enumerate(raw["qa"]) if any(";" in e for e in q["evidence"])]
    assert junk, "26.json is expected to hold the 'D8:6; D9:17' evidence entry"
    user = next(u for u in ds.users if u.id == "26")
    q = next(q for q in user.queries if q.id == f"q{junk[0]}")
    assert set(q.gold_turn_ids) == {"D8:6", "D9:17"}


def test_locomo10_layout_equals_per_file_layout(locomo, tmp_path):
    """The single-file release of the same conversations gives identical users."""
    path, ds = locomo
    files = sorted(path.glob("*.json"))[:2]
    samples = []
    for f in files:
        raw = json.loads(f.read_text())
        conv = {k: v for k, v in raw.items() if k != "qa"}
        samples.append({"sample_id": f.stem, "conversation": conv, "qa": raw["qa"]})
    single = load_locomo(_write(tmp_path / "locomo10.json", samples))
    assert single.users == ds.users[:2]
    per_file = load_locomo(path / files[0].name)
    assert per_file.users == ds.users[:1]


# --------------------------------------------------------------------------- LoCoMo (tiny, tmp_path)
def test_locomo_unresolved_evidence_skipped_and_counted(tmp_path):
    ds = load_locomo(_write(tmp_path / "7.json", _tiny_conv()))
    (user,) = ds.users
    assert user.id == "7"
    qs = {q.id: q for q in user.queries}
    assert sorted(qs) == ["q0", "q2", "q3", "q4"]         # q1 and q5 have no resolvable evidence
    assert ds.stats["skipped_unresolved"] == 2
    assert ds.stats["questions"] == 4
    assert ds.stats["per_category"] == {"1": 1, "3": 1, "4": 1, "5": 1}
    assert qs["q2"].gold_turn_ids == ("D2:1",) and qs["q2"].answer == "3"
    assert qs["q3"].gold_turn_ids == ("D1:1", "D2:1", "D2:2", "D1:2")
    assert qs["q4"].category == "5" and qs["q4"].answer == "no"
    t = {t.id: t.text for t in user.turns}
    assert t["D1:1"] == "Ann: I adopted a cat."
    assert t["D1:2"] == "Bob: Look at this! [shares a photo of a red kite]"
    assert t["D2:2"] == "Bob: Nice name. [shares a photo of sunset over a lake]"


def test_locomo_directory_sorted_and_ignores_non_json(tmp_path):
    a, b = _tiny_conv(), _tiny_conv()
    b["qa"] = b["qa"][:1]
    _write(tmp_path / "b.json", a)
    _write(tmp_path / "a.json", b)
    (tmp_path / "NOTICE").write_text("not data")
    ds = load_locomo(tmp_path)
    assert [u.id for u in ds.users] == ["a", "b"]
    assert [len(u.queries) for u in ds.users] == [1, 4]


def test_locomo10_tiny_equals_per_file(tmp_path):
    conv = _tiny_conv()
    (tmp_path / "dir").mkdir()
    _write(tmp_path / "dir" / "x1.json", conv)
    sample = {"sample_id": "x1", "conversation": {k: v for k, v in conv.items() if k != "qa"}, "qa": conv["qa"]}
    single = load_locomo(_write(tmp_path / "locomo10.json", [sample]))
    per_file = load_locomo(tmp_path / "dir")
    assert single.users == per_file.users
    assert single.stats == per_file.stats


@pytest.mark.parametrize("mutate, where", [
    (lambda c: c.pop("qa"), "key 'qa'"),
    (lambda c: c["session_1"][0].pop("text"), "key 'session_1[0].text'"),
    (lambda c: c["session_2"][1].update(dia_id=5), "key 'session_2[1].dia_id'"),
    (lambda c: c.update(session_2="oops"), "key 'session_2'"),
    (lambda c: c["qa"][3].update(evidence="D1:1"), "key 'qa[3].evidence'"),
    (lambda c: c["qa"][0].pop("question"), "key 'qa[0].question'"),
    (lambda c: c["session_2"][0].update(dia_id="D1:1"), "key 'session_2[0].dia_id'"),
])
def test_locomo_bad_record_names_file_and_key(tmp_path, mutate, where):
    conv = _tiny_conv()
    mutate(conv)
    f = _write(tmp_path / "c.json", conv)
    with pytest.raises(InputError) as e:
        load_locomo(f)
    assert str(f) in str(e.value) and where in str(e.value)
    assert "\n" not in str(e.value)


def test_locomo10_bad_sample_names_key(tmp_path):
    f = _write(tmp_path / "locomo10.json", [{"conversation": {}, "qa": []}])
    with pytest.raises(InputError, match=r"key '\[0\]\.sample_id'"):
        load_locomo(f)


def test_bad_files_raise_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_locomo(tmp_path / "missing.json")
    with pytest.raises(InputError, match="no .json files"):
        load_locomo(tmp_path)
    (tmp_path / "empty.json").write_text("  \n")
    with pytest.raises(InputError, match="empty file"):
        load_locomo(tmp_path / "empty.json")
    (tmp_path / "bad.json").write_text('{\n  "qa": [\n    {"question": }\n  ]\n}\n')
    with pytest.raises(InputError, match=re.escape(f"{tmp_path / 'bad.json'}:3: invalid JSON")):
        load_locomo(tmp_path / "bad.json")
    (tmp_path / "num.json").write_text("3")
    with pytest.raises(InputError, match="top level"):
        load_locomo(tmp_path / "num.json")
    with pytest.raises(InputError, match="is a directory"):
        load_longmemeval(tmp_path)


def test_duplicate_user_ids_rejected(tmp_path):
    conv = _tiny_conv()
    _write(tmp_path / "a.json", [{"sample_id": "b", "conversation": conv, "qa": []}])
    _write(tmp_path / "b.json", conv)
    with pytest.raises(InputError, match="user id 'b'"):
        load_locomo(tmp_path)


# --------------------------------------------------------------------------- LongMemEval
def test_longmemeval_turn_level():
    ds = load_longmemeval(FIXTURE)
    raw = json.loads(FIXTURE.read_text())
    assert [u.id for u in ds.users] == [r["question_id"] for r in raw]
    assert ds.stats["questions"] == 3 and ds.stats["abstention"] == 1
    assert ds.stats["per_category"] == {"multi-session": 1, "single-session-user": 2}
    by_id = {u.id: u for u in ds.users}
    u = by_id["gpt4_2655b836"]
    (q,) = u.queries
    assert q.gold_turn_ids == ("answer_aa01_1:0", "answer_aa01_2:2")
    assert q.gold_session_ids == ("answer_aa01_1", "answer_aa01_2")
    assert q.category == "multi-session" and q.answer == "5" and q.date == "2023/06/12 (Mon) 09:00"
    assert not q.abstention and by_id["e47becba_abs"].queries[0].abstention
    assert [s.id for s in u.sessions] == raw[1]["haystack_session_ids"]
    assert [s.timestamp for s in u.sessions] == raw[1]["haystack_dates"]
    t = u.sessions[0].turns[1]
    assert t.id == "answer_aa01_1:1" and t.speaker == "assistant"
    assert t.text == "assistant: " + raw[1]["haystack_sessions"][0][1]["content"]
    assert len(u.turns) == sum(len(s) for s in raw[1]["haystack_sessions"])


def test_longmemeval_session_level_gold_is_all_turns_of_answer_sessions():
    turn = load_longmemeval(FIXTURE, gold_level="turn")
    sess = load_longmemeval(FIXTURE, gold_level="session")
    assert sess.stats["gold_level"] == "session"
    for ut, us in zip(turn.users, sess.users):
        qt, qs = ut.queries[0], us.queries[0]
        assert qs.gold_session_ids == qt.gold_session_ids
        assert qs.gold_turn_ids == tuple(t.id for t in us.turns if t.session_id in qs.gold_session_ids)
        assert set(qt.gold_turn_ids) < set(qs.gold_turn_ids)


@pytest.mark.parametrize("mutate, where", [
    (lambda r: r[0].pop("question"), "key '[0].question'"),
    (lambda r: r[1]["haystack_sessions"][2][0].pop("content"), "key '[1].haystack_sessions[2][0].content'"),
    (lambda r: r[1]["haystack_dates"].pop(), "key '[1].haystack_sessions'"),
    (lambda r: r[0]["haystack_sessions"][1][0].update(has_answer="yes"),
     "key '[0].haystack_sessions[1][0].has_answer'"),
    (lambda r: r[2].update(answer_session_ids="x"), "key '[2].answer_session_ids'"),
    (lambda r: r[2].update(question_id="e47becba"), "key '[2].question_id'"),
])
def test_longmemeval_bad_record_names_file_and_key(tmp_path, mutate, where):
    raw = json.loads(FIXTURE.read_text())
    mutate(raw)
    f = _write(tmp_path / "lme.json", raw)
    with pytest.raises(InputError) as e:
        load_longmemeval(f)
    assert str(e.value).startswith(str(f)) and where in str(e.value)


def test_longmemeval_bad_arguments(tmp_path):
    with pytest.raises(InputError, match="gold_level"):
        load_longmemeval(FIXTURE, gold_level="segment")
    with pytest.raises(InputError, match="expected a list"):
        load_longmemeval(_write(tmp_path / "obj.json", {"question_id": "x"}))


# --------------------------------------------------------------------------- synthetic
def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)
    out = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>.+?)" if p not in parts[1:i:2] else f"(?P={p})"
                  for i, p in enumerate(parts))
    return re.compile(out + "$")


def _match_any(templates, text):
    return next((m for t in templates if (m := _template_regex(t).match(text))), None)


def test_synthetic_deterministic_per_seed():
    a, b, c = make_synthetic(seed=3), make_synthetic(seed=3), make_synthetic(seed=4)
    assert a == b
    assert a.users != c.users
    assert make_synthetic(users=2, seed=3).users == a.users[:2]     # user u is independent of `users`


def test_synthetic_shape_and_gold():
    ds = make_synthetic(users=5, sessions=6, turns=10, seed=1)
    assert ds.name == "synthetic" and len(ds.users) == 5
    assert len({u.sessions[0].turns[0].speaker for u in ds.users}) == 5     # different personas
    per_session = []
    for u in ds.users:
        assert len(u.sessions) == 6 and all(len(s.turns) == 10 for s in u.sessions)
        turn = {t.id: t for t in u.turns}
        assert len(turn) == 60
        session_date = {s.id: s.timestamp for s in u.sessions}
        assert sorted(session_date.values()) == list(session_date.values())
        for q in u.queries:
            assert q.gold_turn_ids and all(g in turn for g in q.gold_turn_ids)
            assert all(turn[g].speaker != "Assistant" for g in q.gold_turn_ids)   # facts come from the user
            assert all(q.date > session_date[turn[g].session_id] for g in q.gold_turn_ids)
            assert (len(q.gold_turn_ids) == 2) == (q.category == "multi-hop")
        per_session.append(len(u.queries) / len(u.sessions))
    assert 2 <= sum(per_session) / len(per_session) <= 4
    assert set(ds.stats["per_category"]) == {"single-hop", "paraphrase", "update", "multi-hop"}
    assert ds.stats["questions"] == sum(len(u.queries) for u in ds.users)


def test_synthetic_update_queries_point_at_latest_fact():
    ds = make_synthetic(users=6, seed=2)
    n = 0
    for u in ds.users:
        turns = [t for t in u.turns if t.speaker != "Assistant"]
        said = [t.text.split(": ", 1)[1] for t in turns]
        for q in (q for q in u.queries if q.category == "update"):
            kind = next(k for k in UPDATES if _match_any(k.questions, q.text))
            (gold,) = q.gold_turn_ids
            pos = [t.id for t in turns].index(gold)
            new = _match_any(kind.new, said[pos])
            assert new and new.group("b") == q.answer
            olds = [i for i, s in enumerate(said) if _match_any(kind.old, s)]
            assert olds and max(olds) < pos                  # the superseded fact came earlier
            assert not any(_match_any(kind.new, s) for s in said[pos + 1:])   # and gold is the latest
            n += 1
    assert n >= 6


def test_synthetic_paraphrases_share_fewer_words_than_single_hop():
    def overlap(q, u):
        words = lambda s: set(re.findall(r"[a-z']+", s.lower()))  # noqa: E731
        ev = set().union(*(words(t.text) for t in u.turns if t.id in q.gold_turn_ids))
        return len(words(q.text) & ev) / len(words(q.text))
    ds = make_synthetic(seed=0)
    mean = {c: [] for c in ("single-hop", "paraphrase")}
    for u in ds.users:
        for q in u.queries:
            if q.category in mean:
                mean[q.category].append(overlap(q, u))
    assert sum(mean["paraphrase"]) / len(mean["paraphrase"]) < sum(mean["single-hop"]) / len(mean["single-hop"])


@pytest.mark.parametrize("kw", [dict(sessions=1, turns=1), dict(sessions=1, turns=2), dict(sessions=2, turns=3),
                                dict(sessions=30, turns=4)])
def test_synthetic_small_and_large_sizes(kw):
    ds = make_synthetic(users=2, **kw)
    for u in ds.users:
        assert len(u.sessions) == kw["sessions"] and all(len(s.turns) == kw["turns"] for s in u.sessions)
        ids = {t.id for t in u.turns}
        assert all(set(q.gold_turn_ids) <= ids for q in u.queries)


def test_synthetic_bad_sizes():
    with pytest.raises(InputError, match="^users: must be a positive integer"):
        make_synthetic(users=0)
    with pytest.raises(InputError, match="^turns:"):
        make_synthetic(turns=-1)
    with pytest.raises(InputError, match="^seed:"):
        make_synthetic(seed=1.5)


def test_parse_synthetic_spec():
    assert parse_synthetic_spec("users=4,sessions=3,turns=8,seed=1") == dict(users=4, sessions=3, turns=8, seed=1)
    assert parse_synthetic_spec(" seed = 0 ") == {"seed": 0}
    assert parse_synthetic_spec("") == {}
    for bad, needle in [("user=4", "unknown key 'user'"), ("users=0", "users must be positive"),
                        ("turns=-2", "turns must be positive"), ("seed=-1", "seed must be non-negative"),
                        ("sessions=x", "sessions must be an integer, got 'x'"), ("users", "expected key=value"),
                        ("users=1,users=2", "key 'users' given twice")]:
        with pytest.raises(InputError, match=re.escape(needle)):
            parse_synthetic_spec(bad)


# --------------------------------------------------------------------------- SPEC strings
def test_load_spec_schemes(tmp_path):
    ds = load_spec("synthetic:users=2,sessions=2,turns=4,seed=5")
    assert ds == make_synthetic(users=2, sessions=2, turns=4, seed=5)
    assert len(load_spec("synthetic").users) == 8
    assert load_spec(f"longmemeval:{FIXTURE}").stats["gold_level"] == "turn"
    sess = load_spec(f"longmemeval:{FIXTURE}@session")
    assert sess == load_longmemeval(FIXTURE, gold_level="session")
    _write(tmp_path / "9.json", _tiny_conv())
    assert load_spec(f"locomo:{tmp_path}") == load_locomo(tmp_path)
    at_dir = tmp_path / "a@b"
    at_dir.mkdir()
    lme = at_dir / "x@session.json"
    lme.write_text(FIXTURE.read_text())
    assert load_spec(f"longmemeval:{lme}").stats["gold_level"] == "turn"


@pytest.mark.parametrize("spec, needle", [
    ("lcomo:/x", "unknown dataset scheme 'lcomo'"), ("", "empty dataset SPEC"), ("locomo:", "missing path"),
    ("longmemeval:@session", "missing path"), ("synthetic:users=0", "users must be positive"),
])
def test_load_spec_bad(spec, needle):
    with pytest.raises(InputError, match=re.escape(needle)):
        load_spec(spec)


@pytest.mark.parametrize("spec", [Path("synthetic"), Path("jsonl:/x.jsonl"), None, 3])
def test_load_spec_says_spec_is_a_str_naming_the_argument(spec):
    """load_spec(Path("synthetic")) said "empty dataset SPEC" of a non-empty spec: a SPEC is a
    str, scheme first (a path has none), and the error names the argument and what it got."""
    with pytest.raises(InputError, match=r"^spec: expected a SPEC str, scheme first .*, got " + type(spec).__name__):
        load_spec(spec)


def test_load_spec_mistyped_gold_level_says_so():
    """`longmemeval:FILE@sessions` (a typo of @session) said "FILE@sessions: no such file" of a file
    that exists; it names the level and the ones there are."""
    with pytest.raises(InputError, match=re.escape("unknown gold level 'sessions' after '@' (expected turn or "
                                                   "session)")):
        load_spec(f"longmemeval:{FIXTURE}@sessions")


def test_load_spec_missing_path_names_path(tmp_path):
    missing = tmp_path / "nope.json"
    for spec in (f"locomo:{missing}", f"longmemeval:{missing}@session"):
        with pytest.raises(InputError, match=re.escape(str(missing))):
            load_spec(spec)


def test_gold_matrix_session_level_on_tiny_locomo(tmp_path):
    """Session memories are gold iff they hold a gold turn (no embeddings needed)."""
    from rmm_jax.data import build_memories
    (user,) = load_locomo(_write(tmp_path / "1.json", _tiny_conv())).users
    mems = build_memories(user, "session")
    g = gold_matrix(user.queries, mems)
    expected = [[any(t in m.turn_ids for t in q.gold_turn_ids) for m in mems] for q in user.queries]
    assert g.tolist() == expected
    assert Counter(map(tuple, g.tolist()))[(True, True)] >= 1


def test_from_python_a_jsonl_only_argument_names_the_argument():
    """load_spec("synthetic:...", skip_invalid=True) said "--skip-invalid:", the option of
    `rmm-jax embed`, to a Python caller; it names the argument (embed still says
    --skip-invalid, --keep-roles)."""
    from rmm_jax.data import load_spec
    from rmm_jax.errors import InputError

    for kw, name in (({"skip_invalid": True}, "skip_invalid"), ({"keep_roles": ("system",)}, "keep_roles")):
        with pytest.raises(InputError, match=rf"^{name}: applies to jsonl: datasets only, not synthetic:$"):
            load_spec("synthetic:users=1", **kw)
