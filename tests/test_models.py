"""ferrum's model forward (through the executor contract and through LLM.generate) against
HF transformers on the same tiny random weights, fp32 on CPU.

Covered shapes: Llama with GQA (untied), Llama with a single KV head (MQA), tied embeddings
and llama3 rope scaling (original context 64, so prompts + decode run past it), Qwen2 (q/k/v
bias, tied), Qwen3 (q/k norm, explicit head_dim != hidden / heads). Each check prints the max
abs logits difference in its assertion message.

Issue 17 families: Mistral with a 24-token sliding window (prompts of 37 and 70 tokens run
past it, and chunked prefill crosses it), Mixtral (4 experts, top-2), Qwen2-MoE (shared
expert, no top-k renormalisation), Qwen3-MoE (8 experts, one dense layer among MoE layers),
Gemma 3 (local/global layers with different rope bases, q/k norm, GeGLU, 1 + w norms,
query_pre_attn_scalar, final logit soft-capping), Phi-3 (fused qkv / gate_up checkpoint
tensors, sliding window), YaRN and linear rope scaling; LongRoPE in its own test.
"""
from __future__ import annotations

import random

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.config import EngineConfig
from ferrum.executor.single import SingleDeviceExecutor
from ferrum.interfaces import DecodeInput, KvCacheHandle, PrefillInput
from ferrum.loader.resolve import resolve_model
from tiny_models import hf_model, make_tiny_model

ATOL = 1e-4
DECODE_STEPS = 20
BLOCK_SIZE = 16
NUM_BLOCKS = 64
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

MODELS = {
    "llama-gqa-untied": dict(family="llama", num_heads=4, num_kv_heads=2, tie=False, seed=1),
    "llama-mqa-tied-rope-llama3": dict(family="llama", num_heads=4, num_kv_heads=1, tie=True,
                                       rope_scaling=LLAMA3_ROPE, seed=2),
    "qwen2-gqa-tied": dict(family="qwen2", num_heads=4, num_kv_heads=2, tie=True, seed=3),
    "qwen3-gqa-headdim32": dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=32,
                                tie=False, seed=4),
    "mistral-swa24": dict(family="mistral", sliding_window=24, seed=5),
    "mixtral-e4-top2": dict(family="mixtral", num_local_experts=4, num_experts_per_tok=2, seed=6),
    "qwen2moe-shared-expert": dict(family="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                   tie=True, seed=7),
    "qwen3moe-e8-dense-layer": dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True, layers=3,
                                    mlp_only_layers=[1], head_dim=32, seed=8),
    "gemma3-local-global": dict(family="gemma3", layers=4, num_kv_heads=1, head_dim=32, tie=True,
                                layer_types=["sliding_attention", "sliding_attention",
                                             "full_attention", "sliding_attention"],
                                sliding_window=20, query_pre_attn_scalar=24,
                                rope_local_base_freq=500.0, final_logit_softcapping=30.0, seed=9),
    "phi3-fused-swa32": dict(family="phi3", sliding_window=32, seed=10),
    "llama-yarn4": dict(family="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64}, seed=11),
    "qwen2-linear2": dict(family="qwen2", rope_scaling={"rope_type": "linear", "factor": 2.0}, seed=12),
    # Llama's attention_bias also biases o_proj, and mlp_bias gate/up/down: both were dropped
    "llama-attn-mlp-bias": dict(family="llama", attention_bias=True, mlp_bias=True, seed=13),
    "qwen3-attn-bias": dict(family="qwen3", attention_bias=True, seed=14),
}

# Mixed prompt lengths: under one block, several blocks, and one past the llama3 original
# context (64) so that scaled low frequencies matter.
PROMPT_LENS = [37, 5, 70]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory):
    """(name, folder, HF model) for each tiny model."""
    name = request.param
    kw = dict(MODELS[name])
    folder = make_tiny_model(str(tmp_path_factory.mktemp(name) / "model"), kw.pop("family"), **kw)
    hf = hf_model(folder)
    hf.generation_config.eos_token_id = None   # never stop early: compare all steps
    hf.generation_config.pad_token_id = 0
    if "rope_scaling" in kw:  # make sure the reference really applies the scaling
        assert hf.model.rotary_emb.rope_type == kw["rope_scaling"]["rope_type"]
    return name, folder, hf


