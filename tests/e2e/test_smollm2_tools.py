"""SmolLM2 end to end with function calling and structured output: the real ``millm serve``
with the example Hermes template, driven by the openai SDK."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .conftest import ServeProcess

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_smollm2_makes_a_forced_call_that_validates(smollm2_tools_server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=smollm2_tools_server.base_url + "/v1", api_key="unused", max_retries=4)  # 503 + Retry-After while the constraint vocabulary builds
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    # A real model reads the question: the city it names is the one asked about.
    assert "paris" in arguments["city"].lower()


def test_smollm2_answers_in_the_schema(smollm2_tools_server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=smollm2_tools_server.base_url + "/v1", api_key="unused", max_retries=4)  # 503 + Retry-After while the constraint vocabulary builds
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 40}}, "required": ["capital"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},  # type: ignore[typeddict-item]
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    document = json.loads(choice.message.content or "")
    jsonschema.validate(document, schema)
    assert "paris" in document["capital"].lower()
