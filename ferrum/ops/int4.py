"""4-bit integer weight linears with per-group scales and zero points (GPTQ, AWQ; W4A16):
w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], g(k) = k // group_size, or g_idx[k] when the
checkpoint was quantized in activation order (GPTQ `desc_act`).

ferrum's packed layout (the checkpoint formats are converted to it at load,
ferrum/layers/quantization/gptq.py and awq.py):
    qweight [N, K // 8] int32: word w of row n holds q[n, 8w + j] in bits 4j..4j+3;
    scales  [N, G] 16-bit, zeros [N, G] same dtype (integers 0..16), G = K // group_size;
    g_idx   [K] int32 or None.
Rows are output features, so a GEMV program streams whole rows like the bf16 GEMV does.

- `int4_gemv` (1-8 rows, CUDA): Triton; each program streams [BLOCK_N, GT, WG] tiles of words
  (GT groups of WG words) and takes nibble j of every word as a separate [BLOCK_N, GT, WG] tensor
  against x[8w + j] (no 4-D shapes, no cross-thread reductions inside the loop): each nibble
  becomes a float without an int->float conversion (`_w4_nibble`: masked into the mantissa of
  2^23, the 2^23 folded into the zero point exactly), the scale is applied once per word and
  group (per element, gathered, with act-order g_idx), and with 2-8 rows each nibble is
  dequantized once per tile for all rows. Optional split-K (float32 partials, then a small
  reduce kernel) for matrices with few rows; PDL as the bf16 GEMV. Configurations:
  `W4_GEMV_CONFIGS`.
- `int4_gemm` (more rows, CUDA): Triton tensor-core GEMM that dequantizes each weight tile in
  registers before `tl.dot` (x [BLOCK_M, BLOCK_K] x w^T [BLOCK_K, BLOCK_N]).
- CPU and the reference: `dequantize_int4`, then F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.ops import gemv_gluon
from ferrum.ops.fp8 import MAX_GEMV_ROWS, gemv_rows_config
from ferrum.ops.triton_utils import HAS_TRITON, fit_block, pdl_ok, pdl_start, reduce_splits, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

PACK = 8  # 4-bit values per int32
F32_2P23_BITS = 0x4B000000  # float32 2^23: ORing an integer < 2^23 into its mantissa adds it


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, C * 8] int32 nibbles, nibble j of word c at column 8c + j."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C * 8] integers 0..15 -> [R, C] int32 (inverse of `unpack_int4_rows`)."""
    q = q.to(torch.int64).reshape(q.shape[0], -1, PACK)
    words = (q << torch.arange(0, 32, 4, device=q.device)).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def group_index(K: int, group_size: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:
    """[K] int64: the group of each input feature."""
    if g_idx is not None:
        return g_idx.to(torch.int64)
    return torch.arange(K, device=device) // group_size


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """ferrum's packed layout (module docstring) -> [N, K] float32."""
    q = unpack_int4_rows(qweight).float()
    g = group_index(q.shape[1], group_size, g_idx, q.device)
    return (q - zeros.float()[:, g]) * scales.float()[:, g]


if HAS_TRITON:
    @triton.jit
    def _w4_tile(qw_rows, s_rows, z_rows, g_ptr, k0, n_mask, K, magic, GROUP: tl.constexpr,
                 HAS_GIDX: tl.constexpr, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_N, BLOCK_K] float32 weights for input features k0 .. k0 + BLOCK_K (k0 a
        multiple of 8) of the rows whose base pointers are qw_rows / s_rows / z_rows
        ([BLOCK_N, 1] each); magic: 0x4B000000."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        if EVEN:
            words = tl.load(qw_rows + offs_w[None, :], eviction_policy="evict_first")
        else:
            words = tl.load(qw_rows + offs_w[None, :], mask=n_mask[:, None] & (offs_w * 8 < K)[None, :],
                            other=0, eviction_policy="evict_first")
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)           # [BLOCK_N, BLOCK_K]: the word of each k
        # float(q) as in `_w4_nibble`: ORed into the mantissa of 2^23, the 2^23 folded into z exactly
        q = (((words >> ((offs_k % 8) * 4)[None, :]) & 0xF) | magic).to(tl.float32, bitcast=True)
        if HAS_GIDX:
            g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0)
        else:
            g = offs_k // GROUP
        if EVEN:
            s = tl.load(s_rows + g[None, :]).to(tl.float32)
            z = tl.load(z_rows + g[None, :]).to(tl.float32)
        else:
            gmask = n_mask[:, None] & (offs_k < K)[None, :]
            s = tl.load(s_rows + g[None, :], mask=gmask, other=0.0).to(tl.float32)
            z = tl.load(z_rows + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        return (q - (z + 8388608.0)) * s

    @triton.jit
    def _w4_nibble(words, hi, J: tl.constexpr, magic):
        """float32 2^23 + 16^(J % 4) q_J for nibble J (0..7) of each int32 word (hi = words >> 16):
        the nibble is masked in place, unshifted (bits <= 15, inside the 23-bit mantissa) and
        ORed into `magic` = 0x4B000000, the bits of 2^23, so the float is exact without an
        int->float conversion (I2F is quarter rate on sm_90). `magic` is a kernel argument, not a
        literal: LOP3 takes one immediate, so only a register operand lets ptxas fuse the AND
        and the OR into one LOP3."""
        if J < 4:
            src = words
        else:
            src = hi
        return ((src & (0xF << (4 * (J % 4)))) | magic).to(tl.float32, bitcast=True)

    @triton.jit
    def _w4_x8(x_ptr, k0, K, valid, EVEN: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr):
        """x[k0 + 8 (WG g + w) + j] for j = 0..7 as eight [GT, WG] float32 (0 past K or when not
        `valid`): the input features that nibble j of word (g, w) of the tile multiplies. One
        contiguous [GT, WG, 8] load (16 bytes per word), split in registers."""
        offs = (k0 + 8 * (WG * tl.arange(0, GT)[:, None, None] + tl.arange(0, WG)[None, :, None])
                + tl.arange(0, 8)[None, None, :])
        if EVEN:
            x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=(offs < K) & valid, other=0.0).to(tl.float32)
        x01, x23 = tl.split(tl.reshape(x, (GT, WG, 4, 2)))        # j even / odd
        x0, x2 = tl.split(tl.reshape(x01, (GT, WG, 2, 2)))        # j = 0, 4 / 2, 6
        x1, x3 = tl.split(tl.reshape(x23, (GT, WG, 2, 2)))        # j = 1, 5 / 3, 7
        xa, xe = tl.split(x0)
        xc, xg = tl.split(x2)
        xb, xf = tl.split(x1)
        xd, xh = tl.split(x3)
        return xa, xb, xc, xd, xe, xf, xg, xh

    @triton.jit
    def _w4_group_sz(s_rows, z_rows, g_ptr, k0, n_mask, K, J: tl.constexpr, GROUP: tl.constexpr,
                     HAS_GIDX: tl.constexpr, EVEN: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr):
        """(s * 16^-(J % 4), 2^23 + 16^(J % 4) z) of the group of nibble J of each word of the
        tile, as [BLOCK_N, GT, 1] (one group per g; tiles never straddle groups) or, with g_idx
        (GT == 1), gathered per word, [BLOCK_N, 1, WG]. 2^23 + 16^i z is exact (< 2^24), so
        `_w4_nibble` minus it is 16^i (q - z) exactly: no cancellation."""
        if HAS_GIDX:
            offs_k = k0 + 8 * tl.arange(0, WG) + J
            g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0)[None, None, :]
            gmask = n_mask[:, :, None] & (offs_k < K)[None, None, :]
            s = tl.load(s_rows[:, :, None] + g, mask=gmask, other=0.0).to(tl.float32)
            z = tl.load(z_rows[:, :, None] + g, mask=gmask, other=0.0).to(tl.float32)
        else:
            g = (k0 // GROUP + tl.arange(0, GT))[None, :, None]
            if EVEN:
                s = tl.load(s_rows[:, :, None] + g).to(tl.float32)
                z = tl.load(z_rows[:, :, None] + g).to(tl.float32)
            else:
                gmask = n_mask[:, :, None] & (k0 + GROUP * tl.arange(0, GT) < K)[None, :, None]
                s = tl.load(s_rows[:, :, None] + g, mask=gmask, other=0.0).to(tl.float32)
                z = tl.load(z_rows[:, :, None] + g, mask=gmask, other=0.0).to(tl.float32)
        i: tl.constexpr = J % 4
        return s * (1.0 / (1 << (4 * i))), z * (1 << (4 * i)) + 8388608.0

    @triton.jit
    def _w4_words(qw_rows, k0, n_mask, K, EVEN: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr):
        """[BLOCK_N, GT, WG] int32 words of input features k0 .. k0 + 8 GT WG: word [n, g, w]
        holds features k0 + 8 (WG g + w) + j, j = 0..7, in bits 4j..4j+3."""
        offs_w = k0 // 8 + WG * tl.arange(0, GT)[:, None] + tl.arange(0, WG)[None, :]   # [GT, WG]
        if EVEN:
            return tl.load(qw_rows[:, :, None] + offs_w[None, :, :], eviction_policy="evict_first")
        return tl.load(qw_rows[:, :, None] + offs_w[None, :, :],
                       mask=n_mask[:, :, None] & (offs_w * 8 < K)[None, :, :], other=0,
                       eviction_policy="evict_first")

    @triton.jit
    def _w4_dot1(words, magic, x_ptr, s_rows, z_rows, g_ptr, k0, n_mask, K, GROUP: tl.constexpr,
                 HAS_GIDX: tl.constexpr, EVEN: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr):
        """[BLOCK_N, GT, WG] float32: sum_j w[n, k] x[k] over the 8 features of each word
        ([BLOCK_N, GT, WG] int32, `_w4_words`) and one row of x. Per nibble: one LOP3, one FADD
        (q - z, exact) and one FFMA; without g_idx the scale (and the 16^-i of `_w4_nibble`) is
        applied once per word and i."""
        hi = words >> 16
        xs = _w4_x8(x_ptr, k0, K, True, EVEN, GT, WG)
        acc = tl.zeros(words.shape, dtype=tl.float32)
        for i in tl.static_range(4):
            sc, zz = _w4_group_sz(s_rows, z_rows, g_ptr, k0, n_mask, K, i, GROUP, HAS_GIDX, EVEN, GT, WG)
            lo = (_w4_nibble(words, hi, i, magic) - zz) * xs[i][None, :, :]
            if HAS_GIDX:  # per-word scales
                sc_hi, zz_hi = _w4_group_sz(s_rows, z_rows, g_ptr, k0, n_mask, K, i + 4, GROUP, HAS_GIDX, EVEN,
                                            GT, WG)
                acc += lo * sc + (_w4_nibble(words, hi, i + 4, magic) - zz_hi) * xs[i + 4][None, :, :] * sc_hi
            else:  # nibbles i and i + 4 share the group's scale
                acc += (lo + (_w4_nibble(words, hi, i + 4, magic) - zz) * xs[i + 4][None, :, :]) * sc
        return acc

    @triton.jit
    def _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, J: tl.constexpr, GROUP: tl.constexpr,
                    HAS_GIDX: tl.constexpr, EVEN: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr):
        """[BLOCK_N, GT, WG] float32 weights of nibble J of each word: (q - z) * s (one LOP3, one
        FADD, one FMUL)."""
        sc, zz = _w4_group_sz(s_rows, z_rows, g_ptr, k0, n_mask, K, J, GROUP, HAS_GIDX, EVEN, GT, WG)
        return (_w4_nibble(words, hi, J, magic) - zz) * sc

    @triton.jit
    def _w4_rows_dot(words, magic, x_ptr, stride_xm, M, s_rows, z_rows, g_ptr, k0, n_mask, K, GROUP: tl.constexpr,
                     HAS_GIDX: tl.constexpr, EVEN: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr,
                     BLOCK_M: tl.constexpr):
        """[BLOCK_M, BLOCK_N] float32: rows 0 .. M-1 of x times the tile's weights. Each nibble
        is dequantized once (`_w4_dequant`) and used by every row (one FFMA per row and nibble)."""
        hi = words >> 16
        w = (_w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 0, GROUP, HAS_GIDX, EVEN, GT, WG),
             _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 1, GROUP, HAS_GIDX, EVEN, GT, WG),
             _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 2, GROUP, HAS_GIDX, EVEN, GT, WG),
             _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 3, GROUP, HAS_GIDX, EVEN, GT, WG),
             _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 4, GROUP, HAS_GIDX, EVEN, GT, WG),
             _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 5, GROUP, HAS_GIDX, EVEN, GT, WG),
             _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 6, GROUP, HAS_GIDX, EVEN, GT, WG),
             _w4_dequant(words, hi, magic, s_rows, z_rows, g_ptr, k0, n_mask, K, 7, GROUP, HAS_GIDX, EVEN, GT, WG))
        offs_m = tl.arange(0, BLOCK_M)
        y = tl.zeros((BLOCK_M, words.shape[0]), dtype=tl.float32)
        for mi in tl.static_range(BLOCK_M):
            xs = _w4_x8(x_ptr + mi * stride_xm, k0, K, mi < M, EVEN, GT, WG)
            p = w[0] * xs[0][None, :, :]
            for j in tl.static_range(1, 8):
                p += w[j] * xs[j][None, :, :]
            part = tl.sum(tl.sum(p, axis=2), axis=1)
            y += tl.where(offs_m[:, None] == mi, part[None, :], 0.0)
        return y

    @triton.jit
    def _w4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, M, N, K, K_SPLIT, magic,
                        stride_xm, stride_qn, stride_sn, stride_ym, stride_ys,
                        GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                        EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GT: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
        """Program (pid_n, pid_k): rows pid_n * BLOCK_N.., input features pid_k * K_SPLIT ..
        (K_SPLIT a multiple of BLOCK_K). A tile of BLOCK_K features spans GT quantization
        groups (1 when BLOCK_K <= GROUP or with g_idx). SPLIT_K == 1 writes y [M, N] (+ bias) in y's dtype;
        else float32 partial sums into y [SPLIT_K, M, N] (stride_ys), reduced by
        `triton_utils.reduce_splits`. magic: 0x4B000000 (`_w4_nibble`)."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_m = tl.arange(0, BLOCK_M)
        qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn
        s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn
        z_rows = z_ptr + offs_n[:, None].to(tl.int64) * stride_sn
        n_mask2 = n_mask[:, None]
        k_start = pid_k * K_SPLIT
        k_end = tl.minimum(k_start + K_SPLIT, K)
        WG: tl.constexpr = BLOCK_K // 8 // GT
        words = _w4_words(qw_rows, k_start, n_mask2, K, EVEN, GT, WG)  # first tile: weights only
        if USE_PDL:
            pdl_start()  # x (the previous kernel's output) is ready after this
        if BLOCK_M == 1:  # one row: accumulate per word, reduce once at the end (no shuffles in the loop)
            acc = _w4_dot1(words, magic, x_ptr, s_rows, z_rows, g_ptr, k_start, n_mask2, K, GROUP, HAS_GIDX, EVEN,
                           GT, WG)
            for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
                words = _w4_words(qw_rows, k0, n_mask2, K, EVEN, GT, WG)
                acc += _w4_dot1(words, magic, x_ptr, s_rows, z_rows, g_ptr, k0, n_mask2, K, GROUP, HAS_GIDX, EVEN,
                                GT, WG)
            y = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
        else:  # 2-8 rows: each nibble is dequantized once per tile and used by every row
            y = _w4_rows_dot(words, magic, x_ptr, stride_xm, M, s_rows, z_rows, g_ptr, k_start, n_mask2, K, GROUP,
                             HAS_GIDX, EVEN, GT, WG, BLOCK_M)
            for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
                words = _w4_words(qw_rows, k0, n_mask2, K, EVEN, GT, WG)
                y += _w4_rows_dot(words, magic, x_ptr, stride_xm, M, s_rows, z_rows, g_ptr, k0, n_mask2, K, GROUP,
                                  HAS_GIDX, EVEN, GT, WG, BLOCK_M)
        out_mask = (offs_m < M)[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=out_mask)
        else:
            tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=out_mask)

    @triton.jit
    def _w4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, M, N, K, magic,
                        stride_xm, stride_qn, stride_sn, stride_ym,
                        GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                        EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn
        s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn
        z_rows = z_ptr + offs_n[:, None].to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            w = _w4_tile(qw_rows, s_rows, z_rows, g_ptr, k0, n_mask, K, magic, GROUP, HAS_GIDX, EVEN, BLOCK_K)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _launch_args(x, qweight, scales, zeros, g_idx, bias, y, group_size):
    M, K = x.shape
    N = qweight.shape[0]
    return (x, qweight, scales, zeros, g_idx if g_idx is not None else qweight,
            bias if bias is not None else scales, y, M, N, K, F32_2P23_BITS, x.stride(0), qweight.stride(0),
            scales.stride(0), y.stride(0)), dict(GROUP=group_size, HAS_GIDX=g_idx is not None,
                                                  HAS_BIAS=bias is not None)


# Tuned configurations of `int4_gemv`: (N, K, rows) -> (BLOCK_N, BLOCK_K, num_warps, num_stages,
# SPLIT_K), rows 1 (M == 1) or 4 (2-8 rows), for group size 128 without g_idx; printed by
# `benchmarks/quant_bench.py kernels` (paste its W4_GEMV_CONFIGS here). Shapes not listed take
# `_w4_default_config`.
W4_GEMV_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (4096, 4096, 1): (8, 1024, 4, 3, 1),
    (4096, 4096, 4): (16, 256, 4, 3, 2),
    (4096, 14336, 1): (16, 512, 4, 3, 2),
    (4096, 14336, 4): (16, 256, 4, 3, 2),
    (6144, 4096, 1): (8, 1024, 4, 3, 1),
    (6144, 4096, 4): (16, 512, 4, 3, 1),
    (28672, 4096, 1): (32, 256, 4, 3, 1),
    (28672, 4096, 4): (16, 256, 4, 3, 1),
}


def _w4_default_config(N: int, K: int, M: int) -> tuple[int, int, int, int, int]:
    """Heuristic for shapes without a tuned entry: the FP8 GEMV's tiles (`gemv_rows_config`), one
    K split."""
    bn, bk, warps, stages = gemv_rows_config(N, K, M)
    return bn, bk, warps, stages, 1


def int4_gemv_config(N: int, K: int, M: int, group_size: int,
                     has_g_idx: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) of `int4_gemv` for an [N, K] weight and
    M rows: `W4_GEMV_CONFIGS[(N, K, 1 or 4)]`, else `_w4_default_config`; BLOCK_K is halved
    until it divides K (the unmasked path)."""
    bn, bk, warps, stages, split = W4_GEMV_CONFIGS.get((N, K, 1 if M == 1 else 4)) or _w4_default_config(N, K, M)
    return bn, fit_block(bk, K, 8), warps, stages, split


