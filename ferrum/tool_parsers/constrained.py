"""Parsers for output that constrained decoding wrote (tool_choice "required" or a named
function): the grammar fixes the layout, so no markers are involved.

- "required": a JSON array of {"name": ..., "parameters": {...}} objects, one per call (the
  schema `ferrum.entrypoints.chat_utils.tool_choice_constraint` builds);
- a named function: the output is the arguments object itself.

Both are `enforced`: the output is never message content. Where the token limit cut it off
(finish_reason "length") the unfinished call is the last call, with its arguments as far as
they got (not valid JSON), as OpenAI and vLLM return it and as the stream sent it: under
"required" after the array elements completed before it (a model may repeat a call until
max_tokens when parallel_tool_calls allows several), unless the cut fell inside its name;
under a named function it is the one call. A choice whose calls are complete finishes
"tool_calls" under "required" and "stop" under a named function, as OpenAI's chat completions
do; a cut one stays "length".
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
        if final and s.calls and s.calls[-1].name is None:
            s.calls.pop()               # cut off inside its name: never sent, no call
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
        done = final and is_json_object(args)
        # final and not done: cut off by the token limit, the arguments as far as they got (as streamed)
        call = PartialCall(self.name, args.rstrip() if done else args, done=done)
        return Scan(content="", in_calls=True, calls=[call])
