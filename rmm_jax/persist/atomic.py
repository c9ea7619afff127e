"""Crash-safe file output: nothing half-written.

Outputs are written into a temporary sibling and moved into place with ``os.replace``
(atomic on POSIX within one filesystem). A crash, a kill or an exception leaves either
the old output or the complete new one, never a mix. The temporary names are hidden
siblings (``.NAME.tmp-*``, and ``.NAME.old-*`` while a directory is replaced); what a
killed process left of them is found by :func:`leftovers`. A file's temp names its writer
(``.NAME.tmp-PID@HOST-*``): a process's first write in a directory removes those there whose
writer is gone (:func:`remove_stale_temps`).

Permissions are the user's: ``tempfile`` creates its files 0600 and directories 0700
whatever the umask, so :func:`temp_file` and :func:`temp_dir` give them the mode a plain
``open``/``mkdir`` would (0666 and 0777 less the umask), and an output moved into place is
as readable as any other file the user writes (a serving account in the same group can
read a store written under umask 002 or 022).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from rmm_jax.errors import PIPE_CLOSED, InputError

_MARKERS = (".tmp-", ".old-")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def process_umask() -> int:
    """The process's umask, read without changing it where ``/proc`` allows (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)                      # elsewhere: the classic set-and-restore
    os.umask(mask)
    return mask


