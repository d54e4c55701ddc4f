"""The store on PostgreSQL (``--db postgresql://user@host:port/dbname``), for servers on
several machines sharing one database. Imported only for such a URL (psycopg with it).

Plugins use it as they use SQLite: :meth:`PostgresStore.transaction` yields an adapter
whose ``execute``/``executemany`` take the same SQLite-dialect statements and ``?``
arguments (translated by :mod:`.dbdialect`) and return a cursor with ``fetchone``,
``fetchall`` and ``rowcount``. ``BYTEA`` values come back as ``bytes``, ``BIGINT`` as
``int``, ``DOUBLE PRECISION`` as ``float`` (``SUM`` of integers as ``Decimal``).

Locking. SQLite's ``BEGIN IMMEDIATE`` takes the database's one write lock, so writers
(every server on the file) run one at a time and each sees what the previous committed.
Here each write transaction takes one transaction-scoped advisory lock
(``pg_advisory_xact_lock(LOCK_KEY)``, the same key for every millm on the database) as its
first statement, at READ COMMITTED: writers still run one at a time, every statement
after the lock sees every earlier writer's commit, and the lock goes with the commit or
rollback. A read-modify-write in one transaction (steering's versioned state, a batch
line's exactly-once record) is therefore as safe as on SQLite. Waiting for the lock is
bounded by ``lock_timeout`` (the store's wait, ``BUSY_TIMEOUT_S`` for a request, longer at
start-up); past it PostgreSQL answers ``lock_not_available`` and the call raises
:class:`~.errors.DatabaseBusy` (503 ``database_busy``), as SQLite's SQLITE_BUSY does; so do
a deadlock, a serialization failure and a connection lost (the next call reconnects).

Reads use their own autocommit connection: each query sees what was committed when it
started and waits for no writer (MVCC); it waits only behind a migration's DDL, at most
``BUSY_TIMEOUT_S``. Migrations run in one write transaction under the same lock: two
servers starting at once on an empty database migrate one after the other, the second
finding nothing left to run.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, cast

import psycopg
import structlog
from psycopg import pq

from .dbdialect import redact, translate
from .errors import DatabaseBusy, InvalidRequest
from .store import BUSY_TIMEOUT_S, RETRY_AFTER_S, STARTUP_WAIT_S, Store

log = structlog.get_logger("millm.store")

LOCK_KEY = int.from_bytes(b"millm_db", "big")
"""The advisory lock every write transaction takes (one per database, every server)."""
# SQLSTATE classes of a connection lost: connection exceptions, an administrator's or a
# crash's shutdown, an idle session's timeout.
_LOST_STATES = ("08", "57P01", "57P02", "57P03", "57P05")
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3
TCP_USER_TIMEOUT_MS = 60_000
STATEMENT_TIMEOUT_MS = 60_000
IDLE_IN_TRANSACTION_MS = 60_000
RECONNECT_TIMEOUT_S = 3.0
_BUSY_STATES = {
    "55P03",  # lock_not_available: lock_timeout passed
    "40P01",  # deadlock_detected
    "40001",  # serialization_failure
}


class PgConnection:
    """What a plugin's write gets inside :meth:`PostgresStore.transaction`: the subset of
    ``sqlite3.Connection`` the plugins use, on SQLite-dialect SQL."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, parameters: Sequence[object] = ()) -> psycopg.Cursor[Any]:
        cursor = self._conn.cursor()
        for statement in translate(sql):
            cursor.execute(statement, tuple(parameters))
        return cursor

    def executemany(self, sql: str, seq_of_parameters: Iterable[Sequence[object]]) -> psycopg.Cursor[Any]:
        (statement,) = translate(sql)
        cursor = self._conn.cursor()
        cursor.executemany(statement, [tuple(p) for p in seq_of_parameters])
        return cursor


