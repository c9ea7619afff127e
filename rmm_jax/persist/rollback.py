"""What a restore that fell back to an older version says: each newer version it skipped
(:class:`Skip`, ``v4 is damaged (...)``) and the warning that names the version restored
(:class:`PolicyRestoreWarning`). No JAX here: the CLI formats these warnings
(:mod:`rmm_jax.cli.warning_lines`) around every verb, including those that never load JAX.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence


class Skip(NamedTuple):
    """A newer version that did not load, and why: ``f"v{version} {reason}"`` reads as a
    sentence (``reason`` starts with "is" or "needs")."""

    version: int
    reason: str


class PolicyRestoreWarning(UserWarning):
    """A newer version did not load and an older one was restored. The message is one line
    (``STORE: user 'u7': restored v3, v4 is damaged (...)``); ``store``, ``who`` (a user id,
    or None for the shared part), ``version`` and ``skipped`` let a CLI summarise many."""

    def __init__(self, store: str, who: str | None, version: int, skipped: Sequence[Skip]):
        self.store, self.who, self.version, self.skipped = store, who, version, tuple(skipped)
        name = "shared" if who is None else f"user {who!r}"
        super().__init__(f"{store}: {name}: restored v{version}, {skips_text(skipped)}")


def skips_text(skipped: Sequence[Skip]) -> str:
    """``v4 is damaged (...); v3 needs shared v2, which is missing``."""
    return "; ".join(f"v{s.version} {s.reason}" for s in skipped)
