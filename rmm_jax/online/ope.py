"""Off-policy evaluation (OPE): what a reranker policy would get, estimated from logged calls.

A logged generator call i shows an ordered selection a_i = (a_i1, …, a_iM) of the K
candidates, drawn by the logging (behaviour) policy μ, and records which shown memories
the generator cited. The slot reward r_ij is 1 when slot j was cited; the call's reward
is R_i = Σ_j r_ij (the cited count), R_i / M_i (the cite rate of the shown memories) or,
where the store has gold, Recall@M = Σ_j gold(a_ij) / |gold_i|. The target policy π is a
stored reranker sampling Plackett–Luce on its scores s/τ, like the online loop
(:func:`rmm_jax.core.sampling.gumbel_top_m`), over the same K logged candidates and
showing as many memories as the logged call did. Its value V(π) = E_x E_{a~π}[R] is
estimated from n calls logged by μ:

* **IPS** (Horvitz & Thompson 1952): V̂ = (1/n) Σ_i w_i R_i with w_i = π(a_i)/μ(a_i), the
  exact PL probabilities of the whole ordered selection (π via
  :func:`rmm_jax.core.sampling.selection_log_prob` at τ; μ from the record's
  ``log_prob``). Unbiased for any reward.
* **SNIPS** (Swaminathan & Joachims, NeurIPS 2015): Σ_i w_i R_i / Σ_i w_i. Biased
  O(1/n), much lower variance.
* **RIPS**, reward-interaction IPS (McInerney et al., KDD 2020): V̂ = (1/n) Σ_i Σ_j
  w_i,1:j r_ij with the prefix ratio w_i,1:j = π(a_i1..a_ij)/μ(a_i1..a_ij). Under PL the
  prefix probability is closed form, Π_{l≤j} exp(z_{a_l}) / Σ_{k not drawn before l}
  exp(z_k) (:func:`rmm_jax.core.sampling.selection_log_probs`, cumulated). Unbiased when
  the reward of slot j depends only on the memories in slots 1..j (a cascade).
  **SNRIPS** normalises every slot by Σ_i w_i,1:j instead of n.
* **IIPS**, independent IPS (Li et al., WSDM 2018): V̂ = (1/n) Σ_i Σ_j
  [π_j(a_ij)/μ_j(a_ij)] r_ij with the per-slot marginals π_j(a) = P(a is drawn j-th).
  Unbiased when slot j's reward depends only on the memory in slot j. PL gives no
  closed form for the marginals; :func:`slot_marginals` computes them exactly by
  dynamic programming over the sets of memories drawn before slot j (P(S) =
  Σ_{b∈S} P(S∖b)·e^{z_b}/Σ_{k∉S∖b} e^{z_k}, Σ_{j<M} C(K, j) sets) when that count is at
  most ``exact_limit``, and by Rao–Blackwellised Monte Carlo otherwise (the average over
  sampled prefixes of e^{z_a}/Σ_{k not drawn} e^{z_k}; a ratio of two such estimates is
  consistent, not unbiased). The report says which.

RIPS, SNRIPS and IIPS need μ's per-draw probabilities, so the log must carry the
behaviour's ``logits`` (:mod:`rmm_jax.data.citation_log`); with ``log_prob`` only, IPS
and SNIPS are reported and the others are skipped with a note. Slot-wise estimators
carry a bias when citations interact across slots: the oracle citation model
(:func:`rmm_jax.data.citations.oracle_cite`) cites a shown non-gold memory with a
probability that depends on how many gold memories the whole selection holds.
``benchmarks/ope_validation.py`` measures this.

Every estimate comes with a nonparametric bootstrap 95% interval (percentile, calls
resampled with replacement; Efron & Tibshirani 1993) and Kish's effective sample size
ESS = (Σ w)² / Σ w² of its weights (the smallest over slots for the slot estimators).
With ``clip``, every weight is capped at ``clip``: lower variance, but biased (towards
the logging policy's value for IPS), which the report states as a warning. For Recall@M
the target's expected value is also computed exactly, with no logged reward at all:
Σ_a P_π(a shown) gold(a)/|gold| from the same marginals (``direct``).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import reranker
from rmm_jax.core.sampling import selection_log_probs, top_m
from rmm_jax.data.citation_log import iter_numbered, pl_log_prob
from rmm_jax.errors import InputError, at
from rmm_jax.online.scoring import user_params
from rmm_jax.online.streams import check_limits, known_ids

__all__ = [
    "Calls", "ESTIMATORS", "Target", "METRICS", "estimate", "estimator_weights", "evaluate_log", "load_calls",
    "prefix_log_probs", "shown_set_probs", "slot_marginals", "slot_marginals_exact", "slot_marginals_mc",
    "subset_count",
]

ESTIMATORS = ("ips", "snips", "rips", "snrips", "iips")
SLATE_ONLY = ("ips", "snips")        # need only the behaviour's log-probability of the whole selection
METRICS = ("cited", "cite_rate", "recall")
DEFAULT_BOOTSTRAP = 1000
DEFAULT_EXACT_LIMIT = 100_000
DEFAULT_MC_SAMPLES = 4096
_CHUNK = 64                          # calls per compiled scoring call (fixed: one compile per K, M)


# --------------------------------------------------------------------------- PL slot marginals
def subset_count(k: int, m: int) -> int:
    """Sets the exact marginals enumerate: Σ_{j<m} C(k, j)."""
    return sum(math.comb(k, j) for j in range(m))


@functools.lru_cache(maxsize=8)
def _subsets(k: int, m: int):
    """Per level j < m: (members (C_j, k) bool, parents (C_j, j) int, removed (C_j, j) int)."""
    levels = [(np.zeros((1, k), bool), np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64))]
    prev = {(): 0}
    for j in range(1, m):
        combos = list(itertools.combinations(range(k), j))
        members = np.zeros((len(combos), k), bool)
        parents = np.zeros((len(combos), j), np.int64)
        removed = np.zeros((len(combos), j), np.int64)
        index = {}
        for c, combo in enumerate(combos):
            index[combo] = c
            members[c, list(combo)] = True
            for p in range(j):
                parents[c, p] = prev[combo[:p] + combo[p + 1:]]
                removed[c, p] = combo[p]
        levels.append((members, parents, removed))
        prev = index
    return levels


def _weights(logits, mask) -> np.ndarray:
    z = np.where(mask, np.asarray(logits, np.float64), -np.inf)
    top = np.max(np.where(mask, z, -np.inf), axis=-1, keepdims=True)
    return np.where(mask, np.exp(z - np.where(np.isfinite(top), top, 0.0)), 0.0)


def _set_levels(logits, mask, levels: int):
    """The subset dynamic programme: per level j < ``levels``, yields ``(j, members (C_j, K),
    prob (n, C_j), rest (n, C_j))``: P(the first j draws are the set S) and the weight
    Σ_{k∉S} w_k still to draw from, with w = exp(logits) (0 where masked)."""
    logits = np.atleast_2d(np.asarray(logits, np.float64))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    n, k = logits.shape
    w = _weights(logits, mask)
    prob = np.ones((n, 1))
    structure = _subsets(k, levels)
    for j, (members, _, _) in enumerate(structure):
        rest = w @ (~members).T.astype(np.float64)
        yield j, members, prob, rest, w
        if j + 1 < levels:
            ratio = np.divide(prob, rest, out=np.zeros_like(prob), where=rest > 0)
            _, parents, removed = structure[j + 1]
            prob = np.zeros((n, parents.shape[0]))
            for p in range(parents.shape[1]):
                prob += ratio[:, parents[:, p]] * w[:, removed[:, p]]


def slot_marginals_exact(logits, mask, m: int) -> np.ndarray:
    """Exact per-slot marginals of Plackett–Luce(softmax(logits)): ``(n, m, K)`` float64,
    ``[i, j, a]`` = P(candidate a is drawn j-th) for call i (0 for masked candidates).

    Dynamic programming over the sets S of candidates drawn before slot j:
    P(S) = Σ_{b∈S} P(S∖b) · w_b / Σ_{k∉S∖b} w_k and P_j(a) = Σ_{|S|=j, a∉S} P(S) · w_a /
    Σ_{k∉S} w_k, with w = exp(logits). Cost Σ_{j<m} C(K, j) sets (:func:`subset_count`).
    """
    logits = np.atleast_2d(np.asarray(logits, np.float64))
    out = np.zeros((logits.shape[0], m, logits.shape[1]))
    for j, members, prob, rest, w in _set_levels(logits, mask, m):
        ratio = np.divide(prob, rest, out=np.zeros_like(prob), where=rest > 0)
        out[:, j, :] = w * (ratio @ (~members).astype(np.float64))
    return out


def shown_set_probs(logits, mask, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``(members (C, K) bool, probs (n, C))``: the probability that the first ``m`` PL draws
    are exactly the set ``members[c]``, in any order, for every set of ``m`` candidates
    (the same dynamic programme as :func:`slot_marginals_exact`, one level further; cost
    C(K, m) sets). The exact expectation of any reward that depends on the shown set only,
    e.g. an oracle citation model's expected cited count."""
    *_, (_, members, prob, _, _) = _set_levels(logits, mask, m + 1)
    return members, prob


