"""Ranking metrics on arrays, jittable.

Inputs are the relevance of a ranked list in rank order, ``rel (Q, L) bool``, and the
total number of gold items per query, ``num_gold (Q,) int`` (which may exceed what the
list contains: gold items the retriever missed still count in the denominator). Every
metric returns a ``(Q,)`` float32 array. ``k`` is a static Python int; ``k > L`` uses the
whole list.

Queries with ``num_gold == 0`` have no meaningful recall/NDCG (they return 0 here) and
must be excluded by the caller; :func:`summarize` does that with its ``valid`` mask.

Example::

    >>> import numpy as np
    >>> from rmm_jax.core.metrics import mrr, recall_at_k
    >>> rel = np.array([[False, True, False, True]])
    >>> float(recall_at_k(rel, np.array([3]), 2)[0])   # 1 of 3 gold in the top 2
    0.3333333432674408
    >>> float(mrr(rel)[0])
    0.5
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.errors import InputError

__all__ = [
    "recall_at_k", "recall_any_at_k", "recall_all_at_k", "ndcg_at_k", "mrr", "summarize",
]


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}", where="k")
    return int(k)


def _check_rel(rel, num_gold=None) -> None:
    """``rel`` (Q, L) bool and ``num_gold`` (Q,), checked on shapes and dtypes only (static
    under jit): a float ``rel`` counted 0.3 as 0.3 of a hit, an int one 2 as two hits, a
    ``num_gold`` of another length broadcast to a (Q',) result, and a 1-D ``rel`` was an
    IndexError."""
    shape = np.shape(rel)
    dtype = rel.dtype if hasattr(rel, "dtype") else np.asarray(rel).dtype
    if len(shape) != 2:
        raise InputError(f"expected a (Q, L) array, one ranked list per query, got shape {shape}", where="rel")
    if dtype != np.bool_:
        raise InputError(f"expected dtype bool (whether each ranked item is gold), got {dtype}", where="rel")
    if num_gold is not None and np.shape(num_gold) != shape[:1]:
        raise InputError(f"expected shape ({shape[0]},), one count per query of rel {shape}, "
                         f"got {np.shape(num_gold)}", where="num_gold")


def _hits(rel, k):
    rel = jnp.asarray(rel).astype(jnp.float32)
    return rel[:, :k]


@functools.partial(jax.jit, static_argnames=("k",))
def _recall(rel, num_gold, k):
    found = _hits(rel, k).sum(axis=1)
    ng = jnp.asarray(num_gold).astype(jnp.float32)
    return jnp.where(ng > 0, found / jnp.maximum(ng, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("k",))
def _recall_any(rel, k):
    return (_hits(rel, k).sum(axis=1) > 0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("k",))
def _recall_all(rel, num_gold, k):
    found = _hits(rel, k).sum(axis=1)
    ng = jnp.asarray(num_gold).astype(jnp.float32)
    return ((ng > 0) & (found >= ng)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("k",))
def _ndcg(rel, num_gold, k):
    h = _hits(rel, k)
    kk = h.shape[1]
    disc = 1.0 / jnp.log2(jnp.arange(kk, dtype=jnp.float32) + 2.0)
    dcg = (h * disc[None, :]).sum(axis=1)
    # ideal DCG: min(num_gold, k) gold items at the top; k here is the effective cut.
    cum = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(1.0 / jnp.log2(
        jnp.arange(k, dtype=jnp.float32) + 2.0))])
    n_ideal = jnp.clip(jnp.asarray(num_gold).astype(jnp.int32), 0, k)
    idcg = cum[n_ideal]
    return jnp.where(idcg > 0, dcg / jnp.where(idcg > 0, idcg, 1.0), 0.0)


@jax.jit
def _mrr(rel):
    r = jnp.asarray(rel).astype(bool)
    if r.shape[1] == 0:
        return jnp.zeros((r.shape[0],), jnp.float32)
    first = jnp.argmax(r, axis=1)
    return jnp.where(r.any(axis=1), 1.0 / (first.astype(jnp.float32) + 1.0), 0.0)


def gold_at(positions, gold):
    """(B, M) bool: whether the candidate at each of ``positions`` (B, M; −1 unfilled) is
    gold (``gold``: (B, K) bool); an unfilled slot is never gold. The ``rel`` the metrics
    below take, for a ranking or a drawn selection given as positions.

    Examples:
      >>> import jax.numpy as jnp
      >>> from rmm_jax.core import metrics
      >>> gold = jnp.array([[True, False, True, False]])
      >>> metrics.gold_at(jnp.array([[2, 1, -1]]), gold).tolist()
      [[True, False, False]]
    """
    return jnp.take_along_axis(gold, jnp.maximum(positions, 0), axis=1) & (positions >= 0)


def recall_at_k(rel, num_gold, k: int):
    """Fraction of the query's gold items found in the top ``k`` (0 when num_gold == 0).

        recall@k = |gold ∩ top-k| / num_gold

    Examples:
      >>> import numpy as np
      >>> from rmm_jax.core import metrics
      >>> rel = np.array([[True, False, True, False],    # gold at ranks 1 and 3
      ...                 [False, False, False, True]])  # gold at rank 4
      >>> metrics.recall_at_k(rel, np.array([2, 1]), 3).tolist()
      [1.0, 0.0]
      >>> metrics.recall_at_k(rel, np.array([4, 0]), 4).tolist()  # 2 of 4 gold were retrieved
      [0.5, 0.0]
    """
    _check_rel(rel, num_gold)
    return _recall(rel, num_gold, k=_check_k(k))


def recall_any_at_k(rel, num_gold, k: int):
    """1 if at least one gold item is in the top ``k``, else 0. ``num_gold`` is unused
    (kept for a uniform signature).

    Examples:
      >>> import numpy as np
      >>> from rmm_jax.core import metrics
      >>> rel = np.array([[True, False, True, False],    # gold at ranks 1 and 3
      ...                 [False, False, False, True]])  # gold at rank 4
      >>> metrics.recall_any_at_k(rel, np.array([2, 1]), 1).tolist()
      [1.0, 0.0]
      >>> metrics.recall_any_at_k(rel, np.array([2, 1]), 4).tolist()
      [1.0, 1.0]
    """
    _check_rel(rel)
    del num_gold
    return _recall_any(rel, k=_check_k(k))


def recall_all_at_k(rel, num_gold, k: int):
    """1 if every gold item (all ``num_gold`` of them) is in the top ``k``, else 0.

    Examples:
      >>> import numpy as np
      >>> from rmm_jax.core import metrics
      >>> rel = np.array([[True, False, True, False],    # gold at ranks 1 and 3
      ...                 [False, False, False, True]])  # gold at rank 4
      >>> metrics.recall_all_at_k(rel, np.array([2, 1]), 2).tolist()  # rank 3 is cut
      [0.0, 0.0]
      >>> metrics.recall_all_at_k(rel, np.array([2, 1]), 4).tolist()
      [1.0, 1.0]
    """
    _check_rel(rel, num_gold)
    return _recall_all(rel, num_gold, k=_check_k(k))


def ndcg_at_k(rel, num_gold, k: int):
    """NDCG@k with binary gains, ``1/log2(rank+1)`` discounts; the ideal DCG puts
    ``min(num_gold, k)`` gold items at the top (0 when num_gold == 0).

    When the list is shorter than ``k`` the ideal still uses ``k`` (a short list is
    penalised for gold it could not show).

        NDCG@k = Σ_{i ≤ k} rel_i / log2(i + 1)  /  Σ_{i ≤ min(num_gold, k)} 1 / log2(i + 1)

    Examples:
      >>> import numpy as np
      >>> from rmm_jax.core import metrics
      >>> rel = np.array([[True, False, True, False],    # gold at ranks 1 and 3
      ...                 [False, False, False, True]])  # gold at rank 4
      >>> [round(x, 4) for x in metrics.ndcg_at_k(rel, np.array([2, 1]), 4).tolist()]
      [0.9197, 0.4307]
    """
    _check_rel(rel, num_gold)
    return _ndcg(rel, num_gold, k=_check_k(k))


def mrr(rel):
    """Reciprocal rank of the first relevant item (1-based), 0 if none in the list.

    Examples:
      >>> import numpy as np
      >>> from rmm_jax.core import metrics
      >>> rel = np.array([[True, False, True, False],    # gold at ranks 1 and 3
      ...                 [False, False, False, True]])  # gold at rank 4
      >>> metrics.mrr(rel).tolist()
      [1.0, 0.25]
      >>> metrics.mrr(np.zeros((1, 3), bool)).tolist()
      [0.0]
    """
    _check_rel(rel)
    return _mrr(rel)


def _mean_block(per_query: dict, sel: np.ndarray) -> dict:
    n = int(sel.sum())
    out = {name: (float(np.asarray(v, np.float64)[sel].mean()) if n else None)
           for name, v in per_query.items()}
    out["n"] = n
    return out


def summarize(per_query: dict, valid, groups: dict | None = None) -> dict:
    """Means of per-query metrics over the valid queries, overall and per group.

    Args:
      per_query: ``{metric name: (Q,) array}``.
      valid: ``(Q,)`` bool; only these queries are averaged (e.g. ``num_gold > 0`` and
        not abstention).
      groups: ``{group name: (Q,) array of labels}``, e.g. ``{"user": ..., "category":
        ...}``.

    Returns:
      ``{"overall": {metric: mean, ..., "n": count}, "per_<group>": {label: {...}}}``.
      A label whose queries are all invalid appears with ``"n": 0`` and ``None`` means.
      Labels are strings, in order of first appearance.

    Example::

        >>> import numpy as np
        >>> from rmm_jax.core.metrics import summarize
        >>> summarize({"mrr": np.array([1.0, 0.5, 0.0])}, np.array([True, True, False]),
        ...           {"user": np.array(["a", "b", "b"])})["per_user"]["b"]
        {'mrr': 0.5, 'n': 1}
    """
    valid = np.asarray(valid).astype(bool)
    q = valid.shape[0]
    for name, v in per_query.items():
        if np.asarray(v).shape != (q,):
            raise InputError(f"per-query metric shape {np.asarray(v).shape} != ({q},)",
                             where=f"per_query[{name!r}]")
    res = {"overall": _mean_block(per_query, valid)}
    for gname, labels in (groups or {}).items():
        labels = np.asarray(labels)
        if labels.shape != (q,):
            raise InputError(f"group labels shape {labels.shape} != ({q},)",
                             where=f"groups[{gname!r}]")
        lab = labels.astype(str)
        order = list(dict.fromkeys(lab.tolist()))
        res[f"per_{gname}"] = {g: _mean_block(per_query, valid & (lab == g)) for g in order}
    return res


def ideal_dcg(n: int) -> float:
    """Ideal DCG of ``n`` gold items at the top (helper for tests and reports)."""
    return sum(1.0 / math.log2(i + 2) for i in range(n))
