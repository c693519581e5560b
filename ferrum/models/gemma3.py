"""Gemma 3 text decoder (Gemma Team 2025; HF `Gemma3ForCausalLM`), from tensor-parallel layers.

Differences from the Llama graph, each from HF `modeling_gemma3.py`:
- RMSNorm scales by (1 + w) and rounds after the product (`GemmaRMSNorm`); llama.cpp's GGUF
  stores 1 + w, which the GGUF loader turns back into w;
- four norms per layer: input, post-attention, pre- and post-feedforward (the sub-block outputs
  are normed before the residual add);
- embeddings multiplied by sqrt(hidden_size) (rounded to the activation dtype);
- q and k RMSNorm per head; attention scale query_pre_attn_scalar ** -0.5;
- local layers (`layer_types` "sliding_attention", 5 of every 6) attend through a sliding window
  and use RoPE base `rope_local_theta` (10,000), global layers the whole context with
  `rope_theta` (1,000,000) and its scaling;
- GeGLU MLP (GELU with the tanh approximation); tied embeddings; optional final logit
  soft-capping c * tanh(logits / c).
"""
from __future__ import annotations

import torch
from torch import nn

from ferrum.config import ModelConfig
from ferrum.layers.layernorm import RMSNorm
from ferrum.layers.mlp import GatedMLP
from ferrum.layers.quantization.base import QuantConfig
from ferrum.layers.rotary_embedding import RotaryEmbedding
from ferrum.layers.vocab_embedding import VocabParallelEmbedding
from ferrum.models.llama import LlamaAttention, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """y = (x / rms(x) * (1 + w)) in float32, rounded to x's dtype (HF Gemma3RMSNorm: Gemma
    rounds after the weight, Llama before). `weight` holds w as in HF checkpoints (0 = identity)."""

    kernel_kind = "gemma_rms"  # ferrum/ops/rope_kv.py

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__(hidden, eps)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> new [..., dim] in x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ffw_norm(mlp(pre_ffw_norm(.))):
    each sub-block's output is normed before its residual add (sandwich norms)."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, layer: int,
                 quant_config: QuantConfig | None = None):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, rotary_emb, layer, quant_config, norm_class=GemmaRMSNorm)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, quant_config=quant_config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [T] int64; x: [T, hidden] -> [T, hidden], or [B, hidden] of the rows
        keep_rows [B] int64 names (`LlamaForCausalLM.forward`)."""
        a = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), keep_rows))
        x = (x if keep_rows is None else x.index_select(0, keep_rows)) + a
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    """Scaled token embedding, the decoder layers (local ones on the local RoPE table, global
    ones on the global), final norm."""

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        common = (cfg.head_dim, cfg.max_position_embeddings)
        global_rope = RotaryEmbedding(*common, cfg.rope_theta, cfg.rope_scaling, cfg.max_model_len)
        local_rope = global_rope
        # local layers never scale: a global table with scaling cannot stand in for them even
        # where the two bases are equal
        if cfg.layer_types is not None and (cfg.rope_local_theta != cfg.rope_theta or cfg.rope_scaling):
            local_rope = RotaryEmbedding(*common, cfg.rope_local_theta, max_model_len=cfg.max_model_len)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, local_rope if cfg.is_sliding(i) else global_rope, i, quant_config)
            for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden], or [B, hidden] of keep_rows
        [B] int64 (`LlamaForCausalLM.forward`); needs a forward context."""
        x = self.embed_tokens(input_ids)
        # HF multiplies by the scale rounded to the weights' dtype (sqrt(640) in bf16 is 25.25)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, keep_rows if i == last else None)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's weight names, loading and logits (with soft-capping) over the Gemma 3
    decoder stack."""

    model_class = Gemma3Model
