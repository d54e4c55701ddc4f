"""The connection cap and the header timeout, on real servers over raw sockets.

- ``--max-connections N``: at most N client connections are accepted at once. Past the cap
  new connections are held at accept (they wait, unaccepted, in the kernel's listen
  backlog: no descriptor of the server's), the open ones keep being served, and the held
  ones are accepted and answered in turn as open ones close. ``0`` is no cap.
- A client that trickles its headers is dropped once ``HEADER_TIMEOUT_S`` has passed since
  its connection was accepted, however steadily it trickles; an unfinished head past
  ``MAX_HEADER_BYTES`` gets 431.
- A client that closes its connection frees its slot at once (hypercorn alone would keep
  it until its idle timer fires).
- One app can be served, stopped and served again (its metrics register once per app).

"Accepted" is read from the kernel: a server-side connection still in the listen backlog
has no socket inode in ``/proc/net/tcp`` until ``accept()`` gives it one.
"""

from __future__ import annotations

import contextlib
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from millm_core.cli import HEADER_TIMEOUT_S, MAX_HEADER_BYTES
from millm_core.config import load_settings
from millm_core.registry import ModelRegistry, ServedModel
from millm_core.server.app import create_app
from millm_core.testing import RunningServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")

CAP = 4
HELD = 20


def accepted(port: int) -> int:
    """Server-side connections on ``port`` that the server has accepted (an established
    connection still waiting in the listen backlog has inode 0)."""
    inodes = set()
    with open("/proc/net/tcp") as fh:
        table = fh.read()
    for line in table.splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        if local_port == port and fields[3] == "01" and fields[9] != "0":
            inodes.add(fields[9])
    # Counted by inode: the kernel walks its socket tables without a snapshot, so while
    # connections come and go a socket can be listed twice.
    return len(inodes)


def settled_accepted(port: int) -> int:
    """``accepted(port)`` read twice in a row, the lower count. One read is no snapshot: the
    kernel hands the table out a page per read call, so a connection closed after its page
    was read and its successor accepted before a later page was read are both listed. A
    count over the cap that is real holds for both reads."""
    return min(accepted(port), accepted(port))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def get(path: str = "/api/health", *, close: bool) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n".encode()


def read_response(sock: socket.socket, timeout: float) -> tuple[int, bytes]:
    """One HTTP/1.1 response (status, body) read within ``timeout`` seconds."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines[1:] if line.lower().startswith("content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def answered(sock: socket.socket) -> bool:
    """Whether the server has sent anything (or closed) on ``sock`` yet, without waiting."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


class Tricklers:
    """Connections that send a request line and then one header byte every 0.2 s, never
    finishing their headers. Records when the server dropped each one."""

    def __init__(self, port: int, count: int) -> None:
        self.socks = [connect(port) for _ in range(count)]
        self.opened = time.monotonic()
        self.dropped: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for sock in self.socks:
            sock.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        while not self._stop.is_set() and len(self.dropped) < len(self.socks):
            for i, sock in enumerate(self.socks):
                if i in self.dropped:
                    continue
                try:
                    if answered(sock) and sock.recv(1024) == b"":
                        raise ConnectionResetError
                    sock.sendall(b"a")
                except OSError:
                    self.dropped[i] = time.monotonic()
            time.sleep(0.2)

    def __enter__(self) -> Tricklers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.socks:
            sock.close()


