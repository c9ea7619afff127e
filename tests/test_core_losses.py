"""REINFORCE is unbiased where documented, masks carry no gradient, listwise loss is CE.

Every test of a pure function runs twice, jitted and eager (the ``variant`` fixture in conftest.py).
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_f32_close, f32_error, gamma

import rmm_jax as rj

K, M, TAU = 5, 2, 0.8
SCORES = jnp.array([0.4, -0.2, 1.0, 0.1, -0.7], jnp.float32)
ITEM_REWARD = jnp.array([1.0, 0.0, 1.0, 0.0, 1.0])  # reward of showing each memory (cited or not)
BASELINE = 0.3


def loss_of(variant):
    return variant(rj.reinforce_loss, static_argnames=("mode", "credit"))


def expected_reward(scores):
    """E[Σ_j r(i_j)] under Plackett–Luce, by enumerating every ordered selection."""
    total = 0.0
    for perm in itertools.permutations(range(K), M):
        sel = jnp.array(perm, jnp.int32)
        total += jnp.exp(rj.selection_log_prob(scores, sel, TAU)) * ITEM_REWARD[sel].sum()
    return total


@functools.cache
def exact_gradient_bound():
    return f32_error(jax.grad(expected_reward), SCORES)


def mc_gradient(credit, n=60_000, seed=0, transform=jax.jit):
    def one(key):
        sel = rj.gumbel_top_m(key, SCORES, M, TAU)
        rewards = ITEM_REWARD[sel][None]
        return -jax.grad(lambda s: rj.reinforce_loss(s[None], sel[None], rewards, BASELINE, TAU,
                                                     credit=credit))(SCORES)
    grads = np.asarray(transform(jax.vmap(one))(jax.random.split(jax.random.key(seed), n)))
    return grads.mean(0), grads.std(0) / np.sqrt(n)


@pytest.mark.parametrize("credit", ["reward_to_go", "selection"])
def test_reinforce_estimator_is_unbiased_for_the_exact_gradient(credit, variant):
    exact = np.asarray(jax.grad(expected_reward)(SCORES))
    mean, se = mc_gradient(credit, transform=variant)
    # Monte Carlo: 5 standard errors per component (fixed seed), plus the float32 rounding of the
    # enumerated gradient and of the mean of n float32 draws (each below max|draw|).
    rounding = exact_gradient_bound() + gamma(60_000) * np.abs(mean).max() * 2
    assert np.all(np.abs(mean - exact) < 5 * se + rounding), (mean, exact, se)


def test_reward_to_go_has_lower_variance_than_whole_selection_credit(variant):
    _, se_rtg = mc_gradient("reward_to_go", transform=variant)
    _, se_sel = mc_gradient("selection", transform=variant)
    assert se_rtg.sum() < se_sel.sum()


def test_per_item_credit_is_biased_under_plackett_luce_sampling(variant):
    # The paper's per-memory credit ignores that a draw removes the memory from later
    # draws; its Monte-Carlo mean misses the exact gradient by far more than the noise.
    exact = np.asarray(jax.grad(expected_reward)(SCORES))
    mean, se = mc_gradient("item", transform=variant)
    assert np.max(np.abs(mean - exact) / (se + 1e-6)) > 10


def test_masked_candidates_get_exactly_zero_gradient(variant):
    loss = loss_of(variant)
    mask = jnp.array([[True, False, True, True, False]])
    sel = jnp.array([[2, 0]], jnp.int32)
    for mode, credit in [("plackett_luce", "reward_to_go"), ("rmm", "item"), ("plackett_luce", "selection")]:
        g = jax.grad(lambda s: loss(s, sel, jnp.array([[1.0, -1.0]]), 0.5, TAU, mode=mode,
                                    credit=credit, gumbel=jnp.ones((1, K)), mask=mask))(SCORES[None])
        g = np.asarray(g)
        assert np.all(g[~np.asarray(mask)] == 0.0) and np.all(np.isfinite(g))
        assert np.any(g[np.asarray(mask)] != 0.0)


def test_unfilled_slots_contribute_nothing(variant):
    loss = loss_of(variant)
    mask = jnp.array([[True, False, False, False, False]])
    one = lambda s, sel, r: rj.reinforce_loss(s, sel, r, 0.0, 1.0, mask=mask)
    args = (SCORES[None], jnp.array([[0]], jnp.int32), jnp.array([[1.0]]))
    padded_args = (SCORES[None], jnp.array([[0, -1]], jnp.int32), jnp.array([[1.0, 1.0]]))
    base, padded = loss(*args, 0.0, 1.0, mask=mask), loss(*padded_args, 0.0, 1.0, mask=mask)
    assert_f32_close(base, padded, f32_error(one, *args) + f32_error(one, *padded_args))


def test_advantages_per_credit_on_a_hand_example(variant):
    adv = variant(rj.advantages, static_argnames=("credit",))
    rewards = variant(rj.citation_rewards, static_argnames=("mapping",))
    r = jnp.array([[1.0, 0.0, 1.0]])
    filled = jnp.array([[True, True, False]])
    # exact in float32: sums and differences of 0, ±0.5 and ±1
    np.testing.assert_array_equal(adv(r, 0.5, filled, "item"), [[0.5, -0.5, 0.0]])
    np.testing.assert_array_equal(adv(r, 0.5, filled, "reward_to_go"), [[0.0, -0.5, 0.0]])
    np.testing.assert_array_equal(adv(r, 0.5, filled, "selection"), [[0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(rewards(jnp.array([True, False]), jnp.array([True, True]), "pm1"), [1, -1])
    np.testing.assert_array_equal(rewards(jnp.array([True, False]), jnp.array([True, False]), "binary"), [1, 0])


def test_advantage_is_a_constant_for_the_gradient(variant):
    # d/ds of the loss must equal -A * d/ds log pi with A fixed, even when the baseline
    # is computed from quantities that depend on the scores.
    loss = loss_of(variant)
    s = SCORES[None]
    sel = jnp.array([[2, 0]], jnp.int32)
    r = jnp.array([[1.0, 0.0]])
    grad = jax.grad(lambda x: rj.reinforce_loss(x, sel, r, jnp.mean(x), TAU, credit="item"))
    g = jax.grad(lambda x: loss(x, sel, r, jnp.mean(x), TAU, credit="item"))(s)
    lp_grads = jax.jacobian(lambda x: rj.selection_log_probs(x[0], sel[0], TAU))
    fixed_a = lambda x: -((r[0] - jnp.mean(x))[:, None, None] * lp_grads(x)).sum(0)
    assert_f32_close(g, fixed_a(s), f32_error(grad, s) + f32_error(fixed_a, s))


def test_listwise_loss_is_cross_entropy_against_normalised_gold(variant):
    listwise = variant(rj.listwise_loss)
    s = jnp.array([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0]])
    gold = jnp.array([[True, False, True, False], [False, False, False, False], [False, True, False, True]])
    mask = jnp.array([[True, True, True, True], [True, True, True, True], [True, True, True, False]])
    # query 2 has no gold; query 3's second gold is masked
    def by_hand(x):
        l0 = -(0.5 * jax.nn.log_softmax(x[0])[0] + 0.5 * jax.nn.log_softmax(x[0])[2])
        return (l0 - jax.nn.log_softmax(x[2, :3])[1]) / 2
    assert_f32_close(listwise(s, gold, mask), by_hand(s),
                     f32_error(lambda x: rj.listwise_loss(x, gold, mask), s) + f32_error(by_hand, s))
    g = jax.grad(lambda x: listwise(x, gold, mask))(s)
    assert g[2, 3] == 0.0 and np.all(np.asarray(g[1]) == 0.0)


def _pointwise_reference(scores, gold, mask, tau, balanced):
    """NumPy, float64: each valid candidate a logistic example, u = (s − max valid s) / τ,
    summed per row (gold ones weighted n_other / n_gold when ``balanced``) and averaged over
    the rows with a valid gold candidate."""
    total, rows = 0.0, 0
    for s, g, mk in zip(scores.astype(np.float64), gold, mask):
        y = g[mk]
        if not y.any():
            continue
        u = (s[mk] - s[mk].max()) / tau
        w_pos = (~y).sum() / y.sum() if balanced else 1.0
        total += -np.sum(np.where(y, w_pos * -np.logaddexp(0, -u), -np.logaddexp(0, u)))
        rows += 1
    return total / max(rows, 1)


def test_pointwise_loss_is_a_logistic_example_per_candidate(variant):
    """Every valid candidate is one logistic example (gold: 1; balanced: gold weighted as the
    others together), the rows without gold count for nothing, and masked candidates neither
    count nor get a gradient. Float32 against float64: each term is within a few ulp of a
    value of order |u| ≤ (max s − min s)/τ times its weight (≤ K), so the sum of K terms per
    row is within K²·(|u|max + 1)·2⁻²⁰."""
    loss = variant(rj.pointwise_loss, static_argnames=("balanced",))
    rng = np.random.default_rng(0)
    for trial in range(16):
        b, k, tau = 5, 8, float(rng.choice([0.05, 0.1, 1.0]))    # one shape: one compile
        balanced = bool(trial % 2)
        scores = rng.normal(0, 0.3, (b, k)).astype(np.float32)
        gold = rng.random((b, k)) < 0.3
        mask = rng.random((b, k)) < 0.8
        got = float(loss(scores, gold, mask, tau, balanced=balanced))
        want = _pointwise_reference(scores, gold, mask, tau, balanced)
        bound = k * k * (np.ptp(scores) / tau + 1) * 2 ** -20
        assert abs(got - want) <= bound, (trial, got, want)
        grad = jax.grad(lambda s: loss(s, gold, mask, tau, balanced=balanced))(scores)
        assert np.all(np.asarray(grad)[~mask] == 0)


JUDGES = [(0.911, 0.154), (0.9, 0.2), (0.6, 0.0), (1.0, 0.0)]


@pytest.mark.parametrize("p_useful, p_other", JUDGES)
@pytest.mark.parametrize("mapping", ["binary", "pm1"])
def test_corrected_rewards_are_unbiased_for_usefulness_by_enumeration(mapping, p_useful, p_other, variant):
    """E[r | y] = Σ_c P(c | y)·r(c) over both citation outcomes equals y (binary) or 2y − 1 (pm1)."""
    rewards = variant(rj.citation_rewards, static_argnames=("mapping", "p_useful", "p_other"))
    args = (jnp.array([True, False]), jnp.array([True, True]))
    r = rewards(*args, mapping, p_useful, p_other)
    r_cited, r_not = float(r[0]), float(r[1])
    # float64 mixture of two float32 rewards: off by at most the larger reward's bound
    bound = f32_error(lambda c, f: rj.citation_rewards(c, f, mapping, p_useful, p_other), *args).max()
    for y in (0, 1):
        p_cite = p_useful if y else p_other
        want = y if mapping == "binary" else 2 * y - 1
        assert_f32_close(p_cite * r_cited + (1 - p_cite) * r_not, want, bound, err_msg=f"y={y}")


@pytest.mark.parametrize("mapping", ["binary", "pm1"])
def test_corrected_rewards_average_to_usefulness_under_the_class_calibrated_simulator(mapping):
    """Monte Carlo with the library's own class-calibrated citations (fixed seed): the mean
    corrected reward of useful and of other shown memories is 1 and 0 (binary) or ±1 (pm1)
    within 5 standard errors; the uncorrected reward misses by far more."""
    from rmm_jax.data.citations import P_OTHER, P_USEFUL, oracle

    n, cite = 40_000, oracle()
    useful = jnp.array([True, False, False, True, False])          # calls that show something useful
    cited = jax.jit(jax.vmap(lambda k: cite(k, useful, jnp.ones(5, bool))))(jax.random.split(jax.random.key(3), n))
    for rates, unbiased in (((P_USEFUL, P_OTHER), True), ((1.0, 0.0), False)):
        r = np.asarray(rj.citation_rewards(cited, jnp.ones_like(cited), mapping, *rates))
        for cls, y in ((np.asarray(useful), 1), (~np.asarray(useful), 0)):
            vals = r[:, cls].ravel()
            want = y if mapping == "binary" else 2 * y - 1
            off = abs(vals.mean() - want)
            assert (off < 5 * vals.std() / np.sqrt(vals.size)) == unbiased, (rates, cls, off)


def test_corrected_binary_reward_with_the_batch_mean_scales_the_reinforce_gradient_by_the_judge_gap(variant):
    """r̂ = (c − p_o)/(p_u − p_o) is affine in c and the batch mean is shift-invariant, so the
    loss gradient is exactly the uncorrected one divided by p_u − p_o (autodiff, both ways)."""
    p_u, p_o = 0.911, 0.154
    sel = jnp.array([[2, 0], [1, 3]], jnp.int32)
    cited = jnp.array([[True, False], [False, False]])
    filled = sel >= 0

    def grad(rates, s=None):
        s = jnp.stack([SCORES, -SCORES]) if s is None else s
        r = rj.citation_rewards(cited, filled, "binary", *rates)
        b = jnp.sum(r) / jnp.sum(filled)
        return jax.grad(lambda s: rj.reinforce_loss(s, sel, r, b, TAU))(s)

    g = variant(grad, static_argnames=("rates",))
    plain, corrected = np.asarray(g((1.0, 0.0))), np.asarray(g((p_u, p_o)))
    assert np.abs(plain).max() > 1e-2                                  # not vacuous
    s = jnp.stack([SCORES, -SCORES])
    bound = f32_error(lambda x: grad((p_u, p_o), x), s) + f32_error(lambda x: grad((1.0, 0.0), x), s) / (p_u - p_o)
    assert_f32_close(corrected, np.asarray(plain, np.float64) / (p_u - p_o), bound)


@pytest.mark.parametrize("p_useful, p_other, field", [(0.0, 0.0, "p_useful"), (1.2, 0.1, "p_useful"),
                                                      (0.5, 0.5, "p_other"), (0.5, -0.1, "p_other")])
def test_judge_rates_without_a_correction_are_rejected_naming_the_field(p_useful, p_other, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        rj.Estimator(p_useful=p_useful, p_other=p_other)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        rj.citation_rewards(jnp.array([True]), jnp.array([True]), "binary", p_useful, p_other)


def logistic_case(key, b=3, k=6, m=3):
    """Random scores, selections (query 1 with an unfilled last slot) and citations; query 0's
    candidate 5 is masked and never selected."""
    ks, kc, kp = jax.random.split(key, 3)
    scores = jax.random.normal(ks, (b, k))
    sel = jax.vmap(lambda kk: jax.random.permutation(kk, k - 1)[:m])(jax.random.split(kp, b)).astype(jnp.int32)
    sel = sel.at[1, -1].set(-1)
    mask = jnp.ones((b, k), bool).at[0, 5].set(False)
    return scores, sel, jax.random.bernoulli(kc, 0.4, (b, m)), mask


def test_plain_logistic_loss_is_binary_cross_entropy_of_the_anchored_logits(variant):
    """p_useful 1, p_other 0: optax's sigmoid BCE of u = (s − max s)/τ + offset over the shown memories."""
    import optax

    scores, sel, cited, mask = logistic_case(jax.random.key(0))
    w = jnp.array([1.0, 0.5, 2.0])
    loss = lambda x: rj.citation_logistic_loss(x, sel, cited, 0.3, offset=0.7, mask=mask, weights=w)
    got = variant(rj.citation_logistic_loss, static_argnames=("offset",))(scores, sel, cited, 0.3, offset=0.7,
                                                                            mask=mask, weights=w)
    s = np.where(np.asarray(mask), np.asarray(scores, np.float64), -np.inf)
    want = 0.0
    with jax.enable_x64(True):                                     # optax's BCE in float64: the exact side
        for b in range(3):
            for j, i in enumerate(np.asarray(sel[b])):
                if i >= 0:
                    u = (s[b, i] - s[b].max()) / 0.3 + 0.7
                    want += float(w[b]) * float(optax.sigmoid_binary_cross_entropy(jnp.float64(u), cited[b, j]))
    assert_f32_close(got, want, f32_error(loss, scores))


