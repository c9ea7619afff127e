"""The embedding store's format marker and version (``manifest.json``'s ``format`` and
``version``): what :func:`~rmm_jax.data.store.write_store` writes and
:func:`~rmm_jax.data.store.open_store` accepts."""

FORMAT = "rmm-jax-embedding-store"
VERSION = 1
