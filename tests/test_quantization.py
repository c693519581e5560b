"""Quantized checkpoints on CPU: every format loads, and the model it gives equals the same
model with the dequantized weights (logits to float32 rounding, greedy tokens identical), which
in turn matches HF transformers; TP=2 equals TP=1; unsupported formats and packings that do not
split over TP ranks are named errors.

The checkpoints are written by tests/quant_checkpoints.py from a tiny random fp32 model.
Each case prints the max relative weight error of its quantization (what the format loses) and
the max abs logit difference against the dequantized model (what ferrum adds: ~1e-6).
"""
from __future__ import annotations

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.config import EngineConfig, ParallelConfig
from ferrum.errors import TensorParallelError, UnsupportedModelError
from ferrum.executor.single import SingleDeviceExecutor
from ferrum.executor.tensor_parallel import TensorParallelExecutor
from ferrum.interfaces import DecodeInput, KvCacheHandle, PrefillInput
from ferrum.loader.safetensors import load_hf_folder
from quant_checkpoints import write_quantized
from tiny_models import hf_model, make_tiny_model

# hidden 128 and intermediate 256 so that group sizes 32, 64 and 128 all divide K
SHAPE = dict(num_heads=4, num_kv_heads=2, hidden=128, inter=256, layers=2, vocab=128)
CASES = {
    "fp8-per-tensor-static": dict(fmt="fp8"),
    "ct-fp8-channel": dict(fmt="ct", strategy="channel"),
    "ct-fp8-tensor": dict(fmt="ct", strategy="tensor"),
    "gptq-g32-asym-v1": dict(fmt="gptq", group=32),
    "gptq-g64-sym-actorder-v1": dict(fmt="gptq", group=64, sym=True, act_order=True),
    "gptq-g128-asym-actorder-v2": dict(fmt="gptq", group=128, act_order=True, version="gptq_v2"),
    "awq-g32": dict(fmt="awq", group=32),
    "awq-g128": dict(fmt="awq", group=128),
}
PROMPTS = [list(range(3, 40)), list(range(50, 61))]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qbase") / "model"), "llama", seed=7, **SHAPE)


@pytest.fixture(scope="module", params=list(CASES))
def quantized(request, base, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param) / "q")
    q, ref, err = write_quantized(base, folder, **CASES[request.param])
    return request.param, q, ref, err


def _run_executor(ex, steps=8, tokens=None):
    """Prefill two sequences then greedy-decode `steps` tokens (or feed `tokens` [steps][2],
    teacher forcing); returns all logits."""
    hs = [KvCacheHandle(str(i), [4 * i + j for j in range(4)], 0, 16) for i in range(len(PROMPTS))]
    out = [ex.prefill(PrefillInput(PROMPTS, hs)).logits]
    for i in range(steps):
        toks = out[-1].argmax(-1).tolist() if tokens is None else tokens[i]
        out.append(ex.decode(DecodeInput(toks, hs)).logits)
    return torch.cat(out)


def _logits(folder, tp=1, **kw):
    src = load_hf_folder(folder)
    cfg = EngineConfig(model=folder, parallel=ParallelConfig(tensor_parallel_size=tp), **kw)
    ex = (SingleDeviceExecutor if tp == 1 else TensorParallelExecutor)(src, cfg, progress=False)
    try:
        return _run_executor(ex)
    finally:
        ex.shutdown()


def test_quantized_model_equals_dequantized_model(quantized):
    name, q, ref, err = quantized
    got, want = _logits(q), _logits(ref)
    diff = (got - want).abs().max().item()
    print(f"{name}: weight rel err {err:.2e}, logits vs dequantized model {diff:.2e}")
    assert err < (0.07 if name.startswith(("fp8", "ct")) else 0.2), f"{name}: quantization error {err}"
    assert diff < 1e-5, f"{name}: max abs logit diff vs dequantized model {diff:.2e}"
    # the dequantized model itself against HF transformers (independent oracle)
    hf = hf_model(ref)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    d = (got[0] - hf_logits).abs().max().item()
    assert d < 1e-4, f"{name}: last prompt logits vs HF transformers {d:.2e}"
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    toks = {}
    for folder in (q, ref):
        with LLM(folder, progress=False, max_model_len=128) as llm:
            toks[folder] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert toks[q] == toks[ref]


