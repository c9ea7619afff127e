"""Where a run's results go: the sinks a :class:`rmm_jax.online.run.Recorder` hands events to.

Each sink takes only the events it cares about (a method per event kind), in the order
the caller lists them; the CLI lists the policy store, then the citation log, then the
run-state, so a checkpoint that counts a chunk as done always comes after that chunk's
policies and log records were written.

* :class:`PolicySink`: every finished chunk's users go to the policy store as one new
  version, each with the calls its policy has learned from, in the same row; in scopes
  with a shared part, that part is saved first and the users' version records it.
* :class:`LogSink`: the simulated citation-log records of every finished (or restored)
  chunk.
* :class:`RunStateSink`: checkpoints (:mod:`rmm_jax.persist.runstate`) at every segment
  and chunk, and the saved outputs of chunks done before a resume.
"""
from __future__ import annotations

import jax
import numpy as np

from rmm_jax.errors import Diverged
from rmm_jax.online.driver import ChunkDone, ChunkSkipped, Resume, SegmentDone
from rmm_jax.online.loop import Program
from rmm_jax.online.run import chunk_records
from rmm_jax.persist.learned_calls import LearnedCalls, add, empty
from rmm_jax.persist.run_saves import chunk_saves


def user_info(stream, outputs: dict, m: int, before: int = 0, simulated: list | None = None,
              start: int | None = None) -> dict:
    """The JSON info stored with a user's new policy version: ``queries_seen``, the queries of
    this run; ``queries_learned``, of every run the policy has learned from (``before`` of the
    runs it continues; like its learner step, it counts from the policy's start); this run's
    prequential Recall@M; and ``simulated_queries``, the store questions its simulate runs
    learned from (``simulated``, the runs it continues, plus this run's when it simulated the
    user's questions from position ``start``; see :func:`add_range`)."""
    out = outputs[stream.user_id]
    n = stream.first_pass                      # replay --passes: the log's queries, once
    info = {"queries_seen": n, "queries_learned": before + n,
            f"prequential_recall@{m}": float(out["recall"][stream.valid].mean()) if stream.valid.any() else None}
    ranges = add_range(simulated or [], (start, start + n)) if start is not None else (simulated or [])
    return {**info, "simulated_queries": ranges} if ranges else info


def queries_learned(info: dict) -> int | None:
    """Queries a saved policy has learned from, over all its runs (a store written before this
    was recorded keeps only its last run's, ``queries_seen``)."""
    return info.get("queries_learned", info.get("queries_seen"))


def simulated_queries(info: dict) -> list[list[int]]:
    """The store questions a saved policy learned from in ``simulate`` runs, as sorted,
    disjoint ``[start, end)`` ranges of positions in its user's questions (none recorded:
    ``[]``; replay's logged calls are remembered apart, :mod:`rmm_jax.persist.learned_calls`)."""
    return [list(r) for r in info.get("simulated_queries", [])]


