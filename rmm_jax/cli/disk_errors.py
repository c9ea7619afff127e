"""One line, not a traceback, for a command stopped by the disk or a process limit.

A full disk, a quota, the file-size limit (``ulimit -f``), a read-only file system or an
I/O error can stop any writing verb part-way, raised as an OSError, an SQLite error or an
error wrapping one (:func:`rmm_jax.persist.atomic.disk_problem` words the cause).
:func:`error_line` names what the command was writing: the file the error names, else the
outputs its checks registered before any work (:func:`writing`: ``--out PATH``,
``--policies PATH``); a run that left a checkpoint says it resumes, as a stop by SIGTERM
does (:data:`rmm_jax.cli.signals.MESSAGE`; :func:`running` registers its target).
"""
from __future__ import annotations

from pathlib import Path

STDOUT = "stdout"     # the file name of stdout's write errors (rmm_jax.cli.main._Stdout)
_OUTPUTS: list[tuple[str, Path | None]] = []     # (how the command names it, its path) of what it writes
_RUNS: list = []                                  # the targets of runs that keep a run-state


def forget() -> None:
    """A new command: nothing registered (the CLI's tests run many in one process)."""
    _OUTPUTS.clear()
    _RUNS.clear()


def writing(where: str, path=None) -> None:
    """The command writes ``path``, named ``where`` (an option and its value) in its errors."""
    if all(w != where for w, _ in _OUTPUTS):
        _OUTPUTS.append((where, Path(path) if path is not None else None))


def running(target) -> None:
    """The command's run keeps its checkpoints in ``target``'s run-state."""
    _RUNS.append(target)


def error_line(e: BaseException) -> str | None:
    """The ``error: WHAT: CAUSE`` line of ``e`` when the disk or a process limit caused it
    (None: something else, left to propagate)."""
    from rmm_jax.persist.atomic import disk_problem, exception_chain

    filename = next((x.filename for x in exception_chain(e) if isinstance(x, OSError) and x.filename), None)
    if filename == STDOUT:
        cause = disk_problem(e)
        return None if cause is None else f"error: {STDOUT}: {cause}"
    named = _named(filename)
    cause = disk_problem(e, named[1] if named else filename)
    if cause is None:
        return None
    what = named[0] if named else (str(filename) if filename else "writing")
    return f"error: {what}: {cause}" + _resume_hint()


def _named(filename) -> tuple[str, Path | None] | None:
    """The registered output ``filename`` lies in (or is), else the only one registered, else
    the target of the run that keeps a run-state (what it writes until the end), else all of
    them in one name; None: none registered."""
    if not _OUTPUTS:
        return None
    if filename:
        f = Path(filename).absolute()
        for where, p in _OUTPUTS:
            if p is not None and (f == p.absolute() or p.absolute() in f.parents or f.parent == p.absolute().parent):
                return where, p
    if len(_OUTPUTS) == 1:
        return _OUTPUTS[0]
    for where, p in _OUTPUTS:        # a run writes its target (--policies) all along; a plot or a log at the end
        if p is not None and any(Path(t).absolute() == p.absolute() for t in _RUNS):
            return where, p
    return " or ".join(w for w, _ in _OUTPUTS), _OUTPUTS[0][1]


def _resume_hint() -> str:
    """``; interrupted; resume with --resume`` where a run left a checkpoint to resume from."""
    if not _RUNS:
        return ""
    from rmm_jax.cli.signals import MESSAGE
    from rmm_jax.persist.runstate import RunState

    try:
        resumable = any(RunState.interrupted_command(t) is not None for t in _RUNS)
    except Exception:    # the run-state unreadable too: no hint rather than a second traceback
        resumable = False
    return f"; {MESSAGE}" if resumable else ""
