"""Sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) with tensor or expert
parallelism.

Per token: router logits = x R^T (R replicated, [E, hidden]); top-k experts and their weights
(`ferrum.ops.moe.select_experts`); the selected experts' SwiGLU FFNs weighted and summed
(`ferrum.ops.moe.fused_moe`); Qwen2-MoE adds a shared expert scaled by sigmoid(x g^T).

Parallel layouts (one all-reduce per block either way, as for the dense MLP):
- tensor parallel (default): every expert's FFN is split like the dense MLP: rank r holds rows
  [r*I/tp, (r+1)*I/tp) of each expert's gate and up, and the same columns of its down, so each
  rank computes a partial sum over all selected experts.
- expert parallel (`--enable-expert-parallel`): rank r holds experts [r*E/tp, (r+1)*E/tp)
  whole. The hidden states are already replicated on every rank (attention is TP), so every
  rank routes all tokens, computes only the (token, slot) pairs that chose its own experts,
  and the all-reduce sums the ranks' contributions (the all-gather form of EP dispatch: no
  token moves, no all-to-all).

Quantization: the router and the shared-expert gate stay in the model dtype (as in vLLM); the
shared expert follows the model's QuantConfig like any dense MLP. The stacked experts are held
in the model dtype: a GGUF's expert blocks are dequantized while loading, `--quantization fp8`
leaves them unquantized, and a checkpoint whose config.json has a `quantization_config` (its
expert tensors quantized: FP8 / GPTQ / AWQ) is refused (UnsupportedModelError).
"""
from __future__ import annotations

import torch
from torch import nn

from ferrum.config import ModelConfig
from ferrum.distributed.communication import tensor_model_parallel_all_reduce
from ferrum.distributed.parallel_state import divide, get_tp
from ferrum.errors import UnsupportedModelError
from ferrum.layers.linear import ReplicatedLinear
from ferrum.layers.mlp import GatedMLP
from ferrum.layers.quantization.base import QuantConfig
from ferrum.layers.weight_utils import check_dtype, check_shape
from ferrum.ops.moe import fused_moe, select_experts


class FusedMoE(nn.Module):
    """The experts of one layer, stacked (vLLM's layout):
    w13_weight [E_local, 2*I_local, hidden] (each expert's gate rows, then its up rows) and
    w2_weight [E_local, hidden, I_local]. TP: E_local = E, I_local = I / tp. EP: E_local = E / tp
    whole experts from global id `expert_start`, I_local = I.

    Checkpoint tensors arrive one expert and projection at a time: shard id (e, 0) gate, (e, 1)
    up for w13 and e for w2 (global expert id e; experts of other EP ranks are skipped).
    Raises TensorParallelError when E (EP) or I (TP) does not divide by the TP size."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.tp = tp = get_tp()
        if tp.expert_parallel:
            self.num_local = divide(num_experts, tp.size, "num_experts (expert parallel)")
            self.inter = intermediate
            self.expert_start = tp.rank * self.num_local
        else:
            self.num_local = num_experts
            self.inter = divide(intermediate, tp.size, "moe_intermediate_size")
            self.expert_start = 0
        local = range(self.expert_start, self.expert_start + self.num_local)
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden, self.inter), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # what load_weights must have seen for each parameter (ferrum/loader/model_loader.py)
        self.w13_weight.shard_ids = [(e, j) for e in local for j in (0, 1)]
        self.w2_weight.shard_ids = list(local)

    def weight_loader(self, param: nn.Parameter, lazy, shard_id) -> None:
        """Copy one expert's gate / up [I, hidden] or down [hidden, I] checkpoint tensor (this
        rank's slice of it under TP) into its place in the stack."""
        e, j = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        le = e - self.expert_start
        if not 0 <= le < self.num_local:
            return  # another EP rank's expert
        n, r = self.inter, self.tp.rank
        split = not self.tp.expert_parallel
        if j is None:   # down_proj [hidden, I]: columns of this rank
            dst = param.data[le]
            full = (dst.shape[0], n * (self.tp.size if split else 1))
            src = lazy.narrow(1, r * n, n) if split else lazy.load()
        else:           # gate (j=0) / up (j=1) [I, hidden]: rows of this rank
            dst = param.data[le, j * n:(j + 1) * n]
            full = (n * (self.tp.size if split else 1), dst.shape[1])
            src = lazy.narrow(0, r * n, n) if split else lazy.load()
        check_shape(lazy.shape, full, f"of expert {e}")
        check_dtype(src.dtype, param.dtype, f"of expert {e}")
        dst.copy_(src.to(param.dtype))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; topk_weights [T, k] float32; topk_ids [T, k] int64 -> this rank's
        partial [T, hidden] (not reduced)."""
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.expert_start)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert), HF parameter names: `gate` (router),
    `experts`, `shared_expert`, `shared_expert_gate`. x: [T, hidden] -> [T, hidden].
    `quant_config` applies to the shared expert only (module docstring). Raises
    UnsupportedModelError for a checkpoint with quantized experts."""

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None):
        super().__init__()
        if cfg.quantization_config:
            method = cfg.quantization_config.get("quant_method", "?")
            raise UnsupportedModelError(
                f"mixture-of-experts checkpoints quantized with {method!r} are not supported (the "
                "experts run in the model dtype); use the unquantized checkpoint, optionally with "
                "--quantization fp8 (attention and dense layers), or a GGUF")
        self.tp = get_tp()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                          cfg.hidden_act, reduce_results=False,
                                          quant_config=quant_config)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], summed over the TP / EP ranks (one all-reduce)."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tensor_model_parallel_all_reduce(y, self.tp)
