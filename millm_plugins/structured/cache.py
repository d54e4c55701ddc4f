"""One constraint vocabulary per served model, built once off the event loop.

lm-format-enforcer walks a prefix tree of the vocabulary's token strings; building it
decodes every token, so it is started when a model is loaded (on a thread of its own),
kept on disk between runs, and shared by every constrained row. A request never builds it
and never waits for it: one that arrives while it is still being built gets a 503 with
Retry-After.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from millm_core.api import AppContext, ServedModel, ServiceUnavailable, StashKey, cache_root

if TYPE_CHECKING:
    from .vocab import VocabData

log = structlog.get_logger("millm.structured")

VOCABS = StashKey[dict[str, "Future[VocabData]"]]("structured.vocabs")
# Its own thread: a build takes seconds and must not hold up the core's text thread
# (prompt rendering) or the model thread.
BUILDER = StashKey[ThreadPoolExecutor]("structured.builder")


def vocab_for(app: AppContext, model: ServedModel) -> Future[VocabData]:
    """The model's constraint vocabulary, building it (once) if nobody started it yet.
    Called on the event loop only (model-loaded and pre-forward hooks), so no lock."""
    vocabs = app.stash.setdefault(VOCABS, dict)
    key = model.info.served_name
    future = vocabs.get(key)
    if future is None or (future.done() and future.exception() is not None):  # a failed build is retried
        directory = Path(os.path.join(cache_root(app.settings), "constraint-vocab"))
        engine: Any = model.engine

        def build() -> VocabData:
            from .vocab import tokenizer_data  # lm-format-enforcer (and torch) load here, not at import

            data = tokenizer_data(engine, directory)
            log.info("constraint_vocab_ready", model=key, seconds=round(data.built_s, 3), cached=data.cached)
            return data

        future = app.stash.setdefault(BUILDER, _builder).submit(build)
        vocabs[key] = future
    return future


def _builder() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="millm-constraint-vocab")


def ready_vocab(app: AppContext, model: ServedModel) -> Future[VocabData]:
    """The model's constraint vocabulary when it is built; while it is still being built
    (the first seconds after a load without a disk cache) a constrained request is
    answered ``503 constraint_vocabulary_building`` (with ``Retry-After``) rather than
    stall the model thread for every row in the batch."""
    future = vocab_for(app, model)
    if not future.done():
        raise ServiceUnavailable(
            f"the constraint vocabulary of '{model.info.served_name}' is still being built (once per tokenizer); retry in a few seconds",
            code="constraint_vocabulary_building",
        )
    error = future.exception()
    if error is not None:
        raise ServiceUnavailable(
            f"the constraint vocabulary could not be built: {type(error).__name__}", code="constraint_vocabulary_failed"
        )
    return future


def shutdown(app: AppContext) -> None:
    """Stop the build thread (a build in progress is left to finish on its own)."""
    if BUILDER in app.stash:
        app.stash[BUILDER].shutdown(wait=False, cancel_futures=True)
