"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`.
All prompts go through the continuous-batching engine at once; a tqdm bar shows progress."""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from ferrum.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import SamplingParams


def engine_config(model: str = "smollm2", *, tensor_parallel_size: int = 1, dtype: str = "auto",
                  device: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 4096, enable_prefix_caching: bool = True,
                  enable_chunked_prefill: bool = True, block_size: int = 16,
                  kv_cache_memory: int | None = None, num_kv_blocks: int | None = None,
                  gpu_memory_utilization: float = 0.9, load_format: str = "auto", seed: int = 0,
                  enforce_eager: bool = False, chat_template: str | None = None,
                  max_waiting: int = 4096, async_scheduling: bool | None = None,
                  split_special_tokens: bool = True,
                  startup_timeout_s: float = 600.0, quantization: str | None = None,
                  kv_cache_dtype: str = "auto") -> EngineConfig:
    """Keyword arguments (the CLI flags without dashes) -> EngineConfig."""
    return EngineConfig(
        model=model, device=device, dtype=dtype, load_format=load_format, seed=seed,
        enforce_eager=enforce_eager, chat_template=chat_template, quantization=quantization,
        split_special_tokens=split_special_tokens,
        cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
                          gpu_memory_utilization=gpu_memory_utilization,
                          enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                  max_waiting=max_waiting, async_scheduling=async_scheduling),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                startup_timeout_s=startup_timeout_s))


class LLM:
    """An engine for offline batches. `model` as in EngineConfig; other kwargs as in
    `engine_config` (tensor_parallel_size, dtype, device, max_model_len, ...)."""

    def __init__(self, model: str = "smollm2", progress: bool = True, **kwargs):
        self.engine = LLMEngine(engine_config(model, **kwargs), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or token-id lists.
        All are queued first, so they run concurrently (continuous batching)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, params):
                if isinstance(p, str):
                    ids.append(self.engine.add_request(None, p, sp))
                else:
                    ids.append(self.engine.add_request(None, None, sp, prompt_token_ids=list(p)))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        t0, gen0 = time.perf_counter(), self.engine.stats["generation_tokens"]
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(final_only=True):
                    done[out.request_id] = out
                    bar.update(1)
                gen = self.engine.stats["generation_tokens"] - gen0
                bar.set_postfix_str(f"{gen / max(time.perf_counter() - t0, 1e-9):.1f} tok/s, "
                                    f"running {len(self.engine.scheduler.running)}", refresh=False)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True,
             split_special_tokens: bool | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them.
        split_special_tokens: see Tokenizer.apply_chat_template (None: the engine's setting)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      split_special_tokens=split_special_tokens)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
