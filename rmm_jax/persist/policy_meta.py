"""What a policy store records about its policies: :class:`PolicyMeta`, the typed form of the
``meta`` object in ``policy_store.json`` (kind, dim, hidden, scope, rank, config).

Every writer builds it (:meth:`PolicyMeta.of` from a run's layout) and every reader reads it
(:meth:`rmm_jax.persist.policy_store.PolicyStore.meta_info`) instead of writing and reading
the dict by hand; :meth:`PolicyMeta.to_dict` is the JSON object on disk, key for key.
"""
from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["PolicyMeta"]


class PolicyMeta(NamedTuple):
    """A policy store's metadata: the reranker ``kind``, the embedding size ``dim``, the
    `mlp` kind's ``hidden`` width (None otherwise), the ``scope`` and ``rank`` as the store
    records them (None: not recorded; a store without a scope is ``user``-scope, the first
    stores') and ``config``, what made the store (``model``: the embedding model,
    ``pretrained``: whether its shared part was pretrained, ``embedding_store``, ...).

    Examples:
        >>> from rmm_jax import preset
        >>> from rmm_jax.persist.policy_meta import PolicyMeta
        >>> meta = PolicyMeta.of(preset(scope="hybrid", rank=4).layout, 8, pretrained=False, model="m")
        >>> meta.to_dict()
        {'kind': 'linear', 'dim': 8, 'hidden': None, 'scope': 'hybrid', 'rank': 4,
         'config': {'pretrained': False, 'model': 'm'}}
        >>> PolicyMeta.from_dict(meta.to_dict()) == meta, meta.model, meta.pretrained
        (True, 'm', False)
        >>> PolicyMeta("linear", 8).to_dict()     # no scope recorded: a user-scope store
        {'kind': 'linear', 'dim': 8, 'hidden': None, 'config': {}}
    """
    kind: str
    dim: int
    hidden: int | None = None
    scope: str | None = None
    rank: int | None = None
    config: dict | None = None

    @classmethod
    def of(cls, layout, dim: int, **config: Any) -> "PolicyMeta":
        """The metadata of a store for runs of ``layout`` (a :class:`rmm_jax.core.config.Layout`:
        its kind, hidden width, scope and rank) on embeddings of size ``dim``; ``config`` the
        entries of its ``config`` (``model=...``, ``pretrained=...``, ...)."""
        return cls.from_dict({"kind": layout.kind, "dim": dim, "hidden": layout.hidden, **layout.scope.meta(),
                              "config": config})

    @classmethod
    def from_dict(cls, meta: dict) -> "PolicyMeta":
        """The metadata a store's ``meta`` object records (keys it lacks are None; others ignored)."""
        return cls(meta.get("kind"), meta.get("dim"), meta.get("hidden"), meta.get("scope"), meta.get("rank"),
                   dict(meta.get("config") or {}))

    def to_dict(self) -> dict:
        """The ``meta`` object written to ``policy_store.json``: scope and rank only where recorded."""
        return {"kind": self.kind, "dim": self.dim, "hidden": self.hidden,
                **({"scope": self.scope} if self.scope is not None else {}),
                **({"rank": self.rank} if self.rank is not None else {}),
                "config": dict(self.config or {})}

    @property
    def model(self) -> str | None:
        """The embedding model the store was made for (``config["model"]``), or None."""
        return (self.config or {}).get("model")

    @property
    def pretrained(self) -> bool:
        """Whether the store's shared part was pretrained (``config["pretrained"]``)."""
        return bool((self.config or {}).get("pretrained"))
