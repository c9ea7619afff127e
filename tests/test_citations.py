"""Tests for rmm_jax.data.citations: the citation simulators (precision/recall, class-calibrated,
position), answer support, the parser, the prompt."""
from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_f32_close, f32_error
from hypothesis import given, settings
from hypothesis import strategies as st

from rmm_jax.data.citations import (
    ANSWER_THRESHOLD,
    ANSWER_TOP_C,
    DEFAULT_PRECISION,
    DEFAULT_RECALL,
    JUDGE_TABLE,
    JUDGE_USEFUL_SHARE,
    P_OTHER,
    P_USEFUL,
    POSITION_DECAY,
    SPURIOUS,
    answer_support,
    class_cite,
    false_cite_prob,
    oracle,
    oracle_cite,
    position_oracle,
)
from rmm_jax.data.prompt import RMM_PROMPT_TEMPLATE, format_prompt, parse_citations
from rmm_jax.errors import InputError

M = 8
N_CALLS = 80_000


# ---------------------------------------------------------------------------
# oracle_cite: calibration
# ---------------------------------------------------------------------------

def _patterns(seed: int, n: int = N_CALLS, m: int = M) -> tuple[np.ndarray, np.ndarray]:
    """Varied (is_gold, valid) patterns: 1..m valid slots, gold rate per call in 0..1."""
    rng = np.random.default_rng(seed)
    n_valid = rng.integers(1, m + 1, size=n)
    valid = np.arange(m)[None, :] < n_valid[:, None]
    gold_rate = rng.choice([0.0, 0.1, 0.25, 0.5, 0.75, 1.0], size=n)
    is_gold = rng.random((n, m)) < gold_rate[:, None]
    # Padded slots get random gold flags too: they must be ignored anyway.
    return is_gold, valid


def _raw_q(is_gold, valid, p, r):
    g = (is_gold & valid).sum(-1).astype(np.float64)
    ng = (~is_gold & valid).sum(-1).astype(np.float64)
    return r * g * (1 - p) / (p * np.maximum(ng, 1)), g, ng


def _simulate(seed, is_gold, valid, p, r):
    keys = jax.random.split(jax.random.key(seed), is_gold.shape[0])
    fn = jax.jit(jax.vmap(lambda k, g, v: oracle_cite(k, g, v, precision=p, recall=r)))
    return np.asarray(fn(keys, jnp.asarray(is_gold), jnp.asarray(valid)))


def _rates(cited, is_gold, valid):
    tp = (cited & is_gold & valid).sum()
    recall = tp / (is_gold & valid).sum()
    precision = tp / cited.sum()
    return float(recall), float(precision)


TOL = 0.01  # >= 6 standard errors: ~1e5 gold slots and ~8e4 citations per setting


@pytest.mark.parametrize("p, r, seed", [
    (DEFAULT_PRECISION, DEFAULT_RECALL, 0),
    (0.7, 0.6, 1),
    (0.95, 0.99, 2),
    (0.5, 0.3, 3),
])
def test_empirical_precision_and_recall_match_settings(p, r, seed):
    """Over calls where the target is reachable - q not clipped and at least one
    non-gold memory selected (with none, no false citation is possible) - the
    aggregate precision and recall match the settings. Calls without gold count too
    (they cite nothing). Adding the unreachable calls only raises precision."""
    is_gold, valid = _patterns(seed)
    raw_q, _, n_nongold = _raw_q(is_gold, valid, p, r)
    reachable = (raw_q <= 1.0) & (n_nongold > 0)
    assert reachable.sum() >= 50_000
    cited = _simulate(seed, is_gold, valid, p, r)
    assert not (cited & ~valid).any()
    recall, precision = _rates(cited[reachable], is_gold[reachable], valid[reachable])
    assert abs(recall - r) < TOL, (recall, r)
    assert abs(precision - p) < TOL, (precision, p)
    recall_all, precision_all = _rates(cited, is_gold, valid)
    assert abs(recall_all - r) < TOL
    assert precision_all >= precision


def _all_counts(width: int, min_gold: int = 0):
    """One call per (n_gold, n_nongold) with n_nongold >= 1 and n_gold + n_nongold <= width:
    gold slots first, then non-gold, then padding."""
    counts = [(g, ng) for g in range(min_gold, width) for ng in range(1, width - g + 1)]
    slot = np.arange(width)[None, :]
    g = np.array([c[0] for c in counts])[:, None]
    ng = np.array([c[1] for c in counts])[:, None]
    return counts, slot < g, slot < g + ng


