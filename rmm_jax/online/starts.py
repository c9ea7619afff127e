"""Where each chunk's users start when a run continues from a policy store.

A run over a store that already holds policies goes on from them: every user of a chunk
that the store holds resumes from its newest saved version (params, optimiser state,
baseline, update count and PRNG key: :class:`rmm_jax.core.types.UserState`), and users new
to the store start from the run's starting policy. :func:`from_store` turns chunks of
streams into :class:`rmm_jax.online.driver.Chunk` s that carry those states; the driver
hands them to ``program.init``. A user's batches sample with ``fold_in(key, update
count)``, so replaying the first half of a log and then the second gives bit for bit the
policies of replaying the whole log once (for users independent of each other; with a
shared part, also when the halves split at a users chunk).

**Exactly once.** A user's saved state also remembers the calls its policy has learned
from (:mod:`rmm_jax.persist.learned_calls`), so a run that continues it learns each logged
call once: :func:`check_learned` sorts a log's calls against it before anything is written
(a call learned with other content is an error naming its line), and :func:`from_store`
leaves out the calls learned already. Replaying a log twice is then a no-op, a log that
mixes old and new calls learns the new ones in order, and a run killed after saving some
chunks and started again skips what those chunks saved, as one uninterrupted run would
have left it. Calls a run generates (``simulate``) are not remembered: each run draws new ones.
The store questions a ``simulate`` run learns from are: each saved version records their
positions (:func:`rmm_jax.online.sinks.simulated_queries`), and :func:`check_simulated`
refuses a run that would learn one of them again; a replay counts a logged call of such a
question (a simulate ``--log-out`` record: its ``query_id``, no ``call_id``) as learned
already (:func:`sort_calls`).

Examples:
  >>> import numpy as np
  >>> from rmm_jax.online.driver import Chunk
  >>> from rmm_jax.online.starts import from_store
  >>> class Empty:                                  # a store that holds nobody
  ...     def load_batch(self, ids, before=None):
  ...         from rmm_jax.persist.policy_store import SavedBatch
  ...         return SavedBatch([], None, [], [], [], list(ids), {})
  >>> [c.known for c in from_store([[]], Empty())]
  [None]
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from rmm_jax.data.citation_log import CONTENT_LEFT_OUT, call_key
from rmm_jax.errors import InputError, at, named
from rmm_jax.online.driver import Chunk
from rmm_jax.online.sinks import overlap, simulated_queries
from rmm_jax.online.streams import Stream, take_queries
from rmm_jax.persist.learned_calls import Calls, Sorted, classify, hash64

CHECK_USERS = 64             # users whose learned calls check_learned reads at a time
_NO_KEYS = np.zeros(0, np.uint64)   # simulated_keys of a user without simulated questions: one array for them all
_NO_KEYS.setflags(write=False)


def from_store(chunks: Iterable[Sequence[Stream]], store, *, before: int | None = None,
               relearn: bool = False, questions=None,
               simulated: Mapping[str, np.ndarray] | None = None, skip_changed: bool = False) -> Iterator[Chunk]:
    """Each chunk with the saved states of its users that ``store`` holds (their newest
    versions older than ``before``, see :meth:`PolicyStore.load_batch`); the others start
    afresh. Each chunk's users are read once, as the chunk is reached.

    Exactly once: a stream of logged calls (``Stream.calls``) keeps only the calls its
    user's policy has not learned from (:func:`rmm_jax.persist.learned_calls.classify`;
    every call with ``relearn``), and a user left with none leaves the chunk. Every stream
    carries what its policy had learned (``Stream.learned``), so the new version remembers
    that plus the stream's calls (:class:`rmm_jax.online.sinks.PolicySink`). Which calls go
    is decided against the versions older than ``before``, so a resumed run makes the same
    chunks as the run it resumes. ``questions``: the embedding store the users' questions come
    from (None: none), whose questions a user's ``simulate`` runs learned count as learned
    calls (:func:`sort_calls`). ``simulated``: per user, those questions' keys as
    :func:`check_learned` found them for the same ``before`` (``LearnedCheck.simulated``),
    not looked up again; a user it lacks is looked up in ``questions``. ``skip_changed``: a call
    learned with other content is left out, as :func:`check_learned` counted it."""
    for streams in chunks:
        streams = list(streams)
        got = store.load_batch([s.user_id for s in streams], before=before)
        row = {u: i for i, u in enumerate(got.users)}
        kept = []
        for s in streams:
            prior = jax.tree.map(lambda x: x[row[s.user_id]], got.learned) if s.user_id in row else None
            if prior is not None and s.calls is not None:
                keys = simulated.get(s.user_id) if simulated is not None else None
                if keys is None:
                    keys = simulated_keys(questions, s.user_id, got.infos[row[s.user_id]])
                sort = sort_calls(prior, s.calls, keys, relearn=relearn)
                if sort.changed.any() and not (relearn or skip_changed):     # check_learned refused it already
                    raise InputError(f"user {s.user_id!r}: a call learned already has other content (the log "
                                     "changed during the run?)", arg="chunks")
                if not sort.learn.all():
                    s = take_queries(s, np.flatnonzero(sort.learn))
                if not s.queries.shape[0]:
                    continue
            kept.append(dataclasses.replace(s, learned=prior))
        if not any(s.user_id in row for s in kept):
            yield Chunk(kept)
            continue
        take = np.array([row.get(s.user_id, 0) for s in kept])
        users = jax.tree.map(lambda x: np.asarray(x)[take], got.state)
        yield Chunk(kept, users, np.array([s.user_id in row for s in kept]))


def simulated_keys(questions, user_id: str, info: dict) -> np.ndarray:
    """The identities (:func:`rmm_jax.data.citation_log.call_key`, hashed) of the store
    questions that ``user_id``'s saved policy (its version's ``info``) learned from in
    ``simulate`` runs (:func:`rmm_jax.online.sinks.simulated_queries`), as a simulate log names
    them (``query_id``, no ``call_id``). ``questions``: the embedding store they are positions
    in (None, or one without the user: none)."""
    ranges = simulated_queries(info)
    if not ranges or questions is None or not questions.has_user(user_id):
        return _NO_KEYS
    ids = [str(r["id"]) for r in questions.query_rows(user_id)]   # its question ids only, not its embeddings
    return np.array([hash64(call_key(_Question(ids[p]))) for a, b in ranges for p in range(a, min(b, len(ids)))],
                    np.uint64)


class _Question(NamedTuple):
    """A store question as a simulate log record names it (what :func:`call_key` reads)."""
    query_id: str
    call_id: None = None
    query_text: None = None


def sort_calls(learned, calls: Calls, simulated: np.ndarray, *, relearn: bool = False) -> Sorted:
    """:func:`rmm_jax.persist.learned_calls.classify`, with a call named as a store question
    the user's policy learned in a ``simulate`` run (``simulated``: :func:`simulated_keys`)
    counted as learned already (``known``; learned only with ``relearn``): a simulate run draws
    its calls anew and remembers its questions, not the calls (a replay of its ``--log-out``
    learned them a second time). Only an untimed call is taken for a simulated one, as
    ``--log-out`` writes them: a served call (``rerank`` stamps its time) of the same question
    carries the application's citations, which no policy has learned."""
    sort = classify(learned, calls, relearn=relearn)
    if not len(simulated):
        return sort
    sim = np.isin(calls.keys, simulated) & np.isnan(calls.times) & ~sort.known & ~sort.changed & ~sort.older
    return sort._replace(known=sort.known | sim, learn=sort.learn if relearn else sort.learn & ~sim)


