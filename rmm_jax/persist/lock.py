"""One writer at a time: an exclusive, non-blocking lock file that names its holder.

The policy store (``STORE/.lock``) and the run-state (``X.runstate/.lock``) each admit
one writing process. :class:`WriterLock` wraps :class:`filelock.FileLock`, which is
``flock`` on POSIX: the kernel drops the lock when the holder exits or is killed, so a
stale lock file is harmless and never needs breaking. While the lock is held the file
records the holder's ``{"pid", "host", "since"}`` (advisory: read only for the error
message). A second writer, in another process or through another ``WriterLock`` in the
same process, fails at once (or after ``wait`` seconds) with the InputError its owner
builds from that record; acquiring again through the same object nests.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
from pathlib import Path
from typing import Callable

import filelock

from rmm_jax.errors import InputError


def _record_holder(fd: int) -> None:
    """Write this process's pid/host into the lock file just taken (filelock's hook)."""
    os.ftruncate(fd, 0)
    since = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode(), 0)


class WriterLock:
    """The exclusive lock on file ``path``.

    ``busy(holder)`` makes the InputError raised when another writer holds the lock;
    ``holder`` is the record it wrote (``{}`` if unreadable), so use ``holder.get``.
    """

    def __init__(self, path: str | os.PathLike, busy: Callable[[dict], InputError]):
        self.path = Path(path)
        self._busy = busy
        self._lock: filelock.BaseFileLock | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock is not None and self._lock.is_locked

    def acquire(self, wait: float = 0.0) -> bool:
        """Take the lock, waiting up to ``wait`` seconds (0: one try). Returns True if
        this call took it, False if this object already held it (nested)."""
        if self.held:
            self._lock.acquire()
            return False
        # A fresh FileLock per outermost hold: filelock refuses an instance made before a fork.
        # thread_local=False: nesting is per object, as for the callers' own re-entrancy.
        # No soft fallback: the file must stay the flock'ed one holding our record.
        self._lock = filelock.FileLock(self.path, thread_local=False, fallback_to_soft=False,
                                       preserve_lock_file=True, on_acquired=_record_holder)
        try:
            self._lock.acquire(timeout=wait, blocking=wait > 0)
        except filelock.Timeout:
            self._lock = None
            raise self._busy(self.holder()) from None
        return True

    def release(self) -> None:
        """Undo one :meth:`acquire`; the outermost releases the file lock."""
        if self.held:
            self._lock.release()

    def holder(self) -> dict:
        """The record the current holder wrote, or ``{}``."""
        try:
            rec = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return rec if isinstance(rec, dict) else {}

    @contextlib.contextmanager
    def hold(self, wait: float = 0.0):
        """``with lock.hold():`` acquire and release around the block; yields whether
        this hold is the outermost one."""
        first = self.acquire(wait)
        try:
            yield first
        finally:
            self.release()
