"""Uncertainty of a gain: mean ± 95% interval from a hierarchical bootstrap.

A gain is a paired difference per query, policy minus baseline, from S seeds on the same Q
queries: ``diffs`` of shape (S, Q). The point estimate is the mean over seeds and queries.
The interval is a percentile bootstrap over the levels the data were sampled at
(hierarchical or multi-stage bootstrap, Davison & Hinkley 1997, §3.8; Field & Welsh 2007),
and the result names them in ``resamples``:

* ``["seed", "query"]`` (no ``groups``): each replicate draws S seeds with replacement,
  then Q queries with replacement (the same queries for every drawn seed, as the runs
  share them), and takes the mean over both. It covers the run-to-run noise of online learning and
  the sampling of queries, *given these users*: the answer to "would another run on the
  same conversations give the same gain?".
* ``["conversation", "seed", "query"]`` (``groups``: the conversation, or user, of each
  query): each replicate first draws G of the G conversations with replacement, then S
  seeds, then, inside every drawn conversation, as many of its queries as it has, with
  replacement (a conversation drawn twice contributes two independent draws); the
  replicate is the mean over all drawn queries and seeds. Queries of one conversation
  share its users, topics and memory bank, so they are not independent draws from the
  population of conversations; this level answers "would other conversations give the
  same gain?". With G = 3 the interval is only approximate (see below).

A level with a single unit (one seed, one conversation) has nothing to resample and is
left out of ``resamples``. A gain whose interval contains 0 is called not significant.

Coverage of a nominal 95%, measured by simulation (gain 0.05, per-query noise σ 0.3,
3 seeds, conversation effects N(0, σ_c²); tests/test_stats.py with fixed seeds):

* Without groups, on independent queries, the interval is conservative (resampling queries
  inside resampled seeds counts the query noise twice): 0.99.
* 8 conversations of 80–120 queries, σ_c = 0.06: three levels 0.95; seed and query alone
  0.66, as they take these conversations as the whole population.
* 3 conversations of 80–120 queries, σ_c = 0.1: three levels 0.79, seed and query 0.46.
  A percentile bootstrap over 3 clusters cannot see how far a fourth could lie (its
  variance is (G − 1)/G of the truth, and 3 clusters have only 10 distinct resamples).
  With LoCoMo's shape (3 held-out conversations of 150–260 queries, σ_c = 0.03, about the
  spread of their per-conversation gains) a one-off simulation gave 0.88 against 0.68.
  Read a three-conversation interval as approximate, if anything too narrow, not as a
  calibrated 95%.

Examples:
  >>> import numpy as np
  >>> from rmm_jax.online.stats import gain_interval
  >>> rng = np.random.default_rng(0)
  >>> r = gain_interval(np.full((3, 50), 0.1) + rng.normal(0, 0.01, (3, 50)))
  >>> round(r["mean"], 2), r["significant"], r["resamples"]
  (0.1, True, ['seed', 'query'])
  >>> groups = np.repeat([0, 1, 2], [40, 60, 50])          # three conversations
  >>> d = 0.1 + np.array([-0.05, 0.0, 0.05])[groups] + rng.normal(0, 0.01, (3, 150))
  >>> r = gain_interval(d, groups=groups)
  >>> r["resamples"], r["groups"], r["lo"] < 0.07 and r["hi"] > 0.13   # the conversations' spread shows
  (['conversation', 'seed', 'query'], 3, True)
  >>> r2 = gain_interval(d)                                 # given these conversations: much narrower
  >>> bool(r2["hi"] - r2["lo"] < (r["hi"] - r["lo"]) / 5)
  True
"""
from __future__ import annotations

import numpy as np

from rmm_jax.core import checks
from rmm_jax.errors import InputError, check_int

# A 95% percentile interval puts 2.5% of the resamples beyond each end: with fewer than
# 1 / 0.025 = 40 a tail holds none, and the interval is a range of a handful of resamples (at 1
# or 0, a point that a verdict or an advice would read as a gain "above 0").
MIN_RESAMPLES = 40
#: More adds nothing an interval can show: at this count each end of a 95% interval has a
#: Monte-Carlo error of about 0.2% of its width (normal approximation: sqrt(p(1-p)/B) /
#: phi(1.96) in sd units, p = 0.025, against a width of 3.92 sd), while the resample table
#: (B, calls) grows with B (1e11 ran for minutes into gigabytes before this bound).
MAX_RESAMPLES = 100_000


