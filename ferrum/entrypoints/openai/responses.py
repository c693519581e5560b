"""POST /v1/responses: OpenAI's Responses API over the same engine as chat completions.

Stateless: ferrum stores no response, so `previous_response_id`, `conversation`, `store: true`
and the retrieval endpoints (GET/DELETE /v1/responses/{id}, .../input_items, .../cancel) are
answered with an error that says so; a client sends the whole conversation as `input` items
each time. An absent `store` (OpenAI's default is true) is accepted and the response reports
`store: false`.

Input (OpenAI API reference, "Create a model response"): a string (one user message) or a
list of items: messages `{"role": "user" | "assistant" | "system" | "developer", "content":
str | [{"type": "input_text" | "output_text", "text"}]}` (with or without `"type": "message"`),
`{"type": "function_call", "call_id", "name", "arguments"}` and `{"type":
"function_call_output", "call_id", "output"}`. `instructions` becomes a leading system
message. They are turned into chat messages (tool calls and results as chat completions
carries them) and rendered with the model's chat template.

`tools` (function tools, `{"type": "function", "name", "description", "parameters",
"strict"}`), `tool_choice` ("none" | "auto" | "required" | `{"type": "function", "name"}`),
`parallel_tool_calls` and `text.format` (`text` | `json_object` | `json_schema` with `name`,
`schema`, `strict`) are turned into their chat completions forms and go through the same
request -> (prompt, constraint, tool parser) conversion as chat (`chat_utils.prepare_chat`):
the same prompt, constrained decoding and tool parsing; errors name the Responses field
(`tools[0].name`, `text.format`).

Output: items in the order the model wrote them: a `message` item with one `output_text`
part for text, a `function_call` item (`call_id`, `name`, `arguments`) per tool call;
`status` "completed", or "incomplete" with `incomplete_details.reason = "max_output_tokens"`
when the token limit cut it. Streaming sends OpenAI's events, each with a `sequence_number`:
response.created, response.in_progress, then per item response.output_item.added,
(message) response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done / (function call) response.function_call_arguments.delta...,
response.function_call_arguments.done, and response.output_item.done; last
response.completed (or response.incomplete). Streamed items equal the whole answer's, also
for a forced call that max_output_tokens cut off: its arguments as far as they got, the
response incomplete (`ferrum.tool_parsers.constrained`).
Output_text logprobs cover the message text only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Iterator, Literal

from pydantic import Field, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse

from ferrum.entrypoints.chat_utils import PARALLEL_TOOL_CALLS, ChatPrompt, prepare_chat
from ferrum.entrypoints.openai.logprobs import chat_logprobs, ready_tokens, token_texts
from ferrum.entrypoints.openai.protocol import ServiceTier, Temperature, _Strict, sampling_defaults
from ferrum.entrypoints.openai.serving import EventStream, OpenAIServing, _Prompt, ferrum_error_body
from ferrum.errors import FerrumError, InvalidRequestError
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import MAX_LOGPROBS, SamplingParams
from ferrum.tokenizer.tokenizer import check_unicode_in
from ferrum.tool_parsers import ToolCallStreamer, ToolParser

_NO_STATE = ("ferrum keeps no stored state (the Responses API is stateless here): send the "
             "whole conversation as input items")
_LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponseNotFoundError(FerrumError):
    """A stored response was asked for; ferrum stores none."""

    http_status = 404
    error_type = "not_found_error"


class TextFormat(_Strict):
    """`text.format`: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
    "name", "schema", "description", "strict"}."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # accepted; no effect here


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None   # accepted; ferrum never pads its events


