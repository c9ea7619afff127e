"""The Plackett–Luce quantities behind the off-policy estimators, against references that
share no code with :mod:`rmm_jax.online.ope`, and the truth of ``benchmarks/ope_validation.py``.

* **Brute force** (plain Python over :func:`itertools.permutations`, every ordered
  selection with its PL probability), at K up to 10 and M up to 5, several calls with
  different masks and scales in one batch: the per-slot marginals IIPS uses
  (``slot_marginals_exact`` and the ``slot_marginals`` dispatch), the shown-set
  probabilities and the prefix log-probabilities RIPS uses.
* **Monte Carlo at K = 20, M = 5**, the size ``evaluate`` and the validation run at:
  marginal frequencies of an independent NumPy Gumbel-top-M sampler (200,000 draws, fixed
  seed); every exact marginal within 5 standard errors of them, and the Monte Carlo
  branch (``slot_marginals_mc``) within 5 standard errors of their difference.
* **The benchmark's truth**: ``ope_validation.enumerate_pl`` equals the brute force,
  ``ope_validation.expected_cited`` equals the simulated mean of
  :func:`rmm_jax.data.citations.oracle_cite`, and importing the benchmark loads no
  :mod:`rmm_jax.online.ope`.
"""
from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import assert_f32_close, f32_error

from rmm_jax.core.sampling import selection_log_probs
from rmm_jax.data.citations import DEFAULT_PRECISION, DEFAULT_RECALL, oracle_cite
from rmm_jax.online.ope import (
    prefix_log_probs,
    shown_set_probs,
    slot_marginals,
    slot_marginals_exact,
    slot_marginals_mc,
    subset_count,
)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import ope_validation  # noqa: E402


# --------------------------------------------------------------------------- references (no rmm_jax.online.ope)
def pl_selections(z, mask, m):
    """Every ordered selection of ``m`` valid candidates with its PL(softmax(z)) probability."""
    valid = [i for i in range(len(z)) if mask[i]]
    for perm in itertools.permutations(valid, m):
        p, left = 1.0, list(valid)
        for a in perm:      # each draw's weights relative to the largest left: exact at any spread
            top = max(z[i] for i in left)
            p *= math.exp(z[a] - top) / sum(math.exp(z[i] - top) for i in left)
            left.remove(a)
        yield perm, p


def brute_marginals(z, mask, m):
    out = np.zeros((m, len(z)))
    for perm, p in pl_selections(z, mask, m):
        for j, a in enumerate(perm):
            out[j, a] += p
    return out


def gumbel_frequencies(z, mask, m, draws, rng):
    """Slot frequencies (m, K) of ``draws`` Gumbel-top-m selections from PL(softmax(z))."""
    keys = np.where(mask, z, -np.inf) + rng.gumbel(size=(draws, len(z)))
    order = np.argsort(-keys, axis=1)[:, :m]
    return np.stack([np.bincount(order[:, j], minlength=len(z)) for j in range(m)]) / draws


def calls(k, seed, scales=(1.0, 3.0, 6.0), masked=(0, 1, 3)):
    """A batch of calls: logits at several spreads (τ = 0.1 on cosine scores spreads them
    to ~±5), each with its own masked candidates."""
    rng = np.random.default_rng(seed)
    z = np.stack([rng.normal(size=k) * s for s in scales])
    mask = np.ones_like(z, bool)
    for i, n in enumerate(masked):
        mask[i, rng.choice(k, n, replace=False)] = False
    return z, mask


SIZES = [(8, 3), (10, 2), (10, 3), (10, 5)]


# --------------------------------------------------------------------------- brute force, K <= 10
# slot_marginals_exact, shown_set_probs and the benchmark's enumeration run in float64 like the brute
# force: rtol 1e-10 leaves room for summation order only. prefix_log_probs runs in float32.
@pytest.mark.parametrize("k,m", SIZES)
def test_slot_marginals_exact_equal_enumeration(k, m):
    z, mask = calls(k, seed=k * 10 + m)
    got = slot_marginals_exact(z, mask, m)
    for i in range(len(z)):
        np.testing.assert_allclose(got[i], brute_marginals(z[i], mask[i], m), rtol=1e-10, atol=1e-13)
    assert np.all(got[~mask[:, None, :].repeat(m, 1)] == 0)
    np.testing.assert_allclose(got.sum(2), 1.0, atol=1e-12)          # one candidate per slot


