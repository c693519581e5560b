"""Tool-call parsers by output format (`--tool-call-parser` names follow vLLM's).

  hermes       <tool_call>{json}</tool_call>   Hermes 2/3, Qwen2.5, Qwen3; ferrum's own tool prompt
  llama3_json  {"name": ..., "parameters": ...} [; ...], optionally after <|python_tag|>
  mistral      [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}

`detect_tool_parser(chat_template)` picks one from the markers the template writes.
"""
from __future__ import annotations

from ferrum.errors import InvalidRequestError
from ferrum.tool_parsers.base import ToolCall, ToolCallStreamer, ToolParser
from ferrum.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from ferrum.tool_parsers.hermes import HermesToolParser
from ferrum.tool_parsers.llama3_json import Llama3JsonToolParser
from ferrum.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser for the format a chat template asks for: Mistral's [TOOL_CALLS], Llama 3's
    <|python_tag|> / ipython role, else Hermes (<tool_call>, and ferrum's tool prompt for
    templates without tool support)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def tool_parser_class(name: str, chat_template: str | None = None) -> type[ToolParser]:
    """The class for `name` ("auto": `detect_tool_parser`). Raises InvalidRequestError for an
    unknown name."""
    if name == "auto":
        name = detect_tool_parser(chat_template)
    if name not in TOOL_PARSERS:
        raise InvalidRequestError(f"unknown tool-call parser {name!r}; choose auto or one of "
                                  f"{', '.join(TOOL_PARSERS)}", param="tool_call_parser")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "NamedToolParser", "RequiredToolParser", "ToolCall", "ToolCallStreamer",
           "ToolParser", "detect_tool_parser", "tool_parser_class"]
