"""Reading policies back from a store's snapshots: which version loads, and the states
(stacked over users) it holds.

A user's version loads when its chunk's metadata and its own row verify
(:func:`rmm_jax.persist.policy_snapshot.read_chunk`)
and, where versions are paired with the shared part (scopes ``shared`` and ``hybrid``), the
shared version it was trained against is available too: the factors of a hybrid user only
make sense with the shared weights they were fitted to, so a user version is never combined
with another shared version. Each user gets the newest version that loads; every newer one
is reported as a :class:`Skip` (``v4 is damaged (rows.bin: sha256 mismatch)``, ``v5 needs
shared v9, which is missing``). A version whose shared version was not recorded (stores
written before pairing existed) loads with the newest good shared version.

:func:`restore_users` reads many users at once, each needed chunk once: candidates are
grouped by chunk, each chunk's metadata and the rows of its users are verified and read,
the rows are copied into one array per leaf with a leading users axis, and users whose
row or chunk failed move on to their next older version in another round (a chunk is
read again only if such a fallback needs it).
"""
from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from rmm_jax.core.types import LearnerState, SharedState, UserState
from rmm_jax.errors import InputError
from rmm_jax.persist.codec import decode_tree, encode_tree, leaf_specs
from rmm_jax.persist.learned_calls import LearnedCalls, empty
from rmm_jax.persist.policy_index import Entry
from rmm_jax.persist.policy_snapshot import (
    LEARNED_PART,
    SHARED_PARTS,
    USER_PARTS,
    cname,
    read_chunk,
    read_shared,
    vname,
)
from rmm_jax.persist.rollback import PolicyRestoreWarning, Skip, skips_text


class Saved(NamedTuple):
    """One user's policy as restored: its state, the JSON info saved with it, the version
    that loaded, the shared version it was trained against (None: scope ``user`` or not
    recorded), the newer versions skipped and the calls it learned from."""

    state: UserState
    info: dict
    version: int
    shared_version: int | None
    skipped: tuple[Skip, ...] = ()
    learned: LearnedCalls | None = None


class SavedBatch(NamedTuple):
    """Users restored together. ``users`` are the requested users the store holds (request
    order); ``state`` stacks theirs on a leading users axis (None when ``users`` is empty);
    ``infos``, ``versions`` and ``shared_versions`` align with ``users``; ``missing`` lists
    the requested users the store does not hold; ``skipped`` the newer versions skipped, for
    the users where any were; ``learned`` stacks the calls each version learned from
    (:mod:`rmm_jax.persist.learned_calls`; none for rows saved before the store kept them)."""

    users: list[str]
    state: UserState | None
    infos: list[dict]
    versions: list[int]
    shared_versions: list[int | None]
    missing: list[str]
    skipped: dict[str, tuple[Skip, ...]]
    learned: LearnedCalls | None = None


class SavedShared(NamedTuple):
    """The shared part as restored: params and optimiser state (None if none was saved),
    its JSON info, its version and the newer shared versions skipped."""

    state: SharedState
    info: dict
    version: int
    skipped: tuple[Skip, ...] = ()


def problem(reason: str) -> str:
    """What is wrong with a version, from a read failure's reason: ``missing`` or ``damaged (...)``."""
    return "missing" if reason == "missing" else f"damaged ({reason})"


class Restored(NamedTuple):
    """What :func:`restore_users` found: per requested user (in order) the entry that loads
    (None: none), the stacked state of the users that load, their infos, the skips, and
    the stacked calls each learned from."""

    picked: list[Entry | None]
    state: UserState | None
    infos: list[dict | None]
    skipped: list[list[Skip]]
    learned: LearnedCalls | None = None


def _canonical(meta: dict, leaves: dict, n: int) -> tuple[dict, dict]:
    """A chunk's specs and leaves with a pre-:class:`LearnerState` learner state (a dict
    ``{baseline, key, step}``) converted to a LearnerState, so old and new chunks stack."""
    spec = meta["spec"]["learner_state"]
    if not (spec["t"] == "dict" and spec["k"] == sorted(LearnerState._fields)):
        return meta["spec"], leaves
    ls = LearnerState(**decode_tree(spec, leaves["learner_state"]))
    new_spec, new_leaves = encode_tree(ls, batch=n, where="learner_state")
    return {**meta["spec"], "learner_state": new_spec}, {**leaves, "learner_state": new_leaves}


@functools.cache
def _no_calls() -> tuple[dict, list[np.ndarray]]:
    """The spec and leaves of a user who has learned from no call (read-only: built once)."""
    spec, leaves = encode_tree(empty(), where=LEARNED_PART)
    for a in leaves:
        a.flags.writeable = False
    return spec, leaves


