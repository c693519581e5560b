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
- kernels: each 1-8 row GEMV (bf16, fp8, 4-bit g128, GGUF Q4_K / Q6_K / Q8_0; at one row also
  the Gluon GEMVs gbf16 / gfp8 / gw4 / gq4_k of ferrum/ops/gemv_gluon.py; gq4_k's time
  includes its x's `q8_1` launch, gw4's x carries its int16 copy as the producers attach it) on the four Llama-3-8B
  matrices (and the LM head, bf16 kernels only) at 1 and 4 rows, every candidate config (GB/s
  of weight bytes read, CUDA graphs over weight copies larger than L2); prints the best configs
  as the dict literals `W4_GEMV_CONFIGS` / `GGUF_GEMV_CONFIGS` / `GLUON_GEMV_CONFIGS` (Gluon
  where it beat the kind's best Triton config, else None) that paste_gemv_configs.py writes.
  `--grid full` times ~160 configs instead of ~60 (several minutes); `kernels --small` runs on
  CPU under TRITON_INTERPRET=1 (crash check).
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
VLLM_QUANT = {"bf16": "bf16", "fp8": "fp8", "awq": "awq", "gguf_q4_k": "gguf_q4_k"}  # vllm_bench.py; gguf: vllm_gguf_peer.py


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


LLAMA3_8B_MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                      "lm_head": (128256, 4096)}  # the LM head: bf16 kernels only
SMALL_MATRICES = {"qkv": (48, 512), "down": (16, 1024)}  # --small: the interpreter smoke run
OLD_W4_GBS = 770.0  # the int4 GEMV before the per-group factoring: 161 tok/s, 0.77 TB/s (issue 15)
GLUON_BASE = {"gbf16": "bf16", "gfp8": "fp8", "gw4": "w4", "gq4_k": "gguf_12"}  # Gluon kernel -> Triton twin
MAX_REL_ERR = 1e-2  # bf16 output: tests/test_quant_kernels.py's bound; a config above it is excluded
L2_FLUSH_BYTES = 256 * 2**20  # > 4x the H200's L2: each timed call reads its weights from HBM


