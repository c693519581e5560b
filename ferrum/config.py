"""Configuration dataclasses: what the model is (ModelConfig), how the KV cache is sized
(CacheConfig), how steps are scheduled (SchedulerConfig) and how the model is split
(ParallelConfig). ModelConfig is read from a Hugging Face `config.json` dict or built from GGUF
metadata by the GGUF loader."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ferrum.errors import InvalidRequestError, UnsupportedModelError

# HF architecture name -> ferrum model family (see ferrum/models/registry.py).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    """Decoder-only transformer shape. Field names follow HF `config.json`.

    head_dim defaults to hidden_size // num_attention_heads. `attention_bias` is True for
    Qwen2 (bias on q/k/v). `qk_norm` is True for Qwen3 (RMSNorm on each head of q and k).
    `rope_scaling` is the HF dict (only `{"rope_type": "llama3", ...}` is supported).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    quantization_config: dict | None = None   # HF `quantization_config` (ferrum/layers/quantization)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF config.json. Raises UnsupportedModelError for an
        architecture or option ferrum does not implement."""
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or d.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        if d.get("sliding_window") and d.get("use_sliding_window", arch == "MistralForCausalLM"):
            if d.get("sliding_window") < d.get("max_position_embeddings", 0):
                raise UnsupportedModelError(
                    f"sliding-window attention (window {d['sliding_window']}) is not supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older `rope_scaling`.
        rp = d.get("rope_parameters") or {}
        rs = d.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
        if rs:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype not in ("llama3", "default"):
                raise UnsupportedModelError(f"rope_scaling type {rtype!r} is not supported "
                                            "(supported: llama3)")
            if rtype == "default":
                rs = None
        n_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        family = SUPPORTED_ARCHITECTURES[arch]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", rp.get("rope_theta", 10000.0)),
            rope_scaling=rs,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            hidden_act=act,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            quantization_config=d.get("quantization_config"),
        )

    def num_params(self) -> int:
        """Parameter count (embedding counted once if tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h
        return L * per_layer + emb * (1 if self.tie_word_embeddings else 2) + h


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 on CPU. Raises InvalidRequestError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"dtype {dtype!r} is not one of auto, float32, bfloat16, float16",
                                  param="dtype")
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """`auto` -> the model dtype; `fp8` / `fp8_e4m3` -> torch.float8_e4m3fn. Raises
    InvalidRequestError otherwise."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise InvalidRequestError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, fp8 (e4m3)",
                              param="kv_cache_dtype")


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidRequestError(f"device {device!r} is not one of auto, cpu, cuda", param="device")
    return device


def resolve_max_model_len(model: ModelConfig, requested: int | None) -> int:
    """The context length (prompt + output tokens) an engine serves: `requested`, or the
    model's `max_position_embeddings` when None.

    Positions at or beyond max_position_embeddings were never trained and have no row in the
    RoPE tables, so a larger value is refused, as vLLM does (`_get_and_verify_max_len`). A
    context-extending rope scaling (llama3) already states the extended length in
    max_position_embeddings (the HF convention), so that limit holds for it too.
    Raises ConfigError (param "max_model_len") for requested < 1 or above the limit."""
    from ferrum.errors import ConfigError
    limit = model.max_position_embeddings
    if requested is None:
        return limit
    if not isinstance(requested, int) or requested < 1:
        raise ConfigError(f"max_model_len must be a positive integer, got {requested!r}",
                          param="max_model_len")
    if requested > limit:
        raise ConfigError(f"max_model_len {requested} exceeds the model's context of {limit} "
                          "positions (max_position_embeddings in its config): positions beyond it "
                          f"have no position embedding; use max_model_len <= {limit}",
                          param="max_model_len")
    return requested


@dataclass
class CacheConfig:
    """Paged KV cache. `num_blocks` None means: size it from memory (kv_cache_memory bytes on
    CPU; gpu_memory_utilization of the GPU on CUDA)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None       # bytes (CPU default: 1 GiB, capped by need)
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache element type: auto (the model dtype) | fp8 (e4m3 with one scale per "
                "layer: half the bytes of bf16, twice the blocks)"})


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None          # None -> model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_waiting: int = 4096                   # more waiting requests -> QueueFullError
    # Prepare and launch decode step n+1 while the device still runs step n (the sampled ids
    # stay on the device). None -> on for CUDA, off for CPU (no device to overlap with).
    async_scheduling: bool | None = None


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Filled in by torchrun launches (SPMD): global ranks already exist.
    distributed_init_method: str | None = None
    step_timeout_s: float = 30.0              # a rank that does not answer within this fails
    # spawned worker ranks must be up (process started, model loaded, KV cache allocated)
    # within this many seconds
    startup_timeout_s: float = 600.0


@dataclass
class EngineConfig:
    """Everything needed to build an engine. `model` is a name (`smollm2`), a local HF folder,
    a .gguf file, a hub id, or `dummy:<folder or config.json>` (random weights)."""

    model: str = "smollm2"
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"            # auto | dummy
    quantization: str | None = field(default=None, metadata={
        "help": "fp8: quantize an unquantized checkpoint's linear layers to FP8 e4m3 (per output "
                "channel) while loading; gptq / awq: random 4-bit weights of dummy: models. A "
                "quantized checkpoint (FP8, compressed-tensors FP8, GPTQ, AWQ, GGUF) runs in its "
                "own format without this"})
    seed: int = 0
    enforce_eager: bool = False
    chat_template: str | None = None     # a Jinja file path or the template text; overrides the model's
    # Special-token strings inside chat messages are encoded as text (only the template's markup
    # yields special tokens); False parses them as control tokens, as before.
    split_special_tokens: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