def check_resamples(n: int, where: str = "bootstrap") -> None:
    """Refuse, as one line naming ``where`` (the argument; the CLI passes its option
    ``--bootstrap``), too few bootstrap resamples for a 95% interval, or more than
    :data:`MAX_RESAMPLES`.

    >>> from rmm_jax.online.stats import check_resamples
    >>> check_resamples(2000)
    >>> check_resamples(10**11)
    Traceback (most recent call last):
    ...
    rmm_jax.errors.InputError: bootstrap: must be <= 100000 (more adds no precision ...), got 100000000000
    """
    named = {"where": where} if where.startswith("--") else {"arg": where}    # an option as given, or the argument
    if n < MIN_RESAMPLES:
        raise InputError(f"must be >= {MIN_RESAMPLES} for a 95% interval (2.5% of the resamples beyond each "
                         f"end), got {n}", **named)
    if n > MAX_RESAMPLES:
        raise InputError(f"must be <= {MAX_RESAMPLES} (more adds no precision to a 95% interval), got {n}",
                         **named)


def resample_counts(groups, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """How often each of Q queries is drawn in each of ``n_boot`` replicates, (n_boot, Q)
    ints: G of the G groups (``groups``: a label per query) with replacement, then inside
    each drawn group as many of its queries as it has, with replacement (a group drawn
    twice gives two independent draws). One group: a plain bootstrap over queries. Any
    statistic of weighted queries (a mean, a ratio of summed counts) is then a product
    with these counts."""
    _, member = np.unique(np.asarray(groups), return_inverse=True)
    member = member.ravel()
    n_groups, q = int(member.max()) + 1, member.size
    drawn = (np.ones((n_boot, 1), np.int64) if n_groups == 1 else
             rng.multinomial(n_groups, np.full(n_groups, 1 / n_groups), size=n_boot))     # (n_boot, G)
    counts = np.zeros((n_boot, q), np.int64)
    # each group's queries in order (a stable sort keeps them ascending, as np.flatnonzero would)
    order = np.argsort(member, kind="stable")
    members = np.split(order, np.cumsum(np.bincount(member, minlength=n_groups))[:-1])
    for j, idx in enumerate(members):
        n = idx.size
        local = np.zeros(n_boot * n, np.int64)            # group j's columns only: O(n_boot · Q) over all groups
        rows = np.arange(n_boot)[:, None] * n
        for copy in range(int(drawn[:, j].max())):        # the copy-th draw of group j, where it was drawn that often
            pick = rng.integers(0, n, (n_boot, n)) + rows
            local += np.bincount(pick[drawn[:, j] > copy].ravel(), minlength=n_boot * n)
        counts[:, idx] += local.reshape(n_boot, n)
    return counts


def gain_interval(diffs, *, groups=None, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """``{mean, lo, hi, seeds, queries, groups, level, resamples, significant}`` of per-query
    paired ``diffs`` (S, Q); ``groups`` (Q,): the conversation (any label) of each query,
    which adds the conversation level (see the module docstring)."""
    # each refused by name: a level of 95 (for 0.95) was NumPy's "Quantiles must be in the range
    # [0, 1]", n_boot=0 "zero-size array to reduction operation maximum", a str diff "could not
    # convert string to float"
    if not (checks.is_real(level) and 0 < level < 1):
        raise InputError(f"must be a number in (0, 1), e.g. 0.95, got {level!r}"[:80], where="level")
    check_int(n_boot, "n_boot", 1, shown=repr, cut=80, where=True)
    try:
        d = np.asarray(diffs, np.float64)
    except (TypeError, ValueError):
        raise InputError(f"expected a (seeds, queries) array of numbers, got {type(diffs).__name__}"
                         f" {diffs!r}"[:100], where="diffs") from None
    if d.ndim == 1:
        d = d[None]
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"diffs: expected a non-empty (seeds, queries) array, got shape {d.shape}")
    s, q = d.shape
    g = np.zeros(q, int) if groups is None else np.asarray(groups)
    if g.shape != (q,):
        raise ValueError(f"groups: expected one label per query, shape ({q},), got {g.shape}")
    n_groups = len(np.unique(g))
    rng = np.random.default_rng(seed)
    per_query_mean = d[rng.integers(0, s, (n_boot, s))].mean(axis=1)   # (n_boot, Q): mean over drawn seeds
    counts = resample_counts(g, n_boot, rng)
    boot = (counts * per_query_mean).sum(axis=1) / counts.sum(axis=1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    levels = (("conversation", n_groups), ("seed", s), ("query", q))
    return {"mean": float(d.mean()), "lo": float(lo), "hi": float(hi), "seeds": s, "queries": q,
            "groups": n_groups, "level": level, "resamples": [name for name, n in levels if n > 1],
            "significant": bool(lo > 0 or hi < 0)}


def format_interval(r: dict) -> str:
    """``+0.0564 [+0.041, +0.072]`` (``n.s.`` appended when the interval contains 0)."""
    return f"{r['mean']:+.4f} [{r['lo']:+.3f}, {r['hi']:+.3f}]" + ("" if r["significant"] else " n.s.")
