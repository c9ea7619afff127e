"""Serving: rank memories for a user's queries with the policy a store holds for them.

:class:`Reranker` is the scoring half of the online program without the update: it loads a
user's policy from a :class:`rmm_jax.persist.policy_store.PolicyStore` (in scope ``hybrid``
the user's factors with exactly the shared version they were trained against), keeps the
most recently used users' policies on the device, and returns the deterministic top-M of
the reranker's scores s_i = q'ᵀm_i' (RMM, Tan et al., ACL 2025, §4.2) for a batch of
queries in one jitted call. A user the store does not hold is served the store's shared
part, the policy a run would start them from. Nothing is written.

**Exploration.** :meth:`Reranker.sample` draws the shown memories instead, as the online
loop does: the Gumbel top-M of s/τ, an ordered Plackett–Luce sample
(:func:`rmm_jax.core.sampling.gumbel_top_m`), and returns the exact log-probability of
the draw (:func:`rmm_jax.core.sampling.selection_log_prob`) and the logits s/τ: the
propensities that let the next day's log be replayed with importance weights and
evaluated off-policy. τ is the behaviour temperature of the learning setting the store
records (:attr:`Reranker.tau`). Each call's noise comes from its own key,
:func:`call_keys` (the seed, the user and the call's identity), so serving the same call
again draws the same memories, whatever else is served with it.

**No policy yet.** ``Reranker(None, dim=d)`` serves the identity reranker to everyone:
its scores are exactly the retriever's cosine q·m, so a team can explore (and log
propensities) from day one, and replaying that log from the identity policy is on-policy.
``Reranker.open(path, dim=d)`` does so until the first night's store exists at ``path``, and
serves that store from the :meth:`Reranker.refresh` that finds it.

Examples:
  >>> import numpy as np, jax, rmm_jax as rj                                       # doctest: +SKIP
  >>> from rmm_jax.online.serve import Reranker                                    # doctest: +SKIP
  >>> rr = Reranker.open("policies")                                               # doctest: +SKIP
  >>> got = rr.rank("user7", q, cands, m=5)         # q (d,) or (n, d); cands (K, d) or (n, K, d)   # doctest: +SKIP
  >>> got.selected, got.scores                       # (n, 5) positions in cands, best first; (n, K)  # doctest: +SKIP
"""
from __future__ import annotations

import collections
import functools
import hashlib
import math
import os
import threading
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rmm_jax.core import checks, reranker
from rmm_jax.core.config import ESTIMATOR_FIELDS, Estimator, setting_values
from rmm_jax.core.executables import aot
from rmm_jax.core.sampling import gumbel_top_m, selection_log_prob, top_m
from rmm_jax.data.calls import Prepared
from rmm_jax.data.citation_log import LogRecord, call_key, call_record, utc_timestamp
from rmm_jax.errors import InputError, check_int
from rmm_jax.online import compile_cache as persistent_cache
from rmm_jax.online.streams import bucket, user_hash
from rmm_jax.persist.policy_checks import check_user_ids
from rmm_jax.persist.policy_header import read_header
from rmm_jax.persist.policy_rollback import DONE, check_store
from rmm_jax.persist.policy_setting import SETTING_KEY, read_setting
from rmm_jax.persist.policy_store import PolicyStore

DEFAULT_CACHE_USERS = 1024
SHARED_ON_DEVICE = 2        # shared versions a Reranker keeps on the device
#: An exploring draw whose median call draws its selection with at least this probability
#: shows, more often than not, one ordered selection: it has stopped exploring.
NO_EXPLORATION = 0.5
#: The fewest exploring draws whose median :func:`serve_calls` judges (a service serving one
#: request at a time gets no warning per request; its logs' ``log_prob`` tell the same).
EXPLORATION_CALLS = 20


class ExplorationWarning(UserWarning):
    """An exploring serve (:func:`serve_calls` with ``explore``) whose draws barely explore:
    the median call's drawn selection had probability >= :data:`NO_EXPLORATION`."""


class Ranking(NamedTuple):
    """The reranked candidates of n queries: ``selected`` (n, m) positions in the candidate
    list, best first (−1 where fewer than m candidates are valid); ``scores`` (n, K), −inf
    at masked candidates."""
    selected: np.ndarray
    scores: np.ndarray


class Sample(NamedTuple):
    """Gumbel top-M draws for n calls: ``selected`` (n, m) positions in the candidate list
    in draw order (−1 where fewer than m candidates are valid); ``log_prob`` (n,) the exact
    Plackett–Luce log-probability of the draw; ``logits`` (n, K) = s/τ (0 at masked
    candidates); ``scores`` (n, K), −inf at masked candidates."""
    selected: np.ndarray
    log_prob: np.ndarray
    logits: np.ndarray
    scores: np.ndarray


