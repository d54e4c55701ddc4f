"""The plugin kit as a third party uses it: the ``millm_server_factory`` fixture (from
:mod:`millm_core.testing`) serving the ``millm_tiny_model`` fixture (from
:mod:`millm_engines.transformers.testing`) with an extra plugin of its own."""

from __future__ import annotations

from typing import Any

import httpx

from millm_core.api import Finalization, Outcome, RequestContext, ServedModel, hookimpl

# Both fixtures come from millm's pytest11 entry points (installed with the package), as
# they do in any project that installs millm: nothing is imported for them here.
from millm_core.testing import ServerFactory


class KitProbe:
    """A third party's feature plugin: it reports how many choices it saw."""

    @hookimpl
    def millm_finalize(self, ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
        out.extensions["kit_probe"] = {"choices": len(outcome.choices)}


def test_a_server_over_the_tiny_model_answers_a_chat(
    millm_server_factory: ServerFactory,  # noqa: F811 - the fixture imported above
    millm_tiny_model: ServedModel,  # noqa: F811
) -> None:
    """A third party's test: a real server over the kit's tiny model, with its own plugin
    registered, answers a chat completion (200, non-empty content, the plugin's extension)."""
    body = {
        "model": millm_tiny_model.info.served_name,
        "messages": [{"role": "user", "content": "The capital of France is"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    with millm_server_factory([millm_tiny_model], plugins=[("kit_probe", KitProbe())], max_queue=4) as server:
        reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert isinstance(data["choices"][0]["message"]["content"], str) and data["choices"][0]["message"]["content"]
    assert data["kit_probe"] == {"choices": 1}
