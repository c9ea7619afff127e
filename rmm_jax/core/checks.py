"""Argument checks that run before tracing where the values are concrete.

Shapes and dtypes are static under ``jit`` and are always checked (with chex; a failed
assertion becomes a ``ValueError`` that names the argument). Values (τ, NaN scores,
selected indices) are checked only when concrete: a traced value cannot be inspected without a host
round trip, so inside a jitted loop the caller's outer check is what guards it.
"""
from __future__ import annotations

import math
import numbers

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.errors import is_int, short  # noqa: F401  (checks.is_int, checks.short: defined with check_int)

F32_MAX = float(np.finfo(np.float32).max)               # the parameters' type: a step size or tau beyond
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)  # these is inf, or 0, once cast


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


def is_real(x, finite: bool = True) -> bool:
    """A real number: a Python or NumPy scalar, or a concrete 0-d int or float array (not a
    bool, a string or a list), and finite unless ``finite=False`` (then ±inf and NaN too).
    What a setting or a temperature takes, checked before it is compared with anything (a
    string was a TypeError from ``<``, a list one from ``float()``)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if not isinstance(x, numbers.Real):
        if not (is_array(x) and is_concrete(x) and np.ndim(x) == 0 and np.dtype(x.dtype).kind in "iuf"):
            return False
        x = float(np.asarray(x))
    return math.isfinite(x) or not finite


def check_positive(x, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``x`` is a real number (not a bool), finite and > 0,
    and finite in float32 (the parameters' type: 1e300 was taken, cast to inf, and made NaN of
    every policy): a step size, which optax would take as NaN, negative or inf without a word."""
    require(is_real(x) and 0 < float(np.asarray(x)) <= F32_MAX and np.float32(float(np.asarray(x))) > 0, name,
            f"must be > 0 and finite in float32 (from {F32_TINY:.3g} to {F32_MAX:.3g}), got {x!r}")


def check_nonnegative(x, name: str) -> None:
    """As :func:`check_positive`, with 0 allowed (a weight decay)."""
    require(is_real(x) and float(np.asarray(x)) >= 0, name, f"must be >= 0 and finite, got {x!r}")


def _chex(assertion, name: str, message: str) -> None:
    """Run a chex assertion; re-raise its failure as a ValueError naming the argument."""
    try:
        assertion()
    except AssertionError:
        raise ValueError(f"{name}: {message}") from None


def is_array(x) -> bool:
    """An array (NumPy, JAX, or a tracer): what has a ``shape`` and a ``dtype``. A Python list
    has neither: chex reads a list as a sequence of arrays (``[1.0, 2.0]`` as two rank-0 ones)
    and ``jnp.result_type`` cannot type a nested one, so it is refused by name first, as
    "expected a ... array (numpy or jax), got list [...]": the functions that take it are
    traced, where a list cannot be converted (and would be a new static argument)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def check_rank(x, rank: int, name: str) -> None:
    require(is_array(x), name, f"expected a rank-{rank} array (numpy or jax), got {short(x)}")
    _chex(lambda: chex.assert_rank(x, rank), name, f"expected a rank-{rank} array, got shape {jnp.shape(x)}")


def check_float(x, name: str) -> None:
    _chex(lambda: chex.assert_type(x, float), name, f"expected a floating dtype, got {jnp.result_type(x)}")


def check_int(x, name: str) -> None:
    _chex(lambda: chex.assert_type(x, int), name, f"expected an integer dtype, got {jnp.result_type(x)}")


# The smallest temperature: s/τ must stay finite in float32 (max 3.4e38), and above the
# masked-logit stand-in −1e30 (rmm_jax.core.sampling.NEG), for every score a reranker of
# (near) unit-norm embeddings gives; at τ = 1e-6 both hold for |s| < 1e24. Below it nothing
# changes that float32 can show (a score gap of 1e-4 is already 100 nats: the draw is the
# top-M), while τ = 1e-45 turned s/τ into inf and the saved policy into NaN.
TAU_MIN = 1e-6


def check_key(key, name: str = "key") -> None:
    """``ValueError`` naming ``name`` unless ``key`` is one PRNG key: a typed key
    (``jax.random.key(seed)``, shape ()) or a raw ``uint32[2]`` (``jax.random.PRNGKey``). An
    int seed would fail deep inside flax or at ``key.dtype``."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and np.shape(key) == ()
    raw = dtype == np.uint32 and np.shape(key) == (2,)
    require(typed or raw, name, f"must be one PRNG key, e.g. jax.random.key(0), got {short(key)}")


