"""Tests for rmm_jax.data.citation_log: the logged-citations JSONL schema, reader and writer."""
from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rmm_jax.data.citation_log import (
    LogRecord,
    LogWriter,
    iter_log,
    iter_numbered,
    iter_user_chunks,
    read_log,
    record_to_json,
    validate_record,
    write_log,
)
from rmm_jax.errors import InputError

# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

ids = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)
finite_nonpos = st.one_of(
    st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
    st.integers(max_value=0, min_value=-(10 ** 6)),
)
timestamps = st.one_of(st.none(), st.text(max_size=10), st.integers(-(10 ** 12), 1_700_000_000),   # not after now
                       st.floats(max_value=1.7e9, allow_nan=False, allow_infinity=False))


# Cheap ids for the many-example malformed-line tests (the round trip uses ``ids``).
small_ids = st.sampled_from(["m1", "m2", "m3", "m4", "m5", "m6", "ü", 'a"b', "x\ny", "\u2028"])


@st.composite
def record_objs(draw, user_id=None, query_id=None, ids=ids):
    """A valid record as a JSON object (dict)."""
    candidates = draw(st.lists(ids, min_size=1, max_size=8, unique=True))
    selected = draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=len(candidates),
                             unique=True))
    cited = draw(st.lists(st.sampled_from(selected), max_size=len(selected), unique=True))
    obj = {
        "user_id": user_id if user_id is not None else draw(ids),
        "query_id": query_id if query_id is not None else draw(ids),
        "candidates": candidates,
        "selected": selected,
        "cited": cited,
    }
    lp = draw(st.one_of(st.none(), st.just("absent"), finite_nonpos))
    if lp != "absent":
        obj["log_prob"] = lp
    ts = draw(st.one_of(st.just("absent"), timestamps))
    if ts != "absent":
        obj["timestamp"] = ts
    if draw(st.booleans()):
        obj["extra_" + draw(st.text(max_size=3))] = draw(st.one_of(st.integers(), st.text()))
    return obj


@st.composite
def record_lists(draw, min_size=1, max_size=6, ids=ids):
    n = draw(st.integers(min_size, max_size))
    users = draw(st.lists(ids, min_size=1, max_size=3, unique=True))
    out, seen = [], set()
    for _ in range(n):
        u = draw(st.sampled_from(users))
        q = draw(ids)
        if (u, q) in seen:
            continue
        seen.add((u, q))
        out.append(draw(record_objs(user_id=u, query_id=q, ids=ids)))
    return out


def _dump(obj) -> str:
    return json.dumps(obj, allow_nan=True)


def _fresh(obj) -> str:
    """An id in none of the record's lists (longer than all of them)."""
    return "#" + "".join(obj["candidates"]) + "#"


def _other_type(draw, kind: str):
    """A JSON value that is not of ``kind`` (and not null where null means absent)."""
    pools = {
        "string": [st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                   st.lists(st.integers(), max_size=2), st.just({"a": 1})],
        "list": [st.text(max_size=3), st.integers(), st.booleans(), st.none(), st.just({"a": [1]})],
        "number": [st.text(max_size=3), st.booleans(), st.lists(st.integers(), max_size=2),
                   st.just({"x": 1})],
        "timestamp": [st.booleans(), st.lists(st.integers(), max_size=2), st.just({"x": 1})],
    }
    return draw(st.one_of(pools[kind]))


MUTATIONS = ["drop", "type", "elem_type", "empty_id", "cited_outside", "selected_outside",
             "duplicate", "empty_list", "bad_log_prob", "non_object", "broken_json",
             "bad_utf8", "dup_json_key", "bad_timestamp", "dup_pair"]


