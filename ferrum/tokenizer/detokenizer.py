"""Incremental (streaming) detokenization that never emits a broken UTF-8 character.

Decoding tokens one at a time is wrong in two ways: byte-level BPE splits a multi-byte
character (emoji, CJK) over several tokens, so a lone token decodes to U+FFFD; and
SentencePiece-style decoders drop or add a leading space depending on what precedes a token.

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2), whose decode is the UTF-8 decode of the tokens'
bytes (`TokenBytes.decodes_as_bytes`): each token's bytes go through an incremental UTF-8
decoder, which returns every completed character at once and keeps at most 3 bytes of an
incomplete one. O(1) per token, exact.

Other tokenizers: the windowed decode of HF text-generation-inference and vLLM
(`detokenize_incrementally`): keep a few emitted tokens as context,

    ids = context (emitted) + pending (not emitted yet)

decode `ids` and emit what it adds beyond the text of the context; wait while a character is
incomplete. Whether it is incomplete is read from the tokens' bytes (SentencePiece byte
fallback `<0xE4>`; tokens of whole characters never leave one). TGI, vLLM and tokenizers'
`DecodeStream` instead wait while the text ends in U+FFFD, so a genuine U+FFFD (the
replacement-character token forced by logit_bias, say) stalls the stream and grows the window
with every token; that rule remains only for tokenizers without byte information, bounded to
`_MAX_PENDING` tokens. At each emission the emitted tokens become the context, so each step
decodes a window of at most 2 * `_MAX_PENDING` tokens: the cost per token stays constant.
"""
from __future__ import annotations

import codecs
from typing import Protocol

from ferrum.tokenizer.token_bytes import TokenBytes

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first output token (vLLM uses 5).
_CONTEXT = 5
# A UTF-8 character has at most 4 bytes, so at most 3 of them wait for the rest, in at most 3
# tokens: more pending tokens (or skipped special tokens in between) never complete one.
_MAX_PENDING = 4


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def token_bytes_of(tokenizer) -> TokenBytes | None:
    """The TokenBytes of ferrum's Tokenizer (kept on it), or one built for another tokenizer
    that is, or exposes as `.hf`, a transformers tokenizer; None otherwise."""
    tb = getattr(tokenizer, "token_bytes", None)
    if isinstance(tb, TokenBytes):
        return tb
    hf = getattr(tokenizer, "hf", tokenizer)
    return TokenBytes(hf) if hasattr(hf, "convert_ids_to_tokens") else None


