"""A byte-level bigram model: a tiny, dependency-free, deterministic millm engine.

**Tokens** are the UTF-8 bytes of the text (ids 0..255) plus ``256``, the text boundary:
the end-of-text token (the only EOS) and the context of an empty row. There is no BOS:
``add_special_tokens`` changes nothing.

**File format** (``*.bigram.json``, written by :func:`make_model`)::

    {"format": "millm-bigram/1",
     "name": "tiny-bigram",
     "table": {"<token>": {"<next token>": <count>, ...}, ...}}

Keys are decimal token ids; counts are positive integers. ``table["256"]`` counts how
texts begin and ``table["<b>"]["256"]`` how often a text ends after byte ``b``. ``name``
is the served name unless ``--served-name`` gives one; the revision is the first 12 hex
digits of the file's SHA-256.

**The model**: the logits after a row's last token ``c`` are ``log(count)`` of each next
token in ``table[c]`` and ``UNSEEN`` (-30: never sampled in practice, yet a logit bias
can still force it) for the others. A token without a row falls back to ``table["256"]``.

**Sampling**, per row: the row's bias is added to the logits; temperature 0 takes the
largest (ties: the lowest id); otherwise logits / T (counts^(1/T)), the ``top_k``
likeliest (ties: lower id first), the smallest prefix whose mass reaches ``top_p``, and
the token at ``uniform(seed, stream, position)`` of their cumulative mass, ``position``
being the row's length (prompt included). A row's tokens are therefore a pure function
of its prompt and sampling parameters, whatever batch it runs in.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from millm_core.api import (
    UNRECORDED,
    Capability,
    Capacity,
    CapacityExceeded,
    ConfigError,
    ModelInfo,
    ModelLocation,
    RowSpec,
    SamplingParams,
    Settings,
    generic_chat_text,
    render_with_continuation,
    uniform,
)

from .plugin import CAPABILITIES, SUFFIX

ENGINE = "bigram"
FORMAT = "millm-bigram/1"
EOS = 256
VOCAB = 257
UNSEEN = -30.0
MAX_ROWS = 8
DEFAULT_CONTEXT = 4096  # a bigram has no window; this bounds default token budgets


def make_model(path: str, texts: str | Sequence[str], *, name: str = "tiny-bigram") -> str:
    """Write a model trained on ``texts`` (each one: boundary, its bytes, boundary) to
    ``path`` and return ``path``."""
    table: dict[str, dict[str, int]] = {}
    for text in [texts] if isinstance(texts, str) else texts:
        ids = [EOS, *text.encode("utf-8"), EOS]
        for a, b in zip(ids, ids[1:], strict=False):
            row = table.setdefault(str(a), {})
            row[str(b)] = row.get(str(b), 0) + 1
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"format": FORMAT, "name": name, "table": table}, fh, indent=1, sort_keys=True)
    return path


def _token(key: str) -> int | None:
    return int(key) if key.isascii() and key.isdigit() and int(key) < VOCAB else None


def _parse(data: Any, path: str) -> dict[int, list[float]]:
    """The logits after each token that has a (non-empty) row, from a decoded file."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("table"), dict):
        raise ConfigError(f"{path}: not a {FORMAT} file (an object with format {FORMAT!r} and a table)")
    logits: dict[int, list[float]] = {}
    for context, counts in data["table"].items():
        if (
            _token(context) is None
            or not isinstance(counts, dict)
            or not all(_token(t) is not None and type(c) is int and c > 0 for t, c in counts.items())
        ):
            raise ConfigError(f"{path}: bad row table[{context!r}]; token ids are 0..256 and counts positive integers")
        if counts:
            row = logits[int(context)] = [UNSEEN] * VOCAB
            for token, count in counts.items():
                row[int(token)] = math.log(count)
    return logits


def load(location: ModelLocation, settings: Settings) -> BigramEngine:
    """Load a ``*.bigram.json`` file (the factory's ``load``)."""
    with open(location.path, "rb") as fh:
        raw = fh.read()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{location.path}: not JSON ({exc})") from exc
    logits = _parse(data, location.path)
    stem = os.path.basename(location.path)[: -len(SUFFIX)]
    info = ModelInfo(
        served_name=settings.served_name or str(data.get("name") or stem),
        engine=ENGINE,
        context_length=settings.max_model_len or DEFAULT_CONTEXT,
        d_model=0,
        n_layers=0,
        vocab_size=VOCAB,
        dtype="int",
        revision=location.revision if location.revision != UNRECORDED else hashlib.sha256(raw).hexdigest()[:12],
    )
    return BigramEngine(logits, info)


