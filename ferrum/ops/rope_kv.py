"""The step between the qkv projection and attention, fused per token on CUDA: the optional
per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE on q and k, and the store of K/V into the paged
cache. Unfused that is up to four launches a layer (q norm, k norm, RoPE, KV store), each a
few microseconds on a decode step's dependency chain; fused it is one.

The rounding steps are the unfused ops': the norm rounds as `ferrum.ops.rms_norm` (Llama:
normalised value rounded to the input dtype, then times the weight) or as Gemma's module (times
1 + w in float32, then rounded), RoPE as `ferrum.ops.rotary` (float32 math on the rounded norm
output, rounded to the input dtype), the store as `write_kv` of the Triton backend (FP8: divided
by the layer's scale and saturated at +-448). Only the order of the norm's float32 sum of squares
differs, so results agree to about 1e-6 in float32 and within one ulp in 16 bits (bf16 matched
bit for bit in the tests, tests/test_triton_kernels.py check_rope_kv).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ferrum.ops.triton_utils import HAS_TRITON, next_pow2, pdl_ok, pdl_start

if HAS_TRITON:
    import triton
    import triton.language as tl

# Norm kinds the kernel computes (`RMSNorm.kernel_kind`); any other module is applied unfused.
_NORM_KINDS = {None: 0, "rms": 1, "gemma_rms": 2}


@dataclass
class RopeInputs:
    """What rotates this step's q and k before they are cached: positions [T] int64, the
    layer's RotaryEmbedding (cos / sin tables [max_position, D/2] float32, called as
    rotary_emb(positions, q, k)) and its per-head q / k norm modules (None: no q/k norm)."""
    positions: torch.Tensor
    rotary_emb: nn.Module
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused ops: q [T, H, D], k [T, Hkv, D] -> normed and rotated (q, k)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary_emb(self.positions, q, k)

    def apply_and_store(self, write_kv, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
                        v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused path of a backend's rope_write_kv: `apply`, then the backend's
        `write_kv` (the FP8 scales passed by keyword, only when set); returns (q, k)."""
        q, k = self.apply(q, k)
        write_kv(kv_cache, k, v, slot_mapping, **({} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)))
        return q, k


