"""The one update: pure, jitted and eager, the same function in every scope, and equal to a
per-user brute force (autodiff of each user's loss, then optax) whatever the optimiser."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_f32_close, f32_error

import rmm_jax as rj
from rmm_jax.core import optim
from rmm_jax.core.config import describe
from rmm_jax.core.update import (
    act,
    baseline_for,
    importance_weights,
    linear_factors,
    reranker_reinforce_loss,
    retriever_best,
    scores_loss,
)

D, K, M, B, U = 6, 5, 2, 3, 4
VALID = jnp.array([[True, True, False], [True, False, False], [False, False, False], [True, True, True]])


def random_tree(tree, key, scale=0.3):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def random_batch(key, valid, u=U):
    kq, km, ks, kc, kl = jax.random.split(key, 5)
    # M distinct candidates of the K - 1 unmasked ones (the last is masked)
    sel = jax.vmap(jax.vmap(lambda k: jax.random.permutation(k, K - 1)[:M]))(jax.random.split(ks, u * B).reshape(u, B))
    return rj.Batch(q=jax.random.normal(kq, (u, B, D)), m=jax.random.normal(km, (u, B, K, D)),
                    mask=jnp.ones((u, B, K), bool).at[:, :, -1].set(False), valid=valid,
                    selected=sel.astype(jnp.int32), cited=jax.random.bernoulli(kc, 0.5, (u, B, M)),
                    gumbel=jnp.zeros((u, B, K)), logged_log_prob=jax.random.normal(kl, (u, B)) - 3.0,
                    has_logged=jnp.zeros((u, B), bool).at[:, 0].set(True), scores=None)


def setup(scope, optimizer, kind="linear", batch_key=4, **est):
    layout = rj.Layout(k=K, m=M, batch=B, kind=kind, hidden=8 if kind == "mlp" else None,
                       scope=rj.Scope.named(scope, 2 if scope == "hybrid" else None))
    estimator = rj.Estimator(**{"baseline": "constant", "baseline_value": 0.25, "clip": 3.0, **est})
    base = random_tree(rj.init_reranker(jax.random.key(0), D, kind, layout.hidden), jax.random.key(1))
    shared = rj.init_shared(base, layout, optimizer)
    users = jax.vmap(lambda k: rj.init_user(base, k, layout, estimator, optimizer))(
        jax.random.split(jax.random.key(2), U))
    users = users._replace(params=random_tree(users.params, jax.random.key(3)))      # non-zero own parts
    batch = random_batch(jax.random.key(batch_key), VALID)
    scores = jax.vmap(lambda lp, q, m, mk: rj.score_batch(rj.merge_params(shared.params, lp), q, m, mk))(
        users.params, batch.q, batch.m, batch.mask)
    return layout, estimator, shared, users, batch._replace(scores=scores)


OPTIMIZERS = {"sgd": lambda: rj.sgd(0.1), "adam": lambda: rj.adam(0.05),
              "optax_adamw": lambda: optax.adamw(0.05, weight_decay=0.1)}   # any optax transformation


@pytest.mark.parametrize("scope", rj.SCOPES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_update_equals_per_user_brute_force_in_every_scope(scope, opt_name):
    """g_shared = mean over users with a query of each user's own autodiff gradient, stepped
    once by the optimiser at √U_a times its step (U_a = 3 users with a query here); each user's
    own part steps on that user's gradient only (jitted;
    the eager run of the same check is the next test)."""
    check_brute_force(scope, opt_name, jax.jit)


@pytest.mark.parametrize("scope", rj.SCOPES)
def test_update_equals_per_user_brute_force_eagerly(scope):
    check_brute_force(scope, "adam", lambda f: f)


@pytest.mark.parametrize("scope", rj.SCOPES)
@pytest.mark.parametrize("variant_name", ["jit", "eager"])
def test_the_logistic_loss_runs_through_the_same_update_and_equals_the_brute_force(scope, variant_name):
    """``loss="logistic"`` (judge-corrected) is a loss of the scores like REINFORCE: the one update's
    closed-form linear gradient and its shared mean equal autodiff of each user's loss."""
    check_brute_force(scope, "adam", jax.jit if variant_name == "jit" else (lambda f: f),
                      loss="logistic", offset=0.5, p_useful=0.9, p_other=0.2)


@pytest.mark.parametrize("scope", rj.SCOPES)
@pytest.mark.parametrize("variant_name", ["jit", "eager"])
def test_the_retriever_anchored_logistic_loss_runs_through_the_same_update(scope, variant_name):
    """``reference="retriever"``: the closed-form linear gradient and the shared mean equal autodiff
    of each user's loss with the anchor held constant."""
    check_brute_force(scope, "adam", jax.jit if variant_name == "jit" else (lambda f: f),
                      loss="logistic", offset=2.0, reference="retriever")


