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


def _readme_required_body() -> dict:
    """README's curl body for tool_choice "required" (the one the README shows the answer of)."""
    import pathlib
    import re
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    bodies = [json.loads(b) for b in re.findall(r"-d '(\{.*?\})'", readme, re.S)]
    (body,) = [b for b in bodies if b.get("tool_choice") == "required"]
    return body


def test_readme_required_example_gives_its_documented_answer(smol):
    """README's curl example as written: one get_weather call for Paris, content null,
    finish_reason tool_calls (parallel_tool_calls false ends the array after the call)."""
    import httpx
    body = _readme_required_body()
    r = httpx.post(str(smol.base_url) + "chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # a stop string that the forced call contains does not cut it (it was a 200 with neither
    # content nor a call)
    r = httpx.post(str(smol.base_url) + "chat/completions", json={**body, "stop": ["city"]}, timeout=600)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"][0]["function"] == call["function"]


def test_readme_json_schema_example_gives_valid_json(smol):
    """README's response_format curl body as written: a finished answer (finish_reason stop)
    whose content validates against the schema (an unbounded integer let SmolLM2 write digits
    until max_tokens)."""
    import pathlib
    import re
    import httpx
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    bodies = [json.loads(b) for b in re.findall(r"-d '(\{.*?\})'", readme, re.S)]
    (body,) = [b for b in bodies if "response_format" in b]
    r = httpx.post(str(smol.base_url) + "chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), body["response_format"]["json_schema"]["schema"])
    # the Python snippet beside it: the SDK's parse with README's City model
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str
        population: int = Field(ge=0, le=100_000_000)
    assert "additionalProperties" not in City.model_json_schema()   # what the offline snippet sends
    parsed = smol.chat.completions.parse(model="smollm2", response_format=City, max_tokens=64, temperature=0,
                                         messages=body["messages"]).choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name
    # the offline snippet's open schema (no strict): its properties close the object, as in vLLM
    # (SmolLM2 added fields beyond name and population while objects stayed open)
    r = smol.chat.completions.create(model="smollm2", max_tokens=64, temperature=0, messages=body["messages"],
                                     extra_body={"structured_outputs": {"json": City.model_json_schema()}})
    assert set(json.loads(r.choices[0].message.content)) == {"name", "population"}


def test_required_cut_off_by_max_tokens_returns_the_calls_as_far_as_they_got(smol, smollm2_gguf_path):
    """With parallel calls allowed (the default) SmolLM2 repeats its call until max_tokens: the
    calls completed by then come back as tool_calls (content null, finish_reason length), then
    the cut one with its arguments as far as they got (as OpenAI and vLLM answer), the same in
    chat (whole and streamed), Responses and the offline LLM.chat."""
    from ferrum import LLM, SamplingParams
    body = _readme_required_body()
    body.pop("parallel_tool_calls", None)
    tools = body["tools"]
    params = tools[0]["function"]["parameters"]
    kw = dict(model="smollm2", messages=body["messages"], tools=tools, tool_choice="required",
              temperature=0, max_tokens=body["max_tokens"])
    choice = smol.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    *finished, (_, cut) = calls
    assert len(finished) >= 2 and {name for name, _ in calls} == {"get_weather"}
    for _, args in finished:
        jsonschema.validate(json.loads(args), params)
    with pytest.raises(ValueError):   # the cut call's arguments: JSON text as far as it got
        json.loads(cut)
    # streamed: the same calls
    streamed, content, reason = {}, "", None
    for chunk in smol.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id:
                    streamed[d.index] = [d.function.name, ""]
                streamed[d.index][1] += d.function.arguments or ""
            reason = c.finish_reason or reason
    streamed = [tuple(v) for _, v in sorted(streamed.items())]
    assert (content, reason, streamed) == ("", "length", calls)
    # Responses: one function_call item per call, the response incomplete
    r = smol.responses.create(model="smollm2", input=body["messages"][0]["content"], temperature=0,
                              tool_choice="required", max_output_tokens=body["max_tokens"],
                              tools=[{"type": "function", **tools[0]["function"]}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.name, o.arguments) for o in r.output] == [("function_call", *c) for c in calls]
    # offline, as README's snippet calls it
    with LLM(smollm2_gguf_path, progress=False, device="cpu", max_model_len=2048) as llm:
        (out,) = llm.chat(body["messages"], SamplingParams(temperature=0, max_tokens=body["max_tokens"]),
                          tools=tools, tool_choice="required")[0].outputs
        assert out.finish_reason == "length" and out.text == ""
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in out.tool_calls] == calls
        (one,) = llm.chat(body["messages"], SamplingParams(temperature=0, max_tokens=body["max_tokens"]),
                          tools=tools, tool_choice="required", parallel_tool_calls=False)[0].outputs
        assert one.finish_reason == "tool_calls" and one.text == ""
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in one.tool_calls] == calls[:1]


def test_named_call_cut_off_by_max_tokens_comes_back_as_far_as_it_got(smol):
    """A named tool_choice cut off by max_tokens: the call with its arguments so far and
    finish_reason length, whole and streamed alike (an empty message before)."""
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=0, max_tokens=6)
    choice = smol.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    got, reason = [], None
    for chunk in smol.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                if d.id:
                    got.append([d.function.name, ""])
                got[d.index][1] += d.function.arguments or ""
            reason = c.finish_reason or reason
    assert (got, reason) == ([["get_weather", call.function.arguments]], "length")
