"""Tool-call parsers: each format's calls and content, malformed output falling back to content,
and streaming (fed in pieces of every size) joining to exactly the one-shot result."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrum.tool_parsers import (NamedToolParser, RequiredToolParser, ToolCallStreamer,
                                 detect_tool_parser, tool_parser_class)
from ferrum.tool_parsers.hermes import HermesToolParser
from ferrum.tool_parsers.llama3_json import Llama3JsonToolParser
from ferrum.tool_parsers.mistral import MistralToolParser

ARGS = '{"city": "Paris", "days": [1, {"note": "}\\" ]"}], "ok": true}'

# (parser, output, expected content, expected [(name, arguments)])
CASES = [
    (HermesToolParser(), f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
     "Checking.", [("get_weather", ARGS)]),
    (HermesToolParser(), '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>\n'
                         '{"name": "b", "arguments": {"x": 1}}\n</tool_call>', None, [("a", "{}"), ("b", '{"x": 1}')]),
    (HermesToolParser(), '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', None, [("a", '{"x": 1}')]),  # no closing tag
    (HermesToolParser(), '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>', None,
     [("a", '{"x": 2}')]),                                    # arguments as a JSON string
    (HermesToolParser(), '<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", "{}")]),
    (Llama3JsonToolParser(), f'{{"name": "get_weather", "parameters": {ARGS}}}', None, [("get_weather", ARGS)]),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "x"}}',
     None, [("a", "{}"), ("b", '{"q": "x"}')]),
    (MistralToolParser(), f'Sure [TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}, '
                          '{"name": "b", "arguments": {}}]', "Sure", [("get_weather", ARGS), ("b", "{}")]),
    (MistralToolParser(), f'[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]b[ARGS]{{}}', None,
     [("get_weather", ARGS), ("b", "{}")]),
    (RequiredToolParser(), f'[{{"name": "get_weather", "parameters": {ARGS}}}, {{"name": "b", "parameters": {{}}}}]',
     None, [("get_weather", ARGS), ("b", "{}")]),
    (NamedToolParser("get_weather"), ARGS, None, [("get_weather", ARGS)]),
    (HermesToolParser(max_calls=1), '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                                    '<tool_call>{"name": "b", "arguments": {}}</tool_call>', None, [("a", "{}")]),
]

MALFORMED = [
    (HermesToolParser(), 'text <tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>'),  # unbalanced
    (HermesToolParser(), '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>'),              # name not a string
    (HermesToolParser(), '<tool_call>\n{"arguments": {}}\n</tool_call>'),                          # no name
    # a function the request did not declare (OpenAI never returns one), also after a declared one
    (HermesToolParser(names={"a"}), '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
                                    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
    (MistralToolParser(names={"get_weather"}), '[TOOL_CALLS][{"name": "b", "arguments": {}}]'),
    (HermesToolParser(), '<tool_call>\nnot json\n</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'),               # not an object
    (HermesToolParser(), '<tool_call>{"name": "a", "arguments": {}} trailing</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "a", "parameters": {"x": 1}'),                           # cut off
    (Llama3JsonToolParser(), '{"city": "Paris"}'),                       # JSON, but not a call
    (Llama3JsonToolParser(), '{"name": "a", "parameters": {}} and more'),
    (MistralToolParser(), '[TOOL_CALLS][{"name": "a", "arguments": {"x": }]'),
    (MistralToolParser(), '[TOOL_CALLS]get_weather'),
    # nested deeper than json.loads recurses (was RecursionError, a failed request)
    (HermesToolParser(), '<tool_call>{"name": "a", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + '}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": "a", "arguments": ' + "[" * 5000 + "]" * 5000 + '}</tool_call>'),
]

# output that constrained decoding wrote, cut off by max_tokens: (parser, output, the calls);
# never content; the unfinished call comes last with its arguments as far as they got, unless
# the cut fell inside its name
TRUNCATED = [
    (RequiredToolParser(), '[{"name": "a", "parameters": {"x": 1', [("a", '{"x": 1')]),
    (RequiredToolParser(), '[', []),
    (RequiredToolParser(), '[{"name": "a", "parameters": {"x": 1}}, {"name": "a", "parameters": {"x": 1}}, '
                           '{"name": "a", "param', [("a", '{"x": 1}'), ("a", '{"x": 1}'), ("a", "")]),
    (RequiredToolParser(), f'[{{"name": "get_weather", "parameters": {ARGS}}}, ', [("get_weather", ARGS)]),
    (RequiredToolParser(), '[{"name": "a", "parameters": {}}, {"na', [("a", "{}")]),
    (RequiredToolParser(max_calls=1), '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}, {',
     [("a", "{}")]),
    (NamedToolParser("f"), '{"x": ', [("f", '{"x": ')]),
    (NamedToolParser("f"), '', [("f", "")]),
]

PLAIN = [(HermesToolParser(), "No tools needed <tool but not a call."),
         (Llama3JsonToolParser(), "The weather is nice."),
         (MistralToolParser(), "Plain [TOOL answer.")]


def stream(parser, text: str, sizes) -> tuple[str, list[tuple[str, str]], bool]:
    """Feed `text` in pieces; returns (joined content, [(name, joined arguments)], called)."""
    streamer = ToolCallStreamer(parser)
    content, calls = "", {}
    pieces, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        pieces.append(text[i:i + n])
        i, k = i + n, k + 1
    for piece in pieces + [None]:
        c, deltas = streamer.feed(piece) if piece is not None else streamer.finish()
        content += c
        indexes = [d["index"] for d in deltas]
        assert len(indexes) == len(set(indexes)), deltas     # one entry per call in a delta
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(v) for _, v in sorted(calls.items())], streamer.called


@pytest.mark.parametrize("case", range(len(CASES)))
def test_formats(case):
    parser, text, content, calls = CASES[case]
    got_content, got = parser.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    for c in got:
        assert isinstance(json.loads(c.arguments), dict)
        assert c.to_openai()["type"] == "function"
    ids = [c.id for c in got]
    assert len(set(ids)) == len(ids)
    if isinstance(parser, MistralToolParser):
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_malformed_output_is_content(case):
    parser, text = MALFORMED[case]
    assert parser.extract(text) == (text, [])


@pytest.mark.parametrize("case", range(len(TRUNCATED)))
def test_enforced_output_cut_off_keeps_the_calls_as_far_as_they_got(case):
    """tool_choice required / named output that max_tokens cut off: the calls completed before
    the cut, then the cut one with its arguments so far (OpenAI's and vLLM's answer); content
    is None (the raw JSON is never content), and the stream joins to the same calls."""
    parser, text, calls = TRUNCATED[case]
    content, got = parser.extract(text)
    assert content is None and [(c.name, c.arguments) for c in got] == calls
    for sizes in ([1], [3, 7], [max(len(text), 1)]):
        assert stream(parser, text, sizes) == ("", calls, bool(calls))
    assert parser.finish_reason("length", called=bool(calls)) == "length"


@pytest.mark.parametrize("case", range(len(PLAIN)))
def test_plain_text_is_content(case):
    parser, text = PLAIN[case]
    assert parser.extract(text) == (text, [])
    assert stream(parser, text, [1]) == (text, [], False)


@settings(max_examples=60, deadline=None)
@given(case=st.integers(0, len(CASES) - 1), sizes=st.lists(st.integers(1, 12), min_size=1, max_size=5))
def test_stream_joins_to_the_one_shot_result(case, sizes):
    parser, text, content, calls = CASES[case]
    got_content, got_calls, called = stream(parser, text, sizes)
    assert got_content == (content or "") and got_calls == calls and called


@settings(max_examples=40, deadline=None)
@given(case=st.integers(0, len(PLAIN) - 1), sizes=st.lists(st.integers(1, 12), min_size=1, max_size=5))
def test_stream_of_plain_and_malformed_text_is_all_content(case, sizes):
    parser, text = PLAIN[case]
    assert stream(parser, text, sizes) == (text, [], False)


def test_detect_from_chat_template():
    assert detect_tool_parser("{{ '<tool_call>' }}") == "hermes"
    assert detect_tool_parser("{{- '<|python_tag|>' }} ipython") == "llama3_json"
    assert detect_tool_parser("[TOOL_CALLS] [AVAILABLE_TOOLS]") == "mistral"
    assert detect_tool_parser(None) == "hermes"
    assert tool_parser_class("auto", "[TOOL_CALLS]") is MistralToolParser
    with pytest.raises(Exception, match="unknown tool-call parser"):
        tool_parser_class("nope")


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_streamed_finish_reason_of_malformed_output_is_the_non_streamed_one(case):
    """A call that breaks off after its first deltas went out (a stop string or EOS inside its
    JSON): the stream cannot take the deltas back, but its finish_reason is the non-streamed
    answer's ("stop": the output is content), not "tool_calls" (it was, once any call was sent)."""
    parser, text = MALFORMED[case]
    streamer = ToolCallStreamer(parser)
    for i in range(0, len(text), 3):
        streamer.feed(text[i:i + 3])
    streamer.finish()
    assert not streamer.calls_found
    assert parser.finish_reason("stop", streamer.calls_found) == "stop"


def test_a_call_sent_then_broken_off_still_ends_with_stop():
    # the case the rule above is for: deltas of call "a" were sent before the output broke
    parser = Llama3JsonToolParser()
    streamer = ToolCallStreamer(parser)
    _, deltas = streamer.feed('{"name": "a", "parameters": {"x": 1')
    assert deltas and streamer.called
    streamer.finish()
    assert not streamer.calls_found
    assert parser.finish_reason("stop", streamer.calls_found) == "stop"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_calls_found_when_the_output_holds_calls(case):
    parser, text, _, calls = CASES[case]
    streamer = ToolCallStreamer(parser)
    streamer.feed(text)
    streamer.finish()
    assert streamer.calls_found == bool(calls)
