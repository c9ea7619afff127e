"""REINFORCE is unbiased where documented, masks carry no gradient, listwise loss is CE.

Every test of a pure function runs twice, jitted and eager (the ``variant`` fixture in conftest.py).
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    # 5 standard errors per component (fixed seed), plus float32 slack.
    assert np.all(np.abs(mean - exact) < 5 * se + 1e-3), (mean, exact, se)


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
    base = loss(SCORES[None], jnp.array([[0]], jnp.int32), jnp.array([[1.0]]), 0.0, 1.0, mask=mask)
    padded = loss(SCORES[None], jnp.array([[0, -1]], jnp.int32), jnp.array([[1.0, 1.0]]), 0.0, 1.0,
                  mask=mask)
    np.testing.assert_allclose(base, padded)


def test_advantages_per_credit_on_a_hand_example(variant):
    adv = variant(rj.advantages, static_argnames=("credit",))
    rewards = variant(rj.citation_rewards, static_argnames=("mapping",))
    r = jnp.array([[1.0, 0.0, 1.0]])
    filled = jnp.array([[True, True, False]])
    np.testing.assert_allclose(adv(r, 0.5, filled, "item"), [[0.5, -0.5, 0.0]])
    np.testing.assert_allclose(adv(r, 0.5, filled, "reward_to_go"), [[0.0, -0.5, 0.0]])
    np.testing.assert_allclose(adv(r, 0.5, filled, "selection"), [[0.0, 0.0, 0.0]])
    np.testing.assert_allclose(rewards(jnp.array([True, False]), jnp.array([True, True]), "pm1"), [1, -1])
    np.testing.assert_allclose(rewards(jnp.array([True, False]), jnp.array([True, False]), "binary"), [1, 0])


def test_advantage_is_a_constant_for_the_gradient(variant):
    # d/ds of the loss must equal -A * d/ds log pi with A fixed, even when the baseline
    # is computed from quantities that depend on the scores.
    loss = loss_of(variant)
    s = SCORES[None]
    sel = jnp.array([[2, 0]], jnp.int32)
    r = jnp.array([[1.0, 0.0]])
    g = jax.grad(lambda x: loss(x, sel, r, jnp.mean(x), TAU, credit="item"))(s)
    lp_grads = jax.jacobian(lambda x: rj.selection_log_probs(x[0], sel[0], TAU))(s)
    a = np.asarray(r[0] - jnp.mean(s))
    np.testing.assert_allclose(g, -(a[:, None, None] * np.asarray(lp_grads)).sum(0), rtol=1e-5, atol=1e-6)


def test_listwise_loss_is_cross_entropy_against_normalised_gold(variant):
    listwise = variant(rj.listwise_loss)
    s = jnp.array([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0]])
    gold = jnp.array([[True, False, True, False], [False, False, False, False], [False, True, False, True]])
    mask = jnp.array([[True, True, True, True], [True, True, True, True], [True, True, True, False]])
    # query 2 has no gold; query 3's second gold is masked
    l0 = -(0.5 * jax.nn.log_softmax(s[0])[0] + 0.5 * jax.nn.log_softmax(s[0])[2])
    l2 = -jax.nn.log_softmax(s[2, :3])[1]
    np.testing.assert_allclose(listwise(s, gold, mask), (l0 + l2) / 2, rtol=1e-6)
    g = jax.grad(lambda x: listwise(x, gold, mask))(s)
    assert g[2, 3] == 0.0 and np.all(np.asarray(g[1]) == 0.0)