def test_the_retriever_anchor_is_each_querys_best_base_score_over_its_valid_candidates():
    """The anchor is max_k qᵀm_k over the unmasked candidates (against NumPy in float64, within the
    float32 error bound of the computation), whatever the reranker scores; the
    loss is the one given that anchor, and it differs from the loss anchored at the best current
    score (the learned reranker ranks otherwise)."""
    _, est, shared, users, batch = setup("user", rj.adam(0.05), loss="logistic", offset=2.0, reference="retriever")
    bu = jax.tree.map(lambda x: x[0], batch)
    q, m, mask = (np.asarray(x, np.float64) for x in (bu.q, bu.m, bu.mask))
    want = np.where(mask.astype(bool), np.einsum("bd,bkd->bk", q, m), -np.inf).max(axis=-1)
    assert_f32_close(retriever_best(est, bu), want, f32_error(lambda b: retriever_best(est, b), bu))
    loss = scores_loss(est, bu.scores, bu, 0.0, jnp.ones(B))
    given = rj.citation_logistic_loss(bu.scores, bu.selected, bu.cited, est.tau, offset=2.0, mask=bu.mask,
                                      reference=retriever_best(est, bu))
    assert float(loss) == float(given)
    own = scores_loss(dataclasses.replace(est, reference="best"), bu.scores, bu, 0.0, jnp.ones(B))
    assert abs(float(own) - float(loss)) > 0.1
    assert retriever_best(dataclasses.replace(est, reference="best"), bu) is None


@pytest.mark.parametrize("scope", rj.SCOPES)
@pytest.mark.parametrize("variant_name", ["jit", "eager"])
def test_the_pairwise_loss_runs_through_the_same_update_and_equals_the_brute_force(scope, variant_name):
    """``loss="pairwise"`` goes through the same closed-form linear gradient and shared mean. (Batch
    key 10: three users have a call that cited one of its two shown memories; under key 4 only a
    logged call with a negligible importance weight has one.)"""
    check_brute_force(scope, "adam", jax.jit if variant_name == "jit" else (lambda f: f), batch_key=10,
                      loss="pairwise")


@pytest.mark.parametrize("scope", ["shared", "hybrid"])
def test_the_shared_step_grows_as_the_root_of_the_users_up_to_ten_times_one_users(scope):
    """U identical users (the same batch, all with a query) have one user's gradient as their
    mean, so the shared part moves √U_a times as far as one user's would, up to √100 = 10 times:
    1, 2, 10, 10, 10 times at U = 1, 4, 100, 144, 400 (√U_a alone would give 12 and 20). SGD and
    Adam alike; both runs' float32 bounds from the jaxpr (helpers.f32_error)."""
    layout = rj.Layout(k=K, m=M, batch=B, scope=rj.Scope.named(scope, 2 if scope == "hybrid" else None))
    est = rj.Estimator(baseline="constant", baseline_value=0.25)
    one = random_batch(jax.random.key(4), jnp.ones((1, B), bool), u=1)
    base = random_tree(rj.init_reranker(jax.random.key(0), D), jax.random.key(1))

    def shared_after(n, opt):
        shared = rj.init_shared(base, layout, opt)
        users = jax.vmap(lambda k: rj.init_user(base, k, layout, est, opt))(jax.random.split(jax.random.key(2), n))
        users = users._replace(params=jax.tree.map(lambda x: jnp.zeros_like(x) + x[:1], users.params))  # identical
        batch = jax.tree.map(lambda x: None if x is None else jnp.repeat(x, n, axis=0), one)
        scores = jax.vmap(lambda lp, q, m, mk: rj.score_batch(rj.merge_params(shared.params, lp), q, m, mk))(
            users.params, batch.q, batch.m, batch.mask)
        args = (shared, users, batch._replace(scores=scores))
        update = rj.make_update(layout, est, opt)
        step = lambda *a: update(*a)[0].params     # noqa: E731
        return shared.params, jax.jit(step)(*args), f32_error(step, *args)

    for opt in (rj.sgd(0.1), rj.adam(0.05)):
        start, after_one, e_one = shared_after(1, opt)
        for n, times in ((4, 2.0), (100, 10.0), (144, 10.0), (400, 10.0)):
            _, after_n, e_n = shared_after(n, opt)
            got = jax.tree.map(lambda a, s: np.float64(a) - np.float64(s), after_n, start)
            want = jax.tree.map(lambda a, s: times * (np.float64(a) - np.float64(s)), after_one, start)
            assert_f32_close(got, want, jax.tree.map(lambda en, e1: en + times * e1, e_n, e_one),
                             f"{scope}, U={n}, {opt.name}")


