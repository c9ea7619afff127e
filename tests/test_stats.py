"""The gain interval covers the true gain (fixed seeds) and flags a null gain as not significant."""
import numpy as np

from rmm_jax.online.stats import format_interval, gain_interval


def test_interval_covers_the_true_gain_at_least_nominally():
    rng = np.random.default_rng(1)
    hits = 0
    for i in range(200):
        d = 0.05 + rng.normal(0, 0.3, (3, 300)) + rng.normal(0, 0.01, (3, 1))
        r = gain_interval(d, n_boot=400, seed=i)
        hits += r["lo"] <= 0.05 <= r["hi"]
    assert hits / 200 >= 0.93


def test_interval_is_not_wider_than_needed_and_null_gains_are_not_significant():
    rng = np.random.default_rng(2)
    r = gain_interval(rng.normal(0, 0.3, (3, 300)), n_boot=1000)
    assert not r["significant"] and "n.s." in format_interval(r)
    # the interval is about ±1.96·σ/√Q·√2 at most (conservative by at most √2 here)
    assert r["hi"] - r["lo"] < 2 * 1.96 * 0.3 / np.sqrt(900) * 1.6
    big = gain_interval(0.2 + rng.normal(0, 0.3, (3, 300)), n_boot=1000)
    assert big["significant"] and big["lo"] > 0.1
