"""What every weight loader returns: a `WeightSource` of lazily read tensors under Hugging Face
parameter names (`model.layers.0.self_attn.q_proj.weight`, ...), so a TP rank can read only
its slice (`narrow`) and no rank ever materialises the whole model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from ferrum.config import ModelConfig

if TYPE_CHECKING:  # annotations only: resolving a model name must not wait for torch
    import torch


class LazyWeight(Protocol):
    """One tensor in a weight file, read on demand. `shape` is the logical torch shape
    (HF layout: Linear weights are [out_features, in_features])."""

    shape: tuple[int, ...]

    def load(self) -> torch.Tensor:
        """The whole tensor (float32 for dequantized GGUF; stored dtype otherwise)."""

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Only rows/columns [start, start+length) along `dim`; reads only what it needs
        where the format allows."""


class WeightSource(Protocol):
    """A checkpoint's tensors by Hugging Face parameter name."""

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""

    def get(self, name: str) -> LazyWeight:
        """The lazily read tensor `name` (KeyError when absent)."""


@dataclass
class RowSlice:
    """Rows [start, start + length) of another LazyWeight, itself a LazyWeight (a fused
    checkpoint tensor seen as its parts). Reads only those rows where the base can."""

    base: LazyWeight
    start: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.length, *self.base.shape[1:])

    def load(self) -> torch.Tensor:
        return self.base.narrow(0, self.start, self.length)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.base.narrow(0, self.start + start, length)
        return self.load().narrow(dim, start, length)


@dataclass
class ModelSource:
    """A resolved model: config, weights and what the tokenizer needs.

    `tokenizer_loader()` returns a ferrum Tokenizer (ferrum/tokenizer/tokenizer.py).
    `eos_token_ids` come from generation_config.json / tokenizer / GGUF metadata.
    `name` is what /v1/models reports.
    """

    name: str
    config: ModelConfig
    weights: Callable[[], WeightSource]
    tokenizer_loader: Callable[[], object] | None
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    path: str | None = None
    fmt: str = "safetensors"   # safetensors | gguf | dummy

