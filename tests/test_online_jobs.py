"""The main job's guarantees: replay reproduces simulate, evaluation is prequential,
pretraining learns, and the CLI chain embed → pretrain → simulate → replay holds."""
import dataclasses
import json
import re
import threading
import time

import jax
import numpy as np
import pytest
from conftest import make_fake_store

import rmm_jax as rj
from rmm_jax.data.citation_log import read_log, validate_record, write_log
from rmm_jax.data.citations import oracle_cite, precision_recall_oracle
from rmm_jax.data.store import open_store
from rmm_jax.errors import InputError
from rmm_jax.online.driver import ChunkDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.pretrain import PretrainConfig, eval_per_query, pretrain, split_streams
from rmm_jax.online.run import run_online
from rmm_jax.online.streams import load_streams, streams_from_log, user_key, user_keys
from rmm_jax.persist.policy_store import PolicyStore

SETTING = rj.preset("default", k=10, m=3, batch=4)
CFG = SETTING.layout
SIM = make_run(*SETTING, cite_fn=precision_recall_oracle(0.9, 0.8))
REPLAY = make_run(*SETTING)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(make_fake_store(tmp_path_factory.mktemp("s") / "store", users=5, sessions=8))


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def one_chunk(streams, params, cite_fn=None, **kw) -> ChunkDone:
    """The (only) completed chunk of a one-chunk run."""
    program = make_run(*SETTING, cite_fn=cite_fn)
    (done,) = [e for e in drive([streams], program, params, users_per_chunk=len(streams), **kw)
               if isinstance(e, ChunkDone)]
    return done


def final_params(res):
    out = {}
    for ids, st in zip(res.chunk_users, res.states):
        for i, u in enumerate(ids):
            out[u] = jax.tree.map(lambda x: x[i], st)
    return out


def test_a_chunks_keys_in_one_call_are_each_users_own_key():
    ids = ["user0", "u1", "<pad0>", "ünï"]
    together = jax.random.key_data(user_keys(5, ids))
    assert np.array_equal(together, np.stack([jax.random.key_data(user_key(5, u)) for u in ids]))
    assert not np.array_equal(together, jax.random.key_data(user_keys(6, ids)))


def test_chunks_read_ahead_keep_their_order_errors_and_an_early_stop(store):
    """drive reads and pads the next chunk in a thread: events still come chunk by chunk,
    an error of the chunk source is raised where that chunk would be, and leaving the loop
    early stops the reading."""
    streams = load_streams(store, CFG.k)
    params = rj.init_reranker(jax.random.key(0), store.dim)
    read = []

    def source(fail_at=None, n=len(streams)):
        for i in range(n):
            if i == fail_at:
                raise InputError("bad user", where="source")
            read.append(i)
            yield [streams[i % len(streams)]]

    done = [e.chunk for e in drive(source(), SIM, params, users_per_chunk=1) if isinstance(e, ChunkDone)]
    assert done == list(range(len(streams)))
    got = []
    with pytest.raises(InputError, match="bad user"):
        for e in drive(source(fail_at=3), SIM, params, users_per_chunk=1):
            got.append(e.chunk)
    assert got == [0, 1]                    # chunk 2 was still in flight (pipelined), as without the thread
    read.clear()
    for _ in drive(source(n=20), SIM, params, users_per_chunk=1):
        break                               # 2 chunks used, 1 waiting, 1 read for the next place at most
    time.sleep(0.5)
    assert len(read) <= 4 and not any(t.name == "rmm-jax-pad-ahead" for t in threading.enumerate())


def test_leaving_the_loop_waits_for_the_reading_thread(store):
    """Closing drive's loop (an exception, a signal's Interrupted) returns only once the
    read-ahead thread is done with the chunk it was reading: a daemon thread still inside
    XLA when the interpreter exits aborted the process (exit 134 on Ctrl-C)."""
    streams = load_streams(store, CFG.k)
    params = rj.init_reranker(jax.random.key(0), store.dim)

    def source():
        for i in range(6):
            if i >= 2:
                time.sleep(1.0)             # a slow chunk in the thread while the loop is left
            yield [streams[i % len(streams)]]

    for _ in drive(source(), SIM, params, users_per_chunk=1):
        break
    assert not any(t.name == "rmm-jax-pad-ahead" for t in threading.enumerate())


def test_run_online_names_chunks_or_a_str_for_streams_and_takes_a_generator(store):
    """run_online([streams[:2], streams[2:]]) (chunks) and run_online("abc") were
    AttributeErrors in the driver; a generator a TypeError (no len())."""
    streams = load_streams(store, CFG.k)[:2]
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    with pytest.raises(InputError, match=r"^streams 0: expected a Stream, got list: run_online takes the streams "):
        run_online([streams[:1], streams[1:]], SIM, p0)
    with pytest.raises(InputError, match=r"^streams: expected a list of streams, got str 'abc'"):
        run_online("abc", SIM, p0)
    assert run_online((s for s in streams), SIM, p0).user_ids == [s.user_id for s in streams]


@pytest.mark.user_xla_flags
def test_replaying_a_simulated_log_reproduces_every_policy_bit_for_bit(store, tmp_path):
    streams = load_streams(store, CFG.k)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    sim = run_online(streams, SIM, p0, seed=3, users_per_chunk=2, want_log=True)
    log = tmp_path / "log.jsonl"
    write_log(log, [validate_record(r) for r in sim.records])
    records, _ = read_log(log)
    rep = run_online(streams_from_log(store, records, CFG), REPLAY, p0, seed=3, users_per_chunk=2)
    a, b = final_params(sim), final_params(rep)
    assert set(a) == set(b) == set(store.user_ids)
    for u in a:
        assert leaves_equal(a[u], b[u]), u
    assert sim.summary["recall@3"] == rep.summary["recall@3"]
    # and the updates did something
    assert not leaves_equal(a[store.user_ids[0]].params, p0)


def test_a_program_that_does_not_fit_its_streams_or_a_flat_list_of_streams_is_refused_by_name(store, tmp_path):
    """A replay program (make_run without cite_fn) on streams without a log was a TypeError
    from the compiled loop ('>=' between None and int); a simulating one on logged streams
    ran without a word, learning from its own draws instead of the log; drive(streams, ...)
    was "'Stream' object is not iterable"."""
    streams = load_streams(store, CFG.k)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    sim = run_online(streams, SIM, p0, seed=3, users_per_chunk=2, want_log=True)
    log = tmp_path / "log.jsonl"
    write_log(log, [validate_record(r) for r in sim.records])
    logged = streams_from_log(store, read_log(log)[0], CFG)
    run = lambda chunks, program: list(drive(chunks, program, p0, users_per_chunk=len(streams)))
    with pytest.raises(ValueError, match=r"^program: replays logged selections .* the streams carry none"):
        run([streams], REPLAY)
    with pytest.raises(ValueError, match=r"^program: simulates citations .* the streams carry logged selections"):
        run([logged], SIM)
    with pytest.raises(ValueError, match=r"^chunks: chunk 0 mixes streams"):
        run([[logged[0], streams[1]]], REPLAY)
    with pytest.raises(ValueError, match=r"^chunks: expected chunks .* got a Stream: drive\(\[streams\], \.\.\.\)"):
        run(streams, SIM)
    assert [type(e).__name__ for e in run([logged], REPLAY)][-1] == "ChunkDone"


