"""Importable test helpers (plain functions), also for test subprocesses: run those with
``PYTHONPATH`` set to this directory (see :data:`TESTS_DIR`) and ``from helpers import ...``."""
from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.extend  # noqa: F401 - jax.extend.core below (once imported through flax, which rmm-jax no longer imports)
import numpy as np
import optax
import pytest

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


def state_for(seed, scope: str = "user", d=8, rank=2) -> UserState:
    """A user's policy holding the part ``scope`` keeps per user (what a save in a store of
    that scope takes): ``state_of`` in ``user``, standard-normal low-rank factors of ``rank``
    in ``hybrid``, no params in ``shared``; each with Adam moments (count 1) and a learner state."""
    if scope == "user":
        return state_of(seed, d=d)
    rng = np.random.default_rng(seed)
    p = {} if scope == "shared" else {
        a: {"lora": {f: rng.standard_normal((d, rank)).astype(np.float32) for f in "ab"}}
        for a in ("q_adapter", "m_adapter")}
    opt = optax.adam(1e-3)
    _, o = opt.update(jax.tree_util.tree_map(lambda x: x + 1, p), opt.init(p), p)
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
    """Save users ``{user: seed}`` (``state_for(seed)`` of the store's scope, ``info_of(seed)``) as one
    version."""
    return store.save(list(seeds), stacked([state_for(s, store.scope.name) for s in seeds.values()]),
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
"""Headroom for what a first-order bound drops (products of two rounding errors, O(u²)), which
also covers evaluating the bound at NumPy's float32 values rather than the compiled program's
(they differ by rounding only)."""


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
    comparisons carry none (a comparison, and the branch or trip count of cond, while and scan, is
    assumed to go the same way as in exact arithmetic, so test inputs stay away from ties). A
    primitive without a rule raises NotImplementedError. Matrix products are taken to run in
    float32 (CPU; on a GPU, TF32 would need its own u).

    The jaxpr is evaluated in NumPy (values in float32, as the program computes them; bounds in
    float64), without compiling anything: JAX itself evaluates only what NumPy lacks (gather,
    scatter, sort, PRNG), one small cached program per shape.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    ins = [_exact(x) for x in jax.tree.leaves(args)]
    outs = _propagate(closed.jaxpr, [_exact(c) for c in closed.consts], ins)
    return jax.tree.unflatten(jax.tree.structure(out_shape),
                              [e if e is not None else np.zeros(np.shape(v)) for v, e in outs])


def assert_f32_close(got, want, bound, err_msg=""):
    """Assert |got − want| ≤ SAFETY·bound elementwise (equal infinities pass), for trees or arrays.

    ``bound`` comes from :func:`f32_error`: of ``got``'s computation when ``want`` is exact
    (float64 from the same float32 inputs), the sum of both sides' when both are float32."""
    numbers = lambda x: isinstance(x, list) and all(isinstance(v, (int, float, np.number)) for v in x)
    leaves = lambda tree: jax.tree.leaves(tree, is_leaf=numbers)          # a list of numbers is one array
    for g, w, b in zip(leaves(got), leaves(want), leaves(bound), strict=True):
        g, w = np.broadcast_arrays(np.asarray(g, np.float64), np.asarray(w, np.float64))
        b = np.broadcast_to(SAFETY * np.asarray(b, np.float64), g.shape)
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


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _exact(x):
    """An input's (value, bound): inputs are exactly what they are (PRNG keys stay JAX arrays)."""
    v = x if _is_key(x) else np.asarray(x)
    return v, (np.zeros(np.shape(v)) if _is_float(v) else None)


def _sub_jaxpr(params):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = params.get(name)
        if j is not None:
            return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, ())
    return None


_CONTROL = ("cond", "while", "scan")


