"""PyTorch-eager reference of RMM's online reranker update (the baseline rmm-jax is timed against).

Our transcription (the paper released no code) in the usual PyTorch style: a Python loop
over the stream, one batch of B queries at a time, each step in eager PyTorch:

  1. forward the reranker: residual adapters ``W_q``, ``W_m`` (``nn.Linear`` without bias,
     zero init; or the GELU-MLP variant with a zero-initialised output layer). Scores are
     computed *naively*: every one of the K candidate memories is adapted,
     ``m_i' = m_i + W_m m_i`` (O(K·d²) per query), then ``s_i = q'ᵀ m_i'``;
  2. prequential evaluation: deterministic top-M of the scores → Recall@M (no grad), the
     same extra work rmm-jax's ``make_run`` does before each update;
  3. Gumbel top-M sampling of M memories from Plackett–Luce(softmax(s/τ));
  4. oracle citations (the same simulator as :func:`rmm_jax.data.citations.oracle_cite`:
     gold cited with prob. r, non-gold with q = clip(r·n_gold(1−p)/(p·n_nongold), 0, 1));
  5. REINFORCE: binary rewards, batch-mean baseline over the shown memories,
     reward-to-go credit, the exact Plackett–Luce log-probability (loop over the M draws),
     ``loss.backward()`` and a ``torch.optim.Adam`` step.

This is the algorithm of ``rmm_jax.Config(credit="reward_to_go")`` (binary reward,
batch_mean baseline, plackett_luce, reward_to_go, Adam), the configuration that
``benchmarks/throughput.py`` times; the library default credit is ``item``. ``tests/test_bench_references.py`` checks
scores, gradients and Adam steps against rmm-jax on fixed inputs.
``torch.set_num_threads`` is left at its default here (``benchmarks/throughput.py`` times
each reference with the faster of 1 thread and the default).

"PyTorch done well" (:class:`CompiledStep`, :func:`run_stream_compiled`): the same loop with
the fused O(d² + K·d) scoring (linear kind) and ``torch.compile`` (inductor) of the forward,
the act/eval/cite step, the loss and ``Adam.step``. It draws the same random numbers in the
same order as :func:`run_stream`, so both make the same selections and citations (tested).
"""
from __future__ import annotations

import functools
import os
import shutil

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NEG = -1e30
PRECISION, RECALL = 0.876, 0.858  # rmm_jax.data.citations.DEFAULT_PRECISION / DEFAULT_RECALL


class ResidualLinear(nn.Module):
    """x ↦ x + W x, W zero initialised (no bias)."""

    def __init__(self, d):
        super().__init__()
        self.W = nn.Linear(d, d, bias=False)
        nn.init.zeros_(self.W.weight)

    def forward(self, x):
        return x + self.W(x)


class ResidualMLP(nn.Module):
    """x ↦ x + down(gelu_tanh(up(x))), output layer zero initialised (flax's nn.gelu is tanh-approximate)."""

    def __init__(self, d, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x), approximate="tanh"))