class LearnedCheck(NamedTuple):
    """What :func:`check_learned` found: calls to learn, calls skipped because the user's
    policy learned them already, and calls skipped as older than what it has learned;
    ``horizon``: the newest horizon (:mod:`rmm_jax.persist.learned_calls`, seconds) of the
    users with such calls (None: none); ``simulated``: per user the store holds, the keys of
    the store questions its ``simulate`` runs learned (:func:`simulated_keys`), for
    :func:`from_store` to sort the same calls without looking them up again."""
    learn: int
    known: int
    older: int
    horizon: float | None = None
    simulated: dict | None = None
    changed: int = 0                 # learned already with other content, left out (skip_changed)
    first_changed: str | None = None  # the first such call's one-line error


def check_learned(calls: dict[str, tuple[Calls, np.ndarray]], store, log_path, *, before: int | None,
                  relearn: bool = False, questions=None, skip_changed: bool = False) -> LearnedCheck:
    """Sort every logged call (``calls``: per user, its calls and their line numbers, from
    :func:`rmm_jax.online.streams.scan_log`) against what the user's policy in ``store`` has
    learned (versions older than ``before``), before the run writes anything. A call
    learned already with other content is the one-line error ``LOG:LINE`` (the log was
    rewritten after it was learned), unless ``relearn``. With ``relearn`` every call is
    learned, and ``known``/``older`` count those learned before. That error names ``relearn``
    (:func:`rmm_jax.errors.named`: ``relearn=True``, the CLI's ``--relearn``). ``questions``:
    the embedding store, whose questions a user's ``simulate`` runs learned count as learned
    (``known``; :func:`sort_calls`), as :func:`from_store` counts them. ``skip_changed``
    (``replay --skip-invalid``): a call learned with other content is left out and counted
    (``changed``, ``first_changed`` its one-line error) instead of refusing the log: one call
    re-logged with late citations blocked a whole night, and ``relearn`` learns every call again."""
    tally = LearnedTally(calls, log_path, relearn=relearn, questions=questions, skip_changed=skip_changed)
    users = list(calls)
    for i in range(0, len(users), CHECK_USERS):
        tally.add(store.load_batch(users[i:i + CHECK_USERS], before=before))
    return tally.result()


