"""python3 benchmarks/probe_small_gemm.py (GPU): the decode-step linears of a small model at 2-256
rows, where a step's GEMMs ran at ~310 TFLOP/s on an H100 (Qwen3-0.6B at 256 rows,
benchmarks/results/h100-2026-12-07): cuBLAS (`F.linear`, what ferrum runs there) against a
plain Triton tile kernel over a grid of tiles and split-K factors. N of 1,024-6,144 leaves a
128 x 128 tile grid with 16-96 CTAs for 132 SMs; smaller tiles and split-K fill the machine.

Weights rotate through copies totalling > 4x the 50 MB L2, so each call reads them from HBM as
a decode step does. Median of 20 CUDA-event timings per (shape, rows, variant); TFLOP/s and the
weight read rate (GB/s) for each; max |diff| of every Triton variant against cuBLAS. PROBE_ROWS
(default "2 4 8 16 32 64 128 256") and PROBE_MODEL (qwen3-0.6b | llama3-8b) pick the cases.
Writes $OUT/probe_small_gemm.json. Under TRITON_INTERPRET=1 on CPU `--check` runs the kernel on
a few small shapes against torch (no timing)."""
from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ferrum.benchmarks.mbu import cuda_event_median_us  # noqa: E402

MODELS = {   # name: (N, K) of each decode-step linear (LM head last)
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)},
}
TILES = [(16, 64, 128), (32, 64, 128), (64, 64, 64), (32, 128, 64), (64, 128, 64), (16, 128, 128)]
SPLITS = (1, 2, 4)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 TILES: tl.constexpr):
    """y[s] = x[:, ks] @ W[:, ks]^T for the s-th of SPLIT_K slices of K (float32 partials when
    SPLIT_K > 1, summed by the caller; else y in x's dtype)."""
    pid_m, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, TILES):   # K tiles per slice: slice s takes tiles s * TILES ..
        kk = (s * TILES + i) * BLOCK_K + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = y_ptr + s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def triton_linear(x: torch.Tensor, w: torch.Tensor, bm: int, bn: int, bk: int, split: int,
                  warps: int = 4, stages: int = 3) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in x's dtype (row-major, contiguous)."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((split, M, N) if split > 1 else (1, M, N), device=x.device,
                    dtype=torch.float32 if split > 1 else x.dtype)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _gemm_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(1), y.stride(0),
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, TILES=triton.cdiv(K, bk * split),
                       num_warps=warps, num_stages=stages)
    return y[0] if split == 1 else y.sum(0).to(x.dtype)


def check() -> None:
    """The kernel against torch on small shapes with ragged edges (CPU interpreter or GPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for (M, N, K), (bm, bn, bk), split in itertools.product([(3, 40, 96), (17, 70, 200)], [(16, 32, 32)], (1, 3)):
        x = torch.randn(M, K, generator=g).to(dev)
        w = torch.randn(N, K, generator=g).to(dev)
        got = triton_linear(x, w, bm, bn, bk, split)
        torch.testing.assert_close(got, x @ w.t(), atol=1e-3, rtol=1e-3)
    print("probe_small_gemm kernel check passed on", dev)


def main() -> None:
    if "--check" in sys.argv:
        check()
        return
    shapes = MODELS[os.environ.get("PROBE_MODEL", "qwen3-0.6b")]
    rows = [int(m) for m in os.environ.get("PROBE_ROWS", "2 4 8 16 32 64 128 256").split()]
    res: dict = {"command": " ".join([sys.executable] + sys.argv), "gpu": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "triton": triton.__version__, "cases": {}}
    for name, (N, K) in shapes.items():
        copies = max(1, -(-200 * 2**20 // (N * K * 2)))   # > 4x the L2 in total
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        turn = itertools.cycle(range(copies))
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            flops, wbytes = 2 * M * N * K, N * K * 2
            row = {}

            def timed(key, fn):
                try:
                    err = (fn(ws[0]).float() - ref.float()).abs().max().item()
                    us = cuda_event_median_us(lambda: fn(ws[next(turn)]))
                except Exception as e:   # out of shared memory / registers for this tile
                    row[key] = {"error": str(e).splitlines()[0][:160]}
                    return
                row[key] = {"us": us, "tflops": flops / us / 1e6, "weight_gbs": wbytes / us / 1e3,
                            "max_abs_diff_vs_cublas": err}
            timed("cublas", lambda w: F.linear(x, w))
            for (bm, bn, bk), split in itertools.product(TILES, SPLITS):
                if bm > 16 and bm >= 2 * M:   # a row tile far wider than the rows: skip
                    continue
                timed(f"triton_{bm}x{bn}x{bk}_s{split}", lambda w, c=(bm, bn, bk, split): triton_linear(x, w, *c))
            ok = sorted(((k, v) for k, v in row.items() if "us" in v), key=lambda kv: kv[1]["us"])
            res["cases"][f"{name}/{M}"] = {"N": N, "K": K, "M": M, "variants": row,
                                            "best": ok[0][0] if ok else None}
            print(f"{name} M={M}: cublas {row['cublas'].get('us', float('nan')):.1f} us; best {ok[0][0]} "
                  f"{ok[0][1]['us']:.1f} us ({ok[0][1]['tflops']:.0f} TFLOP/s)", flush=True)
    out = os.environ.get("OUT", "bench_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "probe_small_gemm.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
