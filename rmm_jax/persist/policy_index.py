"""The policy store's index in SQLite: which saved versions each user has, and where.

``STORE/index.sqlite`` answers "where are ``user_id``'s versions?" with one indexed
lookup, and a save of U users changes O(U) rows in one transaction, however many users
the store holds. It replaced ``index.json`` (one JSON object for all users, parsed by
every load and rewritten by every save; :mod:`rmm_jax.persist.policy_store` still reads
and migrates it, :mod:`rmm_jax.persist.policy_format1`). SQLite is the stdlib's
transactional engine: no server, one file, crash-safe commits, many concurrent readers.

Schema (``kv['schema'] == 2``)::

    kv(key TEXT PRIMARY KEY, value)                 'schema' -> 2, 'next_version' -> int,
                                                     'next_shared' -> int (absent: none recorded)
    versions(version INTEGER PRIMARY KEY, saved_at, shared_version)
                                                     every snapshot some user still keeps
    entries(user, version, chunk, row)               PRIMARY KEY (user, version), WITHOUT ROWID
      + INDEX entries_by_version(version)            (garbage collection, users of a save)

``saved_at`` and ``shared_version`` (the shared version the save's users were trained
against; NULL if none was recorded) are per save, so they live once in ``versions``, not
in each entry. The shared versions still referenced (:meth:`PolicyIndex.shared_refs`) are
what the store may not prune. :meth:`PolicyIndex.commit_version` records one saved version
in ONE transaction: the new entries, the trim of every saved user to its newest ``keep``
versions, and the versions that no entry references any more (returned, so the caller
deletes their directories after the commit). The caller commits only after the snapshot
directory is in place, so a kill leaves the index at the old state or the new one, never
between. Schema 1 (no ``shared_version``) is read as NULLs and upgraded in place by the
first writer that opens it (one ``ALTER TABLE`` transaction).

Concurrency: the store's one writer holds its flock (:mod:`rmm_jax.persist.lock`); the
database uses SQLite's rollback journal (``journal_mode = DELETE``), so readers (opened
``mode=ro``, no lock) see the last committed state, wait at most ``BUSY_TIMEOUT_S`` while
a commit is being written, and create no file: reading a store leaves it byte for byte
as it was (WAL mode would make every reader create ``-wal``/``-shm`` side files). A writer
killed inside a commit leaves a hot journal, which a read-only connection may not roll
back: a reader then reads a rolled-back private copy (:meth:`PolicyIndex._committed_copy`,
the last commit), until the next writer rolls the journal back in place. A
missing, corrupt or unopenable database raises :class:`IndexUnavailable`; the store then
rebuilds the index from the snapshots (:meth:`PolicyIndex.build`: in memory for a reader,
to the file for the writer).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

from rmm_jax.errors import Busy
from rmm_jax.persist.atomic import process_umask

SCHEMA = 2
READS_SCHEMAS = (1, 2)
BUSY_TIMEOUT_S = 30.0
_DDL = (
    "CREATE TABLE kv(key TEXT PRIMARY KEY, value) WITHOUT ROWID",
    "CREATE TABLE versions(version INTEGER PRIMARY KEY, saved_at TEXT, shared_version INTEGER)",
    "CREATE TABLE entries(user TEXT NOT NULL, version INTEGER NOT NULL, chunk INTEGER NOT NULL, "
    "row INTEGER NOT NULL, PRIMARY KEY (user, version)) WITHOUT ROWID",
    "CREATE INDEX entries_by_version ON entries(version)",
)
# entries of users beyond their newest :keep versions (restricted to the users in temp.touched)
_BEYOND_KEEP = """
    SELECT user, version FROM (
        SELECT user, version, ROW_NUMBER() OVER (PARTITION BY user ORDER BY version DESC) AS rn
        FROM entries WHERE user IN (SELECT user FROM temp.touched))
    WHERE rn > :keep"""
_BUSY = ("SQLITE_BUSY", "SQLITE_LOCKED")
QUERY_USERS = 500  # users per IN (...) lookup, well under SQLite's bound-parameter limit


class Entry(NamedTuple):
    """One saved version of one user: snapshot ``version``, chunk number, row in the chunk,
    when it was saved and the shared version it was trained against (None: not recorded)."""

    version: int
    chunk: int
    row: int
    saved_at: str | None
    shared_version: int | None = None


class Save(NamedTuple):
    """One live saved version: when, against which shared version, how many users keep it."""

    version: int
    saved_at: str | None
    shared_version: int | None
    users: int


class IndexUnavailable(Exception):
    """The index is missing, corrupt or cannot be opened; rebuild it from the snapshots."""


class HotJournal(IndexUnavailable):
    """An open read-only connection met a writer's hot journal (killed inside a commit): open
    the index again (:meth:`PolicyIndex.open` reads a rolled-back copy), do not rebuild it from
    the snapshots, which hold the killed commit's."""


