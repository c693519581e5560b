"""Llama-family decoder (Llama 2/3/3.1, SmolLM2, TinyLlama, Mistral), built from
tensor-parallel layers. Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) are the same graph
with two switches in ModelConfig (`attention_bias`, `qk_norm`); Mixtral, Qwen2-MoE and
Qwen3-MoE swap the MLP of their MoE layers (`ModelConfig.moe_layers`) for a sparse MoE block
(ferrum/layers/moe.py); Mistral-style models attend through a sliding window in the layers
`ModelConfig.layer_types` marks.

Per layer, with TP: qkv_proj and gate_up_proj are column-parallel, o_proj and down_proj are
row-parallel (one all-reduce each): two all-reduces per layer (an MoE block also ends in one).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ferrum.config import ModelConfig
from ferrum.layers.attention import Attention
from ferrum.layers.layernorm import RMSNorm
from ferrum.layers.linear import QKVParallelLinear, RowParallelLinear
from ferrum.layers.mlp import GatedMLP
from ferrum.layers.moe import SparseMoeBlock
from ferrum.layers.quantization.base import QuantConfig
from ferrum.layers.rotary_embedding import RotaryEmbedding
from ferrum.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ferrum.loader.model_loader import packed_target
from ferrum.ops.rope_kv import RopeInputs

# One expert's projection in a Mixtral (w1 gate, w3 up, w2 down) or Qwen-MoE checkpoint.
_EXPERT_TENSOR = re.compile(
    r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")


class LlamaAttention(nn.Module):
    """Self-attention of one decoder layer: fused qkv projection (column-parallel), optional
    per-head q/k norm (Qwen3, Gemma 3: `norm_class`), RoPE (`rotary_emb`, shared by the layers
    of one RoPE variant), paged attention, o_proj (row-parallel). The score scale is
    query_pre_attn_scalar ** -0.5 when the config has one (Gemma 3), else head_dim ** -0.5;
    sliding layers (cfg.layer_types) get the window."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, layer: int,
                 quant_config: QuantConfig | None = None, norm_class: type[nn.Module] = RMSNorm):
        super().__init__()
        D = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, D, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias,
                                          quant_config=quant_config)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * D, cfg.hidden_size, bias=cfg.o_proj_bias,
                                        quant_config=quant_config)
        self.rotary_emb = rotary_emb  # one instance shared by all layers (one cos/sin table)
        self.qk_norm = cfg.qk_norm
        self.q_norm = norm_class(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm_class(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        window = cfg.sliding_window if cfg.is_sliding(layer) else None
        scale = (cfg.query_pre_attn_scalar or D) ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, D, scale, window)
        self.head_dim = D

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [T] int64; x: [T, hidden] -> [T, hidden] (all-reduced over TP ranks), or
        [B, hidden] for keep_rows [B] int64, each prefill chunk's last row (only they attend
        and run o_proj; every row's K/V is still written)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q/k norm and RoPE run inside the attention layer, fused with the K/V store on CUDA
        rope = RopeInputs(positions, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v, keep_rows, rope))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual stream is carried between layers un-added (the
    next layer's input norm adds it, `RMSNorm.forward(x, residual)`). The MLP is the dense
    SwiGLU, or a sparse MoE block in the layers cfg.moe_layers marks."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, layer: int,
                 quant_config: QuantConfig | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary_emb, layer, quant_config)
        if cfg.is_moe(layer):
            self.mlp = SparseMoeBlock(cfg, quant_config)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                quant_config=quant_config, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                keep_rows: torch.Tensor | None = None):
        """positions: [T]; x: [T, hidden] (the previous layer's output); residual: [T, hidden]
        or None for the first layer -> (this layer's MLP output, new residual), [T, hidden]
        each, or [B, hidden] with keep_rows [B] int64 (`LlamaForCausalLM.forward`)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, keep_rows)
        if keep_rows is not None:
            residual = residual.index_select(0, keep_rows)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, the decoder layers (one RoPE table shared by all) and the final norm."""

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               cfg.rope_scaling, cfg.max_model_len)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rope, i, quant_config)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden], or [B, hidden]
        of the rows keep_rows [B] int64 names (see `LlamaForCausalLM.forward`)."""
        x, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, keep_rows if i == last else None)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """input_ids [T] int64, positions [T] int64 -> hidden [T, hidden]; `compute_logits`
    maps selected hidden rows to [N, vocab] logits (on TP rank 0). With `quant_config` the
    decoder's linear layers hold quantized weights; embeddings, norms and the LM head do not."""

    # HF checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    model_class = LlamaModel   # the decoder stack (Gemma 3 brings its own)

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None):
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, quant_config)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden] (needs a forward context).
        keep_rows [B] int64, in a prefill: the row of each sequence's chunk's last token (the
        rows sampled), in order: return only those rows, [B, hidden]. The last layer then
        attends for B queries instead of T and runs o_proj and the MLP on B rows: nothing after
        its attention mixes rows, so the other rows' hidden states would be computed only to be
        dropped (1 / num_layers of a long prefill's GEMMs and attention). Every row's K/V still
        reaches the cache."""
        return self.model(input_ids, positions, keep_rows)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        """(parameter, shard id) for a checkpoint tensor: an expert's projection goes to its
        layer's stacked experts (`FusedMoE` shard ids), Mixtral's `block_sparse_moe` is our
        `mlp`, the rest follows packed_modules_mapping."""
        m = _EXPERT_TENSOR.search(name)
        if m is not None:
            layer, e, proj = name[:m.start()], int(m.group(1)), m.group(2)
            if proj in ("down_proj", "w2"):
                return f"{layer}.mlp.experts.w2_weight", e
            return f"{layer}.mlp.experts.w13_weight", (e, 0 if proj in ("gate_proj", "w1") else 1)
        return packed_target(name.replace(".block_sparse_moe.", ".mlp."), self.packed_modules_mapping)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] -> logits [N, vocab_size] on TP rank 0 (None elsewhere), capped
        as c * tanh(logits / c) when the config has final_logit_softcapping c (Gemma 3)."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
