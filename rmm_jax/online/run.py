"""The one consumer of the driver's events: summaries, plus whatever sinks the caller gives.

:func:`rmm_jax.online.driver.drive` yields what happened; a :class:`Recorder` keeps the
prequential summaries (online and base retriever) of every finished user and hands each
event to its sinks in order (:mod:`rmm_jax.online.sinks`: the policy store, the citation
log, the run-state), so the CLI, :func:`run_online` and the benchmarks share one loop
body::

    recorder = Recorder(program.layout.m, sinks=[PolicySink(store, program), LogSink(log)])
    for event in drive(chunks, program, params):
        recorder.feed(event)          # returns the number of users finished by the event
    result = recorder.result()

Examples:
  >>> import jax, rmm_jax as rj
  >>> from rmm_jax.data.citations import oracle
  >>> from rmm_jax.online.vectors import VectorSpec, vector_users
  >>> streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=6), seed=0, indices=[0, 1])
  >>> program = rj.make_run(*rj.preset("default", k=6, m=2), cite_fn=oracle())
  >>> result = rj.run_online(streams, program, rj.init_reranker(jax.random.key(0), 16))
  >>> result.summary["queries"], sorted(result.recall)
  (16, ['u0000000', 'u0000001'])
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from rmm_jax.core import checks
from rmm_jax.core.types import SharedState
from rmm_jax.deprecated import moved
from rmm_jax.errors import InputError, check_int
from rmm_jax.online.driver import (
    ChunkDone,
    ChunkSkipped,
    Event,
    SegmentDone,
    check_seed_and_chunk,
    drive,
    refuse_stream,
)
from rmm_jax.online.loop import Program
from rmm_jax.online.streams import Stream, log_records
from rmm_jax.online.summary import Summary, base_values


@dataclasses.dataclass
class OnlineResult:
    summary: dict          # prequential summary of the run (see rmm_jax.online.summary)
    base: dict             # the base retriever's summary on the same queries
    user_ids: list         # in the order the users finished
    states: list           # per chunk: stacked UserState, host numpy (when kept)
    chunk_users: list      # per chunk: user ids (when states are kept)
    records: list          # log records (dicts), simulate only, when asked for
    recall: dict           # user id -> (T,) prequential Recall@M per query (stream order; valid ones count)
    shared: SharedState | None = None   # the shared part after the last chunk


class Recorder:
    """Consumes :func:`rmm_jax.online.driver.drive`'s events (see the module docstring).

    ``sinks`` receive ``segment(SegmentDone)``, ``chunk(ChunkDone)`` and, for a chunk done
    before a resume, ``restore(ChunkSkipped) -> outputs`` (the first sink that has it).
    ``keep_states``: keep every chunk's final states in the result; ``keep_records``: keep
    the simulated citation-log records.

    Examples:
      ``feed`` counts the users each event finished (0 for a segment):

      >>> import jax, rmm_jax as rj
      >>> from rmm_jax import Recorder
      >>> from rmm_jax.data.citations import oracle
      >>> from rmm_jax.online.driver import drive
      >>> from rmm_jax.online.vectors import VectorSpec, vector_users
      >>> streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=6), seed=0, indices=[0, 1, 2])
      >>> program = rj.make_run(*rj.preset("default", k=6, m=2), cite_fn=oracle())
      >>> recorder = Recorder(program.layout.m)
      >>> events = drive([streams[:2], streams[2:]], program, rj.init_reranker(jax.random.key(0), 16),
      ...                users_per_chunk=2, segment_batches=2)
      >>> [recorder.feed(e) for e in events]
      [0, 2, 0, 1]
      >>> result = recorder.result()
      >>> result.summary["queries"], result.user_ids
      (24, ['u0000000', 'u0000001', 'u0000002'])
    """

    def __init__(self, m: int, *, sinks: Sequence = (), keep_states: bool = False, keep_records: bool = False):
        check_int(m, "m", 1, note=" (the program's layout.m)")         # 0 and "5" were taken
        self.m, self.sinks = int(m), list(sinks)
        self._m_checked = False
        self.keep_states, self.keep_records = keep_states, keep_records
        self.online, self.base = Summary(m), Summary(m)
        self.states, self.chunk_users, self.records, self.recall, self.user_ids = [], [], [], {}, []
        self.shared = None

    def feed(self, event: Event) -> int:
        """Take one event; returns how many users it finished (for a progress bar)."""
        match event:
            case SegmentDone():
                for s in self.sinks:
                    if hasattr(s, "segment"):
                        s.segment(event)
                return 0
            case ChunkSkipped(streams=streams):
                restorers = [s for s in self.sinks if hasattr(s, "restore")]
                if not restorers:
                    raise ValueError("resume: a skipped chunk needs a sink that restores its outputs")
                outputs = restorers[0].restore(event)
                if set(outputs) != {s.user_id for s in streams}:     # the resumed run made other chunks
                    raise InputError(f"users chunk {event.chunk + 1} holds other users than it did in the "
                                     f"interrupted run ({len(streams)} here, {len(outputs)} there), so that run "
                                     "cannot be resumed", arg="resume")
                self._check_m(streams, outputs)
                for s in self.sinks:
                    if hasattr(s, "replayed"):
                        s.replayed(event, outputs)
                self._add(streams, outputs)
                return len(streams)
            case ChunkDone(streams=streams, outputs=outputs):
                self._check_m(streams, outputs)         # before a sink saves what it would mislabel
                for s in self.sinks:
                    if hasattr(s, "chunk"):
                        s.chunk(event)
                self._add(streams, outputs)
                self.shared = event.shared
                if self.keep_states:
                    self.states.append(event.states)
                    self.chunk_users.append([s.user_id for s in streams])
                if self.keep_records:
                    self.records.extend(r for s in streams for r in chunk_records(s, outputs))
                return len(streams)
        raise TypeError(f"not a driver event: {event!r}")

    def _check_m(self, streams, outputs) -> None:
        """Refuse events of a program of another m than ours, once, from what shows it: the
        selections a simulation made, or those a replay's streams logged (which its program
        shows, :func:`rmm_jax.online.driver.drive`). ``Recorder(3)`` on an m=5 program
        reported recall@3 with recall@5's numbers."""
        if self._m_checked or not streams:
            return
        s = streams[0]
        sel = outputs[s.user_id].get("selected", s.selected)
        if sel is not None:
            if np.shape(sel)[-1] != self.m:
                raise InputError(f"is {self.m}, but the program's events show {np.shape(sel)[-1]} selections a query: "
                                 "build the Recorder with program.layout.m", arg="m")
            self._m_checked = True

    def _add(self, streams, outputs) -> None:
        for s in streams:
            n = s.first_pass                            # replay --passes: the first pass is scored
            out = {k: np.asarray(v)[:n] for k, v in outputs[s.user_id].items()}
            valid, shown = s.valid[:n], (out["n_cited"], out["n_shown"])
            self.online.add(s.user_id, out["recall"], out["ndcg"], valid, (out["hit"], *shown),
                            shown_recall=out.get("shown_recall"))    # absent from an older checkpoint
            self.base.add(s.user_id, *(np.asarray(v)[:n] for v in base_values(s, self.m)), valid,
                          (out["hit_base"], *shown))
            self.recall[s.user_id] = out["recall"]
            self.user_ids.append(s.user_id)

    def result(self) -> OnlineResult:
        if not self.online.per_user:
            raise InputError("no users to run", arg="users")
        return OnlineResult(self.online.result(), self.base.result(), self.user_ids, self.states, self.chunk_users,
                            self.records, self.recall, self.shared)


