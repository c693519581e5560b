"""Triton kernels for the MoE experts (`ferrum.ops.moe.fused_moe` dispatches here on CUDA).

Many tokens (prefill, batched decode): the T*k (token, slot) pairs are sorted by expert and
each expert's run padded to a multiple of BLOCK_M (`moe_align`, torch ops on the device, no
host sync, static shapes so a CUDA graph can hold it); then one grouped GEMM per projection
(`_moe_gemm_kernel`): program (m-block, n-block) multiplies BLOCK_M rows of pairs, all routed
to the one expert that owns that m-block, by that expert's weight tile, gathering its A rows
through the sorted pair ids and scattering C rows back to them. gate+up -> SiLU*up -> down
(scaled by the routing weight) -> sum over the k slots. This is the structure of vLLM's
`fused_moe` (itself after MegaBlocks, Gale et al. 2022), written anew here.

One token (batch-1 decode): `_moe_gemv_gate_up_kernel` computes the k selected experts' gate+up
rows (grid: slot x row blocks) and `_moe_gemv_down_kernel` folds SiLU*up, each expert's down
projection and the routing weights into one [hidden] output (grid: row blocks, a loop over the
k slots: no atomics). Only the selected experts' weights are read, which is what bounds a
batch-1 MoE decode step (its MBU counts those bytes only).

Expert parallelism: ids outside [expert_start, expert_start + E_local) belong to another rank;
their pairs are dropped (gemm) or skipped (gemv) and contribute zero here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.ops.activation import silu_and_mul
from ferrum.ops.triton_utils import fit_block


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 tensor cores (10-bit mantissa) on GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


# =============================================================================================
# sorting (token, slot) pairs by expert
# =============================================================================================
def moe_align(topk_ids: torch.Tensor, num_local: int, expert_start: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the T*k pairs by local expert, each group padded to a multiple of block_m.

    topk_ids: [T, k] int64 global expert ids. Returns (sorted_ids [P] int32, block_expert
    [P / block_m] int32) with P = T*k + E_local*(block_m - 1) rounded up to block_m (a bound that
    depends only on shapes): sorted_ids lists pair ids p = t*k + j grouped by expert, padding
    entries = T*k (invalid); block_expert[b] is the local expert of rows [b*block_m,
    (b+1)*block_m), -1 past the last group. Pairs routed to other ranks' experts are dropped."""
    n = topk_ids.numel()
    E = num_local
    dev = topk_ids.device
    local = topk_ids.flatten() - expert_start
    local = torch.where((local >= 0) & (local < E), local, E)           # bucket E: not ours
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, local, torch.ones_like(local))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    order = torch.argsort(local, stable=True)                            # pairs by expert
    expert_of = local[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    P = -(-(n + E * (block_m - 1)) // block_m) * block_m
    dest = torch.where(expert_of < E, pad_start[expert_of.clamp(max=E - 1)] + rank, P)
    buf = torch.full((P + 1,), n, dtype=torch.int32, device=dev)
    buf.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, P, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return buf[:P], block_expert


# =============================================================================================
# grouped GEMM
# =============================================================================================
@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, block_expert_ptr,
                     N, K, num_pairs,
                     stride_am, stride_be, stride_bn, stride_cm,
                     A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    """C[p, n] = sum_k A[p // A_ROW_DIV, k] * B[e, n, k] (* w[p]) for the pairs p of one
    m-block, e its expert. A: [rows, K]; B: [E, N, K] (unit stride on K); C: [num_pairs, N]."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    m_mask = ids < num_pairs
    rows = (ids // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
              + offs_k[:, None])                                           # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc *= tl.load(w_ptr + ids, mask=m_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + ids[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# Tuned (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMMs per (experts,
# 2 * intermediate, hidden, token-slot pairs rounded up to a power of two), timed on an H200 by
# `benchmarks/moe_bench.py tune` and written here by `benchmarks/paste_gemv_configs.py`.
# Shapes not listed take the heuristic of `gemm_config`.
MOE_GEMM_CONFIGS: dict[tuple[int, int, int, int], tuple[int, int, int, int, int]] = {}


def gemm_config(num_pairs: int, num_experts: int, two_i: int | None = None,
                hidden: int | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of both grouped GEMMs: the tuned
    `MOE_GEMM_CONFIGS` entry of (num_experts, two_i, hidden, next power of two >= num_pairs)
    when there is one, else a heuristic on the average pairs per expert. Depends only on
    static shapes (per batch size), so CUDA graphs stay valid."""
    if two_i is not None and hidden is not None:
        cfg = MOE_GEMM_CONFIGS.get((num_experts, two_i, hidden, 1 << max(0, num_pairs - 1).bit_length()))
        if cfg is not None:
            return cfg
    avg = num_pairs / max(1, num_experts)
    if avg <= 16:
        return 16, 64, 128, 4, 3
    if avg <= 64:
        return 32, 64, 64, 4, 3
    return 64, 128, 64, 8, 3


def _grouped_gemm(a, b, c, weights, sorted_ids, block_expert, num_pairs, a_row_div, cfg):
    bm, bn, bk, warps, stages = cfg
    N, K = b.shape[1], b.shape[2]
    grid = (block_expert.numel() * triton.cdiv(N, bn),)
    _moe_gemm_kernel[grid](
        a, b, c, weights if weights is not None else a, sorted_ids, block_expert,
        N, K, num_pairs, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=_dot_precision(a.dtype),
        num_warps=warps, num_stages=stages)


def moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_start: int = 0,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """fused_moe for any T (see ferrum/ops/moe.py): x [T, H] -> [T, H], x's dtype."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E, two_i, _ = w13.shape
    cfg = config or gemm_config(T * k, E, two_i, H)
    sorted_ids, block_expert = moe_align(topk_ids, E, expert_start, cfg[0])
    h13 = torch.empty(T * k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h13, None, sorted_ids, block_expert, T * k, k, cfg)
    act = silu_and_mul(h13)                                              # [T*k, I]
    out = torch.zeros(T * k, H, dtype=x.dtype, device=x.device)          # dropped pairs stay 0
    _grouped_gemm(act, w2, out, topk_weights.flatten().float().contiguous(), sorted_ids,
                  block_expert, T * k, 1, cfg)
    return out.view(T, k, H).float().sum(1).to(x.dtype)


# =============================================================================================
# batch-1 GEMV pair: reads only the k selected experts
# =============================================================================================
@triton.jit
def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, ids_ptr, y_ptr, N, K, num_local, expert_start,
                             stride_we, stride_wn, stride_y,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[j, n] = W13[ids[j] - expert_start, n, :] . x for slot j (zeros for another rank's
    expert). x: [K]; W13: [E, N, K]; y: [k, N] float32."""
    j = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + j) - expert_start
    ours = (e >= 0) & (e < num_local)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_mask = n_mask & ours
    rows = w_ptr + tl.where(ours, e, 0).to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=w_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + j * stride_y + offs_n, tl.sum(acc, axis=1), mask=n_mask)