def test_defaults_never_clip_for_m_up_to_9():
    """Documented: with the defaults q clips only when n_gold / n_nongold > ~8.23, which
    cannot happen for M <= 9. Checked on the code: false_cite_prob (default rates) is
    the unclipped formula, below 1, for every gold/non-gold count of up to 9 selected
    memories, and it does clip at M = 10 (9 gold, 1 non-gold), so the bound is tight."""
    p, r = DEFAULT_PRECISION, DEFAULT_RECALL
    counts, is_gold, valid = _all_counts(9)
    q = np.asarray(false_cite_prob(is_gold, valid))
    raw, _, _ = _raw_q(is_gold, valid, p, r)
    assert np.all(q < 1.0), [c for c, x in zip(counts, q) if x >= 1.0]
    assert_f32_close(q, raw, f32_error(false_cite_prob, is_gold, valid))      # float32 against float64
    ten_gold = np.arange(10) < 9
    assert float(false_cite_prob(ten_gold, np.ones(10, bool))) == 1.0


def test_defaults_hit_target_precision_and_recall_for_every_selection_up_to_m_9():
    """Because q never clips for M <= 9, every single selection pattern with gold and
    non-gold memories (not just the aggregate over a workload) is cited with the paper's
    precision 0.876 and recall 0.858. Per pattern, 20,000 simulated calls with the
    default rates; each measured rate must be within 5 standard errors of its target
    (SE = sqrt(x (1 - x) / n), n = citations for precision, gold slots for recall;
    ~0.0024 and ~0.0025 at worst, fixed seed), and so must the precision pooled over
    all patterns (SE ~0.0002, which catches a q off by a few percent)."""
    p, r, n = DEFAULT_PRECISION, DEFAULT_RECALL, 20_000
    counts, is_gold, valid = _all_counts(9, min_gold=1)
    assert len(counts) == 36
    cited = _simulate(13, np.repeat(is_gold, n, 0), np.repeat(valid, n, 0), p, r).reshape(len(counts), n, -1)
    assert not (cited & ~valid[:, None, :]).any()
    for (g, ng), c, gold in zip(counts, cited, is_gold):
        tp = int(c[:, gold].sum())
        n_cited = int(c.sum())
        precision, recall = tp / n_cited, tp / (g * n)
        assert abs(precision - p) < 5 * math.sqrt(p * (1 - p) / n_cited), (g, ng, precision)
        assert abs(recall - r) < 5 * math.sqrt(r * (1 - r) / (g * n)), (g, ng, recall)
    # Pooled over all patterns (each has expected precision p): ~2e6 citations, SE ~2e-4.
    _, precision = _rates(cited, np.repeat(is_gold[:, None], n, 1), np.repeat(valid[:, None], n, 1))
    assert abs(precision - p) < 5 * math.sqrt(p * (1 - p) / cited.sum()), precision


def test_clipped_q_gives_precision_above_target():
    p, r = 0.5, 0.9
    n = 50_000
    is_gold = np.zeros((n, M), bool)
    is_gold[:, :6] = True  # 6 gold, 1 non-gold: raw q = 0.9 * 6 = 5.4 -> 1
    valid = np.zeros((n, M), bool)
    valid[:, :7] = True
    q = np.asarray(false_cite_prob(is_gold, valid, precision=p, recall=r))
    assert np.all(q == 1.0)
    cited = _simulate(7, is_gold, valid, p, r)
    assert cited[:, 6].all()  # every non-gold slot cited
    _, precision = _rates(cited, is_gold, valid)
    assert precision > p + 0.3  # ~ 5.4 / 6.4 = 0.84


def test_per_call_q_beats_fixed_false_citation_rate():
    """Per-call q hits the target; a fixed q = 1 - precision (the naive reading of a
    "false citation rate") over-cites non-gold memories and loses precision."""
    p, r, seed = DEFAULT_PRECISION, DEFAULT_RECALL, 11
    is_gold, valid = _patterns(seed)
    keys = jax.random.split(jax.random.key(seed), is_gold.shape[0])
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (M,), dtype=jnp.float32))(keys))
    cited = _simulate(seed, is_gold, valid, p, r)
    # Same uniforms: oracle_cite thresholds u against the per-slot probability.
    q = np.asarray(false_cite_prob(is_gold, valid, precision=p, recall=r))
    again = valid & (u < np.where(is_gold, np.float32(r), q[:, None]))
    np.testing.assert_array_equal(cited, again)
    fixed = valid & (u < np.where(is_gold, np.float32(r), np.float32(1 - p)))
    _, prec_oracle = _rates(cited, is_gold, valid)
    _, prec_fixed = _rates(fixed, is_gold, valid)
    assert prec_oracle >= prec_fixed
    # On calls with a non-gold memory selected (no clipping with the defaults):
    ok = (~is_gold & valid).any(-1)
    _, prec_oracle = _rates(cited[ok], is_gold[ok], valid[ok])
    _, prec_fixed = _rates(fixed[ok], is_gold[ok], valid[ok])
    assert abs(prec_oracle - p) < TOL
    assert prec_fixed < p - 0.05


