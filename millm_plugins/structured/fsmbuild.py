"""Building a pattern's automaton in a child process that can be stopped.

``interegular`` builds a regular expression's deterministic automaton in pure Python, and a
pattern can ask for billions of states (``.*a`` followed by twenty ``.``). A thread
cannot be stopped, and a thread running Python takes interpreter time from the server's
other threads, so builds run here instead: one child Python process (started on first
use, this module run as ``python -m``, importing only ``interegular``) builds one pattern
at a time. A build that takes longer than its limit, or more memory than
:data:`MEMORY_LIMIT`, ends the child; the next build starts a fresh one.

The protocol is pickles on the child's stdin and stdout, each preceded by its length.
``interegular``'s ``anything_else`` marker is compared by identity, so it is pickled as a
reference to the parent's own object.
"""

from __future__ import annotations

import copyreg
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

from interegular import parse_pattern
from interegular.fsm import anything_else

MEMORY_LIMIT = 2 * 2**30
"""The child's address space, in bytes: a build that needs more fails (out of memory)."""
_HEADER = struct.Struct("!Q")


def _anything_else() -> Any:
    return anything_else


copyreg.pickle(type(anything_else), lambda _: (_anything_else, ()))


class PatternTooCostly(Exception):
    """A pattern's automaton took longer than its limit, or more memory, to build."""


def _write(stream: IO[bytes], value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    """``size`` bytes from ``fd``; raises TimeoutError past ``deadline`` (monotonic) and
    EOFError when the other side is gone."""
    chunks: list[bytes] = []
    while size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read(fd: int, deadline: float | None) -> Any:
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))


def _serve() -> None:
    """The child: read patterns, answer ``("ok", fsm)`` or ``("error", reason)``."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
        pass
    stdin, stdout = sys.stdin.buffer.fileno(), sys.stdout.buffer
    while True:
        try:
            pattern = _read(stdin, None)
        except EOFError:
            return
        try:
            _write(stdout, ("ok", parse_pattern(pattern).to_fsm()))
        except MemoryError:
            _write(stdout, ("error", f"its automaton needs more than {MEMORY_LIMIT // 2**30} GiB to build"))
        except Exception as exc:  # noqa: BLE001 - interegular's parse errors, whatever their type
            _write(stdout, ("error", f"{type(exc).__name__}: {exc}"))


class Builder:
    """The parent's side: :meth:`build` one pattern at a time in the child."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def build(self, pattern: str, limit_s: float) -> Any:
        """``pattern``'s automaton (an ``interegular`` FSM). Raises
        :class:`PatternTooCostly` past ``limit_s`` or the memory limit, ``ValueError`` for
        a pattern ``interegular`` cannot compile."""
        with self._lock:
            child = self._started()
            assert child.stdin is not None and child.stdout is not None
            try:
                _write(child.stdin, pattern)
                kind, value = _read(child.stdout.fileno(), time.monotonic() + limit_s)
            except TimeoutError:
                self._stop()
                raise PatternTooCostly(f"its automaton takes more than {limit_s:g} s to build") from None
            except (EOFError, OSError):
                self._stop()
                raise PatternTooCostly("the process building its automaton ended (out of memory?)") from None
            if kind != "ok":
                raise (PatternTooCostly(value) if "GiB" in value else ValueError(value))
            return value

    def close(self) -> None:
        """End the child now, even mid-build (that build then fails)."""
        child = self._child
        if child is not None:
            child.kill()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is None or self._child.poll() is not None:
            # The package's own directory first on the child's path: it imports this module
            # as the server did, whatever the server's working directory.
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                env=env,
            )
        return self._child

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            for stream in (self._child.stdin, self._child.stdout):
                if stream is not None:
                    stream.close()
            self._child = None


if __name__ == "__main__":
    # Served from the module under its own name, so that what it pickles refers to it.
    from millm_plugins.structured import fsmbuild

    fsmbuild._serve()