def test_logistic_gradient_moves_only_the_shown_memories_by_the_closed_form(variant):
    """dL/ds_i = −w [c/P − (1 − c)/(1 − P)]·(p_u − p_o)·σ'(u)/τ for a shown memory, 0 for every other
    candidate (the anchor is a constant), the masked one included."""
    p_u, p_o, tau = 0.911, 0.154, 0.2
    scores, sel, cited, mask = logistic_case(jax.random.key(1))
    w = jnp.array([1.0, 0.5, 2.0])
    g = variant(jax.grad(lambda s: rj.citation_logistic_loss(s, sel, cited, tau, p_useful=p_u, p_other=p_o,
                                                              mask=mask, weights=w)))(scores)
    s = np.where(np.asarray(mask), np.asarray(scores, np.float64), -np.inf)
    want = np.zeros(s.shape)
    for b in range(3):
        for j, i in enumerate(np.asarray(sel[b])):
            if i >= 0:
                sig = 1 / (1 + np.exp(-(s[b, i] - s[b].max()) / tau))
                p, c = p_o + (p_u - p_o) * sig, float(cited[b, j])
                want[b, i] += -float(w[b]) * (c / p - (1 - c) / (1 - p)) * (p_u - p_o) * sig * (1 - sig) / tau
    assert np.abs(want).max() > 0.1
    grad = jax.grad(lambda s: rj.citation_logistic_loss(s, sel, cited, tau, p_useful=p_u, p_other=p_o, mask=mask,
                                                        weights=w))
    assert_f32_close(g, want, f32_error(grad, scores))                 # float32 against the float64 closed form


