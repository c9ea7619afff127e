"""Rolling a policy store back: the store as it was when user version V was its newest.

``evaluate`` may show what a night's ``replay`` learned worse than what served the day. Those policies are
already the newest versions in the store, so ``rerank`` would serve them and the next
``replay`` would continue from them. :func:`rollback` takes the store back to what it held
before, without a copy of the store: each user keeps its newest ``keep`` versions (the
store's ``--keep``), and going back means forgetting the newer ones.

After ``rollback(store, to=V)``:

* every user version above V is forgotten (the index, in one transaction), and its
  snapshot is deleted;
* each user that had a version at or below V loads its newest such version again. That
  version includes the calls it had learned from (:mod:`rmm_jax.persist.learned_calls`),
  so the calls that the forgotten versions learned are learnable again, once;
* a user with no version at or below V leaves the store. It was new since V, and the next
  run starts it from the shared part, as it would have before;
* in scopes with a shared part, the shared versions that online runs saved after the
  newest kept user version's shared version are deleted. Serving and continuing use that
  shared version again (:meth:`PolicyStore.learned_shared_version`), or, when no user
  version remains, the store's start (:meth:`PolicyStore.start_shared_version`). Their
  numbers are not handed out again (the index's ``next_shared``, as ``next_version`` for
  user versions): a served line's ``shared_version`` names one shared part;
* the store records the learning setting it recorded before the oldest forgotten version
  was saved. Each run's saves record what it found (``run``, below). Versions saved by an
  rmm-jax that did not record it leave the setting as it is, and the result says so.

Without ``to``, the store goes back to before the newest run: each version saved by an
online run (:func:`rmm_jax.online.session.open_run`) records
``run = {"first_version": F, "setting_before": S}``, where F is the number its first save
took (a resumed run keeps F) and S is the setting the store recorded when the run began.

**Refused** (an :class:`~rmm_jax.errors.InputError`, nothing changed): V at or above the
newest version; a V given below the oldest version the store keeps, which would leave no
user version (undoing the runs one by one, without ``to``, does: the store then serves its
start); a store whose run-state holds an interrupted run (``--resume`` would go on
from the versions it forgets, and take the calls they learned as learned); and a user
whose state at V is gone. That is a user whose kept versions
are all above V while its oldest kept version replaced an earlier one, which ``keep`` then
pruned. Every saved version lists, per user, the version that user had before
(``previous`` in each chunk; None: none). A version saved before that was recorded counts
as having replaced one.

**Crash safety.** The header first records the rollback as pending
(``"rollback": {"to": V, ...}``), atomically. Then the index forgets the versions, the
snapshots and shared versions are deleted, and the header drops the mark and records the
setting. Each step can be done again. A writer that finds the mark, including the next
``rollback`` (:meth:`PolicyStore.writer`), finishes the rollback first; the next run
finishes it before it plans where its users start and which calls they have learned
(:func:`finish_pending`), also a replay that then finds nothing to learn. A kill therefore
leaves the store where it was, or rolled back. Until a writer finishes it, readers still
load the newer versions (:func:`pending_note` says so).

This is not the restore fallback of :mod:`rmm_jax.persist.rollback`, which loads an older
version when a newer one is damaged and changes nothing on disk.

Examples:
  >>> import jax, jax.numpy as jnp, tempfile, rmm_jax as rj
  >>> from rmm_jax.persist.policy_store import PolicyStore
  >>> from rmm_jax.persist.policy_rollback import rollback
  >>> lay, est, opt = rj.preset("default", k=3, m=2)
  >>> p = rj.init_reranker(jax.random.key(0), 4)
  >>> ps = PolicyStore.create(tempfile.mkdtemp() + "/policies", {"kind": "linear", "dim": 4, "hidden": None}, p)
  >>> users = lambda n: jax.vmap(lambda k: rj.init_user(p, k, lay, est, opt))(jax.random.split(jax.random.key(1), n))
  >>> v1 = ps.save(["ann"], users(1), run={"first_version": 1})
  >>> v2 = ps.save(["ann", "bob"], users(2), run={"first_version": 2})
  >>> r = rollback(ps)                       # undo the newest run: v2
  >>> r.to, r.versions, r.users, r.removed
  (1, (2,), ('ann',), ('bob',))
  >>> ps.users(), ps.load("ann").version
  (['ann'], 1)
"""
from __future__ import annotations

