"""Configuration dataclasses, the one place where every engine option and its default lives.

ModelConfig says what the model is (read from a Hugging Face config through transformers'
`AutoConfig`, or built from GGUF metadata by the GGUF loader). EngineConfig and its parts say
how to run it: CacheConfig (KV pool), SchedulerConfig (steps), ParallelConfig (TP ranks).

Every option field carries `metadata` (see `option`): its help text, and optionally a CLI flag
name, aliases, choices or a parser. The CLI flags (`ferrum.entrypoints.args.add_engine_args`)
and `LLM(**kwargs)` (`EngineConfig.from_kwargs`) are generated from these fields, as vLLM's
EngineArgs does, so a default is written only here.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from ferrum.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from ferrum.tool_parsers import TOOL_PARSERS

# `--quantization` values: fp8 quantizes an unquantized checkpoint while loading; the 4-bit
# formats only describe random weights of `dummy:` models (a real checkpoint says its format).
QUANTIZATION_CHOICES = ("fp8", "gptq", "awq", "gguf_q4_0", "gguf_q8_0", "gguf_q4_k", "gguf_q5_k",
                        "gguf_q6_k")

# HF architecture name -> ferrum model family (see ferrum/models/registry.py).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # issue 17: mixtures of experts, Gemma 3, Phi-3 (fields in ModelConfig's last block)
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


@dataclass(slots=True)
class ModelConfig:
    """Decoder-only transformer shape. Field names follow HF `config.json`.

    head_dim defaults to hidden_size // num_attention_heads. `attention_bias` is True for
    Qwen2 (bias on q/k/v). `qk_norm` is True for Qwen3 (RMSNorm on each head of q and k).
    `rope_scaling` is the HF dict with its `rope_type` (llama3, linear, yarn, longrope; see
    ferrum/layers/rotary_embedding.py), for the full-attention layers.

    The last block (sliding window, mixture of experts, Gemma 3) is filled by `_family_fields`
    from the HF keys of those families; its defaults describe a dense model that attends to
    the whole context.
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
    o_proj_bias: bool = False   # Llama / Qwen3 / Gemma 3 `attention_bias` also biases o_proj
    mlp_bias: bool = False      # Llama `mlp_bias`: gate, up and down projections
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    quantization_config: dict | None = None   # HF `quantization_config` (ferrum/layers/quantization)

    # ---- issue 17: sliding window, mixture of experts, Gemma 3 ---------------------------
    # Sliding-window attention: in layer i with layer_types[i] == "sliding_attention" the query
    # at position p sees keys k with p - sliding_window < k <= p (HF masking_utils
    # `sliding_window_overlay`); "full_attention" layers see the whole context. layer_types is
    # None when no layer slides.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None    # RoPE base of sliding layers (Gemma 3: 10,000)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): layer i has a sparse MoE block when
    # moe_layers[i] (else the dense MLP of intermediate_size). Router: softmax over the
    # num_experts logits, the num_experts_per_tok largest kept, renormalised to sum 1 when
    # norm_topk_prob (Mixtral's softmax over the top-k logits is the same numbers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, sigmoid-gated
    moe_layers: list[bool] | None = None
    # Gemma 3: attention scale query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5);
    # final logits capped as c * tanh(logits / c) when final_logit_softcapping is set.
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # The engine's context limit, set by the model runner (None: max_position_embeddings);
    # LongRoPE picks its long or short factors by it, and the RoPE tables have that many rows.
    max_model_len: int | None = None

    _SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")

    def __post_init__(self):
        """A config.json or GGUF header with a size of 0, below 0 or not a whole number (or
        heads that do not group over the KV heads, or a negative rms_norm_eps) is an
        UnsupportedModelError here, not a ZeroDivisionError or a negative tensor size deep in
        the KV pool or the model, or NaN logits."""
        dense = not self.moe_layers or not all(self.moe_layers)   # some layer has the dense MLP
        for name in self._SIZES + (("intermediate_size",) if dense else ()):
            v = getattr(self, name)
            if not _is_whole(v):
                raise UnsupportedModelError(f"model config: {name} must be a whole number >= 1, got {v!r}")
        # a negative epsilon makes RMSNorm's mean + eps negative for small rows: NaN logits
        if not (_is_number(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise UnsupportedModelError(f"model config: rms_norm_eps must be a number >= 0, got "
                                        f"{self.rms_norm_eps!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides (then K/V older than it is never read again and
        its blocks can be freed), else None."""
        if self.layer_types and all(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window
        return None

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` has a sparse MoE block instead of the dense MLP."""
        return self.moe_layers is not None and self.moe_layers[layer]

    @property
    def family(self) -> str:
        """The ferrum model family of the architecture (llama | qwen2 | qwen3; models/registry.py)."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF config.json: transformers' `AutoConfig.for_model` fills the
        defaults of its `model_type`, then `from_hf_config`. Raises UnsupportedModelError for
        an unknown model type, architecture or option."""
        from transformers import AutoConfig
        if not isinstance(d, dict):
            raise UnsupportedModelError(f"a model config must be a JSON object, got {type(d).__name__}")
        try:
            hf = AutoConfig.for_model(**d)
        except Exception as e:  # noqa: BLE001  transformers' validation errors are of many types
            why = " ".join(str(e).split())   # on one line
            raise UnsupportedModelError(
                f"unsupported model config (model_type {d.get('model_type')!r}: {why}); supported "
                f"architectures: {sorted(SUPPORTED_ARCHITECTURES)}") from e
        return cls.from_hf_config(hf)

    @classmethod
    def from_hf_config(cls, hf) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig` (e.g. `AutoConfig.from_pretrained(folder)`).
        Raises UnsupportedModelError for an architecture or option ferrum does not implement."""
        archs = getattr(hf, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:   # ferrum picks the model class by "architectures", as vLLM does
            raise UnsupportedModelError(
                f"config.json has no \"architectures\" list (model_type "
                f"{getattr(hf, 'model_type', None)!r}); add the model class, one of "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        extra = _family_fields(hf, arch)
        n_heads = hf.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // n_heads,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", family == "gemma3")),
            attention_bias=bool(getattr(hf, "attention_bias", getattr(
                hf, "qkv_bias", family in ("qwen2", "qwen2_moe")))),
            # transformers' Llama, Qwen3(-MoE) and Gemma 3 give o_proj a bias with q/k/v's;
            # Qwen2(-MoE) bias q/k/v only
            o_proj_bias=bool(getattr(hf, "attention_bias", False))
            and family in ("llama", "qwen3", "qwen3_moe", "gemma3"),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)) and family == "llama",
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_id=_id_list(getattr(hf, "eos_token_id", None)),
            quantization_config=_as_dict(getattr(hf, "quantization_config", None)),
            **extra,
        )

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Parameters of layer `layer`'s MLP: the dense gate/up/down, or for an MoE layer the
        router, every expert (or, with `active`, the num_experts_per_tok experts one token
        reads) and the shared expert with its gate."""
        h = self.hidden_size
        if not self.is_moe(layer):
            return 3 * h * self.intermediate_size
        n = self.num_experts_per_tok if active else self.num_experts
        p = h * self.num_experts + n * 3 * h * self.moe_intermediate_size
        if self.shared_expert_intermediate_size:
            p += 3 * h * self.shared_expert_intermediate_size + h
        return p

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embedding counted once if tied). `active`: what one token reads
        in a decode step (only its num_experts_per_tok experts of each MoE layer)."""
        h, L = self.hidden_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + (4 if self.family == "gemma3" else 2) * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h
        mlp = sum(self.mlp_params(i, active) for i in range(L))
        return L * per_layer + mlp + emb * (1 if self.tie_word_embeddings else 2) + h


# ---- issue 17: family fields (sliding window, rope scaling, MoE, Gemma 3) -------------------
# Read from transformers' own config class for the model type, which normalises each family's
# conventions (rope_scaling vs rope_parameters, per-layer-type rope, layer_types derived from
# use_sliding_window / max_window_layers / sliding_window_pattern, Phi-3's "su").
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _is_number(v) -> bool:
    """An int or float, not a bool (JSON's true would pass isinstance(v, int))."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_whole(v) -> bool:
    """A whole number >= 1 (a size, a count), not a bool."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _rope_fields(params: dict, arch: str, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from one HF `rope_parameters` dict."""
    params = dict(params or {})
    rtype = params.get("rope_type", params.get("type", "default"))
    if arch == "Phi3ForCausalLM" and rtype in ("su", "yarn"):  # Phi-3's names for LongRoPE
        rtype = "longrope"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope scaling type {rtype!r} ({where}) is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"partial rotary embedding (partial_rotary_factor "
                                    f"{params['partial_rotary_factor']}) is not supported")
    for key in ("rope_theta", "factor"):   # a string or 0 here failed deep in the RoPE table
        v = params.get(key)
        if v is None:
            continue
        if not (_is_number(v) and v > 0):
            raise UnsupportedModelError(f"rope {key} ({where}) must be a number > 0, got {v!r}")
    theta = float(params.get("rope_theta", 10000.0))
    if rtype == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = rtype
    return theta, scaling


def _family_fields(hf, arch: str) -> dict[str, Any]:
    """ModelConfig's rope, activation, sliding-window, MoE and Gemma 3 fields from a
    transformers `PretrainedConfig` of architecture `arch`. Raises UnsupportedModelError for a
    rope type, activation or option not implemented."""
    if arch == "Gemma3ForCausalLM" and getattr(hf, "model_type", None) == "gemma3":
        # the multimodal Gemma 3 config (text_config inside); only the text model is supported
        raise UnsupportedModelError("Gemma 3 with a vision tower (model_type 'gemma3') is not "
                                    "supported; use a text-only Gemma3ForCausalLM checkpoint")
    L = hf.num_hidden_layers
    out: dict[str, Any] = {}
    # transformers >= 5 keeps rope_theta and the scaling in `rope_parameters`; 4.x has
    # `rope_theta` and `rope_scaling`.
    rp = getattr(hf, "rope_parameters", None) or {
        **(getattr(hf, "rope_scaling", None) or {}),
        "rope_theta": getattr(hf, "rope_theta", 10000.0)}
    if "full_attention" in rp:  # per layer type (Gemma 3)
        out["rope_theta"], out["rope_scaling"] = _rope_fields(rp["full_attention"], arch, "full attention")
        local_theta, local_scaling = _rope_fields(rp.get("sliding_attention") or {}, arch,
                                                  "sliding attention")
        if local_scaling is not None:
            raise UnsupportedModelError("rope scaling on sliding-window layers is not supported")
        out["rope_local_theta"] = local_theta
    else:
        out["rope_theta"], out["rope_scaling"] = _rope_fields(rp, arch, "rope_parameters")
    if out["rope_scaling"] and out["rope_scaling"]["rope_type"] in ("yarn", "longrope"):
        out["rope_scaling"].setdefault("original_max_position_embeddings",
                                       getattr(hf, "original_max_position_embeddings", None)
                                       or hf.max_position_embeddings)
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"activation {act!r} is not supported; supported: "
                                    f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    out["hidden_act"] = act

    window = getattr(hf, "sliding_window", None) or None
    if window is not None and not _is_whole(window):
        raise UnsupportedModelError(f"model config: sliding_window must be a whole number >= 1 or "
                                    f"null, got {window!r}")
    types = getattr(hf, "layer_types", None)
    if window and types is None:  # Mistral, Mixtral, Phi-3, Qwen3-MoE: every layer slides
        types = ["sliding_attention"] * L
    if window and types and window < hf.max_position_embeddings and "sliding_attention" in types:
        out["sliding_window"], out["layer_types"] = int(window), list(types)
        if out.get("rope_local_theta") is None:
            out["rope_local_theta"] = out["rope_theta"]
    if getattr(hf, "attn_logit_softcapping", None):
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is "
                                    "not supported")
    if arch == "Gemma3ForCausalLM":
        out["query_pre_attn_scalar"] = float(hf.query_pre_attn_scalar)
        out["final_logit_softcapping"] = hf.final_logit_softcapping

    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
    if experts:
        out["num_experts"] = int(experts)
        out["num_experts_per_tok"] = int(hf.num_experts_per_tok)
        if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size
            out["moe_intermediate_size"] = hf.intermediate_size
            out["moe_layers"] = [True] * L
        else:  # Qwen2-MoE / Qwen3-MoE (modeling_qwen3_moe.py Qwen3MoeDecoderLayer)
            out["moe_intermediate_size"] = hf.moe_intermediate_size
            out["norm_topk_prob"] = bool(hf.norm_topk_prob)
            step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or [])
            out["moe_layers"] = [i not in dense and (i + 1) % step == 0 for i in range(L)]
            out["shared_expert_intermediate_size"] = int(
                getattr(hf, "shared_expert_intermediate_size", 0) or 0)
    return out


def _as_dict(value) -> dict | None:
    """A transformers quantization config (a dict, or an object with to_dict) as a dict."""
    return value.to_dict() if hasattr(value, "to_dict") else value


def _id_list(value) -> list[int]:
    """An HF `eos_token_id` (None, an int or a list) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _generation_config(folder: str) -> dict | None:
    """A HF folder's generation_config.json as a dict (None when there is none), read as
    plain JSON: transformers' GenerationConfig refused values ferrum does not read
    (max_new_tokens 0 failed every load, --generation-config vllm too) and warned that a
    temperature without do_sample "may be ignored" while ferrum applies it. Raises ValueError
    (json.JSONDecodeError) for a file that is not one JSON object."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        given = json.load(f)
    if not isinstance(given, dict):
        raise ValueError(f"not a JSON object but {type(given).__name__}")
    return given


def generation_eos_token_ids(folder: str) -> list[int] | None:
    """`eos_token_id` of a HF folder's generation_config.json; None when the folder has no
    such file or it names no EOS id. Raises ValueError for a file that is not a JSON object
    and for ids that are not integers."""
    value = (_generation_config(folder) or {}).get("eos_token_id")
    ids = _id_list(value)
    # any JSON can stand here; a string or null failed later, inside the tokenizer
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of token ids (integers), "
                         f"got {value!r}")
    return ids or None


# generation_config.json's sampling fields and the SamplingParams field each sets (vLLM's list;
# HF's max_new_tokens is max_tokens)
_GENERATION_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                        "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                        "max_new_tokens": "max_tokens"}


def generation_sampling_defaults(folder: str) -> dict[str, Any]:
    """The sampling defaults a model's creator wrote in `folder`/generation_config.json, as
    SamplingParams fields: temperature, top_p, top_k, min_p, repetition_penalty, and
    max_new_tokens as max_tokens (the fields vLLM's `--generation-config auto` reads; do_sample
    is ignored, as there; a null is no value). {} when the folder has no such file. Requests that leave a field
    unset take it from here. Raises ConfigError (param "generation_config") when the file
    cannot be read or a value is not one SamplingParams accepts."""
    from ferrum.sampling_params import SamplingParams
    where = os.path.join(folder, "generation_config.json")
    try:
        given = _generation_config(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} cannot be read: {type(e).__name__}: {str(e).splitlines()[0]}",
                          param="generation_config") from None
    if given is None:
        return {}
    defaults = {ours: given[hf] for hf, ours in _GENERATION_SAMPLING.items() if given.get(hf) is not None}
    try:
        SamplingParams(**defaults)   # checked once here, not as every request's 400
    except (InvalidRequestError, TypeError) as e:
        raise ConfigError(f"{where}: {e}; start with --generation-config vllm to ignore the "
                          "file's sampling defaults", param="generation_config") from None
    return defaults


def resolve_sampling_defaults(generation_config: str, model_folder: str | None) -> dict[str, Any]:
    """`--generation-config`'s sampling defaults (see generation_sampling_defaults): "auto"
    reads `model_folder` (a HF folder; None for GGUF files and dummy models, which have none),
    "vllm" gives {} (SamplingParams' own defaults), anything else names a folder holding a
    generation_config.json. Raises ConfigError for a folder without one."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        return generation_sampling_defaults(model_folder) if model_folder else {}
    if not os.path.isfile(os.path.join(generation_config, "generation_config.json")):
        raise ConfigError(f"--generation-config {generation_config!r} is not auto, vllm or a folder "
                          "holding a generation_config.json", param="generation_config")
    return generation_sampling_defaults(generation_config)


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype, device: str):
    """`auto` -> torch.bfloat16 on CUDA, torch.float32 on CPU; a name from _DTYPES or a
    torch.dtype -> that torch.dtype. Raises InvalidRequestError otherwise."""
    import torch  # imported here so that building the CLI parser does not load torch
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"dtype {dtype!r} is not one of auto, float32, bfloat16, float16",
                                  param="dtype")
    return getattr(torch, _DTYPES[dtype])


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """`auto` -> the model dtype; `fp8` / `fp8_e4m3` -> torch.float8_e4m3fn. Raises
    InvalidRequestError otherwise."""
    import torch  # as in resolve_dtype: the CLI parser is built without torch
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise InvalidRequestError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, fp8 (e4m3)",
                              param="kv_cache_dtype")


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu. Raises InvalidRequestError (param "device")
    for a name other than auto, cpu, cuda, cuda:N, and for cuda when this torch has no CUDA
    or sees no GPU, or cuda:N beyond the GPUs it sees."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidRequestError(f"device {device!r} is not one of auto, cpu, cuda", param="device")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "torch sees no GPU (CUDA_VISIBLE_DEVICES, driver)")
            raise InvalidRequestError(f"device {device!r}: {why} (torch {torch.__version__}); "
                                      "use --device cpu or auto", param="device")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise InvalidRequestError(f"device {device!r}: torch sees {torch.cuda.device_count()} GPU(s), "
                                      f"cuda:0 to cuda:{torch.cuda.device_count() - 1}", param="device")
    return device


def resolve_max_model_len(model: ModelConfig, requested: int | None) -> int:
    """The context length (prompt + output tokens) an engine serves: `requested`, or the
    model's `max_position_embeddings` when None.

    Positions at or beyond max_position_embeddings were never trained and have no row in the
    RoPE tables, so a larger value is refused, as vLLM does (`_get_and_verify_max_len`). A
    context-extending rope scaling (llama3) already states the extended length in
    max_position_embeddings (the HF convention), so that limit holds for it too.
    Raises ConfigError (param "max_model_len") for requested < 1 or above the limit."""
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


# `ferrum serve --max-request-body`: the largest POST body the server reads. 8 MiB holds a
# million-token context of English text (about 4 bytes a token) and its JSON, or a million
# token ids; a larger body is answered 413 before anything parses or tokenizes it.
MAX_REQUEST_BODY = "8MiB"

# `ferrum serve --shutdown-timeout`: seconds the server lets open requests run after SIGTERM /
# Ctrl-C before it ends them with an error. Below Kubernetes' default grace period (30 s
# before SIGKILL), so the ended streams' last events still go out.
SHUTDOWN_TIMEOUT_S = 20.0


def parse_size(value) -> int:
    """Bytes from an int or a size string: `2GiB`, `512 MiB` (powers of 1024), `2GB`, `2g`
    (powers of 1000), `1073741824`; parsed by pydantic's ByteSize. Raises
    InvalidRequestError for anything else, or a negative size."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    from pydantic import ByteSize, TypeAdapter, ValidationError
    try:
        return int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError:
        raise InvalidRequestError(f"{value!r} is not a size: give bytes or a number with a unit "
                                  "such as 512MiB, 2GiB or 4GB") from None


def parse_body_limit(value) -> int:
    """`--max-request-body` / `max_request_body`: `parse_size`, at least 1 byte (every POST
    has a body, so a limit of 0 would refuse them all). Raises InvalidRequestError otherwise."""
    n = parse_size(value)
    if n < 1:
        raise InvalidRequestError(f"max_request_body must be at least 1 byte, got {value!r} (every "
                                  "POST has a body)", param="max_request_body")
    return n


def format_size(n: int) -> str:
    """`n` bytes as the size options take them (`parse_size` reads it back): in the largest
    of GiB, MiB, KiB that divides it (8MiB, 1536KiB), else in bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_threads(value) -> int:
    """A thread count (`--threads`, `threads=`): an int or its text, at least 1. Raises
    InvalidRequestError (a ValueError, so argparse reports it as a bad --threads) otherwise."""
    try:
        n = int(value) if isinstance(value, str) else value
    except ValueError:
        n = None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequestError(f"threads must be a whole number >= 1, got {value!r} (leave "
                                  "it out for the default: the usable cores less one)",
                                  param="threads")
    return n


def option(default=None, help: str = "", *, default_factory=None, env: str | None = None,
           **cli) -> Any:
    """A config field with its documentation: `help` (a sentence; say in "(default: ...)" what
    None means when the default is None), and optional CLI details in `cli`: `flag` (its
    name, default `--field-name`), `aliases` (more flag names), `choices`, `metavar`, `parse`
    (str -> value, also applied to str values given to `from_kwargs`), `positional=True` (an
    optional positional argument: the model), `cli=False` (not a flag: set by code).
    `env`: an environment variable that overrides the default when set (read each time a
    config is created; bools: 1/0; parsed by `parse` when given): the README's table."""
    metadata = {"help": help, "env": env, **cli}
    if env is not None:
        metadata["plain_default"] = default   # the default when the environment is not read
        default_factory = functools.partial(_env_value, env, default, cli.get("parse"))
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _env_value(name: str, default, parse=None):
    """`default`, or the value of environment variable `name` when set: for a bool default (or
    parse=bool) "1"/"0" (also true/false, yes/no, on/off), else parsed by `parse` (or the default's type).
    Raises ConfigError (an option, not a request) for a value it cannot read."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    if isinstance(default, bool) or parse is bool:   # parse=bool: a flag whose default is None
        flag = text.strip().lower()
        if flag in ("1", "true", "yes", "on"):
            return True
        if flag in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"environment variable {name}={text!r}: expected 1 or 0 "
                          "(or true / false, yes / no, on / off)", param=name)
    try:
        return (parse or (type(default) if default is not None else str))(text)
    except ValueError as e:
        raise ConfigError(f"environment variable {name}={text!r}: {e}", param=name) from None


def option_default(f: dataclasses.Field):
    """The default of a field (calling its factory: an env-overridable default reads the
    environment now)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_positive(cfg, ints: tuple[str, ...] = (), floats: tuple[str, ...] = ()) -> None:
    """Raise ConfigError (param = the field) unless each field named in `ints` is a whole
    number >= 1 (None allowed: "not set") and each in `floats` a finite number > 0: a zero
    token budget or block size would make the scheduler spin or divide by zero later, far
    from the flag that caused it."""
    for name in ints:
        v = getattr(cfg, name)
        if v is not None and not _is_whole(v):
            raise ConfigError(f"{name} must be a whole number >= 1, got {v!r}", param=name)
    for name in floats:
        v = getattr(cfg, name)
        if not (_is_number(v) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{name} must be a finite number > 0, got {v!r}", param=name)


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks the pool gets."""

    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "fix the KV pool at this many blocks per rank "
                                       "(default: size it from memory)")
    kv_cache_memory: int | None = option(
        None, "KV pool bytes per rank on CPU, with a unit (e.g. 2GiB) (default: enough for "
        "max_num_seqs x max_model_len tokens, at most 1GiB)", parse=parse_size, metavar="SIZE")
    gpu_memory_utilization: float = option(
        0.90, "fraction of GPU memory for weights + activations + KV pool (CUDA)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a shared prompt prefix")
    kv_cache_dtype: str = option(
        "auto", "KV cache element type: auto (the model dtype) | fp8 (e4m3 with one scale per "
        "layer: half the bytes of bf16, twice the blocks)", choices=("auto", "fp8"))

    def __post_init__(self):
        check_positive(self, ("block_size", "num_kv_blocks"), ("gpu_memory_utilization",))
        if self.gpu_memory_utilization > 1:
            raise ConfigError(f"gpu_memory_utilization is a fraction of the GPU's memory, at most 1, got "
                              f"{self.gpu_memory_utilization!r}", param="gpu_memory_utilization")


@dataclass(slots=True)
class SchedulerConfig:
    """How each step is filled: batch limits, context length, queue limit."""

    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int = option(4096, "most tokens (prefill + decode) in one step")
    max_model_len: int | None = option(None, "context length: prompt + output tokens "
                                       "(default: the model's max_position_embeddings, lowered "
                                       "to what the KV pool holds when it holds less)",
                                       aliases=("--ctx-size",))
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    long_prefill_token_threshold: int | None = option(
        None, "with chunked prefill, compute at most this many tokens of one prompt per step, so "
        "the running decodes and shorter prompts share the steps of a long one instead of waiting "
        "for all its chunks (vLLM's flag of that name; fewer tokens per step cost a long prompt's "
        "own time to first token) (default: the whole step budget)")
    max_waiting: int = option(4096, "most queued requests of the server; more raise QueueFullError "
                                 "(HTTP 503); offline batches queue all their prompts")
    async_scheduling: bool | None = option(
        None, "prepare and launch decode step n+1 while the device runs step n (default: on "
        "for CUDA, off for CPU, where it only delays each token by one step)")
    longest_decode_first: bool | None = option(
        None, "order each step's decode rows by context length, longest first: the decode "
        "attention starts its programs in row order, so the longest sequences start first and "
        "the SMs finish together (longest-processing-time-first) instead of idling behind a long "
        "sequence that started last; changes no value (default: on for CUDA, off for CPU, whose "
        "attention has no waves of programs)",
        env="FERRUM_LONGEST_DECODE_FIRST", parse=bool)

    def __post_init__(self):
        check_positive(self, ("max_num_seqs", "max_num_batched_tokens", "max_waiting",
                              "long_prefill_token_threshold"))


@dataclass(slots=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks, and how long a rank may take to answer."""

    tensor_parallel_size: int = option(1, "TP ranks (one process each); must divide the "
                                       "attention heads", aliases=("-tp",))
    distributed_init_method: str | None = option(None, "set by torchrun launches", cli=False)
    step_timeout_s: float = option(30.0, "seconds a TP rank may take to answer a step before "
                                   "the step fails")
    startup_timeout_s: float = option(600.0, "seconds spawned TP ranks may take to start "
                                      "(process up, model loaded, KV cache allocated)")
    enable_expert_parallel: bool = option(
        False, "MoE layers: whole experts per TP rank (num_experts / tp each, tokens gathered "
        "and their outputs all-reduced) instead of every expert's FFN split over the ranks")

    def __post_init__(self):
        check_positive(self, ("tensor_parallel_size",), ("step_timeout_s", "startup_timeout_s"))


def parse_count(text: str) -> int:
    """A whole number >= 0 from text. Raises ValueError."""
    value = int(text)
    if value < 0:
        raise ValueError(f"expected a whole number >= 0, got {text!r}")
    return value


def _parse_ints(text: str, names: str) -> tuple[int, ...]:
    """`text` as len(names.split(",")) comma-separated whole numbers >= 1. Raises ValueError."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != len(names.split(",")) or min(values) < 1:
        raise ValueError(f"expected {len(names.split(','))} whole numbers >= 1, {names}, got {text!r}")
    return values


def parse_gemv_config(text: str) -> tuple[int, int, int, int]:
    """`"BN,BK,warps,stages"` -> four ints (the Triton GEMV's block shape). Raises ValueError."""
    return _parse_ints(text, "BN,BK,warps,stages")


def parse_decode_attn_config(text: str) -> tuple[int, int, int]:
    """`"BLOCK_N,warps,stages"` -> three ints (the Triton decode attention's tile). Raises
    ValueError."""
    return _parse_ints(text, "BLOCK_N,warps,stages")


@dataclass(slots=True)
class KernelConfig:
    """Which kernels run: switches for speed work and debugging, process-wide (the kernels
    read `KERNELS`, which `set_kernels` fills from the engine's config when it builds its
    model). Each has an environment variable that overrides its default."""

    triton_gemv: bool = option(True, "batch-1 linears through the Triton GEMV (CUDA, 16-bit)",
                               env="FERRUM_TRITON_GEMV")
    gemv_config: tuple | None = option(
        None, "Triton GEMV block shape BN,BK,warps,stages (default: chosen per matrix shape)",
        env="FERRUM_GEMV_CONFIG", parse=parse_gemv_config, metavar="BN,BK,WARPS,STAGES")
    qgemv_config: tuple | None = option(
        None, "block shape BN,BK,warps,stages of the quantized (FP8, 4-bit) GEMVs (default: "
        "chosen per matrix shape and row count)", env="FERRUM_QGEMV_CONFIG",
        parse=parse_gemv_config, metavar="BN,BK,WARPS,STAGES")
    decode_attn_config: tuple | None = option(
        None, "Triton decode attention's tile BLOCK_N,warps,stages, BLOCK_N a power of two >= 16 tokens "
        "(default: chosen by head size, KV dtype and split count, ferrum/ops/attention_triton.py)",
        env="FERRUM_DECODE_ATTN_CONFIG", parse=parse_decode_attn_config, metavar="BLOCK_N,WARPS,STAGES")
    gluon_gemv: bool = option(True, "FP8, 4-bit and GGUF Q4_K linears of 1-4 rows (and one-row bf16 on "
                              "the shapes its tuning table lists) through the Gluon GEMVs "
                              "(ferrum/ops/gemv_gluon.py; CUDA sm_90+) instead of the Triton ones",
                              env="FERRUM_GLUON_GEMV")
    silu_gemv: bool = option(
        False, "down_proj's Gluon GEMV (bf16 / FP8, 1-4 rows) computes silu(gate) * up from gate_up_proj's "
        "output as it loads x, instead of a SiLU-mul kernel before it (ferrum/ops/gemv_gluon.py; same "
        "values, one launch fewer per layer; off: FP8 batch 1 0.985x on an H100, "
        "benchmarks/results/h100-2026-12-05c)",
        env="FERRUM_SILU_GEMV")
    q8_from_producers: bool = option(
        True, "the RMSNorm, decode-attention merge and SiLU-mul kernels before a Q4_K or 4-bit Gluon "
        "GEMV also write the int8 / int16 x it reads (ferrum/ops/act_quant.py): one q8_1 / q16 launch "
        "fewer per GEMV input",
        env="FERRUM_Q8_FROM_PRODUCERS")
    sdpa_prefill_min_tokens: int = option(
        2048, "CUDA prefill: a prompt chunk of at least this many tokens without cached context "
        "attends through torch's scaled_dot_product_attention (cuDNN / FlashAttention kernels) "
        "instead of the Triton prefill kernel (16-bit model and KV cache, layers without a sliding "
        "window, eager steps: a prefill CUDA graph keeps the kernel); 0: never",
        env="FERRUM_SDPA_PREFILL_MIN_TOKENS", parse=parse_count)
    fused_rope_kv: bool = option(True, "q/k norm, RoPE and the KV-cache store of each layer in one "
                                 "Triton kernel (CUDA; ferrum/ops/rope_kv.py) instead of up to four",
                                 env="FERRUM_FUSED_ROPE_KV")
    pdl: bool = option(True, "programmatic dependent launch of the decode kernels (CUDA sm_90+)",
                       env="FERRUM_PDL")
    cpu_blas_gemv: bool = option(True, "CPU float32 linears through numpy's OpenBLAS (one "
                                 "process) instead of torch", env="FERRUM_CPU_BLAS_GEMV")
    cpu_packed_weights: bool = option(
        True, "keep a oneDNN-packed copy of each CPU float32 linear weight (one process) for "
        "forwards of more than one token (batched decode, prefill); costs the weights' memory "
        "again", env="FERRUM_CPU_PACKED_WEIGHTS")
    cpu_column_major_weights: bool = option(
        True, "store CPU linear weights column-major (faster batch-1 GEMV on MKL)",
        env="FERRUM_CPU_COLUMN_MAJOR_WEIGHTS")
    disable_symm_mem: bool = option(False, "no one-shot all-reduce over symmetric memory for "
                                    "small TP messages (CUDA): NCCL only",
                                    env="FERRUM_DISABLE_SYMM_MEM")
    force_triton: bool = option(False, "run the Triton kernels on CPU tensors too (tests, with "
                                "TRITON_INTERPRET=1)", env="FERRUM_FORCE_TRITON", cli=False)

    def __post_init__(self):
        v = self.sdpa_prefill_min_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"sdpa_prefill_min_tokens must be a whole number >= 0, got {v!r}",
                              param="sdpa_prefill_min_tokens")


def _kernels_at_import() -> KernelConfig:
    """KernelConfig from the environment, or from the plain defaults when a FERRUM_* value in
    it is bad: importing ferrum must not fail on one (a traceback before any command runs);
    building an engine config reads the environment again and raises the named error there."""
    try:
        return KernelConfig()
    except InvalidRequestError:
        return KernelConfig(**{f.name: f.metadata["plain_default"] if f.metadata.get("env") else option_default(f)
                               for f in dataclasses.fields(KernelConfig)})


KERNELS = _kernels_at_import()
"""The kernel switches in force in this process (see KernelConfig)."""


def set_kernels(kernels: KernelConfig) -> None:
    """Put `kernels` in force for this process (in place: modules hold `KERNELS`)."""
    for f in dataclasses.fields(KernelConfig):
        setattr(KERNELS, f.name, getattr(kernels, f.name))


@dataclass(slots=True)
class EngineConfig:
    """Everything needed to build an engine. `model` is a name (`smollm2`), a local HF folder,
    a .gguf file, a hub id, or `dummy:<folder or config.json>` (random weights)."""

    model: str = option("smollm2", "model name (smollm2), HF folder, .gguf file, hub id "
                        "org/name, or dummy:<config.json>", positional=True)
    device: str = option("auto", "auto | cpu | cuda | cuda:N (auto: cuda when available)")
    dtype: str = option("auto", "weight and activation dtype (auto: bfloat16 on CUDA, "
                        "float32 on CPU)", choices=("auto", "float32", "bfloat16", "float16"))
    load_format: str = option("auto", "dummy: random weights of the model's shape",
                              choices=("auto", "dummy"))
    quantization: str | None = option(
        None, "fp8: quantize an unquantized checkpoint's linear layers to FP8 e4m3 (per output "
        "channel) while loading; gptq / awq / gguf_*: random 4-bit weights of dummy: models. A "
        "quantized checkpoint (FP8, compressed-tensors FP8, GPTQ, AWQ, GGUF) runs in its own "
        "format without this (default: none)", choices=QUANTIZATION_CHOICES, aliases=("-q",))
    seed: int = option(0, "seed of dummy weights and the global RNG (a request's sampling "
                       "seed is separate)", flag="--engine-seed")
    enforce_eager: bool = option(False, "no CUDA graphs")
    chat_template: str | None = option(None, "Jinja chat template (a file path or the "
                                       "template text) that replaces the model's (default: "
                                       "the model's own)")
    tool_call_parser: str = option(
        "auto", "format of the model's tool calls, read out of chat output under tool_choice "
        "auto (auto: from the chat template's markers)", choices=("auto", *TOOL_PARSERS))
    generation_config: str = option(
        "auto", "where requests that leave temperature, top_p, top_k, min_p, "
        "repetition_penalty or max_tokens unset take them from: auto = the model folder's "
        "generation_config.json (its creator's settings, as vLLM), vllm = SamplingParams' own "
        "defaults, or a folder holding a generation_config.json")
    split_special_tokens: bool = option(
        True, "encode special-token strings typed inside chat messages as text (only the "
        "template's markup yields special tokens); --no-split-special-tokens parses them as "
        "control tokens")
    threads: int | None = option(
        None, "CPU threads per rank for torch ops and the BLAS (default: the usable cores less "
        "one, split over the TP ranks, at least 1: a busy core then stalls no step)",
        parse=parse_threads)   # checked while parsing flags, not once the model has loaded
    cache: CacheConfig = option(default_factory=CacheConfig)
    scheduler: SchedulerConfig = option(default_factory=SchedulerConfig)
    parallel: ParallelConfig = option(default_factory=ParallelConfig)
    kernels: KernelConfig = option(default_factory=KernelConfig)

    def __post_init__(self):
        # LLM(pathlib.Path("./folder")) reached resolve_model's str methods: an AttributeError
        # traceback; a path object is a path, anything else not a string is named here
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if not isinstance(self.model, str):
            raise ConfigError(f"model must be a model name, a path or a hub id (a string), got "
                              f"{self.model!r:.80}", param="model")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments named after the option fields of EngineConfig
        and its parts (`LLM(model, max_model_len=512, kv_cache_memory="2GiB")`); str values of
        fields with a parser (sizes) are parsed. Raises TypeError naming an unknown keyword
        and the closest known ones, InvalidRequestError for an unparsable value."""
        groups = config_groups(cls)
        owner = {f.name: (name, f) for name, c in groups for f in option_fields(c)}
        unknown = [k for k in kwargs if k not in owner]
        if unknown:
            close = difflib.get_close_matches(unknown[0], owner, n=3)
            raise TypeError(f"unknown engine option {unknown[0]!r}"
                            + (f"; did you mean {', '.join(close)}?" if close else
                               f"; known: {', '.join(sorted(owner))}"))
        parts: dict = {name: {} for name, _ in groups}
        for key, value in kwargs.items():
            name, f = owner[key]
            # a switch given as text (`enforce_eager="no"`) would be truthy: True, silently
            if f.type in ("bool", "bool | None") and not (
                    isinstance(value, bool) or value in (0, 1) or (value is None and f.type != "bool")):
                raise ConfigError(f"{key} must be True or False, got {value!r}", param=key)
            parse = f.metadata.get("parse")
            parts[name][key] = parse(value) if parse is not None and isinstance(value, str) else value
        return cls(**parts[None], **{name: c(**parts[name]) for name, c in groups if name is not None})


def _is_group(cls, f: dataclasses.Field) -> bool:
    """Whether field `f` of `cls` is a nested config dataclass (cache, scheduler, parallel)."""
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
        typing.get_type_hints(cls)[f.name])


def option_fields(cls) -> list[dataclasses.Field]:
    """The option fields of one config dataclass (those made with `option`, without the
    nested config groups)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata and not _is_group(cls, f)]


def config_groups(cls=None) -> list[tuple[str | None, type]]:
    """(attribute name, dataclass) of EngineConfig itself (name None) and each nested part."""
    cls = cls or EngineConfig
    hints = typing.get_type_hints(cls)
    return [(None, cls)] + [(f.name, hints[f.name]) for f in dataclasses.fields(cls)
                            if _is_group(cls, f)]
