"""POST /v1/responses through the official `openai` client against the live server that
test_server.py uses (conftest.py `server`: a tiny random Llama carrying SmolLM2's tokenizer
and chat template): text and item inputs, instructions, streaming events, logprobs, stateless
errors, bad values, function tools and text.format through chat's conversion (equal to chat
completions' answer)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from ferrum import SamplingParams
from ferrum.entrypoints.openai.responses import ResponsesRequest, input_messages
from ferrum.errors import InvalidRequestError
from test_server import TOOLS as CHAT_TOOLS
from test_server import KEY, MODEL, SCHEMAS, _err, _post, client, tok  # noqa: F401

QUESTION = "What is the capital of France?"


def _offline_text(offline, msgs, max_tokens):
    out = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    return out.outputs[0], len(out.prompt_token_ids)


def test_text_input_equals_offline_chat(client, offline):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=9, temperature=0)
    ref, n_prompt = _offline_text(offline, [{"role": "user", "content": QUESTION}], 9)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == ref.text
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage.input_tokens == n_prompt and r.usage.output_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == n_prompt + len(ref.token_ids)
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.store is False
    if ref.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_instructions_and_message_items(client, offline):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
             {"role": "user", "content": "Another one?"}]
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=items,
                                max_output_tokens=6, temperature=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"}]
    ref, n_prompt = _offline_text(offline, msgs, 6)
    assert r.output_text == ref.text and r.usage.input_tokens == n_prompt
    assert r.instructions == "Be brief."


def test_function_call_items_become_chat_tool_messages():
    req = ResponsesRequest(model=MODEL, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]}])
    assert input_messages(req) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon", "name": "get_time"}]
    # a function_call_output whose output is not text names `output` (it has no content)
    for bad, param in [({"a": 1}, "input[2].output"), (None, "input[2].output"), (5, "input[2].output"),
                       ([{"type": "input_image"}], "input[2].output[0].type")]:
        req = ResponsesRequest(model=MODEL, input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": bad}])
        with pytest.raises(InvalidRequestError, match=r"^input\[2\]\.output( |\[0\] )") as e:
            input_messages(req)
        assert e.value.param == param
    req = ResponsesRequest(model=MODEL, input=[{"role": "user", "content": 7}])
    with pytest.raises(InvalidRequestError, match=r"^input\[0\]\.content must be a string"):
        input_messages(req)


@pytest.mark.parametrize("item, param", [
    ({"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "picture"}]},
     "input[2].content[1].type"),
    ({"role": "user", "content": [{"type": "input_text", "text": 5}]}, "input[2].content[0].text"),
    ({"role": "user", "content": ["just a string"]}, "input[2].content[0]"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[2].content[0].type"),
    ({"role": "user"}, "input[2].content"),
    ({"role": "robot", "content": "x"}, "input[2].role"),
    ({"type": "function_call", "call_id": "c2", "name": "", "arguments": "{}"}, "input[2].name"),
    ({"type": "function_call", "call_id": 7, "name": "f", "arguments": "{}"}, "input[2].call_id"),
    ({"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}, "input[2].call_id"),
    ({"type": "function_call_output", "call_id": "nope", "output": "r"}, "input[2].call_id"),
    ({"type": "function_call_output", "call_id": "c1", "output": {"a": 1}}, "input[2].output"),
    ({"type": "web_search_call"}, "input[2].type"),
    ({"type": "item_reference", "id": "msg_1"}, "input[2].type"),
])
def test_a_bad_input_item_is_named_in_param(item, param):
    """The error's param named only `input`; as OpenAI's does, it now names the item and the
    field at fault (`input[2].content[1].type`), and the message starts with that path."""
    req = ResponsesRequest(model=MODEL, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}, item])
    with pytest.raises(InvalidRequestError) as e:
        input_messages(req)
    assert e.value.param == param and str(e.value).startswith("input[2]"), str(e.value)


def test_stream_events_in_order_and_deltas_join(client):
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    n_delta = types.count("response.output_text.delta")
    final = "response.completed" if full.status == "completed" else "response.incomplete"
    assert n_delta >= 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n_delta
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", final])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-4].text == events[-3].part.text
    assert events[-2].item.content[0].text == text
    done = events[-1].response
    assert done.output_text == text and done.status == full.status
    assert done.usage.output_tokens == full.usage.output_tokens
    # the raw stream: `event:` lines name each event, and no [DONE] sentinel (as OpenAI)
    with httpx.stream("POST", str(client.base_url) + "responses", json={**kw, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as raw:
        lines = [x for x in raw.iter_lines() if x]
    assert lines[0] == "event: response.created" and "[DONE]" not in lines[-1]
    assert json.loads(lines[1].removeprefix("data: "))["type"] == "response.created"


def test_output_logprobs(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens
    for e in lps:
        assert len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4)
    assert b"".join(bytes(e.bytes) for e in lps).decode("utf-8", errors="replace") == r.output_text


def test_stateless_errors(server, client):
    for extra, param in [({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"conversation": "conv_1"}, "conversation"), ({"background": True}, "background")]:
        e = _err(_post(server, "/v1/responses", {"model": MODEL, "input": "hi", **extra}), 400)
        assert e["param"] == param and ("stored state" in e["message"] or "stateless" in e["message"])
    ok = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert ok.store is False
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_123")
    assert "stored state" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_123")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_123")


def test_bad_values_name_the_field(server):
    ok = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
    for body, param, words in [
            ({**ok, "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
            ({**ok, "max_output_tokens": 100000}, "max_output_tokens", "max_model_len"),
            ({**ok, "temperature": -1}, "temperature", ">= 0"),
            ({**ok, "temperature": 2.01}, "temperature", "less than or equal to 2"),
            ({**ok, "top_p": 0}, "top_p", "(0, 1]"),
            ({**ok, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
            ({**ok, "include": ["file_search_call.results"]}, "include", "not supported"),
            ({**ok, "truncation": "auto"}, "truncation", "never drops"),
            ({**ok, "reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
            ({**ok, "input": image}, "input[0].content[0].type", "text only"),
            ({**ok, "input": []}, "input", "empty"),
            ({**ok, "input": ""}, "input", "empty"),   # as /v1/completions refuses prompt ""
            ({**ok, "input": [{"role": "robot", "content": "x"}]}, "input[0].role", "input[0].role"),
            ({**ok, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stored state"),
            ({**ok, "input": [{"type": "function_call", "call_id": "c"}]}, "input[0].name", "input[0].name"),
            ({**ok, "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                              {"type": "function_call_output", "call_id": "c2", "output": "r"}]},
             "input[1].call_id", "input[1].call_id 'c2' matches no function_call"),
            ({**ok, "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                              {"role": "user", "content": "x"},
                              {"type": "function_call_output", "call_id": "c1", "output": "r"}]},
             "input[2].call_id", "'c1' answers no function_call of the turn"),
            ({**ok, "input": 5}, "input", "input"),
            ({**ok, "seed": 3}, "seed", "seed"),
            ({**ok, "instructions": 5}, "instructions", "instructions"),
            ({**ok, "metadata": {"k": 1}}, "metadata", "metadata"),
            ({**ok, "text": {"format": {"type": "xml"}}}, "text", "text.format.type"),
            ({**ok, "stream": "maybe"}, "stream", "stream"),
            ({**ok, "parallel_tool_calls": "x"}, "parallel_tool_calls", "parallel_tool_calls"),
            ({**ok, "model": "gpt-4"}, None, "gpt-4")]:
        status = 404 if param is None else 400
        e = _err(_post(server, "/v1/responses", body), status)
        assert e["param"] == param and words in e["message"], (body, e)
    e = _err(_post(server, "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}), 400)
    assert e["param"] == "prompt" and "empty" in e["message"]


def test_function_call_items_and_their_events():
    """Text then two tool calls (as a tool parser's streamer hands them over): a message item,
    then one function_call item per call, each with its events in OpenAI's order."""
    from ferrum.entrypoints.openai.responses import _ResponseState
    req = ResponsesRequest(model=MODEL, input="x", tools=[])
    state = _ResponseState("resp_1", MODEL, req, 5, None)
    state.add_text("Let me check.")
    state.add_call_delta({"index": 0, "id": "call_a", "type": "function",
                          "function": {"name": "get_weather", "arguments": ""}})
    state.add_call_delta({"index": 0, "function": {"arguments": '{"city": '}})
    state.add_call_delta({"index": 0, "function": {"arguments": '"Paris"}'}})
    state.add_call_delta({"index": 1, "id": "call_b", "type": "function",
                          "function": {"name": "get_time", "arguments": "{}"}})
    state.finish()
    events = state.take_events()
    assert [k for k, _ in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [f["output_index"] for k, f in events if k == "response.output_item.added"] == [0, 1, 2]
    assert events[9][1]["arguments"] == '{"city": "Paris"}' and events[9][1]["output_index"] == 1
    body = state.body()
    msg, call_a, call_b = body["output"]
    assert msg["content"][0]["text"] == "Let me check." and msg["status"] == "completed"
    assert call_a["type"] == "function_call" and call_a["call_id"] == "call_a"
    assert call_a["name"] == "get_weather" and call_a["arguments"] == '{"city": "Paris"}'
    assert call_b["arguments"] == "{}" and call_b["status"] == "completed"
    assert call_a["id"].startswith("fc_") and call_a["id"] != call_b["id"]


def test_message_logprobs_cover_the_message_text_only(tok):
    """Text then a Hermes call, with include logprobs: the message's logprobs were those of
    every token, the call's included ('Sure thing. <tool_call>...' for text 'Sure thing.'), and
    streamed they stopped wherever the call began (the stream's differed from the answer's).
    Both now hold the tokens of the message text, which they join to."""
    from ferrum.entrypoints.openai.logprobs import TokenFormatter
    from ferrum.entrypoints.openai.responses import _ResponseState
    from ferrum.outputs import CompletionOutput, Logprob, RequestOutput
    from ferrum.tool_parsers.hermes import HermesToolParser
    text = 'Sure thing. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.encode(text)
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    assert tok.decode(ids) == text
    req = ResponsesRequest(model=MODEL, input="x", include=["message.output_text.logprobs"])
    for chunk in (None, 1, 3):   # None: the whole answer at once
        state = _ResponseState("resp_1", MODEL, req, 5, TokenFormatter(tok), HermesToolParser())
        cuts = [len(ids)] if chunk is None else [*range(chunk, len(ids), chunk), len(ids)]
        sent = 0
        for n in cuts:
            done = n == len(ids)
            now = text[:ends[n - 1]]
            out = CompletionOutput(0, text=now, token_ids=ids[:n], finish_reason="stop" if done else None,
                                   logprobs=[{t: Logprob(-0.5)} for t in ids[:n]],
                                   token_text_ends=ends[:n], delta_text=now[sent:])
            sent = len(now)
            state.update(RequestOutput("r", None, [1], [out], finished=done), whole=chunk is None)
        state.finish()
        msg, call = state.body()["output"]
        part = msg["content"][0]
        assert part["text"] == "Sure thing." and call["arguments"] == '{"city": "Paris"}', chunk
        assert "".join(e["token"] for e in part["logprobs"]) == "Sure thing.", (chunk, part["logprobs"])


def test_only_the_item_a_token_limit_cut_is_incomplete():
    """Forced calls cut by max_output_tokens in the second one: the first call, closed when the
    second began, is "completed" and only the cut one "incomplete", whole and streamed in any
    chunks (as OpenAI marks them). The whole answer marked every item "incomplete", and a
    stream whose last output closed one item and cut the next did too."""
    from ferrum.entrypoints.openai.responses import _ResponseState
    from ferrum.outputs import CompletionOutput, RequestOutput
    from ferrum.tool_parsers.constrained import RequiredToolParser
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "'
    req = ResponsesRequest(model=MODEL, input="x", tools=TOOLS, tool_choice="required")
    for chunk in (None, 1, 7, len(text) - 1):   # None: the whole answer at once
        state = _ResponseState("resp_1", MODEL, req, 5, None, RequiredToolParser(None))
        cuts = [len(text)] if chunk is None else [*range(chunk, len(text), chunk), len(text)]
        sent, done_items = 0, []
        for n in cuts:
            done = n == len(text)
            out = CompletionOutput(0, text=text[:n], token_ids=list(range(n)), delta_text=text[sent:n],
                                   finish_reason="length" if done else None)
            sent = n
            state.update(RequestOutput("r", None, [1], [out], finished=done), whole=chunk is None)
            if done:
                state.finish()
            done_items += [f["item"] for k, f in state.take_events() if k == "response.output_item.done"]
        body = state.body()
        assert body["status"] == "incomplete", chunk
        assert [(o["name"], o["status"]) for o in body["output"]] == [
            ("get_weather", "completed"), ("get_time", "incomplete")], chunk
        assert [o["status"] for o in done_items] == ["completed", "incomplete"], chunk


# ---- tools and text.format ---------------------------------------------------------------------
TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]   # Responses' flat form
ASK = "What is the weather in Paris?"


def _streamed_output(events) -> list[dict]:
    """Output items rebuilt from stream events alone (deltas joined), checking each item's
    events arrive between its output_item.added and output_item.done."""
    items, open_item = [], None
    for e in events:
        if e.type == "response.output_item.added":
            assert open_item is None
            open_item = {"type": e.item.type, "text": "", "arguments": "",
                         "name": getattr(e.item, "name", None)}
        elif e.type == "response.output_text.delta":
            open_item["text"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            open_item["arguments"] += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == open_item["arguments"] and e.name == open_item["name"]
        elif e.type == "response.output_item.done":
            item = e.item
            assert item.type == open_item["type"]
            if item.type == "function_call":
                assert item.arguments == open_item["arguments"]
                items.append(("function_call", item.name, item.arguments))
            else:
                assert item.content[0].text == open_item["text"]
                items.append(("message", item.content[0].text))
            open_item = None
    assert open_item is None and events[-1].type == "response.completed"
    return items


def _whole_output(r) -> list[tuple]:
    return [("function_call", o.name, o.arguments) if o.type == "function_call"
            else ("message", o.content[0].text) for o in r.output]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}],
                         ids=["required", "named"])
