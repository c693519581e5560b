"""RMSNorm (Zhang & Sennrich 2019) computed in float32, with the residual add fused in:
`forward(x, residual)` returns (norm(x + residual), x + residual) as vLLM does, so each
decoder layer carries the residual stream without extra copies."""
from __future__ import annotations

import torch
from torch import nn

from ferrum.layers import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, lazy, shard_id=None):
        from ferrum.loader.base import _check_shape
        _check_shape(lazy, tuple(param.shape))
        param.data.copy_(lazy.load().to(param.dtype))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:  # one Triton kernel for add + norm
            if residual is None:
                return fused_ops.rms_norm(x, self.weight, self.eps)
            return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