class Reranker(nn.Module):
    """s_bi = (m_bi + f_m(m_bi))ᵀ (q_b + f_q(q_b)).

    ``fused=False`` (the eager baseline): naive, all K memories are adapted, O(K·d²) per
    query. ``fused=True`` (linear kind only, what the ``torch.compile`` reference uses):
    s_b = M_b v_b with v_b = q'_b + W_mᵀ q'_b, O(d² + K·d) per query, the algebra of
    rmm-jax's fused path.
    """

    def __init__(self, d, kind="linear", hidden=None, fused=False):
        super().__init__()
        self.kind = kind
        self.fused = fused and kind == "linear"
        if kind == "linear":
            self.q_adapter, self.m_adapter = ResidualLinear(d), ResidualLinear(d)
        else:
            h = hidden or d
            self.q_adapter, self.m_adapter = ResidualMLP(d, h), ResidualMLP(d, h)

    def forward(self, q, m, mask=None):
        """q (B, d), m (B, K, d), mask (B, K) bool → scores (B, K), −inf at masked slots."""
        q2 = self.q_adapter(q)
        if self.fused:                                   # m'ᵀq' = mᵀ(q' + W_mᵀ q')
            s = torch.einsum("bkd,bd->bk", m, q2 + q2 @ self.m_adapter.W.weight)
        else:
            s = torch.einsum("bkd,bd->bk", self.m_adapter(m), q2)
        return s if mask is None else s.masked_fill(~mask, float("-inf"))

    @torch.no_grad()
    def load_flax(self, params):
        """Copy rmm-jax (flax) parameters in: flax Dense computes x @ kernel, so weight = kernelᵀ."""
        for name in ("q_adapter", "m_adapter"):
            p, mod = params[name], getattr(self, name)
            if self.kind == "linear":
                mod.W.weight.copy_(torch.from_numpy(np.asarray(p["W"]["kernel"]).T.copy()))
            else:
                for layer in ("up", "down"):
                    lin = getattr(mod, layer)
                    lin.weight.copy_(torch.from_numpy(np.asarray(p[layer]["kernel"]).T.copy()))
                    lin.bias.copy_(torch.from_numpy(np.asarray(p[layer]["bias"]).copy()))
        return self

    def to_flax(self):
        """Parameters as an rmm-jax-shaped nested dict of numpy arrays."""
        out = {}
        for name in ("q_adapter", "m_adapter"):
            mod = getattr(self, name)
            if self.kind == "linear":
                out[name] = {"W": {"kernel": mod.W.weight.detach().numpy().T.copy()}}
            else:
                out[name] = {layer: {"kernel": getattr(mod, layer).weight.detach().numpy().T.copy(),
                                     "bias": getattr(mod, layer).bias.detach().numpy().copy()}
                             for layer in ("up", "down")}
        return out


def top_m(logits, m, mask):
    """Ordered top-M of the valid logits (B, K) → (B, M) int64, −1 where fewer than M are valid."""
    z = logits.masked_fill(~mask, float("-inf"))
    vals, idx = torch.topk(z, m, dim=1)
    return torch.where(torch.isfinite(vals), idx, torch.full_like(idx, -1))


def gumbel_top_m(scores, m, tau, mask, gen):
    """Gumbel-top-M (Kool et al., 2019): top-M of s/τ + g, g ~ Gumbel(0, 1)."""
    u = torch.rand(scores.shape, generator=gen).clamp_(1e-20, 1.0)
    g = -torch.log(-torch.log(u))
    return top_m(scores.detach() / tau + g, m, mask)


def oracle_cite(is_gold, filled, gen, precision=PRECISION, recall=RECALL):
    """Citation simulator of rmm_jax.data.citations.oracle_cite (same probabilities, torch RNG)."""
    n_gold = (is_gold & filled).sum(1, keepdim=True).float()
    n_non = (~is_gold & filled).sum(1, keepdim=True).float()
    q = (recall * (1 - precision) * n_gold / (precision * n_non.clamp(min=1.0))).clamp(0.0, 1.0)
    prob = torch.where(is_gold, torch.full_like(q, recall).expand_as(is_gold.float()), q.expand_as(is_gold.float()))
    return filled & (torch.rand(is_gold.shape, generator=gen) < prob)


def pl_log_probs(scores, selected, tau, mask):
    """Exact Plackett–Luce per-draw log-probs (B, M): s_{i_j}/τ − logsumexp_{k ∈ R_j} s_k/τ."""
    z = torch.where(mask, scores / tau, torch.full_like(scores, NEG))
    remaining = mask
    cols = torch.arange(scores.shape[1])
    out = []
    for j in range(selected.shape[1]):
        sel = selected[:, j]
        filled = sel >= 0
        idx = sel.clamp(min=0)
        lse = torch.logsumexp(torch.where(remaining, z, torch.full_like(z, NEG)), dim=1)
        lp = z.gather(1, idx[:, None])[:, 0] - lse
        out.append(torch.where(filled, lp, torch.zeros_like(lp)))
        # drop the drawn memory (no boolean indexing: the shapes stay static for torch.compile)
        remaining = remaining & ~((cols[None, :] == idx[:, None]) & filled[:, None])
    return torch.stack(out, 1)


