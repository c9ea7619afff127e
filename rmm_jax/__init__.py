"""rmm-jax: the citation-driven memory reranker of Reflective Memory Management in JAX.

The core (:mod:`rmm_jax.core`) is a handful of pure functions over embedding arrays:

* :func:`init_reranker`, :func:`score` — residual reranker (linear or MLP adapters).
* :func:`gumbel_top_m` — ordered Plackett–Luce sample of M memories.
* :func:`selection_log_prob` — exact (or the paper's surrogate) log-probability.
* :func:`reinforce_loss`, :func:`listwise_loss` — online and offline losses.
* :func:`make_apply_update`, :func:`make_update_step` — one jittable optax update on a
  typed :class:`UserState` and :class:`Batch`.
* :func:`make_apply_scoped_update` — the same for many users sharing a reranker (scopes
  ``shared`` and ``hybrid``: :class:`SharedState` plus per-user :func:`init_lowrank` factors).

Data flows one way: dataset → embedding store (:mod:`rmm_jax.data`) → streams → the
compiled loop (:func:`make_run`) driven chunk by chunk (:func:`drive`, which yields
events) → policies and logs (:mod:`rmm_jax.persist`, :mod:`rmm_jax.cli`).
"""

from rmm_jax.core.losses import advantages, citation_rewards, listwise_loss, reinforce_loss
from rmm_jax.core.reranker import init_lowrank, init_reranker, merge_params, score, score_batch, score_naive
from rmm_jax.core.sampling import gumbel_top_m, selection_log_prob, selection_log_probs, top_m
from rmm_jax.core.scoped import init_local_state, init_shared_state, make_apply_scoped_update, split_params
from rmm_jax.core.types import Batch, LearnerState, QueryBatch, SharedState, UserState
from rmm_jax.core.update import (
                                 PRESETS,
                                 SCOPES,
                                 Config,
                                 init_learner_state,
                                 init_user_state,
                                 make_apply_update,
                                 make_optimizer,
                                 make_update_step,
)
from rmm_jax.online.driver import ChunkDone, ChunkSkipped, Resume, SegmentDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.run import run_online
from rmm_jax.version import __version__

__all__ = [
    "__version__",
    "Batch", "ChunkDone", "ChunkSkipped", "Config", "LearnerState", "PRESETS", "QueryBatch", "Resume", "SCOPES",
    "SegmentDone", "SharedState", "UserState", "advantages", "citation_rewards", "drive", "gumbel_top_m",
    "init_learner_state", "init_local_state", "init_lowrank", "init_reranker", "init_shared_state",
    "init_user_state", "listwise_loss", "make_apply_scoped_update", "make_apply_update", "make_optimizer",
    "make_run", "make_update_step", "merge_params", "reinforce_loss", "run_online", "score", "score_batch",
    "score_naive", "selection_log_prob", "selection_log_probs", "split_params", "top_m",
]
