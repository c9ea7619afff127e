"""The optimisers of the online update: optax's Adam and SGD, able to take a gradient given
as rank-B factors.

The linear reranker's gradient over a batch of B queries is a sum of B outer products,
∂L/∂K = Σ_b x_b ⊗ y_b (:func:`rmm_jax.core.update.linear_factors`). Writing that d×d matrix
and reading it back in Adam's elementwise update is most of a step's memory traffic, so
:class:`Optimizer` adds to optax's ``(init, update)`` pair a ``step_factors`` that takes the
factors and forms the products inside the elementwise update (XLA fuses them into the
moment and parameter loops; the d×d gradient is never written). The state is optax's own
(``ScaleByAdamState``, ``EmptyState``), so a stored policy is the same either way, and
``update`` is optax's, so an :class:`Optimizer` is a ``GradientTransformation`` wherever
optax takes one. Any other optax ``GradientTransformation`` works too: the update then
materialises the gradient from the factors and calls its ``update``.

Examples:
  >>> import jax.numpy as jnp
  >>> from rmm_jax import adam
  >>> opt = adam(1e-3)
  >>> p = {"w": jnp.zeros((3, 3))}
  >>> x, y = jnp.ones((2, 3)), jnp.arange(6.0).reshape(2, 3)     # ∂L/∂w = Σ_b x_b ⊗ y_b
  >>> p1, _ = opt.step_factors(p, opt.init(p), {"w": (x, y)})
  >>> u, _ = opt.update({"w": x.T @ y}, opt.init(p), p)            # optax on the dense gradient
  >>> bool(jnp.allclose(p1["w"], p["w"] + u["w"]))
  True
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rmm_jax.core import checks

OPTIMIZERS = ("adam", "sgd")
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8  # optax.adam's defaults


class Optimizer(NamedTuple):
    """An optax ``GradientTransformation`` (``init``, ``update``) with its name, learning rate
    and ``step_factors(params, state, factors) -> (params, state)``: the same step on a
    gradient given as ``{leaf: (x (B, d), y (B, d'))}``, ∂L/∂leaf = Σ_b x_b ⊗ y_b."""
    init: Callable
    update: Callable
    name: str
    lr: float
    step_factors: Callable


def outer_sum(x, y):
    """Σ_b x_b ⊗ y_b for x (B, d), y (B, d'), written as B broadcast products so that XLA
    fuses it into the elementwise loop that consumes it (a dot would be written out first)."""
    return sum(x[i][:, None] * y[i][None, :] for i in range(x.shape[0]))


def adam(lr: float) -> Optimizer:
    """``optax.adam(lr)`` that can also step on rank-B factors (same formula, same state).

    Examples:
      >>> import rmm_jax as rj
      >>> opt = rj.adam(1e-4)
      >>> opt.name, opt.lr, rj.preset("default", lr=1e-4).optimizer.name
      ('adam', 0.0001, 'adam')
    """
    checks.check_positive(lr, "lr")
    base = optax.adam(lr)

    def step_factors(params, state, factors):
        st = state[0]
        count = optax.safe_increment(st.count)
        c1 = 1 - ADAM_B1 ** count.astype(jnp.float32)
        c2 = 1 - ADAM_B2 ** count.astype(jnp.float32)

        def leaf(p, xy, mu, nu):
            g = outer_sum(*xy)
            mu = (1 - ADAM_B1) * g + ADAM_B1 * mu
            nu = (1 - ADAM_B2) * (g * g) + ADAM_B2 * nu
            return p + (-lr) * ((mu / c1) / (jnp.sqrt(nu / c2) + ADAM_EPS)), mu, nu

        out = jax.tree.map(leaf, params, factors, st.mu, st.nu, is_leaf=lambda v: isinstance(v, tuple))
        pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=lambda v: isinstance(v, tuple))
        return pick(0), (st._replace(count=count, mu=pick(1), nu=pick(2)),) + tuple(state[1:])

    return Optimizer(base.init, base.update, "adam", float(lr), step_factors)


def sgd(lr: float) -> Optimizer:
    """``optax.sgd(lr)`` that can also step on rank-B factors: p ← p − lr Σ_b x_b ⊗ y_b.

    Examples:
      >>> import jax.numpy as jnp, optax, rmm_jax as rj
      >>> opt, p = rj.sgd(0.5), {"w": jnp.array([1.0, 2.0])}
      >>> step, _ = opt.update({"w": jnp.array([1.0, -1.0])}, opt.init(p))
      >>> optax.apply_updates(p, step)["w"].tolist()            # p − 0.5 g
      [0.5, 2.5]
    """
    checks.check_positive(lr, "lr")
    base = optax.sgd(lr)

    def step_factors(params, state, factors):
        new = jax.tree.map(lambda p, xy: p + (-lr) * outer_sum(*xy), params, factors,
                           is_leaf=lambda v: isinstance(v, tuple))
        return new, state

    return Optimizer(base.init, base.update, "sgd", float(lr), step_factors)


def make(name: str, lr: float) -> Optimizer:
    """The optimiser ``name`` (:data:`OPTIMIZERS`) at learning rate ``lr``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: must be one of {OPTIMIZERS}, got {name!r}")
    return adam(lr) if name == "adam" else sgd(lr)


def describe(opt: Any) -> dict:
    """``{"name", "lr"}`` of an :class:`Optimizer`; ``{"name": "custom"}`` for any other optax
    transformation (its hyperparameters are closed over, out of sight)."""
    if isinstance(opt, Optimizer):
        return {"name": opt.name, "lr": opt.lr}
    return {"name": "custom"}


def step_dense_or_factors(opt, params, state, factors):
    """One step of ``opt`` on a factored gradient: :attr:`Optimizer.step_factors` when it has
    one, else optax's ``update`` on the materialised gradient Σ_b x_b ⊗ y_b."""
    if isinstance(opt, Optimizer):
        return opt.step_factors(params, state, factors)
    grads = jax.tree.map(lambda xy: jnp.einsum("bi,bj->ij", *xy), factors, is_leaf=lambda v: isinstance(v, tuple))
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state
