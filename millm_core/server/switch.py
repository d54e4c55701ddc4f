"""Switching models by name: a request that names a model which is not loaded, but which
this server can load (``GET /api/models``), loads it (``--auto-load``, on by default).

One model is resident after a switch: the loaded models are unloaded first, gracefully
(their running requests finish, up to ``--graceful-unload-timeout``). Nothing is unloaded
for a request that would be refused anyway, or for a model that cannot be loaded: before
the switch, in this order,

1. the model is locked out (``409 model_locked``), or a load or unload is in progress
   (``503 model_busy`` with ``Retry-After``);
2. the fields the engine that would serve it cannot honour (its declared capabilities),
   the plugins' ``millm_validate_switch`` problems, and strict mode's unused fields;
3. the engine's preflight: a quantization it cannot load (``400 unsupported_quantization``)
   and the memory check (``503 insufficient_memory``: the weights need more than is free
   plus what unloading the residents gives back, with the figures);
4. ``millm_model_unloading``: a plugin may keep a resident (``409 weights_unsaved``, …).

The switch runs as a task of the server's, not of the request: a request that goes away
mid-switch leaves it running to its end. A load that fails once the residents are gone
answers ``500 model_load_failed`` with the failure's message; readiness then answers 503
until a model is loaded again. A failed load is answered from memory for
``LOAD_FAILURE_MEMORY_S`` seconds (no second eviction for it). Work that may not evict the
live model (``ctx.may_switch`` false: batch lines) waits instead, unless nothing is loaded.
"""

from __future__ import annotations

import asyncio

import structlog

from ..engine import EngineFactory, ModelLocation
from ..errors import MillmError, ModelLoadFailed
from ..lifecycle import Candidate
from ..registry import ServedModel, SwitchTarget
from .pipeline import Admission, check_field_policy, problems_error, refuse_unused_if_strict
from .routes.lifecycle import check_loadable, find_candidate, load_planned, locate_engine, on_model_thread, unload_now
from .state import AppState

log = structlog.get_logger("millm.lifecycle")

MODEL_ENDPOINTS = frozenset({"chat.completions", "completions", "embeddings"})


async def ensure_requested_model(admission: Admission) -> None:
    """Load the model the request names when it is not loaded but loadable; return at
    once when it is loaded, unknown (admission answers 404) or ``--auto-load`` is off.
    Work that may not switch (a Batch API line) is told to wait (503 ``model_busy``) for a
    loadable model that is not loaded, whether or not ``--auto-load`` is on."""
    state, ctx, request = admission.state, admission.ctx, admission.request
    if ctx.endpoint not in MODEL_ENDPOINTS or (not state.settings.auto_load and ctx.may_switch):
        return
    name = state.host.requested_model(ctx, request)
    if name is None or state.models.get(name) is not None:
        return
    lifecycle = state.lifecycle
    if name in lifecycle.loading:
        raise lifecycle.busy_error(f"The model '{name}' is loading; retry shortly")
    candidate = await find_candidate(state, name)
    if candidate is None:
        return
    lifecycle.check_lock(name, "a request for")
    if not ctx.may_switch and (len(state.models) or not state.settings.auto_load):
        why = "the server loads a model only when told (--auto-load false)" if not state.settings.auto_load else "this request may not unload the model served now"
        raise lifecycle.busy_error(f"'{name}' is not loaded, and {why}; it waits for '{name}' (POST /api/models/{name}/load)")
    if lifecycle.busy:
        doing = ", ".join(sorted(lifecycle.loading | lifecycle.unloading))
        raise lifecycle.busy_error(f"Another load or unload is in progress ({doing}); retry once it finishes")
    failed = lifecycle.recent_failure(name)
    if failed is not None:
        raise failed  # a load that just failed is not tried again (nor the resident evicted for it)
    location, factory = await on_model_thread(state, lambda: locate_engine(state, candidate))
    target = SwitchTarget(name=name, engine=factory.name, capabilities=factory.capabilities, residents=tuple(m.info.served_name for m in state.models))
    check_field_policy(state, ctx, request, target.capabilities, target.engine, admission.refused_known)
    problems = state.host.validate_switch(ctx, request, target)
    if problems:
        raise problems_error(problems)
    refuse_unused_if_strict(ctx)
    residents = list(state.models)
    await asyncio.to_thread(check_loadable, state, name, location, factory, residents)
    # Checked again: another request may have begun a switch while this one planned.
    lifecycle.check_lock(name, "a request for")
    if state.models.get(name) is not None:
        return
    if lifecycle.busy or list(state.models) != residents:
        raise lifecycle.busy_error(f"Another load or unload began meanwhile; retry once it finishes ({name})")
    for model in residents:
        state.host.model_unloading(state.app, model)  # a plugin may keep it: nothing is unloaded
    log.info("model_switch", model=name, unloading=[m.info.served_name for m in residents], request_id=ctx.request_id)
    # The switch belongs to the server, not to this request: if its client leaves (or a
    # batch line is cancelled) the switch still ends with a model loaded or a logged failure.
    lifecycle.loading.add(name)
    task = asyncio.ensure_future(_switch(state, candidate, location, factory, residents))
    lifecycle.switching = task
    task.add_done_callback(_report)
    await asyncio.shield(task)


async def _switch(state: AppState, candidate: Candidate, location: ModelLocation, factory: EngineFactory, residents: list[ServedModel]) -> None:
    """Unload ``residents``, then load ``candidate`` (marked loading until it ends). Every
    resident is marked unloading from the start: one waiting its turn is refused (503
    ``model_busy``) as the one unloading is, not served until its own unload begins."""
    lifecycle = state.lifecycle
    waiting = {m.info.served_name for m in residents}
    lifecycle.unloading |= waiting
    try:
        for model in residents:
            await unload_now(state, model)
        try:
            await load_planned(state, candidate, location, factory)
        except MillmError as exc:
            if not residents:
                raise
            gone = ", ".join(repr(m.info.served_name) for m in residents)
            state.load_error = f"ModelLoadFailed: {exc.message}"
            raise ModelLoadFailed(f"loading '{candidate.id}' failed after {gone} was unloaded: {exc.message}") from exc
    finally:
        lifecycle.unloading -= waiting  # a resident left after a failure serves again
        lifecycle.loading.discard(candidate.id)
        lifecycle.switching = None


def _report(task: asyncio.Task[None]) -> None:
    """Log how a switch ended (its request may have left without reading it)."""
    if task.cancelled():
        log.warning("model_switch_cancelled")
    elif task.exception() is not None:
        error = task.exception()
        log.warning("model_switch_failed", code=getattr(error, "code", None), error=str(error))
    else:
        log.info("model_switch_done")