def reinforce_loss(scores, selected, cited, valid, tau, mask):
    """Binary rewards, batch-mean baseline, reward-to-go credit, exact PL log-prob.

    Returns (loss, baseline, rewards).
    """
    filled = (selected >= 0) & valid[:, None]
    r = torch.where(cited, 1.0, 0.0) * filled
    n = filled.sum()
    b = torch.where(n > 0, r.sum() / n.clamp(min=1), torch.zeros(()))
    a = torch.where(filled, r - b, torch.zeros_like(r))
    adv = torch.flip(torch.cumsum(torch.flip(a, [1]), 1), [1]) * filled
    lp = pl_log_probs(scores, selected, tau, mask)
    w = valid.float()[:, None]
    return -(w * adv.detach() * lp).sum(), b, r


def update(model, opt, q, m, mask, selected, cited, valid, tau):
    """One REINFORCE + Adam step on a batch whose selection and citations are given."""
    scores = model(q, m, mask)
    loss, b, r = reinforce_loss(scores, selected, cited, valid, tau, mask)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def make(d, kind="linear", hidden=None, lr=1e-4, params=None, fused=False):
    """A fresh (model, Adam) pair; ``params`` (rmm-jax tree) optionally loaded."""
    model = Reranker(d, kind, hidden, fused)
    if params is not None:
        model.load_flax(params)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _stream_tensors(data):
    """The stream's numpy arrays as torch tensors: bank, q, cand, mask, gold, num_gold."""
    return (torch.from_numpy(np.ascontiguousarray(data["bank"], np.float32)),
            torch.from_numpy(np.ascontiguousarray(data["q"], np.float32)),
            torch.from_numpy(np.asarray(data["cand"], np.int64)),
            torch.from_numpy(np.asarray(data["mask"], bool)),
            torch.from_numpy(np.asarray(data["gold"], bool)),
            torch.from_numpy(np.asarray(data["num_gold"], np.int64)))


