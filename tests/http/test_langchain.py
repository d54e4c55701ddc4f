"""LangChain's ``ChatOpenAI`` against a real millm server: ``bind_tools`` (a forced call
comes back as ``AIMessage.tool_calls``, and a tool result goes back in the history) and
``with_structured_output`` (a json_schema ``response_format``, parsed into a model)."""

from __future__ import annotations

from typing import Literal

import langchain_openai
from pydantic import BaseModel, Field

from millm_core.testing import RunningServer


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


class Verdict(BaseModel):
    """Whether a joke is funny."""

    label: Literal["humor", "not_humor"]
    sure: bool


def _llm(server: RunningServer, model: str) -> object:
    return langchain_openai.ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model=model, temperature=0, max_tokens=96, max_retries=0)


def test_bind_tools_round_trip(tools_server: RunningServer) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = _llm(tools_server, "tiny-hermes").bind_tools([GetWeather], tool_choice="GetWeather")  # type: ignore[attr-defined]
    question = HumanMessage("What is the weather in Paris?")
    reply = llm.invoke([question])
    assert len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])  # the forced arguments validate against the model
    # The call and its result go back into the history; the template renders both.
    follow = _llm(tools_server, "tiny-hermes").bind_tools([GetWeather]).invoke(  # type: ignore[attr-defined]
        [question, reply, ToolMessage(content="sunny", tool_call_id=call["id"])]
    )
    assert follow.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_with_structured_output(server: RunningServer) -> None:
    structured = _llm(server, "tiny").with_structured_output(Verdict, method="json_schema")  # type: ignore[attr-defined]
    verdict = structured.invoke("Is this funny? A horse walks into a bar.")
    assert isinstance(verdict, Verdict)
