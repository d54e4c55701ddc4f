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

from transformers import PreTrainedTokenizerBase

from millm_core.api import generic_chat_text, render_with_continuation


def render_chat_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any]) -> str:
    """The chat as text ready for the assistant's turn; a trailing assistant message is
    continued (see :mod:`millm_core.chatformat`)."""

    def render(head: Sequence[Mapping[str, Any]]) -> str:
        if getattr(tokenizer, "chat_template", None):
            conversation: Any = [dict(m) for m in head]  # the tokenizer's stubs want dict[str, str]; content may be richer
            return str(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **dict(template_kwargs)))
        return generic_chat_text(head)

    return render_with_continuation(render, messages)


def render_chat_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any]) -> list[int]:
    text = render_chat_text(tokenizer, messages, template_kwargs)
    bos = tokenizer.bos_token
    writes_own_bos = bool(bos) and text.startswith(str(bos))
    return list(tokenizer(text, add_special_tokens=not writes_own_bos)["input_ids"])
