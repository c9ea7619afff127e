"""Plackett–Luce slot marginals and prefix probabilities: exact (the dynamic programme
over the sets drawn before each slot), Monte Carlo (Rao–Blackwellised), and the choice
between them. The equations are in :mod:`rmm_jax.online.ope`'s docstring (IIPS)."""
from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from threadpoolctl import threadpool_limits

from rmm_jax.core import checks
from rmm_jax.core.executables import aot
from rmm_jax.core.sampling import check_picks, selection_log_probs, top_m
from rmm_jax.data.retrieval import pad_rows
from rmm_jax.errors import InputError, check_int
from rmm_jax.online.ope._chunks import _CHUNK

DEFAULT_EXACT_LIMIT = 100_000
DEFAULT_MC_SAMPLES = 4096


def subset_count(k: int, m: int) -> int:
    """Sets the exact marginals enumerate: Σ_{j<m} C(k, j)."""
    return sum(math.comb(k, j) for j in range(m))


class _Level(NamedTuple):
    """The sets of j candidates (of K, in the order of their logits, largest first) drawn
    before slot j, lexicographic: ``members`` (C, K) bool; ``parents``/``removed`` (C, j): the
    set without its p-th member, as an index of the level before, and that member; ``first``
    (C,): each set's first candidate not in it (the largest weight left to draw; K: none);
    ``groups``: ``(g, rows, outside)`` of the sets whose first is g < K, ``outside`` (rows, K)
    float64 the candidates each leaves to draw (made once: every block of calls reads it);
    ``via`` (C, j): the row ``first(parent) · K + removed`` of the level before's stacked
    weights (:func:`_set_levels`)."""

    members: np.ndarray
    parents: np.ndarray
    removed: np.ndarray
    first: np.ndarray
    groups: tuple
    via: np.ndarray


@functools.lru_cache(maxsize=8)
def _subsets(k: int, m: int) -> tuple[_Level, ...]:
    """The :class:`_Level` of each j < m."""
    levels, prev, first_prev = [], {(): 0}, None
    for j in range(m):
        combos = list(itertools.combinations(range(k), j))
        members = np.zeros((len(combos), k), bool)
        parents = np.zeros((len(combos), j), np.int64)
        removed = np.zeros((len(combos), j), np.int64)
        index = {}
        for c, combo in enumerate(combos):
            index[combo] = c
            members[c, list(combo)] = True
            for p in range(j):
                parents[c, p] = prev[combo[:p] + combo[p + 1:]]
                removed[c, p] = combo[p]
        first = np.where(members.all(1), k, np.argmin(members, axis=1))
        groups = tuple((g, rows, (~members[rows]).astype(np.float64))
                       for g in np.unique(first) if g < k for rows in [np.flatnonzero(first == g)])
        via = first_prev[parents] * k + removed if j else removed
        levels.append(_Level(members, parents, removed, first, groups, via))
        prev, first_prev = index, first
    return tuple(levels)


def _set_levels(logits, mask, levels: int):
    """The subset dynamic programme, in each call's candidates sorted by logit (largest
    first: ``order`` (n, K), yielded first), per level j < ``levels``: ``(j, level, prob,
    ratio, weights)``, with ``prob`` (C_j, n) P(the first j draws are the set S) and ``ratio``
    (C_j, n) = P(S) / Σ_{k∉S} e^{z_k − z_g}, g the set's first candidate left (:class:`_Level`),
    and ``weights`` (G, K, n) e^{z_b − z_g} for g < G = min(j + 1, K) (0 for b < g and masked b).

    Every quantity is at most 1: each set's weights left are taken relative to the largest of
    them, which is 1, so their sum is at least 1. Weights relative to the call's best
    underflowed once the best was drawn: logits [0, -800, -801] gave a second slot of 0 where
    it is [0, 0.731, 0.269], and [0, -720, -721] NaN (the ratio overflowed). Sets are the
    leading axis: each parent's row is gathered whole, contiguous (calls on the columns
    gathered one call at a time: 3.9 s of CPU for 6,300 calls at K = 20, M = 5, where this
    takes 0.7 s)."""
    z = np.where(mask, np.atleast_2d(np.asarray(logits, np.float64)), -np.inf)
    n, k = z.shape
    order = np.argsort(-z, axis=1, kind="stable")
    zs = np.take_along_axis(z, order, 1)
    lw = (zs - np.where(np.isfinite(zs[:, :1]), zs[:, :1], 0.0)).T            # (K, n): <= 0, -inf masked
    yield order
    prob = np.ones((1, n))
    structure = _subsets(k, levels)
    below = np.arange(k)[None, :, None] >= np.arange(k)[:, None, None]        # (K, K, 1): b >= g
    for j, level in enumerate(structure):
        g_count = min(j + 1, k)
        with np.errstate(invalid="ignore", over="ignore"):
            weights = np.exp(lw[None, :, :] - lw[:g_count, None, :])
        weights = np.where(below[:g_count] & np.isfinite(lw[:g_count])[:, None, :], weights, 0.0)
        rest = np.zeros_like(prob)
        for g, rows, outside in level.groups:
            rest[rows] = outside @ weights[g]
        ratio = np.divide(prob, rest, out=np.zeros_like(prob), where=rest > 0)
        yield j, level, prob, ratio, weights
        if j + 1 < levels:
            flat = weights.reshape(g_count * k, n)
            via = structure[j + 1].via
            prob = ratio[structure[j + 1].parents[:, 0]] * flat[via[:, 0]]
            for p in range(1, via.shape[1]):
                prob += ratio[structure[j + 1].parents[:, p]] * flat[via[:, p]]


