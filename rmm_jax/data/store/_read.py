"""Opening an embedding store: validate its files (:func:`open_store`) and read one user's
rows at a time (:class:`EmbeddingStore`, :class:`UserData`) without holding the whole
store in memory.

An opened store is a snapshot: :func:`open_store` opens the store's directory and every file
it will read at once (:class:`_Files`: at most 8 descriptors a store, whatever its number of
users, besides the one each memory-mapped array holds) and reads through those descriptors
only, so an ``embed --into`` that renames a grown store into place meanwhile changes nothing
it reads (a renamed-away or deleted file stays readable through an open descriptor).
:meth:`EmbeddingStore.refresh` moves it to the store the path holds now;
:meth:`EmbeddingStore.close` (or ``with``, or garbage collection) closes them and drops the
maps, so a deleted version's disk space is freed."""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import stat
import time
import weakref
from pathlib import Path

import numpy as np

from rmm_jax.data.embed import packaged_id
from rmm_jax.data.store._format import FORMAT, VERSION
from rmm_jax.errors import InputError, at, check_int
from rmm_jax.persist.atomic import being_replaced


def _parse_row(line, path, ln: int, keys) -> dict:
    """One JSONL row (str or bytes) that must be an object holding ``keys``."""
    try:
        r = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg}", where=at(path, ln)) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start})", where=at(path, ln)) from None
    if not isinstance(r, dict):
        raise InputError("expected a JSON object", where=at(path, ln))
    for k in keys:
        if k not in r:
            raise InputError("missing key", where=at(path, ln, k))
    return r


_CHUNK = 1 << 20                     # bytes :meth:`_Files.lines` reads at a time


def _join(pieces: list) -> bytes:
    """``pieces`` as one bytes (the only copy :meth:`_Files.lines` makes of a line)."""
    return b"".join(pieces)


_NAMES = ("manifest.json", "users.json", "memories.npy", "queries.npy", "answers.npy", "memories.jsonl",
          "queries.jsonl")


def _close_fds(fds: dict) -> None:
    while fds:
        os.close(fds.popitem()[1])


