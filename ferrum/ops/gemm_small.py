"""y = x W^T (+ b) in Triton for decode steps of 2-256 rows (bf16 / fp16, CUDA), where cuBLAS's
tiles leave SMs idle on a small model's narrow matrices: Qwen3-0.6B's N of 1,024 gives a
128 x 128-tile grid of 16-96 CTAs for 132 SMs, and its decode GEMMs ran at ~310 TFLOP/s
(benchmarks/results/h100-2026-12-07). Smaller tiles and split-K fill the machine.

Used only for the (N, K, rows) cases of a table that `benchmarks/probe_small_gemm.py` measures
against cuBLAS on the GPU it runs on (FERRUM_SMALL_GEMM_TABLE: the path of its
small_gemm_table.json); without a table every GEMM stays cuBLAS. A case runs the config listed
for the fewest rows >= its rows with the same N and K (decode graphs are captured at 1, 2, 4, 8
and multiples of 16 rows).

Split-K (SPLIT > 1): program (m, n, s) sums K tiles s, s + SPLIT, .. into float32 partials
[SPLIT, M, N], summed (+ bias) by `triton_utils.reduce_splits`."""
from __future__ import annotations

import json
import os

import torch

from ferrum.ops.triton_utils import HAS_TRITON, reduce_splits, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
        """Tile (pid_m, pid_n) of y, over the K tiles pid_s, pid_s + SPLIT, ..; float32 partials
        at y + pid_s * stride_ys when SPLIT > 1, else y (+ bias) in y's dtype."""
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
        m_mask, n_mask = offs_m[:, None] < M, offs_n[None, :] < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(pid_s * BLOCK_K, K, SPLIT * BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x_rows + kk[None, :], mask=m_mask & (kk[None, :] < K), other=0.0)
            w = tl.load(w_rows + kk[:, None], mask=n_mask & (kk[:, None] < K), other=0.0)
            acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        ptrs = y_ptr + pid_s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask & n_mask)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         config: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """x [M, K] (last dim contiguous) @ weight [N, K]^T (last dim contiguous) + bias [N] -> a new
    [M, N] tensor in x's dtype. config: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps,
    num_stages); BLOCK_* powers of two >= 16."""
    bm, bn, bk, split, warps, stages = config
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    out = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _gemm_kernel[grid](x, weight, bias if bias is not None else x, out, M, N, K, x.stride(0), weight.stride(0),
                       N, M * N, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                       HAS_BIAS=bias is not None and split == 1, num_warps=warps, num_stages=stages)
    return reduce_splits(out, y, bias, pdl=False) if split > 1 else y


def load_table(path: str) -> dict[tuple[int, int], list[tuple[int, tuple]]]:
    """{(N, K): [(rows, config), ..] sorted by rows} from a probe_small_gemm.py table:
    {"gpu": .., "entries": [{"N", "K", "M", "config": [6 ints]}, ..]}. Raises ValueError on a
    malformed file."""
    with open(path) as f:
        doc = json.load(f)
    table: dict[tuple[int, int], list[tuple[int, tuple]]] = {}
    try:
        for e in doc["entries"]:
            cfg = tuple(int(v) for v in e["config"])
            if len(cfg) != 6:
                raise ValueError(f"{path}: config {list(cfg)} is not 6 ints")
            table.setdefault((int(e["N"]), int(e["K"])), []).append((int(e["M"]), cfg))
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a small-GEMM table ({err!r})") from err
    return {k: sorted(v) for k, v in table.items()}


_TABLE: dict | None = None


def _table() -> dict:
    global _TABLE
    if _TABLE is None:
        path = os.environ.get("FERRUM_SMALL_GEMM_TABLE")
        _TABLE = load_table(path) if path else {}
    return _TABLE


def config_for(x: torch.Tensor, weight: torch.Tensor, table: dict | None = None) -> tuple | None:
    """The table's config for this GEMM, or None (cuBLAS): a Triton device (`use_triton`), 2-D
    bf16 / fp16 x and weight of one dtype with contiguous rows, an (N, K) the table lists with an
    entry for >= x's rows (2 or more)."""
    table = _table() if table is None else table
    if not table or x.dim() != 2 or x.shape[0] < 2 or not use_triton(x) or x.dtype != weight.dtype \
            or x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    for rows, cfg in table.get(tuple(weight.shape), ()):
        if rows >= x.shape[0]:
            return cfg
    return None
