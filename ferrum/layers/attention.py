"""Attention layer over the paged KV cache: norms and rotates q / k when given the layer's
RoPE (`RopeInputs`), writes this step's K/V into the slots of the slot mapping (one kernel with
the rotation on CUDA), then attends through the block table, with the backend the model runner
chose (`ferrum.forward_context`)."""
from __future__ import annotations

import torch
from torch import nn

from ferrum.errors import WeightLoadError
from ferrum.forward_context import get_forward_context
from ferrum.ops import act_quant
from ferrum.ops.rope_kv import RopeInputs


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention of one decoder layer (this rank's heads).
    `kv_cache` [2, num_blocks, block_size, num_kv_heads, head_dim] is bound by the model
    runner (`ModelRunner.allocate_kv_cache`). `sliding_window` W: each query sees only the last
    W positions up to its own (Mistral, Gemma 3's local layers); None: the whole context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window
        self.kv_cache = torch.empty(0)
        # FP8 KV cache: K / V are stored divided by these per-layer scales (device tensors, so
        # a captured CUDA graph reads their current value); 1.0 as vLLM without calibration,
        # else the checkpoint's (`load_kv_scale`)
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def load_kv_scale(self, which: str, value: torch.Tensor, name: str = "") -> None:
        """Set buffer `which` (k_scale | v_scale) from a checkpoint's per-tensor FP8 KV scale
        `value` (one element, any float dtype; checkpoint tensor `name` for errors). The same
        on every TP rank. Raises WeightLoadError for a per-channel / per-head scale (ferrum's
        FP8 cache has one scale per layer) or a value that is not finite and positive."""
        if value.numel() != 1:
            raise WeightLoadError(f"{name}: FP8 KV cache scale of shape {tuple(value.shape)}; only per-tensor "
                                  "(one value per layer) scales are supported")
        v = float(value.float().reshape(()))
        if not (v > 0 and v < float("inf")):
            raise WeightLoadError(f"{name}: FP8 KV cache scale {v} is not a positive finite number")
        getattr(self, which).fill_(v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                last_rows: torch.Tensor | None = None, rope: RopeInputs | None = None) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D] in q's dtype. rope: q and k are normed and
        rotated here first, with the K/V store (`rope_write_kv`: one kernel on CUDA); None: q
        and k come rotated. In a prefill, last_rows [B] int64 = the row of each chunk's last
        token, in order: every row's K/V is written, but only those rows attend
        (`AttentionMetadata.last_tokens_only`) -> [B, H*D]."""
        context = get_forward_context()
        attn_metadata, backend = context.attn_metadata, context.attn_backend
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        fp8 = self.kv_cache.dtype == torch.float8_e4m3fn
        kw = dict(k_scale=self.k_scale, v_scale=self.v_scale) if fp8 else {}
        if rope is not None:
            q, k = backend.rope_write_kv(self.kv_cache, q, k, v, attn_metadata.slot_mapping, rope, **kw)
        else:
            backend.write_kv(self.kv_cache, k, v, attn_metadata.slot_mapping, **kw)
        if self.sliding_window:
            kw["sliding_window"] = self.sliding_window
        if last_rows is not None:
            assert attn_metadata.is_prefill, "last_rows is for prefill steps"
            # (k, v of those rows: a one-token prompt's only key)
            o = backend.prefill_attention(q.index_select(0, last_rows), self.kv_cache,
                                          attn_metadata.last_tokens_only(), self.scale,
                                          k.index_select(0, last_rows), v.index_select(0, last_rows), **kw)
        elif attn_metadata.is_prefill:
            o = backend.prefill_attention(q, self.kv_cache, attn_metadata, self.scale, k, v, **kw)
        else:
            o = backend.decode_attention(q, self.kv_cache, attn_metadata, self.scale, **kw)
        out = o.reshape(o.shape[0], self.num_heads * self.head_dim)
        return act_quant.carry(o, out)  # the integer copy a Q4_K / 4-bit o_proj reads, onto the reshaped view
