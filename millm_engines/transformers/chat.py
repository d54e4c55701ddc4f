"""How a chat becomes token ids on this engine.

- With a chat template: render it with the generation prompt. A render that already
  begins with the tokenizer's BOS token is tokenised without special tokens (one BOS);
  otherwise the tokenizer's own rule applies.
- Without a chat template: the generic fallback of :mod:`millm_core.chatformat`,
  tokenised with the tokenizer's own rule. It is documented in docs/chat-templates.md.
- A trailing assistant message is continued, not restarted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from millm_core.api import (
    ChatTemplateRefused,
    InvalidRequest,
    generic_chat_text,
    refuse_tools_without_template,
    render_with_continuation,
)

# apply_chat_template's own parameters, and the variables the template gets from the
# request itself: a client may set template variables, never these (a client-sent
# ``chat_template`` would replace the model's template; ``tokenize`` breaks rendering).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
        # the tokenizer's special tokens and the template's own functions, which a variable would replace
        "pad_token", "unk_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
        "raise_exception", "strftime_now",
    }
)  # fmt: skip


def check_template_kwargs(template_kwargs: Mapping[str, Any]) -> None:
    """Refuse, by name, the keys that are not template variables."""
    reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may set template variables only; {', '.join(reserved)} cannot be set by a request",
            param=f"chat_template_kwargs.{reserved[0]}",
        )


def render_chat_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The chat as text ready for the assistant's turn; a trailing assistant message is
    continued (see :mod:`millm_core.chatformat`). ``tools`` are given to the template as
    its ``tools`` variable."""

    check_template_kwargs(template_kwargs)
    if not getattr(tokenizer, "chat_template", None):
        refuse_tools_without_template(messages, tools)
    extra: dict[str, Any] = dict(template_kwargs)
    if tools is not None:
        extra["tools"] = [dict(t) for t in tools]

    def render(head: Sequence[Mapping[str, Any]]) -> str:
        if getattr(tokenizer, "chat_template", None):
            conversation: Any = [dict(m) for m in head]  # the tokenizer's stubs want dict[str, str]; content may be richer
            try:
                return str(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **extra))
            except TemplateError as exc:  # raise_exception(...) in the template, or a template error for these messages
                raise ChatTemplateRefused(f"the model's chat template refused the messages: {exc}", param="messages") from exc
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # the template choked on these values
                raise ChatTemplateRefused(
                    f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}", param="messages"
                ) from exc
        return generic_chat_text(head)

    return render_with_continuation(render, messages)


def render_chat_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    text = render_chat_text(tokenizer, messages, template_kwargs, tools)
    bos = tokenizer.bos_token
    writes_own_bos = bool(bos) and text.startswith(str(bos))
    return list(tokenizer(text, add_special_tokens=not writes_own_bos)["input_ids"])
