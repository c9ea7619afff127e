"""The suite's float32 tolerances (tests/helpers.py: ``f32_error``) are bounds, on this machine too.

Two things would make a bound derived from the computation wrong on some CPU: an elementary
function less accurate than the charge ``ELEMENTARY`` (exp, log, tanh... are not correctly rounded,
and numpy, XLA and torch each bring their own SIMD versions), and a rule of the running error
analysis that misses a rounding. The first is measured here on a dense grid, for each library the
suite compares; the second by evaluating real computations of the library in float64
(``jax.enable_x64``) on the same float32 inputs: the float32 result must lie within the bound, and
the bound must stay far below the size of a bug.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from helpers import ELEMENTARY, U32, f32_error, gamma
from scipy import special

import rmm_jax as rj
from rmm_jax.core.update import reranker_reinforce_loss

WIDE = np.linspace(-40, 40, 200_001, dtype=np.float32)
POSITIVE = np.concatenate([np.geomspace(1e-30, 1e30, 100_001), np.linspace(0.25, 4, 100_001)]).astype(np.float32)
FUNCTIONS = {                      # name: (inputs, float64 truth, jax, numpy float32 or None, torch)
    "exp": (WIDE, np.exp, jnp.exp, np.exp, torch.exp),
    "log": (POSITIVE, np.log, jnp.log, np.log, torch.log),
    "log1p": (POSITIVE, np.log1p, jnp.log1p, np.log1p, torch.log1p),
    "expm1": (WIDE / 8, np.expm1, jnp.expm1, np.expm1, torch.expm1),
    "tanh": (WIDE / 8, np.tanh, jnp.tanh, np.tanh, torch.tanh),
    "logistic": (WIDE, special.expit, jax.nn.sigmoid, None, torch.sigmoid),
    "erf": (WIDE / 8, special.erf, jax.scipy.special.erf, None, torch.erf),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_elementary_functions_stay_within_their_charge_in_every_library_the_suite_compares(name):
    x, truth, jax_fn, np_fn, torch_fn = FUNCTIONS[name]
    want = truth(x.astype(np.float64))
    normal = np.isfinite(want) & (np.abs(want) > np.finfo(np.float32).tiny) & (np.abs(want) < 1e38)
    got = {"xla": np.asarray(jax.jit(jax_fn)(x)), "torch": torch_fn(torch.from_numpy(x)).numpy()}
    if np_fn is not None:
        got["numpy"] = np_fn(x)
    for lib, g in got.items():
        rel = np.abs(g.astype(np.float64) - want)[normal] / np.abs(want[normal])
        assert rel.max() <= ELEMENTARY * U32, f"{lib} {name}: {rel.max() / U32:.2f} u > ELEMENTARY = {ELEMENTARY} u"


def test_gamma_is_highams():
    assert gamma(1) == pytest.approx(U32 / (1 - U32), rel=1e-15)          # float64 arithmetic on exact inputs
    assert gamma(384) == pytest.approx(384 * U32 / (1 - 384 * U32), rel=1e-15)


def _rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _unit(shape, seed):
    """Unit-norm rows, as the retriever's embeddings are."""
    x = _rand(shape, seed)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _reranker(kind, rank=None):
    d = 16
    p = rj.init_reranker(jax.random.key(0), d, kind, 24 if kind == "mlp" else None)
    if rank:
        p = rj.merge_params(p, rj.init_lowrank(jax.random.key(1), d, rank))
    return jax.tree.map(lambda a: jnp.asarray(_rand(a.shape, a.size, 0.3)), p)


def _batch():
    b, k, d = 3, 6, 16
    sel = np.array([[0, 3], [5, 1], [2, -1]], np.int32)
    return rj.Batch(q=_unit((b, d), 1), m=_unit((b, k, d), 2), mask=np.ones((b, k), bool), selected=sel,
                    cited=np.array([[True, False], [False, True], [True, False]]), gumbel=np.zeros((b, k), np.float32),
                    valid=np.ones(b, bool), logged_log_prob=np.zeros(b, np.float32), has_logged=np.zeros(b, bool))


def _adam_after_steps(params, grads):
    opt = optax.adam(1e-2)
    state = opt.init(params)
    for g in grads:
        upd, state = opt.update(g, state, params)
        params = optax.apply_updates(params, upd)
    return params


def _loops_and_scatters(x, i):
    y = jax.lax.fori_loop(0, 3, lambda _, c: c * x + 0.25, x)                     # a while loop
    products = jax.lax.scan(lambda c, v: (c + v, c * v), 0.0, x)[1]              # a scan
    return y.at[i].add(products[:2]).at[1].set(x[3] / 3)                          # scatter-add, scatter


CASES = {
    "dot d=384": (jnp.dot, lambda: (_rand(384, 1), _rand(384, 2))),
    "fused linear score": (rj.score, lambda: (_reranker("linear"), _unit(16, 3), _unit((6, 16), 4))),
    "naive hybrid score": (rj.score_naive, lambda: (_reranker("linear", 3), _unit(16, 3), _unit((6, 16), 4))),
    "mlp score": (rj.score, lambda: (_reranker("mlp"), _unit(16, 3), _unit((6, 16), 4))),
    "plackett-luce log-probs": (lambda s: rj.selection_log_probs(s, jnp.array([3, 0, -1]), 0.5),
                                lambda: (_rand(6, 5, 2.0),)),
    "reinforce gradient": (lambda p, bt: jax.grad(reranker_reinforce_loss)(p, bt, 0.4, jnp.ones(3), rj.Estimator()),
                           lambda: (_reranker("linear"), _batch())),
    "loops and scatters": (_loops_and_scatters, lambda: (_unit(6, 7), np.array([4, 2]))),
    "three adam steps": (_adam_after_steps, lambda: (_reranker("linear"), [
        jax.tree.map(lambda a: _rand(a.shape, 100 + i), _reranker("linear")) for i in range(3)])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_bound_holds_against_float64_and_is_far_below_a_bug(case):
    fn, make = CASES[case]
    args = make()
    bound = f32_error(fn, *args)
    got = jax.jit(fn)(*args)
    with jax.enable_x64(True):
        exact = jax.jit(fn)(*jax.tree.map(lambda a: np.asarray(a, np.float64) if np.asarray(a).dtype == np.float32
                                          else a, args))
    for g, e, b in zip(jax.tree.leaves(got), jax.tree.leaves(exact), jax.tree.leaves(bound), strict=True):
        g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
        assert np.all(np.abs(g - e) <= b), (case, np.abs(g - e).max(), b.max())
        assert np.all(b <= 1e-2 * np.abs(e).max()), (case, b.max())        # a bug moves results by far more
