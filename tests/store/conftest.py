"""A real PostgreSQL server for the session (the binaries installed on the machine), and a
fresh database of it per test.

It runs from a temporary directory, on 127.0.0.1 at a free port (and a unix socket in the
same directory), with ``trust`` authentication for the ``millm`` role. PostgreSQL refuses to
run as root: as root, the server runs as an unprivileged account (``postgres`` when there
is one, else ``nobody``). A server that cannot be started fails the tests that need it:
they are never skipped.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

ROLE = "millm"


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    socket_dir: str

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{ROLE}@{self.host}:{self.port}/{dbname}"


def _binary(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is not installed (apt-get install postgresql): the PostgreSQL store tests need it")
    return found


def _account() -> dict[str, Any]:
    """``subprocess`` arguments that run the server as an account PostgreSQL accepts."""
    if os.geteuid() != 0:
        return {}
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    pytest.fail("running as root and no unprivileged account (postgres, nobody) to run PostgreSQL as")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(args: list[str], account: dict[str, Any], log: str | None = None) -> None:
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False, cwd="/", **account)
    if done.returncode != 0:
        tail = open(log).read()[-2000:] if log and os.path.exists(log) else ""
        pytest.fail(f"{' '.join(args)} failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]} {tail}")


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    account = _account()
    base = tempfile.mkdtemp(prefix="millm-pg-")
    if account:
        os.chown(base, account["user"], account["group"])
    data, log = os.path.join(base, "data"), os.path.join(base, "server.log")
    port = _free_port()
    _run([initdb, "-D", data, "-U", ROLE, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"], account)
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    _run([pg_ctl, "-D", data, "-o", options, "-l", log, "-w", "-t", "60", "start"], account, log)
    server = Postgres("127.0.0.1", port, base)
    try:
        yield server
    finally:
        subprocess.run(
            [pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"], capture_output=True, timeout=60, check=False, cwd="/", **account
        )
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(postgres: Postgres) -> str:
    """The URL of a new, empty database on the session's server."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:16]
    with psycopg.connect(postgres.url(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return postgres.url(name)
