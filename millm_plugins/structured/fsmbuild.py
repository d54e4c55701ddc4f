"""Building a pattern's automaton in a child process that can be stopped.

``interegular`` builds a regular expression's deterministic automaton in pure Python, and a
pattern can ask for billions of states (``.*a`` followed by twenty ``.``). A thread
cannot be stopped, and a thread running Python takes interpreter time from the server's
other threads, so builds run here instead: one child Python process (started on first
use, this module run as ``python -P -m``, importing only ``interegular``) builds one
pattern at a time. A build that takes longer than its limit, or more memory than
:data:`MEMORY_LIMIT`, ends the child (the parent stops it; the child's own alarm ends it
too, should the parent be gone); the next build starts a fresh one.

The protocol is pickles on the child's stdin and stdout, each preceded by its length; an
answer carries the number of its question, so the two sides never fall out of step. The
parent unpickles only ``interegular.fsm``'s classes (and its ``anything_else`` marker,
which ``interegular`` compares by identity and is therefore pickled by name).
"""

from __future__ import annotations

import copyreg
import io
import math
import os
import pickle
import selectors
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

from interegular import parse_pattern
from interegular.fsm import FSM, anything_else

MEMORY_LIMIT = 2 * 2**30
"""The child's address space, in bytes: a build that needs more fails (out of memory)."""
_HEADER = struct.Struct("!Q")

copyreg.pickle(type(anything_else), lambda _: "anything_else")  # by name: interegular.fsm.anything_else


class PatternTooCostly(Exception):
    """A pattern's automaton took longer than its limit, or more memory, to build."""


class BuilderUnavailable(Exception):
    """The build process could not be started or ended without an answer for a reason
    of its own (not the pattern's)."""


class _FsmOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "interegular.fsm":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the build process sent {module}.{name}")


def _write(stream: IO[bytes], value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    """``size`` bytes from ``fd``; raises TimeoutError past ``deadline`` (monotonic) and
    EOFError when the other side is gone."""
    out = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while len(out) < size:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise TimeoutError
            chunk = os.read(fd, min(size - len(out), 1 << 20))
            if not chunk:
                raise EOFError
            out += chunk
    return bytes(out)


def _read(fd: int, deadline: float | None, trusted: bool) -> Any:
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    data = _read_exactly(fd, size, deadline)
    return pickle.loads(data) if trusted else _FsmOnly(io.BytesIO(data)).load()


def live_only(fsm: FSM) -> FSM:
    """``fsm`` without its dead states (those from which no final state can be reached) and
    the transitions into them; the same language. lm-format-enforcer's regex parser offers
    every transition of a state as allowed, so a transition into a dead state would let a row
    leave the pattern (and then write anything). Raises ``ValueError`` when no string
    matches the pattern at all (the initial state is dead)."""
    into: dict[Any, set[Any]] = {}
    for state, transitions in fsm.map.items():
        for target in transitions.values():
            into.setdefault(target, set()).add(state)
    live, pending = set(fsm.finals), list(fsm.finals)
    while pending:
        for source in into.get(pending.pop(), ()):
            if source not in live:
                live.add(source)
                pending.append(source)
    if fsm.initial not in live:
        raise ValueError("no string matches the pattern")
    if live >= set(fsm.states):
        return fsm
    kept = {state: {symbol: target for symbol, target in fsm.map.get(state, {}).items() if target in live} for state in live}
    return FSM(alphabet=fsm.alphabet, states=live, initial=fsm.initial, finals=set(fsm.finals), map=kept)


def _serve() -> None:
    """The child: read ``(number, pattern, limit_s)``, answer ``(number, kind, value)``
    with kind ``ok`` (the FSM), ``costly`` or ``error`` (a reason)."""
    import signal

    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limits still hold
        pass
    stdin, stdout = sys.stdin.buffer.fileno(), sys.stdout.buffer
    while True:
        try:
            number, pattern, limit_s = _read(stdin, None, trusted=True)
        except EOFError:
            return
        if hasattr(signal, "alarm"):
            signal.alarm(math.ceil(limit_s) + 2)  # ends this process if nobody stops it
        try:
            _write(stdout, (number, "ok", live_only(parse_pattern(pattern).to_fsm())))
        except MemoryError:
            _write(stdout, (number, "costly", f"its automaton needs more than {MEMORY_LIMIT // 2**30} GiB to build"))
        except Exception as exc:  # noqa: BLE001 - interegular's parse errors, whatever their type
            _write(stdout, (number, "error", f"{type(exc).__name__}: {exc}"))
        if hasattr(signal, "alarm"):
            signal.alarm(0)


class Builder:
    """The parent's side: :meth:`build` one pattern at a time in the child."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._asked = 0

    def build(self, pattern: str, limit_s: float) -> Any:
        """``pattern``'s automaton (an ``interegular`` FSM). Raises
        :class:`PatternTooCostly` past ``limit_s`` or the memory limit, ``ValueError`` for
        a pattern ``interegular`` cannot compile, :class:`BuilderUnavailable` when the
        build process cannot run."""
        with self._lock:
            self._asked += 1
            try:
                child = self._started()
                assert child.stdin is not None and child.stdout is not None
                _write(child.stdin, (self._asked, pattern, limit_s))
                number, kind, value = _read(child.stdout.fileno(), time.monotonic() + limit_s, trusted=False)
            except TimeoutError:
                self._stop()
                raise PatternTooCostly(f"its automaton takes more than {limit_s:g} s to build") from None
            except (EOFError, BrokenPipeError):
                code = self._stop()
                if code in (None, 0) or code < 0:  # killed (the memory limit, the child's own alarm)
                    raise PatternTooCostly("the process building its automaton ended (out of memory?)") from None
                raise BuilderUnavailable(f"the automaton build process exited with status {code}") from None
            except BaseException as exc:
                self._stop()  # whatever happened, the next build starts in step with a fresh process
                if isinstance(exc, (OSError, pickle.UnpicklingError, ValueError, struct.error)):
                    raise BuilderUnavailable(f"the automaton build process failed: {type(exc).__name__}") from None
                raise
            if number != self._asked:
                self._stop()
                raise BuilderUnavailable("the automaton build process answered another question")
            if kind == "ok":
                return value
            raise PatternTooCostly(value) if kind == "costly" else ValueError(value)

    def close(self) -> None:
        """End the child now, even mid-build (that build then fails)."""
        child = self._child
        if child is not None:
            child.kill()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is None or self._child.poll() is not None:
            self._stop()
            # -P: nothing from the working directory shadows what the child imports.
            # stderr is the server's: a child that cannot start says why in its log.
            self._child = subprocess.Popen(
                [sys.executable, "-P", "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True
            )
        return self._child

    def _stop(self) -> int | None:
        """Stop and reap the child; its exit status (None when there was none)."""
        child, self._child = self._child, None
        if child is None:
            return None
        if child.poll() is None:
            child.kill()
        code = child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        return code if code != -9 else None  # our own kill


if __name__ == "__main__":
    _serve()