def test_pairwise_loss_and_gradient_equal_a_loop_over_the_pairs(variant):
    """L = Σ_b w_b mean over (cited i, uncited j) shown pairs of softplus(−(s_i − s_j)/τ), and
    dL/ds its closed form, against a float64 loop over every pair; a call without a pair adds
    nothing, and each call's gradient sums to zero (its scores' level never moves)."""
    tau = 0.3
    scores, sel, cited, mask = logistic_case(jax.random.key(2), b=4)
    cited = cited.at[3].set(False)                                 # query 3 cites nothing: no pair
    w = jnp.array([1.0, 0.5, 2.0, 1.0])
    loss = lambda x: rj.citation_pairwise_loss(x, sel, cited, tau, mask=mask, weights=w)
    got, grad = variant(jax.value_and_grad(loss))(scores)
    s = np.asarray(scores, np.float64)
    want, want_grad, n_pairs = 0.0, np.zeros(s.shape), 0
    for b in range(4):
        pairs = [(i, j) for i, ci in zip(np.asarray(sel[b]), np.asarray(cited[b])) if i >= 0 and ci
                 for j, cj in zip(np.asarray(sel[b]), np.asarray(cited[b])) if j >= 0 and not cj]
        n_pairs += len(pairs)
        for i, j in pairs:
            margin = (s[b, i] - s[b, j]) / tau
            want += float(w[b]) * np.logaddexp(0.0, -margin) / len(pairs)
            pull = float(w[b]) / (1 + np.exp(margin)) / tau / len(pairs)     # σ(−margin)/τ
            want_grad[b, i] -= pull
            want_grad[b, j] += pull
    assert n_pairs >= 3 and not want_grad[3].any()
    assert_f32_close(got, want, f32_error(loss, scores))
    assert_f32_close(grad, want_grad, f32_error(jax.grad(loss), scores))
    np.testing.assert_allclose(np.asarray(grad).sum(axis=1), 0.0, atol=1e-5)   # Σ of ≤ 6 terms of size ≤ 1/τ


