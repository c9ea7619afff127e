"""A record against the ids a store holds (``known=``): what the store lacks, the record
must carry as text, and a text it carries for a memory the store holds must be the store's."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rmm_jax.data.citation_log._schema import LogRecord, _key_where
from rmm_jax.errors import InputError

Known = Any  # object with .users, a Mapping, or a callable; see _known_lookup


def _known_lookup(known: Known) -> Callable[[str], Any]:
    """Normalise ``known`` to ``user_id -> (query_ids, memory_ids) | None``.

    Accepted: an object with a ``users`` mapping ``user_id -> (query_ids, memory_ids)``,
    such a mapping itself, or a callable taking a user id and returning the pair or
    ``None`` for an unknown user (an embedding store has no ``users`` mapping: wrap it
    in a callable that reads one user's ids at a time). ``memory_ids`` may be a mapping
    ``id -> text``: a record's text for such a memory must then be that text.
    """
    users = getattr(known, "users", None)
    if isinstance(users, Mapping):
        return users.get
    if isinstance(known, Mapping):
        return known.get
    if callable(known):
        return known
    raise InputError("must be an object with a 'users' mapping, a mapping or a callable, "
                     f"got {type(known).__name__}", where="argument 'known'")


def _check_known(rec: LogRecord, lookup: Callable[[str], Any], where: str) -> tuple[str, ...]:
    """What the store lacks the record must carry as text: a query id the store does not
    hold needs the ``query`` text, a memory id it does not hold needs the candidate's
    text, and a user it does not hold needs both for everything. When the lookup's memory
    ids are a mapping ``id -> text`` (:func:`rmm_jax.data.log_vectors.known_ids`), a text
    the record carries for a memory the store holds must be the store's. Returns the
    record's gold ids that neither the store nor the record holds (no error: another record
    of the user may list one; a reader counts those none lists): none when the store holds
    the question, whose gold is the store's and the record's is not read."""
    entry = lookup(rec.user_id)
    query_ids, memory_ids = entry if entry is not None else ((), ())
    texts = rec.candidate_texts or (None,) * len(rec.candidates)
    if entry is None and (rec.query_text is None or any(t is None for t in texts)):
        raise InputError(f"unknown user id {rec.user_id!r} (a user the store lacks needs the 'query' text and "
                         "every candidate's text)", where=_key_where(where, "user_id"))
    if rec.query_text is None and rec.query_id not in query_ids:
        what = f"unknown query id {rec.query_id!r}" if rec.query_id is not None else "no query id"
        raise InputError(f"{what} for user {rec.user_id!r} (give the call's text in 'query' to embed it)",
                         where=_key_where(where, "query_id" if rec.query_id is not None else "query"))
    for mid, text in zip(rec.candidates, texts):  # selected and cited are subsets of candidates
        if text is None and mid not in memory_ids:
            raise InputError(f"unknown memory id {mid!r} for user {rec.user_id!r} (give candidates the store "
                             'lacks as {"id", "text"} objects, or append them with `rmm-jax embed --into`)',
                             where=_key_where(where, "candidates"))
        if text is not None and isinstance(memory_ids, Mapping) and mid in memory_ids and memory_ids[mid] != text:
            raise InputError(f"memory {mid!r} of user {rec.user_id!r}: the record's text differs from the store's "
                             "memory of that id (give the store's text, or the id alone)",
                             where=_key_where(where, "candidates"))
    if rec.query_id is not None and rec.query_id in query_ids:
        return ()
    return tuple(g for g in rec.gold or () if g not in memory_ids and g not in rec.candidates)


def check_known(rec: LogRecord, known: Known, where: str) -> None:
    """One record against ``known`` (as :func:`rmm_jax.data.citation_log.iter_log` takes it),
    for records that were read without it: what the store lacks the record must carry as
    text (:func:`_check_known`), an ``InputError`` at ``where`` naming the key and the id.
    Gold ids that neither the store nor the record holds are no error (Recall leaves out those
    no bank holds: :func:`rmm_jax.data.log_vectors.resolve_calls`)."""
    _check_known(rec, _known_lookup(known), where)
