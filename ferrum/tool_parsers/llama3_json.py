"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer is one or more JSON objects,
separated by ';', optionally after the <|python_tag|> token.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Format of Meta's Llama 3.1+ chat template (JSON-based tool calling, "parameters" key; the
"arguments" key is accepted too). An answer that does not start (after whitespace) with '{' or
<|python_tag|> is content; a call always has empty content.
"""
from __future__ import annotations

from ferrum.tool_parsers.base import Scan, ToolParser, scan_call_object
from ferrum.tool_parsers.json_scan import NotJson, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    markers = (PYTHON_TAG, "{")

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        rest = text[i:]
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not rest.startswith("{"):
            if not final and PYTHON_TAG.startswith(rest):
                return Scan(content="")        # nothing yet, or the tag is still arriving
            return Scan(content=text)
        s = Scan(content="", in_calls=True)
        while i < len(text):
            if text[i] != "{":
                raise NotJson("expected a JSON object")
            call, end = scan_call_object(text, i)
            s.calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text):
                if text[i] != ";":
                    raise NotJson("calls must be separated by ';'")
                i = skip_ws(text, i + 1)
        return s
