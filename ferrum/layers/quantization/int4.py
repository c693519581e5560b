"""GPTQ and AWQ 4-bit checkpoints (W4A16, kernels in ferrum/ops/int4.py).

Tensors per linear layer, K input and N output features, G = K / group_size groups, int32 words
holding eight 4-bit values, the first in the lowest bits:
- GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`): `qweight` [K/8, N] packed along K
  (word [i, n] holds rows 8i..8i+7 of column n); `qzeros` [G, N/8] packed along N; `scales`
  [G, N] float16; `g_idx` [K] int32 (group of each input row; with `desc_act` the groups follow
  the activation order); optional `bias`. `checkpoint_format` gptq (v1) stores every zero point
  minus one (the zero point is the stored value + 1, as AutoGPTQ's and vLLM's kernels read
  it); gptq_v2 stores it as is. Symmetric checkpoints store zero 8 (v1: 7).
- AWQ (AutoAWQ GEMM version, `quant_method: awq`, `version: gemm`): `qweight` [K, N/8] and
  `qzeros` [G, N/8] packed along N in AutoAWQ's interleaved order: the value of column 8c + i
  sits in nibble AWQ_NIBBLE[i] of word c (AutoAWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into
  nibbles 0..7); `scales` [G, N] float16; zero points as stored.
Both dequantize as w[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n].

Under TP the packed tensors shard with their rows / columns: a rank's output features must be
whole words of qzeros (multiples of 8), its input features whole words of qweight and whole
groups of scales, else TensorParallelError. With act order (`desc_act`) a row-parallel rank
keeps every group's scales and zeros and its slice of g_idx.
"""
from __future__ import annotations

import torch
from torch import nn

from ferrum.config import KERNELS
from ferrum.errors import UnsupportedModelError, WeightLoadError
from ferrum.layers.quantization.base import (LinearMethod, QuantConfig, dequantized_on_cpu, new_param,
                                             shard_spec)
from ferrum.layers.quantization.fp8 import check_ignored
from ferrum.ops import gemv_gluon
from ferrum.ops import int4 as int4_ops

AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]  # nibble of column 8c + i in AutoAWQ's words
GROUP_SIZES = (32, 64, 128, -1)


class Int4Config(QuantConfig):
    """fmt: gptq | awq. group_size -1 means one group per output channel (all of K).
    zero_offset: added to stored zero points (1 for GPTQ v1 checkpoints)."""

    def __init__(self, fmt: str, group_size: int, desc_act: bool = False, zero_offset: int = 0):
        self.name, self.group_size, self.desc_act, self.zero_offset = fmt, group_size, desc_act, zero_offset

    @staticmethod
    def _check(qc: dict, fmt: str) -> int:
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        # repr: a JSON string "4" read "4-bit weights is not supported; supported: 4 bits"
        if bits != 4:
            raise UnsupportedModelError(f"{fmt} bits {bits!r} is not supported; supported: 4")
        if group not in GROUP_SIZES:
            raise UnsupportedModelError(f"{fmt} group_size {group!r} is not supported; supported: "
                                        f"{', '.join(map(str, GROUP_SIZES))}")
        return group

    @classmethod
    def from_gptq(cls, qc: dict) -> "Int4Config":
        """`quantization_config` with quant_method gptq. Raises UnsupportedModelError for other
        bit widths / group sizes, a quantized lm_head, per-module overrides or an unknown
        checkpoint_format."""
        group = cls._check(qc, "gptq")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"gptq checkpoint_format {fmt!r} is not supported; "
                                        "supported: gptq, gptq_v2")
        if qc.get("lm_head") or qc.get("dynamic"):
            raise UnsupportedModelError("gptq with a quantized lm_head or per-module `dynamic` "
                                        "overrides is not supported")
        return cls("gptq", group, bool(qc.get("desc_act")), 1 if fmt == "gptq" else 0)

    @classmethod
    def from_awq(cls, qc: dict) -> "Int4Config":
        """`quantization_config` with quant_method awq (GEMM layout, zero points)."""
        group = cls._check(qc, "awq")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(f"awq version {version!r} is not supported; supported: gemm")
        if not qc.get("zero_point", True):
            raise UnsupportedModelError("awq without zero points is not supported; supported: zero_point true")
        check_ignored(qc.get("modules_to_not_convert"), "awq")
        return cls("awq", group)

    def linear_method(self) -> LinearMethod:
        return Int4LinearMethod(self)

    def weight_bits(self) -> float:
        g = self.group_size if self.group_size > 0 else 4096
        return 4.0 + 2 * 16.0 / g  # float16 scale and zero per group


