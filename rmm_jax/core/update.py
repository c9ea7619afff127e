"""One online update: (params, opt_state, learner_state, batch, key) → new state, metrics.

Everything here is a pure function of arrays, built once per :class:`Config` by
:func:`make_update_step`; it runs under ``jit``, ``vmap`` (over users) and ``lax.scan``
(over a stream) without Python in the loop.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from rmm_jax.core import _checks
from rmm_jax.core.losses import (BASELINES, CREDITS, REWARDS, citation_rewards,
                            reranker_reinforce_loss)
from rmm_jax.core.reranker import KINDS, score_batch
from rmm_jax.core.sampling import MODES, selection_log_prob, top_m


@dataclasses.dataclass(frozen=True)
class Config:
    """Online-learning configuration. Frozen and hashable: it is a static argument.

    Defaults are the `default` preset (see :data:`PRESETS` and the README for how they
    were chosen); ``Config.preset("paper")`` is the literal RMM setting.
    """
    kind: str = "linear"
    hidden: int | None = None
    k: int = 20                  # candidates from the base retriever
    m: int = 5                   # memories shown to the generator
    batch: int = 4               # queries per update (paper: 4)
    tau: float = 0.1
    lr: float = 3e-4
    optimizer: str = "adam"      # adam | sgd
    reward: str = "binary"       # binary | pm1
    baseline: str = "batch_mean"  # constant | batch_mean | running_mean
    baseline_value: float = 0.5  # b for `constant`; start value for `running_mean`
    ema: float = 0.9             # running_mean decay
    mode: str = "plackett_luce"  # plackett_luce | rmm
    credit: str = "item"         # item | reward_to_go | selection
    clip: float = 5.0            # importance-ratio ceiling for off-policy replay
    on_policy_tol: float = 1e-5  # |log π − log μ| below this counts as on-policy (ratio 1)
    buffer: int = 0              # past batches re-used in every update (importance-weighted)

    def __post_init__(self):
        c = _checks.require
        c(self.kind in KINDS, "kind", f"must be one of {KINDS}")
        c(self.k >= 1, "k", f"must be >= 1, got {self.k}")
        c(1 <= self.m <= self.k, "m", f"must be in [1, k={self.k}], got {self.m}")
        c(self.batch >= 1, "batch", f"must be >= 1, got {self.batch}")
        c(self.tau > 0 and self.tau < float("inf"), "tau", f"must be > 0, got {self.tau}")
        c(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        c(self.optimizer in ("adam", "sgd"), "optimizer", "must be adam or sgd")
        c(self.reward in REWARDS, "reward", f"must be one of {REWARDS}")
        c(self.baseline in BASELINES, "baseline", f"must be one of {BASELINES}")
        c(0 <= self.ema < 1, "ema", f"must be in [0, 1), got {self.ema}")
        c(self.mode in MODES, "mode", f"must be one of {MODES}")
        c(self.credit in CREDITS, "credit", f"must be one of {CREDITS}")
        c(self.clip >= 1, "clip", f"must be >= 1, got {self.clip}")
        c(self.buffer >= 0, "buffer", f"must be >= 0, got {self.buffer}")

    @staticmethod
    def preset(name: str, **overrides) -> "Config":
        _checks.require(name in PRESETS, "preset", f"must be one of {tuple(PRESETS)}, got {name!r}")
        return dataclasses.replace(Config(), **{**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # Chosen by measurement on LoCoMo (README, "Choosing the defaults").
    "default": {},
    # The literal RMM setting (Tan et al., 2025, §5 and App. B).
    "paper": dict(tau=0.5, lr=1e-3, batch=4, reward="pm1", baseline="constant",
                  baseline_value=0.5, mode="rmm", credit="item"),
}


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    return optax.adam(cfg.lr) if cfg.optimizer == "adam" else optax.sgd(cfg.lr)


def init_learner_state(key, cfg: Config):
    """{"baseline": b₀, "step": 0, "key": key}: the per-user state besides params and optimiser."""
    return {"baseline": jnp.asarray(cfg.baseline_value if cfg.baseline != "batch_mean" else 0.0, jnp.float32),
            "step": jnp.asarray(0, jnp.int32),
            "key": jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key}


def _mean_reward(rewards, filled):
    n = jnp.sum(filled)
    return jnp.where(n > 0, jnp.sum(jnp.where(filled, rewards, 0.0)) / jnp.maximum(n, 1), 0.0), n > 0


def baseline_for(cfg: Config, learner_state, rewards, filled):
    """The baseline b for this batch and the next learner state's baseline.

    constant: b = cfg.baseline_value. batch_mean: b = mean reward of the batch's shown
    memories. running_mean: b = EMA before this batch; EMA ← ema·EMA + (1−ema)·batch mean.
    query_mean: b = mean reward of the memories shown for the same query (B, 1), so a
    query where nothing or everything was cited carries no update; it depends on the
    sampled selection, so the estimate is no longer unbiased.
    """
    batch_mean, any_filled = _mean_reward(rewards, filled)
    if cfg.baseline == "constant":
        return jnp.float32(cfg.baseline_value), learner_state["baseline"]
    if cfg.baseline == "batch_mean":
        return batch_mean, learner_state["baseline"]
    if cfg.baseline == "query_mean":
        n = jnp.sum(filled, axis=-1, keepdims=True)
        q_mean = jnp.sum(jnp.where(filled, rewards, 0.0), axis=-1, keepdims=True) / jnp.maximum(n, 1)
        return q_mean, learner_state["baseline"]
    ema = learner_state["baseline"]
    new = jnp.where(any_filled, cfg.ema * ema + (1 - cfg.ema) * batch_mean, ema)
    return ema, new


def importance_weights(cfg: Config, scores, batch):
    """Per-query weights: 0 for padding; clip(π/μ) where a behaviour log-prob μ is logged.

    π is the exact Plackett–Luce probability of the logged selection under the current
    ``scores`` (B, K). A ratio within ``on_policy_tol`` of 1 in log space is exactly 1:
    the replaying policy is the one that logged the data (keeps on-policy replay
    bit-identical).
    """
    lp = jax.vmap(lambda s, sel, mk: selection_log_prob(s, sel, cfg.tau, "plackett_luce", None, mk))(
        scores, batch["selected"], batch["mask"])
    diff = lp - batch["logged_log_prob"]
    ratio = jnp.where(jnp.abs(diff) <= cfg.on_policy_tol, 1.0, jnp.exp(jnp.minimum(diff, jnp.log(cfg.clip))))
    ratio = jnp.where(batch["has_logged"], ratio, 1.0)
    return jax.lax.stop_gradient(jnp.where(batch["valid"], ratio, 0.0))


def make_apply_update(cfg: Config, optimizer: optax.GradientTransformation | None = None):
    """Build ``apply(params, opt_state, learner_state, batch) -> (params, opt_state, learner_state, metrics)``.

    ``batch`` holds: q (B,d), m (B,K,d), mask (B,K) bool, selected (B,M) int32 (−1 unfilled),
    cited (B,M) bool, gumbel (B,K) noise on the score scale (used by mode ``rmm``),
    valid (B,) bool, logged_log_prob (B,) and has_logged (B,) bool; optionally scores
    (B,K), the current policy's scores if the caller already has them (saves a pass).
    """
    opt = optimizer or make_optimizer(cfg)

    def apply(params, opt_state, learner_state, batch):
        filled = (batch["selected"] >= 0) & batch["valid"][:, None]
        rewards = citation_rewards(batch["cited"], filled, cfg.reward)
        b, new_baseline = baseline_for(cfg, learner_state, rewards, filled)
        scores = batch["scores"] if "scores" in batch else score_batch(params, batch["q"], batch["m"], batch["mask"])
        weights = importance_weights(cfg, scores, batch)
        batch = {**batch, "weight": weights}
        loss, grads = jax.value_and_grad(reranker_reinforce_loss)(params, batch, jax.lax.stop_gradient(b), cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        learner_state = {**learner_state, "baseline": new_baseline, "step": learner_state["step"] + 1}
        n = jnp.maximum(jnp.sum(filled), 1)
        metrics = {"loss": loss, "reward": jnp.sum(rewards) / n, "baseline": jnp.mean(b),
                   "cite_rate": jnp.sum(batch["cited"] & filled) / n,
                   "grad_norm": optax.tree.norm(grads), "weight": jnp.mean(weights)}
        return params, opt_state, learner_state, metrics

    return apply


CiteFn = Callable  # (key, is_gold (M,) bool, filled (M,) bool) -> cited (M,) bool


def act(cfg: Config, scores, mask, key):
    """Sample ordered selections for a batch: Gumbel-top-M of s/τ (Plackett–Luce).

    Args: scores (B,K) under the current policy; mask (B,K); key.
    Returns (selected (B,M) int32, gumbel on the score scale (B,K), log P(selection) (B,)).
    """
    g = jax.random.gumbel(key, scores.shape, scores.dtype)
    selected = jax.vmap(lambda z, mk: top_m(z, cfg.m, mk))(scores / cfg.tau + g, mask)
    logp = jax.vmap(lambda s, sel, mk: selection_log_prob(s, sel, cfg.tau, "plackett_luce", None, mk))(
        scores, selected, mask)
    return selected, cfg.tau * g, logp


def simulated_batch(cfg: Config, cite_fn, scores, batch, key):
    """act → cite on a batch with gold labels; returns the batch :func:`make_apply_update` takes."""
    k_act, k_cite = jax.random.split(key)
    selected, gumbel, logp = act(cfg, scores, batch["mask"], k_act)
    filled = (selected >= 0) & batch["valid"][:, None]
    is_gold = jnp.take_along_axis(batch["gold"], jnp.maximum(selected, 0), axis=1) & filled
    cited = jax.vmap(cite_fn)(jax.random.split(k_cite, selected.shape[0]), is_gold, filled)
    return {"q": batch["q"], "m": batch["m"], "mask": batch["mask"], "valid": batch["valid"],
            "selected": selected, "cited": cited, "gumbel": gumbel, "scores": scores,
            "logged_log_prob": logp, "has_logged": jnp.zeros_like(batch["valid"])}


def make_update_step(cfg: Config, cite_fn: CiteFn, optimizer=None):
    """Build ``step(params, opt_state, learner_state, batch, key)``: act → cite → update.

    ``batch`` holds q, m, mask, valid and gold (B,K) bool (what the citation source may
    look at). ``cite_fn(key, is_gold, filled)`` returns which shown memories are cited,
    e.g. :func:`rmm_jax.data.citations.oracle_cite` with its noise settings bound.
    The metrics include the selection, citations and behaviour log-prob (for logging).
    """
    apply = make_apply_update(cfg, optimizer)

    def step(params, opt_state, learner_state, batch, key):
        scores = score_batch(params, batch["q"], batch["m"], batch["mask"])
        full = simulated_batch(cfg, cite_fn, scores, batch, key)
        params, opt_state, learner_state, metrics = apply(params, opt_state, learner_state, full)
        return params, opt_state, learner_state, {
            **metrics, "selected": full["selected"], "cited": full["cited"], "log_prob": full["logged_log_prob"]}

    return step
