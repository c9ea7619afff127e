"""Embedder (packaged MiniLM, disk cache) and the embedding store (write/open/validate)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FakeEmbedder
from helpers import assert_f32_close, f32_error

from rmm_jax.data import embed as E
from rmm_jax.data.store import FORMAT, UserData, is_store, open_store, store_counts, write_store
from rmm_jax.data.types import Dataset, Query, Session, Turn, User, gold_matrix
from rmm_jax.errors import InputError, worded

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("emb-cache")


@pytest.fixture(scope="module")
def embedder(cache_root):
    """One real packaged-MiniLM embedder shared by the module."""
    emb = E.Embedder(cache_dir=cache_root, progress=False)
    yield emb
    emb.close()


def count_model_calls(emb, monkeypatch):
    """Wrap the underlying model's encode; returns the list of texts it saw."""
    seen: list[str] = []
    real = emb._model.encode

    def spy(texts, *a, **kw):
        seen.extend(texts)
        return real(texts, *a, **kw)

    monkeypatch.setattr(emb._model, "encode", spy)
    return seen


def tiny_dataset() -> Dataset:
    def user(uid, n_sessions, n_turns):
        sessions = []
        for s in range(1, n_sessions + 1):
            turns = tuple(Turn(f"D{s}:{t}", f"session_{s}", "Ann" if t % 2 else "Bob",
                               f"{uid} s{s} t{t}: talk about topic {(s * 7 + t) % 5}",
                               f"day {s}") for t in range(1, n_turns + 1))
            sessions.append(Session(f"session_{s}", f"day {s}", turns))
        queries = (
            Query("q0", f"{uid}: what about topic 1?", ("D1:1",), category="1"),
            Query("q1", f"{uid}: and topic 3?", ("D1:2", "D2:3"), category="2", date="day 3"),
            Query("q2", f"{uid}: unanswerable", ("D2:1",), category="5", abstention=True),
            Query("q3", f"{uid}: evidence missing", ("D9:9",), category="2"),
        )
        return User(uid, tuple(sessions), queries)

    return Dataset("tiny", (user("alice", 2, 4), user("bob", 3, 3)), stats={"note": "hand-built"})


# --------------------------------------------------------------------------- Embedder
def assert_unit_rows(x):
    """Rows normalised in float32 (the model's x / ‖x‖), then their norms taken in float32 (NumPy):
    within the float32 bound of those two steps, which depends on x only through magnitudes."""
    unit_norm = lambda y: jnp.linalg.norm(y / jnp.linalg.norm(y, axis=1, keepdims=True), axis=1)
    assert_f32_close(np.linalg.norm(x, axis=1), 1.0, f32_error(unit_norm, x))


def test_encode_shape_norm_and_semantics(embedder):
    texts = ["I adopted a kitten last week.", "My new cat is very playful.",
             "The stock market fell sharply today.", "I adopted a kitten last week."]
    x = embedder.encode(texts)
    assert embedder.model_id == "sentence-transformers/all-MiniLM-L6-v2" and embedder.dim == 384
    assert x.shape == (4, 384) and x.dtype == np.float32
    assert_unit_rows(x)
    np.testing.assert_array_equal(x[0], x[3])
    assert x[0] @ x[1] > x[0] @ x[2] + 0.2           # cats are closer to each other
    assert embedder.encode([]).shape == (0, 384)
    with pytest.raises(InputError):
        embedder.encode("one string, not a list")
    with pytest.raises(InputError, match=r"^texts: encode expects a list of strings, got NoneType$"):
        embedder.encode(None)             # was "'NoneType' object is not iterable"


def test_cache_rerun_embeds_nothing_twice(embedder, cache_root, monkeypatch):
    seen = count_model_calls(embedder, monkeypatch)
    texts = [f"cache probe sentence number {i}" for i in range(10)]
    a = embedder.encode(texts + texts[:3])           # duplicates within a call: embedded once
    assert sorted(seen) == sorted(texts)
    seen.clear()
    b = embedder.encode(texts)
    assert seen == [] and np.array_equal(a[:10], b)
    c = embedder.encode(texts[:5] + ["one brand new sentence"])
    assert seen == ["one brand new sentence"]
    np.testing.assert_array_equal(c[:5], a[:5])
    # a second Embedder (another process would do the same) reads the same on-disk cache
    other = E.Embedder(cache_dir=cache_root, progress=False)
    seen2 = count_model_calls(other, monkeypatch)
    d = other.encode(texts)
    assert seen2 == [] and other.texts_embedded == 0
    np.testing.assert_array_equal(d, a[:10])
    db = cache_root / E.model_slug(other.model_id) / "embeddings.sqlite"
    assert db.is_file()
    other.close()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream, drawn", [(_Terminal, True), (io.StringIO, False)], ids=["terminal", "log file"])
def test_the_embedding_bar_draws_on_a_terminal_only(embedder, monkeypatch, stream, drawn):
    """A nightly replay's log once filled with the bar's carriage returns."""
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(embedder, "progress", True)
    embedder.encode([f"bar probe {drawn} {i}" for i in range(3)], desc="probe")
    assert ("\r" in err.getvalue() and "probe" in err.getvalue()) == drawn, repr(err.getvalue())


@pytest.mark.parametrize("stream, drawn", [(_Terminal, True), (io.StringIO, False)], ids=["terminal", "log file"])
@pytest.mark.parametrize("progress", [True, False], ids=["progress", "quiet"])
def test_loading_the_model_shows_one_line_where_the_bars_show(tmp_path, monkeypatch, stream, drawn, progress):
    """A first command loaded torch and the model's weights for 5-9 s with nothing on the
    screen, before any bar. The line shows where the bars do: a terminal, progress on (-q off)."""
    class Model:
        def get_embedding_dimension(self):
            return 8

    err, while_loading = stream(), []
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(E.Embedder, "_load", lambda self, load_from, given: while_loading.append(err.getvalue())
                        or Model())
    e = E.Embedder(cache_dir=tmp_path, progress=progress)    # an empty cache: the model loads now
    assert e.dim == 8 and len(while_loading) == 1
    e.close()
    line = "loading the embedding model all-MiniLM-L6-v2 ..."
    assert (line in while_loading[0]) == (drawn and progress), repr(while_loading[0])
    assert err.getvalue().count(line) <= 1


