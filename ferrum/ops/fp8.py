"""FP8 (e4m3) weight linears: y = x (s * W_fp8)^T + b with one float32 scale per output
channel s [N] (a per-tensor scale is that scale repeated).

- `fp8_gemv` (1-8 rows, CUDA): a Triton GEMV that streams the 1-byte weights in
  [BLOCK_N, BLOCK_K] tiles, widens them to float32 in registers, multiplies by x (16-bit,
  W8A16) and applies s once per output at the end; with programmatic dependent launch like the
  bf16 GEMV (ferrum/ops/gemv.py).
- larger batches on CUDA: FP8 tensor cores through `torch._scaled_mm`, x quantized per token
  (dynamic, scale = amax / 448) or with the checkpoint's static input scale, row-wise scales.
- CPU and the reference: dequantize, then F.linear.

Format: OCP 8-bit floating point E4M3 (`torch.float8_e4m3fn`, max 448); quantization
q = round_to_nearest_even(w / s), s = amax(|w_row|) / 448 (as vLLM / llm-compressor do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.config import KERNELS
from ferrum.ops import gemv_gluon
from ferrum.ops.triton_utils import HAS_TRITON, fit_block, pdl_ok, pdl_start, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MAX_GEMV_ROWS = 8


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] any float dtype -> (q [N, K] float8_e4m3fn, scale [N] float32) with
    q * scale[:, None] ~= w; an all-zero row gets scale 1."""
    amax = w.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale [N] float32 -> [N, K] float32."""
    return weight.float() * scale.float()[:, None]


if HAS_TRITON:
    @triton.jit
    def _w8_tile(rows, offs_k, n_mask, K, EVEN: tl.constexpr):
        if EVEN:
            w = tl.load(rows + offs_k[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        return w.to(tl.float32)

    @triton.jit
    def _x_tile(x_ptr, stride_xm, offs_m, offs_k, m_mask, K, EVEN: tl.constexpr):
        ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if EVEN:
            x = tl.load(ptrs, mask=m_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def _w8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        offs_k = tl.arange(0, BLOCK_K)
        w = _w8_tile(rows, offs_k, n_mask, K, EVEN)  # first tile: weights only
        if USE_PDL:
            pdl_start()
        if BLOCK_M == 1:  # one row: accumulate the tile, reduce once at the end
            x = _x_tile(x_ptr, stride_xm, offs_m, offs_k, m_mask, K, EVEN)
            acc = w * x
            for k0 in range(BLOCK_K, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = _x_tile(x_ptr, stride_xm, offs_m, offs_k, m_mask, K, EVEN)
                acc += _w8_tile(rows, offs_k, n_mask, K, EVEN) * x
            y = tl.sum(acc, axis=1)[None, :]
        else:  # 2-8 rows: [M, N, K] products reduced over K per tile
            x = _x_tile(x_ptr, stride_xm, offs_m, offs_k, m_mask, K, EVEN)
            y = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = _x_tile(x_ptr, stride_xm, offs_m, offs_k, m_mask, K, EVEN)
                w = _w8_tile(rows, offs_k, n_mask, K, EVEN)
                y += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def gemv_rows_config(n: int, k: int, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the quantized GEMVs for an [n, k] weight and
    m rows: one row takes the bf16 GEMV's tile shapes (ferrum/ops/gemv.py `gemv_config`);
    more rows use narrower K tiles, since the [rows, BLOCK_N, BLOCK_K] products of a tile
    live in registers. `KERNELS.qgemv_config` (--qgemv-config, FERRUM_QGEMV_CONFIG=
    "BN,BK,warps,stages") overrides (tuning runs)."""
    if KERNELS.qgemv_config:
        return KERNELS.qgemv_config
    from ferrum.ops.gemv import gemv_config
    if m == 1:
        return gemv_config(n, k)
    bn, bk, w, s = (16, 128, 4, 3) if m <= 4 else (16, 64, 4, 3)
    return bn, fit_block(bk, k, 16), w, s


# Tuned (BLOCK_N, BLOCK_K, num_warps, num_stages) of `fp8_gemv` per (N, K, 1 or 4 rows), timed on
# an H200 by `benchmarks/quant_bench.py kernels` and written here by
# `benchmarks/paste_gemv_configs.py`. Shapes not listed take `gemv_rows_config`.
FP8_GEMV_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}


