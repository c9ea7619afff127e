"""The online program compiles once per padded shape, not per user or per stream length.

``make_run`` builds one jitted program; :func:`rmm_jax.online.driver.drive` runs every
chunk through it. Compilations are counted with JAX's public monitoring events (one
``backend_compile`` event per XLA compilation, the loop's and any other). After a warm-up
chunk, running more users (chunks of 4, the last padded) and streams of 57 vs 64 queries
with batch 4 (15 vs 16 batches → both the 16-batch bucket; banks of 50 vs 56 memories →
both the 56 bucket) must compile nothing, nor must cutting a chunk into segments of 1, 3
or 7 batches (checkpoints: the batch range is an argument of the one program, so every
segmentation runs the same machine code). A stream of 100 queries (25 batches → the
28-batch bucket) is the positive control: it compiles the loop again.
"""
import jax
import numpy as np
import pytest

import rmm_jax as rj
from rmm_jax.data.citations import oracle_cite
from rmm_jax.online.driver import ChunkDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.streams import Stream

D, K = 8, 6
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def mk(rng, uid, t, n):
    bank = rng.normal(size=(n, D)).astype(np.float32)
    q = rng.normal(size=(t, D)).astype(np.float32)
    cand = np.argsort(-(q @ bank.T), 1)[:, :K].astype(np.int32)
    gold = rng.random((t, n)) < 0.1
    return Stream(uid, bank, q, cand, np.ones((t, K), bool), np.take_along_axis(gold, cand, 1),
                  gold.sum(1).astype(np.int32), gold.sum(1) > 0)


@pytest.fixture
def compiles():
    """A list that receives one entry per XLA compilation while the test runs."""
    seen = []
    listener = lambda event, duration, **kw: seen.append(event) if event == COMPILE_EVENT else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def test_compilations_do_not_grow_with_users_or_lengths_within_a_bucket(compiles):
    rng = np.random.default_rng(0)
    params = rj.init_reranker(jax.random.key(0), D)
    program = make_run(*rj.preset("default", k=K, m=2, batch=4), cite_fn=oracle_cite)

    def drain(streams, segment_batches=None):
        chunks = [streams[i:i + 4] for i in range(0, len(streams), 4)]
        done = [e for e in drive(chunks, program, params, users_per_chunk=4, segment_batches=segment_batches)
                if isinstance(e, ChunkDone)]
        for e in done:
            assert np.all(np.isfinite(np.asarray(e.states.params["q_adapter"]["W"]["kernel"])))
        return sum(len(e.streams) for e in done)

    assert drain([mk(rng, f"a{i}", 57, 50) for i in range(3)]) == 3     # warm-up: compiles
    assert len(compiles) >= 1
    warm = len(compiles)
    assert drain([mk(rng, f"b{i}", 57, 50) for i in range(11)]) == 11
    assert len(compiles) == warm                                # more users, padded chunks: no compile
    assert drain([mk(rng, f"c{i}", 64, 56) for i in range(5)]) == 5
    assert len(compiles) == warm                                # 57 vs 64 queries: same bucket
    for every in (1, 3, 7):
        assert drain([mk(rng, f"s{every}", 57, 50)], segment_batches=every) == 1
    assert len(compiles) == warm                                # segments of any length: the same program
    assert drain([mk(rng, "d0", 100, 60)]) == 1
    assert len(compiles) > warm                                 # control: a new bucket compiles


def test_compare_builds_one_program_per_setting(compiles, monkeypatch):
    """``compare`` (``rmm-jax demo``'s table) builds each setting's program once and runs it
    from each start: the "pretrain+online" row re-uses the "online" row's program, so it makes
    no second ``make_run`` and compiles nothing (it built and compiled its own before)."""
    from rmm_jax.online import compare as compare_module
    from rmm_jax.online.pretrain import PretrainConfig
    from rmm_jax.online.vectors import VectorSpec, vector_users

    built = []
    monkeypatch.setattr(compare_module, "make_run", lambda *a, **kw: built.append(a) or make_run(*a, **kw))
    streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=6), seed=0, indices=[0, 1, 2, 3])
    at_start = {}
    rows = compare_module.compare(streams, streams[:2], rj.preset("default", k=6, m=2),
                                  PretrainConfig(epochs=2, m=2, batch_size=8), rows=("online", "pretrain+online"),
                                  progress=lambda row: at_start.setdefault(row, len(compiles)))
    assert set(rows) == {"_pretrain", "online", "pretrain+online"}
    assert len(built) == 1, built
    assert len(compiles) == at_start["pretrain+online"] > at_start["online"]    # the online row compiled it
