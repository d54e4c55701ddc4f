"""The events log over HTTP: ``GET /api/probes/events`` (filtered by ``probe_id``,
``request_id`` or ``trace_id``; ``limit`` and ``offset``; newest first) and
``GET /api/probes/events/{event_id}`` (an event's id is its result's ``result_id``)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import InvalidRequest, RouteDoc, app_context, json_response

from .results import ProbeResult
from .state import state_of

MAX_LIMIT = 1000


class EventList(msgspec.Struct, kw_only=True):
    """One page of the events log, newest first; ``total`` counts every match."""

    object: str = "list"
    total: int
    limit: int
    offset: int
    data: list[ProbeResult]


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer", param=name) from None
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be {low}–{high}", param=name)
    return value


async def list_events(request: Request) -> Response:
    events = state_of(app_context(request)).events
    limit = _int(request, "limit", 100, 1, MAX_LIMIT)
    offset = _int(request, "offset", 0, 0, 2**62)
    params = request.query_params
    await events.flushed()  # a request's results are readable once its response ended
    total, data = await asyncio.to_thread(
        lambda: events.read(probe_id=params.get("probe_id"), request_id=params.get("request_id"), trace_id=params.get("trace_id"),
                            limit=limit, offset=offset)
    )  # fmt: skip
    return json_response(EventList(total=total, limit=limit, offset=offset, data=data))


async def get_event(request: Request) -> Response:
    events = state_of(app_context(request)).events
    await events.flushed()
    return json_response(await asyncio.to_thread(events.one, request.path_params["event_id"]))


Route = tuple[str, Any, list[str], RouteDoc]
ROUTES: tuple[Route, ...] = (
    (
        "/api/probes/events",
        list_events,
        ["GET"],
        RouteDoc("Probe results of past generations, newest first", response=EventList, errors=("400", "503")),
    ),
    (
        "/api/probes/events/{event_id}",
        get_event,
        ["GET"],
        RouteDoc("One probe result from the events log", response=ProbeResult, errors=("404", "503")),
    ),
)
