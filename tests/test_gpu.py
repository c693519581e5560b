"""GPU correctness (`pytest -m gpu`; skipped without CUDA): ferrum vs HF transformers on random
small Llama, Qwen3, Qwen3-MoE, Mistral (sliding window) and Gemma 3 models, eager and with CUDA
graphs, fp32 and bf16; TP=2 vs TP=1 greedy tokens in fp32 (needs 2 GPUs)."""
from __future__ import annotations

import pytest
import torch

from ferrum import LLM, SamplingParams
from tiny_models import hf_model, make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = {"llama": dict(family="llama", num_heads=8, num_kv_heads=2, hidden=256, head_dim=32),
            "qwen3": dict(family="qwen3", num_heads=8, num_kv_heads=4, hidden=256, head_dim=64),
            # issue 17: MoE (Triton grouped GEMM / batch-1 GEMV), sliding window (prompts of up
            # to 200 tokens past a 64-token window), Gemma 3's local/global layers
            "qwen3_moe": dict(family="qwen3_moe", num_heads=8, num_kv_heads=4, hidden=256, head_dim=64,
                              num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                              norm_topk_prob=True),
            "mistral_swa": dict(family="mistral", num_heads=8, num_kv_heads=2, hidden=256, head_dim=32,
                                sliding_window=64),
            "gemma3": dict(family="gemma3", num_heads=8, num_kv_heads=2, hidden=256, head_dim=32,
                           sliding_window=64, query_pre_attn_scalar=32,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])}


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


