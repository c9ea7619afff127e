"""A record's ``timestamp``: checked, read as seconds, and written for a call served now."""
from __future__ import annotations

import datetime as dt
import math
from typing import Any

from rmm_jax.data.citation_log._schema import _key_where, _type_name
from rmm_jax.errors import InputError


def check_timestamp(value: Any, where: str) -> str | int | float | None:
    """A record's ``timestamp`` (``where``: its ``FILE:LINE``): None, a string, or a number
    that is finite as a float (:func:`timestamp_seconds` reads it as one)."""
    if value is None or isinstance(value, str):
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
    return value


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