def test_model_loads_only_on_a_cache_miss(embedder, cache_root):
    texts = ["a sentence the first embedder cached", "and a second one"]
    a = embedder.encode(texts)
    warm = E.Embedder(cache_dir=cache_root, progress=False)      # the cache records the model's dim
    assert warm.dim == 384
    np.testing.assert_array_equal(warm.encode(texts), a)
    assert warm._loaded is None and warm.texts_embedded == 0     # all cached: torch and weights never loaded
    v = warm.encode(["a text nobody embedded before this test"])
    assert warm._loaded is not None and warm.texts_embedded == 1
    np.testing.assert_array_equal(v, embedder.encode(["a text nobody embedded before this test"]))
    warm.close()


def test_a_process_loads_a_model_once_keeps_a_few_and_close_frees_only_the_disk_cache(tmp_path, monkeypatch):
    """A long-running process made an Embedder per request (embed_texts) and each loaded the
    model again. Every Embedder of a model (its path, its device) now takes the one the process
    loaded; closing one closes its disk cache, not the model another uses; at most
    MODELS_KEPT models stay loaded."""
    class Model:
        def get_embedding_dimension(self):
            return 8

        def encode(self, texts, **kw):
            return FakeEmbedder(8).encode(texts)

    loads = []
    monkeypatch.setattr(E.Embedder, "_load", lambda self, load_from, given: loads.append((given, self.device))
                        or Model())
    a = E.Embedder(cache_dir=tmp_path / "a", progress=False)
    b = E.Embedder(cache_dir=tmp_path / "b", progress=False)           # another cache, the same model
    assert loads == [(E.DEFAULT_MODEL, "cpu")] and a._loaded is b._loaded
    a.close()
    assert b.encode(["still served after a closed"]).shape == (1, 8) and b.texts_embedded == 1
    b.close()
    E.Embedder(cache_dir=tmp_path / "c", progress=False, device="meta").close()      # another device: its own
    assert loads[1:] == [(E.DEFAULT_MODEL, "meta")]
    for i in range(E.MODELS_KEPT + 1):
        model = tmp_path / f"model{i}"
        model.mkdir()
        E.Embedder(str(model), cache_dir=tmp_path / "d", progress=False).close()
    assert len(E._MODELS) == E.MODELS_KEPT and len(loads) == 2 + E.MODELS_KEPT + 1


