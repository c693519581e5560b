"""SamplingParams: per-request generation options, validated on construction.

Semantics follow the OpenAI API and vLLM: temperature 0 (below 1e-5) means greedy; top_k=-1
(or 0) means no top-k; top_p in (0, 1]; min_p in [0, 1]; repetition_penalty > 0 (1 = off,
divides positive logits / multiplies negative ones of already-seen tokens, as in CTRL, Keskar
et al. 2019); presence/frequency penalties in [-2, 2] subtract from logits of generated tokens
(OpenAI). `allowed_token_ids` and `bad_words` follow vLLM: the first restricts sampling to those
ids; each bad word's last token is banned where the output ends with the word's other tokens.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from ferrum.errors import InvalidRequestError
from ferrum.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (as in vLLM): dividing logits by a near-zero
# temperature overflows float32 to inf and the softmax becomes nan.
_GREEDY_EPS = 1e-5

# Most top logprobs per token a request may ask for (generated and prompt tokens alike).
MAX_LOGPROBS = 20

# Most samples (`n`) of one prompt: vLLM's default VLLM_MAX_N_SEQUENCES. Every sample is a
# sequence the scheduler keeps and walks, so an unbounded n (10**6) held the engine for minutes.
MAX_N = 16384


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_logit_bias(bias: dict) -> dict[int, float]:
    """`{token id: bias}` with int keys and float values. Keys may be ints or decimal strings
    (JSON object keys are strings); values must be finite numbers in [-100, 100] (OpenAI).
    Raises one InvalidRequestError (param "logit_bias") that names every bad key and every bad
    value, so a client fixes its request in one round trip."""
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must be an object of token id -> bias, got "
                                  f"{type(bias).__name__}", param="logit_bias")
    # a digit string longer than int() converts (4,300 digits) is no token id either: it was a 500
    bad_keys = [k for k in bias if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
                and not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 4300)]
    bad_values = [(k, v) for k, v in bias.items()
                  if not _is_number(v) or not math.isfinite(v) or not -100 <= v <= 100]
    problems = []
    if bad_keys:
        problems.append(f"keys must be token ids >= 0, got {', '.join(repr(k) for k in bad_keys)}")
    if bad_values:
        problems.append("values must be numbers in [-100, 100], got "
                        + ", ".join(f"{v!r} for token {k!r}" for k, v in bad_values))
    if problems:
        raise InvalidRequestError(f"logit_bias {'; '.join(problems)}", param="logit_bias")
    return {int(k): float(v) for k, v in bias.items()}


@dataclass
class SamplingParams:
    """Per-request generation options (module docstring for the semantics). Raises
    InvalidRequestError naming the parameter when a value is out of range."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None          # top-N logprobs per generated token (0 = chosen only)
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token (0 = that token only)
    skip_special_tokens: bool = True
    # vLLM's: sample only among these token ids (a non-empty list; None: the whole vocabulary)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output must not contain. The engine tokenizes each as it reads at the
    # start of a text and after a space (bad_words_token_ids); the sampler bans a word's last
    # token wherever the output ends with its other tokens (a one-token word: always)
    bad_words: list[str] | None = None
    # -- structured outputs (ferrum.structured_output): the output must match a JSON schema,
    # JSON object, regex, choice or grammar; a dict is read as StructuredOutputsParams (vLLM's
    # `structured_outputs`). The sampler masks every token the grammar does not allow, and the
    # sequence stops ("stop") where the grammar is complete.
    structured_outputs: StructuredOutputsParams | dict | None = None
    # bad_words as token id sequences, set by the engine from its tokenizer when the request is
    # added (`ferrum.tokenizer.Tokenizer.bad_words_token_ids`)
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):   # list() of a number: no TypeError
            v = getattr(self, name)
            if not (v is None or isinstance(v, (list, tuple)) or (name == "stop" and isinstance(v, str))):
                raise InvalidRequestError(f"{name} must be a list{' or a string' if name == 'stop' else ''}"
                                          f", got {type(v).__name__}", param=name)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.top_k == 0:
            self.top_k = -1
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str):
            raise InvalidRequestError(f"{param} {msg}", param=param)

        # types first, as the server's strict fields: True is not 1, "0" is not 0, 1.5 not a
        # count; the range checks below then see Python floats and ints
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
            setattr(self, name, float(v))    # numpy scalars too
        for name in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is None and name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
                continue   # None: unlimited / unseeded / none
            if not _is_integer(v):
                bad(name, f"must be an integer, got {v!r}")
            setattr(self, name, int(v))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        # sample i of a request draws from torch.Generator().manual_seed(seed + i), which takes
        # [-2**63, 2**64 - 1]
        if self.seed is not None and not -2**63 <= self.seed <= 2**64 - self.n:
            bad("seed", f"must be an integer in [-2**63, 2**64 - n], got {self.seed!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop", "must be non-empty strings")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                bad("stop", f"{s!r} holds a lone surrogate: stop strings must be valid Unicode")
        if any(not _is_integer(t) or t < 0 for t in self.stop_token_ids):   # True is no id
            bad("stop_token_ids", f"must be token ids >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty: give at least one token id")
            if any(not _is_integer(t) or t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids", f"must be token ids >= 0, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                bad("bad_words", f"must be strings with a non-space character, got {self.bad_words!r}")
        if self.logit_bias:
            self.logit_bias = _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """True when temperature is below 1e-5: argmax sampling."""
        return self.temperature < _GREEDY_EPS
