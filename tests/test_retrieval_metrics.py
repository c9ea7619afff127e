"""Dense top-k retrieval (rmm_jax.data.retrieval) and ranking metrics (rmm_jax.core.metrics)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_f32_close, f32_error

from rmm_jax.core import metrics as M
from rmm_jax.data import retrieval as R
from rmm_jax.data.store import UserData
from rmm_jax.errors import InputError


# --------------------------------------------------------------------------- references
def metric_bound(f, rel, num_gold, k):
    """The float32 error bound of the metric ``f(rel, num_gold, k)``."""
    return f32_error(lambda r, g: f(r, g, k), rel, num_gold)


def brute_top_k(q, bank, k, mask=None):
    """numpy reference: full score matrix, sort by (score desc, index asc)."""
    s = np.asarray(q, np.float64) @ np.asarray(bank, np.float64).T
    if mask is not None:
        s = np.where(mask[None, :], s, -np.inf)
    idx = np.arange(s.shape[1])
    order = np.stack([np.lexsort((idx, -row)) for row in s])[:, :k]
    return np.take_along_axis(s, order, axis=1), order


def int_data(rng, n_q, n, d, lo=-2, hi=3):
    """Small-integer vectors: dot products are exact in float32 and ties are common."""
    return (rng.integers(lo, hi, (n_q, d)).astype(np.float32),
            rng.integers(lo, hi, (n, d)).astype(np.float32))


# --------------------------------------------------------------------------- top_k
def test_top_k_hand_example_and_ties_by_lower_index():
    bank = np.array([[1, 0], [0, 1], [1, 0], [0.5, 0.5], [1, 0]], np.float32)
    q = np.array([[1, 0], [0, 1]], np.float32)
    s, i = R.top_k(q, bank, 4, chunk_size=2)
    assert i.dtype == np.int32 and s.shape == (2, 4)
    assert i[0].tolist() == [0, 2, 4, 3]          # three rows tie at 1.0 -> lower index first
    assert i[1].tolist() == [1, 3, 0, 2]          # 0.5, then ties at 0 -> 0 before 2
    np.testing.assert_array_equal(s[0], [1, 1, 1, 0.5])            # products of 0, 0.5 and 1: exact


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 16, 64, 10_000])
def test_top_k_matches_brute_force_any_chunk_size(chunk_size):
    rng = np.random.default_rng(chunk_size)
    q, bank = int_data(rng, 9, 53, 5)             # many exact ties
    for k in (1, 5, 53):
        s, i = R.top_k(q, bank, k, chunk_size=chunk_size)
        rs, ri = brute_top_k(q, bank, k)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_array_equal(s, rs.astype(np.float32))


def test_top_k_bank_mask_and_query_blocks():
    rng = np.random.default_rng(1)
    q, bank = int_data(rng, 11, 40, 4)
    mask = rng.random(40) < 0.5
    nv = int(mask.sum())
    s, i = R.top_k(q, bank, nv, chunk_size=6, bank_mask=mask, query_block=4)
    rs, ri = brute_top_k(q, bank, nv, mask)
    np.testing.assert_array_equal(i, ri)
    assert mask[i].all()
    with pytest.raises(InputError, match=r"^k: k=\d+ is larger"):
        R.top_k(q, bank, nv + 1, bank_mask=mask)


def test_top_k_bad_inputs_name_the_argument():
    q = np.zeros((2, 3), np.float32)
    bank = np.zeros((4, 3), np.float32)
    with pytest.raises(InputError, match=r"^k: k=5 is larger than the number of \(valid\) bank rows \(4\)"):
        R.top_k(q, bank, 5)
    with pytest.raises(InputError, match="^k:"):
        R.top_k(q, bank, 0)
    with pytest.raises(InputError, match="^bank:.*dim"):
        R.top_k(q, np.zeros((4, 2), np.float32), 1)
    with pytest.raises(InputError, match="^queries:"):
        R.top_k(np.zeros(3, np.float32), bank, 1)
    with pytest.raises(InputError, match="^chunk_size:"):
        R.top_k(q, bank, 1, chunk_size=0)
    s, i = R.top_k(np.zeros((0, 3), np.float32), bank, 2)
    assert s.shape == (0, 2) and i.shape == (0, 2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("on_device", [False, True])
def test_top_k_refuses_a_non_finite_query_or_bank_row_naming_it(bad, on_device):
    """A NaN bank row scored NaN, which top_k ranks first: bank[3] = nan came back as every
    query's best ([[3, 0]]); a NaN query had NaN scores. Each is an InputError naming the
    argument and the row. A row bank_mask drops is never scored and may hold anything, and
    finite rows whose entries sum past float32 (the check's shortcut) are ranked as before."""
    rng = np.random.default_rng(0)
    q, bank = int_data(rng, 3, 12, 4)
    put = jnp.asarray if on_device else np.asarray
    for row in (0, 3, 11):
        b = bank.copy()
        b[row, 2] = bad
        with pytest.raises(InputError, match=rf"^bank: row {row} holds NaN or inf"):
            R.top_k(q, put(b), 2, chunk_size=5)
        keep = np.arange(12) != row
        s, i = R.top_k(q, put(b), 2, chunk_size=5, bank_mask=keep)
        rs, ri = brute_top_k(q, bank, 2, keep)
        np.testing.assert_array_equal(i, ri)
    for row in (0, 2):
        qq = q.copy()
        qq[row, 1] = bad
        with pytest.raises(InputError, match=rf"^queries: row {row} holds NaN or inf"):
            R.top_k(qq, put(bank), 2)
    probes = np.stack([q, q], axis=1)                      # (3, 2, 4)
    probes[1, 1, 0] = bad
    with pytest.raises(InputError, match=r"^probes: query 1, probe 1 holds NaN or inf"):
        R.multi_probe_top_k(probes, bank, 2)
    pm = np.ones((3, 2), bool)
    pm[1, 1] = False                                        # an ignored probe may hold anything
    np.testing.assert_array_equal(R.multi_probe_top_k(probes, bank, 2, probe_mask=pm)[1], brute_top_k(q, bank, 2)[1])
    big = np.full((3, 4), 1e38, np.float32) * np.array([[1], [0.5], [0.25]], np.float32)  # each row sums to inf
    np.testing.assert_array_equal(R.top_k(np.array([[1e-38, 0, 0, 0]], np.float32), big, 3)[1], [[0, 1, 2]])


def test_top_k_large_bank_against_numpy():
    """>= 200,000 x 384 bank, default chunking (last chunk partial), subset checked."""
    rng = np.random.default_rng(0)
    n, d = 200_003, 384
    bank = rng.standard_normal((n, d), dtype=np.float32)
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    q = rng.standard_normal((24, d), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    k = 50
    s, i = R.top_k(q, bank, k)                    # chunk_size=65536 -> 4 chunks
    sub = np.arange(0, 24, 3)
    rs, ri = brute_top_k(q[sub], bank, k)
    # float32 scores against float64 ones: each within the float32 bound of its dot product, and a
    # sorted list of values moves by no more than its largest value does
    bound = f32_error(lambda x, b: b @ x.T, q[sub], bank).max(axis=0)[:, None]   # one pass: (n, 8) -> per query
    assert_f32_close(s[sub], rs, bound)
    same = i[sub] == ri
    # any disagreement may only be a float near-tie
    assert same.mean() > 0.99 and np.all((np.abs(s[sub] - rs) <= bound)[~same])
    # smaller chunks give the same answer
    s2, i2 = R.top_k(q[sub], bank, k, chunk_size=30_000)
    np.testing.assert_array_equal(i2, i[sub])


def _all_shapes(jaxpr):
    out = []
    for eqn in jaxpr.eqns:
        out.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for p in eqn.params.values():
            subs = p if isinstance(p, (list, tuple)) else [p]
            for sub in subs:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    out.extend(_all_shapes(inner))
                elif hasattr(sub, "eqns"):
                    out.extend(_all_shapes(sub))
    return out


def test_million_row_bank_never_materialises_q_by_n():
    """Trace (no data) a 1,000,000 x 384 bank: no intermediate has N columns."""
    n, d, q, k, chunk = 1_000_000, 384, 64, 20, 65536
    n_chunks = math.ceil(n / chunk)
    args = (jax.ShapeDtypeStruct((q, d), jnp.float32), jax.ShapeDtypeStruct((n, d), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.bool_))
    jaxpr = jax.make_jaxpr(lambda a, b, m: R._top_k_jit(a, b, m, k=k, chunk=chunk,
                                                       n_chunks=n_chunks))(*args)
    shapes = _all_shapes(jaxpr.jaxpr)
    assert (q, chunk) in shapes                   # scores exist only per chunk
    assert not any(len(s) >= 2 and s[-1] >= n for s in shapes), "a (., N) array appears"
    assert max(int(np.prod(s)) for s in shapes if len(s) >= 2 and s[0] == q) <= q * chunk


# --------------------------------------------------------------------------- multi-probe
def multi_probe_reference(probes, bank, k):
    """The definition: union of each probe's top-k, de-duplicated, scored by best probe."""
    out_s, out_i = [], []
    for pq in probes:
        cands = set()
        for p in pq:
            _, ii = brute_top_k(p[None], bank, k)
            cands.update(ii[0].tolist())
        cands = sorted(cands)
        score = {c: max(float(p @ bank[c]) for p in pq) for c in cands}
        order = sorted(cands, key=lambda c: (-score[c], c))[:k]
        out_i.append(order)
        out_s.append([score[c] for c in order])
    return np.array(out_s), np.array(out_i)


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_multi_probe_matches_union_definition(chunk_size):
    rng = np.random.default_rng(7)
    bank = rng.integers(-2, 3, (37, 6)).astype(np.float32)
    probes = rng.integers(-2, 3, (5, 3, 6)).astype(np.float32)
    for k in (1, 4, 10):
        s, i = R.multi_probe_top_k(probes, bank, k, chunk_size=chunk_size)
        rs, ri = multi_probe_reference(probes, bank, k)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_array_equal(s, rs)                   # small-integer dot products: exact


def test_multi_probe_single_probe_equals_top_k_and_probe_mask():
    rng = np.random.default_rng(3)
    q, bank = int_data(rng, 6, 30, 4)
    s1, i1 = R.multi_probe_top_k(q[:, None, :], bank, 7, chunk_size=8)
    s2, i2 = R.top_k(q, bank, 7, chunk_size=8)
    np.testing.assert_array_equal(i1, i2)
    # a masked-out probe is ignored: (q, garbage) with garbage masked == q alone
    probes = np.stack([q, 100 * np.ones_like(q)], axis=1)
    pm = np.array([[True, False]] * 6)
    _, i3 = R.multi_probe_top_k(probes, bank, 7, probe_mask=pm, chunk_size=8)
    np.testing.assert_array_equal(i3, i2)
    with pytest.raises(InputError, match="probe"):
        R.multi_probe_top_k(probes, bank, 7, probe_mask=np.zeros((6, 2), bool))
    with pytest.raises(InputError, match="^k:"):
        R.multi_probe_top_k(probes, bank, 31)


# --------------------------------------------------------------------------- candidates
def _user(n_m, n_q, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return UserData("u", rng.standard_normal((n_m, d)).astype(np.float32),
                    rng.standard_normal((n_q, d)).astype(np.float32),
                    np.zeros((n_q, n_m), bool), tuple(f"m{j}" for j in range(n_m)),
                    tuple(f"q{i}" for i in range(n_q)), ("",) * n_q, np.zeros(n_q, bool))


def test_retrieve_candidates_pads_small_banks():
    u = _user(3, 4)
    idx, mask = R.retrieve_candidates(u, 5)
    assert idx.shape == (4, 5) and idx.dtype == np.int32 and mask.dtype == bool
    assert mask[:, :3].all() and not mask[:, 3:].any()
    assert (idx[:, 3:] == 0).all()
    _, ref = brute_top_k(u.query_emb, u.memory_emb, 3)
    np.testing.assert_array_equal(idx[:, :3], ref)
    # big enough bank: plain top-k, all valid
    u2 = _user(30, 2, seed=1)
    idx2, mask2 = R.retrieve_candidates(u2, 5)
    assert mask2.all()
    np.testing.assert_array_equal(idx2, brute_top_k(u2.query_emb, u2.memory_emb, 5)[1])
    # empty bank / no queries
    idx3, mask3 = R.retrieve_candidates(_user(0, 2), 4)
    assert idx3.shape == (2, 4) and not mask3.any()
    assert R.retrieve_candidates(_user(5, 0), 4)[0].shape == (0, 4)
    with pytest.raises(InputError, match="^k:"):
        R.retrieve_candidates(u, 0)


# --------------------------------------------------------------------------- metrics
def test_metrics_hand_computed():
    rel = np.array([
        [1, 0, 1, 0, 0],   # gold 2, both in list at ranks 1 and 3
        [0, 0, 0, 1, 0],   # gold 3, one found at rank 4
        [0, 0, 0, 0, 0],   # gold 1, missed
        [1, 1, 0, 0, 0],   # gold 2, at ranks 1, 2
    ], bool)
    ng = np.array([2, 3, 1, 2])
    # float32 metrics against exact values, within their float32 bounds (exact where representable)
    check = lambda f, k, want, r=rel, g=ng: assert_f32_close(f(r, g, k), want, metric_bound(f, r, g, k))
    check(M.recall_at_k, 1, [0.5, 0, 0, 0.5])
    check(M.recall_at_k, 3, [1.0, 0, 0, 1.0])
    check(M.recall_at_k, 5, [1.0, 1 / 3, 0, 1.0])
    check(M.recall_at_k, 50, [1.0, 1 / 3, 0, 1.0])
    check(M.recall_any_at_k, 3, [1, 0, 0, 1])
    check(M.recall_any_at_k, 4, [1, 1, 0, 1])
    check(M.recall_all_at_k, 2, [0, 0, 0, 1])
    check(M.recall_all_at_k, 5, [1, 0, 0, 1])
    assert_f32_close(M.mrr(rel), [1.0, 0.25, 0.0, 1.0], f32_error(M.mrr, rel))
    # NDCG@3, row 0: (1 + 1/log2 4) / (1 + 1/log2 3); row 3: 1
    check(M.ndcg_at_k, 3, [(1 + 0.5) / (1 + 1 / math.log2(3)), 0.0, 0.0, 1.0])
    # NDCG@5 row 1: 1/log2(5) over ideal of 3 gold = 1 + 1/log2 3 + 1/2
    nd5, want = np.asarray(M.ndcg_at_k(rel, ng, 5)), (1 / math.log2(5)) / (1 + 1 / math.log2(3) + 0.5)
    assert_f32_close(nd5[1], want, metric_bound(M.ndcg_at_k, rel, ng, 5)[1])
    # ideal uses min(num_gold, k): 3 gold, k=1, rank-1 hit -> 1.0
    check(M.ndcg_at_k, 1, [1.0], np.array([[1, 0]], bool), np.array([3]))
    # num_gold == 0 gives 0 (callers exclude these)
    z = np.zeros((1, 3), bool)
    for f in (M.recall_at_k, M.recall_all_at_k, M.ndcg_at_k):
        assert float(f(z, np.array([0]), 3)[0]) == 0.0
    with pytest.raises(InputError, match="^k:"):
        M.recall_at_k(rel, ng, 0)


def py_metrics(rel_row, ng, k):
    """Brute-force python reference for one query."""
    top = [bool(x) for x in rel_row[:k]]
    found = sum(top)
    rec = found / ng if ng else 0.0
    any_ = float(found > 0)
    all_ = float(ng > 0 and found >= ng)
    dcg = sum(1 / math.log2(r + 2) for r, x in enumerate(top) if x)
    idcg = sum(1 / math.log2(r + 2) for r in range(min(ng, k)))
    nd = dcg / idcg if idcg else 0.0
    first = next((r for r, x in enumerate(rel_row) if x), None)
    rr = 0.0 if first is None else 1 / (first + 1)
    return rec, any_, all_, nd, rr


@pytest.mark.parametrize("seed", range(5))
def test_metrics_random_against_python(seed):
    rng = np.random.default_rng(seed)
    q, length = 40, int(rng.integers(1, 25))
    rel = rng.random((q, length)) < rng.uniform(0.05, 0.5)
    ng = rel.sum(1) + rng.integers(0, 3, q)       # gold may lie outside the list
    for k in (1, 3, 5, 10, 30):
        fs = (M.recall_at_k, M.recall_any_at_k, M.recall_all_at_k, M.ndcg_at_k, lambda r, g, k: M.mrr(r))
        got = [np.asarray(f(rel, ng, k)) for f in fs]
        bounds = [metric_bound(f, rel, ng, k) for f in fs]        # float32 against Python's float64
        for i in range(q):
            ref = py_metrics(rel[i], int(ng[i]), k)
            for g, r, b in zip(got, ref, bounds):
                assert_f32_close(g[i], r, b[i])


def test_metrics_are_jittable():
    rel = jnp.array([[True, False, True]])
    ng = jnp.array([2])

    @jax.jit
    def f(r, g):
        return (M.recall_at_k(r, g, 2) + M.ndcg_at_k(r, g, 2) + M.recall_all_at_k(r, g, 3)
                + M.recall_any_at_k(r, g, 1) + M.mrr(r))

    expected = 0.5 + 1 / (1 + 1 / math.log2(3)) + 1 + 1 + 1
    assert_f32_close(f(rel, ng)[0], expected, f32_error(f, rel, ng)[0])


def test_summarize_overall_and_groups():
    per_q = {"r": np.array([1.0, 0.5, 0.0, 0.25]), "m": np.array([1.0, 1.0, 0.0, 0.0])}
    valid = np.array([True, True, False, True])
    groups = {"user": np.array(["a", "a", "b", "b"]), "category": np.array([1, 2, 2, 2])}
    s = M.summarize(per_q, valid, groups)                   # float64 means: approx's default rel 1e-6 is ample
    assert s["overall"] == {"r": pytest.approx(1.75 / 3), "m": pytest.approx(2 / 3), "n": 3}
    assert s["per_user"]["a"] == {"r": 0.75, "m": 1.0, "n": 2}
    assert s["per_user"]["b"] == {"r": 0.25, "m": 0.0, "n": 1}
    assert s["per_category"]["1"]["n"] == 1 and s["per_category"]["2"]["r"] == pytest.approx(0.375)
    s2 = M.summarize(per_q, np.array([True, True, False, False]), groups)
    assert s2["per_user"]["b"] == {"r": None, "m": None, "n": 0}
    with pytest.raises(InputError, match="per_query"):
        M.summarize({"r": np.zeros(3)}, valid)


def test_the_ceiling_is_the_best_order_of_the_candidates_by_brute_force():
    """online.summary.ceiling_values: the Recall@m and NDCG@m of every gold candidate first
    equal the best over every order of the K candidates (enumerated), and bound the retriever's."""
    import itertools
    from types import SimpleNamespace

    from rmm_jax.online.summary import base_values, ceiling_values
    rng = np.random.default_rng(3)
    t, k, m = 40, 5, 2
    gold = rng.random((t, k)) < 0.3
    mask = np.ones((t, k), bool)
    mask[::7, -1] = False                                   # a padded candidate is never counted
    num_gold = gold.sum(1) + rng.integers(0, 2, t)          # some gold outside the candidates
    s = SimpleNamespace(cand_gold=gold, cand_mask=mask, num_gold=num_gold)
    rec, nd = (np.asarray(x, np.float64) for x in ceiling_values(s, m))
    best_r, best_n = np.zeros(t), np.zeros(t)
    for order in itertools.permutations(range(k)):
        rel = (gold & mask)[:, list(order)][:, :m]
        best_r = np.maximum(best_r, np.asarray(M.recall_at_k(rel, num_gold, m), np.float64))
        best_n = np.maximum(best_n, np.asarray(M.ndcg_at_k(rel, num_gold, m), np.float64))
    assert np.array_equal(rec, best_r) and np.array_equal(nd, best_n)
    base_r, base_n = (np.asarray(x, np.float64) for x in base_values(s, m))
    assert (rec >= base_r).all() and (nd >= base_n).all() and (rec > base_r).any()


@pytest.mark.parametrize("fn", ["recall_at_k", "recall_any_at_k", "recall_all_at_k", "ndcg_at_k", "mrr"])
@pytest.mark.parametrize("rel, num_gold, where", [
    (np.array([[0.3, 0.0, 0.0]]), np.array([1]), "rel"),        # was Recall@2 0.3: 0.3 of a hit
    (np.array([[2, 0, 0]]), np.array([2]), "rel"),              # was Recall@2 1.0: one gold counted twice
    (np.array([True, False, True]), np.array([1]), "rel"),      # was an IndexError
    (np.array([[True, False, True]]), np.array([1, 2]), "num_gold"),   # was a (2,) result for one query
])
def test_metrics_refuse_a_rel_or_num_gold_of_the_wrong_kind(fn, rel, num_gold, where, variant):
    if where == "num_gold" and fn in ("recall_any_at_k", "mrr"):
        pytest.skip("reads no num_gold")
    f = getattr(M, fn)
    call = variant(lambda r, g: f(r) if fn == "mrr" else f(r, g, 2))
    with pytest.raises(InputError, match=rf"^{where}: expected"):
        call(jnp.asarray(rel), jnp.asarray(num_gold))