def call_keys(seed: int, user_id: str, calls: Sequence[str]):
    """The PRNG keys of ``user_id``'s served ``calls``, stacked: each is
    :func:`rmm_jax.online.streams.user_key` (the seed and the user) folded with the first
    and then the second 4 bytes of sha256(call) (each masked to 31 bits), ``call`` being
    the call's identity (:func:`rmm_jax.data.citation_log.call_key`). The same call draws
    the same noise in every run with the same seed; two calls of a user almost surely
    not. One jitted call for all of them (two eager fold_ins a call cost 0.5 ms in
    ``rerank`` per 200 calls).

    >>> import jax
    >>> from rmm_jax.online.serve import call_keys
    >>> k = call_keys(0, "u1", ["call:c1", "call:c2"])
    >>> k.shape, bool((jax.random.key_data(k[0]) == jax.random.key_data(call_keys(0, "u1", ["call:c1"])[0])).all())
    ((2,), True)
    """
    # a str was one key per letter, an int call id an AttributeError
    if isinstance(calls, str) or not all(isinstance(c, str) for c in calls):
        raise InputError(f"must be a sequence of call ids (str), got {checks.short(calls)}", where="calls")
    # a str seed was a TypeError from jax.random, one past 64 bits an OverflowError; the range jax.random.key takes
    check_int(seed, "seed", -2**63, 2**63, where=True)
    seed = int(seed)
    user = np.uint32(user_hash(user_id))
    n = len(calls)
    words = np.zeros((1 << max(n - 1, 0).bit_length(), 2), np.uint32)      # padded: one program per octave
    for j, c in enumerate(calls):
        h = hashlib.sha256(c.encode("utf-8")).digest()
        words[j] = [int.from_bytes(h[i:i + 4], "little") & 0x7FFFFFFF for i in (0, 4)]
    data = np.asarray(jax.random.key_data(_fold_twice(user, words, seed=seed)))
    return jax.random.wrap_key_data(data[:n])          # sliced on the host: an eager slice is a program


@aot(static_argnames=("seed",))
def _fold_twice(user, words, seed: int):
    key = jax.random.fold_in(jax.random.key(seed), user)
    return jax.vmap(lambda w: jax.random.fold_in(jax.random.fold_in(key, w[0]), w[1]))(words)


class Policy(NamedTuple):
    """The policy a user is served: its params and where they come from (``version`` None:
    a user the store does not hold, served the shared part)."""
    params: Any
    version: int | None
    shared_version: int | None


def user_params(store: PolicyStore, user_id: str, *, fallback_to_shared: bool = False):
    """The reranker params that score ``user_id``'s queries, as device arrays (see
    :func:`load_policy`). Unlike :func:`load_policy`, whose default serves a user the store
    does not hold its shared part, a user it does not hold is an error here unless
    ``fallback_to_shared``: asking for one user's params by name, a mistyped id should not
    quietly give everyone's."""
    return load_policy(store, user_id, fallback_to_shared=fallback_to_shared).params


def load_policy(store: PolicyStore, user_id: str, *, fallback_to_shared: bool = True,
                shared_params: Callable[[int | None], tuple[Any, int]] | None = None) -> Policy:
    """The policy ``user_id`` is served, whatever the store's scope
    (:class:`rmm_jax.core.scope.Scope`): its own full params; the shared part as the last
    saved users left it (:meth:`PolicyStore.learned_shared_version`) when users have no params
    of their own; or its own low-rank factors merged with exactly the shared version they
    were trained against (:meth:`PolicyStore.load`; an older store that did not record it
    pairs with the newest). A user the store does not hold gets that shared part with
    ``fallback_to_shared`` (what a run would start it from), else
    an error. ``shared_params(version)`` gives the shared params of a version
    (None: the newest) on the device and the version (default: read from ``store``);
    :class:`Reranker` passes its own, which keeps them there.

    The cold path is one indexed lookup, one chunk's verified ``chunk.json`` and the user's
    own verified row (:mod:`rmm_jax.persist.policy_rows`), then one transfer of the user's
    own params: the shared part is not copied per user. Many users: :func:`load_policies`."""
    return load_policies(store, [user_id], fallback_to_shared=fallback_to_shared, shared_params=shared_params)[0]


def load_policies(store: PolicyStore, user_ids: Sequence[str], *, fallback_to_shared: bool = True,
                  shared_params: Callable[[int | None], tuple[Any, int]] | None = None) -> list[Policy]:
    """:func:`load_policy` of each of ``user_ids``, in their order, read together: one
    :meth:`PolicyStore.load_batch` (each chunk verified and read once) and each shared version
    once. ``rmm-jax evaluate`` reads a day's users so, 64 at a time: one at a time, 300 users
    took 3.4 s, mostly reading the same chunks again."""
    _check_store(store, "PolicyStore", "PolicyStore.open(path)")
    ids = check_user_ids(user_ids, "user_ids")      # before list(): "user5" was five users, 'u' to '5'
    return batch_policies(store, store.load_batch(ids), ids, fallback_to_shared=fallback_to_shared,
                          shared_params=shared_params)


def batch_policies(store: PolicyStore, got, user_ids: Sequence[str], *, fallback_to_shared: bool = True,
                   shared_params: Callable[[int | None], tuple[Any, int]] | None = None) -> list[Policy]:
    """:func:`load_policies` of ``user_ids`` from ``got``, their
    :meth:`PolicyStore.load_batch` already read: for a caller that reads the users' states
    for more than their params (``evaluate`` also counts the calls they learned), once."""
    user_ids = check_user_ids(user_ids, "user_ids")     # a str was its letters, each a user on the shared policy
    # each shared version, and the one the last saved users left, read once for all of them
    shared = functools.cache(shared_params or functools.partial(_shared_on_device, store))
    learned = functools.cache(store.learned_shared_version)
    scope = store.scope
    if got.missing and not fallback_to_shared:
        store.load(got.missing[0])                                       # the one-line error
    row = {u: j for j, u in enumerate(got.users)}
    out = []
    for user_id in user_ids:
        if user_id not in row:
            params, shared_version = shared(learned())
            out.append(Policy(params, None, shared_version))
            continue
        j = row[user_id]
        version = got.versions[j]
        if not scope.has_local:                # one policy for everyone: as its users left it
            params, shared_version = shared(learned())
            out.append(Policy(params, version, shared_version))
            continue
        own = _device(jax.tree.map(lambda a: a[j], got.state.params))   # noqa: B023 (called at once)
        if scope.local_is_full:
            out.append(Policy(own, version, None))
        else:
            params, shared_version = shared(got.shared_versions[j])
            out.append(Policy(scope.merge(params, own), version, shared_version))
    return out


