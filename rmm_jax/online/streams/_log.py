"""Streams from a citation log: each user's logged calls with their logged candidates,
selections and citations (:func:`log_chunks`, :func:`streams_from_log`: replay), the checks
that come first (:func:`scan_log`, :func:`check_limits`, :func:`log_shape`), and a run's
per-query outputs back to log records (:func:`log_records`)."""
from __future__ import annotations

import warnings
from typing import Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from rmm_jax.core.config import Layout
from rmm_jax.data.citation_log import (
    LogRecord,
    NotGroupedError,
    ReadReport,
    call_hash,
    call_hashes,
    call_key,
    call_record,
    check_known,
    iter_numbered,
    iter_user_chunks,
    read_log,
    record_to_json,
    timestamp_seconds,
)
from rmm_jax.data.log_vectors import known_ids, resolve_calls, unseen_texts
from rmm_jax.errors import InputError, named
from rmm_jax.online.cite_rates import check_user_list
from rmm_jax.online.streams._stream import Stream
from rmm_jax.persist.learned_calls import WINDOW


def check_limits(rec: LogRecord, layout: Layout, log_path) -> None:
    """A record may list at most ``layout.k`` candidates and select at most ``layout.m``; the
    error names them as ``k=8`` (from the CLI ``--k 8``: :func:`rmm_jax.errors.named`)."""
    if len(rec.candidates) > layout.k:
        raise InputError(f"record for user {rec.user_id!r}, {call_key(rec)} has {len(rec.candidates)} "
                         f"candidates, more than {named('k', layout.k)}", where=str(log_path))
    if len(rec.selected) > layout.m:
        raise InputError(f"record for user {rec.user_id!r}, {call_key(rec)} selected {len(rec.selected)} "
                         f"memories, more than {named('m', layout.m)}", where=str(log_path))


class LogShape(NamedTuple):
    """The K and M of a log: its records' most candidates and most selected memories, each
    with the first line that has it. ``k_apart``/``m_apart`` name a record that disagrees
    (None when every record agrees, see :func:`log_shape`). ``whole_banks``: every record lists
    every memory its user holds, so any K from ``k`` up agrees with it; ``whole_slates``: every
    record shows all its candidates, so any M from ``m`` up agrees."""
    k: int
    m: int
    k_line: int
    m_line: int
    k_apart: str | None
    m_apart: str | None
    whole_banks: bool = False
    whole_slates: bool = False


def log_shape(log_path, known, *, skip_invalid: bool = False) -> LogShape:
    """What a log says of K and M, in one bounded-memory pass (``known``: :func:`known_ids`).

    The records agree on K when each lists K candidates, or every memory of its user when the
    user's bank holds fewer than K; on M when each shows M memories, or all its candidates when
    it lists fewer than M. Logged by a retriever of top-K and a policy showing M, every record
    agrees; a record that lists fewer (a truncated retrieval, a slate cut short) disagrees.

    A store grown after the log was served (``embed --into``) keeps each user's old memories
    first: a record listing fewer candidates than its user's bank holds now agrees when they are
    exactly the user's first memories in store order (its whole bank when it was served), and no
    earlier record of the user listed more (the bank only grows). Needs ``known``'s memory ids
    in store order (:class:`~rmm_jax.data.log_vectors.StoreMemories`, as
    :func:`~rmm_jax.data.log_vectors.known_ids` gives them)."""
    first_k: dict[int, int] = {}          # n candidates -> first line listing that many
    first_m: dict[int, int] = {}          # n selected -> first line showing that many
    short_k: dict[int, tuple[int, str]] = {}  # n candidates -> (line, why) of a record listing fewer than its bank
    short_m: dict[int, tuple[int, str]] = {}  # n selected -> (line, why) of a record showing fewer than its candidates
    most: dict[str, int] = {}             # user -> most candidates a record of it listed so far
    whole_banks = whole_slates = True
    for line, r in iter_numbered(log_path, known=known, skip_invalid=skip_invalid):
        ids = known(r.user_id)                  # None: a user the store lacks (the log carries its texts)
        nk, nm, bank = len(r.candidates), len(r.selected), (len(ids[1]) if ids else None)
        first_k.setdefault(nk, line)
        first_m.setdefault(nm, line)
        then = bank is not None and nk < bank and _bank_then(r, ids[1], most.get(r.user_id, 0))
        # today's whole bank (a bank-then record may have had more), every candidate one of its memories
        whole_banks = whole_banks and nk == bank and all(c in ids[1] for c in r.candidates)
        whole_slates = whole_slates and nm == nk
        if bank is not None and nk < bank and not then:
            short_k.setdefault(nk, (line, f"line {line} lists {nk} candidates of the {bank} memories "
                                          f"of user {r.user_id!r}"))
        if bank is not None:
            most[r.user_id] = max(most.get(r.user_id, 0), nk)
        if nm < nk:
            short_m.setdefault(nm, (line, f"line {line} shows {nm} memories of its {nk} candidates"))
    k, m = max(first_k), max(first_m)
    # the earliest record that disagrees (the error names it), not the one listing fewest
    apart = lambda short, top: min((at for n, at in short.items() if n < top), default=(0, None))[1]
    return LogShape(k, m, first_k[k], first_m[m], apart(short_k, k), apart(short_m, m), whole_banks, whole_slates)