def test_tools_give_function_call_items_like_chat(client, choice):
    """Forced tool calls: function_call items whose arguments validate, the same calls chat
    completions returns for the same request, and a stream that rebuilds the same items."""
    import jsonschema
    kw = dict(model=MODEL, input=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
              max_output_tokens=200)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and len(calls) == len(r.output)
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if isinstance(choice, dict):
        assert [c.name for c in calls] == ["get_time"]
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": "get_time"}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          tools=CHAT_TOOLS, tool_choice=chat_choice, temperature=0,
                                          max_tokens=200).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in chat.tool_calls] == \
        [(c.name, c.arguments) for c in calls]
    assert r.usage.input_tokens == client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS,
        tool_choice=chat_choice, max_tokens=1).usage.prompt_tokens
    events = list(client.responses.create(stream=True, **kw))
    assert _streamed_output(events) == _whole_output(r)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    one = client.responses.create(**{**kw, "parallel_tool_calls": False})
    assert len(one.output) == 1 and one.output[0].type == "function_call"


def test_function_call_round_trip_items(client):
    """A call and its output sent back as input items render as chat's tool messages: the
    prompt equals chat completions' for the same conversation."""
    call = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required",
                                   temperature=0, max_output_tokens=200).output[0]
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}]
    r = client.responses.create(model=MODEL, input=items, tools=TOOLS, temperature=0, max_output_tokens=8)
    msgs = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp_c": 18}'}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, tools=CHAT_TOOLS, temperature=0,
                                          max_tokens=8)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_text_format_outputs_json_like_chat(client, kind):
    import jsonschema
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "score"], "additionalProperties": False}
    fmt = ({"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
           if kind == "json_schema" else {"type": "json_object"})
    kw = dict(model=MODEL, input=ASK, text={"format": fmt}, temperature=0, max_output_tokens=120)
    r = client.responses.create(**kw)
    if kind == "json_schema":
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.status == "completed" and r.text.format.type == "json_schema"
    elif r.status == "completed":   # json_object: a random model may run out of tokens
        assert isinstance(json.loads(r.output_text), dict)
    chat_fmt = ({"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
                if kind == "json_schema" else {"type": "json_object"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          response_format=chat_fmt, temperature=0, max_tokens=120)
    assert r.output_text == chat.choices[0].message.content
    events = list(client.responses.create(stream=True, **kw))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text


def test_tools_and_text_format_bad_values_name_the_field(server):
    ok = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    for body, param in [
            ({**ok, "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({**ok, "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
            ({**ok, "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
            ({**ok, "tools": [*TOOLS, {"type": "function", "name": "f", "parameters": {"type": "objekt"}}]},
             f"tools[{len(TOOLS)}].parameters"),
            ({**ok, "tools": [{"type": "function", "name": "f", "parameters": {
                "type": "array", "uniqueItems": True}}], "tool_choice": "required"}, "tools[0].parameters"),
            ({**ok, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
            ({**ok, "tools": TOOLS, "tool_choice": {"type": "mcp"}}, "tool_choice"),
            ({**ok, "tool_choice": "required"}, "tool_choice"),
            ({**ok, "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
            ({**ok, "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
             "text.format.name"),
            ({**ok, "text": {"format": {"type": "json_schema", "name": "n",
                                        "schema": {"type": "array", "uniqueItems": True}}}}, "text.format"),
            ({**ok, "tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
             "text.format"),
            ({**ok, "text": {"format": {"type": "json_schema", "name": "n", "schema": {   # cannot be lexed
                "type": "object", "properties": {"k": {"type": "string", "pattern": "^b{999999}$"}},
                "required": ["k"]}}}}, "text.format")]:
        e = _err(_post(server, "/v1/responses", body), 400)
        assert e["param"] == param and e["message"].startswith(param), (body, e)