class PostgresStore(Store):
    """A PostgreSQL database at ``url`` (``postgresql://`` or ``postgres://``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._shown = redact(path)
        self._closed = False
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._pg = self._connect()
        self._pg_reader = self._connect(lock_timeout=BUSY_TIMEOUT_S)
        with self.transaction(wait=STARTUP_WAIT_S) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS migrations (namespace TEXT PRIMARY KEY, version INTEGER NOT NULL)")

    def _connect(self, lock_timeout: float | None = None, connect_timeout: float = STARTUP_WAIT_S) -> psycopg.Connection[Any]:
        if self._closed:
            raise DatabaseBusy("the database connection is closed (the server is stopping)", headers={"Retry-After": str(RETRY_AFTER_S)})
        # No prepared statements: another server's migration may change a table under them.
        # TCP keepalives and timeouts bound what a partition costs: a dead peer is noticed
        # within about a minute (and its advisory lock released by the server), a statement
        # or an open transaction never hangs the store's threads for longer.
        conn = psycopg.connect(
            self.path,
            autocommit=True,
            prepare_threshold=None,
            connect_timeout=max(1, int(connect_timeout)),
            keepalives=1,
            keepalives_idle=KEEPALIVE_IDLE_S,
            keepalives_interval=KEEPALIVE_INTERVAL_S,
            keepalives_count=KEEPALIVE_COUNT,
            tcp_user_timeout=TCP_USER_TIMEOUT_MS,
            options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
        )
        if lock_timeout is not None:
            conn.execute(f"SET lock_timeout = {int(lock_timeout * 1000)}")
        return conn

    @contextmanager
    def _busy_is_503(self) -> Iterator[None]:
        try:
            yield
        except psycopg.DataError as exc:  # a value PostgreSQL cannot store (a NUL character in text)
            raise InvalidRequest(f"a value cannot be stored: {exc.diag.message_primary or type(exc).__name__}", code="invalid_value") from exc
        except psycopg.Error as exc:
            # The URL (host, user, database) stays in the log, never in a client's message.
            if exc.sqlstate in _BUSY_STATES:
                raise DatabaseBusy(
                    "the database is locked by another connection (another server writing?); retry shortly",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from exc
            if isinstance(exc, psycopg.OperationalError) and (exc.sqlstate is None or exc.sqlstate.startswith(_LOST_STATES)):
                log.warning("database_unreachable", db=self._shown, error=str(exc))
                raise DatabaseBusy("the database cannot be reached; retry shortly", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
            raise

    def _writer(self) -> psycopg.Connection[Any]:
        if self._pg.closed:  # lost (a server restart, the network): connect again, quickly
            self._pg = self._connect(connect_timeout=RECONNECT_TIMEOUT_S)
        return self._pg

    def _readers(self) -> psycopg.Connection[Any]:
        if self._pg_reader.closed:
            self._pg_reader = self._connect(lock_timeout=BUSY_TIMEOUT_S, connect_timeout=RECONNECT_TIMEOUT_S)
        return self._pg_reader

    @contextmanager
    def transaction(self, *, wait: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction holding the database's write lock (see the module).
        The adapter it yields stands in for ``sqlite3.Connection`` (``execute``,
        ``executemany``, cursors with ``fetchone``/``fetchall``/``rowcount``)."""
        waited = BUSY_TIMEOUT_S if wait is None else wait
        with self._lock, self._busy_is_503():
            conn = self._writer()
            try:
                conn.execute("BEGIN")
                conn.execute(f"SET LOCAL lock_timeout = {int(waited * 1000)}")
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                yield cast(sqlite3.Connection, PgConnection(conn))
                conn.execute("COMMIT")
            except BaseException:
                if not conn.closed and conn.info.transaction_status != pq.TransactionStatus.IDLE:
                    with suppress(psycopg.Error):  # the connection died meanwhile: nothing to roll back
                        conn.execute("ROLLBACK")
                raise

    def query(self, sql: str, args: Sequence[object] = ()) -> list[tuple[object, ...]]:
        with self._read_lock, self._busy_is_503():
            cursor = self._readers().cursor()
            for statement in translate(sql):
                cursor.execute(statement, tuple(args))
            return list(cursor.fetchall())

    def close(self) -> None:
        """Close both connections; a later call raises ``DatabaseBusy`` instead of connecting again."""
        with self._lock:
            self._closed = True
            with self._read_lock:
                self._pg_reader.close()
            self._pg.close()
