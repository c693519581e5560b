"""OpenAI chat requests -> template messages, tools, constraints (ferrum.entrypoints.chat_utils):
what reaches the chat template equals what Hugging Face's apply_chat_template(messages,
tools=...) renders from the same conversation in its own form; every bad value is a named
error; the tool_choice schemas accept exactly the calls they should."""
from __future__ import annotations

import json

import jsonschema
import pytest

from ferrum.entrypoints.chat_utils import (parse_messages, parse_tool_choice, parse_tools,
                                          prepare_chat, response_format_constraint,
                                          tool_choice_constraint)
from ferrum.errors import InvalidRequestError
from ferrum.tool_parsers import NamedToolParser, RequiredToolParser
from ferrum.tool_parsers.hermes import HermesToolParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}

CONVERSATION = [
    {"role": "developer", "content": "Be brief.", "extra_key": 1},
    {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Weather in"},
                                                {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
]

# A template in the style of Qwen2.5's (tools as JSON, calls with `arguments | tojson`,
# tool results by id), written for this test.
TOOLS_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{% if m.name %}({{ m.name }}){% endif %}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{%- if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


def test_messages_reach_the_template_as_hf_passes_them(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = parse_messages(CONVERSATION)
    assert msgs[0] == {"role": "system", "content": "Be brief."}     # developer -> system, extra key gone
    assert msgs[1] == {"role": "user", "content": "Weather in\nParis?", "name": "ann"}
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[3] == {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1"}
    hf_form = [{"role": "system", "content": "Be brief."},
               {"role": "user", "name": "ann", "content": "Weather in\nParis?"},
               {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    expected = tok.hf.apply_chat_template(hf_form, tools=[WEATHER], chat_template=TOOLS_TEMPLATE,
                                          tokenize=False, add_generation_prompt=True)
    chat = prepare_chat(tok, CONVERSATION, tools=[WEATHER], chat_template=TOOLS_TEMPLATE)
    assert tok.decode(chat.prompt_token_ids, skip_special_tokens=False) == expected
    assert 'get_weather {"city": "Paris"}' in expected          # a dict, not a JSON string
    assert isinstance(chat.tool_parser, HermesToolParser) and chat.structured_outputs is None
    assert chat.tool_parser.names == {"get_weather"}     # a call of another function stays content


def test_history_arguments_that_are_not_a_json_object_stay_strings(smollm2_tokenizer):
    """OpenAI accepts any string as a past call's arguments (a model's malformed JSON echoed
    back): it reaches the template as sent; a JSON object becomes a dict."""
    conv = [CONVERSATION[1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}},
        {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]
    args = [c["function"]["arguments"] for c in parse_messages(conv)[1]["tool_calls"]]
    assert args == ['{"city": "Par', "[1, 2]", {"city": "Oslo"}]
    chat = prepare_chat(smollm2_tokenizer, conv, tools=[WEATHER], chat_template=TOOLS_TEMPLATE)
    text = smollm2_tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert 'get_weather "{\\"city\\": \\"Par"</call>' in text and 'get_weather {"city": "Oslo"}' in text


def test_history_arguments_nested_too_deep_stay_strings():
    """Arguments nested deeper than json.loads recurses raised RecursionError: chat, /tokenize
    and a Responses function_call item answered 500. They stay the string sent, as any other
    string that is not a JSON object."""
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    conv = [CONVERSATION[1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}]}]
    assert parse_messages(conv)[1]["tool_calls"][0]["function"]["arguments"] == deep


def test_a_function_without_parameters_takes_an_empty_object():
    """OpenAI: leaving `parameters` out declares a function without arguments, so under
    tool_choice "required" or its name the grammar allows {} only (an open object let the
    model write keys until max_tokens)."""
    from ferrum.entrypoints.chat_utils import parse_tools, tool_choice_constraint
    tools = parse_tools([{"type": "function", "function": {"name": "now"}}])
    assert tools[0]["function"]["parameters"] == {"type": "object", "properties": {},
                                                  "additionalProperties": False}
    named = tool_choice_constraint(tools, {"type": "function", "function": {"name": "now"}})
    assert json.loads(named.json) if isinstance(named.json, str) else named.json == tools[0]["function"]["parameters"]
    req = tool_choice_constraint(tools, "required").json
    req = json.loads(req) if isinstance(req, str) else req
    assert req["items"]["anyOf"][0]["properties"]["parameters"]["additionalProperties"] is False


def test_template_without_tools_gets_the_hermes_tool_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = CONVERSATION + [{"role": "tool", "tool_call_id": "call_1", "content": "(second result)"}]
    chat = prepare_chat(tok, conv, tools=[WEATHER])
    text = tok.decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert json.dumps(WEATHER) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\n"
            "(second result)\n</tool_response><|im_end|>") in text
    # tool_choice "none": the tools are not offered, history is still written out
    none = tok.decode(prepare_chat(tok, conv, tools=[WEATHER], tool_choice="none").prompt_token_ids,
                      skip_special_tokens=False)
    assert "<tools>" not in none and "<tool_response>" in none


@pytest.mark.parametrize("messages,param,match", [
    ([], "messages", "non-empty"),
    ([{"role": "function", "content": "x"}], "messages[0].role", "one of"),
    ([{"content": "x"}], "messages[0].role", "one of"),
    ([{"role": "user"}], "messages[0].content", "required"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}],
     "messages[0].content[0]", "text only"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
     "messages[0].content[1]", "text only"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]", "text part"),
    ([{"role": "tool", "content": "r"}], "messages[0].tool_call_id", "required"),
    # a tool message answers a call of the assistant message it follows (OpenAI refuses others)
    (CONVERSATION[:3] + [{"role": "tool", "tool_call_id": "call_9", "content": "r"}],
     "messages[3].tool_call_id", "'call_9' answers no tool call.*'call_1'"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1", "content": "r"}],
     "messages[1].tool_call_id", "answer here: none"),
    (CONVERSATION + [{"role": "user", "content": "and?"},
                     {"role": "tool", "tool_call_id": "call_1", "content": "r"}],
     "messages[5].tool_call_id", "answer here: none"),
    (CONVERSATION + [{"role": "tool", "tool_call_id": "call_1", "content": "again"}], None, None),
    ([{"role": "user", "content": "x", "name": 3}], "messages[0].name", "string"),
    ([{"role": "user", "content": "x", "tool_calls": []}], None, None),          # empty list is fine
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
     "messages[0].tool_calls", "only assistant"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": 5}}]}],
     "messages[0].tool_calls[0].function.arguments", "must be a string"),
    ([{"role": "assistant", "tool_calls": [{"type": "custom", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].type", "function"),
    ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[0].tool_calls[0]", "name"),
])
def test_bad_messages_are_named(messages, param, match):
    if param is None:
        parse_messages(messages)
        return
    with pytest.raises(InvalidRequestError, match=match) as info:
        parse_messages(messages)
    assert info.value.param == param


@pytest.mark.parametrize("tools,param", [
    ([], "tools"),
    ({"type": "function"}, "tools"),
    ([{"type": "custom", "custom": {"name": "x"}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "true"}}], "tools[0].function.strict"),
])
def test_bad_tools_are_named(tools, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_tools(tools)
    assert info.value.param == param


def test_tool_choice_values():
    tools = parse_tools([WEATHER, CLOCK])
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, None) == "none"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, tools) == named
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}},
                {"type": "function"}, {"function": {"name": "get_time"}}, 3):
        with pytest.raises(InvalidRequestError) as info:
            parse_tool_choice(bad, tools)
        assert info.value.param == "tool_choice"
    for mode in ("required", "auto", named):
        with pytest.raises(InvalidRequestError) as info:
            parse_tool_choice(mode, None)
        assert info.value.param == "tool_choice"


