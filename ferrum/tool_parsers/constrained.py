"""Parsers for output that constrained decoding wrote (tool_choice "required" or a named
function): the grammar fixes the layout, so no markers are involved.

- "required": a JSON array of {"name": ..., "parameters": {...}} objects, one per call (the
  schema `ferrum.entrypoints.chat_utils.tool_choice_constraint` builds);
- a named function: the output is the arguments object itself.

Both are `enforced`: the output is never message content, and where the token limit cut it off
(finish_reason "length") the unfinished call is left out: under "required" the array elements
completed before it are the calls (a model may repeat a call until max_tokens when
parallel_tool_calls allows several), under a named function there is then no call. A
choice with calls finishes "tool_calls" under "required" and "stop" under a named function, as
OpenAI's chat completions do.
"""
from __future__ import annotations

from ferrum.tool_parsers.base import PartialCall, Scan, ToolParser, is_json_object, scan_call_array
from ferrum.tool_parsers.json_scan import skip_ws


class RequiredToolParser(ToolParser):
    enforced = True

    def scan(self, text: str, final: bool) -> Scan:
        s = Scan(content="", in_calls=True)
        i = skip_ws(text, 0)
        if i < len(text):
            scan_call_array(text, i, s)
        if final and s.calls and not s.calls[-1].done:
            s.calls.pop()               # cut off by the token limit
        return s


class NamedToolParser(ToolParser):
    """name: the function tool_choice names."""

    enforced = True
    calls_finish_reason = "stop"   # what OpenAI returns for a forced named function

    def __init__(self, name: str, max_calls: int | None = None):
        super().__init__(max_calls)
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        args = text[skip_ws(text, 0):]
        if not final:
            return Scan(content="", in_calls=True, calls=[PartialCall(self.name, args)])
        args = args.rstrip()
        calls = [PartialCall(self.name, args, done=True)] if is_json_object(args) else []
        return Scan(content="", in_calls=True, calls=calls)    # none: cut off by the token limit
