"""Running a program over chunks of users into a policy store, a citation log and a run-state.

An online run (``simulate``, ``replay``, the scale benchmark) makes a new policy store
(:func:`create_policies`) or continues one, picks where its users start (:func:`plan_start`),
then opens the run (:func:`open_run`), which drives its chunks through the program and keeps
what each event carries: policies to the store, log records to the log, checkpoints to the
run-state (:mod:`rmm_jax.online.sinks`). The caller owns the loop over the events: what it
shows while it runs (a progress bar) and how it stops (SIGINT/SIGTERM, checked after each
event) are its own, never passed in.

Errors name the arguments of these functions as :func:`rmm_jax.errors.named` does
(``policies=PATH``); the CLI words them as its options (``--policies PATH``).
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax

from rmm_jax.core.checks import short
from rmm_jax.core.reranker import init_reranker
from rmm_jax.core.types import SharedState
from rmm_jax.errors import InputError, named
from rmm_jax.online.driver import UNFIT, check_chunks, drive
from rmm_jax.online.run import Recorder
from rmm_jax.online.sinks import LogSink, PolicySink, RunStateSink, resume_point
from rmm_jax.online.starts import from_store
from rmm_jax.persist.policy_rollback import finish_pending
from rmm_jax.persist.policy_setting import read_setting
from rmm_jax.persist.policy_store import PolicyMeta, PolicyStore


class Start(NamedTuple):
    """Where a run starts: new users' policy ``params``; the shared part to continue from
    (None: from ``params``); ``before``: users continue from their versions older than this
    (None: nobody continues); ``shared_version``: the store's shared version ``params`` (and
    ``shared``) come from, when continuing; ``rolled_back``: the rollback a kill had
    interrupted, which :func:`plan_start` finished before planning
    (:func:`rmm_jax.persist.policy_rollback.finish_pending`; None: none).

    Examples:
        >>> from rmm_jax.online.session import Start
        >>> Start({"w": 0}).before is None
        True
    """
    params: Any
    shared: SharedState | None = None
    before: int | None = None
    shared_version: int | None = None
    rolled_back: Any = None      # the interrupted rollback plan_start finished first (a Rollback; None: none)


INITS = ("identity", "pretrained", "continue")      # where plan_start's users start


def identity_params(dim: int, layout, seed: int):
    """The identity reranker of ``layout``'s kind on embeddings of size ``dim`` (the base
    retriever's order): where a new store, and ``init="identity"``, start."""
    return init_reranker(jax.random.key(seed), dim, layout.kind, layout.hidden)


def create_policies(path, layout, dim: int, params, *, config: dict, keep: int | None = None) -> PolicyStore:
    """A new policy store at ``path`` for runs of ``layout`` (its kind, hidden width, scope and
    rank) on embeddings of size ``dim``, holding ``params`` as its shared part and ``config``
    (what made it) in its metadata; ``keep`` versions per user (None: the default).

    Examples:
        >>> import tempfile, jax
        >>> from rmm_jax import preset
        >>> from rmm_jax.online.session import create_policies, identity_params
        >>> layout = preset("default", k=8, m=2).layout
        >>> path = tempfile.mkdtemp() + "/policies"
        >>> ps = create_policies(path, layout, 4, identity_params(4, layout, 0), config={"model": None})
        >>> ps.meta_info().kind, ps.meta_info().dim, ps.n_users()
        ('linear', 4, 0)
    """
    if not isinstance(config, dict):           # None was a TypeError from PolicyMeta.of(**config)
        raise InputError(f"must be a dict of what made the store (e.g. {{}}), got {short(config)}", arg="config")
    return PolicyStore.create(path, PolicyMeta.of(layout, dim, **config), params,
                              **({"keep": keep} if keep is not None else {}))


