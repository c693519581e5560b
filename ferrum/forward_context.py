"""What the model runner hands every attention layer for one forward pass (the "forward
context" of nano-vllm / vLLM): the step's attention metadata and the attention backend.

The runner enters `forward_context(...)` around the model's forward; `Attention.forward`
reads `get_forward_context()`. Nothing else in the model sees it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache. Shapes: T = tokens in the step,
    B = sequences, M = max blocks per sequence.

    slot_mapping: [T] int64, cache slot of each new token (where its K/V is written); -1 =
        padded CUDA-graph row (nothing written).
    block_tables: [B, M] int32/int64, physical block ids (padded with 0 past each table's end).
    seq_lens:     [B] int32/int64, sequence length after this step (context + new tokens).
    max_seq_len:  max of seq_lens (host int), or the graphs' capacity under CUDA graphs.
    query_lens / context_lens: new tokens per sequence / tokens cached before them, as Python
        lists (prefill; eager decode too; None under CUDA graphs).
    cu_seqlens_q: [B+1] int64 on the device, prefix sums of query_lens (prefill).
    decode_plan: filled by the torch backend's first layer of a decode step, reused by the
        others (`ferrum.ops.attention_torch`): a dict by sliding window (None: full attention).
    csr_plan: the same for the torch backend's batched decode (`attention_torch._csr_plan`),
        a dict by (heads, KV heads, sliding window).
    prefill_plan: filled by the Triton backend's first layer of an eager prefill step: which
        sequences take scaled_dot_product_attention (`attention_triton._prefill_plan`), a dict
        by (sliding window, `KERNELS.sdpa_prefill_min_tokens`).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    query_lens: list[int] | None = None
    context_lens: list[int] | None = None
    cu_seqlens_q: torch.Tensor | None = None
    decode_plan: dict | None = None
    csr_plan: dict | None = None
    prefill_plan: dict | None = None

    def last_tokens_only(self) -> "AttentionMetadata":
        """This prefill step's metadata for a chunk of one query per sequence, its last token
        (position seq_len - 1, keys 0 .. seq_len - 1, read from the cache unless it is the
        sequence's only token): what the last layer needs when only those rows are sampled.
        A prefill, not a decode, so that the kernels and their compiled variants are the ones
        this step's other layers run (the decode kernels' split count would vary with the
        batch and block-table width, each value a compile on first use)."""
        B = len(self.query_lens)
        ctx = None if self.context_lens is None else [
            c + q - 1 for c, q in zip(self.context_lens, self.query_lens)]
        return AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                                 seq_lens=self.seq_lens, max_seq_len=self.max_seq_len, query_lens=[1] * B,
                                 context_lens=ctx,
                                 cu_seqlens_q=torch.arange(B + 1, dtype=torch.int64, device=self.seq_lens.device))


@dataclass
class ForwardContext:
    """attn_metadata: this step's `AttentionMetadata`. attn_backend: the paged attention
    module every layer calls (`ferrum.ops.attention_torch` or `ferrum.ops.attention_triton`:
    `rope_write_kv`, `write_kv`, `prefill_attention`, `decode_attention`), chosen once by the
    model runner."""

    attn_metadata: AttentionMetadata
    attn_backend: ModuleType


_CURRENT: ForwardContext | None = None


@contextmanager
def forward_context(attn_metadata: AttentionMetadata, attn_backend: ModuleType):
    """Make (attn_metadata, attn_backend) the context of the forward pass run inside the
    `with` block; the previous context is restored on exit (also on an exception)."""
    global _CURRENT
    prev, _CURRENT = _CURRENT, ForwardContext(attn_metadata, attn_backend)
    try:
        yield
    finally:
        _CURRENT = prev


def get_forward_context() -> ForwardContext:
    """The context set by the enclosing `forward_context`. Raises AssertionError outside one."""
    assert _CURRENT is not None, "attention called outside forward_context"
    return _CURRENT
