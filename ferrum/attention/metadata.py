"""Per-step attention metadata, set by the model runner before each forward and read by
every attention layer (the "forward context" of nano-vllm / vLLM)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Shapes: T = tokens in the step, B = sequences, M = max blocks per sequence.

    slot_mapping: [T] int64, cache slot of each new token (where its K/V is written).
    block_tables: [B, M] int32, physical block ids (padded with 0 past each table's end).
    seq_lens:     [B] int32, sequence length after this step (context + new tokens).
    For prefill also, as Python lists (the reference backend loops over sequences):
    query_lens:   new tokens per sequence; context_lens: tokens already cached before them.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    query_lens: list[int] | None = None
    context_lens: list[int] | None = None
    cu_seqlens_q: torch.Tensor | None = None


_CURRENT: AttentionMetadata | None = None


@contextmanager
def forward_context(md: AttentionMetadata):
    global _CURRENT
    prev, _CURRENT = _CURRENT, md
    try:
        yield
    finally:
        _CURRENT = prev


def get_attention_metadata() -> AttentionMetadata:
    assert _CURRENT is not None, "attention called outside forward_context"
    return _CURRENT