def plan_start(ps, st, layout, init: str, seed: int, rs=None, *, writer: bool = True) -> Start:
    """The run's :class:`Start` from policy store ``ps`` (embedding store ``st``: its size):
    ``init`` ``identity``, ``pretrained`` (the store's pretrained shared part) or ``continue``
    (every user from its latest version, the shared part as the last saved users left it).
    A resumed run (run-state ``rs``) starts where the interrupted one did (the run-state's
    checkpoint holds it), whatever the store has gained since. A ``writer`` (the process that
    writes ``ps``) first finishes a rollback of ``ps`` a kill interrupted, so the run continues
    from the versions the rollback keeps and learns again the calls of those it forgets
    (:attr:`Start.rolled_back` says so; a reader plans from the store as it stands).

    Examples:
        >>> from rmm_jax import preset
        >>> from rmm_jax.online.session import plan_start
        >>> from types import SimpleNamespace
        >>> start = plan_start(None, SimpleNamespace(dim=4), preset("default").layout, "identity", 0)
        >>> start.params["q_adapter"]["W"]["kernel"].shape, start.before
        ((4, 4), None)
    """
    if init not in INITS:           # 'identiy', 'latest' or None continued from the store without a word
        raise InputError(f"must be one of {', '.join(INITS)}, got {short(init)}", arg="init")
    if init == "identity" and not hasattr(st, "dim"):
        raise InputError(f"init='identity' needs the embedding store (its dim), got {short(st)}", arg="st")
    if init != "identity" and ps is None:
        raise InputError(f"init={init!r} needs the policy store to start from, got None", arg="ps")
    done = finish_pending(ps) if writer and ps is not None else None
    ck = rs.restored if rs is not None else None
    if ck is not None:
        return Start(ck.trees["params"], None, ck.meta.get("before"), rolled_back=done)
    if init == "identity":
        return Start(identity_params(st.dim, layout, seed), rolled_back=done)
    if init == "pretrained":                # what pretrain wrote, not a shared part online runs went on training
        start = ps.start_shared_version()
        if start is None:
            raise InputError("its pretrained parameters are no longer kept (online runs' shared versions pruned "
                             "them, before rmm-jax kept them); pretrain again into a new store",
                             where=named("policies", ps.path))
        return Start(ps.shared_state(start).state.params, rolled_back=done)
    saved = ps.shared_state(ps.learned_shared_version())   # as the last saved users left it
    shared = saved.state if layout.scope.has_shared and saved.state.opt_state is not None else None
    return Start(saved.state.params, shared, ps.next_version(), saved.version, done)


def learned_nothing(ps) -> bool:
    """Whether policy store ``ps`` holds nothing a run learned: no user, and no shared version
    past the one it was made with. A run that created it and stopped before its first save
    leaves such a store; continuing it is starting from the beginning.

    Examples:
        >>> import tempfile
        >>> from rmm_jax import preset
        >>> from rmm_jax.online.session import create_policies, identity_params, learned_nothing
        >>> layout = preset("default", k=8, m=2).layout
        >>> ps = create_policies(tempfile.mkdtemp() + "/p", layout, 4, identity_params(4, layout, 0), config={})
        >>> learned_nothing(ps)
        True
    """
    return not ps.n_users() and len(ps.shared_versions()) <= 1


def rs_fresh(rs) -> bool:
    """Whether a run begins here: not resumed, nor started again after a kill (whose saved
    users are then the interrupted run's own)."""
    return rs is None or (rs.restored is None and rs.interrupted is None)


class SavingRun:
    """A run :func:`open_run` opened: iterating it handles the next of ``drive``'s events
    (its policies saved, its log records written, its checkpoint taken) and yields how many
    users the event finished (0 for a segment); :meth:`result` is the run's
    :class:`rmm_jax.online.run.OnlineResult` once the loop is done. The caller owns the loop:
    what it shows between events (a progress bar) and how it stops (raising after an event:
    the event is saved and checkpointed by then) are its own. Leaving the ``with`` closes the
    run: its events stop (the read-ahead thread is joined) before the store's writer is
    released, and iterating it afterwards is an :class:`rmm_jax.errors.InputError` (it would
    save without the writer)."""

    def __init__(self, events, recorder: Recorder):
        self._events, self._recorder = events, recorder
        self._closed = self._started = False

    def __iter__(self):
        self._check_open()
        return self._feed()

    def _feed(self):
        self._check_open()        # its first next() may come after the with
        self._started = True
        for event in self._events:
            yield self._recorder.feed(event)
            self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise InputError("is closed: its `with open_run(...)` has exited (and released the policy store's "
                             "writer); iterate it inside the with", arg="run")

    def close(self) -> None:
        """Stop the run's events (``drive`` joins its read-ahead thread); what open_run's
        ``with`` does on leaving, before it releases the writer."""
        self._closed = True
        self._events.close()

    def result(self):
        """The run's :class:`rmm_jax.online.run.OnlineResult` (summaries only) of the events
        the loop handled: after a loop left early (``break``, an error), those of the users it
        finished so far, a partial result. An :class:`rmm_jax.errors.InputError` naming
        ``run`` before the loop has run, and naming ``users`` when it ran none."""
        if not self._started:
            raise InputError("its loop has not run: iterate it (for done in run: ...) before result()", arg="run")
        return self._recorder.result()