def brute_force(layout, est, opt, shared, users, batch):
    """Per user, autodiff of that user's own loss; the shared part steps on the mean gradient of
    the users with a query, each own part on its user's gradient (optax). Returns the new shared
    params (None without a shared part), each user's new own params, and the mean shared gradient."""
    grads_s, grads_l = [], []
    for u in range(U):
        bu = jax.tree.map(lambda x: x[u], batch)
        w = importance_weights(est, bu.scores, bu)
        gs, gl = jax.grad(lambda s, ll: reranker_reinforce_loss(rj.merge_params(s, ll), bu, jnp.float32(0.25), w,
                                                                est), argnums=(0, 1))(shared.params,
                                                                                      jax.tree.map(lambda x: x[u],
                                                                                                   users.params))
        grads_s.append(gs)
        grads_l.append(gl)
    new_shared = mean_g = None
    if layout.scope.has_shared:
        active = [u for u in range(U) if np.asarray(VALID)[u].any()]
        mean_g = jax.tree.map(lambda *g: sum(g[u] for u in active) / len(active), *grads_s)
        upd, _ = opt.update(mean_g, shared.opt_state, shared.params)
        upd = jax.tree.map(lambda x: np.float32(np.sqrt(min(len(active), 100))) * x, upd)   # √U_a, at most 10
        new_shared = optax.apply_updates(shared.params, upd)
    new_own = []
    for u in range(U):
        own = lambda tree: jax.tree.map(lambda x: x[u], tree)
        upd, _ = opt.update(grads_l[u], own(users.opt_state), own(users.params))
        new_own.append(optax.apply_updates(own(users.params), upd))
    return new_shared, new_own, mean_g


def check_brute_force(scope, opt_name, variant, **est_fields):
    opt = OPTIMIZERS[opt_name]()
    layout, est, shared, users, batch = setup(scope, opt, **est_fields)
    update = rj.make_update(layout, est, opt)
    new_shared, new_users, metrics = variant(update)(shared, users, batch)
    brute = lambda sh, us, bt: brute_force(layout, est, opt, sh, us, bt)
    want_shared, want_own, mean_g = brute(shared, users, batch)
    # both sides float32: the sum of the two computations' bounds
    e_shared, e_own, _ = f32_error(brute, shared, users, batch)
    e_update_shared, e_update_users, _ = f32_error(update, shared, users, batch)
    plus = lambda a, b: jax.tree.map(np.add, a, b)
    if layout.scope.has_shared:
        assert float(optax.tree.norm(mean_g)) > 1e-3                      # the check is not vacuous
        assert_f32_close(new_shared.params, want_shared, plus(e_shared, e_update_shared.params))
    else:
        assert new_shared.params == {}
    for u in range(U):
        own = lambda tree: jax.tree.map(lambda x: x[u], tree)
        assert_f32_close(own(new_users.params), want_own[u], plus(e_own[u], own(e_update_users.params)),
                         err_msg=f"user {u}")
    np.testing.assert_array_equal(new_users.learner_state.step, [1] * U)
    assert metrics["loss"].shape == (U,)


@pytest.mark.parametrize("scope, kind", [(s, "linear") for s in rj.SCOPES] + [("user", "mlp"), ("shared", "mlp")])
@pytest.mark.parametrize("padding", [float("nan"), float("inf")])
@pytest.mark.parametrize("preset", ["default", "reinforce"])
def test_what_a_padded_slot_holds_changes_no_update(scope, kind, padding, preset):
    """A masked slot may hold anything (score's contract), NaN included. It did not change the
    scores, but 0 · NaN in the params' gradient made every kernel NaN after one update (and a
    shared part spreads it to every user). The update from a batch whose padded slots hold
    NaN or inf is the update from the same batch with zeros there, bit for bit."""
    opt = rj.adam(0.05)
    layout, _, shared, users, batch = setup(scope, opt, kind)
    est = rj.preset(preset, k=K, m=M, batch=B, scope=scope)[1]
    update = jax.jit(rj.make_update(layout, est, opt))
    runs = []
    for fill in (0.0, padding):
        m = jnp.where(batch.mask[..., None], batch.m, fill)
        scores = jax.vmap(lambda lp, q, mm, mk: rj.score_batch(rj.merge_params(shared.params, lp), q, mm, mk))(
            users.params, batch.q, m, batch.mask)
        runs.append(update(shared, users, batch._replace(m=m, scores=scores)))
    (clean_shared, clean_users, _), (got_shared, got_users, _) = runs
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(got_users.params) + jax.tree.leaves(got_shared.params))
    jax.tree.map(np.testing.assert_array_equal, (got_shared.params, got_users.params),
                 (clean_shared.params, clean_users.params))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_positive_advantage_raises_the_log_prob_of_the_selection_and_a_negative_lowers_it(kind):
    layout, est, shared, users, batch = setup("user", rj.adam(1e-2), kind, credit="selection", baseline_value=0.0)
    batch = batch._replace(cited=jnp.ones_like(batch.cited), has_logged=jnp.zeros_like(batch.has_logged))
    lp = lambda params: jax.vmap(lambda p, b: jax.vmap(lambda q, m, mk, s: rj.selection_log_prob(
        rj.score(p, q, m, mk), s, est.tau, mask=mk))(b.q, b.m, b.mask, b.selected).sum())(params, batch)
    _, up, _ = jax.jit(rj.make_update(layout, est, rj.adam(1e-2)))(shared, users, batch)
    neg = rj.Estimator(credit="selection", baseline="constant", baseline_value=2.0)
    _, down, _ = jax.jit(rj.make_update(layout, neg, rj.adam(1e-2)))(shared, users, batch)
    active = np.asarray(jnp.any(VALID, -1))
    assert np.all(np.asarray(lp(up.params) > lp(users.params))[active])
    assert np.all(np.asarray(lp(down.params) < lp(users.params))[active])


