"""Warnings raised while a command runs, printed as one formatted line each on stderr.

Python prints a warning as ``file:line: Category: message`` followed by the source line;
a command-line user needs neither. :func:`reported_warnings` (wrapped around every command
by :func:`rmm_jax.cli.main.main`) collects the warnings that pass the active filters and,
when the command ends (also on an error), prints:

- a policy restore (:class:`rmm_jax.persist.rollback.PolicyRestoreWarning`) as
  ``warning: STORE: user 'u7': restored v3, v4 is damaged (...)``; when more than
  :data:`SUMMARY_AFTER` users of one store roll back past the same versions for the same
  reasons, ONE line instead: ``warning: STORE: 812 users restored an older version (v4 is
  damaged (...)); first: 'u1'``;
- any other warning (e.g. NumPy's ``RuntimeWarning``) as ``warning: RuntimeWarning:
  message`` (rmm-jax's own, written for the user, as ``warning: message``), once per
  distinct message, with ``(N times)`` if it repeated.

A repeated warning (the same user restored twice, the shared part of a store restored for
every user served) prints once. What is kept is one line per user that rolled back and one
count per other distinct message, not every warning.
"""
from __future__ import annotations

import contextlib
import warnings

import click

from rmm_jax.persist.rollback import PolicyRestoreWarning, skips_text

SUMMARY_AFTER = 3  # up to this many users with the same rollback get a line each


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class WarningLines:
    """The warnings of one command, grouped (see the module docstring)."""

    def __init__(self):
        # (store, skipped) -> {who: line}: the users (or None, the shared part) that rolled back so
        self._restores: dict[tuple, dict[str | None, str]] = {}
        self._others: dict[tuple[str, str], int] = {}

    def add(self, message, category, filename, lineno, file=None, line=None) -> None:
        """A ``warnings.showwarning`` replacement: record instead of print."""
        if isinstance(message, PolicyRestoreWarning):
            group = self._restores.setdefault((message.store, message.skipped), {})
            if message.who not in group:   # lines beyond those that may be printed are not kept
                group[message.who] = f"warning: {_one_line(message)}" if len(group) <= SUMMARY_AFTER else ""
            return
        own = category.__module__.startswith("rmm_jax.")     # written for the user: its text says what it is
        key = ("" if own else category.__name__, _one_line(message))
        self._others[key] = self._others.get(key, 0) + 1

    def lines(self) -> list[str]:
        out = []
        for (store, skipped), group in self._restores.items():
            users = [who for who in group if who is not None]
            if None in group:
                out.append(group[None])
            if len(users) <= SUMMARY_AFTER:
                out += [group[who] for who in users]
            else:
                out.append(f"warning: {store}: {len(users)} users restored an older version "
                           f"({skips_text(skipped)}); first: {users[0]!r}")
        for (name, text), n in self._others.items():
            out.append(f"warning: {name + ': ' if name else ''}{text}" + (f" ({n} times)" if n > 1 else ""))
        return out


@contextlib.contextmanager
def reported_warnings():
    """Collect the warnings raised inside the block; print them as lines on stderr at its end."""
    collected = WarningLines()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", category=PolicyRestoreWarning)  # every user counts
        warnings.showwarning = collected.add
        try:
            yield collected
        finally:
            for line in collected.lines():
                click.echo(line, err=True)
