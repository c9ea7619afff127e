"""Persistence, no jobs: atomic files, checksums, locking, the pytree codec, the policy
store and the run-state checkpoints."""