def test_required_schema_accepts_exactly_valid_calls():
    tools = parse_tools([WEATHER, CLOCK])
    schema = tool_choice_constraint(tools, "required", parallel_tool_calls=True).json
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {"zone": "CET"}}]
    jsonschema.validate(good, schema)                      # $defs were lifted to the root
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_time", "parameters": {"zone": "PST"}}],
                [{"name": "other", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "x"}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_constraint(tools, "required", parallel_tool_calls=False).json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    named = tool_choice_constraint(tools, {"type": "function", "function": {"name": "get_time"}})
    assert named.json == CLOCK["function"]["parameters"] and named.param == "tools[1].function.parameters"
    # a $ref into the tool's own root would point into the combined schema under "required"
    loop = parse_tools([CLOCK, {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}])
    with pytest.raises(InvalidRequestError, match="defs") as info:
        tool_choice_constraint(loop, "required")
    assert info.value.param == "tools[1].function.parameters"
    arr = {"type": "array", "items": {"$ref": "#"}}
    for bad in ({"properties": {"default": arr}},                       # a property named like a keyword
                {"properties": {"enum": {"$ref": "#/properties/n"}}},
                {"$defs": {"examples": {"$ref": "#"}}}, {"properties": {"a": {"$ref": ""}}},
                {"allOf": [{"properties": {"k": {"$ref": "#"}}}]}):
        with pytest.raises(InvalidRequestError, match="defs"):
            tool_choice_constraint(parse_tools([{"type": "function", "function": {
                "name": "t", "parameters": {"type": "object", **bad}}}]), "required")
    for good in ({"$defs": {"x": {"type": "string"}}, "properties": {"a": {"$ref": "#/%24defs/x"}}},
                 {"properties": {"a": {"$anchor": "node", "type": "string"}, "b": {"$ref": "#node"}}},
                 {"x-meta": {"$ref": "#"}}, {"properties": {"$ref": {"type": "string"}}},
                 {"properties": {"c": {"const": {"$ref": "#"}}}}):     # data, not references
        tool_choice_constraint(parse_tools([{"type": "function", "function": {
            "name": "t", "parameters": {"type": "object", **good}}}]), "required")
    assert tool_choice_constraint(loop, {"type": "function", "function": {"name": "tree"}}).json["type"] == "object"
    assert tool_choice_constraint(tools, "auto") is None
    # a forced call's arguments are a JSON object even where the schema does not say so ({}
    # let the model write a string, which came back as content, or as a call, finishing "stop");
    # a schema of another type cannot be enforced
    for params in ({}, {"properties": {"a": {"type": "integer"}}}, {"type": ["object", "null"]}):
        t = parse_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            schema = tool_choice_constraint(t, choice).json
            args = schema["items"]["anyOf"][0]["properties"]["parameters"] if choice == "required" else schema
            assert args["type"] == "object"
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate([{"name": "f", "parameters": "x"}] if choice == "required" else "x", schema)
    for params in ({"type": "string"}, {"type": ["array", "null"]}):
        t = parse_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            with pytest.raises(InvalidRequestError, match="must describe a JSON object") as info:
                tool_choice_constraint(t, choice)
            assert info.value.param == "tools[0].function.parameters"
    # a function's strict: true closes its objects, as response_format's strict does
    nested = {"properties": {"o": {"type": "object", "properties": {"k": {"type": "integer"}}}}}
    for strict in (True, False):
        t = parse_tools([{"type": "function", "function": {"name": "f", "parameters": nested, "strict": strict}}])
        args = tool_choice_constraint(t, {"type": "function", "function": {"name": "f"}}).json
        assert (args.get("additionalProperties"), args["properties"]["o"].get("additionalProperties")) == (
            (False, False) if strict else (None, None))
        req = tool_choice_constraint(t, "required").json
        assert (req["items"]["anyOf"][0]["properties"]["parameters"].get("additionalProperties") is False) == strict
    clash = parse_tools([CLOCK, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "$defs": {"zone": {"type": "string"}}}}}])
    with pytest.raises(InvalidRequestError, match="zone") as info:
        tool_choice_constraint(clash, "required")
    assert info.value.param == "tools"


