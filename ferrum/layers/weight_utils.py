"""Shape-checked weight copies for the layers' `weight_loader`s (every parameter has one:
`weight_loader(param, lazy_weight, shard_id)`, called by `ferrum.loader.model_loader`)."""
from __future__ import annotations

import torch

from ferrum.errors import WeightLoadError


def check_shape(shape: tuple[int, ...], expected: tuple[int, ...], name: str = "") -> None:
    """Raise WeightLoadError naming the tensor when `shape` differs from `expected`."""
    if tuple(shape) != tuple(expected):
        what = f"tensor {name}" if name else "tensor"
        raise WeightLoadError(f"{what} has shape {tuple(shape)}, expected {tuple(expected)}")


def _kind(dtype: torch.dtype) -> str:
    return "float8" if dtype.is_floating_point and dtype.itemsize == 1 else (
        "float" if dtype.is_floating_point else "integer")


def check_dtype(dtype: torch.dtype, param_dtype: torch.dtype, name: str = "") -> None:
    """Raise WeightLoadError when a checkpoint tensor of `dtype` would change meaning cast to
    `param_dtype`: integer (or bool) codes read as float weights, FP8 codes without their scales
    (a quantized checkpoint whose config.json lost its quantization_config), floats cast to
    packed codes. Casts within a kind (bf16 -> float32, int32 -> int64) are fine."""
    if _kind(dtype) != _kind(param_dtype):
        what = f"tensor {name}" if name else "tensor"
        raise WeightLoadError(f"{what} is {str(dtype).removeprefix('torch.')}, expected a "
                              f"{_kind(param_dtype)} tensor ({str(param_dtype).removeprefix('torch.')}): "
                              "a quantized tensor with no matching quantization_config in config.json?")


def copy_weight(param: torch.Tensor, w: torch.Tensor, name: str = "") -> None:
    """param[...] = w cast to param's dtype, after `check_shape` and `check_dtype` (param may be
    a narrowed view of a fused parameter). Raises WeightLoadError on a shape or dtype mismatch."""
    check_shape(w.shape, param.shape, name)
    check_dtype(w.dtype, param.dtype, name)
    param.data.copy_(w.to(param.dtype))
