"""Gumbel-top-M draws from Plackett–Luce, and the log-probabilities are exact.

Every test of a pure function runs twice, jitted and eager (the ``variant`` fixture in conftest.py).
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_f32_close, f32_error

import rmm_jax as rj


def gumbel_top_m_of(variant):
    return variant(rj.gumbel_top_m, static_argnames=("m",))


def log_prob_of(variant):
    return variant(rj.selection_log_prob, static_argnames=("mode",))


def pl_prob_bruteforce(scores, sel, tau, valid):
    """P(ordered selection) by the sequential definition, in float64."""
    z = np.where(valid, np.asarray(scores, np.float64) / tau, -np.inf)
    remaining = valid.copy()
    p = 1.0
    for i in sel:
        w = np.exp(z[remaining] - z[remaining].max())
        p *= np.exp(z[i] - z[remaining].max()) / w.sum()
        remaining[i] = False
    return p


@pytest.mark.parametrize("mask", [None, np.array([True, False, True, True, True]),
                                  np.array([True, False, True, False, False])])
@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
def test_plackett_luce_log_probs_of_all_ordered_selections_sum_to_one(mask, tau, variant):
    k, m = 5, 3
    log_prob = log_prob_of(variant)
    scores = jnp.array([0.3, -1.2, 2.0, 0.7, 0.1], jnp.float32)
    valid = np.ones(k, bool) if mask is None else mask
    n_valid = int(valid.sum())
    depth = min(m, n_valid)
    total, worst = 0.0, 0.0
    jmask = None if mask is None else jnp.asarray(mask)
    for perm in itertools.permutations(np.flatnonzero(valid), depth):
        sel = jnp.array(list(perm) + [-1] * (m - depth), jnp.int32)
        lp = float(log_prob(scores, sel, tau, mask=jmask))
        want = pl_prob_bruteforce(scores, perm, tau, valid.copy())
        # exp in float64 of a float32 log-prob within e of the exact one: within P·e (first order)
        e = float(f32_error(lambda s: rj.selection_log_prob(s, sel, tau, mask=jmask), scores))
        assert_f32_close(np.exp(lp), want, want * e)
        total, worst = total + np.exp(lp), max(worst, e)
    assert_f32_close(total, 1.0, worst)                                 # Σ P·e ≤ max e


@pytest.mark.parametrize("offset, tau", [(1e4, 0.01), (-3e3, 0.05), (1e5, 1e-3)])
def test_the_log_prob_of_large_scores_at_a_small_tau_is_as_exact_as_of_small_ones(offset, tau, variant):
    """Plackett–Luce does not see a constant added to every score, and neither does the
    float32 computation now: scores near 1e4 at τ = 0.01 are 1e6 from 0, where float32's step
    is 0.0625, and their log-probability was that far off. Against float64 on the same float32
    scores, within the float32 bound of the computation, a bound the scale of (s − max)/τ sets
    (under 1e-3 here), not that of s/τ."""
    scores = jnp.asarray(np.float32(offset) + np.array([0.3, 0.1, -0.2, 0.5, 0.0], np.float32))
    log_prob = log_prob_of(variant)
    for perm in [(3, 0, 2), (4, 1, 3), (0, 1, 2)]:
        sel = jnp.array(perm, jnp.int32)
        z, left, want = np.asarray(scores, np.float64) / tau, list(range(5)), 0.0
        for i in perm:                          # in logs: exp underflows at these spreads
            want += z[i] - z[left].max() - np.log(np.exp(z[left] - z[left].max()).sum())
            left.remove(i)
        e = float(f32_error(lambda s: rj.selection_log_prob(s, sel, tau), scores))
        assert e < 1e-3
        assert_f32_close(float(log_prob(scores, sel, tau)), want, e)


def test_gumbel_top_m_frequencies_match_plackett_luce(variant):
    k, m, tau, n = 5, 2, 0.7, 40_000
    scores = jnp.array([0.5, -0.3, 1.1, 0.0, -1.0], jnp.float32)
    keys = jax.random.split(jax.random.key(1234), n)
    draws = np.asarray(variant(jax.vmap(lambda kk: rj.gumbel_top_m(kk, scores, m, tau)))(keys))
    counts = {}
    for a, b in draws:
        counts[(a, b)] = counts.get((a, b), 0) + 1
    max_err = 0.0
    for perm in itertools.permutations(range(k), m):
        p = pl_prob_bruteforce(scores, perm, tau, np.ones(k, bool))
        max_err = max(max_err, abs(counts.get(perm, 0) / n - p))
    # 20 cells, each frequency has std <= sqrt(0.25/n) = 0.0025; 0.01 is 4 sigma.
    assert max_err < 0.01, max_err


def ordered_top_m_bruteforce(z, valid, m):
    """Indices of the M largest valid z, largest first, padded with −1 (numpy, float64)."""
    order = [int(i) for i in np.argsort(-np.asarray(z, np.float64), kind="stable") if valid[i]]
    return np.array((order + [-1] * m)[:m], np.int32)


@pytest.mark.parametrize("k, m", [(1, 1), (6, 1), (6, 4), (6, 6), (13, 5)])
def test_gumbel_top_m_is_ordered_by_perturbed_score_and_reproducible(k, m, variant):
    """The draw is exactly the argsort of s/τ + g over the valid candidates (g the
    Gumbel noise of the key), for random scores, temperatures, masks (down to fewer
    valid candidates than M) and −inf scores; the same key gives the same draw."""
    draw = gumbel_top_m_of(variant)
    rng = np.random.default_rng(100 * k + m)
    n_cases = 60
    for case in range(n_cases):
        scores = rng.normal(0.0, 2.0, k).astype(np.float32)
        if case % 3 == 1:
            scores[rng.random(k) < 0.3] = -np.inf        # non-finite scores are never drawn
        mask = None if case % 2 == 0 else rng.random(k) < rng.uniform(0.2, 1.0)
        tau = np.float32(rng.choice([0.1, 0.5, 1.0, 3.0]))
        key = jax.random.key(case)
        kw = {} if mask is None else {"mask": jnp.asarray(mask)}
        sel = np.asarray(draw(key, jnp.asarray(scores), m, tau, **kw))
        assert sel.dtype == np.int32 and sel.shape == (m,)
        np.testing.assert_array_equal(sel, np.asarray(draw(key, jnp.asarray(scores), m, tau, **kw)))
        g = np.asarray(jax.random.gumbel(key, (k,), jnp.float32))
        valid = np.isfinite(scores) & (np.ones(k, bool) if mask is None else mask)
        z = np.where(valid, scores / tau + g, -np.inf)
        np.testing.assert_array_equal(sel, ordered_top_m_bruteforce(z, valid, m), err_msg=f"case {case}")
        # Explicit noise is used as given: the draw is the argsort of s/τ + gumbel.
        g2 = rng.gumbel(size=k).astype(np.float32)
        sel2 = np.asarray(draw(None, jnp.asarray(scores), m, tau, gumbel=jnp.asarray(g2), **kw))
        np.testing.assert_array_equal(
            sel2, ordered_top_m_bruteforce(np.where(valid, scores / tau + g2, -np.inf), valid, m))
    assert len({tuple(np.asarray(draw(jax.random.key(s), jnp.linspace(-1, 1, k), m, 0.5)))
                for s in range(20)}) > (k > 1)  # different keys give different draws


def test_masked_candidates_are_never_selected(variant):
    m = 5
    mask = jnp.array([True, False, True, False, True, True, False, True])
    scores = jnp.array([0., 9., 0., 9., 0., 0., 9., 0.])  # masked ones would win if allowed
    keys = jax.random.split(jax.random.key(7), 2000)
    sel = np.asarray(variant(jax.vmap(lambda kk: rj.gumbel_top_m(kk, scores, m, 1.0, mask)))(keys))
    assert not np.isin(sel, [1, 3, 6]).any()
    # fewer valid than M: the rest are -1, never a masked index
    few = jnp.array([True, False, False, False, True, False, False, False])
    sel = np.asarray(variant(jax.vmap(lambda kk: rj.gumbel_top_m(kk, scores, m, 1.0, few)))(keys))
    assert (np.sort(sel[:, :2], axis=1) == [0, 4]).all() and (sel[:, 2:] == -1).all()


def test_rmm_mode_is_the_sum_of_per_item_log_softmax_of_perturbed_scores(variant):
    log_prob = log_prob_of(variant)
    scores = jnp.array([0.2, 1.0, -0.5, 0.3])
    g = jnp.array([0.1, -0.4, 0.9, 0.0])
    sel = jnp.array([2, 1], jnp.int32)
    tau = 0.5
    by_hand = lambda s: jax.nn.log_softmax((s + g) / tau)[jnp.array([2, 1])].sum()
    got = log_prob(scores, sel, tau, mode="rmm", gumbel=g)
    assert_f32_close(got, by_hand(scores), f32_error(by_hand, scores) + f32_error(
        lambda s: rj.selection_log_prob(s, sel, tau, mode="rmm", gumbel=g), scores))
    # and it is not the exact probability of the selection
    exact = log_prob(scores, sel, tau)
    assert abs(float(got) - float(exact)) > 1e-3


# Shapes, dtypes and the static arguments (m, mode) are checked at trace time: these
# raise under jit too.
@pytest.mark.parametrize("call, arg", [
    (lambda top, lp: top(jax.random.key(0), jnp.zeros(4), 5, 1.0), "m"),
    (lambda top, lp: top(jax.random.key(0), jnp.zeros((2, 4)), 1, 1.0), "scores"),
    (lambda top, lp: top(jax.random.key(0), jnp.zeros(4), 1, 1.0, jnp.ones(3, bool)), "mask"),
    (lambda top, lp: lp(jnp.zeros(4), jnp.zeros(2, jnp.float32), 1.0), "selected"),
    (lambda top, lp: lp(jnp.zeros(4), jnp.zeros(5, jnp.int32), 1.0), "selected"),
    (lambda top, lp: lp(jnp.zeros(4), jnp.zeros(2, jnp.int32), 1.0, mode="bogus"), "mode"),
    (lambda top, lp: lp(jnp.zeros(4), jnp.zeros(2, jnp.int32), 1.0, mode="rmm"), "gumbel"),
    # a seed or no key where a key draws the noise: a TypeError from jax.random ("invalid PRNG key data")
    (lambda top, lp: top(0, jnp.zeros(4), 2, 1.0), "key"),
    (lambda top, lp: top(None, jnp.zeros(4), 2, 1.0), "key"),
    # noise of another shape: (1,) broadcast silently to a wrong draw, (5,) a broadcasting TypeError
    (lambda top, lp: top(None, jnp.zeros(4), 2, 1.0, gumbel=jnp.zeros(1)), "gumbel"),
    (lambda top, lp: top(None, jnp.zeros(4), 2, 1.0, gumbel=jnp.zeros(5)), "gumbel"),
    (lambda top, lp: lp(jnp.zeros(3), jnp.array([0, 1]), 1.0, mode="rmm", gumbel=[0.0, 0.0, 0.0]), "gumbel"),
])
def test_bad_arguments_raise_value_error_naming_the_argument(call, arg, variant):
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        call(gumbel_top_m_of(variant), log_prob_of(variant))


# Values (τ, NaN scores) are checked only when concrete (rmm_jax.core.checks): eager.
@pytest.mark.parametrize("call, arg", [
    (lambda: rj.gumbel_top_m(jax.random.key(0), jnp.zeros(4), 2, 0.0), "tau"),
    (lambda: rj.gumbel_top_m(jax.random.key(0), jnp.zeros(4), 2, -1.0), "tau"),
    (lambda: rj.gumbel_top_m(jax.random.key(0), jnp.ones(4), 2, 1e-45), "tau"),     # s/τ: inf
    (lambda: rj.gumbel_top_m(jax.random.key(0), jnp.array([0., jnp.nan]), 1, 1.0), "scores"),
    (lambda: rj.selection_log_prob(jnp.zeros(6), jnp.array([9, 4, 3]), 1.0), "selected"),   # was finite
    (lambda: rj.selection_log_prob(jnp.zeros(6), jnp.array([5, 5, 3]), 1.0), "selected"),   # was finite
    (lambda: rj.selection_log_prob(jnp.zeros(6), jnp.array([5, -2]), 1.0), "selected"),
])
def test_bad_values_raise_value_error_naming_the_argument(call, arg):
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        call()


def test_a_numpy_integer_m_draws_as_the_int(variant):
    # m=np.int64(3) was refused as "m: must be an int in [1, K=6], got np.int64(3)"
    top = gumbel_top_m_of(variant)
    s = jnp.array([0.3, -1.0, 2.0, 0.5, 1.0, 0.0])
    for m in (np.int64(3), np.int32(3)):
        got = top(jax.random.key(0), s, m, 0.5)
        assert got.dtype == jnp.int32 and got.tolist() == top(jax.random.key(0), s, 3, 0.5).tolist()
    with pytest.raises(ValueError, match="^m:"):
        top(jax.random.key(0), s, True, 0.5)


@pytest.mark.parametrize("m", [0, 7, True])
def test_top_m_refuses_an_m_outside_one_to_k(m, variant):
    # m = 0 returned an empty selection, m = 7 of 6 an XLA error that named no argument
    top = variant(rj.top_m, static_argnames=("m",))
    with pytest.raises(ValueError, match=r"^m: must be an int in \[1, K=6\]"):
        top(jnp.arange(6.0), m)


@pytest.mark.parametrize("tau", [[1.0], (0.5,), None, True, np.ones(2), jnp.ones((1,))])   # a str: jit refuses it
def test_a_tau_that_is_not_one_number_is_refused_jitted_and_eager(tau, variant):
    # tau=[1.0] passed check_tau (np.asarray made it an array of numbers) and was a TypeError
    # from the division, eager, or a TracerArrayConversionError, jitted
    top, lp = gumbel_top_m_of(variant), log_prob_of(variant)
    with pytest.raises(ValueError, match="^tau: must be one number"):
        top(jax.random.key(0), jnp.zeros(4), 2, tau)
    with pytest.raises(ValueError, match="^tau: must be one number"):
        lp(jnp.zeros(4), jnp.array([1, 0]), tau)


def test_a_traced_or_0d_tau_still_draws_as_the_number(variant):
    s = jnp.array([0.3, -1.0, 2.0, 0.5, 1.0, 0.0])
    top, lp = gumbel_top_m_of(variant), log_prob_of(variant)
    want = rj.gumbel_top_m(jax.random.key(3), s, 3, 0.5).tolist()
    for tau in (np.float32(0.5), jnp.float32(0.5), np.array(0.5)):
        assert top(jax.random.key(3), s, 3, tau).tolist() == want
        assert float(lp(s, jnp.array(want), tau)) == float(rj.selection_log_prob(s, jnp.array(want), 0.5))


@pytest.mark.parametrize("logits", [jnp.array([1, 3, 2]), jnp.array([True, False, True])])
def test_top_m_refuses_logits_that_are_not_float(logits, variant):
    # int logits were ranked as they were, where every other scores input is float
    with pytest.raises(ValueError, match="^logits: expected a floating dtype"):
        variant(rj.top_m, static_argnames=("m",))(logits, 2)


def test_top_m_refuses_nan_logits_and_keeps_minus_inf_as_never_chosen():
    # NaN was taken as a masked candidate: [1, nan, 2] gave [2, 0]
    with pytest.raises(ValueError, match="^logits: contains NaN"):
        rj.top_m(jnp.array([1.0, jnp.nan, 2.0]), 2)
    assert rj.top_m(jnp.array([1.0, -jnp.inf, 2.0]), 3).tolist() == [2, 0, -1]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gumbel_noise_is_refused_when_concrete(bad):
    """Caller-supplied noise was taken as given: [0, nan, 0, 0] drew candidate 1 first from scores
    [3, 1, 0, -1] (top_k ranks NaN first), whatever the scores. Refused by name, by the draw, the
    rmm log-probability and reinforce_loss (which checks it on the whole batch: it vmaps)."""
    s, g = jnp.array([3.0, 1.0, 0.0, -1.0]), jnp.zeros(4).at[1].set(bad)
    with pytest.raises(ValueError, match=r"^gumbel: contains NaN or Inf$"):
        rj.gumbel_top_m(None, s, 2, 1.0, gumbel=g)
    with pytest.raises(ValueError, match=r"^gumbel: contains NaN or Inf$"):
        rj.selection_log_prob(s, jnp.array([0, 1]), 1.0, mode="rmm", gumbel=g)
    with pytest.raises(ValueError, match=r"^gumbel: contains NaN or Inf$"):
        rj.reinforce_loss(s[None], jnp.array([[0, 1]]), jnp.ones((1, 2)), 0.0, 1.0, mode="rmm", gumbel=g[None])
    # finite noise is used as given: the draw is the argsort of s/τ + g
    g = jnp.zeros(4).at[3].set(10.0)
    assert rj.gumbel_top_m(None, s, 2, 1.0, gumbel=g).tolist() == [3, 0]


def test_plus_inf_scores_are_refused_not_taken_as_masked():
    """valid_mask is isfinite, so +inf (an overflow) was a masked candidate: top_m([1, inf, 0], 2)
    gave [0, 2], the best never shown, and a draw never drew it. Refused by name when concrete,
    for every function that reads scores; −inf stays a masked candidate."""
    s = jnp.array([1.0, jnp.inf, 0.0])
    calls = {"logits": lambda x: rj.top_m(x, 2),
             "scores": lambda x: rj.gumbel_top_m(jax.random.key(0), x, 2, 1.0)}
    for name, fn in calls.items():
        with pytest.raises(ValueError, match=rf"^{name}: contains \+inf .*-inf for a masked candidate$"):
            fn(s)
        assert -1 not in fn(s.at[1].set(-jnp.inf)).tolist()[:2]       # two valid: both drawn, 1 never
        assert 1 not in fn(s.at[1].set(-jnp.inf)).tolist()
    with pytest.raises(ValueError, match=r"^scores: contains \+inf"):
        rj.selection_log_prob(s, jnp.array([0, 2]), 1.0)


def test_a_selection_no_draw_can_make_is_refused_when_concrete():
    """selection_log_prob of a masked (or -inf) candidate returned the -1e30 sentinel, and a
    -1 between filled slots was skipped ([1, -1, 0] read as 1 then 0): both are refused by
    name on concrete arrays; a selection a draw can make is scored as before, also jitted."""
    s = jnp.log(jnp.array([1.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match=r"^selected: candidate 1 is masked or its score is not finite: no draw "
                                         r"selects it$"):
        rj.selection_log_prob(s, jnp.array([1, 0]), 1.0, mask=jnp.array([True, False, True]))
    with pytest.raises(ValueError, match=r"^selected: candidate 2 is masked or its score is not finite"):
        rj.selection_log_prob(s.at[2].set(-jnp.inf), jnp.array([2]), 1.0)
    with pytest.raises(ValueError, match=r"^scores: contains \+inf"):          # an overflow: refused, not masked
        rj.selection_log_prob(s.at[2].set(jnp.inf), jnp.array([2]), 1.0)
    with pytest.raises(ValueError, match=r"^selected: an unfilled slot \(-1\) comes before a filled one: "
                                         r"unfilled slots end a draw$"):
        rj.selection_log_prob(s, jnp.array([1, -1, 0]), 1.0)
    with pytest.raises(ValueError, match=r"^selected: an unfilled slot \(-1\) comes before a filled one"):
        jax.grad(lambda x: rj.selection_log_prob(x, jnp.array([1, -1, 0]), 1.0))(s)     # the scores traced
    ok = rj.selection_log_prob(s, jnp.array([1, 0, -1]), 1.0)
    assert float(jnp.exp(ok)) == pytest.approx(0.25, rel=1e-6)
    assert float(jax.jit(lambda a, b: rj.selection_log_prob(a, b, 1.0))(s, jnp.array([1, 0, -1]))) == float(ok)
