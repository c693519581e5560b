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


def copy_weight(param: torch.Tensor, w: torch.Tensor, name: str = "") -> None:
    """param[...] = w cast to param's dtype, after `check_shape` (param may be a narrowed view
    of a fused parameter). Raises WeightLoadError on a shape mismatch."""
    check_shape(w.shape, param.shape, name)
    param.data.copy_(w.to(param.dtype))
