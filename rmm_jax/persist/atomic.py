"""Crash-safe file output: nothing half-written.

Outputs are written into a temporary sibling and moved into place with ``os.replace``
(atomic on POSIX within one filesystem). A crash, a kill or an exception leaves either
the old output or the complete new one, never a mix. The temporary names are hidden
siblings (``.NAME.tmp-*``, and ``.NAME.old-*`` while a directory is replaced); what a
killed process left of them is found by :func:`leftovers`.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

_MARKERS = (".tmp-", ".old-")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def fsync_dir(path: Path) -> None:
    """fsync directory ``path`` so renames into it are durable (best effort: errors ignored)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose new directories are durable: each one created is fsynced into its parent."""
    path = Path(path)
    if path.is_dir():
        return
    make_dirs(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        return
    fsync_dir(path.parent)


def leftovers(parent: Path) -> list[Path]:
    """Temporary siblings under ``parent`` that :func:`atomic_dir`/:func:`atomic_file` left
    behind when their process was killed (remove them only while no writer can be running)."""
    if not Path(parent).is_dir():
        return []
    return [p for p in Path(parent).iterdir() if p.name.startswith(".") and any(m in p.name for m in _MARKERS)]


@functools.cache
def _renameat2():
    """libc's ``renameat2`` (Linux, glibc 2.28+), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap paths ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False, with nothing changed, where the system or the filesystem
    cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, *, overwrite: bool = True):
    """Yield a temporary directory that becomes ``target`` on success.

    The caller fsyncs the files it writes; this fsyncs the directory, renames it into place
    and fsyncs the parent, so the new name survives a power cut (missing parents are created
    durably too). On an exception the temporary directory is removed and ``target`` is
    untouched. With ``overwrite`` an existing ``target`` is replaced by swapping the two in
    one step (:func:`exchange`), so a kill at any moment leaves ``target`` whole, old or new
    (the old copy is then a leftover ``.NAME.tmp-*``); where the system cannot swap, by two
    renames, between which ``target`` is missing and the old copy is ``.NAME.old-PID``. The
    old copy is removed after the new one is in place. Without ``overwrite`` an existing
    ``target`` raises FileExistsError before any work and again just before the rename
    (callers that need the check to be race-free hold a lock, as the policy store's writer
    does).
    """
    target = Path(target)
    make_dirs(target.parent)
    if target.exists() and not overwrite:
        raise FileExistsError(str(target))
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        fsync_dir(tmp)
        if target.exists():
            if not overwrite:
                raise FileExistsError(str(target))
            if exchange(tmp, target):      # one atomic step: target is the new copy, tmp the old one
                shutil.rmtree(tmp, ignore_errors=True)
            else:                          # two renames: between them target is missing (old copy at .old-)
                old = target.parent / f".{target.name}.old-{os.getpid()}"
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike, mode: str = "w"):
    """Yield a file object whose content replaces ``target`` only on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(target: str | os.PathLike, obj) -> None:
    """Atomically write ``obj`` as indented JSON."""
    with atomic_file(target) as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
