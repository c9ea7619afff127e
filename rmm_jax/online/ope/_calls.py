"""Logged calls: read a log against an embedding store and score every call with the target
policy (:func:`load_calls`), each metric's slot rewards and range on them
(:func:`slot_rewards`), and the problems in the calls themselves that void an estimator's
weights (:func:`call_problems`)."""
from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from rmm_jax.core import checks, reranker
from rmm_jax.core.config import Layout
from rmm_jax.core.executables import aot
from rmm_jax.data.citation_log import ReadReport, call_hash, iter_numbered, pl_log_prob
from rmm_jax.data.embed import bar_disable, embed_texts
from rmm_jax.data.log_vectors import known_ids, resolve_calls, unseen_texts
from rmm_jax.data.retrieval import pad_rows
from rmm_jax.deprecated import parameter as deprecated_parameter
from rmm_jax.errors import InputError, at
from rmm_jax.online.cite_rates import check_log_inputs
from rmm_jax.online.ope._chunks import _CHUNK
from rmm_jax.online.serve import batch_policies, shared_params_of
from rmm_jax.online.starts import CHECK_USERS, LearnedCheck, LearnedTally
from rmm_jax.online.streams import calls_by_user, check_limits
from rmm_jax.persist.policy_checks import check_embedding_store
from rmm_jax.persist.policy_rollback import check_store

METRICS = ("cited", "cite_rate", "recall")
LOG_FLOAT_MAX = float(np.log(np.finfo(np.float64).max))   # 709.78: exp overflows above
F32_UNIT = 2.0 ** -24               # float32's unit roundoff u (Higham, Accuracy and Stability, §2.1)
_GELU_SLOPE = 1.13                  # max |gelu'(t)| ≈ 1.129 (t ≈ 2.4), and |gelu(t)| <= |t|
ROUNDING_LAMBDA = 10.0              # λ of the probabilistic bound γ̃_n(λ) (:func:`_gamma_prob`, :func:`rounding_bound`)
AGREE_LIMIT = 0.02                  # the largest δ (nats) within which rounding is told from a policy change:
                                    # a decision (a fifth of a policy change's log-ratios), not a float32 bound


@dataclasses.dataclass
class Calls:
    """Logged calls as padded arrays: n calls, K candidate slots, M selection slots."""
    user_ids: list[str]
    query_ids: list[str]               # call_key of each call
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
    served_by_target: np.ndarray | None = None   # (n,) bool: the call's logged versions are those the target loads
    versions_logged: np.ndarray | None = None    # (n,) bool: the record carries policy_version and shared_version
    logit_error: np.ndarray | None = None  # (n,) float64: float32 error bound of the target's logits (rounding_bound)
    read: ReadReport | None = None     # what reading the log found (load_calls)
    hashes: dict | None = None         # no longer filled: what learned counts them from (kept for callers)
    learned: LearnedCheck | None = None  # how many of them the policies learned from (relearn: counted, never refused)

    @property
    def filled(self) -> np.ndarray:
        return self.selected >= 0

    @property
    def shown(self) -> np.ndarray:
        return self.filled.sum(1)


class Target(NamedTuple):
    """The target policy's sampling: at most ``k`` candidates and ``m`` shown, temperature ``tau``."""
    k: int
    m: int
    tau: float


def check_target(cfg) -> None:
    """``InputError`` naming the field unless ``cfg`` is a :class:`Target` the CLI would take
    (``--k``, ``--m``, ``--tau``): called from Python, ``Target(k, m, tau=0)`` (or -1, or NaN)
    gave a whole report of estimates from s/0 with only a RuntimeWarning, ``m > k`` was a
    ValueError from the selection check, a tuple an AttributeError."""
    if not isinstance(cfg, Target):
        raise InputError(f"expected a Target(k, m, tau), got {checks.short(cfg)}", where="cfg")
    try:
        Layout(k=cfg.k, m=cfg.m)
        checks.check_tau(cfg.tau)
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise InputError(msg, where=f"cfg.{name}") from None


