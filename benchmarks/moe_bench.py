"""Mixture-of-experts speed on one GPU: a Qwen3-30B-A3B-shaped model (benchmarks/configs/
qwen3-30b-a3b.json: 48 layers, 128 experts of 768, top-8, dummy bf16 weights), side by side
with vLLM running the same workloads (benchmarks/vllm_moe_peer.py).

    python benchmarks/moe_bench.py kernels latency batch256 nanovllm --out $OUT

Sections (each writes <out>/moe_<section>.json):
- tune: the grouped GEMMs' tile configs timed per token count; the best per count as
  MOE_GEMM_CONFIGS for `python3 benchmarks/paste_gemv_configs.py <out>/moe_tune.json`.
- kernels: one MoE layer (`ferrum.ops.moe.fused_moe`, Triton) alone, T = 1 .. 4096 tokens, CUDA
  events; bytes = the distinct experts the T*8 (token, slot) pairs select, so GB/s compares
  with the batch-1 GEMV's read rate measured in the run (ferrum.benchmarks.mbu).
- latency: batch 1, 128-token prompt, the method of ../shared/peers/vllm_bench.py: TTFT = best
  of 3 one-token requests, decode tok/s = 511 / (time for 512 tokens - TTFT), best of 3. MBU
  counts the bytes a step reads: every weight except the input-embedding table but only the 8
  experts selected per layer (`ModelConfig.num_params(active=True)`), plus the KV cache.
- batch256: 256 prompts of 128 tokens: decode tok/s = 256 * 127 / (time for 128 new tokens -
  time for 1), best of 2. MBU counts the experts 256 tokens are expected to select per layer
  (E * (1 - (1 - k/E)^256), all 128 here).
- nanovllm: nano-vllm's bench.py workload (256 requests, input and output lengths U(100, 1024),
  temperature 0.6, ignore_eos) on this model.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from ferrum.benchmarks.common import (config_path as cfg_path, dummy_llm as make_llm,  # noqa: E402
                                      release_llm as free, run_sections, save_section as save)
from ferrum.benchmarks.mbu import measure_roofline_gbs, spec_bandwidth_gbs  # noqa: E402

MODEL = "qwen3-30b-a3b"
ROOFLINE = SPEC_BW = float("nan")   # bytes/s, set by main()
P_LAT = 128


def _cfg():
    import json
    from ferrum.config import ModelConfig
    with open(cfg_path(MODEL)) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def step_bytes(cfg, batch: int, ctx_tokens: int) -> float:
    """bf16 bytes one decode step reads: weights without the input embedding, with the experts
    `batch` tokens are expected to select per layer (uniform routing), plus the KV cache of
    ctx_tokens positions in all."""
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    distinct = E * (1 - (1 - k / E) ** batch)
    experts = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) * 3 * H * I
    dense = cfg.num_params(active=True) - cfg.vocab_size * H - experts * k
    kv = ctx_tokens * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    return 2 * (dense + experts * distinct + kv)


_ENGINE = None   # one engine serves latency, batch256 and nanovllm (vllm_moe_peer.py does the same)


def _engine():
    """The LLM the engine sections share: 256 sequences, 4096 positions, 16384-token steps."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = make_llm(MODEL, 1, max_num_seqs=256, max_model_len=4096, max_num_batched_tokens=16384)
    return _ENGINE


def _with_vllm(args, section: str, res: dict, key: str) -> dict:
    """res plus vLLM's figure `key` of the same section and `<key>_vs_vllm` (ferrum / vLLM),
    when vllm_moe_peer.py left its JSON in --vllm-dir."""
    import json
    path = os.path.join(args.vllm_dir or "", f"vllm_moe_{section}.json")
    if args.vllm_dir and os.path.exists(path):
        with open(path) as f:
            peer = json.load(f)
        res.update({f"vllm_{key}": peer[key], f"{key}_vs_vllm": res[key] / peer[key]})
    return res


def _generate_s(llm, prompts, max_tokens, temperature=0.0):
    from ferrum import SamplingParams
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t


def _layer(cfg):
    """(generator, w13 [E, 2I, H], w2 [E, H, I], router [E, H]): one MoE layer of random bf16
    weights on CUDA, seeded."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    router = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    return g, w13, w2, router


def sec_kernels(args):
    from ferrum.ops.moe import fused_moe, select_experts
    cfg = _cfg()
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    g, w13, w2, router = _layer(cfg)
    rows = []
    for T in (1, 8, 64, 256, 1024, 4096):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = select_experts(x @ router.T, k, True)
        distinct = ids.unique().numel()
        for _ in range(3):
            fused_moe(x, w13, w2, w, ids)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 50 if T <= 256 else 10
        start.record()
        for _ in range(n):
            fused_moe(x, w13, w2, w, ids)
        end.record()
        torch.cuda.synchronize()
        us = 1000 * start.elapsed_time(end) / n
        nbytes = distinct * 3 * H * I * 2
        rows.append({"tokens": T, "distinct_experts": distinct, "us": us,
                     "expert_GB_per_s": nbytes / us / 1e3, "frac_of_roofline": nbytes / (us * 1e-6) / ROOFLINE})
        print(rows[-1], flush=True)
    save(args, "moe_kernels", {"model": MODEL, "layer": {"experts": E, "top_k": k, "hidden": H, "inter": I},
                               "points": rows})


def tune_candidates() -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) configs `sec_tune` times."""
    return [(bm, bn, bk, w, st) for bm in (16, 32, 64, 128) for bn in (64, 128) for bk in (64, 128)
            for w in (4, 8) for st in (3, 4) if not (bm == 128 and bn == 128 and bk == 128)]


