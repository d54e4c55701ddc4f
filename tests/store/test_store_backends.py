"""The store's contract on both backends: a SQLite file (the default) and PostgreSQL (a
real server, see conftest). Migrations run once and are counted; a transaction commits
whole or not at all; writers run one at a time, so a read-modify-write in one transaction
loses nothing; a lock held past the store's wait is 503 ``database_busy``; bytes, 64-bit
integers and binary64 reals come back as written; every plugin's migrations apply."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from millm_core.dbdialect import UnsupportedSQL, check_db, redact, translate
from millm_core.errors import DatabaseBusy, NotFound
from millm_core.store import BUSY_TIMEOUT_S, Store
from millm_plugins.batches.storage import MIGRATIONS as BATCHES
from millm_plugins.circuits.book import MIGRATIONS as CIRCUITS
from millm_plugins.probes.book import MIGRATIONS as PROBES
from millm_plugins.responses.sealing import MIGRATIONS as RESPONSES_KEY
from millm_plugins.responses.storage import MIGRATIONS as RESPONSES
from millm_plugins.steering.registry import MIGRATIONS as STEERING

TABLE = "CREATE TABLE items (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, body BLOB, score REAL, n INTEGER)"


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> str:
    """A new database: a SQLite file's path or a PostgreSQL URL."""
    if request.param == "sqlite":
        return str(tmp_path / "millm.db")
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def opened(db: str) -> Iterator[Callable[[], Store]]:
    """Open stores on ``db`` (closed after the test)."""
    stores: list[Store] = []

    def open_one() -> Store:
        stores.append(Store(db))
        return stores[-1]

    yield open_one
    for store in stores:
        store.close()


def test_the_backend_follows_the_url(db: str, opened: Callable[[], Store]) -> None:
    store = opened()
    assert store.path == db
    assert type(store).__name__ == ("PostgresStore" if db.startswith("postgresql://") else "Store")


def test_migrations_run_once_and_are_counted(opened: Callable[[], Store]) -> None:
    store = opened()
    first = (TABLE, "INSERT INTO items (id, n) VALUES ('seed', 1)")
    store.migrate("ns", first)
    store.migrate("ns", first)  # nothing left to run
    assert store.version("ns") == 2 and store.version("other") == 0
    store.migrate("ns", (*first, "ALTER TABLE items ADD COLUMN extra INTEGER NOT NULL DEFAULT 7"))
    assert store.version("ns") == 3
    assert store.query("SELECT id, n, extra FROM items") == [("seed", 1, 7)]
    with pytest.raises(RuntimeError, match="newer than this millm"):
        store.migrate("ns", first)
    # Another server opening the same database finds them applied.
    assert opened().version("ns") == 3


def test_a_failed_migration_changes_nothing(opened: Callable[[], Store]) -> None:
    store = opened()
    with pytest.raises(Exception):  # noqa: B017 - each backend's own error type
        store.migrate("ns", (TABLE, "INSERT INTO nowhere VALUES (1)"))
    assert store.version("ns") == 0
    store.migrate("ns", (TABLE,))  # the table was not left behind
    assert store.version("ns") == 1


def test_two_servers_starting_at_once_migrate_once(db: str) -> None:
    migrations = (TABLE, "INSERT INTO items (id) VALUES ('once')")
    errors: list[BaseException] = []
    stores: list[Store] = []
    start = threading.Barrier(4)

    def server() -> None:
        try:
            start.wait()
            store = Store(db)
            stores.append(store)
            store.migrate("ns", migrations)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=server) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert errors == []
        assert stores[0].query("SELECT id FROM items") == [("once",)]
        assert stores[0].version("ns") == 2
    finally:
        for store in stores:
            store.close()


