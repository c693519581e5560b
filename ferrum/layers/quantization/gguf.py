"""GGUF weights kept in their llama.cpp blocks (kernels and block layouts in ferrum/ops/gguf.py).

A GGUF file quantizes each tensor on its own, so the sub-matrices of one merged layer can
differ in type (Q4_K_M files keep some v_proj / down_proj in Q6_K). Each sub-matrix is loaded
as this rank's rows (and, row-parallel, its whole blocks of input features) of raw blocks; after
loading, consecutive sub-matrices of the same type are concatenated into one segment, and `apply`
runs one kernel per segment. Types without a packed kernel (F32/F16/BF16, Q4_1, Q5_0, Q5_1,
Q2_K, Q3_K) are dequantized at load into a dense segment, as before. llama.cpp's row
permutation of Llama Q/K (ferrum/loader/gguf.py) is undone on the raw rows: it only reorders
whole rows.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ferrum.config import KERNELS
from ferrum.errors import TensorParallelError, WeightLoadError
from ferrum.layers.quantization.base import LinearMethod, QuantConfig, dequantized_on_cpu, shard_spec
from ferrum.ops import gemv_gluon
from ferrum.ops import gguf as gguf_ops

# `--quantization` names of random GGUF weights for dummy models -> GGML type
DUMMY_TYPES = {"gguf_q4_0": gguf_ops.Q4_0, "gguf_q8_0": gguf_ops.Q8_0, "gguf_q4_k": gguf_ops.Q4_K,
               "gguf_q5_k": gguf_ops.Q5_K, "gguf_q6_k": gguf_ops.Q6_K}


class GGUFConfig(QuantConfig):
    """dummy_qtype: the block type of random weights (dummy models), else None."""

    name = "gguf"

    def __init__(self, dummy_qtype: int | None = None):
        self.dummy_qtype = dummy_qtype

    def linear_method(self) -> LinearMethod:
        return GGUFLinearMethod(self)

    def weight_bits(self) -> float:
        qk, bpb = gguf_ops.BLOCK.get(self.dummy_qtype or gguf_ops.Q4_K)
        return 8.0 * bpb / qk


class GGUFLinearMethod(LinearMethod):
    """`weight` is a placeholder whose loader keeps each sub-matrix's raw blocks in
    `layer.gguf_parts` {output offset: (qtype or None for dense, tensor)}; after loading the
    layer holds `segments` [(output offset, rows, qtype or None, tensor)]."""

    name = "gguf"

    def __init__(self, config: GGUFConfig):
        self.config = config

    def create_weights(self, layer, in_features, out_sizes, dtype):
        layer.weight = shard_spec(nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False),
                                  output_dim=0, input_dim=1)
        layer.weight.weight_loader = lambda p, lazy, sid=None: self._load(layer, lazy, sid)
        layer.gguf_parts = {}

    @staticmethod
    def _load(layer, lazy, shard_id):
        from ferrum.loader.gguf import _unpermute_rows
        if not hasattr(lazy, "qtype"):
            raise WeightLoadError("a GGUF-quantized layer can only load tensors from a GGUF file")
        off, start, n = layer.output_shard(shard_id)
        k_full = layer.checkpoint_in_features()
        rows_full = layer.checkpoint_out_features(shard_id)  # all of them: a larger tensor is wrong too
        if len(lazy.shape) != 2 or tuple(lazy.shape) != (rows_full, k_full):
            raise WeightLoadError(f"tensor has shape {tuple(lazy.shape)}, expected ({rows_full}, {k_full}) "
                                  "(from the GGUF metadata's sizes)")
        qtype = int(lazy.qtype)
        shard = layer.input_shard() if layer.input_sharded else None
        if qtype in gguf_ops.PACKED_TYPES:
            rows = torch.from_numpy(np.array(lazy.raw[start:start + n]))  # a copy: the file is mapped read-only
            if lazy.unpermute_head_dim:
                rows = _unpermute_rows(rows, lazy.unpermute_head_dim)
            if shard is not None:
                qk, bpb = gguf_ops.BLOCK[qtype]
                if shard[0] % qk or shard[1] % qk:
                    raise TensorParallelError(
                        f"{shard[1]} input features per rank (from {shard[0]}) do not fall on whole "
                        f"{lazy.qtype.name} blocks of {qk} at tensor_parallel_size {layer.tp.size}")
                rows = rows[:, shard[0] // qk * bpb:(shard[0] + shard[1]) // qk * bpb]
            part = (qtype, rows.contiguous().to(layer.param_device()))
        else:
            dense = lazy.narrow(0, start, n)   # dequantized (the loader may have them cached)
            if shard is not None:
                dense = dense[:, shard[0]:shard[0] + shard[1]]
            part = (None, dense.to(layer.params_dtype, copy=True).to(layer.param_device()))
        layer.gguf_parts[off] = part

    def init_dummy(self, layer, gen):
        """Random blocks of `dummy_qtype` with small finite fp16 scales (weights ~0.01-0.1)."""
        qtype = self.config.dummy_qtype
        if qtype is None:
            raise WeightLoadError("GGUF dummy weights need a block type (--quantization gguf_q4_k, ...)")
        qk, bpb = gguf_ops.BLOCK[qtype]
        if layer.in_features % qk:
            msg = f"{layer.in_features} input features per rank are not whole blocks of {qk}"
            raise TensorParallelError(msg) if layer.tp.size > 1 else WeightLoadError(msg)
        dev = layer.param_device()
        N, nb = layer.out_features, layer.in_features // qk
        raw = torch.randint(0, 256, (N, nb, bpb), dtype=torch.uint8, device=dev, generator=gen)
        for at in {gguf_ops.Q6_K: [208], gguf_ops.Q4_K: [0, 2], gguf_ops.Q5_K: [0, 2]}.get(qtype, [0]):
            d = torch.empty(N, nb, device=dev).uniform_(0.0005, 0.002, generator=gen).half()
            raw[:, :, at:at + 2] = d.view(torch.uint8).view(N, nb, 2)
        layer.gguf_parts = {0: (qtype, raw.view(N, nb * bpb))}

    def process_weights_after_loading(self, layer):
        parts = sorted(layer.gguf_parts.items())
        del layer.gguf_parts
        segments = []  # consecutive parts of one packed type become one segment
        for off, (qtype, t) in parts:
            if segments and qtype is not None and segments[-1][2] == qtype:
                o, n, q, prev = segments[-1]
                segments[-1] = (o, n + t.shape[0], q, torch.cat([prev, t]))
            else:
                segments.append((off, t.shape[0], qtype, t))
        if sum(s[1] for s in segments) != layer.out_features:
            raise WeightLoadError(f"GGUF layer has {sum(s[1] for s in segments)} of {layer.out_features} rows")
        on_gpu = segments[0][3].is_cuda or KERNELS.force_triton
        if not on_gpu:
            k = layer.in_features
            w = torch.cat([t if q is None else gguf_ops.gguf_dequantize(t, q, k) for _, _, q, t in segments])
            dequantized_on_cpu(layer, w, ["weight"])
            return
        delattr(layer, "weight")
        layer.segments = segments
        t = segments[0][3]
        if any(q == gguf_ops.Q4_K for _, _, q, _ in segments):
            gemv_gluon.request_x_copies(8, t)   # its GEMV reads int8 x: the norms / SiLU-mul write it

    def apply(self, layer, x, bias):
        outs = [torch.nn.functional.linear(x, t) if q is None else gguf_ops.gguf_linear(x, t, q)
                for _, _, q, t in layer.segments]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y if bias is None else y + bias
