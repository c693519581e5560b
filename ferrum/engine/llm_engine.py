"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

step(): scheduler picks decodes + prefill chunks -> executor runs them (one batched decode
forward, one batched prefill forward) -> the sampler draws the next token of every sequence
whose computation reached its end -> stop checks and incremental detokenization -> outputs.
With async scheduling (default on CUDA) the sampled ids stay on the device and the host
schedules and launches the next decode step before it reads them (see `step`).

Faults: an exception while a step runs fails only the requests that step holds (their
outputs end with finish_reason "error" and `RequestOutput.error`, their KV blocks are freed);
the engine goes on serving the others. Only an executor that can run no more steps (a dead
TP rank, a device fault: `ModelExecutor.health()`) makes `step` raise.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from ferrum.config import EngineConfig, format_size, resolve_max_model_len, resolve_sampling_defaults
from ferrum.engine.block_manager import BlockManager, salt_root
from ferrum.engine.scheduler import Scheduler
from ferrum.engine.sequence import Request, Sequence, SequenceStatus
from ferrum.engine.output_state import SequenceOutputState
from ferrum.errors import (CacheConfigError, InvalidRequestError, OutOfKvCacheError, QueueFullError,
                           check_prompt_len)
from ferrum.executor.base import is_device_fault
from ferrum.executor.memory import pool_flag
from ferrum.interfaces import (DecodeInput, KvCacheHandle, ModelExecutor, PrefillInput,
                               PromptLogprobs)
from ferrum.layers.sampler import Sampler, SamplingMetadata, validate_token_ids
from ferrum.outputs import CompletionOutput, RequestOutput, logprob_entry
from ferrum.sampling_params import SamplingParams
from ferrum.structured_output.manager import StructuredOutputManager

log = logging.getLogger("ferrum")

PLACEHOLDER = -1  # a sequence's next token while it is still on the device (async scheduling)


@dataclass
class StepInFlight:
    """A launched step whose samples the host has not processed yet.

    seqs / positions: the sampled sequences, in the sampler's row order, and the index in each
        one's token_ids of the PLACEHOLDER its sample replaces.
    token_ids: [B] int64 sampler output on the device (the next step's inputs may come from it);
        host_ids: its copy on the host, valid once `ready` (a CUDA event; None on CPU) fired.
    commits: (sequence, computed tokens) whose full blocks enter the prefix cache once every
        token in them is known.
    overlappable: no row needs its output ids on the host before its next step.
    prompt_logprobs: the prefill's PromptLogprobs and, per sequence that asked, (request,
        target ids, position of its first row); or None.
    """

    seqs: list[Sequence]
    positions: list[int]
    token_ids: torch.Tensor | None
    host_ids: torch.Tensor | None
    ready: "torch.cuda.Event | None"
    logprobs: list | None
    commits: list[tuple[Sequence, int]]
    overlappable: bool
    prompt_logprobs: tuple[PromptLogprobs, list[tuple[Request, list[int], int]]] | None = None


def create_executor(source, config: EngineConfig, progress: bool = True) -> ModelExecutor:
    """TensorParallelExecutor for tensor_parallel_size > 1, else SingleDeviceExecutor."""
    if config.parallel.tensor_parallel_size > 1:
        from ferrum.executor.tensor_parallel import TensorParallelExecutor
        return TensorParallelExecutor(source, config, progress)
    from ferrum.executor.single import SingleDeviceExecutor
    return SingleDeviceExecutor(source, config, progress)


