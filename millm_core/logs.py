"""structlog configuration: console or JSON lines, request id bound per request."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """structlog to stderr, as ``console`` lines or one JSON object per line (``json``). In
    JSON, progress bars are turned off (tqdm's, and the Hugging Face libraries' which
    draw with it): they share stderr and would break the lines a log shipper reads."""
    if fmt == "json":
        _no_progress_bars()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def progress_disabled() -> bool:
    """tqdm's ``disable`` for a progress bar millm or a plugin draws: whether progress bars
    are off (JSON logs, or ``TQDM_DISABLE`` set to a true value; read now, as tqdm reads its
    own variables only once, when it is imported)."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


def _no_progress_bars() -> None:
    os.environ["TQDM_DISABLE"] = "1"  # tqdm reads TQDM_* variables as its defaults
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is imported
    # Libraries imported already read their switches then: turned off directly (never imported here).
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None and hasattr(hub, "disable_progress_bars"):
        hub.disable_progress_bars()
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None and hasattr(hf_logging, "disable_progress_bar"):
        hf_logging.disable_progress_bar()
