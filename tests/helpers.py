"""Importable test helpers (plain functions), also for test subprocesses: run those with
``PYTHONPATH`` set to this directory (see :data:`TESTS_DIR`) and ``from helpers import ...``."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax

from rmm_jax.core.types import LearnerState, UserState

TESTS_DIR = Path(__file__).resolve().parent


def params_of(seed, kind="linear", d=8, hidden=16):
    """Reranker-shaped params (``linear`` or ``mlp``) with standard-normal float32 values."""
    rng = np.random.default_rng(seed)
    if kind == "linear":
        shapes = {"q_adapter": {"W": {"kernel": (d, d)}}, "m_adapter": {"W": {"kernel": (d, d)}}}
    else:
        layer = {"down": {"kernel": (hidden, d), "bias": (d,)}, "up": {"kernel": (d, hidden), "bias": (hidden,)}}
        shapes = {"q_adapter": layer, "m_adapter": layer}
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                                  is_leaf=lambda x: isinstance(x, tuple))


def learner_of(seed) -> LearnerState:
    """A learner state whose values all depend on ``seed``."""
    return LearnerState(baseline=np.float32(seed / 7), step=np.int32(seed),
                        key=np.asarray(jax.random.key_data(jax.random.PRNGKey(seed))))


def state_of(seed, kind="linear", d=8) -> UserState:
    """A user's policy: params, an Adam state with non-zero moments (count 1) and a learner state."""
    p = params_of(seed, kind, d)
    opt = optax.adam(1e-3)
    o = opt.init(p)
    g = params_of(seed + 10_000, kind, d)
    _, o = opt.update(g, o, p)
    return UserState(p, o, learner_of(seed))


def info_of(seed) -> dict:
    """The info saved with ``state_of(seed)``: ``{"queries_seen": seed, "seed": seed}``."""
    return {"queries_seen": int(seed), "seed": int(seed)}


def stacked(states) -> UserState:
    """Per-user states stacked on a leading users axis, as the online loop hands them over
    (typed PRNG keys stack as jax arrays)."""
    return jax.tree_util.tree_map(lambda *xs: jax.numpy.stack(xs) if isinstance(xs[0], jax.Array) else np.stack(xs),
                                  *states)


def save_seeds(store, seeds: dict, **kw) -> int:
    """Save users ``{user: seed}`` (``state_of(seed)``, ``info_of(seed)``) as one version."""
    return store.save(list(seeds), stacked([state_of(s) for s in seeds.values()]),
                      [info_of(s) for s in seeds.values()], **kw)


# ----------------------------------------------------------------------------- float32 error bounds
#
# Every comparison of a float32 computation in this suite is `assert_f32_close(got, want, bound)`
# with `bound` from `f32_error`: a bound derived from the computation, never a tolerance read off
# one machine (CI runs on other CPUs, whose SIMD widths, FMA contraction and summation orders
# round differently). Comparisons of float64 or exact-integer results, and Monte Carlo checks
# (sampling error, not rounding), say so where they are made.

U32 = 2.0 ** -24
"""Unit roundoff of IEEE float32 with round to nearest: fl(a ∘ b) = (a ∘ b)(1 + δ), |δ| ≤ u."""

ELEMENTARY = 16
"""Roundings (units of u) charged to one elementary function (exp, log, log1p, expm1, tanh,
logistic, erf, rsqrt, pow): these are not correctly rounded. Measured on a dense grid, XLA's CPU
implementations stay within 6.2 u, numpy's float32 ones within 4.4 u and torch's within 2.5 u;
16 u (8 ulp) leaves room for other CPUs' SIMD paths, and tests/test_f32_bounds.py checks it on the
machine that runs the suite."""

SAFETY = 1.01
"""Headroom for what a first-order bound drops (products of two rounding errors, O(u²)) and for
rounding in evaluating the bound itself (float32, relative O(u))."""


def gamma(n) -> float:
    """Higham's γ_n = n·u/(1 − n·u): |Π_{i≤n} (1 + δ_i)^{±1} − 1| ≤ γ_n for |δ_i| ≤ u
    (Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1). A sum or dot product of
    length n, in any order, with or without FMA: |fl(xᵀy) − xᵀy| ≤ γ_n |x|ᵀ|y| (§3.1)."""
    nu = n * U32
    assert nu < 0.5, n
    return nu / (1 - nu)