# Each mutation returns (line text or bytes, expected key or None, kind).
@st.composite
def malformed_line(draw, earlier: list[dict], kind: str):
    obj = draw(record_objs(ids=small_ids))
    if kind == "drop":
        key = draw(st.sampled_from(["user_id", "query_id", "candidates", "selected", "cited"]))
        del obj[key]
        return _dump(obj), key, kind
    if kind == "type":
        key = draw(st.sampled_from(["user_id", "query_id", "candidates", "selected", "cited",
                                    "log_prob"]))
        want = {"user_id": "string", "query_id": "string", "log_prob": "number"}.get(key, "list")
        obj[key] = _other_type(draw, want)
        return _dump(obj), key, kind
    if kind == "bad_timestamp":
        if draw(st.booleans()):
            obj["timestamp"] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        else:
            obj["timestamp"] = _other_type(draw, "timestamp")
        return _dump(obj), "timestamp", kind
    if kind == "elem_type":
        key = draw(st.sampled_from(["candidates", "selected", "cited"]))
        lst = obj[key] or []
        pos = draw(st.integers(0, len(lst)))
        obj[key] = lst[:pos] + [_other_type(draw, "string")] + lst[pos:]
        return _dump(obj), key, kind
    if kind == "empty_id":
        key = draw(st.sampled_from(["user_id", "query_id", "candidates"]))
        if key == "candidates":
            obj[key] = obj[key] + [""]
        else:
            obj[key] = ""
        return _dump(obj), key, kind
    if kind == "cited_outside":
        outside = draw(st.sampled_from(
            [c for c in obj["candidates"] if c not in obj["selected"]] + [_fresh(obj)]))
        obj["cited"] = obj["cited"] + [outside]
        return _dump(obj), "cited", kind
    if kind == "selected_outside":
        obj["selected"] = obj["selected"] + [_fresh(obj)]
        return _dump(obj), "selected", kind
    if kind == "duplicate":
        key = draw(st.sampled_from(["candidates", "selected", "cited"]))
        if key == "cited" and not obj["cited"]:
            obj["cited"] = [obj["selected"][0]]
        lst = obj[key]
        obj[key] = lst + [draw(st.sampled_from(lst))]
        return _dump(obj), key, kind
    if kind == "empty_list":
        key = draw(st.sampled_from(["candidates", "selected"]))
        obj[key] = []
        return _dump(obj), key, kind
    if kind == "bad_log_prob":
        obj["log_prob"] = draw(st.one_of(
            st.sampled_from([math.nan, math.inf, -math.inf, 1e-300, 10 ** 400, -(10 ** 400)]),
            st.floats(min_value=0.0, exclude_min=True, allow_infinity=False),
            st.integers(min_value=1)))  # -(10 ** 400) overflows float: not finite
        return _dump(obj), "log_prob", kind
    if kind == "non_object":
        value = draw(st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(),
                               st.none(), st.booleans(), st.just([obj])))
        return _dump(value), None, kind
    if kind == "broken_json":
        text = _dump(obj)
        how = draw(st.sampled_from(["truncate", "extra", "quote", "nan_word"]))
        if how == "truncate":
            text = text[:draw(st.integers(1, len(text) - 1))]
        elif how == "extra":
            text = text + draw(st.sampled_from(["}", "]", ",", "x", " {}"]))
        elif how == "quote":
            text = text.replace('"', "'", 1)
        else:
            text = text[:-1] + ', "log_prob": nan}'
        return text, None, kind
    if kind == "bad_utf8":
        return b"\xff\xfe" + _dump(obj).encode(), None, kind
    if kind == "dup_json_key":
        text = _dump(obj)
        return text[:-1] + ', "user_id": "again"}', "user_id", kind
    assert kind == "dup_pair"
    prev = draw(st.sampled_from(earlier))
    # other content (the same record exactly is a repeat, read once: test_a_line_that_repeats_...)
    obj = draw(record_objs(user_id=prev["user_id"], query_id=prev["query_id"], ids=small_ids).filter(
        lambda o: json.loads(_dump(o)) != json.loads(_dump(prev))))
    return _dump(obj), "query_id", kind


def _write_lines(path: Path, lines, blanks) -> list[int]:
    """Write ``lines`` (str or bytes) with ``blanks[i]`` blank lines before line i.

    Returns the physical line number of each line."""
    out, numbers, lineno = [], [], 0
    for line, nb in zip(lines, blanks):
        for _ in range(nb):
            out.append(b"" if nb % 2 else b"   \t")
            lineno += 1
        out.append(line if isinstance(line, bytes) else line.encode())
        lineno += 1
        numbers.append(lineno)
    path.write_bytes(b"\n".join(out) + b"\n")
    return numbers


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(record_lists())
def test_valid_records_round_trip(objs):
    recs = [validate_record(o, "<test>") for o in objs]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "log.jsonl"
        assert write_log(path, recs) == len(recs)
        got, report = read_log(path)
        assert got == recs
        assert list(iter_log(path)) == recs
        assert report._asdict() == {"records": len(recs), "skipped": 0, "first_errors": [], "notes": [], "repeated": 0}
        # The hand-written form (extra keys, nulls, int log_prob) reads the same too.
        raw = Path(d) / "raw.jsonl"
        _write_lines(raw, [json.dumps(o) for o in objs], [i % 3 for i in range(len(objs))])
        assert read_log(raw)[0] == recs
    for r, o in zip(recs, objs):
        assert record_to_json(r)["candidates"] == o["candidates"]
        assert r.log_prob is None or (isinstance(r.log_prob, float) and r.log_prob <= 0)


@pytest.mark.parametrize("kind", MUTATIONS)
# 80 examples per mutation class: 1,200 malformed files in all, each class well covered.
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_malformed_records_rejected_with_file_and_line(tmp_path_factory, kind, data):
    good = data.draw(record_lists(min_size=1 if kind == "dup_pair" else 0, max_size=4,
                                  ids=small_ids))
    before = data.draw(st.integers(1 if kind == "dup_pair" else 0, len(good)))
    bad, key, _ = data.draw(malformed_line(good[:before], kind))
    lines = ([json.dumps(o) for o in good[:before]] + [bad]
             + [json.dumps(o) for o in good[before:]])
    blanks = data.draw(st.lists(st.integers(0, 2), min_size=len(lines), max_size=len(lines)))
    path = _scratch(tmp_path_factory) / "calls-log.jsonl"
    numbers = _write_lines(path, lines, blanks)
    line = numbers[before]
    with pytest.raises(InputError) as info:
        read_log(path)
    msg = str(info.value)
    assert "calls-log.jsonl" in msg
    assert msg.startswith(f"{path}:{line}:"), (kind, msg)
    assert "\n" not in msg
    if key is not None:
        assert f"key '{key}'" in msg, (kind, msg)
    # skip_invalid: the bad line is counted and the good ones are kept.
    if good:
        recs, report = read_log(path, skip_invalid=True)
        assert report.skipped == 1 and report.records == len(good) == len(recs)
        assert report.first_errors == [msg]
    else:
        with pytest.raises(InputError, match="no records"):
            read_log(path, skip_invalid=True)


