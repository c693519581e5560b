"""Tool calling end to end on the real SmolLM2-135M-Instruct (GGUF), through `ferrum serve` and
the official `openai` client, the way an agent uses it: a call forced with tool_choice
"required", the tool's result sent back with the assistant message as the client returned
it, and a final answer."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from live_server import live_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city, e.g. Paris"},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
RESULT = {"city": "Paris", "temperature": 22, "unit": "celsius", "sky": "sunny"}


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path, tmp_path_factory):
    with live_server([smollm2_gguf_path, "--served-model-name", "smollm2", "--device", "cpu",
                      "--max-model-len", "2048"], tmp_path_factory.mktemp("smol") / "server.log",
                     timeout_s=600) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_tool_call_round_trip(smol):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kw = dict(model="smollm2", tools=[WEATHER], temperature=0, max_tokens=120)
    first = smol.chat.completions.create(messages=messages, tool_choice="required", **kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the same request streamed: id and name first, then argument fragments that join
    names, fragments, reason = [], "", None
    for chunk in smol.chat.completions.create(messages=messages, tool_choice="required", stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.id:
                    names.append(d.function.name)
                fragments += d.function.arguments or ""
            reason = c.finish_reason or reason
    assert (names, fragments, reason) == (["get_weather"], call.function.arguments, "tool_calls")

    messages.append(choice.message)          # the SDK's own object, with its null fields
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)})
    final = smol.chat.completions.create(messages=messages, **kw).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "22" in final.message.content       # the tool result reached the model