def f32_error(fn, *args):
    """An elementwise bound on |fl(fn(*args)) − fn(*args)|: how far the float32 evaluation of
    ``fn`` can be from its exact value on these (exactly given) inputs. Same tree as ``fn``'s output.

    A running error analysis (Wilkinson; Higham §3.3) over ``fn``'s jaxpr, so the bound follows the
    computation actually written, gradients and optimiser steps included. Each float value v
    carries a bound e_v, propagated to first order:

    ========================  ===============================================================
    a ± b                      e_a + e_b + u|v|
    a · b                      |a| e_b + |b| e_a + u|v|
    a / b                      (e_a + |v| e_b)/|b| + 2u|v|     (XLA may multiply by 1/b)
    sqrt(a)                    e_a / (2 sqrt(a)) + u|v|
    f(a) elementary            |f'(a)| e_a + ELEMENTARY·u|v|
    xᵀy (dot of length n)      |x|ᵀe_y + e_xᵀ|y| + γ_n |x|ᵀ|y|  (Higham §3.1, any order; Σ x alike)
    max, min, select, gather   the bound of the operand picked (same branch as exact arithmetic)
    ========================  ===============================================================

    A float literal carries its own representation error; integers, booleans, PRNG keys and
    comparisons carry none (a comparison is assumed to go the same way as in exact arithmetic, so
    test inputs stay away from ties). A primitive without a rule raises NotImplementedError.
    Matrix products are taken to run in float32 (CPU; on a GPU, TF32 would need its own u).
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    key = str(closed.jaxpr)
    if key not in _BOUND_PROGRAMS:                # one XLA program per computation, not one per operation
        def bounds(consts, flat, jaxpr=closed.jaxpr):
            outs = _run(jaxpr, [(c, _zeros_like(c)) for c in consts], [(x, _zeros_like(x)) for x in flat])
            return [e if e is not None else jax.numpy.zeros(np.shape(v), np.float32) for v, e in outs]
        _BOUND_PROGRAMS[key] = jax.jit(bounds)
    errs = _BOUND_PROGRAMS[key](closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), [np.asarray(e, np.float64) for e in errs])


_BOUND_PROGRAMS: dict = {}


def assert_f32_close(got, want, bound, err_msg=""):
    """Assert |got − want| ≤ SAFETY·bound elementwise (equal infinities pass), for trees or arrays.

    ``bound`` comes from :func:`f32_error`: of ``got``'s computation when ``want`` is exact
    (float64 from the same float32 inputs), the sum of both sides' when both are float32."""
    for g, w, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(bound), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        b = np.broadcast_to(SAFETY * np.asarray(b, np.float64), np.broadcast_shapes(g.shape, w.shape))
        with np.errstate(invalid="ignore"):
            diff = np.abs(g - w)
        ok = (g == w) | (diff <= b)
        if not ok.all():
            i = np.unravel_index(np.argmax(np.where(ok, -np.inf, diff - b)), ok.shape)
            raise AssertionError(f"{err_msg} {int((~ok).sum())} of {ok.size} beyond the float32 bound; "
                                 f"worst at {i}: got {g[i]!r}, want {w[i]!r}, |diff| {diff[i]:.3g} > bound "
                                 f"{b[i]:.3g}")


def _is_float(x) -> bool:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jax.numpy.issubdtype(dtype, jax.numpy.floating)


def _zeros_like(x):
    return jax.numpy.zeros(np.shape(x), np.float32) if _is_float(x) else None


def _sub_jaxpr(params):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = params.get(name)
        if j is not None:
            return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, ())
    return None


# Primitives that only move, copy or pick values: applied to the bounds as to the values.
_STRUCTURAL = {"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
               "dynamic_update_slice", "concatenate", "pad", "rev", "gather", "copy", "copy_p", "neg", "abs",
               "stop_gradient", "scatter", "split", "real", "optimization_barrier"}
_ELEMENTARY = {  # f'(a) in terms of (a, v = f(a)), for the |f'(a)| e_a term
    "exp": lambda a, v: v, "exp2": lambda a, v: v * np.log(2.0), "log": lambda a, v: 1 / a,
    "log1p": lambda a, v: 1 / (1 + a), "expm1": lambda a, v: v + 1, "tanh": lambda a, v: 1 - v * v,
    "logistic": lambda a, v: v * (1 - v), "erf": lambda a, v: 2 / np.sqrt(np.pi) * jax.numpy.exp(-a * a),
    "erf_inv": lambda a, v: np.sqrt(np.pi) / 2 * jax.numpy.exp(v * v), "rsqrt": lambda a, v: -0.5 * v ** 3,
}