_SCRATCH: list[Path] = []


def _scratch(factory) -> Path:
    """One scratch directory for all examples (a fresh one per example is slow)."""
    if not _SCRATCH:
        _SCRATCH.append(factory.mktemp("malformed"))
    return _SCRATCH[0]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(),
                 st.lists(st.integers()),
                 st.dictionaries(st.sampled_from(["user_id", "query_id", "candidates",
                                                  "selected", "cited", "log_prob",
                                                  "timestamp"]),
                                 st.one_of(st.none(), st.booleans(), st.integers(),
                                           st.floats(), st.text(max_size=3),
                                           st.lists(st.text(max_size=2), max_size=3)))))
def test_validate_record_only_raises_input_error(obj):
    try:
        rec = validate_record(obj, "f.jsonl:3")
    except InputError as exc:
        assert str(exc).startswith("f.jsonl:3")
    else:
        assert isinstance(rec, LogRecord)


# ---------------------------------------------------------------------------
# Unit tests: one per error class
# ---------------------------------------------------------------------------

BASE = {"user_id": "u1", "query_id": "q1", "candidates": ["m1", "m2", "m3"],
        "selected": ["m2", "m1"], "cited": ["m2"], "log_prob": -0.5, "timestamp": "2023-05-01"}


def _with(**changes):
    obj = dict(BASE)
    for k, v in changes.items():
        if v is _DROP:
            obj.pop(k)
        else:
            obj[k] = v
    return obj


_DROP = object()


@pytest.mark.parametrize("obj, key, fragment", [
    (_with(user_id=_DROP), "user_id", "missing required key"),
    (_with(cited=_DROP), "cited", "missing required key"),
    (_with(user_id=7), "user_id", "must be a string, got number"),
    (_with(query_id=None), "query_id", "a record names its call by 'call_id', 'query_id' or the 'query' text"),
    (_with(query_id=""), "query_id", "non-empty"),
    (_with(candidates="m1"), "candidates", "must be a list of strings, got string"),
    (_with(candidates=["m1", 2]), "candidates", "item 1 must be a string, got number"),
    (_with(selected=[True]), "selected", "item 0 must be a string, got boolean"),
    (_with(candidates=[]), "candidates", "non-empty list"),
    (_with(selected=[]), "selected", "non-empty list"),
    (_with(candidates=["m1", "m2", "m1"]), "candidates", "duplicate id 'm1'"),
    (_with(selected=["m2", "m2"]), "selected", "duplicate id 'm2'"),
    (_with(cited=["m2", "m2"]), "cited", "duplicate id 'm2'"),
    (_with(selected=["m2", "m9"]), "selected", "id 'm9' is not in 'candidates'"),
    (_with(cited=["m3"]), "cited", "id 'm3' is not in 'selected'"),
    (_with(log_prob=True), "log_prob", "must be a number, got boolean"),
    (_with(log_prob="-1"), "log_prob", "must be a number, got string"),
    (_with(log_prob=math.nan), "log_prob", "must be finite"),
    (_with(log_prob=-math.inf), "log_prob", "must be finite"),
    (_with(log_prob=-(10 ** 400)), "log_prob", "must be finite"),
    (_with(log_prob=0.25), "log_prob", "must be <= 0"),
    (_with(log_prob=3), "log_prob", "must be <= 0"),
    (_with(timestamp=False), "timestamp", "string or a number"),
    (_with(timestamp=[1]), "timestamp", "string or a number"),
    (_with(timestamp=math.inf), "timestamp", "must be finite"),
    (_with(timestamp=10 ** 400), "timestamp", "must be finite"),     # an int float() cannot hold
])
def test_error_messages_name_file_line_and_key(tmp_path, obj, key, fragment):
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(_with(query_id="q0")) + "\n\n" + json.dumps(obj) + "\n")
    with pytest.raises(InputError) as info:
        read_log(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: key '{key}': "), msg
    assert fragment in msg
    assert info.value.where == f"{path}:3: key '{key}'"


@pytest.mark.parametrize("line, fragment", [
    ("[1, 2]", "expected a JSON object, got list"),
    ("\"text\"", "expected a JSON object, got string"),
    ("null", "expected a JSON object, got null"),
    ("{\"user_id\": ", "invalid JSON ("),
    ("{\"a\": 1} x", "invalid JSON (Extra data"),
    ("1" * 5000, "invalid JSON ("),
    ("[" * 100_000 + "]" * 100_000, "invalid JSON ("),
])
def test_line_level_errors(tmp_path, line, fragment):
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(BASE) + "\n" + line + "\n")
    with pytest.raises(InputError) as info:
        read_log(path)
    assert str(info.value).startswith(f"{path}:2: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize("end", ["\n", "\r\n", ""])
def test_an_invalid_json_line_is_located_by_its_own_column_in_plain_words(tmp_path, end):
    """The column is on the bad line (the line was parsed with its newline, so an object
    missing its '}' was placed at column 1 of the next), and an unterminated string reads
    "starting at column N" (was "starting at at column N")."""
    path = tmp_path / "calls.jsonl"
    line = json.dumps(BASE)
    for bad, msg in ((line[:-1], f"Expecting ',' delimiter at column {len(line)}"),
                     (line[:20], "Unterminated string starting at column 19")):
        assert line[18] == "\"" and "\"" not in line[19:20]     # the string the cut leaves open
        path.write_text(line + "\n" + bad + end)
        with pytest.raises(InputError) as info:
            read_log(path)
        assert str(info.value) == f"{path}:2: invalid JSON ({msg})"


def test_invalid_utf8_and_bom_and_crlf(tmp_path):
    path = tmp_path / "calls.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(BASE).encode() + b"\r\n"
                     + json.dumps(_with(query_id="q2")).encode() + b"\r\n")
    recs, _ = read_log(path)
    assert [r.query_id for r in recs] == ["q1", "q2"]
    path.write_bytes(json.dumps(BASE).encode() + b"\n\xff{}\n")
    with pytest.raises(InputError, match=r":2: invalid UTF-8"):
        read_log(path)


