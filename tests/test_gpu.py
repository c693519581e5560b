"""GPU correctness (`pytest -m gpu`; skipped without CUDA): ferrum vs HF transformers on random
small Llama and Qwen3 models, eager and with CUDA graphs, fp32 and bf16; TP=2 vs TP=1 greedy
tokens in fp32 (needs 2 GPUs)."""
from __future__ import annotations

import pytest
import torch

from ferrum import LLM, SamplingParams
from tiny_models import hf_model, make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = {"llama": dict(family="llama", num_heads=8, num_kv_heads=2, hidden=256, head_dim=32),
            "qwen3": dict(family="qwen3", num_heads=8, num_kv_heads=4, hidden=256, head_dim=64)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    kw = dict(FAMILIES[request.param])
    fam = kw.pop("family")
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), fam, layers=3, vocab=512,
                           inter=512, max_pos=1024, **kw)


def _prompts(n=6, vocab=512):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (int(L),), generator=g).tolist()
            for L in torch.randint(5, 200, (n,), generator=g)]


def _hf_greedy_logits(folder, prompt, steps, dtype):
    m = hf_model(folder).to("cuda", dtype)
    ids = torch.tensor([prompt], device="cuda")
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = m(ids).logits[0, -1].float()
            out.append(logits)
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return torch.stack(out), ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 0.15)])
def test_logits_match_hf(tiny, eager, dtype, tol):
    prompt = _prompts(1)[0]
    steps = 12
    ref, ref_tokens = _hf_greedy_logits(tiny, prompt, steps, getattr(torch, dtype))
    from ferrum.interfaces import DecodeInput, KvCacheHandle, PrefillInput
    with LLM(tiny, progress=False, dtype=dtype, device="cuda", enforce_eager=eager, max_num_seqs=8,
             max_model_len=1024) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        if dtype == "float32":
            assert out == ref_tokens
        # logits of the prefill and of each decode step, fed HF's greedy tokens
        ex = llm.engine.executor
        h = KvCacheHandle("x", list(range(1, 2 + (len(prompt) + steps) // 16)), 0, 16)
        rows = [ex.prefill(PrefillInput([prompt], [h])).logits[0]]
        for t in ref_tokens[:-1]:
            rows.append(ex.decode(DecodeInput([t], [h])).logits[0])
        got = torch.stack(rows).float()
    diff = (got - ref).abs().max().item()
    assert diff < tol, f"{dtype} eager={eager}: max abs logit diff vs HF {diff:.3e}"
    print(f"[gpu] {tiny.split('/')[-1]} {dtype} eager={eager} max|diff| vs HF = {diff:.3e}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_equals_tp1_fp32(tiny):
    prompts = _prompts(8)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(tiny, progress=False, dtype="float32", device="cuda", max_num_seqs=16, max_model_len=1024) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    with LLM(tiny, progress=False, dtype="float32", device="cuda", max_num_seqs=16, max_model_len=1024,
             tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.engine.stats["overlapped_steps"] > 0   # async scheduling is on under TP too
    assert got == ref


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_async_scheduling_matches_sync(tiny, eager):
    """Async scheduling (the CUDA default: decode inputs taken from the previous step's samples
    on the device) gives the tokens of the synchronous loop: greedy and seeded sampling."""
    prompts = _prompts(8)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=8 + 4 * i, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for mode in (False, True):
        with LLM(tiny, progress=False, dtype="float32", device="cuda", max_num_seqs=16,
                 max_model_len=1024, enforce_eager=eager, async_scheduling=mode) as llm:
            runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert (llm.engine.stats["overlapped_steps"] > 0) == mode
    assert runs[True] == runs[False]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_bf16_logit_diff(tiny):
    """Reports the bf16 max logit difference TP=2 vs TP=1 (reduction order differs)."""
    from ferrum.interfaces import KvCacheHandle, PrefillInput
    prompt = _prompts(1)[0]
    res = []
    for tp in (1, 2):
        with LLM(tiny, progress=False, dtype="bfloat16", device="cuda", max_num_seqs=8, max_model_len=1024,
                 tensor_parallel_size=tp) as llm:
            h = KvCacheHandle("x", list(range(1, 20)), 0, 16)
            res.append(llm.engine.executor.prefill(PrefillInput([prompt], [h])).logits[0].float().cpu())
    diff = (res[0] - res[1]).abs().max().item()
    print(f"[gpu] bf16 TP=2 vs TP=1 max|logit diff| = {diff:.3e}")
    assert diff < 0.25