@contextlib.contextmanager
def open_run(chunks, program, start: Start, ps, rs, *, seed: int, users_per_chunk: int, checkpoint_every: int,
             log=None, mesh=None, writer: bool = True, relearn: bool = False, first_query: int | None = None,
             saves=None, questions=None, simulated=None, skip_changed: bool = False):
    """Within ``with``: a :class:`SavingRun` that drives ``chunks`` through ``program`` from
    ``start`` and keeps what each event carries: policies to ``ps``, log records to ``log``
    (simulate), checkpoints and finished outputs to the run-state ``rs``
    (:mod:`rmm_jax.online.sinks`). The ``with`` holds ``ps``'s writer, released on any exit
    (an error of the caller's between events too). With ``start.before``, users the store
    holds continue from their saved versions, learning only the logged calls their policies
    have not learned (all with ``relearn``; ``questions``, the embedding store: also leaving
    out the calls of questions their simulate runs learned,
    :func:`rmm_jax.online.starts.sort_calls`; ``simulated``: their keys as
    :func:`rmm_jax.online.starts.check_learned` found them, not looked up again;
    ``skip_changed``: a call learned with other content is left out, as check_learned counted it). Under
    ``jax.distributed`` every process runs this loop (reading ``ps``) and only the ``writer``,
    process 0, writes. ``first_query``:
    the chunks are the users' store questions from that position (simulate), which each
    saved version records (:func:`rmm_jax.online.sinks.simulated_queries`).

    ``saves``: the sink that saves policies to ``ps`` (None: a
    :class:`rmm_jax.online.sinks.PolicySink`; a benchmark passes one that times its saves).
    An error of the saved states that do not fit ``program`` names ``policies``; one of a
    call that changed since it was learned, ``chunks``; one of a resume, ``resume``.

    Examples:
        >>> import tempfile, jax, rmm_jax as rj
        >>> from rmm_jax.data.citations import oracle
        >>> from rmm_jax.online.session import Start, create_policies, open_run
        >>> from rmm_jax.online.vectors import VectorSpec, vector_users
        >>> streams = vector_users(VectorSpec(dim=16, memories=30, queries=8, k=6), seed=0, indices=[0, 1, 2])
        >>> program = rj.make_run(*rj.preset("default", k=6, m=2), cite_fn=oracle())
        >>> params = rj.init_reranker(jax.random.key(0), 16)
        >>> ps = create_policies(tempfile.mkdtemp() + "/p", program.layout, 16, params, config={})
        >>> with open_run([streams[:2], streams[2:]], program, Start(params), ps, None, seed=0,
        ...               users_per_chunk=2, checkpoint_every=0) as run:
        ...     done = [n for n in run]       # the caller's loop: a progress bar, a stop check
        >>> done, run.result().summary["queries"], ps.n_users()
        ([2, 1], 24, 3)
    """
    if not isinstance(start, Start):      # a dict or bare params was an AttributeError ('before')
        raise InputError(f"expected a Start (rmm_jax.online.session.Start(params)), got a {type(start).__name__}",
                         arg="start")
    check_chunks(chunks)
    if ps is not None:       # a process that does not write may hold no store (none made yet)
        check_program_fits(program, ps, start)
    own = []       # from_store's errors: about the calls of ``chunks``, not the saved states
    if start.before is not None:     # its calls come from the log (replay), its saved states from the store
        chunks = _noted(from_store(chunks, ps, before=start.before, relearn=relearn, questions=questions,
                                   simulated=simulated, skip_changed=skip_changed), own)
    ps = ps if writer else None
    run = run_record(ps, rs)
    checkpoints = RunStateSink(rs, {"params": start.params}, {"before": start.before, "run": run}) \
        if rs is not None else None
    if saves is None and ps is not None:
        saves = PolicySink(ps, program, continues=start.before is not None, run=run, first_query=first_query,
                           before=start.before, resumed=(run or {}).get("first_version")
                           if rs is not None and rs.restored is not None else None)
    sinks = ([saves] if ps is not None else []) \
        + ([LogSink(log)] if log is not None and ps is not None else []) \
        + ([checkpoints] if checkpoints is not None else [])
    recorder = Recorder(program.layout.m, sinks=sinks)
    resume = resume_point(rs)
    shared = start.shared
    # The store's lock first: a run refused as busy (another writer: exit 75) has checkpointed
    # nothing, so its run-state is removed as empty (or one an interrupted run left kept).
    with ps.writer() if ps is not None else contextlib.nullcontext():
        if checkpoints is not None and resume is None:   # the start, before anything is written to the store
            resume = checkpoints.begin(program.init_shared(start.params) if shared is None else shared)
        events = drive(chunks, program, start.params, seed=seed, users_per_chunk=users_per_chunk,
                       segment_batches=checkpoint_every or None, resume=resume, mesh=mesh, shared=shared)
        run = SavingRun(_saved_states_as_policies(events, own), recorder)
        try:
            yield run
        finally:       # however the with is left (a break, the caller's error): before the writer is released
            run.close()