def _kernel_candidates(grid: str, M: int, N: int, K: int) -> dict[str, list[tuple]]:
    """Configs timed per kernel (the first is the current default). Tuples as each kernel's
    `config` argument: bf16 / fp8 (BLOCK_N, BLOCK_K, warps, stages); w4 (BLOCK_N, BLOCK_K,
    warps, stages, SPLIT_K); gguf (BLOCK_N, warps, stages[, MAGIC]). grid: small (the interpreter smoke
    run), default (~60 compiles, fits gpu_run.sh's quantkern limit) or full (~200)."""
    from ferrum.ops import fp8, gemv, gguf, int4
    qtypes = (gguf.Q4_K, gguf.Q6_K, gguf.Q8_0)
    if grid == "small":
        return {"bf16": [(4, 128, 4, 1)] if M == 1 else [], "fp8": [(4, 128, 4, 1)],
                "w4": [int4.int4_gemv_config(N, K, M, 128, False), (8, 128, 4, 1, 2), (4, 1024, 4, 1, 1)],
                **{f"gguf_{q}": [gguf.gguf_gemv_config(q, N, K, M), (4, 4, 1), (4, 4, 1, 0)] for q in qtypes}}
    few_rows = N <= 4096  # few programs without split-K
    if grid == "full":
        splits = (2, 4, 8) if few_rows else (2,)
        if M == 1:
            w4 = [(bn, bk, w, 3, 1) for bn in (4, 8, 16, 32) for bk in (128, 256, 512) for w in (4, 8)]
            w4 += [(bn, bk, 4, st, 1) for bn in (8, 16) for bk in (128, 256) for st in (2, 4)]
            w4 += [(bn, bk, 4, 3, sp) for bn in (8, 16, 32) for bk in (128, 256) for sp in splits]
            gg = [(bn, w, 2) for bn in (2, 4, 8, 16) for w in (2, 4, 8)] + [(bn, 4, 3) for bn in (4, 8, 16)]
            dense = [(bn, bk, 4, 3) for bn in (4, 8, 16) for bk in (256, 512, 1024)]
        else:
            w4 = [(bn, bk, w, 3, 1) for bn in (4, 8, 16) for bk in (64, 128, 256) for w in (4, 8)]
            w4 += [(bn, 128, 4, 3, sp) for bn in (8, 16) for sp in splits]
            gg = [(bn, w, 2) for bn in (2, 4, 8) for w in (4, 8)]
            dense = [(bn, bk, 4, 3) for bn in (8, 16) for bk in (64, 128)]
    elif M == 1:
        # 4-bit: wide tiles and few warps give each thread more rows for the same x values; at
        # most 128 nibbles per thread and tile (BLOCK_N * BLOCK_K <= 4096 warps: more spills)
        w4 = [(bn, bk, 4, 3, 1) for bn, bk in ((8, 256), (8, 512), (8, 1024), (16, 256), (16, 512), (16, 1024),
                                                (32, 256), (32, 512))]
        w4 += [(32, 1024, 8, 3, 1), (8, 1024, 2, 3, 1), (16, 512, 2, 3, 1)]
        w4 += [(bn, bk, 4, 3, 2) for bn, bk in ((16, 512), (16, 1024), (32, 512)) if few_rows]
        # GGUF: the I2F variant (4th element 0) against the 2^23 mantissa trick at two tiles
        gg = [(8, 4, 2), (16, 1, 2), (16, 2, 2), (16, 4, 2), (32, 2, 2), (32, 4, 2), (8, 4, 2, 0), (16, 2, 2, 0)]
        dense = [(8, 512, 4, 3), (16, 256, 4, 4)]
    else:
        w4 = [(bn, bk, 4, 3, 1) for bn in (8, 16) for bk in (128, 256, 512)]
        w4 += [(16, 256, 4, 3, sp) for sp in ((2, 4) if few_rows else ())]
        gg = [(4, 4, 2), (8, 4, 2), (4, 4, 2, 0)]
        dense = [(16, 128, 4, 3)]
    # FP8 weights are half the bytes of bf16: the same bytes per tile need twice the BLOCK_K
    fp8_wide = ([(bn, 1024, w, 3) for bn in (4, 8, 16) for w in (4, 8)] if M == 1 else
                [(8, 256, 4, 3), (16, 256, 4, 3)])
    cands = {"bf16": [gemv.gemv_config(N, K)] + dense if M == 1 else [],
             "fp8": [fp8.fp8_gemv_config(N, K, M)] + dense + fp8_wide,
             "w4": [int4.int4_gemv_config(N, K, M, 128, False)] + w4}
    # the Gluon GEMVs (BLOCK_N, num_warps, SPLIT_K), each against its kind's Triton best; bf16 at one
    # row only (cuBLAS takes more), 2+ rows with BLOCK_N at most its no-spill default
    from ferrum.ops import gemv_gluon
    grids = ((("bf16", (2, 4, 8), (2, 4, 8)), ("fp8", (2, 4, 8), (2, 4, 8)), ("w4", (4, 8, 16), (1, 2, 4)),
              ("q4_k", (2, 4, 8), (1, 2))) if M == 1 else
             (("fp8", (1, 2), (1, 2, 4)), ("w4", (1, 2, 4), (1, 2, 4)), ("q4_k", (1, 2, 4), (1, 2))))
    for kind, bns, warps in grids:
        cfgs = [gemv_gluon.default_config(kind, N, K, M)]
        cfgs += [(bn, w, sp) for bn in bns for w in warps for sp in (1, 2)]
        cands["g" + kind] = [c for c in cfgs if c is not None and gemv_gluon.fits(kind, N, K, c)]
    for q in qtypes:
        cands[f"gguf_{q}"] = [gguf.gguf_gemv_config(q, N, K, M)] + gg
    if grid == "gluon":  # the Gluon grids against each Triton GEMV's current config only
        cands = {k: v if k in GLUON_BASE else v[:1] for k, v in cands.items()}
    return {k: list(dict.fromkeys(v)) for k, v in cands.items()}


