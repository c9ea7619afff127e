"""The residual reranker of RMM's Retrospective Reflection (Tan et al., ACL 2025, §4.2).

A fixed dense retriever gives a query embedding q ∈ R^d and K candidate memory
embeddings m_i ∈ R^d. The reranker adapts both with residual maps and scores by dot
product:

    q' = q + W_q q,    m_i' = m_i + W_m m_i,    s_i = q'ᵀ m_i'            (`linear`, paper)
    q' = q + f_q(q),   m_i' = m_i + f_m(m_i)                             (`mlp`)

with f a two-layer GELU MLP, and for a user u of a ``hybrid`` policy (a shared reranker
plus a per-user low-rank residual, in the flax kernel convention x ↦ x K)

    K_q^u = K_q + A_q^u B_q^uᵀ,    K_m^u = K_m + A_m^u B_m^uᵀ,    A, B ∈ R^{d×r}   (`linear` + `lora`)

(LoRA, Hu et al., ICLR 2022). The residual branches start at exactly zero (zero
initialised output layers), so before any update the reranker ranks candidates exactly
as the base retriever's dot product.

Parameters are the plain nested dict that flax returns, e.g. for `linear`
``{"q_adapter": {"W": {"kernel": (d, d)}}, "m_adapter": {"W": {"kernel": (d, d)}}}``
(flax's Dense computes x @ kernel, so W = kernelᵀ). A low-rank residual adds
``{"lora": {"a": (d, r), "b": (d, r)}}`` beside ``"W"`` in each adapter: the per-user tree of
:func:`init_lowrank` is merged into the shared one with :func:`merge_params`. The kind is
read from the tree's structure, which is static under jit, so one `score` serves every
kind.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import checks

KINDS = ("linear", "mlp")


def kind_of(params) -> str:
    """`linear` or `mlp`, read from the parameter tree's structure. ``ValueError`` naming
    ``params`` unless it is a reranker's tree (:func:`init_reranker`, or one merged with a
    low-rank residual): other params were a KeyError ``'q_adapter'`` or ``'down'``."""
    q, m = (params.get("q_adapter"), params.get("m_adapter")) if isinstance(params, Mapping) else (None, None)
    ok = isinstance(q, Mapping) and isinstance(m, Mapping) and ("W" in q or "down" in q)
    got = f"keys {sorted(params)}" if isinstance(params, Mapping) else checks.short(params)
    factors = isinstance(q, Mapping) and set(q) == {"lora"}     # "expected ... q_adapter and m_adapter, got keys
    checks.require(ok or not factors, "params", "low-rank factors alone (init_lowrank): merge them with the shared "
                                                "reranker first, rmm_jax.merge_params(shared, factors)")   # [those]"
    checks.require(ok, "params", f"expected a reranker's params (init_reranker: q_adapter and m_adapter), got {got}")
    return "linear" if "W" in q else "mlp"


def dim_of(params) -> int:
    kind = kind_of(params)                                  # checks the tree before it is indexed
    leaf = params["q_adapter"]["W" if kind == "linear" else "down"]["kernel"]
    return int(leaf.shape[-1])


def init_reranker(key, dim: int, kind: str = "linear", hidden: int | None = None):
    """Parameters of a reranker whose scores equal the base dot product exactly.

    Args:
      key: PRNG key (the `mlp` input layer is random; its zero output layer keeps the
        residual at zero).
      dim: embedding dimension d.
      kind: ``"linear"`` (paper) or ``"mlp"``.
      hidden: MLP hidden width (default d); must be None for `linear`.

    Returns:
      The flax parameter dict (see the module docstring).

    Examples:
      >>> import jax, rmm_jax as rj
      >>> params = rj.init_reranker(jax.random.key(0), 4)
      >>> jax.tree.map(lambda x: x.shape, params)
      {'m_adapter': {'W': {'kernel': (4, 4)}}, 'q_adapter': {'W': {'kernel': (4, 4)}}}
      >>> mlp = rj.init_reranker(jax.random.key(0), 4, "mlp", hidden=8)
      >>> mlp["q_adapter"]["up"]["kernel"].shape, mlp["q_adapter"]["down"]["kernel"].shape
      ((4, 8), (8, 4))
    """
    checks.check_key(key)
    checks.require(kind in KINDS, "kind", f"must be one of {KINDS}, got {kind!r}")
    checks.require(checks.is_int(dim) and dim > 0, "dim", f"must be a positive int, got {dim!r}")
    dim = int(dim)
    if kind == "linear":
        checks.require(hidden is None, "hidden", "only the `mlp` kind has a hidden width")
    else:
        hidden = dim if hidden is None else hidden
        checks.require(checks.is_int(hidden) and hidden > 0, "hidden", f"must be a positive int, got {hidden!r}")
        hidden = int(hidden)
    from rmm_jax.core.modules import Reranker  # flax: imported to initialise, not to score a linear reranker
    module = Reranker(kind=kind, hidden=hidden)
    return module.init(key, jnp.zeros((dim,), jnp.float32), jnp.zeros((1, dim), jnp.float32))["params"]


def identity_reranker(dim: int) -> dict:
    """The `linear` reranker :func:`init_reranker` gives (both kernels zero: it scores as the
    base dot product), as NumPy float32 zeros of the same tree, built without running JAX:
    ``init_reranker`` traces a dozen small programs (the key, flax's init), in every process
    that serves the identity (``rmm-jax rerank`` before any policy exists).

    Examples:
      >>> import jax, numpy as np, rmm_jax as rj
      >>> from rmm_jax.core.reranker import identity_reranker
      >>> same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b),
      ...                     identity_reranker(4), rj.init_reranker(jax.random.key(0), 4))
      >>> all(jax.tree.leaves(same))
      True
    """
    checks.require(checks.is_int(dim) and dim > 0, "dim", f"must be a positive int, got {dim!r}")
    zero = lambda: {"W": {"kernel": np.zeros((int(dim), int(dim)), np.float32)}}
    return {"m_adapter": zero(), "q_adapter": zero()}


def init_lowrank(key, dim: int, rank: int):
    """A per-user low-rank residual that starts at exactly zero: A ~ N(0, 1/r), B = 0.

    A Bᵀ = 0, so a new user scores exactly as the shared reranker. B's gradient is
    not zero (it is linear in A), so the product leaves zero on the first update;
    A's gradient is zero until B has moved (LoRA's initialisation). A's scale sets how fast
    the residual learns: Adam moves each entry of B by about ``lr`` a step, so an entry of
    A Bᵀ, a sum of r such moves weighted by A's entries, moves by about ``lr`` when they
    have variance 1/r: the user's part learns as fast as a whole kernel of its own (LoRA's
    α/r scaling). At variance 1/d it learned about √(d/r) times slower, and a hybrid user
    kept little of its own (docs/scopes.md).

    Examples:
      >>> import jax, rmm_jax as rj
      >>> lr = rj.init_lowrank(jax.random.key(0), 6, 2)
      >>> jax.tree.map(lambda x: x.shape, lr)["q_adapter"]
      {'lora': {'a': (6, 2), 'b': (6, 2)}}
      >>> float(abs(lr["m_adapter"]["lora"]["b"]).max())
      0.0
    """
    checks.check_key(key)
    checks.require(checks.is_int(dim) and dim > 0, "dim", f"must be a positive int, got {dim!r}")
    checks.require(checks.is_int(rank) and 0 < rank < dim, "rank", f"must be in [1, d={dim}), got {rank!r}")
    dim, rank = int(dim), int(rank)
    kq, km = jax.random.split(key)
    one = lambda k: {"lora": {"a": jax.random.normal(k, (dim, rank), jnp.float32) / jnp.sqrt(jnp.float32(rank)),
                              "b": jnp.zeros((dim, rank), jnp.float32)}}
    return {"m_adapter": one(km), "q_adapter": one(kq)}


def merge_params(shared, local):
    """The reranker params of one user: the union of the shared and per-user trees.

    Scope ``user``: shared ``{}``; ``shared``: local ``{}``; ``hybrid``: the shared
    ``W`` kernels and the user's ``lora`` factors side by side in each adapter.
    Gradients through the merge split back into the two parts.

    Examples:
      >>> import jax, rmm_jax as rj
      >>> lowrank = rj.init_lowrank(jax.random.key(1), 4, 2)
      >>> p = rj.merge_params(rj.init_reranker(jax.random.key(0), 4), lowrank)           # hybrid
      >>> sorted(p["q_adapter"]), sorted(rj.merge_params({}, lowrank)["q_adapter"])      # and an empty shared part
      (['W', 'lora'], ['lora'])
    """
    out = _merge(shared, local, ())
    for name in ("q_adapter", "m_adapter"):        # factors of another size failed deep inside a dot_general
        p = out.get(name) if isinstance(out, dict) else None
        if isinstance(p, dict) and isinstance(p.get("lora"), dict) and isinstance(p.get("W"), dict):
            d, dl = np.shape(p["W"]["kernel"])[-1], np.shape(p["lora"]["a"])[-2]
            checks.require(d == dl, "local", f"low-rank factors of dimension {dl}, the shared reranker's is {d}")
    return out


def _merge(shared, local, path: tuple):
    if isinstance(shared, dict) and not shared:
        return local
    if isinstance(local, dict) and not local:
        return shared
    # a leaf in both parts: the shared one was kept without a word (a user's whole reranker in scope hybrid)
    checks.require(isinstance(shared, dict) and isinstance(local, dict), "local",
                   f"holds {'/'.join(path) or 'params'}, which the shared part holds too: a user's part adds to the "
                   "shared one (in scope hybrid, low-rank factors: init_lowrank), it does not replace it")
    out = dict(shared)
    for k, v in local.items():
        out[k] = _merge(shared[k], v, (*path, k)) if k in shared else v
    return out


def _lora_delta(p, x):
    """x ↦ (x A) Bᵀ: the low-rank residual in O(d·r), or 0 without one."""
    if "lora" not in p:
        return 0.0
    return (x @ p["lora"]["a"]) @ p["lora"]["b"].T


def _apply_adapter(p, x):
    if "W" in p:
        return x + x @ p["W"]["kernel"] + _lora_delta(p, x)
    from rmm_jax.core.modules import ResidualMLP
    return ResidualMLP(p["up"]["kernel"].shape[-1]).apply({"params": p}, x)


def score_naive(params, q, m):
    """Reference path: build every adapted memory, s_i = (m_i + W_m m_i)ᵀ(q + W_q q). O(K·d²).
    The same scores as :func:`score` (without a mask), for testing its fused path.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> params = rj.init_reranker(jax.random.key(0), 3)
      >>> rj.score_naive(params, jnp.array([1.0, 0.0, 2.0]), jnp.eye(3)).tolist()   # at init: m @ q
      [1.0, 0.0, 2.0]
    """
    _check_query(params, q, m)                              # what score checks: a dot_general TypeError
    return _apply_adapter(params["m_adapter"], m) @ _apply_adapter(params["q_adapter"], q)


def _check_query(params, q, m) -> None:
    """``q`` (d,) and ``m`` (K, d) floats of the reranker's dimension (a tree of another kind:
    one ValueError naming ``params``)."""
    checks.check_rank(q, 1, "q")
    checks.check_rank(m, 2, "m")
    checks.check_float(q, "q")
    checks.check_float(m, "m")
    d = dim_of(params)
    checks.require(q.shape[0] == d, "q", f"dimension {q.shape[0]} does not match the reranker's {d}")
    checks.require(m.shape[1] == d, "m", f"dimension {m.shape[1]} does not match the reranker's {d}")


def _score_unmasked(params, q, m):
    if kind_of(params) == "mlp":
        return score_naive(params, q, m)
    # Fused linear path: s_i = m_iᵀ (I + K_m) q' with K_m = W_mᵀ the flax kernel, so
    # s = M v with v = q' + K_m q'. O(d² + K·d) per query; the K adapted memories are
    # never built. A low-rank residual adds K_q^u = K_q + A_q B_qᵀ and K_m^u = K_m + A_m B_mᵀ:
    # (q A_q) B_qᵀ and A_m (B_mᵀ q') cost O(d·r) more.
    pq, pm = params["q_adapter"], params["m_adapter"]
    q_prime = q + q @ pq["W"]["kernel"] + _lora_delta(pq, q)
    v = q_prime + pm["W"]["kernel"] @ q_prime
    if "lora" in pm:
        v = v + pm["lora"]["a"] @ (pm["lora"]["b"].T @ q_prime)
    return m @ v


def score(params, q, m, mask=None):
    """Reranker scores of K candidates for one query.

    Args:
      params: from :func:`init_reranker`.
      q: (d,) query embedding.
      m: (K, d) candidate memory embeddings.
      mask: optional (K,) bool; False marks padding. Masked slots score −inf and
        receive zero gradient.

    Returns:
      (K,) float32 scores s_i = q'ᵀ m_i'. For `linear` the fused O(d² + K·d) path.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> params = rj.init_reranker(jax.random.key(0), 3)
      >>> q = jnp.array([1.0, 0.0, 2.0])
      >>> m = jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
      >>> rj.score(params, q, m).tolist()        # at init: the base dot products m @ q
      [3.0, 2.0, 2.0]
      >>> rj.score(params, q, m, mask=jnp.array([True, False, True])).tolist()
      [3.0, -inf, 2.0]
    """
    _check_query(params, q, m)
    checks.check_mask(mask, (m.shape[0],))
    checks.check_finite(q, "q")                  # eager calls: NaN scored silently, while sampling refused it
    checks.check_finite_where(m, mask, "m")
    if mask is None:
        return _score_unmasked(params, q, m)
    # a masked slot may hold anything, NaN included: zeroed, it adds nothing to the params' gradient
    # (0 · NaN would be NaN there, and one update would spread it to every user of a shared part)
    return jnp.where(mask, _score_unmasked(params, q, jnp.where(mask[:, None], m, 0.0)), -jnp.inf)


def score_batch(params, q, m, mask=None):
    """:func:`score` over a leading batch axis: q (B, d), m (B, K, d), mask (B, K).

    Returns:
      (B, K) float32 scores.

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> params = rj.init_reranker(jax.random.key(0), 3)
      >>> q = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])         # B = 2 queries
      >>> m = jnp.broadcast_to(jnp.eye(3), (2, 3, 3))                 # K = 3 candidates each
      >>> rj.score_batch(params, q, m).tolist()
      [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
      >>> rj.score_batch(params, q, m, jnp.array([[True, True, False]] * 2)).shape
      (2, 3)
    """
    checks.check_rank(q, 2, "q")
    checks.check_rank(m, 3, "m")
    checks.require(m.shape[0] == q.shape[0], "m", f"candidates of {m.shape[0]} queries for {q.shape[0]} queries "
                                                  f"(q {q.shape}, m {m.shape})")
    checks.check_mask(mask, m.shape[:2])
    checks.check_finite(q, "q")                  # (score's own checks see tracers under vmap)
    checks.check_finite_where(m, mask, "m")
    if mask is None:
        return jax.vmap(score, in_axes=(None, 0, 0))(params, q, m)
    return jax.vmap(score, in_axes=(None, 0, 0, 0))(params, q, m, mask)
