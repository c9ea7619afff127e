"""rmm-jax: the citation-driven memory reranker of Reflective Memory Management in JAX.

The core is a handful of pure functions over embedding arrays:

* :func:`init_reranker`, :func:`score` — residual reranker (linear or MLP adapters).
* :func:`gumbel_top_m` — ordered Plackett–Luce sample of M memories.
* :func:`selection_log_prob` — exact (or the paper's surrogate) log-probability.
* :func:`reinforce_loss`, :func:`listwise_loss` — online and offline losses.
* :func:`make_update_step` — one jittable optax update.
"""
__version__ = "0.1.0"

from rmm_jax.core.losses import advantages, citation_rewards, listwise_loss, reinforce_loss
from rmm_jax.core.reranker import init_reranker, score, score_batch, score_naive
from rmm_jax.core.sampling import gumbel_top_m, selection_log_prob, selection_log_probs, top_m
from rmm_jax.core.update import (PRESETS, Config, init_learner_state, make_apply_update,
                            make_optimizer, make_update_step)

__all__ = [
    "Config", "PRESETS", "advantages", "citation_rewards", "gumbel_top_m", "init_learner_state",
    "init_reranker", "listwise_loss", "make_apply_update", "make_optimizer", "make_update_step",
    "reinforce_loss", "score", "score_batch", "score_naive", "selection_log_prob",
    "selection_log_probs", "top_m",
]