import numbers
import socket
from typing import Callable, NamedTuple

import numpy as np

from rmm_jax.errors import InputError, named
from rmm_jax.persist.atomic import remove_dir
from rmm_jax.persist.lock import live_holder
from rmm_jax.persist.policy_setting import SETTING_KEY
from rmm_jax.persist.policy_snapshot import cname, read_chunk_meta, vname
from rmm_jax.persist.policy_versions import drop_unindexed, version_span, writer_index
from rmm_jax.persist.runstate import RunState

PENDING = "rollback"         # the header's mark while a rollback is under way
DONE = "rollbacks"           # the header's count of finished rollbacks
MARKED = ("to", "versions", "shared", "setting", "setting_known")   # what the mark holds


class Rollback(NamedTuple):
    """What a rollback to ``to`` does (:func:`plan`) or did (:func:`rollback`)."""
    to: int                          # user versions above this are forgotten
    versions: tuple[int, ...]        # the versions forgotten, ascending
    users: tuple[str, ...]           # users who load an older version afterwards
    removed: tuple[str, ...]         # users new since ``to``: the store no longer holds them
    shared: tuple[int, ...]          # the shared versions deleted
    setting: dict | None             # the setting the store records afterwards (None: none)
    setting_known: bool              # False: the forgotten versions do not say what it was; it stays
    interrupted: bool = False        # this finished a rollback a kill had stopped (users: not recorded)
    newest: int | None = None        # the newest user version the store keeps afterwards (None: none);
                                     # below ``to`` when no version ``to`` is kept (an earlier rollback forgot it)


def check_store(store, where: str = "store") -> None:
    """``InputError`` naming ``where`` unless ``store`` is a :class:`PolicyStore`: a path, as
    ``rmm-jax policies rollback P`` takes it, was an AttributeError ('str' object has no
    attribute '_header'), here and in every reader of a store's header."""
    from rmm_jax.persist.policy_store import PolicyStore  # which imports this module

    if not isinstance(store, PolicyStore):
        raise InputError(f"expected a policy store, PolicyStore.open(path), got {type(store).__name__} {store!r}"[:120],
                         where=where)


def newest_run(store) -> int:
    """The first version of the newest run that saved users (what ``rollback(store)`` goes
    back to before). Raises InputError when the store holds no user version or its newest
    version records no run; that error names ``to`` (:func:`rmm_jax.errors.named`: ``to=VERSION``,
    or ``--to VERSION`` from the CLI)."""
    check_store(store)
    newest = store.newest_version()
    if newest is None:
        raise InputError("holds no user version: nothing to roll back", where=str(store.path))
    run = _head(store, newest).get("run") or {}
    first = run.get("first_version")
    if not isinstance(first, int) or not 1 <= first <= newest:
        raise InputError(f"its newest version v{newest} does not record the run that saved it (saved by an older "
                         f"rmm-jax, or not by a run of the CLI): give {named('to', 'VERSION')}",
                         where=str(store.path))
    return first