def test_repeated_json_key(tmp_path):
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(BASE)[:-1] + ', "cited": []}\n')
    with pytest.raises(InputError, match=r":1: key 'cited': key repeated"):
        read_log(path)


def test_duplicate_pair(tmp_path):
    path = tmp_path / "calls.jsonl"
    path.write_text("\n".join([json.dumps(BASE), json.dumps(_with(query_id="q2")),
                               json.dumps(_with(cited=[]))]) + "\n")
    with pytest.raises(InputError) as info:
        read_log(path)
    assert str(info.value) == (f"{path}:3: key 'query_id': duplicate (user_id, query_id) "
                               "('u1', 'q1'), first logged at line 1 with other content")
    # Same query id for another user is fine.
    path.write_text(json.dumps(BASE) + "\n" + json.dumps(_with(user_id="u2")) + "\n")
    assert len(read_log(path)[0]) == 2


def test_a_line_that_repeats_a_record_exactly_is_read_once_and_noted(tmp_path):
    """A log delivered at least once (or a day's file appended to itself) repeats records
    exactly; each was refused as a duplicate call, so the whole day could not be replayed or
    evaluated (with --skip-invalid: 'skipped 8 invalid records'). A record repeated exactly,
    its keys in any order, is read once, counted and noted; the same call with other content
    is still an error, also with the repeats before it."""
    path = tmp_path / "calls.jsonl"
    other = _with(query_id="q2")
    again = json.dumps(dict(reversed(list(BASE.items()))))        # the same object, keys in another order
    path.write_text("\n".join([json.dumps(BASE), json.dumps(other), json.dumps(BASE), json.dumps(other), again])
                    + "\n")
    for grouped in (False, True):
        reading = iter_numbered(path, grouped=grouped)
        assert [(n, r.query_id) for n, r in reading] == [(1, "q1"), (2, "q2")]
        assert reading.report.records == 2 and reading.report.repeated == 3 and reading.report.skipped == 0
        assert reading.report.notes == [f"3 lines of {path} repeat an earlier record exactly (first: line 3, as "
                                        "line 1): each call is read once (if they were separate calls, give each its "
                                        "own call_id)"]
    path.write_text("\n".join([json.dumps(BASE), json.dumps(BASE), json.dumps(_with(cited=[]))]) + "\n")
    with pytest.raises(InputError, match=r":3: key 'query_id': duplicate .* first logged at line 1 with other "):
        read_log(path)


def test_extra_keys_ignored_and_nulls_absent(tmp_path):
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(_with(answer="Paris", log_prob=None, timestamp=None)) + "\n")
    (rec,), _ = read_log(path)
    assert rec == LogRecord("u1", "q1", ("m1", "m2", "m3"), ("m2", "m1"), ("m2",))
    assert record_to_json(rec) == {k: BASE[k] for k in
                                   ("user_id", "query_id", "candidates", "selected", "cited")}
    rec = validate_record(_with(log_prob=-3))  # ints are fine, stored as float
    assert rec.log_prob == -3.0 and isinstance(rec.log_prob, float)


