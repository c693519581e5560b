"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer") in the rotate-half ("NeoX")
layout HF Llama/Qwen use: for a head x = [x1 | x2] (halves of head_dim),
out = [x1*cos - x2*sin | x2*cos + x1*sin] with the float32 cos/sin tables of
`ferrum.layers.rotary_embedding.RotaryEmbedding`, rounded to x's dtype. One Triton kernel for
all q and k heads on CUDA (in place: `ferrum.ops.rope_kv`, which also fuses the q/k norm and
the KV store), the torch code beside it elsewhere.
"""
from __future__ import annotations

import torch

from ferrum.ops.rope_kv import rotate_qk
from ferrum.ops.triton_utils import use_triton

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
        rotate_qk(positions, q, k, cos, sin)   # the fused kernel's RoPE-only variant
    return q, k
