"""Tool parsers: model output text -> (content, OpenAI tool calls), whole or while streaming.

A parser implements one method, `scan(text, final)`, that reads the output so far and says
which part is message content that can be sent, and which tool calls have begun, with their
name (once complete) and the raw text of their arguments so far. Both the one-shot
`extract(text)` and the incremental `ToolCallStreamer` are built on it, so streamed
`delta.tool_calls` fragments join to the non-streamed `message.tool_calls` exactly: a call's
`arguments` is the JSON text the model wrote for it (OpenAI sends arguments as a string).

Output that claims to be a tool call but is not well formed (bad JSON, no name, arguments that
are not a JSON object, an unfinished call) is returned as plain content, never half-parsed.
Output that constrained decoding wrote (`ToolParser.enforced`: tool_choice "required" or a
named function) is never content: the grammar makes every call in it well formed, so only the
token limit can leave one unfinished, and that call comes last with its arguments as far as
they got (finish_reason "length"; OpenAI's and vLLM's answer, and what the stream sent).
"""
from __future__ import annotations

import abc
import json
import secrets
import string
from dataclasses import dataclass, field

from ferrum.tool_parsers.json_scan import NotJson, object_members, skip_ws


@dataclass
class ToolCall:
    """A parsed call: name, arguments (JSON text of an object), id (`call_...`)."""

    name: str
    arguments: str
    id: str

    def to_openai(self) -> dict:
        """OpenAI's `message.tool_calls[i]` shape."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    """A call as far as the text goes. name: None until the whole name string is there.
    arguments: the arguments' JSON text so far; a prefix of the final text (streamable) when
    `streamable`, else only meaningful once `done`."""

    name: str | None = None
    arguments: str = ""
    done: bool = False
    streamable: bool = True


@dataclass
class Scan:
    """content: message text that is certain (it never changes as the text grows);
    calls: the calls begun so far; in_calls: a tool-call marker was seen; malformed: what
    follows the marker is not a valid call (the whole text is then content)."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)
    in_calls: bool = False
    malformed: bool = False


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (held back
    while streaming: it may be the start of the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def safe_content(text: str, markers: tuple[str, ...]) -> str:
    """The part of `text` (which contains no marker) that can be sent now: without a trailing
    possible marker prefix and trailing whitespace (content before a call is right-stripped)."""
    hold = max(held_prefix(text, m) for m in markers)
    return text[:len(text) - hold].rstrip()


def scan_call_object(text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
                     ) -> tuple[PartialCall, int | None]:
    """A call written as a JSON object {"name": ..., "arguments" | "parameters": {...}}
    starting at text[i] == '{'. Returns (the call so far, index after the object or None).
    Raises NotJson for a value that cannot be a call."""
    members, end = object_members(text, i)
    call = PartialCall()
    name = members.get("name")
    if name is not None and name.end is not None:
        value = json.loads(text[name.start:name.end])
        if not isinstance(value, str):
            raise NotJson("the name of a tool call must be a string")
        call.name = value
    args = next((members[k] for k in args_keys if k in members), None)
    if args is not None:
        call.streamable = text[args.start] == "{"
        call.arguments = text[args.start:args.end if args.end is not None else len(text)]
        if args.end is not None and not call.streamable:
            call.arguments = _arguments_text(text[args.start:args.end])
    elif end is not None:
        call.arguments = "{}"                      # a call without arguments
    call.done = end is not None
    return call, end


def scan_call_array(text: str, i: int, s: Scan) -> None:
    """Append the calls of a JSON array of call objects starting at text[i] == '[' to s."""
    if text[i] != "[":
        raise NotJson("expected a JSON array of calls")
    i = skip_ws(text, i + 1)
    while i < len(text) and text[i] != "]":
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != "{":
            raise NotJson("expected a JSON object in the array of calls")
        call, end = scan_call_object(text, i)
        s.calls.append(call)
        if end is None:
            return
        i = skip_ws(text, end)


def _arguments_text(raw: str) -> str:
    """Arguments some models write as a JSON string holding the object: the inner text."""
    value = json.loads(raw)
    return value if isinstance(value, str) else raw


def is_json_object(text: str) -> bool:
    """Whether `text` is the JSON text of an object (a call's arguments must be one)."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):   # RecursionError: nested deeper than json parses
        return False


class ToolParser(abc.ABC):
    """Base class. Subclasses set `markers` (texts that start the tool-call part of the
    output, held back while streaming) and implement `scan`.

    max_calls: at most this many calls are returned (1 for parallel_tool_calls=false), the
    rest of the output is dropped; None for no limit. names: the declared function names; output
    calling another function is malformed (all content); None accepts any name.
    """

    markers: tuple[str, ...] = ()
    # True for output written under a grammar (see the module docstring): it is never content
    enforced = False
    # finish_reason of a choice that stopped by itself with calls (OpenAI's; a forced named
    # function gives "stop", NamedToolParser)
    calls_finish_reason = "tool_calls"
    # ids OpenAI-style: "call_" + 24 random alphanumerics (Mistral overrides: 9 characters)
    id_length = 24
    id_prefix = "call_"

    def __init__(self, max_calls: int | None = None, names: set[str] | None = None):
        self.max_calls = max_calls
        self.names = names   # the declared functions (tool_choice "auto"): a call of another is malformed

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The calls in `text` (the output so far; `final`: it is complete), each family's
        format read by its subclass."""

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """A choice's finish_reason: `calls_finish_reason` when it sent calls and stopped by
        itself ("stop"), else `reason` as it is ("length" stays, with or without calls)."""
        return self.calls_finish_reason if called and reason == "stop" else reason

    def new_call_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        return self.id_prefix + "".join(secrets.choice(alphabet) for _ in range(self.id_length))

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (the message content or None, calls). Output without calls is
        all content (`text`), and so is malformed tool-call output; enforced output is never
        content (None), and its last call may be unfinished (cut off by the token limit: its
        arguments are the text so far)."""
        s = self._scan(text, final=True)
        calls = s.calls
        whole = calls[:-1] if self.enforced and calls and not calls[-1].done else calls
        if (not s.in_calls or s.malformed
                or not all(c.done and c.name and is_json_object(c.arguments) for c in whole)):
            return text, []
        if not calls:
            return (None if self.enforced else text), []
        return s.content or None, [ToolCall(c.name, c.arguments, self.new_call_id()) for c in calls]

    def _scan(self, text: str, final: bool) -> Scan:
        try:
            s = self.scan(text, final)
        except (NotJson, ValueError, RecursionError):
            return Scan(content="", in_calls=True, malformed=True)
        if self.names is not None and any(c.name is not None and c.name not in self.names for c in s.calls):
            return Scan(content="", in_calls=True, malformed=True)   # OpenAI never returns an undeclared function
        if self.max_calls is not None:
            s.calls = s.calls[:self.max_calls]
        return s


class ToolCallStreamer:
    """Turns a growing output into OpenAI chat-completion deltas for one choice.

    feed(delta_text, final) -> (content delta, [tool-call deltas]); `final`: the output is
    complete (what is left is sent; `finish()` is the same with no more text). A tool-call delta
    is {"index", "id", "type", "function": {"name", "arguments": what is known}} when a call's
    name is known, then {"index", "function": {"arguments": fragment}} as its arguments grow;
    one entry per call index in a delta (OpenAI's form: clients read delta.tool_calls[i] as call
    i). `called` tells whether any call was sent; `calls_found`, after the final feed, whether
    the whole output holds calls (`extract`'s answer, which decides the finish_reason "tool_calls"
    streamed or not). If the output turns out malformed after a call was sent, the rest is sent
    as content (the stream then differs from the non-streamed answer, which is all content, but
    its finish_reason is the same); an enforced call that the token limit cut off is streamed as
    far as it got, as the non-streamed answer gives it.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.sent: list[list] = []      # per call: [id, arguments chars sent]
        self.called = False
        self.calls_found = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if final:
            return self.finish()
        s = self.parser._scan(self.text, final=False)
        if s.malformed:
            return "", []
        return self._content(s.content), self._calls(s.calls)

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self.parser.extract(self.text)
        self.calls_found = bool(calls)
        parts = [PartialCall(c.name, c.arguments, True) for c in calls]
        return self._content(content or ""), self._calls(parts)

    def _content(self, content: str) -> str:
        if len(content) <= self.content_sent:
            return ""
        delta = content[self.content_sent:]
        self.content_sent = len(content)
        return delta

    def _calls(self, calls: list[PartialCall]) -> list[dict]:
        out = []
        for k, c in enumerate(calls):
            if c.name is None:
                break                    # calls are sent in order, each once its name is known
            new = k == len(self.sent)
            if new:
                call_id = self.parser.new_call_id()
                self.sent.append([call_id, 0])
                self.called = True
                out.append({"index": k, "id": call_id, "type": "function",
                            "function": {"name": c.name, "arguments": ""}})
            if not (c.streamable or c.done):
                continue
            done = self.sent[k][1]
            if len(c.arguments) > done:
                fragment = c.arguments[done:]
                if new:   # in the call's first entry: one entry per index
                    out[-1]["function"]["arguments"] = fragment
                else:
                    out.append({"index": k, "function": {"arguments": fragment}})
                self.sent[k][1] = len(c.arguments)
        return out
