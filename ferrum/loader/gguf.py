"""GGUF loader: one `.gguf` file (llama.cpp format) -> ModelSource with HF parameter names.

Format: GGUF v3 (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), read with the
`gguf` package (`GGUFReader` memory-maps the file, `gguf.quants.dequantize` decodes blocks).

Layout facts this module relies on:
- A tensor's GGUF shape lists dims fastest-first (ggml `ne`), so `ne = [in, out]` is the torch
  shape `[out, in]`. Its raw data is row-major by output row: row r of a quantized matrix is
  `bytes_per_row` contiguous bytes, so rows [a, b) can be dequantized alone (TP slices).
- llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`) reorders the rows of Q and K of
  llama-arch models for interleaved ("GPT-J") RoPE:
      w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(w.shape)
  `_unpermute_rows` inverts it back to HF's rotate-half layout. qwen2/qwen3 are not permuted.
- Mixtral is written as arch `llama` with `llama.expert_count`; MoE experts are stacked
  tensors `ffn_{gate,up,down}_exps` [E, rows, cols], exposed here one expert at a time under
  the HF names (`mlp.experts.{e}.gate_proj.weight`, ...): expert e's rows are one contiguous
  block of the raw data.
- Gemma 3 (`Gemma3Model` in the converter) stores every RMSNorm weight as 1 + w (llama.cpp
  multiplies by it directly); they are returned as w, the HF convention, as transformers' own
  GGUF loader does. Its layer pattern, local RoPE base and attention scale are llama.cpp's
  hparams for LLM_ARCH_GEMMA3 unless the file carries them.
- Llama 3.1/3.2: the converter folds the llama3 rope scaling into `rope_freqs.weight`
  (per-frequency divisors); it becomes the `gguf_rope_freqs` rope type (rotary_embedding.py).

Parsed once per file: GGUFReader reads every metadata string (the vocabulary too) and takes
seconds, and transformers' tokenizer conversion more; `prepare_gguf` does both once and keeps
the result under $FERRUM_HOME/gguf/<file key> (ferrum/loader/cache.py), with the dequantized
float32 weights of models up to DEQUANT_CACHE_MAX_BYTES (`dequantized_cache`), so a later
start reads a JSON file, a tokenizer.json and a safetensors file instead. Writing an entry
drops those of files deleted or changed since (`_stale`, `cache.prune`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from ferrum.config import ModelConfig
from ferrum.errors import UnsupportedModelError, WeightLoadError
from ferrum.loader.base import ModelSource

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",      # MixtralForCausalLM when it has experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

SUPPORTED_QUANT_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
                         QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)

# llama.cpp tensor name (gguf/constants.py TENSOR_NAMES) -> HF name.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 3 norms around each sub-block (ffn_norm is the pre-feedforward norm there)
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# stacked experts [E, rows, cols] -> one HF tensor per expert
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown
    (stacked experts, `ffn_*_exps`, are expanded by `gguf_weights`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation, per head. w: [n_heads * head_dim, ...]
    (a whole tensor or a head-aligned row slice); returns the same shape in HF layout."""
    n = w.shape[0] // head_dim
    return (w.reshape(n, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape).contiguous())


