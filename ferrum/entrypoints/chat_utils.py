"""OpenAI chat requests -> what the engine runs: prompt ids, the output constraint, a tool parser.

Shared by the HTTP server (`/v1/chat/completions`), the offline `LLM.chat` and any other API
built on chat (Responses): each validates its request with these functions, so a bad value gets
the same named error everywhere (InvalidRequestError, `param` = the field's path, e.g.
"messages[2].tool_call_id", "tools[0].function.name", "tool_choice").

Messages follow the OpenAI chat format: roles system, developer (given to the template as
system), user, assistant, tool; `name`; assistant `content: null` with `tool_calls`; `tool`
messages with `tool_call_id`, the id of a call of the assistant message they follow (only
tool messages between; OpenAI refuses others); content as a string or a list of text parts (joined with
newlines; image / audio / file parts are refused: ferrum's models take text only). Unknown
keys inside a message are ignored, as vLLM does. Tool calls reach the chat template the way
Hugging Face's `apply_chat_template(messages, tools=...)` expects them: `function.arguments`
as a dict (transformers' chat-template docs; vLLM does the same; a string that is not a JSON
object stays a string, as OpenAI accepts it), tools in OpenAI's
{"type": "function", "function": {...}} form.

A template that never mentions `tools` (SmolLM2's, for one) gets ferrum's tool prompt instead:
the tools are listed in the system message, past calls are written into the assistant message
as <tool_call> blocks and tool results go back as <tool_response> blocks in a user message:
the Hermes layout, which the hermes parser reads back.

tool_choice (OpenAI): "none" (tools are left out of the prompt and nothing is parsed), "auto"
(default with tools: the model's own format is parsed), "required" (constrained decoding to a
JSON array of {"name", "parameters"} calls built from the tools' parameter schemas), or
{"type": "function", "function": {"name": ...}} (constrained to that function's parameter
schema); a forced call's arguments are a JSON object either way (`_arguments_schema`). `parallel_tool_calls: false` allows one call (the array ends after it); true, the
default as in OpenAI and vLLM, allows several, and a model may repeat a call until max_tokens:
the calls completed by then are returned (`ferrum.tool_parsers.constrained`). Every tool's
parameters are checked as a JSON schema on every request, and the enforced ones as enforceable
(`check_tool_schemas`).
"""
from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from dataclasses import dataclass

from ferrum.errors import InvalidRequestError
from ferrum.sampling_params import SamplingParams
from ferrum.structured_output import StructuredOutputsParams
from ferrum.structured_output.json_schema import (SUBSCHEMA_KEYS, SUBSCHEMA_LIST_KEYS, SUBSCHEMA_MAP_KEYS,
                                                  closed_objects)
from ferrum.structured_output.params import json_value
from ferrum.tokenizer.tokenizer import check_unicode_in
from ferrum.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser, tool_parser_class

PARALLEL_TOOL_CALLS = True  # OpenAI's default: the model may call several tools in one turn

ROLES = ("system", "developer", "user", "assistant", "tool")
# content part types that carry something other than text (OpenAI chat + Responses names)
NON_TEXT_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file",
                  "input_file", "video_url", "video")
# OpenAI's rule for function names
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {msg}", param=param)