class LearnedTally:
    """:func:`check_learned`'s sort, one loaded batch of users at a time
    (:meth:`PolicyStore.load_batch`'s :class:`~rmm_jax.persist.policy_store.SavedBatch`, with
    ``learned`` and ``infos``): for a reader that loads the users' states anyway, as
    ``evaluate`` loads their policies, so that each state is read and verified once.
    ``add`` raises what :func:`check_learned` raises; ``result`` is its :class:`LearnedCheck`."""

    def __init__(self, calls: dict[str, tuple[Calls, np.ndarray]], log_path, *, relearn: bool = False,
                 questions=None, skip_changed: bool = False):
        self.calls, self.log_path = calls, log_path
        self.relearn, self.questions, self.skip_changed = relearn, questions, skip_changed
        self.learn = self.known = self.older = self.changed = 0
        self.first_changed: str | None = None
        self.horizon: float | None = None
        self.simulated: dict[str, np.ndarray] = {}

    def add(self, got) -> None:
        """Sort the calls of ``got``'s users (those it holds, and those it misses: all new)."""
        relearn = self.relearn
        for j, u in enumerate(got.users):
            mine, lines = self.calls[u]
            self.simulated[u] = simulated_keys(self.questions, u, got.infos[j])
            sort = sort_calls(jax.tree.map(lambda x: x[j], got.learned), mine, self.simulated[u],  # noqa: B023
                              relearn=relearn)
            if sort.changed.any() and not relearn:
                line = int(lines[np.flatnonzero(sort.changed)[0]])
                error = InputError(f"user {u!r}: this call was learned with other content (every log key but "
                                   f"{', '.join(CONTENT_LEFT_OUT)} is read: a log_prob rounded or a text re-spaced "
                                   "since is other content): the log was rewritten after it was learned, or it is "
                                   "another call under the same name (give each call its own call_id); "
                                   f"{named('relearn', True)} learns the log's calls again",
                                   where=at(self.log_path, line))
                if not self.skip_changed:
                    raise error
                self.changed += int(sort.changed.sum())
                self.first_changed = self.first_changed or str(error)
            # learned again with relearn, left out with skip_changed (counted apart, in changed)
            self.known += int(sort.known.sum() + (sort.changed.sum() if relearn else 0))
            self.older += int(sort.older.sum())
            self.learn += int(sort.learn.sum())
            if sort.older.any():
                h = float(got.learned.horizon[j])
                self.horizon = h if self.horizon is None else max(self.horizon, h)
        self.learn += sum(len(self.calls[u][1]) for u in got.missing)

    def result(self) -> LearnedCheck:
        return LearnedCheck(self.learn, self.known, self.older, self.horizon, self.simulated, self.changed,
                            self.first_changed)