class _Files:
    """The files of one version of a store, open: its directory (``"."``) and each of
    :data:`_NAMES` it holds, all opened relative to that directory in one go, so they are one
    version's whatever is renamed into place afterwards. Closed by :meth:`close` or when
    garbage collected."""

    def __init__(self, root: Path):
        self.root = root
        self.fds: dict[str, int] = {}
        self.closed = False
        self._finalizer = weakref.finalize(self, _close_fds, self.fds)

    def close(self) -> None:
        self.closed = True
        self._finalizer()

    def has(self, name: str) -> bool:
        return name in self.fds

    def fd(self, name: str) -> int:
        """The descriptor of file ``name``; an ``InputError`` naming it if the store lacks it
        (or naming the store once it is closed)."""
        if self.closed:
            raise InputError("the store is closed", where=str(self.root))
        if name not in self.fds:
            raise InputError("missing file of the embedding store", where=at(self.root / name))
        return self.fds[name]

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``start:end`` of file ``name`` (to its end without ``end``), by ``pread``: no
        file position is shared, so threads may read one store at once."""
        return _pread(self.fd(name), start, None if end is None else end - start)

    def lines(self, name: str):
        """The lines of file ``name`` (bytes, each with its newline), as iterating a file gives them."""
        pieces, pos, fd = [], 0, self.fd(name)         # pieces: the line read so far, joined once whole
        while chunk := os.pread(fd, _CHUNK, pos):
            pos += len(chunk)
            start = 0
            while (nl := chunk.find(b"\n", start)) >= 0:
                pieces.append(chunk[start:nl + 1])
                yield _join(pieces)
                pieces, start = [], nl + 1
            if start < len(chunk):
                pieces.append(chunk[start:])
        if pieces:
            yield _join(pieces)

    def identity(self) -> tuple[int, int]:
        st = os.fstat(self.fd("."))
        return st.st_dev, st.st_ino


def _replaced(root: Path, files: _Files) -> bool:
    """Whether ``root`` names another directory than the one ``files`` opened (a writer renamed
    a new store into place)."""
    try:
        st = os.stat(root)
    except OSError:
        return True
    return (st.st_dev, st.st_ino) != files.identity()


def _open_dir(root: Path, wait: float = 5.0) -> int:
    """A descriptor of directory ``root``. Where the system cannot swap two directories in one
    step, a writer renames the old store aside and then the new one in (:func:`atomic_dir`):
    a missing ``root`` whose writer is between the two is waited for (up to ``wait`` seconds)."""
    end = time.monotonic() + wait
    while True:
        try:
            return os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            if time.monotonic() > end or not being_replaced(root):
                raise
        time.sleep(0.01)


def _open_files(root: Path) -> _Files:
    """Open ``root`` and the store files it holds (a file that is not a regular file counts as
    missing). A file missing because a writer swapped a new store in and deleted the old one's
    files while they were being opened is opened again from the new one (a few tries)."""
    for attempt in range(8):
        files = _Files(root)
        try:
            files.fds["."] = _open_dir(root)
        except FileNotFoundError:
            raise InputError("no such embedding store (create one with `rmm-jax embed`)", where=at(root)) from None
        except NotADirectoryError:
            raise InputError("not an embedding store directory", where=at(root)) from None
        except OSError as e:
            raise InputError(f"cannot open ({e.strerror or e})", where=at(root)) from None
        missing = False
        for name in _NAMES:
            try:
                # O_NONBLOCK: a FIFO named like a store file would block the open (it is no regular file)
                fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0),
                             dir_fd=files.fds["."])
            except (FileNotFoundError, IsADirectoryError):
                missing = True
                continue
            except OSError as e:
                files.close()
                raise InputError(f"cannot open ({e.strerror or e})", where=at(root / name)) from None
            files.fds[name] = fd
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(files.fds.pop(name))
                missing = True
        if not (missing and _replaced(root, files)) or attempt == 7:
            return files
        files.close()


@dataclasses.dataclass(frozen=True)
class UserData:
    """One user's slice of a store.

    ``gold[i, j]`` is True when memory ``j`` holds a gold turn of query ``i``. A query
    counts for retrieval metrics when ``valid[i]``: at least one gold memory and not an
    abstention question.
    """
    user_id: str
    memory_emb: np.ndarray      # (n_m, d) float32
    query_emb: np.ndarray       # (n_q, d) float32
    gold: np.ndarray            # (n_q, n_m) bool
    memory_ids: tuple[str, ...]
    query_ids: tuple[str, ...]
    categories: tuple[str, ...]
    abstention: np.ndarray      # (n_q,) bool

    @property
    def num_gold(self) -> np.ndarray:
        return self.gold.sum(axis=1).astype(np.int32)

    @property
    def valid(self) -> np.ndarray:
        return (self.num_gold > 0) & ~self.abstention


class EmbeddingStore:
    """A validated store directory; use :func:`open_store`.

    A snapshot: it reads the version of the store it opened, through descriptors it holds
    (:class:`_Files`), whatever ``embed --into`` renames into place afterwards; :meth:`refresh`
    moves it to the version the path holds now. :meth:`close` (or leaving a ``with`` block, or
    garbage collection) closes its descriptors and drops its maps (``memory_emb``, ``query_emb``,
    ``answer_emb``: reading them afterwards is an ``InputError``); the rows it gave stay valid."""

    def __init__(self, path: Path, manifest: dict, users: list[dict], memory_emb, query_emb, answer_emb=None, *,
                 files: _Files, expect: tuple = (None, None)):
        self.path = path
        self._files = files
        self._expect = expect
        self.manifest = manifest
        self.dim = int(manifest["dim"])
        self.model = manifest["model"]
        self.granularity = manifest.get("granularity")
        self._users = users
        self._by_id = {u["id"]: u for u in users}
        self.user_ids = tuple(u["id"] for u in users)
        # the maps: dropped by close() and refresh(), so no map of a deleted version keeps its disk space
        self._maps = {"memories.npy": memory_emb, "queries.npy": query_emb, "answers.npy": answer_emb}
        self._mem_meta = None
        self._qry_meta = None
        self._offsets_cache: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        c = self.manifest["counts"]
        return (f"EmbeddingStore({str(self.path)!r}, model={self.model!r}, dim={self.dim}, "
                f"granularity={self.granularity!r}, users={c['users']}, "
                f"memories={c['memories']}, queries={c['queries']})")

    def _map(self, name: str):
        if self._files.closed:
            self._files.fd(name)                       # "the store is closed"
        return self._maps[name]

    @property
    def memory_emb(self) -> np.memmap:
        """(N_mem, d) float32, every user's memories, memory-mapped (read a user's with :meth:`user`)."""
        return self._map("memories.npy")

    @property
    def query_emb(self) -> np.memmap:
        """(N_q, d) float32, every user's questions, memory-mapped."""
        return self._map("queries.npy")

    @property
    def answer_emb(self) -> np.memmap | None:
        """(N_q, d) question + answer embeddings, memory-mapped, or None when the store holds none."""
        return self._map("answers.npy")

    def has_user(self, user_id) -> bool:
        return str(user_id) in self._by_id

    def close(self) -> None:
        """Close the store's files and drop its maps (reading a user or an array afterwards is an
        ``InputError``), so no descriptor or map of its files is left (an array taken from
        ``memory_emb`` and still held keeps its own). Rows read from it stay valid; garbage
        collection closes them too."""
        self._files.close()
        self._maps = dict.fromkeys(self._maps)

    def __enter__(self) -> "EmbeddingStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def refresh(self) -> bool:
        """Read the store the path holds now. The store is a snapshot of the version it opened,
        so after the nightly ``embed --into`` a long-lived one (a server's, beside its
        :class:`~rmm_jax.online.serve.Reranker`) still serves yesterday's memories: call this
        when that job ends (between requests: a read running meanwhile may see either). If
        another store was renamed into place, it is opened and validated as :func:`open_store`
        does (with the model and dim it was opened expecting), this object reads it from then
        on and the old one's files are closed. Returns whether it changed; when it did not, it
        cost one ``stat``."""
        if not _replaced(Path(self.path), self._files):
            return False
        new = open_store(self.path, *self._expect)
        old = self._files
        self.__dict__.update(new.__dict__)             # the old maps go with the old state
        old.close()
        return True

    @property
    def bank_sizes(self) -> dict[str, int]:
        """Number of memories of each user, without reading the metadata files."""
        return {u["id"]: u["mem_end"] - u["mem_start"] for u in self._users}

    def _jsonl(self, name: str, n: int, keys: tuple[str, ...]) -> list[dict]:
        p = self.path / name
        rows = []                         # bytes: a line that is not UTF-8 is _parse_row's one-line error
        for ln, line in enumerate(self._files.lines(name), 1):
            rows.append(_parse_row(line, p, ln, keys))
        if len(rows) != n:
            raise InputError(f"{len(rows)} rows but the manifest counts {n}", where=at(p))
        return rows

    def _line_offsets(self, name: str, n: int) -> np.ndarray:
        """Byte offset of every row of a JSONL file (plus the end): 8 bytes per row, so
        :meth:`user` reads one user's rows without holding every row in memory."""
        if name not in self._offsets_cache:
            offs, pos = [0], 0
            for line in self._files.lines(name):
                pos += len(line)
                offs.append(pos)
            if len(offs) - 1 != n:
                raise InputError(f"{len(offs) - 1} rows but the manifest counts {n}", where=at(self.path / name))
            self._offsets_cache[name] = np.asarray(offs, np.int64)
        return self._offsets_cache[name]

    def _row_slice(self, name: str, n: int, keys: tuple[str, ...], start: int, end: int) -> list[dict]:
        """Rows ``start:end`` of a JSONL file, validated like :meth:`_jsonl`."""
        offs = self._line_offsets(name, n)
        p = self.path / name
        blob = self._files.read(name, int(offs[start]), int(offs[end]))
        rows = []
        for i, line in enumerate(blob.splitlines(keepends=True)[:end - start]):
            ln = start + i + 1
            rows.append(_parse_row(line, p, ln, keys))
        return rows

    @property
    def memories(self) -> list[dict]:
        """Rows of ``memories.jsonl`` (parsed on first use)."""
        if self._mem_meta is None:
            self._mem_meta = self._jsonl("memories.jsonl", self.manifest["counts"]["memories"],
                                         ("user", "id", "text"))
        return self._mem_meta

    @property
    def queries(self) -> list[dict]:
        """Rows of ``queries.jsonl`` (parsed on first use)."""
        if self._qry_meta is None:
            self._qry_meta = self._jsonl("queries.jsonl", self.manifest["counts"]["queries"],
                                         ("user", "id", "text", "gold_memory_ids"))
        return self._qry_meta

    def query_count(self, user_id) -> int:
        """How many questions the store holds for one user (from ``users.json``; nothing read)."""
        u = self._by_id.get(str(user_id))
        if u is None:
            self.user(user_id)                         # the one-line error naming the store
        return u["query_end"] - u["query_start"]

    def _memory_slice(self, start: int, end: int) -> list[dict]:
        if self._mem_meta is not None:
            return self._mem_meta[start:end]
        return self._row_slice("memories.jsonl", self.manifest["counts"]["memories"], ("user", "id", "text"),
                               start, end)

    def _query_slice(self, start: int, end: int) -> list[dict]:
        if self._qry_meta is not None:
            return self._qry_meta[start:end]
        return self._row_slice("queries.jsonl", self.manifest["counts"]["queries"],
                               ("user", "id", "text", "gold_memory_ids"), start, end)

    def _user_entry(self, user_id) -> dict:
        """``user_id``'s row of users.json; ``InputError`` naming ``user_id`` unless it is a str
        (``user(0)`` said "unknown user id '0'" of a store whose ids are 'user0', ...), and one
        naming the store unless the store holds it."""
        if not isinstance(user_id, str):
            raise InputError(f"user ids are str, got {type(user_id).__name__} {user_id!r}"[:100], arg="user_id")
        if user_id not in self._by_id:
            shown = ", ".join(self.user_ids[:5]) + (" ..." if len(self.user_ids) > 5 else "")
            raise InputError(f"unknown user id {user_id!r} (store has {len(self.user_ids)} users: "
                             f"{shown})", where=str(self.path))
        return self._by_id[user_id]

    def memory_rows(self, user_id: str) -> list[dict]:
        """One user's rows of ``memories.jsonl`` (id, session, text, ...), in bank order."""
        u = self._user_entry(user_id)
        return self._memory_slice(u["mem_start"], u["mem_end"])

    def query_rows(self, user_id: str) -> list[dict]:
        """One user's rows of ``queries.jsonl`` (id, text, gold_memory_ids, ...), in store order:
        its questions without their embeddings or its memories (:meth:`user` reads them all)."""
        u = self._user_entry(user_id)
        return self._query_slice(u["query_start"], u["query_end"])

    def user(self, user_id: str) -> UserData:
        """One user's embeddings, gold matrix and ids. ``user_id`` is a str (an int is an
        ``InputError`` naming ``user_id``); one the store does not hold is one naming the store."""
        u = self._user_entry(user_id)
        uid = str(user_id)                             # a str subclass (np.str_) as the str it is
        ms, me, qs, qe = u["mem_start"], u["mem_end"], u["query_start"], u["query_end"]
        # Only this user's rows are read (unless the whole lists were loaded already).
        mems = self._memory_slice(ms, me)
        qrys = self._query_slice(qs, qe)
        qpath = self.path / "queries.jsonl"
        for off, r in enumerate(mems):
            if str(r["user"]) != uid:
                raise InputError(f"row belongs to user {r['user']!r}, users.json says {uid!r}",
                                 where=at(self.path / "memories.jsonl", ms + off + 1))
        mem_ids = tuple(str(r["id"]) for r in mems)
        col = {m: j for j, m in enumerate(mem_ids)}
        gold = np.zeros((len(qrys), len(mems)), bool)
        for i, r in enumerate(qrys):
            if str(r["user"]) != uid:
                raise InputError(f"row belongs to user {r['user']!r}, users.json says {uid!r}",
                                 where=at(qpath, qs + i + 1))
            g = r["gold_memory_ids"]
            if not isinstance(g, list):
                raise InputError("expected a list", where=at(qpath, qs + i + 1, "gold_memory_ids"))
            for m in g:
                if m not in col:
                    raise InputError(f"unknown memory id {m!r} for user {uid!r}",
                                     where=at(qpath, qs + i + 1, "gold_memory_ids"))
                gold[i, col[m]] = True
        return UserData(
            user_id=uid,
            memory_emb=read_rows(self.memory_emb, ms, me, self._files.fd("memories.npy")),
            query_emb=read_rows(self.query_emb, qs, qe, self._files.fd("queries.npy")),
            gold=gold,
            memory_ids=mem_ids,
            query_ids=tuple(str(r["id"]) for r in qrys),
            categories=tuple(str(r.get("category") or "") for r in qrys),
            abstention=np.array([bool(r.get("abstention", False)) for r in qrys], bool),
        )

    def user_answers(self, user_id) -> np.ndarray:
        """One user's question + answer embeddings (n_q, d), for the ``answer`` citation model.
        An unknown user is the one-line error of :meth:`user` (it was a KeyError)."""
        if self.answer_emb is None:
            raise InputError("store holds no answer embeddings; rebuild it with `rmm-jax embed ... --answers`",
                             where=str(self.path))
        u = self._user_entry(user_id)                  # the one-line error naming the store
        return read_rows(self.answer_emb, u["query_start"], u["query_end"], self._files.fd("answers.npy"))

    def iter_users(self):
        """Iterate over :class:`UserData` of every user, in store order."""
        for uid in self.user_ids:
            yield self.user(uid)


