"""Synthetic vector streams: users made of random embeddings with a learnable structure.

For benchmarks and tests that need many users without text or an embedding model (the
scale benchmark, one-question-per-user learning). Each user is generated on the fly from
``(seed, user index)``, so 100,000 users cost no storage.

How a user is made (d dimensions, N memories, T queries):

    memories   m_j ~ N(0, I_d / d)                                 j = 1..N
    gold       g_t uniform over the user's memories                 one per query
    query      q_t = (γ I + α S + β U_u V_uᵀ) m_{g_t} + σ ε_t,   ε_t ~ N(0, I_d / d),  γ = c/√d

S (d×d, entries N(0, 1/d)) is one distortion shared by every user of the seed; U_u, V_u
(U entries N(0, 1/r_u), V entries N(0, 1/d)) a user's own low-rank twist. The base
retriever ranks by q·m: the gold memory's score is about γ, the others' spread about
√((α² + β² + σ²)/d), so with the default c = 2.5 the gold memory is usually among the top-K
but often not in the top-M; a reranker that learns the inverse map (γ I + α S)⁻¹ recovers
it. Scope ``shared`` can learn S from everyone's citations;
``hybrid`` also each user's twist; ``user`` must learn S again for every user.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np

from rmm_jax.online.streams import Stream


class VectorSpec(NamedTuple):
    """The shape and difficulty of a synthetic vector population."""
    dim: int = 384
    memories: int = 100
    queries: int = 100
    k: int = 20
    signal: float = 2.5       # c: the identity part γ = c/√d
    alpha: float = 1.0        # strength of the shared distortion S
    beta: float = 0.5         # strength of each user's own twist
    user_rank: int = 4        # rank of each user's twist
    noise: float = 0.3        # σ


def shared_distortion(spec: VectorSpec, seed: int) -> np.ndarray:
    """S: the distortion every user of ``seed`` shares."""
    rng = np.random.default_rng([seed, 0x5EED])
    return (rng.standard_normal((spec.dim, spec.dim)) / np.sqrt(spec.dim)).astype(np.float32)


def vector_stream(spec: VectorSpec, seed: int, index: int, shared: np.ndarray | None = None) -> Stream:
    """User ``index`` of the population ``seed`` (see the module docstring)."""
    d, n, t, k = spec.dim, spec.memories, spec.queries, spec.k
    s = shared_distortion(spec, seed) if shared is None else shared
    rng = np.random.default_rng([seed, index])
    bank = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(np.float32)
    r = spec.user_rank
    u = rng.standard_normal((d, r)).astype(np.float32) / np.sqrt(r)
    v = rng.standard_normal((d, r)).astype(np.float32) / np.sqrt(d)
    gold_idx = rng.integers(0, n, t)
    g = bank[gold_idx]                                                        # (T, d)
    q = spec.signal / np.sqrt(d) * g + spec.alpha * g @ s.T + spec.beta * (g @ v) @ u.T
    q += spec.noise * rng.standard_normal((t, d)).astype(np.float32) / np.sqrt(d)
    q = q.astype(np.float32)
    scores = q @ bank.T
    cand = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32)
    gold = np.zeros((t, n), bool)
    gold[np.arange(t), gold_idx] = True
    return Stream(user_id=f"u{index:07d}", bank=bank, queries=q, cand=cand, cand_mask=np.ones((t, k), bool),
                  cand_gold=np.take_along_axis(gold, cand, axis=1), num_gold=np.ones(t, np.int32),
                  valid=np.ones(t, bool), memory_ids=tuple(f"m{j}" for j in range(n)),
                  query_ids=tuple(f"q{j}" for j in range(t)))


def vector_chunks(spec: VectorSpec, seed: int, users: int, users_per_chunk: int,
                  start: int = 0) -> Iterator[list[Stream]]:
    """Users ``start .. start+users−1`` in chunks, generated as they are needed."""
    s = shared_distortion(spec, seed)
    for lo in range(start, start + users, users_per_chunk):
        yield [vector_stream(spec, seed, i, s) for i in range(lo, min(lo + users_per_chunk, start + users))]