def restore_users(gens: Path, users: Sequence[str], entries: dict[str, list[Entry]], *,
                  shared_problem: Callable[[int], str | None] | None = None) -> Restored:
    """Each of ``users``' newest version that loads, read from snapshot root ``gens``.

    ``entries[user]`` are the candidates, oldest first (one, for an exact version).
    ``shared_problem(v)`` says what is wrong with shared version ``v`` (None: it loads);
    given it, a candidate trained against a shared version with a problem is skipped. All
    users must hold one tree structure (an InputError otherwise).
    """
    n = len(users)
    cands = {u: list(reversed(entries[u])) for u in users}
    skipped: dict[str, list[Skip]] = {u: [] for u in users}
    picked: dict[str, Entry] = {}
    infos: list[dict | None] = [None] * n
    pos = {u: i for i, u in enumerate(users)}
    specs, out, first = None, None, None
    bad_chunks: dict[tuple[int, int], str] = {}

    def skip(u: str, reason: str) -> None:
        skipped[u].append(Skip(cands[u].pop(0).version, reason))

    learned_spec, none = _no_calls()
    learned = [np.repeat(a[None], n, axis=0) for a in none]
    pending = list(users)
    while pending:
        groups: dict[tuple[int, int], list[str]] = {}
        for u in pending:
            while cands[u]:
                e = cands[u][0]
                if (e.version, e.chunk) in bad_chunks:
                    skip(u, bad_chunks[e.version, e.chunk])
                elif shared_problem and e.shared_version is not None and (bad := shared_problem(e.shared_version)):
                    skip(u, f"needs shared v{e.shared_version}, which is {bad}")
                else:
                    groups.setdefault((e.version, e.chunk), []).append(u)
                    break
        pending = []
        for (v, c), group in sorted(groups.items()):
            group.sort(key=lambda u: cands[u][0].row)
            got = read_chunk(gens / vname(v), cname(c), [cands[u][0].row for u in group])
            if not isinstance(got, str):
                meta, leaves, bad = got
                try:
                    chunk_specs, leaves = _canonical(meta, leaves, len(group))
                    holds = {u: meta["users"][cands[u][0].row] for u in group}
                except Exception as ex:  # noqa: BLE001 - a chunk.json that disagrees with the index
                    got = f"bad chunk ({type(ex).__name__}: {ex})"
            if isinstance(got, str):
                bad_chunks[v, c] = f"is {problem(got)}"
                for u in group:
                    skip(u, bad_chunks[v, c])
                pending += group
                continue
            members = []                   # (position in the rows read, user)
            for i, u in enumerate(group):
                if i in bad:               # this user's row is damaged; the chunk's others may be fine
                    skip(u, f"is {problem(bad[i])}")
                elif holds[u] != u:        # the index and chunk.json disagree (a hand-edited store)
                    skip(u, f"is damaged (row {cands[u][0].row} of c{c:04d} holds {holds[u]!r})")
                else:
                    members.append((i, u))
                    continue
                pending.append(u)
            if not members:
                continue
            state_specs = {p: chunk_specs[p] for p in USER_PARTS}
            if specs is None:
                specs, first = state_specs, (members[0][1], v)
                out = {p: [np.empty((n, *s["shape"]), np.dtype(s["dtype"])) for s in leaf_specs(specs[p])]
                       for p in USER_PARTS}
            elif json.dumps(state_specs, sort_keys=True) != json.dumps(specs, sort_keys=True):
                raise InputError(f"users {first[0]!r} (v{first[1]}) and {members[0][1]!r} (v{v}) hold policies of "
                                 "different structures; load them separately", where=str(gens.parent))
            at = np.array([pos[u] for _, u in members])
            take = np.array([i for i, _ in members])
            for p in USER_PARTS:
                for dst, src in zip(out[p], leaves[p]):
                    _put_rows(dst, at, src, take)
            if LEARNED_PART in chunk_specs:   # rows saved before the store kept them learned from no call
                if json.dumps(chunk_specs[LEARNED_PART], sort_keys=True) != json.dumps(learned_spec, sort_keys=True):
                    raise InputError(f"user {members[0][1]!r} (v{v}) remembers its learned calls in another shape "
                                     "than this rmm-jax does", where=str(gens.parent))
                for dst, src in zip(learned, leaves[LEARNED_PART]):
                    _put_rows(dst, at, src, take)
            for _, u in members:
                picked[u] = cands[u][0]
                infos[pos[u]] = dict(meta["info"][picked[u].row] or {})
    state = None if specs is None else UserState(*(decode_tree(specs[p], out[p]) for p in USER_PARTS))
    return Restored([picked.get(u) for u in users], state, infos, [skipped[u] for u in users],
                    None if specs is None else decode_tree(learned_spec, learned))


