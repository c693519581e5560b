"""FP8 e4m3 weights (W8A16 GEMV / W8A8 GEMM kernels in ferrum/ops/fp8.py).

Checkpoint formats read here (tensor names per linear layer):
- `quant_method: fp8` (vLLM / transformers' serialized FP8): `weight` float8_e4m3fn [out, in],
  `weight_scale` float32 (one per tensor: [] or [1]; or per output channel: [out] / [out, 1]),
  `input_scale` float32 [] when `activation_scheme` is static. Block-wise scales
  (`weight_block_size`, `weight_scale_inv`) are not supported.
- compressed-tensors `float-quantized` (llm-compressor's FP8 checkpoints): the same three names;
  `config_groups.*.weights` gives `strategy` tensor | channel (scale [1] / [out, 1]) and
  `input_activations` static (`input_scale`) or dynamic per token.
- `--quantization fp8` on an unquantized checkpoint: each weight is quantized per output channel
  while it loads (scale = amax(|row|) / 448, from the whole row also when the row is split over TP
  ranks, so every TP size holds the same FP8 values).

Inside, a per-tensor scale becomes a per-output-channel scale vector (exact: each row of a
merged q/k/v or gate/up matrix keeps the scale of the tensor it came from).
"""
from __future__ import annotations

import torch

from ferrum.config import KERNELS
from ferrum.errors import UnsupportedModelError, WeightLoadError
from ferrum.layers.quantization.base import (LinearMethod, QuantConfig, dequantized_on_cpu, new_param,
                                             shard_spec)
from ferrum.ops import fp8 as fp8_ops


def check_ignored(ignore, what: str) -> None:
    """Only the LM head may be left unquantized by name (it always is here): an ignore list
    naming decoder layers would need per-layer methods, which ferrum does not build."""
    for name in ignore or []:
        if name not in ("lm_head", "re:.*lm_head", "re:lm_head"):
            raise UnsupportedModelError(
                f"{what}: leaving layer {name!r} unquantized is not supported; supported: "
                "every decoder linear layer quantized, lm_head unquantized")


class Fp8Config(QuantConfig):
    """serialized: the checkpoint holds FP8 weights (else they are quantized while loading).
    static_input: the checkpoint has `input_scale` (used by the FP8 GEMM; dynamic otherwise)."""

    name = "fp8"

    def __init__(self, serialized: bool = True, static_input: bool = False, source: str = "fp8"):
        self.serialized, self.static_input, self.source = serialized, static_input, source

    @classmethod
    def from_hf(cls, qc: dict) -> "Fp8Config":
        """`quantization_config` with quant_method fp8. Raises UnsupportedModelError for
        block-wise scales or an activation scheme other than static / dynamic."""
        if qc.get("weight_block_size"):
            raise UnsupportedModelError(
                f"fp8 checkpoint with block-wise scales (weight_block_size {qc['weight_block_size']}) "
                "is not supported; supported: fp8 with per-tensor or per-channel scales")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise UnsupportedModelError(f"fp8 activation_scheme {scheme!r} is not supported; "
                                        "supported: static, dynamic")
        check_ignored(qc.get("ignored_layers") or qc.get("modules_to_not_convert"), "fp8")
        return cls(serialized=True, static_input=scheme == "static", source="fp8")

    @classmethod
    def from_compressed_tensors(cls, qc: dict) -> "Fp8Config":
        """compressed-tensors `quantization_config` (format float-quantized). Raises
        UnsupportedModelError naming the format / scheme otherwise."""
        what = "compressed-tensors"
        groups = list((qc.get("config_groups") or {}).values())
        fmt = qc.get("format")
        formats = {g.get("format") or fmt for g in groups} or {fmt}
        if formats != {"float-quantized"}:
            raise UnsupportedModelError(
                f"{what} format {sorted(map(str, formats))} is not supported; supported: "
                "float-quantized (FP8 e4m3 weights, per-tensor or per-channel scales)")
        if len(groups) != 1:
            raise UnsupportedModelError(f"{what}: {len(groups)} config groups; supported: one group "
                                        "targeting every Linear layer")
        grp = groups[0]
        w, a = grp.get("weights") or {}, grp.get("input_activations")
        if (grp.get("targets") != ["Linear"] or w.get("num_bits") != 8 or w.get("type") != "float"
                or w.get("strategy") not in ("tensor", "channel") or not w.get("symmetric", True)
                or w.get("dynamic", False)):
            raise UnsupportedModelError(
                f"{what} weight scheme {w} targeting {grp.get('targets')} is not supported; supported: "
                "8-bit float, symmetric, static, strategy tensor or channel, targets ['Linear']")
        if a is not None and (a.get("num_bits") != 8 or a.get("type") != "float"
                              or a.get("strategy") not in ("tensor", "token")):
            raise UnsupportedModelError(f"{what} input activation scheme {a} is not supported; "
                                        "supported: 8-bit float, per tensor or per token")
        check_ignored(qc.get("ignore"), what)
        static = a is not None and not a.get("dynamic", False)
        return cls(serialized=True, static_input=static, source=f"{what} float-quantized")

    def linear_method(self) -> LinearMethod:
        return Fp8LinearMethod(self)

    def weight_bits(self) -> float:
        return 8.0