def _rule(prim, params, vals, errs, outs):
    """The bounds of ``outs`` (a list) from the operands' values and bounds (see f32_error)."""
    jnp = jax.numpy
    name = prim.name
    if not any(_is_float(o) for o in outs):
        return [None] * len(outs)                       # comparisons, integers, booleans, PRNG keys
    A = [jnp.abs(v) if _is_float(v) else None for v in vals]
    E = [e if e is not None or not _is_float(v) else jnp.zeros(np.shape(v), np.float32) for v, e in zip(vals, errs)]
    v = outs[0]
    av = jnp.abs(v) if _is_float(v) else None
    if name in _STRUCTURAL:
        if params.get("fill_value", 0) is None or name == "gather":
            params = {**params, "fill_value": 0} if "fill_value" in params else params
        res = prim.bind(*[e if e is not None else x for x, e in zip(vals, E)], **params)
        res = list(res) if prim.multiple_results else [res]
        return [jnp.abs(r) if _is_float(r) else None for r in res]
    if name == "select_n":
        if not _is_float(v):
            return [None]
        return [prim.bind(vals[0], *E[1:], **params)]
    if name in ("add", "sub", "add_any"):
        return [E[0] + E[1] + U32 * av]
    if name == "mul":
        return [A[0] * E[1] + A[1] * E[0] + U32 * av]
    if name == "div":
        return [(E[0] + av * E[1]) / A[1] + 2 * U32 * av]
    if name in ("max", "min"):          # the operand picked, or either when rounding could swap them
        sgn = 1 if name == "max" else -1
        a, b = sgn * vals[0], sgn * vals[1]
        return [jnp.where(a - E[0] >= b + E[1], E[0], jnp.where(b - E[1] >= a + E[0], E[1], jnp.maximum(E[0], E[1])))]
    if name == "clamp":
        return [jnp.maximum(jnp.maximum(E[0], E[1]), E[2])]
    if name in ("sign", "floor", "ceil", "round", "iota", "bitcast_convert_type"):
        return [jnp.zeros(np.shape(v), np.float32)]
    if name == "sqrt":                   # sqrt(a + e) − sqrt(a) ≤ min(e / (2 sqrt a), sqrt e)
        return [jnp.minimum(jnp.where(av > 0, E[0] / (2 * jnp.where(av > 0, av, 1.0)), jnp.inf), jnp.sqrt(E[0]))
                + U32 * av]
    if name == "square":
        return [2 * A[0] * E[0] + U32 * av]
    if name == "integer_pow":
        y = params["y"]
        return [abs(y) * A[0] ** (y - 1) * E[0] + (abs(y) + 2) * U32 * av]
    if name == "pow":
        x, y = vals
        ey = E[1] if E[1] is not None else 0.0
        log_x = jnp.where(A[0] > 0, jnp.log(A[0]), 0.0)
        return [jnp.where(x != 0, jnp.abs(y * v / x), 0.0) * E[0] + jnp.abs(v * log_x) * ey
                + ELEMENTARY * U32 * av * (1 + jnp.abs(y * log_x))]
    if name in _ELEMENTARY:
        slope = jnp.abs(_ELEMENTARY[name](jnp.asarray(vals[0]), v))
        return [jnp.where(E[0] > 0, slope * E[0], 0.0) + ELEMENTARY * U32 * av]
    if name == "dot_general":
        (ca, cb), _ = params["dimension_numbers"]
        n = int(np.prod([np.shape(vals[0])[i] for i in ca])) if ca else 1
        p = {**params, "preferred_element_type": np.float32}
        return [prim.bind(A[0], E[1], **p) + prim.bind(E[0], A[1], **p) + gamma(n) * prim.bind(A[0], A[1], **p)]
    if name == "reduce_sum":
        n = int(np.prod([np.shape(vals[0])[i] for i in params["axes"]]))
        return [prim.bind(E[0], **params) + gamma(max(n - 1, 1)) * prim.bind(A[0], **params)]
    if name in ("reduce_max", "reduce_min"):  # the largest bound among operands that could be the extreme
        x = vals[0] if name == "reduce_max" else -vals[0]
        ax = tuple(params["axes"])
        low = jnp.max(x - E[0], axis=ax, keepdims=True)
        return [jnp.max(jnp.where(x + E[0] >= low, E[0], 0.0), axis=ax)]
    if name == "cumsum":
        n = np.shape(vals[0])[params["axis"]]
        return [prim.bind(E[0], **params) + gamma(max(n - 1, 1)) * prim.bind(A[0], **params)]
    if name in ("cummax", "cummin"):
        return [jax.lax.cummax_p.bind(E[0], **params)]
    if name == "cumlogsumexp":
        n = np.shape(vals[0])[params["axis"]]
        return [jax.lax.cummax_p.bind(E[0], **params) + gamma(n + ELEMENTARY) + ELEMENTARY * U32 * av]
    if name == "scatter-add":
        k = max(int(np.size(vals[2])), 1)
        res = prim.bind(E[0], vals[1], E[2], **params) + gamma(k) * prim.bind(A[0], vals[1], A[2], **params)
        return [res]
    if name == "sort":
        nk = params["num_keys"]
        fl = [i for i, x in enumerate(vals) if _is_float(x)]
        res = prim.bind(*vals, *[E[i] for i in fl], **{**params, "num_keys": nk})
        return [res[len(vals) + fl.index(i)] if i in fl else None for i in range(len(vals))]
    if name == "top_k":
        return [jnp.take_along_axis(E[0], outs[1], axis=-1), None]
    if name == "convert_element_type":
        if not _is_float(v):
            return [None]
        return [E[0] if _is_float(vals[0]) else U32 * av]
    raise NotImplementedError(f"f32_error has no rule for the primitive {name!r}")


