"""Helpers for HTTP tests: independent references and small test plugins."""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from millm_core.hookspecs import hookimpl
from millm_core.pipeline_types import ForwardPlan, RowInfo


def hf_reference(engine: Any, prompt_ids: list[int], max_new: int) -> tuple[str, str]:
    """(text, finish_reason) of greedy HF ``generate`` with EOS handling — the reference
    the server's greedy output must equal."""
    eos = sorted(engine.eos_token_ids)
    with torch.no_grad():
        out = engine.model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0
        )
    new = out[0, len(prompt_ids):].tolist()
    if new and new[-1] in engine.eos_token_ids:
        return engine.tokenizer.decode(new[:-1], skip_special_tokens=True), "stop"
    return engine.tokenizer.decode(new, skip_special_tokens=True), "length"


def chat_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids computed with the tokenizer's own API (not the engine's renderer)."""
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])  # the template writes BOS


def sse_frames(raw: bytes) -> list[str]:
    """Split an SSE body into data payloads, checking the framing byte by byte."""
    assert raw.endswith(b"\n\n")
    frames = raw.split(b"\n\n")[:-1]
    out = []
    for frame in frames:
        assert frame.startswith(b"data: "), frame
        assert b"\n" not in frame, frame
        out.append(frame[len(b"data: "):].decode())
    return out


def json_frames(raw: bytes) -> list[dict[str, Any]]:
    frames = sse_frames(raw)
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def automaton_builds(monkeypatch: Any) -> dict[str, list[str]]:
    """Who builds regex automata from now on, by thread name: ``"process"``, the threads
    that hand a pattern to the build process; ``"here"``, the threads that build one in
    this process (lm-format-enforcer builds through ``interegular``'s ``Pattern.to_fsm``;
    validation only parses)."""
    from interegular.patterns import Pattern

    from millm_plugins.structured.fsmbuild import Builder

    seen: dict[str, list[str]] = {"process": [], "here": []}

    def spy(real: Any, key: str) -> Any:
        def record(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen[key].append(threading.current_thread().name)
            return real(self, *args, **kwargs)

        return record

    monkeypatch.setattr(Builder, "build", spy(Builder.build, "process"))
    monkeypatch.setattr(Pattern, "to_fsm", spy(Pattern.to_fsm, "here"))
    return seen


class _Boom:
    def __init__(self, after: int) -> None:
        self.left = after

    def logit_bias(self) -> None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("processor exploded on purpose")
        return text, False

    def flush(self) -> str:
        return ""


class BoomPlugin:
    """Makes every row fail after ``after`` tokens (to test mid-stream errors)."""

    def __init__(self, after: int = 3) -> None:
        self.after = after

    @hookimpl
    def millm_pre_forward(self, ctx: Any, request: Any, plan: ForwardPlan) -> None:
        plan.add_processor(lambda _row: _Boom(self.after))


class _Gate:
    def __init__(self, gate: threading.Event, delay: float) -> None:
        self.gate = gate
        self.delay = delay

    def logit_bias(self) -> None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.gate.wait(30)
        if self.delay:
            threading.Event().wait(self.delay)
        return text, False

    def flush(self) -> str:
        return ""


class GatePlugin:
    """Every row waits at each token until ``gate`` is set, then ``delay`` seconds more."""

    def __init__(self, delay: float = 0.0) -> None:
        self.gate = threading.Event()
        self.delay = delay

    @hookimpl
    def millm_pre_forward(self, ctx: Any, request: Any, plan: ForwardPlan) -> None:
        plan.add_processor(lambda _row: _Gate(self.gate, self.delay))


def row_info_ok(row: RowInfo) -> bool:
    return row.index >= 0


class WorkerKiller(BaseException):
    """Not an ``Exception``: escapes every per-row and per-batch handler, so it stops the
    scheduler's worker thread (to test the watchdog)."""


FAULT_HEADER = "x-test-fault"


