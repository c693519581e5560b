"""Gated activations: input [..., 2*d] = [gate | up] -> act(gate) * up.
SwiGLU (Shazeer 2020) for Llama/Qwen/Mixtral; GeGLU with the tanh approximation of GELU
(HF `gelu_pytorch_tanh`) for Gemma 3."""
import torch
from torch import nn

from ferrum.ops.activation import gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(nn.Module):
    """The MLP activation of Llama/Qwen: see `ferrum.ops.activation.silu_and_mul`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., 2*d] = [gate | up] -> new [..., d] silu(gate) * up, same dtype."""
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """Gemma 3's MLP activation: see `ferrum.ops.activation.gelu_tanh_and_mul`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., 2*d] = [gate | up] -> new [..., d] gelu_tanh(gate) * up, same dtype."""
        return gelu_tanh_and_mul(x)


_ACT_AND_MUL = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation for an HF `hidden_act` name (see config.SUPPORTED_ACTIVATIONS)."""
    return _ACT_AND_MUL[name]()