def check_program_fits(program, ps, start: Start | None = None) -> None:
    """Refuse a ``program`` whose layout is not the policy store ``ps``'s (another scope or
    rank, another reranker kind; naming ``program``), and a ``start`` whose `mlp` params are of
    another hidden width than the store's (None: the default, d; naming ``start``): the run's
    users start from ``start``, not from the program's layout. A hybrid program's factors were
    saved in a user-scope store, which then failed at every load; an `mlp` program's params in a
    `linear` store, whose meta still said linear; a user-scope program in a hybrid store ran a
    whole chunk before a save refused it; users of width d were saved beside a shared part of 8."""
    lay, meta = program.layout, ps.meta_info()

    def scope(s):
        return repr(s.name) + (f" (rank {s.rank})" if s.rank is not None else "")
    if lay.scope != ps.scope:
        raise InputError(f"the program's scope is {scope(lay.scope)}, the policy store's is {scope(ps.scope)} "
                         f"({ps.path}): make the program with the store's scope, or create a new store", arg="program")
    if lay.kind != meta.kind:
        raise InputError(f"the program's reranker is {lay.kind}, the policy store's is {meta.kind} ({ps.path})",
                         arg="program")
    want = meta.hidden if meta.hidden is not None else meta.dim
    for part in (start.params, start.shared.params if start.shared is not None else None) if start else ():
        got = _hidden_width(part)
        if meta.kind == "mlp" and got is not None and got != want:
            raise InputError(f"its params are mlp of hidden width {got}, the policy store's are of {want} "
                             f"({ps.path})", arg="start")


def _hidden_width(params) -> int | None:
    """The `mlp` kind's hidden width of reranker ``params`` (its ``up`` kernel's last axis), else None."""
    try:
        return int(params["q_adapter"]["up"]["kernel"].shape[-1])
    except (KeyError, TypeError, AttributeError, IndexError):
        return None


def _noted(items, own: list):
    """``items`` as they come, each error of the generator that makes them noted in ``own``."""
    try:
        yield from items
    except InputError as e:
        own.append(e)
        raise


def _saved_states_as_policies(events, own: list):
    """``drive``'s events, its errors of the saved states in its chunks (``chunks``: drive's
    argument, :data:`rmm_jax.online.driver.UNFIT`) as errors of the policy store they came
    from (``policies``); its other errors of ``chunks`` (a flat list of streams: the caller's
    ``chunks``) and those of ``own`` (the chunks' calls, :func:`_noted`) pass unchanged. A
    generator raises as it is iterated, so a ``try`` around its call would miss them."""
    try:
        yield from events
    except InputError as e:
        message = e.message
        if e.arg != "chunks" or not message.startswith(UNFIT) or any(e is o for o in own):
            raise
        raise InputError(message, arg="policies" + e.where[len(e.arg):]) from None


def run_record(ps, rs) -> dict | None:
    """What each version a run saves records of the run, for ``policies rollback``
    (:mod:`rmm_jax.persist.policy_rollback`): the number its first save takes and the
    setting the store recorded when it began. A resumed run, and one started again after a
    kill (:meth:`rmm_jax.persist.runstate.RunState.begin`), keep the interrupted one's: a
    rollback undoes both."""
    for meta in ((rs.restored.meta if rs.restored is not None else None), rs.interrupted) if rs is not None else ():
        if meta and meta.get("run"):
            return meta["run"]
    return None if ps is None else {"first_version": ps.next_version(), "setting_before": read_setting(ps)}
