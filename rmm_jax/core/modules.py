"""The reranker as flax modules: they initialise its parameters and apply the `mlp` kind.

A `linear` reranker is scored from its parameter dict directly
(:mod:`rmm_jax.core.reranker`), so a command that only serves or evaluates saved linear
policies never imports flax (about 0.1 s of its start-up).
"""
from __future__ import annotations

import flax.linen as nn


class ResidualLinear(nn.Module):
    """x ↦ x + W x, W initialised to zero."""

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1], use_bias=False, kernel_init=nn.initializers.zeros, name="W")(x)


class ResidualMLP(nn.Module):
    """x ↦ x + W₂ gelu(W₁ x + b₁) + b₂, output layer initialised to zero."""

    hidden: int

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.hidden, name="up")(x))
        return x + nn.Dense(x.shape[-1], kernel_init=nn.initializers.zeros, name="down")(h)


class Reranker(nn.Module):
    """Scores K candidate memories for one query: s = (m + f_m(m)) · (q + f_q(q))."""

    kind: str = "linear"
    hidden: int | None = None

    def setup(self):
        if self.kind == "linear":
            self.q_adapter, self.m_adapter = ResidualLinear(), ResidualLinear()
        else:
            self.q_adapter, self.m_adapter = ResidualMLP(self.hidden), ResidualMLP(self.hidden)

    def __call__(self, q, m):
        return self.m_adapter(m) @ self.q_adapter(q)