@pytest.mark.parametrize("stored, given, says", [
    (dict(), dict(scope="hybrid", rank=2), "scope is 'hybrid' (rank 2), the policy store's is 'user'"),
    (dict(scope="hybrid", rank=2), dict(), "scope is 'user', the policy store's is 'hybrid' (rank 2)"),
    (dict(scope="hybrid", rank=2), dict(scope="hybrid", rank=3), "scope is 'hybrid' (rank 3), the policy store's is "
                                                                 "'hybrid' (rank 2)"),
    (dict(), dict(kind="mlp", hidden=8), "reranker is mlp, the policy store's is linear")])
def test_open_run_refuses_a_program_of_another_layout_than_its_store(store, tmp_path, stored, given, says):
    """open_run took a program of another scope or kind than its policy store: a hybrid
    program's factors were saved in a user-scope store (which then failed at every load), an
    mlp program's params in a linear store, and a user-scope program in a hybrid store ran a
    whole chunk before its save was refused. Each is refused by name before any work."""
    from rmm_jax.online.session import Start, create_policies, open_run

    streams = load_streams(store, CFG.k)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    ps = create_policies(tmp_path / "p", rj.preset("default", k=CFG.k, m=CFG.m, **stored).layout, store.dim, p0,
                         config={})
    program = make_run(*rj.preset("default", k=CFG.k, m=CFG.m, **given), cite_fn=oracle_cite)
    with pytest.raises(InputError, match=rf"^program: the program's {re.escape(says)} "):
        with open_run([streams], program, Start(p0), ps, None, seed=0, users_per_chunk=2, checkpoint_every=0) as run:
            list(run)
    assert ps.n_users() == 0 and ps.shared_versions() == [1]


def test_open_run_takes_a_program_that_fits_its_store_and_none_on_a_process_that_does_not_write(store, tmp_path):
    """What the layout check must refuse and must not (the reviews' regressions): the run's users
    start from ``start``, so its mlp params' hidden width is what must be the store's (None: the
    default d; start params of width d saved users of width d beside a shared part of 8), whatever
    width the program's layout names; and a process that does not write may hold no store (a
    distributed run's process 1, before process 0 made the store: an AttributeError on None)."""
    from rmm_jax.online.session import Start, create_policies, open_run

    streams = load_streams(store, CFG.k)
    p8, pd = (rj.init_reranker(jax.random.key(0), store.dim, "mlp", h) for h in (8, None))
    ps = create_policies(tmp_path / "p", rj.preset("default", k=CFG.k, m=CFG.m, kind="mlp", hidden=8).layout,
                         store.dim, p8, config={})
    named = make_run(*rj.preset("default", k=CFG.k, m=CFG.m, kind="mlp", hidden=8), cite_fn=oracle_cite)
    unnamed = make_run(*rj.preset("default", k=CFG.k, m=CFG.m, kind="mlp"), cite_fn=oracle_cite)
    with pytest.raises(InputError, match=rf"^start: its params are mlp of hidden width {store.dim}, the policy "
                                         r"store's are of 8 "):
        with open_run([streams], named, Start(pd), ps, None, seed=0, users_per_chunk=2, checkpoint_every=0):
            pass
    assert ps.n_users() == 0
    for program, target, writer in ((unnamed, ps, True), (named, None, False)):
        with open_run([streams], program, Start(p8), target, None, seed=0, users_per_chunk=len(streams),
                      checkpoint_every=0, writer=writer) as run:
            assert list(run) == [len(streams)]
    got = ps.load_batch(ps.users())
    assert ps.n_users() == len(streams) and got.state.params["q_adapter"]["up"]["kernel"].shape[1:] == (store.dim, 8)


def test_a_run_on_an_mlp_store_builds_its_reranker_of_the_stores_kind_and_width(capsys, tmp_path, store):
    """simulate and replay have no --hidden: on a `pretrain --hidden 8` store, `--init identity`
    built its users at the default width d and saved them beside a shared part of width 8, and a
    later run failed ("the saved policies do not fit this run"). Without --kind, every run on an
    mlp store was refused ("holds 'mlp' rerankers, not 'linear'"). A run takes the store's kind
    and width; a --kind given that is not the store's is still refused."""
    from conftest import run_cli

    from rmm_jax.persist.policy_store import PolicyStore

    run = ["--k", 8, "--m", 3, "--users-per-chunk", 2, "--checkpoint-every", 0, "-q"]
    code, _, err = run_cli(capsys, "pretrain", store.path, "--out", tmp_path / "p", "--k", 8, "--m", 3, "--kind",
                           "mlp", "--hidden", 8, "--epochs", 1, "-q")
    assert code == 0, err
    for more in (["--init", "identity"], ["--relearn"], ["--init", "pretrained", "--relearn"]):
        code, _, err = run_cli(capsys, "simulate", store.path, "--policies", tmp_path / "p", *run, *more)
        assert code == 0, (more, err)
        ps = PolicyStore.open(tmp_path / "p")
        got = ps.load_batch(ps.users())
        assert got.state.params["q_adapter"]["down"]["kernel"].shape[1:] == (8, store.dim), more
    code, _, err = run_cli(capsys, "simulate", store.path, "--policies", tmp_path / "p", *run, "--relearn",
                           "--log-out", tmp_path / "log.jsonl")
    assert code == 0, err
    code, _, err = run_cli(capsys, "replay", store.path, "--log", tmp_path / "log.jsonl", "--policies", tmp_path / "p",
                           "--relearn", "-q")
    assert code == 0, err
    code, _, err = run_cli(capsys, "simulate", store.path, "--policies", tmp_path / "p", *run, "--relearn", "--kind",
                           "linear")
    assert code == 2 and "error: --kind: policy store holds 'mlp' rerankers, not 'linear'" in err, err


