"""NumPy reference of RMM's online reranker update with hand-written gradients (linear kind).

Same algorithm as ``rmm_jax.Config()`` and :mod:`ref_torch`, one batch of B queries per
step in a Python loop, float32 throughout:

  forward   q'_b = (I + A) q_b,  v_b = (I + B)ᵀ q'_b,  s_bi = m_biᵀ v_b  (= m_i'ᵀ q'_b)
            ``fused=True`` (default) computes s = M v, O(d² + K·d) per query like
            rmm-jax's fused path; ``fused=False`` adapts all K memories first (O(K·d²)).
            A = W_q, B = W_m in math convention (flax kernels are their transposes).
  eval      deterministic top-M → Recall@M (prequential, before the update).
  act       Gumbel-top-M of s/τ; oracle citations (rmm_jax.data.citations.oracle_cite's model).
  backward  binary rewards r, batch-mean baseline b over shown memories, reward-to-go
            advantages A_bj = Σ_{k≥j}(r_bk − b). With z = s/τ and the exact Plackett–Luce
            log-prob lp_bj = z_{b,i_j} − logsumexp_{k∈R_j} z_bk, the loss
            L = −Σ_bj A_bj lp_bj has
                ∂L/∂s_bk = −(1/τ) Σ_j A_bj ([k = i_j] − softmax_{R_j}(z_b)_k [k ∈ R_j]).
            With G = ∂L/∂s and u_b = Σ_k G_bk m_bk = M_bᵀ G_b:
                ∂L/∂q'_b = (I + B) u_b,   ∂L/∂A = Σ_b ∂L/∂q'_b q_bᵀ,   ∂L/∂B = Σ_b q'_b u_bᵀ
            (O(B·d² + B·K·d), no K·d² term).
  Adam      optax.adam(lr) defaults: β1 0.9, β2 0.999, ε 1e-8 (ε outside the sqrt).

``tests/test_bench_references.py`` checks scores, gradients and Adam steps against rmm-jax.
"""
from __future__ import annotations

import numpy as np

NEG = np.float32(-1e30)
PRECISION, RECALL = 0.876, 0.858


def init(d):
    z = np.zeros((d, d), np.float32)
    return {"A": z.copy(), "B": z.copy()}


def from_flax(params):
    return {"A": np.asarray(params["q_adapter"]["W"]["kernel"]).T.copy(),
            "B": np.asarray(params["m_adapter"]["W"]["kernel"]).T.copy()}


def to_flax(p):
    return {"q_adapter": {"W": {"kernel": p["A"].T.copy()}}, "m_adapter": {"W": {"kernel": p["B"].T.copy()}}}


def forward(p, q, m, mask=None, fused=True):
    """q (B, d), m (B, K, d) → scores (B, K), q' (B, d)."""
    qp = q + q @ p["A"].T
    if fused:
        v = qp + qp @ p["B"]
        s = np.einsum("bkd,bd->bk", m, v)
    else:
        mp = m + m @ p["B"].T
        s = np.einsum("bkd,bd->bk", mp, qp)
    if mask is not None:
        s = np.where(mask, s, -np.inf).astype(np.float32)
    return s, qp


def _logsumexp(x, axis):
    mx = np.max(x, axis=axis, keepdims=True)
    return (mx + np.log(np.sum(np.exp(x - mx), axis=axis, keepdims=True))).squeeze(axis)


def advantages(selected, cited, valid):
    """Binary rewards, batch-mean baseline, reward-to-go. Returns (adv (B, M), baseline, filled)."""
    filled = (selected >= 0) & valid[:, None]
    r = np.where(filled & cited, 1.0, 0.0).astype(np.float32)
    n = filled.sum()
    b = np.float32(r.sum() / max(n, 1)) if n > 0 else np.float32(0.0)
    a = np.where(filled, r - b, 0.0).astype(np.float32)
    adv = np.flip(np.cumsum(np.flip(a, 1), 1), 1)
    return np.where(filled, adv, 0.0).astype(np.float32), b, filled


def loss_and_dscores(scores, selected, adv, tau, mask):
    """L = −Σ A_bj lp_bj (exact Plackett–Luce) and ∂L/∂s (B, K)."""
    bsz, k = scores.shape
    z = np.where(mask, scores / np.float32(tau), NEG).astype(np.float32)
    remaining = mask.copy()
    dz = np.zeros_like(z)
    loss = np.float32(0.0)
    rows = np.arange(bsz)
    for j in range(selected.shape[1]):
        sel = selected[:, j]
        filled = sel >= 0
        idx = np.maximum(sel, 0)
        zr = np.where(remaining, z, NEG)
        lse = _logsumexp(zr, 1)
        p = np.exp(zr - lse[:, None]) * remaining
        lp = z[rows, idx] - lse
        a = np.where(filled, adv[:, j], 0.0).astype(np.float32)
        loss -= np.sum(a * lp)
        onehot = np.zeros_like(z)
        onehot[rows[filled], idx[filled]] = 1.0
        dz -= a[:, None] * (onehot - p)
        remaining = remaining.copy()
        remaining[rows[filled], idx[filled]] = False
    return loss, (dz / np.float32(tau)).astype(np.float32)