def check_inputs(store, policies, users) -> None:
    """The arguments :func:`load_calls` takes by type, each refused by name: a path for
    ``store`` or ``policies`` was an AttributeError ('str' object has no attribute
    'user_ids'), and a str ``users`` was read letter by letter (\"unknown user id 'a'\"); a policy
    store of another dimension or embedding model than ``store`` is refused naming ``policies``
    (:func:`rmm_jax.persist.policy_checks.check_embedding_store`: it was estimated without a word)."""
    check_log_inputs(store, users)
    check_store(policies, where="policies")
    check_embedding_store(policies, store, "policies")


@aot
def _score_chunk(params, q, m, mask):
    """The target's scores of a chunk of calls, and per call the largest of its candidates'
    scores on absolute values (:func:`_abs_score`, what float32 rounding is bounded by), in
    one program."""
    scores = jax.vmap(reranker.score, in_axes=(None, 0, 0, 0))(params, q, m, mask)
    return scores, jnp.where(mask, jax.vmap(_abs_score, in_axes=(None, 0, 0))(params, q, m), 0.0).max(1)


def _abs_adapter(p, x):
    """An adapter (:func:`rmm_jax.core.reranker._apply_adapter`) evaluated on absolute values
    (``x`` >= 0): an upper bound on |every term| its float32 evaluation sums. A gelu layer
    passes its input's bound times :data:`_GELU_SLOPE`."""
    a = jax.tree.map(jnp.abs, p)
    if "W" in p or "lora" in p:
        out = x + (x @ a["W"]["kernel"] if "W" in p else 0.0)
        return out + ((x @ a["lora"]["a"]) @ a["lora"]["b"].T if "lora" in p else 0.0)
    h = _GELU_SLOPE * (x @ a["up"]["kernel"] + a["up"]["bias"])
    return x + h @ a["down"]["kernel"] + a["down"]["bias"]


def _abs_score(params, q, m):
    """Per candidate, the score's terms in absolute value (m'ᵀq' on |m|, |q| and |params|)."""
    return _abs_adapter(params["m_adapter"], jnp.abs(m)) @ _abs_adapter(params["q_adapter"], jnp.abs(q))


def _score_depth(params) -> int:
    """N of :func:`rounding_bound`: the longest chain of float32 roundings in a score, 3d + 2w + 8
    (d the embedding dimension, w the widest inner layer: the low-rank r or the mlp's hidden)."""
    d = reranker.dim_of(params)
    widths = [leaf.shape[-1] for path, leaf in jax.tree_util.tree_leaves_with_path(params)
              if any(getattr(k, "key", None) in ("lora", "up") for k in path) and leaf.ndim == 2]
    return 3 * d + 2 * max(widths, default=0) + 8


def _gamma(n) -> np.ndarray:
    """Higham's γ_n = nu/(1 − nu) (Accuracy and Stability, Lemma 3.1), u = :data:`F32_UNIT`."""
    nu = np.asarray(n, np.float64) * F32_UNIT
    return nu / (1 - nu)


def _gamma_prob(n, lam: float = ROUNDING_LAMBDA) -> np.ndarray:
    """Higham and Mary's probabilistic γ̃_n(λ) = exp(λ√n·u + n·u²/(1 − u)) − 1 ≈ λ√n·u
    ("A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5),
    2019, Theorems 2.4 and 3.1), u = :data:`F32_UNIT`: with rounding errors independent of mean
    zero, |θ_n| <= γ̃_n(λ) fails with probability at most 2·exp(−λ²(1 − u)²/2) (4e-22 at
    λ = 10), where the worst case :func:`_gamma` grows with n instead of √n."""
    n = np.asarray(n, np.float64)
    u = F32_UNIT
    return np.expm1(lam * np.sqrt(n) * u + n * u * u / (1 - u))


