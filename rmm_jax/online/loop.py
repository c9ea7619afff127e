"""The online loop: every user's whole citation stream inside one jitted device loop.

For each batch of B queries, in stream order (RMM's Retrospective Reflection, Tan et
al., ACL 2025, §4.2):

  1. score the K base-retriever candidates with the user's current reranker;
  2. **prequential evaluation**: the deterministic top-M (no noise) is scored against
     gold (Recall@M, NDCG@M) *before* any update that uses these queries;
  3. act: Gumbel-top-M selection (simulate) or the logged selection (replay);
  4. citations: the oracle simulator, or the logged ``cited`` ids;
  5. one REINFORCE update (:func:`rmm_jax.core.update.make_apply_update`).

The loop is ``lax.fori_loop`` (the while-loop form of ``lax.scan``, writing per-batch
outputs in place), split at the first batch where some user of the chunk has only
padding, so full batches skip the padding select. Users run side by side under
``vmap``. Streams are padded: the users axis to a fixed chunk size, stream length and
bank size to buckets (four per octave), so users with different numbers of queries and
memories share one compiled program. Padded queries
have weight 0 and a batch with no valid query leaves the state untouched (an Adam step
on a zero gradient would still move the parameters).
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import metrics as rmetrics
from rmm_jax.core.reranker import score_batch
from rmm_jax.core.sampling import top_m
from rmm_jax.core.update import Config, init_learner_state, make_apply_update, make_optimizer, simulated_batch


@dataclasses.dataclass(frozen=True)
class Stream:
    """One user's online stream on host memory (unpadded).

    ``cand`` indexes ``bank``; ``selected`` indexes positions within ``cand`` (replay only).
    """
    user_id: str
    bank: np.ndarray           # (N, d) float32 memory embeddings
    queries: np.ndarray        # (T, d) float32, in stream order
    cand: np.ndarray           # (T, K) int32 base-retriever candidates, best first
    cand_mask: np.ndarray      # (T, K) bool
    cand_gold: np.ndarray      # (T, K) bool
    num_gold: np.ndarray       # (T,) int32 gold memories in the whole bank
    valid: np.ndarray          # (T,) bool: counts in metrics (has gold, not abstention)
    memory_ids: tuple = ()
    query_ids: tuple = ()
    selected: np.ndarray | None = None         # (T, M) int32 positions in cand, -1 unfilled
    cited: np.ndarray | None = None            # (T, M) bool
    logged_log_prob: np.ndarray | None = None  # (T,) float32
    has_logged: np.ndarray | None = None       # (T,) bool
    present: np.ndarray | None = None          # (T,) bool: query takes part in updates


def stream_from_user(user, k: int) -> Stream:
    """Build a :class:`Stream` from a store's :class:`rmm_jax.data.store.UserData`."""
    from rmm_jax.data.retrieval import retrieve_candidates

    cand, cand_mask = retrieve_candidates(user, k)
    gold = np.asarray(user.gold, bool)
    cand_gold = np.take_along_axis(gold, cand, axis=1) & cand_mask if gold.size else np.zeros(cand.shape, bool)
    return Stream(user_id=user.user_id, bank=np.asarray(user.memory_emb, np.float32),
                  queries=np.asarray(user.query_emb, np.float32), cand=cand, cand_mask=cand_mask,
                  cand_gold=cand_gold, num_gold=gold.sum(1).astype(np.int32), valid=np.asarray(user.valid),
                  memory_ids=tuple(user.memory_ids), query_ids=tuple(user.query_ids))


