"""Rotary position embedding (RoPE, Su et al. 2021) in the rotate-half ("NeoX") layout that
HF Llama/Qwen use: x -> x*cos + rotate_half(x)*sin, with cos/sin tables cached per position.

`rope_scaling={"rope_type": "llama3", ...}` rescales inverse frequencies as in Meta's Llama
3.1 reference (`apply_scaling`): low frequencies divided by `factor`, high frequencies kept,
a smooth ramp between `low_freq_factor` and `high_freq_factor`."""
from __future__ import annotations

import math

import torch
from torch import nn

from ferrum.ops.rotary import apply_rotary_emb


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    factor = rope_scaling["factor"]
    low = rope_scaling.get("low_freq_factor", 1.0)
    high = rope_scaling.get("high_freq_factor", 4.0)
    old_len = rope_scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """cos / sin tables [max_position, head_dim / 2] float32 for inverse frequencies
    base^(-2i / head_dim) (llama3-rescaled when `rope_scaling` says so), computed in float64;
    one instance is shared by all layers of a model."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if rope_scaling:
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # [max_position, head_dim/2] each; kept in float32 so bf16 models rotate accurately.
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T] int64; q: [T, Hq, D]; k: [T, Hk, D] -> rotated (q, k), same dtypes
        (on CUDA rotated in place: `ferrum.ops.rotary.apply_rotary_emb`)."""
        return apply_rotary_emb(positions, q, k, self.cos, self.sin)
