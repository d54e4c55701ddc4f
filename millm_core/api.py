"""millm's public API: everything a plugin (engine, model source or feature) may import
from the core, and nothing else.

Built-in plugins use this module alone, exactly as a third party's package would; a test
fails when a module under ``millm_plugins/`` or ``millm_engines/`` imports any other part
of ``millm_core``. Names not listed in ``__all__`` are private and may change.

The groups, in the order a plugin meets them:

- hooks: ``hookimpl`` (and ``PROJECT``, the entry-point group's name);
- declarations made at start-up: ``RequestField``, ``FieldRule``, ``PluginSetting``,
  ``Command``, ``RouteDoc``, ``EngineFactory`` (and its ``LoadPlan``), ``ModelSource``,
  ``ModelLocation``;
- the contexts hooks receive: ``AppContext``, ``RequestContext``, ``StashKey``;
- what request hooks exchange: ``Problem``, ``Generate``, ``Compute``, ``Reply``,
  ``ForwardPlan``, ``RowInfo``, ``TokenProcessor`` (and ``PassThrough``), ``Outcome``, ``ChoiceResult``,
  ``Finalization``, ``RowOwner``;
- the engine contract: ``Engine``, ``Batch``, ``Joinable``, ``EagerJoin``, ``JoinTogether``, ``Embedder``,
  ``Scorer``, ``ResidualReader``, ``Tapping``, ``Rewinding``, ``PrefixReusing``, ``Tap``, ``Readout``,
  ``ResidualListener``, ``Capability``, ``Capacity``, ``ModelInfo``, ``RowSpec``,
  ``SamplingParams``, ``ServedModel``, ``ModelRegistry``, ``SwitchTarget``;
- OpenAI's request and response contracts;
- errors (each carries its HTTP status and code; raise them, never build a response);
- the app ``millm serve`` serves, for another ASGI host (``serving_app``, ``serving_settings``, ``startup_load``);
- serving a model request from a plugin: ``dispatch`` and its ``Dispatched`` reply
  (``declares`` says whether an endpoint takes a field on this server; ``CLIENT_CLOSED``,
  499, is the status of a request whose client left);
- helpers: JSON codec, route helpers (``event_stream``, ``unknown_fields``), prompt ids, the counter-based RNG, chat formatting,
  the steering-set model, SQLite store, logging setup, model loading for commands.
"""

from __future__ import annotations

from . import watching
from .chatformat import (
    generic_chat_text,
    has_tool_history,
    operator_chat_template,
    refuse_tools_without_template,
    render_with_continuation,
    split_continuation,
)
from .codec import convert, decode_json, encode
from .commands import Command
from .config import PluginSetting, Settings, cache_root, guarded_csv, parse_bool
from .context import AppContext, Endpoint, RequestContext, Stash, StashKey
from .contracts.chat import ChatCompletionRequest, ChatMessage
from .contracts.common import Usage
from .contracts.completions import CompletionRequest
from .contracts.embeddings import EmbeddingItem, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from .contracts.errors import ErrorResponse
from .engine import (
    UNRECORDED,
    Batch,
    Capability,
    Capacity,
    EagerJoin,
    Embedder,
    Engine,
    EngineFactory,
    Joinable,
    JoinTogether,
    LoadPlan,
    MemoryAware,
    ModelInfo,
    ModelLocation,
    ModelSource,
    PassThrough,
    PrefixReusing,
    Readout,
    ResidualListener,
    ResidualReader,
    Rewinding,
    RowEnd,
    RowOwner,
    RowSpec,
    SamplingParams,
    Scorer,
    Tap,
    Tapping,
    TapPoint,
    TokenMask,
    TokenProcessor,
    batch_invariant,
)
from .errors import (
    CapacityExceeded,
    ChatTemplateRefused,
    ConfigError,
    ContextLengthExceeded,
    DatabaseBusy,
    FieldNotHonoured,
    InternalError,
    InvalidRequest,
    MillmError,
    ModelDoesNotFit,
    ModelNotFound,
    ModelNotLoaded,
    NonFiniteLogits,
    NotFound,
    OutOfMemory,
    ScoringPrecisionUnavailable,
    ServiceUnavailable,
    UnsupportedQuantization,
)
from .fields import GENERATION_ENDPOINTS, FieldRule
from .hookspecs import PROJECT, hookimpl
from .jobs import RowsFailed
from .loading import load_served_model, local_revision
from .logs import configure_logging, progress_disabled
from .memory import host_available_bytes
from .openapi import RouteDoc
from .pipeline_types import (
    ChatRender,
    ChoiceResult,
    Compute,
    Execution,
    Finalization,
    ForwardPlan,
    Generate,
    Outcome,
    Problem,
    Reply,
    RowInfo,
)
from .prompts import prompt_ids, refuse_empty, with_opening
from .registry import ModelRegistry, ServedModel, SwitchTarget
from .requestfields import RequestField, request_types_with
from .rng import uniform
from .server.dispatch import CLIENT_CLOSED, Dispatched, declares, dispatch
from .server.middleware import request_id
from .server.routes.common import model_endpoint, until_disconnect
from .server.web import app_context, event_stream, json_response, read_json
from .serving import serving_app, serving_settings, startup_load
from .steering import AppliedSet
from .store import Store
from .templatevars import key_location, template_variables
from .unknown import unknown_fields

