"""Importable test helpers (plain functions), also for test subprocesses: run those with
``PYTHONPATH`` set to this directory (see :data:`TESTS_DIR`) and ``from helpers import ...``."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax

from rmm_jax.core.types import LearnerState
from rmm_jax.persist.policy_store import UserPolicy

TESTS_DIR = Path(__file__).resolve().parent


def params_of(seed, kind="linear", d=8, hidden=16):
    """Reranker-shaped params (``linear`` or ``mlp``) with standard-normal float32 values."""
    rng = np.random.default_rng(seed)
    if kind == "linear":
        shapes = {"q_adapter": {"W": {"kernel": (d, d)}}, "m_adapter": {"W": {"kernel": (d, d)}}}
    else:
        layer = {"down": {"kernel": (hidden, d), "bias": (d,)}, "up": {"kernel": (d, hidden), "bias": (hidden,)}}
        shapes = {"q_adapter": layer, "m_adapter": layer}
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                                  is_leaf=lambda x: isinstance(x, tuple))


def learner_of(seed) -> LearnerState:
    """A learner state whose values all depend on ``seed``."""
    return LearnerState(baseline=np.float32(seed / 7), step=np.int32(seed),
                        key=np.asarray(jax.random.key_data(jax.random.PRNGKey(seed))))


def state_of(seed, kind="linear", d=8) -> UserPolicy:
    """A user's policy: params, an Adam state with non-zero moments (count 1), a learner
    state and info ``{"queries_seen": seed, "seed": seed}``."""
    p = params_of(seed, kind, d)
    opt = optax.adam(1e-3)
    o = opt.init(p)
    g = params_of(seed + 10_000, kind, d)
    _, o = opt.update(g, o, p)
    return UserPolicy(p, o, learner_of(seed), {"queries_seen": int(seed), "seed": int(seed)})