def rounding_bound(calls: Calls) -> np.ndarray:
    """Per call, a bound δ on |log π(a) − log μ(a)| when the target π and the logging policy
    μ are the same policy, each evaluated in float32 (in any order, on any CPU): a call whose
    log-ratios all lie within ±δ gives the target the logging policy's probabilities to
    float32 rounding. ``inf`` where :func:`load_calls` did not bound the target's logits.
    Agreement is told from a policy change only while δ <= :data:`AGREE_LIMIT` (0.02 nats:
    weights within 2% of 1); beyond it rounding could hide a real change, so
    :func:`~rmm_jax.online.ope.agrees_to_rounding` never calls such a call agreed. That limit
    is a decision, not a float32 bound: a fifth of the log-ratios a change of policy gave in
    the tests and the 70-night audit (of order 0.1 and beyond).

    Derivation (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., ch. 3;
    Higham and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci.
    Comput. 41(5), 2019; u = 2⁻²⁴, first order in u):

    * **Logits.** A score s = m'ᵀq' is computed by sums and products only (the ``linear``
      adapters; ``mlp`` adds a gelu, whose slope is at most 1.13). Every such value computed
      along a chain of at most N roundings has |ŝ − s| = |θ| · S with S the same computation
      on absolute values (Higham §3.1 and §3.5: an inner product of length d has
      |fl(xᵀy) − xᵀy| <= |θ_d| |x|ᵀ|y|, and the bounds compose along the chain):
      N = 3d + 2w + 8 (:func:`_score_depth`). The worst case |θ_N| <= γ_N = Nu/(1 − Nu) grows
      with N and is reached only when every rounding errs the same way: with learned weights
      (S far above |s|: the terms cancel) it called log-ratios of 0.1 nats and more rounding.
      Rounding errors independent of mean zero (Higham and Mary's model, Theorems 2.4 and
      3.1) give |θ_N| <= γ̃_N(λ) ≈ λ√N·u (:func:`_gamma_prob`) except with probability
      2·exp(−λ²(1 − u)²/2) per θ: at λ = :data:`ROUNDING_LAMBDA` = 10, 4e-22, so below 1e-13
      over the fewer than N² θ's of every logit of a call (K <= 100, d <= 4096). z = s/τ rounds
      once more, so each logit is within e_z = γ̃_{N+2}(λ) · max_k S_k / τ of its exact value
      (``Calls.logit_error``).
    * **Plackett–Luce.** log P(a) = Σ_{j<M} (z_{a_j} − log Σ_{k not drawn} e^{z_k}); each term
      moves by at most twice the largest logit change (log-sum-exp is 1-Lipschitz in the max
      norm), so log P moves by <= 2M·e_z from exact logits. Evaluating it from given logits
      rounds too (worst case, a few dozen roundings): a sum of at most K exponentials is within
      γ_K (relative, so absolute in its log), exp, log and the subtractions add a few u, and
      each term's rounding is relative to its size, at most 2Z + log K (Z = max|z|), cumulated
      over M draws: ε <= M·(γ_{K+4} + γ_{M+3}·(2Z + log K)).
    * **Two evaluations.** π and μ each lie within 2M·e_z + ε of the exact log P, so
      δ = 4M·e_z + 2ε. Prefix log-ratios (fewer draws) lie within the same δ.

    For unit-norm embeddings at the identity reranker, d = 384, τ = 0.1, K = 20, M = 5:
    δ ≈ 4·5·γ̃_1162(10)·1/0.1 + 2ε ≈ 0.004 (weights within 0.4% of 1; the worst case γ_N gave
    0.014), still far above the errors seen (about 1e-7); a different policy's log-ratios are
    of order 0.1 and beyond."""
    n = len(calls.user_ids)
    if calls.logit_error is None:
        return np.full(n, np.inf)
    m = calls.shown.astype(np.float64)
    k = np.maximum(calls.mask.sum(1), 1).astype(np.float64)
    with np.errstate(invalid="ignore"):
        z = np.where(calls.mask, np.abs(calls.target_logits.astype(np.float64)), 0.0).max(1, initial=0.0)
    eps = m * (_gamma(k + 4) + _gamma(m + 3) * (2 * z + np.log(k)))
    return np.where(np.isfinite(z), 4 * m * calls.logit_error + 2 * eps, np.inf)


