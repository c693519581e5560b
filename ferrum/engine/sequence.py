"""A Sequence is one sample being generated: prompt ids, output ids, how many of its tokens
already have K/V in the cache (`num_computed_tokens`), and its status. A Request groups the
`n` samples of one API request."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ferrum.outputs import Logprob, RequestMetrics
from ferrum.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in the scheduler."""

    WAITING = "waiting"      # not scheduled yet, or preempted (its cache was freed)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Sample `index` of `request`, id `seq_id`; token_ids holds prompt + output ids."""

    def __init__(self, seq_id: str, request: "Request", index: int, device: str = "cpu"):
        """device: where the sampler runs (a seeded sample's torch.Generator must live there)."""
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens: int | None = None   # prefix-cache hit at first scheduling
        self.output_state = None            # ferrum.engine.output_state.SequenceOutputState, set by the engine
        seed = request.params.seed
        self.generator = None if seed is None else torch.Generator(device).manual_seed(seed + index)
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.new_tokens = 0                 # generated since the last RequestOutput
        self.sampled_row = -1               # its row in the last launched step's samples

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids (a new list)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V is not in the cache yet (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Sample 0 of a request with `prompt_logprobs` whose prompt logprobs are not all
        computed: its prefill computes every prompt position (no prefix-cache hit, whose
        positions would have no logits; vLLM does the same)."""
        r = self.request
        return (r.prompt_logprobs is not None and self.index == 0
                and r.prompt_logprob_pos < self.num_prompt_tokens - 1)

    @property
    def arrival(self) -> float:
        """The request's arrival time (seconds, time.perf_counter): the FCFS order."""
        return self.request.metrics.arrival_time

    def is_finished(self) -> bool:
        """True once stopped or aborted."""
        return self.status == SequenceStatus.FINISHED


@dataclass
class Request:
    """One API request: its prompt, sampling parameters, metrics and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.perf_counter()))
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False                    # n > 1: children created after the first prefill
    error: str | None = None                # why a step running it failed (it is then finished)
    grammar: object | None = None           # structured outputs: a CompiledGrammar
    # the parent hash of its first KV block (`block_manager.salt_root` of vLLM's cache_salt):
    # requests share cached prefix blocks only under equal salts
    cache_root: bytes = b""
    # With params.prompt_logprobs: entry i is {token id: logprob} for prompt token i (None for
    # token 0, which has no context), filled as prefill chunks finish; prompt_logprob_pos is
    # the next prompt position whose logits are still to be computed.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprob_pos: int = 0

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def finished(self) -> bool:
        """True when all n samples exist and are finished, or when a step failed it."""
        if self.error is not None:
            return True
        if len(self.seqs) != self.params.n:
            return False
        for s in self.seqs:   # a loop, not all(genexpr): it runs for every request every step
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True
