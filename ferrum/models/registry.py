"""Model classes by HF `architectures` name."""
from __future__ import annotations

from torch import nn

from ferrum.config import ModelConfig
from ferrum.errors import UnsupportedModelError
from ferrum.models.llama import LlamaForCausalLM
from ferrum.models.qwen2 import Qwen2ForCausalLM
from ferrum.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise UnsupportedModelError(f"unsupported architecture {cfg.architecture!r}; "
                                    f"supported: {sorted(MODEL_REGISTRY)}") from None
