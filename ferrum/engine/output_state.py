"""Per-sequence output state: token ids, streamed text and the stop decision.

`SequenceOutputState.append(token_id)` runs after every sampled token of one sequence and
decides whether it finishes, following vLLM's rules:

- no stop of any kind (EOS, stop token, stop string) while fewer than `min_tokens` tokens
  have been generated (the sampler also masks EOS / stop token ids during that time);
- EOS (any of the model's EOS ids, unless `ignore_eos`) -> finish_reason "stop",
  stop_reason None; a `stop_token_ids` token -> "stop", stop_reason = that id. In both cases the
  token stays in `token_ids` (as in vLLM) but is not detokenized, so it never appears in `text`;
- a stop string, matched in the detokenized text also when it spans token boundaries ->
  "stop", stop_reason = the string; `text` is cut before it (or after it with
  `include_stop_str_in_output`), and nothing after it is kept;
- `max_tokens` output tokens, or prompt + output reaching `max_model_len` -> "length".
  A stop on the same token wins over "length".

Streaming: `stream_delta()` hands out only text that can no longer change. While the text ends
with something that could be the start of a stop string (a proper prefix of one), that suffix
is held back; it is released once it is known not to be a stop, and a matched stop string
never reaches the stream (unless include_stop_str_in_output). Multi-byte characters split over
tokens are held back by the detokenizer until complete.
"""
from __future__ import annotations

from ferrum.sampling_params import SamplingParams
from ferrum.tokenizer.detokenizer import IncrementalDetokenizer


class SequenceOutputState:
    """Output of one sequence (one of the n samples of a request).

    params: the request's SamplingParams.
    tokenizer: passed to IncrementalDetokenizer (`decode(ids, skip_special_tokens)`); may be None
        when the caller wants token ids only: then `text` stays "" and stop strings are refused
        (ValueError).
    prompt_ids: the prompt token ids (their count enters the max_model_len check; the last few
        give the detokenizer context).
    eos_token_ids: the model's EOS ids (generation_config / tokenizer).
    max_model_len: context length in tokens (prompt + output).

    Attributes: token_ids (all generated ids, including a final EOS / stop token), text,
    text_ends (see token_text_ends),
    finish_reason ("stop" | "length" | "error" | None), stop_reason (str | int | None), finished.
    Calling `append` on a finished sequence raises RuntimeError.
    """

    def __init__(self, params: SamplingParams, tokenizer, prompt_ids: list[int],
                 eos_token_ids: list[int], max_model_len: int):
        if tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer to detokenize the output")
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_model_len = max_model_len
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.token_ids: list[int] = []
        self.text = ""
        self.text_ends: list[int] = []   # len(text) after each token (see token_text_ends)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._streamed = 0  # chars of `text` already handed out by stream_delta()

    @property
    def finished(self) -> bool:
        """True once a finish_reason is set."""
        return self.finish_reason is not None

    def append(self, token_id: int) -> None:
        """Record one generated token, extend `text`, and set finish_reason if it stops."""
        if self.finished:
            raise RuntimeError(f"append() after the sequence finished ({self.finish_reason})")
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self._check(token_id)
        self.text_ends.append(len(self.text))

    def _check(self, token_id: int) -> None:
        may_stop = len(self.token_ids) >= self.params.min_tokens
        if may_stop and token_id in self.eos_token_ids and not self.params.ignore_eos:
            self._finish("stop", None)
            return
        if may_stop and token_id in self.stop_token_ids:
            self._finish("stop", token_id)
            return

        if self.detok is not None:
            old_len = len(self.text)
            self.text += self.detok.add(token_id)
            if may_stop and self.params.stop and self._match_stop_string(old_len):
                return
        if self.params.max_tokens is not None and len(self.token_ids) >= self.params.max_tokens:
            self._finish("length", None)
        elif self.prompt_len + len(self.token_ids) >= self.max_model_len:
            self._finish("length", None)

    def token_text_ends(self) -> list[int] | None:
        """Per generated token, the end offset in `text` of the text it added: token i's text
        is `text[ends[i-1]:ends[i]]` (ends[-1] = 0), so the tokens' texts join to exactly
        `text`. A stop or EOS token adds "", and so does a token holding the first bytes of a
        character (the token completing it adds the character); a stop string's cut clips the
        tokens before it. None without a tokenizer (no text)."""
        if self.detok is None:
            return None
        n = len(self.text)
        return [min(e, n) for e in self.text_ends]

    def _match_stop_string(self, old_len: int) -> bool:
        """Find the earliest stop string that ends in the text added by the last token (it may
        start up to len(stop) - 1 chars before it, across the token boundary). Requiring the
        match to end in the new text skips stops already passed while min_tokens held them."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[:idx + len(stop) if self.params.include_stop_str_in_output else idx]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def finish(self, reason: str) -> None:
        """End the sequence from outside the stop rules (e.g. its grammar is complete)."""
        if not self.finished:
            self._finish(reason, None)

    def _finish(self, reason: str, stop_reason: int | None) -> None:
        # The detokenizer's held-back text (less a character still incomplete at the end)
        # comes out now, and may hold or complete a stop string; after a stop string nothing
        # more is added.
        if self.detok is not None:
            old_len = len(self.text)
            self.text += self.detok.flush()
            if (self.params.stop and len(self.token_ids) >= self.params.min_tokens
                    and self._match_stop_string(old_len)):
                return
        self.finish_reason, self.stop_reason = reason, stop_reason

    def fail(self) -> None:
        """End the sequence with finish_reason "error" (a step running it failed). The text
        stays what was generated so far."""
        if not self.finished:
            self.finish_reason, self.stop_reason = "error", None

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string.
        A suffix of length n is one only if the stop's n-th character is the text's last, so
        only those n are tried (str.rfind, longest first): slicing and comparing every tail
        length cost O(len(stop)^2) per token (a 100,000-character stop slowed each step to
        tens of ms once the text grew)."""
        text, best = self.text, 0
        if not text:
            return 0
        last = text[-1]
        for stop in self.params.stop:
            k = stop.rfind(last, 0, min(len(stop) - 1, len(text)))   # a suffix of k + 1 chars
            while k >= best:
                if text[-k - 1] == stop[0] and text.endswith(stop[:k + 1]):
                    best = k + 1
                    break
                k = stop.rfind(last, 0, k)
        return best

    def stream_delta(self) -> str:
        """Text that is safe to send now and was not returned before; "" if none. Deltas
        concatenate to the final `text`."""
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        if end <= self._streamed:
            return ""
        delta = self.text[self._streamed:end]
        self._streamed = end
        return delta
