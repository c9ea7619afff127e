"""A generator's citation rates against gold, measured from its citation log.

The logistic loss corrects its rewards for a generator that cites a shown useful memory
with P(cite | useful) and any other shown memory with P(cite | not useful)
(``--p-useful``, ``--p-other``; :func:`rmm_jax.core.losses.citation_logistic_loss`).
``--preset calibrated`` assumes the paper's judge rates (0.911 and 0.154). Corrected for
the generator's own rates, the loss read against the best current score gains where it does
not uncorrected (``realistic``; ``citation_noise_matched.json``). The default, read against the
retriever's best score, learns uncorrected over most of that grid (``citation_noise.json``);
corrected for a generator's own rates it gained on the tuning conversations where the generator
cites other memories often (:data:`ADVISE_FROM`) and cost a little where it cites them at 0.1 to
0.3. Corrected for rates the generator does not have, it can lose. This module measures the
rates on logged calls that have gold, and says whether to correct for them (:func:`advice`):

* gold: the store's, for a question the store holds (an abstention question has none);
  else the record's ``gold``; a call without gold is not counted;
* every shown (``selected``) memory of a counted call is one trial, gold or not, cited
  or not;
* ``p_useful`` = cited gold / shown gold; ``p_other`` = cited others / shown others,
  pooled over every counted call, as the loss assumes. Its two parts are reported too:
  calls that show a gold memory, and calls that show none (a generator that cites
  something when nothing useful is shown: the simulators' ``spurious`` rate);
* intervals: a percentile bootstrap of each ratio of summed counts, over users, then
  calls within them (:func:`rmm_jax.online.stats.resample_counts`). The memories shown in
  one call, and the calls of one user, are not independent draws. Each bound is widened to
  at least the exact binomial (Clopper-Pearson) bound of the pooled counts at the same level
  (:func:`exact_interval`): when every trial agrees (7 of 7 cited) every resample gives the
  same ratio, and the bootstrap alone gave the zero-width [1, 1]; the bootstrap's bound is
  kept where it is wider (trials that cluster in calls).

Gold here stands for "useful": a generator that cites what helped the answer but not
the labelled evidence has a lower ``p_useful`` against gold than a judge would give it.
That is the rate the learner meets when it is measured against the same gold.

Examples:
  >>> import numpy as np
  >>> from rmm_jax.online.cite_rates import CallCounts, cite_rates
  >>> c = CallCounts(users=np.array([0, 0, 1]), user_ids=["a", "b"], calls=4,
  ...                gold_shown=np.array([1, 2, 0]), gold_cited=np.array([1, 1, 0]),
  ...                other_shown=np.array([2, 1, 0]), other_cited=np.array([0, 1, 0]),
  ...                none_shown=np.array([0, 0, 3]), none_cited=np.array([0, 0, 0]))
  >>> r = cite_rates(c, n_boot=200)
  >>> r["p_useful"]["value"], r["p_other"]["value"], r["p_other"]["shown"], r["calls_with_gold"]
  (0.6667, 0.1667, 6, 3)
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np

from rmm_jax.core.checks import short
from rmm_jax.data.citation_log import LogRecord, ReadReport, iter_numbered
from rmm_jax.data.log_vectors import known_ids
from rmm_jax.data.store import EmbeddingStore
from rmm_jax.deprecated import parameter as deprecated_parameter
from rmm_jax.errors import InputError
from rmm_jax.online.stats import resample_counts

DIGITS = 4                    # rates are reported to this many decimals
USERS_CACHED = 64              # store users whose questions count_calls keeps at hand


class CallCounts(NamedTuple):
    """Per counted call (a call with gold), T of them: its user (an index into
    ``user_ids``) and its shown and cited memories, split into gold memories, other
    memories of a call that shows gold, and memories of a call that shows none."""
    users: np.ndarray          # (T,) int
    user_ids: list[str]
    calls: int                 # calls read, counted or not
    gold_shown: np.ndarray     # (T,) int
    gold_cited: np.ndarray
    other_shown: np.ndarray
    other_cited: np.ndarray
    none_shown: np.ndarray
    none_cited: np.ndarray
    read: ReadReport | None = None     # what reading the log found (count_calls)


def _gold_of(store, rec: LogRecord, user_rows) -> frozenset | None:
    """The gold memory ids of one call (None: it has none); see the module docstring.
    ``user_rows(user_id)``: the store's user and its question id -> row map."""
    if store.has_user(rec.user_id) and rec.query_id is not None:
        u, rows = user_rows(rec.user_id)
        if rec.query_id in rows:
            row = rows[rec.query_id]
            if u.abstention[row]:
                return None
            gold = frozenset(np.asarray(u.memory_ids)[np.asarray(u.gold[row], bool)].tolist())
            return gold or None
    return frozenset(rec.gold) if rec.gold else None


