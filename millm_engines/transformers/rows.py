"""Each row attends over its own cache columns on the generic HF forward.

On the generic forward (models without the lean decode step) the rows of a batch share
one right-aligned KV cache: a row shorter than the batch's longest, a row that joined
later, or a row taken back by a rewind has columns it does not own, which the attention
mask hides. PyTorch's scaled-dot-product attention then reduces a row's softmax and its
weighted sum over the whole padded width, and the blocking of that reduction follows the
width: in bfloat16 a padded row's logits differ from its solo run's (measured on a tiny
Qwen2: 0.06 in the logits within 12 steps), so its tokens depended on the load.

This module registers an attention implementation with transformers'
``AttentionInterface`` (:data:`NAME`) that, for a decode step (one query per row), runs
SDPA once per row over exactly the key and value columns the row's mask keeps, with no
mask (PyTorch's SDPA directly, grouped-query heads expanded by SDPA itself): the same
call, on the same tensors, as the row alone. A forward with several query
positions (a prefill, scoring) goes to SDPA unchanged; the engine prefills each row on its
own, so no prefill of a generated row is ever padded. The matrix products around attention
are per row already (oneDNN's bfloat16 kernels give a row the same bits whatever the row
count; see ``docs/performance.md`` for float32).

It is installed on a model whose attention is transformers' ``sdpa`` (:func:`install`);
other implementations (eager attention, which models with soft-capping or attention sinks
need) keep theirs, and such a model is not batch-invariant outside float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

NAME = "millm_rows"


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention signature: ``query`` ``[rows, heads, q, head_dim]``, ``key``
    and ``value`` ``[rows, kv_heads, columns, head_dim]``, ``attention_mask`` the boolean
    ``[rows, 1, q, columns]`` mask :func:`sdpa_mask` builds (True: attend), or None when
    no column is hidden. Returns ``[rows, q, heads, head_dim]``."""
    if (
        query.shape[2] != 1
        or (attention_mask is not None and attention_mask.dtype != torch.bool)
        or kwargs.get("position_bias") is not None
    ):
        # Several queries per row, or a mask that adds values rather than hiding columns:
        # SDPA as the model would call it.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    picks = _columns(attention_mask) if attention_mask is not None else None
    gqa = query.shape[1] != key.shape[1]
    outputs: list[torch.Tensor] = []
    for row in range(query.shape[0]):
        keys, values = key[row : row + 1], value[row : row + 1]
        pick = picks[row if len(picks) > 1 else 0] if picks is not None else None
        if isinstance(pick, slice):
            keys, values = keys[:, :, pick], values[:, :, pick]
        elif pick is not None:
            keys, values = keys.index_select(2, pick), values.index_select(2, pick)
        outputs.append(F.scaled_dot_product_attention(query[row : row + 1], keys, values, dropout_p=dropout, scale=scaling, enable_gqa=gqa))
    return torch.cat(outputs).transpose(1, 2).contiguous(), None


# The last mask read and its rows' columns: every layer of a forward pass gets the same
# mask tensor, so its columns are found once per step (held, so the identity is safe).
_last: tuple[torch.Tensor, list[slice | torch.Tensor | None]] | None = None


def _columns(mask: torch.Tensor) -> list[slice | torch.Tensor | None]:
    """Per row of a boolean ``[rows, 1, 1, columns]`` mask, the columns it keeps: None
    (all), a slice (a right-aligned run, the usual case: a view, no copy) or an index."""
    global _last
    held = _last
    if held is not None and held[0] is mask:
        return held[1]
    picks: list[slice | torch.Tensor | None] = []
    for keep in mask[:, 0, 0]:
        kept = int(keep.sum())
        width = keep.shape[0]
        if kept == width:
            picks.append(None)
        elif bool(keep[width - kept :].all()):
            picks.append(slice(width - kept, width))
        else:
            picks.append(keep.nonzero().squeeze(1))
    _last = (mask, picks)
    return picks


def _register() -> None:
    """Make :data:`NAME` known to transformers (idempotent): the attention function, and
    SDPA's mask builder for it."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, rows_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)


def possible(config: object) -> bool:
    """Whether a checkpoint with this config (a ``config.json`` dict or a transformers
    config) would load attending with SDPA, so that :func:`install` can switch it: its
    causal-LM class supports SDPA and dispatches attention through transformers'
    ``AttentionInterface``, its config names no other attention implementation, and it
    soft-caps no attention logits (SDPA cannot). Imports transformers (and torch)."""

    def get(key: str) -> object:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    if get("attn_logit_softcapping") is not None:
        return False
    stated = get("attn_implementation") or get("_attn_implementation_internal")
    if stated is not None and stated not in ("sdpa", NAME):
        return False
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(get("model_type")))
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if not getattr(cls, "_supports_sdpa", False):
        return False
    # Some SDPA models (Falcon) do not dispatch through AttentionInterface: they cannot switch.
    can_switch = getattr(cls, "_can_set_attn_implementation", None)
    return bool(can_switch()) if callable(can_switch) else False


def install(model: Any) -> str | None:
    """Switch ``model`` to :func:`rows_attention`; returns why it cannot be (None: done).
    Only a model attending with transformers' ``sdpa`` switches: the function delegates to
    it, row by row."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return None
    if current != "sdpa":
        return f"the model attends with {current!r}, not sdpa, so its rows cannot attend over their own columns"
    _register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, TypeError, AttributeError) as exc:
        return f"transformers would not switch the model's attention ({type(exc).__name__}: {exc})"
    if getattr(model.config, "_attn_implementation", None) != NAME:
        return "the model does not dispatch attention through transformers' AttentionInterface"
    return None
