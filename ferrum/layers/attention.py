"""Attention layer over the paged KV cache. Writes this step's K/V into the slots of the
slot mapping, then attends through the block table (ferrum/attention/ backends)."""
from __future__ import annotations

import torch
from torch import nn

from ferrum.attention import torch_backend
from ferrum.attention.metadata import get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the model runner.
        self.kv_cache = torch.empty(0)
        self.backend = torch_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        md = get_attention_metadata()
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(self.kv_cache, k, v, md.slot_mapping)
        if md.is_prefill:
            o = self.backend.prefill_attention(q, self.kv_cache, md, self.scale, k, v)
        else:
            o = self.backend.decode_attention(q, self.kv_cache, md, self.scale)
        return o.reshape(T, self.num_heads * self.head_dim)