@functools.partial(jax.jit, static_argnames=("m", "samples"))
def _mc_marginals(logits, mask, key, m: int, samples: int):
    def one(z, mk, key):
        g = jax.random.gumbel(key, (samples,) + z.shape, jnp.float32)
        zz = jnp.where(mk, z, -jnp.inf)
        order = jax.vmap(lambda gg: top_m(zz + gg, m, mk))(g)            # (S, m)
        w = jnp.where(mk, jnp.exp(z - jnp.max(zz)), 0.0)
        hit = (order[:, :, None] == jnp.arange(z.shape[0])) & (order[:, :, None] >= 0)  # (S, m, K)
        before = jnp.cumsum(hit, axis=1) - hit                           # drawn before slot j
        left = w[None, None, :] * (before == 0)
        rest = left.sum(-1, keepdims=True)
        return jnp.mean(jnp.where(rest > 0, left / jnp.where(rest > 0, rest, 1.0), 0.0), axis=0)
    keys = jax.random.split(key, logits.shape[0])
    return jax.vmap(one)(logits, mask, keys)


def slot_marginals_mc(logits, mask, m: int, *, samples: int = DEFAULT_MC_SAMPLES, seed: int = 0) -> np.ndarray:
    """Monte Carlo per-slot marginals, same layout as :func:`slot_marginals_exact`.

    Rao–Blackwellised: for ``samples`` prefixes drawn by Gumbel-top-M, P_j(a) is
    estimated by the mean of 1[a not drawn before j] · w_a / Σ_{k not drawn before j} w_k,
    an unbiased estimate that is positive for every candidate still available (so a
    behaviour marginal in a denominator is never 0).
    """
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    out = []
    key = jax.random.key(seed)
    for s in range(0, logits.shape[0], _CHUNK):
        part = slice(s, s + _CHUNK)
        z, mk = _pad_rows(logits[part], _CHUNK), _pad_rows(mask[part], _CHUNK)
        res = _mc_marginals(jnp.asarray(z), jnp.asarray(mk), jax.random.fold_in(key, s), m=m, samples=samples)
        out.append(np.asarray(res, np.float64)[:logits[part].shape[0]])
    return np.concatenate(out) if out else np.zeros((0, m, logits.shape[1]))


