"""Importable test helpers (plain functions), also for test subprocesses: run those with
``PYTHONPATH`` set to this directory (see :data:`TESTS_DIR`) and ``from helpers import ...``."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax

from rmm_jax.core.types import LearnerState, UserState

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


def state_of(seed, kind="linear", d=8) -> UserState:
    """A user's policy: params, an Adam state with non-zero moments (count 1) and a learner state."""
    p = params_of(seed, kind, d)
    opt = optax.adam(1e-3)
    o = opt.init(p)
    g = params_of(seed + 10_000, kind, d)
    _, o = opt.update(g, o, p)
    return UserState(p, o, learner_of(seed))


def info_of(seed) -> dict:
    """The info saved with ``state_of(seed)``: ``{"queries_seen": seed, "seed": seed}``."""
    return {"queries_seen": int(seed), "seed": int(seed)}


def stacked(states) -> UserState:
    """Per-user states stacked on a leading users axis, as the online loop hands them over
    (typed PRNG keys stack as jax arrays)."""
    return jax.tree_util.tree_map(lambda *xs: jax.numpy.stack(xs) if isinstance(xs[0], jax.Array) else np.stack(xs),
                                  *states)


def save_seeds(store, seeds: dict, **kw) -> int:
    """Save users ``{user: seed}`` (``state_of(seed)``, ``info_of(seed)``) as one version."""
    return store.save(list(seeds), stacked([state_of(s) for s in seeds.values()]),
                      [info_of(s) for s in seeds.values()], **kw)