def test_threads_that_ask_for_a_model_at_once_load_it_once(tmp_path, monkeypatch):
    """A service's request threads each made an Embedder; the second to ask waits for the
    first's load instead of loading the model again beside it."""
    import threading
    import time

    class Model:
        def get_embedding_dimension(self):
            return 8

    loads = []

    def slow(self, load_from, given):
        loads.append(given)
        time.sleep(0.2)
        return Model()

    monkeypatch.setattr(E.Embedder, "_load", slow)
    got = []
    threads = [threading.Thread(target=lambda i=i: got.append(E.Embedder(cache_dir=tmp_path / str(i),
                                                                         progress=False)._loaded)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and len(got) == 4 and all(m is got[0] for m in got)


def test_a_model_once_loading_is_always_loading_or_kept(monkeypatch):
    """A thread that asked between the end of a load and the model's keeping found neither
    and loaded it again: each time the cache's lock is released, a model whose load has
    begun is either still loading or kept."""
    import threading
    key, loads = ("loader", "path", "cpu"), []

    class Spy:
        lock = threading.Lock()

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
            assert not loads or key in E._MODELS or key in E._LOADING, "neither loading nor kept"

    monkeypatch.setattr(E, "_MODELS", type(E._MODELS)())
    monkeypatch.setattr(E, "_LOADING", {})
    monkeypatch.setattr(E, "_MODELS_LOCK", Spy())
    model = E._shared_model(key, lambda: loads.append(1) or "model")
    assert model == "model" and E._shared_model(key, lambda: loads.append(1) or "other") == "model" and loads == [1]


def test_embedder_counts_the_texts_it_cuts(embedder):
    # A 12,929-character message was embedded from its first 256 word pieces, silently: a fact
    # at its end was not retrievable. The embedder counts the texts its model cut, by the
    # model's own tokenizer; a cached text is not counted again.
    assert embedder.max_tokens == 256
    before = embedder.texts_truncated
    fits, cut = "word " * 250 + "short tail", "word " * 300 + "the fact at the end"
    vecs = embedder.encode(["short", fits, cut, "word " * 300 + "another fact"])
    assert embedder.texts_truncated - before == 2
    np.testing.assert_array_equal(vecs[2], vecs[3])      # what follows the cut changes nothing
    embedder.encode([cut])
    assert embedder.texts_truncated - before == 2


def test_alias_names_map_to_packaged_model(cache_root):
    e = E.Embedder("sentence-transformers/all-MiniLM-L6-v2", cache_dir=cache_root, progress=False)
    assert e.model_id == "sentence-transformers/all-MiniLM-L6-v2"
    assert e.cache_dir == cache_root / "sentence-transformers__all-MiniLM-L6-v2"
    e.close()


def test_embed_texts_says_how_many_the_model_ran_on(monkeypatch, tmp_path):
    """What replay tells apart: texts the model embedded and texts the cache held."""
    monkeypatch.setenv("RMM_JAX_CACHE", str(tmp_path))
    first = E.embed_texts(["a cached text", "another", "a cached text"], "all-MiniLM-L6-v2")
    assert len(first) == 2 and first.embedded == 2
    again = E.embed_texts(["another", "a cached text", "one more"], "all-MiniLM-L6-v2")
    assert again.embedded == 1 and np.array_equal(again["another"], first["another"])
    assert E.embed_texts([], "all-MiniLM-L6-v2").embedded == 0


def test_default_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RMM_JAX_CACHE", str(tmp_path / "c"))
    assert E.default_cache_root() == tmp_path / "c"
    monkeypatch.delenv("RMM_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))      # as the compile cache reads it
    assert E.default_cache_root() == tmp_path / "xdg" / "rmm-jax" / "embeddings"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert E.default_cache_root() == Path.home() / ".cache" / "rmm-jax" / "embeddings"
    assert "/" not in E.model_slug("org/model") and E.model_slug("local:/a/b/m").startswith("m-")


@pytest.mark.parametrize("name", ["no-such-model-xyz", "./no/such/dir", "/nonexistent/model"])
def test_unknown_model_is_input_error_naming_it(name, tmp_path):
    with pytest.raises(InputError) as ei:
        E.Embedder(name, cache_dir=tmp_path, progress=False)
    msg = str(ei.value)
    assert msg.startswith("model:") and repr(name) in msg and "\n" not in msg   # the argument (embed: --model)


def test_nan_output_is_input_error_and_not_cached(embedder, monkeypatch):
    monkeypatch.setattr(embedder._model, "encode",
                        lambda texts, *a, **kw: np.full((len(texts), 384), np.nan, np.float32))
    with pytest.raises(InputError, match="NaN/Inf"):
        embedder.encode(["a text whose embedding is NaN"])
    monkeypatch.undo()
    seen = count_model_calls(embedder, monkeypatch)
    v = embedder.encode(["a text whose embedding is NaN"])   # nothing bad was cached
    assert seen == ["a text whose embedding is NaN"] and np.isfinite(v).all()


def test_cache_concurrent_writers(tmp_path):
    """Two processes write one cache at once; every row lands, none is corrupted."""
    code = (
        "import sys, numpy as np; from pathlib import Path; from rmm_jax.data.embed import _Cache\n"
        "c = _Cache(Path(sys.argv[1]), 'fake/m', 4); w = int(sys.argv[2])\n"
        "for i in range(40):\n"
        "    c.put([f'{w}-{i}', f'shared-{i}'], np.full((2, 4), i, np.float32))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(w)], cwd=REPO)
             for w in range(2)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    c = E._Cache(tmp_path, "fake/m", 4)
    got = c.get([f"{w}-{i}" for w in range(2) for i in range(40)] + [f"shared-{i}" for i in range(40)])
    assert len(got) == 120 and len(c) == 120
    assert all(got[f"1-{i}"][0] == i for i in range(40))
    with pytest.raises(InputError, match="belongs to model"):
        E._Cache(tmp_path, "other/model", 4)
    c.close()


# --------------------------------------------------------------------------- store
def test_write_and_open_store_roundtrip(tmp_path):
    ds = tiny_dataset()
    emb = FakeEmbedder()
    out = tmp_path / "store"
    man = write_store(out, ds, "turn", emb, spec="tiny-spec")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "memories.npy", "queries.npy", "users.json", "memories.jsonl",
         "queries.jsonl"])
    disk = json.loads((out / "manifest.json").read_text())
    assert disk == man
    assert disk["format"] == FORMAT and disk["version"] == 1 and disk["model"] == "fake/bow-16"
    assert disk["counts"] == {"users": 2, "memories": 8 + 9, "queries": 8}
    assert disk["granularity"] == "turn" and disk["dataset"] == "tiny" and disk["spec"] == "tiny-spec"
    assert disk["stats"]["note"] == "hand-built"
    assert disk["stats"]["valid_queries"] == 4 and disk["stats"]["abstention_queries"] == 2
    assert disk["stats"]["queries_without_gold_memory"] == 2

    st = open_store(out, expect_model="fake/bow-16", expect_dim=16)
    assert st.dim == 16 and st.model == "fake/bow-16" and st.user_ids == ("alice", "bob")
    assert isinstance(st.memory_emb, np.memmap) and st.memory_emb.shape == (17, 16)
    u = st.user("bob")
    assert isinstance(u, UserData)
    assert u.memory_emb.shape == (9, 16) and u.query_emb.shape == (4, 16)
    assert u.memory_ids[:2] == ("D1:1", "D1:2") and u.query_ids == ("q0", "q1", "q2", "q3")
    assert u.categories == ("1", "2", "5", "2")
    np.testing.assert_array_equal(u.abstention, [False, False, True, False])
    bob = ds.users[1]
    from rmm_jax.data.granularity import build_memories
    mems = build_memories(bob, "turn")
    np.testing.assert_array_equal(u.gold, gold_matrix(bob.queries, mems))
    np.testing.assert_array_equal(u.valid, [True, True, False, False])
    np.testing.assert_array_equal(u.num_gold, [1, 2, 1, 0])
    # the arrays are the embeddings of the texts
    np.testing.assert_array_equal(u.memory_emb, emb.encode([m.text for m in mems]))     # stored as embedded
    np.testing.assert_array_equal(u.query_emb, emb.encode([q.text for q in bob.queries]))
    rows = [json.loads(line) for line in (out / "queries.jsonl").read_text().splitlines()]
    assert rows[5] == {"user": "bob", "id": "q1", "text": "bob: and topic 3?", "category": "2",
                       "date": "day 3", "gold_turn_ids": ["D1:2", "D2:3"],
                       "gold_memory_ids": ["D1:2", "D2:3"], "abstention": False}
    mrow = json.loads((out / "memories.jsonl").read_text().splitlines()[0])
    assert set(mrow) == {"user", "id", "session_id", "timestamp", "turn_ids", "text"}
    assert json.loads((out / "users.json").read_text())[1] == {
        "id": "bob", "mem_start": 8, "mem_end": 17, "query_start": 4, "query_end": 8}
    with pytest.raises(InputError, match="unknown user id 'carol'"):
        st.user("carol")
    # an int said "unknown user id '0'" of a store whose ids are str: it says so, naming the argument
    for read in (st.user, st.memory_rows, st.query_rows):
        with pytest.raises(InputError, match=r"^user_id: user ids are str, got int 0$"):
            read(0)
    assert st.user(np.str_("bob")).user_id == "bob" and st.memory_rows("bob") == st.memory_rows(np.str_("bob"))
    assert st.query_rows("bob") == rows[4:8] and tuple(r["id"] for r in st.query_rows("bob")) == u.query_ids


def test_session_and_segment_granularity(tmp_path):
    ds = tiny_dataset()
    st = open_store(_w(tmp_path / "s", ds, "session"))
    u = st.user("alice")
    assert u.memory_ids == ("session_1", "session_2")
    np.testing.assert_array_equal(u.gold, [[1, 0], [1, 1], [0, 1], [0, 0]])
    seg = open_store(_w(tmp_path / "g", ds, "segment", segment_threshold=0.99,
                        merge_threshold=0.999))
    assert seg.granularity == "segment"
    ua = seg.user("alice")
    # threshold 0.99 on random vectors: every turn its own segment, nothing merged
    assert ua.memory_emb.shape[0] == 8 and ua.gold.sum() == 4
    assert seg.manifest["stats"]["granularity_options"] == {"segment_threshold": 0.99,
                                                           "merge_threshold": 0.999}


def _w(path, ds, gran, **kw):
    write_store(path, ds, gran, FakeEmbedder(), **kw)
    return path


def test_real_model_store(tmp_path, embedder):
    out = tmp_path / "real"
    write_store(out, tiny_dataset(), "turn", embedder)
    st = open_store(out, expect_model="sentence-transformers/all-MiniLM-L6-v2", expect_dim=384)
    # the package's own short name (rmm_jax.data.embed.DEFAULT_MODEL, the CLI's --model default) was refused
    assert open_store(out, expect_model="all-MiniLM-L6-v2").model == "sentence-transformers/all-MiniLM-L6-v2"
    u = st.user("alice")
    assert_unit_rows(np.asarray(u.memory_emb))
    np.testing.assert_array_equal(u.memory_emb[0], embedder.encode([tiny_dataset().users[0].turns[0].text])[0])


def test_failed_write_leaves_nothing(tmp_path):
    class Boom(FakeEmbedder):
        def encode(self, texts, desc=""):
            raise InputError("model exploded", where="--model")

    out = tmp_path / "store"
    with pytest.raises(InputError):
        write_store(out, tiny_dataset(), "turn", Boom())
    # no store, no temporary: only the writers' lock file, taken before the embedding (it stays, as
    # lock files do: removing one another writer waits on would let two hold it)
    assert [p.name for p in tmp_path.iterdir()] == [".store.lock"]
    # an existing store survives a failed rewrite untouched
    write_store(out, tiny_dataset(), "turn", FakeEmbedder())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InputError):
        write_store(out, tiny_dataset(), "session", Boom())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".store.lock", "store"]   # and the writers' lock file
    with pytest.raises(InputError, match="^granularity: unknown granularity"):
        write_store(tmp_path / "x", tiny_dataset(), "paragraph", FakeEmbedder())
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- validation
@pytest.fixture
def store(tmp_path):
    return _w(tmp_path / "store", tiny_dataset(), "turn")


