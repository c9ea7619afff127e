"""Argument checks that run before tracing where the values are concrete.

Shapes and dtypes are static under ``jit`` and are always checked (with chex; a failed
assertion becomes a ``ValueError`` that names the argument). Values (τ, NaN scores)
are checked only when concrete: a traced value cannot be inspected without a host
round trip, so inside a jitted loop the caller's outer check is what guards it.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


def _chex(assertion, name: str, message: str) -> None:
    """Run a chex assertion; re-raise its failure as a ValueError naming the argument."""
    try:
        assertion()
    except AssertionError:
        raise ValueError(f"{name}: {message}") from None


def check_rank(x, rank: int, name: str) -> None:
    _chex(lambda: chex.assert_rank(x, rank), name, f"expected a rank-{rank} array, got shape {jnp.shape(x)}")


def check_float(x, name: str) -> None:
    _chex(lambda: chex.assert_type(x, float), name, f"expected a floating dtype, got {jnp.result_type(x)}")


def check_int(x, name: str) -> None:
    _chex(lambda: chex.assert_type(x, int), name, f"expected an integer dtype, got {jnp.result_type(x)}")


def check_tau(tau) -> None:
    if is_concrete(tau):
        t = np.asarray(tau)
        require(bool(np.all(np.isfinite(t)) and np.all(t > 0)), "tau", f"must be > 0 and finite, got {tau}")


def check_finite(x, name: str) -> None:
    if is_concrete(x):
        require(bool(np.all(np.isfinite(np.asarray(x)))), name, "contains NaN or Inf")


def check_no_nan(x, name: str) -> None:
    if is_concrete(x):
        require(not bool(np.any(np.isnan(np.asarray(x)))), name, "contains NaN")


def check_mask(mask, shape, name: str = "mask") -> None:
    if mask is None:
        return
    require(jnp.shape(mask) == tuple(shape), name, f"expected shape {tuple(shape)}, got {jnp.shape(mask)}")
    require(jnp.result_type(mask) == jnp.bool_, name, f"expected dtype bool, got {jnp.result_type(mask)}")
