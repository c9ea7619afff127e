"""What a policy store accepts: the checks of :class:`~rmm_jax.persist.policy_store.PolicyStore`'s
arguments, each a one-line :class:`~rmm_jax.errors.InputError` naming the argument (or the
key) before anything is read or written.

Examples:
  >>> from rmm_jax.persist.policy_checks import check_user_ids, check_version
  >>> check_user_ids(("a", "b")), check_version(None), check_version(3)
  (['a', 'b'], None, 3)
  >>> check_version("1")
  Traceback (most recent call last):
  ...
  rmm_jax.errors.InputError: version: must be a positive int (a version number), got str '1'
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from rmm_jax.core.checks import is_int, short
from rmm_jax.core.reranker import KINDS
from rmm_jax.core.scope import Scope
from rmm_jax.core.types import SharedState, UserState
from rmm_jax.errors import InputError
from rmm_jax.persist.policy_meta import PolicyMeta


def json_dict(obj, what: str, where: str) -> dict:
    """``obj`` (None: ``{}``) if it is a JSON-serialisable dict, else an InputError at ``where``."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise InputError(f"{what} must be a dict, got {type(obj).__name__}", where=where)
    try:
        json.dumps(obj)
    except (TypeError, ValueError) as e:
        raise InputError(f"{what} is not JSON-serialisable ({e})", where=where) from None
    return obj


def is_pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def check_version(version, name: str = "version") -> int | None:
    """``version`` (None, or a positive int as the store numbers them; a NumPy integer as
    the int it is), else an InputError naming ``name``: ``shared_state("1")`` was a
    ValueError from a format code, ``load(user, version="1")`` said the user "has no
    version 1 (has [1])", ``version=True`` loaded version 1, and ``before="2"`` was a
    TypeError from ``<``."""
    if version is None:
        return None
    if not (is_int(version) and version > 0):
        raise InputError(f"must be a positive int (a version number), got {type(version).__name__} {version!r}"[:100],
                         where=name)
    return int(version)


def check_user_ids(user_ids, arg: str = "users") -> list[str]:
    """``user_ids`` as a list of str, else an InputError naming ``arg``: a list id was a
    TypeError (unhashable), an int one was looked up as given: ``load_batch([7])`` was a
    KeyError '7' where the store held user "7", and listed 7 as missing where it did not."""
    if isinstance(user_ids, str):
        raise InputError(f"expected a list of user ids, got the string {user_ids!r}", arg=arg)
    ids = list(user_ids)
    for bad in ids:
        if not isinstance(bad, str):
            raise InputError(f"user ids are str, got {type(bad).__name__} {bad!r}"[:100], arg=arg)
    return ids


