"""The learning setting a policy store records: which learner trains its policies.

A run that creates a policy store, or first trains one (``pretrain`` writes none), stores
its setting (:func:`rmm_jax.core.config.setting_record`: the preset, the batch, the
estimator, the optimiser and its step size) in the store's header, ``policy_store.json``,
under ``"setting"``. A later run on the store continues with that setting, and a run
that changes it on purpose (``--change-setting``) records the new one
(docs/lifecycle.md, "Continue means the same learner"). The header is rewritten
atomically under the store's writer lock; the rest of the header is kept as it is.
"""
from __future__ import annotations

__all__ = ["SETTING_KEY", "read_setting", "write_setting"]

SETTING_KEY = "setting"


def read_setting(store) -> dict | None:
    """The setting ``store`` (a :class:`rmm_jax.persist.policy_store.PolicyStore`) records,
    or None when no run has recorded one yet."""
    return store._header.get(SETTING_KEY)


def write_setting(store, setting: dict) -> None:
    """Record ``setting`` in ``store``'s header (atomically, under its writer lock)."""
    with store.writer():
        store._write_header({**store._header, SETTING_KEY: setting})
