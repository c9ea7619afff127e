"""Where each chunk's users start when a run continues from a policy store.

A run over a store that already holds policies goes on from them: every user of a chunk
that the store holds resumes from its newest saved version (params, optimiser state,
baseline, update count and PRNG key: :class:`rmm_jax.core.types.UserState`), and users new
to the store start from the run's starting policy. :func:`from_store` turns chunks of
streams into :class:`rmm_jax.online.driver.Chunk` s that carry those states; the driver
hands them to ``program.init``. A user's batches sample with ``fold_in(key, update
count)``, so replaying the first half of a log and then the second gives bit for bit the
policies of replaying the whole log once (for users independent of each other; with a
shared part, also when the halves split at a users chunk).

Examples:
  >>> import numpy as np
  >>> from rmm_jax.online.driver import Chunk
  >>> class Empty:                                  # a store that holds nobody
  ...     def load_batch(self, ids, before=None):
  ...         from rmm_jax.persist.policy_store import SavedBatch
  ...         return SavedBatch([], None, [], [], [], list(ids), {})
  >>> [c.known for c in from_store([[]], Empty())]
  [None]
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from rmm_jax.online.driver import Chunk
from rmm_jax.online.streams import Stream


def from_store(chunks: Iterable[Sequence[Stream]], store, *, before: int | None = None) -> Iterator[Chunk]:
    """Each chunk with the saved states of its users that ``store`` holds (their newest
    versions older than ``before``, see :meth:`PolicyStore.load_batch`); the others start
    afresh. Each chunk's users are read once, as the chunk is reached."""
    for streams in chunks:
        streams = list(streams)
        got = store.load_batch([s.user_id for s in streams], before=before)
        if not got.users:
            yield Chunk(streams)
            continue
        row = {u: i for i, u in enumerate(got.users)}
        take = np.array([row.get(s.user_id, 0) for s in streams])
        users = jax.tree.map(lambda x: np.asarray(x)[take], got.state)
        yield Chunk(streams, users, np.array([s.user_id in row for s in streams]))
