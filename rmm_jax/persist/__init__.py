"""Persistence, no jobs: atomic files, checksums, locking, the pytree codec, the policy
store and the run-state checkpoints.

One concern per module. The building blocks: :mod:`~rmm_jax.persist.atomic` (nothing
half-written), :mod:`~rmm_jax.persist.checksums`, :mod:`~rmm_jax.persist.lock` (one writer),
:mod:`~rmm_jax.persist.codec` (pytrees as a spec plus numpy leaves). The policy store,
:class:`~rmm_jax.persist.policy_store.PolicyStore`, is a face over its parts:
``policy_checks`` (what it accepts), ``policy_header`` (``policy_store.json``),
``policy_meta`` (:class:`~rmm_jax.persist.policy_meta.PolicyMeta`), ``policy_index`` (the
SQLite index), ``policy_versions`` (which versions it holds: repair, commits, garbage
collection), ``policy_snapshot`` and ``policy_rows`` (the chunks on disk),
``policy_restore`` (which version loads), ``policy_shared`` (the shared part),
``learned_calls`` (what a policy learned from), ``policy_report`` (listings and sizes),
``policy_rollback`` and ``rollback`` (rolling back, and the fallbacks a load reports),
``policy_setting`` (the learner a store records) and ``policy_format1`` (format-1 stores).
:mod:`~rmm_jax.persist.runstate` holds the run-state checkpoints.
"""