def test_empty_missing_and_directory(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match=r"empty.jsonl: no records"):
        read_log(empty)
    empty.write_text("\n  \n\t\n")
    with pytest.raises(InputError, match=r"empty.jsonl: no records"):
        read_log(empty)
    with pytest.raises(InputError, match="file not found"):
        read_log(tmp_path / "missing.jsonl")
    with pytest.raises(InputError, match="directory"):
        read_log(tmp_path)


@pytest.mark.parametrize("path", [None, 2.5, ["calls.jsonl"]])   # an int was read as a file descriptor
def test_a_path_that_is_not_a_str_or_pathlike_names_path(path):
    """read_log(None) was a TypeError from open() ("expected str, bytes or os.PathLike object")."""
    for read in (read_log, lambda p: list(iter_log(p)), lambda p: list(iter_user_chunks(p, 1))):
        with pytest.raises(InputError, match=r"^path: expected the log's path \(a str or os\.PathLike\), got "
                                             + type(path).__name__):
            read(path)


def test_skip_invalid_counts_and_caps_first_errors(tmp_path):
    path = tmp_path / "calls.jsonl"
    lines = [json.dumps(_with(query_id=f"q{i}")) for i in range(3)]
    bad = ["{", "[]", json.dumps(_with(query_id="x", cited=["m3"])), "7",
           json.dumps(_with(query_id="q0", cited=[])), json.dumps(_with(query_id="y", log_prob=1)),
           "null"]
    path.write_text("\n".join(lines[:1] + bad + lines[1:]) + "\n")
    recs, report = read_log(path, skip_invalid=True)
    assert [r.query_id for r in recs] == ["q0", "q1", "q2"]
    assert report.records == 3 and report.skipped == 7
    assert len(report.first_errors) == 5
    assert report.first_errors[0].startswith(f"{path}:2: invalid JSON")
    assert report.first_errors[2].startswith(f"{path}:4: key 'cited'")
    assert report.first_errors[4].startswith(f"{path}:6: key 'query_id': duplicate")
    # iter_log's iterator carries the report of what it has read.
    reading = iter_log(path, skip_invalid=True)
    assert len(list(reading)) == 3
    assert reading.report.skipped == 7 and reading.report.records == 3
    assert reading.report.skipped_line() == f"skipped 7 invalid records of 10; first: {report.first_errors[0]}"
    # All invalid -> no records.
    path.write_text("{\n[]\n")
    with pytest.raises(InputError, match=r"no records \(2 invalid lines skipped; first: "):
        read_log(path, skip_invalid=True)


@pytest.mark.parametrize("stamp,hint", [(1735689600000, "(did you write milliseconds?)"),
                                        ("2099-01-01T00:00:00Z", "(a clock set ahead, or a wrong year?)")])