def test_false_cite_prob_formula():
    is_gold = np.array([[1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0],
                        [1, 1, 1, 0, 0, 0]], bool)
    valid = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                      [1, 1, 1, 0, 0, 0]], bool)
    p, r = 0.8, 0.6
    q = np.asarray(false_cite_prob(is_gold, valid, precision=p, recall=r))
    assert q.dtype == np.float32
    bound = f32_error(lambda g, v: false_cite_prob(g, v, precision=p, recall=r), is_gold, valid)
    assert_f32_close(q[0], r * 2 * (1 - p) / (p * 3), bound[0])             # float32 against float64
    assert_f32_close(q[1], r * 1 * (1 - p) / (p * 2), bound[1])
    assert q[2] == 0.0          # no gold selected -> q = 0 (nothing cited)
    assert math.isfinite(q[3])  # no non-gold: finite, unused


# ---------------------------------------------------------------------------
# oracle_cite: masking, edge cases, determinism, transforms
# ---------------------------------------------------------------------------

def test_masked_slots_never_cited_even_when_gold():
    is_gold, valid = _patterns(5, n=20_000)
    cited = _simulate(5, is_gold, valid, 0.6, 1.0)
    assert not (cited & ~valid).any()
    # With recall 1 every valid gold slot is cited.
    assert (cited[is_gold & valid]).all()


def test_precision_one_gives_no_false_citations():
    is_gold, valid = _patterns(6, n=20_000)
    cited = _simulate(6, is_gold, valid, 1.0, DEFAULT_RECALL)
    assert not (cited & ~is_gold).any()
    assert cited.any()


def test_no_gold_selected_cites_nothing():
    is_gold = np.zeros((5_000, M), bool)
    valid = np.ones((5_000, M), bool)
    assert not _simulate(8, is_gold, valid, 0.3, 1.0).any()


def test_recall_zero_cites_nothing_and_recall_one_precision_one_is_exact():
    is_gold, valid = _patterns(9, n=5_000)
    assert not _simulate(9, is_gold, valid, DEFAULT_PRECISION, 0.0).any()
    np.testing.assert_array_equal(_simulate(9, is_gold, valid, 1.0, 1.0), is_gold & valid)


def test_seeded_and_jit_vmap_consistent():
    key = jax.random.key(42)
    g = jnp.array([True, False, True, False, False, True], dtype=jnp.bool_)
    v = jnp.array([True, True, True, True, True, False], dtype=jnp.bool_)
    a = oracle_cite(key, g, v)
    b = oracle_cite(key, g, v)
    c = jax.jit(oracle_cite)(key, g, v)
    d = jax.jit(oracle_cite, static_argnames=("precision", "recall"))(key, g, v, precision=0.5,
                                                                      recall=0.9)
    assert a.dtype == jnp.bool_ and a.shape == (6,) and d.shape == (6,)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    keys = jax.random.split(key, 16)
    batched = jax.vmap(oracle_cite, in_axes=(0, None, None))(keys, g, v)
    for i in range(16):
        np.testing.assert_array_equal(batched[i], oracle_cite(keys[i], g, v))
    assert len({tuple(np.asarray(x)) for x in batched}) > 1  # different keys differ
    # Legacy uint32 keys work too.
    np.testing.assert_array_equal(oracle_cite(jax.random.PRNGKey(0), g, v),
                                  oracle_cite(jax.random.PRNGKey(0), g, v))


@pytest.mark.parametrize("kw, name", [
    ({"precision": 0.0}, "precision"), ({"precision": 1.5}, "precision"),
    ({"precision": float("nan")}, "precision"), ({"precision": True}, "precision"),
    ({"precision": "0.9"}, "precision"), ({"precision": -0.1}, "precision"),
    ({"recall": -0.1}, "recall"), ({"recall": 1.01}, "recall"),
    ({"recall": float("inf")}, "recall"), ({"recall": None}, "recall"),
])
def test_rate_validation(kw, name):
    g = jnp.zeros(4, dtype=jnp.bool_)
    with pytest.raises(InputError, match=f"argument '{name}'"):
        oracle_cite(jax.random.key(0), g, g, **kw)