def plan(store, to: int | None = None, *, interrupted_run_ok: bool = False) -> Rollback:
    """What :func:`rollback` would do, changing nothing; raises InputError where it would
    refuse (module docstring). With ``interrupted_run_ok`` (a dry run) a store whose
    run-state holds an interrupted run is planned for too, though :func:`rollback` refuses it
    until that run is resumed or its state removed. Its errors name ``to`` and the store's
    ``keep`` as arguments (``to=VERSION``, ``keep=1``; from the CLI ``--to VERSION``, ``--keep 1``:
    :func:`rmm_jax.errors.named`)."""
    check_store(store)
    mark = store._header.get(PENDING)
    if mark:
        raise InputError(f"a rollback to v{mark['to']} was interrupted: `rmm-jax policies rollback {store.path}` "
                         "finishes it (so does the next run that writes the store)", where=str(store.path))
    interrupted = RunState.interrupted_command(store.path)
    if interrupted and not interrupted_run_ok:
        raise InputError(f"an interrupted `{interrupted}` run left its state in {RunState.path_for(store.path)}: "
                         "finish it with --resume (or remove that directory) before rolling back",
                         where=str(store.path))
    explicit = to is not None        # a version the caller named (None: before the newest run)
    if to is None:
        to = newest_run(store) - 1
    if not isinstance(to, numbers.Integral) or isinstance(to, (bool, np.bool_)) or to < 0:
        raise InputError(f"must be a version >= 0, got {to!r}", arg="to")
    to = int(to)                     # a NumPy integer too: the mark in the header is JSON
    saves = store.saves()
    newest = saves[-1].version if saves else 0
    if to >= newest:
        raise InputError(f"nothing to roll back: v{to} is not below the newest user version "
                         f"({'v' + str(newest) if newest else 'none'})", where=str(store.path))
    moved = store._query(lambda idx: idx.users_above(to))
    removed = [u for u, kept in moved if kept is None]
    _check_removable(store, removed, to)
    kept = [s for s in saves if s.version <= to]
    if explicit and not kept:        # below every version `policies show` lists: the store would hold no user
        raise InputError(f"no user version would remain: v{to} is below the oldest version the store keeps, "
                         f"v{saves[0].version}, the oldest it can go back to (to undo every run, roll back "
                         f"without {named('to')}, run by run; to start afresh, delete {store.path})", arg="to")
    if store.paired and not kept and store.start_shared_version() is None:
        raise InputError(f"cannot roll back to v{to}: no user version would remain, and the shared version the store "
                         "started from is no longer kept (online runs pruned it, before rmm-jax kept it)",
                         where=str(store.path))
    versions = tuple(s.version for s in saves if s.version > to)
    setting, known = _setting_before(store, versions[0])
    return Rollback(to, versions, tuple(u for u, k in moved if k is not None), tuple(removed),
                    tuple(_shared_after(store, kept[-1].shared_version if kept else None)), setting, known,
                    newest=kept[-1].version if kept else None)


def rollback(store, to: int | None = None, *, starting: Callable[[Rollback], None] | None = None) -> Rollback:
    """Take ``store`` back to what it held when user version ``to`` was its newest (None:
    to before its newest run), under its writer's lock; returns what it did (module
    docstring). On a store whose last rollback was interrupted, it finishes that one, and
    then goes on to ``to`` only if ``to`` is another version. Errors as :func:`plan`'s.
    ``starting``, when given, is called with the plan once nothing refuses it, before the
    work (seconds on a large store): ``rmm-jax policies rollback`` says so there."""
    done = finish_pending(store)             # checks the store
    if done is not None and (to is None or to == done.to):
        return done
    planned = plan(store, to)  # a refusal, before the lock: it creates nothing
    if starting is not None:
        starting(planned)
    with store.writer():
        done = plan(store, to)
        store._write_header({**store._header, PENDING: {k: getattr(done, k) for k in MARKED}})
        finish(store)
    return done


def finish_pending(store) -> Rollback | None:
    """Finish the rollback a kill interrupted, if ``store``'s header marks one, taking its
    writer's lock (:meth:`PolicyStore.writer` finishes it first); returns what it did
    (``interrupted=True``; None: none was pending). A run that will write the store calls
    this before it reads which versions its users continue from and which calls they have
    learned (:func:`rmm_jax.online.session.plan_start`): before, the index still lists the
    versions the rollback forgets."""
    check_store(store)
    mark = store._header.get(PENDING)
    if not mark:
        return None
    with store.writer():
        pass
    return Rollback(mark["to"], tuple(mark["versions"]), (), (), tuple(mark["shared"]), mark["setting"],
                    mark["setting_known"], interrupted=True, newest=store.newest_version())