def as_path(path) -> Path:
    """``path`` as a Path; anything else (None was Path's TypeError) refused naming ``path``."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"expected the store's directory (a str or Path), got {type(path).__name__} {path!r}"[:100],
                         arg="path")
    return Path(path)


def check_keep(keep, where: str) -> int:
    """``keep`` (versions kept per user) if a positive int, else an InputError at ``where``."""
    if not is_pos_int(keep):
        raise InputError(f"keep must be a positive int (versions kept per user), got {keep!r}", where=where)
    return keep


def check_meta(meta: PolicyMeta | dict, where: str) -> dict:
    """``meta`` (a :class:`PolicyMeta` or its dict) checked (one-line InputErrors naming the
    key), as the dict written, with a ``config`` dict."""
    if isinstance(meta, PolicyMeta):
        meta = meta.to_dict()
    if not isinstance(meta, dict):
        raise InputError("meta must be a dict with kind, dim, hidden, config", where=where)
    for key in ("kind", "dim", "hidden"):
        if key not in meta:
            raise InputError(f"meta is missing key '{key}'", where=where)
    if meta["kind"] not in KINDS:
        raise InputError(f"meta kind {meta['kind']!r} is not one of {KINDS}", where=f"{where}: key 'kind'")
    if not is_pos_int(meta["dim"]):
        raise InputError(f"meta dim must be a positive int, got {meta['dim']!r}", where=f"{where}: key 'dim'")
    h = meta["hidden"]
    if h is not None and not is_pos_int(h):
        raise InputError(f"meta hidden must be a positive int or None, got {h!r}", where=f"{where}: key 'hidden'")
    try:
        Scope.from_meta(meta)
    except ValueError as e:
        key, _, msg = str(e).partition(": ")
        raise InputError(f"meta {key} {msg}", where=f"{where}: key '{key}'") from None
    meta = {**meta, "config": dict(meta.get("config") or {})}
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise InputError(f"meta is not JSON-serialisable ({e})", where=where) from None
    return meta


# Where a reranker's params hold the embedding size d (flax kernels, x -> x K): the axes of
# each named leaf, counted from the end, so a users axis in front changes nothing.
_DIM_AXES = {("W", "kernel"): (-2, -1),              # linear: (d, d)
             ("down", "kernel"): (-1,), ("down", "bias"): (-1,), ("up", "kernel"): (-2,),   # mlp: (h, d), (d,), (d, h)
             ("lora", "a"): (-2,), ("lora", "b"): (-2,)}                                    # hybrid users: (d, r)


# the leaves only one kind of reranker has (by their last two keys), and those that hold the
# `mlp` kind's hidden width h: the axes counted from the end
_KIND_OF = {("W", "kernel"): "linear", ("down", "kernel"): "mlp", ("down", "bias"): "mlp", ("up", "kernel"): "mlp",
            ("up", "bias"): "mlp"}
_HIDDEN_AXES = {("down", "kernel"): (-2,), ("up", "kernel"): (-1,), ("up", "bias"): (-1,)}


def check_params(params, meta: dict, arg: str, *, of_kind: bool = True, of: str = "the store's meta") -> None:
    """Refuse ``params`` (a reranker's, a users axis in front or not; ``{}`` or only some
    adapters: what is there is checked) that are not of the store's meta: an embedding size
    other than ``dim`` (a dim-16 policy saved in a dim-384 store was found only when serving:
    ``q: dimension 384 does not match the reranker's 16``), another ``kind`` (linear params
    in an `mlp` store, or the reverse, were stored and failed at serving) or, for `mlp`, a
    hidden width other than ``hidden`` (when the meta records one); naming ``arg``. Without
    ``of_kind`` only the dim (users' params: a store may hold users of another structure,
    which :meth:`PolicyStore.load_batch` refuses to stack). A ``dim`` of None is not checked
    (a program's layout has none); ``of`` names what the meta is in the messages."""
    dim, kind, hidden = meta["dim"], meta["kind"], meta.get("hidden") if of_kind else None
    kind = kind if of_kind else None
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        shape = np.shape(leaf)
        name = "/".join(map(str, keys))
        if kind is not None and _KIND_OF.get(keys[-2:], kind) != kind:
            raise InputError(f"params are of the {_KIND_OF[keys[-2:]]} kind ({name}), {of} kind is {kind}", arg=arg)
        for ax in _DIM_AXES.get(keys[-2:], ()) if dim is not None else ():
            if len(shape) >= -ax and shape[ax] != dim:
                raise InputError(f"params are for embedding size {shape[ax]} ({name} has shape {tuple(shape)}), "
                                 f"{of} dim is {dim}", arg=arg)
        for ax in _HIDDEN_AXES.get(keys[-2:], ()) if kind == "mlp" and hidden is not None else ():
            if len(shape) >= -ax and shape[ax] != hidden:
                raise InputError(f"params have hidden width {shape[ax]} ({name} has shape {tuple(shape)}), "
                                 f"{of} hidden is {hidden}", arg=arg)


def check_user_params(params, scope: Scope, arg: str) -> None:
    """Refuse users' ``params`` (a users axis in front) that hold what ``scope`` does not keep
    per user (:meth:`rmm_jax.core.scope.Scope.split`): a reranker's own leaves (a linear
    ``W``, an ``mlp``'s layers) in ``shared`` or ``hybrid``, whose users keep none (saved in a
    ``hybrid`` store, a whole reranker was served as the shared part alone, without a word: the
    merge keeps the shared kernel), and low-rank factors in ``user`` or ``shared`` (saved in a
    ``user`` store, they failed at every load) or of another rank than a ``hybrid`` store's.
    Other leaves are the caller's to choose. Names ``arg``.

    >>> import jax, rmm_jax as rj
    >>> from rmm_jax.persist.policy_checks import check_user_params
    >>> check_user_params(rj.init_reranker(jax.random.key(0), 4), rj.Scope.named("hybrid", 2), "state")
    Traceback (most recent call last):
    ...
    rmm_jax.errors.InputError: state: scope 'hybrid' keeps each user's low-rank factors ... (m_adapter/W/kernel)
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        name, shape = "/".join(map(str, keys)), np.shape(leaf)
        if keys[-2:] in _KIND_OF and scope.has_shared:
            raise InputError(f"scope {scope.name!r} keeps "
                             + ("each user's low-rank factors (rmm_jax.init_lowrank)" if scope.name == "hybrid" else
                                "no params per user (the shared part is save_shared's)")
                             + f", not a reranker's own params ({name})", arg=arg)
        if keys[-2:] in (("lora", "a"), ("lora", "b")):
            if scope.name != "hybrid":
                raise InputError(f"scope {scope.name!r} keeps no low-rank factors ({name}): those are scope "
                                 "'hybrid''s", arg=arg)
            if not shape or shape[-1] != scope.rank:
                raise InputError(f"low-rank factors of rank {shape[-1] if shape else None} ({name} has shape "
                                 f"{tuple(shape)}), the store's rank is {scope.rank}", arg=arg)


def check_embedding_store(ps, store, arg: str) -> None:
    """Refuse policy store ``ps`` for embedding store ``store`` (an
    :class:`~rmm_jax.data.store.EmbeddingStore`: its ``dim`` and ``model``) when its
    dimension differs, or the embedding model it records (when it records one) is not
    ``store``'s: two models of one dimension embed into different spaces, and a policy of
    one scores the other's vectors without an error. Names ``arg`` (the CLI's ``--policies``)."""
    meta = ps.meta_info()
    if meta.dim != store.dim:
        raise InputError(f"policy store has dim {meta.dim}, the embedding store's is {store.dim} (made for another "
                         "embedding model?)", arg=arg)
    if meta.model and meta.model != store.model:
        raise InputError(f"policy store was made for embedding model {meta.model!r}, the embedding store uses "
                         f"{store.model!r}", arg=arg)


def check_create(path: Path, meta: PolicyMeta | dict, shared_params, keep, chunk_size, chunk_bytes,
                 shared_info) -> tuple[dict, dict]:
    """A :meth:`~rmm_jax.persist.policy_store.PolicyStore.create`'s arguments checked: the
    ``meta`` (:func:`check_meta`), a JSON ``shared_info``, ``keep``, a reranker's
    ``shared_params`` of that meta, chunk sizes >= 1 and a ``path`` that does not exist or
    is an empty directory. Returns the meta and the shared info as written."""
    meta = check_meta(meta, str(path))
    shared_info = json_dict(shared_info, "shared info", str(path))
    check_keep(keep, str(path))
    if not isinstance(shared_params, Mapping):      # None was stored, and serving failed 10 calls deep
        raise InputError(f"expected a reranker's params (init_reranker), got {short(shared_params)}",
                         arg="shared_params")
    check_params(shared_params, meta, "shared_params")
    if (chunk_size is not None and chunk_size < 1) or chunk_bytes < 1:
        raise InputError("chunk_size and chunk_bytes must be >= 1", where=str(path))
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InputError("already exists and is not empty; choose a new policy store path", where=str(path))
    return meta, shared_info


def check_save(user_ids, state, infos, chunk_size, *, scope: Scope, shared_version, meta: dict
               ) -> tuple[list[str], list[dict]]:
    """A :meth:`~rmm_jax.persist.policy_store.PolicyStore.save`'s arguments checked: the
    users (distinct non-empty str), one JSON info each (None: ``{}`` each), a
    :class:`UserState` whose params are of the store's ``meta`` dim and the part its ``scope``
    keeps per user (:func:`check_user_params`), ``chunk_size`` >= 1 if
    given and, where ``scope`` pairs users with the shared part, a ``shared_version``.
    Returns the users and their infos as lists."""
    if isinstance(user_ids, str):
        raise InputError(f"expected a list of user ids, got the string {user_ids!r}", where="save")
    user_ids = list(user_ids)
    if not isinstance(state, UserState):
        raise InputError(f"state must be a UserState(params, opt_state, learner_state), got "
                         f"{type(state).__name__}", where="save")
    infos = [{} for _ in user_ids] if infos is None else list(infos)
    if len(infos) != len(user_ids):
        raise InputError(f"{len(infos)} infos for {len(user_ids)} users", where="save: infos")
    if not user_ids:
        raise InputError("nothing to save (no users)", where="save")
    if len(set(user_ids)) != len(user_ids):
        dup = next(u for u in user_ids if user_ids.count(u) > 1)
        raise InputError(f"user {dup!r} appears twice in one save", where="user_ids")
    for uid, info in zip(user_ids, infos):
        if not isinstance(uid, str) or not uid:
            raise InputError(f"user id must be a non-empty string, got {uid!r}", where="user_ids")
        json_dict(info, "info", f"user {uid!r} info")
    if chunk_size is not None and chunk_size < 1:
        raise InputError(f"chunk_size must be >= 1, got {chunk_size}", where="save")
    if scope.has_shared and shared_version is None:
        raise InputError(f"a save in scope {scope.name!r} needs shared_version (the shared version these "
                         "users were trained against)", where="save")
    check_params(state.params, meta, "state", of_kind=False)
    check_user_params(state.params, scope, "state")
    return user_ids, infos


def check_save_shared(state, info, meta: dict) -> dict:
    """A :meth:`~rmm_jax.persist.policy_store.PolicyStore.save_shared`'s arguments checked:
    a :class:`SharedState` whose params are of the store's ``meta``, a JSON ``info`` dict
    (None: ``{}``, returned)."""
    if not isinstance(state, SharedState):
        raise InputError(f"expected a SharedState(params, opt_state), got {type(state).__name__}",
                         where="save_shared")
    info = json_dict(info, "shared info", "save_shared: info")
    check_params(state.params, meta, "state")
    return info
