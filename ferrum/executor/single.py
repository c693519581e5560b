"""SingleDeviceExecutor: the whole model on one device (CPU or one GPU)."""
from __future__ import annotations

import logging

import torch

from ferrum.config import EngineConfig
from ferrum.distributed.parallel_state import init_tensor_parallel
from ferrum.executor.base import ExecutorBase
from ferrum.executor.memory import num_kv_blocks
from ferrum.executor.model_runner import ModelRunner
from ferrum.interfaces import DecodeInput, PrefillInput, PromptLogprobs
from ferrum.loader.base import ModelSource

log = logging.getLogger("ferrum")


class SingleDeviceExecutor(ExecutorBase):
    """The `ModelExecutor` for one device: one ModelRunner, TP size 1, KV pool sized by
    `num_kv_blocks` from the memory left after the weights."""

    def __init__(self, source: ModelSource, config: EngineConfig, progress: bool = True):
        super().__init__(source, config)
        torch.manual_seed(config.seed)
        init_tensor_parallel(0, 1, None)  # layers built below see TP size 1
        self.runner = ModelRunner(source, self.device, self.dtype, config.load_format, config.seed, progress,
                                  config.quantization, config.cache.kv_cache_dtype,
                                  config.scheduler.max_model_len)
        self.memory = self.runner.memory_requirements(1)
        s = config.scheduler
        self._allocate_kv_cache(num_kv_blocks(self.memory, config.cache, self.device, self.max_model_len,
                                              s.max_num_seqs, s.max_num_batched_tokens))

    def _prefill(self, inp: PrefillInput) -> tuple[torch.Tensor, PromptLogprobs | None]:
        return self.runner.prefill(inp.token_ids, inp.kv, inp.prompt_logprob_targets,
                                   inp.num_top_logprobs)

    def _decode(self, inp: DecodeInput) -> torch.Tensor:
        return self.runner.decode(inp.token_ids, inp.kv, inp.prev_sampled, inp.prev_rows)

    def warmup(self) -> None:
        """On CUDA: compile the kernels of a full-budget prefill chunk (`warmup_prefill`), then
        capture decode and short-prefill CUDA graphs (unless --enforce-eager)."""
        if self.runner.device.type != "cuda":
            return
        s = self.config.scheduler
        self.runner.warmup_prefill(min(s.max_num_batched_tokens, self.max_model_len))
        if not self.config.enforce_eager:
            self.runner.capture_cuda_graphs(s.max_num_seqs, self.max_model_len, s.max_num_batched_tokens)
            self.cuda_graphs = True

    def shutdown(self) -> None:
        """Free graphs, KV cache and weights; later calls do nothing."""
        if self.runner is not None:
            self.runner.release()
            self.runner = None
