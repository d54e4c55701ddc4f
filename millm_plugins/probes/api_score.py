"""``POST /api/probes/score``: probes on given inputs, stateless and unsteered; and
``GET /api/probes/identity``, the served model's identity as a probe document records it.

Scoring reads the residual stream with the engine's own reader (``ResidualReader``), which
is never steered: every attached SAE is left out of the pass. Nothing is persisted (no
events), no steering header is sent, and nothing is generated, so the ``response`` window
is ``skipped`` (``no_response``). Inputs are chats (``messages``: rendered exactly as a
chat completion renders them, the chat template and one BOS) or raw ``token_ids``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import (
    FieldNotHonoured,
    InvalidRequest,
    MillmError,
    ModelNotFound,
    ResidualReader,
    RouteDoc,
    ServedModel,
    app_context,
    json_response,
    read_json,
    request_id,
    until_disconnect,
)

from .api_events import ROUTES as EVENT_ROUTES
from .book import Armed
from .detector import Detector, identity_mismatches, score_tokens
from .document import Window
from .gates import resident
from .results import Finding, ProbeResult, Served, ordered, result, scored
from .saes import attached_sae, usable
from .settings import MAX_ARMED, SCORE_MAX_INPUTS, SCORE_MAX_TOKENS
from .state import ProbesState, state_of
from .trace import trace_of
from .windows import Placement, blanked, last_user_index, place, span_of

NonNegative = Annotated[int, Meta(ge=0)]


class ScoreMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One message of a chat input (``ScoreInput.messages``): a role and its text, rendered as a chat completion renders them."""

    role: str
    content: str


class ScoreInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One input: a chat (``messages``) or ``token_ids``, not both."""

    messages: Annotated[list[ScoreMessage], Meta(min_length=1)] | None = None
    token_ids: Annotated[list[NonNegative], Meta(min_length=1)] | None = None


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``probe_ids`` (default: the armed probes), ``windows`` (default: each probe's armed
    windows, or ``all`` for a probe that is not armed) and the ``inputs``."""

    probe_ids: list[str] | None = None
    windows: list[Window] | None = None
    inputs: Annotated[list[ScoreInput], Meta(min_length=1)]


class ScoreResponse(msgspec.Struct, kw_only=True):
    """One ``mi.probe.result/v1`` per input, probe and window (``served.input`` says which
    input), in the header's order within each input."""

    object: str = "list"
    model: str
    data: list[ProbeResult]


class IdentityInfo(msgspec.Struct, kw_only=True):
    """A served model's identity, as a probe document's ``model`` records it."""

    model: str
    d_model: int
    n_layers: int
    chat_template_sha256: str | None


def _probes(state: ProbesState, body: ScoreRequest, limit: int) -> list[Armed]:
    if body.probe_ids is None:
        chosen = list(state.book.armed)
        if not chosen:
            raise InvalidRequest("no probe is armed; name the probes to score with probe_ids", param="probe_ids")
    else:
        if not body.probe_ids:
            raise InvalidRequest("probe_ids names no probe", param="probe_ids")
        armed = {a.detector.probe_id: a for a in state.book.armed}
        chosen = [armed.get(i) or Armed(state.book.get(i).detector, ("all",)) for i in dict.fromkeys(body.probe_ids)]
    if len(chosen) > limit:
        raise InvalidRequest(f"{len(chosen)} probes named; one request scores at most {limit} (probes_max_armed)", param="probe_ids")
    if body.windows is not None:
        if not body.windows:
            raise InvalidRequest("windows names no window", param="windows")
        chosen = [Armed(a.detector, tuple(dict.fromkeys(body.windows))) for a in chosen]
    return chosen


async def _tokens(
    request: Request, model: ServedModel, inputs: list[ScoreInput], needs_user: bool
) -> list[tuple[list[int], Placement | None]]:
    app = app_context(request)
    engine = model.engine
    out: list[tuple[list[int], Placement | None]] = []
    for index, item in enumerate(inputs):
        if (item.messages is None) == (item.token_ids is None):
            raise InvalidRequest("an input is either messages or token_ids", param=f"inputs[{index}]")
        if item.token_ids is not None:
            for j, token in enumerate(item.token_ids):
                if token >= model.info.vocab_size:
                    raise InvalidRequest(
                        f"token id {token} is past the vocabulary ({model.info.vocab_size})", param=f"inputs[{index}].token_ids[{j}]"
                    )
            out.append((list(item.token_ids), None))
            continue
        assert item.messages is not None
        messages = [{"role": m.role, "content": m.content} for m in item.messages]
        try:
            ids = list(await app.run_text(lambda messages=messages: engine.render_chat(messages)))  # type: ignore[misc]
        except MillmError as exc:
            raise InvalidRequest(exc.message, param=f"inputs[{index}].messages", code=exc.code) from exc
        where: Placement | None = Placement(None, "window_unplaced")
        user = last_user_index(messages)
        if not needs_user:
            where = None
        elif user is None:
            where = Placement(None, "no_user_message")
        else:
            try:
                other = await app.run_text(lambda messages=messages, user=user: engine.render_chat(blanked(messages, user)))  # type: ignore[misc]
                where = place(ids, other)
            except Exception:  # noqa: BLE001 - a template that refuses the emptied message: the window is not placed
                pass
        out.append((ids, where))
    return out


def _finding(det: Detector, window: Window, residual: np.ndarray, sae: Any | None, where: Placement | None, is_chat: bool) -> Finding:
    if window == "response":
        return Finding("skipped", "no_response")
    if window == "last_user":
        if not is_chat:
            return Finding("skipped", "not_a_chat")
        if where is None or where.span is None:
            return Finding("skipped", where.reason if where is not None else "window_unplaced")
    n = len(residual)
    span = span_of(window, n, n, where.span if where is not None else None)
    assert span is not None
    return scored(score_tokens(det, residual, sae, span), span)