def _prompts(seed: int, vocab: int = 128) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in PROMPT_LENS]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _run_executor(ex, prompts: list[list[int]], steps: int, chunk: int | None, seed: int,
                  vocab: int = 128):
    """Prefill every prompt (whole, or in chunks of `chunk` tokens, all sequences in each
    call), then `steps` batched greedy decode steps. Blocks are taken from a shuffled pool so
    block tables are non-contiguous. Returns (logits [B, steps+1, V], tokens per sequence)."""
    pool = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(pool)
    handles = []
    for i, p in enumerate(prompts):
        nblk = -(-(len(p) + steps) // BLOCK_SIZE)
        handles.append(KvCacheHandle(f"s{i}", [pool.pop() for _ in range(nblk)], 0, BLOCK_SIZE))
    last = [None] * len(prompts)
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        idx = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        chunks = []
        for i in idx:
            n = len(prompts[i]) - done[i] if chunk is None else min(chunk, len(prompts[i]) - done[i])
            chunks.append(prompts[i][done[i]:done[i] + n])
            done[i] += n
        out = ex.prefill(PrefillInput(chunks, [handles[i] for i in idx]))
        assert out.logits.shape == (len(idx), vocab) and out.logits.dtype == torch.float32
        for j, i in enumerate(idx):
            last[i] = out.logits[j]
    rows = [[l] for l in last]
    toks = [[int(l.argmax())] for l in last]
    for _ in range(steps):
        out = ex.decode(DecodeInput([t[-1] for t in toks], handles))
        assert out.logits.shape == (len(prompts), vocab)
        for i in range(len(prompts)):
            rows[i].append(out.logits[i])
            toks[i].append(int(out.logits[i].argmax()))
    for h in handles:
        ex.release_cache(h.cache_id)
    return torch.stack([torch.stack(r) for r in rows]), toks


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole-prefill", "chunked-prefill-16"])
def test_executor_prefill_and_decode_match_hf(tiny, chunk):
    """Prefill logits and 20 greedy decode steps through SingleDeviceExecutor, batched over
    three prompts of mixed lengths, against HF forward over prompt + generated tokens."""
    name, folder, hf = tiny
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu", max_model_len=256,
                                   num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    ex = SingleDeviceExecutor(resolve_model(folder), cfg, progress=False)
    prompts = _prompts(MODELS[name]["seed"])
    logits, toks = _run_executor(ex, prompts, DECODE_STEPS, chunk, seed=MODELS[name]["seed"])
    assert ex.status().running_sequences == 0
    worst = 0.0
    for i, p in enumerate(prompts):
        full = p + toks[i][:DECODE_STEPS]   # the last sampled token is never fed back
        ref = _hf_logits(hf, full)[len(p) - 1:]
        assert ref.shape == logits[i].shape
        diff = (logits[i] - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < ATOL, f"{name} chunk={chunk} prompt {i} (len {len(p)}): max abs diff {diff:.3e}"
        assert toks[i] == ref.argmax(-1).tolist(), f"{name} prompt {i}: greedy tokens differ from HF"
    print(f"{name} chunk={chunk}: max abs logits diff vs HF = {worst:.3e}")


def test_keep_rows_equal_the_full_forwards_rows(tiny):
    """The model's keep_rows (each chunk's last row: the last layer attends and runs o_proj /
    MLP only for them, as every prefill without prompt logprobs does) gives those rows of the
    full forward and writes the same K/V into the cache: three prompts in one prefill, the
    second with cached context."""
    from ferrum.executor.model_inputs import prepare_prefill
    from ferrum.forward_context import forward_context
    name, folder, _ = tiny
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu", max_model_len=256,
                                   num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner = SingleDeviceExecutor(resolve_model(folder), cfg, progress=False).runner
    prompts = _prompts(MODELS[name]["seed"])
    cached = 3   # the second prompt's first tokens (of 5), prefilled by an earlier step

    def prefill(chunks, handles, keep=None):
        ids, pos, meta, cu = prepare_prefill(chunks, handles, BLOCK_SIZE, runner.device)
        with torch.inference_mode(), forward_context(meta, runner.attn_backend):
            return runner.model(ids, pos, cu[1:] - 1 if keep else None), cu

    rows, caches = [], []
    for keep in (False, True):
        for layer in runner.attn_layers:
            layer.kv_cache.fill_(float("nan"))   # unwritten slots must stay unread
        handles, start = [], 0
        for i, p in enumerate(prompts):
            nblk = -(-len(p) // BLOCK_SIZE)
            handles.append(KvCacheHandle(f"s{i}", list(range(start, start + nblk)), 0, BLOCK_SIZE))
            start += nblk
        prefill([prompts[1][:cached]], [handles[1]])
        handles[1] = KvCacheHandle("s1", handles[1].block_table, cached, BLOCK_SIZE)
        hidden, cu = prefill([prompts[0], prompts[1][cached:], prompts[2]], handles, keep)
        rows.append(hidden)
        caches.append([layer.kv_cache[:, :start].clone() for layer in runner.attn_layers])
    assert rows[1].shape == (3, rows[0].shape[1])
    diff = (rows[1] - rows[0][cu[1:] - 1]).abs().max().item()
    assert diff < 1e-5, f"{name}: kept rows differ from the full forward's by {diff:.3e}"
    for a, b in zip(*caches):
        # (NaN past each prompt's end in its last block: compared as equal)
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True), f"{name}: keep_rows changed the K/V"


def test_llm_generate_matches_hf_generate(tiny):
    """LLM.generate greedy token ids == HF generate (greedy, no EOS stop), 20 new tokens."""
    name, folder, hf = tiny
    prompts = _prompts(MODELS[name]["seed"] + 100)
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=DECODE_STEPS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        want = ref.sequences[0, len(p):].tolist()
        if got != want:
            k = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            top2 = ref.logits[k][0].topk(2).values
            pytest.fail(f"{name} prompt len {len(p)}: token {k} differs: ferrum {got} vs HF {want} "
                        f"(HF top-2 logit gap at that step {float(top2[0] - top2[1]):.2e})")
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("max_model_len,lens", [(64, [20, 33]), (256, [70, 90])],
                         ids=["short-factors", "long-factors"])
def test_phi3_longrope_matches_hf(tmp_path_factory, max_model_len, lens):
    """Phi-3 LongRoPE: ferrum picks one factor set for the run (long when max_model_len exceeds
    the original 64-token context, as vLLM does); HF picks per forward call by the longest
    position. They agree when every sequence stays on one side of 64 for the whole run."""
    rs = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
          "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0]}
    folder = make_tiny_model(str(tmp_path_factory.mktemp("phi3-longrope") / "m"), "phi3",
                             rope_scaling=rs, original_max_position_embeddings=64, seed=13)
    hf = hf_model(folder)
    assert hf.model.rotary_emb.rope_type == "longrope"
    rng = random.Random(13)
    prompts = [[rng.randrange(2, 128) for _ in range(n)] for n in lens]
    steps = 64 - max(lens) - 1 if max_model_len == 64 else DECODE_STEPS
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu",
                                   max_model_len=max_model_len, num_kv_blocks=NUM_BLOCKS,
                                   block_size=BLOCK_SIZE)
    ex = SingleDeviceExecutor(resolve_model(folder), cfg, progress=False)
    logits, toks = _run_executor(ex, prompts, steps, None, seed=13)
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf, p + toks[i][:steps])[len(p) - 1:]
        diff = (logits[i] - ref).abs().max().item()
        assert diff < ATOL, f"max_model_len={max_model_len} prompt {len(p)}: max abs diff {diff:.3e}"
        assert toks[i] == ref.argmax(-1).tolist()