def check_simulated(store, counts: dict[str, int], queries: tuple[int, int | None], *,
                    relearn: bool = False) -> int:
    """Refuse a ``simulate`` run that continues ``store`` over questions a user's policy has
    learned from in an earlier simulate run: ``counts``, the questions each user run holds;
    ``queries``, the run's ``(start, stop)`` of each user's questions (``stop`` None: all).
    The one-line error, naming ``queries`` (the CLI's ``--queries``), names the first such
    user and how many of its questions, the range from which every user run has only new
    questions (none: say so), that users who stopped at different questions run apart, and
    that ``relearn`` (``--relearn``) learns them again. Returns how many questions the run
    learns again (0 unless ``relearn``).

    Examples:
      >>> from rmm_jax.online.starts import check_simulated
      >>> class Store:                                # user a learned its questions 0-11 before
      ...     def listing(self, ids):
      ...         return [("a", [], {"simulated_queries": [[0, 12]]})]
      >>> check_simulated(Store(), {"a": 21}, (12, None))
      0
      >>> check_simulated(Store(), {"a": 21}, (8, None), relearn=True)
      4
      >>> check_simulated(Store(), {"a": 21}, (8, None))
      Traceback (most recent call last):
      ...
      rmm_jax.errors.InputError: queries: the policy of user 'a' has learned 4 of its questions 8:21 in an \
earlier simulate run (it learned 0:12); from question 12 on every user's are new: give queries from 12 on; \
or relearn=True learns these again
    """
    again, first, ends, most = 0, None, {}, 0
    for u, _, info in store.listing(list(counts)):
        n, ranges = counts[u], simulated_queries(info)
        span = (min(queries[0], n), n if queries[1] is None else min(queries[1], n))
        mine = overlap(ranges, span)
        if mine:
            ends[u] = max(b for a, b in ranges if b > span[0])
            first = first or (u, mine, span, ", ".join(f"{a}:{b}" for a, b in ranges))
        most, again = max(most, span[1]), again + mine
    if first is None or relearn:
        return again
    u, mine, span, learned = first
    free = max(ends.values())       # at and after it no user run has learned a question
    stop = queries[1]
    nothing_new = free >= (most if stop is None else min(stop, most))
    new = (f"every question of {'this user' if len(counts) == 1 else 'these users'} in that range is learned"
           if nothing_new else f"from question {free} on every user's are new: give {named('queries')} from {free} "
                               "on")
    apart = ("; users stopped at different questions (" + ", ".join(f"{v} at {e}" for v, e in list(ends.items())[:3])
             + "): run them apart with " + named("users")) if len(set(ends.values())) > 1 else ""
    raise InputError(f"the policy of user {u!r} has learned {mine} of its questions {span[0]}:{span[1]} in an "
                     f"earlier simulate run (it learned {learned}); {new}{apart}; or {named('relearn', True)} learns "
                     "these again", arg="queries")