@pytest.mark.parametrize("scope", ["user", "hybrid"])
def test_closed_form_linear_gradient_equals_autodiff(scope):
    """linear_factors: Σ_b x_b ⊗ y_b at every leaf, kernels and low-rank factors, equals
    jax.grad of the same scores loss through the reranker."""
    layout, est, shared, users, batch = setup(scope, rj.sgd(0.1))
    u = 0
    bu = jax.tree.map(lambda x: x[u], batch)
    params = rj.merge_params(shared.params, jax.tree.map(lambda x: x[u], users.params))
    loss = lambda p: scores_loss(est, rj.score_batch(p, bu.q, bu.m, bu.mask), bu, 0.25, importance_weights(
        est, bu.scores, bu))
    want = jax.grad(loss)(params)

    def factors(p):
        ds = jax.grad(lambda s: scores_loss(est, s, bu, 0.25, importance_weights(est, bu.scores, bu)))(bu.scores)
        return linear_factors(p, bu.q, bu.m, bu.mask, ds)

    dense = lambda p: [x.T @ y for x, y in jax.tree.leaves(factors(p), is_leaf=lambda v: isinstance(v, tuple))]
    pairs = jax.tree.leaves(factors(params), is_leaf=lambda v: isinstance(v, tuple))
    assert len(pairs) == len(jax.tree.leaves(want)) == (6 if scope == "hybrid" else 2)
    bound = [a + b for a, b in zip(f32_error(dense, params), jax.tree.leaves(f32_error(jax.grad(loss), params)))]
    for (x, y), g, e in zip(pairs, jax.tree.leaves(want), bound, strict=True):
        assert x.shape[0] == y.shape[0] == bu.q.shape[0]                  # rank B
        assert_f32_close(x.T @ y, g, e)


@pytest.mark.parametrize("make", [rj.adam, rj.sgd])
def test_an_optimizer_steps_the_same_on_factors_as_optax_on_the_dense_gradient(make):
    opt = make(1e-2)
    p = {"w": jax.random.normal(jax.random.key(0), (5, 7))}
    xys = [(jax.random.normal(jax.random.key(10 + i), (3, 5)), jax.random.normal(jax.random.key(20 + i), (3, 7)))
           for i in range(5)]

    def on_factors(p, step=opt.step_factors):
        st = opt.init(p)
        for x, y in xys:
            p, st = step(p, st, {"w": (x, y)})
        return p, st

    def on_dense(p):
        st = opt.init(p)
        for x, y in xys:
            upd, st = opt.update({"w": x.T @ y}, st, p)
            p = optax.apply_updates(p, upd)
        return p, st

    (pf, st_f), (pd, st_d) = on_factors(p, jax.jit(opt.step_factors)), on_dense(p)
    bound = jax.tree.map(np.add, f32_error(on_factors, p), f32_error(on_dense, p))     # both float32
    assert_f32_close((pf, st_f), (pd, st_d), bound)
    assert jax.tree.structure(st_f) == jax.tree.structure(st_d)              # a stored policy is the same


def test_a_batch_without_queries_leaves_the_shared_part(variant):
    layout, est, shared, users, batch = setup("shared", rj.adam(0.05))
    batch = batch._replace(valid=jnp.zeros((U, B), bool))
    new_shared, _, _ = variant(rj.make_update(layout, est, rj.adam(0.05)))(shared, users, batch)
    for a, b in zip(jax.tree.leaves(new_shared), jax.tree.leaves(shared)):
        assert np.array_equal(a, b)


def test_running_mean_baseline_is_an_ema_used_before_its_update():
    est = rj.Estimator(baseline="running_mean", baseline_value=0.5, ema=0.9)
    ls = rj.init_learner_state(jax.random.key(0), est)
    rewards = jnp.array([[1.0, 0.0, 1.0, 1.0]])
    filled = jnp.ones((1, 4), bool)
    b, new = baseline_for(est, ls, rewards, filled)
    assert float(b) == 0.5
    assert_f32_close(new, 0.9 * 0.5 + 0.1 * 0.75, f32_error(lambda r: baseline_for(est, ls, r, filled)[1], rewards))
    b, _ = baseline_for(rj.Estimator(baseline="batch_mean"), ls, rewards, jnp.array([[True, True, False, False]]))
    assert float(b) == 0.5                                                   # (1 + 0) / 2: exact