def test_rope_tables_have_one_row_per_usable_position(tmp_path):
    """The RoPE cos/sin tables have max_model_len rows, not max_position_embeddings: a config
    that claims 10**12 positions (the table was 10**12 rows: an 8 TB allocation) loads at
    max_model_len 96 and gives exactly the logits of the same (dummy, seeded) weights under a
    512-position config."""
    import json
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
          "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 1}
    prompts = _prompts(15)[:2]   # 37 and 5 tokens, + 20 decode steps
    runs = []
    for max_pos in (512, 10**12):
        path = tmp_path / f"{max_pos}.json"
        path.write_text(json.dumps({**hf, "max_position_embeddings": max_pos}))
        cfg = EngineConfig.from_kwargs(model=f"dummy:{path}", dtype="float32", device="cpu",
                                       max_model_len=96, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        ex = SingleDeviceExecutor(resolve_model(cfg.model), cfg, progress=False)
        assert ex.runner.model.model.layers[0].self_attn.rotary_emb.cos.shape == (96, 8)
        runs.append(_run_executor(ex, prompts, DECODE_STEPS, None, seed=15))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


@pytest.mark.parametrize("rope_scaling", [
    LLAMA3_ROPE, {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "original_max_position_embeddings": 64},   # factor: 4096 / 64
    {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0] * 8,
     "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0]}], ids=lambda rs: rs["rope_type"])
def test_rope_tables_for_max_model_len_keep_the_scaling_of_the_config(rope_scaling):
    """A table sized to max_model_len is the first rows of the max_position_embeddings one:
    the scalings still read the config's values (YaRN's factor from max_position_embeddings,
    LongRoPE's attention factor), not max_model_len."""
    from ferrum.layers.rotary_embedding import RotaryEmbedding
    full = RotaryEmbedding(16, 4096, 10000.0, rope_scaling)
    short = RotaryEmbedding(16, 4096, 10000.0, rope_scaling, max_model_len=100)
    assert short.cos.shape == short.sin.shape == (100, 8)
    assert torch.equal(short.cos, full.cos[:100]) and torch.equal(short.sin, full.sin[:100])


def test_gemma3_rope_scaling_stays_off_local_layers_of_the_same_base(tmp_path):
    """Gemma 3 with rope_scaling (linear, as its 4B-27B configs) and one RoPE base for local and
    global layers: the local layers shared the global table, scaling and all, so the logits were
    off by ~4 from HF's; the scaling applies to the global layers only."""
    folder = make_tiny_model(str(tmp_path / "m"), "gemma3", layers=2, num_kv_heads=1, head_dim=32,
                             tie=True, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=20, rope_scaling={"rope_type": "linear", "factor": 8.0},
                             rope_local_base_freq=10000.0, seed=16)
    hf = hf_model(folder)
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu", max_model_len=128,
                                   num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    ex = SingleDeviceExecutor(resolve_model(folder), cfg, progress=False)
    prompts = _prompts(16)[:2]
    logits, toks = _run_executor(ex, prompts, 4, None, seed=16)
    for i, p in enumerate(prompts):
        diff = (logits[i] - _hf_logits(hf, p + toks[i][:4])[len(p) - 1:]).abs().max().item()
        assert diff < ATOL, f"prompt {len(p)}: max abs diff {diff:.3e}"
