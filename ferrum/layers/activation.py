"""SwiGLU activation (Shazeer 2020): input [..., 2*d] = [gate | up] -> silu(gate) * up."""
import torch
from torch import nn

from ferrum.ops.activation import silu_and_mul


class SiluAndMul(nn.Module):
    """The MLP activation of Llama/Qwen: see `ferrum.ops.activation.silu_and_mul`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., 2*d] = [gate | up] -> new [..., d] silu(gate) * up, same dtype."""
        return silu_and_mul(x)