def call_row(is_gold: np.ndarray, is_cited: np.ndarray) -> tuple[int, ...]:
    """One call's counts in :class:`CallCounts` order (gold shown, gold cited, other shown,
    other cited, shown when no gold is, cited when no gold is), from its shown memories'
    ``is_gold`` and ``is_cited`` (M,) bools."""
    is_gold, is_cited = np.asarray(is_gold, bool), np.asarray(is_cited, bool)
    any_gold = bool(is_gold.any())
    return (int(is_gold.sum()), int((is_gold & is_cited).sum()),
            int((~is_gold).sum()) if any_gold else 0, int((~is_gold & is_cited).sum()) if any_gold else 0,
            0 if any_gold else int(is_gold.size), 0 if any_gold else int(is_cited.sum()))


def counts_of(users: Sequence[int], rows: Sequence[tuple[int, ...]], user_ids: list[str], calls: int) -> CallCounts:
    """:class:`CallCounts` from each counted call's user index and :func:`call_row`."""
    cols = np.array(rows, np.int64).reshape(-1, 6).T
    return CallCounts(np.asarray(users, np.int64).reshape(-1), user_ids, calls, *cols)


def check_user_list(users) -> None:
    """``users`` is None (every user) or a list of distinct str ids, refused by name otherwise:
    a str was read letter by letter, an empty list meant every user, and a repeated id ran
    (and counted) its user twice."""
    if users is None:
        return
    if isinstance(users, str) or not all(isinstance(u, str) for u in users):
        raise InputError(f"expected a list of user ids (str), got {short(users)}", arg="users")
    if not len(users):
        raise InputError("is empty; give None for every user, or at least one user id", arg="users")
    seen: set[str] = set()
    twice = next((u for u in users if u in seen or seen.add(u)), None)
    if twice is not None:
        raise InputError(f"user id {twice!r} is given twice", arg="users")


def check_log_inputs(store, users) -> None:
    """What a reader of a citation log against ``store`` takes (:func:`count_calls`,
    :func:`rmm_jax.online.ope.load_calls`), and the streams of a store
    (:func:`rmm_jax.online.streams.check_users`), refused by name: an embedding store (a path was an
    AttributeError, 'str' object has no attribute 'user_ids') and ``users`` (:func:`check_user_list`)."""
    if not isinstance(store, EmbeddingStore):
        raise InputError(f"expected an embedding store, open_store(path), got {short(store)}", where="store")
    check_user_list(users)