def _control(name, params, pairs):
    """cond, while and scan, stepped in Python on (value, bound) pairs."""
    run = lambda closed, ins: _propagate(closed.jaxpr, [_exact(c) for c in closed.consts], ins)
    if name == "cond":
        return run(params["branches"][int(pairs[0][0])], pairs[1:])
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = pairs[:nc], pairs[nc:nc + nb], pairs[nc + nb:]
        while bool(run(params["cond_jaxpr"], cconsts + carry)[0][0]):
            carry = run(params["body_jaxpr"], bconsts + carry)
        return carry
    nc, ncarry, length = params["num_consts"], params["num_carry"], params["length"]
    consts, carry, xs = pairs[:nc], pairs[nc:nc + ncarry], pairs[nc + ncarry:]
    steps = range(length - 1, -1, -1) if params["reverse"] else range(length)
    ys = {}
    for i in steps:
        out = run(params["jaxpr"], consts + carry + [(v[i], None if e is None else e[i]) for v, e in xs])
        carry, ys[i] = out[:ncarry], out[ncarry:]
    stack = lambda j, k: None if ys[0][j][k] is None else np.stack([ys[i][j][k] for i in range(length)])
    n_ys = len(ys[0]) if length else 0
    return carry + [(stack(j, 0), stack(j, 1)) for j in range(n_ys)]


def _propagate(jaxpr, consts, args):
    """Evaluate ``jaxpr`` on (value, bound) pairs."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

    def read(var):
        if isinstance(var, jax.extend.core.Literal):
            x = np.asarray(var.val, var.aval.dtype)
            if not _is_float(x):
                return x, None
            exact = float(np.asarray(var.val, np.float64))          # a literal's own rounding to float32
            return x, np.asarray(abs(exact - float(x)) if np.isfinite(exact) else 0.0)
        return env[var]

    for eqn in jaxpr.eqns:
        prim, params = eqn.primitive, eqn.params
        pairs = [read(v) for v in eqn.invars]
        vals = [p[0] for p in pairs]
        sub = _sub_jaxpr(params)
        if prim.name in _CONTROL:
            out = _control(prim.name, params, pairs)
        elif sub is not None:
            out = _propagate(sub[0], [_exact(c) for c in sub[1]], pairs)
        else:
            res = _evaluate(prim, params, vals)
            where_from = [_WHERE_FROM[prim.name](prim, params, vals)] if prim.name in _WHERE_FROM else []
            errs = _rule(prim, params, vals, [p[1] for p in pairs], res + where_from)
            # an infinite result (a masked score) is infinite in exact arithmetic too: no error
            out = [(r, e if e is None else np.where(np.isfinite(r), e, 0.0)) for r, e in zip(res, errs)]
        env.update(zip(eqn.outvars, out))
    return [read(v) for v in jaxpr.outvars]


def _evaluate(prim, params, vals):
    """The primitive's outputs (a list): in NumPy where :data:`_NUMPY` has it, else by JAX."""
    if prim.name in _NUMPY and not any(map(_is_key, vals)):          # PRNG keys stay with JAX
        with np.errstate(all="ignore"):
            res = _NUMPY[prim.name](params, *vals)
        return [np.asarray(r) for r in res] if prim.multiple_results else [np.asarray(res)]
    res = prim.bind(*vals, **params)
    res = list(res) if prim.multiple_results else [res]
    return [r if _is_key(r) else np.asarray(r) for r in res]


def _broadcast_in_dim(x, shape, broadcast_dimensions, **_):
    dims = list(broadcast_dimensions)
    return np.broadcast_to(np.reshape(x, [x.shape[dims.index(i)] if i in dims else 1 for i in range(len(shape))]),
                           shape)


def _slice(x, start_indices, limit_indices, strides, **_):
    return x[tuple(slice(a, b, c) for a, b, c in zip(start_indices, limit_indices, strides or [1] * x.ndim))]


def _pad(x, value, padding_config, **_):
    if any(lo < 0 or hi < 0 for lo, hi, _i in padding_config):
        raise NotImplementedError("f32_error: negative padding")
    shape = [lo + hi + n + max(n - 1, 0) * i for n, (lo, hi, i) in zip(x.shape, padding_config)]
    out = np.full(shape, value, np.result_type(x, value))
    out[tuple(slice(lo, lo + n + max(n - 1, 0) * i, i + 1) for n, (lo, _h, i) in zip(x.shape, padding_config))] = x
    return out


def _dot_general(a, b, dimension_numbers, **_):
    (lc, rc), (lb, rb) = dimension_numbers
    names = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    sa, sb = [None] * a.ndim, [None] * b.ndim
    for i, j in [*zip(lb, rb), *zip(lc, rc)]:
        sa[i] = sb[j] = next(names)
    sa = [c or next(names) for c in sa]
    sb = [c or next(names) for c in sb]
    out = [sa[i] for i in lb] + [sa[i] for i in range(a.ndim) if i not in (*lb, *lc)] \
        + [sb[j] for j in range(b.ndim) if j not in (*rb, *rc)]
    return np.einsum(f"{''.join(sa)},{''.join(sb)}->{''.join(out)}", a, b)