def test_rate_accepts_numpy_scalars_and_boundaries():
    g = jnp.array([True, False, True, False], dtype=jnp.bool_)
    oracle_cite(jax.random.key(0), g, g, precision=np.float32(0.5), recall=np.float64(0.0))
    oracle_cite(jax.random.key(0), g, g, precision=1, recall=1)


def test_traced_rate_is_input_error():
    g = jnp.array([True, False, True, False], dtype=jnp.bool_)
    with pytest.raises(InputError, match="argument 'precision'.*static"):
        jax.jit(lambda k, p: oracle_cite(k, g, g, precision=p))(jax.random.key(0), 0.5)


def test_shape_mismatch_is_input_error():
    with pytest.raises(InputError, match="argument 'valid'"):
        oracle_cite(jax.random.key(0), jnp.zeros(4, bool), jnp.zeros(5, bool))
    with pytest.raises(InputError, match="argument 'is_gold'"):
        oracle_cite(jax.random.key(0), jnp.bool_(True), jnp.bool_(True))


# ---------------------------------------------------------------------------
# Class-calibrated simulator (oracle), position model
# ---------------------------------------------------------------------------

def _draw(cite_fn, seed, is_gold, valid):
    """The cite_fn as the loop calls it: jitted, vmapped over calls, one key per call."""
    keys = jax.random.split(jax.random.key(seed), is_gold.shape[0])
    return np.asarray(jax.jit(jax.vmap(cite_fn))(keys, jnp.asarray(is_gold), jnp.asarray(valid)))


def _class_rates(cited, is_gold, valid):
    """Empirical P(cite | useful), P(cite | not useful, call shows a useful one),
    P(cite | call shows none useful), each with its number of trials."""
    useful = is_gold & valid
    any_useful = useful.any(-1, keepdims=True)
    groups = {"useful": useful, "other": valid & ~is_gold & any_useful, "spurious": valid & ~any_useful}
    return {k: (float(cited[g].mean()), int(g.sum())) for k, g in groups.items()}


def _close(rate, n, p, z=5.0):
    """|rate - p| within z binomial standard deviations (exact when p is 0 or 1)."""
    return abs(rate - p) <= z * math.sqrt(p * (1 - p) / n) + 1e-12


def test_judge_constants_follow_the_class_rows():
    """The documented derivation: P(cite|useful) = R(Useful), P(cite|not useful) =
    1 - R(Not-useful), spurious = that same rate."""
    assert P_USEFUL == JUDGE_TABLE["useful"][1] == 0.911
    assert P_OTHER == pytest.approx(1 - JUDGE_TABLE["not_useful"][1], abs=1e-12)    # float64 constants
    assert SPURIOUS == P_OTHER
    assert JUDGE_TABLE["overall"] == (DEFAULT_PRECISION, DEFAULT_RECALL)


def test_implied_share_reproduces_the_table_precisions():
    """The two recalls and the share pi of useful memories fix both precisions; pi = 0.585
    must give the table's 89.4 / 87.2 to within the rounding of its inputs (0.2 point)."""
    pi, a, b = JUDGE_USEFUL_SHARE, P_USEFUL, P_OTHER
    p_useful = pi * a / (pi * a + (1 - pi) * b)
    p_not = (1 - pi) * (1 - b) / ((1 - pi) * (1 - b) + pi * (1 - a))
    assert abs(p_useful - JUDGE_TABLE["useful"][0]) < 0.002
    assert abs(p_not - JUDGE_TABLE["not_useful"][0]) < 0.002


@pytest.mark.parametrize("p_useful, p_other, spurious, seed", [
    (P_USEFUL, P_OTHER, SPURIOUS, 0),
    (0.6, 0.3, 0.05, 1),
    (0.35, 0.0, 0.5, 2),
    (1.0, 0.0, 0.0, 3),
])
def test_oracle_per_class_rates_match(p_useful, p_other, spurious, seed):
    """80,000 varied calls (M = 8, 1..8 filled slots, useful share 0..1 per call): each
    class's empirical cite rate is within 5 binomial s.d. of its setting (exact at 0 and
    1); padded slots are never cited, even when flagged useful."""
    is_gold, valid = _patterns(seed)
    cited = _draw(oracle(p_useful=p_useful, p_other=p_other, spurious=spurious), seed, is_gold, valid)
    assert not (cited & ~valid).any()
    rates = _class_rates(cited, is_gold, valid)
    for name, p in (("useful", p_useful), ("other", p_other), ("spurious", spurious)):
        rate, n = rates[name]
        assert n > 30_000, (name, n)
        assert _close(rate, n, p), (name, rate, p, n)