#: The dynamic programme's products are (sets × K) by (K × calls), K about 20: too thin for BLAS's
#: threads, which only contend, with each other and with anything else running. Under a load of
#: 4 on 2 cores, 6,300 calls at K = 20, M = 5 took 6.2 s of CPU on two threads, 0.7 s on one.
_ONE_BLAS_THREAD = threadpool_limits.wrap(limits=1, user_api="blas")


@_ONE_BLAS_THREAD
def slot_marginals_exact(logits, mask, m: int, *, block: int = 128) -> np.ndarray:
    """Exact per-slot marginals of Plackett–Luce(softmax(logits)): ``(n, m, K)`` float64,
    ``[i, j, a]`` = P(candidate a is drawn j-th) for call i (0 for masked candidates, and in
    the slots after the last valid candidate is drawn).

    Dynamic programming over the sets S of candidates drawn before slot j:
    P(S) = Σ_{b∈S} P(S∖b) · w_b / Σ_{k∉S∖b} w_k and P_j(a) = Σ_{|S|=j, a∉S} P(S) · w_a /
    Σ_{k∉S} w_k, with w = exp(logits), each ratio of weights taken relative to the largest
    weight left to draw (:func:`_set_levels`): exact for logits of any spread. Cost
    Σ_{j<m} C(K, j) sets (:func:`subset_count`), run ``block`` calls at a time: a level holds
    (sets × calls) float64 arrays, 3.9 GB each for 100,000 calls at K = 20, M = 5 without
    blocks, 5 MB in blocks of 128 (small blocks also stay nearer the cache: 6,300 calls took
    0.7 s of CPU in blocks of 128, 0.8 s in 64 or 256).
    """
    logits = np.atleast_2d(np.asarray(logits, np.float64))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    n, k = logits.shape
    out = np.zeros((n, m, k))
    for lo in range(0, n, block):
        levels = _set_levels(logits[lo:lo + block], mask[lo:lo + block], m)
        order = next(levels)
        part = np.zeros((m, k, order.shape[0]))
        for j, level, _, ratio, weights in levels:
            for g, rows, outside in level.groups:
                part[j] += weights[g] * (outside.T @ ratio[rows])
        np.put_along_axis(out[lo:lo + block], np.broadcast_to(order[:, None, :], (order.shape[0], m, k)),
                          part.transpose(2, 0, 1), axis=2)
    return out


