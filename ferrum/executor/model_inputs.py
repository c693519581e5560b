"""Input preparation for one forward pass: token ids, positions and `AttentionMetadata` from
the sequences' block tables (`KvCacheHandle`), built on the host and copied to the device.
The eager paths of `ModelRunner` use these; the CUDA-graph path fills its static buffers
itself (`ferrum.executor.cuda_graph`).

Slot of position p of a sequence: `block_table[p // block_size] * block_size + p % block_size`
(vLLM's slot mapping, `ferrum.interfaces`).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from ferrum.forward_context import AttentionMetadata
from ferrum.interfaces import KvCacheHandle


def block_tables(kv: list[KvCacheHandle]) -> torch.Tensor:
    """[B, M] int64 on the host: each sequence's block table padded with 0 to the longest."""
    lens = [len(h.block_table) for h in kv]
    M = max(lens)
    if min(lens) == M:   # one flat list through numpy: torch.tensor on nested lists is slow
        flat = np.fromiter(itertools.chain.from_iterable(h.block_table for h in kv), dtype=np.int64,
                           count=len(kv) * M)
        return torch.from_numpy(flat.reshape(len(kv), M))
    table = np.zeros((len(kv), M), dtype=np.int64)
    for row, h, n in zip(table, kv, lens):
        row[:n] = h.block_table
    return torch.from_numpy(table)


def slot_mapping(bt: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """[T] int64: the cache slot of token t, at position pos[t] of sequence seq_idx[t], through
    the block tables bt [B, M]."""
    return bt[seq_idx, pos // block_size] * block_size + pos % block_size


def prepare_prefill(token_ids: list[list[int]], kv: list[KvCacheHandle], block_size: int,
                    device: torch.device):
    """Inputs of a prefill step: chunk i of `token_ids` (>= 1 tokens) continues sequence i
    after its kv[i].num_tokens cached tokens.

    Returns (input_ids [T] int64 on device, positions [T] int64 on the host, attn_metadata with
    device tensors and host query/context lengths, cu_seqlens [B+1] int64 on the host)."""
    qlens = [len(t) for t in token_ids]
    ctx = [h.num_tokens for h in kv]
    bt = block_tables(kv)
    seq_idx = torch.repeat_interleave(torch.arange(len(kv)), torch.tensor(qlens))
    starts = torch.tensor(ctx)
    cu = torch.zeros(len(kv) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(qlens), 0)
    pos = starts[seq_idx] + torch.arange(cu[-1].item()) - cu[:-1][seq_idx]
    # every copy non_blocking: a blocking host-to-device copy waits for the whole stream (on
    # CUDA, a decode step still running under async scheduling, or this forward's own kernels)
    attn_metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=slot_mapping(bt, seq_idx, pos, block_size).to(device, non_blocking=True),
        block_tables=bt.to(device, non_blocking=True),
        seq_lens=torch.tensor([c + q for c, q in zip(ctx, qlens)], dtype=torch.int32).to(device, non_blocking=True),
        max_seq_len=max(c + q for c, q in zip(ctx, qlens)),
        query_lens=qlens, context_lens=ctx, cu_seqlens_q=cu.to(device, non_blocking=True))
    # through numpy: torch.tensor on a long int list is slow, and this is on the path to the first token
    flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=int(cu[-1]))
    ids = torch.from_numpy(flat).to(device, non_blocking=True)
    return ids, pos, attn_metadata, cu


def prepare_decode(token_ids: list[int], kv: list[KvCacheHandle], block_size: int,
                   device: torch.device):
    """Inputs of an eager decode step: token_ids[i] sits at position kv[i].num_tokens.

    Returns (input_ids [B] int64 on device, positions [B] int64 on the host, attn_metadata
    with device tensors and host context lengths)."""
    B = len(kv)
    bt = block_tables(kv)
    pos = torch.tensor([h.num_tokens for h in kv], dtype=torch.int64)
    attn_metadata = AttentionMetadata(
        is_prefill=False,
        slot_mapping=slot_mapping(bt, torch.arange(B), pos, block_size).to(device, non_blocking=True),
        block_tables=bt.to(device, non_blocking=True),
        seq_lens=(pos + 1).to(device, non_blocking=True),
        max_seq_len=int(pos.max()) + 1,
        query_lens=[1] * B, context_lens=[h.num_tokens for h in kv])
    ids = torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True)
    return ids, pos, attn_metadata


def take_prev_sampled(ids: torch.Tensor, prev: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Async scheduling: ids [B] with row i replaced by prev[rows[i]] where rows[i] >= 0 (the
    previous step's sampled ids, still on the device; all three tensors on one device)."""
    return torch.where(rows >= 0, prev[rows.clamp(min=0)], ids)


class PinnedStaging:
    """Host staging rows for the CUDA-graph paths' one-copy inputs: `count` int64 buffers of
    `shape`, pinned on CUDA so each copy is one async DMA, used in turn. `next()` returns the
    next buffer (as a tensor and the numpy view of the same memory) once the copy that last
    read it has run: nothing else guarantees that, since a caller may queue steps without
    waiting for their outputs (the GPU then runs several steps behind the host, and an
    overwritten buffer would feed a queued copy the wrong step's inputs). `to_device(buf)`
    queues the copy and records when it has run."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, count: int = 2):
        pin = device.type == "cuda"
        self.device = device
        self.buffers = torch.zeros(count, *shape, dtype=torch.int64, pin_memory=pin)
        self.arrays = self.buffers.numpy()    # same memory
        self.copied = [torch.cuda.Event() if pin else None for _ in range(count)]
        self.used = [False] * count
        self.turn = 0

    def next(self):
        """(tensor, numpy array) of the next staging buffer, free to overwrite."""
        self.turn = (self.turn + 1) % len(self.buffers)
        if self.used[self.turn] and self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()   # normally long done: returns at once
        return self.buffers[self.turn], self.arrays[self.turn]

    def to_device(self, buf: torch.Tensor) -> torch.Tensor:
        """Queue the copy of `buf` (a view of the current buffer) to the device."""
        dev = buf.to(self.device, non_blocking=True)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].record()
        self.used[self.turn] = True
        return dev