def count_calls(store, log_path, *, users: Sequence[str] | None = None, skip_invalid: bool = False,
                report: dict | None = None) -> CallCounts:
    """Read a citation log against an embedding store (every record validated, as
    ``replay`` reads it) and count each call's shown and cited memories by gold
    (:class:`CallCounts`). ``users``: only their calls.

    A path for ``store`` was an AttributeError ('str' object has no attribute 'user_ids'),
    and a str ``users`` was read letter by letter ("user 'a' has no record"): both are
    refused by name. ``read``: the log's :class:`~rmm_jax.data.citation_log.ReadReport`
    (``report``, a dict filled with it, is deprecated)."""
    if report is not None:
        deprecated_parameter("count_calls", "report", "read the returned CallCounts' .read, a ReadReport")
    check_log_inputs(store, users)
    wanted = None if not users else set(users)

    @functools.lru_cache(maxsize=USERS_CACHED)
    def user_rows(user_id: str):
        u = store.user(user_id)
        return u, {q: i for i, q in enumerate(u.query_ids)}

    index: dict[str, int] = {}
    who, rows, calls, seen = [], [], 0, set()
    reading = iter_numbered(log_path, known=known_ids(store), skip_invalid=skip_invalid)
    for _, rec in reading:
        if wanted is not None and rec.user_id not in wanted:
            continue
        calls += 1
        seen.add(rec.user_id)
        gold = _gold_of(store, rec, user_rows)
        if gold is None:
            continue
        cited = set(rec.cited)
        who.append(index.setdefault(rec.user_id, len(index)))
        rows.append(call_row([m in gold for m in rec.selected], [m in cited for m in rec.selected]))
    read = reading.report
    if report is not None:
        report.update(read._asdict())
    missing = sorted((wanted or set()) - seen)
    if missing:
        raise InputError(f"user {missing[0]!r} has no record in {log_path}", arg="users")
    return counts_of(who, rows, list(index), calls)._replace(read=read)


def exact_interval(cited: int, shown: int, level: float = 0.95) -> tuple[float, float]:
    """The exact binomial (Clopper-Pearson) interval of ``cited`` successes in ``shown``
    independent trials at ``level``: Beta quantiles, (1 - level) / 2 beyond each end, and
    0 or 1 at an end the counts reach (0 of n: lo 0; n of n: hi 1).

    >>> from rmm_jax.online.cite_rates import exact_interval
    >>> [round(b, 4) for b in exact_interval(7, 7)], [round(b, 4) for b in exact_interval(0, 7)]
    ([0.5904, 1.0], [0.0, 0.4096])
    """
    from scipy.special import betaincinv  # the Beta quantile (scipy comes with JAX; imported here, when used)

    tail = (1 - level) / 2
    lo = 0.0 if cited == 0 else float(betaincinv(cited, shown - cited + 1, tail))
    hi = 1.0 if cited == shown else float(betaincinv(cited + 1, shown - cited, 1 - tail))
    return lo, hi


def _rate(cited: np.ndarray, shown: np.ndarray, counts: np.ndarray, level: float) -> dict:
    """``{value, lo, hi, shown, cited}`` of sum(cited) / sum(shown); value None when nothing
    was shown. Its interval: the percentile bootstrap over ``counts`` (n_boot, T), each bound
    widened to at least :func:`exact_interval`'s of the summed counts (the bootstrap is zero
    wide when every trial agrees)."""
    n_shown, n_cited = int(shown.sum()), int(cited.sum())
    if n_shown == 0:
        return {"value": None, "lo": None, "hi": None, "shown": 0, "cited": 0}
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = (counts @ cited) / (counts @ shown)
    lo, hi = np.nanquantile(boot, [(1 - level) / 2, (1 + level) / 2])
    exact_lo, exact_hi = exact_interval(n_cited, n_shown, level)
    return {"value": round(n_cited / n_shown, DIGITS), "lo": round(min(float(lo), exact_lo), DIGITS),
            "hi": round(max(float(hi), exact_hi), DIGITS), "shown": n_shown, "cited": n_cited}


# Where correcting today's default for a generator's own rates paid, on the conversations the
# defaults were tuned on (26 and 30: citation_noise_default_matched_tuned_on.json beside
# citation_noise_tuned_on.json, the same grid, seeds and citation draws): every cell from
# P(cite | useful) 0.7 and P(cite | not useful) 0.3 gained (+0.008 to +0.041); outside, it cost on
# average where the generator cites others at 0.1 to 0.3 (down to -0.032) and gained a little where it
# cites none. The bounds sit midway between the grid's cells. On 41-43, checked after the rule was fixed
# (citation_noise_default_matched.json), the region gained at P(cite | not useful) 0.4 and 0.5 and cost
# a little at 0.3 (docs/citations.md).
ADVISE_FROM = {"p_useful": 0.65, "p_other": 0.25}


