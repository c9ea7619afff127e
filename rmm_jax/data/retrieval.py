"""Dense retrieval in JAX: exact top-k by dot product over a large memory bank.

The bank is scanned in chunks of ``chunk_size`` rows. Each chunk is scored against the
queries, reduced with :func:`jax.lax.top_k`, and merged into a running ``(Q, k)`` best
list, so a ``1,000,000 x 384`` bank never materialises a ``(Q, N)`` score matrix: peak
extra memory is ``(Q, chunk_size)`` scores. Queries are processed in blocks of
``query_block`` rows for the same reason.

Ties are broken by the lower bank index: :func:`jax.lax.top_k` puts the lower index
first among equal values, and the running list (which only holds rows of earlier
chunks, i.e. lower indices) is placed before the new chunk in every merge.

Example::

    >>> import numpy as np
    >>> from rmm_jax.data.retrieval import top_k
    >>> bank = np.eye(4, dtype=np.float32)
    >>> q = np.array([[0.1, 0.9, 0.0, 0.5]], np.float32)
    >>> scores, idx = top_k(q, bank, 2)
    >>> idx.tolist()
    [[1, 3]]
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import metrics as M
from rmm_jax.core.executables import aot
from rmm_jax.errors import InputError, named

__all__ = ["top_k", "multi_probe_top_k", "retrieve_candidates", "pad_rows", "metric_names", "evaluate_store"]

_NEG_INF = -jnp.inf


def _chunk_scan(score_chunk, bank, bank_mask, k: int, chunk: int, n_chunks: int, n_q: int):
    """Running top-k over the bank in chunks.

    ``score_chunk(rows (C, d)) -> (Q, C)`` scores one chunk. The last chunk is read at a
    clamped start (``N - C``) so no padded copy of the bank is made; its rows that
    belong to the previous chunk are set to ``-inf`` (the padding), as are masked rows.
    """
    n, d = bank.shape
    kk = min(k, chunk)
    col = jnp.arange(chunk, dtype=jnp.int32)

    def body(carry, c):
        best_s, best_i = carry
        nominal = c * chunk
        start = jnp.minimum(nominal, n - chunk)
        rows = jax.lax.dynamic_slice(bank, (start, 0), (chunk, d))
        rmask = jax.lax.dynamic_slice(bank_mask, (start,), (chunk,))
        gidx = start + col
        ok = rmask & (gidx >= nominal)              # drop overlap with the previous chunk
        s = score_chunk(rows)
        s = jnp.where(ok[None, :], s, _NEG_INF)
        cs, ci = jax.lax.top_k(s, kk)
        ci = gidx[ci]
        all_s = jnp.concatenate([best_s, cs], axis=1)
        all_i = jnp.concatenate([best_i, ci], axis=1)
        ms, mi = jax.lax.top_k(all_s, k)
        return (ms, jnp.take_along_axis(all_i, mi, axis=1)), None

    init = (
        jnp.full((n_q, k), _NEG_INF, jnp.float32),
        jnp.full((n_q, k), -1, jnp.int32),
    )
    (s, i), _ = jax.lax.scan(body, init, jnp.arange(n_chunks, dtype=jnp.int32))
    return s, i


@aot(static_argnames=("k", "chunk", "n_chunks"))
def _top_k_jit(queries, bank, bank_mask, *, k, chunk, n_chunks):
    def score(rows):
        return jnp.matmul(queries, rows.T, precision=jax.lax.Precision.HIGHEST)

    return _chunk_scan(score, bank, bank_mask, k, chunk, n_chunks, queries.shape[0])


@functools.partial(jax.jit, static_argnames=("k", "chunk", "n_chunks"))
def _multi_probe_jit(probes, probe_mask, bank, bank_mask, *, k, chunk, n_chunks):
    def score(rows):
        s = jnp.einsum("qpd,nd->qpn", probes, rows, precision=jax.lax.Precision.HIGHEST)
        s = jnp.where(probe_mask[:, :, None], s, _NEG_INF)
        return s.max(axis=1)

    return _chunk_scan(score, bank, bank_mask, k, chunk, n_chunks, probes.shape[0])


def _non_finite_row(x, keep=None, finite=None) -> int | None:
    """The first row of ``x`` (N, d) host float32 that holds NaN or ±inf (among the rows ``keep``
    holds, None: all), else None. A NaN row scored NaN against every query, which top_k ranks
    first: the bank's row came back as every query's best, a NaN query's scores were all NaN.
    One matrix-vector product finds the candidates (NaN and inf carry through a sum), cheap
    beside the scoring's matrix product; a row whose finite entries merely overflow that sum
    is cleared by its own check. ``finite``: the (N,) row flags, computed where ``x`` lives
    (a bank on the device: :func:`_finite_rows`)."""
    if finite is not None:
        bad = np.flatnonzero(~finite if keep is None else ~finite & keep)
        return int(bad[0]) if len(bad) else None
    if x.size == 0:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        maybe = ~np.isfinite(x @ np.ones(x.shape[1], np.float32))
    if keep is not None:
        maybe &= keep
    for i in np.flatnonzero(maybe):
        if not np.isfinite(x[i]).all():
            return int(i)
    return None


def _check_finite_rows(x, name: str, keep=None, finite=None) -> None:
    """InputError naming ``name`` and the row when :func:`_non_finite_row` finds one."""
    i = _non_finite_row(x, keep, finite)
    if i is not None:
        raise InputError(f"row {i} holds NaN or inf (a vector to score must be finite)", where=name)


@aot
def _finite_rows(bank):
    """:func:`_non_finite_row`'s test of a bank already on the device, there: (N,) bool."""
    return jnp.isfinite(bank).all(axis=1)