def test_run_online_and_drive_refuse_a_bad_seed_chunk_size_stream_or_m_by_name_before_any_work(store, tmp_path):
    """seed="1" was a JAX TypeError 14 calls deep; users_per_chunk=0 range()'s "arg 3 must
    not be zero"; run_online(stream) "'Stream' has no len()"; replaying streams logged with
    m=3 by an m=2 program numpy's "could not broadcast ... into shape (.., 2)"; drive checked
    nothing until its first event was asked for."""
    streams = load_streams(store, CFG.k)[:2]
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    never = lambda *a, **k: pytest.fail("ran")              # nothing is compiled or run
    program = SIM._replace(init_shared=never, init=never, pad=never, batches=never, run=never)
    for kw, arg in (({"seed": "1"}, "seed"), ({"seed": 1.0}, "seed"), ({"users_per_chunk": 0}, "users_per_chunk"),
                    ({"users_per_chunk": "2"}, "users_per_chunk")):
        for call in (lambda: run_online(streams, program, p0, **kw), lambda: drive([streams], program, p0, **kw)):
            with pytest.raises(InputError, match=rf"^{arg}: must be an int"):
                call()
    with pytest.raises(InputError, match=r"^streams: expected a list of streams, got a Stream: run_online\(\[stream\]"):
        run_online(streams[0], program, p0)
    sim = run_online(streams, SIM, p0, seed=3, want_log=True)
    write_log(tmp_path / "log.jsonl", [validate_record(r) for r in sim.records])
    logged = streams_from_log(store, read_log(tmp_path / "log.jsonl")[0], CFG)
    m2 = make_run(*rj.preset("default", k=10, m=2, batch=4))
    with pytest.raises(InputError, match=r"^program: shows m=2, but the streams log 3 selections a query "
                                         r"\(user '.*'\): replay them with a program of m=3$"):
        run_online(logged, m2, p0)


@pytest.mark.parametrize("params_kind, layout_kind", [(("linear", None), ("mlp", 8)), (("mlp", 4), ("mlp", 8)),
                                                       (("mlp", 8), ("linear", None))])
def test_run_online_and_drive_refuse_params_of_another_kind_or_width_than_the_layout(store, params_kind,
                                                                                      layout_kind):
    """The params a caller hands in were never checked against the program's layout: linear
    params under an `mlp` layout trained a linear reranker, an `mlp` of hidden 4 under hidden 8
    ran as 4, and `mlp` params under a linear layout were a KeyError 'W' in the update. Each is
    one InputError naming params (PolicyStore.create's check), before anything is compiled or
    run; params of the layout's kind and width run."""
    streams = load_streams(store, CFG.k)[:2]
    (pk, ph), (lk, lh) = params_kind, layout_kind
    params = rj.init_reranker(jax.random.key(0), store.dim, kind=pk, **({"hidden": ph} if ph else {}))
    setting = rj.preset("default", k=10, m=3, batch=4, kind=lk, **({"hidden": lh} if lh else {}))
    never = lambda *a, **k: pytest.fail("ran")              # nothing is compiled or run
    program = make_run(*setting, cite_fn=oracle_cite)._replace(init_shared=never, init=never, pad=never,
                                                                 batches=never, run=never)
    what = "kind is" if pk != lk else f"hidden is {lh}"
    for call in (lambda: run_online(streams, program, params), lambda: drive([streams], program, params)):
        with pytest.raises(InputError, match=rf"^params: params (are of the {pk} kind|have hidden width {ph}) .*the "
                                             rf"program's layout {what}"):
            call()
    fits = rj.init_reranker(jax.random.key(0), store.dim, kind=lk, **({"hidden": lh} if lh else {}))
    assert run_online(streams[:1], make_run(*setting, cite_fn=oracle_cite), fits).summary["queries"] > 0


def test_a_recorder_of_another_m_than_its_programs_is_refused(store, tmp_path):
    """Recorder(0) and Recorder("5") were taken, and Recorder(2) on an m=3 program reported
    recall@2 with recall@3's numbers; now the first event that shows the program's m
    (the selections a simulation made, or those a replay's streams logged) is refused,
    before any sink sees it."""
    from rmm_jax.online.run import Recorder
    for wrong in (0, "5", 2.0, True):
        with pytest.raises(InputError, match=r"^m: must be an int >= 1"):
            Recorder(wrong)
    streams = load_streams(store, CFG.k)[:2]
    p0 = rj.init_reranker(jax.random.key(0), store.dim)

    class Sink:
        def chunk(self, event):
            pytest.fail("a sink saw a mislabelled chunk")

    sim = run_online(streams, SIM, p0, seed=3, want_log=True)
    write_log(tmp_path / "log.jsonl", [validate_record(r) for r in sim.records])
    logged = streams_from_log(store, read_log(tmp_path / "log.jsonl")[0], CFG)
    for program, chunk in ((SIM, streams), (REPLAY, logged)):
        rec = Recorder(2, sinks=[Sink()])
        with pytest.raises(InputError, match=r"^m: is 2, but the program's events show 3 selections a query: "
                                             r"build the Recorder with program.layout.m$"):
            for e in drive([chunk], program, p0):
                rec.feed(e)
        ok = Recorder(CFG.m)
        for e in drive([chunk], program, p0):
            ok.feed(e)
        assert sorted(ok.result().recall) == sorted(s.user_id for s in chunk)


def test_off_policy_log_probs_change_the_replayed_policy(store, tmp_path):
    streams = load_streams(store, CFG.k)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    sim = run_online(streams[:1], SIM, p0, seed=1, want_log=True)
    recs = [validate_record({**r, "log_prob": r["log_prob"] - 1.0}) for r in sim.records]
    rep = run_online(streams_from_log(store, recs, CFG), REPLAY, p0, seed=1)
    assert not leaves_equal(final_params(sim)[streams[0].user_id], final_params(rep)[streams[0].user_id])


