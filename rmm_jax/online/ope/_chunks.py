"""The fixed number of calls every compiled program of OPE runs on: scoring the logged
calls with the target (:func:`~rmm_jax.online.ope.load_calls`) and the Monte Carlo
slot marginals (:func:`~rmm_jax.online.ope.slot_marginals_mc`) pad the last chunk, so
each compiles once per K, M."""
from __future__ import annotations

import numpy as np

CHUNK = 64                           # calls per compiled scoring call (fixed: one compile per K, M)


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    if x.shape[0] == rows:
        return x
    pad = np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad])