def test_pairwise_loss_takes_no_judge_rates():
    for fields in ({"p_useful": 0.9, "p_other": 0.1}, {"offset": -1.0}):
        with pytest.raises(ValueError, match=r"^loss: the pairwise loss takes no judge rates"):
            rj.Estimator(loss="pairwise", **fields)
    assert rj.Estimator(loss="pairwise").loss == "pairwise"


@pytest.mark.parametrize("eta", [0.1, 0.4, 0.8])
def test_judge_corrected_logistic_loss_is_proper_for_usefulness(eta):
    """A memory useful with probability η, cited at the judge's rates: the expected corrected loss
    is smallest at σ(u) = η; the uncorrected one at σ(u) = P(cite) = p_o + (p_u − p_o)·η instead."""
    p_u, p_o, off = 0.911, 0.154, 6.0
    x = jnp.linspace(-12.0, 0.0, 2401)                   # the memory's score; the other candidate's is 0, the best
    scores = jnp.stack([jnp.zeros_like(x), x], axis=1)
    sel = jnp.ones((1, 1), jnp.int32)
    p_cite = p_o + (p_u - p_o) * eta

    def expected(rates):
        per = lambda c: jax.vmap(lambda s: rj.citation_logistic_loss(s[None], sel, jnp.full((1, 1), c), 1.0,
                                                                     offset=off, p_useful=rates[0],
                                                                     p_other=rates[1]))(scores)
        return p_cite * per(True) + (1 - p_cite) * per(False)

    logit = lambda p: np.log(p / (1 - p))
    best = lambda rates: float(x[int(jnp.argmin(expected(rates)))]) + off          # u at the minimum
    # 0.02: four steps of the grid of x (0.005), which limits where the minimum can be found
    assert abs(best((p_u, p_o)) - logit(eta)) < 0.02
    assert abs(best((1.0, 0.0)) - logit(p_cite)) < 0.02


