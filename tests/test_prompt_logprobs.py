"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against HF transformers' log_softmax on the
same tiny model: whole and chunked prefill, in a batch with other requests, after a prefix-cache
hit on the same prompt, after preemption. TP=2 equal to TP=1: test_tensor_parallel.py."""
from __future__ import annotations

import random

import pytest
import torch

from ferrum import LLM, SamplingParams
from tiny_models import hf_model, make_tiny_model

VOCAB = 128
MAX_LEN = 128
TOP = 5
# fp32 on CPU: ferrum and transformers differ by float rounding only (measured 1.4e-6)
TOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("plp") / "llama"), "llama", num_heads=4,
                           num_kv_heads=2, hidden=64, layers=2, vocab=VOCAB, seed=11)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (70, 1, 2, 33, 16, 17)]


@pytest.fixture(scope="module")
def hf(folder):
    return hf_model(folder)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """HF log_softmax after each of `ids`: [len, V] float32, row p for the token after p."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def reference(hf, prompts):
    """HF log_softmax over each prompt: [len - 1, V] float32, row p for prompt token p + 1."""
    return [hf_logprobs(hf, p)[:-1] for p in prompts]


def make_llm(folder, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": MAX_LEN, **kw}
    return LLM(folder, progress=False, **kw)


def max_diff(outs, prompts, reference, top: int = TOP) -> float:
    """Checks the format and returns the max abs difference to HF over every prompt token
    and every top-`top` entry (ids must match HF's order where values are not tied)."""
    worst = 0.0
    for out, p, ref in zip(outs, prompts, reference):
        lps = out.prompt_logprobs
        assert len(lps) == len(p) and lps[0] is None
        for i, entry in enumerate(lps[1:]):
            tok = p[i + 1]
            assert tok in entry and len(entry) in (top, top + 1)
            worst = max(worst, abs(entry[tok] - ref[i, tok].item()))
            values, ids = ref[i].topk(top)
            ours = list(entry.items())[:top]
            assert [v for _, v in ours] == sorted((v for _, v in ours), reverse=True)
            for (tid, v), rv, rid in zip(ours, values.tolist(), ids.tolist()):
                worst = max(worst, abs(v - rv), abs(ref[i, tid].item() - v))
    return worst


def test_prompt_logprobs_equal_hf_whole_and_chunked(folder, prompts, reference):
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for kw in (dict(enable_chunked_prefill=False),
               dict(enable_chunked_prefill=True, max_num_batched_tokens=24)):
        with make_llm(folder, **kw) as llm:
            # in a batch with requests that want none (their rows must not shift the others')
            outs = llm.generate(prompts + prompts[:2], [sp] * len(prompts) + [plain] * 2,
                                use_tqdm=False)
            assert all(o.prompt_logprobs is None for o in outs[len(prompts):])
            diff = max_diff(outs[:len(prompts)], prompts, reference)
            assert diff < TOL, f"{kw}: max abs diff to HF {diff:.2e}"
            # the generated tokens do not change when prompt logprobs are asked for
            assert [o.outputs[0].token_ids for o in outs[:2]] == \
                [o.outputs[0].token_ids for o in outs[len(prompts):]]
            assert llm.engine.executor.status().running_sequences == 0


def check_ranks(entry: dict, token: int, ref: torch.Tensor, top: int) -> int:
    """vLLM's Logprob fields of one position: `.logprob` is the value, no decoded_token, the
    top entries ranked 1..top in order, and `token` (the prompt or chosen token) ranked as in
    HF's full distribution `ref` [V]: 1 + the other tokens whose logprob is >= its own, within
    TOL of float rounding. Returns its rank."""
    assert all(v.logprob == v and type(v.logprob) is float and v.decoded_token is None
               for v in entry.values())
    assert [v.rank for v in entry.values()][:top] == list(range(1, top + 1))
    rank, v = entry[token].rank, entry[token].logprob
    assert 1 + int((ref > v + TOL).sum()) <= rank <= int((ref >= v - TOL).sum())
    return rank


def test_logprob_ranks_equal_hf(folder, hf, prompts, reference):
    """Prompt and sample logprobs carry vLLM's rank: a prompt token's and a sampled token's
    rank among the vocabulary by logprob equals the one HF's logits give (temperature 1, so
    the sampled tokens are not all the most likely)."""
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=12, logprobs=TOP, prompt_logprobs=TOP,
                        ignore_eos=True)
    with make_llm(folder) as llm:
        out = llm.generate([prompts[3]], sp, use_tqdm=False)[0]
    prompt_ranks = [check_ranks(e, t, reference[3][i], TOP)
                    for i, (e, t) in enumerate(zip(out.prompt_logprobs[1:], prompts[3][1:]))]
    c = out.outputs[0]
    ref = hf_logprobs(hf, prompts[3] + c.token_ids)[len(prompts[3]) - 1:]
    sample_ranks = [check_ranks(e, t, ref[i], TOP) for i, (e, t) in enumerate(zip(c.logprobs, c.token_ids))]
    assert max(prompt_ranks) > TOP + 1 and max(sample_ranks) > 1   # not only the top ones
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(c.logprobs, c.token_ids)))