def _run(jaxpr, consts, args):
    """Evaluate ``jaxpr`` on (value, bound) pairs; returns the outputs' (value, bound) pairs."""
    env = {}

    def read(var):
        if isinstance(var, jax.extend.core.Literal):
            x = var.val
            if _is_float(x):                     # a literal's own rounding to float32 (0 for ±inf)
                exact = float(np.asarray(x, np.float64))
                err = abs(exact - float(np.float32(x))) if np.isfinite(exact) else 0.0
                return x, jax.numpy.asarray(err, np.float32)
            return x, None
        return env[var]

    for var, pair in zip(jaxpr.constvars, consts):
        env[var] = pair
    for var, pair in zip(jaxpr.invars, args):
        env[var] = pair
    for eqn in jaxpr.eqns:
        pairs = [read(v) for v in eqn.invars]
        vals, errs = [p[0] for p in pairs], [p[1] for p in pairs]
        name, params = eqn.primitive.name, eqn.params
        if name in ("while", "scan", "cond"):
            out = _control(name, params, pairs)
        elif _sub_jaxpr(params) is not None:
            inner, inner_consts = _sub_jaxpr(params)
            out = _run(inner, [(c, _zeros_like(c)) for c in inner_consts], pairs)
        else:
            res = eqn.primitive.bind(*vals, **params)
            res = list(res) if eqn.primitive.multiple_results else [res]
            # an infinite result (a masked score) is infinite in exact arithmetic too: no error
            out = [(r, e if e is None else jax.numpy.where(jax.numpy.isfinite(r), e, 0.0))
                   for r, e in zip(res, _rule(eqn.primitive, params, vals, errs, res))]
        for var, pair in zip(eqn.outvars, out):
            env[var] = pair
    return [read(v) for v in jaxpr.outvars]


def _control(name, params, pairs):
    """while, scan and cond on (value, bound) pairs, as the same control flow (traced under jit)."""
    lax = jax.lax
    run = lambda closed, ins: _run(closed.jaxpr, [(c, _zeros_like(c)) for c in closed.consts], ins)
    if name == "cond":
        branches = [lambda ins, br=br: run(br, ins) for br in params["branches"]]
        return lax.switch(pairs[0][0], branches, pairs[1:])
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = pairs[:nc], pairs[nc:nc + nb], pairs[nc + nb:]
        return lax.while_loop(lambda c: run(params["cond_jaxpr"], cconsts + c)[0][0],
                              lambda c: run(params["body_jaxpr"], bconsts + c), carry)
    nc, ncarry = params["num_consts"], params["num_carry"]
    consts, carry, xs = pairs[:nc], pairs[nc:nc + ncarry], pairs[nc + ncarry:]

    def body(c, x):
        out = run(params["jaxpr"], consts + c + x)
        return out[:ncarry], out[ncarry:]

    carry, ys = lax.scan(body, carry, xs, length=params["length"], reverse=params["reverse"])
    return carry + ys