def test_default_oracle_reproduces_the_judge_table():
    """Shown memories useful i.i.d. with the implied share 0.585: the simulated citations,
    scored against the labels like the paper's judge table, give each class's P and R to
    within 0.002 (the derivation's rounding) plus 5 s.d. (1.2e6 memories, >= 4e5 per
    denominator)."""
    rng = np.random.default_rng(4)
    n, m = 240_000, 5
    is_gold = rng.random((n, m)) < JUDGE_USEFUL_SHARE
    valid = np.ones((n, m), bool)
    cited = _draw(oracle(), 4, is_gold, valid)
    tp, fp = (cited & is_gold).sum(), (cited & ~is_gold).sum()
    fn, tn = (~cited & is_gold).sum(), (~cited & ~is_gold).sum()
    got = {"useful": (tp / (tp + fp), tp / (tp + fn)), "not_useful": (tn / (tn + fn), tn / (tn + fp))}
    for row, (p, r) in got.items():
        for measured, target in zip((p, r), JUDGE_TABLE[row]):
            sd = math.sqrt(target * (1 - target) / (n * m * 0.4))
            assert abs(measured - target) < 0.002 + 5 * sd, (row, measured, target)


def test_spurious_zero_is_no_cite_when_nothing_useful_and_spurious_fires_only_then():
    is_gold = np.zeros((20_000, M), bool)
    valid = np.ones((20_000, M), bool)
    assert not _draw(oracle(spurious=0.0), 5, is_gold, valid).any()
    cited = _draw(oracle(p_other=0.0, spurious=0.4), 5, is_gold, valid)
    assert _close(cited.mean(), cited.size, 0.4)
    # One useful memory shown: the other slots follow p_other (0 here), not spurious.
    is_gold[:, 3] = True
    cited = _draw(oracle(p_other=0.0, spurious=1.0), 5, is_gold, valid)
    assert not cited[:, [0, 1, 2, 4, 5, 6, 7]].any()
    # An unfilled useful slot does not count as "a useful memory is shown".
    valid[:, 3] = False
    cited = _draw(oracle(p_other=0.0, spurious=1.0), 5, is_gold, valid)
    np.testing.assert_array_equal(cited, valid)


def test_exact_oracle_cites_exactly_the_useful_shown_memories():
    is_gold, valid = _patterns(6, n=5_000)
    cited = _draw(oracle(p_useful=1.0, p_other=0.0, spurious=0.0), 6, is_gold, valid)
    np.testing.assert_array_equal(cited, is_gold & valid)