def test_a_call_from_the_future_is_refused_naming_its_line(tmp_path, stamp, hint):
    """A timestamp after now (epoch milliseconds read as seconds, a year 2099) was taken as it
    was: its user's horizon moved past every later call, which replay then skipped as older
    than what the user had learned, never to be learned. It is one line naming FILE:LINE, or
    skipped and counted with skip_invalid; an hour ahead (clocks disagree) is read."""
    path = tmp_path / "calls.jsonl"
    now = time.time()
    recs = [_with(query_id="q0", timestamp=now + 3600), _with(query_id="q1", timestamp=stamp),
            _with(query_id="q2", timestamp=now - 60)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(InputError) as e:
        read_log(path)
    assert str(e.value).startswith(f"{path}:2: key 'timestamp': its time ") and " is after now (" in str(e.value)
    assert str(e.value).endswith(f"; times are seconds since the epoch or ISO 8601 dates {hint}"), str(e.value)
    got, report = read_log(path, skip_invalid=True)
    assert [r.query_id for r in got] == ["q0", "q2"] and report.skipped == 1


def test_a_log_is_checked_against_one_reading_of_the_clock(tmp_path, monkeypatch):
    """Each record's timestamp check read the clock (time.time) again: a log of N timed
    records read it N times. A read of the log (and a write of records) reads it once."""
    path = tmp_path / "calls.jsonl"
    now = time.time()
    recs = [_with(query_id=f"q{i}", timestamp=now - 60 * i) for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    reads = []
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: reads.append(1) or real_time())
    got, _ = read_log(path)
    assert len(got) == 5 and len(reads) == 1, len(reads)
    reads.clear()
    write_log(tmp_path / "out.jsonl", recs)
    assert len(reads) == 1, len(reads)

def test_an_unknown_key_that_looks_misspelt_is_noted_once_naming_its_first_line(tmp_path):
    """Unknown keys are ignored (forward compatibility), so a misspelt optional key used to
    vanish silently. One close to a log key is noted, once per key, at the first line of a
    valid record that has it; other extra keys (a logger's own, rerank's scores) are not."""
    path = tmp_path / "log.jsonl"
    extra = {"answer": "Lisbon", "model": "gpt", "latency_ms": 120, "scores": [0.5], "positions": [1, 0]}
    lines = [_with(**extra),
             {**_with(query_id="q2"), "timestmap": "2023-05-02"},
             {**_with(query_id="q3", log_prob=_DROP), "timestmap": "2023-05-03", "log_porb": -0.5},
             {**_with(query_id="q4"), "Cited": ["m2"], "log_porb": -0.5, "timestmap": 1}]
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    records, report = read_log(path)
    assert len(records) == 4 and records[1].timestamp == "2023-05-01" and records[2].log_prob is None   # ignored
    assert report.notes == [
        f"{path}:2: key 'timestmap' is not a log key and was ignored (did you mean 'timestamp'?)",
        f"{path}:3: key 'log_porb' is not a log key and was ignored (did you mean 'log_prob'?)",
        f"{path}:4: key 'Cited' is not a log key and was ignored (did you mean 'cited'?)"]
    # a skipped record's keys are not noted: the first valid record that has the key is
    path.write_text(json.dumps({**_with(cited=["zz"]), "timestmap": 0}) + "\n"
                    + json.dumps({**_with(query_id="q2"), "timestmap": 0}) + "\n")
    _, report = read_log(path, skip_invalid=True)
    assert report.skipped == 1 and report.notes == [
        f"{path}:2: key 'timestmap' is not a log key and was ignored (did you mean 'timestamp'?)"]



def test_a_log_key_with_an_id_or_text_suffix_is_noted_unless_the_record_has_the_key(tmp_path):
    """A logger's own name for a log key (gold_ids, query_text, cited_ids) is too far from it
    for a ratio (gold_ids to gold: 0.67), so such keys vanished silently; a record that has the
    key too is not noted (a logger may keep both)."""
    path = tmp_path / "log.jsonl"
    lines = [{**_with(), "gold_ids": ["m1"], "query_text": "where?", "candidate_ids": ["m1"]},
             {**_with(query_id="q2", gold=["m1"]), "gold_id": "m1", "cited_ids": ["m1"]}]
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    _, report = read_log(path)
    assert report.notes == [
        f"{path}:1: key 'gold_ids' is not a log key and was ignored (did you mean 'gold'?)",
        f"{path}:1: key 'query_text' is not a log key and was ignored (did you mean 'query'?)"]   # not candidate_ids
    rec = {k: v for k, v in _with().items() if k != "cited"}
    path.write_text(json.dumps({**rec, "cited_ids": ["m1"]}) + "\n")
    with pytest.raises(InputError, match=r"key 'cited': missing required key \(the record has 'cited_ids'\)"):
        read_log(path)

class _Store:
    def __init__(self):
        self.users = {"u1": ({"q1", "q2"}, {"m1", "m2", "m3"}), "u2": ({"q1"}, {"m1"})}


@pytest.mark.parametrize("known", [
    _Store(), _Store().users, lambda uid: _Store().users.get(uid)])
def test_known_ids(tmp_path, known):
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(BASE) + "\n")
    assert len(read_log(path, known=known)[0]) == 1
    cases = [
        (_with(user_id="u9"), "user_id", "unknown user id 'u9'"),
        (_with(query_id="q7"), "query_id", "unknown query id 'q7' for user 'u1'"),
        (_with(candidates=["m1", "m2", "m3", "m4"]), "candidates",
         "unknown memory id 'm4' for user 'u1'"),
    ]
    for obj, key, fragment in cases:
        path.write_text(json.dumps(BASE) + "\n" + json.dumps(obj) + "\n")
        with pytest.raises(InputError) as info:
            read_log(path, known=known)
        assert str(info.value).startswith(f"{path}:2: key '{key}': {fragment} ("), str(info.value)
        recs, report = read_log(path, known=known, skip_invalid=True)
        assert len(recs) == 1 and report.skipped == 1
    # What the store lacks, the record may carry as text: a new question, a new memory, a new user.
    texts = [{"id": m, "text": f"text of {m}"} for m in ("m1", "m2", "m4")]
    carried = [_with(query_id="q7", query="a new question"), _with(candidates=texts),
               _with(user_id="u9", query="new", candidates=texts, selected=["m2", "m1"], cited=["m2"])]
    path.write_text("".join(json.dumps(o) + "\n" for o in carried))
    assert len(read_log(path, known=known)[0]) == 3
    path.write_text(json.dumps(_with(user_id="u9", query="new")) + "\n")     # ids only: unknown user
    with pytest.raises(InputError, match="unknown user id 'u9'"):
        read_log(path, known=known)