def candidates(entries: dict[str, list[Entry]], ids: Sequence[str], *, version: int | None, before: int | None,
               keep: int, where: str) -> dict[str, list[Entry]]:
    """Each of ``ids``' kept ``entries`` that a load may take: with ``before`` only those
    older than it (a user whose every such version was pruned by ``keep`` is an InputError;
    one with fewer than ``keep`` versions was new then), with ``version`` only that one (a
    user who does not keep it is an InputError). Changes and returns ``entries``."""
    if before is not None:
        for u in ids:
            older = [e for e in entries[u] if e.version < before]
            if entries[u] and not older and len(entries[u]) >= keep:   # fewer: it was new then
                raise InputError(f"user {u!r} keeps no version older than v{before} (has "
                                 f"{[e.version for e in entries[u]]}; pruned by keep={keep})", where=where)
            entries[u] = older
    if version is not None:
        for u in ids:
            if entries[u] and not any(e.version == version for e in entries[u]):
                raise InputError(f"user {u!r} has no version {version} (has "
                                 f"{[e.version for e in entries[u]]})", where=where)
            entries[u] = [e for e in entries[u] if e.version == version]
    return entries


def restore_batch(gens: Path, found: list[str], entries: dict[str, list[Entry]], missing: list[str],
                  again: Callable[[], dict[str, list[Entry]]], *,
                  shared_problem: Callable[[int], str | None] | None, stacklevel: int) -> SavedBatch:
    """:func:`restore_users` of the ``found`` users as a :class:`SavedBatch` (``missing``:
    the requested users the store does not hold). Users none of whose candidates loads are
    read once more from the candidates ``again()`` gives, when those changed (a writer may
    have replaced versions meanwhile), then an InputError; each user that loads an older
    version warns a :class:`PolicyRestoreWarning` (``stacklevel`` counted from the caller, as its own
    ``warnings.warn`` would count it)."""
    got = restore_users(gens, found, entries, shared_problem=shared_problem)
    if None in got.picked:  # a writer may have replaced versions meanwhile: re-read once
        fresh = again()
        if any(fresh[u] != entries[u] for u, e in zip(found, got.picked) if e is None):
            got = restore_users(gens, found, fresh, shared_problem=shared_problem)
    where = str(gens.parent)
    if None in got.picked:
        i = got.picked.index(None)
        more = sum(e is None for e in got.picked) - 1
        raise InputError(f"no good saved version for user {found[i]!r}: {skips_text(got.skipped[i])}"
                         + (f" (and {more} more users)" if more else ""), where=where)
    for u, e, sk in zip(found, got.picked, got.skipped):
        if sk:
            warnings.warn(PolicyRestoreWarning(where, u, e.version, sk), stacklevel=stacklevel + 1)
    return SavedBatch(found, got.state, got.infos, [e.version for e in got.picked],
                      [e.shared_version for e in got.picked], missing,
                      {u: tuple(sk) for u, sk in zip(found, got.skipped) if sk}, got.learned)


def one_user(batch: SavedBatch) -> Saved:
    """The one user of ``batch`` as a :class:`Saved` (its state without the users axis)."""
    state, learned = jax.tree_util.tree_map(lambda a: a[0], (batch.state, batch.learned))
    return Saved(state, batch.infos[0], batch.versions[0], batch.shared_versions[0],
                 batch.skipped.get(batch.users[0], ()), learned)


def restore_shared(snap: Path) -> tuple[SharedState, dict] | str:
    """The shared state and info of shared snapshot ``snap``, or the reason it does not load."""
    got = read_shared(snap)
    if isinstance(got, str):
        return got
    meta, leaves = got
    try:
        state = SharedState(*(decode_tree(meta["spec"][p], leaves[p]) for p in SHARED_PARTS))
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - any decode failure = bad version
        return f"restore failed ({type(e).__name__}: {e})"
    return state, dict(meta.get("info") or {})


def _put_rows(dst: np.ndarray, at: np.ndarray, src: np.ndarray, take: np.ndarray) -> None:
    """``dst[at] = src[take]`` with one copy where it can: every row read taken in order (no
    damaged one) is ``src`` itself, and consecutive positions are a slice. The fancy-indexed
    form copied each user's state twice (3.5 MB a full d = 384 user; evaluate of 300 users
    read 1 GB)."""
    rows = src if take.size == len(src) and (take == np.arange(take.size)).all() else src[take]
    if at.size and (at == np.arange(at[0], at[0] + at.size)).all():
        dst[at[0]:at[0] + at.size] = rows
    else:
        dst[at] = rows
