"""What the engine returns: one RequestOutput per request per step (streaming) or at the end."""
from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """One entry of a logprobs dict: the logprob itself, a float (`lp + 1.0`, `math.exp(lp)`,
    comparisons, `lp == -0.25`, `json.dumps`, `repr` and pickling work as they did when the
    values were plain floats), carrying vLLM's `Logprob` fields:

    logprob: the value as a plain float.
    rank: 1-based rank of the token in the vocabulary by logprob (vLLM's definition). A top-N
        entry has its place in the top N (1 = most likely); the chosen token (sample logprobs)
        or prompt token (prompt logprobs) added after them, when not among them, has 1 + the
        number of other tokens whose logprob is >= its own (ties rank it last among equals, as
        vLLM counts). Computed on the device with the logprobs (one compare-and-sum per row).
    decoded_token: None: ferrum does not decode each entry's token (a tokenizer call per
        entry); `LLM.get_tokenizer().decode([token_id])` gives it.

    Unlike vLLM's dataclass, `==` and hashing compare the numbers only (rank is not part of
    them), so dicts of these compare equal to dicts of floats with the same values."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = float.__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        """The logprob as a plain float (vLLM's field)."""
        return float(self)


_float_new = float.__new__


def logprob_entry(top_ids: list[int], top_logprobs: list[float], token_id: int,
                  token_logprob: float, token_rank: int) -> dict[int, Logprob]:
    """{token id: Logprob} of one position: the top entries in the order given (descending,
    ranks 1, 2, ...), then `token_id` with `token_logprob` and `token_rank` unless it is among
    them. Builds the Logprobs without calling `Logprob.__new__` (a Python call per entry):
    the engine makes one per logprob it returns."""
    entry: dict[int, Logprob] = {}
    rank = 0
    for tid, v in zip(top_ids, top_logprobs):
        rank += 1
        lp = _float_new(Logprob, v)
        lp.rank = rank
        lp.decoded_token = None
        entry[tid] = lp
    if token_id not in entry:
        lp = _float_new(Logprob, token_logprob)
        lp.rank = token_rank
        lp.decoded_token = None
        entry[token_id] = lp
    return entry


@dataclass
class CompletionOutput:
    """One sample of a request. `text` and `token_ids` are cumulative; `finish_reason` is
    None while running, then "stop" (EOS, stop token, stop string or the end of a structured
    output's grammar), "length" (max_tokens or max_model_len), "tool_calls" (LLM.chat parsed
    tool calls) or "error" (a step holding this request failed; see `RequestOutput.error`).
    `logprobs[i]` maps token id -> Logprob (a float with vLLM's `.logprob`, `.rank`,
    `.decoded_token`) for generated token i (the top-N, then the chosen token if it is not
    among them), when requested; `cumulative_logprob` is the sum of the chosen tokens'
    logprobs then (a plain float), and None when logprobs were not requested."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
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
    None for the first (nothing precedes it, as in vLLM and OpenAI), else {token id: Logprob}
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
