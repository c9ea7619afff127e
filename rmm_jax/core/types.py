"""Typed state, as optax types its states (``ScaleByAdamState``): the fields are named,
``jax.tree`` maps over them, and ``state.learner_state.step`` replaces ``state[2]["step"]``.

Every type is a ``NamedTuple`` of arrays, so it is a pytree that ``jit``, ``vmap`` (over
users) and ``lax`` loops carry as is. Shapes are for one user; the online loop stacks a
leading users axis on every leaf.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax

Array = jax.Array
Params = Any          # the reranker's parameter tree (a plain dict, see reranker.py)
OptState = Any        # optax's state for the chosen optimiser


class LearnerState(NamedTuple):
    """Per-user learner state besides params and optimiser state."""
    baseline: Array   # () float32: the running-mean baseline (unused by other baselines)
    step: Array       # () int32: updates applied
    key: Array        # (2,) uint32: PRNG key data; batch i samples with fold_in(key, i)


class UserState(NamedTuple):
    """Everything one user's online learning carries from batch to batch."""
    params: Params
    opt_state: OptState
    learner_state: LearnerState


class SharedState(NamedTuple):
    """The part of the policy every user of a run shares (scopes ``shared``/``hybrid``):
    its params and optimiser state. Empty trees in scope ``user``."""
    params: Params
    opt_state: OptState


class QueryBatch(NamedTuple):
    """B queries as the policy sees them, plus what a citation simulator may read."""
    q: Array          # (B, d) query embeddings
    m: Array          # (B, K, d) candidate memory embeddings, retriever order
    mask: Array       # (B, K) bool: real candidates
    valid: Array      # (B,) bool: real queries (False: padding, weight 0)
    gold: Array       # (B, K) bool: gold memories (simulated citations only)


class Batch(NamedTuple):
    """B queries with the shown selection and its citations: one REINFORCE update's input."""
    q: Array                 # (B, d)
    m: Array                 # (B, K, d)
    mask: Array              # (B, K) bool
    valid: Array             # (B,) bool
    selected: Array          # (B, M) int32 positions in the candidates, draw order; −1 unfilled
    cited: Array             # (B, M) bool
    gumbel: Array            # (B, K) sampled noise on the score scale (mode ``rmm``); zeros when not logged
    logged_log_prob: Array   # (B,) behaviour log P(selected), where logged
    has_logged: Array        # (B,) bool: ``logged_log_prob`` is known
    scores: Array | None = None  # (B, K) current scores if the caller has them (saves a pass)