def _cumulative(op, x, axis, reverse, **_):
    x = np.flip(x, axis) if reverse else x
    y = op.accumulate(x, axis=axis)
    return np.flip(y, axis) if reverse else y


# Primitives that only move, copy or pick values: applied to the bounds as to the values (NumPy).
_MOVES = {
    "broadcast_in_dim": lambda p, x: _broadcast_in_dim(x[0], **p),
    "reshape": lambda p, x: np.reshape(x[0], p["new_sizes"]),
    "transpose": lambda p, x: np.transpose(x[0], p["permutation"]),
    "squeeze": lambda p, x: np.squeeze(x[0], axis=tuple(p["dimensions"])),
    "expand_dims": lambda p, x: np.expand_dims(x[0], tuple(p["dimensions"])),
    "slice": lambda p, x: _slice(x[0], **p),
    "concatenate": lambda p, x: np.concatenate(x, axis=p["dimension"]),
    "pad": lambda p, x: _pad(x[0], x[1], **p),
    "rev": lambda p, x: np.flip(x[0], tuple(p["dimensions"])),
    "split": lambda p, x: np.split(x[0], np.cumsum(p["sizes"])[:-1], axis=p["axis"]),
    **{name: (lambda p, x: x[0]) for name in ("copy", "copy_p", "stop_gradient", "optimization_barrier")},
}


def _flat_iota(shape):
    """Each element's flat index, as float32 (exact below 2^24) so that linear maps can carry it."""
    return jax.numpy.arange(int(np.prod(shape)), dtype=jax.numpy.float32).reshape(shape)


def _gather_sources(prim, params, ins):
    """For each gathered element, the flat index of the operand element it came from (−1: filled)."""
    p = {**params, "fill_value": -1} if "fill_value" in params else params
    return prim.bind(_flat_iota(np.shape(ins[0])), ins[1], **p)


def _scatter_targets(prim, params, ins):
    """For each update, the flat index of the operand element it lands on (scatter or scatter-add):
    the transpose of scatter-add (a gather, as in JAX's own transpose rule) applied to the flat indices."""
    operand, indices, updates = ins
    add = lambda u: jax.lax.scatter_add(jax.numpy.zeros(np.shape(operand), np.float32), indices, u,
                                        params["dimension_numbers"], mode=params["mode"])
    return jax.linear_transpose(add, jax.ShapeDtypeStruct(np.shape(updates), np.float32))(
        _flat_iota(np.shape(operand)))[0]


def _sort_permutation(prim, params, ins):
    """Where each sorted element came from along the sorted dimension."""
    dim = params["dimension"]
    iota = jax.lax.broadcasted_iota(np.int32, np.shape(ins[0]), dim)
    return prim.bind(*ins, iota, **params)[-1]


# Moves whose index map is recorded in the compiled pass, then applied to the bounds in NumPy.
_WHERE_FROM = {"gather": _gather_sources, "scatter-add": _scatter_targets, "scatter": _scatter_targets,
               "sort": _sort_permutation}


def _dynamic_starts(shape, sizes, starts):
    """XLA clamps dynamic start indices into range."""
    return [int(np.clip(int(s), 0, n - k)) for s, n, k in zip(starts, shape, sizes)]


def _dynamic_slice(x, *starts, slice_sizes, **_):
    begin = _dynamic_starts(x.shape, slice_sizes, starts)
    return x[tuple(slice(b, b + k) for b, k in zip(begin, slice_sizes))]


def _dynamic_update_slice(x, update, *starts, **_):
    begin = _dynamic_starts(x.shape, update.shape, starts)
    out = np.array(x, np.result_type(x, update))
    out[tuple(slice(b, b + k) for b, k in zip(begin, update.shape))] = update
    return out


_MOVES["dynamic_slice"] = lambda p, x: _dynamic_slice(*x, **p)
_MOVES["dynamic_update_slice"] = lambda p, x: _dynamic_update_slice(*x, **p)


