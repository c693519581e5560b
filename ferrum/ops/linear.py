"""y = x W^T + b: the one place that picks the implementation for every linear layer and the
LM head. The batch-1 Triton GEMV on CUDA (`ferrum.ops.gemv`: one row, 16-bit; the Gluon one,
`ferrum.ops.gemv_gluon`, for the shapes its tuning table lists), numpy's BLAS on CPU for
one-token forwards (`ferrum.ops.cpu_blas`: float32, one process), oneDNN on a weight
packed at load for the other CPU forwards (`ferrum.ops.cpu_packed`, when the layer has one),
else `F.linear`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.ops import cpu_blas, cpu_packed, gemv, gemv_gluon


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           single_process: bool = True, packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the fast paths above. x: [T, K]; weight: [N, K] (any
    strides); bias: [N] or None; returns a new [T, N] tensor in x's dtype. `single_process`:
    False under tensor parallelism on CPU (the BLAS path's thread pool would oversubscribe).
    `packed`: `cpu_packed.pack(weight)` when the model runner made one (CPU float32)."""
    if gemv.can_use(x, weight):
        cfg = gemv_gluon.config_for("bf16", x, *weight.shape)
        if cfg is not None:  # only shapes where the sweep found it faster (GLUON_GEMV_CONFIGS)
            return gemv_gluon.dense_gemv(x, weight, None, bias, cfg)
        return gemv.gemv(x, weight, bias)
    if cpu_blas.can_use(x, weight, single_process):
        return cpu_blas.blas_linear(x, weight, bias)
    if packed is not None and x.dim() == 2:
        return cpu_packed.packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)