class ResponsesRequest(_Strict):
    """POST /v1/responses body. Unknown fields are refused with 400 naming them; fields that
    need stored state are refused by `check_stateless`."""

    NULL_ONLY = frozenset({"prompt", "max_tool_calls", "prompt_cache_retention"})   # see _Strict

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Temperature | None = None
    top_p: float | None = None
    top_logprobs: StrictInt | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = PARALLEL_TOOL_CALLS
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None                  # accepted for API compatibility; unused
    safety_identifier: str | None = None     # accepted; unused
    prompt_cache_key: str | None = None      # accepted; the prefix cache needs no key
    service_tier: ServiceTier | None = None

    def check_stateless(self) -> None:
        """Raises InvalidRequestError (400) for what needs stored state or a feature ferrum
        lacks, naming the field."""
        if self.store:  # explicitly true (absent is None: OpenAI's default, accepted)
            raise InvalidRequestError(f"store: true is not supported: {_NO_STATE} (send "
                                      "store: false or leave it out)", param="store")
        if self.previous_response_id is not None:
            raise InvalidRequestError(f"previous_response_id is not supported: {_NO_STATE}",
                                      param="previous_response_id")
        if self.conversation is not None:
            raise InvalidRequestError(f"conversation is not supported: {_NO_STATE}",
                                      param="conversation")
        if self.background:
            raise InvalidRequestError("background responses need stored state, which ferrum "
                                      "does not keep; use stream: true instead", param="background")
        if self.truncation == "auto":
            raise InvalidRequestError("truncation: auto is not supported: ferrum never drops "
                                      "input items; send a shorter input", param="truncation")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidRequestError("reasoning options are not supported by ferrum's models",
                                      param="reasoning")
        bad = [x for x in self.include or [] if x != _LOGPROBS_INCLUDE]
        if bad:
            raise InvalidRequestError(f"include: {bad[0]!r} is not supported; only "
                                      f"{_LOGPROBS_INCLUDE!r} is", param="include")

    @property
    def want_logprobs(self) -> bool:
        return _LOGPROBS_INCLUDE in (self.include or [])

    def sampling_params(self, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """SamplingParams for the request (max_tokens already checked against the context),
        before the chat conversion adds its constraint (`ChatPrompt.sampling_params`); the
        sampling fields it leaves unset (this API has no top_k, min_p, repetition_penalty)
        take `defaults` (the model's, see OpenAIServing.sampling_defaults). Raises
        InvalidRequestError naming the field."""
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
                                      param="max_output_tokens")
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                                      param="top_logprobs")
        given = {name: value for name in ("temperature", "top_p")   # None: the default
                 if (value := getattr(self, name)) is not None}
        return SamplingParams(
            **sampling_defaults(defaults, given), max_tokens=max_tokens,
            logprobs=(top or 0) if self.want_logprobs else None)


    def chat_tools(self) -> tuple[list[dict] | None, str | dict, dict | None]:
        """(tools, tool_choice, response_format) in chat completions' form: each function tool
        `{"type": "function", "name", ...}` -> `{"type": "function", "function": {"name", ...}}`,
        `{"type": "function", "name"}` choice -> `{"type": "function", "function": {"name"}}`,
        text.format -> response_format. Raises InvalidRequestError for a tool type other than
        function (web search, file search, MCP, ...: ferrum runs no hosted tools), a
        tool_choice that names no function, or a json_schema format without a schema."""
        tools = []
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else t
                raise InvalidRequestError(
                    f"tools[{i}].type: only function tools are supported, got {kind!r} (ferrum "
                    "runs no hosted tools)", param=f"tools[{i}].type")
            tools.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
        choice = self.tool_choice
        if not tools and choice == "auto":
            choice = None   # OpenAI's default, also without tools
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                          '{"type": "function", "name": ...}', param="tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        fmt = self.text.format if self.text else None
        response_format = None
        if fmt is not None and fmt.type == "json_object":
            response_format = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None or not fmt.name:
                raise InvalidRequestError("text.format: json_schema needs \"name\" and \"schema\"",
                                          param="text.format")
            response_format = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        return tools or None, choice, response_format


