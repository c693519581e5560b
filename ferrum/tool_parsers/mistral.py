"""Mistral tool calls, after the [TOOL_CALLS] token, in either of Mistral's two layouts:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (tokenizer v3, v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                             (tokenizer v11+)

(the second repeats [TOOL_CALLS] before each call). Content = the text before the first
[TOOL_CALLS], right-stripped. Call ids are 9 alphanumerics: Mistral's chat templates reject
others.
"""
from __future__ import annotations

from ferrum.tool_parsers.base import (PartialCall, Scan, ToolParser, safe_content,
                                      scan_call_array)
from ferrum.tool_parsers.json_scan import NotJson, skip_ws, value_end

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    markers = (TOOL_CALLS,)
    id_prefix, id_length = "", 9

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return Scan(content=text if final else safe_content(text, self.markers))
        s = Scan(content=text[:first].rstrip(), in_calls=True)
        i = skip_ws(text, first + len(TOOL_CALLS))
        if i < len(text) and text[i] == "[" and not text.startswith(ARGS, i):
            scan_call_array(text, i, s)
            return s
        while i < len(text):              # name[ARGS]{...} [TOOL_CALLS]name[ARGS]{...} ...
            k = text.find(ARGS, i)
            if k < 0:
                if not final:
                    break                   # the name (or [ARGS]) is still arriving
                raise NotJson("expected name[ARGS]{...} after [TOOL_CALLS]")
            call = PartialCall(name=text[i:k].strip())
            j = skip_ws(text, k + len(ARGS))
            s.calls.append(call)
            if j >= len(text):
                break
            if text[j] != "{":
                raise NotJson("[ARGS] must be followed by a JSON object")
            end = value_end(text, j)
            call.arguments = text[j:end if end is not None else len(text)]
            call.done = end is not None
            if end is None:
                break
            i = skip_ws(text, end)
            if text.startswith(TOOL_CALLS, i):
                i = skip_ws(text, i + len(TOOL_CALLS))
                continue
            if i >= len(text) or (not final and TOOL_CALLS.startswith(text[i:])):
                break
            raise NotJson("unexpected text after a call")
        return s
