"""Errors raised on bad input.

Every error a user can cause is an :class:`InputError` whose message is one line that
names what is wrong and where: ``file:line``, a JSON key, or a CLI option. The CLI
prints the message on stderr and exits with status 2, with no traceback.
"""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input: a file, a record, an option or an array argument."""

    def __init__(self, message: str, *, where: str | None = None):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


def at(path, line: int | None = None, key: str | None = None) -> str:
    """Format a location: ``path``, ``path:line`` or ``path:line: key 'k'``."""
    loc = str(path)
    if line is not None:
        loc += f":{line}"
    if key is not None:
        loc += f": key '{key}'"
    return loc