@pytest.mark.parametrize("k,m", [(6, 3), (8, 4)])
def test_slot_marginals_exact_hold_at_any_spread_of_the_logits(k, m):
    """Logits hundreds apart (a policy whose scores grew, at a small τ): weights relative to the
    call's best underflowed once it was drawn, and [0, -800, -801] gave a second slot of 0
    where it is [0, 0.731, 0.269] ([0, -720, -721]: NaN). Exact in float64 at any spread."""
    z, mask = calls(k, seed=k + m, scales=(300.0, 1000.0, 5000.0), masked=(0, 1, 2))
    got = slot_marginals_exact(z, mask, m)
    members, probs = shown_set_probs(z, mask, m)
    index = {frozenset(np.flatnonzero(row).tolist()): c for c, row in enumerate(members)}
    for i in range(len(z)):
        np.testing.assert_allclose(got[i], brute_marginals(z[i], mask[i], m), rtol=1e-10, atol=1e-13)
        want = np.zeros(len(members))
        for perm, p in pl_selections(z[i], mask[i], m):
            want[index[frozenset(perm)]] += p
        np.testing.assert_allclose(probs[i], want, rtol=1e-10, atol=1e-13)
    second = 1 / (1 + math.exp(-1))
    for gap in (720.0, 800.0):
        three = np.array([[0.0, -gap, -gap - 1]])
        np.testing.assert_allclose(slot_marginals_exact(three, np.ones((1, 3), bool), 2)[0, 1],
                                   [0, second, 1 - second], atol=1e-14)
    # the Monte Carlo branch, in float32, underflowed from a gap of 88: its first draw is the best
    # almost surely, so the Rao-Blackwellised second slot is the exact conditional
    np.testing.assert_allclose(slot_marginals_mc(np.array([[0.0, -90.0, -91.0]]), np.ones((1, 3), bool), 2,
                                                 samples=64)[0, 1], [0, second, 1 - second], atol=1e-6)


@pytest.mark.parametrize("k,m", [(10, 3), (10, 5)])
def test_slot_marginals_dispatch_exact_branch(k, m):
    """What IIPS calls: exact below the limit, labelled so; uniform logits give 1/K_valid."""
    z, mask = calls(k, seed=7)
    got, info = slot_marginals(z, mask, m)
    assert info == {"method": "exact", "subsets": subset_count(k, m)}
    for i in range(len(z)):
        np.testing.assert_allclose(got[i], brute_marginals(z[i], mask[i], m), rtol=1e-10, atol=1e-13)
    flat = np.zeros((1, k))
    flat_mask = np.arange(k)[None] < k - 2
    np.testing.assert_allclose(slot_marginals(flat, flat_mask, m)[0][0][:, :k - 2], 1 / (k - 2), atol=1e-14)


