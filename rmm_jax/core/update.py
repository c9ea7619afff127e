"""One online update: (UserState, Batch) → (UserState, metrics), and the Config that builds it.

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

from rmm_jax.core import checks
from rmm_jax.core.losses import BASELINES, CREDITS, REWARDS, citation_rewards, reinforce_loss
from rmm_jax.core.reranker import KINDS, score_batch
from rmm_jax.core.sampling import MODES, selection_log_prob, top_m
from rmm_jax.core.types import Batch, LearnerState, QueryBatch, UserState

# Who learns from whose citations (README, "Policy scopes"):
#   user    every user has a private reranker, learnt from that user's citations only;
#   shared  one reranker learns from every user's citations (the paper's runs);
#   hybrid  a shared reranker plus a per-user low-rank residual A Bᵀ (rank ``Config.rank``).
SCOPES = ("user", "shared", "hybrid")
DEFAULT_RANK = 8


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
    baseline: str = "batch_mean"  # constant | batch_mean | running_mean | query_mean
    baseline_value: float = 0.5  # b for `constant`; start value for `running_mean`
    ema: float = 0.9             # running_mean decay
    mode: str = "plackett_luce"  # plackett_luce | rmm
    credit: str = "item"         # item | reward_to_go | selection
    clip: float = 5.0            # importance-ratio ceiling for off-policy replay
    on_policy_tol: float = 1e-5  # |log π − log μ| below this counts as on-policy (ratio 1)
    buffer: int = 0              # past batches re-used in every update (importance-weighted)
    noise: str = "tempered"      # tempered: top-M of s/τ + g (PL at τ) | unit: top-M of s + g, τ only in log P
    scope: str = "user"          # user | shared | hybrid (see SCOPES)
    rank: int = DEFAULT_RANK     # rank r of the per-user residual (scope hybrid)

    def __post_init__(self):
        c = checks.require
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
        c(self.noise in NOISES, "noise", f"must be one of {NOISES}, got {self.noise!r}")
        c(self.scope in SCOPES, "scope", f"must be one of {SCOPES}, got {self.scope!r}")
        c(isinstance(self.rank, int) and self.rank >= 1, "rank", f"must be >= 1, got {self.rank!r}")
        c(self.scope != "hybrid" or self.kind == "linear", "scope",
          "hybrid needs the linear reranker (the low-rank residual adapts its W)")
        c(self.scope == "user" or self.buffer == 0, "buffer", "the experience buffer needs --scope user")

    @property
    def sample_tau(self) -> float:
        """The temperature of the behaviour policy's Plackett–Luce sample: τ for tempered
        noise (top-M of s/τ + g), 1 for unit noise (top-M of s + g, the paper's literal
        sampler, where τ enters only the rmm log-prob)."""
        return self.tau if self.noise == "tempered" else 1.0

    @staticmethod
    def preset(name: str, **overrides) -> "Config":
        checks.require(name in PRESETS, "preset", f"must be one of {tuple(PRESETS)}, got {name!r}")
        return dataclasses.replace(Config(), **{**PRESETS[name], **overrides})


NOISES = ("tempered", "unit")

PRESETS: dict[str, dict] = {
    # Chosen by measurement on LoCoMo (README, "Choosing the defaults").
    "default": {},
    # The RMM update as the paper writes it (Tan et al., 2025, §4.2 Retrospective
    # Reflection, and App. B): s̃ = s + g with unit Gumbel g, the top-M of s̃ shown,
    # p = softmax(s̃/τ), rewards ±1, b = 0.5, Δφ = η (R − b) ∇ log P with plain SGD,
    # η = 1e-3, batch 4, τ = 0.5. Reading taken where it is ambiguous: each shown memory's
    # own R − b weighs its own log p (credit "item"); see README, "Paper fidelity".
    "paper": dict(tau=0.5, lr=1e-3, batch=4, reward="pm1", baseline="constant", baseline_value=0.5,
                  mode="rmm", credit="item", optimizer="sgd", noise="unit"),
    # The earlier "paper" preset: the same rewards, baseline and rmm log-prob, but the
    # Gumbel noise scaled by τ (a Plackett–Luce sample at temperature τ) and Adam.
    "tempered_adam": dict(tau=0.5, lr=1e-3, batch=4, reward="pm1", baseline="constant", baseline_value=0.5,
                          mode="rmm", credit="item"),
}


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    return optax.adam(cfg.lr) if cfg.optimizer == "adam" else optax.sgd(cfg.lr)


def init_learner_state(key, cfg: Config) -> LearnerState:
    """The learner state of a new user: b₀, step 0 and the user's PRNG key data."""
    return LearnerState(
        baseline=jnp.asarray(cfg.baseline_value if cfg.baseline != "batch_mean" else 0.0, jnp.float32),
        step=jnp.asarray(0, jnp.int32),
        key=jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)


