"""What the reasoning tests share: a plugin that forces scripted tokens (so that budgets,
redirects and loops happen on a model with random weights), and a reference that steps a
second copy of the model directly, with the same biases, and splits its text the way the
reasoning plugin should."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from millm_core.api import ForwardPlan, RequestContext, SamplingParams, hookimpl
from millm_core.detokenize import Detokenizer
from millm_core.engine import RowSpec

FORCE = 30000.0
CLOSE = "</think>"


class Script:
    """Forces ``ids[i]`` at step i (None: the model chooses), until its row is rewound."""

    def __init__(self, ids: Sequence[int | None]) -> None:
        self.ids = list(ids)
        self.step = 0
        self.stopped = False

    def logit_bias(self) -> dict[int, float] | None:
        if self.stopped or self.step >= len(self.ids):
            return None
        tok = self.ids[self.step]
        self.step += 1
        return None if tok is None else {tok: FORCE}

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        return text, False

    def flush(self) -> str:
        return ""

    def on_rewind(self, k: int) -> None:
        self.stopped = True


class ScriptPlugin:
    """``X-Script: [ids or null, ...]`` puts a :class:`Script` before every other processor."""

    @hookimpl(trylast=True)
    def millm_pre_forward(self, ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
        raw = ctx.headers.get("x-script")
        if raw:
            ids = json.loads(raw)
            plan.add_processor(lambda _row: Script(ids), first=True)


def reference(engine: Any, prompt: Sequence[int], n: int, biases: Mapping[int, Mapping[int, float]] | None = None) -> list[int]:
    """``n`` greedy tokens after ``prompt``, with ``biases[step]`` added at that step;
    stops early at an end of sequence (which is included)."""
    batch = engine.open_batch([RowSpec(prompt_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0))])
    out: list[int] = []
    try:
        for step in range(n):
            [tok] = engine.step(batch, [dict((biases or {}).get(step, {})) or None])
            out.append(tok)
            if tok in engine.eos_token_ids:
                break
    finally:
        engine.close(batch)
    return out


def texts(engine: Any, ids: Sequence[int]) -> str:
    """The text the server's row decoder makes of ``ids`` (end of sequence excluded)."""
    detok = Detokenizer(engine.decode)
    out = "".join(detok.push(t) for t in ids if t not in engine.eos_token_ids)
    return out + detok.flush()


def split(text: str, opened: bool = True) -> tuple[str, str]:
    """(reasoning, answer) as the reasoning plugin should return them for a row that
    started inside the block: leading newlines of each part dropped, trailing newlines
    of the reasoning before the close too."""
    at = text.find(CLOSE)
    if at < 0:
        return text.lstrip("\n"), ""
    return text[:at].lstrip("\n").rstrip("\n"), text[at + len(CLOSE) :].lstrip("\n")


def forcing(start: int, ids: Sequence[int]) -> dict[int, dict[int, float]]:
    """Biases that force ``ids`` from step ``start`` on."""
    return {start + i: {tok: FORCE} for i, tok in enumerate(ids)}