def load_calls(store, log_path, policies, cfg: Target, *, users: Sequence[str] | None = None,
               skip_invalid: bool = False, report: dict | None = None, cache_dir=None, progress: bool = False) -> Calls:
    """Read a log against an embedding store and score every call with the target policy.

    Each record is validated (schema, ids known to ``store`` or carried as text, the
    ``cfg.k``/``cfg.m`` limits: :func:`rmm_jax.online.streams.check_limits`)
    and must carry the behaviour's ``log_prob`` or ``logits``.
    Queries and memories the store lacks are embedded from the records' texts
    (:mod:`rmm_jax.data.log_vectors`, the store's model through the embedding cache rooted at
    ``cache_dir``: :func:`rmm_jax.data.embed.embed_texts`).
    Every user's target params come from :func:`rmm_jax.online.serve.batch_policies`, 64 users at a
    time (the shared params for users without their own), scored with
    :func:`rmm_jax.core.reranker.score`. ``served_by_target`` marks the calls whose logged
    ``policy_version`` and ``shared_version`` (``rmm-jax rerank`` writes both, null
    included) are exactly the versions the target loads for their user: the target served
    them itself. A record without the two keys is never marked. The check is by version
    number: the log does not name the policy store that served it. ``logit_error``: per call,
    how far float32 rounding can move the target's logits (:func:`rounding_bound`). ``read``: the log's
    :class:`~rmm_jax.data.citation_log.ReadReport` (``report``, a dict filled with it, is deprecated).
    ``learned``: how many of the calls the policies learned from (what :func:`learned_calls`
    counts: :func:`rmm_jax.online.starts.check_learned` with ``relearn``), from the same single
    read of the log and of each user's state (``hashes`` is no longer filled). ``progress``: bars on
    stderr while it is a terminal, over the texts embedded and the users scored.
    """
    if report is not None:
        deprecated_parameter("load_calls", "report", "read the returned Calls' .read, a ReadReport")
    check_target(cfg)
    check_inputs(store, policies, users)
    known = known_ids(store)
    wanted = None if not users else set(users)
    by_user: dict[str, list] = {}
    texts: dict[str, None] = {}
    hashes: dict[str, list] = {}
    reading = iter_numbered(log_path, known=known, skip_invalid=skip_invalid)
    for line, rec in reading:
        check_limits(rec, cfg, log_path)
        if rec.log_prob is None and rec.logits is None:
            near = [n for n in reading.report.notes if n.endswith(("'log_prob'?)", "'logits'?)"))]
            raise InputError("missing: off-policy evaluation needs the logging policy's log_prob (or logits) "
                             "on every record" + (f"; note: {near[0]}" if near else ""),
                             where=at(log_path, line, "log_prob"))
        if wanted is None or rec.user_id in wanted:
            by_user.setdefault(rec.user_id, []).append(rec)
            hashes.setdefault(rec.user_id, []).append((*call_hash(rec), line))
            texts.update(dict.fromkeys(unseen_texts(rec, known(rec.user_id))))
    read = reading.report
    if report is not None:
        report.update(read._asdict())
    missing = sorted((wanted or set()) - set(by_user))
    if missing:
        u = missing[0]
        raise InputError(f"user {u!r} has no record in {log_path}" if store.has_user(u) else
                         f"unknown user id {u!r} (not in STORE, no record in {log_path})", arg="users")
    vectors = embed_texts(list(texts), store.model, cache_dir=cache_dir, progress=progress, desc="new texts")
    has_policy = set(policies.users())
    rows: dict[str, list] = {key: [] for key in ("uid", "qid", "t", "b", "mask", "sel", "cited", "lp", "cg", "ng",
                                                 "valid", "served", "versioned", "err")}
    all_logits = all(r.logits is not None for recs in by_user.values() for r in recs)
    hashed = calls_by_user(hashes)
    tally = LearnedTally(hashed, log_path, relearn=True, questions=store)      # counted, never refused
    scoring = tqdm(_with_policies(policies, by_user, tally), total=len(by_user), desc="scoring", unit="user",
                   file=sys.stderr, disable=bar_disable(progress), leave=False)
    for uid, recs, policy in scoring:
        c = resolve_calls(store, uid, recs, vectors, cfg.k, cfg.m)
        params, loads = policy.params, (policy.version, policy.shared_version)
        n = len(recs)
        scores, sizes = [], []
        for s in range(0, n, _CHUNK):
            part = slice(s, s + _CHUNK)
            rows_here = c.queries[part].shape[0]
            q = pad_rows(c.queries[part], _CHUNK)
            mm = pad_rows(c.bank[c.cand[part]], _CHUNK)
            mk = pad_rows(c.cand_mask[part], _CHUNK)
            mk[rows_here:, 0] = True  # padded rows: one valid slot keeps the scores finite
            got, largest = jax.device_get(_score_chunk(params, q, mm, mk))
            scores.append(got[:rows_here])
            sizes.append(largest[:rows_here])
        scores = np.concatenate(scores).astype(np.float32)
        size = np.concatenate(sizes).astype(np.float64)
        lp = [r.log_prob if r.log_prob is not None else
              pl_log_prob(r.logits, [p for p in c.selected[i] if p >= 0]) for i, r in enumerate(recs)]
        rows["uid"] += [uid] * n
        rows["qid"] += list(c.call_keys)
        rows["t"].append(np.where(c.cand_mask, scores / cfg.tau, 0.0).astype(np.float32))
        rows["b"].append(c.logits)
        rows["mask"].append(c.cand_mask)
        rows["sel"].append(c.selected)
        rows["cited"].append(c.cited)
        rows["lp"].append(np.asarray(lp, np.float64))
        rows["cg"].append(c.cand_gold)
        rows["ng"].append(c.num_gold)
        rows["valid"].append(c.valid)
        rows["err"].append(_gamma_prob(_score_depth(params) + 2) * size / cfg.tau)
        rows["served"].append(np.array([r.versions_logged and (r.policy_version, r.shared_version) == loads
                                        for r in recs], bool))
        rows["versioned"].append(np.array([bool(r.versions_logged) for r in recs], bool))
    cat = lambda key: np.concatenate(rows[key])
    return Calls(user_ids=rows["uid"], query_ids=rows["qid"], target_logits=cat("t"),
                 behaviour_logits=cat("b") if all_logits else None, mask=cat("mask"), selected=cat("sel"),
                 cited=cat("cited"), log_prob=cat("lp"), cand_gold=cat("cg"), num_gold=cat("ng"),
                 valid=cat("valid"), own_policy={u: u in has_policy for u in by_user},
                 served_by_target=cat("served"), versions_logged=cat("versioned"), logit_error=cat("err"), read=read,
                 learned=tally.result())


