"""Parsers for output that constrained decoding wrote (tool_choice "required" or a named
function): the grammar fixes the layout, so no markers are involved.

- "required": a JSON array of {"name": ..., "parameters": {...}} objects, one per call (the
  schema `ferrum.entrypoints.chat_utils.tool_choice_constraint` builds);
- a named function: the output is the arguments object itself.
"""
from __future__ import annotations

from ferrum.tool_parsers.base import PartialCall, Scan, ToolParser, scan_call_array
from ferrum.tool_parsers.json_scan import skip_ws


class RequiredToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        s = Scan(content="", in_calls=True)
        i = skip_ws(text, 0)
        if i < len(text):
            scan_call_array(text, i, s)
        return s


class NamedToolParser(ToolParser):
    """name: the function tool_choice names."""

    def __init__(self, name: str, max_calls: int | None = None):
        super().__init__(max_calls)
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        args = text[skip_ws(text, 0):]
        return Scan(content="", in_calls=True,
                    calls=[PartialCall(self.name, args.rstrip() if final else args, done=final)])