def content_text(content, where: str) -> str | None:
    """A message's content as text: a string, None, or a list of text parts (joined with
    newlines). Raises InvalidRequestError naming `where` for anything else."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NON_TEXT_PARTS:
            raise _bad(here, f"is a {kind} part, but this model takes text only")
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _bad(here, "must be a text part {\"type\": \"text\", \"text\": ...}")
    return "\n".join(texts)


def _arguments(value, where: str) -> dict | str:
    """A past call's `function.arguments`: OpenAI sends a JSON string. A JSON object becomes a
    dict (chat templates expect one); any other string stays as sent (OpenAI accepts it: a
    model's malformed arguments echoed back in the history). Raises InvalidRequestError when it
    is neither a string nor an object."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise _bad(where, f"must be a string (the arguments as JSON), got {type(value).__name__}")
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):   # RecursionError: nested deeper than json parses
        return value
    return parsed if isinstance(parsed, dict) else value


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _bad(where, "must be a list")
    out = []
    for j, call in enumerate(calls):
        here = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(here, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        if call.get("type", "function") != "function":
            raise _bad(f"{here}.type", f"must be \"function\", got {call.get('type')!r}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _bad(f"{here}.id", "must be a string")
        entry = {"type": "function", "function": {
            "name": fn["name"], "arguments": _arguments(fn.get("arguments"), f"{here}.function.arguments")}}
        if call.get("id") is not None:
            entry["id"] = call["id"]
        out.append(entry)
    return out


def parse_messages(messages) -> list[dict]:
    """OpenAI chat messages -> messages for the chat template (see the module docstring).
    Raises InvalidRequestError naming the message and field, also for a tool message whose
    `tool_call_id` is not the id of a call of the assistant message it follows (with only tool
    messages between them), as OpenAI refuses it."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of messages")
    out = []
    answerable: list[str] = []   # ids of the calls of the assistant message this run of tool messages follows
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object with a role")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {role!r}")
        content = content_text(m.get("content"), f"{where}.content")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise _bad(f"{where}.name", "must be a string")
            msg["name"] = m["name"]
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        elif m.get("tool_calls"):
            raise _bad(f"{where}.tool_calls", "only assistant messages carry tool calls")
        elif content is None:
            raise _bad(f"{where}.content", f"is required for {role} messages")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise _bad(f"{where}.tool_call_id", "is required for tool messages (the id of "
                                                    "the call this answers)")
            if m["tool_call_id"] not in answerable:
                raise _bad(f"{where}.tool_call_id", f"{m['tool_call_id']!r} answers no tool call: a "
                           "tool message must follow the assistant message with that call in its "
                           "tool_calls (only tool messages between); the calls it can answer here: "
                           f"{', '.join(map(repr, answerable)) or 'none'}")
            msg["tool_call_id"] = m["tool_call_id"]
        else:   # OpenAI: tool messages must follow the assistant message whose calls they answer
            answerable = [c["id"] for c in msg.get("tool_calls", ()) if "id" in c]
        out.append(msg)
    return out


def parse_tools(tools) -> list[dict] | None:
    """OpenAI `tools` (function tools) -> the same list, checked and with `parameters`
    defaulted to an empty object schema. Raises InvalidRequestError naming the tool."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "must be a non-empty list of tools (leave it out for none)")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"{where}.type", "only function tools ({\"type\": \"function\", "
                                        "\"function\": {...}}) are supported")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", f"must be 1-64 letters, digits, '_' or '-'; got {name!r}")
        if name in seen:
            raise _bad(f"{where}.function.name", f"{name!r} is defined twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:  # OpenAI: a function that takes no arguments (so the grammar closes it)
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description", "must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict", f"must be a boolean, got {fn['strict']!r}")
        out.append({"type": "function", "function": {**{k: v for k, v in fn.items() if v is not None},
                                                     "parameters": params}})
    return out


def parse_tool_choice(tool_choice, tools: list[dict] | None) -> str | dict:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name"}} (OpenAI);
    None means "auto" with tools, else "none". Raises InvalidRequestError (param
    "tool_choice") for other values, a mode that needs tools without them, or an unknown name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise _bad("tool_choice", f"{tool_choice!r} needs tools")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(fn, dict) and tool_choice.get("type") == "function"
            and isinstance(fn.get("name"), str)):
        raise _bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": "
                                  "\"function\", \"function\": {\"name\": ...}}")
    names = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in names:
        raise _bad("tool_choice", f"names function {fn['name']!r}, which is not among the "
                                  f"tools ({', '.join(names) or 'none given'})")
    return {"type": "function", "function": {"name": fn["name"]}}


def check_tool_schemas(tools: list[dict] | None, tool_choice) -> None:
    """Every tool's `parameters` must be a valid JSON schema, whatever tool_choice is; the
    schemas tool_choice enforces ("required": all, a named function: its own) must also be
    ones constrained decoding can enforce (`structured_output.grammar.check_json_schema`).
    Raises InvalidRequestError naming `tools[i].function.parameters`."""
    from ferrum.structured_output.grammar import check_json_schema
    for i, t in enumerate(tools or []):
        fn = t["function"]
        enforced = tool_choice == "required" or (
            isinstance(tool_choice, dict) and tool_choice["function"]["name"] == fn["name"])
        check_json_schema(fn["parameters"], f"tools[{i}].function.parameters", enforced)


def _root_refs(schema) -> list[str]:
    """The "$ref"s in a schema that point into it by a JSON pointer other than through $defs /
    definitions ("", "#", "#/properties/..."; percent-encoding decoded): they change meaning
    once the schema is nested in another. Anchors ("#name") and other documents are left to
    the grammar engine."""
    if not isinstance(schema, dict):
        return []
    ref = schema.get("$ref")
    refs = []
    if isinstance(ref, str) and (ref in ("", "#") or (
            ref.startswith("#/") and not urllib.parse.unquote(ref).startswith(("#/$defs/", "#/definitions/")))):
        refs.append(ref)
    for key, value in schema.items():
        if key in SUBSCHEMA_KEYS:
            refs += _root_refs(value)
        elif key in SUBSCHEMA_LIST_KEYS and isinstance(value, list):
            refs += [r for v in value for r in _root_refs(v)]
        elif key in SUBSCHEMA_MAP_KEYS and isinstance(value, dict):
            refs += [r for v in value.values() for r in _root_refs(v)]
    return refs


def _lift_defs(schema: dict, defs: dict, where: str) -> dict:
    """Move a parameter schema's $defs / definitions into `defs` (the combined schema's root,
    where its "#/$defs/..." references resolve). Raises InvalidRequestError on a name two tools
    define differently, and naming `where` on a reference to the schema's own root or to a
    path outside $defs (it would point into the combined schema)."""
    refs = _root_refs(schema)
    if refs:
        raise _bad(where, f"under tool_choice \"required\" a $ref must point into $defs or definitions, "
                          f"got {refs[0]!r}")
    schema = dict(schema)
    for key in ("$defs", "definitions"):
        for name, d in (schema.pop(key, None) or {}).items():
            if defs.setdefault(key, {}).setdefault(name, d) != d:
                raise _bad("tools", f"two tools define {key}/{name} differently")
    return schema


def _arguments_schema(fn: dict, where: str) -> dict:
    """A tool's parameter schema as the grammar of a forced call's arguments, which are always
    a JSON object (OpenAI's; clients pass them as keyword arguments, and the tool parsers read
    nothing else as a call): a schema without `type` ({}, {"properties": ...}) gets "object",
    else the model could write a string or an array there; one whose type leaves out "object"
    cannot be enforced and is refused (raises InvalidRequestError naming `where`), as OpenAI
    refuses it. With the function's `strict: true`, every object schema that does not set
    additionalProperties is closed (`closed_objects`), as response_format's strict does."""
    params = fn["parameters"]
    kind = params.get("type")
    if kind is None or (isinstance(kind, list) and "object" in kind):
        params = {**params, "type": "object"}
    elif kind != "object":
        raise _bad(where, f"must describe a JSON object (the arguments of a call are one), "
                          f"got type {kind!r}")
    return closed_objects(params) if fn.get("strict") else params


def tool_choice_constraint(tools: list[dict], tool_choice, parallel_tool_calls: bool = PARALLEL_TOOL_CALLS
                           ) -> StructuredOutputsParams | None:
    """The JSON schema that tool_choice "required" / a named function imposes (None for
    "none" / "auto"). Required: an array of 1 (or, with parallel_tool_calls, more) objects
    {"name": one tool's name, "parameters": that tool's parameter schema}, name first. The
    arguments are JSON objects either way (`_arguments_schema`)."""
    if not isinstance(tool_choice, dict) and tool_choice != "required":
        return None
    where = [f"tools[{i}].function.parameters" for i in range(len(tools))]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        i = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_arguments_schema(tools[i]["function"], where[i]),
                                       param=where[i])
    defs: dict = {}
    variants = [{"type": "object",
                 "properties": {"name": {"const": t["function"]["name"]},
                                "parameters": _lift_defs(_arguments_schema(t["function"], where[i]),
                                                         defs, where[i])},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for i, t in enumerate(tools)]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}, **defs}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, param="tool_choice")


