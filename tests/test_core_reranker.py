"""The reranker starts as the base retriever, and the fused path equals the naive one.

Every test of a pure function runs twice, jitted and eager (the ``variant`` fixture in conftest.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_f32_close, f32_error

import rmm_jax as rj


def random_params(key, d, kind):
    """Parameters with non-zero residuals, to compare scoring paths away from init."""
    p = rj.init_reranker(key, d, kind, None if kind == "linear" else 16)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())  # numpy: no compiles
    return jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), jnp.float32), p)


@pytest.mark.parametrize("seed", range(5))
def test_fused_linear_scores_equal_naive_scores(seed, variant):
    d, k = 32, 20
    key = jax.random.key(seed)
    p = random_params(key, d, "linear")
    q = jax.random.normal(jax.random.fold_in(key, 1), (d,))
    m = jax.random.normal(jax.random.fold_in(key, 2), (k, d))
    assert_f32_close(variant(rj.score)(p, q, m), variant(rj.score_naive)(p, q, m),      # both float32
                     f32_error(rj.score, p, q, m) + f32_error(rj.score_naive, p, q, m))


def test_fused_path_never_builds_the_k_adapted_memories():
    # The jaxpr of the fused path has no (K, d) x (d, d) product: its only matmul with
    # the memory matrix is (K, d) @ (d,).
    d, k = 16, 7
    p = rj.init_reranker(jax.random.key(0), d)
    jaxpr = jax.make_jaxpr(rj.score)(p, jnp.ones(d), jnp.ones((k, d)))
    shapes = [tuple(v.aval.shape) for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"
              for v in eqn.outvars]
    assert (k, d) not in shapes and (k,) in shapes


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_initial_ranking_equals_base_dot_product_ranking(kind, variant):
    d, k = 24, 30
    init = variant(rj.init_reranker, static_argnames=("dim", "kind", "hidden"))
    score = variant(rj.score)
    for seed in range(5):
        key = jax.random.key(seed)
        p = init(key, d, kind)
        q = jax.random.normal(jax.random.fold_in(key, 1), (d,))
        m = jax.random.normal(jax.random.fold_in(key, 2), (k, d))
        s = score(p, q, m)
        # at init the residual terms are exact zeros: the same dot product as m @ q, summed in any order
        assert_f32_close(s, m @ q, f32_error(rj.score, p, q, m) + f32_error(jnp.matmul, m, q))
        np.testing.assert_array_equal(np.argsort(-np.asarray(s)), np.argsort(-np.asarray(m @ q)))


def test_score_batch_is_score_per_query(variant):
    b, d, k = 3, 8, 5
    key = jax.random.key(11)
    p = random_params(key, d, "mlp")
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((b, d)), jnp.float32)
    m = jnp.asarray(rng.standard_normal((b, k, d)), jnp.float32)
    mask = jnp.asarray(rng.random((b, k)) < 0.7)
    assert not mask.all() and mask.any(axis=1).all()
    batched = np.asarray(variant(rj.score_batch)(p, q, m, mask))
    bound = 2 * f32_error(rj.score_batch, p, q, m)                        # the same formula twice, in float32
    for i in range(b):
        assert_f32_close(batched[i], rj.score(p, q[i], m[i], mask[i]), bound[i])
    assert_f32_close(variant(rj.score_batch)(p, q, m)[0], rj.score(p, q[0], m[0]), bound[0])


def test_masked_slots_score_minus_inf_and_get_zero_gradient(variant):
    d, k = 8, 6
    key = jax.random.key(3)
    p = random_params(key, d, "linear")
    q = jax.random.normal(key, (d,))
    m = jax.random.normal(jax.random.fold_in(key, 1), (k, d))
    mask = jnp.array([True, True, False, True, False, True])
    score = variant(rj.score)
    s = score(p, q, m, mask)
    assert np.isneginf(np.asarray(s)[~np.asarray(mask)]).all()
    g = jax.grad(lambda mm: jnp.sum(jnp.where(mask, score(p, q, mm, mask), 0.0) ** 2))(m)
    assert np.all(np.asarray(g)[~np.asarray(mask)] == 0.0)


@pytest.mark.parametrize("call, arg", [
    (lambda score, p: score(p, jnp.ones(7), jnp.ones((3, 8))), "q"),
    (lambda score, p: score(p, jnp.ones(8), jnp.ones((3, 7))), "m"),
    (lambda score, p: score(p, jnp.ones((1, 8)), jnp.ones((3, 8))), "q"),
    (lambda score, p: score(p, jnp.ones(8, jnp.int32), jnp.ones((3, 8))), "q"),
    (lambda score, p: score(p, jnp.ones(8), jnp.ones((3, 8)), jnp.ones(3)), "mask"),
])
def test_bad_shapes_and_dtypes_raise_value_error_naming_the_argument(call, arg, variant):
    # Shapes and dtypes are static, so the checks fire under jit too (at trace time).
    p = rj.init_reranker(jax.random.key(0), 8)
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        call(variant(rj.score), p)


def test_init_rejects_bad_arguments(variant):
    init = variant(rj.init_reranker, static_argnames=("dim", "kind", "hidden"))
    with pytest.raises(ValueError, match="^kind:"):
        init(jax.random.key(0), 8, "transformer")
    with pytest.raises(ValueError, match="^dim:"):
        init(jax.random.key(0), 0)
    with pytest.raises(ValueError, match="^hidden:"):
        init(jax.random.key(0), 8, "linear", hidden=4)
    # a seed where a key belongs, or a batch of keys: one line naming the key, not flax's error
    for key in (5, np.int64(5), jax.random.split(jax.random.key(0), 2), np.zeros(2, np.float32)):
        with pytest.raises(ValueError, match="^key: must be one PRNG key"):
            init(key, 8)
    raw = init(jax.random.PRNGKey(3), 8, "mlp", 4)           # a raw uint32[2] key is one key too
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), raw,
                                     init(jax.random.wrap_key_data(jax.random.PRNGKey(3)), 8, "mlp", 4)))


def test_numpy_integers_are_taken_as_the_ints_they_are(variant):
    # init_reranker(key, np.int64(4)) was refused as "dim: must be a positive int, got np.int64(4)"
    init = variant(rj.init_reranker, static_argnames=("dim", "kind", "hidden"))
    for kind, hidden in (("linear", None), ("mlp", 3)):
        want = init(jax.random.key(0), 4, kind, hidden)
        got = init(jax.random.key(0), np.int64(4), kind, None if hidden is None else np.int32(hidden))
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, want))
    lowrank = rj.init_lowrank(jax.random.key(0), np.int64(6), np.int64(2))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), lowrank,
                                     rj.init_lowrank(jax.random.key(0), 6, 2)))
    with pytest.raises(ValueError, match="^dim:"):
        init(jax.random.key(0), True)


@pytest.mark.parametrize("call, arg", [
    (lambda p: rj.score(p, [1.0, 0.0, 2.0], jnp.eye(3)), "q"),
    (lambda p: rj.score(p, jnp.ones(3), jnp.eye(3), [True, False, True]), "mask"),
    (lambda p: rj.top_m([0.1, 3.0, -2.0], 2), "logits"),
    (lambda p: rj.top_m(jnp.ones(3), 2, mask=[True, False, True]), "mask"),
    (lambda p: rj.listwise_loss(jnp.zeros((1, 3)), [[True, False, False]]), "gold"),
    (lambda p: rj.score_batch(p, [[1.0, 0.0, 2.0]], jnp.ones((1, 3, 3))), "q"),
])
def test_a_python_list_where_an_array_belongs_is_named_as_a_list(call, arg):
    # A list q was "q: expected a rank-1 array, got shape (3,)" (chex read it as three rank-0
    # arrays), and a list mask or gold a TypeError from jnp.result_type ("Cannot determine dtype").
    # Then "q: expected a rank-1 array, got list [1.0, 0.0, 2.0]", which a list seems to be: the
    # message says the array is a NumPy or JAX one (these functions are traced: no conversion).
    p = rj.init_reranker(jax.random.key(0), 3)
    pattern = rf"^{arg}: expected an? (rank-\d |bool )?array \(numpy or jax\).*, got list \["
    with pytest.raises(ValueError, match=pattern):
        call(p)


@pytest.mark.parametrize("call, arg", [
    (lambda sb, p: sb(p, jnp.ones(3), jnp.ones((1, 2, 3))), "q"),                        # (d,) for (B, d)
    (lambda sb, p: sb(p, jnp.ones((2, 3)), jnp.ones((1, 4, 3))), "m"),                   # B = 2 and 1
    (lambda sb, p: sb(p, jnp.ones((2, 3)), jnp.ones((4, 3))), "m"),                      # (K, d) for (B, K, d)
    (lambda sb, p: sb(p, jnp.ones((2, 3)), jnp.ones((2, 4, 3)), jnp.ones((4,), bool)), "mask"),
])
def test_score_batch_names_the_argument_of_a_wrong_shape(call, arg, variant):
    # each was JAX's "vmap got inconsistent sizes for array axes to be mapped" or "vmap was
    # requested to map its argument along axis 0", naming no argument of score_batch
    p = rj.init_reranker(jax.random.key(0), 3)
    with pytest.raises(ValueError, match=rf"^{arg}: "):
        call(variant(rj.score_batch), p)


@pytest.mark.parametrize("params", [{}, {"q_adapter": {}}, {"W": {"kernel": jnp.eye(3)}}, [1.0], None,
                                    "lowrank"])
@pytest.mark.parametrize("fn", ["score", "score_naive", "score_batch"])
def test_params_that_are_not_a_rerankers_are_one_value_error(params, fn, variant):
    # rj.score({}, q, m) was KeyError 'q_adapter'; a per-user low-rank tree alone KeyError 'down', then
    # "expected ... q_adapter and m_adapter, got keys ['m_adapter', 'q_adapter']": it says what to do now
    says = r"expected a reranker's params \(init_reranker"
    if params == "lowrank":
        params = rj.init_lowrank(jax.random.key(0), 3, 1)
        says = r"low-rank factors alone \(init_lowrank\): merge them with the shared reranker first"
    q, m = (jnp.ones((2, 3)), jnp.ones((2, 4, 3))) if fn == "score_batch" else (jnp.ones(3), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=rf"^params: {says}"):
        variant(getattr(rj, fn))(params, q, m)


def test_merge_params_refuses_parts_that_do_not_add_up():
    """merge_params kept the shared leaf where both parts held one (a whole reranker as a
    hybrid user's part: served as the shared part alone), and took factors of another size
    than the shared kernels (a dot_general TypeError when scored)."""
    p, lr = rj.init_reranker(jax.random.key(0), 4), rj.init_lowrank(jax.random.key(1), 4, 2)
    with pytest.raises(ValueError, match=r"^local: holds m_adapter/W/kernel, which the shared part holds too"):
        rj.merge_params(p, rj.init_reranker(jax.random.key(2), 4))
    with pytest.raises(ValueError, match=r"^local: low-rank factors of dimension 3, the shared reranker's is 4$"):
        rj.merge_params(p, rj.init_lowrank(jax.random.key(1), 3, 2))
    merged = rj.merge_params(p, lr)
    assert rj.merge_params({}, p) is p and rj.merge_params(p, {}) is p
    q, m = jnp.ones(4), jnp.eye(4)
    assert merged["q_adapter"].keys() == {"W", "lora"} and merged["m_adapter"]["lora"] is lr["m_adapter"]["lora"]
    assert rj.score(merged, q, m).shape == (4,)


@pytest.mark.parametrize("batched", [False, True], ids=["score", "score_batch"])
def test_a_nan_embedding_is_refused_eagerly_unless_its_slot_is_masked(batched):
    """rj.score returned NaN scores for a NaN query or candidate, while the samplers, losses
    and Reranker refuse NaN. Eager calls now refuse it by name; a padded (masked) slot may hold
    anything; under jit (traced) nothing is checked, as for the other core functions."""
    p = rj.init_reranker(jax.random.key(0), 3)
    q, m = np.ones(3, np.float32), np.ones((4, 3), np.float32)
    bad_q, bad_m = q.copy(), m.copy()
    bad_q[1], bad_m[2, 0] = np.nan, np.inf
    mask = np.array([True, True, False, True])
    fn = (lambda p, q, m, mask=None: rj.score_batch(p, q[None], m[None], None if mask is None else mask[None])) \
        if batched else rj.score
    with pytest.raises(ValueError, match=r"^q: contains NaN or Inf$"):
        fn(p, bad_q, m)
    with pytest.raises(ValueError, match=r"^m: contains NaN or Inf$"):
        fn(p, q, bad_m)
    with pytest.raises(ValueError, match=r"^m: contains NaN or Inf in a slot the mask keeps$"):
        fn(p, q, bad_m, mask=np.array([True, True, True, True]))
    out = np.asarray(fn(p, q, bad_m, mask=mask)).ravel()          # the bad row is padding: scored -inf
    assert np.isneginf(out[2]) and np.isfinite(out[[0, 1, 3]]).all()
    assert np.isnan(np.asarray(jax.jit(fn)(p, bad_q, m))).all()   # traced: unchecked (core.checks says so)


@pytest.mark.parametrize("dim", [1, 8, 384])
def test_the_identity_reranker_is_init_reranker_bit_for_bit_without_tracing(dim):
    """Serving the identity built it with init_reranker: a dozen small programs traced in every
    `rerank` process before any policy exists. identity_reranker is the same tree of zeros."""
    from rmm_jax.core.reranker import identity_reranker

    got, want = identity_reranker(dim), rj.init_reranker(jax.random.key(0), dim)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == np.asarray(b).tobytes()