@pytest.mark.parametrize("decay", [POSITION_DECAY, 0.5])
def test_position_bias_decays_geometrically_per_slot(decay):
    """Every slot filled; per slot and class, the empirical rate is within 5 s.d. of
    rate * decay**slot, and the measured per-slot rates decrease."""
    rng = np.random.default_rng(7)
    n = 60_000
    is_gold = rng.random((n, M)) < 0.4
    is_gold[: n // 4] = False  # a quarter of the calls show nothing useful
    valid = np.ones((n, M), bool)
    cited = _draw(position_oracle(decay=decay), 7, is_gold, valid)
    any_useful = is_gold.any(-1)
    for j in range(M):
        factor = decay ** j
        for name, sel, p in (("useful", is_gold[:, j], P_USEFUL),
                             ("other", ~is_gold[:, j] & any_useful, P_OTHER),
                             ("spurious", ~any_useful, SPURIOUS)):
            rate = cited[sel, j].mean()
            assert _close(rate, int(sel.sum()), p * factor), (j, name, rate, p * factor)
    useful_by_slot = [cited[is_gold[:, j], j].mean() for j in range(M)]
    assert all(a > b for a, b in zip(useful_by_slot, useful_by_slot[1:]))


def test_position_decay_one_is_the_oracle_and_jit_matches_eager():
    key = jax.random.key(3)
    g = jnp.array([True, False, True, False, False, True, False, False])
    v = jnp.array([True, True, True, True, True, True, False, False])
    for fn in (oracle(), position_oracle(), oracle(p_useful=0.5, p_other=0.5, spurious=0.5)):
        eager = fn(key, g, v)
        assert eager.dtype == jnp.bool_ and eager.shape == (M,)
        np.testing.assert_array_equal(eager, jax.jit(fn)(key, g, v))
        keys = jax.random.split(key, 8)
        batched = jax.jit(jax.vmap(fn, in_axes=(0, None, None)))(keys, g, v)
        for i in range(8):
            np.testing.assert_array_equal(batched[i], fn(keys[i], g, v))
    # Same key, same uniforms: decay 1 is the oracle bit for bit; decay < 1 only removes citations.
    keys = jax.random.split(key, 2_000)
    gs = jnp.asarray(np.random.default_rng(0).random((2_000, M)) < 0.3)
    vs = jnp.ones((2_000, M), bool)
    base = jax.vmap(oracle())(keys, gs, vs)
    np.testing.assert_array_equal(base, jax.vmap(position_oracle(decay=1.0))(keys, gs, vs))
    biased = jax.vmap(position_oracle())(keys, gs, vs)
    assert not (biased & ~base).any() and (base & ~biased).any()
    np.testing.assert_array_equal(biased[:, 0], base[:, 0])


@pytest.mark.parametrize("kw, name", [
    ({"p_useful": 1.2}, "p_useful"), ({"p_useful": -0.1}, "p_useful"), ({"p_other": float("nan")}, "p_other"),
    ({"spurious": "0.1"}, "spurious"), ({"spurious": True}, "spurious"), ({"decay": 0.0}, "decay"),
    ({"decay": 1.5}, "decay"),
])
def test_class_rate_validation(kw, name):
    with pytest.raises(InputError, match=f"argument '{name}'"):
        position_oracle(**kw)
    with pytest.raises(InputError, match=f"argument '{name}'"):
        class_cite(jax.random.key(0), jnp.zeros(4, bool), jnp.ones(4, bool), **kw)


def test_oracle_rates_are_keyword_only_and_traced_rates_rejected():
    with pytest.raises(TypeError):
        oracle(0.9, 0.1)  # positional (precision, recall) is oracle_cite's; no silent mix-up
    g = jnp.array([True, False, False, False])
    with pytest.raises(InputError, match="argument 'p_useful'.*static"):
        jax.jit(lambda k, p: class_cite(k, g, g, p_useful=p))(jax.random.key(0), 0.5)


# ---------------------------------------------------------------------------
# answer_support
# ---------------------------------------------------------------------------

def _brute_support(qa, bank, cand, mask, top_c, threshold):
    """Loop-by-loop reference: rank the real candidates by (-similarity, position)."""
    t, k = cand.shape
    out = np.zeros((t, k), bool)
    for i in range(t):
        real = [j for j in range(k) if mask[i, j]]
        sims = {j: float(np.dot(qa[i].astype(np.float64), bank[cand[i, j]].astype(np.float64))) for j in real}
        ranked = sorted(real, key=lambda j: (-sims[j], j))
        keep = ranked if top_c is None else ranked[:top_c]
        for j in keep:
            if threshold is None or sims[j] >= threshold:
                out[i, j] = True
    return out


def _random_case(seed, t=40, n=30, k=12, d=16):
    rng = np.random.default_rng(seed)
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    bank, qa = unit(rng.normal(size=(n, d))), unit(rng.normal(size=(t, d)))
    cand = np.stack([rng.choice(n, size=k, replace=False) for _ in range(t)]).astype(np.int32)
    mask = np.arange(k)[None, :] < rng.integers(0, k + 1, size=t)[:, None]
    cand[~mask] = rng.integers(-5, 1000, size=(~mask).sum())  # padding is never read
    return qa, bank, cand, mask


@pytest.mark.parametrize("top_c, threshold", [
    (ANSWER_TOP_C, ANSWER_THRESHOLD), (1, None), (3, None), (2, 0.1), (None, 0.2), (None, -1.0), (50, None),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answer_support_matches_brute_force(top_c, threshold, seed):
    qa, bank, cand, mask = _random_case(seed)
    got = answer_support(qa, bank, cand, mask, top_c=top_c, threshold=threshold)
    assert got.dtype == bool and got.shape == cand.shape
    np.testing.assert_array_equal(got, _brute_support(qa, bank, cand, mask, top_c, threshold))
    assert not (got & ~mask).any()
    if top_c is not None:
        assert (got.sum(1) <= np.minimum(top_c, mask.sum(1))).all()


def test_answer_support_ties_go_to_the_earlier_candidate():
    qa = np.array([[1.0, 0.0]], np.float32)
    bank = np.array([[0.6, 0.8], [0.6, -0.8], [0.0, 1.0]], np.float32)  # memories 0 and 1 tie
    cand = np.array([[2, 1, 0]], np.int32)
    got = answer_support(qa, bank, cand, np.ones((1, 3), bool), top_c=1, threshold=None)
    np.testing.assert_array_equal(got, [[False, True, False]])


@pytest.mark.parametrize("top_c", [1, 2, 5, 9])
def test_answer_support_many_ties_match_brute_force(top_c):
    """40 candidates drawn from 4 memories: every rank limit cuts through ties, which go
    to the earlier candidates (a sort that is not stable fails this)."""
    qa, bank, _, _ = _random_case(9, t=30, n=4, k=4)
    cand = np.random.default_rng(9).integers(0, 4, size=(30, 40)).astype(np.int32)
    mask = np.ones(cand.shape, bool)
    got = answer_support(qa, bank, cand, mask, top_c=top_c, threshold=None)
    np.testing.assert_array_equal(got, _brute_support(qa, bank, cand, mask, top_c, None))


def test_answer_support_reads_no_gold():
    """No gold input exists: the result is a function of the embeddings and candidates only."""
    params = inspect.signature(answer_support).parameters
    assert list(params)[:4] == ["qa_emb", "bank", "cand", "cand_mask"]
    assert not any("gold" in p or "label" in p for p in params)


def test_answer_support_then_exact_oracle_cites_the_supported_shown_memories():
    """The online path: support precomputed per candidate (Stream.cite_gold), gathered to
    the shown slots, then cited inside jit."""
    qa, bank, cand, mask = _random_case(5, t=64, k=10)
    support = answer_support(qa, bank, cand, mask, top_c=2, threshold=None)
    rng = np.random.default_rng(5)
    selected = np.stack([rng.permutation(10)[:4] for _ in range(64)])
    filled = np.take_along_axis(mask, selected, 1)
    is_useful = np.take_along_axis(support, selected, 1) & filled
    cited = _draw(oracle(p_useful=1.0, p_other=0.0, spurious=0.0), 0, is_useful, filled)
    np.testing.assert_array_equal(cited, is_useful)


@pytest.mark.parametrize("kw, name", [
    ({"top_c": None, "threshold": None}, "top_c"), ({"top_c": 0}, "top_c"), ({"top_c": 1.5}, "top_c"),
    ({"top_c": True}, "top_c"), ({"threshold": float("nan")}, "threshold"), ({"threshold": "0.5"}, "threshold"),
])
def test_answer_support_rule_validation(kw, name):
    qa, bank, cand, mask = _random_case(0, t=3)
    with pytest.raises(InputError, match=f"argument '{name}'"):
        answer_support(qa, bank, cand, mask, **kw)


def test_answer_support_shape_validation():
    qa, bank, cand, mask = _random_case(0, t=3)
    with pytest.raises(InputError, match="argument 'qa_emb'"):
        answer_support(qa[:, :5], bank, cand, mask)
    with pytest.raises(InputError, match="argument 'cand'"):
        answer_support(qa, bank, cand[:2], mask[:2])
    with pytest.raises(InputError, match="argument 'cand_mask'"):
        answer_support(qa, bank, cand, mask[:, :3])
    bad = cand.copy()
    bad[0, 0], mask = 10_000, mask.copy()
    mask[0, 0] = True
    with pytest.raises(InputError, match="argument 'cand'"):
        answer_support(qa, bank, bad, mask)
    with pytest.raises(InputError, match="argument 'bank'"):
        answer_support(qa, bank[0], cand, mask)


# ---------------------------------------------------------------------------
# parse_citations
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, n, expected", [
    ("I went there. [1]", 5, (0,)),
    ("Yes [2, 3].", 5, (1, 2)),
    ("Yes [1,2]", 5, (0, 1)),
    ("see [Memory 3]", 5, (2,)),
    ("see [memory 3]", 5, (2,)),
    ("[M2]", 5, (1,)),
    ("[m2]", 5, (1,)),
    ("[Memory 1, Memory 4]", 5, (0, 3)),
    ("[M1][M3]", 5, (0, 2)),
    ("Nothing relevant.\nCitations: [NO_CITE]", 5, ()),
    ("[no_cite]", 5, ()),
    ("In [2023] we met [2]", 5, (1,)),
    ("[0] [6] [3]", 5, (2,)),
    ("[3] then [1] then [3, 1] again", 5, (2, 0)),
    ("[see above] [1, foo] [2]", 5, (1,)),
    ("no citations at all", 5, ()),
    ("[1]", 0, ()),
    ("[ 2 ; 4 ]", 5, (1, 3)),
    ("[Memory4]", 5, (3,)),
    ("Citations: [1, 3]", 3, (0, 2)),
    ("[]", 3, ()),
    ("[[2]]", 3, (1,)),
    ("[99999999999999999999999]", 3, ()),
])
def test_parse_examples(text, n, expected):
    assert parse_citations(text, n) == expected


def test_parse_validation():
    with pytest.raises(InputError, match="argument 'text'"):
        parse_citations(None, 3)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InputError, match="argument 'num_shown'"):
            parse_citations("[1]", bad)
    assert parse_citations("[2]", np.int64(3)) == (1,)