def test_importance_weight_is_one_on_policy_and_clipped_off_policy():
    est = rj.Estimator(clip=2.0)
    batch = jax.tree.map(lambda x: x[0], random_batch(jax.random.key(4), jnp.ones((1, B), bool), u=1))
    scores = rj.score_batch(rj.init_reranker(jax.random.key(0), D), batch.q, batch.m, batch.mask)
    sel, _, logp = act(est, M, scores, batch.mask, jax.random.key(8))
    weights = lambda b: importance_weights(est, scores, b)
    on = batch._replace(selected=sel, logged_log_prob=logp, has_logged=jnp.ones((B,), bool))
    np.testing.assert_array_equal(weights(on), np.ones(B))
    np.testing.assert_array_equal(weights(on._replace(logged_log_prob=logp - 5.0)), np.full(B, 2.0))   # clipped: exact
    off = on._replace(logged_log_prob=logp + 1.0)            # float32 logp + 1: not exactly 1 apart
    want = np.exp(np.asarray(logp, np.float64) - np.asarray(off.logged_log_prob, np.float64))
    assert_f32_close(weights(off), want, f32_error(lambda sc: importance_weights(est, sc, off), scores))
    np.testing.assert_array_equal(weights(on._replace(valid=jnp.array([True, False, True]))), [1, 0, 1])


@pytest.mark.parametrize("field, value", [("m", 30), ("tau", 0.0), ("tau", -1.0), ("k", 0), ("reward", "pm2"),
                                          ("baseline", "median"), ("lr", 0.0), ("optimizer", "rmsprop"),
                                          ("scope", "everyone"), ("rank", 0), ("batch", 0), ("loss", "hinge"),
                                          ("offset", float("nan")), ("p_useful", 0.0), ("p_other", 1.0)])
def test_settings_reject_out_of_range_values_naming_the_field(field, value):
    extra = {"scope": "hybrid"} if field == "rank" else {}
    with pytest.raises(ValueError, match=rf"^{field}:"):
        rj.preset("default", **{field: value}, **extra)


@pytest.mark.parametrize("overrides, field", [
    ({"lr": float("nan")}, "lr"), ({"lr": float("inf")}, "lr"), ({"lr": -1.0}, "lr"), ({"lr": "1e-3"}, "lr"),
    ({"batch": True}, "batch"), ({"k": True, "m": 1}, "k"), ({"kind": "mlp", "hidden": 0}, "hidden"),
    ({"baseline_value": float("nan")}, "baseline_value"), ({"on_policy_tol": -1.0}, "on_policy_tol")])
def test_settings_reject_non_finite_values_and_bools_naming_the_field(overrides, field):
    # each was taken: a NaN or infinite step size, a bool as a count, a hidden width of 0
    with pytest.raises(ValueError, match=rf"^{field}:"):
        rj.preset("default", **overrides)


def test_settings_take_numpy_integers_as_the_ints_they_are():
    # preset(k=np.int64(20)) was refused as "k: must be >= 1, got 20"
    got = rj.preset("default", k=np.int64(20), m=np.int32(3), batch=np.int64(2), scope="hybrid", rank=np.int64(4))
    lay = got.layout
    assert lay == rj.preset("default", k=20, m=3, batch=2, scope="hybrid", rank=4).layout
    assert all(type(v) is int for v in (lay.k, lay.m, lay.batch, lay.scope.rank))    # JSON-ready
    assert rj.preset("default", kind="mlp", hidden=np.int64(8)).layout.hidden == 8


@pytest.mark.parametrize("wrap", [jnp.asarray, np.asarray, np.float32, np.float64])
def test_an_estimator_of_numpy_or_jax_numbers_is_hashable_and_json_ready(wrap):
    """check_tau takes a 0-d array, and the Estimator kept it: a jax or NumPy 0-d tau made it
    unhashable (it keys the compiled programs), and a np.float32 one its setting_record a
    TypeError in json.dumps. Each number is the Python float it is, the record as a plain one's."""
    import json

    from rmm_jax.core.config import setting_record

    numbers = dict(tau=0.5, draw_tau=0.25, offset=-1.0, p_useful=0.75, p_other=0.125, baseline_value=0.5,
                   ema=0.5, clip=4.0, on_policy_tol=0.0625)    # exact in float32: the same floats once cast
    est = rj.Estimator(loss="logistic", **{f: wrap(v) for f, v in numbers.items()})
    plain = rj.Estimator(loss="logistic", **numbers)
    assert all(type(getattr(est, f)) is float for f in numbers)
    assert est == plain and hash(est) == hash(plain)
    setting = rj.preset("default")
    record = setting_record("default", setting._replace(estimator=est))
    assert json.loads(json.dumps(record)) == setting_record("default", setting._replace(estimator=plain))


@pytest.mark.parametrize("make", [rj.adam, rj.sgd])
# the last two are inf and 0 in float32, the parameters' type
@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1.0, 0.0, True, 1e300, 1e-50])
def test_optimizers_refuse_a_step_size_that_is_not_positive_and_finite(make, lr):
    with pytest.raises(ValueError, match=r"^lr: must be > 0 and finite"):
        make(lr)


def test_hybrid_needs_the_linear_kind_and_a_rank_below_d():
    with pytest.raises(ValueError, match="^scope:"):
        rj.preset("default", scope="hybrid", kind="mlp", hidden=4)
    with pytest.raises(ValueError, match="^rank:"):
        rj.Scope.named("hybrid", 4).validate("linear", dim=4)


