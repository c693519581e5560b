"""OpenAI logprobs formatting (issue 13 items 4 and 5) on the SmolLM2 tokenizer, where CJK
characters are split over byte tokens that each decode to U+FFFD.

- top_logprobs keyed by text lost entries on equal texts, and the chosen token's value was
  overwritten by a lower-ranked one; `return_tokens_as_token_ids` keys them apart;
- the tokens of an answer must join to exactly its text: no EOS text, no text a stop string cut,
  and the tokens of one character join to that character.
"""
from __future__ import annotations

import copy
import json
import math
import pickle

import pytest

import ferrum
from ferrum.engine.output_state import SequenceOutputState
from ferrum.entrypoints.openai.logprobs import (TokenFormatter, chat_logprobs, completion_logprobs,
                                                ready_tokens, token_texts)
from ferrum.outputs import Logprob, logprob_entry
from ferrum.sampling_params import SamplingParams

CJK = "你好世界。"
EOS = 2   # <|im_end|>


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def generate(tok, ids, params, prompt="Say it:") -> SequenceOutputState:
    """Feed `ids` as if sampled; returns the finished (or stopped) output state."""
    state = SequenceOutputState(params, tok, tok.encode(prompt), [EOS], 10_000)
    for t in ids:
        state.append(t)
        if state.finished:
            break
    return state


def test_colliding_texts_keep_the_chosen_logprob_and_the_best_rank(tok):
    ids = tok.encode(CJK)
    a, b, c = ids[0], ids[1], ids[3]                  # three byte tokens: all decode to U+FFFD
    assert {tok.decode([t]) for t in (a, b, c)} == {"\ufffd"}
    fmt = TokenFormatter(tok)
    # the chosen token b is ranked below a: before, a's value under the shared key "\ufffd"
    # was overwritten by c's (the last, lowest-ranked)
    lp = {a: -0.5, b: -1.0, c: -2.0, 905: -3.0}
    out = completion_logprobs(fmt, [b], [lp], None)
    assert out["tokens"] == ["\ufffd"] and out["token_logprobs"] == [-1.0]
    assert out["top_logprobs"][0] == {"\ufffd": -1.0, " world": -3.0}
    lp = {a: -0.5, b: -1.0, c: -2.0}
    out = completion_logprobs(fmt, [a], [lp], None)
    assert out["top_logprobs"][0] == {"\ufffd": -0.5}           # the best of the colliding ones
    out = completion_logprobs(fmt, [b], [lp], None, as_ids=True)
    assert out["tokens"] == [f"token_id:{b}"]
    assert out["top_logprobs"][0] == {f"token_id:{a}": -0.5, f"token_id:{b}": -1.0,
                                      f"token_id:{c}": -2.0}
    chat = chat_logprobs(fmt, [b], [lp], None, 3, as_ids=True)["content"][0]
    assert chat["token"] == f"token_id:{b}" and [e["token"] for e in chat["top_logprobs"]] == [
        f"token_id:{a}", f"token_id:{b}", f"token_id:{c}"]


def test_text_offsets_index_the_text_with_token_id_names(tok):
    """return_tokens_as_token_ids renames the tokens, not the text: text_offset still counts
    the characters each token added (an EOS token adds none)."""
    ids = tok.encode(" Paris is big")
    texts = [tok.decode([t]) for t in ids] + [""]
    lps = [{t: -1.0} for t in ids] + [{0: -1.0}]
    plain = completion_logprobs(TokenFormatter(tok), ids + [0], lps, texts, text_offset=3)
    named = completion_logprobs(TokenFormatter(tok), ids + [0], lps, texts, text_offset=3, as_ids=True)
    want = [3 + sum(map(len, texts[:i])) for i in range(len(texts))]
    assert plain["text_offset"] == named["text_offset"] == want
    assert named["tokens"][0] == f"token_id:{ids[0]}"


