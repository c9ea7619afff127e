"""rmm-jax: the citation-driven memory reranker of Reflective Memory Management in JAX.

The core (:mod:`rmm_jax.core`) is a handful of pure functions over embedding arrays:

* :func:`init_reranker`, :func:`score` — residual reranker (linear or MLP adapters).
* :func:`gumbel_top_m` — ordered Plackett–Luce sample of M memories.
* :func:`selection_log_prob` — exact (or the paper's surrogate) log-probability.
* :func:`reinforce_loss`, :func:`listwise_loss`, :func:`pointwise_loss` — online and offline losses.
* :class:`Layout`, :class:`Estimator`, an optax optimiser (:func:`adam`, :func:`sgd`) and
  :func:`preset` — the three parts of a program, and the named settings.
* :class:`Scope` — who learns from whose citations (``user``, ``shared``, ``hybrid``).
* :func:`make_update` — one jittable update of U users in every scope: a shared part
  (:class:`SharedState`) and each user's own (:class:`UserState`).

Data flows one way: dataset → embedding store (:mod:`rmm_jax.data`) → streams → the
compiled loop (:func:`make_run`, a :class:`Program`) driven chunk by chunk (:func:`drive`,
which yields events, consumed by a :class:`Recorder` and its sinks) → policies and logs
(:mod:`rmm_jax.persist`, :mod:`rmm_jax.cli`).
"""

import importlib
from typing import TYPE_CHECKING

from rmm_jax.version import __version__

if TYPE_CHECKING:  # what the names are, for readers, type checkers and the API docs (griffe reads these)
    from rmm_jax.core.config import PRESETS, Estimator, Layout, Setting, preset
    from rmm_jax.core.losses import (
        advantages,
        citation_logistic_loss,
        citation_pairwise_loss,
        citation_rewards,
        listwise_loss,
        pointwise_loss,
        reinforce_loss,
    )
    from rmm_jax.core.optim import Optimizer, adam, sgd
    from rmm_jax.core.reranker import init_lowrank, init_reranker, merge_params, score, score_batch, score_naive
    from rmm_jax.core.sampling import gumbel_top_m, selection_log_prob, selection_log_probs, top_m
    from rmm_jax.core.scope import SCOPES, Scope
    from rmm_jax.core.types import Batch, LearnerState, QueryBatch, SharedState, UserState
    from rmm_jax.core.update import init_learner_state, init_shared, init_user, make_update
    from rmm_jax.online.driver import ChunkDone, ChunkSkipped, Resume, SegmentDone, drive
    from rmm_jax.online.loop import Program, make_run
    from rmm_jax.online.run import Recorder, run_online

# Where each name lives: importing the package imports none of them (nor JAX), so that
# `rmm-jax embed` and `rmm-jax --version` start without JAX; the first use of a name imports its
# module (PEP 562). tests/test_layering.py checks that this table, the imports above and __all__ agree.
_MODULES = {
    "rmm_jax.core.config": "PRESETS Estimator Layout Setting preset",
    "rmm_jax.core.losses": "advantages citation_logistic_loss citation_pairwise_loss citation_rewards listwise_loss "
                           "pointwise_loss reinforce_loss",
    "rmm_jax.core.optim": "Optimizer adam sgd",
    "rmm_jax.core.reranker": "init_lowrank init_reranker merge_params score score_batch score_naive",
    "rmm_jax.core.sampling": "gumbel_top_m selection_log_prob selection_log_probs top_m",
    "rmm_jax.core.scope": "SCOPES Scope",
    "rmm_jax.core.types": "Batch LearnerState QueryBatch SharedState UserState",
    "rmm_jax.core.update": "init_learner_state init_shared init_user make_update",
    "rmm_jax.online.driver": "ChunkDone ChunkSkipped Resume SegmentDone drive",
    "rmm_jax.online.loop": "Program make_run",
    "rmm_jax.online.run": "Recorder run_online",
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names.split()}

__all__ = [
    "__version__",
    "Batch", "ChunkDone", "ChunkSkipped", "Estimator", "LearnerState", "Layout", "Optimizer", "PRESETS", "Program",
    "QueryBatch", "Recorder", "Resume", "SCOPES", "Scope", "SegmentDone", "Setting", "SharedState", "UserState",
    "adam", "advantages", "citation_logistic_loss", "citation_pairwise_loss", "citation_rewards", "drive",
    "gumbel_top_m", "init_learner_state", "init_lowrank", "init_reranker", "init_shared", "init_user",
    "listwise_loss", "make_run", "make_update", "merge_params", "pointwise_loss", "preset", "reinforce_loss",
    "run_online", "score", "score_batch", "score_naive", "selection_log_prob", "selection_log_probs", "sgd", "top_m",
]


# What users look for here that lives in its own room: the error says where (it said only "no attribute")
_ELSEWHERE = {"Reranker": "rmm_jax.online.serve", "serve_calls": "rmm_jax.online.serve",
              "PolicyStore": "rmm_jax.persist.policy_store", "open_store": "rmm_jax.data.store",
              "write_store": "rmm_jax.data.store", "Embedder": "rmm_jax.data.embed",
              "evaluate_log": "rmm_jax.online.ope", "read_log": "rmm_jax.data.citation_log",
              "prepare_calls": "rmm_jax.data.calls"}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        hint = f" (it is {_ELSEWHERE[name]}.{name})" if name in _ELSEWHERE else ""
        raise AttributeError(f"module 'rmm_jax' has no attribute {name!r}{hint}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
