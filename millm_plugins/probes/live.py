"""Armed probes on a request: what runs (pre-forward), and the results (finalize).

Nothing is done for a request while no probe is armed, so its response is unchanged byte
for byte. Otherwise every armed probe reports each of its windows on every row: a probe
that cannot run here says why (``skipped`` with a reason code); scoring and embeddings
requests are ``not_monitored``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from millm_core.api import Capability, ForwardPlan, Joinable, RequestContext, ServedModel

from .book import Armed
from .detector import identity_mismatches
from .monitor import Entry, Monitor, build_groups
from .results import Finding, ProbeResult, Served, result
from .saes import attached_sae, usable
from .state import ProbesState
from .trace import Trace, trace_of
from .windows import Placement, place


@dataclass(frozen=True)
class AltRender:
    """The chat rendered again with the last user message's content emptied (``ids``),
    or why it could not be (``reason``)."""

    ids: tuple[int, ...] | None
    reason: str = "ok"


def backend(model: ServedModel) -> str:
    engine = model.engine
    return "batched" if isinstance(engine, Joinable) and getattr(engine, "batches_requests", True) else "serial"


def request_served(ctx: RequestContext, model: ServedModel, *, generation: bool) -> Served:
    return Served(
        request_id=ctx.request_id, endpoint=ctx.endpoint, model=model.info.served_name, engine=model.info.engine,
        backend=backend(model) if generation else None,  # type: ignore[arg-type]
        stream=ctx.stream, read_point="unsteered" if not generation else "pre_steering",
    )  # fmt: skip


def _skip(state: ProbesState, ctx: RequestContext, model: ServedModel, armed: Armed) -> tuple[str | None, Any | None]:
    """Why ``armed`` cannot run on this request (None: it runs), and its SAE."""
    det = armed.detector
    if identity_mismatches(det.identity, state.identity(model)):
        return "model_mismatch", None
    if Capability.TAPS not in model.capabilities:
        return "engine_cannot_tap", None
    if det.basis != "sae_features":
        return None, None
    assert det.sae_id is not None
    sae = attached_sae(ctx.app, det.sae_id, det.layer)
    if not usable(sae, det.width):  # detached, resized, or not encoded faithfully since arming
        return "sae_not_attached", None
    return None, sae


def placements(ctx: RequestContext, alts: Mapping[int, AltRender]) -> tuple[Placement, ...] | None:
    """Where ``last_user`` is in each of this request's served prompts, by conversation
    (None: not a chat)."""
    if ctx.endpoint != "chat.completions":
        return None
    out: list[Placement] = []
    for index, served in enumerate(ctx.prompts or []):
        alt = alts.get(index)
        if alt is None or alt.ids is None:
            out.append(Placement(None, alt.reason if alt is not None else "window_unplaced"))
        else:
            out.append(place(served, alt.ids))
    return tuple(out)


def monitor_for(state: ProbesState, ctx: RequestContext, plan: ForwardPlan, armed: Sequence[Armed], trace: Trace,
                alts: Mapping[int, AltRender]) -> Monitor:  # fmt: skip
    """The request's monitor; adds its taps to ``plan`` (only where the engine can tap)."""
    model = ctx.model
    assert model is not None
    skips: list[str | None] = []
    runnable: list[tuple[Armed, Any | None]] = []
    for probe in armed:
        reason, sae = _skip(state, ctx, model, probe)
        skips.append(reason)
        if reason is None:
            runnable.append((probe, sae))
    groups, where = build_groups(runnable)
    entries: list[Entry] = []
    column = iter(where)
    for probe, reason in zip(armed, skips, strict=True):
        if reason is not None:
            entries.append(Entry(probe, skip=reason))
        else:
            group, col = next(column)
            entries.append(Entry(probe, group=group, column=col))
    for reads in groups:
        plan.taps.add(reads.tap)
    needs_user = any("last_user" in probe.windows for probe in armed)
    return Monitor(
        trace=trace, served=request_served(ctx, model, generation=True), entries=entries, groups=groups,
        last_users=placements(ctx, alts) if needs_user else None,
        steered_layers=frozenset(plan.deltas),
    )  # fmt: skip


def not_monitored(armed: Sequence[Armed], ctx: RequestContext, model: ServedModel, kind: str, trace: Trace) -> list[ProbeResult]:
    """Every armed probe's windows on a scoring or embeddings request."""
    reason = "scoring_request" if kind == "scoring" else "embeddings_request"
    served = request_served(ctx, model, generation=False)
    return [result(p.detector, window, Finding("not_monitored", reason), served, trace) for p in armed for window in p.windows]


def request_trace(ctx: RequestContext) -> Trace:
    return trace_of(ctx.headers)