def read_rows(mm: np.memmap, start: int, end: int, fd: int | None = None) -> np.ndarray:
    """Rows ``start:end`` of a memory-mapped ``.npy`` array, read with ``pread`` from ``fd``
    (the open file it maps: a store's, :class:`_Files`), else from the file it names
    (``np.load(..., mmap_mode="r")``); a map of an open file names none (a store's arrays:
    read their rows with :meth:`EmbeddingStore.user`), so without ``fd`` it is an
    ``InputError`` naming ``fd``. An array that is no whole map (a slice or view of one, whose
    rows are not at the map's offsets) is sliced.

    Touching the memory map would make its pages resident in this process, so reading
    every user once would grow the RSS by the whole store; read pages stay in the
    kernel's page cache instead and memory stays bounded with the number of users.
    """
    if not isinstance(mm, np.memmap) or not isinstance(mm.base, mmap.mmap):
        return np.asarray(mm[start:end])
    if fd is None and mm.filename is None:
        raise InputError("a map of an open file names no file to read from: pass the descriptor it maps "
                         "(a store's rows: EmbeddingStore.user)", arg="fd")
    width = int(np.prod(mm.shape[1:], dtype=np.int64))
    row = width * mm.dtype.itemsize
    if fd is not None:
        buf = _pread(fd, mm.offset + start * row, (end - start) * row)
    else:
        with open(mm.filename, "rb") as f:
            buf = _pread(f.fileno(), mm.offset + start * row, (end - start) * row)
    return np.frombuffer(buf, mm.dtype).reshape((end - start,) + mm.shape[1:])