def _check_store(store, expected: str, opener: str) -> None:
    """``store`` an opened PolicyStore, else the InputError naming ``store``: a path was an
    AttributeError ('meta')."""
    if not isinstance(store, PolicyStore):
        raise InputError(f"expected a {expected}, got {checks.short(store)}; {opener} opens a policy store by its "
                         "path", where="store")


def shared_params_of(store: PolicyStore) -> Callable[[int | None], tuple[Any, int]]:
    """``shared_params`` for :func:`load_policies` and :func:`batch_policies`: each shared
    version of ``store`` read and put on the device once, for every batch a caller loads
    (``evaluate`` loads its users 64 at a time)."""
    return functools.cache(functools.partial(_shared_on_device, store))


def _shared_on_device(store: PolicyStore, version: int | None) -> tuple[Any, int]:
    got = store.shared_state(version)
    return _device(got.state.params), got.version


def _device(params):
    """``params`` where the compiled ranking reads them. On an accelerator: one device_put
    of the tree (no per-leaf dispatch). On the CPU backend host memory is the device's, and
    a jitted call takes host arrays directly: a device_put there only adds its Python
    path (about 0.5 ms a cold user, ``benchmarks/serve.py``), so the leaves stay
    host arrays, passed to the compiled call as they are (copied first, so that a cached
    policy does not keep alive the whole row read from disk). Everything that computes
    with them is jitted (:func:`_rank`, :func:`_sample`, :mod:`rmm_jax.online.ope`), so
    nothing runs in NumPy instead of XLA."""
    if jax.default_backend() == "cpu":
        return jax.tree.map(np.array, params)
    return jax.device_put(params)


@aot(static_argnames=("m",))
def _rank(params, q, cands, mask, m: int):
    scores = reranker.score_batch(params, q, cands, mask)
    return jax.vmap(lambda s, mk: top_m(s, m, mk))(scores, mask), scores


@aot(static_argnames=("m",))
def _sample(params, q, cands, mask, keys, tau, m: int):
    scores = reranker.score_batch(params, q, cands, mask)
    sel = jax.vmap(lambda key, s, mk: gumbel_top_m(key, s, m, tau, mk))(keys, scores, mask)
    lp = jax.vmap(lambda s, se, mk: selection_log_prob(s, se, tau, mask=mk))(scores, sel, mask)
    return sel, lp, scores


def _real_array(x, name: str) -> np.ndarray:
    """``x`` as a float32 array, ``InputError`` naming ``name`` unless it holds floating-point
    numbers: a string was NumPy's ValueError ("could not convert string to float"), a ragged
    list its "inhomogeneous shape" one, and a complex array lost its imaginary part with only
    a ComplexWarning. An int or bool embedding (``q.astype(np.int32)``, truncated to zeros)
    was ranked without a word: refused as the core's ``check_float`` refuses it."""
    try:
        a = np.asarray(x)
    except (TypeError, ValueError):
        a = None
    if a is None or a.dtype.kind not in "biuf":
        raise InputError(f"expected an array of real numbers, got {checks.short(x)}", where=name)
    if a.dtype.kind != "f":
        raise InputError(f"expected a floating dtype, got {a.dtype}" + ("" if hasattr(x, "dtype") else
                                                                      f" (from a {type(x).__name__} of ints)"),
                         where=name)
    return a.astype(np.float32, copy=False)        # no copy of what is float32 already (the serving path)


def _check_scores(scores: np.ndarray, mask: np.ndarray) -> None:
    """``InputError`` when a valid candidate's score is not finite: finite embeddings whose
    product overflows float32 (entries of 1e20) scored inf, and :meth:`Reranker.rank`
    returned positions -1 without a word, the garbage the NaN check on the inputs refuses."""
    bad = ~np.isfinite(scores) & mask
    if bad.any():
        i, j = np.argwhere(bad)[0].tolist()
        raise InputError(f"the score of query {i}, candidate {j} overflows float32 ({scores[i, j]}): scale the "
                         "embeddings to unit norm, as the retriever's are (or the policy's params are that large: "
                         "`policies show` them, `policies rollback` a version that diverged)",
                         where="query_emb, candidate_embs")


def _generation(store: PolicyStore | None, header: dict | None = None) -> tuple:
    """What a :class:`Reranker` serves from ``store``: its newest user version, its setting,
    and how many rollbacks it has finished (undoing the newest run brings the newest version
    back to what it was before the run), ``header`` being the store's header as read now
    (None: as ``store`` opened it). Whether the directory is still the one ``store`` opened
    is :meth:`PolicyStore.replaced`: a store deleted and made again can repeat all three."""
    if store is None:
        return ()
    header = store._header if header is None else header
    return store.newest_version(), header.get(SETTING_KEY), int(header.get(DONE, 0))