if HAS_TRITON:
    @triton.jit
    def _norm_rope_heads(base, stride_h, w_ptr, cos, sin, eps, H: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
        """Norm (NORM 1: Llama's RMSNorm, 2: Gemma's) and rotate the H heads of one token in
        place; returns the rotated halves in the input dtype and their mask."""
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HALF
        m = (offs_h[:, None] < H) & d_mask[None, :]
        p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(p1, mask=m, other=0.0)
        x2 = tl.load(p1 + HALF, mask=m, other=0.0)
        dtype = x1.dtype
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if NORM > 0:
            rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
            w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            if NORM == 1:  # round the normalised value, then weight * it, rounded (rms_norm)
                a = ((a * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
                b = ((b * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
            else:          # Gemma: x / rms * (1 + w) in float32, rounded once
                a = (a * rstd * (1.0 + w1)).to(dtype).to(tl.float32)
                b = (b * rstd * (1.0 + w2)).to(dtype).to(tl.float32)
        y1 = (a * cos - b * sin).to(dtype)
        y2 = (b * cos + a * sin).to(dtype)
        tl.store(p1, y1, mask=m)
        tl.store(p1 + HALF, y2, mask=m)
        return y1, y2, m

    @triton.jit
    def _store_cache(dst, x1, x2, scale_ptr, m, HALF: tl.constexpr, FP8: tl.constexpr):
        """Store a token's K or V halves at dst, cast to the cache dtype (FP8: divided by the
        layer's scale and saturated at +-448, as write_kv)."""
        ty = dst.dtype.element_ty
        if FP8:
            s = tl.load(scale_ptr)
            tl.store(dst, tl.clamp(x1.to(tl.float32) / s, -448.0, 448.0).to(ty), mask=m)
            tl.store(dst + HALF, tl.clamp(x2.to(tl.float32) / s, -448.0, 448.0).to(ty), mask=m)
        else:
            tl.store(dst, x1.to(ty), mask=m)
            tl.store(dst + HALF, x2.to(ty), mask=m)

    @triton.jit
    def _norm_rope_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                             kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, eps,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_cos, stride_cblk, stride_cslot, stride_ch,
                             PAGE: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                             BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                             NORM: tl.constexpr, FP8: tl.constexpr, STORE_KV: tl.constexpr,
                             USE_PDL: tl.constexpr):
        # One program per token: q's and k's heads normed and rotated in place, then (STORE_KV)
        # K and V into the token's cache slot (slot < 0: a padded CUDA-graph row, not stored).
        if USE_PDL:  # see triton_utils.py, PDL
            pdl_start()
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HALF
        cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
        _norm_rope_heads(q_ptr + t * stride_qt, stride_qh, qw_ptr, cos, sin, eps, HQ, HALF, BLOCK_HQ, BLOCK_D, NORM)
        k1, k2, m = _norm_rope_heads(k_ptr + t * stride_kt, stride_kh, kw_ptr, cos, sin, eps, HK, HALF,
                                     BLOCK_HK, BLOCK_D, NORM)
        slot = tl.load(slot_ptr + t).to(tl.int64) if STORE_KV else -1
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_HK)
            src_v = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            v1 = tl.load(src_v, mask=m)
            v2 = tl.load(src_v + HALF, mask=m)
            dst = (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_cslot + offs_h[:, None] * stride_ch + offs_d[None, :]
            _store_cache(kc_ptr + dst, k1, k2, ks_ptr, m, HALF, FP8)
            _store_cache(vc_ptr + dst, v1, v2, vs_ptr, m, HALF, FP8)


def _norm_kind(rope: RopeInputs, dtype: torch.dtype) -> int | None:
    """The kernel's NORM constant for rope's q/k norms, or None when the kernel cannot compute
    them (another norm module, weights in another dtype than q)."""
    if rope.q_norm is None:
        return 0
    # the class's own kernel_kind only: a subclass that changes forward() is not the kernel's math
    kind = type(rope.q_norm).__dict__.get("kernel_kind", "?")
    if kind not in _NORM_KINDS or type(rope.k_norm).__dict__.get("kernel_kind", "?") != kind:
        return None
    if rope.q_norm.weight.dtype != dtype or rope.k_norm.weight.dtype != dtype or rope.q_norm.eps != rope.k_norm.eps:
        return None
    return _NORM_KINDS[kind]


def norm_rope_write_kv(kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor, rope: RopeInputs, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One Triton launch: q [T, H, D] and k [T, Hkv, D] normed (rope's q/k norms) and rotated in
    place, then k and v [T, Hkv, D] stored at `slot_mapping` [T] (int64 / int32; < 0 skipped)
    of kv_cache [2, num_blocks, block_size, Hkv, D] (last dim contiguous, written through its
    strides; float8_e4m3fn with k_scale /
    v_scale [1] float32). q, k, v may be views (last dim contiguous), all in one 16/32-bit
    dtype. Returns (q, k), or None when these inputs need the unfused ops (`RopeInputs.apply`
    then the backend's write_kv): a norm the kernel does not compute, odd head_dim, strides."""
    T, hq, d = q.shape
    hk = k.shape[1]
    cos, sin = rope.rotary_emb.cos, rope.rotary_emb.sin
    norm = _norm_kind(rope, q.dtype)
    if (norm is None or d % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
            or not (q.dtype == k.dtype == v.dtype) or kv_cache.stride(-1) != 1
            or cos.shape[-1] != d // 2 or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        return None
    if T == 0:
        return q, k
    kc, vc = kv_cache[0], kv_cache[1]
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    weights = (rope.q_norm.weight, rope.k_norm.weight) if norm else (q, q)
    eps = rope.q_norm.eps if norm else 0.0
    pdl = pdl_ok(q)
    _norm_rope_kv_kernel[(T,)](
        q, k, v, rope.positions, cos, sin, *weights, kc, vc, slot_mapping,
        *((k_scale, v_scale) if fp8 else (cos, cos)), eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        PAGE=kc.shape[1], HQ=hq, HK=hk, HALF=d // 2, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk), BLOCK_D=next_pow2(d // 2),
        NORM=norm, FP8=fp8, STORE_KV=True, USE_PDL=pdl, num_warps=4 if hq * d >= 2048 else 1, launch_pdl=pdl)
    return q, k


def rotate_qk(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
    """RoPE alone, in place, one launch (the kernel above without norm and store):
    positions [T]; q [T, H, D], k [T, Hkv, D] (last dims contiguous); cos, sin [max_position,
    D/2] float32 (`ferrum.ops.rotary.apply_rotary_emb` checks the shapes)."""
    T, hq, d = q.shape
    hk = k.shape[1]
    pdl = pdl_ok(q)
    _norm_rope_kv_kernel[(T,)](
        q, k, k, positions, cos, sin, q, q, q, q, positions, cos, cos, 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0, cos.stride(0), 0, 0, 0,
        PAGE=1, HQ=hq, HK=hk, HALF=d // 2, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk), BLOCK_D=next_pow2(d // 2),
        NORM=0, FP8=False, STORE_KV=False, USE_PDL=pdl, num_warps=4 if hq * d >= 2048 else 1, launch_pdl=pdl)