def _edit_manifest(store, **changes):
    m = json.loads((store / "manifest.json").read_text())
    m.update(changes)
    (store / "manifest.json").write_text(json.dumps(m))


def test_open_store_rejects_missing_and_malformed(store, tmp_path):
    with pytest.raises(InputError, match="no such embedding store"):
        open_store(tmp_path / "nope")
    (store / "manifest.json").write_text("{not json")
    with pytest.raises(InputError, match=r"manifest\.json:1: invalid JSON"):
        open_store(store)
    (store / "manifest.json").unlink()
    with pytest.raises(InputError, match="missing manifest.json"):
        open_store(store)


def test_open_store_rejects_format_version_and_mismatch(tmp_path):
    s = _w(tmp_path / "a", tiny_dataset(), "turn")
    _edit_manifest(s, format="something-else")
    with pytest.raises(InputError, match="key 'format'"):
        open_store(s)
    s = _w(tmp_path / "b", tiny_dataset(), "turn")
    _edit_manifest(s, version=99)
    with pytest.raises(InputError, match="key 'version'.*version 99"):
        open_store(s)
    s = _w(tmp_path / "c", tiny_dataset(), "turn")
    with pytest.raises(InputError) as ei:
        open_store(s, expect_model="sentence-transformers/all-MiniLM-L6-v2")
    assert str(s) in str(ei.value) and "'fake/bow-16'" in str(ei.value)
    with pytest.raises(InputError, match="dim 16, expected 384"):
        open_store(s, expect_dim=384)
    _edit_manifest(s, dim=8)
    with pytest.raises(InputError, match=r"memories\.npy: shape \(17, 16\)"):
        open_store(s)


def test_open_store_names_a_path_or_expect_dim_of_the_wrong_kind(tmp_path):
    """open_store(None) was Path's TypeError, open_store(p, expect_dim="abc") int()'s raw
    ValueError ("invalid literal for int() with base 10")."""
    s = _w(tmp_path / "a", tiny_dataset(), "turn")
    for wrong in (None, 3, [str(s)]):
        with pytest.raises(InputError, match=r"^path: expected the store's directory \(a str or Path\), got "):
            open_store(wrong)
    for dim in ("abc", "16", 16.0, 0, True):
        with pytest.raises(InputError, match=r"^expect_dim: must be an int >= 1 or None, got "):
            open_store(s, expect_dim=dim)
    assert open_store(s, expect_dim=np.int64(16)).dim == 16


