"""Which SAE a ``return_sae_activations`` request reads, and the checks made before
anything runs: the row count, the SAE, the features, ``top_k`` and the worst-case size."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from millm_core.api import InvalidRequest, Problem
from millm_plugins.steering.public import SAE, InvalidFeatureIndex, SAENotAttached

from .fields import PositionRange, ReturnSAEActivations

PARAM = "return_sae_activations"


class TooManyEntries(InvalidRequest):
    code = "sae_activations_too_large"


class AttachmentUnusable(InvalidRequest):
    """400: the attachment is listed but cannot be read for this request."""

    code = "attachment_unusable"


@dataclass(frozen=True)
class Selected:
    """The attached SAE a request reads, where it is attached, and its candidates
    (None: every feature)."""

    sae_id: str
    layer: int
    sae: SAE
    features: tuple[int, ...] | None

    @property
    def encoder(self) -> SAE:
        """What encodes a position: the SAE restricted to the candidates when they are
        listed (their encoder columns only), else the whole SAE. A topk SAE is always
        encoded whole: its activations depend on every feature."""
        if self.features is None or self.sae.architecture == "topk":
            return self.sae
        return self.sae.restricted(self.features)


def shape_problems(ctx: Any, request: Any, asked: ReturnSAEActivations, max_top_k: int) -> list[Problem]:
    """Checks that need no SAE: one row, a sane range, ``top_k`` under the limit."""
    problems: list[Problem] = []
    n = getattr(request, "n", None)
    if isinstance(n, int) and n > 1:
        problems.append(Problem("return_sae_activations reads one row; send n: 1 (there is no single position axis)", param="n"))
    if ctx.endpoint == "completions" and len(request.prompts()) > 1:
        problems.append(Problem("return_sae_activations reads one row; send one prompt (there is no single position axis)", param="prompt"))
    if ctx.endpoint == "chat.completions" and len(request.conversations()) > 1:
        problems.append(Problem("return_sae_activations reads one row; send no extra_messages (there is no single position axis)", param="extra_messages"))
    if asked.top_k > max_top_k:
        problems.append(Problem(f"top_k {asked.top_k} is over this server's limit of {max_top_k}", param=f"{PARAM}.top_k"))
    if isinstance(asked.positions, PositionRange) and asked.positions.end <= asked.positions.start:
        problems.append(Problem("positions.end must be greater than positions.start (the range is half-open)", param=f"{PARAM}.positions"))
    if asked.features is not None:
        seen: set[int] = set()
        for i, index in enumerate(asked.features):
            if index in seen:
                problems.append(Problem(f"feature {index} is listed twice", param=f"{PARAM}.features[{i}]"))
            seen.add(index)
    return problems


def select(asked: ReturnSAEActivations, attachments: Iterable[tuple[str, int]], saes: Mapping[str, SAE], unusable: Iterable[Any]) -> Selected:
    """The (SAE, layer) ``asked`` reads, or the request's 400."""
    attached = list(attachments)
    if not attached:
        raise SAENotAttached("return_sae_activations needs an attached SAE; none is attached (POST /api/saes/{id}/attach)", param=PARAM)
    candidates = [(s, layer) for s, layer in attached if asked.sae_id in (None, s) and asked.layer in (None, layer)]
    if not candidates:
        at = f" at layer {asked.layer}" if asked.layer is not None else ""
        where = ", ".join(f"({s}, layer {layer})" for s, layer in attached)
        what = f"SAE {asked.sae_id!r} is not attached{at}" if asked.sae_id is not None else f"no SAE is attached{at}"
        raise SAENotAttached(f"{what} (attached: {where})", param=f"{PARAM}.sae_id" if asked.sae_id is not None else f"{PARAM}.layer")
    if len(candidates) > 1:
        listed = ", ".join(f"({s}, layer {layer})" for s, layer in candidates)
        name = "layer" if asked.sae_id is not None else "sae_id"
        raise InvalidRequest(f"several attachments match: {listed}; name one with return_sae_activations.{name}", param=f"{PARAM}.{name}")
    sae_id, layer = candidates[0]
    if (sae_id, layer) in set(unusable) or sae_id not in saes:
        raise AttachmentUnusable(f"SAE {sae_id!r} at layer {layer} is attached but unusable (see GET /api/steering)", param=PARAM)
    sae = saes[sae_id]
    if sae.encode_refusal is not None:
        raise InvalidRequest(f"SAE {sae_id!r} cannot be read faithfully: {sae.encode_refusal}", param=PARAM, code="sae_encoding_unsupported")
    if asked.features is not None:
        for i, index in enumerate(asked.features):
            if index >= sae.d_sae:
                raise InvalidFeatureIndex(f"feature {index} is past SAE {sae_id!r}'s width {sae.d_sae}", param=f"{PARAM}.features[{i}]")
    return Selected(sae_id, layer, sae, tuple(asked.features) if asked.features is not None else None)


def check_model(selected: Selected, d_model: int, n_layers: int) -> None:
    """Refuse an attachment the serving model cannot take (another model than the one the
    attachments were checked against)."""
    if selected.sae.d_in != d_model or selected.layer >= n_layers:
        raise AttachmentUnusable(
            f"SAE {selected.sae_id!r} (width {selected.sae.d_in}) at layer {selected.layer} does not fit this model "
            f"(width {d_model}, {n_layers} layers)",
            param=PARAM,
        )


def worst_case_positions(asked: ReturnSAEActivations, prompt_tokens: int, max_new_tokens: int) -> int:
    """The most positions the request could list: ``max_tokens`` counted in full."""
    positions = asked.positions
    if positions == "last":
        return 1
    if positions == "prompt":
        return prompt_tokens
    if positions == "completion":
        return max_new_tokens
    if positions == "all":
        return prompt_tokens + max_new_tokens
    assert isinstance(positions, PositionRange)
    return max(0, min(positions.end, prompt_tokens + max_new_tokens) - positions.start)


def check_size(asked: ReturnSAEActivations, selected: Selected, prompt_tokens: int, max_new_tokens: int, max_entries: int) -> None:
    """Refuse a request whose worst case (positions × top_k) is over ``max_entries``."""
    width = len(selected.features) if selected.features is not None else selected.sae.d_sae
    per_position = min(asked.top_k, width)
    positions = worst_case_positions(asked, prompt_tokens, max_new_tokens)
    if positions * per_position > max_entries:
        raise TooManyEntries(
            f"return_sae_activations could list {positions} positions × {per_position} features = {positions * per_position} "
            f"entries, over this server's limit of {max_entries}; ask for fewer positions, a smaller top_k or fewer max_tokens",
            param=PARAM,
        )