def slot_marginals(logits, mask, m: int, *, exact_limit: int = DEFAULT_EXACT_LIMIT,
                   samples: int = DEFAULT_MC_SAMPLES, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Per-slot PL marginals, exact when ``subset_count(K, m) <= exact_limit``, else Monte
    Carlo: ``(marginals (n, m, K), {"method", "subsets" or "samples"})``."""
    k = np.shape(logits)[-1]
    count = subset_count(k, m)
    if count <= exact_limit:
        return slot_marginals_exact(logits, mask, m), {"method": "exact", "subsets": count}
    return (slot_marginals_mc(logits, mask, m, samples=samples, seed=seed),
            {"method": "monte_carlo", "samples": samples, "subsets_needed_for_exact": count})


def prefix_log_probs(logits, selected, mask=None) -> np.ndarray:
    """log P(a_1..a_j) for every prefix of an ordered selection under PL(softmax(logits)):
    the cumulative sum of :func:`rmm_jax.core.sampling.selection_log_probs` (τ = 1),
    ``(n, M)``; unfilled slots (−1) repeat the last prefix."""
    logits = jnp.atleast_2d(jnp.asarray(logits, jnp.float32))
    selected = jnp.atleast_2d(jnp.asarray(selected, jnp.int32))
    mask = jnp.ones(logits.shape, bool) if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), logits.shape)
    return np.cumsum(np.asarray(_per_draw(logits, selected, mask), np.float64), axis=1)


@jax.jit
def _per_draw(logits, selected, mask):
    return jax.vmap(lambda z, s, mk: selection_log_probs(z, s, 1.0, mask=mk))(logits, selected, mask)


# --------------------------------------------------------------------------- estimators
def estimator_weights(name: str, *, log_ratio, prefix_log_ratio=None, marginal_ratio=None) -> np.ndarray:
    """Per-slot weights ``(n, M)`` of an estimator (before clipping).

    ``log_ratio`` (n,): log π(a)/μ(a) of the whole selection (ips, snips);
    ``prefix_log_ratio`` (n, M): of each prefix (rips, snrips); ``marginal_ratio``
    (n, M): π_j(a_j)/μ_j(a_j) (iips).
    """
    if name in SLATE_ONLY:
        lr = np.asarray(log_ratio, np.float64)
        m = 1 if prefix_log_ratio is None else np.shape(prefix_log_ratio)[1]
        return np.repeat(np.exp(lr)[:, None], m, axis=1)
    if name in ("rips", "snrips"):
        return np.exp(np.asarray(prefix_log_ratio, np.float64))
    if name == "iips":
        return np.asarray(marginal_ratio, np.float64)
    raise InputError(f"unknown estimator {name!r}; one of {', '.join(ESTIMATORS)}", where="estimator")


def _values(weights, rewards, counts, self_normalized: bool, slate: bool) -> np.ndarray:
    """Estimates for each row of ``counts`` (B, n): how often each call is in the resample."""
    wr = weights * rewards                                               # (n, M)
    num = counts @ wr                                                    # (B, M)
    if not self_normalized:
        return num.sum(1) / counts.sum(1)
    if slate:
        den = counts @ weights[:, 0]                                     # (B,)
        return np.divide(num.sum(1), den, out=np.zeros_like(den), where=den > 0)
    den = counts @ weights                                               # (B, M)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0).sum(1)


def estimate(name: str, weights, rewards, *, clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP,
             seed: int = 0, level: float = 0.95) -> dict:
    """One estimate from per-slot ``weights`` and ``rewards`` (n, M): value, bootstrap
    interval, standard error, ESS and how many weights ``clip`` capped.

    ``name`` picks the normalisation: ``ips``, ``rips``, ``iips`` divide by n, ``snips``
    by Σ_i w_i and ``snrips`` by Σ_i w_ij per slot. ``weights`` of ``ips``/``snips`` are
    the slate weight repeated over the slots (:func:`estimator_weights`).
    """
    w = np.asarray(weights, np.float64)
    r = np.asarray(rewards, np.float64)
    n = r.shape[0]
    if n == 0:
        raise InputError("no calls to estimate from", where="log")
    clipped = 0
    if clip is not None:
        clipped = int((w[:, 0] > clip).sum()) if name in SLATE_ONLY else int((w > clip).sum())
        w = np.minimum(w, clip)
    self_norm, slate = name in ("snips", "snrips"), name in SLATE_ONLY
    value = float(_values(w, r, np.ones((1, n)), self_norm, slate)[0])
    rng = np.random.default_rng(seed)
    boot = []
    step = max(1, 4_000_000 // max(n, 1))
    for s in range(0, bootstrap, step):
        b = min(step, bootstrap - s)
        draws = rng.integers(0, n, size=(b, n)) + (np.arange(b) * n)[:, None]
        counts = np.bincount(draws.ravel(), minlength=b * n).reshape(b, n).astype(np.float64)
        boot.append(_values(w, r, counts, self_norm, slate))
    boot = np.concatenate(boot) if boot else np.zeros(0)
    lo, hi = (np.quantile(boot, [(1 - level) / 2, (1 + level) / 2]) if boot.size else (value, value))
    cols = w[:, :1] if slate else w
    sums, sq = cols.sum(0), (cols ** 2).sum(0)
    ess = np.divide(sums ** 2, sq, out=np.zeros_like(sums), where=sq > 0)
    return {"value": value, "ci95": [float(lo), float(hi)], "se": float(boot.std(ddof=1)) if boot.size > 1 else None,
            "ess": float(ess.min()), "n": n, **({"clipped": clipped} if clip is not None else {})}


# --------------------------------------------------------------------------- logged calls
@dataclasses.dataclass
class Calls:
    """Logged calls as padded arrays: n calls, K candidate slots, M selection slots."""
    user_ids: list[str]
    query_ids: list[str]
    target_logits: np.ndarray          # (n, K) float32: target scores / τ (0 where masked)
    behaviour_logits: np.ndarray | None  # (n, K) float32 from the log's 'logits'; None: not on every record
    mask: np.ndarray                   # (n, K) bool
    selected: np.ndarray               # (n, M) int32 positions in the candidates, −1 unfilled
    cited: np.ndarray                  # (n, M) bool
    log_prob: np.ndarray               # (n,) float64: the behaviour's log P(selected)
    cand_gold: np.ndarray              # (n, K) bool
    num_gold: np.ndarray               # (n,) int32 gold memories in the user's whole bank
    valid: np.ndarray                  # (n,) bool: has gold, not an abstention question
    own_policy: dict                   # user id -> True when the policy store holds the user's own params

    @property
    def filled(self) -> np.ndarray:
        return self.selected >= 0

    @property
    def shown(self) -> np.ndarray:
        return self.filled.sum(1)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    if x.shape[0] == rows:
        return x
    pad = np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad])


class Target(NamedTuple):
    """The target policy's sampling: at most ``k`` candidates and ``m`` shown, temperature ``tau``."""
    k: int
    m: int
    tau: float


@jax.jit
def _score_chunk(params, q, m, mask):
    return jax.vmap(reranker.score, in_axes=(None, 0, 0, 0))(params, q, m, mask)


def load_calls(store, log_path, policies, cfg: Target, *, users: Sequence[str] | None = None,
               skip_invalid: bool = False, report: dict | None = None) -> Calls:
    """Read a log against an embedding store and score every call with the target policy.

    Each record is validated (schema, ids known to ``store``, the ``--k``/``--m``
    limits) and must carry the behaviour's ``log_prob`` or ``logits``. Every user's
    target params come from :func:`rmm_jax.online.scoring.user_params` (the shared params
    for users without their own), scored with :func:`rmm_jax.core.reranker.score`.
    """
    known = known_ids(store)
    wanted = None if not users else set(users)
    if wanted is not None:
        missing = sorted(wanted - set(store.user_ids))
        if missing:
            raise InputError(f"unknown user id {missing[0]!r} (the store has {len(store.user_ids)} users)",
                             where="--user")
    by_user: dict[str, list] = {}
    report = {} if report is None else report
    for line, rec in iter_numbered(log_path, known=known, skip_invalid=skip_invalid, report=report):
        check_limits(rec, cfg, log_path)
        if rec.log_prob is None and rec.logits is None:
            raise InputError("missing: off-policy evaluation needs the logging policy's log_prob (or logits) "
                             "on every record", where=at(log_path, line, "log_prob"))
        if wanted is None or rec.user_id in wanted:
            by_user.setdefault(rec.user_id, []).append(rec)
    if not by_user:
        raise InputError("no logged call of the requested users", where="--user")
    has_policy = set(policies.users())
    k, m = cfg.k, cfg.m
    rows: dict[str, list] = {key: [] for key in ("uid", "qid", "t", "b", "mask", "sel", "cited", "lp", "cg", "ng",
                                                 "valid")}
    all_logits = all(r.logits is not None for recs in by_user.values() for r in recs)
    for uid, recs in by_user.items():
        user = store.user(uid)
        params = user_params(policies, uid, fallback_to_shared=uid not in has_policy)
        mem_index = {mid: j for j, mid in enumerate(user.memory_ids)}
        q_index = {qid: i for i, qid in enumerate(user.query_ids)}
        n = len(recs)
        cand = np.zeros((n, k), np.int64)
        mask = np.zeros((n, k), bool)
        sel = np.full((n, m), -1, np.int32)
        cited = np.zeros((n, m), bool)
        qi = np.array([q_index[r.query_id] for r in recs], np.int64)
        beh = np.zeros((n, k), np.float32)
        for i, r in enumerate(recs):
            cand[i, :len(r.candidates)] = [mem_index[c] for c in r.candidates]
            mask[i, :len(r.candidates)] = True
            pos = {c: p for p, c in enumerate(r.candidates)}
            sel[i, :len(r.selected)] = [pos[x] for x in r.selected]
            cset = set(r.cited)
            cited[i, :len(r.selected)] = [x in cset for x in r.selected]
            if r.logits is not None:
                beh[i, :len(r.candidates)] = r.logits
        scores = []
        for s in range(0, n, _CHUNK):
            part = slice(s, s + _CHUNK)
            q = _pad_rows(np.asarray(user.query_emb)[qi[part]], _CHUNK)
            mm = _pad_rows(np.asarray(user.memory_emb)[cand[part]], _CHUNK)
            mk = _pad_rows(mask[part], _CHUNK)
            mk[qi[part].shape[0]:, 0] = True  # padded rows: one valid slot keeps the scores finite
            scores.append(np.asarray(_score_chunk(params, jnp.asarray(q), jnp.asarray(mm), jnp.asarray(mk)))
                          [:qi[part].shape[0]])
        scores = np.concatenate(scores).astype(np.float32)
        gold = np.asarray(user.gold, bool)[qi]
        cand_gold = np.take_along_axis(gold, cand, axis=1) & mask if gold.size else np.zeros((n, k), bool)
        lp = [r.log_prob if r.log_prob is not None else
              pl_log_prob(r.logits, [p for p in sel[i] if p >= 0]) for i, r in enumerate(recs)]
        rows["uid"] += [uid] * n
        rows["qid"] += [r.query_id for r in recs]
        rows["t"].append(np.where(mask, scores / cfg.tau, 0.0).astype(np.float32))
        rows["b"].append(beh)
        rows["mask"].append(mask)
        rows["sel"].append(sel)
        rows["cited"].append(cited)
        rows["lp"].append(np.asarray(lp, np.float64))
        rows["cg"].append(cand_gold)
        rows["ng"].append(gold.sum(1).astype(np.int32))
        rows["valid"].append(np.asarray(user.valid, bool)[qi])
    cat = lambda key: np.concatenate(rows[key])
    return Calls(user_ids=rows["uid"], query_ids=rows["qid"], target_logits=cat("t"),
                 behaviour_logits=cat("b") if all_logits else None, mask=cat("mask"), selected=cat("sel"),
                 cited=cat("cited"), log_prob=cat("lp"), cand_gold=cat("cg"), num_gold=cat("ng"),
                 valid=cat("valid"), own_policy={u: u in has_policy for u in by_user})


def slot_rewards(calls: Calls) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per metric: ``(slot rewards (n', M), rows of calls used)``; recall only on valid calls."""
    filled = calls.filled
    cited = (calls.cited & filled).astype(np.float64)
    shown = np.maximum(calls.shown, 1)[:, None]
    out = {"cited": (cited, np.arange(len(cited))), "cite_rate": (cited / shown, np.arange(len(cited)))}
    rows = np.flatnonzero(calls.valid)
    if rows.size:
        gold = np.take_along_axis(calls.cand_gold, np.maximum(calls.selected, 0), 1) & filled
        out["recall"] = ((gold / np.maximum(calls.num_gold, 1)[:, None])[rows], rows)
    return out


def evaluate_calls(calls: Calls, cfg: Target, *, clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP,
                   seed: int = 0, exact_limit: int = DEFAULT_EXACT_LIMIT,
                   mc_samples: int = DEFAULT_MC_SAMPLES) -> dict:
    """The estimates of every metric by every estimator that the log supports (see the
    module docstring), the logging policy's own logged value and, for Recall@M, the
    exact expected value of the target (``direct``)."""
    m = calls.selected.shape[1]
    target_prefix = prefix_log_probs(calls.target_logits, calls.selected, calls.mask)      # (n, M)
    log_ratio = target_prefix[:, -1] - calls.log_prob
    notes, names = [], list(SLATE_ONLY)
    t_marg, info = slot_marginals(calls.target_logits, calls.mask, m, exact_limit=exact_limit,
                                  samples=mc_samples, seed=seed)
    kw = {"log_ratio": log_ratio}
    if calls.behaviour_logits is not None:
        b_prefix = prefix_log_probs(calls.behaviour_logits, calls.selected, calls.mask)
        b_marg, _ = slot_marginals(calls.behaviour_logits, calls.mask, m, exact_limit=exact_limit,
                                   samples=mc_samples, seed=seed + 1)
        idx = np.maximum(calls.selected, 0)[:, :, None]
        pt = np.take_along_axis(t_marg, idx, 2)[:, :, 0]
        pb = np.take_along_axis(b_marg, idx, 2)[:, :, 0]
        kw["prefix_log_ratio"] = target_prefix - b_prefix
        kw["marginal_ratio"] = np.where(calls.filled, np.divide(pt, pb, out=np.zeros_like(pt), where=pb > 0), 1.0)
        names += ["rips", "snrips", "iips"]
    else:
        kw["prefix_log_ratio"] = np.zeros_like(target_prefix)
        notes.append("rips, snrips and iips skipped: they need the logging policy's per-candidate 'logits' on "
                     "every record (ips and snips need only 'log_prob')")
    weights = {name: estimator_weights(name, **kw) for name in names}
    out: dict = {}
    for metric, (rewards, rows) in slot_rewards(calls).items():
        per = {"logged": _logged(rewards, bootstrap, seed)}
        for name in names:
            per[name] = estimate(name, weights[name][rows], rewards, clip=clip, bootstrap=bootstrap, seed=seed)
        if metric == "recall":
            incl = (t_marg * (np.arange(m)[None, :, None] < calls.shown[:, None, None])).sum(1)   # (n, K)
            direct = (incl * calls.cand_gold).sum(1) / np.maximum(calls.num_gold, 1)
            per["direct"] = _logged(direct[rows][:, None], bootstrap, seed)
        out[metric] = per
    if "recall" not in out:
        notes.append("recall skipped: no logged call has gold memories in STORE")
    return {"estimates": out, "estimators": names, "marginals": info, "notes": notes}


def _logged(rewards, bootstrap: int, seed: int) -> dict:
    """The plain mean of the logged rewards: the logging policy's own value."""
    res = estimate("ips", np.ones((rewards.shape[0], 1)), rewards.sum(1, keepdims=True), bootstrap=bootstrap,
                   seed=seed)
    res.pop("ess")
    return res


def evaluate_log(store, log_path, policies, cfg: Target, *, users: Sequence[str] | None = None,
                 clip: float | None = None, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                 exact_limit: int = DEFAULT_EXACT_LIMIT, mc_samples: int = DEFAULT_MC_SAMPLES,
                 skip_invalid: bool = False) -> dict:
    """Off-policy estimates of the policies in ``policies`` (a
    :class:`~rmm_jax.persist.policy_store.PolicyStore`) from the calls logged in
    ``log_path`` on ``store`` (an embedding store): the report ``rmm-jax evaluate`` prints."""
    if clip is not None and not (clip >= 1.0 and math.isfinite(clip)):
        raise InputError(f"must be a finite number >= 1, got {clip}", where="--clip")
    if bootstrap < 0:
        raise InputError(f"must be >= 0, got {bootstrap}", where="--bootstrap")
    read: dict = {}
    calls = load_calls(store, log_path, policies, cfg, users=users, skip_invalid=skip_invalid, report=read)
    res = evaluate_calls(calls, cfg, clip=clip, bootstrap=bootstrap, seed=seed, exact_limit=exact_limit,
                         mc_samples=mc_samples)
    scope = (getattr(policies, "meta", None) or {}).get("scope") or "user"
    shared = [] if scope == "shared" else sorted(u for u, own in calls.own_policy.items() if not own)
    if shared:
        res["notes"].append(f"{len(shared)} of {len(calls.own_policy)} users have no policy of their own in "
                            f"POLICIES: scored with its shared params")
    warnings = []
    if clip is not None:
        n_clipped = {name: est.get("clipped", 0) for name, est in next(iter(res["estimates"].values())).items()
                     if name not in ("logged", "direct")}
        counts = ", ".join(f"{k}: {v}" for k, v in n_clipped.items())
        warnings.append(f"importance weights clipped at {clip:g} (weights capped, cited metric: {counts}): "
                        "clipped estimates are biased, towards the logging policy's value for ips")
    return {"calls": int(len(calls.user_ids)), "users": len(calls.own_policy), "users_on_shared_params": len(shared),
            "tau": cfg.tau, "k": cfg.k, "m": cfg.m, "clip": clip, "bootstrap": bootstrap, "seed": seed,
            "log": {"path": str(log_path), **{k: v for k, v in read.items()}}, "warnings": warnings, **res}