def test_presets_route_each_field_to_its_part():
    lay, est, opt = rj.preset("paper")
    assert (est.tau, opt.lr, lay.batch, est.reward, est.baseline, est.baseline_value, est.mode, est.credit,
            opt.name, est.noise) == (0.5, 1e-3, 4, "pm1", "constant", 0.5, "rmm", "item", "sgd", "unit")
    lay, est, opt = rj.preset("tempered_adam", k=7, scope="hybrid", rank=3)
    assert (opt.name, est.noise, est.tau, est.mode, lay.k, lay.scope) == ("adam", "tempered", 0.5, "rmm", 7,
                                                                          rj.Scope("hybrid", 3))
    assert optim.describe(optax.sgd(0.1)) == {"name": "custom"}
    # realistic: the default before anchored, the REINFORCE default's estimator with the logistic loss, at 1e-4;
    # the default (and anchored, its name before): the same loss against the retriever's best score, +2, at 3e-4
    default, realistic, old = rj.preset("default"), rj.preset("realistic"), rj.preset("reinforce")
    assert default.layout == realistic.layout == old.layout and describe(*rj.preset("anchored")) == describe(*default)
    assert optim.describe(realistic.optimizer) == {**optim.describe(old.optimizer), "lr": 1e-4}
    assert realistic.estimator == dataclasses.replace(old.estimator, loss="logistic") != old.estimator
    assert default.estimator == dataclasses.replace(realistic.estimator, reference="retriever", offset=2.0)
    assert optim.describe(default.optimizer) == {"name": "adam", "lr": 3e-4}
    assert old.estimator == rj.Estimator() and optim.describe(old.optimizer) == {"name": "adam", "lr": 3e-4}
    # calibrated, per scope (BY_SCOPE): realistic's loss corrected for the paper's judge rates, at 2e-4
    # in user and 1e-4 in shared and hybrid; realistic itself is the same in every scope
    judge = dict(p_useful=0.911, p_other=0.154, offset=-1.0)
    for scope, lr in (("user", 2e-4), ("shared", 1e-4), ("hybrid", 1e-4)):
        cal, plain = rj.preset("calibrated", scope=scope), rj.preset("realistic", scope=scope)
        assert cal.layout == plain.layout and cal.layout.scope.name == scope
        assert optim.describe(cal.optimizer) == {"name": "adam", "lr": lr}
        assert optim.describe(plain.optimizer) == {"name": "adam", "lr": 1e-4}
        assert cal.estimator == dataclasses.replace(plain.estimator, **judge)
    # an override wins over the scope's value, and a Scope object selects it as its name does
    assert rj.preset("calibrated", lr=1e-3).optimizer.lr == 1e-3
    assert describe(*rj.preset("calibrated", scope=rj.Scope.named("hybrid", 4))) == \
        describe(*rj.preset("calibrated", scope="hybrid", rank=4))


@pytest.mark.parametrize("scope", ["user", "shared", "hybrid"])
def test_a_store_recorded_under_a_preset_defined_otherwise_keeps_its_learner(scope):
    """A policy store records its setting as the preset's name plus every field; continuing
    it (the recorded fields over the preset, as ``online.setting.resolve_setting`` does) gives
    the learner it was trained with, whatever the name means now in its scope (here a record
    named ``calibrated`` holding the plain loss's values)."""
    from rmm_jax.core.config import setting_record, setting_values
    old = {**setting_record("realistic", rj.preset("realistic", scope=scope)), "preset": "calibrated"}
    values = {k: v for k, v in setting_values(old).items() if k != "preset"}
    continued = rj.preset("calibrated", scope=scope, **values)
    assert describe(*continued) == describe(*rj.preset("realistic", scope=scope))


def test_a_store_recorded_before_the_anchor_existed_keeps_the_best_score_anchor():
    """A record without ``reference`` (written before the field) was trained anchored at the best
    current score: continuing it keeps that, whatever a preset now says, and a run under
    ``anchored`` lists the anchor among its changes (so the CLI can refuse or record it)."""
    from rmm_jax.core.config import setting_changes, setting_record, setting_values
    old = setting_record("default", rj.preset("realistic"))      # the default as it was then
    del old["estimator"]["reference"]
    assert setting_values(old)["reference"] == "best"
    continued = rj.preset("anchored", **{k: v for k, v in setting_values(old).items() if k != "preset"})
    assert continued.estimator.reference == "best"
    changes = setting_changes(old, setting_record("anchored", rj.preset("anchored")))
    assert ("reference", "best", "retriever") in changes


@pytest.mark.parametrize("loss", ["reinforce", "pairwise"])
def test_the_retriever_anchor_is_refused_for_another_loss(loss):
    for name in ("default", "anchored"):
        with pytest.raises(ValueError, match=r"^loss: the retriever anchor \(reference='retriever', presets "
                                             r"'default' and 'anchored'\)"):
            rj.preset(name, loss=loss)


