"""The update step is pure: it jits, vmaps over users, and moves the policy the right way."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rmm_jax as rj
from rmm_jax.core.update import act, baseline_for, importance_weights

D, K, M, B = 16, 8, 3, 4


def make_batch(key, cited_pattern=(True, False, False)):
    kq, km = jax.random.split(key)
    sel = jnp.tile(jnp.array([[0, 3, 5]], jnp.int32), (B, 1))
    return rj.Batch(q=jax.random.normal(kq, (B, D)), m=jax.random.normal(km, (B, K, D)),
                    mask=jnp.ones((B, K), bool), selected=sel,
                    cited=jnp.tile(jnp.array([cited_pattern]), (B, 1)), gumbel=jnp.zeros((B, K)),
                    valid=jnp.ones((B,), bool), logged_log_prob=jnp.zeros((B,)),
                    has_logged=jnp.zeros((B,), bool))


def setup(cfg, key=jax.random.key(0)) -> rj.UserState:
    return rj.init_user_state(rj.init_reranker(key, D, cfg.kind), key, cfg)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_positive_advantage_raises_log_prob_of_the_chosen_selection(kind):
    cfg = rj.Config(kind=kind, m=M, k=K, lr=1e-2, baseline="constant", baseline_value=0.0,
                    reward="binary", credit="selection")
    state = setup(cfg)
    params = state.params
    batch = make_batch(jax.random.key(1), cited_pattern=(True, True, True))
    apply = jax.jit(rj.make_apply_update(cfg))
    lp = lambda p: jax.vmap(lambda q, m, s: rj.selection_log_prob(rj.score(p, q, m), s, cfg.tau))(
        batch.q, batch.m, batch.selected).sum()
    new, _ = apply(state, batch)
    assert lp(new.params) > lp(params)
    # and a negative advantage lowers it
    cfg_neg = dataclasses.replace(cfg, baseline_value=2.0)
    new, _ = jax.jit(rj.make_apply_update(cfg_neg))(state, batch)
    assert lp(new.params) < lp(params)


def test_update_runs_under_vmap_over_users_and_equals_per_user_updates():
    cfg = rj.Config(m=M, k=K, lr=1e-2)
    n_users = 3
    keys = jax.random.split(jax.random.key(5), n_users)
    states = [setup(cfg, k) for k in keys]
    batches = [make_batch(jax.random.fold_in(k, 9), (True, i % 2 == 0, False)) for i, k in enumerate(keys)]
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
    apply = rj.make_apply_update(cfg)
    vstate, _ = jax.jit(jax.vmap(apply))(stack(states), stack(batches))
    for u in range(n_users):
        ustate, _ = jax.jit(apply)(states[u], batches[u])
        for a, b in zip(jax.tree.leaves(ustate), jax.tree.leaves(jax.tree.map(lambda x: x[u], vstate))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(vstate.learner_state.step, [1] * n_users)


def test_step_acts_cites_and_updates_under_jit():
    cfg = rj.Config(m=M, k=K, lr=1e-2)
    state = setup(cfg)
    batch = make_batch(jax.random.key(2))
    gold = jnp.zeros((B, K), bool).at[:, :4].set(True)
    queries = rj.QueryBatch(q=batch.q, m=batch.m, mask=batch.mask, valid=batch.valid, gold=gold)
    cite_gold = lambda key, is_gold, filled: is_gold & filled
    step = jax.jit(rj.make_update_step(cfg, cite_gold))
    new, metrics = step(state, queries, jax.random.key(3))
    sel, cited = np.asarray(metrics["selected"]), np.asarray(metrics["cited"])
    np.testing.assert_array_equal(cited, sel < 4)  # exactly the gold ones were cited
    assert int(new.learner_state.step) == 1
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params)))


def test_running_mean_baseline_is_an_ema_used_before_its_update():
    cfg = rj.Config(baseline="running_mean", baseline_value=0.5, ema=0.9)
    ls = rj.init_learner_state(jax.random.key(0), cfg)
    rewards = jnp.array([[1.0, 0.0, 1.0, 1.0]])
    b, new = baseline_for(cfg, ls, rewards, jnp.ones((1, 4), bool))
    assert float(b) == 0.5
    np.testing.assert_allclose(new, 0.9 * 0.5 + 0.1 * 0.75)
    first_two = jnp.array([[True, True, False, False]])
    b, _ = baseline_for(dataclasses.replace(cfg, baseline="batch_mean"), ls, rewards, first_two)
    np.testing.assert_allclose(b, 0.5)


def test_importance_weight_is_one_on_policy_and_clipped_off_policy():
    cfg = rj.Config(m=M, k=K, clip=2.0)
    state = setup(cfg)
    batch = make_batch(jax.random.key(4))
    scores = rj.score_batch(state.params, batch.q, batch.m, batch.mask)
    sel, _, logp = act(cfg, scores, batch.mask, jax.random.key(8))
    weights = lambda b: importance_weights(cfg, scores, b)
    on = batch._replace(selected=sel, logged_log_prob=logp, has_logged=jnp.ones((B,), bool))
    np.testing.assert_array_equal(weights(on), np.ones(B))
    off = on._replace(logged_log_prob=logp - 5.0)  # logged policy found it far less likely
    np.testing.assert_allclose(weights(off), np.full(B, 2.0), rtol=1e-6)
    low = on._replace(logged_log_prob=logp + 1.0)
    np.testing.assert_allclose(weights(low), np.full(B, np.exp(-1.0)), rtol=1e-5)
    pad = on._replace(valid=jnp.array([True, False, True, False]))
    np.testing.assert_array_equal(weights(pad), [1, 0, 1, 0])


@pytest.mark.parametrize("field, value", [("m", 30), ("tau", 0.0), ("tau", -1.0), ("k", 0),
                                          ("reward", "pm2"), ("baseline", "median"), ("lr", 0.0)])
def test_config_rejects_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        rj.Config(**{field: value})


def test_paper_preset_is_the_literal_setting():
    c = rj.Config.preset("paper")
    assert (c.tau, c.lr, c.batch, c.reward, c.baseline, c.baseline_value, c.mode, c.credit, c.optimizer,
            c.noise) == (0.5, 1e-3, 4, "pm1", "constant", 0.5, "rmm", "item", "sgd", "unit")
    t = rj.Config.preset("tempered_adam")
    assert (t.optimizer, t.noise, t.tau, t.mode) == ("adam", "tempered", 0.5, "rmm")


@pytest.mark.parametrize("noise, temp", [("unit", 1.0), ("tempered", 0.5)])
def test_act_samples_plackett_luce_at_the_noise_temperature(noise, temp):
    """Unit noise (the paper: top-M of s + g) picks i with softmax(s)_i whatever τ is;
    tempered noise with softmax(s/τ)_i. The logged log-prob is the exact one of that sampler."""
    cfg = rj.Config(k=3, m=1, tau=0.5, noise=noise)
    s = jnp.array([[1.0, 0.0, -0.5]])
    sel, _, logp = jax.vmap(lambda k: act(cfg, s, jnp.ones((1, 3), bool), k))(jax.random.split(jax.random.key(0),
                                                                                             20000))
    freq = np.bincount(np.asarray(sel[:, 0, 0]), minlength=3) / 20000
    want = np.asarray(jax.nn.softmax(s[0] / temp))
    assert np.all(np.abs(freq - want) < 4 * np.sqrt(want * (1 - want) / 20000)), (freq, want)
    np.testing.assert_allclose(np.exp(np.asarray(logp[:, 0])), want[np.asarray(sel[:, 0, 0])], rtol=1e-5)
