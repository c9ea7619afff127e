"""Errors raised on bad input.

Every error a user can cause is an :class:`InputError` whose message is one line that
names what is wrong and where: ``file:line``, a JSON key, or a CLI option. The CLI
prints the message on stderr and exits with its :attr:`~InputError.exit_code`, with no
traceback: 2, or :data:`EXIT_BUSY` (75) for a :class:`Busy` one (another process is writing
what this one must write: retry when it ends), or 1 for a :class:`WriteFailed` one (the disk
or a limit of this process stopped a write).
"""
from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

PIPE_CLOSED = "its reader closed the pipe before everything was written"
"""The error when a pipe written into (a FIFO given as ``--out``, or stdout into ``| head``) loses its reader."""
EXIT_BUSY = 75          # EX_TEMPFAIL (sysexits.h): a temporary failure, try again later


class InputError(ValueError):
    """Bad user input: a file, a record, an option or an array argument.

    ``where`` is a location as it is shown (``file:line``, a key, an option, a path);
    ``arg`` names an argument of the Python API (``min_ess``, or ``users user9``: its name,
    a space, and which part of it): it is shown as ``where`` is, and marks the error as one
    of that argument (``self.arg``, the name alone), which the CLI shows as the option that
    gives it (:func:`rmm_jax.cli.shell.as_options`). A path that happens to be spelt like an
    argument (a store directory named ``users``) stays a location.

    >>> from rmm_jax.errors import InputError
    >>> e = InputError("bad", arg="users user9")
    >>> str(e), e.where, e.arg, e.message
    ('users user9: bad', 'users user9', 'users', 'bad')
    >>> InputError("bad", where="users").arg is None
    True
    """

    def __init__(self, message: str, *, where: str | None = None, arg: str | None = None):
        if where is not None and arg is not None:
            raise TypeError("InputError takes where= (a location) or arg= (an argument), not both")
        self.arg = arg.partition(" ")[0] if arg else None
        self.where = arg if arg else where
        self.message = message      # without the location: what a re-worded error keeps
        super().__init__(f"{self.where}: {message}" if self.where else message)

    exit_code = 2                   # the CLI's exit status for it: bad input


class WriteFailed(InputError):
    """The disk or a limit of this process stopped a write (a full disk, a quota, ``ulimit
    -f``): nothing is wrong with the input, and nothing was half-written. The CLI exits 1, as
    for the same failure raised as an OSError (docs/reliability.md, Exit status).

    >>> from rmm_jax.errors import WriteFailed
    >>> e = WriteFailed("cannot write the embedding cache: no space left on device", where="c.sqlite")
    >>> str(e), e.exit_code
    ('c.sqlite: cannot write the embedding cache: no space left on device', 1)
    """

    exit_code = 1


class Diverged(InputError):
    """A learning setting whose updates made a parameter non-finite (a step size far out of
    scale): bad input, found only once the run has learned. Nothing of it is worth resuming,
    so the run-state goes with it (:func:`rmm_jax.cli.online.saving_run`) and the same command
    with a smaller ``--lr`` runs again; users chunks the run saved before it diverged keep
    their versions, which the message says ``policies rollback`` undoes.

    >>> from rmm_jax.errors import Diverged
    >>> e = Diverged("not finite", where="--lr")
    >>> str(e), e.exit_code
    ('--lr: not finite', 2)
    """


class Busy(InputError):
    """Another process holds the lock on what this one must write (a store, a run-state):
    nothing is wrong with the input, retry when that process ends. The CLI exits with
    :data:`EXIT_BUSY` (75, ``EX_TEMPFAIL``), so a wrapper can tell "busy, retry" from bad input
    (2).

    >>> from rmm_jax.errors import Busy, InputError
    >>> e = Busy.of(InputError("in use by pid 7", where="p.runstate"))
    >>> isinstance(e, InputError), str(e), e.exit_code
    (True, 'p.runstate: in use by pid 7', 75)
    """

    exit_code = EXIT_BUSY

    @classmethod
    def of(cls, e: InputError) -> "Busy":
        """``e`` as a :class:`Busy` error: the same message, location and argument."""
        if isinstance(e, cls):
            return e
        busy = cls(e.message)
        busy.where, busy.arg, busy.args = e.where, e.arg, e.args
        return busy


