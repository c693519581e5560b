"""Tiny quantized checkpoints written from a tiny fp32 HF model (tests/tiny_models.py), each
following its format's specification, plus the dequantized fp32 twin of each (the same model
with every quantized weight replaced by the value the format encodes) for the reference run.

Formats (tensor layouts as documented in ferrum/layers/quantization/fp8.py and int4.py):
- fp8 (`quant_method: fp8`, per-tensor scales, static input scales);
- compressed-tensors float-quantized, written with the `compressed-tensors` package's own
  compressor and config classes (per-channel or per-tensor);
- GPTQ v1 / v2 (symmetric or asymmetric zero points, act order with a random g_idx);
- AWQ GEMM (zero points, AutoAWQ's nibble order).
The integer codes, scales and zero points are drawn here from the weights (round-to-nearest per
group), packed by the loops below, and the reference weights come from those same codes, not
from any ferrum code.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ packs these columns into nibbles 0..7


def _pack_words(vals: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 4-bit values (0..15) along `dim`, 8 per int32, the first in the lowest bits."""
    vals = vals.to(torch.int64).movedim(dim, -1)
    v = vals.reshape(*vals.shape[:-1], -1, 8)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(8):
        words |= v[..., j] << (4 * j)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _quantize_int4(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor):
    """w [N, K] -> codes [K, N] (0..15), scales [G, N], zeros [G, N] (ints), reference [N, K]:
    round-to-nearest per group of input rows (the groups g_idx gives)."""
    N, K = w.shape
    G = int(g_idx.max()) + 1
    scales, zeros = torch.zeros(G, N), torch.zeros(G, N, dtype=torch.int64)
    for g in range(G):
        cols = w[:, g_idx == g]
        if sym:
            s = cols.abs().amax(1) / 7.5
            z = torch.full((N,), 8, dtype=torch.int64)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / 15
            z = (-lo / s).round().clamp(1, 15).to(torch.int64)  # >= 1: GPTQ v1 stores z - 1
        scales[g], zeros[g] = s, z
    scales = scales.half()  # checkpoints store float16 scales; codes are rounded against them
    s_k, z_k = scales.float()[g_idx].t(), zeros[g_idx].t()           # [N, K]
    codes = (w / s_k).round().add(z_k).clamp(0, 15).to(torch.int64)
    ref = (codes - z_k).float() * s_k
    return codes.t().contiguous(), scales, zeros, ref


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def write_quantized(src: str, dst: str, fmt: str, group: int = 32, sym: bool = False,
                    act_order: bool = False, version: str = "gptq", strategy: str = "channel",
                    seed: int = 0, kv_scales: dict[int, tuple[float, float]] | None = None,
                    kv_scale_names: str = "vllm") -> tuple[str, str, float]:
    """Write `dst` (quantized) and `dst + '-ref'` (dequantized fp32) from the HF folder `src`.
    fmt: fp8 | ct (compressed-tensors) | gptq | awq. kv_scales {layer: (k_scale, v_scale)}:
    FP8 KV-cache scales stored under `kv_scale_names`: "vllm" (`self_attn.k_scale` /
    `v_scale`, float32 []), "kv" (the older single `self_attn.kv_scale`, k_scale's value),
    "modelopt" (`self_attn.k_proj.k_scale`), "ct" (compressed-tensors' `kv_cache_scheme`:
    `self_attn.k_proj.output_scale` [1], and the scheme in the config). Returns (dst, ref
    folder, max relative weight error of the quantization over all layers)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    out, ref, worst = {}, {}, 0.0
    perms: dict[str, torch.Tensor] = {}  # act order follows the input: q/k/v share one, gate/up one
    for name, w in tensors.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in LINEARS or parts[-1] != "weight":
            out[name] = ref[name] = w
            continue
        base = name[: -len(".weight")]
        N, K = w.shape
        if fmt == "fp8":
            scale = w.abs().amax() / 448
            q = _fp8(w, scale)
            out[name], out[base + ".weight_scale"] = q, scale.reshape(())
            out[base + ".input_scale"] = torch.tensor(0.05 + 0.01 * (len(out) % 3))  # static, differs per shard
            deq = q.float() * scale
        elif fmt == "ct":
            import compressed_tensors.compressors as ctc
            scheme = _ct_scheme(strategy)
            scale = (w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)) / 448
            packed = ctc.FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
            out[name], out[base + ".weight_scale"] = packed["weight"], packed["weight_scale"]
            deq = ctc.FloatQuantizationCompressor.decompress(dict(packed), scheme)["weight"].float()
        else:
            if act_order:
                key = base.rsplit(".", 1)[0] + (":out" if parts[-2] in ("o_proj", "down_proj") else ":in")
                if key not in perms:
                    perms[key] = torch.randperm(K, generator=gen)
                g_idx = torch.empty(K, dtype=torch.int64)
                g_idx[perms[key]] = torch.arange(K) // group
            else:
                g_idx = torch.arange(K) // group
            codes, scales, zeros, deq = _quantize_int4(w, group, sym, g_idx)
            if fmt == "gptq":
                stored_z = zeros - 1 if version == "gptq" else zeros
                out[base + ".qweight"] = _pack_words(codes, 0)                 # [K/8, N]
                out[base + ".qzeros"] = _pack_words(stored_z & 0xF, 1)         # [G, N/8]
                out[base + ".g_idx"] = g_idx.to(torch.int32)
            else:  # awq: columns 8c + AWQ_ORDER[j] into nibble j
                perm = torch.tensor([8 * c + o for c in range(N // 8) for o in AWQ_ORDER])
                out[base + ".qweight"] = _pack_words(codes[:, perm], 1)         # [K, N/8]
                out[base + ".qzeros"] = _pack_words(zeros[:, perm], 1)         # [G, N/8]
            out[base + ".scales"] = scales
        worst = max(worst, ((deq - w).abs().max() / w.abs().max()).item())
        ref[name] = deq.contiguous()
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static"}
    elif fmt == "ct":
        from compressed_tensors.quantization import QuantizationConfig
        qc = QuantizationConfig(config_groups={"group_0": _ct_scheme(strategy)}, format="float-quantized",
                                ignore=["lm_head"], quantization_status="compressed").model_dump(mode="json")
    elif fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
              "checkpoint_format": version}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    for layer, (ks, vs) in (kv_scales or {}).items():
        pre = f"model.layers.{layer}.self_attn."
        names = {"vllm": ("k_scale", "v_scale"), "kv": ("kv_scale", None), "modelopt": ("k_proj.k_scale", "v_proj.v_scale"),
                 "ct": ("k_proj.output_scale", "v_proj.output_scale")}[kv_scale_names]
        shape = (1,) if kv_scale_names == "ct" else ()
        for name, value in zip(names, (ks, vs)):
            if name is not None:
                out[pre + name] = torch.full(shape, value, dtype=torch.float32)
    if kv_scales and kv_scale_names == "ct":
        from compressed_tensors.quantization import QuantizationArgs
        qc["kv_cache_scheme"] = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True,
                                                 dynamic=False).model_dump(mode="json")
    for folder, tensors_out, cfg in ((dst, out, {**config, "quantization_config": qc}), (dst + "-ref", ref, config)):
        os.makedirs(folder, exist_ok=True)
        save_file(tensors_out, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(src, extra)):
                shutil.copy(os.path.join(src, extra), folder)
    return dst, dst + "-ref", worst


def _ct_scheme(strategy: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    w = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    a = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=w, input_activations=a)
