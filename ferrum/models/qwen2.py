"""Qwen2 / Qwen2.5: the Llama graph with bias on q/k/v (ModelConfig.attention_bias)."""
from ferrum.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