@pytest.mark.parametrize("fields, temp", [({"noise": "unit"}, 1.0), ({"noise": "tempered"}, 0.5),
                                          ({"draw_tau": 0.25}, 0.25)])
def test_act_samples_plackett_luce_at_the_noise_temperature(fields, temp):
    """Unit noise (the paper: top-M of s + g) picks i with softmax(s)_i whatever τ is;
    tempered noise with softmax(s/τ)_i, or softmax(s/draw_tau)_i when the draw has its own
    temperature. The logged log-prob is the exact one of that sampler."""
    est = rj.Estimator(tau=0.5, **fields)
    s = jnp.array([[1.0, 0.0, -0.5]])
    sel, _, logp = jax.vmap(lambda k: act(est, 1, s, jnp.ones((1, 3), bool), k))(jax.random.split(jax.random.key(0),
                                                                                                 20000))
    freq = np.bincount(np.asarray(sel[:, 0, 0]), minlength=3) / 20000
    z = np.asarray(s[0], np.float64) / temp
    want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()                  # float64
    assert np.all(np.abs(freq - want) < 4 * np.sqrt(want * (1 - want) / 20000)), (freq, want)   # Monte Carlo
    # the logged log-prob of each candidate drawn: exp in float64 of float32 within e, so within P·e
    picked = np.asarray(sel[:, 0, 0])
    for i in range(3):
        k = jax.random.split(jax.random.key(0), 20000)[int(np.argmax(picked == i))]
        e = float(f32_error(lambda x: act(est, 1, x, jnp.ones((1, 3), bool), k)[2][0], s))
        assert_f32_close(np.exp(np.asarray(logp[picked == i, 0], np.float64)), want[i], want[i] * e)


def test_a_draw_temperature_changes_the_draw_and_not_the_logistic_loss():
    """``draw_tau`` is the sampler's temperature alone: the logistic loss of a given batch is the
    same with or without it (its logits stay at τ), REINFORCE's exact log-prob takes the
    sampler's, and a bad value is one error naming the field."""
    layout, est, shared, users, batch = setup("user", OPTIMIZERS["adam"](), loss="logistic")
    b = jax.tree.map(lambda x: x[0], batch)
    w = importance_weights(est, b.scores, b._replace(has_logged=jnp.zeros_like(b.has_logged)))
    apart = dataclasses.replace(est, draw_tau=0.02)
    assert apart.sample_tau == 0.02 and apart.tau == est.tau
    assert float(scores_loss(apart, b.scores, b, 0.25, w)) == float(scores_loss(est, b.scores, b, 0.25, w))
    assert rj.Estimator(draw_tau=0.02).loss_tau == 0.02            # REINFORCE: the exact log-prob of the draw
    for fields, message in (({"draw_tau": 0.0}, "must be > 0"), ({"draw_tau": 0.1, "noise": "unit"}, "unit noise")):
        with pytest.raises(ValueError, match=rf"^draw_tau: .*{message}"):
            rj.Estimator(**fields)


# A wrong shape or dtype was a chex AssertionError or a broadcasting error inside the step:
# static, so checked under jit too
@pytest.mark.parametrize("change, field", [
    (lambda b: b._replace(q=b.q[:, 0]), "q"),                                   # rank 2
    (lambda b: b._replace(q=jnp.concatenate([b.q, b.q[:1]])), "q"),              # U + 1 users
    (lambda b: b._replace(cited=jnp.zeros((U, B, M + 1), bool)), "cited"),
    (lambda b: b._replace(valid=b.valid[:, 0]), "valid"),
    (lambda b: b._replace(scores=b.scores[:, :, :-1]), "scores"),
    (lambda b: b._replace(mask=b.mask.astype(jnp.float32)), "mask"),
    (lambda b: b._replace(selected=b.selected.astype(jnp.float32)), "selected"),
])
def test_a_batch_of_the_wrong_shape_or_dtype_is_refused_naming_the_field(change, field, variant):
    layout, est, shared, users, batch = setup("shared", rj.adam(0.05))
    with pytest.raises(ValueError, match=rf"^{field}:"):
        variant(rj.make_update(layout, est, rj.adam(0.05)))(shared, users, change(batch))


# Values are checked when the update runs eagerly (under jit they are traced: the losses vmap over users)
@pytest.mark.parametrize("change, field", [
    (lambda b: b._replace(q=b.q.at[0, 0, 0].set(jnp.nan)), "q"),        # was NaN params with a finite loss
    (lambda b: b._replace(scores=b.scores.at[0, 0, 1].set(jnp.nan)), "scores"),
    (lambda b: b._replace(selected=b.selected.at[0, 0, 1].set(K + 2)), "selected"),   # was a NaN loss
])
def test_a_batch_with_nan_or_an_index_beyond_k_is_refused_eagerly(change, field):
    layout, est, shared, users, batch = setup("user", rj.adam(0.05))
    with pytest.raises(ValueError, match=rf"^{field}:"):
        rj.make_update(layout, est, rj.adam(0.05))(shared, users, change(batch))