def init_user_state(params, key, cfg: Config, optimizer: optax.GradientTransformation | None = None) -> UserState:
    """A new user's :class:`UserState`: ``params``, a fresh optimiser state and learner state."""
    opt = optimizer or make_optimizer(cfg)
    return UserState(params, opt.init(params), init_learner_state(key, cfg))


def _mean_reward(rewards, filled):
    n = jnp.sum(filled)
    return jnp.where(n > 0, jnp.sum(jnp.where(filled, rewards, 0.0)) / jnp.maximum(n, 1), 0.0), n > 0


def baseline_for(cfg: Config, learner_state: LearnerState, rewards, filled):
    """The baseline b for this batch and the next learner state's baseline.

    constant: b = cfg.baseline_value. batch_mean: b = mean reward of the batch's shown
    memories. running_mean: b = EMA before this batch; EMA ← ema·EMA + (1−ema)·batch mean.
    query_mean: b = mean reward of the memories shown for the same query (B, 1), so a
    query where nothing or everything was cited carries no update; it depends on the
    sampled selection, so the estimate is no longer unbiased.
    """
    batch_mean, any_filled = _mean_reward(rewards, filled)
    if cfg.baseline == "constant":
        return jnp.float32(cfg.baseline_value), learner_state.baseline
    if cfg.baseline == "batch_mean":
        return batch_mean, learner_state.baseline
    if cfg.baseline == "query_mean":
        n = jnp.sum(filled, axis=-1, keepdims=True)
        q_mean = jnp.sum(jnp.where(filled, rewards, 0.0), axis=-1, keepdims=True) / jnp.maximum(n, 1)
        return q_mean, learner_state.baseline
    ema = learner_state.baseline
    new = jnp.where(any_filled, cfg.ema * ema + (1 - cfg.ema) * batch_mean, ema)
    return ema, new


def importance_weights(cfg: Config, scores, batch: Batch):
    """Per-query weights: 0 for padding; clip(π/μ) where a behaviour log-prob μ is logged.

    π is the exact Plackett–Luce probability of the logged selection under the current
    ``scores`` (B, K). A ratio within ``on_policy_tol`` of 1 in log space is exactly 1:
    the replaying policy is the one that logged the data (keeps on-policy replay
    bit-identical).
    """
    lp = jax.vmap(lambda s, sel, mk: selection_log_prob(s, sel, cfg.sample_tau, "plackett_luce", None, mk))(
        scores, batch.selected, batch.mask)
    diff = lp - batch.logged_log_prob
    ratio = jnp.where(jnp.abs(diff) <= cfg.on_policy_tol, 1.0, jnp.exp(jnp.minimum(diff, jnp.log(cfg.clip))))
    ratio = jnp.where(batch.has_logged, ratio, 1.0)
    return jax.lax.stop_gradient(jnp.where(batch.valid, ratio, 0.0))


def reranker_reinforce_loss(params, batch: Batch, baseline, weights, cfg: Config):
    """:func:`rmm_jax.core.losses.reinforce_loss` on the reranker's scores of ``batch``."""
    scores = score_batch(params, batch.q, batch.m, batch.mask)
    rewards = citation_rewards(batch.cited, batch.selected >= 0, cfg.reward)
    tau = cfg.tau if cfg.mode == "rmm" else cfg.sample_tau
    return reinforce_loss(scores, batch.selected, rewards, baseline, tau, mode=cfg.mode,
                          credit=cfg.credit, gumbel=batch.gumbel, mask=batch.mask, weights=weights)


