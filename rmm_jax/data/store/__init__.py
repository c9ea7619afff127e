"""The embedding store: a dataset's memories and queries, embedded once, on disk.

Layout of a store directory (written whole by :func:`write_store` through
:func:`rmm_jax.persist.atomic.atomic_dir`, so a failure leaves no partial store; one
writer at a time, holding the lock file ``.NAME.lock`` beside it, :func:`store_writer`)::

    manifest.json    {"format": "rmm-jax-embedding-store", "version": 1, "model", "dim",
                      "granularity", "dataset", "spec",
                      "counts": {"users", "memories", "queries"}, "stats"}
    memories.npy     (N_mem, d) float32, all users concatenated
    queries.npy      (N_q, d) float32
    users.json       [{"id", "mem_start", "mem_end", "query_start", "query_end"}, ...]
    memories.jsonl   {"user", "id", "session_id", "timestamp", "turn_ids", "text"} per row
    queries.jsonl    {"user", "id", "text", "category", "date", "gold_turn_ids",
                      "gold_memory_ids", "abstention"} per row

``gold_memory_ids`` are the ids of that user's memories holding a gold turn
(:func:`rmm_jax.data.types.gold_matrix`).

:func:`open_store` validates a store and returns an :class:`EmbeddingStore`; its
``.user(id)`` gives one user's arrays (:class:`UserData`), the unit that retrieval,
reranking and the metrics work on.

Example::

    >>> store = open_store("store", expect_model="sentence-transformers/all-MiniLM-L6-v2")  # doctest: +SKIP
    >>> u = store.user(store.user_ids[0])                      # doctest: +SKIP
    >>> u.memory_emb.shape, u.gold.shape                       # doctest: +SKIP
    ((419, 384), (199, 419))

Growing a store by a day's sessions and users, keeping every old row bit for bit, is
:func:`append_store`.

One concern per private module: ``_format`` (the marker and version), ``_write`` (a new
store, whole), ``_read`` (opening and reading), ``_append`` (growing one).
"""
from rmm_jax.data.granularity import GRANULARITIES
from rmm_jax.data.store._append import APPENDABLE, append_store, check_model
from rmm_jax.data.store._format import FORMAT, VERSION
from rmm_jax.data.store._read import EmbeddingStore, UserData, is_store, open_store, read_rows
from rmm_jax.data.store._write import answer_texts, store_writer, write_store

__all__ = ["FORMAT", "VERSION", "GRANULARITIES", "write_store", "open_store", "EmbeddingStore", "UserData",
           "append_store", "APPENDABLE", "check_model", "is_store", "read_rows", "store_writer", "answer_texts"]
