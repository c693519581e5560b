"""Qwen3 (dense): the Llama graph with RMSNorm on each head of q and k before RoPE
(ModelConfig.qk_norm) and an explicit head_dim."""
from ferrum.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