def check_tau(tau, name: str = "tau") -> None:
    """``ValueError`` naming ``name`` unless τ is one real number (a Python or NumPy scalar,
    or a 0-d int or float array), finite and >= :data:`TAU_MIN`. A traced τ (under ``jit``)
    is checked for its shape and dtype only, which are static; its value when concrete. A
    list (``[1.0]``) passed here and was a TypeError further on."""
    if not is_concrete(tau):
        require(np.ndim(tau) == 0 and np.dtype(tau.dtype).kind in "iuf", name,
                f"must be one number (a 0-d int or float array), got {short(tau)}")
        return
    require(is_real(tau, finite=False), name, f"must be one number, got {short(tau)}")
    t = float(np.asarray(tau))
    require(t > 0, name, f"must be > 0, got {tau}")
    require(math.isfinite(t) and t <= F32_MAX, name, f"must be finite (at most {F32_MAX:.3g}, float32's largest), "
            f"got {tau}")
    require(t >= TAU_MIN, name, f"must be >= {TAU_MIN:g} (below it s/τ overflows float32), got {tau}")


def check_finite(x, name: str) -> None:
    if is_concrete(x):
        require(bool(np.all(np.isfinite(np.asarray(x)))), name, "contains NaN or Inf")


def check_finite_where(x, mask, name: str) -> None:
    """:func:`check_finite` on the rows of ``x`` (..., K, d) that ``mask`` (..., K; None: all)
    keeps: a padded slot may hold anything, since its score is masked."""
    if is_concrete(x) and (mask is None or is_concrete(mask)):
        rows = np.asarray(x) if mask is None else np.asarray(x)[np.asarray(mask, bool)]
        require(bool(np.all(np.isfinite(rows))), name, "contains NaN or Inf" + ("" if mask is None else
                                                                               " in a slot the mask keeps"))


def check_no_nan(x, name: str) -> None:
    if is_concrete(x):
        require(not bool(np.any(np.isnan(np.asarray(x)))), name, "contains NaN")


def check_scores(x, name: str = "scores") -> None:
    """Scores (or logits) as the draws and losses read them, when concrete: no NaN, and no +inf.
    −inf is a masked candidate (never drawn); +inf, an overflow, was taken as masked too
    (``top_m([1, inf, 0], 2)`` gave [0, 2]: the best candidate never shown), so it is refused."""
    check_no_nan(x, name)           # its own message, as every other input's NaN
    if is_concrete(x):
        require(not bool(np.any(np.isposinf(x))), name,
                "contains +inf (an overflow?): a score must be finite, or -inf for a masked candidate")


def check_selected(selected, k: int, name: str = "selected") -> None:
    """Each filled entry (>= 0) of a selection (..., M) names one of K candidates, once per
    selection; −1 is an unfilled slot. Checked when concrete: under ``jit`` or ``vmap`` the
    indices are traced, and a gather clamps an index out of range (a finite, wrong value), so
    there the caller's outer check is what guards it."""
    if not is_concrete(selected):
        return
    s = np.asarray(selected)
    bad = s[(s < -1) | (s >= k)].tolist()
    require(not bad, name, f"indices must be in [0, K={k}), or -1 for an unfilled slot, got {bad[:1] and bad[0]}")
    srt = np.sort(s, axis=-1)
    twice = srt[..., 1:][(srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)].tolist()
    require(not twice, name, f"candidate {twice[:1] and twice[0]} is selected twice in one selection")


def check_mask(mask, shape, name: str = "mask") -> None:
    if mask is None:
        return
    require(is_array(mask), name, f"expected a bool array (numpy or jax) of shape {tuple(shape)}, got {short(mask)}")
    require(jnp.shape(mask) == tuple(shape), name, f"expected shape {tuple(shape)}, got {jnp.shape(mask)}")
    require(jnp.result_type(mask) == jnp.bool_, name, f"expected dtype bool, got {jnp.result_type(mask)}")