def test_a_transaction_commits_whole_or_not_at_all(opened: Callable[[], Store]) -> None:
    store = opened()
    store.migrate("ns", (TABLE,))
    with store.transaction() as conn:
        conn.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("a", 1))
        conn.executemany("INSERT INTO items (id, n) VALUES (?, ?)", [("b", 2), ("c", 3)])
        assert conn.execute("SELECT COUNT(*) FROM items").fetchone()[0] == 3  # the block reads its own writes
    with pytest.raises(NotFound), store.transaction() as conn:
        conn.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("d", 4))
        conn.execute("DELETE FROM items WHERE id = ?", ("a",))
        raise NotFound("refused halfway")
    with pytest.raises(Exception), store.transaction() as conn:  # noqa: B017 - a unique violation, each backend's own type
        conn.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("e", 5))
        conn.execute("INSERT INTO items (id, n) VALUES (?, ?)", ("a", 6))
    assert store.query("SELECT id, n FROM items ORDER BY seq") == [("a", 1), ("b", 2), ("c", 3)]
    with store.transaction() as conn:  # the store is usable after both
        assert conn.execute("UPDATE items SET n = n + 10 WHERE id IN (?, ?)", ("a", "zz")).rowcount == 1
        assert conn.execute("DELETE FROM items WHERE id = ?", ("nope",)).rowcount == 0
    assert opened().query("SELECT n FROM items WHERE id = ?", ("a",)) == [(11,)]


def test_values_come_back_as_written(opened: Callable[[], Store]) -> None:
    store = opened()
    store.migrate("ns", (TABLE,))
    blob = bytes(range(256)) + b"\x00tail"
    with store.transaction() as conn:
        conn.execute("INSERT INTO items (id, body, score, n) VALUES (?, ?, ?, ?)", ("x", blob, 0.1 + 0.2, 2**62 + 1))
        conn.execute("INSERT INTO items (id, body, score, n) VALUES (?, ?, ?, ?)", ("y", None, None, None))
        conn.execute("INSERT INTO items (id, body) VALUES ('100%', ?)", (b"",))  # a literal % and ? in quotes are left alone
        conn.execute("INSERT INTO items (id) VALUES ('what?')")
    rows = store.query("SELECT id, body, score, n FROM items ORDER BY seq")
    assert rows == [("x", blob, 0.1 + 0.2, 2**62 + 1), ("y", None, None, None), ("100%", b"", None, None), ("what?", None, None, None)]
    assert isinstance(rows[0][1], bytes)
    assert store.query("SELECT id FROM items WHERE id LIKE '%?'") == [("what?",)]
    assert store.query("SELECT id FROM items WHERE id LIKE ?", ("100%",)) == [("100%",)]  # arguments are never rewritten


def test_insert_or_ignore_upserts_and_ids_never_reused(opened: Callable[[], Store]) -> None:
    store = opened()
    store.migrate("ns", (TABLE, "CREATE TABLE one (id INTEGER PRIMARY KEY CHECK (id = 1), total INTEGER NOT NULL)"))
    with store.transaction() as conn:
        assert conn.execute("INSERT OR IGNORE INTO items (id, n) VALUES (?, ?)", ("a", 1)).rowcount == 1
        assert conn.execute("INSERT OR IGNORE INTO items (id, n) VALUES (?, ?)", ("a", 2)).rowcount == 0
        conn.execute("INSERT INTO items (id, n) VALUES (?, ?) ON CONFLICT(id) DO UPDATE SET n = excluded.n", ("a", 3))
        conn.execute("INSERT INTO one (id, total) VALUES (1, ?) ON CONFLICT(id) DO UPDATE SET total = excluded.total", (5,))
        conn.execute("INSERT INTO items (id, n) SELECT ?, ? WHERE EXISTS (SELECT 1 FROM one WHERE id = ?)", ("b", None, 1))
        (b,) = conn.execute("SELECT seq FROM items WHERE id = ?", ("b",)).fetchone()
        conn.execute("DELETE FROM items WHERE id = ?", ("b",))
        conn.execute("INSERT INTO items (id) VALUES (?)", ("c",))
    rows = store.query("SELECT seq, id, n FROM items ORDER BY seq")
    assert [row[1:] for row in rows] == [("a", 3), ("c", None)]
    assert rows[0][0] == 1 and rows[1][0] > b  # the deleted row's id is not given again


def test_triggers_keep_a_running_total(opened: Callable[[], Store]) -> None:
    """The responses plugin's table: triggers keep its byte total in a one-row table."""
    store = opened()
    store.migrate("responses", RESPONSES)
    with store.transaction() as conn:
        for i in range(3):
            conn.execute(
                "INSERT INTO responses_stored (id, created_at, response, history, bytes) VALUES (?, ?, ?, ?, ?)",
                (f"r{i}", i, b"x", b"", 10 + i),
            )
        conn.execute("DELETE FROM responses_stored WHERE id = ?", ("r1",))
    assert store.query("SELECT total FROM responses_stored_bytes WHERE id = 1") == [(22,)]


