"""Synthetic vector streams: users made of random embeddings with a learnable structure.

For benchmarks and tests that need many users without text or an embedding model (the
scale benchmark, one-question-per-user learning). Each user is generated on the fly from
``(seed, user index)`` in one jitted call per chunk (``jax.random``), so 100,000 users cost
no storage and little time.

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

import functools
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
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


def shared_distortion(spec: VectorSpec, seed: int) -> jax.Array:
    """S: the distortion every user of ``seed`` shares."""
    return jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x5EED), (spec.dim, spec.dim)) / np.sqrt(spec.dim)


@functools.partial(jax.jit, static_argnums=0)
def _make_users(spec: VectorSpec, s, keys):
    """Bank, queries, candidates and gold of a batch of users (one PRNG key each)."""
    d, n, t, r = spec.dim, spec.memories, spec.queries, spec.user_rank

    def one(key):
        kb, ku, kv, kg, ke = jax.random.split(key, 5)
        bank = jax.random.normal(kb, (n, d)) / np.sqrt(d)
        u = jax.random.normal(ku, (d, r)) / np.sqrt(r)
        v = jax.random.normal(kv, (d, r)) / np.sqrt(d)
        gold_idx = jax.random.randint(kg, (t,), 0, n)
        g = bank[gold_idx]
        q = spec.signal / np.sqrt(d) * g + spec.alpha * g @ s.T + spec.beta * (g @ v) @ u.T
        q = q + spec.noise * jax.random.normal(ke, (t, d)) / np.sqrt(d)
        _, cand = jax.lax.top_k(q @ bank.T, spec.k)
        return bank, q, cand.astype(jnp.int32), cand == gold_idx[:, None]

    return jax.vmap(one)(keys)


def vector_users(spec: VectorSpec, seed: int, indices, shared=None) -> list[Stream]:
    """Users ``indices`` of the population ``seed`` (see the module docstring), made in one
    jitted call on the default device."""
    s = shared_distortion(spec, seed) if shared is None else shared
    base = jax.random.fold_in(jax.random.key(seed), 0xB0B)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(indices, jnp.uint32))
    bank, q, cand, gold = jax.device_get(_make_users(spec, s, keys))
    t, k = spec.queries, spec.k
    mem_ids, q_ids = tuple(f"m{j}" for j in range(spec.memories)), tuple(f"q{j}" for j in range(t))
    return [Stream(user_id=f"u{i:07d}", bank=bank[j], queries=q[j], cand=cand[j], cand_mask=np.ones((t, k), bool),
                   cand_gold=gold[j], num_gold=np.ones(t, np.int32), valid=np.ones(t, bool), memory_ids=mem_ids,
                   query_ids=q_ids) for j, i in enumerate(indices)]


def vector_stream(spec: VectorSpec, seed: int, index: int, shared=None) -> Stream:
    """User ``index`` of the population ``seed``."""
    return vector_users(spec, seed, [index], shared)[0]


def vector_chunks(spec: VectorSpec, seed: int, users: int, users_per_chunk: int,
                  start: int = 0) -> Iterator[list[Stream]]:
    """Users ``start .. start+users−1`` in chunks, generated as they are needed."""
    s = shared_distortion(spec, seed)
    for lo in range(start, start + users, users_per_chunk):
        yield vector_users(spec, seed, list(range(lo, min(lo + users_per_chunk, start + users))), s)