def test_open_store_rejects_bad_arrays(store):
    np.save(store / "memories.npy", np.zeros((5, 16), np.float32))
    with pytest.raises(InputError, match=r"memories\.npy: shape"):
        open_store(store)
    np.save(store / "memories.npy", np.zeros((17, 16), np.float64))
    with pytest.raises(InputError, match=r"memories\.npy: dtype float64"):
        open_store(store)
    np.save(store / "memories.npy", np.zeros((17, 16), np.float32))
    q = np.load(store / "queries.npy")
    q[3, 2] = np.inf
    np.save(store / "queries.npy", q)
    with pytest.raises(InputError, match=r"queries\.npy: NaN/Inf .*row 3"):
        open_store(store)
    q[3, 2] = np.nan
    np.save(store / "queries.npy", q)
    with pytest.raises(InputError, match=r"queries\.npy: NaN/Inf"):
        open_store(store)
    (store / "queries.npy").write_bytes(b"garbage")
    with pytest.raises(InputError, match=r"queries\.npy: not a readable"):
        open_store(store)


def test_open_store_rejects_bad_users_and_jsonl(store):
    users = json.loads((store / "users.json").read_text())
    users[1]["mem_start"] = 7
    (store / "users.json").write_text(json.dumps(users))
    with pytest.raises(InputError, match=r"users\.json: key '\[1\]'"):
        open_store(store)
    users[1]["mem_start"] = 8
    (store / "users.json").write_text(json.dumps(users))
    lines = (store / "queries.jsonl").read_text().splitlines()
    lines[2] = "{broken"
    (store / "queries.jsonl").write_text("\n".join(lines) + "\n")
    st = open_store(store)                   # metadata is parsed lazily ...
    with pytest.raises(InputError, match=r"queries\.jsonl:3: invalid JSON"):
        st.user("alice")                     # ... and fails naming file:line


