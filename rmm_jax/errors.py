"""Errors raised on bad input.

Every error a user can cause is an :class:`InputError` whose message is one line that
names what is wrong and where: ``file:line``, a JSON key, or a CLI option. The CLI
prints the message on stderr and exits with status 2, with no traceback.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar


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
