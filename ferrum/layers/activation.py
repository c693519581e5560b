"""SwiGLU activation (Shazeer 2020): input [..., 2*d] = [gate | up] -> silu(gate) * up."""
import torch
import torch.nn.functional as F
from torch import nn

from ferrum.layers import fused_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