def test_online_fp8_equals_per_channel_quantized_checkpoint(base, tmp_path):
    """--quantization fp8 on an fp32 checkpoint gives the same model as the checkpoint
    quantized per channel by compressed-tensors."""
    _, ref, _ = write_quantized(base, str(tmp_path / "ct"), "ct", strategy="channel")
    got, want = _logits(base, quantization="fp8"), _logits(ref)
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, f"online fp8 vs compressed-tensors per-channel: {diff:.2e}"


@pytest.mark.parametrize("case", ["fp8-per-tensor-static", "gptq-g64-sym-actorder-v1", "awq-g32", "online-fp8"])
def test_tp2_equals_tp1_quantized(case, base, tmp_path):
    if case == "online-fp8":
        folder, kw = base, dict(quantization="fp8")
    else:
        folder, kw = write_quantized(base, str(tmp_path / "q"), **CASES[case])[0], {}
    diff = (_logits(folder, 2, **kw) - _logits(folder, 1, **kw)).abs().max().item()
    assert diff < 1e-5, f"{case}: TP=2 vs TP=1 max abs logit diff {diff:.2e}"


def test_packing_that_does_not_split_is_named_error(base, tmp_path):
    """GPTQ group 128 at TP=2: o_proj's 128 input features give each rank 64, half a group."""
    q = write_quantized(base, str(tmp_path / "q"), "gptq", group=128)[0]
    with pytest.raises(TensorParallelError, match="o_proj.*quantization group"):
        _logits(q, 2)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq bits 8 is not"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16"),
    # values written as JSON strings: named as strings ("4-bit is not supported; supported: 4 bits")
    ({"quant_method": "gptq", "bits": "4", "group_size": 32}, "gptq bits '4' is not supported; supported: 4$"),
    ({"quant_method": "awq", "bits": 4, "group_size": "32"}, "awq group_size '32' is not"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise scales"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "compressed-tensors format.*pack-quantized"),
    ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]}, "leaving layer"),
])
def test_unsupported_quantization_is_named_error(qc, match):
    from ferrum.layers.quantization import get_quant_config
    with pytest.raises(UnsupportedModelError, match=match):
        get_quant_config(qc)
    with pytest.raises(UnsupportedModelError, match="--quantization 'awq' is not supported"):
        get_quant_config(None, "awq")  # 4-bit formats come from a checkpoint, except dummy weights