def make_apply_update(cfg: Config, optimizer: optax.GradientTransformation | None = None):
    """Build ``apply(state, batch) -> (state, metrics)``: one REINFORCE + optimiser step.

    ``state`` is a :class:`UserState`, ``batch`` a :class:`Batch`; ``metrics`` is a dict
    of scalars (loss, reward, baseline, cite_rate, grad_norm, weight).

    Examples:
      >>> import jax, jax.numpy as jnp, rmm_jax as rj
      >>> cfg = rj.Config(k=3, m=2)
      >>> state = rj.init_user_state(rj.init_reranker(jax.random.key(0), 4), jax.random.key(1), cfg)
      >>> b = rj.Batch(q=jnp.ones((1, 4)), m=jnp.eye(3, 4)[None], mask=jnp.ones((1, 3), bool),
      ...              valid=jnp.ones(1, bool), selected=jnp.array([[0, 2]]), cited=jnp.array([[True, False]]),
      ...              gumbel=jnp.zeros((1, 3)), logged_log_prob=jnp.zeros(1), has_logged=jnp.zeros(1, bool))
      >>> new, metrics = rj.make_apply_update(cfg)(state, b)
      >>> int(new.learner_state.step), float(metrics["cite_rate"])
      (1, 0.5)
    """
    opt = optimizer or make_optimizer(cfg)

    def apply(state: UserState, batch: Batch):
        params, opt_state, learner_state = state
        filled = (batch.selected >= 0) & batch.valid[:, None]
        rewards = citation_rewards(batch.cited, filled, cfg.reward)
        b, new_baseline = baseline_for(cfg, learner_state, rewards, filled)
        scores = batch.scores if batch.scores is not None else score_batch(params, batch.q, batch.m, batch.mask)
        weights = importance_weights(cfg, scores, batch)
        loss, grads = jax.value_and_grad(reranker_reinforce_loss)(
            params, batch, jax.lax.stop_gradient(b), weights, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        learner_state = learner_state._replace(baseline=new_baseline, step=learner_state.step + 1)
        n = jnp.maximum(jnp.sum(filled), 1)
        metrics = {"loss": loss, "reward": jnp.sum(rewards) / n, "baseline": jnp.mean(b),
                   "cite_rate": jnp.sum(batch.cited & filled) / n,
                   "grad_norm": optax.tree.norm(grads), "weight": jnp.mean(weights)}
        return UserState(params, opt_state, learner_state), metrics

    return apply


CiteFn = Callable  # (key, is_gold (M,) bool, filled (M,) bool) -> cited (M,) bool


def act(cfg: Config, scores, mask, key):
    """Sample ordered selections for a batch: Gumbel-top-M of s/τ' (Plackett–Luce at τ').

    τ' = ``cfg.sample_tau``: τ for tempered noise, 1 for the paper's unit noise (top-M of
    s + g). Args: scores (B,K) under the current policy; mask (B,K); key.
    Returns (selected (B,M) int32, gumbel on the score scale (B,K), exact behaviour
    log P(selection) (B,) under PL at τ').
    """
    t = cfg.sample_tau
    g = jax.random.gumbel(key, scores.shape, scores.dtype)
    selected = jax.vmap(lambda z, mk: top_m(z, cfg.m, mk))(scores / t + g, mask)
    logp = jax.vmap(lambda s, sel, mk: selection_log_prob(s, sel, t, "plackett_luce", None, mk))(
        scores, selected, mask)
    return selected, t * g, logp


def simulated_batch(cfg: Config, cite_fn: CiteFn, scores, queries: QueryBatch, key) -> Batch:
    """act → cite on queries with gold labels; returns the :class:`Batch` an update takes."""
    k_act, k_cite = jax.random.split(key)
    selected, gumbel, logp = act(cfg, scores, queries.mask, k_act)
    filled = (selected >= 0) & queries.valid[:, None]
    is_gold = jnp.take_along_axis(queries.gold, jnp.maximum(selected, 0), axis=1) & filled
    cited = jax.vmap(cite_fn)(jax.random.split(k_cite, selected.shape[0]), is_gold, filled)
    return Batch(q=queries.q, m=queries.m, mask=queries.mask, valid=queries.valid, selected=selected,
                 cited=cited, gumbel=gumbel, logged_log_prob=logp,
                 has_logged=jnp.zeros_like(queries.valid), scores=scores)


def make_update_step(cfg: Config, cite_fn: CiteFn, optimizer=None):
    """Build ``step(state, queries, key) -> (state, metrics)``: act → cite → update.

    ``queries`` is a :class:`QueryBatch` (gold is what the citation source may look
    at). ``cite_fn(key, is_gold, filled)`` returns which shown memories are cited, e.g.
    :func:`rmm_jax.data.citations.oracle_cite` with its noise settings bound. The
    metrics include the selection, citations and behaviour log-prob (for logging).
    """
    apply = make_apply_update(cfg, optimizer)

    def step(state: UserState, queries: QueryBatch, key):
        scores = score_batch(state.params, queries.q, queries.m, queries.mask)
        full = simulated_batch(cfg, cite_fn, scores, queries, key)
        state, metrics = apply(state, full)
        return state, {**metrics, "selected": full.selected, "cited": full.cited, "log_prob": full.logged_log_prob}

    return step