def test_a_querys_own_citations_never_affect_its_prequential_score(store):
    # Replay the same logged stream twice, differing only in the citations of query t:
    # every query up to the end of t's batch is scored identically (its update comes
    # after), and later queries see a different policy.
    streams = load_streams(store, CFG.k)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    sim = run_online(streams[:1], SIM, p0, seed=2, want_log=True)
    records = [validate_record(r) for r in sim.records]
    t = 9  # third batch (queries 8..11)
    flipped = list(records)
    r = records[t]
    flipped[t] = dataclasses.replace(r, cited=tuple(x for x in r.selected if x not in r.cited))
    a, b = (one_chunk(streams_from_log(store, recs, CFG), p0) for recs in (records, flipped))
    uid = streams[0].user_id
    ra, rb = a.outputs[uid]["recall"], b.outputs[uid]["recall"]
    end = (t // CFG.batch + 1) * CFG.batch
    np.testing.assert_array_equal(ra[:end], rb[:end])
    assert not leaves_equal(a.states.params, b.states.params)


def test_prequential_score_uses_the_policy_from_before_the_querys_batch(store):
    # Batch n's online scores equal a static evaluation with the params reached after
    # running only batches 0..n-1 (n: a later batch with some non-zero recall).
    s = load_streams(store, CFG.k)[0]
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    cite = lambda k, g, f: oracle_cite(k, g, f, 0.9, 0.8)
    cut = lambda a, b: dataclasses.replace(s, queries=s.queries[a:b], cand=s.cand[a:b], cand_mask=s.cand_mask[a:b],
                                           cand_gold=s.cand_gold[a:b], num_gold=s.num_gold[a:b],
                                           valid=s.valid[a:b], query_ids=s.query_ids[a:b])
    recall = one_chunk([s], p0, cite_fn=cite, seed=4).outputs[s.user_id]["recall"]
    b = CFG.batch
    n_real = s.queries.shape[0] // b
    n = next(i for i in range(2, n_real) if recall[i * b:(i + 1) * b].max() > 0)
    st = one_chunk([cut(0, n * b)], p0, cite_fn=cite, seed=4).states
    params_before = jax.tree.map(lambda x: x[0], st.params)
    nxt = cut(n * b, (n + 1) * b)
    data = {"q": nxt.queries, "m": nxt.bank[nxt.cand], "mask": nxt.cand_mask, "gold": nxt.cand_gold,
            "num_gold": nxt.num_gold}
    static_recall, _ = eval_per_query(params_before, data, CFG.m)
    # each Recall is hits / num_gold, one correctly rounded division of the same integers: exact
    np.testing.assert_array_equal(recall[n * b:(n + 1) * b], static_recall)


def test_pretraining_raises_training_recall_and_keeps_the_best_epoch(store):
    streams = load_streams(store, CFG.k)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    pcfg = PretrainConfig(epochs=15, m=3, batch_size=8)
    train, val, split = split_streams(streams, pcfg.val_fraction, seed=0)
    best, hist = pretrain(p0, train, val, pcfg, seed=0)
    assert set(split["train"]).isdisjoint(split["validation"]) and split["validation"]
    assert max(hist["train_recall"]) > hist["train_recall"][0]
    best_val = hist["val_recall"][hist["best_epoch"]]
    assert best_val == max(hist["val_recall"])


def test_pretraining_scores_each_stream_on_its_own_memories(store):
    """Pretraining keeps every stream's memories in one bank and gathers each minibatch's
    candidates from it: its training Recall@M equals the one scored on each stream's own
    candidate embeddings, row by row (float32 sums of N recalls: within N·2⁻²⁴), so no row
    reads another stream's memories."""
    streams = load_streams(store, CFG.k)
    assert not np.array_equal(streams[0].bank, streams[1].bank)  # another stream's memories would score otherwise
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    params, hist = pretrain(p0, streams, [], PretrainConfig(epochs=2, m=3, batch_size=8, val_fraction=0.0), seed=0)
    per = []
    for s in streams:
        keep = s.valid & (s.num_gold > 0)
        r, _ = eval_per_query(params, {"q": s.queries[keep], "m": s.bank[s.cand[keep]], "mask": s.cand_mask[keep],
                                       "gold": s.cand_gold[keep], "num_gold": s.num_gold[keep]}, 3)
        per.append(np.asarray(r, np.float64))
    want = np.concatenate(per)
    assert want.size > 8 and 0 < want.mean() < 1
    assert abs(hist["train_recall"][-1] - want.mean()) <= want.size * 2 ** -24


def test_pretraining_with_the_pointwise_loss_learns_and_an_unknown_loss_is_refused(store):
    streams = load_streams(store, CFG.k)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    cfg = PretrainConfig(epochs=6, m=3, batch_size=8, val_fraction=0.0, loss="logistic")
    params, hist = pretrain(p0, streams, [], cfg, seed=0)
    assert hist["train_recall"][-1] > hist["train_recall"][0]
    listwise, _ = pretrain(p0, streams, [], dataclasses.replace(cfg, loss="listwise"), seed=0)
    assert not np.array_equal(jax.tree.leaves(params)[0], jax.tree.leaves(listwise)[0])
    balanced, _ = pretrain(p0, streams, [], dataclasses.replace(cfg, loss="balanced_logistic"), seed=0)
    assert not np.array_equal(jax.tree.leaves(params)[0], jax.tree.leaves(balanced)[0])
    with pytest.raises(ValueError, match="loss must be one of"):
        pretrain(p0, streams, [], dataclasses.replace(cfg, loss="hinge"), seed=0)


@pytest.mark.user_xla_flags
def test_cli_chain_and_bit_identical_replay(tmp_path, capsys):
    # embed-free chain on a fake store: pretrain → simulate (logging) → replay the log.
    # Replaying a simulate log from the same start reproduces its policies bit for bit,
    # from the pretrained start and from identity.
    from rmm_jax.cli.main import main

    def run(*args):
        try:
            main(list(args))
        except SystemExit as e:
            assert not e.code, capsys.readouterr().err
        return capsys.readouterr()

    km = ("--k", "10", "--m", "3")
    st = make_fake_store(tmp_path / "st", users=3)
    pol = str(tmp_path / "pol")
    run("pretrain", str(st), "--out", pol, "--epochs", "2", *km)
    out = run("simulate", str(st), "--policies", pol, "--init", "pretrained", *km,
              "--log-out", str(tmp_path / "log.jsonl"), "--json")
    # the first night from the pretrained store says where its users started (it said nothing)
    assert f"started 3 new users in {pol} from its pretrained reranker (--init pretrained)" in out.err.splitlines()
    summary = json.loads(out.out)
    assert summary["online"]["queries"] == summary["base"]["queries"] > 0
    simulated = {u: PolicyStore.open(pol).load(u).state.params for u in PolicyStore.open(pol).users()}
    err = run("replay", str(st), "--log", str(tmp_path / "log.jsonl"), "--policies", pol, "--init", "pretrained",
              *km).err
    assert "started 3 of 3 users afresh although" in err and "leave out --init" in err   # not continued: said
    replayed = PolicyStore.open(pol)
    assert set(simulated) == set(replayed.users()) and simulated
    for u in simulated:
        assert len(replayed.entries(u)) == 2  # a new version was written...
        assert leaves_equal(replayed.load(u).state.params, simulated[u])  # ...with the same policy

    run("simulate", str(st), "--policies", str(tmp_path / "pol3"), *km, "--log-out", str(tmp_path / "log3.jsonl"))
    run("replay", str(st), "--log", str(tmp_path / "log3.jsonl"), "--policies", str(tmp_path / "pol2"),
        "--init", "identity", *km)
    a, b = PolicyStore.open(tmp_path / "pol2"), PolicyStore.open(tmp_path / "pol3")
    assert set(a.users()) == set(b.users()) and a.users()
    for u in a.users():
        assert leaves_equal(a.load(u).state.params, b.load(u).state.params)


def test_replay_passes_learn_the_log_again_and_score_the_first_pass(tmp_path, capsys):
    """``replay --passes 2`` leaves the policy of one pass over the log continued, with its
    whole state (optimiser moments, step), by a second pass over the same records; and it
    reports the prequential Recall of the first pass, as ``--passes 1`` does."""
    from conftest import run_cli

    from rmm_jax.online.driver import Chunk

    km = ("--k", "10", "--m", "3", "--users-per-chunk", "3", "--checkpoint-every", "0")
    st = make_fake_store(tmp_path / "st", users=3)
    code, _, err = run_cli(capsys, "simulate", st, "--policies", tmp_path / "sim", *km,
                           "--log-out", tmp_path / "a.jsonl")
    assert code == 0, err
    got = {}
    for passes in (1, 2):
        code, out, err = run_cli(capsys, "replay", st, "--log", tmp_path / "a.jsonl", "--policies",
                                 tmp_path / f"p{passes}", "--init", "identity", "--passes", passes, *km, "--json")
        assert code == 0, err
        got[passes] = (json.loads(out)["online"], PolicyStore.open(tmp_path / f"p{passes}"))
    assert got[2][0] == got[1][0]                    # the report scores the first pass only

    store = open_store(st)
    streams = streams_from_log(store, read_log(tmp_path / "a.jsonl")[0], CFG)
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    first = one_chunk(streams, p0)
    (second,) = [e for e in drive([Chunk(streams, first.states, np.ones(len(streams), bool))], REPLAY, p0,
                                  users_per_chunk=len(streams)) if isinstance(e, ChunkDone)]
    for i, s in enumerate(second.streams):
        want = jax.tree.map(lambda x: x[i], second.states.params)
        # an allowance, not a float32 bound: the two runs pad to other lengths, so XLA may order
        # their sums differently, and a whole run's worst-case bound is vacuous (tests/helpers.py,
        # f32_error); 1e-4 as in tests/test_sharding.py, far below what a wrong second pass moves
        np.testing.assert_allclose(jax.tree.leaves(got[2][1].load(s.user_id).state.params),
                                   jax.tree.leaves(want), rtol=1e-4, atol=1e-5)
        assert not leaves_equal(got[1][1].load(s.user_id).state.params, want)
    code, _, err = run_cli(capsys, "replay", st, "--log", tmp_path / "a.jsonl", "--policies", tmp_path / "bad",
                           "--passes", 0, *km)
    assert code != 0 and "--passes" in err and not (tmp_path / "bad").exists()


def test_replay_passes_over_a_log_that_mixes_learned_and_new_calls_learns_the_new_ones_every_pass(tmp_path, capsys):
    """``--passes 2`` over a log whose first calls the policy learned already repeats only the
    new calls, twice each: bit for bit the run over a log of only the new calls. (It used to
    keep the new calls of the first pass only.)"""
    from conftest import run_cli

    km = ("--k", "8", "--m", "3", "--users-per-chunk", "2", "--checkpoint-every", "0")
    st = make_fake_store(tmp_path / "st", users=3, sessions=6)
    code, _, err = run_cli(capsys, "simulate", st, "--policies", tmp_path / "sim", *km,
                           "--log-out", tmp_path / "all.jsonl")
    assert code == 0, err
    records = (tmp_path / "all.jsonl").read_text().splitlines()
    seen: dict = {}
    early = [seen.setdefault(json.loads(r)["user_id"], []).append(r) or len(seen[json.loads(r)["user_id"]]) <= 5
             for r in records]
    (tmp_path / "day1.jsonl").write_text("".join(r + "\n" for r, e in zip(records, early) if e))
    (tmp_path / "new.jsonl").write_text("".join(r + "\n" for r, e in zip(records, early) if not e))
    stores = {}
    for name, day2 in (("mixed", "all.jsonl"), ("new", "new.jsonl")):
        pol = tmp_path / name
        for log, more in (("day1.jsonl", ()), (day2, ("--passes", "2", "--json"))):
            code, out, err = run_cli(capsys, "replay", st, "--log", tmp_path / log, "--policies", pol, *km, *more)
            assert code == 0, err
        stores[name] = (json.loads(out)["online"]["queries"], PolicyStore.open(pol))
    (n_mixed, mixed), (n_new, new) = stores["mixed"], stores["new"]
    assert n_mixed == n_new == sum(not e for e in early) > 0
    for u in new.users():
        a, b = mixed.load(u), new.load(u)
        assert leaves_equal(a.state, b.state), u
        assert a.info["queries_seen"] == b.info["queries_seen"]


def test_a_skipped_chunk_whose_users_differ_from_the_interrupted_runs_is_one_line():
    """A resumed run's done chunk is restored only if it holds the users whose outputs were
    saved; otherwise the resume is refused in one line, not a KeyError half-way through."""
    from rmm_jax.online.driver import ChunkSkipped
    from rmm_jax.online.run import Recorder
    from rmm_jax.online.vectors import VectorSpec, vector_users
    streams = vector_users(VectorSpec(dim=8, memories=12, queries=4, k=4), seed=0, indices=[0, 1])

    class Saved:
        def __init__(self, users):
            self.users = users

        def restore(self, event):
            return {u: {} for u in self.users}

    with pytest.raises(InputError, match="users chunk 1 holds other users") as e:
        Recorder(2, sinks=[Saved(["u0000000", "u0000009"])]).feed(ChunkSkipped(0, streams))
    assert e.value.where == "resume"       # drive's argument; the CLI says --resume (cli.online.run_and_save)


def test_shown_recall_is_the_recall_of_what_the_calls_drew_and_replay_reports_the_logged_one(tmp_path, capsys):
    """``simulate --json``'s ``shown_recall@M`` is the Recall of the memories each call drew,
    recomputed here from the log's ``selected`` ids and the store's gold ids alone (set
    arithmetic, float64), per user and overall; the policy's own top-M (``recall@M``) differs
    from it. Replaying that log reports the same shown recall: what the log records it showed.
    Each per-query value is one float32 division (relative error at most 2^-24), so their
    means agree within 2^-23."""
    from rmm_jax.cli.main import main

    def run(*args):
        try:
            main(list(args))
        except SystemExit as e:
            assert not e.code, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    st = make_fake_store(tmp_path / "st", users=3)
    km = ("--k", "10", "--m", "3", "--json")
    sim = run("simulate", str(st), "--policies", str(tmp_path / "a"), *km, "--log-out", str(tmp_path / "log.jsonl"))
    gold = {}
    for line in (st / "queries.jsonl").read_text().splitlines():
        q = json.loads(line)
        if q["gold_memory_ids"] and not q["abstention"]:
            gold[q["user"], q["id"]] = set(q["gold_memory_ids"])
    per_user: dict[str, list[float]] = {}
    for line in (tmp_path / "log.jsonl").read_text().splitlines():
        r = json.loads(line)
        g = gold.get((r["user_id"], r["query_id"]))
        if g is not None:
            per_user.setdefault(r["user_id"], []).append(len(g & set(r["selected"])) / len(g))
    tol = 2.0 ** -23
    for u, values in per_user.items():
        assert sim["online"]["per_user"][u]["shown_recall@3"] == pytest.approx(np.mean(values), abs=tol)
    every = [v for vs in per_user.values() for v in vs]
    assert sim["online"]["shown_recall@3"] == pytest.approx(np.mean(every), abs=tol)
    assert sim["online"]["queries"] == len(every)
    assert any(sim["online"]["per_user"][u]["shown_recall@3"] != sim["online"]["per_user"][u]["recall@3"]
               for u in per_user)
    rep = run("replay", str(st), "--log", str(tmp_path / "log.jsonl"), "--policies", str(tmp_path / "b"), *km)
    assert rep["online"]["shown_recall@3"] == sim["online"]["shown_recall@3"]
    assert {u: r["shown_recall@3"] for u, r in rep["online"]["per_user"].items()} == \
        {u: r["shown_recall@3"] for u, r in sim["online"]["per_user"].items()}


def test_replay_json_gives_the_per_user_base_values_the_table_prints(tmp_path, capsys):
    """replay printed each user's base Recall@M and base cited-recall@M in its tables, but
    --json gave the base's overall values only: a nightly job could not compute per-user
    deltas. The JSON's base.per_user holds each user's values the tables print."""
    from rmm_jax.cli.main import main

    def run(*args):
        try:
            main(list(args))
        except SystemExit as e:
            assert not e.code, capsys.readouterr().err
        return capsys.readouterr().out

    st = make_fake_store(tmp_path / "st", users=3)
    km = ("--k", "10", "--m", "3")
    run("simulate", str(st), "--policies", str(tmp_path / "a"), *km, "--log-out", str(tmp_path / "log.jsonl"))
    log = ("--log", str(tmp_path / "log.jsonl"))
    doc = json.loads(run("replay", str(st), *log, "--policies", str(tmp_path / "b"), *km, "--json"))
    table = run("replay", str(st), *log, "--policies", str(tmp_path / "c"), *km)
    base = doc["base"]["per_user"]
    assert set(base) == set(doc["online"]["per_user"]) and len(base) == 3
    recall, cited = table.split("\n\n")[:2]            # the Recall@M table, then the cited-recall@M table
    rows = [r.split() for r in recall.splitlines()[1:] if r.split()[0] in base]
    rows_c = [r.split() for r in cited.splitlines()[1:] if r.split()[0] in base]
    assert len(rows) == len(rows_c) == 3
    for uid, queries, b, *_ in rows:
        assert (int(queries), f"{base[uid]['recall@3']:.4f}") == (base[uid]["queries"], b)
        assert 0 <= base[uid]["ndcg@3"] <= 1
    for uid, _, _, b, *_ in rows_c:
        assert f"{base[uid]['cited_recall@3']:.4f}" == b


def test_an_overall_shown_recall_is_over_every_query_or_absent():
    """Users restored from a checkpoint written before shown recall was kept have none: their
    rows go without it and the overall value is left out, never a mean over some users."""
    from rmm_jax.online.summary import Summary
    acc = Summary(3)
    acc.add("a", [1.0, 0.0], [1.0, 0.0], [True, True], shown_recall=[0.5, 0.0])
    assert acc.result()["shown_recall@3"] == 0.25
    acc.add("b", [1.0], [1.0], [True])
    out = acc.result()
    assert "shown_recall@3" not in out and "shown_recall@3" not in out["per_user"]["b"]
    assert out["per_user"]["a"]["shown_recall@3"] == 0.25 and out["recall@3"] == 2 / 3


def test_the_cited_curve_is_over_calls_with_a_citation_as_cited_recall_is():
    """cited_recall@M is a mean over the calls with a citation; its learning curve is too. A
    call without one has no share to count: the curve counted it as 0, so a run whose every
    cited call had its citations in the top M drew a curve far below the 1.0 it reported."""
    from rmm_jax.online.summary import CURVE_WINDOW, Summary
    acc = Summary(3)
    t = 2 * CURVE_WINDOW
    hit = np.tile([1.0, 0.0], t // 2)                 # every other call cites one memory, in the top 3
    acc.add("a", np.zeros(t), np.zeros(t), np.zeros(t, bool), cited=(hit, hit, np.full(t, 3.0)))
    out = acc.result()
    assert out["cited_recall@3"] == 1.0 and out["calls_cited"] == t // 2
    assert out["cited_curve"] == [1.0] * (t // 2)


def test_a_segmented_chunk_keeps_only_its_own_outputs(monkeypatch):
    """Each segment's call returns the whole chunk's outputs; the driver keeps the segment's
    own batches as arrays of their own. Views kept every segment's chunk-long array alive
    until the chunk ended: 388 MB for 0.67 MB of outputs at 512 segments."""
    import rmm_jax.online.driver as drv
    from rmm_jax.online.vectors import VectorSpec, vector_users
    streams = vector_users(VectorSpec(dim=8, memories=12, queries=160, k=4), seed=0, indices=[0, 1])
    program = make_run(*rj.preset("default", k=4, m=2), cite_fn=oracle_cite)
    held, real = [], {}
    keep = drv._batches
    monkeypatch.setattr(drv, "_batches", lambda out, lo, hi: held.append(keep(out, lo, hi)) or held[-1])
    for e in drv.drive([streams], program, rj.init_reranker(jax.random.key(0), 8), users_per_chunk=2,
                       segment_batches=1):
        if isinstance(e, ChunkDone):
            real = e.outputs
    assert len(held) == 40                                  # one per segment of one batch
    owned = sum((v.base if v.base is not None else v).nbytes for part in held for v in part.values())
    assert owned <= 2 * sum(v.nbytes for o in real.values() for v in o.values()), owned


def test_make_run_refuses_a_cite_fn_that_is_not_a_function():
    """make_run(..., cite_fn="oracle") was taken, and the first chunk failed in the trace with
    "Expected a callable value, got oracle"."""
    for wrong in ("oracle", 0.9):
        with pytest.raises(ValueError, match=r"^cite_fn: expected a citation function, .* got "):
            make_run(*SETTING, cite_fn=wrong)
    assert make_run(*SETTING, cite_fn=oracle_cite).simulates and not make_run(*SETTING).simulates


def test_from_python_saved_states_or_learned_calls_that_do_not_fit_name_the_chunks(store, monkeypatch):
    """drive() given a Chunk whose saved states do not fit the program said "--policies:",
    from_store() given a stream whose learned call changed "--log:": the options of the
    CLI, to a Python caller who gave chunks. They name the argument; the CLI's run loop
    (cli.online.run_and_save, looping over rmm_jax.online.session.open_run) names its
    options as before."""
    from types import SimpleNamespace

    from rmm_jax.cli.shell import as_options
    from rmm_jax.online import starts
    from rmm_jax.online.driver import Chunk

    streams = load_streams(store, CFG.k)[:2]
    p0 = rj.init_reranker(jax.random.key(0), store.dim)
    wrong = {"params": np.zeros((2, 3), np.float32)}
    with pytest.raises(InputError, match=r"^chunks: the saved policies do not fit this run \(another ") as e:
        list(drive([Chunk(streams, wrong, np.ones(2, bool))], SIM, p0, users_per_chunk=2))
    assert "--" not in str(e.value), str(e.value)     # said "another --kind, --rank": the CLI's options

    class Saved:         # a policy store that holds user "u" (what from_store reads of it)
        def load_batch(self, ids, before=None):
            return SimpleNamespace(users=["u"], learned={"calls": np.zeros((1, 2))}, infos=[{}])

    monkeypatch.setattr(starts, "classify", lambda prior, calls, relearn: SimpleNamespace(
        changed=np.array([True]), learn=np.array([False])))
    chunks = starts.from_store([[SimpleNamespace(user_id="u", calls=object())]], Saved())
    with pytest.raises(InputError, match=r"^chunks: user 'u': a call learned already has other content"):
        list(chunks)
    chunks = starts.from_store([[SimpleNamespace(user_id="u", calls=object())]], Saved())
    with pytest.raises(InputError, match=r"^--log: user 'u': a call learned already has other content"), \
            as_options("resume", "policies", chunks="log"):        # as cli.online.run_and_save words it
        list(chunks)


def test_streams_from_log_names_what_the_store_lacks_in_one_line(store):
    """streams_from_log(store, records, layout) over records of users the store lacks (read
    without it: read_log(path)) raised a bare KeyError: 'None', where evaluate_log says
    "log.jsonl:1: key 'user_id': unknown user id 'user0' (...)". It words it so too, at the
    record; a text that ``vectors`` holds no embedding of is named likewise."""
    bare = validate_record({"user_id": "zed", "query_id": "q1", "candidates": ["m1", "m2"], "selected": ["m1"],
                            "cited": []})
    texts = validate_record({"user_id": "zed", "query": "where?", "candidates": [{"id": "m1", "text": "here"}],
                             "selected": ["m1"], "cited": []})
    with pytest.raises(InputError, match=r"^calls\.jsonl: record 2: key 'user_id': unknown user id 'zed' \(a user "
                                         r"the store lacks needs the 'query' text and every candidate's text\)$"):
        streams_from_log(store, [texts, bare], CFG, "calls.jsonl")
    with pytest.raises(InputError, match=r"^vectors: holds no embedding of the text 'here' \(embed "):
        streams_from_log(store, [texts], CFG)
    vec = np.ones(store.dim, np.float32) / np.sqrt(store.dim)
    (s,) = streams_from_log(store, [texts], CFG, vectors={"where?": vec, "here": vec})
    assert s.user_id == "zed" and s.memory_ids == ("m1",)


def test_the_run_names_saved_states_that_do_not_fit_policies_and_changed_calls_chunks():
    """rmm_jax.online.session.open_run tells drive's error of the saved states in its
    chunks (drive's ``chunks``) from from_store's error of a changed call (the run's
    ``chunks``): the first names ``policies``, the second ``chunks``; the CLI's run loop
    words them ``--policies`` and ``--log``, as it did when it held the loop."""
    from rmm_jax.cli.shell import as_options
    from rmm_jax.online.session import _noted, _saved_states_as_policies

    def raising(message):
        raise InputError(message, arg="chunks")
        yield

    own = []
    cases = [(_saved_states_as_policies(raising("the saved policies do not fit"), own), "policies"),
             (_saved_states_as_policies(_noted(raising("user 'u': a call changed"), own), own), "chunks")]
    for events, arg in cases:
        with pytest.raises(InputError) as e:
            list(events)
        assert e.value.arg == arg, str(e.value)
    own = []
    with pytest.raises(InputError, match=r"^--policies: the saved policies do not fit$"), \
            as_options("resume", "policies", chunks="log"):
        list(_saved_states_as_policies(raising("the saved policies do not fit"), own))
    with pytest.raises(InputError, match=r"^--log: user 'u': a call changed$"), \
            as_options("resume", "policies", chunks="log"):
        list(_saved_states_as_policies(_noted(raising("user 'u': a call changed"), own), own))


def test_the_caller_owns_the_run_loop_and_an_error_of_its_between_events_releases_the_writer(tmp_path):
    """session.open_run hands the loop to its caller (the CLI's progress bar and stop check,
    the scale benchmark's load sampling): each item comes once its event is saved, so a
    caller that raises after the first chunk (StopSignals.check) leaves that chunk's users
    saved, and the ``with`` releases the store's writer on the way out."""
    from rmm_jax.online.session import Start, create_policies, open_run
    from rmm_jax.online.vectors import VectorSpec, vector_users

    class Stop(Exception):
        pass

    streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=10), seed=0, indices=[0, 1, 2])
    p0 = rj.init_reranker(jax.random.key(0), 16)
    ps = create_policies(tmp_path / "p", CFG, 16, p0, config={})
    done = []
    with pytest.raises(Stop), open_run([streams[:2], streams[2:]], SIM, Start(p0), ps, None, seed=0,
                                       users_per_chunk=2, checkpoint_every=0) as run:
        for n in run:
            done.append(n)
            raise Stop
    assert done == [2] and ps.n_users() == 2
    with PolicyStore.open(tmp_path / "p").writer():     # another writer: the run's is released
        pass


def test_leaving_the_run_early_closes_its_events_and_joins_the_read_ahead_thread(tmp_path):
    """A caller that broke out of open_run's loop after the first event left drive's
    read-ahead thread running: at interpreter exit two "Exception ignored" tracebacks
    printed (threading.join, and session's generator). Leaving the ``with`` now closes the
    events, joining the thread, before the writer is released; the run is then closed:
    iterating it again is one InputError naming ``run`` (it would save without the writer),
    and result() is the partial result of the users finished."""
    import subprocess
    import sys
    script = f"""
import threading, jax, rmm_jax as rj
from rmm_jax.data.citations import oracle
from rmm_jax.online.session import Start, create_policies, open_run
from rmm_jax.online.vectors import VectorSpec, vector_users
streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=6), seed=0, indices=list(range(8)))
program = rj.make_run(*rj.preset("default", k=6, m=2), cite_fn=oracle())
params = rj.init_reranker(jax.random.key(0), 16)
ps = create_policies({str(tmp_path / "p")!r}, program.layout, 16, params, config={{}})
with open_run([streams[i:i + 2] for i in range(0, 8, 2)], program, Start(params), ps, None, seed=0,
              users_per_chunk=2, checkpoint_every=0) as run:
    for n in run:
        break
alive = [t.name for t in threading.enumerate() if t.name == "rmm-jax-pad-ahead"]
print("alive", alive, "queries", run.result().summary["queries"])
try:
    list(run)
except Exception as e:
    print(type(e).__name__, e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "alive [] queries 16", out.stdout
    assert lines[1].startswith("InputError run: is closed: its `with open_run(...)` has exited"), out.stdout
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_run_iterated_after_its_with_exited_is_refused_and_result_before_the_loop_says_so(tmp_path):
    """A SavingRun iterated after its ``with`` exited saved policies without the store's
    writer (another writer held it meanwhile); result() before the loop said "users: no
    users to run", as if the input were empty. Both are one InputError naming ``run``."""
    from rmm_jax.online.session import Start, create_policies, open_run
    from rmm_jax.online.vectors import VectorSpec, vector_users

    streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=10), seed=0, indices=[0, 1, 2])
    p0 = rj.init_reranker(jax.random.key(0), 16)
    ps = create_policies(tmp_path / "p", CFG, 16, p0, config={})
    with open_run([streams[:2], streams[2:]], SIM, Start(p0), ps, None, seed=0, users_per_chunk=2,
                  checkpoint_every=0) as run:
        with pytest.raises(InputError, match=r"^run: its loop has not run: iterate it"):
            run.result()
        it = iter(run)
    with pytest.raises(InputError, match=r"^run: is closed: its `with open_run\(\.\.\.\)` has exited"):
        next(it)
    with pytest.raises(InputError, match=r"^run: is closed"):
        iter(run)
    assert ps.n_users() == 0