def _tile_groups(bk: int, group_size: int, has_g_idx: bool) -> tuple[int, int]:
    """(BLOCK_K, GT): a tile of BLOCK_K features covers GT whole quantization groups, or lies
    inside one (GT 1, BLOCK_K shrunk until it divides the group); with g_idx GT is 1."""
    if has_g_idx:
        return bk, 1
    if bk >= group_size and bk % group_size == 0:
        return bk, bk // group_size
    while bk > group_size or group_size % bk:  # bk stays a power of two (a group is a multiple of 8)
        bk //= 2
    return bk, 1


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 8, unit stride along K); packed weight as in the module docstring
    (scales / zeros with unit stride along G; group_size a multiple of 8); bias [N] or None ->
    [M, N] in x's dtype (float32 accumulation). `config` (BLOCK_N, BLOCK_K, warps, stages[,
    SPLIT_K]) overrides `int4_gemv_config`. SPLIT_K > 1 splits K over that many programs per
    row block (more programs for matrices with few rows), whose float32 partial sums a second
    kernel adds."""
    M, K = x.shape
    N = qweight.shape[0]
    assert M <= MAX_GEMV_ROWS and qweight.shape[1] * 8 == K and x.stride(1) == 1 and group_size % 8 == 0
    bn, bk, warps, stages, *split = config or int4_gemv_config(N, K, M, group_size, g_idx is not None)
    bk, gt = _tile_groups(max(bk, 8), group_size, g_idx is not None)
    n_tiles = triton.cdiv(K, bk)
    split = min(split[0] if split else 1, n_tiles)
    k_split = triton.cdiv(n_tiles, split) * bk
    split = triton.cdiv(K, k_split)  # every split non-empty
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    pdl = pdl_ok(x)
    _w4_gemv_kernel[(triton.cdiv(N, bn), split)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales, out, M, N, K, k_split, F32_2P23_BITS, x.stride(0), qweight.stride(0),
        scales.stride(0), N, M * N, GROUP=group_size, HAS_GIDX=g_idx is not None, HAS_BIAS=bias is not None,
        EVEN=N % bn == 0 and K % bk == 0, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=bk,
        GT=gt, SPLIT_K=split, USE_PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y if split == 1 else reduce_splits(out, y, bias, pdl)


def int4_gemm_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of `int4_gemm`."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    return bm, 128 if M > 64 else 64, fit_block(64, K, 16), 4 if bm <= 64 else 8, 3


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """As `int4_gemv` for any number of rows (tensor cores through tl.dot; x 16-bit on GPU)."""
    M, K = x.shape
    N = qweight.shape[0]
    bm, bn, bk, warps, stages = config or int4_gemm_config(M, N, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    args, kw = _launch_args(x, qweight, scales, zeros, g_idx, bias, y, group_size)
    _w4_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        *args, **kw, EVEN=N % bn == 0 and K % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return y


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, g_idx: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + bias with W in ferrum's packed 4-bit layout. x: [T, K]. Dispatch: Triton
    GEMV for T <= 8 (T <= 4 without g_idx: the Gluon GEMV where its tile fits,
    ferrum/ops/gemv_gluon.py), Triton dequant-in-tile GEMM above (CUDA); dequantize + F.linear
    on CPU."""
    if use_triton(x) and x.stride(1) == 1 and x.dtype != torch.float32:
        cfg = None if g_idx is not None or group_size % 32 else gemv_gluon.config_for(
            "w4", x, qweight.shape[0], qweight.shape[1] * 8)
        if cfg is not None:
            return gemv_gluon.w4_gemv(x, qweight, scales, zeros, group_size, bias, cfg)
        if x.shape[0] <= MAX_GEMV_ROWS:
            return int4_gemv(x, qweight, scales, zeros, group_size, g_idx, bias)
        return int4_gemm(x, qweight, scales, zeros, group_size, g_idx, bias)
    w = dequantize_int4(qweight, scales, zeros, group_size, g_idx)
    return F.linear(x, w.to(x.dtype), bias)
