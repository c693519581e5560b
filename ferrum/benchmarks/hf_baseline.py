"""HF transformers as the in-process baseline of `ferrum bench latency`: `generate` on the same
weights, prompts and device, in its fastest stock form where that works.

Modes (`--hf-mode`):
  compile  a StaticCache (one, reset before each call, so shapes never change) and
           transformers' automatic `torch.compile` of the decode step (mode "reduce-overhead",
           fullgraph: CUDA graphs), which `generate` turns on for a compileable cache on CUDA
           (and, with `CompileConfig(_compile_all_devices=True)`, on CPU)
  static   the StaticCache without compilation
  eager    `generate` with its default dynamic cache
  auto     compile on CUDA, eager on CPU (inductor's CPU build is slow to compile and rarely
           faster there)
The mode that actually ran is reported (`label`): when compilation fails the baseline falls
back to eager and says so.

Timing, per batch of prompts: TTFT = generate(max_new_tokens=1); TPOT = (generate(output_len)
- TTFT) / (output_len - 1).
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from ferrum.benchmarks.common import sync_device

if TYPE_CHECKING:
    import torch


class HFBaseline:
    """HF model `model` (already on `device`, eval) timed as above in `mode`; max_len: the
    static cache's length in tokens (prompt + output)."""

    def __init__(self, model, mode: str, device: str, max_len: int):
        import torch
        self.model, self.device = model, device
        if mode == "auto":
            mode = "compile" if device.startswith("cuda") else "eager"
        self.mode = self.label = mode
        self.cache = None
        if mode in ("compile", "static"):
            from transformers import StaticCache
            self.cache = StaticCache(config=model.config, max_cache_len=max_len)
            gc = model.generation_config
            gc.disable_compile = mode == "static"
            if mode == "compile" and not device.startswith("cuda"):
                from transformers import CompileConfig
                gc.compile_config = CompileConfig(_compile_all_devices=True)
        self._torch = torch

    def _generate(self, x, n: int):
        kw = {}
        if self.cache is not None:
            self.cache.reset()
            kw["past_key_values"] = self.cache
        return self.model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """(TTFT, TPOT) in seconds for one batch of equal-length token-id prompts. On the
        first call in "compile" mode a failure to compile switches to eager (label says so)."""
        torch = self._torch
        x = torch.tensor(prompts, device=self.device)
        with torch.inference_mode():
            try:
                return self._timed(x, output_len)
            except Exception as e:   # inductor / dynamo failure: keep a labelled eager baseline
                if self.mode != "compile" or self.label != "compile":
                    raise
                self.label = f"eager (compile failed: {type(e).__name__}: {str(e)[:120]})"
                self.cache = None
                self.model.generation_config.disable_compile = True
                return self._timed(x, output_len)

    def _timed(self, x, output_len: int) -> tuple[float, float]:
        sync_device(self.device)
        t = time.perf_counter()
        self._generate(x, 1)
        sync_device(self.device)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        g = self._generate(x, output_len)
        sync_device(self.device)
        total = time.perf_counter() - t
        assert g.shape[1] == x.shape[1] + output_len
        if self.mode == "compile" and self.label == "compile" and not hasattr(self.model, "_compiled_call"):
            self.label = "static cache, not compiled (transformers did not compile the decode step)"
        return ttft, max(total - ttft, 0.0) / max(1, output_len - 1)


def load_hf_model(source, dtype: torch.dtype, device: str):
    """The same weights in HF transformers: `from_pretrained` for a HF folder, `gguf_file=` for
    a GGUF (HF dequantizes it; needs `accelerate`), `from_config` + ferrum's loader for a GGUF
    when that is unavailable, and `from_config` (random weights) for dummy models."""
    import transformers
    path = source.path
    if source.fmt == "safetensors" and path:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    elif source.fmt == "gguf" and path:
        try:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        except (ImportError, ValueError) as e:   # e.g. accelerate missing
            print(f"HF cannot load the GGUF itself ({e}); loading ferrum's dequantized tensors into it")
            m = _hf_from_ferrum_weights(source, dtype)
    elif source.fmt == "dummy" and path:   # the config.json itself: every family transformers knows
        import json
        with open(path) as f:
            d = json.load(f)
        cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        m = _hf_from_config(source.config, dtype)
    m.generation_config.eos_token_id = None      # never stop early: time exactly output_len tokens
    m.generation_config.pad_token_id = 0
    return m.to(device).eval()


def _hf_config(cfg):
    import transformers
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
              num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
              rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.rope_scaling:
        kw["rope_scaling"] = dict(cfg.rope_scaling)
    names = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    if cfg.family not in names:
        from ferrum.errors import UnsupportedModelError
        raise UnsupportedModelError(f"no HF reference for {cfg.architecture} built from ferrum's "
                                    "config; load the model from an HF folder or GGUF instead")
    return getattr(transformers, names[cfg.family])(**kw)


def _hf_from_config(cfg, dtype):
    import transformers
    return transformers.AutoModelForCausalLM.from_config(_hf_config(cfg), dtype=dtype)


def _hf_from_ferrum_weights(source, dtype):
    m = _hf_from_config(source.config, dtype)
    ws = source.weights()
    sd = {n: ws.get(n).load() for n in ws.names()}
    missing, _ = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and source.config.tie_word_embeddings)]
    if missing:
        raise RuntimeError(f"HF model lacks weights for {missing[:5]}")
    return m