def add_range(ranges: list, new: tuple[int, int]) -> list[list[int]]:
    """``ranges`` (sorted, disjoint ``[start, end)``) with ``new`` added, touching ones merged.

    Examples:
      >>> from rmm_jax.online.sinks import add_range
      >>> add_range([[0, 12]], (12, 21))
      [[0, 21]]
      >>> add_range([[0, 4], [10, 12]], (6, 8))
      [[0, 4], [6, 8], [10, 12]]
    """
    out: list[list[int]] = []
    for a, b in sorted([*map(tuple, ranges), tuple(new)]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(ranges: list, new: tuple[int, int]) -> int:
    """How many positions of ``new`` (``[start, end)``) lie in ``ranges``.

    Examples:
      >>> from rmm_jax.online.sinks import overlap
      >>> overlap([[0, 12]], (8, 20)), overlap([[0, 12]], (12, 20))
      (4, 0)
    """
    return sum(max(0, min(b, new[1]) - max(a, new[0])) for a, b in ranges)


class PolicySink:
    """Saves each finished chunk to a :class:`rmm_jax.persist.policy_store.PolicyStore`: in
    scopes with a shared part, that part first (a new shared version), then the chunk's
    users as one version that records the shared version they were trained against.
    ``continues``: users the store holds continue from their saved policies (their versions
    older than ``before``; None: their newest), so their query counts continue from those.
    ``run``: what every version saved records of the run
    (:mod:`rmm_jax.persist.policy_rollback`; None: nothing). ``resumed``: the run resumes an
    interrupted one whose saves are the store's versions from this number on (its
    ``first_version``; None: not resumed), so a chunk it does again, whose users the
    interrupted run saved before its checkpoint, is not saved a second time
    (:func:`rmm_jax.persist.run_saves.chunk_saves`): exactly once."""

    def __init__(self, store, program: Program, continues: bool = False, run: dict | None = None,
                 first_query: int | None = None, before: int | None = None, resumed: int | None = None):
        self.store, self.program, self.continues, self.run = store, program, continues, run
        self.first_query = first_query      # simulate: its streams are the users' questions from this position
        self.before, self.resumed = before, resumed
        self.saved = 0                      # users chunks this run has saved

    def chunk(self, event: ChunkDone) -> None:
        m = self.program.layout.m
        uids = [s.user_id for s in event.streams]
        infos = {}
        if self.continues or self.resumed is not None:
            had = chunk_saves(self.store, uids, before=self.before, first_version=self.resumed)
            if had.saved:           # the interrupted run saved this chunk: these states, bit for bit
                return
            infos = had.infos if self.continues else {}
        check_finite_chunk(event, self.program, self.saved, self.store.path)
        shared_version = self.save_shared(event) if self.program.layout.scope.has_shared else None
        self.store.save(uids, event.states,
                        [user_info(s, event.outputs, m, queries_learned(infos.get(s.user_id, {})) or 0,
                                   simulated_queries(infos.get(s.user_id, {})), self.first_query)
                         for s in event.streams], shared_version=shared_version,
                        learned=learned_after(event.streams), run=self.run)
        self.saved += 1

    def save_shared(self, event: ChunkDone) -> int:
        return self.store.save_shared(event.shared, {"source": "online"})


def check_finite_chunk(event: ChunkDone, program: Program, saved: int = 0, store=None) -> None:
    """:class:`~rmm_jax.errors.Diverged` unless every parameter the chunk would save is finite,
    and small enough that no score overflows (:func:`_row_bounds`): a learning setting that
    diverges (a step size far out of scale: ``--lr 1e30``) made NaN of every policy, which the
    store saved with exit 0, and ``rerank`` then blamed the embeddings.
    Nothing of the chunk is saved; the ``saved`` users chunks this run saved before it keep
    their versions, which the message says how to undo (``policies rollback`` on ``store``)."""
    n = len(event.streams)
    user_finite, user_log = _row_bounds(event.states.params, n)
    shared_finite, shared_log = _row_bounds(event.shared.params, None)
    shared = ~shared_finite | (shared_log > _LOG_MAX)
    users = ~user_finite | (user_log + shared_log[0] > _LOG_MAX)       # a user's score: its part and the shared
    if users.any() or shared.any():
        who = (f"the policy of user {event.streams[int(np.argmax(users))].user_id!r}" if users.any()
               else "the shared part")
        lr, est = getattr(program.optimizer, "lr", None), program.estimator
        setting = (f"lr {lr:g}, " if lr is not None else "") + f"tau {est.tau:g}, loss {est.loss}"
        earlier = "" if not saved else (
            f"; users chunks this run saved before it ({saved}) keep what they learned at this setting: "
            f"`rmm-jax policies rollback {store}` undoes them, and their calls are learned again")
        raise Diverged(f"the learning diverged: {who} is not finite after its updates, or so large its scores "
                       f"overflow float32 ({setting}); nothing of this "
                       f"users chunk was saved, nor the run-state kept{earlier}: a smaller --lr (or a --tau, --offset "
                       "or judge rates in scale) learns", where="--lr")


#: log of float32's largest: past it a score overflows.
_LOG_MAX = float(np.log(np.finfo(np.float32).max))


def _row_bounds(tree, n: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of the leading (users) axis, the first ``n`` of it (``n`` None: one row, the
    whole tree: the shared part), whether every leaf of ``tree`` is finite there, and the log of
    Π (1 + ‖leaf‖_F). For unit-norm embeddings (as the embedder writes them) that product bounds
    every score's magnitude, each kind and scope alike: a score composes residual maps
    (I + W, I + A Bᵀ, an MLP's layers through GELU, |gelu(t)| <= |t|), each at most 1 plus its
    leaves' norms. ``--lr 1e30`` left finite params of about 1e33 and every score NaN (saved,
    and ``rerank`` then blamed the embeddings); an mlp at ``--lr 1e8`` and hybrid factors at
    ``--lr 1e12`` overflowed with every entry far below a per-entry limit. A policy that learns
    stays many orders of magnitude below float32's largest."""
    rows_n = 1 if n is None else n
    finite, log_bound = np.ones(rows_n, bool), np.zeros(rows_n)
    for leaf in jax.tree.leaves(tree):
        x = np.asarray(leaf)
        rows = x.reshape(1, -1) if n is None else x[:n].reshape(n, -1)
        for lo in range(0, rows_n, _BOUND_ROWS):        # a few users at a time: a chunk's d x d kernels
            block = rows[lo:lo + _BOUND_ROWS]
            if block.dtype not in (np.float32, np.float64):  # bfloat16, float16: einsum's float64 takes these two
                block = block.astype(np.float64)
            ok = np.isfinite(block).all(1)
            finite[lo:lo + _BOUND_ROWS] &= ok
            # sums of squares accumulated in float64 (a float32 entry's square is exact there) with no float64
            # copy of the block: 3-5x faster than astype, where and ** (2.1 s of a 300-user simulate's 17 s)
            with np.errstate(over="ignore", invalid="ignore"):   # float64 entries past 1e154 square to inf: a
                sq = np.einsum("ij,ij->i", block, block, dtype=np.float64)   # bound of inf, as it is
            log_bound[lo:lo + _BOUND_ROWS] += np.log1p(np.sqrt(np.where(ok, sq, 0.0)))
    return finite, log_bound


_BOUND_ROWS = 16           # users whose leaf _row_bounds holds in float64 at once (16 x 384² x 8 B: 19 MB)


def learned_after(streams) -> LearnedCalls | None:
    """The calls each stream's policy has learned from once the stream is learned, stacked:
    what it had learned (``Stream.learned``; none if None) plus the stream's logged calls
    (``Stream.calls``; a run's generated calls are not remembered). None when no stream's
    policy has learned from a logged call."""
    if all(s.learned is None and s.calls is None for s in streams):
        return None
    rows = []
    for s in streams:
        had = s.learned if s.learned is not None else empty()
        rows.append(had if s.calls is None else add(had, s.calls))
    return jax.tree.map(lambda *xs: np.stack(xs), *rows)


class LogSink:
    """Writes the simulated citation-log records to a :class:`rmm_jax.data.citation_log.LogWriter`."""

    def __init__(self, writer):
        self.writer = writer

    def chunk(self, event: ChunkDone) -> None:
        self.writer.write([r for s in event.streams for r in chunk_records(s, event.outputs)])

    def replayed(self, event: ChunkSkipped, outputs: dict) -> None:
        self.writer.write([r for s in event.streams for r in chunk_records(s, outputs)])


class RunStateSink:
    """Checkpoints to a :class:`rmm_jax.persist.runstate.RunState` and restores skipped chunks.

    Every checkpoint also holds ``trees`` and ``meta`` the caller gives once (where the run
    started: new users' params, which store versions users continue from), so a resumed run
    starts where the interrupted one did."""

    def __init__(self, runstate, trees: dict | None = None, meta: dict | None = None):
        self.rs, self.trees, self.meta = runstate, dict(trees or {}), dict(meta or {})

    def begin(self, shared) -> Resume:
        """A checkpoint of the start (no chunk done, the shared part ``shared``), written before
        the run writes anything else; returns it as the :class:`Resume` to drive from."""
        resume = Resume(0, shared=shared)
        self._checkpoint(resume)
        return resume

    def segment(self, event: SegmentDone) -> None:
        self._checkpoint(event.resume())

    def chunk(self, event: ChunkDone) -> None:
        self.rs.save_done(event.chunk, event.outputs)
        self._checkpoint(event.resume())

    def restore(self, event: ChunkSkipped) -> dict:
        return self.rs.load_done(event.chunk)

    def _checkpoint(self, resume: Resume) -> None:
        self.rs.save({"chunks_done": resume.chunks_done, "segments_done": resume.segments_done, **self.meta},
                     {"states": resume.states, "outputs": resume.outputs, "shared": resume.shared, **self.trees})


def resume_point(runstate) -> Resume | None:
    """The :class:`Resume` of a run-state's restored checkpoint (None: start afresh); what to
    tell the user about it is :func:`resume_note`."""
    ck = runstate.restored if runstate is not None else None
    if ck is None:
        return None
    m, t = ck.meta, ck.trees
    return Resume(m["chunks_done"], m["segments_done"], t["states"], t["outputs"], t["shared"])


def resume_note(runstate) -> str | None:
    """The line that tells the user where a run resumes from the run-state's restored
    checkpoint (None: it starts afresh), shown as the run starts."""
    ck = runstate.restored if runstate is not None else None
    if ck is None:
        return None
    done, segments = ck.meta["chunks_done"], ck.meta["segments_done"]
    return (f"resuming from {ck.path.name}: {done} users chunks done"
            + (f", users chunk {done + 1} at segment {segments}" if segments else ""))