def _check_bank(bank, bank_mask, k, chunk_size, d_query):
    bank = np.asarray(bank) if not isinstance(bank, jax.Array) else bank
    if bank.ndim != 2:
        raise InputError(f"bank must be 2-D (N, d), got shape {tuple(bank.shape)}", where="bank")
    n, d = bank.shape
    if d != d_query:
        raise InputError(f"query dim {d_query} != bank dim {d}", where="bank")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}", where="k")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive integer, got {chunk_size!r}", where="chunk_size")
    if bank_mask is None:
        n_valid = n
        mask = np.ones((n,), bool)
    else:
        m = np.asarray(bank_mask)
        if m.shape != (n,):
            raise InputError(f"bank_mask shape {m.shape} != ({n},)", where="bank_mask")
        m = m.astype(bool)
        n_valid = int(m.sum())
        mask = m
    if k > n_valid:
        raise InputError(
            f"k={k} is larger than the number of (valid) bank rows ({n_valid}); use k <= {n_valid}",
            where="k",
        )
    chunk = int(min(chunk_size, n))
    n_chunks = math.ceil(n / chunk)
    # on the device once for every query block; converted on the host and put there (jnp.asarray
    # and eager casts are programs to trace and load in every process, device_put is not)
    if isinstance(bank, jax.Array):
        bank = bank.astype(jnp.float32)
        _check_finite_rows(bank, "bank", mask, finite=np.asarray(_finite_rows(bank)))   # on the device: N flags back
    else:
        bank = np.asarray(bank, np.float32)
        _check_finite_rows(bank, "bank", mask)                 # rows bank_mask drops are never scored
        bank = jax.device_put(bank)
    return bank, jax.device_put(mask), int(k), chunk, n_chunks


def _blocks(n_q: int, query_block: int):
    qb = max(1, min(int(query_block), n_q))
    return qb, [(s, min(s + qb, n_q)) for s in range(0, n_q, qb)]