def _with_policies(policies, by_user: dict[str, list], tally: LearnedTally):
    """``(user, records, policy)`` of each user in ``by_user``, their states read 64 at a
    time (:meth:`PolicyStore.load_batch`), each read once for its policy
    (:func:`rmm_jax.online.serve.batch_policies`, each shared version put on the device once
    for all of them) and for the calls it learned (``tally``)."""
    users = list(by_user)
    shared = shared_params_of(policies)
    for i in range(0, len(users), CHECK_USERS):          # users read together, as check_learned reads them
        part = users[i:i + CHECK_USERS]
        got = policies.load_batch(part)
        tally.add(got)
        for uid, policy in zip(part, batch_policies(policies, got, part, fallback_to_shared=True,
                                                    shared_params=shared)):
            yield uid, by_user[uid], policy


class MetricRewards(NamedTuple):
    """One metric's slot rewards on the calls it is defined for, with the exact range of
    each call's expected reward over every policy that shows as many memories."""
    rewards: np.ndarray                # (n', M) slot rewards
    rows: np.ndarray                   # (n',) the calls used (recall: calls with gold)
    low: np.ndarray                    # (n',) the least expected reward any policy can get on each call
    high: np.ndarray                   # (n',) the most

    @property
    def value_range(self) -> tuple[float, float]:
        """The estimand's range: the mean over the calls of each call's range."""
        return float(self.low.mean()), float(self.high.mean())


