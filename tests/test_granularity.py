"""Memory granularity: turn / session / segment memories, add-merge and gold mapping."""
from __future__ import annotations

import re
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import locomo_dir

from rmm_jax.data import (
    GRANULARITIES,
    Session,
    Topic,
    Turn,
    User,
    build_memories,
    gold_matrix,
    load_locomo,
    load_longmemeval,
    make_synthetic,
)
from rmm_jax.data.granularity import Segment, add_or_merge, split_session
from rmm_jax.errors import InputError

FIXTURE = Path(__file__).parent / "fixtures" / "longmemeval_tiny.json"


def hashed_bow(texts: list[str], dim: int = 256) -> np.ndarray:
    """A deterministic bag-of-words embedding (crc32 hashing), L2-normalised."""
    out = np.zeros((len(texts), dim), np.float32)
    for i, text in enumerate(texts):
        for w in re.findall(r"[a-z']+", text.lower()):
            out[i, zlib.crc32(w.encode()) % dim] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def topic_embed(texts: list[str]) -> np.ndarray:
    """Hand-made embeddings: text "... <topic k> ..." -> unit vector e_k (8 dims)."""
    out = np.zeros((len(texts), 8), np.float32)
    for i, t in enumerate(texts):
        out[i, int(re.search(r"<topic (\d+)>", t).group(1))] = 1.0
    return out


def _user(*sessions: list[int]) -> User:
    """A user whose session s holds turns labelled with the given topic numbers."""
    out = []
    for s, topics in enumerate(sessions, 1):
        turns = tuple(Turn(f"D{s}:{i}", f"session_{s}", "A", f"A: talk <topic {k}> {s}.{i}", f"day {s}")
                      for i, k in enumerate(topics, 1))
        out.append(Session(f"session_{s}", f"day {s}", turns))
    return User("u", tuple(out), ())


def _assert_partition(user: User, mems) -> None:
    """Every turn of the user is in exactly one memory, and nothing else is."""
    counts = Counter(t for m in mems for t in m.turn_ids)
    assert counts == Counter(t.id for t in user.turns)
    assert set(counts.values()) <= {1}


def _users() -> list[User]:
    users = list(make_synthetic(users=2, sessions=4, turns=8, seed=7).users)
    users += list(load_longmemeval(FIXTURE).users)
    return users


# --------------------------------------------------------------------------- turn / session
def test_turn_and_session_memories():
    user = make_synthetic(users=1, sessions=3, turns=6).users[0]
    turns = build_memories(user, "turn")
    assert [m.id for m in turns] == [t.id for t in user.turns]
    assert all(m.turn_ids == (m.id,) and m.text == t.text for m, t in zip(turns, user.turns))
    sessions = build_memories(user, "session")
    assert [m.id for m in sessions] == [s.id for s in user.sessions]
    s = user.sessions[1]
    assert sessions[1].text == "\n".join(t.text for t in s.turns)
    assert sessions[1].timestamp == s.timestamp and sessions[1].session_id == s.id


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_every_turn_in_exactly_one_memory(granularity):
    for user in _users():
        _assert_partition(user, build_memories(user, granularity, hashed_bow))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_gold_memory_iff_it_holds_a_gold_turn(granularity):
    for user in _users():
        mems = build_memories(user, granularity, hashed_bow, merge_threshold=0.6)
        g = gold_matrix(user.queries, mems)
        for i, q in enumerate(user.queries):
            assert g[i].tolist() == [bool(set(q.gold_turn_ids) & set(m.turn_ids)) for m in mems]
            assert g[i].any() == bool(q.gold_turn_ids)


def test_locomo_session_gold_is_union_of_turn_gold():
    ds = load_locomo(locomo_dir())
    user = min(ds.users, key=lambda u: len(u.turns))
    turns = build_memories(user, "turn")
    sessions = build_memories(user, "session")
    _assert_partition(user, turns)
    _assert_partition(user, sessions)
    g_turn, g_sess = gold_matrix(user.queries, turns), gold_matrix(user.queries, sessions)
    session_of = np.array([[t.session_id == s.id for s in sessions] for t in user.turns])   # (turns, sessions)
    assert np.array_equal(g_sess, (g_turn.astype(int) @ session_of.astype(int)) > 0)
    for i, q in enumerate(user.queries):
        gold_sessions = {t.session_id for t in user.turns if t.id in q.gold_turn_ids}
        assert {sessions[j].id for j in np.flatnonzero(g_sess[i])} == gold_sessions
    segs = build_memories(user, "segment", hashed_bow)
    _assert_partition(user, segs)
    g_seg = gold_matrix(user.queries, segs)
    assert np.array_equal(g_seg.any(1), g_turn.any(1))


