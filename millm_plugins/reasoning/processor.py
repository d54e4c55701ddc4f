"""One row's reasoning processor: it owns the row while the model reasons.

It splits what the model writes into the reasoning (``reasoning_content``) and the
answer (passed on to the other processors, so ``stop``, tool calls and JSON constraints
see the answer only), and, while the block is open:

- forces the close once the row has spent its thinking budget;
- turns an end of turn drawn inside the block into the block's close (the redirect), so
  the model goes on to answer;
- takes a loop back (the loop guard): the last copy of a repeated span is rewound and the
  token that began it is banned for the step that redraws it;
- forces a deferred opening (a forced tool call's) right after the close, swallowing its
  text: the tool-call processor parses the answer as if the prompt had ended with it.

Forced tokens are drawn with a logit bias so large that nothing else can be drawn (every
engine applies biases; no token mask needed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from millm_core.api import RowEnd

from .loops import LoopGuard
from .markers import ReasoningFormat, Start

# A bias that decides the draw (and still fits float16 logits).
FORCE_BIAS = 30000.0
FIELD = "reasoning_content"


@dataclass(frozen=True)
class RowPolicy:
    """What one request asks of its rows' reasoning. ``budget``: reasoning tokens before
    the close is forced (None: no budget); ``spend``: the most tokens the row may draw
    (taken-back ones included) before the close is forced, so that the answer reserve
    holds (None: no limit); ``redirect``: an end of turn inside the block becomes its
    close; ``guard``: the loop guard (None: off); ``opening_ids``: a forced call's
    opening, forced right after the close."""

    budget: int | None
    redirect: bool
    guard: LoopGuard | None
    opening_ids: tuple[int, ...] = ()
    spend: int | None = None


class Reasoning:
    """The row owner described in the module docstring."""

    def __init__(self, fmt: ReasoningFormat, start: Start, policy: RowPolicy) -> None:
        self._fmt = fmt
        self._policy = policy
        self._guard = policy.guard
        self._state = start  # "open" (the model may open the block) | "reasoning" | "content"
        self.entered = start == "reasoning"
        self._buf = ""  # text not yet passed on: the reasoning (or what may open it)
        window = self._guard.window if self._guard else 0
        self._lens: deque[int] = deque(maxlen=window or None)  # text length of the latest reasoning tokens
        self._ids: list[int] = []  # the latest reasoning token ids (the loop detector's input)
        self._force: deque[int] = deque()
        self._forced_text = 0  # length of the text of a close being forced, drawn so far
        self._closing = ""  # the text of the close being forced (its newline, its marker)
        self._head_read = False  # whether the reasoning's start was read for a repeated opening
        self._swallow = 0  # forced opening tokens whose text is not passed on
        self._ban: int | None = None
        self._take = 0
        self._side = ""
        self._shown = ""  # the last character of reasoning passed on
        self._started_side = False
        self._started_content = False
        self.drawn = 0
        self._opening_tokens = 0  # tokens drawn while the block may still be opening
        self.reasoning_tokens = 0
        self.rewound = 0
        self._rewinds = 0
        self._redirects = 0
        self.forced_at: int | None = None
        self.redirected_at: int | None = None
        if policy.opening_ids and start == "content":
            self._defer_opening()  # the prompt closed the block: the call comes first
        elif policy.opening_ids and start == "open":
            self._force.extend(fmt.open_ids)  # a forced call comes after reasoning: open it

    # -- the per-token stage ------------------------------------------------------------

    def owns_row(self) -> bool:
        """Inside the block, and while forcing; while the block may still open only when
        a forced call waits for it (otherwise the answer's masks apply from the start)."""
        if self._state == "open":
            return bool(self._policy.opening_ids)
        return self._state == "reasoning" or bool(self._force) or self._swallow > 0

    def logit_bias(self) -> Mapping[int, float] | None:
        if self._force:
            return {self._force[0]: FORCE_BIAS}
        if self._ban is not None:
            return {self._ban: -FORCE_BIAS}
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        if token_id < 0:  # text released as the row ends
            return self._text(text), False
        self.drawn += 1
        self._ban = None
        forced = bool(self._force)
        if forced:
            self._force.popleft()
        if self._swallow > 0:
            self._swallow -= 1
            return "", False
        if self._state == "content":
            return self._content(text), False
        if self._state == "open":
            return self._opening(token_id, text), False
        self.reasoning_tokens += 1
        if self._guard is not None:
            self._ids.append(token_id)
            self._lens.append(len(text))
        if forced:
            self._forced_text += len(text)
        self._buf += text
        return self._reasoning(), False

    def flush(self) -> str:
        if self._state == "reasoning":
            if self._force:  # the row ended inside a close the plugin was writing: none of it is reasoning
                self._buf = self._buf[: len(self._buf) - self._forced_part()].rstrip("\n")
            self._emit_side(self._buf)
            self._buf = ""
            return ""
        rest, self._buf = self._buf, ""
        return self._content(rest) if self._state == "content" else rest

    def side_text(self) -> Mapping[str, str] | None:
        if not self._side:
            return None
        out, self._side = self._side, ""
        return {FIELD: out}

    def take_back(self) -> int:
        out, self._take = self._take, 0
        return out

    def end_of_turn(self, token_id: int) -> bool:
        """The redirect: an end of turn drawn inside the block becomes its close. Where
        the close and an answer no longer fit in the row's tokens, the row ends by length
        (the truth: it ran out of tokens), never as a stop with reasoning only."""
        if self._state != "reasoning" or not self._policy.redirect or self._force:
            return False
        self._redirects += 1
        self.redirected_at = self.drawn - self.rewound  # where the close begins in the output
        self._force_close()
        return True

    def end(self, finish_reason: str) -> RowEnd | None:
        if not self.entered:
            return None
        # An end of turn drawn as the row's last token, inside the block: no room was left
        # to redirect it, and the turn did not end with an answer; it ran out of tokens.
        cut = finish_reason == "stop" and self._state == "reasoning" and self._policy.redirect
        usage = {"reasoning_tokens": self.reasoning_tokens}
        if self.rewound:
            usage["rewound_tokens"] = self.rewound
        choice = {"thinking_budget_forced_at": self.forced_at} if self.forced_at is not None else {}
        # A block with no text still says the model reasoned.
        fields = {} if self._started_side else {FIELD: ""}
        return RowEnd(fields=fields, usage=usage, choice=choice, finish_reason="length" if cut else None)

    # -- states -------------------------------------------------------------------------

    def _text(self, text: str) -> str:
        """Text with no token (the decoder's tail as the row ends)."""
        if self._state == "content":
            return self._content(text)
        self._buf += text
        return ""

    def _opening(self, token_id: int, text: str) -> str:
        """Before anything else: does the model open the block?"""
        self._buf += text
        self._opening_tokens += 1
        stripped = self._buf.lstrip()
        if stripped.startswith(self._fmt.open):
            self._state, self.entered = "reasoning", True
            self.reasoning_tokens += self._opening_tokens
            # The token that completed the opening is never taken back: only the text
            # after the marker joins the reasoning.
            self._buf = stripped[len(self._fmt.open) :]
            return self._reasoning()
        if self._fmt.open.startswith(stripped):
            return ""  # may still become the opening
        self._state = "content"
        rest, self._buf = self._buf, ""
        return self._content(rest)

    def _reasoning(self) -> str:
        """After a reasoning token: the close, a spent budget, a loop; then pass on what
        is safe to show."""
        at = self._buf.find(self._fmt.close)
        if at >= 0:
            return self._closed(at)
        holding = self._repeated_opening()
        if not self._force:
            budget, spend = self._policy.budget, self._policy.spend
            if (budget is not None and self.reasoning_tokens >= budget) or (spend is not None and self.drawn + self._redirects >= spend):
                self.forced_at = self.reasoning_tokens
                self._force_close()
            elif self._guard is not None and self._rewinds < self._guard.max_rewinds:
                self._loop()
        if not holding:  # the start is held while it may still be a repeated opening
            self._emit_safe()
        return ""

    def _repeated_opening(self) -> bool:
        """At the reasoning's start, an opening marker the model writes again (after the one
        the prompt or the model already wrote) is not reasoning: it is dropped. True while
        the start may still become one (the text is held)."""
        if self._head_read or self._started_side:
            return False
        head = self._buf.lstrip()
        if head.startswith(self._fmt.open):
            self._buf = head[len(self._fmt.open) :]
            self._head_read = True
        elif not head or self._fmt.open.startswith(head):
            return True  # only blanks so far, or what may still become the opening
        else:
            self._head_read = True
        return False

    def _closed(self, at: int) -> str:
        reasoning, after = self._buf[:at], self._buf[at + len(self._fmt.close) :]
        self._emit_side(reasoning.rstrip("\n"))
        self._buf, self._ids = "", []
        self._lens.clear()
        self._forced_text = 0
        self._state = "content"
        if self._policy.opening_ids:
            if not self._force:  # the model closed the block itself: the blank line first
                self._force.extend(self._fmt.gap_ids)
            self._defer_opening()
            return ""
        return self._content(after)

    def _defer_opening(self) -> None:
        """Force a forced call's opening next (after the rest of a forced close). Their
        text is not passed on: the tool-call processor has the opening already."""
        self._force.extend(self._policy.opening_ids)
        self._swallow = len(self._force)

    def _content(self, text: str) -> str:
        if not self._started_content:
            text = text.lstrip("\n")
            self._started_content = bool(text)
        return text

    def _force_close(self) -> None:
        text = self._buf or self._side or self._shown
        ends_line = not text or text.endswith("\n")
        self._force.extend(self._fmt.close_ids if ends_line else self._fmt.close_nl_ids)
        self._closing = ("" if ends_line else "\n") + self._fmt.close

    def _forced_part(self) -> int:
        """How much of the reasoning text's end the forced close wrote: the longest end
        that begins the close, no longer than the forced tokens' text (that text may also
        carry reasoning bytes the decoder held back)."""
        most = min(self._forced_text, len(self._buf), len(self._closing))
        return next((n for n in range(most, 0, -1) if self._buf.endswith(self._closing[:n])), 0)

    def _loop(self) -> None:
        assert self._guard is not None
        if len(self._ids) > 2 * self._guard.history:
            del self._ids[: len(self._ids) - self._guard.history]
        period = self._guard.period(self._ids)
        if not period or period > len(self._lens):
            return
        dropped = sum(self._lens.pop() for _ in range(period))
        self._buf = self._buf[: len(self._buf) - dropped]
        first = self._ids[-period]
        del self._ids[-period:]
        self._take, self._ban = period, first
        self.reasoning_tokens -= period
        self.rewound += period
        self._rewinds += 1

    def _emit_safe(self) -> None:
        """Pass on the reasoning text that can no longer be taken back nor begin the
        close marker."""
        held = sum(self._lens)
        # The start of a close marker, and the newlines that may come before one (they
        # are not part of the reasoning).
        partial = _partial_suffix(self._buf, self._fmt.close)
        newlines = len(self._buf) - partial - len(self._buf[: len(self._buf) - partial].rstrip("\n"))
        safe = len(self._buf) - max(held, partial + newlines)
        if safe > 0:
            self._emit_side(self._buf[:safe])
            self._buf = self._buf[safe:]

    def _emit_side(self, text: str) -> None:
        if not self._started_side:
            text = text.lstrip("\n")
            self._started_side = bool(text)
        self._side += text
        if self._side:
            self._shown = self._side[-1]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
