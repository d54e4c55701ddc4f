"""What one Ray Serve replica adds around the millm app it runs (no Ray import here):

- :class:`ReplicaApp`, an ASGI wrapper that names the replica on every response
  (``X-miLLM-Replica``) and holds the app's lifespan start-up until the model is loaded,
  so that Ray routes nothing to a replica that would answer 503 ``model_not_loaded``;
- :data:`PLUGIN`, a plugin registered into each replica's host only (never into a plain
  ``millm serve``), with which every replica's Batch API drives the batches any replica
  accepted: the replica holding the data directory's lock runs them, and when it dies
  another one takes the lock over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import structlog

from millm_core.api import AppContext, StashKey, hookimpl, startup_load

log = structlog.get_logger("millm.ray")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]

REPLICA_HEADER = b"x-millm-replica"
ADOPT_S = 1.0
"""How often each replica looks for batches accepted by another replica (and, on a replica
without the data directory's lock, whether the lock is free to take over)."""


class ReplicaApp:
    """The millm app as one replica serves it. ``replica`` is the Ray Serve replica's id
    (the last part of its actor's name, ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.replica = replica

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
        elif scope["type"] == "http":
            await self.app(scope, receive, self._http_send(scope, send))
        else:
            await self.app(scope, receive, send)

    def _http_send(self, scope: Message, send: Send) -> Send:
        sent_id = next((v for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), None)

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                # Ray's proxy puts its request id on the request and adds it to the
                # response itself: millm's echo of that same id would be a second copy.
                headers = [(k, v) for k, v in headers if not (k.lower() == b"x-request-id" and v == sent_id)]
                headers.append((REPLICA_HEADER, self.replica.encode()))
                message = {**message, "headers": headers}
            await send(message)

        return named

    def _lifespan_send(self, send: Send) -> Send:
        async def loaded_first(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                failed = await startup_load(self.app)
                if failed:
                    message = {"type": "lifespan.startup.failed", "message": f"the model did not load: {failed}"}
            await send(message)

        return loaded_first


ADOPTER = StashKey["asyncio.Task[None]"]("rayserve.adopter")


async def _adopt(app: AppContext) -> None:
    """Keep this replica's batch runner in step with the database: take the data
    directory's lock when it is free (its holder died), and, holding it, drive every
    unfinished batch (``drive`` skips those already driven) and stop those another replica
    cancelled."""
    from millm_plugins.batches.public import STATE

    state = app.stash[STATE]
    runner, store = state.runner, state.store
    cancelled: set[str] = set()
    while True:
        await asyncio.sleep(ADOPT_S)
        try:
            if not runner.active:
                if not await runner.off(state.disk.lock):
                    continue
                runner.active = True
                log.warning("batches_lock_taken_over", data_dir=state.disk.path)
            for batch_id in await runner.off(store.unfinished):
                if batch_id not in cancelled and await runner.off(store.status, batch_id) == "cancelling":
                    cancelled.add(batch_id)
                    runner.cancel(batch_id)
                else:
                    runner.drive(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a busy database, say: looked at again next time
            log.exception("batches_adopt_failed")


class _Plugin:
    """Registered into each replica's plugin host under the name ``rayserve-replica``."""

    @staticmethod
    @hookimpl(trylast=True)  # after the batches plugin has put its state in the stash
    def millm_startup(app: AppContext) -> None:
        from millm_plugins.batches.public import STATE

        if STATE in app.stash:
            app.stash[ADOPTER] = asyncio.get_running_loop().create_task(_adopt(app), name="rayserve batches")

    @staticmethod
    @hookimpl(tryfirst=True)  # before the batches plugin stops its runner
    def millm_shutdown(app: AppContext) -> None:
        if ADOPTER in app.stash:
            with contextlib.suppress(Exception):
                app.stash[ADOPTER].cancel()


PLUGIN = _Plugin()
PLUGIN_NAME = "rayserve-replica"