def test_writers_run_one_at_a_time(db: str, opened: Callable[[], Store]) -> None:
    """Read-modify-write from two servers' stores (and two threads each) loses nothing."""
    stores = [opened(), opened()]
    stores[0].migrate("ns", (TABLE,))
    with stores[0].transaction() as conn:
        conn.execute("INSERT INTO items (id, n) VALUES ('counter', 0)")

    def bump(store: Store) -> None:
        for _ in range(25):
            with store.transaction(wait=30) as conn:
                (n,) = conn.execute("SELECT n FROM items WHERE id = 'counter'").fetchone()
                time.sleep(0.001)  # room for another writer to interleave, were it let in
                conn.execute("UPDATE items SET n = ? WHERE id = 'counter'", (int(n) + 1,))

    threads = [threading.Thread(target=bump, args=(store,)) for store in stores for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stores[1].query("SELECT n FROM items WHERE id = 'counter'") == [(100,)]


def test_a_lock_held_past_the_wait_is_database_busy(opened: Callable[[], Store]) -> None:
    holder, other = opened(), opened()
    holder.migrate("ns", (TABLE,))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.transaction() as conn:
            conn.execute("INSERT INTO items (id) VALUES ('held')")
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        with pytest.raises(DatabaseBusy) as refused, other.transaction() as conn:
            conn.execute("INSERT INTO items (id) VALUES ('other')")
        waited = time.monotonic() - started
        assert (refused.value.status, refused.value.code) == (503, "database_busy")
        assert refused.value.headers["Retry-After"] == "1"
        assert BUSY_TIMEOUT_S * 0.8 <= waited < BUSY_TIMEOUT_S + 2.0
        assert other.query("SELECT id FROM items") == []  # reads do not wait behind the writer
    finally:
        release.set()
        thread.join()
    with other.transaction() as conn:  # once released, the write goes through
        conn.execute("INSERT INTO items (id) VALUES ('other')")
    assert sorted(other.query("SELECT id FROM items")) == [("held",), ("other",)]


def test_every_plugins_migrations_apply_twice(opened: Callable[[], Store]) -> None:
    plugins = {
        "steering": STEERING, "probes": PROBES, "circuits": CIRCUITS, "batches": BATCHES, "responses": RESPONSES,
        "responses_key": RESPONSES_KEY,
    }  # fmt: skip
    store = opened()
    for namespace, migrations in plugins.items():
        store.migrate(namespace, migrations)
    again = opened()
    for namespace, migrations in plugins.items():
        again.migrate(namespace, migrations)
        assert again.version(namespace) == len(migrations)


# ---------------------------------------------------------------------- the dialect, no database


def test_the_translation_of_the_dialect_used_here() -> None:
    assert translate("SELECT a FROM t WHERE b = ? AND c LIKE 'x%?'") == ("SELECT a FROM t WHERE b = %s AND c LIKE 'x%%?'",)
    assert translate('CREATE TABLE t (seq INTEGER PRIMARY KEY AUTOINCREMENT, b BLOB, r REAL, "offset" INTEGER)') == (
        'CREATE TABLE t (seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, b BYTEA, r DOUBLE PRECISION, "offset" BIGINT)',
    )
    assert translate("INSERT OR IGNORE INTO t (a) VALUES (?)") == ("INSERT INTO t (a) VALUES (%s) ON CONFLICT DO NOTHING",)
    function, trigger = translate("CREATE TRIGGER t_added AFTER INSERT ON t BEGIN UPDATE s SET n = n + NEW.n WHERE id = 1; END")
    assert "LANGUAGE plpgsql" in function and "UPDATE s SET n = n + NEW.n WHERE id = 1; RETURN NULL;" in function
    assert trigger == "CREATE TRIGGER t_added AFTER INSERT ON t FOR EACH ROW EXECUTE FUNCTION t_added_fn()"


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT OR REPLACE INTO t (a) VALUES (?)",
        "REPLACE INTO t (a) VALUES (?)",
        "PRAGMA journal_mode=WAL",
        "BEGIN IMMEDIATE",
        "SELECT name FROM sqlite_master",
        "CREATE TRIGGER x BEFORE INSERT ON t BEGIN SELECT 1; END",
        "SELECT a FROM t -- don't ?",
        "SELECT a /* it's */ FROM t WHERE b = ?",
        "INSERT OR IGNORE INTO t (a) VALUES (?) RETURNING a",
        "SELECT a FROM t WHERE b = ?1",
        "SELECT a FROM t WHERE b = :b",
    ],
)
def test_what_has_no_sound_translation_is_refused_by_name(sql: str) -> None:
    with pytest.raises(UnsupportedSQL):
        translate(sql)