def _to_torch(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    arr = dequantize(raw, qtype)
    if not arr.flags.writeable:          # F32 dequantize returns a view of the read-only mmap
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


@dataclass
class GGUFWeight:
    """One GGUF tensor as a LazyWeight. `shape` is the torch/HF shape ([out, in] for Linear);
    `load`/`narrow` return float32 CPU tensors, dequantized on each call, or read from `dense`.

    raw: the tensor's memory-mapped bytes, [rows, bytes_per_row] for quantized types (the GGUF
        linear layers keep the blocks of types they have kernels for).
    unpermute_head_dim: head_dim when rows are llama.cpp-permuted Q/K rows, else None.
    dense: the same tensor dequantized and un-permuted (a LazyWeight over the loader's float32
        cache, `dequantized_cache`), or None.
    """

    name: str
    raw: np.ndarray
    qtype: QT
    shape: tuple[int, ...]
    unpermute_head_dim: int | None = None
    dense: object | None = None
    offset: float = 0.0     # added to every value (-1 for Gemma 3's stored 1 + w norms)

    def _fix(self, w: torch.Tensor) -> torch.Tensor:
        if self.offset:
            w = w + self.offset
        return _unpermute_rows(w, self.unpermute_head_dim) if self.unpermute_head_dim else w

    def load(self) -> torch.Tensor:
        """The whole tensor: float32, `self.shape`."""
        if self.dense is not None:
            return self.dense.load()
        return self._fix(_to_torch(self.raw, self.qtype, self.shape))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows/columns [start, start+length) along `dim`, float32. Along dim 0 of a matrix only
        those rows are dequantized (for permuted Q/K: when start and length are multiples of
        head_dim); otherwise the whole tensor is dequantized and sliced."""
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for {self.name} "
                             f"of shape {self.shape}")
        if self.dense is not None:
            return self.dense.narrow(dim, start, length)
        hd = self.unpermute_head_dim
        if dim == 0 and len(self.shape) >= 2 and (not hd or (start % hd == 0 and length % hd == 0)):
            rows = self.raw[start:start + length]
            return self._fix(_to_torch(rows, self.qtype, (length, *self.shape[1:])))
        return self.load().narrow(dim, start, length)


class GGUFSource:
    """WeightSource over the tensors of one GGUF file, under HF names (see `hf_name`)."""

    def __init__(self, weights: dict[str, GGUFWeight]):
        self._weights = weights

    def names(self) -> list[str]:
        """The HF names of the file's tensors."""
        return list(self._weights)

    def get(self, name: str) -> GGUFWeight:
        """The lazy tensor under HF name `name` (KeyError if absent)."""
        return self._weights[name]


def open_reader(path: str) -> GGUFReader:
    """Open and validate a GGUF file. Raises WeightLoadError when it is unreadable or when any
    tensor's data (offset + size) runs past the end of the file (a truncated download)."""
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/... on a short or corrupt file
        raise WeightLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}; "
                              "the file is unreadable or truncated") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise WeightLoadError(f"GGUF file {path} is truncated: tensor {t.name} ends at byte "
                                  f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


def gguf_field(reader: GGUFReader, key: str, default=None):
    """The value of metadata `key` (str, int, float or list), or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_eos_token_ids(reader: GGUFReader) -> list[int]:
    """tokenizer.ggml.eos_token_id, then eot_token_id and eom_token_id when present (deduped)."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        v = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return ids


def gguf_config(reader: GGUFReader) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `.embedding_length`, ...; keys per
    the GGUF spec / gguf/constants.py). Raises UnsupportedModelError for an architecture not in
    GGUF_ARCHITECTURES, a rope scaling type other than linear / yarn, or partial rotary."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; "
                                    f"supported: {sorted(GGUF_ARCHITECTURES)}")

    def get(key, default=None):
        v = gguf_field(reader, f"{arch}.{key}", default)
        if v is None:
            raise WeightLoadError(f"GGUF metadata lacks {arch}.{key}")
        return v

    tensor_names = {t.name for t in reader.tensors}
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    # max(): a head count of 0 is ModelConfig's named error, not a ZeroDivisionError here
    head_dim = int(get("attention.key_length", hidden // max(n_heads, 1)))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary embedding (rope.dimension_count != head_dim) "
                                    "is not supported")
    vocab = gguf_field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise WeightLoadError("GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens.data)
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    layers = int(get("block_count"))
    architecture = GGUF_ARCHITECTURES[arch]
    experts = int(get("expert_count", 0))
    if arch == "llama" and experts:
        architecture = "MixtralForCausalLM"
    extra = {}
    if experts:
        extra = _gguf_moe_fields(reader, arch, experts, layers, tensor_names, get)
    if arch == "gemma3":
        extra = _gguf_gemma3_fields(reader, layers, hidden, n_heads, head_dim, get)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        # a key the file lacks takes ModelConfig's default (written once, there)
        max_position_embeddings=int(get("context_length", _DEFAULTS["max_position_embeddings"])),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", _DEFAULTS["rms_norm_eps"])),
        rope_theta=float(get("rope.freq_base", _DEFAULTS["rope_theta"])),
        rope_scaling=_gguf_rope_scaling(reader, arch, get),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=gguf_eos_token_ids(reader),
        **extra,
    )


def _gguf_rope_scaling(reader: GGUFReader, arch: str, get) -> dict | None:
    """HF-style rope_scaling from `{arch}.rope.scaling.*` (linear, yarn) or the Llama 3.1
    `rope_freqs.weight` tensor (divisors of the inverse frequencies)."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if freqs.tensor_type != QT.F32:
            raise UnsupportedModelError(f"rope_freqs.weight of type {freqs.tensor_type.name} "
                                        "is not supported (F32 only)")
        return {"rope_type": "gguf_rope_freqs",
                "freq_divisors": [float(v) for v in np.asarray(freqs.data).reshape(-1)]}
    scaling = get("rope.scaling.type", "none")
    if scaling in ("none", ""):
        return None
    factor = float(get("rope.scaling.factor"))
    if scaling == "linear":
        return {"rope_type": "linear", "factor": factor}
    if scaling == "yarn":
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
    raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported "
                                "(supported: linear, yarn, rope_freqs)")


def _gguf_moe_fields(reader, arch: str, experts: int, layers: int, tensor_names: set, get) -> dict:
    """MoE fields: a layer is sparse when it has a router (`ffn_gate_inp`). Top-k weights are
    renormalised as llama.cpp's graphs do (Mixtral and qwen3moe: yes, qwen2moe: no) unless the
    file says otherwise (`expert_weights_norm`)."""
    moe = [f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers)]
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length", get("feed_forward_length"))),
        norm_topk_prob=bool(get("expert_weights_norm", arch != "qwen2moe")),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
        moe_layers=moe,
    )


def _gguf_gemma3_fields(reader, layers: int, hidden: int, n_heads: int, head_dim: int, get) -> dict:
    """Gemma 3 fields, with llama.cpp's LLM_ARCH_GEMMA3 hparams where the file is silent: every
    6th layer global (`sliding_window_pattern`), local RoPE base 10,000 (`rope.freq_base_swa`),
    attention scale 1/sqrt(head_dim), except 1/sqrt(hidden / heads) for the 62-layer 27B."""
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):   # per layer, true = sliding
        sliding = [bool(v) for v in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    scalar = hidden // n_heads if layers == 62 else head_dim
    return dict(
        hidden_act="gelu_pytorch_tanh",
        sliding_window=int(get("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=gguf_field(reader, "gemma3.final_logit_softcapping"),
    )


def tensor_table(reader: GGUFReader, config: ModelConfig) -> list[list]:
    """The tensors of an opened GGUF as JSON-able rows [hf_name, qtype, hf_shape, data_offset,
    raw_dtype, raw_shape]: where each tensor's bytes lie in the file and how gguf views them
    (`raw` below). A stacked expert tensor `blk.N.ffn_*_exps` [E, rows, cols] becomes E rows,
    one per expert under its HF name (expert e's bytes are the e-th contiguous block);
    `rope_freqs.weight` is config (rope scaling), not a weight. Raises UnsupportedModelError
    for a tensor type outside SUPPORTED_QUANT_TYPES and for a tensor name with no HF
    equivalent."""
    arch = "gemma3" if config.family == "gemma3" else "llama"
    rows = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name} has quantization type {t.tensor_type.name}, which is not "
                f"supported; supported: {', '.join(q.name for q in SUPPORTED_QUANT_TYPES)}")
        shape = [int(d) for d in reversed(t.shape.tolist())]
        raw_shape, dtype = list(t.data.shape), t.data.dtype
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_STACKS:
            expert_bytes = int(np.prod(raw_shape[1:])) * dtype.itemsize
            for e in range(shape[0]):
                name = f"model.layers.{parts[1]}.mlp.experts.{e}.{_EXPERT_STACKS[parts[2]]}.weight"
                rows.append([name, int(t.tensor_type), shape[1:],
                             int(t.data_offset) + e * expert_bytes, dtype.str, raw_shape[1:]])
            continue
        name = hf_name(t.name, arch)
        if name is None:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no counterpart in "
                                        f"{config.architecture}")
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = [1, shape[0]]           # HF: Linear(hidden, 1)
        rows.append([name, int(t.tensor_type), shape, int(t.data_offset), dtype.str, raw_shape])
    return rows


def gguf_weights(path: str, table: list[list], config: ModelConfig, dense=None) -> GGUFSource:
    """Lazy HF-named weights over the memory-mapped file at `path`, from its `tensor_table`
    (llama-arch Q/K rows are un-permuted on read, Gemma 3's stored 1 + w norms read as w);
    `dense`: a WeightSource of the same tensors dequantized (`dequantized_cache`) that their
    load / narrow read instead."""
    data = np.memmap(path, mode="r")
    permuted = config.family in ("llama", "mixtral")
    gemma = config.family == "gemma3"
    weights: dict[str, GGUFWeight] = {}
    for name, qtype, shape, offset, dtype, raw_shape in table:
        nbytes = int(np.prod(raw_shape)) * np.dtype(dtype).itemsize
        raw = data[offset:offset + nbytes].view(dtype).reshape(raw_shape)
        qk = permuted and (".q_proj." in name or ".k_proj." in name)
        weights[name] = GGUFWeight(name=name, raw=raw, qtype=QT(qtype), shape=tuple(shape),
                                   unpermute_head_dim=config.head_dim if qk else None,
                                   dense=dense.get(name) if dense is not None else None,
                                   offset=-1.0 if gemma and name.endswith("norm.weight") else 0.0)
    return GGUFSource(weights)


# ---- once per file: parse, convert the tokenizer, dequantize -----------------------------------
# Cache entry <ferrum_home>/gguf/<file_key>/: meta.json (config, EOS ids, chat template, tensor
# table, the source file's path, size and mtime), tokenizer/ (the converted tokenizer, saved by
# transformers) and model.safetensors (every tensor dequantized to float32, when that takes at
# most DEQUANT_CACHE_MAX_BYTES).
CACHE_FORMAT = 2   # 2: MoE / Gemma 3 fields in the config, one table row per expert
DEQUANT_CACHE_MAX_BYTES = 2 << 30


def _say(msg: str) -> None:
    print(f"ferrum: {msg}", file=sys.stderr, flush=True)


def _parse(path: str, folder: str) -> dict:
    """Read the GGUF's metadata once (gguf's GGUFReader) and convert its tokenizer
    (transformers); write meta.json and tokenizer/ into `folder`; returns the meta."""
    import transformers
    stat = os.stat(path)
    reader = open_reader(path)
    config = gguf_config(reader)
    meta = {"format": CACHE_FORMAT, "transformers": transformers.__version__,
            "config": dataclasses.asdict(config), "eos_token_ids": list(config.eos_token_id),
            "chat_template": gguf_field(reader, "tokenizer.chat_template"),
            "tensors": tensor_table(reader, config), "tokenizer_error": None,
            "source": {"path": os.path.realpath(path), "size": stat.st_size,   # for `_stale`
                       "mtime_ns": stat.st_mtime_ns}}
    del reader
    try:
        _convert_tokenizer(path).save_pretrained(os.path.join(folder, "tokenizer"))
    except Exception as e:  # noqa: BLE001  no or unsupported tokenizer: the model still serves ids
        meta["tokenizer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def _convert_tokenizer(path: str):
    """The GGUF's tokenizer as transformers converts it (a PreTrainedTokenizerFast)."""
    import transformers
    return transformers.PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))