@pytest.mark.parametrize("eta", [0.3, 0.6, 0.9])
def test_a_retriever_anchored_logistic_loss_is_proper_for_the_best_candidate_too(eta):
    """The shown memory is the query's best (score x above the other's 0), cited at rate η. Anchored
    at a fixed reference r = 0, the expected loss is smallest at σ(u) = η, u = (x − r)/τ + offset.
    Anchored at the best current score, its logit is `offset` whatever x: the expected loss is the
    same at every x > 0 and its gradient (σ(offset) − η)/τ never vanishes, so the score of a best
    candidate cited more often than σ(offset) rises without end."""
    tau, off = 0.5, -1.0
    x = jnp.linspace(0.01, 12.0, 2399)
    scores = jnp.stack([jnp.zeros_like(x), x], axis=1)
    sel = jnp.ones((1, 1), jnp.int32)

    def expected(reference):
        per = lambda c: jax.vmap(lambda s: rj.citation_logistic_loss(s[None], sel, jnp.full((1, 1), c), tau,
                                                                     offset=off, reference=reference))(scores)
        return eta * per(True) + (1 - eta) * per(False)

    fixed = expected(jnp.zeros(1))
    u_min = float(x[int(jnp.argmin(fixed))]) / tau + off
    want = np.log(eta / (1 - eta))
    if want > 0.01 / tau + off:                 # inside the grid: the minimum is where σ(u) = η
        assert abs(u_min - want) < 0.03         # three steps of the grid of u (0.01)
    anchored = expected(None)
    assert bool(jnp.all(anchored == anchored[0]))      # u = offset exactly (x − x = 0): flat, no x preferred
    g = jax.vmap(jax.grad(lambda s: rj.citation_logistic_loss(s[None], sel, jnp.ones((1, 1), bool), tau,
                                                               offset=off)))(scores)[:, 1]
    g0 = jax.vmap(jax.grad(lambda s: rj.citation_logistic_loss(s[None], sel, jnp.zeros((1, 1), bool), tau,
                                                                offset=off)))(scores)[:, 1]
    sig = 1 / (1 + np.exp(-off))
    # the same at every x, and not zero. Each gradient is a float32 σ and a division (a few ulps of
    # its size); the mix cancels, so the bound is on the terms: 8 ulps of η|g| + (1 − η)|g0|
    terms = eta * np.abs(np.asarray(g, np.float64)) + (1 - eta) * np.abs(np.asarray(g0, np.float64))
    mix = eta * np.asarray(g, np.float64) + (1 - eta) * np.asarray(g0, np.float64)
    assert np.all(np.abs(mix - (sig - eta) / tau) <= 8 * 2.0 ** -24 * terms)