def test_a_password_is_not_shown() -> None:
    assert redact("postgresql://me:s3cret@db:5432/millm") == "postgresql://me:***@db:5432/millm"
    assert redact("postgresql://me@db/millm") == "postgresql://me@db/millm"
    assert redact("postgresql://me:p@ss@db/millm") == "postgresql://me:***@db/millm"  # '@' in the password
    assert redact("postgresql://me@db/millm?password=s3cret&sslmode=require") == "postgresql://me@db/millm?password=***&sslmode=require"
    with pytest.raises(ValueError) as refused:
        check_db("POSTGRESQL+psycopg://me:s3cret@db/millm")
    assert "s3cret" not in str(refused.value)


def test_a_lost_connection_is_database_busy_then_reconnects(pg_url: str) -> None:
    """A connection the server ended (a restart, an administrator, a timeout) answers 503
    database_busy, never a 500; the next call connects again."""
    import psycopg

    store = Store(pg_url)
    try:
        store.migrate("lost", ("CREATE TABLE lost (a INTEGER NOT NULL)",))
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        for attempt in (lambda: store.query("SELECT count(*) FROM lost"), lambda: store.transaction().__enter__()):
            with pytest.raises(DatabaseBusy):
                attempt()
        assert store.query("SELECT count(*) FROM lost") == [(0,)]
        with store.transaction() as conn:
            conn.execute("INSERT INTO lost (a) VALUES (?)", (1,))
        assert store.query("SELECT a FROM lost") == [(1,)]
    finally:
        store.close()


def test_sqlite_never_imports_psycopg(tmp_path: pathlib.Path) -> None:
    code = (
        "import sys; from millm_core.store import Store; "
        f"s = Store({str(tmp_path / 'x.db')!r}); s.migrate('ns', ('CREATE TABLE t (a BLOB)',)); s.close(); "
        "m = Store(':memory:'); m.close(); assert 'psycopg' not in sys.modules, 'psycopg imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("db", "ok"),
    [
        ("millm.db", True),
        (":memory:", True),
        ("postgresql://me:pw@db:5432/millm", True),
        ("postgres://me@db/millm", True),
        ("mysql://me:pw@db/x", False),
    ],
)
def test_the_db_setting(db: str, ok: bool) -> None:
    from millm_core.config import load_settings
    from millm_core.errors import ConfigError

    if ok:
        assert load_settings({"db": db}, environ={}).db == db
    else:
        with pytest.raises(ConfigError, match="postgresql://") as refused:
            load_settings({"db": db}, environ={})
        assert "pw" not in str(refused.value)


def test_a_value_postgres_cannot_store_is_a_400(pg_url: str) -> None:
    """PostgreSQL text cannot hold a NUL character (SQLite's can): the request that sent
    one is refused, the store and its connection keep working."""
    from millm_core.errors import InvalidRequest

    store = Store(pg_url)
    try:
        store.migrate("nul", ("CREATE TABLE nul (a TEXT NOT NULL)",))
        with pytest.raises(InvalidRequest) as refused, store.transaction() as conn:
            conn.execute("INSERT INTO nul (a) VALUES (?)", ("a\x00b",))
        assert refused.value.status == 400
        with store.transaction() as conn:
            conn.execute("INSERT INTO nul (a) VALUES (?)", ("ab",))
        assert store.query("SELECT a FROM nul") == [("ab",)]
    finally:
        store.close()