def _cached_tokenizer(path: str, folder: str):
    """The tokenizer the entry `folder` holds; when its files cannot be read (deleted, cut
    short), converted again from the GGUF and written back (if the cache can take it)."""
    from transformers import PreTrainedTokenizerFast
    from ferrum.loader import cache
    saved = os.path.join(folder, "tokenizer")
    try:
        return PreTrainedTokenizerFast.from_pretrained(saved)
    except Exception as e:  # noqa: BLE001 - any unreadable file: convert again
        _say(f"the cached tokenizer in {saved} cannot be read ({type(e).__name__}); converting "
             f"the one of {os.path.basename(path)} again")
    hf = _convert_tokenizer(path)
    try:
        with cache.exclusive(saved), cache.staged_folder(saved) as tmp:
            hf.save_pretrained(tmp)
    except OSError:   # a read-only or full cache: this start has the tokenizer all the same
        pass
    return hf


def _read_meta(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    import transformers
    if meta.get("format") != CACHE_FORMAT or meta.get("transformers") != transformers.__version__:
        return None   # made by another ferrum or transformers: the tokenizer may differ
    return meta


def _stale(folder: str) -> bool:
    """Whether the cache entry `folder` is of no more use: the GGUF it was made from is gone,
    or its size or mtime changed (it has a new key now), or the entry does not say which file
    it was made from (made by an older ferrum; rebuilt on its next use)."""
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            source = json.load(f)["source"]
        stat = os.stat(source["path"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):   # gone; or no "source"
        return True
    except OSError:   # e.g. no permission to look: the file may still be there
        return False
    return (stat.st_size, stat.st_mtime_ns) != (source["size"], source["mtime_ns"])


def prepare_gguf(path: str) -> tuple[str, dict]:
    """The cache entry of a GGUF file, built on first use: (its folder, its meta). Later calls,
    in this or any process, read meta.json and skip the GGUF parse and tokenizer conversion.
    The entry stays in use (`cache.use`) until this process exits. Writing an entry prunes
    the cache (`cache.prune`): entries of GGUF files that are gone or changed since, and lock
    files nobody holds, go unless another process builds or uses them.
    Raises what `open_reader`, `gguf_config` and `tensor_table` raise (nothing is cached then)."""
    from ferrum.loader import cache
    root = os.path.join(cache.ferrum_home(), "gguf")
    try:
        folder = os.path.join(root, cache.file_key(path))
    except OSError as e:
        raise WeightLoadError(f"cannot read GGUF file {path}: {e}") from e
    meta = _read_meta(folder)
    if meta is not None and cache.use(folder):   # else removed meanwhile: build it again
        return folder, meta
    try:
        with cache.exclusive(folder):
            meta = _read_meta(folder)   # another process may have built it while we waited
            built = meta is None
            if built:
                if not cache.remove_if_unused(folder):   # made by another ferrum/transformers,
                    return _parse_to_temp(path)           # and a process has it loaded
                _say(f"reading {os.path.basename(path)} once (metadata and tokenizer; cached "
                     f"in {folder})")
                with cache.staged_folder(folder) as tmp:
                    meta = _parse(path, tmp)
            cache.use(folder)   # cannot fail: removing it takes the lock held here
        if built:
            cache.prune(root, _stale)
        return folder, meta
    except PermissionError:   # a read-only $FERRUM_HOME: build into a temporary folder
        return _parse_to_temp(path)


def _parse_to_temp(path: str) -> tuple[str, dict]:
    """`_parse` into a new temporary folder, for when the cache cannot hold the entry."""
    import tempfile
    folder = tempfile.mkdtemp(prefix="ferrum-gguf-")
    return folder, _parse(path, folder)


def _readable(path: str) -> bool:
    """Whether `path` is a whole safetensors file (its header, and data to the size it gives:
    safetensors reads only the header and checks the file's size)."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt"):
            return True
    except Exception:  # noqa: BLE001 - absent, unreadable or cut short: all mean build it
        return False


def dequantized_cache(path: str, folder: str, meta: dict, config: ModelConfig):
    """A SafetensorsSource over `folder`/model.safetensors: every tensor of the file
    dequantized to float32 and un-permuted, written on first use (about 3 s of numpy
    dequantization for SmolLM2 on a 2-core box, paid again on every start otherwise); None
    when it would take more than DEQUANT_CACHE_MAX_BYTES. Layers that run a type's blocks
    (ferrum/layers/quantization/gguf.py) read `raw` instead; the others, and the embedding,
    read this."""
    from ferrum.loader.cache import exclusive, staged_file
    from ferrum.loader.safetensors import SafetensorsSource
    nbytes = 4 * sum(int(np.prod(shape)) for _, _, shape, *_ in meta["tensors"])
    if nbytes > DEQUANT_CACHE_MAX_BYTES:
        return None
    target = os.path.join(folder, "model.safetensors")
    if not _readable(target):
        with exclusive(target):
            if not _readable(target):   # absent; or cut short (a disk error, a copy): replaced
                from safetensors.torch import save_file
                _say(f"dequantizing the weights once ({nbytes / 2**20:.0f} MiB of float32, cached "
                     f"in {folder})")
                source = gguf_weights(path, meta["tensors"], config)
                with staged_file(target) as tmp:
                    save_file({name: source.get(name).load() for name in source.names()}, tmp)
    return SafetensorsSource(folder)


def load_gguf(path: str, dequant_cache: bool = True) -> ModelSource:
    """Resolve a `.gguf` file into a ModelSource (fmt "gguf").

    Config from GGUF metadata (`gguf_config`), weights as lazy GGUFWeights under HF names
    (`lm_head.weight` only when the file has `output.weight`): the raw blocks, and their
    float32 values from `dequantized_cache` when `dequant_cache` and the model is small enough
    (else dequantized on each read; TP ranks read only their rows). EOS ids from
    `tokenizer.ggml.{eos,eot,eom}_token_id`, chat template from `tokenizer.chat_template`,
    tokenizer converted by transformers; all cached per file (`prepare_gguf`).
    Raises WeightLoadError (unreadable/truncated file), UnsupportedModelError (architecture,
    quantization type or option not implemented).
    """
    folder, meta = prepare_gguf(path)
    config = ModelConfig(**meta["config"])
    eos, chat_template = list(meta["eos_token_ids"]), meta["chat_template"]

    def weights():
        dense = dequantized_cache(path, folder, meta, config) if dequant_cache else None
        return gguf_weights(path, meta["tensors"], config, dense)

    def tokenizer_loader():
        from ferrum.tokenizer.tokenizer import Tokenizer
        if meta["tokenizer_error"]:
            raise ValueError(f"the GGUF's tokenizer could not be converted: {meta['tokenizer_error']}")
        return Tokenizer(_cached_tokenizer(path, folder), eos, chat_template)

    return ModelSource(
        name=os.path.splitext(os.path.basename(path))[0],
        config=config,
        weights=weights,
        tokenizer_loader=tokenizer_loader,
        eos_token_ids=eos,
        chat_template=chat_template,
        path=path,
        fmt="gguf",
    )
