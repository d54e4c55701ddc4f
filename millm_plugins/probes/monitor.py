"""Armed probes on live traffic: one :class:`Monitor` per request, one :class:`RowMonitor`
per row.

Pre-forward groups the armed probes that can run on this request by what they read (a
tap, and the SAE for ``sae_features`` probes) and stacks their heads, so that each step
costs one matrix product per group for each row: ``[positions, width] @ [width, probes]``
(a long prefill ``ROWS`` positions at a time, an SAE's activations included). A row
aggregates those per-position logits online, per window (sum and count, maximum, latest
value), so what it holds does not grow with its length; the scores are taken when the
request is finalised. Nothing here touches I/O, and a probe
that fails marks its row's results ``error`` instead of failing the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import structlog

from millm_core.api import PassThrough, Readout, RowInfo, Tap

from .book import Armed
from .detector import Detector, logits, position_logits, stack
from .results import Finding, ProbeResult, Served, result, scored
from .trace import Trace
from .windows import Placement, Span, span_of

log = structlog.get_logger("millm.probes")


@dataclass(frozen=True)
class Group:
    """Probes that read the same thing at each position: ``tap`` (and ``sae``)."""

    tap: Tap
    sae: Any | None
    weights: np.ndarray  # [width, P]
    bias: np.ndarray  # [P]


@dataclass(frozen=True)
class Entry:
    """One armed probe in this request: where its logits are (``group``, ``column``), or
    why it does not run here (``skip``: a reason code)."""

    armed: Armed
    group: int = -1
    column: int = -1
    skip: str | None = None


INF = 1 << 62


class Running:
    """One group's per-position logits aggregated online over one window's positions
    ``[lo, hi)``: their count, sum and maximum, and the logits at the latest position, per
    column. The state is replaced whole at each update, so a reader on another thread
    always sees one consistent snapshot."""

    __slots__ = ("lo", "hi", "state")

    def __init__(self, lo: int, hi: int, columns: int) -> None:
        self.lo, self.hi = lo, hi
        self.state: tuple[int, np.ndarray, np.ndarray, np.ndarray, int] = (
            0, np.zeros(columns), np.full(columns, -np.inf), np.full(columns, np.nan), -1,
        )  # fmt: skip

    def add(self, start: int, z: np.ndarray) -> None:
        """Take logits ``z [n, P]`` of positions ``start .. start + n - 1``."""
        n = len(z)
        count, total, top, last, last_at = self.state
        if n == 1:  # a decode step
            if not self.lo <= start < self.hi:
                return
            row = z[0]
            self.state = (count + 1, total + row, np.maximum(top, row), row if start >= last_at else last, max(start, last_at))
            return
        lo, hi = max(self.lo, start), min(self.hi, start + n)
        if hi <= lo:
            return
        part = z[lo - start : hi - start]
        total, top = total + part.sum(0), np.maximum(top, part.max(0))
        if hi - 1 >= last_at:
            last, last_at = part[-1].copy(), hi - 1
        self.state = (count + len(part), total, top, last, last_at)

    def value(self, column: int, how: str) -> float | None:
        """Column ``column`` aggregated ``how`` (``mean``, ``max``, ``last``); None: no
        position of the window was read."""
        count, total, top, last, _ = self.state
        if count == 0:
            return None
        if how == "mean":
            return float(total[column] / count)
        return float(top[column] if how == "max" else last[column])


class RowMonitor(PassThrough):
    """A :class:`~millm_core.api.TokenProcessor` that listens to its row's residual
    vectors and aggregates each group's per-position logits online, per window: a row
    holds a few floats per group and window, however long it runs. It leaves the row's
    tokens and text as they are."""

    def __init__(self, info: RowInfo, groups: tuple[Group, ...], windows: tuple[dict[str, Span], ...]) -> None:
        self.info = info
        self.groups = groups
        self.windows = [
            {w: Running(lo, hi, g.bias.shape[0]) for w, (lo, hi) in ranges.items()} for g, ranges in zip(groups, windows, strict=True)
        ]
        self.fed = 0
        self.failed: str | None = None

    def on_residuals(self, readout: Readout) -> None:
        if self.failed is not None:
            return
        try:
            for index, group in enumerate(self.groups):
                vectors = readout.vectors.get(group.tap)
                if vectors is None:
                    continue
                running = self.windows[index].values()
                if len(vectors) == 1:  # a decode step: no slicing to do
                    z = logits(group.sae.encode(vectors) if group.sae is not None else vectors, group.weights, group.bias)
                    for window in running:
                        window.add(readout.start, z)
                else:
                    for offset, z in position_logits(vectors, group.sae, group.weights, group.bias):
                        for window in running:
                            window.add(readout.start + offset, z)
                self.fed = max(self.fed, readout.start + len(vectors))
        except Exception as exc:  # noqa: BLE001 - monitoring never fails the request it watches
            self.failed = type(exc).__name__
            log.error("probe_row_failed", row=self.info.index, exc_info=exc)

    def value(self, group: int, window: str, column: int, how: str) -> float | None:
        """The group's column ``column`` aggregated ``how`` over ``window`` (None: empty)."""
        running = self.windows[group].get(window)
        return None if running is None else running.value(column, how)