def fp8_gemv_config(n: int, k: int, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of `fp8_gemv` for an [n, k] weight and m rows:
    `KERNELS.qgemv_config` if set, else `FP8_GEMV_CONFIGS[(n, k, 1 or 4)]` (BLOCK_K halved
    until it divides k), else `gemv_rows_config`."""
    cfg = None if KERNELS.qgemv_config else FP8_GEMV_CONFIGS.get((n, k, 1 if m == 1 else 4))
    if cfg is None:
        return gemv_rows_config(n, k, m)
    bn, bk, w, s = cfg
    return bn, fit_block(bk, k, 16), w, s


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 8, unit stride along K), weight: [N, K] float8_e4m3fn (unit stride along
    K), scale: [N] float32, bias: [N] or None -> [M, N] in x's dtype (float32 accumulation)."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= MAX_GEMV_ROWS and weight.shape[1] == K and x.stride(1) == 1 and weight.stride(1) == 1
    bn, bk, warps, stages = config or fp8_gemv_config(N, K, M)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl = pdl_ok(x)
    _w8_gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, scale, bias if bias is not None else scale, y, M, N, K, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, EVEN=N % bn == 0 and K % bk == 0,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


if HAS_TRITON:
    @triton.jit
    def _quant_fp8_rows_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, stride_x, stride_q,
                               STATIC: tl.constexpr, BLOCK: tl.constexpr):
        """Program = one row of x: scale = max(amax(|x|) / 448, 1e-12), or the checkpoint's
        static input scale (STATIC); q = clamp(x / scale, -448, 448) in e4m3 (round to nearest
        even, as torch's cast). Reads the row twice (amax, then quantize) when dynamic."""
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * stride_q
        if STATIC:
            scale = tl.load(in_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            # div_rn: `/` is the approximate division on CUDA, a scale an ulp off torch's
            scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -448.0, 448.0)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] -> (x_fp8 [T, K], scale [T, 1] float32). Dynamic (amax / 448 per row) unless a
    static per-tensor `input_scale` [1] float32 is given. On CUDA one Triton pass per row
    (`_quant_fp8_rows_kernel`; the torch code below launches six kernels over [T, K] float32
    temporaries, which per linear of a batched decode step cost more than the quantization)."""
    if use_triton(x) and x.stride(-1) == 1 and x.shape[0] > 0:
        T, K = x.shape
        q = torch.empty(T, K, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty(T, 1, dtype=torch.float32, device=x.device)
        static = input_scale is not None
        _quant_fp8_rows_kernel[(T,)](x, q, scale, input_scale.float() if static else scale, K, x.stride(0),
                                     q.stride(0), STATIC=static, BLOCK=min(4096, triton.next_power_of_2(K)),
                                     num_warps=4)
        return q, scale
    if input_scale is not None:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    else:
        scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 tensor-core GEMM (CUDA sm_89+): x [T, K] 16-bit, weight [N, K] float8_e4m3fn
    (row-major, so weight.t() is the column-major B `_scaled_mm` wants), scale [N] float32.
    Needs K and N multiples of 16. Returns [T, N] in x's dtype."""
    xq, xs = quantize_fp8_per_token(x, input_scale)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.float().reshape(1, -1),
                         out_dtype=x.dtype)
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x (scale * weight)^T + bias. x: [T, K] bf16/fp16/fp32; weight [N, K]
    float8_e4m3fn; scale [N] float32; input_scale: [1] float32 (static activation scale of
    the checkpoint) or None. Dispatch: the Gluon GEMV for T <= 4 where its tile fits
    (ferrum/ops/gemv_gluon.py), for 5-8 rows in launches of 4 rows and the rest, else the
    Triton GEMV for T <= 8, `torch._scaled_mm` above that on CUDA (bfloat16 x, N and K
    multiples of 16), else dequantize + F.linear. (Two Gluon launches for 5-8 rows beat one
    Triton launch: figures in benchmarks/results/README.md.)"""
    T, K = x.shape
    if use_triton(x) and T <= MAX_GEMV_ROWS and x.dtype != torch.float32 and x.stride(1) == 1:
        N, rows = weight.shape[0], min(T, gemv_gluon.TUNED_ROWS)
        cfg = gemv_gluon.config_for("fp8", x[:rows], N, K) if weight.stride(1) == 1 else None
        rest = gemv_gluon.config_for("fp8", x[rows:], N, K) if cfg is not None and rows < T else None
        if cfg is not None and rows == T:
            return gemv_gluon.dense_gemv(x, weight, scale, bias, cfg)
        if rest is not None:
            return torch.cat([gemv_gluon.dense_gemv(x[:rows], weight, scale, bias, cfg),
                              gemv_gluon.dense_gemv(x[rows:], weight, scale, bias, rest)])
        return fp8_gemv(x, weight, scale, bias)
    # row-wise scaled _scaled_mm produces bfloat16 only
    if x.is_cuda and x.dtype == torch.bfloat16 and K % 16 == 0 and weight.shape[0] % 16 == 0:
        return fp8_scaled_mm(x, weight, scale, bias, input_scale)
    return F.linear(x, dequantize_fp8(weight, scale).to(x.dtype), bias)