def test_a_text_for_a_stored_memory_must_be_the_stores(tmp_path):
    """A memory the store holds is read from the store, so a record that carries another text
    for its id would have that text silently ignored: with the store's texts known
    (memory ids mapped to texts, as known_ids gives them) it is an error naming the line and
    the id; the store's own text is accepted."""
    known = {"u1": ({"q1"}, {"m1": "my dog is Max", "m2": "I live in Lisbon", "m3": "peanuts"})}
    path = tmp_path / "calls.jsonl"
    same = _with(candidates=[{"id": "m1", "text": "my dog is Max"}, "m2", "m3"])
    other = _with(query_id="q2", query="new", candidates=[{"id": "m1", "text": "my cat is Tom"}, "m2", "m3"])
    path.write_text(json.dumps(same) + "\n")
    assert read_log(path, known=known)[0][0].candidate_texts == ("my dog is Max", None, None)
    path.write_text(json.dumps(BASE) + "\n" + json.dumps(other) + "\n")
    with pytest.raises(InputError) as info:
        read_log(path, known=known)
    assert str(info.value) == (f"{path}:2: key 'candidates': memory 'm1' of user 'u1': the record's text differs "
                               "from the store's memory of that id (give the store's text, or the id alone)")
    assert len(read_log(path, known={"u1": ({"q1"}, {"m1", "m2", "m3"})})[0]) == 2     # ids only: no texts to check


def test_known_ids_of_a_store_give_its_memory_texts(tmp_path):
    from conftest import make_fake_store

    from rmm_jax.data.log_vectors import known_ids
    from rmm_jax.data.store import open_store
    st = open_store(make_fake_store(tmp_path / "store", users=2, sessions=2, dim=8))
    uid = st.user_ids[0]
    query_ids, texts = known_ids(st)(uid)
    assert query_ids == frozenset(st.user(uid).query_ids)
    assert set(texts) == set(st.user(uid).memory_ids) and "nope" not in texts
    assert texts._texts is None                                        # ids alone read no text
    assert dict(texts) == {r["id"]: r["text"] for r in st.memory_rows(uid)}
    assert known_ids(st)("nobody") is None


def test_bad_known_argument(tmp_path):
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(BASE) + "\n")
    with pytest.raises(InputError, match="argument 'known'"):
        read_log(path, known=42)


def test_iter_user_chunks(tmp_path):
    path = tmp_path / "calls.jsonl"
    objs = [_with(user_id=u, query_id=q) for u, q in
            [("a", "1"), ("a", "2"), ("b", "1"), ("c", "1"), ("c", "2"), ("d", "1")]]
    path.write_text("\n".join(json.dumps(o) for o in objs) + "\n")
    chunks = list(iter_user_chunks(path, 2))
    assert [[(r.user_id, r.query_id) for r in c] for c in chunks] == [
        [("a", "1"), ("a", "2"), ("b", "1")], [("c", "1"), ("c", "2"), ("d", "1")]]
    assert [len(c) for c in iter_user_chunks(path, 10)] == [6]
    path.write_text("\n".join(json.dumps(o) for o in objs + [_with(user_id="a", query_id="3")])
                    + "\n")
    with pytest.raises(InputError, match=r":7: key 'user_id': records of user 'a' are not"):
        list(iter_user_chunks(path, 2))
    with pytest.raises(InputError, match="users_per_chunk"):
        list(iter_user_chunks(path, 0))


def test_streaming_by_user_against_a_store_holds_one_users_ids(tmp_path):
    """Read by user against ``known`` (replay's two passes), the reader held every user's
    candidate ids to the end, to count the gold ids no record of a user lists: a review
    measured 8 MB at 2,000 users and 83 MB at 20,000 (0.4 and 5.9 MB before, the set of
    finished user ids). It finishes each user as the next begins: the peak is that of a read
    without ``known``, and the count holds."""
    import tracemalloc

    def make(path, n):
        with open(path, "w") as f:
            for u in range(n):
                c = [{"id": f"mem{u}_{j}_" + "x" * 20, "text": "t"} for j in range(20)]
                gold = ["never-retrieved"] if u % 2 else [c[0]["id"]]
                f.write(json.dumps({"user_id": f"user{u}", "call_id": "c", "query": "q", "candidates": c,
                                    "selected": [c[0]["id"]], "cited": [], "gold": gold}) + "\n")

    n = 1500                # the old reader held 10 times a read without the store here
    path = tmp_path / "log.jsonl"
    make(path, n)
    peaks = {}
    for known in (None, lambda u: None):
        reading = iter_user_chunks(path, 1, known=known)
        tracemalloc.start()
        for _ in reading:
            pass
        peaks[known is None] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    note = [x for x in reading.report.notes if "no memory of the store" in x]
    assert len(note) == 1 and note[0].startswith(f"{path}: {n // 2} gold ids name no memory"), note
    assert "(first: line 2, 'never-retrieved' of user 'user1')" in note[0], note
    assert peaks[False] < 1.5 * peaks[True], peaks       # against the store: no more than without it


def test_write_log_validates_and_is_atomic(tmp_path):
    path = tmp_path / "out.jsonl"
    good = [validate_record(BASE), validate_record(_with(query_id="q2", log_prob=None))]
    assert write_log(path, good) == 2
    before = path.read_bytes()
    bad = LogRecord("u1", "q3", ("m1",), ("m1",), ("m2",))
    with pytest.raises(InputError, match=r"record 1: key 'cited'"):
        write_log(path, [good[0], bad])
    with pytest.raises(InputError, match=r"record 1: key 'log_prob': must be finite"):
        write_log(path, [good[0], LogRecord("u1", "q3", ("m1",), ("m1",), (), math.nan)])
    with pytest.raises(InputError, match=r"record 1: key 'query_id': duplicate"):
        write_log(path, [good[0], good[0]])
    with pytest.raises(InputError, match=r"record 0: expected a LogRecord"):
        write_log(path, ["nope"])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no temp leftovers
    assert read_log(path)[0] == good
    # Plain dicts are accepted (validated) too.
    write_log(path, [BASE])
    assert read_log(path)[0] == [good[0]]


