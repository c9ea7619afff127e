"""What a user's policy has learned from: the calls, remembered in bounded space, saved in
the user's row with the params that learned from them.

A nightly ``replay`` must learn every logged call exactly once, however often a log is
replayed, mixed with newer calls, or its run killed and started again. So a policy
remembers which calls it has learned from, as a Kafka consumer commits its offset with its
output: the record is one more part of the user's saved state (``learned`` in the row,
:mod:`rmm_jax.persist.policy_rows`), written in the same atomic step as the params, so the
two cannot disagree after a crash.

**What is remembered** (:class:`LearnedCalls`, 12 KiB a user at ``WINDOW = 512``; a user
whose policy never learned from a logged call, e.g. one only simulated, has none saved):

* the window: the last ``WINDOW`` calls learned, each as a 64-bit hash of its identity (the
  log's call key within the user: ``call_id``, else ``query_id``, else the query text), a
  64-bit hash of its content (what the learner reads of the record) and its timestamp in
  seconds (NaN: none), in a ring (slot ``i % WINDOW`` holds the ``i``-th call learned);
* ``count``: how many calls the policy has learned, ever;
* ``horizon``: the newest timestamp among the calls that have left the window (−inf: none
  has, or none that left had a timestamp). A time more than :data:`FUTURE_SKEW` after now
  (epoch milliseconds learned as seconds, before logs refused them) never becomes the
  horizon, and a horizon saved from one is not used: it would leave every later call of the
  user "older than what it has learned", never learned.

**How a call is sorted** (:func:`classify`), against what the user had learned before the run:

* its identity is in the window with the same content: *learned already*, skipped;
* its identity is in the window with other content: *changed*, the log was rewritten after
  it was learned (the caller's one-line error; ``--relearn`` learns it again);
* not in the window, and its timestamp is at or before the horizon: *older than what the
  user has learned*, skipped. It is older than calls that have left the window, so it was
  either learned and forgotten, or arrives too late to be learned in order; the user cannot
  tell which, and learning a call twice is the error this module exists to prevent;
* otherwise: *new*, learned. A call without a timestamp outside the window is new: give
  calls timestamps (or keep a user's calls per day below ``WINDOW``) and an old log
  replayed after a user has learned more than ``WINDOW`` calls is still recognised.

A call's identity is hashed to 64 bits, so two calls of one user in one window collide with
probability about ``WINDOW / 2**64`` (then the newer one reads as changed: an error, never a
silent skip). When several window slots hold one identity (``--relearn``), the newest counts.

Examples:
  >>> import numpy as np
  >>> from rmm_jax.persist.learned_calls import Calls, add, classify, empty, hash64
  >>> calls = Calls(np.array([hash64("call:a"), hash64("call:b")]), np.array([hash64("x"), hash64("y")]),
  ...               np.array([1.0, 2.0]))
  >>> seen = add(empty(window=4), calls)
  >>> int(seen.count), classify(seen, calls).known.tolist()
  (2, [True, True])
  >>> edited = calls._replace(digests=np.array([hash64("x"), hash64("z")]))
  >>> classify(seen, edited).changed.tolist()
  [False, True]
"""
from __future__ import annotations

import hashlib
import time
from typing import NamedTuple

import numpy as np

__all__ = ["WINDOW", "FUTURE_SKEW", "LearnedCalls", "Calls", "Sorted", "hash64", "empty", "classify", "add"]

WINDOW = 512
FUTURE_SKEW = 86_400.0      # seconds a timestamp may lie after now: clocks of the machines that log disagree


def _trusted(times, now: float | None = None):
    """``times`` (seconds) with those more than :data:`FUTURE_SKEW` after ``now`` (None: the
    clock's) as NaN: no horizon comes from a time in the future."""
    t = np.asarray(times, np.float64)
    return np.where(t > (time.time() if now is None else now) + FUTURE_SKEW, np.nan, t)


def _horizon(learned: "LearnedCalls", now: float | None = None) -> float:
    """``learned``'s horizon, −inf where it was saved from a time in the future: not used."""
    h = float(learned.horizon)
    return -np.inf if np.isnan(_trusted(h, now)) else h


