"""Probes: linear detectors on the residual stream, imported as ``mi.probe/v1`` documents,
armed through gates (:mod:`.gates`) and run on every row of live chat and text
completions, in the shared batch.

While a probe is armed, every chat and text completion reports each armed probe's windows
(``mi.probe.result/v1``): in ``X-miLLM-Probe-Verdicts`` and ``millm_probe_verdicts`` beside
``choices``, or, on a stream, in a closing chunk before the activations and steering
chunks. Results of generations also go to the events log (an ended-early stream's as
``interrupted``). Nothing is added while no probe is armed.

Reading uses the engine's taps (``Capability.TAPS``); on an engine without them, or a
model the probe was not fitted on, results say ``skipped`` with the reason instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from millm_core.api import (
    AppContext,
    ChatRender,
    Finalization,
    ForwardPlan,
    Outcome,
    PluginSetting,
    RequestContext,
    ServedModel,
    StashKey,
    hookimpl,
    with_opening,
)
from millm_plugins.scoring.public import is_scoring

from . import api, api_score, header
from .book import ProbeBook
from .events import EventLog
from .gates import check_limit
from .live import AltRender, monitor_for, not_monitored, request_trace
from .monitor import Monitor
from .results import ordered
from .settings import ALL, EVENTS_MAX, MAX_ARMED
from .state import STATE, ProbesState, state_of
from .windows import blanked, last_user_index

BODY_KEY = "millm_probe_verdicts"
CLOSING_ORDER = 10  # before SAE activations (20) and the steering report (90)
MONITOR = StashKey[Monitor]("probes.monitor")
ALT = StashKey[dict[int, AltRender]]("probes.alt_render")  # per conversation


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    for setting in ALL:
        register(setting)


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    # Fixed paths first: /api/probes/{probe_id} would otherwise take "events" and "score".
    for path, handler, methods, doc in (*api_score.ROUTES, *api.ROUTES):
        register(path, handler, methods, doc=doc)


@hookimpl
def millm_startup(app: AppContext) -> None:
    """Migrate the plugin's tables, read the probes and their arming back, and keep
    watching the database for other servers' writes (a database file only)."""
    limit = int(MAX_ARMED.get(app.settings))
    book = ProbeBook(store=app.store, limit_gate=lambda armed_ids, probe_id: check_limit(armed_ids, probe_id, limit))
    app.stash[STATE] = ProbesState(book=book, events=EventLog(store=app.store, keep=int(EVENTS_MAX.get(app.settings))))
    book.start_watching()


@hookimpl
def millm_shutdown(app: AppContext) -> None:
    """Stop watching the database, and write the probe results still queued for the events
    log before it closes."""
    if STATE in app.stash:
        state = state_of(app)
        state.book.stop_watching()
        state.events.close()


@hookimpl(trylast=True)
def millm_render_chat(ctx: RequestContext, request: Any, model: ServedModel, chat: ChatRender) -> None:
    """Render the chat again with the last user message emptied, to place ``last_user``
    (last, so that every other plugin's changes are in; only while such a window is armed,
    and never for a scoring request, which is not monitored)."""
    if STATE not in ctx.app.stash or is_scoring(request) or not any("last_user" in a.windows for a in state_of(ctx.app).book.armed):
        return
    index = last_user_index(chat.messages)
    if index is None:
        ctx.stash.setdefault(ALT, dict)[chat.conversation] = AltRender(None, "no_user_message")
        return
    messages = with_opening(blanked(chat.messages, index), chat.opening)
    try:
        if chat.tools is not None:
            ids = model.engine.render_chat(messages, tools=chat.tools, **chat.template_kwargs)
        else:
            ids = model.engine.render_chat(messages, **chat.template_kwargs)
    except Exception:  # noqa: BLE001 - a template that refuses the emptied message: the window is not placed
        ctx.stash.setdefault(ALT, dict)[chat.conversation] = AltRender(None, "window_unplaced")
        return
    ctx.stash.setdefault(ALT, dict)[chat.conversation] = AltRender(tuple(ids))


@hookimpl(trylast=True)
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    """Tap and monitor this request's rows for the armed probes (last, so that the
    steering deltas are known: results say whether a row was steered at the probe's layer)."""
    if STATE not in ctx.app.stash:
        return
    state = state_of(ctx.app)
    armed = state.book.armed  # one snapshot for the whole request
    if not armed:
        return
    alts: dict[int, AltRender] = ctx.stash[ALT] if ALT in ctx.stash else {}
    monitor = monitor_for(state, ctx, plan, armed, request_trace(ctx), alts)
    ctx.stash[MONITOR] = monitor
    plan.add_processor(monitor.processor)


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    if STATE not in ctx.app.stash or ctx.model is None:
        return
    state = state_of(ctx.app)
    if outcome.kind == "generation":
        if MONITOR not in ctx.stash:
            return
        monitor = ctx.stash[MONITOR]
        results = ordered(monitor.results(interrupted=outcome.cancelled))
        state.events.record(results)
        if outcome.cancelled:
            return  # the stream is gone: the results are in the events log only
    elif outcome.kind in ("scoring", "embeddings"):
        armed = state.book.armed
        if not armed:
            return
        results = ordered(not_monitored(armed, ctx, ctx.model, outcome.kind, request_trace(ctx)))
    else:
        return
    if not ctx.stream:
        out.headers[header.NAME] = header.value(results)
    out.extend(BODY_KEY, msgspec.to_builtins(results), order=CLOSING_ORDER)