def response_format_constraint(response_format) -> StructuredOutputsParams | None:
    """OpenAI `response_format`: {"type": "text"} (None), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}:
    `name` is required (OpenAI's rule for names), `schema` optional (any object), and
    `strict: true` closes every object that does not set additionalProperties
    (`closed_objects`). Raises InvalidRequestError (param "response_format", or
    "response_format.json_schema.<key>" for a bad key)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        where = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise _bad("response_format", "json_schema needs a \"json_schema\" object with "
                                          "\"name\" and \"schema\"")
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.name", f"is required: 1-64 letters, digits, '_' or '-'; got {name!r}")
        schema = spec.get("schema", {"type": "object"})   # OpenAI: schema is optional
        if not isinstance(schema, dict):
            raise _bad(f"{where}.schema", f"must be a JSON schema object; got {json_value(schema)}")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"{where}.strict", f"must be a boolean, got {strict!r}")
        return StructuredOutputsParams(json=closed_objects(schema) if strict else schema,
                                       param="response_format")
    raise _bad("response_format", f"type must be text, json_object or json_schema; got {kind!r}")


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (else ferrum's tool prompt is used)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def _tool_prompt(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to answer. Their JSON signatures are listed between <tools> "
            f"and </tools>:\n<tools>\n{listing}\n</tools>\n"
            "To call functions, reply with one JSON object per call, each between <tool_call> "
            "and </tool_call>:\n<tool_call>\n"
            '{"name": "<function name>", "arguments": {<the arguments as a JSON object>}}\n'
            "</tool_call>")


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template without tool support: tools into the system message, calls and
    results written out as <tool_call> / <tool_response> text (see the module docstring)."""
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False) + "\n</tool_call>" for c in m["tool_calls"])
            text = "\n".join(x for x in (m.get("content"), calls) if x)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):     # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "_tool_results": True}
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        prompt = _tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


