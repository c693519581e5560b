"""RMSNorm (Zhang & Sennrich 2019) computed in float32, with the residual add fused in:
`forward(x, residual)` returns (norm(x + residual), x + residual) as vLLM does, so each
decoder layer carries the residual stream without extra copies."""
from __future__ import annotations

import torch
from torch import nn

from ferrum.layers.weight_utils import copy_weight
from ferrum.ops.rms_norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned weight [hidden] (replicated on every TP rank);
    `ferrum.ops.rms_norm` computes it."""

    # as a q/k norm the fused rope_kv kernel computes it (ferrum/ops/rope_kv.py); a subclass
    # must set its own (it is read from the class itself, not inherited)
    kernel_kind = "rms"

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, lazy, shard_id=None):
        """Copy the checkpoint's [hidden] weight into param. Raises WeightLoadError on a shape
        mismatch."""
        copy_weight(param, lazy.load())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., hidden]. Without residual: returns RMSNorm(x), a new tensor in
        promote(x, weight) dtype. With residual (same shape as x): returns the tuple
        (RMSNorm(x + residual), x + residual), the sum rounded to the activation dtype
        (`ferrum.ops.rms_norm.fused_add_rms_norm`)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
