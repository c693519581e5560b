"""How a linear layer holds and applies its weights: one `LinearMethod` per layer (vLLM's
`quant_method`), chosen by the checkpoint's `QuantConfig`.

A method registers its parameters on the layer (`create_weights`), each tagged with how it
shards (`shard_spec`); the layer's weight loader reads this rank's slice of every parameter from
that tag (ferrum/layers/linear.py). After loading, `process_weights_after_loading` turns the
checkpoint layout into the one `apply` reads: on CUDA the packed layout of the ferrum/ops
kernels; on CPU a dequantized `weight`, after which the layer runs unquantized (see
`dequantized_on_cpu`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


def shard_spec(param: nn.Parameter, output_dim: int | None = None, input_dim: int | None = None,
               output_div: int = 1, input_div: int = 1, optional: bool = False) -> nn.Parameter:
    """Tag a parameter with how it shards under TP and return it.

    output_dim / input_dim: the tensor dim indexed by output / input features (None: not along
    that side; the tensor is then replicated on that side). output_div / input_div: logical
    features per index along that dim (8 for 4-bit values packed in int32, group_size for
    per-group scales). optional: the checkpoint may lack it (e.g. a static input scale)."""
    param.output_dim, param.input_dim = output_dim, input_dim
    param.output_div, param.input_div = output_div, input_div
    param.optional = optional
    return param


def new_param(shape: tuple[int, ...], dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    """A frozen parameter on the current default device (zeros, or `fill`)."""
    t = torch.zeros(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


class LinearMethod(ABC):
    """Base of every linear method. `out_sizes` are the output features per rank of each
    stacked sub-matrix (one entry unless the layer is merged: q/k/v, gate/up)."""

    name = "unquantized"

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        """Register this format's parameters on `layer`, each tagged by `shard_spec`, for
        `in_features` inputs and `sum(out_sizes)` outputs per rank; `dtype` is the model's."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Checkpoint layout -> the layout `apply` reads. Default: nothing to do."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, in_features_per_rank] -> [T, out_features_per_rank] in x's dtype."""

    def apply_silu_and_mul(self, layer: nn.Module, gate_up: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor | None:
        """`apply(layer, silu_and_mul(gate_up), bias)` in one kernel where this format has one
        for these rows, else None (the caller runs the two). gate_up: [T, 2 in_features_per_rank]."""
        return None

    @abstractmethod
    def init_dummy(self, layer: nn.Module, gen: torch.Generator) -> None:
        """Random weights of this format (for `dummy:` models)."""


class UnquantizedLinearMethod(LinearMethod):
    """A plain [out, in] weight in the model dtype; y = x W^T + b through `gemv.linear`."""

    def create_weights(self, layer, in_features, out_sizes, dtype):
        layer.weight = shard_spec(new_param((sum(out_sizes), in_features), dtype), output_dim=0, input_dim=1)

    def apply(self, layer, x, bias):
        from ferrum.ops.linear import linear
        return linear(x, layer.weight, bias, layer.tp.size == 1, layer.weight_packed)

    def apply_silu_and_mul(self, layer, gate_up, bias):
        from ferrum.ops.gemv_gluon import silu_mul_gemv
        return silu_mul_gemv(gate_up, layer.weight, None, bias)

    def init_dummy(self, layer, gen):
        layer.weight.normal_(0.0, 0.02, generator=gen)


def dequantized_on_cpu(layer: nn.Module, weight: torch.Tensor, packed: list[str]) -> None:
    """CPU: replace the packed parameters `packed` by one dequantized [out, in] `weight` in the
    model dtype and run the layer unquantized from now on. Once at load rather than per call:
    the CPU path is fp32 BLAS (ferrum/ops/cpu_blas.py), and dequantizing every step would read
    the packed weights and write a full-size fp32 copy before the BLAS call reads it again,
    several times the work of the GEMV itself; CPU memory is not what limits the models run
    here. The values are those the GPU kernels compute in registers, so greedy tokens agree."""
    for name in packed:
        delattr(layer, name)
    layer.weight = shard_spec(nn.Parameter(weight.to(layer.params_dtype).contiguous(), requires_grad=False),
                              output_dim=0, input_dim=1)
    layer.quant_method = UnquantizedLinearMethod()


class QuantConfig(ABC):
    """A checkpoint's quantization format. `name` is what errors and logs say;
    `linear_method()` gives the method of each quantized linear layer (embeddings, norms and
    the LM head stay in the model dtype)."""

    name = "none"

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """A new method object for one quantized linear layer."""

    @abstractmethod
    def weight_bits(self) -> float:
        """Bytes-per-parameter x 8 of a quantized linear weight, scales included (memory sizing)."""
