"""Policy scopes: the scoped update against per-user brute force, the low-rank residual,
the order users see the shared part in, and what one question per user can teach."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rmm_jax as rj
from rmm_jax.core.update import importance_weights, reranker_reinforce_loss
from rmm_jax.data.citations import oracle_cite
from rmm_jax.online.driver import ChunkDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.run import simulate
from rmm_jax.online.vectors import VectorSpec, shared_distortion, vector_chunks, vector_stream

D, K, M, B, U = 6, 5, 2, 3, 4


def random_tree(tree, key, scale=0.3):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def random_batch(key, valid):
    kq, km, ks, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (U, B, D))
    m = jax.random.normal(km, (U, B, K, D))
    sel = jax.vmap(jax.vmap(lambda k: jax.random.permutation(k, K)[:M]))(jax.random.split(ks, U * B).reshape(U, B))
    return rj.Batch(q=q, m=m, mask=jnp.ones((U, B, K), bool), valid=valid, selected=sel.astype(jnp.int32),
                    cited=jax.random.bernoulli(kc, 0.5, (U, B, M)), gumbel=jnp.zeros((U, B, K)),
                    logged_log_prob=jnp.zeros((U, B)), has_logged=jnp.zeros((U, B), bool), scores=None)


@pytest.mark.parametrize("scope", ["shared", "hybrid"])
def test_scoped_update_matches_per_user_brute_force(variant, scope):
    """g_shared = mean over users with a query of each user's own gradient; each user's
    factors get that user's gradient only; SGD makes the update exactly −lr·g."""
    cfg = rj.Config(k=K, m=M, batch=B, scope=scope, rank=2, optimizer="sgd", lr=0.1, baseline="constant",
                    baseline_value=0.25)
    base = random_tree(rj.init_reranker(jax.random.key(0), D), jax.random.key(1))
    shared = rj.init_shared_state(base, cfg)
    users = jax.vmap(lambda k: rj.init_local_state(base, k, cfg))(jax.random.split(jax.random.key(2), U))
    users = users._replace(params=random_tree(users.params, jax.random.key(3)))    # non-zero factors
    valid = jnp.array([[True, True, False], [True, False, False], [False, False, False], [True, True, True]])
    batch = random_batch(jax.random.key(4), valid)
    scores = jax.vmap(lambda lp, q, m: rj.score_batch(rj.merge_params(shared.params, lp), q, m))(users.params,
                                                                                               batch.q, batch.m)
    batch = batch._replace(scores=scores)
    new_shared, new_users, _ = variant(rj.make_apply_scoped_update(cfg))(shared, users, batch)

    grads_s, grads_l = [], []
    for u in range(U):
        bu = jax.tree.map(lambda x: x[u], batch)
        lp = jax.tree.map(lambda x: x[u], users.params)
        w = importance_weights(cfg, bu.scores, bu)
        gs, gl = jax.grad(lambda s, ll: reranker_reinforce_loss(rj.merge_params(s, ll), bu, jnp.float32(0.25), w,
                                                                cfg), argnums=(0, 1))(shared.params, lp)
        grads_s.append(gs)
        grads_l.append(gl)
    active = [u for u in range(U) if bool(valid[u].any())]
    mean_g = jax.tree.map(lambda *g: sum(g[u] for u in active) / len(active), *grads_s)
    want_shared = jax.tree.map(lambda p, g: p - 0.1 * g, shared.params, mean_g)
    for a, b in zip(jax.tree.leaves(new_shared.params), jax.tree.leaves(want_shared)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert float(optax.tree.norm(mean_g)) > 1e-3                     # the check is not vacuous
    for u in range(U):
        want = jax.tree.map(lambda p, g: p[u] - 0.1 * g, users.params, grads_l[u])
        for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x[u], new_users.params)), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_scoped_update_without_queries_leaves_the_shared_part(variant):
    cfg = rj.Config(k=K, m=M, batch=B, scope="shared")
    p = random_tree(rj.init_reranker(jax.random.key(0), D), jax.random.key(1))
    shared = rj.init_shared_state(p, cfg)
    users = jax.vmap(lambda k: rj.init_local_state(p, k, cfg))(jax.random.split(jax.random.key(2), U))
    batch = random_batch(jax.random.key(4), jnp.zeros((U, B), bool))
    batch = batch._replace(scores=jax.vmap(lambda q, m: rj.score_batch(p, q, m))(batch.q, batch.m))
    new_shared, _, _ = variant(rj.make_apply_scoped_update(cfg))(shared, users, batch)
    for a, b in zip(jax.tree.leaves(new_shared), jax.tree.leaves(shared)):
        assert np.array_equal(a, b)