class _Fault:
    """One row's fault, chosen by the request's ``X-Test-Fault`` header."""

    def __init__(self, plugin: FaultPlugin, mode: str, arg: float) -> None:
        self.plugin = plugin
        self.mode = mode
        self.arg = arg
        self.tokens = 0

    def logit_bias(self) -> dict[int, float] | None:
        if self.mode == "bias-raise" and self.tokens >= self.arg:
            raise RuntimeError("logit_bias exploded on purpose")
        if self.mode == "bad-bias" and self.tokens >= self.arg:
            return {10**9: 1.0}  # outside any vocabulary: the engine's step raises for the whole batch
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.tokens += 1
        if self.mode == "raise" and self.tokens > self.arg:
            raise RuntimeError("processor exploded on purpose")
        if self.mode == "fatal" and self.tokens > self.arg:
            raise WorkerKiller("the worker thread is killed on purpose")
        if self.mode == "gate":
            self.plugin.entered.set()
            self.plugin.gate.wait(30)
        if self.mode == "slow":
            threading.Event().wait(self.arg)
        return text, False

    def flush(self) -> str:
        return ""


class FaultPlugin:
    """Faults for one request at a time, chosen per request by the ``X-Test-Fault``
    header ``mode[:arg]``: ``raise:N`` (on_token raises after N tokens), ``bias-raise:N``
    (logit_bias raises after N tokens), ``bad-bias:N`` (an out-of-vocabulary bias after N
    tokens: the whole step raises), ``fatal:N`` (a BaseException after N tokens: the
    worker thread dies), ``bad-join`` (a steering delta on a layer the model lacks: the
    engine refuses the rows in ``open_batch``/``join``), ``gate`` (each token waits for
    ``gate``, holding the worker; ``entered`` is set once it waits), ``slow:S`` (S seconds
    a token). Requests without the header run untouched."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    @hookimpl
    def millm_pre_forward(self, ctx: Any, request: Any, plan: ForwardPlan) -> None:
        raw = ctx.headers.get(FAULT_HEADER)
        if not raw:
            return
        mode, _, arg = raw.partition(":")
        if mode == "bad-join":
            plan.deltas[10**6] = (0.0,)
            return
        value = float(arg or 0)
        plan.add_processor(lambda _row: _Fault(self, mode, value))


def scheduler_stats(base_url: str) -> dict[str, Any]:
    """The server's scheduler counters (``GET /api/health/inference``)."""
    import httpx

    return dict(httpx.get(base_url + "/api/health/inference").json()["scheduler"])


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


# ------------------------------------------------------------------ /v1/responses


def seal_reasoning(text: str, key: bytes) -> str:
    """Encrypted reasoning in the documented format, written with the cryptography package
    directly: base64url(version 1 | key id: the first 4 bytes of the key's SHA-256 |
    12-byte nonce | AES-256-GCM(text) with its tag), the version, key id and context
    string authenticated."""
    import base64
    import hashlib
    import os

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    header = b"\x01" + hashlib.sha256(key).digest()[:4]
    nonce = os.urandom(12)
    return base64.urlsafe_b64encode(header + nonce + AESGCM(key).encrypt(nonce, text.encode(), header + b"millm responses reasoning v1")).decode()


def open_reasoning(blob: str, key: bytes) -> str:
    """The text of an encrypted reasoning blob (the documented format), opened with ``key``."""
    import base64

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    raw = base64.urlsafe_b64decode(blob)
    header, nonce, sealed = raw[:5], raw[5:17], raw[17:]
    return AESGCM(key).decrypt(nonce, sealed, header + b"millm responses reasoning v1").decode()


class FinalizeRecorder:
    """Records ``outcome.cancelled`` of every generation's finalize."""

    def __init__(self) -> None:
        self.cancelled: list[bool] = []

    @hookimpl
    def millm_finalize(self, ctx: Any, request: Any, outcome: Any, out: Any) -> None:
        if outcome.kind == "generation":
            self.cancelled.append(bool(outcome.cancelled))


def sdk_validate(response: dict[str, Any] | None = None, events: list[dict[str, Any]] | None = None) -> None:
    """Validate a Response, and every event of a stream, strictly with the openai SDK's own
    pydantic types (what its parsers would build), failing on the first that does not fit."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    if response is not None:
        Response.model_validate(response, strict=True)
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for event in events or []:
        adapter.validate_python(event, strict=True)
