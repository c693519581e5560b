"""Hermes / Qwen tool calls: each call is a JSON object inside <tool_call>...</tool_call>.

    I will look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Format of NousResearch Hermes-2-Pro / Hermes-3 and the Qwen2.5 / Qwen3 chat templates (their
`tools` section asks for it); also what ferrum's own tool prompt asks of models whose template
has no tool support (`ferrum.entrypoints.chat_utils`). Content = the text before the first
<tool_call>, right-stripped; text between and after the calls is dropped. A last call whose
JSON is complete counts even without its closing tag (some models stop right after the JSON).
"""
from __future__ import annotations

from ferrum.tool_parsers.base import Scan, ToolParser, safe_content, scan_call_object
from ferrum.tool_parsers.json_scan import NotJson, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    markers = (START,)

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(content=text if final else safe_content(text, self.markers))
        s = Scan(content=text[:first].rstrip(), in_calls=True)
        i = first
        while i >= 0:
            j = skip_ws(text, i + len(START))
            if j >= len(text):
                break
            if text[j] != "{":
                raise NotJson("a <tool_call> must hold a JSON object")
            call, end = scan_call_object(text, j)
            s.calls.append(call)
            if end is None:
                break
            close = skip_ws(text, end)
            if text.startswith(END, close):
                i = text.find(START, close + len(END))
            elif len(text) - close < len(END) and END.startswith(text[close:]):
                break               # the closing tag is still arriving
            else:
                raise NotJson("a tool call's JSON must be followed by </tool_call>")
        return s