def _pread(fd: int, offset: int, size: int | None = None) -> bytes:
    """``size`` bytes of ``fd`` from ``offset`` (None: to its end; fewer where the file ends),
    by ``pread`` calls of at most 1 GiB: one call returns at most about 2 GiB on Linux, and
    may return less than asked."""
    parts, pos = [], offset
    while size is None or pos < offset + size:
        chunk = os.pread(fd, 1 << 30 if size is None else min(1 << 30, offset + size - pos), pos)
        if not chunk:
            break
        parts.append(chunk)
        pos += len(chunk)
    return b"".join(parts)


def _map_npy(fd: int) -> np.memmap:
    """The ``.npy`` array of open file ``fd`` mapped read-only (the map holds the file, not its
    name); ``ValueError`` unless it is a C-order ``.npy`` file as long as its header says."""
    fmt = np.lib.format
    with open(fd, "rb", closefd=False) as f:
        f.seek(0)
        version = fmt.read_magic(f)
        header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
        if header is None:
            raise ValueError(f"unsupported .npy format version {version}")
        shape, fortran, dtype = header(f)
        if fortran and len(shape) > 1:
            raise ValueError("stored in Fortran order")
        return np.memmap(f, dtype=dtype, mode="r", offset=f.tell(), shape=shape)