# --------------------------------------------------------------------------- segmentation (i)
def test_segments_split_at_topic_changes():
    user = _user([0, 0, 1, 1, 1, 2], [3, 3])
    mems = build_memories(user, "segment", topic_embed, merge_threshold=1.0)
    assert [m.turn_ids for m in mems] == [("D1:1", "D1:2"), ("D1:3", "D1:4", "D1:5"), ("D1:6",), ("D2:1", "D2:2")]
    assert [m.id for m in mems] == ["seg0", "seg1", "seg2", "seg3"]
    assert mems[1].text == "\n".join(f"A: talk <topic 1> 1.{i}" for i in (3, 4, 5))
    assert mems[3].session_id == "session_2" and mems[3].timestamp == "day 2"


def test_split_compares_with_segment_mean_not_previous_turn():
    """A slow drift (30 degrees per turn) splits once the turn leaves the segment's mean."""
    angles = np.radians([0, 30, 60, 90])
    emb = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
    session = _user([0, 0, 0, 0]).sessions[0]
    # Adjacent cosines are all cos(30) = 0.87, so a previous-turn rule would never split at 0.8;
    # the mean of turns 0-1 lies at 15 degrees, 45 degrees from turn 2 (cos 0.71 < 0.8).
    assert split_session(session, emb, 0.8) == [[0, 1], [2, 3]]
    assert split_session(session, emb, 0.4) == [[0, 1, 2, 3]]
    assert split_session(session, emb, 1.0) == [[0], [1], [2], [3]]


# --------------------------------------------------------------------------- add / merge (ii)
def test_merge_above_threshold_add_otherwise():
    user = _user([0, 0, 1], [2, 0, 0], [1])
    merged = build_memories(user, "segment", topic_embed, merge_threshold=0.85)
    # session 2's topic-0 segment joins seg0; session 3's topic-1 turn joins seg1.
    assert [m.id for m in merged] == ["seg0", "seg1", "seg2"]
    assert merged[0].turn_ids == ("D1:1", "D1:2", "D2:2", "D2:3")
    assert merged[0].text == "\n".join(f"A: talk <topic 0> {x}" for x in ("1.1", "1.2", "2.2", "2.3"))
    assert merged[0].session_id == "session_2" and merged[0].timestamp == "day 2"   # latest contribution
    assert merged[1].turn_ids == ("D1:3", "D3:1") and merged[1].session_id == "session_3"
    assert merged[2].turn_ids == ("D2:1",)
    _assert_partition(user, merged)
    added = build_memories(user, "segment", topic_embed, merge_threshold=1.0)
    assert len(added) == 5
    _assert_partition(user, added)


def test_merge_updates_memory_embedding_to_mean_of_its_turns():
    """After a merge the memory sits at the renormalised mean of its turns.

    x and y are 35 degrees apart (cos 0.82 > 0.8: merge); their mean lies 17.5 degrees
    from each. w is 35 degrees off that mean, out of the x-y plane: cos(w, mean) = 0.82
    but cos(w, x) = cos(w, y) = 0.78, so w merges only if the memory embedding moved to
    the mean (not if it stayed at x, nor if it became y).
    """
    th, ph = np.radians(35), np.radians(35)
    x = np.array([1, 0, 0.0])
    y = np.array([np.cos(th), np.sin(th), 0.0])
    mean = (x + y) / np.linalg.norm(x + y)
    w = np.cos(ph) * mean + np.sin(ph) * np.array([0, 0, 1.0])
    vectors = {"x": x, "y": y, "w": w}
    sessions = tuple(Session(f"s{i}", f"day {i}", (Turn(f"s{i}:1", f"s{i}", "A", f"A: {v}", f"day {i}"),))
                     for i, v in enumerate("xyw"))
    user = User("u", sessions, ())

    def embed(texts):
        return np.stack([vectors[t.split()[-1]] for t in texts]).astype(np.float32)

    mems = build_memories(user, "segment", embed, merge_threshold=0.8)
    assert [m.turn_ids for m in mems] == [("s0:1", "s1:1", "s2:1")]
    assert mems[0].session_id == "s2" and mems[0].timestamp == "day 2"
    assert len(build_memories(user, "segment", embed, merge_threshold=0.83)) == 3


