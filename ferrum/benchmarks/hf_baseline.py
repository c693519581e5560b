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

import time

from ferrum.benchmarks.common import sync_device


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
