"""A record's ``timestamp``: checked, read as seconds, and written for a call served now."""
from __future__ import annotations

import datetime as dt
import math
import time
from typing import Any

from rmm_jax.data.citation_log._schema import _key_where, _type_name
from rmm_jax.errors import InputError
from rmm_jax.persist.learned_calls import FUTURE_SKEW


def check_timestamp(value: Any, where: str, now: float | None = None) -> str | int | float | None:
    """A record's ``timestamp`` (``where``: its ``FILE:LINE``): None, a string, or a number
    that is finite as a float (:func:`timestamp_seconds` reads it as one), at most a day
    (:data:`FUTURE_SKEW`) after ``now`` (None: the clock's): a call from the future, such as epoch
    milliseconds read as seconds, would leave every later call of its user older than what
    its policy has learned, never learned.

    >>> from rmm_jax.data.citation_log import check_timestamp
    >>> check_timestamp(1735689600000, "log.jsonl:1", now=1735689600.0)
    Traceback (most recent call last):
    ...
    rmm_jax.errors.InputError: log.jsonl:1: key 'timestamp': its time 1735689600000 (year 56971) is after now \
(2025-01-01T00:00:00Z); times are seconds since the epoch or ISO 8601 dates (did you write milliseconds?)
    """
    if value is None or isinstance(value, str):
        _check_not_future(value, where, now)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"must be a string or a number, got {_type_name(value)}",
                         where=_key_where(where, "timestamp"))
    try:
        finite = math.isfinite(float(value))
    except OverflowError:        # an int beyond float's range
        finite = False
    if not finite:
        shown = repr(value) if len(repr(value)) <= 24 else repr(value)[:20] + "…"
        raise InputError(f"must be finite (seconds), got {shown}", where=_key_where(where, "timestamp"))
    _check_not_future(value, where, now)
    return value


def _check_not_future(value, where: str, now: float | None) -> None:
    """:func:`check_timestamp`'s refusal of a time after ``now`` (and its allowance for skew)."""
    t = timestamp_seconds(value)
    now = time.time() if now is None else now
    if not t > now + FUTURE_SKEW:        # NaN (none, free text) passes
        return
    shown = repr(value) if isinstance(value, str) else f"{value} (year {int(1970 + t / 31_556_952)})"
    hint = "did you write milliseconds?" if not isinstance(value, str) else "a clock set ahead, or a wrong year?"
    raise InputError(f"its time {shown} is after now ({time_text(now)}); times are seconds since the epoch or "
                     f"ISO 8601 dates ({hint})", where=_key_where(where, "timestamp"))


def time_text(seconds: float) -> str:
    """A time in seconds since the epoch as a person reads it: ISO 8601 UTC to the second, or
    the seconds where no calendar date holds them.

    >>> from rmm_jax.data.citation_log import time_text
    >>> time_text(1735689600.0), time_text(1.7e12)
    ('2025-01-01T00:00:00Z', '1.7e+12 seconds since the epoch')
    """
    try:
        return dt.datetime.fromtimestamp(int(seconds), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, ValueError, OSError):
        return f"{seconds:g} seconds since the epoch"


def timestamp_seconds(value: str | int | float | None) -> float:
    """A record's ``timestamp`` as seconds that compare in time: a number as it is, an ISO
    8601 string (``2024-05-01``, ``2024-05-01T09:30:00+02:00``; without a zone, UTC) as
    seconds since the epoch; NaN when there is none or it is free text.

    >>> import math
    >>> from rmm_jax.data.citation_log import timestamp_seconds
    >>> timestamp_seconds("1970-01-02"), timestamp_seconds(5), math.isnan(timestamp_seconds("last Tuesday"))
    (86400.0, 5.0, True)
    """
    if value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    try:
        t = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        return math.nan
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def utc_timestamp(microseconds: int) -> str:
    """A time in whole microseconds since the epoch as the ISO 8601 UTC string a log's
    ``timestamp`` holds (``rmm-jax rerank`` stamps a call that came without one with it).
    :func:`timestamp_seconds` reads it back to the microsecond, and two such strings of one
    length compare as their times do.

    >>> from rmm_jax.data.citation_log import timestamp_seconds, utc_timestamp
    >>> utc_timestamp(1_714_555_800_000_001)
    '2024-05-01T09:30:00.000001Z'
    >>> timestamp_seconds(utc_timestamp(86_400_000_000))
    86400.0
    """
    seconds, micro = divmod(int(microseconds), 1_000_000)
    t = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).replace(microsecond=micro)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
