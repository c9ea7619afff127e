"""Names that moved keep their old import path for a while: each old path gives the new
module's very object, after a DeprecationWarning that names where it lives now."""
import importlib

import pytest

MOVED = [
    ("rmm_jax.data.citations", "parse_citations", "rmm_jax.data.prompt"),
    ("rmm_jax.data.citations", "format_prompt", "rmm_jax.data.prompt"),
    ("rmm_jax.data.citations", "RMM_PROMPT_TEMPLATE", "rmm_jax.data.prompt"),
    ("rmm_jax.data.citations", "NO_CITE", "rmm_jax.data.prompt"),
    ("rmm_jax.data.jsonl", "load_log_dataset", "rmm_jax.data.log_dataset"),
    ("rmm_jax.data.jsonl", "parse_log_spec", "rmm_jax.data.log_dataset"),
    ("rmm_jax.data.store_append", "append_store", "rmm_jax.data.store"),
    ("rmm_jax.data.store_append", "check_model", "rmm_jax.data.store"),
    ("rmm_jax.data.store_append", "APPENDABLE", "rmm_jax.data.store"),
    ("rmm_jax.online.run", "precision_recall_oracle", "rmm_jax.data.citations"),
]


@pytest.mark.parametrize("old, name, new", MOVED)
def test_an_old_path_warns_and_gives_the_new_object(old, name, new):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} moved to {new}\.{name}: import it from there"):
        got = getattr(module, name)
    assert got is getattr(importlib.import_module(new), name)


def test_from_import_of_a_moved_name_works_and_warns():
    with pytest.warns(DeprecationWarning, match="rmm_jax.data.store.append_store"):
        from rmm_jax.data.store_append import append_store
    from rmm_jax.data.store import append_store as new
    assert append_store is new


@pytest.mark.parametrize("old", sorted({m[0] for m in MOVED}))
def test_a_name_that_never_was_there_is_still_an_attribute_error(old):
    with pytest.raises(AttributeError, match=f"module '{old}' has no attribute 'nothing_here'"):
        getattr(importlib.import_module(old), "nothing_here")


def test_the_table_covers_every_moved_name():
    """Every module of rmm_jax that serves moved names (a ``deprecated.moved`` ``__getattr__``)
    serves exactly the names MOVED lists for it, so each old path above is tested."""
    import pkgutil

    import rmm_jax

    served = set()
    for info in pkgutil.walk_packages(rmm_jax.__path__, "rmm_jax."):
        hook = getattr(importlib.import_module(info.name), "__getattr__", None)
        for name, new in getattr(hook, "moved", {}).items():
            served.add((info.name, name, new))
    assert served == set(MOVED)



def test_write_store_and_append_store_take_log_as_the_old_name_of_progress(tmp_path):
    """write_store's and append_store's progress line came through ``log=``, now ``progress=``
    (a progress line as the write goes, not a log): ``log=`` still works, warning."""
    from conftest import FakeEmbedder

    from rmm_jax.data import make_synthetic
    from rmm_jax.data.store import append_store, write_store

    data, lines = make_synthetic(users=2, sessions=2, turns=4, seed=0), []
    with pytest.warns(DeprecationWarning, match=r"^write_store\(log=\.\.\.\) is now write_store\(progress=\.\.\.\)"):
        write_store(tmp_path / "s", data, "turn", FakeEmbedder(8), log=lines.append)
    with pytest.warns(DeprecationWarning, match=r"^append_store\(log=\.\.\.\) is now append_store\(progress="):
        append_store(tmp_path / "s", data, FakeEmbedder(8), log=lines.append)
    assert lines[0].startswith("2 users, ") and lines[1].startswith("new: 0 users"), lines
    with pytest.raises(TypeError, match="got progress= and its old name log="):
        write_store(tmp_path / "t", data, "turn", FakeEmbedder(8), log=print, progress=print)


def test_a_read_reports_old_dict_ways_work_and_warn(tmp_path):
    """A log's read report was a dict, filled in place through a ``report=`` parameter: the
    parameter still fills a dict and indexing the ReadReport by key still works, each with a
    DeprecationWarning that says what to use instead."""
    import json

    from rmm_jax.data.citation_log import iter_log, iter_numbered, iter_user_chunks, read_log

    path = tmp_path / "calls.jsonl"
    rec = {"user_id": "u", "query_id": "q", "candidates": ["a", "b"], "selected": ["a"], "cited": ["a"]}
    path.write_text(json.dumps(rec) + "\n{\n")
    for fn in (iter_log, iter_numbered, lambda p, **kw: iter_user_chunks(p, 1, **kw)):
        rep = {"stale": 1}
        with pytest.warns(DeprecationWarning, match=r"\(report=\.\.\.\) is deprecated: read the returned iterator's"):
            reading = fn(path, skip_invalid=True, report=rep)
        assert len(list(reading)) == 1
        assert rep["records"] == 1 and rep["skipped"] == 1 and rep["first_errors"][0].startswith(f"{path}:2")
    _, report = read_log(path, skip_invalid=True)
    with pytest.warns(DeprecationWarning, match=r"report\['skipped'\] is deprecated: .* use report\.skipped"):
        assert report["skipped"] == 1
    # `"skipped" in report` of the dict was False without a word (a tuple's `in` looks at its values)
    with pytest.warns(DeprecationWarning, match=r"^'skipped' in report is deprecated: .* \(report\.skipped\)$"):
        assert "skipped" in report
    assert "absent" not in report and 1 in report       # not a field: a tuple's `in`, as before
    assert report[1] == 1 and report.skipped_line().startswith("skipped 1 invalid records of 2; first: ")


def test_a_log_scans_old_dict_keys_work_and_warn(tmp_path):
    """scan_log returned a dict (the read report's keys flat among its own): indexing its
    LogScan by those keys still works, with a DeprecationWarning naming the attribute."""
    import json

    from rmm_jax.core.config import Layout
    from rmm_jax.online.streams import scan_log

    path = tmp_path / "calls.jsonl"
    rec = {"user_id": "u", "query_id": "q", "candidates": ["a", "b"], "selected": ["a"], "cited": ["a"]}
    path.write_text(json.dumps(rec) + "\n{\n")
    scan = scan_log(path, Layout(k=4, m=2), skip_invalid=True)
    assert scan.read.records == 1 and scan.read.skipped == 1 and scan.user_ids == ["u"] and scan.calls is None
    with pytest.warns(DeprecationWarning, match=r"\[.skipped.\] is deprecated: .* scan\.read\.skipped"):
        assert scan["skipped"] == 1
    with pytest.warns(DeprecationWarning, match=r"use scan\.user_ids"):
        assert scan["user_ids"] == ["u"]
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        scan["calls"]
