"""The fixed number of calls every compiled program of OPE runs on: scoring the logged
calls with the target (:func:`~rmm_jax.online.ope.load_calls`) and the Monte Carlo
slot marginals (:func:`~rmm_jax.online.ope.slot_marginals_mc`) pad the last chunk
(:func:`rmm_jax.data.retrieval.pad_rows`), so each compiles once per K, M."""

_CHUNK = 64                          # calls per compiled scoring call (fixed: one compile per K, M)