@contextlib.contextmanager
def opened(port: int, count: int) -> Iterator[list[socket.socket]]:
    socks = [connect(port) for _ in range(count)]
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def wait_for(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_connections_past_the_cap_are_held_at_accept_while_open_ones_are_served(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(max_connections=CAP) as srv:
        port = srv.port
        assert wait_for(lambda: accepted(port) == 0, 5), "the start-up health checks' connections did not close"
        with opened(port, 1) as [keeper]:
            keeper.sendall(get(close=False))
            assert read_response(keeper, 5)[0] == 200
            with Tricklers(port, CAP - 1) as tricklers:
                assert wait_for(lambda: accepted(port) == CAP, 5), accepted(port)
                with opened(port, HELD) as held:  # connect() succeeds: the kernel completes the handshake
                    for sock in held:
                        sock.sendall(get(close=True))
                    time.sleep(1.0)
                    # Held, not accepted-then-starved: no descriptor of the server's, no answer.
                    assert accepted(port) == CAP
                    assert not any(answered(sock) for sock in held)
                    # An open connection keeps being served.
                    started = time.monotonic()
                    keeper.sendall(get(close=False))
                    assert read_response(keeper, 5)[0] == 200
                    assert time.monotonic() - started < HEADER_TIMEOUT_S / 2  # served now, not at the header timeout
                    # The tricklers are dropped at the header timeout; the held connections
                    # are then accepted in turn (never more than the cap) and answered.
                    peak = 0
                    statuses = []
                    deadline = time.monotonic() + HEADER_TIMEOUT_S + 10
                    for sock in held:
                        while not answered(sock):
                            peak = max(peak, settled_accepted(port))
                            assert time.monotonic() < deadline, f"{len(statuses)} of {HELD} held connections answered"
                            time.sleep(0.01)
                        statuses.append(read_response(sock, 5)[0])
                    assert statuses == [200] * HELD
                    assert peak <= CAP
                # The tricklers' thread notices a drop at its next poll (0.2 s, longer on a busy machine).
                assert wait_for(lambda: len(tricklers.dropped) == CAP - 1, 5), tricklers.dropped
                lived = [at - tricklers.opened for at in tricklers.dropped.values()]
                assert max(lived) < HEADER_TIMEOUT_S + 2, lived  # trickling never extended it


def test_without_a_cap_every_connection_is_accepted_at_once(make_server) -> None:  # type: ignore[no-untyped-def]
    """The control for the test above: the same load with ``--max-connections 0``."""
    with make_server(max_connections=0) as srv:
        port = srv.port
        with Tricklers(port, CAP), opened(port, HELD) as held:
            for sock in held:
                sock.sendall(get(close=True))
            assert [read_response(sock, 5)[0] for sock in held] == [200] * HELD


def test_a_slot_frees_as_soon_as_its_client_closes(make_server) -> None:  # type: ignore[no-untyped-def]
    """Clients that close a kept-alive connection, or give up while held at accept, free
    their slots at once, not at the header timeout: a new client is served right away."""
    with make_server(max_connections=2) as srv:
        port = srv.port
        with opened(port, 2) as kept:
            for sock in kept:
                sock.sendall(get(close=False))
                assert read_response(sock, 5)[0] == 200
            assert accepted(port) == 2
            with opened(port, 10):
                time.sleep(0.2)  # the ten give up while held
        started = time.monotonic()
        assert httpx.get(srv.base_url + "/api/health", timeout=HEADER_TIMEOUT_S + 5).status_code == 200
        assert time.monotonic() - started < HEADER_TIMEOUT_S / 2  # served now, not at the header timeout


def test_an_unfinished_head_past_the_limit_is_refused(make_server) -> None:  # type: ignore[no-untyped-def]
    """The server buffers at most ``MAX_HEADER_BYTES`` of a request head it is still
    waiting to complete: past that, 431 at once and the connection closes."""
    with make_server() as srv, opened(srv.port, 1) as [sock]:
        sock.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1024))
        started = time.monotonic()
        assert read_response(sock, 5)[0] == 431
        assert time.monotonic() - started < HEADER_TIMEOUT_S / 2  # served now, not at the header timeout
        sock.settimeout(5)
        assert sock.recv(1024) == b""


def test_a_client_that_sends_nothing_is_dropped_at_the_header_timeout(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server() as srv, opened(srv.port, 1) as [sock]:
        started = time.monotonic()
        sock.settimeout(HEADER_TIMEOUT_S + 5)
        assert sock.recv(1024) == b""  # closed by the server, nothing sent
        assert HEADER_TIMEOUT_S - 1 < time.monotonic() - started < HEADER_TIMEOUT_S + 2


def test_one_app_can_be_served_twice(tiny_model: ServedModel) -> None:
    """Stopping and starting one app registers its metrics (the scheduler's collector, a
    plugin's counters) again without a duplicate error, and exports each once."""
    registry = ModelRegistry()
    registry.add(tiny_model)
    app = create_app(load_settings({"log_level": "warning", "db": ":memory:"}, environ={}), models=registry)
    for _ in range(2):
        with RunningServer(app) as srv:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(srv.base_url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
            lines = httpx.get(srv.base_url + "/metrics").text.splitlines()
            assert sum(line.startswith("millm_queue_depth ") for line in lines) == 1
            assert [line for line in lines if line.startswith('millm_steered_requests_total{kind="none"}')] != []
