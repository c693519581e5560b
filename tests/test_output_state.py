"""SequenceOutputState: stop rules and hold-back streaming, on a toy tokenizer whose tokens are
explicit byte strings (so a test chooses exactly where token boundaries fall)."""
import pytest

from ferrum.engine.output_state import SequenceOutputState
from ferrum.sampling_params import SamplingParams

EOS = 0


class ByteTokenizer:
    """Token i decodes to VOCAB[i]; invalid UTF-8 becomes U+FFFD like HF's byte-level decoder."""

    VOCAB = [b"<eos>", b"Hello", b" wor", b"ld", b"\n", b"###", b"#", b"##", b" END", b"E", b"ND",
             b"\xf0\x9f", b"\x98\x80", b"x", b"\xe6\x97\xa5", b"ND\xf0\x9f"]

    def decode(self, ids, skip_special_tokens=True):
        pieces = [self.VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS)]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def ids(self, *pieces: bytes) -> list[int]:
        return [self.VOCAB.index(p) for p in pieces]


TOK = ByteTokenizer()


def run(params, pieces, prompt=(1,), max_model_len=1000):
    """Feed tokens until finished; return the state and the streamed deltas."""
    state = SequenceOutputState(params, TOK, list(prompt), [EOS], max_model_len)
    deltas = []
    for t in TOK.ids(*pieces):
        state.append(t)
        deltas.append(state.stream_delta())
        if state.finished:
            break
    assert "".join(deltas) == state.text
    return state, deltas


def test_stop_string_split_over_three_tokens_is_cut_and_never_streamed():
    state, deltas = run(SamplingParams(stop=["###"], max_tokens=50),
                        [b"Hello", b"#", b"#", b"#", b"x"])
    assert (state.finish_reason, state.stop_reason, state.text) == ("stop", "###", "Hello")
    assert state.token_ids == TOK.ids(b"Hello", b"#", b"#", b"#")
    assert deltas == ["Hello", "", "", ""]


def test_stop_string_starting_mid_token_partial_release():
    # "##END" = last two chars of "###" + "E" + "ND"; the "#" before it is released as soon as
    # it can no longer start the stop string.
    state, deltas = run(SamplingParams(stop=["##END"]), [b"Hello", b"#", b"###", b"E", b"ND"])
    assert deltas == ["Hello", "", "##", "", ""]
    assert (state.text, state.stop_reason) == ("Hello##", "##END")
    state, deltas = run(SamplingParams(stop=["xE"]), [b"ld", b"x", b"E", b"ND"])
    assert deltas == ["ld", "", ""] and state.text == "ld"


def test_include_stop_str_in_output():
    state, deltas = run(SamplingParams(stop=["##"], include_stop_str_in_output=True),
                        [b"Hello", b"#", b"###"])
    # The first occurrence wins: "Hello" + "#" + "#" completes "##".
    assert state.text == "Hello##" and deltas == ["Hello", "", "##"]


def test_held_back_prefix_released_when_not_a_stop():
    state, deltas = run(SamplingParams(stop=["###"], max_tokens=4), [b"Hello", b"##", b"x", b"ld"])
    assert deltas == ["Hello", "", "##x", "ld"]
    assert (state.finish_reason, state.stop_reason) == ("length", None)
    assert state.text == "Hello##xld"


def test_earliest_of_several_stop_strings():
    state, _ = run(SamplingParams(stop=["ld", " wor"]), [b"Hello", b" wor", b"ld"])
    assert state.stop_reason == " wor" and state.text == "Hello"


def test_max_tokens_gives_length():
    state, _ = run(SamplingParams(max_tokens=3), [b"x"] * 10)
    assert (state.finish_reason, state.text, len(state.token_ids)) == ("length", "xxx", 3)
    with pytest.raises(RuntimeError):
        state.append(1)


def test_max_model_len_gives_length():
    state, _ = run(SamplingParams(max_tokens=None), [b"x"] * 10, prompt=[1, 1, 1],
                   max_model_len=5)
    assert state.finish_reason == "length" and state.token_ids == [13, 13]


def test_eos_stops_and_is_kept_in_token_ids_but_not_text():
    state, _ = run(SamplingParams(skip_special_tokens=False), [b"Hello", b"<eos>", b"x"])
    assert (state.finish_reason, state.stop_reason) == ("stop", None)
    assert state.token_ids == [1, EOS] and state.text == "Hello"


def test_ignore_eos_continues_to_max_tokens():
    state, _ = run(SamplingParams(ignore_eos=True, max_tokens=4),
                   [b"Hello", b"<eos>", b"x", b"<eos>", b"x"])
    assert (state.finish_reason, state.text) == ("length", "Hellox")
    assert state.token_ids == [1, EOS, 13, EOS]


def test_stop_token_ids():
    state, _ = run(SamplingParams(stop_token_ids=[4]), [b"Hello", b"\n", b"x"])
    assert (state.finish_reason, state.stop_reason, state.text) == ("stop", 4, "Hello")
    assert state.token_ids == [1, 4]


