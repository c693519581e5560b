"""Phi-3 (HF `Phi3ForCausalLM`): the Llama graph; its checkpoints store q/k/v as one `qkv_proj`
and gate/up as one `gate_up_proj`, split here at load time into the parts our tensor-parallel
layers shard (each rank reads only its rows of each part). Its LongRoPE scaling lives in
ferrum/layers/rotary_embedding.py, its sliding window in the attention layer."""
from __future__ import annotations

from ferrum.loader.base import LazyWeight, RowSlice
from ferrum.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose loader first splits the fused checkpoint projections."""

    def split_fused_weight(self, name: str, lazy: LazyWeight) -> list[tuple[str, LazyWeight]]:
        """`...qkv_proj.weight` [(Hq + 2 Hkv) * D, hidden] -> q_proj / k_proj / v_proj row slices;
        `...gate_up_proj.weight` [2 I, hidden] -> gate_proj / up_proj; anything else as is."""
        cfg = self.config
        if name.endswith(".qkv_proj.weight"):
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            parts = [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]
            old = "qkv_proj"
        elif name.endswith(".gate_up_proj.weight"):
            i = cfg.intermediate_size
            parts = [("gate_proj", 0, i), ("up_proj", i, i)]
            old = "gate_up_proj"
        else:
            return [(name, lazy)]
        prefix = name[:-len(f"{old}.weight")]
        return [(f"{prefix}{new}.weight", RowSlice(lazy, start, n)) for new, start, n in parts]