def _by_blocks(n_q: int, query_block: int, call):
    """Run ``call(start, end, padded_rows) -> (scores, indices)`` over fixed-size query
    blocks (one compiled shape) and concatenate the unpadded results."""
    qb, blocks = _blocks(n_q, query_block)
    out_s, out_i = [], []
    for s, e in blocks:
        sc, ix = call(s, e, qb)
        out_s.append(np.asarray(sc)[: e - s])
        out_i.append(np.asarray(ix)[: e - s])
    return np.concatenate(out_s), np.concatenate(out_i).astype(np.int32)


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` with zero rows appended up to ``rows`` (a chunk of fixed shape, so that a
    compiled program runs on every chunk without compiling again).

    >>> import numpy as np
    >>> from rmm_jax.data.retrieval import pad_rows
    >>> pad_rows(np.ones((2, 3), np.float32), 4).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    if x.shape[0] == rows:
        return x
    pad = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return np.pad(x, pad)


def top_k(queries, bank, k: int, *, chunk_size: int = 65536, bank_mask=None,
          query_block: int = 1024):
    """Exact top-``k`` bank rows per query by dot product.

    Args:
      queries: ``(Q, d)`` float array.
      bank: ``(N, d)`` float array (numpy, memmap or jax).
      k: how many rows to return; must not exceed the number of valid bank rows.
      chunk_size: bank rows scored at once (peak memory ``Q_block x chunk_size``).
      bank_mask: optional ``(N,)`` bool; False rows are never returned.
      query_block: queries scored at once.

    Returns:
      ``(scores (Q, k) float32, indices (Q, k) int32)`` as numpy arrays, best first,
      ties broken by lower index.

    Raises:
      InputError: bad shapes, ``k`` larger than the number of valid bank rows, or a query or
        a valid bank row that holds NaN or inf (named by its row).
    """
    q = np.asarray(queries, dtype=np.float32)
    if q.ndim != 2:
        raise InputError(f"queries must be 2-D (Q, d), got shape {q.shape}", where="queries")
    bank, mask, k, chunk, n_chunks = _check_bank(bank, bank_mask, k, chunk_size, q.shape[1])
    _check_finite_rows(q, "queries")
    n_q = q.shape[0]
    if n_q == 0:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int32)
    return _by_blocks(n_q, query_block, lambda s, e, qb: _top_k_jit(
        pad_rows(q[s:e], qb), bank, mask, k=k, chunk=chunk, n_chunks=n_chunks))


def multi_probe_top_k(probes, bank, k: int, *, chunk_size: int = 65536, bank_mask=None,
                      probe_mask=None, query_block: int = 256):
    """Top-``k`` rows per query when each query has several probe vectors.

    Semantics: take the union of every probe's candidates, de-duplicate, score each
    candidate by its best probe (max dot product), and return the top ``k`` of that.
    This equals an exact top-``k`` of ``max_p <probe_p, row>`` over the whole bank (a
    row in that top-``k`` is necessarily in the top-``k`` of its best probe), which is
    how it is computed: chunk by chunk, without a ``(Q, N)`` matrix, each row once.

    Args:
      probes: ``(Q, P, d)``.
      probe_mask: optional ``(Q, P)`` bool; False probes are ignored (each query needs
        at least one True probe).

    Returns:
      ``(scores (Q, k), indices (Q, k) int32)``, best first, ties by lower index.
    """
    p = np.asarray(probes, dtype=np.float32)
    if p.ndim != 3:
        raise InputError(f"probes must be 3-D (Q, P, d), got shape {p.shape}", where="probes")
    bank, mask, k, chunk, n_chunks = _check_bank(bank, bank_mask, k, chunk_size, p.shape[2])
    n_q, n_p = p.shape[:2]
    if probe_mask is None:
        pm = np.ones((n_q, n_p), bool)
    else:
        pm = np.asarray(probe_mask).astype(bool)
        if pm.shape != (n_q, n_p):
            raise InputError(f"probe_mask shape {pm.shape} != {(n_q, n_p)}", where="probe_mask")
    if n_p == 0 or (n_q and not pm.any(axis=1).all()):
        raise InputError("every query needs at least one probe", where="probes")
    i = _non_finite_row(p.reshape(n_q * n_p, p.shape[2]), pm.reshape(-1))     # probe_mask's False probes are ignored
    if i is not None:
        raise InputError(f"query {i // n_p}, probe {i % n_p} holds NaN or inf (a vector to score must be finite)",
                         where="probes")
    if n_q == 0:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int32)
    def block(s, e, qb):
        ms = pad_rows(pm[s:e], qb)
        ms[e - s:] = True
        return _multi_probe_jit(jnp.asarray(pad_rows(p[s:e], qb)), jnp.asarray(ms), bank, mask, k=k,
                                chunk=chunk, n_chunks=n_chunks)

    return _by_blocks(n_q, query_block, block)


def retrieve_candidates(store_user, k: int, *, chunk_size: int = 65536):
    """Top-``k`` memory candidates for each query of one user, padded to exactly ``k``.

    Banks smaller than ``k`` are allowed: the missing slots hold index 0 with mask False.
    Downstream reranking works on these ``K`` candidates per query plus the mask.

    Args:
      store_user: a :class:`rmm_jax.data.store.UserData` (``memory_emb``, ``query_emb``).
      k: candidates per query.

    Returns:
      ``(cand_idx (n_q, k) int32, cand_mask (n_q, k) bool)``, best first.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}", where="k")
    mem = store_user.memory_emb
    qry = store_user.query_emb
    n_q, n_m = qry.shape[0], mem.shape[0]
    idx = np.zeros((n_q, k), np.int32)
    msk = np.zeros((n_q, k), bool)
    kk = min(k, n_m)
    if kk == 0 or n_q == 0:
        return idx, msk
    _, top = top_k(np.asarray(qry), np.asarray(mem), kk, chunk_size=chunk_size)
    idx[:, :kk] = top
    msk[:, :kk] = True
    return idx, msk


def metric_names(k: int) -> list[str]:
    """Columns reported for a cut-off ``k``: Recall@{5,10,20} up to k (and @k), all@k,
    NDCG@min(10,k), MRR.

    Examples:
      >>> from rmm_jax.data.retrieval import metric_names
      >>> metric_names(12)
      ['recall@5', 'recall@10', 'recall@12', 'recall_all@12', 'ndcg@10', 'mrr']
    """
    cuts = sorted({c for c in (5, 10, 20) if c <= k} | {k})
    return ([f"recall@{c}" for c in cuts] + [f"recall_all@{k}", f"ndcg@{min(10, k)}", "mrr"])


def evaluate_store(store, k: int, *, pad_short_banks: bool = False) -> dict:
    """Dense retrieval of the top ``k`` memories for every question of every user
    (``rmm-jax retrieve``).

    Returns ``{"overall", "per_user", "per_category", "counts", "k", ...}`` where each block
    maps metric names (see :func:`metric_names`) to means over the valid questions
    (>= 1 gold memory and not an abstention question) plus ``"n"``. A ``k`` larger than the
    bank of a user with questions raises :class:`~rmm_jax.errors.InputError` naming ``k``
    unless ``pad_short_banks``.

    Examples:
      >>> import tempfile, zlib
      >>> import numpy as np
      >>> from rmm_jax.data.retrieval import evaluate_store
      >>> from rmm_jax.data.store import open_store, write_store
      >>> from rmm_jax.data.synthetic import make_synthetic
      >>> class Hashed:       # any .encode/.model_id/.dim: one random unit vector a text
      ...     model_id, dim = "hashed-8", 8
      ...     def encode(self, texts, desc=""):
      ...         v = np.stack([np.random.default_rng(zlib.crc32(t.encode())).normal(size=8) for t in texts])
      ...         return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
      >>> path = tempfile.mkdtemp() + "/store"
      >>> _ = write_store(path, make_synthetic(users=2, sessions=2, turns=4), "session", Hashed())
      >>> res = evaluate_store(open_store(path), 2)
      >>> res["metrics"], sorted(res["per_user"]), res["counts"]["users"]
      (['recall@2', 'recall_all@2', 'ndcg@2', 'mrr'], ['user0', 'user1'], 2)
      >>> evaluate_store(open_store(path), 5)
      Traceback (most recent call last):
      ...
      rmm_jax.errors.InputError: k: k=5 is larger than the memory bank of user ... or pad_short_banks=True
    """
    if not hasattr(store, "bank_sizes"):
        raise InputError(f"expected an opened store (open_store(path)), got {type(store).__name__} {store!r:.60}",
                         arg="store")
    M._check_k(k)                         # before the bank sizes are compared with it
    if not pad_short_banks:               # a user without questions retrieves nothing: its bank may be short
        for uid, n_m in store.bank_sizes.items():
            if k > n_m and store.query_count(uid):
                raise InputError(f"k={k} is larger than the memory bank of user {uid!r} "
                                 f"({n_m} memories); use a smaller {named('k')} or {named('pad_short_banks', True)}",
                                 arg="k")
    rels, golds, valid, users, cats = [], [], [], [], []
    n_abst = n_nogold = 0
    for u in store.iter_users():
        n_q = u.query_emb.shape[0]
        if n_q == 0:
            continue
        idx, mask = retrieve_candidates(u, k)
        rel = np.zeros((n_q, k), bool) if u.gold.shape[1] == 0 else \
            np.take_along_axis(u.gold, idx, axis=1) & mask
        rels.append(rel)
        golds.append(u.num_gold)
        valid.append(u.valid)
        users.extend([u.user_id] * n_q)
        cats.extend(c or "(none)" for c in u.categories)
        n_abst += int(u.abstention.sum())
        n_nogold += int(((u.num_gold == 0) & ~u.abstention).sum())
    names = metric_names(k)
    if rels:
        rel = np.concatenate(rels)
        ng = np.concatenate(golds)
        ok = np.concatenate(valid)
    else:
        rel, ng, ok = np.zeros((0, k), bool), np.zeros((0,), np.int32), np.zeros((0,), bool)
    per_q = {}
    for name in names:
        if name.startswith("recall_all@"):
            per_q[name] = M.recall_all_at_k(rel, ng, k)
        elif name.startswith("recall@"):
            per_q[name] = M.recall_at_k(rel, ng, int(name.split("@")[1]))
        elif name.startswith("ndcg@"):
            per_q[name] = M.ndcg_at_k(rel, ng, int(name.split("@")[1]))
        else:
            per_q[name] = M.mrr(rel)
    per_q = {n: np.asarray(v) for n, v in per_q.items()}
    s = M.summarize(per_q, ok, {"user": np.array(users, dtype=object).astype(str),
                                "category": np.array(cats, dtype=object).astype(str)})
    for uid in store.user_ids:  # users without questions still get a row
        s["per_user"].setdefault(uid, {**{n: None for n in names}, "n": 0})
    c = store.manifest["counts"]
    return {
        "store": str(store.path), "model": store.model, "granularity": store.granularity, "k": k,
        "metrics": names,
        "overall": s["overall"], "per_user": s["per_user"],
        "per_category": dict(sorted(s["per_category"].items(), key=lambda kv: _cat_key(kv[0]))),
        "counts": {"users": c["users"], "memories": c["memories"], "queries": c["queries"],
                   "valid_queries": int(ok.sum()), "abstention_queries": n_abst,
                   "queries_without_gold_memory": n_nogold},
    }


def _cat_key(c: str):
    return (0, int(c), "") if c.isdigit() else (1, 0, c)
