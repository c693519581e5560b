"""What the engine returns: one RequestOutput per request per step (streaming) or at the end."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request. `text` and `token_ids` are cumulative; `finish_reason` is
    None while running, then "stop" (EOS, stop token, stop string or the end of a structured
    output's grammar), "length" (max_tokens or max_model_len), "tool_calls" (LLM.chat parsed
    tool calls) or "error" (a step holding this request failed; see `RequestOutput.error`).
    `logprobs[i]` maps token id -> logprob for generated token i (the chosen token plus the
    top-N), when requested; `cumulative_logprob` is the sum of the chosen tokens' logprobs
    then, and None when logprobs were not requested."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""          # text safe to stream that was not in earlier outputs
    num_delta_tokens: int = 0     # tokens generated since the previous output of this request
    # with logprobs: token i's text is text[ends[i-1]:ends[i]] (ends[-1] = 0); they join to `text`
    token_text_ends: list[int] | None = None
    # LLM.chat with tools: the calls parsed from the output (OpenAI's message.tool_calls form);
    # `text` is then the message content without them
    tool_calls: list[dict] | None = None

    @property
    def finished(self) -> bool:
        """True once the sample has a finish_reason."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times in seconds (time.perf_counter) for TTFT / TPOT / e2e latency."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt, one CompletionOutput per sample, whether
    all samples finished, timing metrics, how many prompt tokens came from the prefix cache
    (num_cached_tokens, a multiple of the block size), and `error`: None unless a step that
    ran this request failed; then it says why, the request is finished (its unfinished samples
    have finish_reason "error", their KV blocks are freed) and the engine serves the others.
    prompt_logprobs (with `SamplingParams.prompt_logprobs` = N): one entry per prompt token,
    None for the first (nothing precedes it, as in vLLM and OpenAI), else {token id: logprob}
    with the top-N tokens in descending order followed by the prompt token itself if it is not
    among them; complete in every output (a request produces none before its prefill ends)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