def _chat_param(param: str | None) -> str | None:
    """The Responses field for a chat completions field named in an error."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param.startswith("response_format"):   # response_format.json_schema.name -> text.format.name
        return re.sub(r"^response_format(\.json_schema)?", "text.format", param)
    param = re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", param)
    return re.sub(r"^tool_choice\.function", "tool_choice", param)


def prepare_response(serving: OpenAIServing, req: ResponsesRequest) -> ChatPrompt:
    """The request through chat's conversion (`chat_utils.prepare_chat`): input items ->
    messages, tools / tool_choice / text.format -> the same prompt, constraint and tool parser
    chat completions gets. Errors are re-raised naming the Responses field."""
    tools, choice, response_format = req.chat_tools()
    check_unicode_in(req.instructions, "instructions")   # named here: both become messages
    check_unicode_in(req.input, "input")
    messages = input_messages(req)
    try:
        chat = prepare_chat(serving.tokenizer, messages, tools=tools, tool_choice=choice,
                            parallel_tool_calls=req.parallel_tool_calls,
                            response_format=response_format, tool_parser=serving.tool_parser)
    except InvalidRequestError as e:
        param = _chat_param(e.param)
        text = str(e)
        if e.param and text.startswith(f"{e.param}:"):
            text = f"{param}:" + text[len(e.param) + 1:]
        raise InvalidRequestError(text, param=param) from e
    if chat.structured_outputs is not None:   # a grammar that fails to compile names the field
        where = _chat_param(chat.structured_outputs.param)
        chat.structured_outputs = dataclasses.replace(chat.structured_outputs, param=where)
    return chat


# ---- input items -> chat messages ------------------------------------------------------------
def _text_of(content: Any, where: str, field: str = "content") -> str:
    """A message's content (or a function_call_output's `output`: `field` names it in errors),
    a string or a list of text parts, as one string."""
    where = f"{where}.{field}"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of content parts",
                                  param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequestError(f"{where}[{j}] is {kind}: ferrum's models take "
                                      "text only", param=f"{where}[{j}].type")
        else:   # param: the part's field at fault, as OpenAI names it (input[2].content[0].type)
            field = ("" if not isinstance(part, dict) else
                     ".text" if kind in ("input_text", "output_text", "text") else
                     ".refusal" if kind == "refusal" else ".type")
            raise InvalidRequestError(f"{where}[{j}]: expected an input_text or "
                                      f"output_text part, got {part!r:.200}", param=f"{where}[{j}]{field}")
    return "\n".join(texts)


def _string_field(item: dict, key: str, where: str, empty_ok: bool = True) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not (v or empty_ok):
        raise InvalidRequestError(f"{where}.{key} must be a{'' if empty_ok else ' non-empty'} string",
                                  param=f"{where}.{key}")
    return v


def input_messages(req: ResponsesRequest) -> list[dict]:
    """Chat messages for the request: `instructions` as a system message, then the input
    items in order. Consecutive function_call items join the assistant message before them
    (one turn, parallel calls); a function_call_output becomes a `tool` message carrying its
    call's name. `developer` is rendered as `system` (chat templates know that role).
    Raises InvalidRequestError whose param names the offending item's field (as OpenAI's
    does: "input[2].content[0].type"), also for a function_call_output whose call_id no
    earlier function_call item has, or whose call is not in the assistant turn it follows."""
    msgs: list[dict] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        if not req.input:   # as /v1/completions refuses prompt ""
            raise InvalidRequestError("input is an empty string; give the user's text or input "
                                      "items", param="input")
        return msgs + [{"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidRequestError("input is an empty list; give at least one item", param="input")
    call_names: dict[str, str] = {}
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role must be user, assistant, system or "
                                          f"developer, got {role!r}", param=f"{where}.role")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            # non-empty: an output answers it by this id ("" reached chat's tool-message check,
            # whose 400 said 'input: is required for tool messages')
            call_id = _string_field(item, "call_id", where, empty_ok=False)
            name = _string_field(item, "name", where, empty_ok=False)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _string_field(item, "arguments", where)}}
            call_names[call_id] = name
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string_field(item, "call_id", where)
            if call_id not in call_names:   # OpenAI: "No tool call found for function call output"
                raise InvalidRequestError(f"{where}.call_id {call_id!r} matches no function_call "
                                          "item before it", param=f"{where}.call_id")
            # chat's rule (chat_utils.parse_messages), checked here to name the item: an output
            # answers a call of the assistant turn it follows, with only outputs between
            turn = next(m for m in reversed(msgs) if m["role"] != "tool")
            if call_id not in [c["id"] for c in turn.get("tool_calls", ())]:
                raise InvalidRequestError(f"{where}.call_id {call_id!r} answers no function_call of "
                                          "the turn it follows: outputs must come after their calls, "
                                          "with only other outputs between", param=f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": call_id, "name": call_names[call_id],
                         "content": _text_of(item.get("output"), where, "output")})
        elif kind == "item_reference":
            raise InvalidRequestError(f"{where} is an item_reference: {_NO_STATE}", param=f"{where}.type")
        else:
            raise InvalidRequestError(f"{where}: input items of type {kind!r} are not supported "
                                      "(message, function_call and function_call_output are)",
                                      param=f"{where}.type")
    return msgs


# ---- serving ---------------------------------------------------------------------------------
def _sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class OpenAIServingResponses:
    """The handler behind POST /v1/responses, over an OpenAIServing (shared model check,
    prompt limits, engine requests, metrics)."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, req: ResponsesRequest, raw: Request):
        t0 = time.perf_counter()
        s = self.serving
        model = s.check_model(req.model)
        req.check_stateless()
        if s.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so it cannot take chat input; "
                                      "use /v1/completions with token ids", param="input")
        chat = await asyncio.to_thread(prepare_response, s, req)   # tokenizing: off the loop
        ids = chat.prompt_token_ids
        params = chat.sampling_params(req.sampling_params(
            s._max_tokens(len(ids), req.max_output_tokens, "max_output_tokens", "input"),
            s.sampling_defaults))
        rid = f"resp_{uuid.uuid4().hex}"
        streams = await s._start(rid, [_Prompt(None, ids)], [params])
        state = _ResponseState(rid, model, req, len(ids), s.fmt, chat.tool_parser, params)
        if req.stream:
            return EventStream(self._stream(state, streams, t0), streams)
        (out,) = await s._collect(streams, t0, raw)
        state.update(out, whole=True)
        state.finish()
        return JSONResponse(state.body())

    async def _stream(self, state: "_ResponseState", streams, t0: float) -> AsyncIterator[str]:
        seq = 0

        def events() -> Iterator[str]:
            nonlocal seq
            for kind, fields in state.take_events():
                seq += 1
                yield _sse_event({"type": kind, "sequence_number": seq - 1, **fields})

        state.emit("response.created", response=state.body("in_progress"))
        state.emit("response.in_progress", response=state.body("in_progress"))
        try:
            async for _, out in self.serving._tracked(streams, t0):
                state.update(out)
                for e in events():
                    yield e
        except FerrumError as e:
            err = ferrum_error_body(e)["error"]
            state.emit("error", code=err["type"], message=err["message"], param=err["param"])
            state.emit("response.failed", response=state.body("failed", err))
            for e in events():
                yield e
            return
        state.finish()
        state.emit("response.completed" if state.status == "completed" else "response.incomplete",
                   response=state.body())
        for e in events():
            yield e