def test_prompt_logprobs_zero_gives_only_the_prompt_token(folder, prompts, reference):
    with make_llm(folder) as llm:
        out = llm.generate([prompts[0]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
    assert all(len(e) == 1 and list(e) == [t] for e, t in zip(out.prompt_logprobs[1:], prompts[0][1:]))
    diff = max(abs(e[t] - reference[0][i, t].item())
               for i, (e, t) in enumerate(zip(out.prompt_logprobs[1:], prompts[0][1:])))
    assert diff < TOL


def test_prompt_logprobs_after_prefix_cache_hit(folder, prompts, reference):
    """The prompt's blocks are cached by a first request: a request for prompt logprobs
    computes every position anyway (no hit), and its values are the same."""
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    with make_llm(folder, enable_prefix_caching=True) as llm:
        first = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        again = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
        out = llm.generate([prompts[0]], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert max_diff([out], prompts[:1], reference[:1]) < TOL
        # once its prompt logprobs are done, it left its blocks in the cache for others
        assert llm.generate([prompts[0]], SamplingParams(max_tokens=1),
                            use_tqdm=False)[0].num_cached_tokens == 64


def test_prompt_logprobs_survive_preemption(folder, prompts, reference):
    """A pool too small for all requests at once: sequences are preempted and recomputed;
    each prompt logprob is still computed once, in order."""
    sp = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=2, ignore_eos=True)
    with make_llm(folder, num_kv_blocks=10, max_num_batched_tokens=32) as llm:
        outs = llm.generate([prompts[0], prompts[3], prompts[0]], sp, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    ps = [prompts[0], prompts[3], prompts[0]]
    assert max_diff(outs, ps, [reference[0], reference[3], reference[0]], top=2) < TOL


def test_abort_mid_prefill_leaves_nothing(folder, prompts, reference):
    """A request for prompt logprobs aborted between two chunks of its prefill: its blocks go
    back to the pool and the engine goes on serving (the same prompt, asked again, is right)."""
    with make_llm(folder, max_num_batched_tokens=16) as llm:
        eng = llm.engine
        free = eng.block_manager.num_free_blocks
        rid = eng.add_request(None, prompts[0], SamplingParams(max_tokens=4, prompt_logprobs=1))
        eng.step()
        eng.step()
        assert 0 < len(eng.requests[rid].prompt_logprobs) < len(prompts[0])
        assert eng.abort_request(rid)
        assert eng.block_manager.num_free_blocks == free and not eng.has_unfinished_requests()
        out = llm.generate([prompts[0]], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        assert max_diff([out], prompts[:1], reference[:1], top=1) < TOL