def test_response_format_values():
    assert response_format_constraint(None) is None
    assert response_format_constraint({"type": "text"}) is None
    assert response_format_constraint({"type": "json_object"}).json_object
    s = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for strict in (None, False):
        c = response_format_constraint({"type": "json_schema", "json_schema": {"name": "x", "schema": s,
                                                                              "strict": strict}})
        assert c.json == s and c.param == "response_format"
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json", {"type": "json_schema", "json_schema": []}):
        with pytest.raises(InvalidRequestError) as info:
            response_format_constraint(bad)
        assert info.value.param == "response_format"
    # OpenAI requires the name (a-z, A-Z, 0-9, _ and -, up to 64); strict must be a boolean
    for spec, param in [({"schema": s}, "name"), ({"name": "a b", "schema": s}, "name"),
                        ({"name": "x" * 65}, "name"), ({"name": "x", "schema": 3}, "schema"),
                        ({"name": "x", "schema": s, "strict": "yes"}, "strict")]:
        with pytest.raises(InvalidRequestError) as info:
            response_format_constraint({"type": "json_schema", "json_schema": spec})
        assert info.value.param == f"response_format.json_schema.{param}", spec
        assert str(info.value).startswith(info.value.param)


def test_strict_json_schema_closes_objects_that_do_not_say():
    """strict: true (OpenAI) means additionalProperties: false in every object schema that does
    not set it: nested properties, items, anyOf branches and $defs; an object that sets it keeps
    its value, and the parts of an allOf stay open (closing each would refuse their union)."""
    leaf = {"type": "object", "properties": {"v": {"type": "string"}}}
    schema = {"type": "object", "properties": {
        "a": leaf, "b": {"type": "array", "items": leaf}, "c": {"anyOf": [leaf, {"type": "null"}]},
        "d": {"type": "object", "additionalProperties": {"type": "integer"}},
        "e": {"allOf": [leaf, {"type": "object", "properties": {"w": {"type": "integer"}}}]},
        "f": {"$ref": "#/$defs/thing"}},
        "$defs": {"thing": {"type": ["object", "null"], "properties": {"x": leaf}}}}
    closed = {**leaf, "properties": {"v": {"type": "string"}}, "additionalProperties": False}
    c = response_format_constraint({"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}})
    assert c.json == {"type": "object", "additionalProperties": False, "properties": {
        "a": closed, "b": {"type": "array", "items": closed}, "c": {"anyOf": [closed, {"type": "null"}]},
        "d": {"type": "object", "additionalProperties": {"type": "integer"}},
        "e": schema["properties"]["e"], "f": {"$ref": "#/$defs/thing"}},
        "$defs": {"thing": {"type": ["object", "null"], "properties": {"x": closed},
                            "additionalProperties": False}}}
    assert schema["properties"]["a"] == leaf   # the request's own schema is left as it was
    jsonschema.validate({"a": {"v": "1"}, "f": {"x": {"v": "2"}}}, c.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {"v": "1", "extra": 2}}, c.json)


def test_prepare_chat_modes(smollm2_tokenizer):
    tok, msgs = smollm2_tokenizer, [{"role": "user", "content": "hi"}]
    required = prepare_chat(tok, msgs, tools=[WEATHER], tool_choice="required")
    assert isinstance(required.tool_parser, RequiredToolParser) and required.structured_outputs.json["minItems"] == 1
    named = prepare_chat(tok, msgs, tools=[WEATHER], tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}})
    assert isinstance(named.tool_parser, NamedToolParser) and named.tool_parser.name == "get_weather"
    fmt = prepare_chat(tok, msgs, tools=[WEATHER], response_format={"type": "json_object"})
    assert fmt.tool_parser is None and fmt.structured_outputs.json_object   # the format wins over auto
    assert prepare_chat(tok, msgs).tool_parser is None
    with pytest.raises(InvalidRequestError) as info:
        prepare_chat(tok, msgs, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert info.value.param == "response_format"
    with pytest.raises(InvalidRequestError) as info:
        prepare_chat(tok, msgs, tools=[WEATHER], parallel_tool_calls="yes")
    assert info.value.param == "parallel_tool_calls"
    from ferrum import SamplingParams
    with pytest.raises(InvalidRequestError) as info:
        required.sampling_params(SamplingParams(structured_outputs={"regex": "a"}))
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as info:   # a named function's conflict names tool_choice too
        named.sampling_params(SamplingParams(structured_outputs={"regex": "a"}))
    assert info.value.param == "tool_choice"
    # a forced call's grammar decides where it ends: no stop string or stop token cuts it
    for forced in (required, named):
        p = forced.sampling_params(SamplingParams(stop=["}"], stop_token_ids=[7, 8]))
        assert not p.stop and not p.stop_token_ids and p.structured_outputs is forced.structured_outputs
    p = fmt.sampling_params(SamplingParams(stop=["}"], stop_token_ids=[7]))
    assert p.stop == ["}"] and p.stop_token_ids == [7]


@pytest.mark.parametrize("kw,param", [
    (dict(messages=[{"role": "user", "content": "a\ud800"}]), "messages[0].content"),
    (dict(messages=[{"role": "system", "content": "ok"},
                    {"role": "user", "content": [{"type": "text", "text": "\udfffb"}]}]),
     "messages[1].content[0].text"),
    (dict(messages=[{"role": "user", "content": "hi", "name": "\ud800"}]), "messages[0].name"),
    (dict(messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "f", "description": "\ud800"}}]), "tools[0].function.description"),
])
def test_a_lone_surrogate_names_its_field(smollm2_tokenizer, kw, param):
    """A lone UTF-16 surrogate cannot be encoded: the 400 names the string's field, not the
    rendered prompt (offline LLM.chat and the server alike come through prepare_chat)."""
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        prepare_chat(smollm2_tokenizer, **kw)
    assert info.value.param == param and str(info.value).startswith(f"{param}: ")
    with pytest.raises(InvalidRequestError) as info:
        smollm2_tokenizer.encode("x\ud800")
    assert info.value.param == "prompt"