def pending_note(store) -> str | None:
    """For a reader (``policies list``, ``evaluate``, ``rerank``), which writes nothing: the
    line saying that ``store`` is read as it was before an interrupted rollback (None: none
    pending). Until the next writer finishes it, the index still lists the versions it forgets."""
    mark = store._header.get(PENDING)
    if not mark:
        return None
    vs = list(mark.get("versions") or [])
    span = version_span(vs) if vs else "its newer versions"
    return (f"a rollback of {store.path} to v{mark['to']} was interrupted: this shows the store as it was before it "
            f"({span} and the calls they learned still count); `rmm-jax policies rollback {store.path}` finishes it "
            "(so does the next run that writes the store)")


def unfinished_run(store) -> dict | None:
    """For a reader (which writes nothing and takes no lock), beside :func:`pending_note`: the
    run that has not finished writing ``store``, whose users hold a mix of the versions it
    wrote and those before it: one ``running`` now (it holds the run-state's or the store's
    lock: :func:`rmm_jax.persist.lock.live_holder`), or one ``interrupted`` (killed) that
    left its run-state (``POLICIES.runstate``). None if there is none; else ``command``,
    ``state``, ``pid`` (running; else None), ``runstate`` (its path), ``first_version`` (the
    first version it wrote; None: not known), ``users`` (how many users hold a version it
    wrote) and ``note`` (the line saying so, and what to do)."""
    from rmm_jax.persist.policy_store import LOCK_FILE  # which imports this module

    check_store(store)
    doc = RunState.interrupted_run(store.path)
    holder = RunState.running(store.path) or live_holder(store.path / LOCK_FILE)
    if doc is None and holder is None:
        return None
    path, command = RunState.path_for(store.path), (holder or {}).get("command") or (doc or {}).get("command")
    first = (((doc or {}).get("meta") or {}).get("run") or {}).get("first_version")
    first = first if isinstance(first, int) else None
    users = sum(s.users for s in store.saves() if first is not None and s.version >= first)
    holders = "no user holds a version it wrote yet" if not users else (
        (f"{users} users hold versions" if users != 1 else "1 user holds a version") + f" it wrote, v{first} and later")
    if holder is not None:
        who = f"a `{command}`" if command else "a writer"
        so_far = f" ({holders})" if first is not None else ""
        pid = f"pid {holder['pid']}" + ("" if holder.get("host") in (None, socket.gethostname())
                                        else f" on host {holder['host']}")
        note = (f"{who} ({pid}) is writing {store.path}: what this reads is the versions it has written so far"
                f"{so_far} and the others' older ones; run it again after that run ends for one consistent set")
        return {"command": command, "state": "running", "pid": holder["pid"], "runstate": str(path),
                "first_version": first, "users": users, "note": note}
    command = command or "run"
    wrote = (f"{holders}; the others those before it" if users else holders) if first is not None \
        else "its users' versions are a mix of what it wrote and what was there"
    note = (f"an interrupted `{command}` left {path}: {wrote}; resume it with `rmm-jax {command} ... "
            f"--policies {store.path} --resume` (its options), or remove {path} and undo what it saved with "
            f"`rmm-jax policies rollback {store.path}`")
    return {"command": command, "state": "interrupted", "pid": None, "runstate": str(path), "first_version": first,
            "users": users, "note": note}


class StoreNotes(NamedTuple):
    """What a reader of a policy store (which writes nothing and takes no lock) says about
    the state it reads (:func:`store_notes`): ``pending_rollback`` (:func:`pending_note`) and
    ``unfinished_run`` (:func:`unfinished_run`), each None when there is none (``StoreNotes()``:
    a store that does not exist, or no policy store)."""
    pending_rollback: str | None = None
    unfinished_run: dict | None = None

    @property
    def lines(self) -> list[str]:
        """The note lines, in order: the pending rollback, then the unfinished run."""
        return [n for n in (self.pending_rollback, (self.unfinished_run or {}).get("note")) if n]

    def doc(self) -> dict:
        """The two keys a reader's ``--json`` carries (null where there is none)."""
        return {"unfinished_run": self.unfinished_run, "pending_rollback": self.pending_rollback}