@triton.jit
def _moe_gemv_down_kernel(h_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, N, I, num_local, expert_start,
                          stride_h, stride_we, stride_wn,
                          TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = sum_j wts[j] * W2[e_j, n, :] . (silu(g_j) * u_j), h[j] = [g_j | u_j] float32
    [k, 2I]; W2: [E, N, I]; slots of other ranks' experts add nothing."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + j) - expert_start
        ours = (e >= 0) & (e < num_local)
        wt = tl.load(wts_ptr + j).to(tl.float32)
        rows = (w_ptr + tl.where(ours, e, 0).to(tl.int64) * stride_we
                + offs_n[:, None].to(tl.int64) * stride_wn)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            g = tl.load(h_ptr + j * stride_h + offs_k, mask=k_mask, other=0.0)
            u = tl.load(h_ptr + j * stride_h + I + offs_k, mask=k_mask, other=0.0)
            a = g * tl.sigmoid(g) * u
            w = tl.load(rows + offs_k[None, :], mask=(n_mask & ours)[:, None] & k_mask[None, :],
                        other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * a[None, :]
        out += wt * tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for one expert matrix [n, k]. Untuned starting points."""
    return (8 if n <= 4096 else 16), fit_block(256, k, 32), 4


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """fused_moe for one token: x [1, H] -> [1, H]; reads only the selected experts."""
    H = x.shape[1]
    E, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(k)
    h13 = torch.empty(k, two_i, dtype=torch.float32, device=x.device)
    bn, bk, warps = gemv_config(two_i, H)
    _moe_gemv_gate_up_kernel[(k, triton.cdiv(two_i, bn))](
        x, w13, ids, h13, two_i, H, E, expert_start, w13.stride(0), w13.stride(1), h13.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    y = torch.empty(1, H, dtype=x.dtype, device=x.device)
    bn, bk, warps = gemv_config(H, two_i // 2)
    _moe_gemv_down_kernel[(triton.cdiv(H, bn),)](
        h13, w2, ids, topk_weights.reshape(k).float().contiguous(), y, H, two_i // 2, E, expert_start,
        h13.stride(0), w2.stride(0), w2.stride(1), TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """ferrum.ops.moe.fused_moe on the Triton kernels: GEMV pair for one token, else grouped GEMM."""
    x = x.contiguous()
    if x.shape[0] == 1:
        return moe_gemv(x, w13, w2, topk_weights, topk_ids, expert_start)
    return moe_grouped(x, w13, w2, topk_weights, topk_ids, expert_start)
