"""The UTF-8 bytes of single tokens, read from how the vocabulary spells them.

A token may hold part of a character: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) spells
every byte as one printable character, and SentencePiece's byte fallback (Llama 2, Mistral)
has `<0xE4>`-style byte tokens. Decoding such a token alone gives U+FFFD, which cannot be told
apart from a genuine U+FFFD; its bytes can. The detokenizer uses them to know whether a
character is still incomplete, the logprobs formatter to report each token's `bytes`.
"""
from __future__ import annotations

import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (Radford et al. 2019, encoder.py): byte-level BPE
    vocabularies spell every byte as one printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def vocabulary_kind(hf) -> str | None:
    """How a transformers tokenizer spells bytes: "byte_level" (its decoder is ByteLevel
    alone: a decode is the UTF-8 decode of the tokens' bytes), "byte_level_sequence" (ByteLevel
    among other decoders), "byte_fallback" (it has a ByteFallback decoder), "text" (every token
    is whole characters), or None when unknown (a slow tokenizer without a tokenizers backend)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = backend.decoder
    spec = decoder.__getstate__() if decoder is not None else b""
    if spec.startswith(b'{"type":"ByteLevel"'):
        return "byte_level"
    if b'"ByteLevel"' in spec:   # ByteLevel inside a sequence of decoders
        return "byte_level_sequence"
    if b'"ByteFallback"' in spec:
        return "byte_fallback"
    return "text"


class TokenBytes:
    """`piece_bytes(token_id) -> bytes`: the UTF-8 bytes a token stands for (cached per id).

    hf: a transformers tokenizer (anything with convert_ids_to_tokens and decode).
    kind: see `vocabulary_kind`. `may_split_characters` is False when every token holds
    whole characters, None when that is unknown. `special_ids`: ids that
    `skip_special_tokens` drops (added tokens marked special). `decodes_as_bytes`: a decode
    of any ids is exactly the UTF-8 decode (errors replaced) of their bytes, special tokens
    dropped when skipped (byte-level BPE without clean-up of tokenization spaces).
    """

    def __init__(self, hf):
        self.hf = hf
        self.kind = vocabulary_kind(hf)
        self.may_split_characters = None if self.kind is None else self.kind != "text"
        decoder = getattr(hf, "added_tokens_decoder", {}) or {}
        self.special_ids = frozenset(i for i, t in decoder.items() if getattr(t, "special", False))
        self._cache: dict[int, bytes] = {}
        self.decodes_as_bytes = (self.kind == "byte_level"
                                 and not getattr(hf, "clean_up_tokenization_spaces", False))

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for: from its vocabulary piece for byte-level and
        byte-fallback vocabularies (a piece may hold part of a character), else the UTF-8 of
        its decoded text (special tokens as their text)."""
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(token_id)
        return b

    def _bytes(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens([token_id])[0] or ""
        if self.kind in ("byte_level", "byte_level_sequence") and token_id not in self.special_ids:
            dec = byte_decoder()
            if all(ch in dec for ch in piece):
                return bytes(dec[ch] for ch in piece)
        elif self.kind == "byte_fallback":
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            if token_id not in self.special_ids:
                return piece.replace("\u2581", " ").encode("utf-8")
        return self.hf.decode([token_id], skip_special_tokens=False).encode("utf-8")
