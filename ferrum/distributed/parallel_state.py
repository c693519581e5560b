"""Tensor-parallel rank and group of this process. TP size 1 (the default) means every
collective is a no-op, so the same layers run single-device and sharded."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class _TPState:
    """`expert_parallel`: MoE layers place whole experts on ranks (E / size each) instead of
    splitting every expert's FFN; the TP group carries both (ParallelConfig.enable_expert_parallel)."""

    rank: int = 0
    size: int = 1
    group: "dist.ProcessGroup | None" = None
    expert_parallel: bool = False


_TP = _TPState()


def init_tensor_parallel(rank: int, size: int, group=None, expert_parallel: bool = False) -> None:
    """Make (rank, size, group, expert_parallel) the TP state layers built from now on take
    (`get_tp`)."""
    global _TP
    _TP = _TPState(rank, size, group, expert_parallel)


def get_tp() -> _TPState:
    """The TP state in force now. Layers keep the one they were built under, so a TP=1 model
    and a TP=2 model can live in the same process (tests compare them)."""
    return _TP


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or TensorParallelError naming the sizes."""
    from ferrum.errors import TensorParallelError
    if numerator % denominator:
        raise TensorParallelError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
