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

A load that fails once the residents are gone answers ``500 model_load_failed`` with the
failure's message; readiness then answers 503 until a model is loaded again.
"""

from __future__ import annotations

import asyncio

import structlog

from ..errors import MillmError, ModelLoadFailed
from ..registry import SwitchTarget
from .pipeline import Admission, check_field_policy, problems_error, refuse_unused_if_strict
from .routes.lifecycle import check_loadable, find_candidate, load_planned, locate_engine, on_model_thread, unload_now

log = structlog.get_logger("millm.lifecycle")

MODEL_ENDPOINTS = frozenset({"chat.completions", "completions", "embeddings"})


async def ensure_requested_model(admission: Admission) -> None:
    """Load the model the request names when it is not loaded but loadable; return at
    once when it is loaded, unknown (admission answers 404) or ``--auto-load`` is off."""
    state, ctx, request = admission.state, admission.ctx, admission.request
    if not state.settings.auto_load or ctx.endpoint not in MODEL_ENDPOINTS:
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
    if lifecycle.busy:
        doing = ", ".join(sorted(lifecycle.loading | lifecycle.unloading))
        raise lifecycle.busy_error(f"Another load or unload is in progress ({doing}); retry once it finishes")
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
    if lifecycle.busy or state.models.get(name) is not None:
        if state.models.get(name) is not None:
            return
        raise lifecycle.busy_error(f"Another load or unload began meanwhile; retry once it finishes ({name})")
    residents = list(state.models)
    for model in residents:
        state.host.model_unloading(state.app, model)  # a plugin may keep it: nothing is unloaded
    log.info("model_switch", model=name, unloading=[m.info.served_name for m in residents], request_id=ctx.request_id)
    lifecycle.loading.add(name)
    try:
        for model in residents:
            await unload_now(state, model)
        try:
            await load_planned(state, candidate, location, factory)
        except MillmError as exc:
            if not residents:
                raise
            raise ModelLoadFailed(f"loading '{name}' failed after {', '.join(repr(m.info.served_name) for m in residents)} was unloaded: {exc.message}") from exc
    finally:
        lifecycle.loading.discard(name)