class LearnedCalls(NamedTuple):
    """The calls one user's policy has learned from (module docstring); every leaf may carry
    a leading users axis (the store saves them stacked)."""
    keys: np.ndarray          # (W,) uint64: hash of each call's identity; slot i % W holds the i-th call learned
    digests: np.ndarray       # (W,) uint64: hash of its content
    times: np.ndarray         # (W,) float64: its timestamp in seconds, NaN: none
    count: np.ndarray         # () int64: calls learned, ever
    horizon: np.ndarray       # () float64: the newest timestamp among calls that left the window, -inf: none


class Calls(NamedTuple):
    """A user's calls in log order: identity hashes, content hashes, timestamps (NaN: none)."""
    keys: np.ndarray          # (T,) uint64
    digests: np.ndarray       # (T,) uint64
    times: np.ndarray         # (T,) float64

    def take(self, which) -> "Calls":
        """The calls at ``which`` (indices or a boolean mask), in order."""
        return Calls(self.keys[which], self.digests[which], self.times[which])


class Sorted(NamedTuple):
    """:func:`classify`'s answer, one flag per call: ``learn`` it; or it was learned already
    (``known``: same content; ``changed``: other content) or is ``older`` than the horizon."""
    learn: np.ndarray
    known: np.ndarray
    changed: np.ndarray
    older: np.ndarray


def hash64(text: str) -> np.uint64:
    """The first 8 bytes of sha256(``text``) as a little-endian uint64."""
    return np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], "<u8")[0]


def empty(window: int = WINDOW) -> LearnedCalls:
    """A policy that has learned from no call."""
    return LearnedCalls(np.zeros(window, np.uint64), np.zeros(window, np.uint64), np.full(window, np.nan),
                        np.array(0, np.int64), np.array(-np.inf))


def _window(learned: LearnedCalls) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The window's slots in the order their calls were learned, oldest first."""
    w, count = learned.keys.shape[0], int(learned.count)
    order = np.arange(max(count - w, 0), count) % w
    return learned.keys[order], learned.digests[order], learned.times[order]


def classify(learned: LearnedCalls, calls: Calls, *, relearn: bool = False) -> Sorted:
    """Sort ``calls`` against what ``learned`` remembers (module docstring). With
    ``relearn`` every call is learned, and the flags still say which were learned before."""
    keys, digests, _ = _window(learned)
    newest_first_keys, newest_first_digests = keys[::-1], digests[::-1]
    uniq, first = np.unique(newest_first_keys, return_index=True)     # the newest slot of each identity
    pos = np.minimum(np.searchsorted(uniq, calls.keys), max(len(uniq) - 1, 0))
    found = (uniq[pos] == calls.keys) if len(uniq) else np.zeros(len(calls.keys), bool)
    same = found & (newest_first_digests[first][pos] == calls.digests) if len(uniq) else found
    evicted = int(learned.count) > learned.keys.shape[0]
    older = ~found & evicted & (calls.times <= _horizon(learned))
    learn = np.ones(len(calls.keys), bool) if relearn else ~found & ~older
    return Sorted(learn, same, found & ~same, older)


def add(learned: LearnedCalls, calls: Calls) -> LearnedCalls:
    """``learned`` after learning ``calls``, in order: each goes into the ring, and calls
    pushed out of the window move the horizon up to their newest timestamp."""
    w, count, t = learned.keys.shape[0], int(learned.count), len(calls.keys)
    old = _window(learned)
    seq = [np.concatenate([a, b]) for a, b in zip(old, (calls.keys, calls.digests, calls.times))]
    total = count + t
    stay = min(total, w)
    now = time.time()           # once: the horizon kept and the times that leave are judged by one clock
    gone = _trusted(seq[2][:len(seq[2]) - stay], now)
    horizon = _horizon(learned, now)
    if gone.size and not np.all(np.isnan(gone)):
        horizon = max(horizon, float(np.nanmax(gone)))
    slots = np.arange(total - stay, total) % w
    out = [a.copy() for a in (learned.keys, learned.digests, learned.times)]
    for dst, src in zip(out, seq):
        dst[slots] = src[len(src) - stay:]
    return LearnedCalls(*out, np.array(total, np.int64), np.array(horizon))