def _load_npy(files: _Files, name: str, rows: int, dim: int, what: str):
    path = files.root / name
    fd = files.fd(name)
    try:
        arr = _map_npy(fd)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise InputError(f"not a readable .npy array ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})",
                         where=at(path)) from None
    if arr.dtype != np.float32:
        raise InputError(f"dtype {arr.dtype}, expected float32", where=at(path))
    if arr.shape != (rows, dim):
        raise InputError(f"shape {arr.shape} does not match the manifest ({rows} {what}, dim {dim})",
                         where=at(path))
    step = max(1, (1 << 24) // max(dim, 1))
    for s in range(0, rows, step):
        block = read_rows(arr, s, min(rows, s + step), fd)
        ok = np.isfinite(block).all(axis=1)
        if not ok.all():
            bad = s + int(np.flatnonzero(~ok)[0])
            raise InputError(f"NaN/Inf in the embeddings (row {bad}, and maybe others); "
                             f"re-run `rmm-jax embed`", where=at(path))
    return arr


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _json_file(files: _Files, name: str, cannot: str):
    """A store's JSON file parsed; an error names it (and the line), ``cannot`` worded for an
    unreadable one."""
    path = files.root / name
    try:
        return json.loads(files.read(name).decode("utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON: {e.msg}", where=at(path, e.lineno)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{cannot} ({e})", where=at(path)) from None


def _manifest(path):
    """The parsed ``manifest.json`` of directory ``path``, or None where it holds no readable one (a
    FIFO of that name is none: opened without blocking, then checked to be a regular file)."""
    try:
        fd = os.open(Path(path) / "manifest.json",
                     os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with open(fd, "rb") as f:
        try:
            return json.loads(f.read().decode("utf-8")) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        except (OSError, UnicodeDecodeError, ValueError):
            return None


def is_store(path) -> bool:
    """Whether directory ``path`` holds an embedding store: a ``manifest.json`` of this format
    (any version, valid or not). ``embed --out`` replaces only such a directory (or an empty
    one): anything else there, a policy store or someone's files, is not its to delete."""
    manifest = _manifest(path)
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def store_counts(path) -> dict | None:
    """The ``counts`` the manifest of the store at ``path`` records (``users``, ``memories``,
    ``queries``), read without opening the store: what ``embed --out`` says it replaced. None
    when there is no readable manifest or it records no counts."""
    manifest = _manifest(path)
    counts = manifest.get("counts") if isinstance(manifest, dict) else None
    if not isinstance(counts, dict) or not all(_nonneg_int(counts.get(k)) for k in ("users", "memories")):
        return None
    return counts


def open_store(path, expect_model: str | None = None, expect_dim: int | None = None) -> EmbeddingStore:
    """Open and validate an embedding store.

    Checks: the manifest exists and parses, its format and version, that the arrays are
    float32 with the manifest's counts and dim, finite values, that ``users.json``
    tiles the rows, and optionally the model and dim the caller expects. Every failure
    is an :class:`InputError` naming the file (or the store and the mismatch).

    The store it returns is a snapshot of the version ``path`` held when it was opened (the
    module's docstring): it keeps reading it while ``embed --into`` grows the store, and
    opening during an append gives the old store or the new one, never a mix.
    :meth:`EmbeddingStore.refresh` moves to the new one.
    """
    # by name: None was Path's TypeError, expect_dim="abc" int()'s ValueError (after the manifest)
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"expected the store's directory (a str or Path), got {type(path).__name__} {path!r}"[:100],
                         arg="path")
    if expect_dim is not None:
        check_int(expect_dim, "expect_dim", 1, note=" or None", shown=lambda x: f"{type(x).__name__} {x!r}", cut=80,
                  where=True)
    root = Path(path)
    files = _open_files(root)                 # every file now: the version this store reads
    try:
        return _validate(root, files, expect_model, expect_dim)
    except BaseException:
        files.close()
        raise


def _validate(root: Path, files: _Files, expect_model: str | None, expect_dim: int | None) -> EmbeddingStore:
    """:func:`open_store`'s checks, on the files ``files`` opened."""
    mpath = root / "manifest.json"
    if not files.has("manifest.json"):
        raise InputError("missing manifest.json: not an embedding store (or an incomplete one)",
                         where=at(root))
    manifest = _json_file(files, "manifest.json", "cannot read manifest")
    if not isinstance(manifest, dict):
        raise InputError("expected a JSON object", where=at(mpath))
    if manifest.get("format") != FORMAT:
        raise InputError(f"format {manifest.get('format')!r}, expected {FORMAT!r}",
                         where=at(mpath, key="format"))
    if manifest.get("version") != VERSION:
        raise InputError(f"unsupported store version {manifest.get('version')!r} (this rmm-jax "
                         f"reads version {VERSION})", where=at(mpath, key="version"))
    for key in ("model", "dim", "counts"):
        if key not in manifest:
            raise InputError("missing key", where=at(mpath, key=key))
    dim = manifest["dim"]
    if not _nonneg_int(dim) or dim == 0:
        raise InputError(f"dim must be a positive integer, got {dim!r}", where=at(mpath, key="dim"))
    counts = manifest["counts"]
    if not isinstance(counts, dict):
        raise InputError("expected an object", where=at(mpath, key="counts"))
    for key in ("users", "memories", "queries"):
        if not _nonneg_int(counts.get(key)):
            raise InputError(f"expected a non-negative integer, got {counts.get(key)!r}",
                             where=at(mpath, key=f"counts.{key}"))
    if expect_model is not None and manifest["model"] not in (expect_model, packaged_id(expect_model)):
        raise InputError(f"store was embedded with model {manifest['model']!r}, expected "
                         f"{expect_model!r}", where=at(root))
    if expect_dim is not None and dim != int(expect_dim):
        raise InputError(f"store has embedding dim {dim}, expected {expect_dim}", where=at(root))

    upath = root / "users.json"
    users = _json_file(files, "users.json", "cannot read")
    if not isinstance(users, list) or len(users) != counts["users"]:
        raise InputError(f"expected a list of {counts['users']} users", where=at(upath))
    m_end = q_end = 0
    seen = set()
    for i, u in enumerate(users):
        if not isinstance(u, dict):
            raise InputError("expected an object", where=at(upath, key=f"[{i}]"))
        for key in ("id", "mem_start", "mem_end", "query_start", "query_end"):
            if key not in u:
                raise InputError("missing key", where=at(upath, key=f"[{i}].{key}"))
        u["id"] = str(u["id"])
        if u["id"] in seen:
            raise InputError(f"duplicate user id {u['id']!r}", where=at(upath, key=f"[{i}].id"))
        seen.add(u["id"])
        if (u["mem_start"] != m_end or u["query_start"] != q_end
                or not _nonneg_int(u["mem_end"]) or not _nonneg_int(u["query_end"])
                or u["mem_end"] < u["mem_start"] or u["query_end"] < u["query_start"]):
            raise InputError("row ranges do not tile the arrays in order",
                             where=at(upath, key=f"[{i}]"))
        m_end, q_end = u["mem_end"], u["query_end"]
    if m_end != counts["memories"] or q_end != counts["queries"]:
        raise InputError(f"users cover {m_end} memories / {q_end} queries, the manifest counts "
                         f"{counts['memories']} / {counts['queries']}", where=at(upath))

    mem = _load_npy(files, "memories.npy", counts["memories"], dim, "memories")
    qry = _load_npy(files, "queries.npy", counts["queries"], dim, "queries")
    ans = _load_npy(files, "answers.npy", counts["queries"], dim, "answers") if manifest.get("answers") else None
    return EmbeddingStore(root, manifest, users, mem, qry, ans, files=files, expect=(expect_model, expect_dim))