@_ONE_BLAS_THREAD
def shown_set_probs(logits, mask, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``(members (C, K) bool, probs (n, C))``: the probability that the first ``m`` PL draws
    are exactly the set ``members[c]``, in any order, for every set of ``m`` candidates
    (the same dynamic programme as :func:`slot_marginals_exact`, one level further; cost
    C(K, m) sets). The exact expectation of any reward that depends on the shown set only,
    e.g. an oracle citation model's expected cited count. A call with fewer than ``m`` valid
    candidates draws no set of ``m``: its row is 0."""
    logits = np.atleast_2d(np.asarray(logits, np.float64))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    n, k = logits.shape
    levels = _set_levels(logits, mask, m + 1)
    order = next(levels)
    *_, (_, level, prob, _, _) = levels
    # each call's sorted set is the set of its original candidates order[i, set]: placed by rank
    comb = np.array([[math.comb(a, t + 1) for t in range(m)] for a in range(k)], np.int64)
    colex = lambda sets: comb[sets, np.arange(m)].sum(-1)               # noqa: E731  (rank of a sorted set)
    lex_of = np.empty(len(level.removed), np.int64)
    lex_of[colex(level.removed)] = np.arange(len(level.removed))
    original = np.sort(order.astype(np.int16)[:, level.removed], axis=-1)    # (n, C, m): K < 2**15 by far
    out = np.zeros((n, len(level.removed)))
    np.put_along_axis(out, lex_of[colex(original)], prob.T, axis=1)
    return level.members, out


@functools.partial(jax.jit, static_argnames=("m", "samples"))
def _mc_marginals(logits, mask, key, m: int, samples: int):
    def one(z, mk, key):
        g = jax.random.gumbel(key, (samples,) + z.shape, jnp.float32)
        zz = jnp.where(mk, z, -jnp.inf)
        order = jax.vmap(lambda gg: top_m(zz + gg, m, mk))(g)            # (S, m)
        hit = (order[:, :, None] == jnp.arange(z.shape[0])) & (order[:, :, None] >= 0)  # (S, m, K)
        before = jnp.cumsum(hit, axis=1) - hit                           # drawn before slot j
        # the weights left, relative to the largest of them (to the call's best, they underflowed
        # in float32 once it was drawn: logits [0, -90, -91] gave a second slot of 0)
        left = jnp.where((before == 0) & mk, z, -jnp.inf)
        top = jnp.max(left, axis=-1, keepdims=True)
        e = jnp.where(jnp.isfinite(top), jnp.exp(left - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        rest = e.sum(-1, keepdims=True)
        return jnp.mean(jnp.where(rest > 0, e / jnp.where(rest > 0, rest, 1.0), 0.0), axis=0)
    keys = jax.random.split(key, logits.shape[0])
    return jax.vmap(one)(logits, mask, keys)


def slot_marginals_mc(logits, mask, m: int, *, samples: int = DEFAULT_MC_SAMPLES, seed: int = 0) -> np.ndarray:
    """Monte Carlo per-slot marginals, same layout as :func:`slot_marginals_exact`.

    Rao–Blackwellised: for ``samples`` prefixes drawn by Gumbel-top-M, P_j(a) is
    estimated by the mean of 1[a not drawn before j] · w_a / Σ_{k not drawn before j} w_k,
    an unbiased estimate that is positive for every candidate still available (so a
    behaviour marginal in a denominator is never 0).
    """
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    out = []
    key = jax.random.key(seed)
    for s in range(0, logits.shape[0], _CHUNK):
        part = slice(s, s + _CHUNK)
        z, mk = pad_rows(logits[part], _CHUNK), pad_rows(mask[part], _CHUNK)
        res = _mc_marginals(jnp.asarray(z), jnp.asarray(mk), jax.random.fold_in(key, s), m=m, samples=samples)
        out.append(np.asarray(res, np.float64)[:logits[part].shape[0]])
    return np.concatenate(out) if out else np.zeros((0, m, logits.shape[1]))


def check_marginal_options(*, exact_limit, samples, seed, samples_arg: str = "samples") -> None:
    """The options of :func:`slot_marginals`, each refused by name: ``exact_limit`` and
    ``samples`` >= 1 (``samples=0`` gave NaN marginals, -1 a JAX error), ``seed`` an int in
    [0, 2**63) (what NumPy's generators and JAX's keys both take; ``"0"`` was a TypeError)."""
    check_int(exact_limit, "exact_limit", 1)
    check_int(samples, samples_arg, 1)
    check_int(seed, "seed", 0, 2**63)


def _check_logits(logits, mask, *, finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(logits (n, K) float64, mask (n, K) bool)`` of a public function's arguments, or
    ``InputError`` naming the argument: logits of rank 1 (one call) or 2, K >= 1, finite
    where the mask holds; a mask that broadcasts to them."""
    z = np.asarray(logits)
    if z.ndim not in (1, 2) or z.shape[-1] == 0 or z.dtype.kind not in "iuf":
        raise InputError(f"expected a real array (n calls, K candidates), got {checks.short(z)}", arg="logits")
    z = np.atleast_2d(z.astype(np.float64))
    mk = np.ones(z.shape, bool) if mask is None else np.asarray(mask)
    try:
        if np.broadcast_shapes(mk.shape, z.shape) != z.shape:
            raise ValueError
    except ValueError:
        raise InputError(f"expected shape {z.shape} (n, K) as logits, or one that broadcasts to it, got "
                         f"{mk.shape}", arg="mask") from None
    mk = np.broadcast_to(mk.astype(bool), z.shape)
    if finite and not np.isfinite(z[mk]).all():
        raise InputError("contains NaN or Inf where mask is True", arg="logits")
    return z, mk


def slot_marginals(logits, mask, m: int, *, exact_limit: int = DEFAULT_EXACT_LIMIT,
                   samples: int = DEFAULT_MC_SAMPLES, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Per-slot PL marginals, exact when ``subset_count(K, m) <= exact_limit``, else Monte
    Carlo: ``(marginals (n, m, K), {"method", "subsets" or "samples"})``.

    ``logits`` (n, K) (or (K,), one call), finite where ``mask`` (broadcast to (n, K)) holds;
    ``1 <= m <= K``. Raises ``InputError`` naming the argument otherwise."""
    z, mk = _check_logits(logits, mask)
    k = z.shape[1]
    if not (checks.is_int(m) and 1 <= m <= k):
        raise InputError(f"must be an int in [1, K={k}], got {checks.short(m)}", arg="m")
    check_marginal_options(exact_limit=exact_limit, samples=samples, seed=seed)
    return _slot_marginals(z, mk, m, exact_limit=exact_limit, samples=samples, seed=seed)


def _slot_marginals(logits, mask, m: int, *, exact_limit: int, samples: int, seed: int) -> tuple[np.ndarray, dict]:
    """:func:`slot_marginals` without its checks: the report's calls, whose target logits may
    be non-finite (reported as unreliable, not refused)."""
    k = np.shape(logits)[-1]
    count = subset_count(k, m)
    if count <= exact_limit:
        return slot_marginals_exact(logits, mask, m), {"method": "exact", "subsets": count}
    return (slot_marginals_mc(logits, mask, m, samples=samples, seed=seed),
            {"method": "monte_carlo", "samples": samples, "subsets_needed_for_exact": count})


def prefix_log_probs(logits, selected, mask=None) -> np.ndarray:
    """log P(a_1..a_j) for every prefix of an ordered selection under PL(softmax(logits)):
    the cumulative sum of :func:`rmm_jax.core.sampling.selection_log_probs` (τ = 1),
    ``(n, M)``; unfilled slots (−1) repeat the last prefix.

    ``logits`` (n, K) (or (K,)), finite where ``mask`` holds; ``selected`` (n, M) (or (M,))
    ints, each a candidate in [0, K) that ``mask`` keeps, at most once per row, or -1. Raises ``InputError``
    naming the argument otherwise."""
    z, mk = _check_logits(logits, mask)
    sel = np.asarray(selected)
    if sel.ndim not in (1, 2) or sel.dtype.kind not in "iu":
        raise InputError(f"expected an int array (n calls, M slots), got {checks.short(sel)}", arg="selected")
    sel = np.atleast_2d(sel)
    if sel.shape[0] != z.shape[0]:
        raise InputError(f"expected {z.shape[0]} rows (one per row of logits), got shape {sel.shape}",
                         arg="selected")
    try:
        checks.check_selected(sel, z.shape[1])
        check_picks(z, sel, mk)                   # a masked pick was a prefix of -1e30, no error
    except ValueError as e:
        raise InputError(str(e).partition(": ")[2], arg="selected") from None
    return _prefix_log_probs(z, sel, mk)


def _prefix_log_probs(logits, selected, mask=None) -> np.ndarray:
    """:func:`prefix_log_probs` without its checks (the report's calls, see :func:`_slot_marginals`)."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))          # NumPy: an eager jnp op is a program to load
    selected = np.atleast_2d(np.asarray(selected, np.int32))
    mask = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), logits.shape)
    return np.cumsum(np.asarray(_per_draw(logits, selected, mask), np.float64), axis=1)


@aot
def _per_draw(logits, selected, mask):
    return jax.vmap(lambda z, s, mk: selection_log_probs(z, s, 1.0, mask=mk))(logits, selected, mask)
