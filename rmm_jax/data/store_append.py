"""Moved: growing a store is :func:`rmm_jax.data.store.append_store` (the package's "Growing a
store"); importing a name from here still works, with a :class:`DeprecationWarning`."""
from rmm_jax.deprecated import moved

__getattr__ = moved(__name__, dict.fromkeys(("APPENDABLE", "append_store", "check_model"), "rmm_jax.data.store"))