def test_write_log_refuses_no_records_one_record_or_a_directory_and_writes_nothing(tmp_path):
    """write_log("w.jsonl", []) wrote an empty file that read_log refuses ("no records"),
    though a written log reads back; write_log(path, record) with one LogRecord was
    "'LogRecord' object is not iterable", with one dict "record 0: expected a LogRecord, got
    str"; a directory for path was an IsADirectoryError from the rename; LogWriter.write(dict)
    read its keys. Each is one line naming the argument, and nothing is written."""
    path = tmp_path / "w.jsonl"
    with pytest.raises(InputError, match=r"^records: holds no record; a log needs at least one"):
        write_log(path, [])
    with pytest.raises(InputError, match=r"^records: holds no record"):
        write_log(path, iter(()))
    for one, kind in ((validate_record(BASE), "LogRecord"), (dict(BASE), "dict")):
        with pytest.raises(InputError, match=rf"^records: expected a list of records, got one {kind}; pass a list "
                                             r"of records \(\[record\] for one\)$"):
            write_log(path, one)
    assert list(tmp_path.iterdir()) == []
    a_dir = tmp_path / "st"
    a_dir.mkdir()
    (a_dir / "keep.txt").write_text("kept")
    with pytest.raises(InputError, match=rf"^path {a_dir}: is a directory; give the log's file path$"):
        write_log(a_dir, [BASE])
    with pytest.raises(InputError, match=rf"^path {a_dir}: is a directory"):
        with LogWriter(a_dir):
            pass
    assert [p.name for p in a_dir.iterdir()] == ["keep.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["st"]
    with pytest.raises(InputError, match=r"^records: expected a list of records, got one dict"):
        with LogWriter(path) as log:
            log.write(dict(BASE))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["st"]


def test_log_writer_round_trip_chunk_by_chunk(tmp_path):
    path = tmp_path / "gen.jsonl"
    recs = [validate_record(_with(user_id=f"u{i // 3}", query_id=f"q{i}",
                                  log_prob=-0.5 * i if i % 2 else None)) for i in range(7)]
    with LogWriter(path) as log:
        assert log.count == 0
        log.write(recs[:3])                                   # LogRecords ...
        log.write([record_to_json(r) for r in recs[3:6]])     # ... or their JSON objects
        log([])                                               # calling it is write()
        log(recs[6:])
        assert not path.exists()                              # nothing in place before the end
    assert log.count == 7
    got, report = read_log(path)
    assert got == recs and report.records == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.jsonl"]


def test_log_writer_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "gen.jsonl"
    with pytest.raises(RuntimeError, match="boom"):
        with LogWriter(path) as log:
            log.write([BASE])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []                    # no file, no temp leftover
    # An invalid record fails the block too (naming it), and an old log stays as it was.
    write_log(path, [BASE])
    before = path.read_bytes()
    with pytest.raises(InputError, match=r"generated record 1: key 'cited'"):
        with LogWriter(path) as log:
            log.write([_with(query_id="q2"), _with(query_id="q3", cited=["m9"])])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.jsonl"]


@pytest.mark.parametrize("typo,key", [("cites", "cited"), ("Cited", "cited"), ("canidates", "candidates"),
                                      ("user-id", "user_id"), ("selectd", "selected")])
def test_a_misspelt_required_key_names_what_the_record_has(typo, key):
    rec = {"user_id": "u", "candidates": ["a", "b"], "selected": ["a"], "cited": []}
    rec[typo] = rec.pop(key)
    with pytest.raises(InputError) as e:
        validate_record(rec, "log.jsonl:3")
    assert str(e.value) == f"log.jsonl:3: key '{key}': missing required key (the record has '{typo}')"
    rec.pop(typo)                          # nothing close: the plain message
    rec["latency_ms"] = 3
    with pytest.raises(InputError) as e:
        validate_record(rec, "log.jsonl:3")
    assert str(e.value) == f"log.jsonl:3: key '{key}': missing required key"
@pytest.mark.parametrize("kw, where", [
    (dict(candidates="m1", selected=["m1"]), "candidates: must be a list of ids"),   # became ('m', '1')
    (dict(candidates=["a", "b", "c"], selected=["a"], candidate_texts=["x"]),
     "candidate_texts: has 1 texts for 3 candidates"),                               # record_to_json dropped b, c
])
def test_call_record_refuses_a_str_for_ids_or_texts_of_another_length(kw, where):
    from rmm_jax.data.citation_log import call_record
    with pytest.raises(InputError) as e:
        call_record("u1", **kw)
    assert str(e.value).startswith(where), str(e.value)