def behaviour_tau(store: PolicyStore | None) -> float:
    """The temperature the policies of ``store`` sample at: the behaviour τ
    (:attr:`rmm_jax.core.config.Estimator.sample_tau`) of the learning setting the store
    records, else of the default estimator (no store, or no setting recorded yet)."""
    if store is not None:
        check_store(store)           # a path was an AttributeError ('_header')
    rec = read_setting(store) if store is not None else None
    est = (rec or {}).get("estimator") or {}
    return Estimator(**{k: v for k, v in est.items() if k in ESTIMATOR_FIELDS}).sample_tau


class Reranker:
    """Serve a policy store's policies (module docstring). ``cache_users``: how many users'
    policies stay on the device (least recently used dropped first). ``store`` None: the
    identity reranker for everyone (``dim`` needed), before any policy exists;
    :meth:`open` with ``dim`` serves it until the store at a path exists, then that store
    (after :meth:`refresh`). ``compile_cache``: use the persistent compilation cache as the CLI does
    (:func:`rmm_jax.online.compile_cache.ensure`: a new process's first call loads its
    programs instead of compiling them, unless ``RMM_JAX_COMPILE_CACHE=0`` or the
    application configured JAX's cache directory itself); False leaves JAX's settings alone.

    **Threads.** One Reranker may serve many threads: :meth:`policy`, :meth:`rank`,
    :meth:`sample` and :meth:`refresh` may run at once (the cache of users' policies is
    kept under a lock; a user's policy is read from disk and put on the device outside it).
    A call that began before a :meth:`refresh` that changed the store may still be served
    from the old store; nothing loaded from the old store enters the new store's cache, and
    :func:`serve_calls` draws and logs each batch with the one policy it looked up."""

    def __init__(self, store: PolicyStore | None, *, cache_users: int = DEFAULT_CACHE_USERS, dim: int | None = None,
                 compile_cache: bool = True):
        if store is not None:
            _check_store(store, "PolicyStore or None", "Reranker.open(path)")
        check_int(cache_users, "cache_users", 1, shown=repr, where=True)      # "3" was a TypeError, 2.5 taken
        if store is None and dim is None:
            raise InputError("the identity reranker (no policy store) needs the embedding dim", where="dim")
        if dim is not None or store is None:   # 2.5 was served as d = 2
            check_int(dim, "dim", 1, shown=repr, where=True)
        if store is not None and dim is not None and dim != store.meta_info().dim:   # was ignored
            raise InputError(f"is {dim}, the policy store's is {store.meta_info().dim}", where="dim")
        if compile_cache:       # before anything compiles: JAX settles the cache at its first compile
            persistent_cache.ensure()
        self.cache_users = cache_users
        self.dim = int(store.meta_info().dim) if store is not None else int(dim)
        self._path = None             # open(path, dim=d) of a store not made yet: refresh() opens it once it is
        self._lock = threading.Lock()                 # the cache and what is served (store, tau, identity)
        self._refreshing = threading.Lock()           # one refresh at a time (it reads the disk outside _lock)
        self._serve(store)

    def _serve(self, store: PolicyStore | None) -> None:
        """Serve ``store`` (None: the identity reranker) from now on, with an empty cache."""
        seen, tau = _generation(store), behaviour_tau(store)
        identity = None if store is not None else Policy(
            _device(reranker.identity_reranker(self.dim)), None, None)       # traces nothing (init_reranker did)
        with self._lock:
            self.store, self.tau, self._seen, self._identity = store, tau, seen, identity
            # new objects, not cleared ones: a load that began before this puts nothing into them
            self._cache: collections.OrderedDict[str, Policy] = collections.OrderedDict()
            self._shared: collections.OrderedDict[int, Any] = collections.OrderedDict()   # version -> device params

    @classmethod
    def open(cls, path, *, cache_users: int = DEFAULT_CACHE_USERS, dim: int | None = None,
             compile_cache: bool = True) -> "Reranker":
        """Serve the policy store at ``path`` (an ``InputError`` if there is none). With
        ``dim`` (the embedding dimension), a service may start before the first night's
        ``replay`` made the store: while none exists at ``path`` it serves the identity
        reranker (as ``Reranker(None, dim=dim)``; an empty directory, such as a volume made
        for the store, is none yet), and the :meth:`refresh` that finds the store there serves
        it from then on; a store of another dim is refused."""
        if dim is not None:
            check_int(dim, "dim", 1, shown=repr, where=True)
            if isinstance(path, (str, os.PathLike)) and _no_store_yet(path):
                rr = cls(None, cache_users=cache_users, dim=dim, compile_cache=compile_cache)
                rr._path = path
                return rr
        return cls(PolicyStore.open(path, expect_dim=dim), cache_users=cache_users, compile_cache=compile_cache)

    def refresh(self) -> bool:
        """Serve what the store holds now. A Reranker keeps the policies it has loaded, so
        after a night's run saved new versions, or a rollback forgot some, a long-lived one
        would serve its cached users yesterday's policies and the others today's. Call this
        when such a job ends: if the store changed (its directory was deleted and made again,
        or its newest user version, its learning setting, or a rollback finished), the store is reopened
        (the old one closed, :meth:`PolicyStore.close`) and every cached policy dropped, so each user's next
        call loads what the store serves now, at the setting's τ. A Reranker opened with
        ``dim`` before its store existed (:meth:`open`) serves the store once it exists.
        Returns whether it changed; when it did not, it cost one ``stat``, one indexed
        query and one small file read (no store is opened)."""
        with self._refreshing:
            old = self.store
            if old is None:
                if self._path is None or _no_store_yet(self._path):
                    return False
                self._serve(PolicyStore.open(self._path, expect_dim=self.dim))
                self._path = None
                return True
            if not old.replaced() and _generation(old, read_header(old.path)) == self._seen:
                return False
            self._serve(PolicyStore.open(old.path, expect_dim=self.dim))
            old.close()
            return True

    def policy(self, user_id: str) -> Policy:
        """The policy ``user_id`` is served (cached; :meth:`refresh` drops the cache when the
        store changes). ``user_id`` is a str, as the store and :func:`call_keys` hold it: an int
        id was looked up as given and never found the user's policy (``7`` is not ``"7"``)."""
        return self._served(user_id)[0]

    def _served(self, user_id: str) -> tuple[Policy, str, float]:
        """:meth:`policy` with who serves it (``identity``, ``shared`` or ``own_policy``, as
        :class:`Served` names it) and the store's :attr:`tau`, read together: one snapshot
        that a concurrent :meth:`refresh` cannot split, so a draw and its log record name
        the policy that drew it."""
        if not isinstance(user_id, str):
            raise InputError(f"must be a str, got {checks.short(user_id)}", where="user_id")
        with self._lock:
            tau = self.tau
            if self._identity is not None:
                return self._identity, "identity", tau
            cache, shared, store = self._cache, self._shared, self.store
            got = cache.get(user_id)
            if got is not None:
                cache.move_to_end(user_id)
                return got, _who(got), tau
        # read and put on the device outside the lock; into the cache of the store it came from
        got = load_policy(store, user_id, shared_params=functools.partial(self._shared_params, store, shared))
        with self._lock:
            if cache is self._cache:             # else a refresh replaced the store meanwhile: served, not kept
                got = cache.setdefault(user_id, got)
                cache.move_to_end(user_id)
                while len(cache) > self.cache_users:
                    cache.popitem(last=False)
        return got, _who(got), tau

    def _shared_params(self, store: PolicyStore, shared: collections.OrderedDict, version: int | None
                       ) -> tuple[Any, int]:
        """Shared ``version`` of ``store`` (None: the newest that loads) on the device, once per
        version (``shared``: the device copies of ``store``'s)."""
        got = store.shared_state(version)     # outside the lock: its cache is thread-safe, a read may take a while
        with self._lock:
            params = shared.get(got.version)
            if params is not None:
                shared.move_to_end(got.version)
                return params, got.version
        params = _device(got.state.params)
        with self._lock:
            params = shared.setdefault(got.version, params)
            while len(shared) > SHARED_ON_DEVICE:
                shared.popitem(last=False)
        return params, got.version

    def _padded(self, query_emb, candidate_embs, m, mask):
        """Inputs checked and padded to buckets: ``(n, K, q, cands, mask)``."""
        q = _real_array(query_emb, "query_emb")
        one = q.ndim == 1
        q = q[None] if one else q
        c = _real_array(candidate_embs, "candidate_embs")
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise InputError(f"expected shape (d,) or (n, d) with d={self.dim}, got {np.shape(query_emb)}",
                             where="query_emb")
        n = q.shape[0]
        if c.ndim == 2:
            c = np.broadcast_to(c, (n,) + c.shape)
        if c.ndim != 3 or c.shape[0] != n or c.shape[2] != self.dim:
            raise InputError(f"expected shape (K, {self.dim}) or ({n}, K, {self.dim}), got {np.shape(candidate_embs)}",
                             where="candidate_embs")
        k = c.shape[1]
        mk = np.ones((n, k), bool) if mask is None else np.asarray(mask)
        if mk.dtype != bool or mk.shape not in ((k,), (n, k)):      # a float mask was cast: 0.3 counted as True
            raise InputError(f"expected a bool array of shape ({k},) or ({n}, {k}), got {mk.dtype} {mk.shape}",
                             where="mask")
        mk = np.broadcast_to(mk, (n, k))
        if not checks.is_int(m) or not 1 <= m <= k:
            raise InputError(f"must be in [1, K={k}], got {m!r}", where="m")
        # NaN or inf would rank as garbage (positions -1), silently: refused, masked padding aside
        for name, bad in (("query_emb", ~np.isfinite(q).all(-1)), ("candidate_embs", ~np.isfinite(c).all(-1) & mk)):
            if bad.any():
                i, *j = np.argwhere(bad)[0].tolist()
                place = ([] if one else [f"query {i}"]) + [f"candidate {x}" for x in j]
                raise InputError("holds NaN or inf" + (f" ({', '.join(place)})" if place else ""), where=name)
        nb, kb = bucket(n, 1), bucket(k, 1)
        qp = np.zeros((nb, self.dim), np.float32)
        qp[:n] = q
        cp = np.zeros((nb, kb, self.dim), np.float32)
        cp[:n, :k] = c
        mp = np.zeros((nb, kb), bool)
        mp[:n, :k] = mk
        return n, k, qp, cp, mp

    def rank(self, user_id: str, query_emb, candidate_embs, m: int, mask=None) -> Ranking:
        """Deterministic top-``m`` of ``user_id``'s policy for one query or a batch.

        ``query_emb`` (d,) or (n, d); ``candidate_embs`` (K, d), shared by every query, or
        (n, K, d), both floating-point (an int or bool embedding is refused); ``mask`` (K,)
        or (n, K) bool, False at padding. Shapes are padded to buckets, so batches of nearby
        sizes share one compiled program."""
        padded = self._padded(query_emb, candidate_embs, m, mask)
        return self._top(self.policy(user_id), m, *padded)

    def _top(self, policy: Policy, m: int, n, k, qp, cp, mp) -> Ranking:
        """:meth:`rank` with ``policy``, of inputs :meth:`_padded` checked."""
        sel, scores = jax.device_get(_rank(policy.params, qp, cp, mp, m=int(m)))
        _check_scores(scores[:n, :k], mp[:n, :k])
        return Ranking(np.asarray(sel[:n]), np.asarray(scores[:n, :k]))

    def sample(self, user_id: str, query_emb, candidate_embs, m: int, *, keys, tau: float | None = None,
               mask=None) -> Sample:
        """Gumbel top-``m`` draws of ``user_id``'s policy at temperature ``tau`` (default
        :attr:`tau`, the store's) for one query or a batch, shapes as in :meth:`rank`.

        ``keys``: one PRNG key per query (n,), e.g. :func:`call_keys` of the calls; a
        query's draw depends on its key, scores and candidate count only.

        >>> import jax, numpy as np
        >>> from rmm_jax.online.serve import Reranker
        >>> rr = Reranker(None, dim=2)                       # no policy yet: the identity reranker
        >>> q, c = np.array([1.0, 0.0]), np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
        >>> got = rr.sample("u1", q, c, 2, keys=jax.random.split(jax.random.key(0), 1), tau=1.0)
        >>> got.selected.shape, bool(np.allclose(got.logits, [[1.0, 0.0, 0.6]]))
        ((1, 2), True)
        """
        tau, inputs = self._draw_inputs(query_emb, candidate_embs, m, keys, tau, mask)
        policy, _, store_tau = self._served(user_id)
        return self._draw(policy, store_tau if tau is None else tau, m, *inputs)

    def _draw_inputs(self, query_emb, candidate_embs, m, keys, tau, mask) -> tuple[float | None, tuple]:
        """:meth:`sample`'s inputs checked: ``tau`` (None: the store's, left to the caller's
        snapshot) and ``(n, K, q, cands, mask, keys)`` padded to buckets."""
        if tau is not None:
            try:
                checks.check_tau(tau)
            except ValueError as e:
                raise InputError(str(e).partition(": ")[2], where="tau") from None
            tau = float(tau)
        n, k, qp, cp, mp = self._padded(query_emb, candidate_embs, m, mask)
        try:
            keys = keys if isinstance(keys, jax.Array) else jnp.asarray(keys)
        except (TypeError, ValueError):          # a str or None: a TypeError from jnp.asarray
            keys = np.asarray(keys, object)
        if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):      # seeds were a TypeError from jax.random
            raise InputError(f"expected {n} typed PRNG keys, e.g. jax.random.split(jax.random.key(0), {n}) or "
                             f"call_keys(seed, user, calls), got {keys.dtype}{list(keys.shape)}", where="keys")
        if keys.shape != (n,):
            raise InputError(f"expected {n} keys, one per query, got shape {keys.shape}", where="keys")
        data = np.asarray(jax.random.key_data(keys))        # padded on the host: eager pads are programs
        fill = data[:1] if n else np.zeros((1,) + data.shape[1:], data.dtype)   # n = 0: no key to repeat; a
        data = np.concatenate([data, np.repeat(fill, qp.shape[0] - n, axis=0)])  # padded row's draw is dropped
        keys = jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))
        return tau, (n, k, qp, cp, mp, keys)

    def _draw(self, policy: Policy, tau: float, m: int, n, k, qp, cp, mp, keys) -> Sample:
        """:meth:`sample` with ``policy`` at ``tau``, of inputs :meth:`_draw_inputs` checked."""
        tau = float(tau)
        sel, lp, scores = jax.device_get(_sample(policy.params, qp, cp, mp, keys, tau, m=int(m)))
        scores = np.asarray(scores[:n, :k])
        _check_scores(scores, mp[:n, :k])
        logits = np.where(mp[:n, :k], scores / np.float32(tau), 0.0).astype(np.float32)
        return Sample(np.asarray(sel[:n]), np.asarray(lp[:n], np.float64), logits, scores)