class Int4LinearMethod(LinearMethod):
    """Checkpoint tensors as listed in the module docstring, converted after loading to
    ferrum's packed layout (`qweight` [N, K/8], `scales` / `zeros` [N, G] float16, `g_idx`)."""

    def __init__(self, config: Int4Config):
        self.config = config
        self.name = config.name

    def create_weights(self, layer, in_features, out_sizes, dtype):
        cfg, N, K = self.config, sum(out_sizes), in_features
        k_full = K * layer.tp.size if layer.input_sharded else K
        group = cfg.group_size if cfg.group_size > 0 else k_full
        # scales and zeros follow a row-parallel rank's input slice unless groups are not
        # contiguous in K (act order) or span all of K (group_size -1): then every rank keeps all
        keep_all = layer.input_sharded and (cfg.desc_act or cfg.group_size <= 0)
        G = -(-k_full // group) if keep_all or not layer.input_sharded else -(-K // group)
        in_dim, in_div = (None, 1) if keep_all else (0, group)
        layer.group_size = group
        if cfg.name == "gptq":
            layer.qweight = shard_spec(new_param((K // 8, N), torch.int32), output_dim=1, input_dim=0, input_div=8)
            layer.g_idx = shard_spec(new_param((K,), torch.int32), input_dim=0, optional=not cfg.desc_act)
            layer.g_idx.weight_loader = lambda p, lazy, sid=None: self._load_g_idx(layer, p, lazy, sid)
        else:
            layer.qweight = shard_spec(new_param((K, N // 8), torch.int32), output_dim=1, output_div=8, input_dim=0)
        layer.qzeros = shard_spec(new_param((G, N // 8), torch.int32), output_dim=1, output_div=8,
                                  input_dim=in_dim, input_div=in_div)
        layer.scales = shard_spec(new_param((G, N), torch.float16), output_dim=1, input_dim=in_dim, input_div=in_div)
        if N % 8 or K % 8:
            raise WeightLoadError(f"{cfg.name}: {N} output / {K} input features per rank are not "
                                  "multiples of 8 (4-bit values packed in int32 words)")

    @staticmethod
    def _load_g_idx(layer, param, lazy, shard_id):
        """Every sub-matrix of a merged layer shares its input, hence its act order (GPTQ orders
        columns by the input's Hessian diagonal): they must agree."""
        dst, src = layer.shard_slice(param, lazy, shard_id)
        if getattr(param, "loaded", False) and not torch.equal(dst, src.to(dst.device, dst.dtype)):
            raise WeightLoadError("g_idx differs between the sub-matrices of a merged layer")
        dst.copy_(src)
        param.loaded = True

    def _unpack_cols(self, packed: torch.Tensor) -> torch.Tensor:
        """[R, C/8] int32 packed along columns -> [R, C] values in column order."""
        v = int4_ops.unpack_int4_rows(packed)
        if self.config.name == "awq":
            v = v.view(v.shape[0], -1, 8)[:, :, AWQ_NIBBLE].reshape(v.shape[0], -1)
        return v

    def process_weights_after_loading(self, layer):
        cfg = self.config
        if cfg.name == "gptq":
            qweight = layer.qweight.data.t().contiguous()                        # [N, K/8]
        else:
            qweight = int4_ops.pack_int4_rows(self._unpack_cols(layer.qweight.data).t())
        zeros = (self._unpack_cols(layer.qzeros.data) + cfg.zero_offset).t().to(torch.float16).contiguous()
        scales = layer.scales.data.t().contiguous()
        g_idx = None
        if cfg.desc_act:
            g_idx = layer.g_idx.data.to(torch.int32)
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[1]:
                raise WeightLoadError(f"g_idx values outside 0..{scales.shape[1] - 1}")
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        if not (qweight.is_cuda or KERNELS.force_triton):
            dequantized_on_cpu(layer, int4_ops.dequantize_int4(qweight, scales, zeros, layer.group_size, g_idx), [])
            return
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.scales = nn.Parameter(scales, requires_grad=False)
        layer.zeros = nn.Parameter(zeros, requires_grad=False)
        layer.g_idx = None if g_idx is None else nn.Parameter(g_idx, requires_grad=False)
        if g_idx is None and layer.group_size % 32 == 0:
            gemv_gluon.request_x_copies(16, qweight)   # its GEMV reads int16 x: the norms / SiLU-mul write it

    def apply(self, layer, x, bias):
        return int4_ops.int4_linear(x, layer.qweight, layer.scales, layer.zeros, layer.group_size,
                                    layer.g_idx, bias)

    def init_dummy(self, layer, gen):
        """Random codes, zero point 8, scales so that weights have std ~0.02."""
        qw = layer.qweight.data
        qw.copy_(torch.randint(-2**31, 2**31 - 1, qw.shape, dtype=torch.int32, device=qw.device, generator=gen))
        zero = 8 - self.config.zero_offset
        layer.qzeros.data.fill_(int4_ops.pack_int4_rows(torch.full((1, 8), zero)).item())
        layer.scales.data.fill_(0.02 / 4.6)  # uniform codes 0..15 minus 8: std ~4.6
        if self.config.name == "gptq":
            K = layer.g_idx.shape[0]
            layer.g_idx.data.copy_(torch.arange(K, device=qw.device) // layer.group_size)