# ---------------------------------------------------------------- GGUF kept packed
def _tiny_gguf(path, o_type="Q5_K", seed=0):
    """A llama GGUF (hidden 256, so K-quant blocks of 256 fit) whose merged layers mix block
    types the way Q4_K_M files do: q/k Q4_K, v Q6_K, o `o_type`, gate Q4_0, up and down Q8_0
    (K = 128 is no whole K-quant block). K-quant blocks are random bytes with small scales."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize
    from test_gguf import hf_weights, llama_cpp_permute, write_gguf
    from test_quant_kernels import _gguf_raw
    w = hf_weights("llama", hidden=256, inter=128, heads=4, head_dim=64, kv_heads=2, seed=seed)
    g = torch.Generator().manual_seed(seed)
    over = {}
    for name, t in w.items():
        kind = name.split(".")[-2]
        qt = {"q_proj": QT.Q4_K, "k_proj": QT.Q4_K, "v_proj": QT.Q6_K, "o_proj": QT[o_type],
              "gate_proj": QT.Q4_0, "up_proj": QT.Q8_0, "down_proj": QT.Q8_0}.get(kind)
        if qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            over[name] = (_gguf_raw(int(qt), t.shape[0], t.shape[1], g).numpy(), qt)
        elif qt is not None:
            a = t.numpy().astype("float32")
            over[name] = (quantize(a, qt), qt)
    return write_gguf(path, weights=w, heads=4, kv_heads=2, head_dim=64, hidden=256, raw_override=over,
                      inter=128)


def test_gguf_blocks_kept_until_placed_equal_dense_loader(tmp_path, monkeypatch):
    """The GGUF method (raw blocks per sub-matrix, merged into segments, dequantized at the end
    on CPU) gives the same logits as the dense loader, at TP=1 and TP=2 (row-parallel ranks
    take whole blocks)."""
    path = _tiny_gguf(tmp_path / "m.gguf", o_type="Q8_0")
    from ferrum.loader.resolve import resolve_model
    src = resolve_model(path)

    def logits(tp=1):
        cfg = EngineConfig(model=path, parallel=ParallelConfig(tensor_parallel_size=tp))
        ex = (SingleDeviceExecutor if tp == 1 else TensorParallelExecutor)(src, cfg, progress=False)
        try:
            return _run_executor(ex)
        finally:
            ex.shutdown()

    packed, packed_tp2 = logits(), logits(2)
    import ferrum.executor.model_runner as mr
    monkeypatch.setattr(mr, "get_quant_config", lambda *a, **k: None)  # the dense loader
    dense = logits()
    assert (packed - dense).abs().max().item() < 1e-5
    # this file's N(0, 1) weights give logits of ~30: float32 summation order differs at TP=2
    rel = ((packed_tp2 - dense).abs().max() / dense.abs().max()).item()
    assert rel < 1e-4, f"TP=2 vs dense, max abs logit diff relative to the largest logit: {rel:.2e}"


def test_gguf_block_split_over_tp_is_named_error(tmp_path):
    """o_proj is Q5_K (256-element blocks): at TP=2 each rank would get 128 input features."""
    path = _tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(TensorParallelError, match="o_proj.*Q5_K blocks of 256"):
        _logits_gguf(path, 2)


def _logits_gguf(path, tp):
    from ferrum.loader.resolve import resolve_model
    cfg = EngineConfig(model=path, parallel=ParallelConfig(tensor_parallel_size=tp))
    TensorParallelExecutor(resolve_model(path), cfg, progress=False).shutdown()


# ---------------------------------------------------------------- FP8 KV cache
def test_fp8_kv_cache_logits_close_and_half_the_bytes(base, monkeypatch):
    """--kv-cache-dtype fp8 (e4m3, per-layer scale 1.0): equals an fp32 cache holding K/V
    rounded through e4m3 (the reference), and its logits stay within a stated bound of the fp32
    cache's (e4m3 keeps 3 mantissa bits: up to 6% per element); a quarter of fp32's KV bytes
    per token (half of bf16's), so a fixed KV budget holds 4x the blocks."""
    budget = 1 << 20

    def run(kv, tokens=None):
        src = load_hf_folder(base)
        cfg = EngineConfig(model=base)
        cfg.cache.kv_cache_dtype, cfg.cache.kv_cache_memory = kv, budget
        ex = SingleDeviceExecutor(src, cfg, progress=False)
        try:
            return _run_executor(ex, 12, tokens), ex.capabilities().memory, ex.num_blocks
        finally:
            ex.shutdown()

    ref, mem32, blocks32 = run("auto")
    fed = ref.argmax(-1).view(-1, 2).tolist()  # the fp32 run's greedy tokens, fed to both
    got, mem8, blocks8 = run("fp8", fed)
    assert mem8.kv_bytes_per_token * 4 == mem32.kv_bytes_per_token
    assert blocks8 == 4 * blocks32
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"fp8 KV vs fp32 KV: max abs logit diff {(got - ref).abs().max().item():.3e}, relative {rel:.2e}")
    assert 0 < rel < 0.1, f"fp8 KV logits relative difference {rel:.2e}"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"fp8 KV: greedy token agreement with fp32 KV {agree:.2%} of {got.shape[0]} steps")
    assert agree >= 0.9
    from ferrum.ops import attention_torch as tb
    write, prefill = tb.write_kv, tb.prefill_attention

    def rt(x):  # e4m3 round trip at scale 1
        return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float().to(x.dtype)

    monkeypatch.setattr(tb, "write_kv", lambda c, k, v, s, **kw: write(c, rt(k), rt(v), s))
    monkeypatch.setattr(tb, "prefill_attention", lambda q, c, md, sc, k, v, **kw: prefill(q, c, md, sc, rt(k), rt(v)))
    rounded = run("auto", fed)[0]
    d = (got - rounded).abs().max().item()
    assert d < 1e-5, f"fp8 KV vs fp32 KV holding e4m3-rounded values: {d:.2e}"