def _who(policy: Policy) -> str:
    """Who serves a policy loaded from a store, as :class:`Served` names it."""
    return "shared" if policy.version is None else "own_policy"


def _no_store_yet(path) -> bool:
    """Whether no policy store exists at ``path`` yet: nothing there, or an empty directory
    (made before the first store, e.g. a mounted volume; :meth:`PolicyStore.create` makes
    the store in it)."""
    if not os.path.lexists(path):
        return True
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:                 # a file, or unreadable: PolicyStore.open says what is wrong
        return False


class Served(NamedTuple):
    """One served call: ``index``, its place in the prepared calls; ``record``, its
    citation-log record without ``cited`` (:func:`rmm_jax.data.citation_log.call_record`;
    written with ``record_to_json(record, served=True)``); ``served_by``: ``own_policy``
    (its user's saved policy), ``shared`` (the shared part, for a user the store does not
    hold) or ``identity`` (no policy store); for the deterministic top-M (else None),
    ``positions``, the selected candidates' places in the call's candidate list, and
    ``scores``, their scores rounded to 6 decimals."""
    index: int
    record: LogRecord
    served_by: str
    positions: list[int] | None = None
    scores: list[float] | None = None


def call_batches(prepared_calls: Sequence[Prepared]) -> dict[tuple[str, int], list[int]]:
    """The batches :func:`serve_calls` serves ``prepared_calls`` in: the indices of the
    calls of each user and candidate count, one batched call each, in order of first call.

    >>> import numpy as np
    >>> from rmm_jax.data.calls import Call, Prepared
    >>> from rmm_jax.online.serve import call_batches
    >>> p = [Prepared(Call(i + 1, u, call_id=f"c{i}"), np.zeros(2), np.zeros((n, 2)), [], None)
    ...      for i, (u, n) in enumerate([("u1", 3), ("u2", 3), ("u1", 3), ("u1", 2)])]
    >>> call_batches(p)
    {('u1', 3): [0, 2], ('u2', 3): [1], ('u1', 2): [3]}
    """
    groups: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    for i, p in enumerate(prepared_calls):
        groups[(p.call.user_id, p.cands.shape[0])].append(i)
    return dict(groups)