def _naive_add_or_merge(segments, emb_of, threshold):
    """The definition, step by step: every memory's embedding re-averaged from all its turns."""
    bank: list[list] = []     # [turn ids, session id] per memory
    for turns, session in segments:
        e = np.mean([emb_of[t] for t in turns], axis=0)
        e = e / np.linalg.norm(e)
        means = [np.mean([emb_of[t] for t in m[0]], axis=0) for m in bank]
        sims = [float(v @ e / np.linalg.norm(v)) for v in means]
        if sims and max(sims) > threshold:
            j = int(np.argmax(sims))
            bank[j][0] = bank[j][0] + [t for t in turns if t not in bank[j][0]]
            bank[j][1] = session
        else:
            bank.append([list(turns), session])
    return [(tuple(m[0]), m[1]) for m in bank]


@pytest.mark.parametrize("threshold", [0.5, 0.6, 0.7])
def test_add_or_merge_matches_the_definition_on_random_banks(threshold):
    """400 random segments of 1-4 turns around 40 topics in 16 dims (many merges, a bank
    that outgrows its first buffer), against the definition: same memories, turns, order."""
    rng = np.random.default_rng(int(threshold * 10))
    topics = rng.normal(size=(40, 16))
    emb_of, segments, sessions = {}, [], {}
    for k in range(400):
        sid = f"s{k // 5}"
        sessions.setdefault(sid, Session(sid, f"day {k // 5}", ()))
        turns = [f"t{k}.{i}" for i in range(int(rng.integers(1, 5)))]
        for t in turns:
            v = rng.normal(size=16) + 2.0 * topics[int(rng.integers(40))]
            emb_of[t] = (v / np.linalg.norm(v)).astype(np.float32)
        segments.append((turns, sid))
    got = add_or_merge([Segment(" ".join(t), sessions[s], t) for t, s in segments], emb_of, threshold)
    want = _naive_add_or_merge(segments, emb_of, threshold)
    assert 12 < len(want) < 300, len(want)          # the case merges often and adds often
    assert [(m.turn_ids, m.session_id) for m in got] == want
    assert [m.id for m in got] == [f"seg{n}" for n in range(len(want))]


# --------------------------------------------------------------------------- topic extractor
def test_topic_extractor_replaces_segmentation():
    user = _user([0, 0, 1, 1, 2], [0, 5])

    def extractor(session):
        if session.id == "session_1":
            ids = [t.id for t in session.turns]
            return [Topic("User talks about topic zero.", (ids[0], ids[1])),
                    Topic("Topic one, repeated citation.", (ids[1], ids[2], ids[3]))]   # D1:5 uncited
        return [Topic("More on topic zero.", ("D2:1",))]

    mems = build_memories(user, "segment", topic_embed, topic_extractor=extractor, merge_threshold=0.9)
    _assert_partition(user, mems)
    by_first = {m.turn_ids[0]: m for m in mems}
    assert by_first["D1:1"].text == "User talks about topic zero.\nMore on topic zero."
    assert by_first["D1:1"].turn_ids == ("D1:1", "D1:2", "D2:1")
    assert by_first["D1:3"].turn_ids == ("D1:3", "D1:4")          # D1:2 stays with the first topic
    assert by_first["D1:5"].text == "A: talk <topic 2> 1.5"       # uncited turn kept verbatim
    assert by_first["D2:2"].turn_ids == ("D2:2",)


def test_topic_extractor_bad_citation():
    user = _user([0, 1])
    with pytest.raises(InputError, match="topic_extractor.*D9:9"):
        build_memories(user, "segment", topic_embed, topic_extractor=lambda s: [Topic("x", ("D9:9",))])
    with pytest.raises(InputError, match="topic_extractor.*Topic objects"):
        build_memories(user, "segment", topic_embed, topic_extractor=lambda s: ["summary"])


# --------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("kwargs, where", [
    (dict(granularity="paragraph"), "granularity"),
    (dict(segment_threshold=1.5), "segment_threshold"),
    (dict(merge_threshold=float("nan")), "merge_threshold"),
    (dict(merge_threshold="high"), "merge_threshold"),
    (dict(embed_fn=None), "embed_fn"),
    (dict(embed_fn=lambda texts: np.zeros((len(texts) + 1, 4))), "embed_fn"),
    (dict(embed_fn=lambda texts: np.full((len(texts), 4), np.nan)), "embed_fn"),
    (dict(topic_extractor=42), "topic_extractor"),
])
def test_bad_arguments_name_the_argument(kwargs, where):
    args = dict(granularity="segment", embed_fn=topic_embed) | kwargs
    with pytest.raises(InputError) as e:
        build_memories(_user([0, 1]), args.pop("granularity"), args.pop("embed_fn"), **args)
    assert str(e.value).startswith(where)


def test_empty_user_and_turn_granularity_needs_no_embeddings():
    empty = User("e", (Session("s", None, ()),), ())
    for g in GRANULARITIES:
        assert build_memories(empty, g, topic_embed) == []
    assert len(build_memories(_user([0, 1]), "turn")) == 2