__all__ = [
    "CLIENT_CLOSED",
    "GENERATION_ENDPOINTS",
    "PROJECT",
    "UNRECORDED",
    "AppContext",
    "AppliedSet",
    "Batch",
    "Capability",
    "Capacity",
    "CapacityExceeded",
    "ChatCompletionRequest",
    "ChatTemplateRefused",
    "ChatMessage",
    "ChoiceResult",
    "ChatRender",
    "Command",
    "CompletionRequest",
    "Compute",
    "ConfigError",
    "ContextLengthExceeded",
    "DatabaseBusy",
    "Dispatched",
    "EmbeddingItem",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "EagerJoin",
    "Embedder",
    "Endpoint",
    "Engine",
    "EngineFactory",
    "ErrorResponse",
    "Execution",
    "FieldNotHonoured",
    "FieldRule",
    "Finalization",
    "ForwardPlan",
    "Generate",
    "InternalError",
    "InvalidRequest",
    "Joinable",
    "JoinTogether",
    "LoadPlan",
    "MemoryAware",
    "MillmError",
    "ModelInfo",
    "ModelLocation",
    "ModelNotFound",
    "ModelNotLoaded",
    "ModelRegistry",
    "ModelSource",
    "NonFiniteLogits",
    "NotFound",
    "Outcome",
    "ModelDoesNotFit",
    "OutOfMemory",
    "PluginSetting",
    "Problem",
    "Reply",
    "RequestContext",
    "RequestField",
    "Readout",
    "ResidualListener",
    "ResidualReader",
    "RouteDoc",
    "RowInfo",
    "RowSpec",
    "RowsFailed",
    "SamplingParams",
    "Scorer",
    "ScoringPrecisionUnavailable",
    "ServedModel",
    "ServiceUnavailable",
    "Settings",
    "Stash",
    "StashKey",
    "Store",
    "SwitchTarget",
    "Tap",
    "TapPoint",
    "Tapping",
    "Rewinding",
    "PrefixReusing",
    "TokenProcessor",
    "PassThrough",
    "TokenMask",
    "UnsupportedQuantization",
    "RowEnd",
    "RowOwner",
    "Usage",
    "app_context",
    "batch_invariant",
    "cache_root",
    "configure_logging",
    "progress_disabled",
    "convert",
    "declares",
    "decode_json",
    "dispatch",
    "encode",
    "event_stream",
    "request_id",
    "generic_chat_text",
    "has_tool_history",
    "host_available_bytes",
    "operator_chat_template",
    "refuse_tools_without_template",
    "hookimpl",
    "guarded_csv",
    "key_location",
    "template_variables",
    "watching",
    "json_response",
    "load_served_model",
    "local_revision",
    "model_endpoint",
    "parse_bool",
    "prompt_ids",
    "with_opening",
    "read_json",
    "refuse_empty",
    "render_with_continuation",
    "request_types_with",
    "serving_app",
    "serving_settings",
    "startup_load",
    "split_continuation",
    "uniform",
    "unknown_fields",
    "until_disconnect",
]