class Fp8LinearMethod(LinearMethod):
    """Parameters: `weight` [out, in] float8_e4m3fn, `weight_scale` [out] float32,
    `input_scale` [1] float32 (static activation scale, the max over a merged layer's
    sub-matrices; 0 = dynamic)."""

    name = "fp8"

    def __init__(self, config: Fp8Config):
        self.config = config

    def create_weights(self, layer, in_features, out_sizes, dtype):
        n = sum(out_sizes)
        layer.weight = shard_spec(new_param((n, in_features), fp8_ops.FP8_DTYPE), output_dim=0, input_dim=1)
        # quantizing while loading: the scales come with the weight, not from the checkpoint
        layer.weight_scale = shard_spec(new_param((n,), torch.float32, fill=1.0), output_dim=0,
                                        optional=not self.config.serialized)
        layer.input_scale = shard_spec(new_param((1,), torch.float32), optional=True)
        layer.weight_scale.weight_loader = lambda p, lazy, sid=None: self._load_scale(layer, p, lazy, sid)
        layer.input_scale.weight_loader = lambda p, lazy, sid=None: p.data.copy_(
            torch.maximum(p.data, lazy.load().to(p.device, torch.float32).reshape(-1)[:1]))
        if not self.config.serialized:
            layer.weight.weight_loader = lambda p, lazy, sid=None: self._quantize_on_load(layer, p, lazy, sid)

    @staticmethod
    def _load_scale(layer, param, lazy, shard_id):
        """A per-tensor scale fills the rows of its sub-matrix; a per-channel one is sliced
        like the weight's rows."""
        if lazy.shape in ((), (1,)):
            off, _, n = layer.output_shard(shard_id)
            param.data[off:off + n] = lazy.load().float().reshape(-1)[0]
            return
        if len(lazy.shape) == 2 and lazy.shape[1] == 1:  # compressed-tensors channel: [out, 1]
            dst, src = layer.shard_slice(param, _Flat(lazy), shard_id)
        else:
            dst, src = layer.shard_slice(param, lazy, shard_id)
        if dst.shape != src.shape:
            raise WeightLoadError(f"weight_scale has shape {tuple(lazy.shape)}; expected one value "
                                  "or one per output channel")
        dst.copy_(src.float())

    @staticmethod
    def _quantize_on_load(layer, param, lazy, shard_id):
        """--quantization fp8: quantize this rank's rows per output channel as they load, with
        each row's scale taken over the whole row (also when a row-parallel layer splits it)."""
        off, _, n = layer.output_shard(shard_id)
        shard = layer.input_shard()
        if shard is not None and layer.tp.size > 1:
            full = lazy.load().to(param.device)
            if tuple(full.shape) != (n, layer.tp.size * layer.in_features):
                raise WeightLoadError(f"tensor has shape {tuple(full.shape)}, expected "
                                      f"{(n, layer.tp.size * layer.in_features)}")
            _, scale = fp8_ops.quantize_fp8_per_channel(full)
            src = full.narrow(1, shard[0], shard[1])
            q = (src.float() / scale[:, None]).clamp(-fp8_ops.FP8_MAX, fp8_ops.FP8_MAX).to(fp8_ops.FP8_DTYPE)
            dst = param.data
        else:
            dst, src = layer.shard_slice(param, lazy, shard_id)
            q, scale = fp8_ops.quantize_fp8_per_channel(src.to(dst.device))
        if tuple(q.shape) != tuple(dst.shape):
            raise WeightLoadError(f"tensor has shape {tuple(q.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(q)
        layer.weight_scale.data[off:off + n] = scale

    def init_dummy(self, layer, gen):
        for i in range(0, layer.weight.shape[0], 4096):  # bounded temporaries for 70B shapes
            rows = layer.weight.data[i:i + 4096]
            w = torch.empty(rows.shape, dtype=torch.float32, device=rows.device).normal_(0.0, 0.02, generator=gen)
            q, s = fp8_ops.quantize_fp8_per_channel(w)
            rows.copy_(q)
            layer.weight_scale.data[i:i + 4096] = s

    def process_weights_after_loading(self, layer):
        if not (layer.weight.is_cuda or KERNELS.force_triton):
            dequantized_on_cpu(layer, fp8_ops.dequantize_fp8(layer.weight, layer.weight_scale),
                               ["weight", "weight_scale", "input_scale"])
            return
        if not self.config.static_input or float(layer.input_scale) <= 0:
            layer.input_scale = None

    def apply(self, layer, x, bias):
        return fp8_ops.fp8_linear(x, layer.weight, layer.weight_scale, bias, layer.input_scale)

    def apply_silu_and_mul(self, layer, gate_up, bias):
        from ferrum.ops.gemv_gluon import silu_mul_gemv
        return silu_mul_gemv(gate_up, layer.weight, layer.weight_scale, bias)


class _Flat:
    """A LazyWeight [n, 1] seen as [n] (compressed-tensors' per-channel scales)."""

    def __init__(self, lazy):
        self.lazy, self.shape = lazy, (lazy.shape[0],)

    def load(self):
        return self.lazy.load().reshape(-1)

    def narrow(self, dim, start, length):
        return self.lazy.narrow(0, start, length).reshape(-1)
