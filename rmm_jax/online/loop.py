"""The compiled online loop: every user's whole citation stream inside one jitted device loop.

For each batch of B queries, in stream order (RMM's Retrospective Reflection, Tan et al.,
ACL 2025, §4.2):

  1. score the K base-retriever candidates with the user's current reranker;
  2. **prequential evaluation**: the deterministic top-M (no noise) is scored against
     gold (Recall@M, NDCG@M) *before* any update that uses these queries;
  3. act: Gumbel-top-M selection (simulate) or the logged selection (replay);
  4. citations: the citation simulator, or the logged ``cited`` ids; the gold-free
     measures (:func:`cited_counts`) score the policy's top-M of step 2, and the
     retriever's, against these citations, still before the update;
  5. one REINFORCE update of every user of the chunk (:func:`rmm_jax.core.update.make_update`,
     the same function in every scope).

:func:`make_run` binds a :class:`~rmm_jax.core.config.Layout`, an
:class:`~rmm_jax.core.config.Estimator` and an optimiser once and returns a
:class:`Program` (PureJaxRL's ``make_train``): ``init`` starts a chunk's states, ``pad``
stacks its streams into fixed shapes, ``run`` is the jitted loop. The host driver
(:mod:`rmm_jax.online.driver`) takes the program and nothing else.

**Loop order and speed.** The batch loop is ``lax.fori_loop`` over the chunk's batches,
users side by side under ``vmap``; a batch where some user has only padding runs in a
second loop that keeps such users' states (an Adam step on a zero gradient would still
move them), and batches that are padding for every user are not run at all. In scope
``user`` the users are independent, so the chunk runs in cache-sized groups (on CPU): each
group of G users runs its whole stream before the next starts, so G users' params and
optimiser moments stay in the last-level cache instead of streaming the chunk's states
through main memory at every batch (:func:`users_per_group`). In scopes ``shared`` and
``hybrid`` every user of the chunk must see the shared part after the previous batch, so
the chunk is the group. Streams are padded (:func:`rmm_jax.online.streams.pad_streams`):
the users axis to a fixed chunk size, stream length and bank size to buckets (four per
octave), so users with different numbers of queries and memories share one compiled
program.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from rmm_jax.core import metrics as rmetrics
from rmm_jax.core import optim
from rmm_jax.core.config import Estimator, Layout
from rmm_jax.core.reranker import score_batch
from rmm_jax.core.sampling import top_m
from rmm_jax.core.types import Batch, QueryBatch, SharedState, UserState
from rmm_jax.core.update import CiteFn, init_shared, init_user, make_update, simulated_batch
from rmm_jax.online.streams import ChunkData, pad_streams, stream_batches

PER_QUERY = ("recall", "ndcg", "eval", "selected", "cited", "log_prob",   # outputs with a (B,) axis per batch
             "hit", "hit_base", "n_cited", "n_shown", "shown_recall")
GROUP_CACHE_BYTES = 24 << 20   # what a group of users' states may take: most of a 32 MiB last-level cache


class LoopState(NamedTuple):
    """What the compiled loop carries for a chunk: every user's own state (users axis first)
    and the part they share (:class:`SharedState`; empty trees in scope ``user``)."""
    users: UserState
    shared: SharedState


class Program(NamedTuple):
    """An online program, built once by :func:`make_run`; the driver needs nothing else.

    * ``init(params, keys, shared=None, users=None, known=None) -> LoopState``: a chunk's
      starting states. Every user starts from ``params`` (its own part, see
      :meth:`rmm_jax.core.scope.Scope.split`) with key ``keys[u]``, except where ``known[u]``:
      that user continues from row u of ``users`` (a stacked :class:`UserState`). The shared
      part continues from ``shared``, or starts from ``params``.
    * ``init_shared(params) -> SharedState``: the shared part of a starting policy.
    * ``pad(streams, users_per_chunk, batches_multiple=1) -> ChunkData``: fixed shapes.
    * ``batches(streams) -> int``: padded batches of a chunk of streams.
    * ``run(state, data, start=0, stop=None, group=None) -> (state, outputs)``, jitted
      (``state`` donated): batches ``start`` to ``stop`` (None: to the end). The range is an
      argument, not a shape, so every segment of a chunk runs the same compiled program
      and a segmentation cannot change the results (XLA may round two programs of the
      same function differently). ``stop=None`` traces a program of its own (the end is
      then a constant): the driver always passes both ends. ``group`` users per cache group (None:
      :func:`users_per_group` on CPU, none on other backends; 0: no grouping). ``outputs``
      (users axis first, then all the chunk's batches; zeros outside the range) hold
      per-query ``recall``, ``ndcg`` (prequential, at M), ``eval``, the gold-free counts
      ``hit``, ``hit_base``, ``n_cited``, ``n_shown`` (:func:`cited_counts`), and when
      simulating ``selected`` (positions in ``cand``), ``cited``, ``log_prob``; and per-batch
      ``reward``, ``cite_rate``, ``loss``, ``updated``.
    """
    layout: Layout
    estimator: Estimator
    optimizer: Any
    simulates: bool
    init: Callable
    init_shared: Callable
    pad: Callable
    batches: Callable
    run: Callable


def segment_plan(n_batches: int, segment_batches: int | None) -> tuple[int, int]:
    """``(batches per segment, segments)`` for a padded stream of ``n_batches`` batches.

    Segments hold at most ``segment_batches`` batches and are equal but for a shorter last
    one (None/0: one segment of the whole stream).

    >>> from rmm_jax.online.loop import segment_plan
    >>> segment_plan(10, 4), segment_plan(10, 16)    # segments of 4, 4 and 2 batches; one of 10
    ((4, 3), (10, 1))
    """
    if not segment_batches or segment_batches >= n_batches:
        return n_batches, 1
    n_seg = -(-n_batches // segment_batches)
    return -(-n_batches // n_seg), n_seg


def users_per_group(n_users: int, bytes_per_user: int, cache_bytes: int = GROUP_CACHE_BYTES) -> int:
    """The largest divisor G of ``n_users`` whose G users' states (and a gradient's worth
    more) fit in ``cache_bytes``; at least 1.

    >>> from rmm_jax.online.loop import users_per_group
    >>> users_per_group(100, 4_718_592)     # d = 384, Adam: params, μ, ν and a gradient, 4.7 MB a user
    5
    """
    fit = max(1, cache_bytes // max(1, bytes_per_user))
    return max(g for g in range(1, min(fit, n_users) + 1) if n_users % g == 0)


def shown_recall(selected, gold, num_gold):
    """(B,) Recall of what each call showed the generator: the share of the query's gold
    among its drawn (simulate) or logged (replay) memories. The policy's own top-M is
    ``recall``; an exploring draw shows other memories, and the generator reads these.

    Args: ``selected`` (B, M) positions in the candidates, −1 unfilled; ``gold`` (B, K) bool;
    ``num_gold`` (B,) gold memories in the whole bank (0: the recall is 0).

    Examples:
      >>> import jax.numpy as jnp
      >>> from rmm_jax.online.loop import shown_recall
      >>> sel = jnp.array([[2, 0, -1], [1, 3, 0]])
      >>> gold = jnp.array([[True, False, True, False], [False, False, False, True]])
      >>> [round(r, 6) for r in shown_recall(sel, gold, jnp.array([3, 1])).tolist()]   # 2 of 3 gold; 1 of 1
      [0.666667, 1.0]
    """
    return rmetrics.recall_at_k(rmetrics.gold_at(selected, gold), num_gold, selected.shape[1])


def cited_counts(top, selected, cited, present, m: int) -> dict:
    """The gold-free measures of one batch, as counts per query (docs/lifecycle.md,
    "Measures without gold"): ``n_shown`` memories shown, ``n_cited`` of them cited,
    ``hit`` cited memories that the policy's deterministic top-M ``top`` holds and
    ``hit_base`` cited memories among the retriever's first M candidates. The summaries
    turn them into prequential cited-recall@M (hit / n_cited over calls with a citation)
    and the cite rate (n_cited / n_shown).

    Args: ``top`` (B, M) positions in the candidates, −1 unfilled; ``selected`` (B, M')
    positions shown, −1 unfilled; ``cited`` (B, M') bool per shown slot; ``present`` (B,).

    >>> import jax.numpy as jnp
    >>> from rmm_jax.online.loop import cited_counts
    >>> c = cited_counts(jnp.array([[3, 0]]), jnp.array([[0, 2, 3]]), jnp.array([[True, False, True]]),
    ...                  jnp.array([True]), m=2)
    >>> {k: int(v[0]) for k, v in sorted(c.items())}    # cited: positions 0 and 3; top-2 {3, 0}; retriever {0, 1}
    {'hit': 2, 'hit_base': 1, 'n_cited': 2, 'n_shown': 3}
    """
    shown = (selected >= 0) & present[:, None]
    pos = jnp.where(cited & shown, selected, -1)                         # cited positions, −1 elsewhere
    in_top = jnp.any((pos[:, :, None] == top[:, None, :]) & (top[:, None, :] >= 0), axis=-1)
    return {"hit": jnp.sum(in_top & (pos >= 0), axis=-1, dtype=jnp.int32),
            "hit_base": jnp.sum((pos >= 0) & (pos < m), axis=-1, dtype=jnp.int32),
            "n_cited": jnp.sum(pos >= 0, axis=-1, dtype=jnp.int32), "n_shown": jnp.sum(shown, axis=-1, dtype=jnp.int32)}


def _tree_where_users(pred, new, old):
    """Per user (leading axis): ``new`` where ``pred`` else ``old``."""
    return jax.tree.map(lambda a, b: jnp.where(pred.reshape(pred.shape + (1,) * (a.ndim - 1)), a, b), new, old)


def make_run(layout: Layout, estimator: Estimator, optimizer=None, cite_fn: CiteFn | None = None) -> Program:
    """Build the :class:`Program` of ``layout``, ``estimator`` and ``optimizer`` (any optax
    ``GradientTransformation``; default :func:`rmm_jax.core.optim.adam` at 3e-4).

    ``cite_fn`` given: simulate (act + simulated citations, e.g.
    :func:`rmm_jax.data.citations.oracle` with its rates bound); ``cite_fn=None``: replay the
    logged selections and citations the chunks carry. It compiles once per padded shape.

    Examples:
      >>> import jax, rmm_jax as rj
      >>> from rmm_jax.data.citations import oracle
      >>> program = rj.make_run(*rj.preset("default", k=6, m=2), cite_fn=oracle())
      >>> program.layout.m, program.optimizer.name, program.simulates
      (2, 'adam', True)
    """
    # a name (cite_fn="oracle") was taken, and the first chunk failed in the trace with
    # "Expected a callable value, got oracle"
    if cite_fn is not None and not callable(cite_fn):
        raise ValueError(f"cite_fn: expected a citation function, e.g. rmm_jax.data.citations.oracle(), or None "
                         f"to replay, got {type(cite_fn).__name__} {cite_fn!r}"[:160])
    optimizer = optim.adam(3e-4) if optimizer is None else optimizer
    apply = make_update(layout, estimator, optimizer)
    replay = cite_fn is None
    scope, b, m_shown = layout.scope, layout.batch, layout.m

    def observe(params, key_data, x: ChunkData, index, bank):
        """One batch of one user before the update: prequential metrics, then the batch
        the update takes (the logged one, or act + cite with fold_in(key, ``index``))."""
        m = bank[x.cand]                                                 # (B, K, d)
        scores = score_batch(params, x.q, m, x.mask)
        top = jax.vmap(lambda s, mk: top_m(s, m_shown, mk))(scores, x.mask)
        rel = rmetrics.gold_at(top, x.gold)
        out = {"recall": rmetrics.recall_at_k(rel, x.num_gold, m_shown),
               "ndcg": rmetrics.ndcg_at_k(rel, x.num_gold, m_shown), "eval": x.eval}
        if replay:
            full = Batch(q=x.q, m=m, mask=x.mask, valid=x.present, selected=x.selected, cited=x.cited,
                         gumbel=jnp.zeros_like(scores), logged_log_prob=x.logged_log_prob,
                         has_logged=x.has_logged, scores=scores)
        else:
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), index)
            queries = QueryBatch(q=x.q, m=m, mask=x.mask, valid=x.present,
                                 gold=x.gold if x.cite_gold is None else x.cite_gold)
            full = simulated_batch(estimator, m_shown, cite_fn, scores, queries, key)
            out.update(selected=full.selected, cited=full.cited, log_prob=full.logged_log_prob)
        out.update(cited_counts(top, full.selected, full.cited, x.present, m_shown))
        out["shown_recall"] = shown_recall(full.selected, x.gold, x.num_gold)
        return full, out

    def step(state: LoopState, x: ChunkData, bank):
        """One batch of every user of a group: observe under vmap, then one update."""
        shared, users = state.shared, state.users
        # A user's batch samples with fold_in(key, its update count): for a fresh stream that is
        # the batch index, and a user continued from a store goes on where it stopped.
        full, out = jax.vmap(lambda lp, ls, xu, bk: observe(scope.merge(shared.params, lp), ls.key, xu, ls.step, bk))(
            users.params, users.learner_state, x, bank)
        shared, users, met = apply(shared, users, full)
        out.update(reward=met["reward"], cite_rate=met["cite_rate"], loss=met["loss"],
                   updated=jnp.any(x.present, axis=-1))
        return LoopState(users, shared), out

    # Traced once: the output shapes and both batch loops below call it with the same shapes
    # (a command's second run still traces what the compilation cache then loads).
    step = jax.jit(step)

    def run_group(state: LoopState, data: ChunkData, start, stop):
        bank = data.bank                                                 # (U, N, d)
        n_total = data.q.shape[1] // b
        # Batch i of every user is read where it lies, (U, n_total, B, ...) indexed at i, and the
        # outputs fill a buffer of the whole chunk's batches: no shape depends on the batch range,
        # so every segment of a chunk, of whatever length, runs the same compiled program.
        xs = jax.tree.map(lambda x: x.reshape((x.shape[0], n_total, b) + x.shape[2:]), data._replace(bank=None))
        at = lambda i: jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, i, axis=1, keepdims=False), xs)
        out_shapes = jax.eval_shape(step, state, at(0), bank)[1]
        outs = jax.tree.map(lambda o: jnp.zeros((n_total,) + o.shape, o.dtype), out_shapes)

        def body(i, carry, masked: bool):
            state, outs = carry
            x = at(i)
            new_state, out = step(state, x, bank)
            if masked:
                # A user with no valid query in this batch (padding at the end of a shorter
                # stream) keeps its state. The select costs a pass over the state, so only
                # the padded tail pays for it; the update already leaves the shared part
                # alone when no user has a query.
                new_state = new_state._replace(
                    users=_tree_where_users(jnp.any(x.present, axis=-1), new_state.users, state.users))
            return new_state, jax.tree.map(lambda o, v: o.at[i].set(v), outs, out)

        # Batches where every user has a real query run without the select; batches where
        # none has one (the padding of the length bucket) are not run. Both are decided over
        # the whole chunk, so a batch runs the same way in every segmentation of it.
        present = jnp.any(xs.present, axis=-1).T                            # (n_total, U)
        full, live = jnp.all(present, axis=-1), jnp.any(present, axis=-1)   # (n_total,)
        n_full = jnp.where(jnp.all(full), n_total, jnp.argmin(full))
        n_live = jnp.where(jnp.any(live), n_total - jnp.argmax(live[::-1]), 0)
        mid = jnp.clip(n_full, start, stop)
        carry = jax.lax.fori_loop(start, mid, functools.partial(body, masked=False), (state, outs))
        state, outs = jax.lax.fori_loop(mid, jnp.clip(n_live, mid, stop), functools.partial(body, masked=True),
                                        carry)
        return state, jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), outs)

    def run(state: LoopState, data: ChunkData, start=0, stop=None, group: int | None = None):
        n_users = data.q.shape[0]
        if stop is None:
            stop = data.q.shape[1] // b
        if group is None:
            per_user = sum(x.nbytes for x in jax.tree.leaves((state.users.params, state.users.params,
                                                               state.users.opt_state))) // n_users
            group = users_per_group(n_users, per_user) if jax.default_backend() == "cpu" else 0
        if not scope.local_is_full or not group or group >= n_users or n_users % group:
            return run_group(state, data, start, stop)
        split = lambda x: x.reshape((n_users // group, group) + x.shape[1:])
        merge = lambda x: x.reshape((n_users,) + x.shape[2:])

        def one_group(args):
            users, chunk = args
            new, outs = run_group(LoopState(users, state.shared), chunk, start, stop)
            return new.users, outs

        users, outs = jax.lax.map(one_group, (jax.tree.map(split, state.users), jax.tree.map(split, data)))
        return LoopState(jax.tree.map(merge, users), state.shared), jax.tree.map(merge, outs)

    @jax.jit
    def init(params, keys, shared=None, users=None, known=None) -> LoopState:
        # Jitted so that the outputs are fresh buffers: the run donates them, and a state
        # aliasing the caller's keys or params would delete the caller's arrays.
        fresh = jax.vmap(lambda key: init_user(params, key, layout, estimator, optimizer))(keys)
        if users is not None:
            fresh = _tree_where_users(known, users, fresh)
        shared = init_shared(params, layout, optimizer) if shared is None else jax.tree.map(jnp.copy, shared)
        return LoopState(fresh, shared)

    return Program(
        layout=layout, estimator=estimator, optimizer=optimizer, simulates=not replay, init=init,
        init_shared=jax.jit(lambda params: init_shared(params, layout, optimizer)),
        pad=lambda streams, users_per_chunk, batches_multiple=1: pad_streams(
            streams, layout, users_per_chunk, batches_multiple=batches_multiple),
        batches=lambda streams: stream_batches(streams, layout),
        run=jax.jit(run, donate_argnums=(0,), static_argnames=("group",)))


def per_query(outputs: dict) -> dict:
    """(U, n_batches, B, ...) per-query outputs → (U, n_batches·B, ...); per-batch ones dropped."""
    return {k: v.reshape((v.shape[0], -1) + v.shape[3:]) for k, v in outputs.items() if k in PER_QUERY}