Run = tuple[Armed, str | None, Any | None]  # a probe, why it is skipped (None: it runs), its SAE


def _findings_at(engine: ResidualReader, layer: int, runs: list[Run], inputs: list[tuple[list[int], Placement | None]],
                 chats: list[bool]) -> dict[tuple[int, int, str], Finding]:  # fmt: skip
    """On the model thread: the findings of the probes reading ``layer``, by ``(input,
    probe, window)``. Only this layer's residuals are held, and only scalars come back."""
    residuals: list[Any] = list(engine.residuals([ids for ids, _ in inputs], layer))
    out: dict[tuple[int, int, str], Finding] = {}
    for index, ((_, where), is_chat) in enumerate(zip(inputs, chats, strict=True)):
        residual = np.asarray(residuals[index])
        residuals[index] = None  # let each input's vectors go once they are read
        for number, (probe, skip, sae) in enumerate(runs):
            det = probe.detector
            if skip is None and det.layer == layer:
                for window in probe.windows:
                    out[(index, number, window)] = _finding(det, window, residual, sae, where, is_chat)
    return out


async def score(request: Request) -> Response:
    body = await read_json(request, ScoreRequest)
    return await until_disconnect(request, _score(request, body))


async def _score(request: Request, body: ScoreRequest) -> Response:
    app = app_context(request)
    state = state_of(app)
    max_inputs, max_tokens = int(SCORE_MAX_INPUTS.get(app.settings)), int(SCORE_MAX_TOKENS.get(app.settings))
    if len(body.inputs) > max_inputs:
        raise InvalidRequest(
            f"{len(body.inputs)} inputs sent; one request scores at most {max_inputs} (probes_score_max_inputs)", param="inputs"
        )
    probes = _probes(state, body, int(MAX_ARMED.get(app.settings)))
    model = resident(app)
    engine = model.engine
    if not isinstance(engine, ResidualReader):
        raise FieldNotHonoured(
            f"the {model.info.engine} engine serving {model.info.served_name!r} cannot read the residual stream", param="inputs"
        )
    inputs = await _tokens(request, model, body.inputs, any("last_user" in p.windows for p in probes))
    total = sum(len(ids) for ids, _ in inputs)
    if total > max_tokens:
        raise InvalidRequest(
            f"the inputs hold {total} tokens; one request reads at most {max_tokens} (probes_score_max_tokens)", param="inputs"
        )
    for index, (ids, _) in enumerate(inputs):
        if len(ids) > model.info.context_length:
            raise InvalidRequest(f"input {index} is {len(ids)} tokens; the model reads at most {model.info.context_length}",
                                 code="context_length_exceeded", param=f"inputs[{index}]")  # fmt: skip
    identity = state.identity(model)
    runs: list[Run] = []
    for probe in probes:
        det = probe.detector
        sae = attached_sae(app, det.sae_id, det.layer) if det.basis == "sae_features" and det.sae_id else None
        skip = "model_mismatch" if identity_mismatches(det.identity, identity) else None
        if skip is None and det.basis == "sae_features" and not usable(sae, det.width):
            skip = "sae_not_attached"
        runs.append((probe, skip, sae))
    layers = sorted({p.detector.layer for p, skip, _ in runs if skip is None})
    chats = [item.messages is not None for item in body.inputs]
    findings: dict[tuple[int, int, str], Finding] = {}
    for layer in layers:  # one layer at a time, scored on the model thread
        findings.update(await app.run_model(lambda layer=layer: _findings_at(engine, layer, runs, inputs, chats)))  # type: ignore[misc]
    trace = trace_of({"traceparent": request.headers.getlist("traceparent")})
    rid = request_id(request)
    results: list[ProbeResult] = []
    for index in range(len(inputs)):
        served = Served(request_id=rid, endpoint="probes.score", model=model.info.served_name, engine=model.info.engine,
                        input=index, read_point="unsteered", steered_at_layer=False)  # fmt: skip
        found: list[ProbeResult] = []
        for number, (probe, skip, _) in enumerate(runs):
            for window in probe.windows:
                finding = Finding("skipped", skip) if skip is not None else findings[(index, number, window)]
                found.append(result(probe.detector, window, finding, served, trace))
        results.extend(ordered(found))
    return json_response(ScoreResponse(model=model.info.served_name, data=results))


async def identity(request: Request) -> Response:
    app = app_context(request)
    name = request.query_params.get("model")
    model = resident(app) if name is None else next((m for m in app.models if m.info.served_name == name), None)
    if model is None:
        raise ModelNotFound(f"no served model is named {name!r}", param="model")
    have = state_of(app).identity(model)
    return json_response(IdentityInfo(model=model.info.served_name, d_model=have.d_model, n_layers=have.n_layers,
                                      chat_template_sha256=have.chat_template_sha256))  # fmt: skip


Route = tuple[str, Any, list[str], RouteDoc]
ROUTES: tuple[Route, ...] = (
    (
        "/api/probes/score",
        score,
        ["POST"],
        RouteDoc(
            "Score probes on inputs: stateless, unsteered, nothing persisted", ScoreRequest, ScoreResponse, errors=("400", "404", "503")
        ),
    ),
    (
        "/api/probes/identity",
        identity,
        ["GET"],
        RouteDoc("A served model's identity (?model=; default: the first served)", response=IdentityInfo, errors=("404", "503")),
    ),
    *EVENT_ROUTES,
)
