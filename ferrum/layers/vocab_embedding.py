"""Vocabulary-parallel embedding and LM head (Megatron-LM). Rank r holds vocab rows
[r*Vp, (r+1)*Vp) with Vp = ceil(V / tp); rows past V are zero padding.

Embedding: each rank looks up the ids it owns (others give 0) and the partial results are
all-reduced. LM head: each rank computes logits for its rows; they are gathered on rank 0
and the padding is cut."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrum.distributed.communication import (tensor_model_parallel_all_reduce,
                                              tensor_model_parallel_gather)
from ferrum.distributed.parallel_state import get_tp
from ferrum.layers.weight_utils import check_dtype, check_shape
from ferrum.ops.linear import linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding [vocab_size, hidden] split over the vocabulary: this rank's weight is
    [ceil(vocab_size / tp), hidden], rows past vocab_size zero."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp = get_tp()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, lazy, shard_id=None):
        """Copy this rank's rows of the checkpoint's [vocab_size, hidden] tensor into param.
        Raises WeightLoadError when the checkpoint tensor has another shape."""
        check_shape(lazy.shape, (self.vocab_size, param.shape[1]))
        n = max(0, min(self.per_rank, self.vocab_size - self.start))
        if n:
            rows = lazy.narrow(0, self.start, n)
            check_dtype(rows.dtype, param.dtype)
            param.data[:n].copy_(rows.to(param.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int64 -> [T, hidden] in the weight's dtype (all-reduced over TP ranks:
        each rank looks up the ids it holds, 0 for the others)."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = F.embedding(torch.where(mask, local, 0), self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(y, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head: the same vocab-parallel weight layout (shared with the embedding when
    tie_word_embeddings), used as a linear map hidden -> logits."""

    # oneDNN-packed copy of the weight (`ferrum.ops.cpu_packed`), set by the CPU model runner
    weight_packed: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] -> logits [N, vocab_size] in the weight's dtype, gathered on TP
        rank 0 (None on the other ranks)."""
        logits = linear(hidden, self.weight, None, self.tp.size == 1, self.weight_packed)
        logits = tensor_model_parallel_gather(logits, dim=-1, tp=self.tp)
        if logits is None:
            return None
        return logits[:, : self.vocab_size]