@pytest.mark.parametrize("names,fmt", [("vllm", "fp8"), ("kv", "fp8"), ("modelopt", "fp8"), ("ct", "ct")])
def test_checkpoint_kv_scales_load_into_fp8_kv_cache(base, tmp_path, monkeypatch, names, fmt):
    """An FP8 checkpoint's KV-cache scales (vLLM `self_attn.k_scale` / `v_scale`, the older
    `kv_scale`, ModelOpt `k_proj.k_scale`, compressed-tensors `k_proj.output_scale`) reach each
    layer's Attention buffers; with --kv-cache-dtype fp8 the cache stores K / V divided by them
    (the scales passed to write_kv) and the logits stay within the FP8 KV bound of an fp32
    cache; without an FP8 cache they change nothing."""
    scales = {0: (0.02, 0.015), 1: (0.025, 0.02)}  # |K|, |V| < 4 here: no e4m3 saturation (448)
    q, ref, _ = write_quantized(base, str(tmp_path / "q"), fmt, kv_scales=scales, kv_scale_names=names)
    want_scales = {i: (k, k if names == "kv" else v) for i, (k, v) in scales.items()}
    from ferrum.ops import attention_torch as tb
    seen = []
    write = tb.write_kv

    def spy(cache, k, v, slots, **kw):
        if kw:
            seen.append((kw["k_scale"].item(), kw["v_scale"].item()))
        return write(cache, k, v, slots, **kw)

    monkeypatch.setattr(tb, "write_kv", spy)

    def run(kv, tokens=None):
        cfg = EngineConfig(model=q)
        cfg.cache.kv_cache_dtype = kv
        ex = SingleDeviceExecutor(load_hf_folder(q), cfg, progress=False)
        try:
            got = [(a.k_scale.item(), a.v_scale.item()) for a in ex.runner.attn_layers]
            return _run_executor(ex, 4, tokens), got
        finally:
            ex.shutdown()

    def r6(pairs):
        return [(round(k, 6), round(v, 6)) for k, v in pairs]

    plain, loaded = run("auto")
    assert r6(loaded) == r6(want_scales[i] for i in range(2)) and not seen  # loaded, unused
    torch.testing.assert_close(plain, _logits(ref)[: plain.shape[0]], rtol=0, atol=1e-4)
    fp8, _ = run("fp8", plain.argmax(-1).view(-1, 2).tolist())  # the same tokens fed to both
    assert set(r6(seen)) == set(r6(want_scales.values()))  # every layer wrote with its own scales
    rel = ((fp8 - plain).abs().max() / plain.abs().max()).item()
    print(f"fp8 KV with checkpoint scales ({names}) vs fp32 KV: max rel logit diff {rel:.2e}")
    assert rel < 0.1


def test_kv_scale_that_is_not_per_tensor_is_named_error(base, tmp_path):
    from ferrum.errors import WeightLoadError
    from safetensors.torch import load_file, save_file
    q, _, _ = write_quantized(base, str(tmp_path / "q"), "fp8", kv_scales={0: (0.01, 0.01)})
    tensors = load_file(f"{q}/model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.full((2,), 0.01)
    save_file(tensors, f"{q}/model.safetensors")
    with pytest.raises(WeightLoadError, match="k_scale.*only per-tensor"):
        SingleDeviceExecutor(load_hf_folder(q), EngineConfig(model=q), progress=False)


def test_kv_cache_dtype_is_validated():
    from ferrum.config import resolve_kv_cache_dtype
    from ferrum.errors import InvalidRequestError
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype 'int8'"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


@pytest.mark.parametrize("quantization", ["fp8", "gptq", "awq", "gguf_q4_k", "gguf_q6_k"])
def test_dummy_weights_in_each_format_generate(base, quantization, tmp_path):
    """`dummy:` models with --quantization draw packed random weights of that format (the GPU
    benchmark's models) and run; parameter bytes per rank follow the format's bits."""
    import json
    import os
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=256, intermediate_size=512, head_dim=64)  # whole K-quant blocks
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with LLM(f"dummy:{tmp_path / 'config.json'}", progress=False, quantization=quantization,
             max_model_len=64) as llm:
        out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        mem = llm.engine.executor.capabilities().memory
    from ferrum.config import ModelConfig
    from ferrum.executor.memory import compute_memory_requirements
    full = compute_memory_requirements(ModelConfig.from_hf_dict(cfg), torch.float32, 1)
    assert mem.param_bytes < full.param_bytes


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_equals_transformers_on_the_same_checkpoint(base, tmp_path, strategy):
    """transformers reads the same compressed-tensors FP8 folder (its CompressedTensors
    quantizer, dequantize=True) as an independent loader: last-token logits agree."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    q = write_quantized(base, str(tmp_path / "ct"), "ct", strategy=strategy)[0]
    hf = AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    got = _logits(q)[0]
    d = (got - want).abs().max().item()
    assert d < 1e-4, f"compressed-tensors {strategy}: ferrum vs transformers {d:.2e}"
