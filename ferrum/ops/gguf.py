"""Linears over GGUF-quantized weights kept in their llama.cpp block layout.

A weight [N, K] is `raw` [N, K // QK * BPB] uint8: row n is its K // QK blocks of BPB bytes
(ggml-common.h; QK elements per block):
    Q4_0 (QK 32, 18 B): fp16 d; qs[16]: x[j] = d * ((qs[j] & 15) - 8), x[j+16] = d * ((qs[j] >> 4) - 8)
    Q8_0 (QK 32, 34 B): fp16 d; int8 qs[32]: x[j] = d * qs[j]
    Q4_K (QK 256, 144 B): fp16 d, dmin; scales[12] (eight 6-bit scale / min pairs,
        `get_scale_min_k4`); qs[128]: element e of chunk c = e // 64 is nibble (e // 32) % 2 of
        qs[32c + e % 32]; x = d * sc[s] * q - dmin * m[s], sub-block s = e // 32
    Q5_K (QK 256, 176 B): as Q4_K plus qh[32] before qs: bit s of qh[e % 32] is the fifth bit
    Q6_K (QK 256, 210 B): ql[128], qh[64], int8 scales[16], fp16 d: element e of half H = e // 128,
        quarter Q = (e % 128) // 32, l = e % 32 is (nibble Q // 2 of ql[64H + 32(Q % 2) + l]) |
        (((qh[32H + l] >> 2Q) & 3) << 4), minus 32, times d * scales[8H + 2Q + l // 16]
The reference decoder is the `gguf` package's (a numpy port of llama.cpp's dequantize_row_*).

- `gguf_gemv` (1-8 rows, CUDA): Triton; each program streams BLOCK_N rows, 256 elements per
  row and step laid out [A, B, L] sub-blocks (`STEP_LAYOUT`): the quant bytes are loaded once
  per step, the block headers once per sub-block, and the product is factored per sub-block,
  scale * sum(q x) - min * sum(x), as llama.cpp's vec_dot kernels do. Configurations:
  `GGUF_GEMV_CONFIGS`.
- `gguf_gemm` (9 to `GGUF_GEMM_MAX_ROWS` rows, CUDA): the same per-step decode feeding tl.dot
  tiles (the weight is never written out in 16 bits). Above that (large prefill chunks)
  `gguf_dequantize_triton` decodes the whole weight once to 16 bits for cuBLAS, faster there.
- CPU and the reference: `gguf_dequantize`, then F.linear.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ferrum.ops import gemv_gluon
from ferrum.ops.fp8 import MAX_GEMV_ROWS
from ferrum.ops.int4 import F32_2P23_BITS
from ferrum.ops.triton_utils import HAS_TRITON, pdl_ok, pdl_start, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 8, 12, 13, 14  # GGMLQuantizationType values
BLOCK = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
PACKED_TYPES = tuple(BLOCK)
CHUNK = 256  # elements of a row decoded per kernel step
DEQUANT_BLOCK_N = 8  # rows per program of the dequantize kernel (16 spills registers for Q6_K)


def gguf_dequantize(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """raw [N, K // QK * BPB] uint8 (any device) -> [N, K] float32 on raw's device (decoded on
    CPU by the `gguf` package)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    arr = dequantize(raw.cpu().numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(raw.shape[0], k).to(raw.device)


if HAS_TRITON:
    @triton.jit
    def _u8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _f16(ptr, mask):
        """fp16 at byte address ptr (any alignment) as float32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _scale_min_k4(sc_ptr, s, mask):
        """llama.cpp get_scale_min_k4: 6-bit scale and min of sub-block s (0..7)."""
        lo = s < 4
        a = _u8(sc_ptr + s, mask)                     # q[j]
        b = _u8(sc_ptr + s + 4, mask)                 # q[j + 4]
        c = _u8(sc_ptr + tl.where(lo, s, s - 4), mask)   # q[j - 4] (j >= 4)
        sc = tl.where(lo, a & 63, (b & 15) | ((c >> 6) << 4))
        m = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def _decode(rows, k0, n_mask, K, QTYPE: tl.constexpr):
        """[BLOCK_N, CHUNK] float32: elements k0 .. k0 + CHUNK of the rows at byte pointers
        `rows` [BLOCK_N, 1] (k0 a multiple of CHUNK; elements >= K are 0)."""
        e = k0 + tl.arange(0, 256)
        mask = n_mask[:, None] & (e < K)[None, :]
        if QTYPE == 2 or QTYPE == 8:  # Q4_0 / Q8_0: 32-element blocks
            BPB: tl.constexpr = 18 if QTYPE == 2 else 34
            blk = rows + ((e // 32) * BPB)[None, :]
            d = _f16(blk, mask)
            j = (e % 32)[None, :]
            if QTYPE == 2:
                byte = _u8(blk + 2 + (j % 16), mask)
                q = tl.where(j < 16, byte & 15, byte >> 4) - 8
            else:
                q = tl.load(blk + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)
            w = d * q.to(tl.float32)
        else:  # K-quants: one 256-element super-block per step
            BPB2: tl.constexpr = 144 if QTYPE == 12 else (176 if QTYPE == 13 else 210)
            blk = rows + (k0 // 256) * BPB2
            r = (e % 256)[None, :]
            if QTYPE == 14:  # Q6_K
                H = r // 128
                Q = (r % 128) // 32
                l = r % 32
                ql = _u8(blk + 64 * H + 32 * (Q % 2) + l, mask)
                qh = _u8(blk + 128 + 32 * H + l, mask)
                q = (tl.where(Q < 2, ql & 15, ql >> 4) | (((qh >> (2 * Q)) & 3) << 4)) - 32
                sc = tl.load(blk + 192 + 8 * H + 2 * Q + l // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
                w = _f16(blk + 208, mask) * sc.to(tl.float32) * q.to(tl.float32)
            else:  # Q4_K / Q5_K
                d = _f16(blk, mask)
                dmin = _f16(blk + 2, mask)
                s = r // 32
                sc, m = _scale_min_k4(blk + 4, s, mask)
                QS: tl.constexpr = 16 if QTYPE == 12 else 48
                byte = _u8(blk + QS + 32 * (r // 64) + r % 32, mask)
                q = tl.where(s % 2 == 0, byte & 15, byte >> 4)
                if QTYPE == 13:
                    qh = _u8(blk + 16 + r % 32, mask)
                    q += ((qh >> s) & 1) << 4
                w = d * sc * q.to(tl.float32) - dmin * m
        return w

    @triton.jit
    def _gguf_step(rows, kb, n_mask, K, magic, MAGIC: tl.constexpr, QTYPE: tl.constexpr, A: tl.constexpr,
                   B: tl.constexpr,
                   L: tl.constexpr):
        """Elements 256 kb .. 256 kb + 255 of the rows at byte pointers `rows` [BLOCK_N, 1],
        laid out [BLOCK_N, A, B, L] (element 256 kb + (B a + b) L + l) as w = scale * q - minc:
        returns q [BLOCK_N, A, B, L] float32 and scale, minc [BLOCK_N, A, B] float32 (one per
        sub-block of L elements; sub-block (a, b) of a K-quant super-block is the one whose
        header entry the formats' docs name). K-quants: one super-block; Q4_0 / Q8_0: 8 blocks
        (past K: zeros). MAGIC: q to float32 through magic = 0x4B000000 (`F32_2P23_BITS`), else
        by int->float conversion (the GEMM: the magic path spills registers for Q5_K there)."""
        a3 = tl.arange(0, A)[None, :, None]
        b3 = tl.arange(0, B)[None, None, :]
        a4 = a3[:, :, :, None]
        b4 = b3[:, :, :, None]
        l4 = tl.arange(0, L)[None, None, None, :]
        if QTYPE == 2 or QTYPE == 8:  # Q4_0 / Q8_0: 32-element blocks a = 0..7 of this step
            BPB: tl.constexpr = 18 if QTYPE == 2 else 34
            bmask = n_mask[:, :, None] & ((kb * 8 + a3) * 32 < K)
            blk = rows[:, :, None] + (kb * 8 + a3) * BPB            # [BLOCK_N, A, 1]
            d = _f16(blk, bmask)
            if QTYPE == 2:  # byte l holds elements l (low nibble, b = 0) and l + 16 (b = 1)
                byte = _u8(blk[:, :, :, None] + 2 + l4, bmask[:, :, :, None])
                q = (byte >> (4 * b4)) & 15
                scale = d + 0.0 * b3
                minc = 8.0 * scale
            else:
                # int8 q + 128 = byte ^ 0x80: an offset, so the float trick below stays non-negative
                q = _u8(blk[:, :, :, None] + 2 + l4, bmask[:, :, :, None]) ^ 0x80
                scale = d
                minc = 0.0 * d
        else:  # K-quants: super-block kb
            BPB2: tl.constexpr = 144 if QTYPE == 12 else (176 if QTYPE == 13 else 210)
            blk = rows[:, :, None] + kb * BPB2                       # [BLOCK_N, 1, 1]
            mask3 = n_mask[:, :, None]
            mask4 = mask3[:, :, :, None]
            blk4 = blk[:, :, :, None]
            if QTYPE == 14:  # Q6_K: a = 4 H + Q (half, quarter), b = l // 16, L = 16
                H = a4 // 4
                Q = a4 % 4
                ql = _u8(blk4 + 64 * H + 32 * (Q % 2) + 16 * b4 + l4, mask4)
                qh = _u8(blk4 + 128 + 32 * H + 16 * b4 + l4, mask4)
                q = ((ql >> (4 * (Q // 2))) & 15) | (((qh >> (2 * Q)) & 3) << 4)
                sc = tl.load(blk + 192 + 2 * a3 + b3, mask=mask3, other=0).to(tl.int8, bitcast=True)
                scale = _f16(blk + 208, mask3) * sc.to(tl.float32)
                minc = 32.0 * scale
            else:  # Q4_K / Q5_K: a = chunk of 64, b = nibble: sub-block s = 2a + b, L = 32
                QS: tl.constexpr = 16 if QTYPE == 12 else 48
                byte = _u8(blk4 + QS + 32 * a4 + l4, mask4)             # [BLOCK_N, A, 1, L]
                s4 = 2 * a4 + b4
                q = (byte >> (4 * b4)) & 15
                if QTYPE == 13:
                    qh = _u8(blk4 + 16 + l4, mask4)
                    q += ((qh >> s4) & 1) << 4
                sc, m = _scale_min_k4(blk + 4, 2 * a3 + b3, mask3)
                scale = _f16(blk, mask3) * sc
                minc = _f16(blk + 2, mask3) * m
        # float(q) exactly without the quarter-rate I2F: q (0..255) ORed into the mantissa of
        # 2^23 (`magic` = 0x4B000000, a register operand so that the AND before fuses into one
        # LOP3), minus 2^23 per element (minus 2^23 + 128 for Q8_0's offset)
        OFF: tl.constexpr = 8388608.0 + (128.0 if QTYPE == 8 else 0.0)
        if MAGIC:
            return (q | magic).to(tl.float32, bitcast=True) - OFF, scale, minc
        return q.to(tl.float32) - (128.0 if QTYPE == 8 else 0.0), scale, minc

    @triton.jit
    def _gguf_x(x_ptr, kb, K, valid, A: tl.constexpr, B: tl.constexpr, L: tl.constexpr):
        """x[256 kb + (B a + b) L + l] as [A, B, L] float32 (0 past K or when not `valid`)."""
        offs = (256 * kb + (B * tl.arange(0, A)[:, None, None] + tl.arange(0, B)[None, :, None]) * L
                + tl.arange(0, L)[None, None, :])
        return tl.load(x_ptr + offs, mask=(offs < K) & valid, other=0.0).to(tl.float32)

    @triton.jit
    def _gguf_step_dot(q, scale, minc, x):
        """[BLOCK_N, A, B]: sum_l w x per sub-block, factored as scale * sum(q x) - minc * sum(x)."""
        return scale * tl.sum(q * x[None, :, :, :], axis=3) - minc * tl.sum(x, axis=2)[None, :, :]

    @triton.jit
    def _gguf_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, magic, stride_xm, stride_wn, stride_ym,
                          QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, A: tl.constexpr, B: tl.constexpr, L: tl.constexpr,
                          MAGIC: tl.constexpr, USE_PDL: tl.constexpr):
        """y [M, N] = x W^T (+ bias), BLOCK_N rows per program; MAGIC: quants to float32 through
        the 2^23 mantissa trick (LOP3 + FADD) instead of I2F (`_gguf_step`)."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_m = tl.arange(0, BLOCK_M)
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        n_mask2 = n_mask[:, None]
        q, scale, minc = _gguf_step(rows, 0, n_mask2, K, magic, MAGIC, QTYPE, A, B, L)  # weights before waiting for x
        if USE_PDL:
            pdl_start()
        steps = tl.cdiv(K, 256)
        if BLOCK_M == 1:  # one row: accumulate per sub-block, reduce once at the end
            acc = _gguf_step_dot(q, scale, minc, _gguf_x(x_ptr, 0, K, True, A, B, L))
            for kb in range(1, steps):
                q, scale, minc = _gguf_step(rows, kb, n_mask2, K, magic, MAGIC, QTYPE, A, B, L)
                acc += _gguf_step_dot(q, scale, minc, _gguf_x(x_ptr, kb, K, True, A, B, L))
            y = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
        else:  # 2-8 rows: each step is decoded once and used by every row
            y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(0, steps):
                if kb > 0:
                    q, scale, minc = _gguf_step(rows, kb, n_mask2, K, magic, MAGIC, QTYPE, A, B, L)
                for mi in tl.static_range(BLOCK_M):
                    x = _gguf_x(x_ptr + mi * stride_xm, kb, K, mi < M, A, B, L)
                    part = tl.sum(tl.sum(_gguf_step_dot(q, scale, minc, x), axis=2), axis=1)
                    y += tl.where(offs_m[:, None] == mi, part[None, :], 0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & n_mask[None, :])

    @triton.jit
    def _gguf_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, magic, stride_xm, stride_wn, stride_ym,
                          QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, A: tl.constexpr, B: tl.constexpr, L: tl.constexpr,
                          DOT_PREC: tl.constexpr):
        """y = x W^T (+ bias) for any M: each 256-element step of a [BLOCK_N] row block is
        decoded in registers (`_gguf_step`) and fed to tensor cores (tl.dot)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, 256)):
            offs_k = kb * 256 + tl.arange(0, 256)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            q, scale, minc = _gguf_step(rows, kb, n_mask[:, None], K, magic, False, QTYPE, A, B, L)
            w = tl.reshape(scale[:, :, :, None] * q - minc[:, :, :, None], (BLOCK_N, 256))
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _gguf_dequant_kernel(w_ptr, out_ptr, N, K, stride_wn, stride_on, QTYPE: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        k0 = tl.program_id(1) * 256
        w = _decode(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn, k0, n_mask, K, QTYPE)
        offs_k = k0 + tl.arange(0, 256)
        tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


# Sub-block layout of one 256-element kernel step per type (`_gguf_step`): (A, B, L).
STEP_LAYOUT = {Q4_0: (8, 2, 16), Q8_0: (8, 1, 32), Q4_K: (4, 2, 32), Q5_K: (4, 2, 32), Q6_K: (8, 2, 16)}

# Tuned configurations of `gguf_gemv`: (qtype, N, K, rows) -> (BLOCK_N, num_warps, num_stages[,
# MAGIC]), rows 1 (M == 1) or 4 (2-8 rows); printed by `benchmarks/quant_bench.py kernels` (paste its
# GGUF_GEMV_CONFIGS here). Shapes not listed take `_gguf_default_config`.
GGUF_GEMV_CONFIGS: dict[tuple[int, int, int, int], tuple[int, ...]] = {
    (8, 4096, 4096, 1): (8, 4, 2),
    (8, 4096, 4096, 4): (8, 4, 2),
    (8, 4096, 14336, 1): (8, 4, 2),
    (8, 4096, 14336, 4): (8, 4, 2),
    (8, 6144, 4096, 1): (16, 4, 2),
    (8, 6144, 4096, 4): (8, 4, 2),
    (8, 28672, 4096, 1): (16, 4, 2),
    (8, 28672, 4096, 4): (8, 4, 2),
    (12, 4096, 4096, 1): (16, 2, 2),
    (12, 4096, 4096, 4): (8, 4, 2),
    (12, 4096, 14336, 1): (16, 2, 2),
    (12, 4096, 14336, 4): (8, 4, 2),
    (12, 6144, 4096, 1): (16, 2, 2, 0),
    (12, 6144, 4096, 4): (8, 4, 2),
    (12, 28672, 4096, 1): (16, 1, 2),
    (12, 28672, 4096, 4): (8, 4, 2),
    (14, 4096, 4096, 1): (8, 4, 2),
    (14, 4096, 4096, 4): (8, 4, 2),
    (14, 4096, 14336, 1): (8, 4, 2),
    (14, 4096, 14336, 4): (8, 4, 2),
    (14, 6144, 4096, 1): (8, 4, 2, 0),
    (14, 6144, 4096, 4): (8, 4, 2),
    (14, 28672, 4096, 1): (8, 4, 2, 0),
    (14, 28672, 4096, 4): (8, 4, 2),
}


def _gguf_default_config(qtype: int, N: int, K: int, M: int) -> tuple[int, int, int]:
    """Heuristic for shapes without a tuned entry."""
    return (8, 4, 2) if M == 1 else (4, 4, 2)


def gguf_gemv_config(qtype: int, N: int, K: int, M: int) -> tuple[int, ...]:
    """(BLOCK_N, num_warps, num_stages[, MAGIC]) of `gguf_gemv`: `GGUF_GEMV_CONFIGS[(qtype, N, K, 1 or 4)]`,
    else `_gguf_default_config`."""
    return GGUF_GEMV_CONFIGS.get((qtype, N, K, 1 if M == 1 else 4)) or _gguf_default_config(qtype, N, K, M)


def gguf_gemv(x: torch.Tensor, raw: torch.Tensor, qtype: int, bias: torch.Tensor | None = None,
              config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 8, unit stride along K); raw: [N, K // QK * BPB] uint8 (rows
    contiguous); bias [N] or None -> [M, N] in x's dtype (float32 accumulation). Each program
    streams BLOCK_N rows one 256-element step at a time: the step's quant bytes are loaded
    once, its block headers (d, dmin, 6-bit scales) decoded once per sub-block, and the
    product factored per sub-block, scale * sum(q x) - min * sum(x) (as llama.cpp's
    vec_dot_q*_K kernels). `config` (BLOCK_N, warps, stages[, MAGIC]) overrides
    `gguf_gemv_config`; MAGIC 1 (the default) turns quants into floats by the 2^23 mantissa trick,
    0 by int->float conversion (fewer instructions, but I2F runs at a quarter rate on sm_90)."""
    M, K = x.shape
    N = raw.shape[0]
    qk, bpb = BLOCK[qtype]
    assert M <= MAX_GEMV_ROWS and raw.shape[1] * qk == K * bpb and raw.stride(1) == 1 and x.stride(1) == 1
    bn, warps, stages, *magic = config or gguf_gemv_config(qtype, N, K, M)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl = pdl_ok(x)
    A, B, L = STEP_LAYOUT[qtype]
    _gguf_gemv_kernel[(triton.cdiv(N, bn),)](
        x, raw, bias if bias is not None else x, y, M, N, K, F32_2P23_BITS, x.stride(0), raw.stride(0), y.stride(0),
        QTYPE=qtype, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn,
        A=A, B=B, L=L, MAGIC=bool(magic[0]) if magic else True, USE_PDL=pdl, num_warps=warps,
        num_stages=stages, launch_pdl=pdl)
    return y


def gguf_gemm_config(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of `gguf_gemm`."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    return bm, 64, 4 if bm <= 32 else 8, 2


def gguf_gemm(x: torch.Tensor, raw: torch.Tensor, qtype: int, bias: torch.Tensor | None = None,
              config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """As `gguf_gemv` for any number of rows: the weight is decoded tile by tile in registers
    and multiplied on tensor cores (tl.dot), never written out. `config` (BLOCK_M, BLOCK_N,
    warps, stages) overrides `gguf_gemm_config`."""
    M, K = x.shape
    N = raw.shape[0]
    bm, bn, warps, stages = config or gguf_gemm_config(M)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    A, B, L = STEP_LAYOUT[qtype]
    _gguf_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, raw, bias if bias is not None else x, y, M, N, K, F32_2P23_BITS, x.stride(0), raw.stride(0), y.stride(0),
        QTYPE=qtype, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, A=A, B=B, L=L,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return y


def gguf_dequantize_triton(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """As `gguf_dequantize`, decoded on raw's device by Triton, in `dtype`."""
    N = raw.shape[0]
    out = torch.empty(N, k, dtype=dtype, device=raw.device)
    _gguf_dequant_kernel[(triton.cdiv(N, DEQUANT_BLOCK_N), triton.cdiv(k, CHUNK))](
        raw, out, N, k, raw.stride(0), out.stride(0), QTYPE=qtype, BLOCK_N=DEQUANT_BLOCK_N, num_warps=4)
    return out


# Above this many rows, decoding the weight once into 16 bits and calling cuBLAS beats the
# dequant-in-tile GEMM (H200, Llama-3-8B matrices, benchmarks/results/h200-2026-12-01b/
# quant_kernels.json: at 64 rows the tiled GEMM is 1.2-4x faster, at 512 rows 1.5-3x slower).
GGUF_GEMM_MAX_ROWS = 128


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + bias with W packed as GGUF `qtype` (module docstring). x: [T, K]. CUDA:
    the GEMV up to 8 rows (Q4_K up to 4 rows: the Gluon GEMV, ferrum/ops/gemv_gluon.py), the
    dequant-in-tile GEMM up to `GGUF_GEMM_MAX_ROWS`, above that the weight decoded once
    (`gguf_dequantize_triton`) and cuBLAS; CPU: dequantize + F.linear."""
    K = x.shape[1]
    if use_triton(x) and x.stride(1) == 1:
        cfg = gemv_gluon.config_for("q4_k", x, raw.shape[0], K) if qtype == Q4_K and raw.stride(1) == 1 else None
        if cfg is not None:
            return gemv_gluon.q4k_gemv(x, raw, bias, cfg)
        if x.shape[0] <= MAX_GEMV_ROWS:
            return gguf_gemv(x, raw, qtype, bias)
        if x.shape[0] <= GGUF_GEMM_MAX_ROWS:
            return gguf_gemm(x, raw, qtype, bias)
        return F.linear(x, gguf_dequantize_triton(raw, qtype, K, x.dtype), bias)
    return F.linear(x, gguf_dequantize(raw, qtype, K).to(x.dtype), bias)
