"""One writer at a time: an exclusive, non-blocking lock file that names its holder.

The policy store (``STORE/.lock``) and the run-state (``X.runstate/.lock``) each admit
one writing process. :class:`WriterLock` wraps :class:`filelock.FileLock`, which is
``flock`` on POSIX: the kernel drops the lock when the holder exits or is killed, so a
stale lock file is harmless and never needs breaking. While the lock is held the file
records the holder's ``{"pid", "host", "since"}`` and the ``command`` its owner names
(advisory: read for the error message, and by readers, :func:`live_holder`, to name the
writer that is running); the outermost release marks it ``"released"`` before unlocking. A
second writer, in another process or through another ``WriterLock`` in the same process,
fails within :data:`GRACE` seconds (or after ``wait`` seconds) with the InputError its owner builds from that
record, as a :class:`rmm_jax.errors.Busy` (the CLI's exit status 75: retry when the holder
ends); acquiring again through the same object nests.

Whether a writer is running is whether the lock is held now (:func:`held`), never whether
the record's pid is alive: a record a SIGKILLed writer left (or one written before the
``"released"`` mark existed) may name a pid the system has since given to an unrelated
process. ``flock`` has no query, so :func:`held` tries a non-blocking *shared* lock on its
own descriptor and drops it at once (or learns that the exclusive holder refuses it). That
probe lasts microseconds, but a writer trying then would see the lock taken: so a writer
retries for :data:`GRACE` seconds before it calls the lock busy, and a probe never makes a
writer fail.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import socket
from pathlib import Path
from typing import Callable

import filelock

from rmm_jax.errors import Busy, InputError
from rmm_jax.persist.atomic import pid_alive

try:
    import fcntl
except ImportError:                 # not POSIX: held() cannot tell, live_holder() reads the pid
    fcntl = None

GRACE = 0.2             # seconds a writer retries a lock it finds taken: longer than a reader's probe (held())
_POLL = 0.01


def _record_holder(fd: int, command: str | None = None) -> None:
    """Write this process's pid/host (and ``command``) into the lock file just taken (filelock's hook)."""
    os.ftruncate(fd, 0)
    since = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    rec = {"pid": os.getpid(), "host": socket.gethostname(), "since": since}
    if command:
        rec["command"] = command
    os.pwrite(fd, json.dumps(rec).encode(), 0)


def _read_record(path: Path) -> dict:
    try:
        rec = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def held(path: str | os.PathLike) -> bool | None:
    """Whether some process (this one included, through another :class:`WriterLock`) holds
    the lock file ``path`` now; None when this cannot be told (no ``flock`` here, the file
    unreadable). Takes nothing a writer waits on: a shared ``flock`` on a descriptor of its
    own, dropped at once (a writer retries for :data:`GRACE` seconds, so it never fails on
    this probe); a missing file is not held."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return True if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def live_holder(path: str | os.PathLike) -> dict | None:
    """The record of the process holding the lock file ``path`` now, read without taking the
    lock (a reader must not make a writer fail "in use"): None when there is no record, its
    holder released it, or the lock is not held now (:func:`held`), as after a SIGKILL, whatever
    process now has the pid the record names. Only where the lock cannot be queried is the
    record's pid checked instead (a holder on another host then taken as alive)."""
    rec = _read_record(Path(path))
    if not rec.get("pid") or rec.get("released"):
        return None
    now = held(path)
    if now is not None:
        return rec if now else None
    pid = rec["pid"]
    if rec.get("host") == socket.gethostname() and not (isinstance(pid, int) and pid > 0 and pid_alive(pid)):
        return None
    return rec


class WriterLock:
    """The exclusive lock on file ``path``.

    ``busy(holder)`` makes the InputError raised when another writer holds the lock;
    ``holder`` is the record it wrote (``{}`` if unreadable), so use ``holder.get``.
    ``command`` (e.g. ``replay``) is recorded with the pid, for readers to name the writer.
    """

    def __init__(self, path: str | os.PathLike, busy: Callable[[dict], InputError], command: str | None = None):
        self.path = Path(path)
        self._busy = busy
        self.command = command
        self._lock: filelock.BaseFileLock | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock is not None and self._lock.is_locked

    def acquire(self, wait: float = 0.0) -> bool:
        """Take the lock, waiting up to ``wait`` seconds (0: at most :data:`GRACE`, the time a
        reader's probe of it may take, :func:`held`). Returns True if this call took it, False
        if this object already held it (nested)."""
        if self.held:
            self._lock.acquire()
            return False
        # A fresh FileLock per outermost hold: filelock refuses an instance made before a fork.
        # thread_local=False: nesting is per object, as for the callers' own re-entrancy.
        # No soft fallback: the file must stay the flock'ed one holding our record.
        self._lock = filelock.FileLock(self.path, thread_local=False, fallback_to_soft=False,
                                       preserve_lock_file=True,
                                       on_acquired=lambda fd: _record_holder(fd, self.command))
        was = self.holder()         # who holds it now, for the error should its directory go as we wait
        try:
            self._lock.acquire(timeout=max(wait, GRACE), poll_interval=_POLL, blocking=True)
        except filelock.Timeout:
            self._lock = None
            raise Busy.of(self._busy(self.holder())) from None
        except FileNotFoundError:   # the holder ended as we waited and removed the lock's directory (a run-state)
            self._lock = None
            raise Busy.of(self._busy(was)) from None
        return True

    def check_free(self) -> None:
        """Raise the error :meth:`acquire` would if another holder has the lock now, taking
        nothing (the readers' probe, :func:`live_holder`): for a command that must say it is
        busy before it says or writes anything else, and takes the lock later."""
        if self.held:
            return
        rec = live_holder(self.path)
        if rec is not None:
            raise Busy.of(self._busy(rec))

    def release(self) -> None:
        """Undo one :meth:`acquire`; the outermost marks the record released (still holding
        the lock, so no next holder's record is overwritten) and releases the file lock."""
        if self.held:
            if self._lock.lock_counter == 1:
                self._mark_released()
            self._lock.release()

    def _mark_released(self) -> None:
        rec = self.holder()
        if rec.get("pid") != os.getpid():
            return
        data = json.dumps({**rec, "released": True}).encode()
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.pwrite(fd, data, 0)          # longer than the record: then cut, never empty
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)

    def holder(self) -> dict:
        """The record the current (or last) holder wrote, or ``{}``."""
        return _read_record(self.path)

    @contextlib.contextmanager
    def hold(self, wait: float = 0.0):
        """``with lock.hold():`` acquire and release around the block; yields whether
        this hold is the outermost one."""
        first = self.acquire(wait)
        try:
            yield first
        finally:
            self.release()