def _bank_then(rec: LogRecord, memories, most: int) -> bool:
    """Whether ``rec``, listing fewer candidates than its user's bank holds now (``memories``),
    listed the user's whole bank when it was served: its candidates are the first memories in
    store order (``StoreMemories.first``) and no earlier record of the user listed more (``most``)."""
    first = getattr(memories, "first", None)
    n = len(rec.candidates)
    return first is not None and most <= n and frozenset(rec.candidates) == first(n)


def streams_from_log(store, records: Sequence[LogRecord], layout: Layout, log_path: str = "log",
                     vectors: Mapping[str, np.ndarray] | None = None) -> list[Stream]:
    """Replay streams: per user, the logged calls in log order with their logged
    candidates, selections and citations, resolved against the store
    (:func:`rmm_jax.data.log_vectors.resolve_calls`: what the store lacks comes from
    ``vectors``, the embeddings of the log's unseen texts, :func:`scan_log`); each record
    within :func:`check_limits`. Records read without the store (``read_log(path)``, no
    ``known=``) that name what the store lacks without carrying its text, or texts that
    ``vectors`` lacks, are refused in one line (:func:`_unresolved`)."""
    by_user: dict[str, list] = {}
    for rec in records:
        check_limits(rec, layout, log_path)
        by_user.setdefault(rec.user_id, []).append(rec)
    streams = []
    for uid, recs in by_user.items():
        try:
            c = resolve_calls(store, uid, recs, vectors or {}, layout.k, layout.m)
        except KeyError as e:           # an id the store lacks, or a text without a vector: say which
            raise _unresolved(store, records, log_path, e) from None
        streams.append(Stream(
            user_id=uid, bank=c.bank, queries=c.queries, cand=c.cand, cand_mask=c.cand_mask, cand_gold=c.cand_gold,
            num_gold=c.num_gold, valid=c.valid, memory_ids=c.memory_ids, query_ids=c.call_keys,
            selected=c.selected, cited=c.cited, logged_log_prob=c.log_prob.astype(np.float32),
            has_logged=c.has_log_prob, calls=call_hashes(recs)))
    return streams


def _unresolved(store, records: Sequence[LogRecord], log_path, e: KeyError) -> Exception:
    """What :func:`streams_from_log` could not resolve (``e``, from
    :func:`~rmm_jax.data.log_vectors.resolve_calls`), as one line: the first record naming a
    user, query or memory the store lacks without its text, as a log read against the store
    words it (:func:`~rmm_jax.data.citation_log.check_known`, at ``log_path: record N``),
    else the text that ``vectors`` holds no embedding of; else ``e`` itself."""
    known = known_ids(store)
    for i, rec in enumerate(records):
        check_known(rec, known, f"{log_path}: record {i + 1}")
    text = e.args[0] if e.args else None
    if isinstance(text, str):
        return InputError(f"holds no embedding of the text {text[:60]!r} (embed the texts the store lacks, "
                          "scan_log(...).texts)", arg="vectors")
    return e