class LLMEngine:
    """Requests in (`add_request`), RequestOutputs out (`step`), over one executor.

    Built from an EngineConfig: resolves the model, refuses a max_model_len above the model's
    positions (ConfigError), loads the tokenizer and chat template, starts the executor and
    sizes the block manager and scheduler from its capabilities. Not thread-safe: one thread
    drives it (AsyncLLMEngine's for the server)."""

    def __init__(self, config: EngineConfig, progress: bool = True):
        from ferrum.loader.resolve import resolve_model
        self.config = config
        source = resolve_model(config.model)
        # fail before loading the tokenizer / weights
        resolve_max_model_len(source.config, config.scheduler.max_model_len)
        if config.parallel.tensor_parallel_size > 1:
            from ferrum.executor.tensor_parallel import validate_tp_sizes
            validate_tp_sizes(source.config, config.parallel.tensor_parallel_size,
                              config.parallel.enable_expert_parallel)
        self.model_name = source.name
        self.model_config = source.config
        self.tokenizer = None
        if source.tokenizer_loader is not None:
            try:
                self.tokenizer = source.tokenizer_loader()
            except (OSError, ValueError) as e:
                # A folder without tokenizer files (AutoTokenizer raises OSError or, in
                # transformers 5, ValueError): the engine still serves token-id prompts.
                log.warning("%s: no usable tokenizer (%s); only token-id prompts are accepted",
                            source.name, str(e).splitlines()[0])
        if config.chat_template:
            from ferrum.tokenizer import load_chat_template
            template = load_chat_template(config.chat_template)
            if self.tokenizer is not None:
                self.tokenizer.chat_template = self.tokenizer.hf.chat_template = template
        if self.tokenizer is not None:
            self.tokenizer.split_special_tokens = config.split_special_tokens
        self.eos_token_ids = list(source.eos_token_ids or (self.tokenizer.eos_token_ids if self.tokenizer else []))
        # what requests that leave temperature, top_p, ... unset get: the model creator's values
        # from generation_config.json under --generation-config auto, as vLLM
        self.sampling_defaults = resolve_sampling_defaults(
            config.generation_config, source.path if source.fmt == "safetensors" else None)
        if self.sampling_defaults:
            where = source.path if config.generation_config == "auto" else config.generation_config
            log.warning("sampling defaults from %s: %s (--generation-config vllm, or "
                        "generation_config=\"vllm\" in Python, ignores them)",
                        os.path.join(where, "generation_config.json"), self.sampling_defaults)
        self.executor = create_executor(source, config, progress)
        try:
            self._init_after_executor(config)
        except BaseException:
            self.executor.shutdown()  # no worker ranks or device memory left behind
            raise

    def _init_after_executor(self, config: EngineConfig) -> None:
        self.executor.warmup()  # CUDA graphs / collectives set-up; no-op on CPU
        caps = self.executor.capabilities()
        self.max_model_len = caps.max_seq_len
        self.block_size = caps.block_size
        self.num_blocks = caps.num_kv_blocks
        per_seq = -(-self.max_model_len // self.block_size)
        msg = (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
               f"{self.num_blocks * self.block_size} tokens "
               f"({caps.memory.kv_bytes_per_block(self.block_size) * self.num_blocks / 2**20:.0f} MiB per rank); "
               f"{self.num_blocks / per_seq:.2f} sequences of max_model_len {self.max_model_len}")
        if self.num_blocks < per_seq:   # max_model_len set by the user (else it was fitted)
            flag = pool_flag(config.cache, self.executor.info().device)
            need = per_seq * caps.memory.kv_bytes_per_block(self.block_size)
            scale = 2**20 if need >= 2**20 else 2**10   # rounded up to whole MiB / KiB
            need = {"--num-kv-blocks": str(per_seq),
                    "--kv-cache-memory": format_size(-(-need // scale) * scale)}.get(flag)
            fix = f"raise {flag}" + (f" to at least {need}" if need else "")
            if self.num_blocks:
                fix = f"lower --max-model-len to at most {self.num_blocks * self.block_size} or {fix}"
            raise CacheConfigError(f"{msg}: not even one sequence fits; {fix}")
        log.info(msg)
        self.block_manager = BlockManager(self.num_blocks, self.block_size,
                                          config.cache.enable_prefix_caching)
        self.sample_device = self.executor.info().device   # logits arrive on rank 0's device
        on_cuda = self.sample_device.startswith("cuda")     # what a None (device-decided) option means
        sched = config.scheduler
        if sched.longest_decode_first is None:   # on where the decode attention runs in SM waves
            sched = dataclasses.replace(sched, longest_decode_first=on_cuda)
        self.scheduler = Scheduler(sched, self.block_manager, self.max_model_len)
        self.sampler = Sampler()
        self.vocab_size = self.model_config.vocab_size
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {"requests_finished": 0, "requests_aborted": 0, "requests_failed": 0,
                      "prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "overlapped_steps": 0}
        self.sampler.warmup(self.vocab_size, self.sample_device)
        a = config.scheduler.async_scheduling
        self.async_scheduling = on_cuda if a is None else a
        self._in_flight: StepInFlight | None = None
        # (sampled sequences, their SamplingMetadata) of the last step, when it can be reused
        self._metadata_cache: tuple[list[Sequence], SamplingMetadata] | None = None

    # ---- requests -------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's sampling defaults (`sampling_defaults`): what a
        request without its own SamplingParams gets (vLLM's get_default_sampling_params)."""
        return SamplingParams(**self.sampling_defaults)

    def add_request(self, request_id: str | None, prompt: str | list[int] | None,
                    params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, queue_limit: bool = False,
                    cache_salt: str | None = None) -> str:
        """Queue a request. `prompt` is text (tokenized here) or token ids. queue_limit: refuse
        it when `max_waiting` requests wait (the server's back-pressure; an offline batch
        queues every prompt it was given). cache_salt (vLLM's): the request shares cached
        prefix blocks only with requests of the same salt (`block_manager.salt_root`).

        Raises InvalidRequestError (empty prompt, token id out of range, duplicate id, a
        structured-outputs schema / regex / grammar that does not compile),
        PromptTooLongError (prompt >= max_model_len), OutOfKvCacheError (the request could
        never fit in the KV pool), QueueFullError (queue_limit and too many waiting requests)."""
        params = params or self.default_sampling_params()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer; pass prompt token ids")
                text, prompt_token_ids = prompt, self.tokenizer.encode(prompt)
            else:
                prompt_token_ids = list(prompt or [])
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty; give at least one token", param="prompt")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:   # (C loops)
            bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.vocab_size})", param="prompt")
        n = len(prompt_token_ids)
        check_prompt_len(n, self.max_model_len)
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words need a tokenizer", param="bad_words")
            params.bad_words_token_ids = self.tokenizer.bad_words_token_ids(params.bad_words)
        validate_token_ids(params, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", param="stop")
        total = min(self.max_model_len, n + (params.max_tokens or self.max_model_len))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        if -(-total // self.block_size) > self.num_blocks:
            raise OutOfKvCacheError(f"request needs {total} tokens of KV cache but the pool holds "
                                    f"{self.num_blocks * self.block_size}; lower max_tokens or "
                                    "raise --kv-cache-memory / --gpu-memory-utilization")
        limit = self.config.scheduler.max_waiting
        if queue_limit and len(self.scheduler.waiting) >= limit:   # (the count walks the queue)
            if (waiting := self.scheduler.num_waiting_requests()) >= limit:
                raise QueueFullError(f"{waiting} requests are waiting (limit {limit}); retry later")
        grammar = (self.structured.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        req = Request(request_id, text, list(prompt_token_ids), params, grammar=grammar,
                      cache_root=salt_root(cache_salt))
        self._new_seq(req, 0)
        self.requests[request_id] = req  # only once nothing above can raise
        self.stats["prompt_tokens"] += n
        return request_id

    def _new_seq(self, req: Request, index: int) -> Sequence:
        seq = Sequence(f"{req.request_id}#{index}", req, index, self.sample_device)
        seq.output_state = SequenceOutputState(req.params, self.tokenizer, req.prompt_token_ids,
                                               self.eos_token_ids, self.max_model_len)
        req.seqs.append(seq)
        if req.grammar is not None:   # each of the n samples walks the grammar on its own
            self.structured.add(seq.seq_id, req.grammar)
        if index == 0:
            self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            self._drop(seq)
        self.stats["requests_aborted"] += 1
        return True

    def _drop(self, seq: Sequence, completed: bool = False) -> None:
        """Finish `seq` and free its blocks; `completed`: it stopped on its own (not aborted or
        failed), which the scheduler's admission reserve learns from."""
        self.structured.release(seq.seq_id)
        if seq.status != SequenceStatus.FINISHED:
            self.scheduler.remove(seq, completed)
            self.executor.release_cache(seq.seq_id)
            seq.status = SequenceStatus.FINISHED

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or not yet returned as finished."""
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for each request that produced tokens
        (with final_only, only for requests that finished: an offline batch needs no
        per-step snapshots, and building one copies every running request's token list).

        With async scheduling a step's sampled ids stay on the device: when the next step can
        run without them on the host (`_can_overlap`), it is scheduled and launched first and
        the previous step's tokens are read and processed while the device runs it; when
        they cannot overlap the previous step is processed first. Either way a call returns
        the tokens of the step launched by the call before (on CPU, where a launch runs the
        whole forward, that only delays each token by a step: async is off there by default).

        An exception in scheduling, in a launch or in processing a step's samples fails the
        requests it concerns (see `_fail`) and the call returns normally; it raises only when
        the executor can run no more steps (`ModelExecutor.health()` says why)."""
        touched: dict[str, Request] = {}
        if self._in_flight is not None and not self._can_overlap():
            self._finish(touched)
        overlapped = self._in_flight is not None
        try:
            sched = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - any request the scheduler holds may be half-placed
            self._fail(list(self.scheduler.running) + list(self.scheduler.waiting), e, touched)
            sched = None
        launched = None
        if sched is not None:
            # overlap is only chosen when scheduling cannot admit or preempt (see _can_overlap)
            assert not overlapped or not (sched.prefills or sched.preempted), "overlap broke its rule"
            for seq in sched.preempted:   # its blocks went back to the pool: drop the stale handle
                self.executor.release_cache(seq.seq_id)
            if not sched.is_empty():
                self.stats["steps"] += 1
                self.stats["overlapped_steps"] += overlapped
                try:
                    launched = self._launch(sched)
                except Exception as e:  # noqa: BLE001 - fails this step's requests only
                    self._fail([c.seq for c in sched.decodes + sched.prefills], e, touched)
        self._finish(touched)         # the previous step, while the device runs this one
        self._in_flight = launched
        if not self.async_scheduling:
            self._finish(touched)
        return [self._output(r) for r in touched.values() if not final_only or r.finished()]

    def health(self) -> str | None:
        """None while the executor can run steps, else why not (see ModelExecutor.health)."""
        return self.executor.health()

    def _fail(self, seqs: list[Sequence], error: Exception, touched: dict) -> None:
        """A step (or the part of it that processes `seqs`) raised `error`: fail every request
        owning one of `seqs` (all its samples end with finish_reason "error", their blocks go
        back to the pool) and carry on. Re-raises `error` when the executor is broken or the
        device faulted: then no request can run any more."""
        reason = self.executor.health()
        if reason is None and is_device_fault(error):
            reason = f"the device failed: {type(error).__name__}: {error}"
        if reason is not None:
            log.error("the executor can run no more steps: %s", reason)
            raise error
        reqs = {s.request.request_id: s.request for s in seqs if not s.request.finished()}
        log.error("a step failed; failing %d request(s) %s and serving the rest",
                  len(reqs), sorted(reqs)[:8], exc_info=error)
        message = f"{type(error).__name__}: {error}"
        for req in reqs.values():
            req.error = message
            for seq in req.seqs:
                if seq.status is not SequenceStatus.FINISHED:
                    self._drop(seq)
                    seq.output_state.fail()
            self.stats["requests_failed"] += 1
            touched[req.request_id] = req

    def _can_overlap(self) -> bool:
        """True when the next step needs nothing from the in-flight step's samples on the
        host: every running sequence was sampled in it and only decodes (their input ids are
        taken from the device), no penalties / min_tokens / logprobs read output ids, no
        grammar needs the sampled token before it computes the next mask, the
        scheduler will neither admit (no waiting request, no free sequence slot, or too few
        free blocks for the first waiting one: `Scheduler.would_admit_next`) nor preempt
        (enough free blocks). A sequence that the in-flight token finishes gets one
        wasted row (as in vLLM); its position is still < max_model_len, since a running
        sequence holds at most max_model_len tokens. When the in-flight tokens surely end
        every running sequence (max_tokens or max_model_len reached, known without their
        values), the step would be all waste, which the next request would wait behind (a
        max_tokens=1 request, as a TTFT measurement sends): process them first instead."""
        in_flight, scheduler = self._in_flight, self.scheduler
        if not in_flight.overlappable or (len(scheduler.running) < self.config.scheduler.max_num_seqs
                                          and scheduler.would_admit_next()):
            return False
        bs = self.block_size
        new_blocks = 0
        ending = 0
        for s in scheduler.running:
            if s.token_ids[-1] != PLACEHOLDER:
                return False
            new_blocks += s.num_computed_tokens % bs == 0
            max_tokens = s.request.params.max_tokens
            ending += ((max_tokens is not None and len(s.token_ids) - s.num_prompt_tokens >= max_tokens)
                       or len(s.token_ids) >= self.max_model_len)
        return ending < len(scheduler.running) and new_blocks <= self.block_manager.num_free_blocks

    def _launch(self, sched) -> "StepInFlight":
        """Run the step's forward passes and the sampler; returns without waiting for the
        device. Every sampled sequence gets a PLACEHOLDER token until `_finish` reads it."""
        now = time.perf_counter()
        prev = self._in_flight
        logits_parts, sample_seqs = [], []
        prompt_lps = None
        # the grammar masks of the rows this step samples (decodes, then prefills that end
        # their prompt: sample_seqs' order) are computed while the forward runs
        grammar_mask = self.structured.bitmask_async(
            [c.seq.seq_id for c in sched.decodes]
            + [c.seq.seq_id for c in sched.prefills if c.completes]) if self.structured.num_active else None
        if sched.decodes:
            seqs = [c.seq for c in sched.decodes]
            tokens = [s.token_ids[-1] for s in seqs]
            inp = DecodeInput(tokens, self._handles(seqs))
            if PLACEHOLDER in tokens:  # inputs sampled by the in-flight step, still on the device
                inp.prev_sampled = prev.token_ids
                inp.prev_rows = [s.sampled_row if t == PLACEHOLDER else -1 for s, t in zip(seqs, tokens)]
                inp.token_ids = [max(t, 0) for t in tokens]
            logits_parts.append(self.executor.decode(inp).logits)
            sample_seqs += seqs
        if sched.prefills:
            seqs = [c.seq for c in sched.prefills]
            chunks = [s.token_ids[s.num_computed_tokens:s.num_computed_tokens + c.num_tokens]
                      for s, c in zip(seqs, sched.prefills)]
            completes = [c.completes for c in sched.prefills]
            inp = PrefillInput(chunks, self._handles(seqs))
            targets = [self._prompt_logprob_targets(s, len(chunk)) for s, chunk in zip(seqs, chunks)]
            if any(targets):
                inp.prompt_logprob_targets = targets
                inp.num_top_logprobs = max(s.request.params.prompt_logprobs
                                           for s, t in zip(seqs, targets) if t)
            out = self.executor.prefill(inp)
            if out.prompt_logprobs is not None:
                prompt_lps = (out.prompt_logprobs, [(s.request, t, s.num_computed_tokens)
                                                    for s, t in zip(seqs, targets) if t])
            if any(completes):
                idx = [i for i, c in enumerate(completes) if c]
                if len(idx) < len(seqs):   # an index list would be copied to the device blocking
                    rows = torch.tensor(idx).to(out.logits.device, non_blocking=True)
                    logits_parts.append(out.logits.index_select(0, rows))
                else:
                    logits_parts.append(out.logits)
                sample_seqs += [seqs[i] for i in idx]
        bs = self.block_size
        commits = []
        window = self.model_config.kv_window
        for c in sched.decodes + sched.prefills:
            s = c.seq
            if window and not (s.index == 0 and s.request.params.n > 1 and not s.request.forked):
                # This step's first query (position num_computed_tokens) and every later one see
                # no key older than num_computed_tokens - window + 1: release blocks before it.
                # (Not before n > 1 samples fork from this prompt: they still read it.)
                self.block_manager.free_blocks_before(s.seq_id, s.num_computed_tokens - window + 1)
            s.num_computed_tokens += c.num_tokens
            metrics = s.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            # a decode fills a block only when it lands on a block boundary
            if c.num_tokens > 1 or s.num_computed_tokens % bs == 0:
                commits.append((s, s.num_computed_tokens))
        if not sample_seqs:
            return StepInFlight([], [], None, None, None, None, commits, prompt_lps is None, prompt_lps)
        logits = torch.cat(logits_parts) if len(logits_parts) > 1 else logits_parts[0]
        cached = self._metadata_cache
        if cached is not None and grammar_mask is None and cached[0] == sample_seqs:
            # the same sequences in the same rows as the step before, and their metadata reads
            # no output ids: it is unchanged (a steady decode batch rebuilt it every step)
            need_out, sampling_metadata = False, cached[1]
        else:
            params = [s.request.params for s in sample_seqs]
            # Output ids (a copy per sequence) only when penalties, min_tokens or bad words read them.
            need_out = any(p.min_tokens or p.repetition_penalty != 1.0 or p.presence_penalty
                           or p.frequency_penalty or p.bad_words_token_ids for p in params)
            sampling_metadata = SamplingMetadata.build(
                params, [s.request.prompt_token_ids for s in sample_seqs],
                [s.output_token_ids for s in sample_seqs] if need_out else [()] * len(sample_seqs),
                [s.generator for s in sample_seqs], self.eos_token_ids, self.vocab_size, logits.device)
            reusable = not need_out and grammar_mask is None
            self._metadata_cache = (sample_seqs, sampling_metadata) if reusable else None
        constrained = None if grammar_mask is None else grammar_mask.result()
        if constrained is not None:
            # the matcher must have seen every earlier token: such steps are never overlapped
            assert all(sample_seqs[r].token_ids[-1] != PLACEHOLDER for r in constrained[0])
            sampling_metadata.set_grammar_bitmask(*constrained)
        out = self.sampler(logits, sampling_metadata)
        ids, ready = out.token_ids, None
        host = ids
        if ids.is_cuda:  # copy into pinned memory; `ready` fires when it has landed
            host = ids.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        positions = []
        for i, s in enumerate(sample_seqs):
            positions.append(len(s.token_ids))
            s.token_ids.append(PLACEHOLDER)
            s.sampled_row = i
        return StepInFlight(sample_seqs, positions, ids, host, ready, out.logprobs, commits,
                            not need_out and out.logprobs is None and prompt_lps is None
                            and constrained is None, prompt_lps)

    @staticmethod
    def _prompt_logprob_targets(seq: Sequence, num_tokens: int) -> list[int]:
        """Prompt tokens whose logprobs the next `num_tokens` computed positions of `seq` give
        (all of them from its first position on, or [] when none is new): position p yields
        the logprob of prompt token p + 1, for p < num_prompt_tokens - 1 (the last prompt
        position predicts the first output token). After a preemption the recomputed chunk
        may repeat positions already done; `_store_prompt_logprobs` skips those."""
        req, start = seq.request, seq.num_computed_tokens
        end = min(start + num_tokens, seq.num_prompt_tokens - 1)
        if not seq.needs_prompt_logprobs or start > req.prompt_logprob_pos or end <= req.prompt_logprob_pos:
            return []
        req.prompt_logprob_pos = end
        return seq.token_ids[start + 1:end + 1]

    def _handles(self, seqs: list[Sequence]) -> list[KvCacheHandle]:
        return [KvCacheHandle(s.seq_id, self.block_manager.block_table(s.seq_id),
                              s.num_computed_tokens, self.block_size) for s in seqs]

    def _finish(self, touched: dict) -> None:
        """Wait for the in-flight step's samples, put them in place of the placeholders, hash
        the blocks it filled, and run stop checks / detokenization."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        for seq, n in in_flight.commits:
            if seq.status is SequenceStatus.RUNNING:
                try:
                    self.block_manager.commit_full_blocks(seq.seq_id, seq.token_ids, n)
                except Exception as e:  # noqa: BLE001 - fails this sequence's request only
                    self._fail([seq], e, touched)
        if in_flight.prompt_logprobs is not None:
            self._store_prompt_logprobs(*in_flight.prompt_logprobs)
        if not in_flight.seqs:
            return
        try:
            if in_flight.ready is not None:
                in_flight.ready.synchronize()
            token_ids = in_flight.host_ids.tolist()
        except Exception as e:  # noqa: BLE001 - the step's samples are lost: fail its requests
            self._fail(in_flight.seqs, e, touched)
            return
        now = time.perf_counter()
        requests, logprobs = self.requests, in_flight.logprobs
        FINISHED = SequenceStatus.FINISHED
        generated = 0
        for i, (seq, pos, tok) in enumerate(zip(in_flight.seqs, in_flight.positions, token_ids)):
            req = seq.request
            if seq.status is FINISHED or req.request_id not in requests:
                continue  # aborted, failed, or finished by the step before (extra work)
            try:
                if seq.index == 0 and req.params.n > 1 and not req.forked:
                    self._fork(req, seq)
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                seq.token_ids[pos] = tok
                state = seq.output_state
                constrained = req.grammar is not None   # unconstrained rows skip the matcher calls
                if constrained:   # a token the grammar rejects fails the request (except below)
                    self.structured.accept(seq.seq_id, tok)
                state.append(tok)
                if constrained and not state.finished and self.structured.is_terminated(seq.seq_id):
                    state.finish("stop")  # the grammar is complete: nothing but EOS could follow
                seq.new_tokens += 1
                if logprobs is not None and logprobs[i] is not None:
                    seq.logprobs.append(logprobs[i])
                    seq.cumulative_logprob += logprobs[i].get(tok, 0.0)
                generated += 1
                if state.finish_reason is not None:
                    del seq.token_ids[pos + 1:]  # a placeholder of a step launched after this one
                    self._drop(seq, completed=True)
            except Exception as e:  # noqa: BLE001 - grammar, stop checks, detokenizer: this request only
                self._fail([seq], e, touched)
            touched[req.request_id] = req
        self.stats["generation_tokens"] += generated

    @staticmethod
    def _store_prompt_logprobs(lps: PromptLogprobs,
                               groups: list[tuple[Request, list[int], int]]) -> None:
        """Append a prefill's prompt logprobs to their requests (steps finish in launch order,
        so a request's entries arrive in prompt order): per target, {token id: Logprob} of the
        request's top-N (N = its prompt_logprobs) followed by the target itself, ranked (see
        Logprob). Rows for prompt tokens that already have an entry (recomputed after
        preemption) are skipped."""
        token_lps, token_ranks = lps.token_logprobs.tolist(), lps.token_ranks.tolist()
        top_ids, top_lps = lps.top_ids.tolist(), lps.top_logprobs.tolist()
        row = 0
        for req, targets, first_pos in groups:
            n = req.params.prompt_logprobs
            for j, tok in enumerate(targets):
                if first_pos + j + 1 == len(req.prompt_logprobs):
                    req.prompt_logprobs.append(logprob_entry(top_ids[row], top_lps[row][:n], tok,
                                                             token_lps[row], token_ranks[row]))
                row += 1

    def _fork(self, req: Request, parent: Sequence) -> None:
        """n > 1: the other samples share the prompt's full blocks with sample 0 and compute
        only the rest of the prompt themselves. Those beyond max_num_seqs running sequences
        wait at the front of the queue (as preempted ones do) and prefill the prompt when
        admitted, from the prefix cache where it holds the prompt."""
        req.forked = True
        waiting = []
        for i in range(1, req.params.n):
            child = self._new_seq(req, i)
            if len(self.scheduler.running) < self.config.scheduler.max_num_seqs:
                child.num_computed_tokens = self.block_manager.fork(
                    parent.seq_id, child.seq_id, parent.num_prompt_tokens)
                self.scheduler.add_running(child)
            else:
                waiting.append(child)
        for child in reversed(waiting):   # admitted in index order
            self.scheduler.add(child, front=True)

    def _output(self, req: Request) -> RequestOutput:
        try:
            return self._build_output(req)
        except Exception as e:  # noqa: BLE001 - fail this request, not the step
            if not req.finished():
                self._fail(req.seqs, e, {})
            self.requests.pop(req.request_id, None)
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                                 [CompletionOutput(s.index, finish_reason=s.output_state.finish_reason)
                                  for s in req.seqs], True, req.metrics,
                                 error=req.error or f"{type(e).__name__}: {e}")

    def _build_output(self, req: Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            state = s.output_state
            outs.append(CompletionOutput(
                index=s.index, text=state.text, token_ids=list(state.token_ids),
                finish_reason=state.finish_reason, stop_reason=state.stop_reason,
                logprobs=list(s.logprobs) if req.params.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if req.params.logprobs is not None else None,
                delta_text=state.stream_delta(),
                num_delta_tokens=s.new_tokens,
                token_text_ends=state.token_text_ends() if req.params.logprobs is not None else None))
            s.new_tokens = 0
        finished = req.finished()
        if finished:
            req.metrics.finished_time = time.perf_counter()
            self.requests.pop(req.request_id, None)
            self.stats["requests_finished"] += 1
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             req.metrics, num_cached_tokens=req.seqs[0].num_cached_tokens or 0,
                             error=req.error, prompt_logprobs=req.prompt_logprobs)

    # ---- status ---------------------------------------------------------------------------------
    def status(self) -> dict:
        """Live numbers: executor status plus scheduler / block manager / request counters."""
        ex = self.executor.status()
        bm = self.block_manager
        return {
            "executor": ex,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "grammar_matchers": self.structured.num_active,
            **self.stats,
        }

    def shutdown(self) -> None:
        """Drop the in-flight step and shut the executor down (worker ranks, device memory)."""
        self._in_flight = None
        self.executor.shutdown()