@dataclass
class ChatPrompt:
    """A chat request made ready for the engine.

    prompt_token_ids: the rendered conversation.
    structured_outputs: the constraint tool_choice or response_format asks for (None if none).
    tool_parser: reads tool calls out of each choice's text (None: the text is all content).
    skip_special_tokens: False when the parser needs marker tokens that are special tokens
        (Mistral's [TOOL_CALLS], Llama's <|python_tag|>) to survive detokenization.
    """

    prompt_token_ids: list[int]
    structured_outputs: StructuredOutputsParams | None = None
    tool_parser: ToolParser | None = None
    skip_special_tokens: bool | None = None

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with this chat's constraint and detokenization applied (a copy; a forced
        tool call drops the stop strings and stop token ids, which would cut it). Raises
        InvalidRequestError when params already carry a constraint (structured_outputs /
        guided_*) and tool_choice or response_format asks for another one."""
        changes: dict = {}
        if self.structured_outputs is not None:
            if params.structured_outputs is not None:
                p = "response_format" if self.structured_outputs.param == "response_format" else "tool_choice"
                raise _bad(p, f"cannot be combined with {params.structured_outputs.param}: "
                              "give one output constraint")
            changes["structured_outputs"] = self.structured_outputs
        if self.skip_special_tokens is not None:
            changes["skip_special_tokens"] = self.skip_special_tokens
        if self.tool_parser is not None and self.tool_parser.enforced:
            # the forced call's grammar decides where the output ends: a stop string or stop
            # token inside it would cut the call short and still finish "stop"
            if params.stop:
                changes["stop"] = None
            if params.stop_token_ids:
                changes["stop_token_ids"] = None
        return dataclasses.replace(params, **changes) if changes else params


# arguments of the rendering itself (ferrum's apply_chat_template and transformers'): a request
# sets them through their own fields, and some would change what rendering returns (tokenize)
RENDER_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "chat_template", "add_generation_prompt",
    "continue_final_message", "split_special_tokens", "add_special_tokens", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def parse_template_kwargs(kwargs) -> dict:
    """vLLM's `chat_template_kwargs`: extra variables for the chat template (Qwen3's
    {"enable_thinking": false}). Their strings are data like message text (see
    Tokenizer.apply_chat_template). Raises InvalidRequestError for a value that is not an
    object, or naming a key that is one of RENDER_ARGUMENTS."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", f"must be an object; got {json_value(kwargs)}")
    for key in kwargs:
        if key in RENDER_ARGUMENTS:
            raise _bad(f"chat_template_kwargs.{key}", "is an argument of the rendering, not a "
                       "template variable (use the request field of that name where there is one)")
    return kwargs


