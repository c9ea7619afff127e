"""The host driver: chunks of users through the compiled loop, as a stream of events.

:func:`drive` takes an iterable of stream chunks and runs each through the program that
:func:`rmm_jax.online.loop.make_run` built, in segments of at most a given number of batches.
It saves nothing and calls nothing back: it *yields* what happened, and the caller
decides what to keep::

    program = make_run(layout, estimator, optimizer, cite_fn)     # built once
    for event in drive(chunks, program, params, segment_batches=16, resume=resume):
        match event:
            case SegmentDone():   runstate.save(...)        # a resumable point in a chunk
            case ChunkSkipped():  outputs = runstate.load_done(event.chunk)
            case ChunkDone():     policies.save(...); log.write(...)

Determinism: every user's PRNG key derives from the seed and its id, batch i samples
with ``fold_in(key, i)``, and every segment of a chunk is a call of one compiled program
(the batch range is an argument, not a shape), so a run resumed from a :class:`SegmentDone`,
or cut into segments of another length, runs the same machine code on the same inputs as
an uninterrupted one: its results are bit-identical.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterable, Iterator, NamedTuple, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from rmm_jax.core import checks
from rmm_jax.core.types import SharedState, UserState
from rmm_jax.errors import InputError, check_int
from rmm_jax.online.loop import LoopState, Program, per_query, segment_plan
from rmm_jax.online.sharding import replicate, shard_users
from rmm_jax.online.streams import Stream, user_keys
from rmm_jax.persist.policy_checks import check_params

OUTPUT_KEYS = ("recall", "ndcg", "selected", "cited", "log_prob",   # per-query outputs kept per user
               "hit", "hit_base", "n_cited", "n_shown", "shown_recall")


class Chunk(NamedTuple):
    """A chunk of streams whose users may continue from saved states (a policy store's):
    stream i starts from row i of ``users`` where ``known[i]``, and afresh otherwise. A
    plain sequence of streams is a chunk where every user starts afresh."""
    streams: list[Stream]
    users: UserState | None = None     # stacked over the streams (host arrays); rows of unknown users unused
    known: np.ndarray | None = None    # (len(streams),) bool


class Resume(NamedTuple):
    """Where an interrupted run stands: ``chunks_done`` chunks are complete, leaving the
    shared part ``shared``; the next one has run ``segments_done`` segments, reaching
    ``states`` (a :class:`LoopState`, padded users axis) with the raw ``outputs`` of those
    segments (batches on axis 1)."""
    chunks_done: int
    segments_done: int = 0
    states: LoopState | None = None
    outputs: dict | None = None
    shared: SharedState | None = None


class SegmentDone(NamedTuple):
    """A segment of chunk ``chunk`` ran and more remain: a point to checkpoint."""
    chunk: int
    segments_done: int
    states: LoopState         # users stacked over the padded users axis, and the shared part; host arrays
    outputs: dict             # raw outputs of the chunk's segments so far

    def resume(self) -> Resume:
        return Resume(self.chunk, self.segments_done, self.states, self.outputs, self.states.shared)


class ChunkDone(NamedTuple):
    """Chunk ``chunk`` ran to the end of every stream."""
    chunk: int
    streams: list[Stream]
    states: UserState         # final per-user states, users axis first (padding users removed), host arrays
    outputs: dict             # user id -> {key in OUTPUT_KEYS: (T_user, ...) array}
    shared: SharedState       # the shared part after this chunk (empty trees in scope ``user``)

    def resume(self) -> Resume:
        return Resume(self.chunk + 1, shared=self.shared)


class ChunkSkipped(NamedTuple):
    """Chunk ``chunk`` was completed before the run was resumed; its outputs are the caller's."""
    chunk: int
    streams: list[Stream]


Event = SegmentDone | ChunkDone | ChunkSkipped

UNFIT = "the saved policies do not fit"     # how drive's error of saved states that do not fit the program begins


def drive(chunks: Iterable[Sequence[Stream] | Chunk], program: Program, params, *, seed: int = 0,
          users_per_chunk: int = 8, segment_batches: int | None = None, resume: Resume | None = None,
          mesh=None, shared: SharedState | None = None) -> Iterator[Event]:
    """Run ``program`` (:func:`rmm_jax.online.loop.make_run`) over ``chunks``, each at
    most ``users_per_chunk`` streams.

    Streams that carry logged selections are replayed (the program must be built
    without a citation function). Every user starts from ``params`` with a fresh
    optimiser and ``user_key(seed, user_id)`` (``program.init``), except the users a
    :class:`Chunk` carries saved states for, which continue from them. The shared part (scopes
    ``shared``/``hybrid``) starts from ``params``, or from ``shared`` when given, and is
    carried from chunk to chunk in order: with ``users_per_chunk=1`` each user sees only
    the updates of the users before it. Each chunk runs as segments of at most
    ``segment_batches`` batches (:func:`rmm_jax.online.loop.segment_plan`; None: one
    segment), each a call of the chunk's one compiled program, with the states brought to
    the host in between.
    ``resume`` skips the chunks it counts as done and continues the next one from its
    segment. ``mesh`` (a 1-D ``users`` mesh, :mod:`rmm_jax.online.sharding`) shards each
    chunk over devices. Under ``jax.distributed`` (several processes, ``mesh`` over all
    their devices) every process runs this same loop on the same chunks, and each event
    carries the whole chunk's results on every process.

    **Pipelined.** A background thread reads (iterates ``chunks``) and pads chunk i+1 while
    chunk i runs on the device, and the :class:`ChunkDone` of chunk i is yielded only after
    chunk i+1 has been dispatched, so whatever the caller does with it (writing policies
    and logs) overlaps chunk i+1's run and chunk i+2's padding. Memory holds about three
    chunks. (Over several processes the chunks run one after
    another: their collectives must not interleave.)

    Examples:
      Three users in chunks of two; with ``segment_batches=2`` each chunk runs as two
      segments (two batches of queries, padded to four), and stops once in between (a point
      to checkpoint):

      >>> import jax, rmm_jax as rj
      >>> from rmm_jax import ChunkDone, drive
      >>> from rmm_jax.data.citations import oracle
      >>> from rmm_jax.online.vectors import VectorSpec, vector_users
      >>> streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=6), seed=0, indices=[0, 1, 2])
      >>> program = rj.make_run(*rj.preset("default", k=6, m=2), cite_fn=oracle())
      >>> params = rj.init_reranker(jax.random.key(0), 16)
      >>> [(type(e).__name__, e.chunk) for e in drive([streams[:2], streams[2:]], program, params,
      ...                                            users_per_chunk=2, segment_batches=2)]
      [('SegmentDone', 0), ('ChunkDone', 0), ('SegmentDone', 1), ('ChunkDone', 1)]
      >>> done = [e for e in drive([streams], program, params, users_per_chunk=3) if isinstance(e, ChunkDone)]
      >>> sorted(done[0].outputs), done[0].outputs["u0000000"]["recall"].shape
      (['u0000000', 'u0000001', 'u0000002'], (8,))
    """
    check_seed_and_chunk(seed, users_per_chunk)            # a generator's checks ran only at the first next()
    check_chunks(chunks)
    check_program_params(params, program)
    return _drive(chunks, program, params, seed=seed, users_per_chunk=users_per_chunk,
                  segment_batches=segment_batches, resume=resume, mesh=mesh, shared=shared)


def check_seed_and_chunk(seed, users_per_chunk) -> None:
    """``seed`` an int and ``users_per_chunk`` an int >= 1, else an InputError naming it:
    ``seed="1"`` was a TypeError from JAX's key 14 calls deep, ``users_per_chunk=0``
    range()'s "arg 3 must not be zero"."""
    check_int(seed, "seed")
    check_int(users_per_chunk, "users_per_chunk", 1)


def check_program_params(params, program: Program) -> None:
    """``params`` of ``program``'s layout, else an InputError naming ``params``: the kind
    (linear params under an `mlp` layout trained a linear reranker without a word, `mlp`
    params under a linear one were a KeyError 'W' deep in the update) and an `mlp`'s hidden
    width (4 under a layout of 8 ran as 4). :meth:`PolicyStore.create`'s check of its meta."""
    layout = program.layout
    check_params(params, {"kind": layout.kind, "dim": None, "hidden": layout.hidden}, "params",
                 of="the program's layout")


def check_chunks(chunks) -> None:
    """``chunks`` an iterable of chunks, not a string, else an InputError naming it: ``"abc"``
    (a path given for the chunks) was an AttributeError ('str' object has no attribute
    'selected') from the padding."""
    if isinstance(chunks, (str, bytes)) or not hasattr(chunks, "__iter__"):
        raise InputError(f"expected chunks (each a list of streams, or a Chunk), got {checks.short(chunks)}",
                         arg="chunks")


def refuse_stream(x, arg: str, expected: str, fix: str) -> None:
    """A single :class:`Stream` where ``expected`` (a list of them) belongs, refused naming
    ``arg`` and how to pass it (``fix``): it was "'Stream' object is not iterable" or "has no len()"."""
    if isinstance(x, Stream):
        raise InputError(f"expected {expected}, got a Stream: {fix}", arg=arg)


def _drive(chunks, program: Program, params, *, seed: int, users_per_chunk: int, segment_batches: int | None,
           resume: Resume | None, mesh, shared: SharedState | None) -> Iterator[Event]:
    carried = resume.shared if resume is not None and resume.shared is not None else shared
    if carried is None:
        carried = program.init_shared(params)
    skip = resume.chunks_done if resume is not None else 0
    ahead = _ahead(_padded(chunks, program, users_per_chunk, segment_batches, skip))
    try:
        yield from _run_chunks(ahead, program, params, seed, users_per_chunk, resume, mesh, carried)
    finally:          # closed early (the caller stopped): join the read-ahead thread now, not at garbage collection
        ahead.close()


def _run_chunks(ahead, program: Program, params, seed: int, users_per_chunk: int, resume: Resume | None, mesh,
                carried) -> Iterator[Event]:
    pipelined = jax.process_count() == 1
    group = 0 if mesh is not None else None        # cache groups split the users axis that a mesh shards
    pending = None                                 # a chunk whose last segment is dispatched, not yet fetched
    for ci, chunk, padded in ahead:
        streams = chunk.streams
        if padded is None:
            yield ChunkSkipped(ci, streams)
            continue
        n_total, seg, n_seg, data = padded
        parts, first = [], 0
        if resume is not None and ci == resume.chunks_done and resume.segments_done > 0:
            states, parts, first = resume.states, [resume.outputs], resume.segments_done
        else:
            ids = [s.user_id for s in streams] + [f"<pad{i}>" for i in range(users_per_chunk - len(streams))]
            keys = user_keys(seed, ids)
            states = program.init(params, keys, carried, *_padded_start(chunk, program, params, keys, carried))
        if mesh is not None:
            data = shard_users(data, mesh)
        for s in range(first, n_seg):
            if mesh is not None:
                states = LoopState(shard_users(states.users, mesh), replicate(states.shared, mesh))
            lo, hi = s * seg, min((s + 1) * seg, n_total)
            states, out = program.run(states, data, lo, hi, group=group)
            if pending is not None:                # chunk i-1 finished first; the caller's work overlaps this run
                yield _chunk_done(*pending)
                pending = None
            if s + 1 < n_seg:
                states, out = _fetch((states, out))
                parts.append(_batches(out, lo, hi))
                yield SegmentDone(ci, s + 1, states, _concat(parts))
        carried = states.shared
        pending = (ci, streams, states, parts, (out, lo, hi))
        if not pipelined:
            yield _chunk_done(*pending)
            pending = None
    if pending is not None:
        yield _chunk_done(*pending)


def _as_chunk(c) -> Chunk:
    refuse_stream(c, "chunks", "chunks (each a list of streams, or a Chunk)",             # drive(streams, ...)
                  "drive([streams], ...) runs a list of streams as one chunk")
    if isinstance(c, (str, bytes)) or not (isinstance(c, Chunk) or hasattr(c, "__iter__")):
        raise InputError(f"expected chunks (each a list of streams, or a Chunk), got a chunk {checks.short(c)}",
                         arg="chunks")
    return c if isinstance(c, Chunk) else Chunk(list(c))


def _check_logged(ci: int, streams: Sequence[Stream], program: Program) -> None:
    """A chunk's streams all carry logged selections (a replay: ``make_run`` without a
    citation function) or none do (a simulation: with one). A replay program on streams
    without a log was a TypeError from the compiled loop ('>=' between None and int), a
    simulation on logged streams ran without a word and learned from its own draws instead of
    the log, and a mixed chunk was a TypeError from the padding (int() of None)."""
    logged = {s.selected is not None for s in streams}
    if len(logged) > 1:
        raise ValueError(f"chunks: chunk {ci} mixes streams that carry logged selections with streams that do not")
    if logged == {True} and program.simulates:
        raise ValueError("program: simulates citations (make_run with a cite_fn), but the streams carry logged "
                         "selections: replay them with make_run(..., cite_fn=None)")
    if logged == {False} and not program.simulates:
        raise ValueError("program: replays logged selections (make_run with cite_fn=None), but the streams carry "
                         "none: give make_run a citation function, e.g. rmm_jax.data.citations.oracle()")
    m = program.layout.m
    wrong = next((s for s in streams if s.selected is not None and np.shape(s.selected)[-1] != m), None)
    if wrong is not None:             # was numpy's "could not broadcast ... (12,5) into ... (12,3)" from the padding
        k = np.shape(wrong.selected)[-1]
        raise InputError(f"shows m={m}, but the streams log {k} selections a query (user {wrong.user_id!r}): "
                         f"replay them with a program of m={k}", arg="program")


def _padded(chunks, program: Program, users_per_chunk: int, segment_batches: int | None, skip: int):
    """``(index, chunk, (batches, batches per segment, segments, padded data))`` of every
    non-empty chunk; ``None`` in place of the padding for the first ``skip`` (done before a
    resume). The padding does not depend on the segments: all run one compiled program."""
    for ci, chunk in enumerate(c for c in map(_as_chunk, chunks) if c.streams):
        if len(chunk.streams) > users_per_chunk:
            raise ValueError(f"users_per_chunk: a chunk of {len(chunk.streams)} streams, more than {users_per_chunk}")
        _check_logged(ci, chunk.streams, program)
        if ci < skip:
            yield ci, chunk, None
            continue
        n_batches = program.batches(chunk.streams)
        yield ci, chunk, (n_batches, *segment_plan(n_batches, segment_batches), program.pad(chunk.streams,
                                                                                            users_per_chunk))


def _ahead(items: Iterator, depth: int = 1) -> Iterator:
    """``items``, produced by a background thread up to ``depth`` items ahead of the
    consumer: the next chunk's streams are read and padded while this one runs and the
    caller saves the last (NumPy and file reads release the GIL). An exception in the
    thread is raised here, in order; when the consumer stops early, the thread stops at
    its next item, and closing waits for it to finish the item it is on (a daemon thread
    still inside XLA when the interpreter exits aborts the process)."""
    box: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                box.put(x, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def work():
        try:
            for x in items:
                if not put((x, None)):
                    return
            put((end, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            put((end, e))

    worker = threading.Thread(target=work, name="rmm-jax-pad-ahead", daemon=True)
    worker.start()
    try:
        while True:
            x, err = box.get()
            if x is end:
                if err is not None:
                    raise err
                return
            yield x
    finally:
        stop.set()
        worker.join()   # done with its item: a daemon thread still in XLA at exit aborts the process


def _padded_start(chunk: Chunk, program: Program, params, keys, shared) -> tuple:
    """``(users, known)`` for ``program.init``, padded to the chunk size; ``()`` when every
    user starts afresh. Saved states that do not fit the program (another kind, rank,
    optimiser or embedding size) are refused in one line."""
    if chunk.users is None or not np.any(chunk.known):
        return ()
    want = jax.eval_shape(program.init, params, keys, shared).users
    shape = lambda t: jax.tree.map(lambda x: x.shape[1:], t)
    if jax.tree.structure(chunk.users) != jax.tree.structure(want) or shape(chunk.users) != shape(want):
        raise InputError(f"{UNFIT} this run (another reranker kind, rank, optimiser or embedding size than the one "
                         "they were trained with?)", arg="chunks")
    n, pad = len(chunk.streams), keys.shape[0] - len(chunk.streams)
    users = jax.tree.map(lambda x: np.concatenate([x, np.repeat(x[:1], pad, axis=0)]), chunk.users)
    return users, np.concatenate([np.asarray(chunk.known, bool)[:n], np.zeros(pad, bool)])


def _chunk_done(ci: int, streams: list, states: LoopState, parts: list, last: tuple) -> ChunkDone:
    """Bring a finished chunk to the host: its users' states (padding removed), per-user
    outputs (``parts``, then the ``(outputs, start, stop)`` of its last segment)."""
    states, out = _fetch((states, last[0]))
    n = len(streams)
    flat = per_query(_concat([*parts, _batches(out, *last[1:])]))
    outputs = {st.user_id: {k: np.array(flat[k][i, :st.queries.shape[0]]) for k in OUTPUT_KEYS if k in flat}
               for i, st in enumerate(streams)}
    return ChunkDone(ci, streams, jax.tree.map(lambda x: x[:n], states.users), outputs, states.shared)


def _batches(out: dict, lo: int, hi: int) -> dict:
    """A segment's own batches ``lo:hi`` of the chunk-long outputs that ``program.run`` returns
    (on the host), copied: a view would keep each segment's chunk-long array alive until the
    chunk ends, memory that grows with the square of the stream's length."""
    return {k: np.array(v[:, lo:hi]) for k, v in out.items()}


def _concat(parts: list) -> dict:
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *parts)


def _fetch(tree):
    """``device_get`` that waits in short sleeps, so that Python signal handlers (e.g. a
    second Ctrl-C) run while a long jitted call is in flight. Arrays spread over several
    processes are gathered, so every process gets the whole tree."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "is_ready")]
    while not all(x.is_ready() for x in leaves):
        time.sleep(0.002)
    if jax.process_count() > 1:
        return jax.tree.map(_gather, tree)
    return jax.device_get(tree)


def _gather(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