def sample(logits: Sequence[float], params: SamplingParams, position: int) -> int:
    """One token from ``logits`` (bias already added), as the module docstring says."""
    if params.greedy:
        return max(range(len(logits)), key=logits.__getitem__)  # max keeps the first: lowest id
    scaled = [value / params.temperature for value in logits]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])  # stable: ties keep the lower id first
    if params.top_k:
        order = order[: params.top_k]
    top = scaled[order[0]]
    weights = [math.exp(scaled[t] - top) for t in order]
    total, mass, kept = sum(weights), 0.0, 0
    while kept < len(order) and (kept == 0 or mass < params.top_p * total):
        mass += weights[kept]
        kept += 1
    target = uniform(params.seed, params.stream, position) * mass
    for token, weight in zip(order[:kept], weights[:kept], strict=True):
        target -= weight
        if target < 0:
            return token
    return order[kept - 1]


@dataclass
class _Row:
    tokens: list[int]  # prompt and generated tokens
    sampling: SamplingParams


@dataclass
class BigramBatch:
    """The rows being stepped: each row's tokens so far and its sampling parameters."""

    rows: list[_Row] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.rows)


class BigramEngine:
    """A loaded bigram model. It keeps no state between steps beyond each row's tokens,
    so rows of other requests can join a running batch (it is ``Joinable``, and
    ``EagerJoin``: a joined row draws its first token as soon as it joins)."""

    capabilities: frozenset[Capability] = CAPABILITIES
    eos_token_ids: frozenset[int] = frozenset({EOS})
    capacity: Capacity = Capacity(max_rows=MAX_ROWS, max_tokens=None)

    def __init__(self, logits: Mapping[int, list[float]], info: ModelInfo) -> None:
        self.info = info
        self._logits = dict(logits)
        self._live = 0  # rows held by open batches, against capacity.max_rows

    # ------------------------------------------------------------------ text

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(t for t in ids if 0 <= t < EOS).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Mapping[str, Any]], /, **template_kwargs: Any) -> list[int]:
        """The generic chat format (this model has no template); a trailing assistant
        message is continued."""
        return self.encode(render_with_continuation(generic_chat_text, messages), add_special_tokens=True)

    def next_logits(self, context: int) -> list[float]:
        """The logits after token ``context`` (a fresh list)."""
        row = self._logits.get(context) or self._logits.get(EOS)
        return list(row) if row is not None else [UNSEEN] * EOS + [0.0]  # an empty table ends every text

    # ------------------------------------------------------------------ batches

    def can_join(self, rows: Sequence[RowSpec]) -> bool:
        return self._live + len(rows) <= MAX_ROWS

    def open_batch(self, rows: Sequence[RowSpec]) -> BigramBatch:
        if not self.can_join(rows):  # admission refuses this before it gets here; a guard
            raise CapacityExceeded(f"{len(rows)} more rows; the bigram engine runs at most {MAX_ROWS}", param="prompt")
        batch = BigramBatch()
        self.join(batch, rows)
        return batch

    def join(self, batch: BigramBatch, rows: Sequence[RowSpec]) -> None:
        batch.rows += [_Row(tokens=list(r.prompt_ids), sampling=r.sampling) for r in rows]
        self._live += len(rows)

    def step(self, batch: BigramBatch, biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        return self._draw(batch.rows, biases)

    def first_tokens(self, batch: BigramBatch, biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        """``EagerJoin``: the first tokens of the rows that just joined (the batch's last
        ``len(biases)`` rows), drawn at once instead of with the next step. A bigram has no
        prefill to wait for, so this only shows the protocol's shape."""
        return self._draw(batch.rows[len(batch.rows) - len(biases) :], biases)

    def _draw(self, rows: Sequence[_Row], biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        out: list[int] = []
        for row, bias in zip(rows, biases, strict=True):
            logits = self.next_logits(row.tokens[-1] if row.tokens else EOS)
            for token, value in (bias or {}).items():
                if 0 <= token < VOCAB:
                    logits[token] += value
            token = sample(logits, row.sampling, len(row.tokens))
            row.tokens.append(token)
            out.append(token)
        return out

    def retain(self, batch: BigramBatch, keep: Sequence[int]) -> None:
        self._live -= len(batch.rows) - len(keep)
        batch.rows = [batch.rows[i] for i in keep]

    def close(self, batch: BigramBatch) -> None:
        self._live -= len(batch.rows)
        batch.rows = []
