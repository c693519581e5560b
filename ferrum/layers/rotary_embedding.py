"""Rotary position embedding (RoPE, Su et al. 2021) in the rotate-half ("NeoX") layout that
HF Llama/Qwen use: x -> x*cos + rotate_half(x)*sin, with cos/sin tables cached per position.

`rope_scaling` (the HF dict, `rope_type` one of config.SUPPORTED_ROPE_TYPES) rescales the
inverse frequencies, following transformers' `modeling_rope_utils`:
- llama3: Meta's Llama 3.1 reference (`apply_scaling`): low frequencies divided by `factor`,
  high frequencies kept, a smooth ramp between `low_freq_factor` and `high_freq_factor`.
- linear: every frequency divided by `factor` (positions interpolated).
- yarn (Peng et al. 2023, arXiv:2309.00071): interpolation below / extrapolation above a ramp
  between the dimensions that rotate `beta_slow` and `beta_fast` times over the original
  context, and cos/sin scaled by the attention factor 0.1 ln(factor) + 1.
- longrope (Phi-3, "su"): per-frequency divisors `short_factor` or `long_factor` and cos/sin
  scaled by sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original. One set
  serves the whole run, as in vLLM: long when the engine's max_model_len exceeds the original
  context, else short (HF switches per forward call, which would mix both in one KV cache).
- gguf_rope_freqs (ours): a GGUF's `rope_freqs.weight`, per-frequency divisors that
  llama.cpp's converter precomputes from Llama 3.1's llama3 scaling."""
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, rs: dict, head_dim: int, base: float,
                   max_position: int) -> tuple[torch.Tensor, float]:
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_position / orig
    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over orig
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attn)


def _longrope_inv_freq(inv_freq: torch.Tensor, rs: dict, max_position: int,
                       max_model_len: int) -> tuple[torch.Tensor, float]:
    orig = rs["original_max_position_embeddings"]
    factors = rs["long_factor"] if max_model_len > orig else rs["short_factor"]
    ext = torch.tensor(factors, dtype=torch.float64)
    if ext.shape != inv_freq.shape:
        from ferrum.errors import UnsupportedModelError
        raise UnsupportedModelError(f"longrope factors have {ext.numel()} entries, expected "
                                    f"head_dim / 2 = {inv_freq.numel()}")
    factor = rs.get("factor") or max_position / orig
    attn = rs.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv_freq / ext, float(attn)


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None,
                  max_position: int = 4096, max_model_len: int | None = None
                  ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] float64, attention factor multiplying cos/sin) for one
    RoPE variant (module docstring). max_position: the config's max_position_embeddings;
    max_model_len: the engine's context limit (default max_position)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rtype = (rope_scaling or {}).get("rope_type", "default")
    if rtype == "default":
        return inv_freq, 1.0
    if rtype == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling), 1.0
    if rtype == "linear":
        return inv_freq / rope_scaling["factor"], 1.0
    if rtype == "yarn":
        return _yarn_inv_freq(inv_freq, rope_scaling, head_dim, base, max_position)
    if rtype == "longrope":
        return _longrope_inv_freq(inv_freq, rope_scaling, max_position, max_model_len or max_position)
    if rtype == "gguf_rope_freqs":  # llama.cpp: theta_i = pos * inv_freq_i / rope_freqs[i]
        return inv_freq / torch.tensor(rope_scaling["freq_divisors"], dtype=torch.float64), 1.0
    from ferrum.errors import UnsupportedModelError
    raise UnsupportedModelError(f"rope scaling type {rtype!r} is not supported")


class RotaryEmbedding(nn.Module):
    """cos / sin tables [N, head_dim / 2] float32 for positions 0..N-1, for one RoPE variant
    (`rope_inv_freq`; scaled by its attention factor), computed in float64; one instance is
    shared by all layers of a model that use that variant.

    max_position: the config's max_position_embeddings, which the scaling formulas read;
    max_model_len: the engine's context limit. N is max_model_len (the positions the engine
    can use; no more than max_position), else max_position: a 1M-context config served at 4k
    positions keeps 4k rows, not 0.5 GB of them."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 max_model_len: int | None = None):
        super().__init__()
        freq, attn = rope_inv_freq(head_dim, base, rope_scaling, max_position, max_model_len)
        t = torch.arange(min(max_model_len or max_position, max_position), dtype=torch.float64)
        freqs = torch.outer(t, freq)
        # [N, head_dim/2] each; kept in float32 so bf16 models rotate accurately.
        self.register_buffer("cos", (freqs.cos() * attn).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attn).float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T] int64; q: [T, Hq, D]; k: [T, Hk, D] -> rotated (q, k), same dtypes
        (on CUDA rotated in place: `ferrum.ops.rotary.apply_rotary_emb`)."""
        return apply_rotary_emb(positions, q, k, self.cos, self.sin)
