"""Gated MLP (Llama's SwiGLU, Gemma's GeGLU, the MoE shared expert): down(act(gate(x)) * up(x)).
gate_up_proj is column-parallel (gate and up stacked), down_proj row-parallel: one all-reduce,
or none with reduce_results=False (the caller sums partial results first)."""
from __future__ import annotations

import torch
from torch import nn

from ferrum.config import KERNELS
from ferrum.layers.activation import get_act_and_mul
from ferrum.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from ferrum.layers.quantization.base import QuantConfig


class GatedMLP(nn.Module):
    """x: [T, hidden] -> [T, hidden]; `act` is an HF hidden_act name (silu, gelu_pytorch_tanh);
    with `quant_config` both projections hold quantized weights."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", reduce_results: bool = True,
                 quant_config: QuantConfig | None = None, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias,
                                                       quant_config=quant_config)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, quant_config=quant_config,
                                           reduce_results=reduce_results)
        self.act_fn = get_act_and_mul(act)
        self.silu = act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (all-reduced over TP ranks unless reduce_results=False)."""
        gate_up = self.gate_up_proj(x)
        if self.silu and KERNELS.silu_gemv:   # SiLU-mul inside down_proj's GEMV where it has one
            return self.down_proj.forward_silu_and_mul(gate_up)
        return self.down_proj(self.act_fn(gate_up))
