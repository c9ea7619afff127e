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

    >>> from rmm_jax.data.store import open_store                                           # doctest: +SKIP
    >>> store = open_store("store", expect_model="sentence-transformers/all-MiniLM-L6-v2")  # doctest: +SKIP
    >>> u = store.user(store.user_ids[0])                      # doctest: +SKIP
    >>> u.memory_emb.shape, u.gold.shape                       # doctest: +SKIP
    ((419, 384), (199, 419))

Growing a store
---------------
Memory banks grow: :func:`append_store` (``rmm-jax embed SPEC --into STORE``) reads a
dataset as ``embed`` does and adds to an existing store what it does not hold yet (a day's
new sessions, new users), embedding only the new texts. What is **new**, for any dataset
the loaders read (``jsonl:``, ``locomo:``, ``longmemeval:``, ``synthetic``):

* a **user** the store does not hold: all of it (sessions and questions), after the
  store's users;
* a **session**, by its ``session_id`` within its user: a session id the store does not
  hold for that user is new, and its memories go after the user's existing ones. A
  session the store holds with the same memories (ids, texts, timestamps) is a **repeat**:
  skipped and counted, so appending the same day twice changes nothing. The same
  session id with other content is an error (one line naming the user and the session):
  give every session of a day file its own ``session_id`` (``jsonl:`` numbers sessions
  without one from 1 in each file, so two day files without ids collide);
* a **question**, by its id within its user, likewise: new ones are appended with gold
  over the user's whole bank, repeats skipped, a changed text, gold or abstention is an
  error (the store would keep its own without a word). Its gold may
  name turns and sessions of an earlier day: the ids its file does not hold
  (``Dataset.gold_elsewhere``, kept by ``load_jsonl(..., gold_elsewhere=True)``) are looked
  up in the store's memories of its user (their ``turn_ids`` and ``session_id``), and an id
  neither holds is an error naming its file:line and key. A user the store does not hold
  has only its file to name gold in.

What stays: every existing user, memory and question keeps its id, its position in its
user's bank (the rows of :meth:`rmm_jax.data.store.EmbeddingStore.user`) and its
embedding, bit for bit, so policies trained on the store keep working (a policy is a
function of embeddings, and logs name memories by id). Only the global row offsets of
the users after a grown one move. The store must have been embedded with the same model
and at ``turn`` or ``session`` granularity (``segment`` merges new topics into old
memories, which would change them). The new store is written whole, next to the old one,
and renamed into place (:func:`rmm_jax.persist.atomic.atomic_dir`): a crash leaves the
old store. Readers take no lock: an opened store reads the version it opened, through the
files it opened at once (``_read``), and :meth:`EmbeddingStore.refresh` moves it to the one
renamed into place since.

One concern per private module: ``_format`` (the marker and version), ``_write`` (a new
store, whole), ``_read`` (opening and reading), ``_append`` (growing one).
"""
from rmm_jax.data.granularity import GRANULARITIES
from rmm_jax.data.store._append import APPENDABLE, append_store, check_model
from rmm_jax.data.store._format import FORMAT, VERSION
from rmm_jax.data.store._read import EmbeddingStore, UserData, is_store, open_store, read_rows, store_counts
from rmm_jax.data.store._write import answer_texts, check_store_path, store_writer, unanswered, write_store

__all__ = ["FORMAT", "VERSION", "GRANULARITIES", "write_store", "open_store", "EmbeddingStore", "UserData",
           "append_store", "APPENDABLE", "check_model", "is_store", "read_rows", "store_writer", "answer_texts",
           "unanswered", "store_counts", "check_store_path"]