def test_min_tokens_defers_every_stop():
    params = SamplingParams(min_tokens=4, stop=["#"], stop_token_ids=[4], max_tokens=10)
    state, deltas = run(params, [b"<eos>", b"\n", b"#", b"x", b"#", b"x"])
    # EOS, "\n" and "#" come before the 4th token: ordinary output; the 5th token stops.
    assert (state.finish_reason, state.stop_reason) == ("stop", "#")
    assert state.text == "\n#x" and len(state.token_ids) == 5
    # The min_tokens-th token itself may stop, as in vLLM (for EOS / stop ids this cannot
    # happen in practice: the sampler masks them for the first min_tokens tokens).
    state, _ = run(SamplingParams(min_tokens=2, stop=["xx"]), [b"x", b"x", b"x"])
    assert (state.text, len(state.token_ids)) == ("", 2)
    state, _ = run(SamplingParams(min_tokens=2, stop_token_ids=[4]), [b"\n", b"\n", b"x"])
    assert (state.stop_reason, state.token_ids) == (4, [4, 4])
    # A short stop passed during min_tokens is not matched later, even when a longer stop
    # string widens the search window back over it.
    state, _ = run(SamplingParams(min_tokens=2, stop=["#", "Hello world"], max_tokens=4),
                   [b"#", b"x", b"x", b"x"])
    assert (state.finish_reason, state.text) == ("length", "#xxx")


def test_multibyte_character_across_tokens_with_stop_string():
    # "😀" is split as \xf0\x9f + \x98\x80; the stop string starts with it.
    state, deltas = run(SamplingParams(stop=["😀#"]),
                        [b"Hello", b"\xf0\x9f", b"\x98\x80", b"#", b"x"])
    assert deltas == ["Hello", "", "", ""]
    assert (state.text, state.stop_reason) == ("Hello", "😀#")
    # The same emoji when it is not followed by "#": released whole, never as U+FFFD.
    state, deltas = run(SamplingParams(stop=["😀#"], max_tokens=5),
                        [b"\xe6\x97\xa5", b"\xf0\x9f", b"\x98\x80", b"x", b"ld"])
    assert deltas == ["日", "", "", "😀x", "ld"] and state.finish_reason == "length"


def test_incomplete_character_at_length_limit_is_dropped():
    """The text of a sequence cut by max_tokens inside a character ends with the last whole
    character, not U+FFFD (issue 19 item 7)."""
    state, deltas = run(SamplingParams(max_tokens=2), [b"x", b"\xf0\x9f"])
    assert state.text == "x" and deltas == ["x", ""]


def test_stop_string_in_text_released_at_the_end_is_cut():
    """Text the detokenizer holds until the sequence ends (a token whose last bytes begin a
    character that never completes) is searched for stop strings too: "ND" came out of
    flush() at EOS / max_tokens after the stop check, so " worEND" was returned and streamed
    with stop_reason None."""
    for params, end in ((SamplingParams(stop=["END"]), [b"<eos>"]),
                        (SamplingParams(stop=["END"], max_tokens=3), [])):
        state, deltas = run(params, [b" wor", b"E", b"ND\xf0\x9f"] + end)
        assert (state.text, state.finish_reason, state.stop_reason) == (" wor", "stop", "END")
        assert "".join(deltas) == " wor"


def test_a_long_stop_string_costs_linear_time_per_token():
    """The hold-back check sliced every suffix of the text up to the longest stop's length and
    compared each: O(len(stop)^2) per token, so one request with a 100,000-character stop
    took 26 s over 3,200 tokens of SmolLM2 output (16 ms a token at the end, holding up every
    other sequence's step). The hold-back is unchanged: the longest suffix that is a proper
    prefix of a stop."""
    import time
    t0 = time.perf_counter()
    state, deltas = run(SamplingParams(stop=["H" + "x" * 100_000], max_tokens=3000), [b"Hello"] * 3000,
                        max_model_len=10_000)
    assert time.perf_counter() - t0 < 5   # 0.02 s; the quadratic check took 18 s
    assert state.text == "Hello" * 3000 and deltas[-1] == "Hello"
    state, deltas = run(SamplingParams(stop=["x" * 10, "Hellox#"], max_tokens=6),
                        [b"Hello", b"x", b"x", b"#", b"x", b"x"])
    assert deltas == ["", "", "Hello", "xx#", "", "xx"]


def test_no_tokenizer_means_token_ids_only():
    state = SequenceOutputState(SamplingParams(max_tokens=2), None, [1], [EOS], 100)
    state.append(13), state.append(13)
    assert (state.finish_reason, state.text, state.stream_delta()) == ("length", "", "")
    with pytest.raises(ValueError, match="stop strings"):
        SequenceOutputState(SamplingParams(stop=["a"]), None, [1], [EOS], 100)