def store_notes(store) -> StoreNotes:
    """The notes of a reader of ``store``: its pending rollback and its unfinished run."""
    return StoreNotes(pending_note(store), unfinished_run(store))


def finish(store) -> None:
    """Finish the rollback the header marks as pending, if any (under the writer's lock;
    every step can be done again after a kill)."""
    mark = store._header.get(PENDING)
    if not mark:
        return
    with writer_index(store.path, store._header, store.keep) as idx:
        idx.reserve_shared(max(store.shared_versions(), default=0) + 1)   # the deleted ones' numbers stay taken
        idx.drop_above(int(mark["to"]))
        live, last = set(idx.live_versions()), idx.last_shared()
    drop_unindexed(store.path, store._header, store.keep, live)
    for v in _shared_after(store, last):
        remove_dir(store.path / "shared" / vname(v))
    store._forget_shared_cache()
    header = {k: v for k, v in store._header.items() if k != PENDING}
    header[DONE] = rollbacks(store) + 1
    if mark.get("setting_known"):
        header.pop(SETTING_KEY, None)
        if mark.get("setting") is not None:
            header[SETTING_KEY] = mark["setting"]
    store._write_header(header)


def rollbacks(store) -> int:
    """How many rollbacks ``store`` has finished. With its newest user version, this tells a
    reader that the store changed: after undoing the newest run, the newest version is the
    one it was before that run."""
    return int(store._header.get(DONE, 0))


def _head(store, version: int) -> dict:
    """Version ``version``'s first chunk's metadata ({} when it cannot be read)."""
    try:
        return read_chunk_meta(store.path / "gens" / vname(version), cname(0))
    except (OSError, ValueError, KeyError):
        return {}


def _check_removable(store, users: list[str], to: int) -> None:
    """Refuse when a user without a version at or below ``to`` had one that ``keep`` pruned."""
    if not users:
        return
    entries = store._query(lambda idx: idx.entries(users))
    metas: dict[tuple[int, int], dict] = {}
    lost = []
    for u in users:
        oldest = entries[u][0]
        key = (oldest.version, oldest.chunk)
        if key not in metas:
            try:
                metas[key] = read_chunk_meta(store.path / "gens" / vname(oldest.version), cname(oldest.chunk))
            except (OSError, ValueError, KeyError):
                metas[key] = {}
        previous = metas[key].get("previous")
        if previous is None:
            lost.append((u, f"its oldest kept version, v{oldest.version}, does not record whether it replaced one "
                            "(saved by an older rmm-jax)"))
        elif previous[oldest.row] is not None:
            lost.append((u, f"its versions before v{oldest.version} are no longer kept "
                            f"({named('keep', store.keep)})"))
    if lost:
        u, why = lost[0]
        more = f" (and {len(lost) - 1} more users)" if len(lost) > 1 else ""
        raise InputError(f"cannot roll back to v{to}: user {u!r} keeps no version at or below it, and {why}{more}",
                         where=str(store.path))


def _setting_before(store, version: int) -> tuple[dict | None, bool]:
    """The setting the store recorded before the run that saved ``version`` began, and
    whether that version says (False: it does not; the setting stays as it is)."""
    run = _head(store, version).get("run")
    if not isinstance(run, dict) or "setting_before" not in run:
        return store._header.get(SETTING_KEY), False
    return run["setting_before"], True


def _shared_after(store, last: int | None) -> list[int]:
    """The shared versions an online run saved after shared version ``last`` (all an online
    run saved, when None): nothing uses them once no kept user version is newer."""
    if not store.paired:
        return []
    return [v for v in store.shared_versions() if (last is None or v > last) and store._shared.online(v)]
