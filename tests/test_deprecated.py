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