def chunk_records(stream: Stream, outputs: dict) -> list[dict]:
    """The citation-log records of one simulated user of a chunk (empty for a replay)."""
    out = outputs[stream.user_id]
    if "selected" not in out:
        return []
    return log_records(stream, out["selected"], out["cited"], out["log_prob"])


def run_online(streams: Sequence[Stream], program: Program, params, *, seed: int = 0, users_per_chunk: int = 8,
               want_log: bool = False, mesh=None, shared: SharedState | None = None) -> OnlineResult:
    """Simulate (``program`` built with a citation function) or replay (the streams carry
    logged selections) over ``streams`` in memory (any iterable of :class:`Stream`, not
    chunks of them), keeping the summaries, every chunk's final
    states and, with ``want_log``, the simulated log records. Every user starts from
    ``params``; the shared part from ``shared`` when given (see
    :func:`rmm_jax.online.driver.drive`).

    Examples:
      >>> import jax, rmm_jax as rj
      >>> from rmm_jax.data.citations import oracle
      >>> from rmm_jax.online.vectors import VectorSpec, vector_users
      >>> streams = vector_users(VectorSpec(dim=8, memories=12, queries=4, k=4), seed=0, indices=[0, 1, 2])
      >>> program = rj.make_run(*rj.preset("default", k=4, m=2), cite_fn=oracle())
      >>> result = rj.run_online(streams, program, rj.init_reranker(jax.random.key(0), 8), users_per_chunk=2,
      ...                        want_log=True)
      >>> result.user_ids, result.chunk_users, result.summary["queries"]
      (['u0000000', 'u0000001', 'u0000002'], [['u0000000', 'u0000001'], ['u0000002']], 12)
      >>> len(result.records), sorted(result.records[0])[:4]
      (12, ['candidates', 'cited', 'log_prob', 'query_id'])
      >>> 0 <= result.summary["recall@2"] <= 1 and set(result.base["per_user"]) == set(result.user_ids)
      True
    """
    refuse_stream(streams, "streams", "a list of streams", "run_online([stream], ...) runs one user")
    if isinstance(streams, (str, bytes)) or not hasattr(streams, "__iter__"):
        raise InputError(f"expected a list of streams, got {checks.short(streams)}", arg="streams")
    streams = list(streams)                 # any iterable of streams (a generator had no len())
    for i, s in enumerate(streams):
        if not isinstance(s, Stream):
            raise InputError(f"expected a Stream, got {type(s).__name__}: run_online takes the streams themselves "
                             "(it chunks them by users_per_chunk), not chunks of them", arg=f"streams {i}")
    check_seed_and_chunk(seed, users_per_chunk)
    chunks = [streams[i:i + users_per_chunk] for i in range(0, len(streams), users_per_chunk)]
    recorder = Recorder(program.layout.m, keep_states=True, keep_records=want_log)
    for event in drive(chunks, program, params, seed=seed, users_per_chunk=users_per_chunk, mesh=mesh,
                       shared=shared):
        recorder.feed(event)
    return recorder.result()


def final_params(result: OnlineResult, program: Program, user_id: str):
    """The reranker a user ended with in an in-memory run: its own part merged with the
    final shared part."""
    for users, ids in zip(result.states, result.chunk_users):
        if user_id in ids:
            local = jax.tree.map(lambda x: x[ids.index(user_id)], users.params)
            return program.layout.scope.merge(result.shared.params if result.shared is not None else {}, local)
    raise KeyError(user_id)


# moved to rmm_jax.data.citations (the data layer owns the citation models); the old path warns
__getattr__ = moved(__name__, {"precision_recall_oracle": "rmm_jax.data.citations"})