def advice(useful: float | None, other: float | None, apart: bool) -> str:
    """What :func:`cite_rates` advises for measured rates, one of five names:
    ``correct`` (learn with ``--p-useful``/``--p-other`` set to them) when the two intervals
    are apart and both rates reach :data:`ADVISE_FROM`, where the correction paid;
    ``uncorrected`` when they are apart elsewhere, where it did not; ``uninformative`` when
    P(cite | useful) is not above P(cite | not useful); ``unmeasured`` when either rate has no
    memory of its kind shown (None: 0 / 0; it was called an overlap); ``overlap`` otherwise.

    Examples:
      >>> from rmm_jax.online.cite_rates import advice
      >>> advice(0.9, 0.3, True), advice(0.911, 0.154, True), advice(0.3, 0.4, False), advice(0.5, 0.4, False)
      ('correct', 'uncorrected', 'uninformative', 'overlap')
      >>> advice(None, 0.2, False), advice(0.8, None, False)
      ('unmeasured', 'unmeasured')
    """
    if useful is None or other is None:
        return "unmeasured"
    if useful <= other:
        return "uninformative"
    if not apart:
        return "overlap"
    return "correct" if useful >= ADVISE_FROM["p_useful"] and other >= ADVISE_FROM["p_other"] else "uncorrected"


def cite_rates(c: CallCounts, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """The rates of :class:`CallCounts` with their intervals, what to do with them
    (``advice``, :func:`advice`) and the options that correct the default's logistic loss
    for them: ``options`` is None unless the advice is ``correct``. The correction divides by
    the rates' difference, so it needs their intervals apart (rates that may be equal would
    make it noise), and it paid only where the generator cites other memories often
    (:data:`ADVISE_FROM`).

    Each interval (at ``level``) is the percentile bootstrap over users, then calls, with
    each bound widened to at least the exact binomial (Clopper-Pearson) bound of the pooled
    counts (:func:`exact_interval`). The bootstrap alone is zero wide when every trial
    agrees (7 of 7 gold memories cited gave [1, 1], and a correction was advised from it);
    the exact bound gives [0.5904, 1] there, and the bootstrap's bound stays where it is
    wider, as when trials cluster in calls.

    Raises:
      InputError: naming ``c`` unless it is a :class:`CallCounts` (:func:`count_calls`).
      ValueError: when no call has gold.
    """
    if not isinstance(c, CallCounts):      # a dict was an AttributeError ('dict' object has no attribute 'users')
        raise InputError(f"expected CallCounts, count_calls(store, log_path), got {short(c)}", arg="c")
    if c.users.size == 0:
        raise ValueError("no call has gold")
    counts = resample_counts(c.users, n_boot, np.random.default_rng(seed)).astype(np.float64)
    other_shown, other_cited = c.other_shown + c.none_shown, c.other_cited + c.none_cited
    useful, other = _rate(c.gold_cited, c.gold_shown, counts, level), _rate(other_cited, other_shown, counts, level)
    apart = useful["value"] is not None and other["value"] is not None and useful["lo"] > other["hi"]
    advised = advice(useful["value"], other["value"], apart)
    options = f"--p-useful {useful['value']} --p-other {other['value']}" if advised == "correct" else None
    return {"calls": c.calls, "calls_with_gold": int(c.users.size), "users": len(c.user_ids),
            "p_useful": useful, "p_other": other,
            "p_other_when_gold_shown": _rate(c.other_cited, c.other_shown, counts, level),
            "p_cite_when_no_gold_shown": _rate(c.none_cited, c.none_shown, counts, level),
            "apart": apart, "advice": advised, "options": options, "level": level, "resamples": n_boot,
            "resampled": ["user", "call"] if len(c.user_ids) > 1 else ["call"]}
