"""Tensor-parallel linear layers in the Megatron-LM layout (Shoeybi et al. 2019).

ColumnParallelLinear splits the output features over ranks (no communication);
RowParallelLinear splits the input features and all-reduces its output. A column-parallel
layer followed by a row-parallel one needs one all-reduce in total.

Each layer's parameters come from its `quant_method` (ferrum/layers/quantization/): a plain
[out_features_per_rank, in_features_per_rank] weight (the torch / HF layout) when the model is
not quantized, packed weights with scales / zero points otherwise. Every parameter carries a
shard spec (which dim holds output / input features, and how many features one index packs) and
a `weight_loader(param, lazy_weight, shard_id)` that reads only this rank's slice from a
`LazyWeight` (ferrum/loader/base.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ferrum.distributed.communication import tensor_model_parallel_all_reduce
from ferrum.distributed.parallel_state import divide, get_tp
from ferrum.errors import TensorParallelError, WeightLoadError
from ferrum.layers.quantization.base import QuantConfig, UnquantizedLinearMethod, new_param, shard_spec
from ferrum.layers.weight_utils import copy_weight
from ferrum.ops.activation import silu_and_mul


class LinearBase(nn.Module):
    """in_features: input features per rank; out_sizes: output features per rank of each
    stacked sub-matrix. Subclasses say which slice of the checkpoint tensor a rank holds
    (`output_shard`, `input_shard`)."""

    input_sharded = False  # RowParallelLinear: rank r holds input features [r*in, (r+1)*in)
    # oneDNN-packed copy of an unquantized weight (`ferrum.ops.cpu_packed`), set by the CPU model runner
    weight_packed: torch.Tensor | None = None

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool,
                 quant_config: QuantConfig | None = None):
        super().__init__()
        self.tp = get_tp()
        self.params_dtype = torch.get_default_dtype()
        self.in_features, self.out_sizes = in_features, out_sizes
        self.out_features = sum(out_sizes)
        self.quant_method = quant_config.linear_method() if quant_config else UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_sizes, self.params_dtype)
        if bias:
            self.bias = shard_spec(new_param((self.out_features,), self.params_dtype), output_dim=0)
        else:
            self.register_parameter("bias", None)
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader

    def param_device(self) -> torch.device:
        """The device the layer's parameters live on."""
        return next(self.parameters(recurse=False)).device

    def output_shard(self, shard_id=None) -> tuple[int, int, int]:
        """(offset in this rank's output features, first checkpoint output feature, count)
        of sub-matrix `shard_id`. Default: every output feature (replicated / row-parallel)."""
        return 0, 0, self.out_features

    def input_shard(self) -> tuple[int, int] | None:
        """(first checkpoint input feature, count) this rank holds; None: all of them."""
        return None

    def checkpoint_out_features(self, shard_id=None) -> int:
        """Output features of sub-matrix `shard_id` in the checkpoint, over all ranks."""
        return self.out_features

    def checkpoint_in_features(self) -> int:
        """Input features in the checkpoint, over all ranks."""
        return self.in_features

    def weight_loader(self, param: nn.Parameter, lazy, shard_id=None) -> None:
        """Copy this rank's slice of `lazy` into `param` (or into the rows of sub-matrix
        `shard_id`), following the parameter's shard spec. Raises TensorParallelError when a
        rank's slice does not fall on whole packed words or groups, WeightLoadError on a shape
        mismatch."""
        dst, src = self.shard_slice(param, lazy, shard_id)
        copy_weight(dst, src, "" if shard_id is None else str(shard_id))

    def shard_slice(self, param: nn.Parameter, lazy, shard_id=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(view of `param` that sub-matrix `shard_id` fills, this rank's slice of `lazy`)."""
        dst, src_dim, src_start, src_len, src_full = param.data, None, 0, 0, 0
        if param.output_dim is not None:
            off, start, n = self.output_shard(shard_id)
            d = param.output_div
            self._check_div((off, start, n), d, "output features")
            dst = dst.narrow(param.output_dim, off // d, n // d)
            src_dim, src_start, src_len = param.output_dim, start // d, n // d
            src_full = -(-self.checkpoint_out_features(shard_id) // d)
        shard = self.input_shard()
        if param.input_dim is not None and shard is not None:
            start, n = shard
            d = param.input_div
            self._check_div((start, n), d, "input features")
            src_dim, src_start, src_len = param.input_dim, start // d, n // d
            src_full = -(-self.checkpoint_in_features() // d)
        if src_dim is None:
            return dst, lazy.load()
        # the whole dim, not only this rank's slice: a larger tensor (a config.json whose heads
        # or sizes do not match the weights) would otherwise load its first rows without a word
        if len(lazy.shape) <= src_dim or lazy.shape[src_dim] != src_full:
            raise WeightLoadError(f"tensor has shape {tuple(lazy.shape)}, expected {src_full} "
                                  f"entries along dim {src_dim} (from config.json's sizes)")
        return dst, lazy.narrow(src_dim, src_start, src_len)

    def _check_div(self, sizes: tuple[int, ...], d: int, what: str) -> None:
        if d > 1 and any(s % d for s in sizes):
            msg = (f"{what} {sizes[-1]} per rank (from {sizes[-2]}) do not fall on whole units of "
                   f"{d} (4-bit packing or quantization group) of {self.quant_method.name}")
            if self.tp.size > 1:
                raise TensorParallelError(f"{msg} at tensor_parallel_size {self.tp.size}")
            raise WeightLoadError(msg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> new [T, out_features] (the quant method's apply)."""
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole [out, in] weight on every rank (MoE routers: every rank routes every token);
    LinearBase's default shards are the whole tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config: QuantConfig | None = None):
        super().__init__(in_features, [out_features], bias, quant_config)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config: QuantConfig | None = None):
        self.out_per_rank = divide(out_features, get_tp().size, "output features")
        super().__init__(in_features, [self.out_per_rank], bias, quant_config)

    def output_shard(self, shard_id=None):
        n = self.out_per_rank
        return 0, self.tp.rank * n, n

    def checkpoint_out_features(self, shard_id=None):
        return self.out_per_rank * self.tp.size


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices stacked into one GEMM (gate_proj + up_proj).
    `shard_id` is the index of the sub-matrix being loaded."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 quant_config: QuantConfig | None = None):
        tp = get_tp().size
        super().__init__(in_features, [divide(n, tp, "output features") for n in out_sizes], bias,
                         quant_config)

    def output_shard(self, shard_id=None):
        n = self.out_sizes[shard_id]
        return sum(self.out_sizes[:shard_id]), self.tp.rank * n, n

    def checkpoint_out_features(self, shard_id=None):
        return self.out_sizes[shard_id] * self.tp.size


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection split by attention heads. When num_kv_heads < tp the KV heads
    are replicated: rank r uses KV head r // (tp // num_kv_heads), which is the KV head its
    query heads [r*h/tp, (r+1)*h/tp) belong to under grouped-query attention."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant_config: QuantConfig | None = None):
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
        super().__init__(hidden, [self.q_size, self.kv_size, self.kv_size], bias, quant_config)

    def output_shard(self, shard_id=None):
        r = self.tp.rank
        if shard_id == "q":
            return 0, r * self.q_size, self.q_size
        kv_rank = r // self.kv_replicas
        off = self.q_size + (0 if shard_id == "k" else self.kv_size)
        return off, kv_rank * self.kv_size, self.kv_size

    def checkpoint_out_features(self, shard_id=None):
        if shard_id == "q":
            return self.q_size * self.tp.size
        return self.kv_size * self.tp.size // self.kv_replicas


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_r W_r^T) with W split by input columns; bias added once, after.
    With reduce_results=False the partial sum x_r W_r^T is returned (no bias allowed): the
    caller adds it to other partial sums and all-reduces once (MoE shared expert)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config: QuantConfig | None = None, reduce_results: bool = True):
        self.in_per_rank = divide(in_features, get_tp().size, "input features")
        assert reduce_results or not bias, "a partial sum cannot carry the bias"
        self.reduce_results = reduce_results
        self.input_sharded = get_tp().size > 1
        super().__init__(self.in_per_rank, [out_features], bias, quant_config)

    def input_shard(self):
        n = self.in_per_rank
        return self.tp.rank * n, n

    def checkpoint_in_features(self):
        return self.in_per_rank * self.tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features / tp] (this rank's slice) -> [T, out_features], summed over the
        TP ranks (one all-reduce), plus the bias; with reduce_results=False this rank's partial
        sum only."""
        return self._reduce(self.quant_method.apply(self, x, None))

    def forward_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`forward(silu_and_mul(gate_up))`, gate_up [T, 2 in_features / tp] = [gate | up]
        (gate_up_proj's output): one kernel where the weight format has one for these rows
        (`LinearMethod.apply_silu_and_mul`), else the SiLU-mul kernel and `forward`."""
        y = self.quant_method.apply_silu_and_mul(self, gate_up, None)
        return self.forward(silu_and_mul(gate_up)) if y is None else self._reduce(y)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product -> the layer's output (see `forward`)."""
        if not self.reduce_results:
            return y
        y = tensor_model_parallel_all_reduce(y, self.tp)
        if self.bias is not None:
            y = y + self.bias
        return y
