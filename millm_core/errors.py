"""Typed errors carrying (status, type, code, param), translated to OpenAI's error shape in
exactly one place (:func:`millm_core.server.errors.error_response`).

Code that decides what happened branches on the exception's class or ``code``, never on
its message text.
"""

from __future__ import annotations


class MillmError(Exception):
    """An error a client can act on. ``status`` is the HTTP status, ``code`` a stable
    machine-readable string, ``param`` the request field (a JSON path) it concerns."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param
        self.headers = dict(headers or {})


class InvalidRequest(MillmError):
    """400: the request cannot be served as sent."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_parameter"


class FieldNotHonoured(InvalidRequest):
    """400: an output-changing field no enabled plugin or engine can honour."""

    code = "field_not_honoured"


class ChatTemplateRefused(InvalidRequest):
    """400: the model's chat template raised for these messages (its ``raise_exception``,
    e.g. "System role not supported") or cannot render them."""

    code = "chat_template_refused"


class ContextLengthExceeded(InvalidRequest):
    """400: prompt plus requested completion exceed the model's context window."""

    code = "context_length_exceeded"


class UnsupportedQuantization(InvalidRequest):
    """400: the named model's quantization cannot be loaded by its engine here (the
    message says what it would need); raised by an engine's preflight, before anything
    is unloaded."""

    code = "unsupported_quantization"


class NotFound(MillmError):
    """404: the named model or object does not exist."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    """404: no served model has the requested name."""

    code = "model_not_found"


class ScoringPrecisionUnavailable(MillmError):
    """409: ``scoring_precision: "float32"`` cannot be served; ``reason`` is one of
    ``model_not_float32_castable``, ``memory``, ``device``, ``busy``."""

    status = 409
    type = "invalid_request_error"
    code = "scoring_precision_unavailable"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message, param="scoring_precision", headers={"X-miLLM-Scoring-Precision-Reason": reason})
        self.reason = reason


class PayloadTooLarge(MillmError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(MillmError):
    """408: the request body did not arrive within ``--read-timeout``."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class ServiceUnavailable(MillmError):
    """503: the server cannot take the request now; retrying later may succeed."""

    status = 503
    type = "server_error"
    code = "service_unavailable"


class ModelNotLoaded(ServiceUnavailable):
    """503: the model is still loading, or failed to load (readiness says which)."""

    code = "model_not_loaded"


class ModelBusy(ServiceUnavailable):
    """503: the named model is being unloaded, or another load or unload is in progress;
    retry once it finishes (``Retry-After``)."""

    code = "model_busy"


class ModelLocked(MillmError):
    """409: another model is locked (``POST /api/models/{id}/lock``): requests, loads and
    unloads that concern a different model are refused until it is unlocked."""

    status = 409
    type = "invalid_request_error"
    code = "model_locked"


class QueueFull(ServiceUnavailable):
    """503: more requests wait than ``--max-queue`` allows."""

    code = "queue_full"


class CapacityExceeded(InvalidRequest):
    """400: the request needs more than the engine can ever hold at once (rows, KV cells);
    refused before anything runs. Engines raise it naming the request field to change."""

    code = "capacity_exceeded"


class DatabaseBusy(ServiceUnavailable):
    """503: the database is locked by another connection (for example a second server on
    the same ``--db`` file) for longer than the store waits; retrying later may succeed."""

    code = "database_busy"


class OutOfMemory(ServiceUnavailable):
    """503: the device ran out of memory for this request; retrying later, or with a
    smaller request, may succeed. Typed ``invalid_request_error``, as the API contract
    says: the request (its prompt, rows and cache) is what did not fit."""

    type = "invalid_request_error"
    code = "insufficient_memory"


class ModelDoesNotFit(OutOfMemory):
    """503: a model a request or a load names does not fit in the memory free (nothing was
    unloaded); the model, not the request, is what did not fit."""

    type = "server_error"


class InternalError(MillmError):
    """500: an unexpected failure; its details are in the server's log."""

    status = 500
    type = "server_error"
    code = "internal_error"


class ModelLoadFailed(InternalError):
    """500: loading the named model failed; the message gives the reason without paths
    (the server log has the details)."""

    code = "model_load_failed"


class NonFiniteLogits(InternalError):
    """500: a row's logits held NaN or ±inf; engines report it for that row alone
    (:class:`~millm_core.jobs.RowsFailed`), so only its request fails."""

    code = "non_finite_logits"


class ConfigError(Exception):
    """Raised at start-up for a configuration that cannot be served (bad flag, missing
    model). The CLI prints it and exits non-zero; it never reaches an HTTP client."""