def _fmt_item(style: str, n: int, upper: bool) -> str:
    if style == "plain":
        return str(n)
    if style == "memory":
        return ("Memory " if upper else "memory ") + str(n)
    return ("M" if upper else "m") + str(n)


@st.composite
def _cited_text(draw):
    num_shown = draw(st.integers(1, 30))
    cites = draw(st.lists(st.integers(1, num_shown), min_size=0, max_size=12))
    filler = st.text(alphabet=st.characters(blacklist_characters="[]",
                                            blacklist_categories=("Cs",)), max_size=12)
    noise = st.sampled_from(["[NO_CITE]", "[2023]", "[0]", f"[{num_shown + 1}]",
                             "[see above]", "[1, foo]", "[]", "", "Memory [x]"])
    parts = [draw(filler)]
    i = 0
    while i < len(cites):
        size = draw(st.integers(1, len(cites) - i))
        group = cites[i:i + size]
        i += size
        sep = draw(st.sampled_from([",", ", ", " , ", ";", "; "]))
        items = [_fmt_item(draw(st.sampled_from(["plain", "memory", "m"])), n, draw(st.booleans()))
                 for n in group]
        parts.append("[" + sep.join(items) + "]")
        parts.append(draw(st.one_of(filler, noise)))
    if draw(st.booleans()):
        parts.append("\nCitations: " + draw(noise))
    expected = tuple(dict.fromkeys(n - 1 for n in cites))
    return "".join(parts), num_shown, expected


