"""The compiled online loop: every user's whole citation stream inside one jitted device loop.

For each batch of B queries, in stream order (RMM's Retrospective Reflection, Tan et
al., ACL 2025, §4.2):

  1. score the K base-retriever candidates with the user's current reranker;
  2. **prequential evaluation**: the deterministic top-M (no noise) is scored against
     gold (Recall@M, NDCG@M) *before* any update that uses these queries;
  3. act: Gumbel-top-M selection (simulate) or the logged selection (replay);
  4. citations: the citation simulator, or the logged ``cited`` ids;
  5. one REINFORCE update (:func:`rmm_jax.core.update.make_apply_update`).

The loop is ``lax.fori_loop`` (the while-loop form of ``lax.scan``, writing per-batch
outputs in place), split at the first batch where some user of the chunk has only
padding, so full batches skip the padding select. Users run side by side under
``vmap``. Streams are padded (:func:`rmm_jax.online.streams.pad_streams`): the users
axis to a fixed chunk size, stream length and bank size to buckets (four per octave),
so users with different numbers of queries and memories share one compiled program.
Padded queries have weight 0 and a batch with no valid query leaves the state untouched
(an Adam step on a zero gradient would still move the parameters).

:func:`make_run` builds the program once (PureJaxRL's ``make_train``); the host driver
(:mod:`rmm_jax.online.driver`) feeds it chunks and segments.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rmm_jax.core import metrics as rmetrics
from rmm_jax.core.reranker import merge_params, score_batch
from rmm_jax.core.sampling import top_m
from rmm_jax.core.scoped import init_local_state, init_shared_state, make_apply_scoped_update
from rmm_jax.core.types import Batch, QueryBatch, SharedState, UserState
from rmm_jax.core.update import CiteFn, Config, make_apply_update, make_optimizer, simulated_batch
from rmm_jax.online.streams import ChunkData

PER_QUERY = ("recall", "ndcg", "eval", "selected", "cited", "log_prob")  # outputs with a (B,) axis per batch


class ReplayBuffer(NamedTuple):
    """A ring of ``cfg.buffer`` past batches (newest first) of one user."""
    q: jax.Array                # (R, B, d)
    cand: jax.Array             # (R, B, K) int32
    mask: jax.Array             # (R, B, K) bool
    selected: jax.Array         # (R, B, M) int32
    cited: jax.Array            # (R, B, M) bool
    logged_log_prob: jax.Array  # (R, B)
    valid: jax.Array            # (R, B) bool


class LoopState(NamedTuple):
    """What the compiled loop carries for a chunk: every user's own state (users axis first)
    and the part they share (:class:`SharedState`; empty trees in scope ``user``)."""
    users: UserState
    shared: SharedState


def init_states(params, cfg: Config, keys, shared: SharedState | None = None) -> LoopState:
    """A chunk's starting :class:`LoopState`.

    ``params`` is one starting reranker (e.g. pretrained): in scope ``user`` every user gets
    a copy, in ``shared``/``hybrid`` it is the shared part and users get empty or zero
    low-rank parts (:func:`rmm_jax.core.scoped.split_params`). ``keys`` is a (U,) array
    of PRNG keys, one per user. ``shared`` continues a shared state carried from an
    earlier chunk instead of starting one from ``params``.
    """
    return _init_states(params, keys, shared, cfg)


@functools.partial(jax.jit, static_argnums=1)
def init_shared(params, cfg: Config) -> SharedState:
    """The shared part of a starting policy ``params`` with a fresh optimiser state."""
    return init_shared_state(params, cfg)


@functools.partial(jax.jit, static_argnums=3)
def _init_states(params, keys, shared, cfg: Config) -> LoopState:
    # Jitted so that the outputs are fresh buffers: the run donates them, and a state
    # aliasing the caller's keys or params would delete the caller's arrays.
    opt = make_optimizer(cfg)
    users = jax.vmap(lambda key: init_local_state(params, key, cfg, opt))(keys)
    if shared is None:
        shared = init_shared_state(params, cfg, opt)
    else:
        shared = jax.tree.map(jnp.copy, shared)
    return LoopState(users, shared)


def segment_plan(n_batches: int, segment_batches: int | None) -> tuple[int, int]:
    """``(batches per segment, segments)`` for a padded stream of ``n_batches`` batches.

    Segments hold at most ``segment_batches`` batches and are equal, so the stream is
    padded by fewer than one batch per segment (None/0: one segment of the whole stream).
    """
    if not segment_batches or segment_batches >= n_batches:
        return n_batches, 1
    n_seg = -(-n_batches // segment_batches)
    return -(-n_batches // n_seg), n_seg


def _tree_where_users(pred, new, old):
    """Per user (leading axis): ``new`` where ``pred`` else ``old``."""
    return jax.tree.map(lambda a, b: jnp.where(pred.reshape(pred.shape + (1,) * (a.ndim - 1)), a, b), new, old)


def _empty_buffer(cfg: Config, d: int, dtype) -> ReplayBuffer:
    r, b, k = cfg.buffer, cfg.batch, cfg.k
    return ReplayBuffer(q=jnp.zeros((r, b, d), dtype), cand=jnp.zeros((r, b, k), jnp.int32),
                        mask=jnp.zeros((r, b, k), bool), selected=jnp.full((r, b, cfg.m), -1, jnp.int32),
                        cited=jnp.zeros((r, b, cfg.m), bool), logged_log_prob=jnp.zeros((r, b), jnp.float32),
                        valid=jnp.zeros((r, b), bool))


def _with_buffer(full: Batch, buf: ReplayBuffer, bank, params) -> Batch:
    """The current batch followed by the buffered ones, as one (R+1)·B batch.

    Buffered selections were drawn by earlier policies: their updates are importance
    weighted with the logged behaviour log-prob (clipped ratio, see
    :func:`rmm_jax.core.update.importance_weights`).
    """
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), buf)
    m = bank[flat.cand]
    old = Batch(q=flat.q, m=m, mask=flat.mask, valid=flat.valid, selected=flat.selected, cited=flat.cited,
                gumbel=jnp.zeros(flat.mask.shape, full.gumbel.dtype), logged_log_prob=flat.logged_log_prob,
                has_logged=flat.valid, scores=score_batch(params, flat.q, m, flat.mask))
    return jax.tree.map(lambda a, b_: jnp.concatenate([a, b_]), full, old)


def make_run(cfg: Config, cite_fn: CiteFn | None = None):
    """Build ``run(state, data, start=0, n_batches=None) -> (state, outputs)``, jitted
    over a users chunk; build it once and run every chunk and segment through it.

    ``state`` is the chunk's :class:`LoopState` (donated; :func:`init_states`), ``data``
    its :class:`ChunkData`. ``cite_fn`` given: simulate (act + simulated citations);
    ``cite_fn=None``: replay the logged selections and citations in ``data``.
    ``n_batches`` (static): run that many batches starting at batch ``start`` (traced,
    so every segment of a chunk reuses one compiled program; used for periodic
    checkpoints); None runs the whole padded stream. It compiles once per padded shape
    and segment length.

    Scope ``user`` runs each user's update independently under ``vmap``
    (:func:`rmm_jax.core.update.make_apply_update`); ``shared`` and ``hybrid`` make one
    step of the whole chunk per batch (:func:`rmm_jax.core.scoped.make_apply_scoped_update`):
    at batch i every user of the chunk scores, acts and is cited with the policy after
    batch i−1, then the shared part takes the mean of their gradients. Users of later
    chunks see the shared state the earlier chunks left (the driver carries it).

    ``outputs`` (users axis first, then batches) hold per-query ``recall``, ``ndcg``
    (prequential, at M), ``eval``, and for simulate ``selected`` (positions in
    ``cand``), ``cited``, ``log_prob``; and per-batch ``reward``, ``cite_rate``,
    ``loss``, ``updated``.
    """
    scoped = cfg.scope != "user"
    apply = make_apply_scoped_update(cfg) if scoped else make_apply_update(cfg)
    replay = cite_fn is None
    b = cfg.batch

    def observe(params, key_data, x: ChunkData, index, bank):
        """One batch of one user before the update: prequential metrics, then the batch
        the update takes (the logged one, or act + cite)."""
        m = bank[x.cand]                                                 # (B, K, d)
        scores = score_batch(params, x.q, m, x.mask)
        top = jax.vmap(lambda s, mk: top_m(s, cfg.m, mk))(scores, x.mask)
        rel = jnp.take_along_axis(x.gold, jnp.maximum(top, 0), axis=1) & (top >= 0)
        out = {"recall": rmetrics.recall_at_k(rel, x.num_gold, cfg.m),
               "ndcg": rmetrics.ndcg_at_k(rel, x.num_gold, cfg.m), "eval": x.eval}
        if replay:
            full = Batch(q=x.q, m=m, mask=x.mask, valid=x.present, selected=x.selected, cited=x.cited,
                         gumbel=jnp.zeros_like(scores), logged_log_prob=x.logged_log_prob,
                         has_logged=x.has_logged, scores=scores)
        else:
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), index)
            queries = QueryBatch(q=x.q, m=m, mask=x.mask, valid=x.present,
                                 gold=x.gold if x.cite_gold is None else x.cite_gold)
            full = simulated_batch(cfg, cite_fn, scores, queries, key)
            out.update(selected=full.selected, cited=full.cited, log_prob=full.logged_log_prob)
        return full, out

    def user_step(state: UserState, buf: ReplayBuffer, x: ChunkData, index, bank):
        """Scope ``user``: one batch of one user: evaluate, act, cite, update."""
        full, out = observe(state.params, state.learner_state.key, x, index, bank)
        if cfg.buffer:
            entry = ReplayBuffer(q=x.q, cand=x.cand, mask=x.mask, selected=full.selected, cited=full.cited,
                                 logged_log_prob=full.logged_log_prob, valid=x.present)
            new, met = apply(state, _with_buffer(full, buf, bank, state.params))
            buf = jax.tree.map(lambda b_, e: jnp.concatenate([e[None], b_[:-1]]), buf, entry)
        else:
            new, met = apply(state, full)
        out.update(reward=met["reward"], cite_rate=met["cite_rate"], loss=met["loss"], updated=jnp.any(x.present))
        return new, buf, out

    def chunk_step(state: LoopState, buf, x: ChunkData, index, bank):
        """One batch of every user of the chunk: ``user`` vmaps :func:`user_step`;
        ``shared``/``hybrid`` observe under vmap, then make one scoped update."""
        if not scoped:
            users, buf, out = jax.vmap(user_step, in_axes=(0, 0, 0, None, 0))(state.users, buf, x, index, bank)
            return LoopState(users, state.shared), buf, out
        shared, users = state.shared, state.users
        full, out = jax.vmap(lambda lp, kd, xu, bk: observe(merge_params(shared.params, lp), kd, xu, index, bk))(
            users.params, users.learner_state.key, x, bank)
        shared, users, met = apply(shared, users, full)
        out.update(reward=met["reward"], cite_rate=met["cite_rate"], loss=met["loss"],
                   updated=jnp.any(x.present, axis=-1))
        return LoopState(users, shared), buf, out

    def run(state: LoopState, data: ChunkData, start=0, n_batches: int | None = None):
        bank = data.bank                                                 # (U, N, d)
        n_total = data.q.shape[1] // b
        seg = n_total if n_batches is None else n_batches

        def batched(x):  # (U, T, ...) -> (n_batches, U, B, ...), loop axis first
            x = jnp.moveaxis(x.reshape((x.shape[0], n_total, b) + x.shape[2:]), 1, 0)
            return x if n_batches is None else jax.lax.dynamic_slice_in_dim(x, start, seg, axis=0)

        xs = jax.tree.map(batched, data._replace(bank=None))
        n_users = bank.shape[0]
        bufs = jax.vmap(lambda _: _empty_buffer(cfg, data.q.shape[-1], data.q.dtype))(jnp.arange(n_users))
        at = lambda i: jax.tree.map(lambda v: v[i], xs)
        out_shapes = jax.eval_shape(chunk_step, state, bufs, at(0), start, bank)[2]
        outs = jax.tree.map(lambda o: jnp.zeros((seg,) + o.shape, o.dtype), out_shapes)

        def body(i, carry, masked: bool):
            state, buf, outs = carry
            x = at(i)
            new_state, buf, out = chunk_step(state, buf, x, start + i, bank)
            if masked:
                # A user with no valid query in this batch (padding at the end of a
                # shorter stream) keeps its state: an Adam step on a zero gradient would
                # still move it. The select costs a full pass over the state, so only
                # the padded tail of the chunk pays for it. (The scoped update already
                # leaves the shared part alone when no user has a query.)
                new_state = new_state._replace(
                    users=_tree_where_users(jnp.any(x.present, axis=-1), new_state.users, state.users))
            outs = jax.tree.map(lambda o, v: o.at[i].set(v), outs, out)
            return new_state, buf, outs

        # Batches where every user of the chunk has a real query run without the select.
        full = jnp.all(jnp.any(xs.present, axis=-1), axis=-1)               # (seg,)
        n_full = jnp.where(jnp.all(full), seg, jnp.argmin(full))
        carry = jax.lax.fori_loop(0, n_full, functools.partial(body, masked=False), (state, bufs, outs))
        state, _, outs = jax.lax.fori_loop(n_full, seg, functools.partial(body, masked=True), carry)
        return state, jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), outs)

    return jax.jit(run, donate_argnums=(0,), static_argnames=("n_batches",))


def per_query(outputs: dict) -> dict:
    """(U, n_batches, B, ...) per-query outputs → (U, n_batches·B, ...); per-batch ones dropped."""
    return {k: v.reshape((v.shape[0], -1) + v.shape[3:]) for k, v in outputs.items() if k in PER_QUERY}