@dataclass
class Monitor:
    """One request's monitoring: its probes, groups, rows and trace."""

    trace: Trace
    served: Served  # the request-level part; per row, choice and prompt index are set
    entries: list[Entry]
    groups: tuple[Group, ...]
    last_users: tuple[Placement, ...] | None  # per conversation (prompt index); None: not a chat
    steered_layers: frozenset[int]
    rows: list[RowMonitor] = field(default_factory=list)

    def processor(self, info: RowInfo) -> RowMonitor:
        row = RowMonitor(info, self.groups, tuple(self._ranges(index, info) for index in range(len(self.groups))))
        self.rows.append(row)
        return row

    def last_user(self, info: RowInfo) -> Placement | None:
        """Where ``last_user`` is in this row's prompt (None: not a chat)."""
        if self.last_users is None:
            return None
        return self.last_users[info.prompt_index] if info.prompt_index < len(self.last_users) else Placement(None, "window_unplaced")

    def _ranges(self, group: int, info: RowInfo) -> dict[str, Span]:
        """The positions of each window the group's probes report, in this row's prompt
        (``last_user`` only where it is placed)."""
        prompt_tokens = info.prompt_tokens
        wanted = {w for e in self.entries if e.group == group and e.skip is None for w in e.armed.windows}
        last_user = self.last_user(info)
        placed = last_user.span if last_user is not None else None
        ranges = {"all": (0, INF), "prompt": (0, prompt_tokens), "response": (prompt_tokens, INF), "last_user": placed}
        return {w: span for w, span in ranges.items() if w in wanted and span is not None}

    def results(self, interrupted: bool) -> list[ProbeResult]:
        out: list[ProbeResult] = []
        for row in sorted(list(self.rows), key=lambda r: r.info.index):
            served = msgspec.structs.replace(self.served, choice=row.info.index, prompt_index=row.info.prompt_index)
            for entry in self.entries:
                detector = entry.armed.detector
                row_served = msgspec.structs.replace(
                    served, read_point=detector.read_point, steered_at_layer=detector.layer in self.steered_layers
                )
                for window in entry.armed.windows:
                    finding = self._finding(entry, window, row, interrupted)
                    out.append(result(detector, window, finding, row_served, self.trace))
        return out

    def _finding(self, entry: Entry, window: Any, row: RowMonitor, interrupted: bool) -> Finding:
        if entry.skip is not None:
            return Finding("skipped", entry.skip)
        if row.failed is not None:
            return Finding("error", "probe_failed")
        last_user = self.last_user(row.info)
        if window == "last_user":
            if last_user is None:
                return Finding("skipped", "not_a_chat")
            if last_user.span is None:
                return Finding("skipped", last_user.reason)
        span = span_of(window, row.info.prompt_tokens, row.fed, last_user.span if last_user else None)
        assert span is not None
        detector: Detector = entry.armed.detector
        value = row.value(entry.group, window, entry.column, detector.aggregation) if span[1] > span[0] else None
        return scored(detector.linked(value), span, interrupted)


def build_groups(runnable: list[tuple[Armed, Any | None]]) -> tuple[tuple[Group, ...], list[tuple[int, int]]]:
    """Group ``(armed probe, its SAE or None)`` pairs by what they read; returns the groups
    and each pair's ``(group, column)``."""
    keys: dict[tuple[Tap, int], list[int]] = {}
    for index, (armed, sae) in enumerate(runnable):
        det = armed.detector
        keys.setdefault((Tap(det.layer, det.read_point), id(sae)), []).append(index)  # type: ignore[arg-type]
    groups: list[Group] = []
    where: list[tuple[int, int]] = [(-1, -1)] * len(runnable)
    for (tap, _), members in keys.items():
        weights, bias = stack([runnable[i][0].detector for i in members])
        for column, i in enumerate(members):
            where[i] = (len(groups), column)
        groups.append(Group(tap, runnable[members[0]][1], weights, bias))
    return tuple(groups), where
