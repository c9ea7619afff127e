"""The online loop for library callers who keep everything in memory.

:func:`run_online` drives streams through the compiled loop and keeps what the events
carry (summaries, final states, log records); the CLI consumes the same events from
:func:`rmm_jax.online.driver.drive` and writes them to disk instead.

Examples:
  >>> import jax, rmm_jax as rj
  >>> from rmm_jax.data import make_synthetic  # doctest: +SKIP
  >>> result = run_online(streams, params, rj.Config(), cite_fn=precision_recall_oracle(0.9, 0.9))  # doctest: +SKIP
  >>> result.summary["recall@5"]  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from rmm_jax.core.update import CiteFn, Config
from rmm_jax.data.citations import check_rate, oracle_cite
from rmm_jax.errors import InputError
from rmm_jax.online.driver import ChunkDone, drive
from rmm_jax.online.loop import make_run
from rmm_jax.online.streams import Stream, log_records
from rmm_jax.online.summary import Summary, base_values


@dataclasses.dataclass
class OnlineResult:
    summary: dict          # prequential summary of the run (see rmm_jax.online.summary)
    base: dict             # the base retriever's summary on the same queries
    user_ids: list
    states: list           # per chunk: stacked UserState, host numpy
    chunk_users: list      # per chunk: user ids
    records: list          # log records (dicts), simulate only, when asked for
    recall: dict           # user id -> (T,) prequential Recall@M per query (stream order; valid ones count)


def precision_recall_oracle(precision: float, recall: float) -> CiteFn:
    """The precision/recall oracle (:func:`rmm_jax.data.citations.oracle_cite`) with its
    rates bound, checked here before any tracing. Not the class-calibrated
    :func:`rmm_jax.data.citations.oracle` of ``simulate --citations oracle``."""
    check_rate(precision, "precision", low_open=True)
    check_rate(recall, "recall", low_open=False)
    return functools.partial(oracle_cite, precision=precision, recall=recall)


def run_online(streams: Sequence[Stream], params, cfg: Config, *, cite_fn: CiteFn | None = None, seed: int = 0,
               users_per_chunk: int = 8, want_log: bool = False, mesh=None, shared=None) -> OnlineResult:
    """Simulate (``cite_fn`` given) or replay (the streams carry logged selections) over
    streams in memory; every user starts from ``params`` (the shared part from ``shared``
    when given, see :func:`rmm_jax.online.driver.drive`)."""
    online, base = Summary(cfg.m), Summary(cfg.m)
    states, chunk_users, records, recall = [], [], [], {}
    chunks = [streams[i:i + users_per_chunk] for i in range(0, len(streams), users_per_chunk)]
    program = make_run(cfg, cite_fn)
    for event in drive(chunks, params, cfg, program, seed=seed, users_per_chunk=users_per_chunk, mesh=mesh,
                       shared=shared):
        if not isinstance(event, ChunkDone):
            continue
        for s in event.streams:
            out = event.outputs[s.user_id]
            online.add(s.user_id, out["recall"], out["ndcg"], s.valid)
            recall[s.user_id] = out["recall"]
            base.add(s.user_id, *base_values(s, cfg.m), s.valid)
            if want_log and cite_fn is not None:
                records.extend(log_records(s, out["selected"], out["cited"], out["log_prob"]))
        states.append(event.states)
        chunk_users.append([s.user_id for s in event.streams])
    if not online.per_user:
        raise InputError("no users to run", where="users")
    return OnlineResult(online.result(), base.result(), [s.user_id for s in streams], states, chunk_users, records,
                        recall)


def simulate(streams: Sequence[Stream], params, cfg: Config, *, precision: float, recall: float,
             **kw) -> OnlineResult:
    """:func:`run_online` against the oracle citation simulator."""
    return run_online(streams, params, cfg, cite_fn=precision_recall_oracle(precision, recall), **kw)