def temp_dir(prefix: str, parent: str | os.PathLike) -> Path:
    """``tempfile.mkdtemp`` in ``parent``, with the mode ``mkdir`` would give (0777 & ~umask)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~process_umask())
    return path


def temp_file(prefix: str, parent: str | os.PathLike) -> tuple[int, str]:
    """``tempfile.mkstemp`` in ``parent`` (an open fd and the path), with the mode ``open``
    would give (0666 & ~umask)."""
    fd, path = tempfile.mkstemp(prefix=prefix, dir=parent)
    os.fchmod(fd, 0o666 & ~process_umask())
    return fd, path


class WriteProblem(str):
    """Why a directory cannot take new files (:func:`write_problem`), in words; ``machine``: the
    file system's doing (read-only, full, an I/O error: :func:`disk_problem` words it), not a
    permission or an immutable file the operator set."""

    machine: bool = False

    @classmethod
    def of(cls, text: str, machine: bool = False) -> "WriteProblem":
        out = cls(text)
        out.machine = machine
        return out


def write_problem(path: str | os.PathLike, depth: int = 0, *, own_files: bool = True) -> WriteProblem | None:
    """Why new files cannot be written in directory ``path``, or None if they can.

    ``path`` need not exist: then its nearest existing ancestor is what must take the new
    entries (and nothing below that ancestor is probed: its other directories are not the
    output's). A probe file is created and removed in the directory and in every directory up to
    ``depth`` levels below it: permissions, read-only mounts and immutable directories answer
    alike, for root too (which ignores modes). With ``own_files`` (a store rewritten in place),
    the files directly in it must be writable too; a file output renamed into the directory
    (``own_files=False``) does not touch the others: a read-only archived log beside it refused
    every ``--out`` there.
    """
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    if not p.is_dir():
        return WriteProblem.of(f"{p} is not a directory")
    level, dirs = [p], []
    for _ in range(depth + 1 if p == Path(path) else 1):
        dirs += level
        try:
            level = [c for d in level for c in d.iterdir() if c.is_dir() and not c.is_symlink()]
        except OSError as e:
            return WriteProblem.of(f"{e.filename or p}: {e.strerror or e}", disk_problem(e) is not None)
    for d in dirs:
        try:
            fd, probe = temp_file(".write-probe-", d)
        except OSError as e:
            return WriteProblem.of(f"{d}: {e.strerror or e}", disk_problem(e) is not None)
        os.close(fd)
        os.unlink(probe)
    if own_files and p == Path(path):
        for f in p.iterdir():
            if f.is_file() and not os.access(f, os.W_OK):
                return WriteProblem.of(f"{f}: not writable")
    return None


NO_SPACE = "no space left on device"
TOO_LARGE = "file too large for this process's limit (ulimit -f)"
SHORT_WRITE = "the file system took only part of a write (no space left on device?)"
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")   # numpy's tofile/np.save: a short fwrite, no errno


def disk_problem(e: BaseException | None, path: str | os.PathLike | None = None) -> str | None:
    """What a write that raised ``e`` ran out of, in words (None: not the disk's or a process
    limit's doing): a full disk or quota, the file-size limit (``ulimit -f``: EFBIG), a
    read-only file system, an I/O error, as an OSError (numpy's short write too: "N requested
    and M written", no errno) or as SQLite words them ("database or disk is full", "disk I/O
    error"), also where ``e`` is the cause or context of another error (an index that became
    unavailable). SQLite's "disk I/O error" says neither: where
    ``path``'s file system has next to no space left it is that, where this process has a
    file-size limit it is that likely, else it stays an I/O error.

    Examples:
        >>> import errno
        >>> from rmm_jax.persist.atomic import disk_problem
        >>> disk_problem(OSError(errno.ENOSPC, "No space left on device"))
        'no space left on device'
        >>> disk_problem(ValueError("bad")) is None
        True
    """
    import sqlite3

    for e in exception_chain(e):
        if isinstance(e, OSError) and not isinstance(e, BrokenPipeError):
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return NO_SPACE if e.errno == errno.ENOSPC else "disk quota exceeded"
            if e.errno == errno.EFBIG:
                return TOO_LARGE if _size_limit() is not None else "file too large for the file system"
            if e.errno == errno.EROFS:
                return "read-only file system"
            if e.errno == errno.EIO:
                return _io_cause(path or e.filename)
        if isinstance(e, OSError) and e.errno is None and _SHORT_WRITE.search(str(e)):
            return TOO_LARGE if _size_limit() is not None else SHORT_WRITE
        if isinstance(e, sqlite3.Error):
            text = str(e)
            if "disk is full" in text:
                return NO_SPACE
            if "disk I/O error" in text:
                return _io_cause(path)
            if "readonly database" in text:
                return "read-only (a read-only file system, or a file this process may not write)"
    return None


def exception_chain(e: BaseException | None):
    """``e``, then the error it was raised from or during (its cause, else its context), and
    so on, each once."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``; None: unlimited)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _io_cause(path) -> str:
    """An I/O error's likely cause (:func:`disk_problem`): a full file system at ``path``, a
    file-size limit, or the device."""
    p = Path(path) if path else None
    while p is not None and not p.exists() and p.parent != p:
        p = p.parent
    try:
        full = p is not None and shutil.disk_usage(p).free < 1 << 20
    except OSError:
        full = False
    if full:
        return NO_SPACE
    if _size_limit() is not None:
        return TOO_LARGE
    return "disk I/O error (a failing device?)"


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


def fsync_files(directory: Path) -> None:
    """fsync every file under ``directory``: what a writer of a whole directory calls last
    in :func:`atomic_dir`, so that the files a rename makes visible hold their bytes after a
    power cut (a name that survived with empty or partial files is a corrupt output)."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
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


def remove_dir(path: Path) -> None:
    """Delete directory ``path`` whole or not at all, as readers see it: it is first renamed
    to a leftover sibling (``.NAME.old-PID``, which the next writer removes if a kill stops
    the deletion), so no half-deleted ``path`` is ever listed. A missing ``path`` is fine."""
    path = Path(path)
    aside = path.parent / f".{path.name}.old-{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


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


def real_path(path: str | os.PathLike) -> Path:
    """``path``, or where it points when it is a symbolic link: what a write through it
    replaces, and what its lock and run-state are named after, whichever name a command is given.

    Examples:
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> from rmm_jax.persist.atomic import real_path
        >>> d = Path(tempfile.mkdtemp()); (d / "real").mkdir(); os.symlink(d / "real", d / "link")
        >>> real_path(d / "link") == (d / "real").resolve(), real_path(d / "new") == d / "new"
        (True, True)
    """
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, *, overwrite: bool = True):
    """Yield a temporary directory that becomes ``target`` on success.

    The caller fsyncs the files it writes; this fsyncs the directory, renames it into place
    and fsyncs the parent, so the new name survives a power cut (missing parents are created
    durably too). On an exception the temporary directory is removed and ``target`` is
    untouched. With ``overwrite`` an existing ``target`` is replaced by swapping the two in
    one step (:func:`exchange`), so a kill at any moment leaves ``target`` whole, old or new
    (the old copy is then a leftover ``.NAME.tmp-*``); where the system cannot swap, by two
    renames, between which ``target`` is missing and the old copy is ``.NAME.old-PID`` (a
    reader that finds it missing can wait for the second: :func:`being_replaced`). The
    old copy is removed after the new one is in place. Without ``overwrite`` an existing
    ``target`` raises FileExistsError before any work and again just before the rename
    (callers that need the check to be race-free hold a lock, as the policy store's writer
    does). A symbolic link stays a link: the directory it points to is replaced (swapped, the
    link became the new copy, and the old directory stayed, stale, under its own name).
    """
    target = real_path(target)        # a link stays a link: swapped, it was replaced by the new copy
    make_dirs(target.parent)
    if target.exists() and not overwrite:
        raise FileExistsError(str(target))
    tmp = temp_dir(f".{target.name}.tmp-", target.parent)
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


def being_replaced(target: str | os.PathLike) -> bool:
    """Whether a running process has moved ``target`` aside (``.NAME.old-PID``, its pid alive):
    :func:`atomic_dir` between its two renames where the system cannot swap, or
    :func:`remove_dir` deleting it. A reader that finds ``target`` missing waits while this holds."""
    target = Path(target)
    try:
        names = [p.name for p in target.parent.iterdir()]
    except OSError:
        return False
    prefix = f".{target.name}.old-"
    return any(n.startswith(prefix) and n[len(prefix):].isdigit() and pid_alive(int(n[len(prefix):])) for n in names)


@functools.cache
def _host_tag() -> str:
    """A short tag of this host, so that a temp's owner is a pid on this host."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _owner_prefix(target: Path, pid: int | None = None) -> str:
    """The temp-name prefix of :func:`atomic_file`: ``.NAME.tmp-PID@HOST-`` (its writer)."""
    return f".{target.name}.tmp-{os.getpid() if pid is None else pid}@{_host_tag()}-"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host: a zombie (killed, not yet reaped, as under
    an init that reaps nothing) does not. The one liveness probe of :mod:`rmm_jax.persist`
    (:func:`rmm_jax.persist.lock.live_holder` uses it where ``flock`` cannot be queried)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:             # another user's process: alive
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:             # no /proc (or it just ended): as kill said
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove the temps that :func:`atomic_file` writers left in ``directory`` when they were
    killed (SIGKILL, a second Ctrl-C during their cleanup): only files named as such a writer
    names them, ``.NAME.tmp-PID@HOST-*``, of this host and a pid that no longer runs; never
    another host's, a live writer's, nor a temp of another naming. Returns what was removed.
    :func:`atomic_file` calls it once per process and directory (:func:`_swept`), so a run
    that writes an output again (resumed, or started over) leaves no 0-byte leftover beside
    it, and a directory of many outputs (a run-state's chunks) is listed once, not per write."""
    directory = Path(directory)
    tail = f"@{_host_tag()}-"
    removed = []
    try:
        names = [p for p in directory.iterdir() if p.name.startswith(".") and ".tmp-" in p.name]
    except OSError:
        return removed
    for p in names:
        pid, sep, rest = p.name.partition(".tmp-")[2].partition(tail)
        if not sep or not rest or not pid.isdigit() or int(pid) <= 0 or pid_alive(int(pid)):
            continue
        if p.is_file() and not p.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


_SWEPT: set[Path] = set()


def _swept(directory: Path) -> None:
    """:func:`remove_stale_temps` of ``directory``, the first time this process writes in it."""
    if directory not in _SWEPT:
        remove_stale_temps(directory)
        _SWEPT.add(directory)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike, mode: str = "w"):
    """Yield a file object whose content replaces ``target`` only on success. The temp is
    ``.NAME.tmp-PID@HOST-*`` (its writer); the first write of this process in a directory
    removes the temps there whose writer is gone (:func:`remove_stale_temps`).

    A symbolic link stays a link: the file it points to is replaced. A target that exists
    and is neither a file nor a directory (``/dev/null``, a named pipe) is written into as
    it is, since replacing it would turn it into a plain file (``--out /dev/null`` made
    ``/dev/null`` one for every program on the machine); a pipe whose reader goes away is an
    ``InputError`` naming it."""
    target = real_path(target)
    if target.exists() and not target.is_file() and not target.is_dir():
        try:
            with open(target, mode) as f:
                yield f
        except BrokenPipeError as e:
            raise InputError(PIPE_CLOSED, where=str(target)) from e
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    _swept(target.parent.absolute())
    fd, tmp = temp_file(_owner_prefix(target), target.parent)
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
