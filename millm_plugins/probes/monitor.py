"""Armed probes on live traffic: one :class:`Monitor` per request, one :class:`RowMonitor`
per row.

Pre-forward groups the armed probes that can run on this request by what they read (a
tap, and the SAE for ``sae_features`` probes) and stacks their heads, so that each step
costs one matrix product per group for each row: ``[positions, width] @ [width, probes]``.
A row keeps only those per-position logits (a few floats per position); the windows are
cut and aggregated when the request is finalised. Nothing here touches I/O, and a probe
that fails marks its row's results ``error`` instead of failing the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import structlog

from millm_core.api import Readout, RowInfo, Tap

from .book import Armed
from .detector import Detector, logits, stack
from .results import Finding, ProbeResult, Served, result, scored
from .trace import Trace
from .windows import Placement, span_of

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


class RowMonitor:
    """A :class:`~millm_core.api.TokenProcessor` that listens to its row's residual
    vectors and keeps each group's per-position logits."""

    def __init__(self, info: RowInfo, groups: tuple[Group, ...]) -> None:
        self.info = info
        self.groups = groups
        self.chunks: list[list[tuple[int, np.ndarray]]] = [[] for _ in groups]
        self.failed: str | None = None

    def logit_bias(self) -> Mapping[int, float] | None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        return text, False

    def flush(self) -> str:
        return ""

    def on_residuals(self, readout: Readout) -> None:
        if self.failed is not None:
            return
        try:
            for index, group in enumerate(self.groups):
                vectors = readout.vectors.get(group.tap)
                if vectors is None:
                    continue
                feats = group.sae.encode(vectors) if group.sae is not None else vectors
                self.chunks[index].append((readout.start, logits(feats, group.weights, group.bias)))
        except Exception as exc:  # noqa: BLE001 - monitoring never fails the request it watches
            self.failed = type(exc).__name__
            log.error("probe_row_failed", row=self.info.index, exc_info=exc)

    def logits(self, group: int) -> np.ndarray:
        """The group's logits ``[fed, P]`` by position (a snapshot: the row may still run)."""
        chunks = sorted(list(self.chunks[group]), key=lambda c: c[0])
        if not chunks:
            return np.zeros((0, self.groups[group].bias.shape[0]))
        fed = max(start + len(z) for start, z in chunks)
        out = np.full((fed, chunks[0][1].shape[1]), np.nan)
        for start, z in chunks:
            out[start : start + len(z)] = z
        return out


@dataclass
class Monitor:
    """One request's monitoring: its probes, groups, rows and trace."""

    trace: Trace
    served: Served  # the request-level part; per row, choice and prompt index are set
    entries: list[Entry]
    groups: tuple[Group, ...]
    last_user: Placement | None  # None: not a chat
    steered_layers: frozenset[int]
    rows: list[RowMonitor] = field(default_factory=list)

    def processor(self, info: RowInfo) -> RowMonitor:
        row = RowMonitor(info, self.groups)
        self.rows.append(row)
        return row

    def results(self, interrupted: bool) -> list[ProbeResult]:
        out: list[ProbeResult] = []
        for row in sorted(list(self.rows), key=lambda r: r.info.index):
            served = msgspec.structs.replace(self.served, choice=row.info.index, prompt_index=row.info.prompt_index)
            cache: dict[int, np.ndarray] = {}
            for entry in self.entries:
                detector = entry.armed.detector
                row_served = msgspec.structs.replace(
                    served, read_point=detector.read_point, steered_at_layer=detector.layer in self.steered_layers
                )
                for window in entry.armed.windows:
                    finding = self._finding(entry, window, row, cache, interrupted)
                    out.append(result(detector, window, finding, row_served, self.trace))
        return out

    def _finding(self, entry: Entry, window: Any, row: RowMonitor, cache: dict[int, np.ndarray], interrupted: bool) -> Finding:
        if entry.skip is not None:
            return Finding("skipped", entry.skip)
        if row.failed is not None:
            return Finding("error", "probe_failed")
        if window == "last_user":
            if self.last_user is None:
                return Finding("skipped", "not_a_chat")
            if self.last_user.span is None:
                return Finding("skipped", self.last_user.reason)
        if entry.group not in cache:
            cache[entry.group] = row.logits(entry.group)
        z = cache[entry.group][:, entry.column]
        span = span_of(window, row.info.prompt_tokens, len(z), self.last_user.span if self.last_user else None)
        assert span is not None
        detector: Detector = entry.armed.detector
        return scored(detector.score(z[span[0] : span[1]]), span, interrupted)


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
