"""python3 benchmarks/probe_small_gemm.py (GPU): the decode-step linears of a small model at 2-256
rows, where a step's GEMMs ran at ~310 TFLOP/s on an H100 (Qwen3-0.6B at 256 rows,
benchmarks/results/h100-2026-12-07): cuBLAS (`F.linear`, ferrum's default there) against
ferrum.ops.gemm_small's Triton kernel over a grid of tiles and split-K factors. N of 1,024-6,144 leaves a
128 x 128 tile grid with 16-96 CTAs for 132 SMs; smaller tiles and split-K fill the machine.

Weights rotate through copies totalling > 4x the 50 MB L2, so each call reads them from HBM as
a decode step does. Each (shape, rows, variant) is timed inside a CUDA graph, as the engine's
decode steps run it: one graph calls it once per weight copy, twice over, best of 5 replays,
divided by the calls. (Until 12-07 each call was timed alone between two CUDA events, which
counted the host's launch, ~40 us, into a 3-40 us kernel: every case measured 37-46 us and no
Triton variant could win.) TFLOP/s and the
weight read rate (GB/s) for each; max |diff| of every Triton variant against cuBLAS. PROBE_ROWS
(default "2 4 8 16 32 64 128 256") and PROBE_MODEL (qwen3-0.6b | llama3-8b) pick the cases.
Writes $OUT/probe_small_gemm.json and $OUT/small_gemm_table.json: the cases where the best
Triton variant took <= 97% of cuBLAS's time, the table the engine reads from
FERRUM_SMALL_GEMM_TABLE (ferrum/ops/gemm_small.py; the kernel's CPU test is check_gemv in
tests/test_triton_kernels.py)."""
from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ferrum.benchmarks.mbu import cuda_graph_time_ms  # noqa: E402
from ferrum.ops import gemm_small  # noqa: E402

MODELS = {   # name: (N, K) of each decode-step linear (LM head last)
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)},
}
TILES = [(16, 32, 128), (16, 64, 128), (32, 64, 128), (64, 64, 64), (32, 128, 64), (64, 128, 64), (16, 128, 128)]
SPLITS = (1, 2, 4, 8)
WARPS, STAGES = 4, 3
WIN = 0.97   # a Triton variant enters the table when it takes <= 97% of cuBLAS's time


def triton_linear(x: torch.Tensor, w: torch.Tensor, bm: int, bn: int, bk: int, split: int,
                  warps: int = 4, stages: int = 3) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in x's dtype through the engine's kernel (ferrum.ops.gemm_small)."""
    return gemm_small.gemm(x, w, None, (bm, bn, bk, split, warps, stages))


def main() -> None:
    shapes = MODELS[os.environ.get("PROBE_MODEL", "qwen3-0.6b")]
    rows = [int(m) for m in os.environ.get("PROBE_ROWS", "2 4 8 16 32 64 128 256").split()]
    res: dict = {"command": " ".join([sys.executable] + sys.argv), "gpu": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "triton": triton.__version__, "cases": {}}
    for name, (N, K) in shapes.items():
        copies = max(1, -(-200 * 2**20 // (N * K * 2)))   # > 4x the L2 in total
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            flops, wbytes = 2 * M * N * K, N * K * 2
            row = {}

            def timed(key, fn):
                try:
                    err = (fn(ws[0]).float() - ref.float()).abs().max().item()
                    us = 1e3 * cuda_graph_time_ms(lambda: [fn(w) for w in ws], iters=2) / copies
                except Exception as e:   # out of shared memory / registers for this tile
                    row[key] = {"error": str(e).splitlines()[0][:160]}
                    return
                row[key] = {"us": us, "tflops": flops / us / 1e6, "weight_gbs": wbytes / us / 1e3,
                            "max_abs_diff_vs_cublas": err}
            timed("cublas", lambda w: F.linear(x, w))
            for (bm, bn, bk), split in itertools.product(TILES, SPLITS):
                if bm > 16 and bm >= 2 * M:   # a row tile far wider than the rows: skip
                    continue
                timed(f"triton_{bm}x{bn}x{bk}_s{split}", lambda w, c=(bm, bn, bk, split): triton_linear(x, w, *c, WARPS, STAGES))
            ok = sorted(((k, v) for k, v in row.items() if "us" in v), key=lambda kv: kv[1]["us"])
            res["cases"][f"{name}/{M}"] = {"N": N, "K": K, "M": M, "variants": row,
                                            "best": ok[0][0] if ok else None}
            print(f"{name} M={M}: cublas {row['cublas'].get('us', float('nan')):.1f} us; best {ok[0][0]} "
                  f"{ok[0][1]['us']:.1f} us ({ok[0][1]['tflops']:.0f} TFLOP/s)", flush=True)
    out = os.environ.get("OUT", "bench_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "probe_small_gemm.json"), "w") as f:
        json.dump(res, f, indent=1)
    entries = []
    for case in res["cases"].values():
        best, cub = case["best"], case["variants"]["cublas"].get("us")
        if best and best != "cublas" and cub and case["variants"][best]["us"] <= WIN * cub:
            (bm, bn, bk), split = (int(v) for v in best.split("_")[1].split("x")), int(best.split("_s")[1])
            entries.append({"N": case["N"], "K": case["K"], "M": case["M"], "config": [bm, bn, bk, split, WARPS, STAGES],
                            "us": case["variants"][best]["us"], "cublas_us": cub})
    with open(os.path.join(out, "small_gemm_table.json"), "w") as f:
        json.dump({"gpu": res["gpu"], "win": WIN, "entries": entries}, f, indent=1)
    print(f"small_gemm_table.json: {len(entries)} of {len(res['cases'])} cases faster in Triton", flush=True)


if __name__ == "__main__":
    main()