def serve_calls(reranker: Reranker, prepared_calls: Sequence[Prepared], m: int, *, explore: bool = False,
                seed: int = 0, tau: float | None = None, now: int,
                batches: dict[tuple[str, int], list[int]] | None = None) -> Iterator[list[Served]]:
    """Serve ``prepared_calls`` (:func:`rmm_jax.data.calls.prepare_calls`) with
    ``reranker``, one batch at a time (:func:`call_batches`), yielding each batch's
    :class:`Served` calls: what ``rmm-jax rerank`` writes, in the order the batches run
    (``index`` puts each back in input order).

    A call selects ``m`` memories (all of them when it has fewer candidates): the
    deterministic top-M (:meth:`Reranker.rank`, with the selected ``positions`` and
    ``scores``) or, with ``explore``, a Gumbel top-M draw at ``tau`` (None: the store's,
    :attr:`Reranker.tau`) whose noise comes from :func:`call_keys` of ``seed``, the user and
    the call's identity, logged with its ``log_prob`` and ``logits``. A call without a
    timestamp is stamped ``now`` (microseconds since the epoch, read once per run) plus
    its index, as ISO 8601 UTC (:func:`rmm_jax.data.citation_log.utc_timestamp`); an
    ``InputError`` names ``now`` if it is not such an int (a float, or seconds), ``m`` if
    it is not an int >= 1, and a call without candidates or with fewer ids than candidates.
    ``batches``: :func:`call_batches` of ``prepared_calls``, when the caller has grouped them
    already (``rmm-jax rerank``, for its progress bar's total); None: grouped here. An
    exploring serve of at least :data:`EXPLORATION_CALLS` draws whose median drew its
    selection with probability 1/2 or more warns, once, with an :class:`ExplorationWarning`
    when the generator is exhausted (docs/lifecycle.md, "When the draw stops exploring").

    Examples:
      >>> import numpy as np
      >>> from rmm_jax.data.calls import Call, Prepared
      >>> from rmm_jax.data.citation_log import record_to_json
      >>> from rmm_jax.online.serve import Reranker, serve_calls
      >>> rr = Reranker(None, dim=2)                       # no policy yet: the identity reranker
      >>> c = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32)
      >>> calls = [Prepared(Call(1, "u1", call_id="c1"), np.array([1.0, 0.0], np.float32), c, ["m1", "m2", "m3"],
      ...                   None)]
      >>> [got] = serve_calls(rr, calls, 2, now=1_714_555_800_000_000)
      >>> got[0].served_by, got[0].positions, got[0].scores
      ('identity', [0, 2], [1.0, 0.6])
      >>> record_to_json(got[0].record, served=True)["selected"], got[0].record.timestamp
      (['m1', 'm3'], '2024-05-01T09:30:00.000000Z')
      >>> [got] = serve_calls(rr, calls, 2, explore=True, seed=0, tau=1.0, now=0)
      >>> got[0].record.log_prob < 0, got[0].record.logits
      (True, (1.0, 0.0, 0.6))
    """
    prepared_calls = _check_serve_args(prepared_calls, m, now, reranker.dim)
    drawn = []          # log-probabilities of the draws that chose among more than m candidates
    for (uid, n), rows in (call_batches(prepared_calls) if batches is None else batches).items():
        mm = min(m, n)                    # a call with fewer candidates than m shows all of them
        q = np.stack([prepared_calls[i].query for i in rows])
        cands = np.stack([prepared_calls[i].cands for i in rows])
        # one snapshot per batch: a refresh() meanwhile must not draw with one policy and log another
        pol, who, store_tau = reranker._served(uid)
        if explore:
            keys = call_keys(seed, uid, [call_key(prepared_calls[i].call) for i in rows])
            given, inputs = reranker._draw_inputs(q, cands, mm, keys, tau, None)
            drew_at = store_tau if given is None else given
            got = reranker._draw(pol, drew_at, mm, *inputs)
            if n > mm:
                drawn.append((np.asarray(got.log_prob, np.float64), np.abs(got.logits).max()))   # masked: 0
        else:
            got = reranker._top(pol, mm, *reranker._padded(q, cands, mm, None))
        batch = []
        for r, i in enumerate(rows):
            pos = [int(x) for x in got.selected[r] if x >= 0]
            rec = _served_record(prepared_calls[i], pos, pol, utc_timestamp(now + i),
                                 *((got.log_prob[r], got.logits[r]) if explore else (None, None)))
            batch.append(Served(i, rec, who) if explore else
                         Served(i, rec, who, pos, [round(float(got.scores[r, x]), 6) for x in pos]))
        yield batch
    if sum(len(lp) for lp, _ in drawn) >= EXPLORATION_CALLS:
        _warn_if_not_exploring(drawn, m, drew_at, reranker.store)


