"""Quantized weights: which format a model's linear layers use (`get_quant_config`) and the
per-layer methods that load and apply them (fp8.py, int4.py, gguf.py; kernels in ferrum/ops/)."""
from __future__ import annotations

from ferrum.errors import UnsupportedModelError
from ferrum.layers.quantization.base import QuantConfig

CHECKPOINT_METHODS = ("fp8", "compressed-tensors (float-quantized)", "gptq", "awq")


def get_quant_config(hf_quant: dict | None, quantization: str | None = None,
                     dummy: bool = False, fmt: str = "safetensors") -> QuantConfig | None:
    """The QuantConfig of a checkpoint: GGUF blocks for a .gguf file (`fmt` gguf); from its
    `quantization_config` (config.json) when it has one; else from `quantization` (None:
    unquantized). Raises UnsupportedModelError for an unknown or unsupported format, and when
    `quantization` asks for another format than the checkpoint's."""
    from ferrum.layers.quantization.fp8 import Fp8Config
    from ferrum.layers.quantization.gguf import DUMMY_TYPES, GGUFConfig
    from ferrum.layers.quantization.int4 import Int4Config
    if fmt == "gguf":
        if quantization is not None:
            raise UnsupportedModelError(f"a GGUF file runs in its own block types; --quantization "
                                        f"{quantization} cannot be applied to it")
        return GGUFConfig()
    if hf_quant:
        method = str(hf_quant.get("quant_method", "")).lower()
        parsers = {"fp8": Fp8Config.from_hf, "compressed-tensors": Fp8Config.from_compressed_tensors,
                   "gptq": Int4Config.from_gptq, "awq": Int4Config.from_awq}
        if method not in parsers:
            raise UnsupportedModelError(f"checkpoint quantization method {method!r} is not supported; "
                                        f"supported: {', '.join(CHECKPOINT_METHODS)}")
        config = parsers[method](hf_quant)
        if quantization is not None and quantization != config.name:
            raise UnsupportedModelError(f"the checkpoint is quantized as {config.name}; "
                                        f"--quantization {quantization} cannot be applied to it")
        return config
    if quantization is None:
        return None
    if quantization == "fp8":
        return Fp8Config(serialized=False)
    if quantization in ("gptq", "awq") and dummy:
        return Int4Config(quantization, 128, zero_offset=1 if quantization == "gptq" else 0)
    if quantization in DUMMY_TYPES and dummy:
        return GGUFConfig(DUMMY_TYPES[quantization])
    raise UnsupportedModelError(
        f"--quantization {quantization!r} is not supported here; supported: fp8 (quantizes an "
        "unquantized checkpoint while loading); gptq, awq, gguf_q4_0, gguf_q8_0, gguf_q4_k, gguf_q5_k, "
        "gguf_q6_k only with dummy weights (a quantized checkpoint is read in its own format)")