class _ResponseState:
    """A response as far as the engine has written it: its output items (assistant message
    text and the function calls a tool parser reads out of the output), the OpenAI JSON
    forms, and the stream events that announce each change (`take_events`).

    Item life cycle in events: output_item.added (+ content_part.added for a message), deltas
    (output_text.delta), then output_text.done, content_part.done, output_item.done. The
    message opens at its first text (or at the end, empty, when nothing else was output).
    """

    def __init__(self, rid: str, model: str, req: ResponsesRequest, num_prompt: int, fmt,
                 tool_parser: ToolParser | None = None, params: SamplingParams | None = None):
        """fmt: the server's TokenFormatter (token text and bytes for logprobs). tool_parser:
        reads function calls out of the output (None: all output is message text). params:
        what the request runs with, whose temperature and top_p the response reports (the
        model's defaults where the request left them out; None: the request's, else 1.0)."""
        self.rid, self.model, self.req, self.fmt = rid, model, req, fmt
        self.params = params
        self.tool_parser = tool_parser
        self.streamer = ToolCallStreamer(tool_parser) if tool_parser is not None else None
        self.created = int(time.time())
        self.num_prompt = num_prompt
        self.num_tokens = 0
        self.text_len = 0                    # characters of output text taken so far
        self.content_len = 0                 # of them, characters of message text (a prefix)
        self.num_logprob_tokens = 0          # tokens whose logprobs were taken
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.items: list[dict] = []          # output items; the last may still be open
        self.open: dict | None = None        # the item being written
        self.pending_logprobs: list[dict] = []   # of tokens whose text has not been sent yet
        self.pending_starts: list[int] = []      # where each pending token's text starts
        self._events: list[tuple[str, dict]] = []

    # ---- feeding ---------------------------------------------------------------------------
    def update(self, out: RequestOutput, whole: bool = False) -> None:
        """Take the engine's latest output: its new text (`delta_text`, or with `whole` the
        final output's entire text) and logprobs into the output items. With a tool parser the
        text is split into message text and function calls: streamed through its
        ToolCallStreamer, a whole answer through `extract` (as chat completions does, so both
        give the items a chat answer's message and tool_calls give)."""
        c = out.outputs[0]
        self.finish_reason, self.cached_tokens = c.finish_reason, out.num_cached_tokens
        self.num_tokens = len(c.token_ids)
        text = c.text if whole else c.delta_text
        self.text_len += len(text)
        if self.req.want_logprobs:  # tokens whose text is final and sent (see ready_tokens)
            start = self.num_logprob_tokens
            ready = ready_tokens(c.token_text_ends, start, len(c.token_ids), self.text_len,
                                 c.finished)
            self.pending_logprobs += chat_logprobs(
                self.fmt, c.token_ids[start:ready], (c.logprobs or [])[start:ready],
                token_texts(c.text, c.token_text_ends, start, ready), self.req.top_logprobs or 0
            )["content"]
            ends = c.token_text_ends
            self.pending_starts += [ends[i - 1] if ends and i else 0 for i in range(start, ready)]
            self.num_logprob_tokens = ready
        if self.tool_parser is None:
            self.add_text(text)
            return
        if whole:
            content, found = self.tool_parser.extract(text)
            calls = [{"index": k, **call.to_openai()} for k, call in enumerate(found)]
            content = content or ""
        else:
            content, calls = self.streamer.feed(text, final=c.finished)
        self.add_text(content)
        for delta in calls:
            self.add_call_delta(delta)

    def add_text(self, delta: str) -> None:
        """Message text: opens the message item if needed, then one output_text.delta. With a
        tool parser the message is a prefix of the output, and only the tokens that start in
        its text so far go with it (not those of the calls after it, nor of text held back)."""
        self.content_len += len(delta)
        n = len(self.pending_logprobs)
        if self.tool_parser is not None:
            n = sum(1 for start in self.pending_starts if start < self.content_len)
        if not delta and not (n and self._is_open("message")):
            return
        if not self._is_open("message"):
            self._close()
            self._open_message()
        part = self.open["content"][0]
        part["text"] += delta
        lps, self.pending_logprobs = self.pending_logprobs[:n], self.pending_logprobs[n:]
        self.pending_starts = self.pending_starts[n:]
        part["logprobs"] += lps
        self.emit("response.output_text.delta", delta=delta, logprobs=lps, **self._where(0))

    def add_call_delta(self, delta: dict) -> None:
        """A tool-call delta in chat completions' streaming form (what a tool parser's streamer
        gives): {"index", "id", "type": "function", "function": {"name", "arguments": ""}}
        starts a call -> a function_call item (output_item.added); {"index", "function":
        {"arguments": fragment}} extends it (response.function_call_arguments.delta)."""
        fn = delta.get("function") or {}
        if "id" in delta:
            self._close()
            self._open({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                        "call_id": delta["id"], "name": fn["name"], "arguments": "",
                        "status": "in_progress"})
        fragment = fn.get("arguments") or ""
        if fragment and self._is_open("function_call"):
            self.open["arguments"] += fragment
            self.emit("response.function_call_arguments.delta", delta=fragment, **self._where())

    def _used(self, name: str) -> float:
        """The temperature / top_p the request runs with (the model's default where it left
        the field out), else the request's, else OpenAI's default 1.0."""
        if self.params is not None:
            return getattr(self.params, name)
        given = getattr(self.req, name)
        return 1.0 if given is None else given

    def finish(self) -> None:
        """The output is complete: close the open item (an empty message if there was none),
        the one item a token limit can have cut (`status`)."""
        if not self.items:
            self._open_message()
        self._close(self.status)

    # ---- items -----------------------------------------------------------------------------
    def _is_open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _where(self, content_index: int | None = None) -> dict:
        where = {"item_id": self.open["id"], "output_index": len(self.items) - 1}
        if content_index is not None:
            where["content_index"] = content_index
        return where

    def _open(self, item: dict) -> None:
        """Start an output item (copies go into events: the item changes after)."""
        self.items.append(item)
        self.open = item
        self.emit("response.output_item.added", item=dict(item), output_index=len(self.items) - 1)

    def _open_message(self) -> None:
        self._open({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                    "role": "assistant", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open["content"] = [part]
        self.emit("response.content_part.added", part=dict(part, logprobs=[]), **self._where(0))

    def _close(self, status: str = "completed") -> None:
        """Close the open item; one closed because the next began is complete, also when the
        same engine output then hit the token limit."""
        item, where = self.open, (self._where() if self.open else None)
        if item is None:
            return
        if item["type"] == "message":
            part = item["content"][0]
            self.emit("response.output_text.done", text=part["text"], logprobs=part["logprobs"],
                      **self._where(0))
            self.emit("response.content_part.done", part=dict(part), **self._where(0))
        else:
            self.emit("response.function_call_arguments.done", name=item["name"],
                      arguments=item["arguments"], **self._where())
        item["status"] = status
        self.open = None
        self.emit("response.output_item.done", item=item, output_index=where["output_index"])

    # ---- JSON ------------------------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        self._events.append((kind, fields))

    def take_events(self) -> list[tuple[str, dict]]:
        events, self._events = self._events, []
        return events

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def body(self, status: str | None = None, error: dict | None = None) -> dict:
        """The Response object; `status` defaults to the final one (completed/incomplete)."""
        req = self.req
        status = status or self.status
        done = status in ("completed", "incomplete")
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": list(self.items) if done else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": None, "store": False,
            "temperature": self._used("temperature"),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": req.tool_choice, "tools": req.tools, "top_logprobs": req.top_logprobs,
            "top_p": self._used("top_p"), "truncation": "disabled",
            "usage": {"input_tokens": self.num_prompt,
                      "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.num_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.num_prompt + self.num_tokens} if done else None,
            "user": req.user, "metadata": req.metadata or {},
        }


def add_routes(app, serving: OpenAIServing) -> None:
    """Register POST /v1/responses and the stored-response endpoints (which answer 404:
    nothing is stored) on a FastAPI app."""
    responses = OpenAIServingResponses(serving)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request):
        return await responses.create(body, raw)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.api_route("/v1/responses/{response_id}/{action}", methods=["GET", "POST"])
    async def stored_response(response_id: str, action: str | None = None):
        raise ResponseNotFoundError(f"response {response_id!r} cannot be retrieved, listed or "
                                    f"cancelled: {_NO_STATE}")