def sec_tune(args):
    """Every `tune_candidates` config of the grouped GEMMs (ferrum.ops.moe_triton.moe_grouped,
    both projections + align + activation, CUDA events, median of 10) at T = 2 .. 4096 tokens on
    this model's layer; prints and saves the best per T as MOE_GEMM_CONFIGS (keyed as
    `gemm_config` looks it up), for benchmarks/paste_gemv_configs.py."""
    from ferrum.ops.moe import select_experts
    from ferrum.ops import moe_triton as mt
    cfg = _cfg()
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    g, w13, w2, router = _layer(cfg)
    rows, table = [], {}
    for T in (2, 8, 32, 64, 128, 256, 512, 1024, 4096):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = select_experts(x @ router.T, k, True)
        ref = mt.moe_grouped(x, w13, w2, w, ids)
        default = mt.gemm_config(T * k, E)
        times = {}
        for c in [default] + [c for c in tune_candidates() if c != default]:
            try:
                out = mt.moe_grouped(x, w13, w2, w, ids, config=c)
                if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                    raise AssertionError("result differs from the default config's")
                ts = []
                for _ in range(12):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    mt.moe_grouped(x, w13, w2, w, ids, config=c)
                    b.record()
                    b.synchronize()
                    ts.append(1000 * a.elapsed_time(b))
                times[c] = sorted(ts[2:])[len(ts[2:]) // 2]
            except Exception as e:   # a config that does not compile / fit in shared memory
                print(T, c, type(e).__name__, str(e)[:120], flush=True)
        best = min(times, key=times.get)
        table[str((E, 2 * I, H, 1 << max(0, T * k - 1).bit_length()))] = list(best)
        rows.append({"tokens": T, "default": list(default), "default_us": times[default], "best": list(best),
                     "best_us": times[best], "speedup": times[default] / times[best]})
        print(rows[-1], flush=True)
        save(args, "moe_tune", {"model": MODEL, "points": rows, "MOE_GEMM_CONFIGS": table})


def sec_latency(args):
    cfg = _cfg()
    llm = _engine()
    rng = random.Random(2)
    p = [[rng.randrange(10, 128000) for _ in range(P_LAT)]]
    _generate_s(llm, p, 16)
    _generate_s(llm, p, 16)
    t1 = min(_generate_s(llm, p, 1) for _ in range(3))
    tn = min(_generate_s(llm, p, 512) for _ in range(3))
    tps = 511 / (tn - t1)
    b = step_bytes(cfg, 1, P_LAT + 256)
    res = {"model": MODEL, "prompt_len": P_LAT, "ttft_ms": 1e3 * t1, "decode_tok_s": tps, "e2e_512_s": tn,
           "bytes_per_step": b, "active_params": cfg.num_params(active=True),
           "mbu_vs_roofline": b * tps / ROOFLINE, "mbu": b * tps / SPEC_BW,
           "cuda_graphs": llm.engine.executor.capabilities().cuda_graphs}
    save(args, "moe_latency", _with_vllm(args, "latency", res, "decode_tok_s"))


def sec_batch256(args):
    cfg = _cfg()
    B, G = 256, 128
    llm = _engine()
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 128000) for _ in range(P_LAT)] for _ in range(B)]
    _generate_s(llm, prompts[:16], 8)
    t1 = min(_generate_s(llm, prompts, 1) for _ in range(2))
    tg = min(_generate_s(llm, prompts, G) for _ in range(2))
    tps = B * (G - 1) / (tg - t1)
    b = step_bytes(cfg, B, B * (P_LAT + G // 2))
    res = {"model": MODEL, "batch": B, "prompt_len": P_LAT, "new_tokens": G, "prefill_s": t1, "total_s": tg,
           "decode_tok_s": tps, "bytes_per_step": b, "mbu_vs_roofline": b * tps / B / ROOFLINE, "mbu": b * tps / B / SPEC_BW}
    save(args, "moe_batch256", _with_vllm(args, "batch256", res, "decode_tok_s"))


def sec_nanovllm(args):
    llm = _engine()
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    outs_len = [rng.randint(100, 1024) for _ in range(256)]
    from ferrum import SamplingParams
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in outs_len]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, sps, use_tqdm=True)
    dt = time.perf_counter() - t0
    res = {"model": MODEL, "requests": 256, "output_tokens": sum(outs_len), "wall_s": dt,
           "output_tok_s": sum(outs_len) / dt}
    save(args, "moe_nanovllm", _with_vllm(args, "nanovllm", res, "output_tok_s"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sections", nargs="+", choices=["kernels", "tune", "latency", "batch256", "nanovllm"])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--vllm-dir", default=None, help="folder of vllm_moe_<section>.json from "
                   "vllm_moe_peer.py run just before, on this machine: adds `*_vs_vllm` ratios")
    args = p.parse_args()
    # bytes/s of the headline MBU (the device's spec bandwidth) and of the roofline column (the
    # batch-1 GEMV's read rate measured in this run), as ferrum.benchmarks.mbu defines them
    global ROOFLINE, SPEC_BW
    ROOFLINE = measure_roofline_gbs("cuda")[0] * 1e9
    SPEC_BW = (spec_bandwidth_gbs("cuda")[0] or float("nan")) * 1e9
    run_sections(args, globals(), lambda s, e: save(args, f"moe_failed_{s}", {"error": f"{type(e).__name__}: {e}"}))
    if _ENGINE is not None:
        free(_ENGINE)


if __name__ == "__main__":
    main()