class IncrementalDetokenizer:
    """Streams the text of generated tokens.

    tokenizer: anything with `decode(ids: list[int], skip_special_tokens: bool) -> str`, e.g.
        ferrum's Tokenizer; its token bytes come from `token_bytes_of(tokenizer)`.
    prompt_ids: the prompt's token ids; its last few tokens give the first output token its
        context (leading-space rules), they never appear in `text`.
    skip_special_tokens: as in every decode (SamplingParams.skip_special_tokens).

    `add(token_id) -> str` returns the text newly completed by that token ("" while a character
    is incomplete or the token decodes to nothing); `text` is everything emitted so far. At the
    end of a sequence `flush()` returns the held-back remainder without the bytes of a
    character the sequence stopped in the middle of (cut by max_tokens, say): the text ends
    with the last whole character, not U+FFFD.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._bytes = token_bytes_of(tokenizer)
        kind_known = self._bytes is not None and self._bytes.may_split_characters is not None
        self._direct = kind_known and self._bytes.decodes_as_bytes
        self._track_bytes = kind_known and self._bytes.may_split_characters
        if not kind_known:
            self._bytes = None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = [] if self._direct else list(prompt_ids[-_CONTEXT:])
        self._num_context = len(self._ids)      # context + pending = _ids
        self._context_text: str | None = None   # decode(context), cached
        self.text = ""
        # A token-id prompt may end inside a character: its leading bytes wait in the UTF-8
        # decoder (or, windowed, their tokens wait as pending), so the output's first character
        # comes out whole; if the output never completes it, those bytes are dropped.
        self._prompt_partial = 0
        if self._bytes is not None and (self._direct or self._track_bytes):
            for token_id in prompt_ids[-_CONTEXT:]:
                self._feed(token_id)
            self._prompt_partial = len(self._utf8.getstate()[0])
            if not self._prompt_partial:
                self._utf8.reset()
            elif not self._direct:
                left = self._prompt_partial   # move the partial character's tokens to pending
                while left > 0 and self._num_context > 0:
                    self._num_context -= 1
                    token_id = self._ids[self._num_context]
                    if not (skip_special_tokens and token_id in self._bytes.special_ids):
                        left -= len(self._bytes.piece_bytes(token_id))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _feed(self, token_id: int) -> str:
        """The token's bytes through the UTF-8 decoder: the characters they complete."""
        if self.skip_special_tokens and token_id in self._bytes.special_ids:
            return ""
        return self._utf8.decode(self._bytes.piece_bytes(token_id))

    def _char_pending(self) -> bool:
        return bool(self._utf8.getstate()[0])

    def add(self, token_id: int) -> str:
        """Append one generated token id; return the newly completed text (may be "")."""
        token_id = int(token_id)
        if self._direct:
            delta = self._drop_orphan_prompt_bytes(self._feed(token_id))
            self.text += delta
            return delta
        if self._bytes is not None and self.skip_special_tokens and token_id in self._bytes.special_ids:
            return ""   # a decode drops it before anything else: leave it out of the window
        self._ids.append(token_id)
        num_pending = len(self._ids) - self._num_context
        if self._bytes is not None:
            if self._track_bytes:
                self._feed(token_id)
                if self._char_pending() and num_pending < _MAX_PENDING:
                    return ""
            window_text = self._decode(self._ids)
        else:
            window_text = self._decode(self._ids)
            if window_text.endswith(_REPLACEMENT) and num_pending < _MAX_PENDING:
                return ""   # perhaps an incomplete character: wait (bounded)
        return self._emit(window_text)

    def _drop_orphan_prompt_bytes(self, delta: str) -> str:
        """The first text after a prompt that ended inside a character: when the output did
        not complete that character, its bytes decoded to U+FFFD (one, or one per byte for
        byte-fallback decoders), which belong to the prompt, not the output."""
        if self._prompt_partial and delta:
            if delta.startswith(_REPLACEMENT):
                n = 1 if self._direct else self._prompt_partial
                delta = delta[:n].lstrip(_REPLACEMENT) + delta[n:]
            self._prompt_partial = 0
        return delta

    def _emit(self, window_text: str) -> str:
        if self._context_text is None:
            self._context_text = self._decode(self._ids[:self._num_context])
        delta = self._drop_orphan_prompt_bytes(window_text[len(self._context_text):])
        # The tokens just emitted (at most _MAX_PENDING) are the next ones' context: they start
        # at a character boundary (ByteFallback decodes a run of byte tokens all or nothing).
        self._ids = self._ids[self._num_context:]
        self._num_context = len(self._ids)
        self._context_text = None
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (call once the sequence has finished), less the bytes of
        an incomplete last character."""
        pending = self._utf8.getstate()[0]
        self._utf8.reset()
        if self._direct or self._num_context == len(self._ids):
            return ""
        if pending:   # decode without the tokens that carry the incomplete character's bytes
            end, left = len(self._ids), len(pending)
            while left > 0 and end > self._num_context:
                end -= 1
                tid = self._ids[end]
                if not (self.skip_special_tokens and tid in self._bytes.special_ids):
                    left -= len(self._bytes.piece_bytes(tid))
            if left == 0:
                return self._emit(self._decode(self._ids[:end]))
        window_text = self._decode(self._ids)
        if (pending or self._bytes is None) and window_text.endswith(_REPLACEMENT):
            # a token also carrying whole characters, or no byte information: drop the U+FFFD
            # that an incomplete sequence decodes to (one, its maximal subpart)
            window_text = window_text[:-1]
        return self._emit(window_text)
