"""Builds the model on one device (one TP rank), owns its paged KV cache, and runs one
forward pass for a prefill batch or a decode batch. Used by the single-device executor and by
every rank of the tensor-parallel executor."""
from __future__ import annotations

import logging
import os

import torch

from ferrum.attention.metadata import AttentionMetadata, forward_context
from ferrum.config import ModelConfig
from ferrum.interfaces import KvCacheHandle
from ferrum.ops.cpu_blas import cpu_blas_forward
from ferrum.loader.base import ModelSource
from ferrum.loader.model_loader import init_dummy_weights, load_weights
from ferrum.models.registry import get_model_class

log = logging.getLogger("ferrum")


def _column_major_weights(model: torch.nn.Module) -> None:
    """CPU only: store every F.linear weight [out, in] with out >= in column-major (an [in, out]
    buffer; same shape, values and dtype, only strides change), so y = x W^T is a plain
    x @ (W^T) GEMM. MKL runs the usual transposed-B form through a slow path when x has 1-2
    rows: on the 2-core AMD EPYC dev box (1 thread) a SmolLM2 batch-1 decode step took 57 ms
    row-major vs 40 ms this way; at batch >= 4 it is 5-10% slower, and for out < in (down_proj)
    row-major is faster at every batch, so those stay. A tied embedding shares the LM head's
    buffer: its row lookups become strided (~25 ms per 2048 prompt tokens for SmolLM2).
    Disable with FERRUM_CPU_COLUMN_MAJOR_WEIGHTS=0."""
    from ferrum.layers.linear import LinearBase
    from ferrum.layers.vocab_embedding import ParallelLMHead
    for mod in model.modules():
        if isinstance(mod, (LinearBase, ParallelLMHead)):
            w = mod.weight
            if w.dim() == 2 and w.shape[0] >= w.shape[1] and w.is_contiguous():
                w.data = w.data.t().contiguous().t()


