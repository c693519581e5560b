"""Batch-1 GEMV in Triton: y = x W^T + b for one row x, the matrix product of a decode step.

A batch-1 decode step is a chain of matrix-vector products whose speed is the rate at which
the weights stream from HBM. cuBLAS reaches that roofline on large matrices but loses time on
the smaller ones of a step (o_proj, and every matrix at TP=2); this kernel streams W in
[BLOCK_N, BLOCK_K] tiles with each program owning BLOCK_N output rows, so the grid always has
thousands of programs and no split-K reduction is needed. With PDL (`triton_utils`) it reads
its first weight tile before waiting for x. `ferrum.ops.linear` decides when it runs (x one
row, 16-bit, on CUDA; `KERNELS.triton_gemv`, FERRUM_TRITON_GEMV=0, turns it off). Measured speed:
benchmarks/results/README.md ("Figures behind the kernel choices").
"""
from __future__ import annotations

import torch

from ferrum.config import KERNELS
from ferrum.ops.triton_utils import HAS_TRITON, fit_block, pdl_ok, pdl_start

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _load_w_tile(rows, offs_k, n_mask, K, EVEN: tl.constexpr):
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked, fully vectorised loads
            w = tl.load(rows + offs_k[None, :], eviction_policy="evict_first")
        else:
            k_mask = offs_k < K
            w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
        return w

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        offs_k = tl.arange(0, BLOCK_K)
        w = _load_w_tile(rows, offs_k, n_mask, K, EVEN)  # first tile: weights only
        if USE_PDL:
            pdl_start()             # x (written by the previous kernel) is ready after this
        if EVEN:
            x = tl.load(x_ptr + offs_k)
        else:
            x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
        acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                x = tl.load(x_ptr + offs_k)
            else:
                x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
            w = _load_w_tile(rows, offs_k, n_mask, K, EVEN)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight, chosen per Llama-3-8B
    matrix on H200 from 8 block shapes (`benchmarks/profile_decode.py gemv`): wide matrices
    (gate_up, LM head) like short wide tiles; matrices of <= 32 MB (o_proj, qkv at TP=2) like
    long thin tiles, which give more programs; the rest (qkv, down) sit in between. BLOCK_K
    is halved until it divides k, keeping the unmasked path.
    `KERNELS.gemv_config` (--gemv-config, FERRUM_GEMV_CONFIG="BN,BK,warps,stages") overrides
    (tuning runs)."""
    if KERNELS.gemv_config:
        return KERNELS.gemv_config
    if n >= 14336:
        bn, bk, w, s = 16, 256, 4, 4
    elif n * k <= 4096 * 4096:
        bn, bk, w, s = 4, 1024, 4, 2
    else:
        bn, bk, w, s = 8, 512, 4, 3
    return bn, fit_block(bk, k, 64), w, s


def can_use(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `gemv(x, weight)` applies: enabled, triton present, x a contiguous [1, K]
    CUDA tensor in bf16/fp16 and weight [N, K] of the same dtype with unit stride along K."""
    return (KERNELS.triton_gemv and HAS_TRITON and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.is_contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y = x W^T + b for one row: x [1, K] contiguous; weight [N, K] with unit stride along K;
    bias [N] or None; all bf16 or all fp16 on CUDA (see `can_use`). Returns a new [1, N]
    tensor in x's dtype, accumulated in float32. `config` overrides `gemv_config(N, K)`.
    Raises AssertionError when x is not [1, K]."""
    N, K = weight.shape
    assert x.shape == (1, K), (x.shape, weight.shape)
    bn, bk, warps, stages = config or gemv_config(N, K)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    even = N % bn == 0 and K % bk == 0
    pdl = pdl_ok(x)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if bias is not None else x, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y

