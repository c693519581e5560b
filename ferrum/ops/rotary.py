"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer") in the rotate-half ("NeoX")
layout HF Llama/Qwen use: for a head x = [x1 | x2] (halves of head_dim),
out = [x1*cos - x2*sin | x2*cos + x1*sin] with the float32 cos/sin tables of
`ferrum.layers.rotary_embedding.RotaryEmbedding`, rounded to x's dtype. One Triton kernel for
all q and k heads on CUDA (in place), the torch code beside it elsewhere.
"""
from __future__ import annotations

import torch

from ferrum.ops.triton_utils import HAS_TRITON, next_pow2, pdl_ok, pdl_start, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_heads(base, stride_h, cos, sin, offs_d, d_mask, H: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr):
        """Rotate the H heads of one token in place (q or k)."""
        offs_h = tl.arange(0, BLOCK_H)
        m = (offs_h[:, None] < H) & d_mask[None, :]
        p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(p1, mask=m, other=0.0)
        x2 = tl.load(p1 + HALF, mask=m, other=0.0)
        y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
        y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
        tl.store(p1, y1.to(x1.dtype), mask=m)
        tl.store(p1 + HALF, y2.to(x1.dtype), mask=m)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                     HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_PDL: tl.constexpr):
        if USE_PDL:  # see triton_utils.py, PDL
            pdl_start()
        # One program per token: all q and k heads. x = [x1 | x2] (halves of head_dim):
        # out = [x1*cos - x2*sin | x2*cos + x1*sin], in float32, rounded to x's dtype.
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HALF
        cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]

        _rope_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, offs_d, d_mask, HQ, HALF, BLOCK_HQ)
        _rope_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, offs_d, d_mask, HK, HALF, BLOCK_HK)


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch rotation of x [T, H, D] by cos, sin [T, 1, D/2] float32 (the rows of x's
    positions): new tensor in x's dtype, float32 math."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary_emb(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions; returns the rotated (q, k).

    positions: [T] int64 (or int32); q: [T, Hq, D], k: [T, Hk, D] (bf16/fp16/fp32; views such
    as slices of a fused qkv output are fine); cos, sin: [max_position, D/2] float32. The Triton
    path (CUDA, last dims contiguous) rotates q and k in place and returns them; the torch path
    returns new tensors. Callers use the returned pair either way.
    """
    if not use_triton(q) or q.stride(-1) != 1 or k.stride(-1) != 1:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return rotate_torch(q, c, s), rotate_torch(k, c, s)
    T, hq, d = q.shape
    hk = k.shape[1]
    assert k.shape[0] == T and k.shape[2] == d and d % 2 == 0, (q.shape, k.shape)
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride() and cos.shape[-1] == d // 2
    if T > 0:
        _rope_kernel[(T,)](
            q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            HQ=hq, HK=hk, HALF=d // 2, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk),
            BLOCK_D=next_pow2(d // 2), USE_PDL=pdl_ok(q), num_warps=4 if hq * d >= 2048 else 1,
            launch_pdl=pdl_ok(q))
    return q, k
