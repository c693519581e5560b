"""Bookkeeping shared by both executors: info, capabilities, live status, and the set of
sequences whose caches were touched (released by `release_cache`)."""
from __future__ import annotations

import logging

import torch

from ferrum.config import EngineConfig, resolve_device, resolve_dtype, resolve_max_model_len
from ferrum.errors import EngineDeadError
from ferrum.interfaces import (DecodeInput, DecodeOutput, ExecutorCapabilities, ExecutorStatus,
                               KvCacheHandle, ModelInfo, PrefillInput, PrefillOutput,
                               PromptLogprobs)
from ferrum.loader.base import ModelSource
from ferrum.executor.memory import compute_memory_requirements, fit_max_model_len
from ferrum.executor.threads import apply_engine_settings

log = logging.getLogger("ferrum")


def is_device_fault(error: BaseException) -> bool:
    """True for an error that leaves the device unusable for every later step: a CUDA error
    such as an illegal memory access is sticky (torch raises AcceleratorError, or a
    RuntimeError saying "CUDA error" on older versions). An out-of-memory error is not: the
    step's requests fail and the memory comes back."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(error, accel)) or (
        isinstance(error, RuntimeError) and "CUDA error" in str(error))


class ExecutorBase:
    """The bookkeeping half of a `ModelExecutor`: model info, capabilities, memory
    requirements and live status from the config; subclasses implement `_prefill` /
    `_decode` and size the pool with `_allocate_kv_cache`."""

    def __init__(self, source: ModelSource, config: EngineConfig):
        self.source, self.config = source, config
        self.cfg = source.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # the thread that runs the steps (rank 0's): threads, kernel switches, one warning
        apply_engine_settings(config, warn=self.device == "cpu")
        self.tp = config.parallel.tensor_parallel_size
        self.max_model_len = resolve_max_model_len(self.cfg, config.scheduler.max_model_len)
        # unquantized, model-dtype KV; subclasses replace it by their runner's (quantization,
        # KV cache dtype) once it is built
        self.memory = compute_memory_requirements(self.cfg, self.dtype, self.tp)
        self.num_blocks = 0
        self._live: dict[str, KvCacheHandle] = {}
        self._steps = {"prefill_steps": 0, "decode_steps": 0, "prefill_tokens": 0, "decode_tokens": 0}
        self._broken: str | None = None   # why no step can run any more (see health)

    # Subclasses implement these two (returning logits [num_seqs, vocab] float32; _prefill
    # with the step's PromptLogprobs or None) and call _allocate_kv_cache; the public
    # prefill/decode below add the bookkeeping.
    def _prefill(self, inp: PrefillInput) -> tuple[torch.Tensor, PromptLogprobs | None]:
        raise TypeError(f"{type(self).__name__} must implement _prefill")

    def _decode(self, inp: DecodeInput) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} must implement _decode")

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """Give rank 0's runner a pool of `num_blocks` blocks (the count every rank agreed on)
        and fit max_model_len to it when the user left it unset (`fit_max_model_len`)."""
        self.num_blocks = num_blocks
        self.max_model_len = fit_max_model_len(self.max_model_len, num_blocks, self.config.cache,
                                               self.device, self.config.scheduler.max_model_len)
        self.runner.allocate_kv_cache(num_blocks, self.config.cache.block_size)

    def _guarded(self, run, inp):
        """Run one forward; a device fault marks the executor broken (every later step
        raises EngineDeadError at once instead of failing on the device again)."""
        if self._broken is not None:
            raise EngineDeadError(f"the executor is broken: {self._broken}")
        try:
            return run(inp)
        except Exception as e:
            if self._broken is None and is_device_fault(e):
                self._broken = f"the device failed: {type(e).__name__}: {e}"
            raise

    def health(self) -> str | None:
        """None while steps can run; else why not (a device fault, a dead TP rank). Cheap and
        safe to call from another thread than the one running steps (the server's /health)."""
        return self._broken

    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        """Run `_prefill`, then advance each handle's num_tokens by its chunk length and
        record the sequence as live. Logits: [num_seqs, vocab_size] float32; prompt logprobs
        when the input names targets (see PrefillInput)."""
        logits, prompt_logprobs = self._guarded(self._prefill, inp)
        for ids, h in zip(inp.token_ids, inp.kv):
            h.num_tokens += len(ids)
            self._live[h.cache_id] = h
        self._steps["prefill_steps"] += 1
        self._steps["prefill_tokens"] += sum(map(len, inp.token_ids))
        return PrefillOutput(logits, inp.kv, prompt_logprobs)

    def decode(self, inp: DecodeInput) -> DecodeOutput:
        """Run `_decode`, then advance each handle's num_tokens by 1 and record the sequence
        as live. Logits: [num_seqs, vocab_size] float32."""
        logits = self._guarded(self._decode, inp)
        for h in inp.kv:
            h.num_tokens += 1
            self._live[h.cache_id] = h
        self._steps["decode_steps"] += 1
        self._steps["decode_tokens"] += len(inp.token_ids)
        return DecodeOutput(logits, inp.kv)

    def release_cache(self, cache_id: str) -> None:
        """Forget the sequence (its blocks belong to the block manager; nothing to free on
        the device). Unknown ids are ignored."""
        self._live.pop(cache_id, None)

    def info(self) -> ModelInfo:
        """Architecture, sizes, dtype, device and TP size of the loaded model."""
        c = self.cfg
        return ModelInfo(c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers,
                         c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.max_model_len,
                         str(self.dtype).replace("torch.", ""), self.device, self.tp, c.num_params())

    def capabilities(self) -> ExecutorCapabilities:
        """Static limits: max batch (max_num_seqs), max sequence length (tokens), KV block
        size and count, dtypes, devices, TP/PP sizes, CUDA graphs, memory requirements."""
        return ExecutorCapabilities(
            max_batch_size=self.config.scheduler.max_num_seqs, max_seq_len=self.max_model_len,
            block_size=self.config.cache.block_size, num_kv_blocks=self.num_blocks,
            dtypes=["float32", "bfloat16", "float16"], devices=["cpu", "cuda"],
            tensor_parallel_size=self.tp, pipeline_parallel_size=1,
            cuda_graphs=getattr(self, "cuda_graphs", False), memory=self.memory)

    def status(self) -> ExecutorStatus:
        """Live numbers: sequences not yet released, step and token counters."""
        return ExecutorStatus(len(self._live), **self._steps)

    def warmup(self) -> None:
        """Nothing to prepare by default (CPU); CUDA executors capture graphs here."""

    def shutdown(self) -> None:
        """Nothing to release by default; executors holding devices or ranks override it."""