def test_init_user_takes_one_prng_key_and_refuses_a_seed():
    # An int seed was an AttributeError ('int' object has no attribute 'dtype').
    lay, est, opt = rj.preset("default", k=3, m=2)
    params = rj.init_reranker(jax.random.key(0), 4)
    for key in (3, np.int64(3), jax.random.split(jax.random.key(0), 2)):
        with pytest.raises(ValueError, match="^key: must be one PRNG key"):
            rj.init_user(params, key, lay, est, opt)
    typed = rj.init_user(params, jax.random.key(1), lay, est, opt)
    raw = rj.init_user(params, jax.random.PRNGKey(1), lay, est, opt)
    assert np.array_equal(typed.learner_state.key, raw.learner_state.key)


@pytest.mark.parametrize("call", [
    lambda key: rj.init_learner_state(key, rj.Estimator()),      # was AttributeError: 'int' has no 'dtype'
    lambda key: rj.init_lowrank(key, 6, 2),                       # was TypeError: invalid PRNG key data
])
def test_the_other_initialisers_take_one_prng_key_and_refuse_a_seed(call):
    for key in (3, np.int64(3), jax.random.split(jax.random.key(0), 2)):
        with pytest.raises(ValueError, match="^key: must be one PRNG key"):
            call(key)
    typed, raw = call(jax.random.key(1)), call(jax.random.PRNGKey(1))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), typed, raw))


@pytest.mark.parametrize("build, field", [
    (lambda lay, est, opt: rj.make_run("default", est, opt), "layout"),        # was AttributeError: no 'scope'
    (lambda lay, est, opt: rj.make_update(lay, "default", opt), "estimator"),  # was taken: failed at the first step
    (lambda lay, est, opt: rj.make_run(lay, est, "adam"), "optimizer"),        # was taken: failed at program.init
    (lambda lay, est, opt: rj.make_update(lay, est, 1e-4), "optimizer"),
])
def test_a_program_refuses_parts_of_the_wrong_kind_when_it_is_built(build, field):
    lay, est, opt = rj.preset("default", k=3, m=2)
    with pytest.raises(ValueError, match=rf"^{field}: must be"):
        build(lay, est, opt)


@pytest.mark.parametrize("field", ["p_useful", "p_other", "offset", "clip", "baseline_value", "ema", "tau",
                                   "draw_tau", "on_policy_tol"])
@pytest.mark.parametrize("value", ["x", [1.0], None])
def test_settings_refuse_a_number_of_the_wrong_type_naming_the_field(field, value):
    # a string or a list was a bare TypeError from a comparison in Estimator.__post_init__
    # ("'<' not supported between 'float' and 'str'"), which the CLI cannot name as an option
    if value is None and field == "draw_tau":
        pytest.skip("draw_tau None: the loss's τ")
    with pytest.raises(ValueError, match=rf"^{field}: must be"):
        rj.preset("default", **{field: value})


def test_settings_keep_an_infinite_clip_and_tolerance():
    # the type checks above take +inf where a comparison took it (clip inf: no clipping)
    est = rj.preset("default", clip=float("inf"), on_policy_tol=float("inf")).estimator
    assert est.clip == float("inf") and est.on_policy_tol == float("inf")


# Swapped or missing arguments were "'SharedState' object has no attribute 'learner_state'";
# checked on the Python side (at trace time under jit), so both ways name the argument
@pytest.mark.parametrize("args, field, want", [
    (lambda s, u, b: (u, s, b), "shared", "SharedState"),
    (lambda s, u, b: (s, s, b), "users", "UserState"),
    (lambda s, u, b: (s, u, None), "batch", "Batch"),
    (lambda s, u, b: (s, u, b._asdict()), "batch", "Batch"),
])
def test_the_update_refuses_an_argument_of_the_wrong_type_naming_it(args, field, want, variant):
    layout, est, shared, users, batch = setup("shared", rj.adam(0.05))
    with pytest.raises(ValueError, match=rf"^{field}: expected a {want} .*got "):
        variant(rj.make_update(layout, est, rj.adam(0.05)))(*args(shared, users, batch))


@pytest.mark.parametrize("scope, kind", [("user", "linear"), ("shared", "linear"), ("hybrid", "linear"),
                                         ("shared", "mlp")])
def test_a_query_of_the_wrong_size_is_blamed_on_q_not_m(scope, kind, variant):
    # a q of d + 1 said "m: expected shape (U, B, K, d + 1)"; m of the wrong size still names m
    layout, est, shared, users, batch = setup(scope, rj.adam(0.05), kind)
    update = variant(rj.make_update(layout, est, rj.adam(0.05)))
    wide = lambda x: jnp.concatenate([x, x[..., :1]], -1)          # noqa: E731
    with pytest.raises(ValueError, match=r"^q: embedding size \d+, the policy's is \d+"):
        update(shared, users, batch._replace(q=wide(batch.q)))
    with pytest.raises(ValueError, match=r"^m: expected shape"):
        update(shared, users, batch._replace(m=wide(batch.m)))