def sidecar_files(path: Path) -> list[Path]:
    """SQLite's side files of database ``path`` (WAL, shared memory, rollback journal)."""
    return [path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal")]


def remove_database(path: Path) -> None:
    """Delete database ``path`` and its side files. A stale ``-wal`` next to a new file of
    the same name would be replayed into it, so they go together."""
    for p in [path, *sidecar_files(path)]:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _stamp(path: Path) -> list:
    """(mtime, size) of database ``path`` and of its rollback journal (None: absent)."""
    out = []
    for p in (path, sidecar_files(path)[2]):
        try:
            st = p.stat()
        except FileNotFoundError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size))
    return out


class PolicyIndex:
    """A connection to a policy-store index (see the module docstring). Use as a context
    manager or call :meth:`close`."""

    def __init__(self, conn: sqlite3.Connection, where: str):
        self._conn = conn
        self.where = where
        self._sv = "v.shared_version"    # "NULL" on a read-only schema-1 index (no such column)
        self._copy: tempfile.TemporaryDirectory | None = None   # _committed_copy's directory
        self._copied: list | None = None       # the original's files' (mtime, size) when copied

    # ---- open / create / build

    @classmethod
    def open(cls, path: str | os.PathLike, *, readonly: bool = True, any_thread: bool = False) -> "PolicyIndex":
        """Open an existing index file; :class:`IndexUnavailable` if it is missing, not
        an index of this schema, or cannot be opened. ``any_thread``: another thread may use
        or close it (the caller makes sure no two threads use it at once)."""
        path = Path(path)
        if not path.is_file():
            raise IndexUnavailable(f"{path}: missing")
        uri = path.resolve().as_uri() + ("?mode=ro" if readonly else "?mode=rw")
        for _ in range(5):          # a hot journal a writer rolls back meanwhile: the original, again
            try:
                conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=not any_thread)
            except sqlite3.Error as e:
                raise IndexUnavailable(f"{path}: cannot open ({e})") from None
            idx = cls(conn, str(path))
            if not readonly:
                return cls._checked(idx, path, readonly)
            try:
                conn.execute("SELECT value FROM kv WHERE key = 'schema'").fetchall()
                return cls._checked(idx, path, readonly)
            except sqlite3.Error as e:
                idx.close()
                err = idx._error(e)
                if not isinstance(err, HotJournal):
                    raise err from None
            copy = cls._committed_copy(path.resolve(), any_thread)      # the journal is beside the real file
            if copy is not None:
                return cls._checked(copy, path, readonly)
        raise IndexUnavailable(f"{path}: the journal of an interrupted commit kept changing while it was read")

    @classmethod
    def _committed_copy(cls, path: Path, any_thread: bool) -> "PolicyIndex | None":
        """A reader's view of an index whose writer was killed inside a commit: SQLite left a
        hot rollback journal, which a read-only connection may not roll back
        (``SQLITE_READONLY_ROLLBACK``). The database and its journal are copied to a private
        directory and opened there, where SQLite rolls the journal back: the last committed
        state, read without touching the store (its next writer rolls the journal back in
        place). Before, the reader rebuilt the index from the snapshot directories, which
        hold the killed commit's snapshot too: a replay run again counted that version's
        calls as learned, and its writer then dropped the version, so they were learned again.
        A copy taken while the files changed is never used: the journal gone, or the files
        changed while copied, a writer has rolled it back meanwhile, and None says to open the
        original again."""
        tmp = tempfile.TemporaryDirectory(prefix="rmm-index-")
        journal, db = sidecar_files(path)[2], Path(tmp.name) / path.name
        stamp = _stamp(path)
        try:
            if stamp[1] is not None:
                shutil.copyfile(path, db)
                shutil.copyfile(journal, sidecar_files(db)[2])
                if stamp == _stamp(path):
                    idx = cls(sqlite3.connect(str(db), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                              check_same_thread=not any_thread), str(path))
                    idx._copy, idx._copied = tmp, stamp
                    return idx
        except FileNotFoundError:           # the journal went while copied: rolled back
            pass
        except (OSError, sqlite3.Error) as e:
            tmp.cleanup()
            raise IndexUnavailable(f"{path}: cannot read past its interrupted commit ({e})") from None
        tmp.cleanup()
        return None

    def stale(self) -> bool:
        """Whether this is a :meth:`_committed_copy` whose original has changed since (its
        writer rolled the journal back and committed): a reader must open it again, or it would
        go on reading the state of the kill."""
        return self._copy is not None and _stamp(Path(self.where)) != self._copied

    @classmethod
    def _checked(cls, idx: "PolicyIndex", path: Path, readonly: bool) -> "PolicyIndex":
        """``idx`` once its schema is one this version reads (a writer upgrades schema 1)."""
        conn = idx._conn
        try:
            schema = idx._one("SELECT value FROM kv WHERE key = 'schema'")
            if schema not in READS_SCHEMAS:
                raise IndexUnavailable(f"{path}: schema {schema!r}, expected one of {READS_SCHEMAS}")
            if not readonly:
                idx._run("PRAGMA synchronous = FULL")
                if schema == 1:
                    with idx._transaction():
                        conn.execute("ALTER TABLE versions ADD COLUMN shared_version INTEGER")
                        conn.execute("UPDATE kv SET value = ? WHERE key = 'schema'", (SCHEMA,))
                    schema = SCHEMA
            if schema == 1:
                idx._sv = "NULL"
        except BaseException:
            idx.close()
            raise
        return idx

    @classmethod
    def create(cls, path: str | os.PathLike | None = None, *, next_version: int = 1) -> "PolicyIndex":
        """A new empty index at ``path`` (which must not exist), or in memory if None."""
        if path is None:
            conn = sqlite3.connect(":memory:", isolation_level=None)
            where = ":memory:"
        else:
            path = Path(path)
            if path.exists():
                raise FileExistsError(str(path))
            conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
            os.chmod(path, 0o666 & ~process_umask())          # SQLite creates 0644 whatever the umask
            conn.execute("PRAGMA journal_mode = DELETE")
            conn.execute("PRAGMA synchronous = FULL")
            where = str(path)
        idx = cls(conn, where)
        with idx._transaction():
            for stmt in _DDL:
                conn.execute(stmt)
            conn.executemany("INSERT INTO kv VALUES (?, ?)", [("schema", SCHEMA), ("next_version", next_version)])
        return idx

    @classmethod
    def build(cls, path: str | os.PathLike | None,
              records: Iterable[tuple[str, int, int, int, str | None, int | None]],
              *, keep: int, next_version: int = 1) -> "PolicyIndex":
        """A new index holding ``records`` ``(user, version, chunk, row, saved_at,
        shared_version)``, each user trimmed to its newest ``keep`` versions; versions nobody
        keeps are left out (a version's saved_at and shared_version: its first record's).
        ``next_version`` is raised above the newest version seen. With a ``path`` the
        file is written beside it and renamed into place (old file and side files go)."""
        if path is None:
            return cls._fill(cls.create(None), records, keep, next_version)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        remove_database(tmp)
        try:
            cls._fill(cls.create(tmp), records, keep, next_version).close()
            remove_database(path)
            os.replace(tmp, path)
        finally:
            remove_database(tmp)
        return cls.open(path, readonly=False)

    @classmethod
    def _fill(cls, idx: "PolicyIndex", records, keep: int, next_version: int) -> "PolicyIndex":
        c = idx._conn
        with idx._transaction():
            c.execute("CREATE TEMP TABLE IF NOT EXISTS touched(user TEXT PRIMARY KEY) WITHOUT ROWID")
            saved: dict[int, tuple] = {}

            def rows():
                for user, version, chunk, row, saved_at, shared in records:
                    saved.setdefault(int(version), (saved_at, None if shared is None else int(shared)))
                    yield str(user), int(version), int(chunk), int(row)

            c.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)", rows())
            c.executemany("INSERT INTO versions VALUES (?, ?, ?)", [(v, *x) for v, x in sorted(saved.items())])
            c.execute("INSERT INTO temp.touched SELECT DISTINCT user FROM entries")
            c.execute(f"DELETE FROM entries WHERE (user, version) IN ({_BEYOND_KEEP})", {"keep": keep})
            c.execute("DELETE FROM versions WHERE version NOT IN (SELECT version FROM entries)")
            c.execute("DELETE FROM temp.touched")
            top = max(saved, default=0)
            c.execute("UPDATE kv SET value = ? WHERE key = 'next_version'", (max(int(next_version), top + 1),))
        return idx

    def close(self) -> None:
        self._conn.close()
        if self._copy is not None:
            self._copy.cleanup()
            self._copy = None

    def __enter__(self) -> "PolicyIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- queries

    def _run(self, sql: str, params=()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, params)
        except sqlite3.Error as e:
            raise self._error(e) from None

    def _all(self, sql: str, params=()) -> list[tuple]:
        try:
            return self._run(sql, params).fetchall()
        except sqlite3.Error as e:
            raise self._error(e) from None

    def _one(self, sql: str, params=()):
        rows = self._all(sql, params)
        return rows[0][0] if rows else None

    def _error(self, e: sqlite3.Error) -> Exception:
        """Busy after the timeout: a one-line :class:`~rmm_jax.errors.Busy` (the CLI exits 75:
        retry). Anything else: the file is not a usable index (corrupt, truncated, other schema)."""
        name = getattr(e, "sqlite_errorname", "")
        if name in _BUSY:
            return Busy(f"policy index is busy for more than {BUSY_TIMEOUT_S:.0f} s ({e}); retry when its "
                        "writer ends", where=self.where)
        if name == "SQLITE_READONLY_ROLLBACK":
            return HotJournal(f"{self.where}: {type(e).__name__}: {e}")
        return IndexUnavailable(f"{self.where}: {type(e).__name__}: {e}")

    @contextlib.contextmanager
    def _transaction(self):
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise self._error(e) from None
        try:
            yield
            self._conn.execute("COMMIT")
        except BaseException as e:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            if isinstance(e, sqlite3.Error):
                raise self._error(e) from None
            raise

    def _select(self) -> str:
        return (f"SELECT e.user, e.version, e.chunk, e.row, v.saved_at, {self._sv} "
                "FROM entries e JOIN versions v USING (version)")

    def entries(self, users: Sequence[str]) -> dict[str, list[Entry]]:
        """Each of ``users``' entries, oldest first ([] if unknown): one indexed query per
        :data:`QUERY_USERS` users."""
        if isinstance(users, str):
            raise TypeError("entries() takes a sequence of user ids, not one string")
        users = list(dict.fromkeys(users))
        out: dict[str, list[Entry]] = {u: [] for u in users}
        for lo in range(0, len(users), QUERY_USERS):
            part = users[lo:lo + QUERY_USERS]
            rows = self._all(f"{self._select()} WHERE e.user IN ({','.join('?' * len(part))}) "
                             "ORDER BY e.user, e.version", part)
            for r in rows:
                out[r[0]].append(Entry(*r[1:]))
        return out

    def all_entries(self) -> Iterator[tuple[str, Entry]]:
        """``(user, entry)`` for every entry, by user then version (streamed)."""
        cur = self._run(f"{self._select()} ORDER BY e.user, e.version")
        try:
            for r in cur:
                yield r[0], Entry(*r[1:])
        except sqlite3.Error as e:
            raise self._error(e) from None

    def has_user(self, user: str) -> bool:
        return self._one("SELECT 1 FROM entries WHERE user = ? LIMIT 1", (user,)) is not None

    def users(self) -> list[str]:
        """Every user with an entry, sorted."""
        return [r[0] for r in self._all("SELECT DISTINCT user FROM entries ORDER BY user")]

    def n_users(self) -> int:
        return int(self._one("SELECT COUNT(DISTINCT user) FROM entries"))

    def live_versions(self) -> list[int]:
        """Versions some user still keeps, ascending."""
        return [r[0] for r in self._all("SELECT version FROM versions ORDER BY version")]

    def saves(self) -> list[Save]:
        """Every live version with its saved_at, shared version and number of users, ascending."""
        return [Save(*r) for r in self._all(
            f"SELECT v.version, v.saved_at, {self._sv}, (SELECT COUNT(*) FROM entries e WHERE e.version = v.version) "
            "FROM versions v ORDER BY v.version")]

    def shared_refs(self) -> set[int]:
        """The shared versions some live user version was trained against (never pruned)."""
        return {r[0] for r in self._all(f"SELECT DISTINCT {self._sv} FROM versions v") if r[0] is not None}

    def last_shared(self) -> int | None:
        """The shared version the newest live user version was trained against (None: none
        recorded, or no user version)."""
        return self._one(f"SELECT {self._sv} FROM versions v ORDER BY v.version DESC LIMIT 1")

    def newest_version(self) -> int | None:
        """The newest live user version (None: none). It changes with every save (no number
        is handed out twice), not always with a rollback: undoing the newest run brings it
        back to what it was before that run."""
        return self._one("SELECT MAX(version) FROM versions")

    def version_users(self, version: int) -> int:
        """How many users keep ``version`` (an indexed count)."""
        return int(self._one("SELECT COUNT(*) FROM entries WHERE version = ?", (version,)))

    def next_version(self) -> int:
        return int(self._one("SELECT value FROM kv WHERE key = 'next_version'"))

    def reserve(self, version: int) -> None:
        """Raise next_version to at least ``version`` (never lower it): a number once
        handed out is not handed out again, even when the snapshot that took it is removed."""
        with self._transaction():
            self._conn.execute("UPDATE kv SET value = MAX(value, ?) WHERE key = 'next_version'", (int(version),))

    def next_shared(self) -> int:
        """The lowest number the next shared version may take: above every shared version
        saved since this was recorded, rolled back or not (1: none recorded, as in an index
        an older rmm-jax wrote, or one rebuilt from the snapshots)."""
        return int(self._one("SELECT COALESCE((SELECT value FROM kv WHERE key = 'next_shared'), 1)"))

    def reserve_shared(self, version: int) -> None:
        """Raise next_shared to at least ``version`` (never lower it), as :meth:`reserve` does
        for user versions: a shared version number once handed out is not handed out again
        after a rollback deletes its snapshot, so a served line's ``shared_version`` names one
        shared part."""
        with self._transaction():
            self._conn.execute("INSERT INTO kv VALUES ('next_shared', ?) ON CONFLICT(key) DO UPDATE "
                               "SET value = MAX(value, excluded.value)", (int(version),))

    def users_above(self, version: int) -> list[tuple[str, int | None]]:
        """``(user, its newest version at or below version)`` (None: it has none) for every
        user with a version above ``version``, sorted by user: who a rollback to ``version``
        moves (:mod:`rmm_jax.persist.policy_rollback`)."""
        return self._all("SELECT user, MAX(CASE WHEN version <= :v THEN version END) FROM entries "
                         "GROUP BY user HAVING MAX(version) > :v ORDER BY user", {"v": int(version)})

    # ---- the one write

    def commit_version(self, version: int, saved_at: str, placed: Iterable[tuple[str, int, int]], *,
                       keep: int, shared_version: int | None = None) -> list[int]:
        """Record saved ``version`` holding ``placed`` ``(user, chunk, row)``, trained
        against ``shared_version``, in one transaction: add the entries, keep each of these
        users' newest ``keep``, drop the versions nobody keeps any more, set next_version.
        Returns the dropped versions."""
        if version < self.next_version():
            raise ValueError(f"version {version} is below next_version {self.next_version()}")
        c = self._conn
        with self._transaction():
            c.execute("CREATE TEMP TABLE IF NOT EXISTS touched(user TEXT PRIMARY KEY) WITHOUT ROWID")
            c.execute("INSERT INTO versions VALUES (?, ?, ?)", (version, saved_at, shared_version))
            c.executemany("INSERT INTO entries VALUES (?, ?, ?, ?)",
                          ((u, version, int(ch), int(r)) for u, ch, r in placed))
            c.execute("INSERT INTO temp.touched SELECT user FROM entries WHERE version = ?", (version,))
            doomed = c.execute(f"SELECT DISTINCT version FROM ({_BEYOND_KEEP})", {"keep": keep}).fetchall()
            c.execute(f"DELETE FROM entries WHERE (user, version) IN ({_BEYOND_KEEP})", {"keep": keep})
            dead = [v for (v,) in doomed
                    if c.execute("SELECT 1 FROM entries WHERE version = ? LIMIT 1", (v,)).fetchone() is None]
            c.executemany("DELETE FROM versions WHERE version = ?", [(v,) for v in dead])
            c.execute("DELETE FROM temp.touched")
            c.execute("UPDATE kv SET value = ? WHERE key = 'next_version'", (version + 1,))
        return sorted(dead)

    def drop_above(self, version: int) -> list[int]:
        """Forget every user version above ``version`` in one transaction (a rollback):
        their entries and their rows in ``versions``. next_version is kept, so no number is
        handed out twice. Returns the versions forgotten, ascending."""
        c = self._conn
        with self._transaction():
            gone = [v for (v,) in c.execute("SELECT version FROM versions WHERE version > ? ORDER BY version",
                                            (int(version),))]
            c.execute("DELETE FROM entries WHERE version > ?", (int(version),))
            c.execute("DELETE FROM versions WHERE version > ?", (int(version),))
        return gone