def _scores_grow(store: PolicyStore | None) -> bool:
    """Whether the policies of ``store`` learn with a loss whose scores can grow without end:
    the logistic loss read against the query's best current score (``reference="best"``, as
    ``realistic`` and ``calibrated`` do, and every store recorded before the field), not the
    default's retriever anchor. No store, or none recorded yet: False (the identity reranker's
    scores, or the default's)."""
    rec = read_setting(store) if store is not None else None
    values = setting_values(rec) if rec else {}
    return values.get("loss") == "logistic" and values.get("reference", "best") == "best"


def _warn_if_not_exploring(drawn: list, m: int, tau: float, store: PolicyStore | None = None) -> None:
    """An :class:`ExplorationWarning` (one per call of :func:`serve_calls` that drew at least
    :data:`EXPLORATION_CALLS` times, when its generator is exhausted) when the median of the
    draws' probabilities is at least :data:`NO_EXPLORATION`: the logits s/τ lie so far apart
    (the policies' scores have grown, or τ is small) that the Gumbel top-M shows the same
    memories, in the same order, more often than not, so the next log labels little beyond
    the policy's own choice and ``evaluate`` can judge little else (docs/lifecycle.md, "When
    the draw stops exploring"). ``drawn``: per batch, the draws' log-probabilities and the
    batch's largest |logit|; ``tau``: the temperature they were drawn at; ``store``: the policies'
    store: when they learn with the best-score anchor (:func:`_scores_grow`) the warning also
    names the move to the default preset, whose scores stay bounded."""
    log_p = np.concatenate([lp for lp, _ in drawn])
    p = math.exp(float(np.median(log_p)))
    if p >= NO_EXPLORATION:
        largest = max(float(x) for _, x in drawn)
        warnings.warn(ExplorationWarning(
            f"the exploring draw barely explored: the median call drew its {m} memories, in that order, with "
            f"probability {p:.2f} ({len(log_p)} calls): its logits s/tau lie far apart (up to {largest:.3g} at tau "
            f"{tau:g}), so tomorrow's log labels little beyond the policy's own top {m} and evaluate can judge "
            f"little else; draw at a larger tau (rerank --draw-tau)"
            + (", or move the policies to the default preset (replay ... --preset default --change-setting), whose "
               "scores stop growing" if _scores_grow(store) else "")
            + " (docs/lifecycle.md, \"When the draw stops exploring\")"),
            stacklevel=2)