def take_prev_sampled(ids: torch.Tensor, prev: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """ids [B] with row i replaced by prev[rows[i]] where rows[i] >= 0 (all on one device)."""
    return torch.where(rows >= 0, prev[rows.clamp(min=0)], ids)


class ModelRunner:
    def __init__(self, source: ModelSource, device: str, dtype: torch.dtype,
                 load_format: str = "auto", seed: int = 0, progress: bool = True):
        self.cfg: ModelConfig = source.config
        self.device = torch.device(device)
        self.dtype = dtype
        cls = get_model_class(self.cfg)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with self.device:
                self.model = cls(self.cfg).eval()
        finally:
            torch.set_default_dtype(prev)
        if load_format == "dummy" or source.fmt == "dummy":
            init_dummy_weights(self.model, seed)
        else:
            load_weights(self.model, source.weights(), progress=progress)
        if self.device.type == "cpu" and os.environ.get("FERRUM_CPU_COLUMN_MAJOR_WEIGHTS", "1") != "0":
            _column_major_weights(self.model)
        self.attn_layers = [m for m in self.model.modules() if m.__class__.__name__ == "Attention"]
        # CPU fp32, one process: linears run on numpy's BLAS (ferrum/ops/cpu_blas.py)
        from ferrum.distributed.parallel_state import get_tp
        self.tp = get_tp()
        self.cpu_blas = self.device.type == "cpu" and dtype == torch.float32 and self.tp.size == 1
        self.block_size = 16
        self.num_blocks = 0
        self.graphs = None
        if self.device.type == "cuda":
            from ferrum.attention import triton_backend
            for layer in self.attn_layers:
                layer.backend = triton_backend

    def release(self) -> None:
        """Drop graphs, KV cache and weights so the device memory is free at once."""
        self.graphs = None
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0)
        self.attn_layers = []
        self.model = None
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode graphs for batch sizes up to max_num_seqs (all TP ranks together)."""
        from ferrum.executor.cuda_graph import DecodeCudaGraphs, graph_batch_sizes
        self.graphs = DecodeCudaGraphs(self, graph_batch_sizes(max_num_seqs),
                                       -(-max_model_len // self.block_size))

    def graph_replay_stats(self, bs: int, iters: int = 50, profile_steps: int = 0) -> dict | None:
        """See DecodeCudaGraphs.replay_stats; None without graphs (eager / CPU)."""
        if self.graphs is None or bs not in self.graphs.graphs:
            return None
        return self.graphs.replay_stats(bs, iters, profile_steps)

    def enable_symm_mem_all_reduce(self, allowed: bool = True) -> bool:
        """Every rank gets the same `allowed` (rank 0 decides, see symm_mem.py)."""
        from ferrum.distributed.parallel_state import get_tp
        from ferrum.distributed.symm_mem import try_enable_symm_mem
        if not allowed or os.environ.get("FERRUM_DISABLE_SYMM_MEM") == "1":
            return False
        tp = get_tp()
        return tp.size > 1 and try_enable_symm_mem(tp.group, self.device, self.dtype)

    # ---- KV cache ---------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One [2, num_blocks, block_size, kv_heads_per_rank, head_dim] tensor per layer."""
        self.num_blocks, self.block_size = num_blocks, block_size
        a = self.attn_layers[0]
        for layer in self.attn_layers:
            layer.kv_cache = torch.zeros(2, num_blocks, block_size, a.num_kv_heads, a.head_dim,
                                         dtype=self.dtype, device=self.device)

    # ---- inputs -------------------------------------------------------------------------
    def _block_tables(self, kv: list[KvCacheHandle]) -> torch.Tensor:
        M = max(len(h.block_table) for h in kv)
        return torch.tensor([h.block_table + [0] * (M - len(h.block_table)) for h in kv],
                            dtype=torch.int64)

    def _slots(self, bt: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return bt[seq_idx, pos // bs] * bs + pos % bs

    # ---- forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, token_ids: list[list[int]], kv: list[KvCacheHandle]) -> torch.Tensor | None:
        """Returns logits [num_seqs, vocab] float32 of each chunk's last token (TP rank 0;
        None on other ranks)."""
        qlens = [len(t) for t in token_ids]
        ctx = [h.num_tokens for h in kv]
        bt = self._block_tables(kv)
        seq_idx = torch.repeat_interleave(torch.arange(len(kv)), torch.tensor(qlens))
        starts = torch.tensor(ctx)
        cu = torch.zeros(len(kv) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(qlens), 0)
        pos = starts[seq_idx] + torch.arange(cu[-1].item()) - cu[:-1][seq_idx]
        dev = self.device
        md = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._slots(bt, seq_idx, pos).to(dev, non_blocking=True),
            block_tables=bt.to(dev, non_blocking=True),
            seq_lens=torch.tensor([c + q for c, q in zip(ctx, qlens)], dtype=torch.int32).to(dev),
            max_seq_len=max(c + q for c, q in zip(ctx, qlens)),
            query_lens=qlens, context_lens=ctx, cu_seqlens_q=cu.to(dev))
        ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.int64).to(dev, non_blocking=True)
        with forward_context(md), cpu_blas_forward(self.cpu_blas):
            hidden = self.model(ids, pos.to(dev, non_blocking=True))
            last = (cu[1:] - 1).to(dev)
            logits = self.model.compute_logits(hidden[last])
        return None if logits is None else logits.float()

    def prev_sampled_ids(self, prev_sampled: torch.Tensor | None, num_prev: int) -> torch.Tensor:
        """The previous step's sampled ids [num_prev] int64 on this rank's device (async
        scheduling): rank 0 holds them (the engine's sampler output), the other ranks receive
        them with one broadcast on the TP group, queued on the stream like the forward."""
        if self.tp.size == 1:
            return prev_sampled
        import torch.distributed as dist
        buf = (prev_sampled.contiguous() if self.tp.rank == 0 else
               torch.empty(num_prev, dtype=torch.int64, device=self.device))
        dist.broadcast(buf, src=0, group=self.tp.group)
        return buf

    @torch.inference_mode()
    def decode(self, token_ids: list[int], kv: list[KvCacheHandle],
               prev_sampled: torch.Tensor | None = None, prev_rows: list[int] | None = None,
               num_prev: int = 0) -> torch.Tensor | None:
        """One token per sequence; returns logits [num_seqs, vocab] float32 (TP rank 0).
        With prev_rows (async scheduling, see DecodeInput), row i whose prev_rows[i] >= 0 takes
        its input token from the previous step's sampled ids instead of token_ids[i]; on ranks
        > 0 prev_sampled is None and num_prev gives its length."""
        prev = None
        if prev_rows is not None:
            prev = self.prev_sampled_ids(prev_sampled, num_prev or len(prev_sampled))
        if self.graphs is not None and self.graphs.can_run(len(kv)):
            return self.graphs.run(token_ids, kv, prev, prev_rows)
        B = len(kv)
        bt = self._block_tables(kv)
        pos = torch.tensor([h.num_tokens for h in kv], dtype=torch.int64)
        dev = self.device
        md = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._slots(bt, torch.arange(B), pos).to(dev, non_blocking=True),
            block_tables=bt.to(dev, non_blocking=True),
            seq_lens=(pos + 1).to(dev, non_blocking=True),
            max_seq_len=int(pos.max()) + 1,
            query_lens=[1] * B, context_lens=[h.num_tokens for h in kv])
        ids = torch.tensor(token_ids, dtype=torch.int64).to(dev, non_blocking=True)
        if prev is not None:
            ids = take_prev_sampled(ids, prev, torch.tensor(prev_rows).to(dev, non_blocking=True))
        with forward_context(md), cpu_blas_forward(self.cpu_blas):
            hidden = self.model(ids, pos.to(dev, non_blocking=True))
            logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()