@pytest.mark.parametrize("k,m", [(8, 3), (10, 3), (10, 5)])
def test_shown_set_probs_equal_enumeration(k, m):
    z, mask = calls(k, seed=k + m)
    members, probs = shown_set_probs(z, mask, m)
    index = {frozenset(np.flatnonzero(row).tolist()): c for c, row in enumerate(members)}
    assert len(index) == math.comb(k, m)
    for i in range(len(z)):
        want = np.zeros(len(members))
        for perm, p in pl_selections(z[i], mask[i], m):
            want[index[frozenset(perm)]] += p
        np.testing.assert_allclose(probs[i], want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("k,m", [(8, 3), (10, 3)])
def test_prefix_log_probs_equal_enumeration(k, m):
    """RIPS's prefix probabilities, for every ordered selection of every call: float32, within the
    float32 bound of the per-draw log-probabilities cumulated (the enumeration takes the same
    float32 logits, in float64)."""
    z, mask = calls(k, seed=3 * k + m)
    z = z.astype(np.float32)
    rows, sel, want = [], [], []
    for i in range(len(z)):
        for perm, _ in pl_selections(z[i], mask[i], m):
            w = {a: math.exp(z[i][a]) for a in range(k) if mask[i][a]}
            left, lp, prefix = sum(w.values()), 0.0, []
            for a in perm:
                lp += math.log(w[a] / left)
                left -= w[a]
                prefix.append(lp)
            rows.append(i)
            sel.append(perm)
            want.append(prefix)
    sel = np.array(sel, np.int32)
    got = prefix_log_probs(z[rows], sel, mask[rows])
    per_draw = jax.vmap(lambda x, s, mk: selection_log_probs(x, s, 1.0, mask=mk))
    bound = np.cumsum(f32_error(lambda x: per_draw(x, sel, mask[rows]), z[rows]), axis=1)
    assert_f32_close(got, np.array(want), bound)


# --------------------------------------------------------------------------- Monte Carlo, K = 20
K20, M20, DRAWS = 20, 5, 200_000


@pytest.fixture(scope="module")
def k20():
    z, mask = calls(K20, seed=2020, scales=(1.0, 3.0, 5.0), masked=(0, 4, 1))
    rng = np.random.default_rng(12345)
    freq = np.stack([gumbel_frequencies(z[i], mask[i], M20, DRAWS, rng) for i in range(len(z))])
    return z, mask, freq


def five_sigma(p, n):
    """5 binomial standard errors of a frequency over ``n`` draws at probability ``p`` (with a
    1/n floor, so a probability near 0 allows a few stray hits)."""
    return 5 * np.sqrt((p * (1 - p) + 1 / n) / n)


def test_slot_marginals_exact_match_sampling_at_k20(k20):
    z, mask, freq = k20
    got, info = slot_marginals(z, mask, M20)
    assert info["method"] == "exact"                                   # what evaluate uses at K=20, M=5
    np.testing.assert_array_equal(got, slot_marginals_exact(z, mask, M20))
    dev = np.abs(got - freq)
    assert np.all(dev <= five_sigma(got, DRAWS)), float((dev / five_sigma(got, DRAWS)).max())
    assert dev.max() > 0                                                # the comparison is not vacuous
    assert np.all(got[~mask[:, None, :].repeat(M20, 1)] == 0)


def test_slot_marginals_monte_carlo_branch_at_k20(k20):
    """The Rao–Blackwellised branch (beyond ``exact_limit``) against the independent sampler:
    within 5 standard errors of the difference of two frequencies."""
    z, mask, freq = k20
    samples = 4096
    got, info = slot_marginals(z, mask, M20, exact_limit=10, samples=samples, seed=3)
    assert info["method"] == "monte_carlo" and info["samples"] == samples
    np.testing.assert_array_equal(got, slot_marginals_mc(z, mask, M20, samples=samples, seed=3))
    p = freq
    tol = 5 * np.sqrt((p * (1 - p) + 1 / DRAWS) / DRAWS + (p * (1 - p) + 1 / samples) / samples)
    assert np.all(np.abs(got - freq) <= tol)


# --------------------------------------------------------------------------- the benchmark's truth
@pytest.mark.parametrize("k,m", [(6, 3), (8, 4)])
def test_benchmark_enumeration_equal_brute_force(k, m):
    z, mask = calls(k, seed=k * m)
    gold = np.random.default_rng(k).random(z.shape) < 0.4
    out = ope_validation.enumerate_pl(z, mask, gold, m)
    assert out["mass_error"] < 1e-12                                   # float64, like the brute force
    for i in range(len(z)):
        np.testing.assert_allclose(out["marginals"][i], brute_marginals(z[i], mask[i], m), rtol=1e-10, atol=1e-13)
        want = np.zeros(m + 1)
        for perm, p in pl_selections(z[i], mask[i], m):
            want[sum(bool(gold[i, a] and mask[i, a]) for a in perm)] += p
        np.testing.assert_allclose(out["gold_shown"][i], want, rtol=1e-10, atol=1e-13)
    leaves = np.zeros((1, 0), np.int64)
    for _, parent, appended in ope_validation.prefix_tree(k, m):
        leaves = np.concatenate([leaves[parent], appended[:, None]], axis=1)
    assert leaves.tolist() == [list(p) for p in itertools.permutations(range(k), m)]


def test_benchmark_expected_cited_equal_oracle_mean():
    """E[cited | g gold of M shown] of the truth equals oracle_cite's mean, every g."""
    m, n = 5, 100_000
    keys = jax.random.split(jax.random.key(0), n)
    draw = jax.jit(jax.vmap(lambda key, is_gold: oracle_cite(key, is_gold, np.ones(m, bool)), in_axes=(0, None)))
    for g in range(m + 1):
        cited = np.asarray(draw(keys, np.arange(m) < g)).sum(1)
        want = ope_validation.expected_cited(g, m, DEFAULT_PRECISION, DEFAULT_RECALL)
        assert abs(cited.mean() - want) <= 5 * cited.std() / np.sqrt(n) + 1e-9, (g, cited.mean(), want)
    assert ope_validation.expected_cited(0, m, DEFAULT_PRECISION, DEFAULT_RECALL) == 0


def test_benchmark_truth_imports_no_ope():
    code = "import sys, ope_validation; sys.exit('rmm_jax.online.ope' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