@pytest.mark.parametrize("case", ["eos", "stop_string", "stop_token", "cjk", "cut_in_char"])
def test_token_texts_join_to_the_text(tok, case):
    """What each token added joins to exactly the returned text, and its `bytes` too."""
    words = tok.encode(" The capital of France is Paris.")
    cjk = tok.encode(CJK * 2)
    params, ids = {
        "eos": (SamplingParams(max_tokens=50), words + [EOS]),
        "stop_string": (SamplingParams(max_tokens=50, stop=["ital of"]), words),
        "stop_token": (SamplingParams(max_tokens=50, stop_token_ids=[words[3]]), words),
        "cjk": (SamplingParams(max_tokens=50), cjk + [EOS]),
        "cut_in_char": (SamplingParams(max_tokens=len(cjk) - 1), cjk),
    }[case]
    state = generate(tok, ids, params)
    n = len(state.token_ids)
    texts = token_texts(state.text, state.token_text_ends(), 0, n)
    assert "".join(texts) == state.text
    assert state.text == {"eos": " The capital of France is Paris.", "stop_string": " The cap",
                          "stop_token": " The capital of", "cjk": CJK * 2,
                          "cut_in_char": CJK + CJK[:-1]}[case]
    if case in ("eos", "stop_token"):
        assert texts[-1] == ""                       # before: "<|im_end|>" / " France"
    if case == "cjk":                                # a character comes with its last token
        assert texts[:3] == ["", "你", ""]
    fmt = TokenFormatter(tok)
    lps = [{t: -1.0} for t in state.token_ids]
    out = completion_logprobs(fmt, state.token_ids, lps, texts, 7)
    assert "".join(out["tokens"]) == state.text
    assert out["text_offset"][0] == 7 and out["text_offset"][-1] == 7 + len(state.text) - len(texts[-1])
    assert all(top[t] == -1.0 for t, top in zip(out["tokens"], out["top_logprobs"]))
    chat = chat_logprobs(fmt, state.token_ids, lps, texts, 1)["content"]
    assert "".join(e["token"] for e in chat) == state.text
    assert bytes(b for e in chat for b in e["bytes"]).decode("utf-8") == state.text


def test_streamed_tokens_wait_until_their_text_is_final(tok):
    """A token whose text may still be cut by a stop string waits; once finished, all go."""
    ids = tok.encode(" The capital of France")
    state = SequenceOutputState(SamplingParams(max_tokens=50, stop=["ital of"]), tok,
                                tok.encode("Q"), [EOS], 10_000)
    sent = streamed = 0
    joined = ""
    for t in ids:
        state.append(t)
        streamed += len(state.stream_delta())
        ends = state.token_text_ends()
        ready = ready_tokens(ends, sent, len(state.token_ids), streamed, state.finished)
        joined += "".join(token_texts(state.text, ends, sent, ready))
        assert joined == state.text[:len(joined)] and len(joined) <= streamed
        sent = ready
        if state.finished:
            break
    assert sent == len(state.token_ids) and joined == state.text == " The cap"


def test_logprob_is_a_float_with_vllm_fields(tok):
    """The engine's logprob values: vLLM's `.logprob` / `.rank` / `.decoded_token`, and
    everything a float did before (arithmetic, comparisons, ==, repr, json, pickle). The
    OpenAI formatting gets plain floats from them, the same JSON as before."""
    assert ferrum.Logprob is Logprob
    lp = Logprob(-0.25, rank=3, decoded_token=" Paris")
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.25, 3, " Paris")
    assert type(lp.logprob) is float and isinstance(lp, float)
    assert lp == -0.25 and hash(lp) == hash(-0.25) and {7: lp} == {7: -0.25}
    assert lp + 1.0 == 0.75 and type(lp + 1.0) is float and math.exp(lp) == math.exp(-0.25)
    assert -1.0 < lp < 0 and max([Logprob(-2.0), lp]) is lp and sum([lp, lp]) == -0.5
    assert repr(lp) == str(lp) == f"{lp}" == "-0.25" and f"{lp:.1f}" == "-0.2"
    assert json.dumps({"7": lp}) == '{"7": -0.25}'
    for back in (pickle.loads(pickle.dumps(lp)), copy.deepcopy(lp)):
        assert (back, back.rank, back.decoded_token, type(back)) == (-0.25, 3, " Paris", Logprob)
    assert Logprob(-1.0).rank is None and Logprob(-1.0).decoded_token is None
    # what the engine builds: top entries ranked in order, then the chosen token if not among them
    entry = logprob_entry([5, 9], [-0.5, -1.5], 4, -3.0, 17)
    assert [(k, v, v.rank, v.decoded_token) for k, v in entry.items()] == \
        [(5, -0.5, 1, None), (9, -1.5, 2, None), (4, -3.0, 17, None)]
    assert list(logprob_entry([5, 9], [-0.5, -1.5], 9, -1.5, 4).items()) == [(5, -0.5), (9, -1.5)]
    assert logprob_entry([5, 9], [-0.5, -1.5], 9, -1.5, 4)[9].rank == 2
    ids = tok.encode(" Paris is")
    lps = [logprob_entry([t, 905], [-0.5, float("-inf")], t, -0.5, 1) for t in ids]
    out = completion_logprobs(TokenFormatter(tok), ids, lps, None)
    chat = chat_logprobs(TokenFormatter(tok), ids, lps, None, 2)["content"]
    values = out["token_logprobs"] + [v for top in out["top_logprobs"] for v in top.values()] + \
        [e["logprob"] for e in chat] + [t["logprob"] for e in chat for t in e["top_logprobs"]]
    assert {type(v) for v in values} == {float} and set(values) == {-0.5, -9999.0}