class LogScan(NamedTuple):
    """What :func:`scan_log` found in a log: ``read``, the
    :class:`~rmm_jax.data.citation_log.ReadReport`; ``users`` (how many will be replayed)
    and ``user_ids`` (which); ``grouped``; ``texts``; ``untimed_over_window``; ``replayed``;
    ``calls`` (None unless asked for). See :func:`scan_log`."""
    read: ReadReport
    users: int
    user_ids: list[str]
    grouped: bool
    texts: list[str]
    untimed_over_window: list[str]
    replayed: int
    calls: dict | None = None

    def __getitem__(self, key):
        if isinstance(key, str):            # the scan was a dict: scan["user_ids"], scan["skipped"]
            warnings.warn(f"scan_log(...)[{key!r}] is deprecated: it returns a LogScan, use "
                          f"scan.{'read.' if key in ReadReport._fields else ''}{key} (the old way goes in a later "
                          "release)", DeprecationWarning, stacklevel=2)
            if key in ReadReport._fields:
                return getattr(self.read, key)
            if key not in self._fields or (key == "calls" and self.calls is None):
                raise KeyError(key)
            return getattr(self, key)
        return tuple.__getitem__(self, key)


def scan_log(log_path, layout: Layout, *, known=None, skip_invalid: bool = False,
             users: Sequence[str] | None = None, calls: bool = False) -> LogScan:
    """Validation pass over a whole log before any work, in bounded memory (with ``calls``,
    plus a few numbers per record).

    Checks every record (schema, ``known`` ids, repeated calls, the ``layout.k``/``layout.m``
    limits: :func:`check_limits`) and returns a :class:`LogScan`: the read report
    (``read``, a :class:`~rmm_jax.data.citation_log.ReadReport`) plus
    ``users`` (how many will be replayed:
    all, or those of ``users``, each of which must have a record), ``user_ids`` (which)
    and ``grouped``: False
    when a user's records are not on consecutive lines (such a log cannot be streamed by
    user; :func:`log_chunks` reads it whole), and ``texts``: the distinct texts of the
    replayed records that the store lacks (:func:`rmm_jax.data.log_vectors.unseen_texts`),
    to embed before the run. ``calls``: also ``calls`` (else None), per replayed user the
    ``(Calls, lines)`` of its records in log order (:func:`rmm_jax.data.citation_log.call_hashes`
    and their line numbers), to check against what the user's policy has learned
    (:func:`rmm_jax.online.starts.check_learned`). Always ``untimed_over_window``: the
    users with more calls without a timestamp than a policy remembers
    (:data:`rmm_jax.persist.learned_calls.WINDOW`), whose earlier calls a later replay of
    the same log cannot recognise; and ``replayed``, how many valid records the replayed
    users have."""
    if not (hasattr(layout, "k") and hasattr(layout, "m")):   # a Layout, or anything with its k and m
        hint = " (a Setting: pass its .layout)" if hasattr(layout, "layout") else ""
        raise InputError(f"must be a Layout{hint}, got {type(layout).__name__}", arg="layout")
    check_user_list(users)
    read: list[ReadReport] = []
    seen: set[str] = set()
    texts: dict[str, None] = {}
    hashes: dict[str, list] = {}
    untimed: dict[str, int] = {}
    replayed = [0]                   # valid records of the replayed users
    keep = (lambda u: True) if not users else frozenset(users).__contains__

    def scan(grouped: bool) -> None:
        seen.clear(), texts.clear(), hashes.clear(), untimed.clear()
        replayed[0] = 0
        reading = iter_numbered(log_path, known=known, skip_invalid=skip_invalid, grouped=grouped)
        for line, r in reading:
            check_limits(r, layout, log_path)
            seen.add(r.user_id)
            if keep(r.user_id):
                texts.update(dict.fromkeys(unseen_texts(r, known(r.user_id) if known is not None else None)))
                replayed[0] += 1
                if r.timestamp is None or np.isnan(timestamp_seconds(r.timestamp)):
                    untimed[r.user_id] = untimed.get(r.user_id, 0) + 1
                if calls:
                    hashes.setdefault(r.user_id, []).append((*call_hash(r), line))
        read.append(reading.report)

    try:
        scan(True)
        grouped = True
    except NotGroupedError:
        scan(False)
        grouped = False
    missing = [u for u in users or () if u not in seen]
    if missing:
        raise InputError(f"user {missing[0]!r} has no record in {log_path}", arg="users")
    ids = list(users) if users else sorted(seen)
    return LogScan(read[-1], len(ids), ids, grouped, list(texts),
                   sorted(u for u, n in untimed.items() if n > WINDOW), replayed[0],
                   calls_by_user(hashes) if calls else None)