def _iota(dtype, shape, dimension, **_):
    return np.broadcast_to(np.arange(shape[dimension], dtype=dtype).reshape(
        [-1 if i == dimension else 1 for i in range(len(shape))]), shape)


def _int_div(a, b):
    if np.issubdtype(np.result_type(a, b), np.integer):          # XLA rounds toward zero
        return (np.abs(a) // np.abs(b)) * np.sign(a) * np.sign(b)
    return a / b


def _cumulative_value(op, x, axis, reverse, **_):
    return _cumulative(op, x, axis, reverse).astype(x.dtype)


def _argmax(p, x, pick):
    return pick(x, axis=p["axes"][0]).astype(p["index_dtype"])


# The value of each primitive in NumPy (float32 stays float32). Anything else is run by JAX.
_NUMPY = {
    **{name: (lambda move: lambda p, *x: move(p, list(x)))(move) for name, move in _MOVES.items()},
    "neg": lambda p, x: -x, "abs": lambda p, x: np.abs(x), "sign": lambda p, x: np.sign(x),
    "add": lambda p, a, b: a + b, "add_any": lambda p, a, b: a + b, "sub": lambda p, a, b: a - b,
    "mul": lambda p, a, b: a * b, "div": lambda p, a, b: _int_div(a, b), "rem": lambda p, a, b: np.fmod(a, b),
    "max": lambda p, a, b: np.maximum(a, b), "min": lambda p, a, b: np.minimum(a, b),
    "exp": lambda p, x: np.exp(x), "exp2": lambda p, x: np.exp2(x), "log": lambda p, x: np.log(x),
    "log1p": lambda p, x: np.log1p(x), "expm1": lambda p, x: np.expm1(x),
    "tanh": lambda p, x: np.tanh(x), "logistic": lambda p, x: (1 / (1 + np.exp(-x))).astype(x.dtype),
    "sqrt": lambda p, x: np.sqrt(x), "rsqrt": lambda p, x: (1 / np.sqrt(x)).astype(x.dtype),
    "square": lambda p, x: x * x, "integer_pow": lambda p, x: (x ** p["y"]).astype(x.dtype),
    "pow": lambda p, a, b: np.power(a, b), "floor": lambda p, x: np.floor(x), "ceil": lambda p, x: np.ceil(x),
    "round": lambda p, x: np.round(x), "is_finite": lambda p, x: np.isfinite(x),
    "eq": lambda p, a, b: a == b, "ne": lambda p, a, b: a != b, "lt": lambda p, a, b: a < b,
    "le": lambda p, a, b: a <= b, "gt": lambda p, a, b: a > b, "ge": lambda p, a, b: a >= b,
    "and": lambda p, a, b: a & b, "or": lambda p, a, b: a | b, "xor": lambda p, a, b: a ^ b,
    "not": lambda p, x: np.invert(x),
    "select_n": lambda p, pred, *cases: np.choose(np.asarray(pred, np.int32), cases).astype(cases[0].dtype),
    "clamp": lambda p, lo, x, hi: np.clip(x, lo, hi), "nextafter": lambda p, a, b: np.nextafter(a, b),
    "convert_element_type": lambda p, x: x.astype(p["new_dtype"]),
    "iota": lambda p: _iota(**p),
    "dot_general": lambda p, a, b: _dot_general(a, b, **p).astype(np.result_type(a, b)),
    "reduce_sum": lambda p, x: np.sum(x, axis=tuple(p["axes"]), dtype=x.dtype),
    "reduce_max": lambda p, x: np.max(x, axis=tuple(p["axes"])),
    "reduce_min": lambda p, x: np.min(x, axis=tuple(p["axes"])),
    "reduce_and": lambda p, x: np.all(x, axis=tuple(p["axes"])),
    "reduce_or": lambda p, x: np.any(x, axis=tuple(p["axes"])),
    "argmax": lambda p, x: _argmax(p, x, np.argmax), "argmin": lambda p, x: _argmax(p, x, np.argmin),
    "cumsum": lambda p, x: _cumulative_value(np.add, x, **p),
    "cummax": lambda p, x: _cumulative_value(np.maximum, x, **p),
    "cummin": lambda p, x: _cumulative_value(np.minimum, x, **p),
    "cumlogsumexp": lambda p, x: _cumulative_value(np.logaddexp, x, **p),
}

_ELEMENTARY = {  # f'(a) in terms of (a, v = f(a)), for the |f'(a)| e_a term
    "exp": lambda a, v: v, "exp2": lambda a, v: v * np.log(2.0), "log": lambda a, v: 1 / a,
    "log1p": lambda a, v: 1 / (1 + a), "expm1": lambda a, v: v + 1, "tanh": lambda a, v: 1 - v * v,
    "logistic": lambda a, v: v * (1 - v), "erf": lambda a, v: 2 / np.sqrt(np.pi) * np.exp(-a * a),
    "erf_inv": lambda a, v: np.sqrt(np.pi) / 2 * np.exp(v * v), "rsqrt": lambda a, v: -0.5 * v ** 3,
}


def _rule(prim, params, vals, errs, outs):
    """The bounds of ``outs`` (a list) from the operands' values and bounds (see f32_error)."""
    name = prim.name
    results = outs[:-1] if name in _WHERE_FROM else outs          # without the recorded index map
    if not any(_is_float(o) for o in results):
        return [None] * len(results)                    # comparisons, integers, booleans, PRNG keys
    f64 = lambda x: np.asarray(x, np.float64)
    A = [np.abs(f64(x)) if _is_float(x) else None for x in vals]
    E = [(e if e is not None else np.zeros(np.shape(x))) if _is_float(x) else None for x, e in zip(vals, errs)]
    v = f64(outs[0]) if _is_float(outs[0]) else None
    av = None if v is None else np.abs(v)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if name in ("neg", "abs"):
            return [E[0]]
        if name in _MOVES:
            res = _MOVES[name](params, [e if e is not None else x for x, e in zip(vals, E)])
            return [np.abs(f64(r)) for r in res] if prim.multiple_results else [np.abs(f64(res))]
        if name == "gather":
            src = np.asarray(outs[-1]).astype(np.int64)
            return [np.where(src >= 0, E[0].ravel()[np.maximum(src, 0)], 0.0)]
        if name == "sort":
            perm, dim = np.asarray(outs[-1]), params["dimension"]
            return [np.take_along_axis(e, perm, axis=dim) if e is not None else None for e in E][:len(results)]
        if name == "top_k":
            return [np.take_along_axis(E[0], np.asarray(outs[1]), axis=-1), None]
        if name == "select_n":
            return [np.choose(np.asarray(vals[0], int), E[1:])]
        if name in ("add", "sub", "add_any"):
            return [E[0] + E[1] + U32 * av]
        if name == "mul":
            return [A[0] * E[1] + A[1] * E[0] + U32 * av]
        if name == "div":
            return [np.where(E[0] + E[1] > 0, (E[0] + av * E[1]) / A[1], 0.0) + 2 * U32 * av]
        if name in ("max", "min"):       # the operand picked, or either when rounding could swap them
            a, b = (f64(vals[0]), f64(vals[1])) if name == "max" else (-f64(vals[0]), -f64(vals[1]))
            return [np.where(a - E[0] >= b + E[1], E[0], np.where(b - E[1] >= a + E[0], E[1], np.maximum(E[0], E[1])))]
        if name == "clamp":
            return [np.maximum(np.maximum(E[0], E[1]), E[2])]
        if name in ("sign", "floor", "ceil", "round", "iota", "bitcast_convert_type"):
            return [np.zeros(np.shape(v))]
        if name == "sqrt":               # sqrt(a + e) − sqrt(a) ≤ min(e / (2 sqrt a), sqrt e)
            return [np.minimum(np.where(av > 0, E[0] / (2 * av), np.inf), np.sqrt(E[0])) + U32 * av]
        if name == "square":
            return [2 * A[0] * E[0] + U32 * av]
        if name == "integer_pow":
            y = params["y"]
            return [np.where(E[0] > 0, abs(y) * A[0] ** (y - 1) * E[0], 0.0) + (abs(y) + 2) * U32 * av]
        if name == "pow":
            x, y = f64(vals[0]), f64(vals[1])
            log_x = np.where(A[0] > 0, np.log(A[0]), 0.0)
            ey = E[1] if E[1] is not None else 0.0
            return [np.where(x != 0, np.abs(y * v / x), 0.0) * E[0] + np.abs(v * log_x) * ey
                    + ELEMENTARY * U32 * av * (1 + np.abs(y * log_x))]
        if name in _ELEMENTARY:
            slope = np.abs(_ELEMENTARY[name](f64(vals[0]), v))
            return [np.where(E[0] > 0, slope * E[0], 0.0) + ELEMENTARY * U32 * av]
        if name == "dot_general":
            (ca, _), _ = params["dimension_numbers"]
            n = int(np.prod([np.shape(vals[0])[i] for i in ca])) if ca else 1
            return [_dot_general(A[0], E[1], **params) + _dot_general(E[0], A[1], **params)
                    + gamma(n) * _dot_general(A[0], A[1], **params)]
        if name == "reduce_sum":
            ax = tuple(params["axes"])
            n = int(np.prod([np.shape(vals[0])[i] for i in ax]))
            return [E[0].sum(axis=ax) + gamma(max(n - 1, 1)) * A[0].sum(axis=ax)]
        if name in ("reduce_max", "reduce_min"):   # the largest bound among operands that could be the extreme
            x, ax = (f64(vals[0]) if name == "reduce_max" else -f64(vals[0])), tuple(params["axes"])
            low = np.max(x - E[0], axis=ax, keepdims=True)
            return [np.max(np.where(x + E[0] >= low, E[0], 0.0), axis=ax)]
        if name == "cumsum":
            n = np.shape(vals[0])[params["axis"]]
            return [_cumulative(np.add, E[0], **params) + gamma(max(n - 1, 1)) * _cumulative(np.add, A[0], **params)]
        if name in ("cummax", "cummin"):
            return [_cumulative(np.maximum, E[0], **params)]
        if name == "cumlogsumexp":
            n = np.shape(vals[0])[params["axis"]]
            return [_cumulative(np.maximum, E[0], **params) + gamma(n + ELEMENTARY) + ELEMENTARY * U32 * av]
        if name == "scatter":            # the operand's bounds, overwritten where updates land
            tgt = np.asarray(outs[-1]).astype(np.int64).ravel()
            out = E[0].copy().ravel()
            out[tgt] = 0.0
            np.maximum.at(out, tgt, E[2].ravel())
            return [out.reshape(np.shape(vals[0]))]
        if name == "scatter-add":
            tgt = np.asarray(outs[-1]).astype(np.int64).ravel()
            size = int(np.prod(np.shape(vals[0])))
            spread = lambda u: np.bincount(tgt, weights=u.ravel(), minlength=size).reshape(np.shape(vals[0]))
            return [E[0] + spread(E[2]) + gamma(max(int(np.size(vals[2])), 1)) * (A[0] + spread(A[2]))]
        if name == "convert_element_type":
            return [E[0] if _is_float(vals[0]) else U32 * av]
    raise NotImplementedError(f"f32_error has no rule for the primitive {name!r}")


# Descriptor counts read /proc/self/fd (Linux); elsewhere those tests skip with this reason.
needs_proc_fd = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")


def open_fds() -> int:
    """How many file descriptors this process holds."""
    return len(os.listdir("/proc/self/fd"))


def die_inside_commit(n: int = 1) -> None:
    """Make this process SIGKILL itself at the COMMIT of its ``n``-th
    :meth:`PolicyIndex.commit_version`, with SQLite's page cache at one page so that the
    transaction has spilt into the database file: a hot rollback journal is left, as a kill
    inside a real commit leaves it (for test subprocesses)."""
    import signal

    from rmm_jax.persist.policy_index import PolicyIndex
    commit, calls = PolicyIndex.commit_version, [0]

    class Dying:
        def __init__(self, conn):
            self._conn = conn

        def execute(self, sql, *a):
            if sql == "COMMIT":
                os.kill(os.getpid(), signal.SIGKILL)
            if sql == "BEGIN IMMEDIATE":
                self._conn.execute("PRAGMA cache_size = 1")
                self._conn.execute("PRAGMA cache_spill = 1")
            return self._conn.execute(sql, *a)

        def __getattr__(self, name):
            return getattr(self._conn, name)

    def dying(self, *a, **k):
        calls[0] += 1
        if calls[0] == n:
            self._conn = Dying(self._conn)
        return commit(self, *a, **k)

    PolicyIndex.commit_version = dying
