"""Fill a model's parameters from a WeightSource (HF names), one tensor at a time, each rank
reading only its slice through the parameters' `weight_loader`s."""
from __future__ import annotations

import re
import sys

import torch
from torch import nn
from tqdm.auto import tqdm

from ferrum.errors import TensorParallelError, WeightLoadError
from ferrum.loader.base import WeightSource
from ferrum.ops import act_quant

# Checkpoint entries that are derived state, not weights.
_SKIP = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def packed_target(name: str, mapping: dict) -> tuple[str, object]:
    """(our parameter name, shard id) for checkpoint tensor `name` under a model's
    `packed_modules_mapping` (`q_proj` -> (`qkv_proj`, "q"), ...); (name, None) if unpacked."""
    for ckpt, (ours, sid) in mapping.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{ours}."), sid
    return name, None


# FP8 KV-cache scales as checkpoints name them (suffix of `<layer>.self_attn`) -> the Attention
# buffers they fill (`<layer>.self_attn.attn.k_scale` / `v_scale`): vLLM / AutoFP8 `k_scale`,
# `v_scale`; the older single `kv_scale` (both); ModelOpt `k_proj.k_scale`; compressed-tensors'
# `kv_cache_scheme` writes the k_proj / v_proj output scales.
KV_SCALE_NAMES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",), "kv_scale": ("k_scale", "v_scale"),
                  "k_proj.k_scale": ("k_scale",), "v_proj.v_scale": ("v_scale",),
                  "k_proj.output_scale": ("k_scale",), "v_proj.output_scale": ("v_scale",)}


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(Attention module name, buffers) that checkpoint tensor `name` fills when it is an FP8
    KV-cache scale (`KV_SCALE_NAMES`), else None. `model.layers.3.self_attn.k_scale` ->
    (`model.layers.3.self_attn.attn`, ("k_scale",))."""
    head, sep, tail = name.partition(".self_attn.")
    if not sep or tail not in KV_SCALE_NAMES:
        return None
    return f"{head}.self_attn.attn", KV_SCALE_NAMES[tail]


def load_weights(model: nn.Module, source: WeightSource, progress: bool = True) -> None:
    """Raises WeightLoadError when a parameter is missing from the source, a shape differs,
    or a file cannot be read; an extra tensor only where `check_unused` says (layers past the
    config's, a bias the config has not), others are ignored (e.g. tied lm_head copies).
    FP8 KV-cache scales (`kv_scale_target`) go to the Attention layers' k_scale / v_scale,
    which only an FP8 KV cache reads.

    A checkpoint name maps to (parameter, shard id) through the model's `map_weight_name(name)`
    when it has one (MoE experts, renamed modules), else its `packed_modules_mapping`. A
    model whose checkpoints store projections fused (Phi-3's qkv_proj) splits them first with
    `split_fused_weight(name, lazy)` -> [(name, lazy)] (row slices under the unfused names).
    A parameter with a `shard_ids` list must receive every one of them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    mapping = getattr(model, "packed_modules_mapping", {})
    remap = getattr(model, "map_weight_name", None) or (lambda n: packed_target(n, mapping))
    split = getattr(model, "split_fused_weight", None) or (lambda n, lazy: [(n, lazy)])
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unused: list[tuple[str, object]] = []   # checkpoint tensors no parameter takes (name, lazy)
    names = source.names()
    # a terminal clears the finished bar; a log keeps it, ended by a newline, so the next line
    # does not run onto it
    for full_name in tqdm(names, desc="loading weights", unit="tensor", disable=not progress,
                          leave=not sys.stderr.isatty()):
        if full_name.endswith(_SKIP) or (tied and full_name == "lm_head.weight"):
            continue
        kv = kv_scale_target(full_name)
        if kv is not None and hasattr(modules.get(kv[0]), "load_kv_scale"):
            for buffer in kv[1]:
                modules[kv[0]].load_kv_scale(buffer, source.get(full_name).load(), full_name)
            continue
        for name, lazy in split(full_name, source.get(full_name)):
            target, shard = remap(name)
            param = params.get(target)
            if param is None:
                unused.append((name, lazy))
                continue
            try:
                param.weight_loader(param, lazy, shard)
            except (WeightLoadError, TensorParallelError) as e:
                raise type(e)(f"{name}: {e}") from e
            loaded.add(target if shard is None else f"{target}:{shard}")
    check_unused(model, unused, remap, modules)
    shards: dict[str, list] = {}  # fused module -> the shard ids it is loaded from
    for ours, sid in mapping.values():
        shards.setdefault(ours, []).append(sid)
    missing = []
    for pname, param in params.items():
        if (tied and pname == "lm_head.weight") or getattr(param, "optional", False):
            continue
        module = pname.rsplit(".", 2)[-2] if pname.count(".") >= 1 else ""
        if getattr(param, "shard_ids", None) is not None:  # stacked MoE experts
            need = [f"{pname}:{s}" for s in param.shard_ids]
        elif module in shards:
            need = [f"{pname}:{s}" for s in shards[module]]
        else:
            need = [pname]
        missing += [n for n in need if n not in loaded]
    if missing:
        raise WeightLoadError(f"{len(missing)} tensors missing from the checkpoint, e.g. {missing[:4]}")
    process_weights_after_loading(model)


def check_unused(model: nn.Module, unused: list[tuple[str, object]], remap,
                 modules: dict[str, nn.Module]) -> None:
    """Raise WeightLoadError for checkpoint tensors (name, lazy tensor) that no parameter took
    but that the model needs to compute what the checkpoint computes: layers past the config's
    num_hidden_layers (the model would run on its first layers only) and a nonzero bias of a
    layer the config builds without one (attention_bias / mlp_bias off). An all-zero bias is
    skipped: AutoGPTQ writes one for every linear of models without biases, and vLLM's loaders
    skip extra biases. Other unused tensors (tied lm_head copies, extra heads) are ignored."""
    n_layers = model.config.num_hidden_layers
    for name, lazy in unused:
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m and int(m[1]) >= n_layers:
            raise WeightLoadError(f"{name}: the checkpoint has layer {m[1]}, but the model config "
                                  f"(config.json / GGUF block_count) has num_hidden_layers {n_layers}")
        owner = modules.get(remap(name)[0].rpartition(".")[0])
        if (name.endswith(".bias") and owner is not None and getattr(owner, "bias", 0) is None
                and bool(lazy.load().any())):
            raise WeightLoadError(f"{name}: the checkpoint has a bias that the model config does "
                                  "not enable (config.json's attention_bias / mlp_bias, or its architecture)")


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each quantized linear turn its checkpoint layout into the layout it runs with. The
    last model loaded in a process decides `act_quant.wanted` (its Q4_K / 4-bit layers set it): a model
    loaded next to it without them turns it off (the other then takes q8_1's launches)."""
    act_quant.wanted = 0
    for mod in model.modules():
        method = getattr(mod, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(mod)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for speed work: N(0, 0.02) matrices, ones for norm weights. Values are
    drawn on the parameters' device (no host copy), so an 8B model initialises in seconds."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    quantized = set()
    for mod in model.modules():  # packed formats draw their own random codes and scales
        method = getattr(mod, "quant_method", None)
        if method is not None and method.name != "unquantized":
            method.init_dummy(mod, g)
            quantized.update(id(p) for p in mod.parameters(recurse=False))
    for name, p in model.named_parameters():
        if id(p) in quantized and not name.endswith("bias"):
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dtype.is_floating_point:
            p.normal_(0.0, 0.02, generator=g)
    process_weights_after_loading(model)
