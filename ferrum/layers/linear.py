"""Tensor-parallel linear layers in the Megatron-LM layout (Shoeybi et al. 2019).

ColumnParallelLinear splits the output features over ranks (no communication);
RowParallelLinear splits the input features and all-reduces its output. A column-parallel
layer followed by a row-parallel one needs one all-reduce in total.

Weights are [out_features_per_rank, in_features_per_rank] (the torch / HF layout). Each
parameter has a `weight_loader(param, lazy_weight, shard_id)` that reads only this rank's
slice from a `LazyWeight` (ferrum/loader/base.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ferrum.distributed.communication import tensor_model_parallel_all_reduce
from ferrum.distributed.parallel_state import divide, get_tp
from ferrum.layers.weight_utils import copy_weight
from ferrum.ops.linear import linear


class LinearBase(nn.Module):
    """y = x W^T + b on this rank's weight [out_features, in_features] (as given: the
    subclasses pass per-rank sizes) and optional bias [out_features], in the default dtype at
    construction. Built under the TP state in force then (`get_tp()`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp = get_tp()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> new [T, out_features] (`ferrum.ops.linear.linear`)."""
        return linear(x, self.weight, self.bias, self.tp.size == 1)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.out_per_rank = divide(out_features, get_tp().size, "output features")
        super().__init__(in_features, self.out_per_rank, bias)

    def weight_loader(self, param, lazy, shard_id=None):
        """Copy this rank's rows of the checkpoint tensor `lazy` ([out, in] weight or [out]
        bias) into param. Raises WeightLoadError on a shape mismatch."""
        n = self.out_per_rank
        copy_weight(param, lazy.narrow(0, self.tp.rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one GEMM (gate_proj + up_proj).
    `shard_id` is the index of the sub-matrix being loaded."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param, lazy, shard_id=None):
        """Copy this rank's rows of sub-matrix `shard_id` (0 = gate_proj, 1 = up_proj) into
        its place in the stacked param. Raises WeightLoadError on a shape mismatch."""
        tp = self.tp.size
        n = self.out_sizes[shard_id] // tp
        off = sum(self.out_sizes[:shard_id]) // tp
        copy_weight(param.narrow(0, off, n), lazy.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by attention heads. When num_kv_heads < tp the KV heads
    are replicated: rank r uses KV head r // (tp // num_kv_heads), which is the KV head its
    query heads [r*h/tp, (r+1)*h/tp) belong to under grouped-query attention."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        tp = get_tp().size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.kv_replicas = divide(tp, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param, lazy, shard_id=None):
        """Copy this rank's heads of q_proj / k_proj / v_proj (`shard_id` "q", "k", "v"; weight
        or bias) into their place in the fused param: [q | k | v] rows. Raises WeightLoadError
        on a shape mismatch."""
        r = self.tp.rank
        if shard_id == "q":
            dst, src = param.narrow(0, 0, self.q_size), lazy.narrow(0, r * self.q_size, self.q_size)
        else:
            kv_rank = r // self.kv_replicas
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
            dst = param.narrow(0, off, self.kv_size)
            src = lazy.narrow(0, kv_rank * self.kv_size, self.kv_size)
        copy_weight(dst, src, shard_id)


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_r W_r^T) with W split by input columns; bias added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.in_per_rank = divide(in_features, get_tp().size, "input features")
        super().__init__(self.in_per_rank, out_features, bias)

    def weight_loader(self, param, lazy, shard_id=None):
        """Copy this rank's input columns of the checkpoint weight [out, in] into param; a
        bias [out] is replicated. Raises WeightLoadError on a shape mismatch."""
        if param.dim() == 1:  # bias: replicated
            copy_weight(param, lazy.load())
            return
        n = self.in_per_rank
        copy_weight(param, lazy.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features / tp] (this rank's slice) -> [T, out_features], summed over the
        TP ranks (one all-reduce), plus the bias."""
        y = linear(x, self.weight, None, self.tp.size == 1)
        y = tensor_model_parallel_all_reduce(y, self.tp)
        if self.bias is not None:
            y = y + self.bias
        return y