def user_key(seed: int, user_id: str):
    """Per-user PRNG key from the run seed and a stable hash of the user id.

    Depends on the user, not on its position in a chunk, so chunking, sharding and
    resuming never change a user's random stream.
    """
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(user_id.encode()) & 0x7FFFFFFF)


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest size ≥ max(n, minimum) of the form j·2^e with j ∈ {4..7}: four buckets
    per octave, so padding wastes at most 25% while lengths inside a bucket share one
    compiled program."""
    n = max(int(n), minimum, 1)
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def pad_streams(streams: Sequence[Stream], cfg: Config, users_per_chunk: int, *, replay: bool = False,
                batches_multiple: int = 1) -> dict:
    """Stack streams into fixed-shape arrays with a leading users axis.

    Users are padded to ``users_per_chunk`` (dummy users have no valid query), stream
    length to B·bucket(⌈T/B⌉) (rounded to a multiple of ``batches_multiple`` batches) and
    the bank to bucket(N).
    """
    assert 1 <= len(streams) <= users_per_chunk
    d = streams[0].bank.shape[1]
    k, b = cfg.k, cfg.batch
    n_batches = bucket(max(-(-s.queries.shape[0] // b) for s in streams), 4)
    n_batches = -(-n_batches // batches_multiple) * batches_multiple
    t, n = n_batches * b, bucket(max(s.bank.shape[0] for s in streams), 32)
    u = users_per_chunk
    out = {"bank": np.zeros((u, n, d), np.float32), "q": np.zeros((u, t, d), np.float32),
           "cand": np.zeros((u, t, k), np.int32), "mask": np.zeros((u, t, k), bool),
           "gold": np.zeros((u, t, k), bool), "num_gold": np.zeros((u, t), np.int32),
           "eval": np.zeros((u, t), bool), "present": np.zeros((u, t), bool)}
    if replay:
        out.update(selected=np.full((u, t, cfg.m), -1, np.int32), cited=np.zeros((u, t, cfg.m), bool),
                   logged_log_prob=np.zeros((u, t), np.float32), has_logged=np.zeros((u, t), bool))
    for i, s in enumerate(streams):
        nq, nm = s.queries.shape[0], s.bank.shape[0]
        if s.cand.shape[1] != k:
            raise ValueError(f"k: stream of user {s.user_id} has {s.cand.shape[1]} candidates, config k={k}")
        out["bank"][i, :nm] = s.bank
        out["q"][i, :nq] = s.queries
        out["cand"][i, :nq] = s.cand
        out["mask"][i, :nq] = s.cand_mask
        out["gold"][i, :nq] = s.cand_gold
        out["num_gold"][i, :nq] = s.num_gold
        out["eval"][i, :nq] = s.valid
        out["present"][i, :nq] = True if s.present is None else s.present
        if replay:
            out["selected"][i, :nq] = s.selected
            out["cited"][i, :nq] = s.cited
            out["logged_log_prob"][i, :nq] = s.logged_log_prob
            out["has_logged"][i, :nq] = s.has_logged
    return out


def init_states(params, cfg: Config, keys) -> tuple:
    """Per-user (params, opt_state, learner_state), stacked over the users axis.

    ``params`` is one shared tree (e.g. pretrained), broadcast to every user; ``keys``
    is a (U,) array of PRNG keys, one per user.
    """
    return _init_states(params, keys, cfg)


@functools.partial(jax.jit, static_argnums=2)
def _init_states(params, keys, cfg: Config):
    # Jitted so that the outputs are fresh buffers: the run donates them, and a state
    # aliasing the caller's keys or params would delete the caller's arrays.
    opt = make_optimizer(cfg)
    one = lambda p, key: (p, opt.init(p), init_learner_state(key, cfg))
    return jax.vmap(one, in_axes=(None, 0))(params, keys)


def _tree_where_users(pred, new, old):
    """Per user (leading axis): ``new`` where ``pred`` else ``old``."""
    return jax.tree.map(lambda a, b: jnp.where(pred.reshape(pred.shape + (1,) * (a.ndim - 1)), a, b), new, old)


def _empty_buffer(cfg: Config, data) -> dict:
    """A ring of ``cfg.buffer`` past batches (newest first), initially all invalid."""
    r, b, k, d = cfg.buffer, cfg.batch, cfg.k, data["q"].shape[-1]
    return {"q": jnp.zeros((r, b, d), data["q"].dtype), "cand": jnp.zeros((r, b, k), jnp.int32),
            "mask": jnp.zeros((r, b, k), bool), "selected": jnp.full((r, b, cfg.m), -1, jnp.int32),
            "cited": jnp.zeros((r, b, cfg.m), bool), "logged_log_prob": jnp.zeros((r, b), jnp.float32),
            "valid": jnp.zeros((r, b), bool)}


def _with_buffer(full: dict, buf: dict, bank, params) -> dict:
    """The current batch followed by the buffered ones, as one (R+1)·B batch.

    Buffered selections were drawn by earlier policies: their updates are importance
    weighted with the logged behaviour log-prob (clipped ratio, see
    :func:`rmm_jax.core.update.importance_weights`).
    """
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), buf)
    m = bank[flat["cand"]]
    old = {"q": flat["q"], "m": m, "mask": flat["mask"], "valid": flat["valid"], "selected": flat["selected"],
           "cited": flat["cited"], "gumbel": jnp.zeros(flat["mask"].shape, full["gumbel"].dtype),
           "scores": score_batch(params, flat["q"], m, flat["mask"]),
           "logged_log_prob": flat["logged_log_prob"], "has_logged": flat["valid"]}
    return jax.tree.map(lambda a, b_: jnp.concatenate([a, b_]), full, old)


def make_run(cfg: Config, cite_fn: Callable | None = None, *, segment_batches: int | None = None):
    """Build ``run(states, data, start) -> (states, outputs)``, jitted over a users chunk.

    ``PureJaxRL``-style: one function jit-compiles the whole loop. ``cite_fn`` given:
    simulate (act + oracle citations); ``cite_fn=None``: replay logged selections and
    citations from ``data``. ``segment_batches``: run that many batches starting at batch
    ``start`` (a traced int, so every segment reuses one compiled program; used for
    periodic checkpoints); None runs the whole padded stream.

    ``outputs`` (leading users axis) hold per-query ``recall``, ``ndcg`` (prequential,
    at M), ``eval``, and for simulate ``selected`` (positions in ``cand``), ``cited``,
    ``log_prob``; and per-batch ``reward``, ``cite_rate``, ``loss``.
    """
    apply = make_apply_update(cfg)
    replay = cite_fn is None
    b = cfg.batch

    def user_step(state, buf, x, bank):
        """One batch of one user: evaluate, act, cite, update (no padding logic)."""
        params, opt_state, ls = state
        m = bank[x["cand"]]                                              # (B, K, d)
        scores = score_batch(params, x["q"], m, x["mask"])
        top = jax.vmap(lambda s, mk: top_m(s, cfg.m, mk))(scores, x["mask"])
        rel = jnp.take_along_axis(x["gold"], jnp.maximum(top, 0), axis=1) & (top >= 0)
        out = {"recall": rmetrics.recall_at_k(rel, x["num_gold"], cfg.m),
               "ndcg": rmetrics.ndcg_at_k(rel, x["num_gold"], cfg.m), "eval": x["eval"]}
        batch = {"q": x["q"], "m": m, "mask": x["mask"], "valid": x["present"], "gold": x["gold"]}
        if replay:
            full = {**batch, "selected": x["selected"], "cited": x["cited"], "scores": scores,
                    "gumbel": jnp.zeros_like(scores), "logged_log_prob": x["logged_log_prob"],
                    "has_logged": x["has_logged"]}
        else:
            key = jax.random.fold_in(jax.random.wrap_key_data(ls["key"]), x["index"])
            full = simulated_batch(cfg, cite_fn, scores, batch, key)
            out.update(selected=full["selected"], cited=full["cited"], log_prob=full["logged_log_prob"])
        full.pop("gold", None)
        if cfg.buffer:
            entry = {"q": x["q"], "cand": x["cand"], "mask": x["mask"], "selected": full["selected"],
                     "cited": full["cited"], "logged_log_prob": full["logged_log_prob"], "valid": x["present"]}
            new = apply(params, opt_state, ls, _with_buffer(full, buf, bank, params))
            buf = jax.tree.map(lambda b_, e: jnp.concatenate([e[None], b_[:-1]]), buf, entry)
        else:
            new = apply(params, opt_state, ls, full)
        met = new[3]
        out.update(reward=met["reward"], cite_rate=met["cite_rate"], loss=met["loss"], updated=jnp.any(x["present"]))
        return new[:3], buf, out

    def run(states, data, start):
        bank = data["bank"]                                              # (U, N, d)
        n_total = data["q"].shape[1] // b
        seg = n_total if segment_batches is None else segment_batches

        def batched(x):  # (U, T, ...) -> (n_batches, U, B, ...), scan axis first
            x = jnp.moveaxis(x.reshape((x.shape[0], n_total, b) + x.shape[2:]), 1, 0)
            return jax.lax.dynamic_slice_in_dim(x, start, seg, axis=0) if segment_batches else x

        xs = {name: batched(v) for name, v in data.items() if name != "bank"}
        n_users = bank.shape[0]
        xs["index"] = jnp.broadcast_to((start + jnp.arange(seg))[:, None], (seg, n_users))
        step = jax.vmap(user_step)
        bufs = jax.vmap(lambda _: _empty_buffer(cfg, data))(jnp.arange(n_users))
        at = lambda i: jax.tree.map(lambda v: v[i], xs)
        out_shapes = jax.eval_shape(step, states, bufs, at(0), bank)[2]
        outs = jax.tree.map(lambda o: jnp.zeros((seg,) + o.shape, o.dtype), out_shapes)

        def body(i, carry, masked: bool):
            state, buf, outs = carry
            x = at(i)
            new_state, buf, out = step(state, buf, x, bank)
            if masked:
                # A user with no valid query in this batch (padding at the end of a
                # shorter stream) keeps its state: an Adam step on a zero gradient would
                # still move it. The select costs a full pass over the state, so only
                # the padded tail of the chunk pays for it.
                new_state = _tree_where_users(jnp.any(x["present"], axis=-1), new_state, state)
            outs = jax.tree.map(lambda o, v: o.at[i].set(v), outs, out)
            return new_state, buf, outs

        # Batches where every user of the chunk has a real query run without the select.
        full = jnp.all(jnp.any(xs["present"], axis=-1), axis=-1)              # (seg,)
        n_full = jnp.where(jnp.all(full), seg, jnp.argmin(full))
        carry = jax.lax.fori_loop(0, n_full, functools.partial(body, masked=False), (states, bufs, outs))
        states, _, outs = jax.lax.fori_loop(n_full, seg, functools.partial(body, masked=True), carry)
        return states, jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), outs)

    return jax.jit(run, donate_argnums=(0,))


@dataclasses.dataclass
class RunResult:
    """Per-user final states (host numpy, users axis first) and prequential outputs."""
    user_ids: list
    states: tuple                      # (params, opt_state, learner_state), stacked
    per_query: dict                    # name -> list of (T_u, ...) arrays, one per user
    per_batch: dict                    # name -> list of (n_batches_u,) arrays


@dataclasses.dataclass
class ChunkProgress:
    """A users chunk part-way through its stream (for resuming): ``segments_done``
    segments have run; ``states`` are the stacked host states after them (padded users
    axis) and ``outputs`` the raw outputs of those segments (batches on axis 1)."""
    segments_done: int
    states: tuple
    outputs: dict


def segment_plan(n_batches: int, segment_batches: int | None) -> tuple[int, int]:
    """``(batches per segment, segments)`` for a padded stream of ``n_batches`` batches.

    Segments hold at most ``segment_batches`` batches and are equal, so the stream is
    padded by fewer than one batch per segment (None/0: one segment of the whole stream).
    """
    if not segment_batches or segment_batches >= n_batches:
        return n_batches, 1
    n_seg = -(-n_batches // segment_batches)
    return -(-n_batches // n_seg), n_seg


def stream_batches(streams: Sequence[Stream], cfg: Config) -> int:
    """Padded number of batches of a chunk of streams (see :func:`pad_streams`)."""
    return bucket(max(-(-s.queries.shape[0] // cfg.batch) for s in streams), 4)


def _fetch(tree):
    """``device_get`` that waits in short sleeps, so that Python signal handlers (e.g. a
    second Ctrl-C) run while a long jitted call is in flight."""
    import time

    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "is_ready")]
    while not all(x.is_ready() for x in leaves):
        time.sleep(0.002)
    return jax.device_get(tree)


def run_streams(streams: Sequence[Stream], params, cfg: Config, *, seed: int = 0, cite_fn=None,
                users_per_chunk: int = 8, initial_states: Callable | None = None, mesh=None,
                progress: Callable[[int], None] | None = None, run_fn=None,
                segment_batches: int | None = None, segment_runs: Callable | None = None,
                resume: ChunkProgress | None = None,
                on_segment: Callable[[ChunkProgress], None] | None = None) -> Iterable[tuple]:
    """Run the online loop over many users, chunk by chunk; yields per-chunk results.

    Yields ``(chunk_streams, final_states, outputs)`` with host (numpy) arrays, users
    axis first (padding users removed, outputs cut to each user's stream length by the
    caller via :func:`unpad_outputs`). ``initial_states(chunk_streams) -> states`` can
    supply per-user starting states (e.g. resumed policies); by default every user
    starts from ``params`` with a fresh optimiser and ``user_key(seed, user_id)``.
    ``mesh``: a :class:`jax.sharding.Mesh` with a ``users`` axis; the chunk's users
    axis is sharded over it.

    ``segment_batches`` (periodic checkpoints): each chunk runs as equal segments of at
    most that many batches (:func:`segment_plan`), one compiled call each, with the
    states brought to the host in between; ``on_segment(ChunkProgress)`` is called after
    every segment but the last. ``resume`` continues the FIRST chunk from such a
    progress. An interrupted-and-resumed run makes exactly the same sequence of calls
    on the same inputs as an uninterrupted one, so its results are bit-identical.
    ``segment_runs(n) -> run`` supplies (cached) programs for n-batch segments.
    """
    replay = cite_fn is None
    if segment_batches:
        if segment_runs is None:
            segment_runs = segment_runner(cfg, cite_fn)
    else:
        run = run_fn or make_run(cfg, cite_fn)
    for start in range(0, len(streams), users_per_chunk):
        chunk = list(streams[start:start + users_per_chunk])
        seg, n_seg = segment_plan(stream_batches(chunk, cfg), segment_batches)
        data = pad_streams(chunk, cfg, users_per_chunk, replay=replay, batches_multiple=seg)
        if segment_batches:
            run = segment_runs(seg)
        parts, first = [], 0
        if resume is not None and start == 0 and resume.segments_done > 0:
            states, parts, first = resume.states, [resume.outputs], resume.segments_done
        elif initial_states is not None:
            states = initial_states(chunk, users_per_chunk)
        else:
            ids = [s.user_id for s in chunk] + [f"<pad{i}>" for i in range(users_per_chunk - len(chunk))]
            keys = jnp.stack([user_key(seed, u) for u in ids])
            states = init_states(params, cfg, keys)
        if mesh is not None:
            from rmm_jax.online.sharding import shard_users
            data = shard_users(data, mesh)
        for s in range(first, n_seg):
            if mesh is not None:
                states = shard_users(states, mesh)
            states, out = _fetch(run(states, data, s * seg))
            parts.append(out)
            if on_segment is not None and s + 1 < n_seg:
                on_segment(ChunkProgress(s + 1, states, _concat(parts)))
        outputs = _concat(parts)
        n = len(chunk)
        states = jax.tree.map(lambda x: x[:n], states)
        outputs = jax.tree.map(lambda x: x[:n], outputs)
        if progress is not None:
            progress(n)
        yield chunk, states, outputs


def _concat(parts: list) -> dict:
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *parts)


def segment_runner(cfg: Config, cite_fn=None) -> Callable[[int], Callable]:
    """``get(n) -> make_run(cfg, cite_fn, segment_batches=n)``, built once per ``n``."""
    cache: dict[int, Callable] = {}

    def get(n: int):
        if n not in cache:
            cache[n] = make_run(cfg, cite_fn, segment_batches=n)
        return cache[n]

    return get


def flatten_queries(outputs: dict, b: int) -> dict:
    """(U, n_batches, B, ...) per-query outputs → (U, n_batches·B, ...)."""
    per_query = ("recall", "ndcg", "eval", "selected", "cited", "log_prob")
    return {k: v.reshape((v.shape[0], -1) + v.shape[3:]) for k, v in outputs.items() if k in per_query}


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (shorter window at the start)."""
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)
