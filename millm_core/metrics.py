"""Prometheus metrics (``GET /metrics``) and the access log: one registry per app (no
process-global state), fed by an ASGI middleware (requests by route, status and code;
one access-log line each), by the response path (tokens, time to first token,
inter-token latency) and, at scrape time, by the scheduler's counters.

Plugins may add their own metrics to ``AppContext.metrics`` (a
``prometheus_client.CollectorRegistry``), for example the steering plugin's count of
steered requests by kind.

One app may be started more than once (served, stopped, served again). What a start
registers (the scheduler's collector, the plugins' metrics) belongs to that start: the next
start replaces it, so registering again is never a duplicate. The request and token metrics
belong to the app and carry on across starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger("millm.access")

# Latency buckets (seconds): CPU decode steps are tens of ms, prefill up to seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _SchedulerCollector(Collector):
    """Reads the scheduler's counters when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._snapshot()
        yield GaugeMetricFamily("millm_queue_depth", "Requests and model calls waiting for the model thread", value=stats.queued)
        yield GaugeMetricFamily("millm_running_rows", "Rows (sequences) in the running batch", value=stats.active_rows)
        yield GaugeMetricFamily("millm_running_jobs", "Requests whose rows are being generated", value=stats.running_jobs)
        yield CounterMetricFamily("millm_scheduler_steps", "Decode steps run", value=stats.steps)
        yield CounterMetricFamily("millm_cancelled_rows", "Rows cancelled (client gone)", value=stats.cancelled_rows)
        yield CounterMetricFamily("millm_failed_jobs", "Requests that failed while running", value=stats.failed_jobs)


class AppRegistry(CollectorRegistry):
    """A registry that knows which collectors the current start of the app registered,
    so that the next start can drop them before registering its own. Two registrations of
    one name within a start are still refused."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self._this_start: list[Collector] | None = None  # None: before the first start

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if self._this_start is not None:
            self._this_start.append(collector)

    def new_start(self) -> None:
        """Forget what the previous start registered (its scheduler, its plugins)."""
        for collector in self._this_start or ():
            self.unregister(collector)
        self._this_start = []


class Metrics:
    """The app's metrics. ``registry`` is what ``/metrics`` renders."""

    def __init__(self) -> None:
        self.registry = AppRegistry()
        self.requests = Counter(
            "millm_requests", "HTTP requests by route template, status and error code", ["route", "status", "code"], registry=self.registry
        )
        self.prompt_tokens = Counter("millm_prompt_tokens", "Prompt tokens read", ["endpoint"], registry=self.registry)
        self.completion_tokens = Counter("millm_completion_tokens", "Completion tokens generated", ["endpoint"], registry=self.registry)
        self.ttft = Histogram(
            "millm_time_to_first_token_seconds", "Request start to its first token", buckets=TTFT_BUCKETS, registry=self.registry
        )
        self.itl = Histogram(
            "millm_inter_token_latency_seconds", "Time between a request's successive tokens", buckets=ITL_BUCKETS, registry=self.registry
        )
        self.step = Histogram(
            "millm_scheduler_step_seconds",
            "Duration of one decode step (a batch's forward pass and sampling)",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )

    def watch_scheduler(self, snapshot: Callable[[], Any]) -> None:
        """Expose the scheduler's counters (read at scrape time). The lifespan calls this
        once per start, before the plugins start: it begins a new start, replacing what
        the previous one registered (its scheduler's collector, the plugins' metrics)."""
        self.registry.new_start()
        self.registry.register(_SchedulerCollector(snapshot))

    def tokens(self, endpoint: str, prompt: int, completion: int) -> None:
        self.prompt_tokens.labels(endpoint).inc(prompt)
        if completion:
            self.completion_tokens.labels(endpoint).inc(completion)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class TokenClock:
    """Times one request's tokens: the first (TTFT, from the request's start) and the gaps
    between later ones."""

    __slots__ = ("_metrics", "_started", "_last")

    def __init__(self, metrics: Metrics, started: float) -> None:
        self._metrics = metrics
        self._started = started
        self._last: float | None = None

    def tick(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._metrics.ttft.observe(now - self._started)
        else:
            self._metrics.itl.observe(now - self._last)
        self._last = now


def route_of(routes: list[BaseRoute], scope: Scope) -> str:
    """The matched route's path template (bounded label values), or ``other``."""
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", "other"))
    return "other"


class AccessMiddleware:
    """Counts every response by route, status and error code, and logs one access line
    (method, path, status, duration, request id, tokens) at info."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Callable[[], list[BaseRoute]]) -> None:
        self.app = app
        self.metrics = metrics
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, record_status)
        except Exception:
            failed = True  # answered by the outermost error handler, after this layer
            raise
        finally:
            state = scope.get("state", {})
            code = "internal_error" if failed else (str(state.get("error_code", "")) if status >= 400 else "")
            status = 500 if failed else status
            self.metrics.requests.labels(route_of(self._routes(), scope), str(status), code).inc()
            log.info(
                "request",
                method=scope.get("method"),
                path=scope.get("path"),
                status=status,
                code=code or None,
                duration_ms=round((time.monotonic() - started) * 1000, 1),
                request_id=state.get("request_id"),
                prompt_tokens=state.get("prompt_tokens"),
                completion_tokens=state.get("completion_tokens"),
                **_plugin_fields(state),
            )


_CORE_FIELDS = frozenset(
    {"request_id", "error_code", "prompt_tokens", "completion_tokens", "method", "path", "status", "code", "duration_ms", "event"}
)


def _plugin_fields(state: Mapping[str, Any]) -> dict[str, Any]:
    """What plugins put on the request's log line (``ctx.access_log``): plain values only."""
    return {k: v for k, v in state.items() if k not in _CORE_FIELDS and isinstance(v, str | int | float | bool | list)}