def test_the_logistic_reference_is_one_finite_anchor_per_query():
    with pytest.raises(ValueError, match=r"^reference: one anchor per query"):
        rj.citation_logistic_loss(S2, SEL2, CITED2, 0.5, reference=jnp.zeros(3))
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match=r"^reference: contains NaN or Inf"):
            rj.citation_logistic_loss(S2, SEL2, CITED2, 0.5, reference=jnp.array([0.3, bad]),
                                      weights=jnp.array([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"^reference: must be one of"):
        rj.Estimator(loss="logistic", reference="mean")


# ---- contracts: values (τ, indices, NaN) are checked when concrete, i.e. eager (rmm_jax.core.checks)

S2 = jnp.array([[1.0, 0.0, 0.5, -0.5], [0.2, 0.4, 0.0, 0.0]])
SEL2 = jnp.array([[0, 2], [1, -1]], jnp.int32)
CITED2 = jnp.array([[True, False], [True, False]])
GOLD2 = jnp.array([[True, False, False, False], [False, True, False, False]])
LOSSES = {
    "reinforce": lambda s, sel, tau: rj.reinforce_loss(s, sel, CITED2.astype(jnp.float32), 0.5, tau),
    "logistic": lambda s, sel, tau: rj.citation_logistic_loss(s, sel, CITED2, tau),
    "pairwise": lambda s, sel, tau: rj.citation_pairwise_loss(s, sel, CITED2, tau),
    "listwise": lambda s, sel, tau: rj.listwise_loss(s, GOLD2, tau=tau),
    "pointwise": lambda s, sel, tau: rj.pointwise_loss(s, GOLD2, tau=tau),
}


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan"), float("inf"), 1e-45, 5e-7])
@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_refuses_a_temperature_that_is_not_positive_finite_and_above_the_floor(name, tau):
    # τ = 0 gave NaN, τ < 0 a finite loss of the wrong sign, τ = 1e-45 an s/τ of inf
    with pytest.raises(ValueError, match=r"^tau: must be"):
        LOSSES[name](S2, SEL2, tau)


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_is_finite_at_the_smallest_temperature(name):
    from rmm_jax.core.checks import TAU_MIN

    assert np.isfinite(float(LOSSES[name](S2 * 100.0, SEL2, TAU_MIN)))


def test_the_estimator_refuses_a_temperature_below_the_floor():
    for field in ("tau", "draw_tau"):
        with pytest.raises(ValueError, match=rf"^{field}: must be >= 1e-06"):
            rj.Estimator(**{field: 1e-45})


@pytest.mark.parametrize("selected, what", [([[0, 9], [1, -1]], "in \\[0, K=4\\)"),
                                            ([[2, 2], [1, -1]], "candidate 2 is selected twice")])
@pytest.mark.parametrize("name", ["reinforce", "logistic", "pairwise"])
def test_the_per_call_losses_refuse_an_index_beyond_k_or_twice_in_a_selection(name, selected, what):
    # an index >= K was clamped by the gather (a finite, wrong loss, or NaN); a duplicate counted twice
    with pytest.raises(ValueError, match=rf"^selected: .*{what}"):
        LOSSES[name](S2, jnp.array(selected, jnp.int32), 0.5)
    # -1 marks an unfilled slot, and two of them are no duplicate
    assert np.isfinite(float(LOSSES[name](S2, jnp.array([[0, -1], [-1, -1]], jnp.int32), 0.5)))


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_refuses_nan_scores(name):
    # the per-call losses vmap over the queries, where the scores are traced: a NaN passed
    # unchecked and reinforce_loss returned a finite loss
    with pytest.raises(ValueError, match=r"^scores: contains NaN"):
        LOSSES[name](S2.at[0, 3].set(jnp.nan), SEL2, 0.5)


@pytest.mark.parametrize("name", ["reinforce", "logistic", "pairwise"])
def test_the_per_call_losses_refuse_a_selection_no_draw_can_make(name):
    """A pick of a masked (or −inf) candidate: selection_log_prob refuses it, but the losses vmap
    over the queries, where its check saw tracers, and took it (reinforce 1e30, logistic 1.45,
    pairwise 0.744: each a loss of a draw that cannot happen). Refused on the whole batch, by
    row; every pick a draw can make (gumbel_top_m under the same mask) is still taken."""
    fn = {"reinforce": lambda s, sel, mk: rj.reinforce_loss(s, sel, CITED2.astype(F32), 0.0, 1.0, mask=mk),
          "logistic": lambda s, sel, mk: rj.citation_logistic_loss(s, sel, CITED2, 1.0, mask=mk),
          "pairwise": lambda s, sel, mk: rj.citation_pairwise_loss(s, sel, CITED2, 1.0, mask=mk)}[name]
    mask = jnp.array([[True, True, True, False], [True, True, False, True]])
    for b, j in zip(*np.nonzero(~np.asarray(mask))):
        sel = SEL2.at[b, 1].set(j)               # [[0, 3], [1, -1]] and [[0, 2], [1, 2]]
        with pytest.raises(ValueError, match=rf"^selected: candidate {j} \(row {b}\) is masked or its score is "
                                             r"not finite: no draw selects it$"):
            fn(S2, sel, mask)
    s_inf = S2.at[1, 3].set(-jnp.inf)           # a -inf score: masked as well
    with pytest.raises(ValueError, match=r"^selected: candidate 3 \(row 1\) is masked"):
        fn(s_inf, SEL2.at[1, 1].set(3), None)
    for seed in range(5):
        keys = jax.random.split(jax.random.key(seed), 2)
        drawn = jax.vmap(lambda k, s, mk: rj.gumbel_top_m(k, s, 2, 1.0, mk))(keys, S2, mask)
        assert np.isfinite(float(fn(S2, drawn, mask)))


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_refuses_plus_inf_scores_and_keeps_minus_inf_as_masked(name):
    # +inf was taken as masked (valid_mask is isfinite): the best candidate dropped from the loss
    with pytest.raises(ValueError, match=r"^scores: contains \+inf .*-inf for a masked candidate"):
        LOSSES[name](S2.at[0, 3].set(jnp.inf), SEL2, 0.5)
    assert np.isfinite(float(LOSSES[name](S2.at[0, 3].set(-jnp.inf), SEL2, 0.5)))


F32 = jnp.float32


# Shapes and dtypes are static: these raise under jit too, naming the argument (they were
# broadcasting errors, or a loss over the wrong rows)
@pytest.mark.parametrize("fn, args, arg", [
    (lambda s, sel, c: rj.citation_logistic_loss(s, sel, c, 0.5), (S2[:1], SEL2, CITED2), "selected"),  # was finite
    (lambda s, sel, r: rj.reinforce_loss(s, sel, r, 0.5, 0.5), (S2, SEL2, jnp.ones((2, 3))), "rewards"),
    (lambda s, sel, g: rj.reinforce_loss(s, sel, jnp.ones((2, 2)), 0.5, 0.5, gumbel=g), (S2, SEL2, jnp.zeros((2, 3))),
     "gumbel"),
    (lambda s, sel, mk: rj.citation_pairwise_loss(s, sel, CITED2, 0.5, mask=mk), (S2, SEL2, jnp.ones((2, 3), bool)),
     "mask"),
    (lambda s, sel: rj.reinforce_loss(s, sel, jnp.ones((2, 2)), 0.5, 0.5, gumbel=[[0.0] * 4] * 2), (S2, SEL2),
     "gumbel"),
    (lambda s, sel, c: rj.citation_pairwise_loss(s, sel, c, 0.5), (S2, SEL2.astype(F32), CITED2), "selected"),
    (lambda s, g: rj.listwise_loss(s, g), (S2, GOLD2.astype(F32)), "gold"),
    (lambda s, g: rj.pointwise_loss(s, g), (S2, GOLD2[:, :3]), "gold"),
    (lambda s, g, mk: rj.listwise_loss(s, g, mask=mk), (S2, GOLD2, jnp.ones(4, bool)), "mask"),
    (lambda c, f: rj.citation_rewards(c, f), (CITED2, CITED2[:, :1]), "filled"),
    (lambda r, f: rj.advantages(r, 0.5, f), (jnp.ones((2, 2)), CITED2[:, :1]), "filled"),
])
def test_bad_shapes_and_dtypes_raise_value_error_naming_the_argument(fn, args, arg, variant):
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        variant(fn)(*args)


# Each was taken or failed deep: a float `cited` counted every non-zero entry as a citation (0.3 was
# cited) and was a TypeError in the pairwise loss; a list was a TypeError from jnp.where or the
# vmap; a baseline that does not broadcast a TypeError from jnp.subtract; mode 'rmm' without its
# noise took zeros (selection_log_probs refuses it).
@pytest.mark.parametrize("fn, args, arg", [
    (lambda c, f: rj.citation_rewards(c, f), (jnp.array([0.3, 0.0]), jnp.array([True, True])), "cited"),
    (lambda c, f: rj.citation_rewards(c, f), (jnp.array([True, False]), jnp.array([1, 1])), "filled"),
    (lambda f: rj.citation_rewards([True, False], f), (jnp.array([True, True]),), "cited"),
    (lambda f: rj.advantages([1.0, 0.0], 0.5, f), (jnp.array([True, True]),), "rewards"),
    (lambda r, f: rj.advantages(r, jnp.zeros(3), f), (jnp.ones(2), jnp.array([True, True])), "baseline"),
    (lambda s, sel: rj.citation_pairwise_loss(s, sel, CITED2.astype(F32), 0.5), (S2, SEL2), "cited"),
    (lambda s, sel: rj.citation_logistic_loss(s, sel, CITED2.astype(jnp.int32), 0.5), (S2, SEL2), "cited"),
    (lambda s, sel: rj.reinforce_loss(s, sel, jnp.ones((2, 2)), 0.5, 0.5, weights=[1.0, 1.0]), (S2, SEL2), "weights"),
    (lambda s, sel: rj.reinforce_loss(s, sel, jnp.ones((2, 2)), 0.5, 0.5, mode="rmm"), (S2, SEL2), "gumbel"),
])
def test_wrong_kinds_of_argument_raise_value_error_naming_the_argument(fn, args, arg, variant):
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        variant(fn)(*args)


@pytest.mark.parametrize("field", ["rewards", "weights"])
def test_nan_rewards_or_weights_are_refused_eagerly(field):
    # each gave a NaN loss, and an update on it NaN params; checked when concrete, as NaN scores are
    bad = {"rewards": jnp.array([[jnp.nan, 0.0], [1.0, 0.0]]), "weights": jnp.array([1.0, jnp.nan])}
    args = {"rewards": jnp.ones((2, 2)), "weights": None, **{field: bad[field]}}
    with pytest.raises(ValueError, match=rf"^{field}: contains NaN"):
        rj.reinforce_loss(S2, SEL2, args["rewards"], 0.5, 0.5, weights=args["weights"])


def test_a_nan_baseline_is_refused_eagerly_as_nan_rewards_are():
    # it gave a NaN loss (and NaN advantages) without a word, while NaN rewards were refused
    with pytest.raises(ValueError, match=r"^baseline: contains NaN"):
        rj.reinforce_loss(S2, SEL2, jnp.ones((2, 2)), float("nan"), 0.5)
    with pytest.raises(ValueError, match=r"^baseline: contains NaN"):
        rj.advantages(jnp.ones(3), jnp.array([0.5, jnp.nan, 0.5]), jnp.ones(3, bool))
    # under jit a traced baseline is not inspected (no host sync), as the other value checks
    adv = jax.jit(lambda b: rj.advantages(jnp.ones(3), b, jnp.ones(3, bool)))(0.5)
    assert adv.tolist() == [0.5, 0.5, 0.5]
