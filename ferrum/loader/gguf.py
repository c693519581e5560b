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

Parsed once per file: GGUFReader reads every metadata string (the vocabulary too) and takes
seconds, and transformers' tokenizer conversion more; `prepare_gguf` does both once and keeps
the result under $FERRUM_HOME/gguf/<file key> (ferrum/loader/cache.py), with the dequantized
float32 weights of models up to DEQUANT_CACHE_MAX_BYTES (`dequantized_cache`), so a later
start reads a JSON file, a tokenizer.json and a safetensors file instead.
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

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
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
}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
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

    def _fix(self, w: torch.Tensor) -> torch.Tensor:
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
    the GGUF spec / gguf/constants.py). Raises UnsupportedModelError for an architecture other
    than llama/qwen2/qwen3, a rope scaling type, partial rotary, or Llama-3 `rope_freqs`."""
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
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "") or "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            f"GGUF rope scaling ({scaling if scaling not in ('none', '') else 'rope_freqs tensor'})"
            " is not supported")
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
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
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3",
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=gguf_eos_token_ids(reader),
    )


def tensor_table(reader: GGUFReader, config: ModelConfig) -> list[list]:
    """The tensors of an opened GGUF as JSON-able rows [hf_name, qtype, hf_shape, data_offset,
    raw_dtype, raw_shape]: where each tensor's bytes lie in the file and how gguf views them
    (`raw` below). Raises UnsupportedModelError for a tensor type outside
    SUPPORTED_QUANT_TYPES and for a tensor name with no HF equivalent."""
    rows = []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no counterpart in "
                                        f"{config.architecture}")
        if t.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name} has quantization type {t.tensor_type.name}, which is not "
                f"supported; supported: {', '.join(q.name for q in SUPPORTED_QUANT_TYPES)}")
        rows.append([name, int(t.tensor_type), [int(d) for d in reversed(t.shape.tolist())],
                     int(t.data_offset), t.data.dtype.str, list(t.data.shape)])
    return rows


def gguf_weights(path: str, table: list[list], config: ModelConfig, dense=None) -> GGUFSource:
    """Lazy HF-named weights over the memory-mapped file at `path`, from its `tensor_table`
    (llama-arch Q/K rows are un-permuted on read); `dense`: a WeightSource of the same tensors
    dequantized (`dequantized_cache`) that their load / narrow read instead."""
    data = np.memmap(path, mode="r")
    permuted = config.architecture == "LlamaForCausalLM"
    weights: dict[str, GGUFWeight] = {}
    for name, qtype, shape, offset, dtype, raw_shape in table:
        nbytes = int(np.prod(raw_shape)) * np.dtype(dtype).itemsize
        raw = data[offset:offset + nbytes].view(dtype).reshape(raw_shape)
        qk = permuted and (".q_proj." in name or ".k_proj." in name)
        weights[name] = GGUFWeight(name=name, raw=raw, qtype=QT(qtype), shape=tuple(shape),
                                   unpermute_head_dim=config.head_dim if qk else None,
                                   dense=dense.get(name) if dense is not None else None)
    return GGUFSource(weights)


# ---- once per file: parse, convert the tokenizer, dequantize -----------------------------------
# Cache entry <ferrum_home>/gguf/<file_key>/: meta.json (config, EOS ids, chat template, tensor
# table), tokenizer/ (the converted tokenizer, saved by transformers) and model.safetensors
# (every tensor dequantized to float32, when that takes at most DEQUANT_CACHE_MAX_BYTES).
CACHE_FORMAT = 1
DEQUANT_CACHE_MAX_BYTES = 2 << 30


def _say(msg: str) -> None:
    print(f"ferrum: {msg}", file=sys.stderr, flush=True)


def _parse(path: str, folder: str) -> dict:
    """Read the GGUF's metadata once (gguf's GGUFReader) and convert its tokenizer
    (transformers); write meta.json and tokenizer/ into `folder`; returns the meta."""
    import transformers
    reader = open_reader(path)
    config = gguf_config(reader)
    meta = {"format": CACHE_FORMAT, "transformers": transformers.__version__,
            "config": dataclasses.asdict(config), "eos_token_ids": list(config.eos_token_id),
            "chat_template": gguf_field(reader, "tokenizer.chat_template"),
            "tensors": tensor_table(reader, config), "tokenizer_error": None}
    del reader
    try:
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
        hf.save_pretrained(os.path.join(folder, "tokenizer"))
    except Exception as e:  # noqa: BLE001  no or unsupported tokenizer: the model still serves ids
        meta["tokenizer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


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


def prepare_gguf(path: str) -> tuple[str, dict]:
    """The cache entry of a GGUF file, built on first use: (its folder, its meta). Later calls,
    in this or any process, read meta.json and skip the GGUF parse and tokenizer conversion.
    Raises what `open_reader`, `gguf_config` and `tensor_table` raise (nothing is cached then)."""
    import tempfile

    from ferrum.loader.cache import exclusive, ferrum_home, file_key, staged_folder
    try:
        folder = os.path.join(ferrum_home(), "gguf", file_key(path))
    except OSError as e:
        raise WeightLoadError(f"cannot read GGUF file {path}: {e}") from e
    meta = _read_meta(folder)
    if meta is not None:
        return folder, meta
    try:
        with exclusive(folder):
            meta = _read_meta(folder)   # another process may have built it while we waited
            if meta is None:
                _say(f"reading {os.path.basename(path)} once (metadata and tokenizer; cached "
                     f"in {folder})")
                with staged_folder(folder) as tmp:
                    meta = _parse(path, tmp)
        return folder, meta
    except PermissionError:   # a read-only $FERRUM_HOME: build into a temporary folder
        folder = tempfile.mkdtemp(prefix="ferrum-gguf-")
        return folder, _parse(path, folder)


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
    if not os.path.exists(target):
        with exclusive(target):
            if not os.path.exists(target):
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
        from transformers import PreTrainedTokenizerFast
        from ferrum.tokenizer.tokenizer import Tokenizer
        if meta["tokenizer_error"]:
            raise ValueError(f"the GGUF's tokenizer could not be converted: {meta['tokenizer_error']}")
        hf = PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, "tokenizer"))
        return Tokenizer(hf, eos, chat_template)

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