_MIN_NOW_US = 10**14   # microseconds since the epoch below this (1973) are seconds or milliseconds


def _check_serve_args(prepared_calls, m, now, dim: int) -> list:
    """:func:`serve_calls`'s arguments, each refused by name before any call is served:
    ``prepared_calls`` a list of :class:`~rmm_jax.data.calls.Prepared` (not one), each with
    candidates and one id per candidate, embedded in ``dim`` (the reranker's: calls prepared
    on an embedding store of another dimension failed naming ``query_emb``, no argument of
    serve_calls); ``m`` an int >= 1; ``now`` an int of microseconds since the epoch
    (``time.time()`` seconds stamped 1970 silently)."""
    if isinstance(prepared_calls, Prepared) or not isinstance(prepared_calls, Sequence) or any(
            not isinstance(p, Prepared) for p in prepared_calls):
        raise InputError("must be a list of Prepared calls (rmm_jax.data.calls.prepare_calls), got "
                         f"{checks.short(prepared_calls)}", arg="prepared_calls")
    check_int(m, "m", 1)
    if not checks.is_int(now) or 0 < now < _MIN_NOW_US:
        raise InputError(f"must be an int of microseconds since the epoch (int(time.time() * 1e6)), got "
                         f"{checks.short(now)}", arg="now")
    for i, p in enumerate(prepared_calls):
        n = np.shape(p.cands)[0] if np.ndim(p.cands) else 0
        if n == 0:
            raise InputError(f"call {p.call.call_id or i} has no candidates", arg=f"prepared_calls {i}")
        if len(p.ids) != n:
            raise InputError(f"call {p.call.call_id or i} has {len(p.ids)} ids for {n} candidates",
                             arg=f"prepared_calls {i}")
        got = {np.shape(x)[-1] if np.ndim(x) else None for x in (p.query, p.cands)} - {dim}
        if got:
            raise InputError(f"call {p.call.call_id or i} is embedded in {got.pop()} dimensions, the reranker's "
                             f"are {dim} (prepared on another embedding store?)", arg=f"prepared_calls {i}")
    return prepared_calls


def _served_record(p: Prepared, sel: list[int], policy: Policy, stamp: str, log_prob=None, logits=None) -> LogRecord:
    """The record of prepared call ``p`` served with candidates ``sel`` (positions) by
    ``policy``: the request's timestamp, else ``stamp`` (the time it was served)."""
    c = p.call
    return call_record(c.user_id, p.ids, [p.ids[i] for i in sel], query_id=c.query_id, call_id=c.call_id,
                       query_text=c.query_text, candidate_texts=p.texts, log_prob=log_prob, logits=logits,
                       timestamp=stamp if c.timestamp is None else c.timestamp, policy_version=policy.version,
                       shared_version=policy.shared_version)