def test_open_run_names_chunks_for_a_mistake_in_the_chunks(tmp_path):
    """open_run given a flat list of streams (not chunks of them) said "policies: expected
    chunks ...": it renamed every error drive raised of ``chunks`` as one of the store. Only
    the saved states that do not fit are the store's; the rest names ``chunks``, as drive does."""
    from rmm_jax.online.session import Start, create_policies, open_run
    from rmm_jax.online.vectors import VectorSpec, vector_users

    streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=10), seed=0, indices=[0, 1])
    p0 = rj.init_reranker(jax.random.key(0), 16)
    ps = create_policies(tmp_path / "p", CFG, 16, p0, config={})
    with pytest.raises(InputError, match=r"^chunks: expected chunks \(each a list of streams, or a Chunk\), got a "
                                         r"Stream"):
        with open_run(streams, SIM, Start(p0), ps, None, seed=0, users_per_chunk=2, checkpoint_every=0) as run:
            list(run)


def test_plan_start_refuses_an_init_it_does_not_know_and_what_the_init_needs():
    """plan_start took any ``init`` ('identiy', 'latest', None, 0) as ``continue``: the run
    continued from the store without a word. It is one of identity, pretrained, continue,
    else one InputError naming ``init``; identity without an embedding store (st=None) was
    an AttributeError ('dim'), continue without a store one too: each names its argument."""
    from types import SimpleNamespace

    from rmm_jax.online.session import create_policies, identity_params, plan_start

    lay = rj.preset("default").layout
    ps = create_policies(str(__import__("tempfile").mkdtemp()) + "/p", lay, 8, identity_params(8, lay, 0), config={})
    for init in ["identiy", "latest", None, 0]:
        with pytest.raises(InputError, match=r"^init: must be one of identity, pretrained, continue, got "):
            plan_start(ps, SimpleNamespace(dim=8), lay, init, 0)
    with pytest.raises(InputError, match=r"^st: init='identity' needs the embedding store \(its dim\), got "):
        plan_start(ps, None, lay, "identity", 0)
    with pytest.raises(InputError, match=r"^ps: init='continue' needs the policy store to start from, got None$"):
        plan_start(None, SimpleNamespace(dim=8), lay, "continue", 0)
    assert plan_start(ps, SimpleNamespace(dim=8), lay, "continue", 0).before == ps.next_version()