def calls_by_user(hashes: dict[str, list]) -> dict[str, tuple]:
    """Per user, its ``(*call_hash(record), line)`` tuples in log order as ``(Calls, lines)``:
    :func:`rmm_jax.data.citation_log.call_hashes` and the line numbers (:func:`scan_log`'s
    ``calls``, and :func:`rmm_jax.online.ope.load_calls`'s ``hashes``)."""
    return {u: (call_hashes(h[:3] for h in hs), np.array([h[3] for h in hs])) for u, hs in hashes.items()}


def log_chunks(store, log_path, layout: Layout, users_per_chunk: int, *, grouped: bool, known=None,
               skip_invalid: bool = False, users: Sequence[str] | None = None,
               vectors: Mapping[str, np.ndarray] | None = None) -> Iterator[list[Stream]]:
    """Replay streams from a log, ``users_per_chunk`` users at a time (only ``users``' when given).

    ``grouped`` (see :func:`scan_log`): each user's records are on consecutive lines, so
    the log is streamed and memory holds one chunk; otherwise it is read whole (sort it
    by user_id to stream it). ``vectors``: the embeddings of the texts the store lacks."""
    check_user_list(users)
    keep = (lambda u: True) if not users else frozenset(users).__contains__
    if grouped:
        chunk: list[Stream] = []
        for recs in iter_user_chunks(log_path, 1, known=known, skip_invalid=skip_invalid):
            if keep(recs[0].user_id):
                chunk += streams_from_log(store, recs, layout, str(log_path), vectors)
            if len(chunk) == users_per_chunk:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
        return
    records, _ = read_log(log_path, known=known, skip_invalid=skip_invalid)
    streams = streams_from_log(store, [r for r in records if keep(r.user_id)], layout, str(log_path), vectors)
    for i in range(0, len(streams), users_per_chunk):
        yield streams[i:i + users_per_chunk]


def log_records(s: Stream, selected, cited, log_prob) -> list[dict]:
    """Citation-log records of one simulated stream: the run's selections (positions in
    ``s.cand``), citations and behaviour log-probs mapped back to memory ids, each built by
    :func:`rmm_jax.data.citation_log.call_record` (as ``rerank`` builds its served lines)
    and given as its JSON object (:func:`rmm_jax.data.citation_log.record_to_json`)."""
    out = []
    for t, qid in enumerate(s.query_ids):
        cand_ids = [s.memory_ids[j] for j, ok in zip(s.cand[t], s.cand_mask[t]) if ok]
        sel = [int(p) for p in selected[t] if p >= 0]
        rec = call_record(s.user_id, cand_ids, [s.memory_ids[s.cand[t][p]] for p in sel],
                          cited=[s.memory_ids[s.cand[t][p]] for p, c in zip(sel, cited[t]) if c],
                          query_id=qid, log_prob=log_prob[t])
        out.append(record_to_json(rec))
    return out