def _timer(device: str, copies: int):
    """fn(i) over weight copy i -> microseconds per call: CUDA graph of every copy's call,
    best of 5 replays (no launch gaps, weights from HBM); on CPU (the interpreter) one call's
    wall time."""
    def time_us(fn) -> float:
        if device == "cuda":
            from ferrum.benchmarks.mbu import cuda_graph_time_ms
            return 1e3 * cuda_graph_time_ms(lambda: [fn(i) for i in range(copies)], iters=2) / copies
        t = time.perf_counter()
        fn(0)
        return 1e6 * (time.perf_counter() - t)
    return time_us


def _kernel_inputs(N: int, K: int, copies: int, device: str, gen):
    """Random weights of one [N, K] matrix in every timed format, `copies` of each, and the
    float32 dequantized reference of copy 0 per format."""
    import torch
    from ferrum.ops import fp8, gguf, int4
    w = {}
    w["bf16"] = [torch.randn(N, K, device=device, generator=gen).bfloat16() * 0.02 for _ in range(copies)]
    w["fp8"] = [fp8.quantize_fp8_per_channel(t) for t in w["bf16"]]
    w["w4"] = [(torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, device=device, generator=gen),
                (torch.rand(N, K // 128, device=device, generator=gen) * 0.004 + 0.001).half(),
                torch.randint(0, 16, (N, K // 128), device=device, generator=gen).half()) for _ in range(copies)]
    for q in (gguf.Q4_K, gguf.Q6_K, gguf.Q8_0):
        qk, bpb = gguf.BLOCK[q]
        raws = []
        for _ in range(copies):
            raw = torch.randint(0, 256, (N, K // qk, bpb), dtype=torch.uint8, device=device, generator=gen)
            for at in {gguf.Q6_K: [208], gguf.Q4_K: [0, 2]}.get(q, [0]):
                d = (torch.rand(N, K // qk, device=device, generator=gen) * 0.002 + 0.0005).half()
                raw[:, :, at:at + 2] = d.view(torch.uint8).view(N, K // qk, 2)
            raws.append(raw.view(N, -1))
        w[f"gguf_{q}"] = raws
    ref = {"bf16": w["bf16"][0].float(), "fp8": fp8.dequantize_fp8(*w["fp8"][0]),
           "w4": int4.dequantize_int4(*w["w4"][0], 128)}
    for q in (gguf.Q4_K, gguf.Q6_K, gguf.Q8_0):
        ref[f"gguf_{q}"] = gguf.gguf_dequantize_triton(w[f"gguf_{q}"][0], q, K, torch.float32)
    nbytes = {"bf16": N * K * 2, "fp8": N * K + N * 4, "w4": N * K // 2 + 2 * N * (K // 128) * 2,
              **{f"gguf_{q}": w[f"gguf_{q}"][0].numel() for q in (gguf.Q4_K, gguf.Q6_K, gguf.Q8_0)}}
    return w, ref, nbytes


def sec_kernels(args):
    """Every candidate config of each 1-8 row GEMV (bf16 reference, FP8, the 4-bit W4A16 GEMV
    with group 128, GGUF Q4_K / Q6_K / Q8_0) on the Llama-3-8B matrices at 1 and 4 rows: GB/s
    of weight bytes, max relative error of the default and best config against the
    dequantized weight (a config above `MAX_REL_ERR` is excluded), and the best config per
    matrix printed as the dict literals `W4_GEMV_CONFIGS` (ferrum/ops/int4.py) and
    `GGUF_GEMV_CONFIGS` (ferrum/ops/gguf.py).
    Then, at `--gemm-rows`, the GGUF dequant-in-tile GEMM against dequantize + cuBLAS.
    `--small`: tiny matrices and three configs, for a crash check under TRITON_INTERPRET=1."""
    import torch
    from ferrum.ops import fp8, gemv, gguf, int4
    if os.environ.get("TRITON_INTERPRET") == "1":  # the tests' fixes to Triton 3.6's interpreter
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from test_triton_kernels import _shim_interpreter
        _shim_interpreter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    matrices = SMALL_MATRICES if args.small else LLAMA3_8B_MATRICES
    gen = torch.Generator(device=device).manual_seed(0)
    res = {"old_w4_GBs": OLD_W4_GBS, "matrices": {}}
    best_fp8, best_w4, best_gguf, best_gluon = {}, {}, {}, {}
    from ferrum.ops import act_quant, gemv_gluon
    call = {"bf16": lambda x, w, c: gemv.gemv(x, w, config=c),
            "fp8": lambda x, w, c: fp8.fp8_gemv(x, *w, config=c),
            "w4": lambda x, w, c: int4.int4_gemv(x, *w, 128, config=c),
            "gbf16": lambda x, w, c: gemv_gluon.dense_gemv(x, w, config=c),
            "gfp8": lambda x, w, c: gemv_gluon.dense_gemv(x, *w, config=c),
            "gw4": lambda x, w, c: gemv_gluon.w4_gemv(x, *w, 128, config=c),
            "gq4_k": lambda x, w, c: gemv_gluon.q4k_gemv(x, w, config=c)}
    for q in (gguf.Q4_K, gguf.Q6_K, gguf.Q8_0):
        call[f"gguf_{q}"] = lambda x, w, c, q=q: gguf.gguf_gemv(x, w, q, config=c)
    for name, (N, K) in matrices.items():
        if args.matrices and name not in args.matrices:
            continue
        copies = 1 if device == "cpu" else max(1, -(-L2_FLUSH_BYTES // (N * K // 2)))
        weights, refs, nbytes = _kernel_inputs(N, K, copies, device, gen)
        for M in args.rows:
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            if M <= act_quant.MAX_ROWS and device == "cuda":  # gw4 reads x's int16 copy, as the producers attach it
                act_quant.attach(x, *gemv_gluon.q16(x))
            row = {}
            for kern, configs in _kernel_candidates("small" if args.small else args.grid, M, N, K).items():
                if args.kernels and kern not in args.kernels or not configs:
                    continue
                if name == "lm_head" and kern not in ("bf16", "gbf16"):  # the LM head stays bf16
                    continue
                base = GLUON_BASE.get(kern, kern)  # a Gluon kernel reads its Triton twin's weights
                ws = weights[base]
                times = {}
                for cfg in configs:
                    try:
                        times[cfg] = _timer(device, len(ws))(lambda i: call[kern](x, ws[i], cfg))
                    except Exception as e:  # a config that does not compile / fit
                        times[cfg] = float("inf")
                        print(name, M, kern, cfg, type(e).__name__, str(e)[:200], flush=True)
                ref = x.float() @ refs[base].t()
                errs = {c: ((call[kern](x, ws[0], c).float() - ref).abs().max() / ref.abs().max()).item()
                        for c, t in times.items() if t < float("inf")}
                for c, e in errs.items():  # a wrong config never becomes a table entry
                    if not e < MAX_REL_ERR:
                        print(name, M, kern, c, f"max rel err {e:.1e}: excluded", flush=True)
                        times[c] = float("inf")
                best = min(times, key=times.get)
                if times[best] == float("inf"):
                    row[kern] = {"error": "no config ran correctly"}
                    continue
                gbs = {c: nbytes[base] / t / 1e3 for c, t in times.items()}
                row[kern] = {"default_config": configs[0], "default_us": times[configs[0]],
                             "default_GBs": gbs[configs[0]], "best_config": best, "best_us": times[best],
                             "best_GBs": gbs[best], "max_rel_err": {str(c): e for c, e in errs.items()},
                             "all": {str(c): round(g, 1) for c, g in gbs.items()}}
                if kern == "fp8":
                    best_fp8[(N, K, M)] = best
                elif kern == "w4":
                    best_w4[(N, K, M)] = best
                    row[kern]["best_vs_old"] = gbs[best] / OLD_W4_GBS
                elif kern.startswith("gguf_"):
                    best_gguf[(int(kern[5:]), N, K, M)] = best
                print(f"{name} M={M} {kern}: default {configs[0]} {gbs[configs[0]]:.1f} GB/s, best {best} "
                      f"{gbs[best]:.1f} GB/s, max rel err {errs[best]:.1e}", flush=True)
            for kern, base in GLUON_BASE.items():  # each Gluon GEMV against its Triton twin's best
                if "best_us" in row.get(kern, {}) and "best_us" in row.get(base, {}):
                    faster = row[kern]["best_us"] < row[base]["best_us"]
                    best_gluon[(kern[1:], N, K, 1 if M == 1 else 4)] = row[kern]["best_config"] if faster else None
                    row[kern]["vs_triton"] = row[base]["best_us"] / row[kern]["best_us"]
            res["matrices"][f"{name}_m{M}"] = row
            save(args, "quant_kernels", res)  # after every matrix: a timeout keeps what was measured
        for M in [] if name == "lm_head" else [9] if args.small else args.gemm_rows:  # prefill: GGUF tiled GEMM vs dequant + cuBLAS
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            row = {}
            for q in (gguf.Q4_K, gguf.Q6_K):
                ws = weights[f"gguf_{q}"]
                tiled = _timer(device, len(ws))(lambda i: gguf.gguf_gemm(x, ws[i], q))
                dense = _timer(device, len(ws))(
                    lambda i: torch.nn.functional.linear(x, gguf.gguf_dequantize_triton(ws[i], q, K, x.dtype)))
                w4_us = _timer(device, len(weights["w4"]))(lambda i: int4.int4_gemm(x, *weights["w4"][i], 128))
                ref = x.float() @ refs[f"gguf_{q}"].t()
                err = ((gguf.gguf_gemm(x, ws[0], q).float() - ref).abs().max() / ref.abs().max()).item()
                row[f"gguf_{q}"] = {"gemm_us": tiled, "dequant_cublas_us": dense, "int4_gemm_us": w4_us,
                                    "gemm_max_rel_err": err}
                print(f"{name} M={M} gguf_{q}: dequant-in-tile GEMM {tiled:.1f} us, dequantize + cuBLAS "
                      f"{dense:.1f} us (int4 GEMM g128 {w4_us:.1f} us), max rel err {err:.1e}", flush=True)
            res["matrices"][f"{name}_gemm_m{M}"] = row
            save(args, "quant_kernels", res)
        weights = refs = None  # free this matrix's copies before the next one's are drawn
    res["FP8_GEMV_CONFIGS"] = {str(k): v for k, v in best_fp8.items()}
    res["W4_GEMV_CONFIGS"] = {str(k): v for k, v in best_w4.items()}
    res["GGUF_GEMV_CONFIGS"] = {str(k): v for k, v in best_gguf.items()}
    res["GLUON_GEMV_CONFIGS"] = {str(k): v for k, v in best_gluon.items()}
    save(args, "quant_kernels", res)
    print("# `python3 benchmarks/paste_gemv_configs.py <out>/quant_kernels.json` writes these tables:")
    print(f"FP8_GEMV_CONFIGS = {best_fp8!r}")
    print("# paste into ferrum/ops/int4.py:")
    print(f"W4_GEMV_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {best_w4!r}")
    print("# paste into ferrum/ops/gguf.py:")
    print(f"GGUF_GEMV_CONFIGS: dict[tuple[int, int, int, int], tuple[int, int, int]] = {best_gguf!r}")
    print("# paste into ferrum/ops/gemv_gluon.py (None: the Triton GEMV was faster):")
    print(f"GLUON_GEMV_CONFIGS = {best_gluon!r}")


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
    p.add_argument("--small", action="store_true",
                   help="kernels: tiny matrices and few configs (a crash check under TRITON_INTERPRET=1 on CPU)")
    p.add_argument("--grid", default="default", choices=["default", "full", "gluon"],
                   help="kernels: candidate configs (full: ~200 compiles, several minutes; gluon: the "
                        "Gluon GEMVs' grids against each Triton GEMV's current config)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="kernels: activation rows M")
    p.add_argument("--gemm-rows", type=int, nargs="*", default=[64, 512],
                   help="kernels: prefill rows at which the GGUF GEMM is timed against dequantize + cuBLAS")
    p.add_argument("--kernels", nargs="+", default=None,
                   help="kernels: only these (bf16 fp8 w4 gguf_12 gguf_14 gguf_8; Gluon: gbf16 gfp8 gw4 "
                   "gq4_k)")
    p.add_argument("--matrices", nargs="+", default=None, choices=list(LLAMA3_8B_MATRICES),
                   help="kernels: only these matrices")
    args = p.parse_args()
    run_sections(args, globals(), lambda s, e: save(args, f"failed_quant_{s}", {"error": f"{type(e).__name__}: {e}"}))


if __name__ == "__main__":
    main()
