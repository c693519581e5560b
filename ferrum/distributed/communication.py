"""Collectives used by the model layers. With TP size 1 they return their input unchanged.

An optional fast path (`set_all_reduce_impl`) lets the GPU runner swap in a one-shot
all-reduce over symmetric memory for small messages; the default is torch.distributed
(NCCL on CUDA, gloo on CPU)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ferrum.distributed.parallel_state import get_tp_group, get_tp_rank, get_tp_size

_all_reduce_impl: Callable[[torch.Tensor], torch.Tensor] | None = None


def set_all_reduce_impl(fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    global _all_reduce_impl
    _all_reduce_impl = fn


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over TP ranks (in place when using torch.distributed)."""
    if get_tp_size() == 1:
        return x
    if _all_reduce_impl is not None:
        return _all_reduce_impl(x)
    dist.all_reduce(x, group=get_tp_group())
    return x


def tensor_model_parallel_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate each rank's x along `dim` on TP rank 0; other ranks get None.
    Used for vocab-parallel logits: [tokens, vocab/tp] -> [tokens, vocab] on rank 0."""
    if get_tp_size() == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:  # NCCL gather exists but all_gather_into_tensor is the well-trodden path
        out = torch.empty((get_tp_size(),) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=get_tp_group())
        parts = list(out.unbind(0))
    else:
        parts = [torch.empty_like(x) for _ in range(get_tp_size())] if get_tp_rank() == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(get_tp_group(), 0)
                    if get_tp_group() is not None else 0, group=get_tp_group())
    if get_tp_rank() != 0:
        return None
    return torch.cat(parts, dim=dim)
