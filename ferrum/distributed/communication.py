"""Collectives used by the model layers. With TP size 1 they return their input unchanged.

An optional fast path (`set_all_reduce_impl`) lets the GPU runner swap in a one-shot
all-reduce over symmetric memory for small messages; the default is torch.distributed
(NCCL on CUDA, gloo on CPU)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ferrum.distributed.parallel_state import get_tp

_all_reduce_impl: Callable[[torch.Tensor], torch.Tensor] | None = None


def set_all_reduce_impl(fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Route TP all-reduces on fn's process group (`fn.group`) through fn (x -> sum of x over
    the ranks); None restores torch.distributed."""
    global _all_reduce_impl
    _all_reduce_impl = fn


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp=None) -> torch.Tensor:
    """Sum of x over the TP ranks of `tp` (default: the current TP state); in place when
    using torch.distributed."""
    tp = tp or get_tp()
    if tp.size == 1:
        return x
    # The fast path belongs to one process group: an engine built after an earlier one in the
    # same process must not reach the earlier (destroyed) group through it.
    if _all_reduce_impl is not None and getattr(_all_reduce_impl, "group", None) is tp.group:
        return _all_reduce_impl(x)
    dist.all_reduce(x, group=tp.group)
    return x


def tensor_model_parallel_gather(x: torch.Tensor, dim: int = -1, tp=None) -> torch.Tensor | None:
    """Concatenate each rank's x along `dim` on TP rank 0; other ranks get None.
    Used for vocab-parallel logits: [tokens, vocab/tp] -> [tokens, vocab] on rank 0."""
    tp = tp or get_tp()
    if tp.size == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:  # NCCL gather exists but all_gather_into_tensor is the well-trodden path
        out = torch.empty((tp.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=tp.group)
        parts = list(out.unbind(0))
    else:
        parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
        dist.gather(x, parts, group_dst=0, group=tp.group)
    if tp.rank != 0:
        return None
    return torch.cat(parts, dim=dim)