@settings(max_examples=200, deadline=None)
@given(_cited_text())
def test_parse_round_trip(case):
    text, num_shown, expected = case
    assert parse_citations(text, num_shown) == expected


@settings(max_examples=200, deadline=None)
@given(st.text(), st.integers(0, 50))
def test_parse_never_crashes_and_stays_in_range(text, n):
    out = parse_citations(text, n)
    assert isinstance(out, tuple)
    assert len(set(out)) == len(out)
    assert all(isinstance(i, int) and 0 <= i < n for i in out)


# ---------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------

def test_template_placeholders():
    assert "{memories}" in RMM_PROMPT_TEMPLATE and "{query}" in RMM_PROMPT_TEMPLATE
    assert "[NO_CITE]" in RMM_PROMPT_TEMPLATE and "Citations: [1, 3]" in RMM_PROMPT_TEMPLATE
    # Only the two documented placeholders.
    RMM_PROMPT_TEMPLATE.format(memories="", query="")


def test_format_prompt_numbers_memories_in_order():
    text = format_prompt("Where did I go {last} week?", ["I went to {Paris}.", "I like tea."])
    assert "Memory [1]: I went to {Paris}." in text
    assert "Memory [2]: I like tea." in text
    assert text.index("Memory [1]") < text.index("Memory [2]") < text.index("User: Where")
    assert "User: Where did I go {last} week?" in text
    assert "(no memories)" in format_prompt("hi", [])


def test_format_prompt_validation():
    with pytest.raises(InputError, match="argument 'query'"):
        format_prompt(3, ["a"])
    with pytest.raises(InputError, match="argument 'memories'"):
        format_prompt("q", "abc")
    with pytest.raises(InputError, match="argument 'memories'"):
        format_prompt("q", ["a", None])


def test_citation_model_chooses_by_name_and_its_error_words_as_simulate_did():
    """``citation_model`` is the one chooser of a citation model by name (simulate's
    ``--citations``, the benchmarks' ``_common.citation_model``); precision/recall replace the
    oracle only, and under the CLI's option names the error is simulate's line."""
    from rmm_jax.cli.shell import as_options
    from rmm_jax.data import citations as cm
    from rmm_jax.errors import InputError
    assert cm.citation_model("oracle").keywords == cm.oracle().keywords
    assert cm.citation_model("position").keywords == cm.position_oracle().keywords
    assert cm.citation_model("answer").keywords == cm.oracle(p_useful=1.0, p_other=0.0, spurious=0.0).keywords
    assert cm.citation_model("precision_recall").keywords == {"precision": cm.DEFAULT_PRECISION,
                                                              "recall": cm.DEFAULT_RECALL}
    assert cm.citation_model("oracle", precision=0.5).keywords == {"precision": 0.5, "recall": cm.DEFAULT_RECALL}
    with pytest.raises(InputError, match=r"^--citations: --precision/--recall replace the oracle; they do not apply "
                                         r"to 'position'$"):
        with as_options("precision", "recall", name="citations"):
            cm.citation_model("position", recall=0.5)
    with pytest.raises(InputError, match="^name: must be one of oracle, position, answer, precision_recall"):
        cm.citation_model("gold")
