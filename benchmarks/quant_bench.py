"""Quantized weights and KV cache on the H200 (issue 15): ferrum in each weight format against
ferrum bf16 and, when its JSON files are given, vLLM with the same format.

    python benchmarks/quant_bench.py latency throughput big --out $OUT [--vllm-dir DIR]

Dummy (random) weights of the real configs (benchmarks/configs), drawn directly in each packed
format (`--quantization` of dummy models), token-id prompts. The workloads are those of the vLLM
peer driver (../shared/peers/vllm_bench.py), so the figures compare one to one:
- latency: Llama-3-8B, batch 1, 128-token prompt; TTFT = best of 3 one-token requests, decode
  tok/s = 511 / (best of 3 times for 512 tokens - TTFT). Formats: bf16, fp8 (per-channel,
  W8A16 GEMV), awq and gptq (4-bit, group 128), gguf_q4_k.
- throughput: 1000 requests x (1000 in, 1000 out), ignore_eos, greedy, FP8 weights with the
  `--throughput-kv` KV cache dtype, and bf16 for the ratio.
- big: Llama-3-70B with FP8 weights on one GPU, batch 1, 128 in / 128 out.
- kernels: each batch-1 GEMV (bf16, fp8, 4-bit g128, GGUF Q4_K / Q6_K / Q8_0) on the four
  Llama-3-8B matrices, default tile shape and a small grid of others (GB/s of weight bytes read;
  the best shape per matrix is what `gemv_rows_config` should pick).
Each section writes `<out>/quant_<section>.json` with the keys `fp8_speedup_vs_bf16`,
`w4a16_speedup_vs_bf16` (AWQ), `gptq_speedup_vs_bf16`, `gguf_q4_k_speedup_vs_bf16` and, with
vLLM's files (`vllm_latency_<quant>_p128_tp1.json`, `vllm_throughput_<quant>_p128_tp1.json`),
`*_vs_vllm`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from ferrum.benchmarks.common import (dummy_llm as make_llm, random_prompts, release_llm as free,  # noqa: E402
                                      run_sections, save_section as save)
from ferrum.benchmarks.mbu import (engine_bytes_per_step, mbu_columns, measure_roofline_gbs,  # noqa: E402
                                   spec_bandwidth_gbs)

FORMATS = {"bf16": None, "fp8": "fp8", "awq": "awq", "gptq": "gptq", "gguf_q4_k": "gguf_q4_k"}
SPEEDUP_KEY = {"fp8": "fp8", "awq": "w4a16", "gptq": "gptq", "gguf_q4_k": "gguf_q4_k"}
VLLM_QUANT = {"bf16": "bf16", "fp8": "fp8", "awq": "awq"}  # formats vllm_bench.py runs


def _vllm(args, section: str, fmt: str) -> dict | None:
    path = os.path.join(args.vllm_dir, f"vllm_{section}_{VLLM_QUANT.get(fmt, '-')}_p128_tp1.json")
    if fmt not in VLLM_QUANT or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def batch1(llm, prompt_len: int, new_tokens: int) -> dict:
    """vllm_bench.py's latency measurement on ferrum's LLM.generate."""
    from ferrum import SamplingParams
    import random
    rng = random.Random(2)
    p = [[rng.randrange(10, 128000) for _ in range(prompt_len)]]

    def run(n):
        t = time.perf_counter()
        llm.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    run(16), run(16)
    t1 = min(run(1) for _ in range(3))
    tn = min(run(new_tokens) for _ in range(3))
    tps = (new_tokens - 1) / (tn - t1)
    b = engine_bytes_per_step(llm.engine, prompt_len + new_tokens // 2)
    return {"ttft_ms": 1e3 * t1, "decode_tok_s": tps, f"e2e_{new_tokens}_s": tn,
            "bytes_per_step": b, **mbu_columns(b, 1 / tps, *_bandwidths())}


_BANDWIDTHS: list = []


def _bandwidths() -> tuple[float | None, float]:
    """(spec GB/s, measured GEMV roofline GB/s) of the GPU, measured once per process
    (`ferrum.benchmarks.mbu`)."""
    if not _BANDWIDTHS:
        _BANDWIDTHS.extend([spec_bandwidth_gbs("cuda")[0], measure_roofline_gbs("cuda")[0]])
    return tuple(_BANDWIDTHS)


def sec_latency(args):
    res = {"model": "llama3-8b", "input_len": 128, "output_len": 512, "batch": 1, "runs": {}}
    for fmt in args.formats:
        llm = make_llm("llama3-8b", 1, max_num_seqs=8, max_model_len=128 + 600, quantization=FORMATS[fmt])
        res["runs"][fmt] = batch1(llm, 128, 512)
        print(fmt, res["runs"][fmt], flush=True)
        free(llm)
    _ratios(args, res, "latency", "decode_tok_s")
    save(args, "quant_latency", res)


def sec_throughput(args):
    from ferrum import SamplingParams
    n, P, G = args.num_requests, 1000, 1000
    res = {"model": "llama3-8b", "requests": n, "input_len": P, "output_len": G, "runs": {}}
    for fmt in args.throughput_formats:
        kv = args.throughput_kv if fmt != "bf16" else "auto"
        llm = make_llm("llama3-8b", 1, max_num_seqs=256, max_model_len=P + G + 16, max_num_batched_tokens=8192,
                       quantization=FORMATS[fmt], kv_cache_dtype=kv)
        prompts = random_prompts(n, P, llm.engine.vocab_size, 3)
        llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=G, ignore_eos=True), use_tqdm=True)
        dt = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        st = llm.engine.status()
        res["runs"][fmt] = {"kv_cache_dtype": kv, "wall_s": dt, "output_tok_s": toks / dt,
                            "kv_blocks": st["kv_blocks_total"], "preemptions": st["num_preemptions"]}
        print(fmt, res["runs"][fmt], flush=True)
        free(llm)
    _ratios(args, res, "throughput", "output_tok_s")
    save(args, "quant_throughput", res)


def sec_big(args):
    llm = make_llm("llama3-70b", 1, max_num_seqs=8, max_model_len=128 + 256, quantization="fp8")
    res = {"model": "llama3-70b", "quantization": "fp8", "gpus": 1, "input_len": 128, "output_len": 128,
           "fp8_batch1": batch1(llm, 128, 128)}
    free(llm)
    save(args, "quant_big", res)


def _time_us(fn, iters: int = 200) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def sec_kernels(args):
    import torch
    from ferrum.ops import gemv
    from ferrum.ops import fp8, gguf, int4
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    grid = [(bn, bk, 4, st) for bn in (4, 8, 16) for bk in (256, 512, 1024) for st in (2, 4)]
    res = {"rows": 1, "matrices": {}}
    for name, (N, K) in shapes.items():
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        w8, s8 = fp8.quantize_fp8_per_channel(wb)
        q4 = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, device="cuda")
        sc = torch.full((N, K // 128), 0.004, dtype=torch.float16, device="cuda")
        zr = torch.full_like(sc, 8)
        gen = torch.Generator(device="cuda").manual_seed(0)
        raws = {}
        for qt in (gguf.Q4_K, gguf.Q6_K, gguf.Q8_0):
            qk, bpb = gguf.BLOCK[qt]
            raw = torch.randint(0, 256, (N, K // qk, bpb), dtype=torch.uint8, device="cuda", generator=gen)
            for at in {gguf.Q6_K: [208], gguf.Q4_K: [0, 2]}.get(qt, [0]):
                raw[:, :, at:at + 2] = torch.full((N, K // qk), 0.001, dtype=torch.float16,
                                                  device="cuda").view(torch.uint8).view(N, K // qk, 2)
            raws[qt] = raw.view(N, -1)
        row = {}

        def record(key, nbytes, fn_of_cfg, configs):
            times = {}
            for cfg in configs:
                try:
                    times[cfg] = _time_us(lambda: fn_of_cfg(cfg))
                except Exception as e:  # a shape that does not compile / fit
                    times[cfg] = float("inf")
                    print(key, cfg, type(e).__name__, str(e)[:200], flush=True)
            best = min(times, key=times.get)
            row[key] = {"default_us": times[configs[0]], "default_GBs": nbytes / times[configs[0]] / 1e3,
                        "best_us": times[best], "best_GBs": nbytes / times[best] / 1e3, "best_config": best}
            print(name, key, row[key], flush=True)

        record("bf16", N * K * 2, lambda c: gemv.gemv(x, wb, config=c), [gemv.gemv_config(N, K)] + grid)
        record("fp8", N * K, lambda c: fp8.fp8_gemv(x, w8, s8, config=c), [fp8.gemv_rows_config(N, K, 1)] + grid)
        record("int4_g128", N * K // 2 + sc.numel() * 4, lambda c: int4.int4_gemv(x, q4, sc, zr, 128, config=c),
               [fp8.gemv_rows_config(N, K, 1)] + grid)
        for qt, raw in raws.items():
            record(f"gguf_{qt}", raw.numel(), lambda c, r=raw, q=qt: gguf.gguf_gemv(x, r, q, block_n=c[0]),
                   [(8, 0, 0, 0), (2, 0, 0, 0), (4, 0, 0, 0), (16, 0, 0, 0)])
        res["matrices"][name] = row
    save(args, "quant_kernels", res)


def _ratios(args, res: dict, section: str, key: str) -> None:
    runs = res["runs"]
    for fmt, r in runs.items():
        if fmt != "bf16" and "bf16" in runs:
            res[f"{SPEEDUP_KEY[fmt]}_speedup_vs_bf16"] = r[key] / runs["bf16"][key]
        peer = _vllm(args, section, fmt)
        if peer is not None:
            name = "bf16" if fmt == "bf16" else SPEEDUP_KEY[fmt]
            res[f"{name}_vs_vllm"] = r[key] / peer[key]
            res.setdefault("vllm", {})[fmt] = peer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sections", nargs="+", choices=["latency", "throughput", "big", "kernels"])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--vllm-dir", default=os.environ.get("OUT", "bench_out"),
                   help="folder with vllm_bench.py's JSON files")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--throughput-formats", nargs="+", default=["bf16", "fp8"], choices=list(FORMATS))
    p.add_argument("--throughput-kv", default="fp8", choices=["auto", "fp8"],
                   help="KV cache dtype of the quantized throughput runs")
    p.add_argument("--num-requests", type=int, default=1000)
    args = p.parse_args()
    run_sections(args, globals(), lambda s, e: save(args, f"failed_quant_{s}", {"error": f"{type(e).__name__}: {e}"}))


if __name__ == "__main__":
    main()