def _hf_greedy_logits(folder, prompt, steps):
    """HF float32 greedy continuation of `prompt`: (logits of each step [steps, V] float32,
    tokens), and the same rows from HF's bfloat16 forward fed those tokens."""
    m = hf_model(folder).to("cuda", torch.float32)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, m(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        ref = m(ids).logits[0, len(prompt) - 1:-1].float()
        bf16 = m.to(torch.bfloat16)(ids).logits[0, len(prompt) - 1:-1].float()
    return ref, ids[0, len(prompt):].tolist(), bf16


def _teacher_forced_logits(llm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] float32 of the executor's prefill of `prompt` and of each decode
    step fed tokens[:-1] (one sequence in blocks 1, 2, ...)."""
    from ferrum.interfaces import DecodeInput, KvCacheHandle, PrefillInput
    ex = llm.engine.executor
    h = KvCacheHandle("x", list(range(1, 2 + (len(prompt) + len(tokens)) // 16)), 0, 16)
    rows = [ex.prefill(PrefillInput([prompt], [h])).logits[0]]
    for t in tokens[:-1]:
        rows.append(ex.decode(DecodeInput([t], [h])).logits[0])
    return torch.stack(rows).float()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_hf(tiny, eager, dtype):
    """Prefill + 12 teacher-forced decode steps against HF float32 on the same weights.
    float32: max logit diff < 1e-3 and the same greedy tokens. bfloat16: max logit error at
    most 2x HF's own bfloat16 error against the float32 reference."""
    prompt = _prompts(1)[0]
    steps = 12
    ref, ref_tokens, hf_bf16 = _hf_greedy_logits(tiny, prompt, steps)
    with LLM(tiny, progress=False, dtype=dtype, device="cuda", enforce_eager=eager, max_num_seqs=8,
             max_model_len=1024) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        if dtype == "float32":
            assert out == ref_tokens
        got = _teacher_forced_logits(llm, prompt, ref_tokens)
    diff = (got - ref).abs().max().item()
    hf_diff = (hf_bf16 - ref).abs().max().item()
    print(f"[gpu] {tiny.split('/')[-1]} {dtype} eager={eager} max|diff| vs HF fp32 = {diff:.3e} "
          f"(HF bf16: {hf_diff:.3e})")
    if dtype == "float32":
        assert diff < 1e-3, f"float32 eager={eager}: max abs logit diff vs HF {diff:.3e}"
    else:
        assert diff <= 2 * hf_diff, f"bfloat16 eager={eager}: {diff:.3e} > 2x HF bf16's {hf_diff:.3e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prompt_sdpa_prefill_matches_hf(tiny, dtype, monkeypatch):
    """A 900-token prompt prefilled eagerly through scaled_dot_product_attention
    (`sdpa_prefill_min_tokens` 512; float32 and sliding-window layers keep the Triton kernel) + 12
    teacher-forced decode steps against HF float32, with test_logits_match_hf's bounds."""
    from ferrum.ops import attention_triton
    calls = []
    real = attention_triton._prefill_sdpa
    monkeypatch.setattr(attention_triton, "_prefill_sdpa", lambda *a: calls.append(1) or real(*a))
    prompt = torch.randint(2, 512, (900,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = 12
    ref, ref_tokens, hf_bf16 = _hf_greedy_logits(tiny, prompt, steps)
    with LLM(tiny, progress=False, dtype=dtype, device="cuda", enforce_eager=True, max_num_seqs=4,
             max_model_len=1024, sdpa_prefill_min_tokens=512) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        got = _teacher_forced_logits(llm, prompt, ref_tokens)
    every_layer_windowed = "swa" in tiny   # Gemma 3's global layer takes SDPA, its local ones the kernel
    # float32 keeps the kernel (SDPA would take torch's math kernel)
    assert bool(calls) == (dtype == "bfloat16" and not every_layer_windowed), f"SDPA prefill calls: {len(calls)}"
    diff, hf_diff = (got - ref).abs().max().item(), (hf_bf16 - ref).abs().max().item()
    print(f"[gpu] {tiny.split('/')[-1]} {dtype} 900-token prompt, SDPA prefill {len(calls)} calls: "
          f"max|diff| vs HF fp32 = {diff:.3e} (HF bf16: {hf_diff:.3e})")
    if dtype == "float32":
        assert out == ref_tokens and diff < 1e-3, diff
    else:
        assert diff <= 2 * hf_diff, f"{diff:.3e} > 2x HF bf16's {hf_diff:.3e}"


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


# ---- production shapes -----------------------------------------------------------------------
# Llama-3-8B's weight matrices [N, K] as one rank holds them at TP=1 and TP=2.
LLAMA3_8B_MATRICES = {
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096),
    "qkv/tp2": (3072, 4096), "o_proj/tp2": (4096, 2048), "gate_up/tp2": (14336, 4096),
    "down/tp2": (4096, 7168), "lm_head/tp2": (64128, 4096)}


def _gemv_configs(N: int, K: int) -> list[tuple[int, int, int, int]]:
    """The configuration production picks for [N, K] (`gemv_config`) and the other two block
    shapes it can pick for some matrix of a step, BLOCK_K halved to divide K as it does."""
    from ferrum.ops.gemv import gemv_config
    out = [gemv_config(N, K)]
    for bn, bk, w, s in ((16, 256, 4, 4), (4, 1024, 4, 2), (8, 512, 4, 3)):
        while bk > 64 and K % bk:
            bk //= 2
        if (bn, bk, w, s) not in out:
            out.append((bn, bk, w, s))
    return out


@pytest.mark.parametrize("name", list(LLAMA3_8B_MATRICES))
def test_gemv_at_llama3_8b_shapes(name):
    """The batch-1 GEMV on every Llama-3-8B matrix at every block configuration it runs with:
    error against float64 at most 2x cuBLAS's own bf16 error on the same inputs, through the
    production dispatch (`ops.linear` picks the Triton GEMV, or the Gluon one where
    GLUON_GEMV_CONFIGS lists the shape) too."""
    from ferrum.ops import gemv, gemv_gluon
    from ferrum.ops.linear import linear
    N, K = LLAMA3_8B_MATRICES[name]
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    ref = x.double() @ w.double().t()
    cublas_err = (torch.nn.functional.linear(x, w).double() - ref).abs().max().item()
    assert gemv.can_use(x, w)
    for cfg in _gemv_configs(N, K):
        err = (gemv.gemv(x, w, config=cfg).double() - ref).abs().max().item()
        print(f"[gpu] gemv {name} {N}x{K} cfg={cfg}: max|err| {err:.3e} (cuBLAS {cublas_err:.3e})")
        assert err <= 2 * cublas_err, f"{name} cfg={cfg}: {err:.3e} vs cuBLAS {cublas_err:.3e}"
    gluon_cfg = gemv_gluon.config_for("bf16", x, N, K)
    if gluon_cfg is None:
        assert torch.equal(linear(x, w), gemv.gemv(x, w))
    else:
        err = (gemv_gluon.dense_gemv(x, w, config=gluon_cfg).double() - ref).abs().max().item()
        print(f"[gpu] Gluon gemv {name} {N}x{K} cfg={gluon_cfg}: max|err| {err:.3e} (cuBLAS {cublas_err:.3e})")
        assert err <= 2 * cublas_err, f"{name} Gluon cfg={gluon_cfg}: {err:.3e} vs cuBLAS {cublas_err:.3e}"
        assert torch.equal(linear(x, w), gemv_gluon.dense_gemv(x, w, config=gluon_cfg))


def test_gemv_chain_in_cuda_graph_waits_for_its_input():
    """gate_up GEMV -> SiLU*mul -> down GEMV at Llama-3-8B shapes, captured in a CUDA graph as a
    decode step runs them (PDL launches: each kernel starts before its predecessor ends and
    must wait for its input); replayed on new inputs, equal to the same chain run eagerly."""
    from ferrum.ops.activation import silu_and_mul
    from ferrum.ops.gemv import gemv
    g = torch.Generator(device="cuda").manual_seed(3)
    w1 = (torch.randn(28672, 4096, device="cuda", generator=g) * 4096 ** -0.5).bfloat16()
    w2 = (torch.randn(4096, 14336, device="cuda", generator=g) * 14336 ** -0.5).bfloat16()
    x = torch.zeros(1, 4096, device="cuda", dtype=torch.bfloat16)

    def chain():
        return gemv(silu_and_mul(gemv(x, w1)), w2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for seed in range(3):
        x.copy_(torch.randn(1, 4096, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.testing.assert_close(out, chain(), atol=0, rtol=0)


def _llama3_8b_layers(tmp_path, layers: int = 2) -> str:
    """Llama-3-8B's config (benchmarks/configs) with `layers` decoder layers: every kernel at
    its production shapes (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256)."""
    import json
    import os
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "benchmarks", "configs", "llama3-8b.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _hf_from_ferrum(llm, config_path: str):
    """HF LlamaForCausalLM (float32, CUDA) holding ferrum's weights, unfused (q/k/v, gate/up)."""
    import transformers
    model = llm.engine.executor.runner.model
    cfg = transformers.LlamaConfig.from_json_file(config_path)
    with torch.device("cuda"):   # initialised on the GPU: a CPU init of 1.6B weights takes a while
        hf = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    sd = {}
    q_size = cfg.num_attention_heads * 128
    kv_size = cfg.num_key_value_heads * 128
    for name, p in model.state_dict().items():
        if ".qkv_proj." in name:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split([q_size, kv_size, kv_size])):
                sd[name.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), p.chunk(2)):
                sd[name.replace("gate_up_proj", part)] = t
        else:
            sd[name] = p
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf


def test_bf16_logits_at_llama3_8b_shapes_within_hf_bf16_error(tmp_path):
    """Llama-3-8B shapes (2 layers, dummy weights): ferrum bf16 (CUDA graphs, Triton kernels)
    against float32 on the same weights, prefill and 16 teacher-forced decode steps. Its max
    logit error is at most 2x that of HF transformers' own bf16 forward; its greedy token
    equals the float32 one wherever the float32 top-2 margin exceeds twice ferrum's error."""
    config = _llama3_8b_layers(tmp_path)
    steps = 16
    prompt = torch.randint(10, 128000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with LLM(f"dummy:{config}", progress=False, dtype="bfloat16", device="cuda", max_num_seqs=4,
             max_model_len=1024) as llm:
        hf = _hf_from_ferrum(llm, config)
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            for _ in range(steps):   # float32 greedy continuation: the reference tokens
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            ref = hf(ids).logits[0, len(prompt) - 1:-1].float()              # [steps, V]
            hf_bf16 = hf.to(torch.bfloat16)(ids).logits[0, len(prompt) - 1:-1].float()
        del hf
        got = _teacher_forced_logits(llm, prompt, ids[0, len(prompt):].tolist())
    err, hf_err = (got - ref).abs().max().item(), (hf_bf16 - ref).abs().max().item()
    print(f"[gpu] Llama-3-8B shapes bf16: ferrum max|logit err| {err:.3e}, HF bf16 {hf_err:.3e}")
    assert err <= 2 * hf_err, f"ferrum bf16 error {err:.3e} > 2x HF bf16's {hf_err:.3e}"
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert decided.any(), "no step had a margin above the error: the token check would be empty"
    assert torch.equal(got.argmax(-1)[decided], ref.argmax(-1)[decided])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_moe_expert_parallel_tp2_equals_tp1_fp32(tmp_path_factory):
    """--enable-expert-parallel on two GPUs (8 of 16 experts per rank, Triton MoE kernels,
    CUDA graphs): greedy tokens equal TP=1's."""
    kw = dict(FAMILIES["qwen3_moe"])
    kw.pop("family")
    d = make_tiny_model(str(tmp_path_factory.mktemp("ep")), "qwen3_moe", layers=3, vocab=512,
                        inter=512, max_pos=1024, **kw)
    prompts = _prompts(8)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = []
    for tp, ep in ((1, False), (2, True)):
        with LLM(d, progress=False, dtype="float32", device="cuda", max_num_seqs=16, max_model_len=1024,
                 tensor_parallel_size=tp, enable_expert_parallel=ep) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert runs[1] == runs[0]


def test_prompt_logprobs_match_hf_async(tiny):
    """Prompt logprobs on CUDA, fp32, with async scheduling on (the CUDA default) and chunked
    prefill spreading a prompt over several steps, in a batch with plain requests."""
    prompts = _prompts(6)
    m = hf_model(tiny).to("cuda", torch.float32)
    sp = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=3, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(tiny, progress=False, dtype="float32", device="cuda", max_num_seqs=16, max_model_len=1024,
             max_num_batched_tokens=64) as llm:
        assert llm.engine.async_scheduling
        outs = llm.generate(prompts + prompts, [sp] * 6 + [plain] * 6, use_tqdm=False)
    worst = 0.0
    with torch.no_grad():
        for p, out in zip(prompts, outs[:6]):
            ref = m(torch.tensor([p], device="cuda")).logits[0].float().log_softmax(-1)[:-1].cpu()
            assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
            for i, entry in enumerate(out.prompt_logprobs[1:]):
                worst = max(worst, max(abs(v - ref[i, k].item()) for k, v in entry.items()))
                assert p[i + 1] in entry
    print(f"[gpu] {tiny.split('/')[-1]} fp32 prompt logprobs max|diff| vs HF = {worst:.3e}")
    assert worst < 1e-3