def is_int(x) -> bool:
    """A Python or NumPy integer (``numbers.Integral``), not a bool: what a count or size takes.
    (NumPy's ``bool_`` is not an ``Integral``.)"""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def short(x) -> str:
    """What ``x`` is, in a few words, for an error message."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"{x.dtype}{list(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:60]


def _bound(v: int) -> str:
    return {2**63: "2**63", -2**63: "-2**63"}.get(v, str(v))


def check_int(x, name: str, low: int | None = None, high: int | None = None, *, note: str = "",
              shown: Callable[[object], str] = short, cut: int | None = None, where: bool = False) -> None:
    """:class:`InputError` unless ``x`` is an int (:func:`is_int`, not a bool) >= ``low`` (and
    < ``high``): "must be an int >= {low}{note}, got {shown(x)}" (or "in [low, high)", or no
    bound without ``low``), cut to ``cut`` characters, naming ``name`` as an argument (``arg=``)
    or, with ``where=True``, as a location. Here, not in :mod:`rmm_jax.core.checks`: the
    store's reader (``rmm-jax embed``) checks without importing JAX.

    >>> from rmm_jax.errors import check_int
    >>> check_int(3, "samples", 1)
    >>> check_int(0, "samples", 1)
    Traceback (most recent call last):
    ...
    rmm_jax.errors.InputError: samples: must be an int >= 1, got int 0
    >>> check_int(-1, "seed", 0, 2**63, shown=repr)
    Traceback (most recent call last):
    ...
    rmm_jax.errors.InputError: seed: must be an int in [0, 2**63), got -1
    """
    if is_int(x) and (low is None or x >= low) and (high is None or x < high):
        return
    span = "" if low is None else f" >= {low}" if high is None else f" in [{_bound(low)}, {_bound(high)})"
    message = f"must be an int{span}{note}, got {shown(x)}"[:cut]
    raise InputError(message, where=name) if where else InputError(message, arg=name)


def at(path, line: int | None = None, key: str | None = None) -> str:
    """Format a location: ``path``, ``path:line`` or ``path:line: key 'k'``."""
    loc = str(path)
    if line is not None:
        loc += f":{line}"
    if key is not None:
        loc += f": key '{key}'"
    return loc


_WORDING: ContextVar[Mapping[str, str]] = ContextVar("rmm_jax_wording", default={})


def named(name: str, value=None) -> str:
    """How a message names argument ``name`` (given ``value``): ``name=value`` (or ``name``)
    for a Python caller; inside :func:`worded` that maps ``name``, what the caller gave it as
    (the CLI's ``--k 3``, or ``--relearn`` for a flag's True), so that every message names
    what its reader can change without the API taking the CLI's words as arguments.

    >>> from rmm_jax.errors import named, worded
    >>> named("k", 3), named("clip"), named("relearn", True)
    ('k=3', 'clip', 'relearn=True')
    >>> with worded({"k": "--k", "relearn": "--relearn"}):
    ...     named("k", 3), named("clip"), named("relearn", True)
    ('--k 3', 'clip', '--relearn')
    """
    given = option_of(name)
    if given is None:
        return name if value is None else f"{name}={value}"
    return given if value is None or value is True else f"{given} {value}"


def option_of(name: str) -> str | None:
    """What argument ``name`` was given as, inside a :func:`worded` that maps it (the CLI's
    ``--queries``), else None: for a message whose wording differs beyond :func:`named`'s.

    >>> from rmm_jax.errors import option_of, worded
    >>> with worded({"queries": "--queries"}):
    ...     option_of("queries")
    '--queries'
    >>> option_of("queries") is None
    True
    """
    return _WORDING.get().get(name)


@contextlib.contextmanager
def worded(names: Mapping[str, str]) -> Iterator[None]:
    """Within it, :func:`named` words the arguments ``names`` maps as it says: the CLI's
    :func:`rmm_jax.cli.shell.as_options` maps each argument to its option, and
    :func:`rmm_jax.data.embed.embed_texts` its caches' root to the variable that sets it.
    Inner mappings add to outer ones."""
    token = _WORDING.set({**_WORDING.get(), **names})
    try:
        yield
    finally:
        _WORDING.reset(token)