def test_a_store_file_that_is_not_utf8_is_one_line_naming_it(store):
    """users.json, or a row of memories.jsonl, with bytes that are not UTF-8 (a disk error, an
    editor's Latin-1 save) is an InputError naming the file (and line), not a UnicodeDecodeError."""
    users = (store / "users.json").read_bytes()
    (store / "users.json").write_bytes(b"\xff\xfe" + users)
    with pytest.raises(InputError, match=r"users\.json: cannot read \(.*utf-8"):
        open_store(store)
    (store / "users.json").write_bytes(users)
    lines = (store / "memories.jsonl").read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"text": "', b'"text": "\xe9', 1)
    (store / "memories.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(InputError, match=r"memories\.jsonl:2: not UTF-8 text \(byte \d+\)$"):
        open_store(store).user("alice")          # one user's rows
    with pytest.raises(InputError, match=r"memories\.jsonl:2: not UTF-8 text \(byte \d+\)$"):
        open_store(store).memories               # every row


def test_a_fifo_in_a_store_is_a_missing_file_not_a_hang(store):
    """open_store opened each store file before checking it is a regular file: a FIFO named
    manifest.json blocked it forever (the open waits for a writer); it is a missing file."""
    import os
    import threading
    (store / "manifest.json").unlink()
    os.mkfifo(store / "manifest.json")
    got = []

    def run():
        try:
            open_store(store)
        except InputError as e:
            got.append(str(e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():                                 # release the blocked open: a writer comes and goes
        os.close(os.open(store / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("open_store blocked on a FIFO")
    assert len(got) == 1 and "missing manifest.json: not an embedding store" in got[0]
    # what embed --out asks of the directory it replaces
    t = threading.Thread(target=lambda: got.append((is_store(store), store_counts(store))), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():
        os.close(os.open(store / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("is_store blocked on a FIFO")
    assert got[1] == (False, None)


def test_read_rows_without_fd_preads_or_names_fd(store):
    """read_rows(mm, a, b) of a store's array (a map of an open descriptor: no file name) fell
    back to slicing the map, making its pages resident: what it exists to avoid. Without ``fd``
    it reads a map that names its file, and refuses one that names none, naming ``fd``."""
    from rmm_jax.data.store import read_rows
    st = open_store(store)
    with pytest.raises(InputError, match=r"^fd: a map of an open file names no file to read from") as e:
        read_rows(st.memory_emb, 0, 2)
    assert e.value.arg == "fd"
    want = st.user("alice").memory_emb[:2]
    assert read_rows(st.memory_emb, 0, 2, st._files.fd("memories.npy")).tobytes() == want.tobytes()
    assert read_rows(np.load(store / "memories.npy", mmap_mode="r"), 0, 2).tobytes() == want.tobytes()
    assert read_rows(np.asarray(st.memory_emb), 0, 2).tobytes() == want.tobytes()    # no map: sliced
    # a slice of a map kept the map's offset: its rows 0:2 were the file's rows 0:2
    whole = np.load(store / "memories.npy", mmap_mode="r")
    assert read_rows(whole[1:], 0, 2).tobytes() == np.asarray(whole[1:3]).tobytes()


def test_a_store_file_s_lines_are_read_in_linear_copies(store, monkeypatch):
    """_Files.lines joined and split ``rest + chunk`` at every chunk: a line of n chunks (a
    memories.jsonl without newlines) was copied n times over, O(n²). Each line is now joined once."""
    import rmm_jax.data.store._read as R
    body = b"".join([b"x" * 50 + b"\n", b"\n", b"y" * 7 + b"\n", b"z" * 123])       # lines longer than a chunk
    (store / "big.jsonl").write_bytes(body)
    monkeypatch.setattr(R, "_NAMES", R._NAMES + ("big.jsonl",))
    files = R._open_files(store)
    joined = []
    join = R._join
    monkeypatch.setattr(R, "_join", lambda pieces: joined.append(sum(map(len, pieces))) or join(pieces))
    for chunk in (1, 4, 5, 1 << 20):
        monkeypatch.setattr(R, "_CHUNK", chunk)
        joined.clear()
        assert list(files.lines("big.jsonl")) == body.splitlines(keepends=True)
        assert sum(joined) == len(body)              # every byte copied into its line once
    files.close()


def test_from_python_the_errors_name_the_argument_not_embeds_option(tmp_path):
    """Embedder(""), write_store(..., "paragraph", ...), an embedder giving NaN, check_model
    and append_store to a segment store said "--model:", "--granularity:", "--into:": the
    options of `rmm-jax embed`, to a Python caller who gave none. They name the argument
    (model, granularity, embedder, model_id, path); `embed` still names its option
    (tests/test_cli_embed_retrieve.py, tests/test_bad_input.py)."""
    from rmm_jax.data.store import append_store, check_model

    class NaNs(FakeEmbedder):
        def encode(self, texts, desc=""):
            return np.full((len(texts), self.dim), np.nan, np.float32)

    with pytest.raises(InputError, match=r"^model: model must be a name or a path, got ''$"):
        E.Embedder("", progress=False)
    with pytest.raises(InputError, match=r"^granularity: unknown granularity 'paragraph'; choose one of "):
        write_store(tmp_path / "x", tiny_dataset(), "paragraph", FakeEmbedder())
    with pytest.raises(InputError, match=r"^embedder: NaN/Inf in memories embeddings from model 'fake/bow-16'$"):
        write_store(tmp_path / "x", tiny_dataset(), "turn", NaNs())
    s = _w(tmp_path / "seg", tiny_dataset(), "segment")
    st = open_store(s)
    with pytest.raises(InputError, match=r"^model_id: STORE .* was embedded with model 'fake/bow-16', not 'other'"):
        check_model(st, s, "other")
    with pytest.raises(InputError, match=r"^path: STORE .* has 'segment' memories; appending keeps "):
        append_store(s, tiny_dataset(), FakeEmbedder())
    with pytest.raises(InputError, match=r"^embedder: STORE .* was embedded with model 'fake/bow-16', not "):
        append_store(s, tiny_dataset(), FakeEmbedder(8))


def test_a_store_write_names_an_embedder_or_dataset_of_the_wrong_kind_and_writes_nothing(tmp_path):
    """An embedder giving another size than its .dim was "cannot reshape array of size 144 into
    shape (16,8)"; embedder=None and a SPEC str for the dataset were AttributeErrors. Each is one
    InputError naming the argument, and nothing is written."""
    from rmm_jax.data.store import append_store

    class Wider(FakeEmbedder):
        def encode(self, texts, desc=""):
            return np.ones((len(texts), self.dim + 1), np.float32)

    out = tmp_path / "x"
    with pytest.raises(InputError, match=r"^embedder: memories embeddings from model 'fake/bow-16' have shape "
                                         r"\(\d+, 17\), expected \(\d+, 16\) \(\d+ texts, embedder\.dim 16\)$"):
        write_store(out, tiny_dataset(), "turn", Wider())
    for embedder in (None, "fake/bow-16"):
        with pytest.raises(InputError, match=r"^embedder: expected an Embedder \(\.encode, \.model_id, \.dim\), "):
            write_store(out, tiny_dataset(), "turn", embedder)
    with pytest.raises(InputError, match=r"^dataset: expected a Dataset, e\.g\. rmm_jax\.data\.load_spec\(SPEC\), "
                                         r"got str 'synthetic'"):
        write_store(out, "synthetic", "turn", FakeEmbedder())
    assert not out.exists()
    s = _w(tmp_path / "s", tiny_dataset(), "turn")
    before = sorted(p.name for p in s.iterdir())
    more = Dataset("more", (User("carol", tiny_dataset().users[0].sessions, ()),))
    with pytest.raises(InputError, match=r"^embedder: memories embeddings .* expected \(\d+, 16\) "
                                         r"\(\d+ texts, the store's dim 16\)$"):
        append_store(s, more, Wider())
    with pytest.raises(InputError, match=r"^dataset: expected a Dataset"):
        append_store(s, "synthetic", FakeEmbedder())
    with pytest.raises(InputError, match=r"^embedder: expected an Embedder"):
        append_store(s, more, None)
    assert sorted(p.name for p in s.iterdir()) == before and "carol" not in open_store(s).user_ids


def test_the_progress_lines_say_1_user_not_1_users(tmp_path):
    """write_store's line said "1 users, ..." and append_store's "new: 1 users, 1 sessions
    (...)": the data layer cannot import the CLI's count, so it spelt every plural out.
    They share rmm_jax.data.words.count with the CLI now."""
    from rmm_jax.data.store import append_store

    data = tiny_dataset()
    alice, bob = data.users
    lines = []
    write_store(tmp_path / "s", Dataset("one", (alice,)), "turn", FakeEmbedder(), progress=lines.append)
    assert lines[0].startswith("1 user, 8 turn memories, 4 queries ("), lines
    one = Session("session_9", "day 9", (Turn("D9:1", "session_9", "Ann", "one more thing", "day 9"),))
    lines.clear()
    append_store(tmp_path / "s", Dataset("more", (User("carol", (one,), ()),)), FakeEmbedder(), progress=lines.append)
    assert lines[0] == ("new: 1 user, 1 session (1 memory), 0 questions; already in the store: 0 sessions, "
                        "0 questions"), lines


def test_a_cache_of_another_dimension_names_what_the_caller_can_change(tmp_path, monkeypatch):
    """A cache that records another dimension for the model: the Embedder's error named the
    CLI's --cache-dir to a Python caller, and to rerank, replay and evaluate run without
    --cache-dir (their cache root is then $RMM_JAX_CACHE). Each now names what its caller gives."""
    model_id = E._resolve("all-MiniLM-L6-v2")[1]
    E._Cache(tmp_path / E.model_slug(model_id), model_id, 8).close()        # recorded: dim 8, not 384
    for words, fix in (({}, "use another cache_dir"), ({"cache_dir": "--cache-dir"}, "use another --cache-dir")):
        with worded(words):                       # as the CLI's embed (as_options) words it
            e = E.Embedder(cache_dir=tmp_path, progress=False)
        with pytest.raises(InputError, match=rf"^[^\n]*: model 'all-MiniLM-L6-v2' has dim 384, its embedding cache "
                                             rf"says 8; {fix}$"):
            e.encode(["a text no cache holds"])
        e.close()
    monkeypatch.setenv("RMM_JAX_CACHE", str(tmp_path))
    with pytest.raises(InputError, match=r"says 8; use another \$RMM_JAX_CACHE$"):
        E.embed_texts(["a text no cache holds"], "all-MiniLM-L6-v2")


def test_write_store_refuses_a_directory_that_is_not_an_embedding_store(tmp_path):
    """write_store(path, ...) replaced whatever directory was at ``path``: someone's files, or
    a policy store, were deleted without a word (only `embed --out` refused them). It refuses
    them itself now, naming ``path``, and leaves them as they were; an embedding store is
    still replaced, and an empty directory filled."""
    import jax
    from conftest import make_fake_store

    from rmm_jax.core.reranker import init_reranker
    from rmm_jax.persist.policy_store import PolicyStore

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep me")
    pol = tmp_path / "pol"
    PolicyStore.create(pol, {"kind": "linear", "dim": 8, "hidden": None, "config": {}},
                       init_reranker(jax.random.key(0), 8))
    make_fake_store(tmp_path / "st", users=2, sessions=2)
    pol_before = sorted((p.relative_to(pol), p.read_bytes()) for p in pol.rglob("*") if p.is_file())
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me too")
    for path in (notes, pol, a_file):
        with pytest.raises(InputError, match=rf"^path {path}: .*(not an embedding store|not a directory); "
                                             "choose a new store path$"):
            write_store(path, tiny_dataset(), "turn", FakeEmbedder())
    assert [p.name for p in notes.iterdir()] == ["notes.txt"] and (notes / "notes.txt").read_text() == "keep me"
    assert sorted((p.relative_to(pol), p.read_bytes()) for p in pol.rglob("*") if p.is_file()) == pol_before
    assert a_file.read_text() == "keep me too"
    st = tmp_path / "st"
    write_store(st, Dataset("one", tiny_dataset().users[:1]), "session", FakeEmbedder())   # a store: replaced
    assert list(open_store(st).user_ids) == ["alice"] and open_store(st).granularity == "session"
    empty = tmp_path / "empty"
    empty.mkdir()
    write_store(empty, tiny_dataset(), "turn", FakeEmbedder())
    assert list(open_store(empty).user_ids) == ["alice", "bob"]


def test_write_store_refuses_thresholds_at_a_granularity_that_ignores_them(tmp_path):
    """write_store(..., "turn", segment_threshold=0.5) built turn memories and ignored the
    threshold (`embed` refused --segment-threshold without --granularity segment): refused by
    name now, before any work."""
    for gran in ("turn", "session"):
        for name in ("segment_threshold", "merge_threshold"):
            with pytest.raises(InputError, match=rf"^{name}: only granularity=segment reads it; this store "
                                                 rf"builds {gran} memories$"):
                write_store(tmp_path / "x", tiny_dataset(), gran, FakeEmbedder(), **{name: 0.5})
    assert not (tmp_path / "x").exists()
    with worded({"granularity": "--granularity"}):
        with pytest.raises(InputError, match="only --granularity segment reads it"):
            write_store(tmp_path / "x", tiny_dataset(), "turn", FakeEmbedder(), segment_threshold=0.5)


@pytest.mark.parametrize("texts, model, where", [
    ("hello", "all-MiniLM-L6-v2", "texts: expected a list of texts, got one str"),   # embedded h, e, l, o
    (["ok"], None, "model: expected an embedding model's name"),                      # AttributeError
])
def test_embed_texts_names_a_str_for_texts_or_a_model_that_is_not_a_name(texts, model, where):
    from rmm_jax.data.embed import embed_texts
    from rmm_jax.errors import InputError
    with pytest.raises(InputError) as e:
        embed_texts(texts, model)
    assert str(e.value).startswith(where), str(e.value)


# --------------------------------------------------------------------------- one writer, any name


def test_a_new_store_holds_the_writer_lock_while_it_embeds(tmp_path):
    """write_store took the store's lock only to rename: an append that ran during its
    embedding (minutes) was lost when the new store replaced the old, both exiting 0. The
    lock is held from the first read to the rename: a writer meanwhile is told the store is busy."""
    from rmm_jax.data import make_synthetic
    from rmm_jax.data.store import append_store, store_writer
    from rmm_jax.errors import Busy

    store = tmp_path / "s"
    write_store(store, make_synthetic(users=2, sessions=2, turns=4, seed=0), "turn", FakeEmbedder(8))
    seen = []

    class Embedding(FakeEmbedder):          # while the new store is embedded, another writer tries
        def encode(self, texts, desc=""):
            try:
                with store_writer(store):
                    seen.append("took the lock")
            except Busy as e:
                seen.append(str(e))
            return super().encode(texts, desc)

    write_store(store, make_synthetic(users=3, sessions=2, turns=4, seed=1), "turn", Embedding(8))
    assert seen and all("in use by pid" in s for s in seen), seen
    with pytest.raises(Busy, match="in use by pid"):      # and an append during another append's embedding
        class Appending(FakeEmbedder):
            def encode(self, texts, desc=""):
                append_store(store, make_synthetic(users=4, sessions=2, turns=4, seed=1), FakeEmbedder(8))
        append_store(store, make_synthetic(users=4, sessions=2, turns=4, seed=1), Appending(8))


def test_a_store_reached_by_a_symbolic_link_is_written_where_it_points(tmp_path):
    """Written through a link, a store replaced the link with a directory and left the old
    store, stale, under its real name (and the link, renamed, as a leftover): readers of the
    real name saw none of the new data. Now the link stays, and the directory it points to is
    the new store, under one lock and one run-state whichever name is given."""
    import os

    from rmm_jax.data import make_synthetic
    from rmm_jax.data.store import append_store, store_writer
    from rmm_jax.errors import Busy
    from rmm_jax.persist.runstate import RunState

    real, link = tmp_path / "real", tmp_path / "link"
    write_store(real, make_synthetic(users=3, sessions=4, turns=8, seed=0), "turn", FakeEmbedder(8))
    os.symlink(real, link)
    append_store(link, make_synthetic(users=4, sessions=4, turns=8, seed=0), FakeEmbedder(8))
    assert link.is_symlink() and store_counts(real)["users"] == 4
    write_store(link, make_synthetic(users=5, sessions=2, turns=4, seed=2), "turn", FakeEmbedder(8))
    assert link.is_symlink() and store_counts(real)["users"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [".real.lock", "link", "real"]     # nothing left over
    with store_writer(real), pytest.raises(Busy), store_writer(link):
        pass
    assert RunState.path_for(link) == RunState.path_for(real.resolve())


# --------------------------------------------------------------------------- the cache is a cache


def test_a_damaged_embedding_cache_is_moved_aside_and_a_new_one_started(cache_root, tmp_path):
    """A cache SQLite cannot read ("file is not a database") failed every command that embeds,
    exit 2, where a damaged policy index is rebuilt: it holds nothing that cannot be embedded
    again. It is moved aside with a warning naming where, and the same texts embed to the same
    vectors through a new one."""
    import shutil
    import warnings

    root = tmp_path / "cache"
    shutil.copytree(cache_root, root)
    texts = ["a first text", "and a second one"]
    emb = E.Embedder(cache_dir=root, progress=False)
    want, cache = emb.encode(texts), emb.cache_dir / "embeddings.sqlite"
    emb.close()
    cache.write_bytes(b"not a database at all" * 100)
    for suffix in ("-wal", "-shm"):
        cache.with_name(cache.name + suffix).unlink(missing_ok=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        emb = E.Embedder(cache_dir=root, progress=False)
        # embedded again: the model's own float32 results, batched otherwise (padding moves the last bits)
        np.testing.assert_allclose(emb.encode(texts), want, atol=1e-6)
        assert len(emb._cache) == 2
        emb.close()
    said = [str(w.message) for w in seen if issubclass(w.category, E.EmbeddingCacheWarning)]
    assert len(said) == 1 and "file is not a database; moved aside to embeddings.sqlite.damaged-" in said[0]
    aside = [p for p in cache.parent.iterdir() if p.name.startswith("embeddings.sqlite.damaged-")]
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"not a database")


def test_an_embedding_cache_the_disk_stops_is_left_for_the_run(cache_root, tmp_path, monkeypatch):
    """A full disk under the cache (not under the output) stopped rerank and replay, exit 1,
    serving nothing. The run goes on without the cache, with one warning; the vectors are the
    cached run's."""
    import errno
    import shutil
    import sqlite3
    import warnings

    root = tmp_path / "cache"
    shutil.copytree(cache_root, root)
    texts = ["one text", "another text", "a third"]
    emb = E.Embedder(cache_dir=root, progress=False)
    want = emb.encode(texts)
    emb.close()

    def full(self, keys, vecs):
        raise E.WriteFailed("cannot write the embedding cache: no space left on device", where=str(self.path)) \
            from sqlite3.OperationalError(errno.ENOSPC)

    monkeypatch.setattr(E._Cache, "put", full)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        emb = E.Embedder(cache_dir=root, progress=False)
        np.testing.assert_array_equal(emb.encode(texts + ["a new text"])[:3], want)
        assert emb._cache is None
        emb.encode(["and one more"])
        emb.close()
    said = [str(w.message) for w in seen if issubclass(w.category, E.EmbeddingCacheWarning)]
    assert len(said) == 1 and "no space left on device: the rest of this run embeds without it" in said[0], said


def test_an_embedding_cache_damaged_past_its_header_is_set_aside_as_it_is_read(cache_root, tmp_path):
    """Pages damaged past the header open fine and fail as they are read ("database disk image
    is malformed"): a traceback from the cache's read, exit 1. The cache is moved aside as it
    is found, with a warning, and the run goes on without one, to the same vectors."""
    import shutil
    import warnings

    root = tmp_path / "cache"
    shutil.copytree(cache_root, root)
    texts = [f"text number {i} about things" for i in range(200)]
    emb = E.Embedder(cache_dir=root, progress=False)
    want, cache = emb.encode(texts), emb.cache_dir / "embeddings.sqlite"
    emb.close()
    for suffix in ("-wal", "-shm"):
        cache.with_name(cache.name + suffix).unlink(missing_ok=True)
    data = bytearray(cache.read_bytes())
    data[3 * 4096:] = bytes((i * 7) % 256 for i in range(len(data) - 3 * 4096))    # the header pages kept
    cache.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        emb = E.Embedder(cache_dir=root, progress=False)
        np.testing.assert_allclose(emb.encode(texts[:20] + ["a new one"])[:20], want[:20], atol=1e-6)
        assert emb._cache is None
        emb.close()
    said = [str(w.message) for w in seen if issubclass(w.category, E.EmbeddingCacheWarning)]
    assert len(said) == 1 and "malformed; moved aside to embeddings.sqlite.damaged-" in said[0], said