def grads(p, q, m, mask, selected, cited, valid, tau, fused=True):
    """(loss, {"A": ∂L/∂A, "B": ∂L/∂B}, scores) for one batch with given selection/citations."""
    s, qp = forward(p, q, m, mask, fused)
    adv, _, _ = advantages(selected, cited, valid)
    adv = adv * valid[:, None]
    loss, g = loss_and_dscores(s, selected, adv, tau, mask)
    u = np.einsum("bk,bkd->bd", g, m)                 # (B, d)
    dqp = u + u @ p["B"].T                            # (I + B) u_b
    return loss, {"A": dqp.T @ q, "B": qp.T @ u}, s


class Adam:
    """optax.adam: μ ← β1 μ + (1−β1) g, ν ← β2 ν + (1−β2) g², p ← p − lr μ̂ / (√ν̂ + ε)."""

    def __init__(self, params, lr=1e-4, b1=0.9, b2=0.999, eps=1e-8):
        self.lr, self.b1, self.b2, self.eps, self.t = lr, b1, b2, eps, 0
        self.mu = {k: np.zeros_like(v) for k, v in params.items()}
        self.nu = {k: np.zeros_like(v) for k, v in params.items()}

    def step(self, params, g):
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for k in params:
            mu, nu = self.mu[k], self.nu[k]
            mu *= self.b1
            mu += (1 - self.b1) * g[k]
            nu *= self.b2
            nu += (1 - self.b2) * np.square(g[k])
            params[k] -= (self.lr * (mu / c1) / (np.sqrt(nu / c2) + self.eps)).astype(np.float32)
        return params


def update(p, opt, q, m, mask, selected, cited, valid, tau, fused=True):
    loss, g, _ = grads(p, q, m, mask, selected, cited, valid, tau, fused)
    opt.step(p, g)
    return loss


def top_m(logits, m, mask):
    z = np.where(mask, logits, -np.inf)
    idx = np.argsort(-z, axis=1, kind="stable")[:, :m]
    ok = np.isfinite(np.take_along_axis(z, idx, 1))
    return np.where(ok, idx, -1)


def oracle_cite(is_gold, filled, rng, precision=PRECISION, recall=RECALL):
    n_gold = (is_gold & filled).sum(1, keepdims=True)
    n_non = (~is_gold & filled).sum(1, keepdims=True)
    q = np.clip(recall * (1 - precision) * n_gold / (precision * np.maximum(n_non, 1)), 0, 1)
    prob = np.where(is_gold, recall, q)
    return filled & (rng.random(is_gold.shape) < prob)


def class_cite(is_gold, filled, rng, p_useful, p_other, spurious):
    """rmm_jax.data.citations.class_cite's model: per call (last axis), a useful shown memory is
    cited with p_useful, another with p_other, and every memory of a call that shows nothing
    useful with spurious; unfilled slots never."""
    useful = is_gold & filled
    prob = np.where(useful, p_useful, np.where(useful.any(-1, keepdims=True), p_other, spurious))
    return filled & (rng.random(is_gold.shape) < prob)


def run_stream(p, opt, data, *, m=5, batch=4, tau=1.0, seed=0, fused=True):
    """The online loop over one user's stream (see module docstring). Returns per-batch Recall@M."""
    rng = np.random.default_rng(seed)
    bank, qs, cand = data["bank"], data["q"], data["cand"]
    masks, golds, num_gold = data["mask"], data["gold"], data["num_gold"]
    recalls = []
    for t in range(0, qs.shape[0], batch):
        q, mask, gold = qs[t:t + batch], masks[t:t + batch], golds[t:t + batch]
        mem = bank[cand[t:t + batch]]
        s, qp = forward(p, q, mem, mask, fused)
        top = top_m(s, m, mask)
        rel = np.take_along_axis(gold, np.maximum(top, 0), 1) & (top >= 0)
        recalls.append(float(np.mean(rel.sum(1) / np.maximum(num_gold[t:t + batch], 1))))
        g = -np.log(-np.log(np.clip(rng.random(s.shape, np.float32), 1e-20, 1.0)))
        selected = top_m(s / np.float32(tau) + g, m, mask)
        filled = selected >= 0
        is_gold = np.take_along_axis(gold, np.maximum(selected, 0), 1) & filled
        cited = oracle_cite(is_gold, filled, rng)
        valid = np.ones(q.shape[0], bool)
        # backward reuses the forward's scores and q' (no second forward)
        adv, _, _ = advantages(selected, cited, valid)
        _, gs = loss_and_dscores(s, selected, adv, tau, mask)
        u = np.einsum("bk,bkd->bd", gs, mem)
        dqp = u + u @ p["B"].T
        opt.step(p, {"A": dqp.T @ q, "B": qp.T @ u})
    return np.asarray(recalls)
