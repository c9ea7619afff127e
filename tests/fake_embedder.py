"""A deterministic embedder with no model, for fast store tests. Plain NumPy (no JAX), so that
a test subprocess can embed with it and still check what the CLI imports."""
from __future__ import annotations

import hashlib
import re

import numpy as np


class FakeEmbedder:
    """Deterministic bag-of-words embedder, no model: fast store tests.

    A text is the normalised sum of one fixed random vector per lower-cased word, so
    texts that share words are close (retrieval has signal, as with a real model).
    """

    def __init__(self, dim: int = 16, max_tokens: int | None = None):
        self.calls = 0
        self.texts_embedded = 0  # as Embedder counts them (none cached here)
        self.max_tokens = max_tokens  # as Embedder's: a text of more words counts in texts_truncated
        self.texts_truncated = 0
        self.dim = dim
        self.model_id = f"fake/bow-{dim}"
        self.cache_dir = None  # as Embedder(use_cache=False)

    def _word(self, w):
        seed = int.from_bytes(hashlib.sha256(w.encode()).digest()[:8], "little")
        return np.random.default_rng(seed).standard_normal(self.dim)

    def encode(self, texts, desc=""):
        self.calls += 1
        self.texts_embedded += len(texts)
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            words = re.findall(r"[a-z0-9]+", t.lower()) or [t]
            self.texts_truncated += self.max_tokens is not None and len(words) > self.max_tokens
            v = sum(self._word(w) for w in words) + 1e-3 * self._word("\0" + t)
            out[i] = v / np.linalg.norm(v)
        return out

    def close(self):
        pass
