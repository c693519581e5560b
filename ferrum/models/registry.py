"""Model classes by HF `architectures` name. Mistral (without sliding window), Qwen2 and Qwen3
are the Llama graph: Qwen2's q/k/v bias and Qwen3's per-head q/k RMSNorm are switches in
ModelConfig (`attention_bias`, `qk_norm`), set from the architecture by `ferrum.config`."""
from __future__ import annotations

from torch import nn

from ferrum.config import ModelConfig
from ferrum.errors import UnsupportedModelError
from ferrum.models.gemma3 import Gemma3ForCausalLM
from ferrum.models.llama import LlamaForCausalLM
from ferrum.models.phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # mixtures of experts: the Llama graph with SparseMoeBlock MLPs (ModelConfig.moe_layers)
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The class for cfg.architecture. Raises UnsupportedModelError naming the supported ones."""
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise UnsupportedModelError(f"unsupported architecture {cfg.architecture!r}; "
                                    f"supported: {sorted(MODEL_REGISTRY)}") from None