def prepare_chat(tokenizer, messages, *, tools=None, tool_choice=None,
                 parallel_tool_calls: bool = PARALLEL_TOOL_CALLS, response_format=None,
                 tool_parser: str = "auto", add_generation_prompt: bool = True,
                 continue_final_message: bool = False, chat_template: str | None = None,
                 split_special_tokens: bool | None = None,
                 add_special_tokens: bool = False, chat_template_kwargs: dict | None = None) -> ChatPrompt:
    """OpenAI chat fields -> ChatPrompt (prompt ids, constraint, tool parser).

    tokenizer: ferrum Tokenizer (None: InvalidRequestError, chat needs one). tool_parser:
    "auto" (from the chat template, `ferrum.tool_parsers.detect_tool_parser`) or a name in
    `ferrum.tool_parsers.TOOL_PARSERS`. add_generation_prompt / continue_final_message: see
    `Tokenizer.render_chat`. split_special_tokens: see `Tokenizer.apply_chat_template` (None:
    the tokenizer's setting); add_special_tokens: BOS etc. on top of the template's (see there,
    default False); chat_template_kwargs: extra template variables (`parse_template_kwargs`).
    Raises InvalidRequestError naming the bad field."""
    if tokenizer is None:
        raise _bad("messages", "this model has no tokenizer, so it cannot chat; use "
                               "/v1/completions with token ids")
    check_unicode_in(messages, "messages")   # the rendering cannot name the string at fault
    check_unicode_in(tools, "tools")
    check_unicode_in(chat_template_kwargs, "chat_template_kwargs")
    extra = parse_template_kwargs(chat_template_kwargs)
    msgs = parse_messages(messages)
    tools = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, tools)
    check_tool_schemas(tools, choice)
    if not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls", "must be a boolean")
    constraint = tool_choice_constraint(tools, choice, parallel_tool_calls) if tools else None
    fmt = response_format_constraint(response_format)
    if constraint is not None and fmt is not None:
        raise _bad("response_format", "cannot be combined with tool_choice \"required\" or a "
                                      "named function (the call's arguments are the output)")
    template = chat_template or tokenizer.chat_template
    offered = tools if choice != "none" else None
    if not template_takes_tools(template) and (offered or any(
            m.get("tool_calls") or m["role"] == "tool" for m in msgs)):
        msgs, offered = _hermes_messages(msgs, offered), None
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        chat_template=chat_template, tools=offered,
                                        split_special_tokens=split_special_tokens,
                                        add_special_tokens=add_special_tokens, **extra)
    max_calls = None if parallel_tool_calls else 1
    parser, skip = None, None
    if choice == "required":
        parser = RequiredToolParser(max_calls)
    elif isinstance(choice, dict):
        parser = NamedToolParser(choice["function"]["name"], max_calls)
    elif choice == "auto" and fmt is None:
        parser = tool_parser_class(tool_parser, template)(max_calls, {t["function"]["name"] for t in tools or []})
        if any(_is_special_token(tokenizer, m) for m in parser.markers):
            skip = False
    return ChatPrompt(ids, constraint or fmt, parser, skip)


def _is_special_token(tokenizer, text: str) -> bool:
    """Whether `text` is one added token marked special (decoding with skip_special_tokens
    would drop it)."""
    added = getattr(tokenizer.hf, "added_tokens_decoder", {}) or {}
    return any(t.content == text and t.special for t in added.values())


def apply_tool_calls(parser: ToolParser | None, output) -> None:
    """Offline API: parse a CompletionOutput's text in place: `text` becomes the message
    content ("" for none), `tool_calls` the calls in OpenAI form (`ToolParser.extract`),
    finish_reason as `ToolParser.finish_reason` gives it."""
    if parser is None:
        return
    content, calls = parser.extract(output.text)
    output.text = content or ""
    if calls:
        output.tool_calls = [c.to_openai() for c in calls]
        output.finish_reason = parser.finish_reason(output.finish_reason, called=True)