def slot_rewards(calls: Calls) -> dict[str, MetricRewards]:
    """Per metric, its :class:`MetricRewards`; recall only on valid calls.

    Ranges (M_i shown, K_i candidates, G_i of them gold, N_i gold in the bank): cited
    [0, M_i] (the generator may cite none or all); cite rate [0, 1]; Recall@M
    [max(0, M_i − (K_i − G_i)) / N_i, min(M_i, G_i) / N_i], which any selection of M_i
    of the candidates attains (recall does not depend on the generator).
    """
    filled = calls.filled
    cited = (calls.cited & filled).astype(np.float64)
    shown = np.maximum(calls.shown, 1)
    everyone = np.arange(len(cited))
    zero = np.zeros(len(cited))
    out = {"cited": MetricRewards(cited, everyone, zero, shown.astype(np.float64)),
           "cite_rate": MetricRewards(cited / shown[:, None], everyone, zero, np.ones(len(cited)))}
    rows = np.flatnonzero(calls.valid)
    if rows.size:
        gold = np.take_along_axis(calls.cand_gold, np.maximum(calls.selected, 0), 1) & filled
        n_gold = np.maximum(calls.num_gold, 1).astype(np.float64)
        g, k = calls.cand_gold.sum(1), calls.mask.sum(1)
        low, high = np.maximum(0, calls.shown - (k - g)) / n_gold, np.minimum(calls.shown, g) / n_gold
        out["recall"] = MetricRewards((gold / n_gold[:, None])[rows], rows, low[rows], high[rows])
    return out


def call_problems(calls: Calls, rows, *, log_ratio, prefix_log_ratio=None, marginals=None) -> dict[str, list[str]]:
    """Per estimator (and ``direct``), the reasons found in the calls ``rows`` themselves
    that make its weights meaningless: the target's scores not finite, a selection no
    Plackett–Luce policy can draw, a ``log_prob`` that is not a log-probability, and
    log-ratios beyond float64 (``exp`` overflows above :data:`LOG_FLOAT_MAX`).
    ``marginals``: ``(target, behaviour)`` per-slot marginals of the shown memories (n, M)."""
    rows = np.asarray(rows)
    n = rows.size

    def on(flags, text: str) -> list[str]:
        k = int(np.asarray(flags)[rows].sum())
        return [f"{text} on {k} of {n} calls"] if k else []

    def overflow(lr, text: str) -> list[str]:
        over = (np.asarray(lr) > LOG_FLOAT_MAX).reshape(len(lr), -1).any(1)
        top = float(np.max(np.asarray(lr)[rows])) if over[rows].any() else 0.0
        return on(over, f"weights overflow: {text} up to {top:.4g}, beyond float64's {LOG_FLOAT_MAX:.1f},")

    mask, sel = calls.mask, calls.selected
    filled = sel >= 0
    target_bad = ~np.where(mask, np.isfinite(calls.target_logits), True).all(1)
    ordered = np.sort(sel, axis=1)
    impossible = ((filled & ~np.take_along_axis(mask, np.maximum(sel, 0), 1)).any(1)
                  | ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1))
    common = (on(target_bad, "the target policy's scores are not finite")
              + on(impossible, "the logged selection is impossible under any Plackett–Luce policy over its "
                               "candidates (a shown memory that is not a candidate, or shown twice)"))
    lp = np.asarray(calls.log_prob, np.float64)
    slate = (common + on(~(np.isfinite(lp) & (lp <= 0)), "log_prob is not a log-probability (> 0 or not finite)")
             + overflow(log_ratio, "log(π/μ)"))
    out = {"direct": on(target_bad, "the target policy's scores are not finite"), "ips": slate, "snips": slate}
    if prefix_log_ratio is not None:
        out["rips"] = out["snrips"] = common + overflow(prefix_log_ratio, "prefix log(π/μ)")
    if marginals is not None:
        pt, pb = marginals
        out["iips"] = common + on((filled & (pb <= 0) & (pt > 0)).any(1),
                                  "weights overflow: the logging policy's per-slot marginal of a shown memory "
                                  "underflows to 0")
    return out