def test_lowrank_scores_equal_the_dense_adapted_reranker(variant):
    """Fused O(d² + K·d + d·r) path = (m + m K_m^u)·(q + q K_q^u) with K^u = K + A Bᵀ built densely."""
    p = random_tree(rj.init_reranker(jax.random.key(0), D), jax.random.key(1))
    lr = random_tree(rj.init_lowrank(jax.random.key(2), D, 2), jax.random.key(3))
    q, m = jax.random.normal(jax.random.key(4), (D,)), jax.random.normal(jax.random.key(5), (K, D))
    dense = lambda a: p[a]["W"]["kernel"] + lr[a]["lora"]["a"] @ lr[a]["lora"]["b"].T
    want = (m + m @ dense("m_adapter")) @ (q + q @ dense("q_adapter"))
    got = variant(rj.score)(rj.merge_params(p, lr), q, m)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rj.score_naive(rj.merge_params(p, lr), q, m), want, rtol=1e-5, atol=1e-5)


def test_a_new_hybrid_user_scores_exactly_as_the_shared_policy():
    p = random_tree(rj.init_reranker(jax.random.key(0), D), jax.random.key(1))
    cfg = rj.Config(scope="hybrid", rank=3)
    shared, local = rj.split_params(p, jax.random.key(7), cfg)
    assert float(jnp.abs(local["q_adapter"]["lora"]["a"]).max()) > 0       # A random, B zero
    q, m = jax.random.normal(jax.random.key(4), (D,)), jax.random.normal(jax.random.key(5), (K, D))
    assert np.array_equal(rj.score(rj.merge_params(shared, local), q, m), rj.score(p, q, m))


def test_rank_and_scope_are_checked():
    with pytest.raises(ValueError, match="rank"):
        rj.init_lowrank(jax.random.key(0), 4, 4)
    with pytest.raises(ValueError, match="rank"):
        rj.Config(scope="hybrid", rank=0)
    with pytest.raises(ValueError, match="scope"):
        rj.Config(scope="hybrid", kind="mlp", hidden=4)
    with pytest.raises(ValueError, match="scope"):
        rj.Config(scope="everyone")


SPEC = VectorSpec(dim=16, memories=24, queries=12, k=8)
CFG = rj.Config(k=8, m=3, lr=1e-2)


def run_chunks(chunks, cfg, shared=None, upc=4):
    return [e for e in drive(chunks, rj.init_reranker(jax.random.key(0), SPEC.dim), cfg,
                             make_run(cfg, oracle_cite), users_per_chunk=upc, shared=shared)
            if isinstance(e, ChunkDone)]


@pytest.mark.parametrize("scope", ["shared", "hybrid"])
def test_user_by_user_order_sees_only_earlier_users(scope):
    """With one user per chunk, user 1 runs from the shared part user 0 left, and nothing else."""
    cfg = dataclasses.replace(CFG, scope=scope, rank=2)
    s = shared_distortion(SPEC, 0)
    users = [vector_stream(SPEC, 0, i, s) for i in range(2)]
    first, second = run_chunks([[users[0]], [users[1]]], cfg, upc=1)
    (alone,) = run_chunks([[users[1]]], cfg, shared=first.shared, upc=1)
    for key in ("recall", "selected", "cited"):
        assert np.array_equal(second.outputs[users[1].user_id][key], alone.outputs[users[1].user_id][key])
    for a, b in zip(jax.tree.leaves(second.shared), jax.tree.leaves(alone.shared)):
        assert np.array_equal(a, b)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), first.shared.params,
                                         rj.init_shared_state(rj.init_reranker(jax.random.key(0), SPEC.dim),
                                                              cfg).params))
    assert max(moved) > 0                                              # user 0 did teach the shared part


def test_one_question_per_user_user_scope_cannot_learn_shared_can():
    """Prequential scoring scores a user's only query before its only update: scope user
    equals the base retriever exactly; scope shared carries what earlier users taught."""
    spec = VectorSpec(dim=32, memories=60, queries=1, k=20)
    streams = [s for c in vector_chunks(spec, 1, 160, 16) for s in c]
    params = rj.init_reranker(jax.random.key(0), spec.dim)
    user = simulate(streams, params, rj.Config(lr=3e-3), precision=0.876, recall=0.858, users_per_chunk=16)
    assert user.summary["recall@5"] == user.base["recall@5"]
    shared = simulate(streams, params, rj.Config(lr=3e-3, scope="shared"), precision=0.876, recall=0.858,
                      users_per_chunk=16)
    assert shared.summary["recall@5"] > shared.base["recall@5"] + 0.02, (shared.summary["recall@5"],
                                                                         shared.base["recall@5"])
