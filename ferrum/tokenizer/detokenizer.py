"""Incremental (streaming) detokenization that never emits a broken UTF-8 character.

Decoding tokens one at a time is wrong in two ways: byte-level BPE splits a multi-byte
character (emoji, CJK) over several tokens, so a lone token decodes to U+FFFD; and
SentencePiece-style decoders drop or add a leading space depending on what precedes a token.
The fix used by HF text-generation-inference and vLLM (`detokenize_incrementally`): keep two
offsets into the token ids,

    prefix_offset .. read_offset   tokens whose text was already emitted (context only)
    read_offset   .. end           tokens not yet emitted

decode the window `ids[prefix_offset:]`, and emit what it adds beyond the text of
`ids[prefix_offset:read_offset]`. When the window's text ends in U+FFFD, a character is still
incomplete and nothing is emitted until a later token completes it. Each step decodes a window
of a few tokens, so the cost per token does not grow with the sequence length.
"""
from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first output token (vLLM uses 5).
_INITIAL_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of generated tokens.

    tokenizer: anything with `decode(ids: list[int], skip_special_tokens: bool) -> str`, e.g.
        ferrum's Tokenizer or a transformers tokenizer.
    prompt_ids: the prompt's token ids; its last few tokens give the first output token its
        context (leading-space rules), they never appear in `text`.
    skip_special_tokens: passed to every decode (SamplingParams.skip_special_tokens).

    `add(token_id) -> str` returns the text newly completed by that token ("" while a character
    is incomplete or the token decodes to nothing); `text` is everything emitted so far. At the
    end of a sequence `flush()` returns any held-back remainder (an incomplete character comes
    out as U+FFFD, exactly as a one-shot decode of all output ids would show it).
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the context window of the prompt is kept; older ids are never decoded again.
        self._ids: list[int] = list(prompt_ids[-_INITIAL_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None   # decode(ids[prefix:read]), cached
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token id; return the newly completed text (may be "")."""
        self._ids.append(int(token_id))
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or a multi-byte character still incomplete: wait
        delta = window_text[len(self._prefix_text):]
        # Drop ids that are no longer needed as context so the list stays short.
        self._ids = self._ids[self._read_offset:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (call once the sequence has finished)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        delta = window_text[len(prefix_text):]
        self._ids = self._ids[self._read_offset:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        self.text += delta
        return delta