def run_stream(model, opt, data, *, m=5, batch=4, tau=1.0, seed=0):
    """The online loop over one user's stream: per-batch Python loop as described above.

    data: dict of numpy arrays bank (N, d), q (T, d), cand (T, K) int, mask (T, K) bool,
    gold (T, K) bool, num_gold (T,) int. Returns per-batch mean prequential Recall@M.
    """
    gen = torch.Generator().manual_seed(seed)
    bank, qs, cand, masks, golds, num_gold = _stream_tensors(data)
    recalls = []
    for t in range(0, qs.shape[0], batch):
        q, c, mask, gold = qs[t:t + batch], cand[t:t + batch], masks[t:t + batch], golds[t:t + batch]
        mem = bank[c]                                                   # (B, K, d)
        scores = model(q, mem, mask)
        with torch.no_grad():                                           # prequential eval
            top = top_m(scores, m, mask)
            rel = gold.gather(1, top.clamp(min=0)) & (top >= 0)
            recalls.append((rel.sum(1).float() / num_gold[t:t + batch].clamp(min=1).float()).mean().item())
        selected = gumbel_top_m(scores, m, tau, mask, gen)
        filled = selected >= 0
        is_gold = gold.gather(1, selected.clamp(min=0)) & filled
        cited = oracle_cite(is_gold, filled, gen)
        valid = torch.ones(q.shape[0], dtype=torch.bool)
        loss, b, r = reinforce_loss(scores, selected, cited, valid, tau, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return np.asarray(recalls)


# --------------------------------------------------------------------------- torch.compile

def compile_available() -> tuple[bool, str]:
    """Whether ``torch.compile`` can run here (its CPU backend, inductor, needs a C++ compiler)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return False, "no C++ compiler (g++/c++/clang++) on PATH: inductor's CPU backend compiles C++"
    return True, f"inductor CPU backend, C++ compiler {cxx}"


def act_and_eval(scores, mask, gold, num_gold, u_gumbel, u_cite, m: int, tau: float):
    """Prequential Recall@M of the deterministic top-M, Gumbel-top-M selection and oracle
    citations, from uniforms drawn outside (so the function has no RNG state and compiles
    to one graph). Same computation as :func:`run_stream`'s eager steps."""
    scores = scores.detach()
    top = top_m(scores, m, mask)
    rel = gold.gather(1, top.clamp(min=0)) & (top >= 0)
    recall = (rel.sum(1).float() / num_gold.clamp(min=1).float()).mean()
    g = -torch.log(-torch.log(u_gumbel.clamp(1e-20, 1.0)))
    selected = top_m(scores / tau + g, m, mask)
    filled = selected >= 0
    is_gold = gold.gather(1, selected.clamp(min=0)) & filled
    n_gold = (is_gold & filled).sum(1, keepdim=True).float()
    n_non = (~is_gold & filled).sum(1, keepdim=True).float()
    q = (RECALL * (1 - PRECISION) * n_gold / (PRECISION * n_non.clamp(min=1.0))).clamp(0.0, 1.0)
    prob = torch.where(is_gold, torch.full_like(q, RECALL).expand_as(is_gold.float()), q.expand_as(is_gold.float()))
    cited = filled & (u_cite < prob)
    return recall, selected, cited


class CompiledStep:
    """The same online step as :func:`run_stream`, "PyTorch done well": fused scoring (linear
    kind), and ``torch.compile`` (inductor) of the forward, the act/eval/cite step, the
    REINFORCE loss and Adam's step (``torch.compile(opt.step)``, the PyTorch recipe for a
    compiled optimizer). Random numbers come from a ``torch.Generator`` outside the graphs;
    the backward runs through the compiled graphs' AOTAutograd backward.
    """

    def __init__(self, model, opt, *, m: int, tau: float):
        self.model, self.opt, self.m, self.tau = model, opt, m, tau
        # Static shapes: one stream's batches all have the same shape (no dynamic-shape kernels).
        self.fwd = torch.compile(model, dynamic=False)
        self.act = torch.compile(functools.partial(act_and_eval, m=m, tau=tau), dynamic=False)
        self.loss = torch.compile(functools.partial(reinforce_loss, tau=tau), dynamic=False)
        self.opt_step = torch.compile(opt.step, dynamic=False)

    def __call__(self, q, mem, mask, gold, num_gold, gen):
        scores = self.fwd(q, mem, mask)
        u1 = torch.rand(scores.shape, generator=gen)
        u2 = torch.rand((scores.shape[0], self.m), generator=gen)
        recall, selected, cited = self.act(scores, mask, gold, num_gold, u1, u2)
        valid = torch.ones(q.shape[0], dtype=torch.bool)
        loss, _, _ = self.loss(scores, selected, cited, valid, mask=mask)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt_step()
        return recall


@torch.no_grad()
def reset(model, opt, params):
    """Put a (model, Adam) pair back to its start in place: parameters from ``params`` (an
    rmm-jax tree) and Adam's state zeroed, which is what a fresh optimiser holds after its
    lazy initialisation. Keeps the objects, so graphs compiled for them are reused."""
    model.load_flax(params)
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                v.zero_()


def run_stream_compiled(step: CompiledStep, data, *, batch=4, seed=0):
    """:func:`run_stream` with a :class:`CompiledStep` (build the step once; its first
    calls compile). Returns per-batch mean prequential Recall@M."""
    gen = torch.Generator().manual_seed(seed)
    bank, qs, cand, masks, golds, num_gold = _stream_tensors(data)
    recalls = []
    for t in range(0, qs.shape[0], batch):
        recalls.append(step(qs[t:t + batch], bank[cand[t:t + batch]], masks[t:t + batch], golds[t:t + batch],
                            num_gold[t:t + batch], gen))
    return torch.stack(recalls).numpy()