def test_open_run_and_create_policies_name_the_argument_given_wrong(tmp_path):
    """open_run("abc", ...) was an AttributeError from drive's padding, a dict or bare params
    for ``start`` one ('before'), create_policies(config=None) a TypeError: each is one
    InputError naming the argument."""
    from rmm_jax.online.session import Start, create_policies, open_run

    p0 = rj.init_reranker(jax.random.key(0), 16)
    ps = create_policies(tmp_path / "p", CFG, 16, p0, config={})
    kw = dict(seed=0, users_per_chunk=2, checkpoint_every=0)
    with pytest.raises(InputError, match=r"^chunks: expected chunks \(each a list of streams, or a Chunk\), got str"):
        with open_run("abc", SIM, Start(p0), ps, None, **kw) as run:
            list(run)
    with pytest.raises(InputError, match=r"^chunks: expected chunks .*, got a chunk str 'abc'$"):
        list(drive(["abc"], SIM, p0, users_per_chunk=2))
    for start in ({"params": p0}, p0):
        with pytest.raises(InputError, match=r"^start: expected a Start \(rmm_jax\.online\.session\.Start\(params\)\), "
                                             r"got a dict$"):
            with open_run([], SIM, start, ps, None, **kw) as run:
                list(run)
    with pytest.raises(InputError, match=r"^config: must be a dict of what made the store \(e\.g\. \{\}\), got "
                                         r"NoneType None$"):
        create_policies(tmp_path / "q", CFG, 16, p0, config=None)
    assert not (tmp_path / "q").exists()
