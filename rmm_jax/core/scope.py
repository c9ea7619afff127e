"""Who learns from whose citations: the one place that knows the three policy scopes.

A user's reranker is ``merge(shared, local_u)`` (:func:`rmm_jax.core.reranker.merge_params`):

    user     every user has a private reranker φ_u: shared part {}, local part φ_u;
    shared   one reranker φ for all users: shared part φ, local part {};
    hybrid   φ_u = (W_q, W_m) shared + (A_q^u, B_q^u, A_m^u, B_m^u) per user: the low-rank
             residual K^u = K + A^u B^uᵀ of each adapter (rank r, LoRA; Hu et al., ICLR 2022).

So scope ``user`` is the case with an empty shared part, and one update
(:func:`rmm_jax.core.update.make_update`) serves all three: the shared part learns from
the mean of the active users' gradients (nothing, when it is empty), each local part from
its own user's. Everything else (the loop, the policy store, the CLI) asks a :class:`Scope`
how to split, merge, start and record a policy, and never tests the scope's name.

Examples:
  >>> import jax, rmm_jax as rj
  >>> from rmm_jax import Scope
  >>> p = rj.init_reranker(jax.random.key(0), 4)
  >>> shared, local = Scope.named("hybrid", rank=2).split(p, jax.random.key(1))
  >>> sorted(shared["q_adapter"]), sorted(local["q_adapter"]), local["q_adapter"]["lora"]["a"].shape
  (['W'], ['lora'], (4, 2))
  >>> Scope.named("user").split(p, jax.random.key(1))[0]
  {}
  >>> Scope.from_meta({"scope": "hybrid", "rank": 8}).meta()
  {'scope': 'hybrid', 'rank': 8}
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from rmm_jax.core import checks
from rmm_jax.core.reranker import dim_of, init_lowrank, merge_params

SCOPES = ("user", "shared", "hybrid")
"""Who learns from whose citations: every user alone, one policy for all, or both (:class:`Scope`)."""
DEFAULT_RANK = 8
LOWRANK_KEY = 0x10CA1  # folded into a user's key for its low-rank initialisation


class Scope(NamedTuple):
    """A policy scope: ``name`` in :data:`SCOPES` and, for ``hybrid``, the residual's rank.

    Examples:
      >>> import rmm_jax as rj
      >>> rj.Scope(), rj.Scope.named("hybrid", 4), rj.Scope.named("shared")   # rank: hybrid only
      (Scope(name='user', rank=None), Scope(name='hybrid', rank=4), Scope(name='shared', rank=None))
    """
    name: str = "user"
    rank: int | None = None

    @staticmethod
    def named(name: str, rank: int | None = None) -> "Scope":
        """The scope ``name``; ``rank`` is for ``hybrid`` only (default :data:`DEFAULT_RANK`).
        Raises ``ValueError("scope: ...")``/``("rank: ...")`` for a bad value, and a rank with
        another scope (it was dropped without a word), as ``rmm-jax``'s ``--rank`` without
        ``--scope hybrid``."""
        checks.require(name in SCOPES, "scope", f"must be one of {SCOPES}, got {name!r}")
        if name != "hybrid":
            checks.require(rank is None, "rank", f"only scope 'hybrid' has a per-user rank, not {name!r} "
                                                 "(give scope='hybrid', or leave rank out)")
            return Scope(name, None)
        rank = DEFAULT_RANK if rank is None else rank
        checks.require(checks.is_int(rank) and rank >= 1, "rank", f"must be >= 1, got {rank!r}")
        return Scope(name, int(rank))

    # ---- what each scope shares

    @property
    def has_shared(self) -> bool:
        """Whether users share a part that learns from all of them (``shared``, ``hybrid``)."""
        return self.name != "user"

    @property
    def has_local(self) -> bool:
        """Whether each user has params of its own (``user``, ``hybrid``)."""
        return self.name != "shared"

    @property
    def local_is_full(self) -> bool:
        """Whether a user's local part is a whole reranker (``user``)."""
        return self.name == "user"

    def validate(self, kind: str, dim: int | None = None) -> None:
        """A name of :data:`SCOPES` with a rank for ``hybrid`` alone (what :meth:`named` makes;
        ``Scope(...)`` built directly checks nothing: ``Scope("xx")`` and ``Scope("hybrid")``
        passed a :class:`~rmm_jax.core.config.Layout` and failed only at the first split, as
        "rank: ... got None", and ``Scope("shared", 3)`` recorded a rank (:meth:`meta`) that
        :meth:`from_meta` refuses), and ``hybrid`` adapts the linear reranker's W with a
        residual of rank below d."""
        checks.require(self.name in SCOPES, "scope", f"must be one of {SCOPES}, got {self.name!r}")
        checks.require(self.name == "hybrid" or self.rank is None, "rank",
                       f"is only for scope 'hybrid', not {self.name!r}")
        if self.name != "hybrid":
            return
        checks.require(checks.is_int(self.rank) and self.rank >= 1, "rank",
                       f"scope 'hybrid' needs an int rank >= 1, got {self.rank!r} (Scope.named gives the default)")
        checks.require(kind == "linear", "scope", "hybrid needs the linear reranker (the low-rank residual "
                                                  "adapts its W)")
        if dim is not None:
            checks.require(self.rank < dim, "rank", f"must be in [1, d={dim}), got {self.rank}")

    # ---- params

    def split(self, params, key):
        """``(shared, local)`` parts of a starting policy ``params`` for one user: ``user``
        ``({}, params)``; ``shared`` ``(params, {})``; ``hybrid`` ``(params, low-rank zero
        residual)`` with a key derived from ``key``, so the user scores exactly as ``params``."""
        if self.name == "user":
            return {}, params
        if self.name == "shared":
            return params, {}
        return params, init_lowrank(jax.random.fold_in(key, LOWRANK_KEY), dim_of(params), self.rank)

    def shared_part(self, params):
        """The shared part of ``params`` (``{}`` in scope ``user``)."""
        return params if self.has_shared else {}

    @staticmethod
    def merge(shared, local):
        """A user's reranker from its two parts (:func:`rmm_jax.core.reranker.merge_params`)."""
        return merge_params(shared, local)

    # ---- what a policy store records

    def meta(self) -> dict:
        """The policy store's record of this scope: ``{"scope": name}`` plus ``rank`` for hybrid."""
        return {"scope": self.name, **({"rank": self.rank} if self.rank is not None else {})}

    @staticmethod
    def from_meta(meta: dict) -> "Scope":
        """The scope a policy store's metadata records (absent: ``user``, the first stores'),
        checked: a rank is recorded for ``hybrid`` and only for it (``ValueError("scope: ...")``
        or ``("rank: ...")`` otherwise)."""
        name, rank = meta.get("scope") or "user", meta.get("rank")
        checks.require(name in SCOPES, "scope", f"must be one of {SCOPES}, got {name!r}")
        checks.require(name == "hybrid" or rank is None, "rank", f"is only for scope 'hybrid', not {name!r}")
        checks.require(name != "hybrid" or rank is not None, "rank", "scope 'hybrid' needs a rank (a positive int)")
        return Scope.named(name, rank)

    def mismatch(self, stored: "Scope") -> tuple[str, str] | None:
        """``(option, message)`` when a store of scope ``stored`` cannot take this scope's
        policies, else None."""
        if stored.name != self.name:
            return "--scope", (f"holds '{stored.name}'-scope policies, not '{self.name}' "
                               f"(use --scope {stored.name} or a new --policies)")
        if stored.rank != self.rank:
            return "--rank", f"holds rank-{stored.rank} residuals, not rank {self.rank}"
        return None
