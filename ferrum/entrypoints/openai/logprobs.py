"""Token text, token bytes and the two OpenAI logprobs formats.

The engine gives, per generated token, a dict token id -> logprob holding the top-N tokens and
the chosen one (ferrum.layers.sampler). Completions want
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (legacy API); chat wants
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
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


def _finite(v: float | None) -> float | None:
    """JSON has no -inf (a masked token's logprob): report -9999.0 instead, as vLLM does."""
    return None if v is None else max(v, -9999.0)


class TokenFormatter:
    """Text and UTF-8 bytes of single tokens, cached per id. Without a tokenizer a token is
    shown as `token_id:<id>`. Token bytes come from the byte-level BPE alphabet when the
    vocabulary uses it (so a token holding half of a multi-byte character has its true
    bytes), else from decoding the token alone."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self.byte_level = False
        if tokenizer is not None:
            pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" the the", add_special_tokens=False))
            self.byte_level = any(p and p.startswith("Ġ") for p in pieces)

    def text(self, tid: int) -> str:
        t = self._text.get(tid)
        if t is None:
            t = (f"token_id:{tid}" if self.tok is None
                 else self.tok.decode([tid], skip_special_tokens=False))
            self._text[tid] = t
        return t

    def bytes(self, tid: int) -> list[int]:
        b = self._bytes.get(tid)
        if b is None:
            b = None
            if self.byte_level:
                piece = self.tok.convert_ids_to_tokens([tid])[0] or ""
                dec = _byte_decoder()
                if piece and all(ch in dec for ch in piece):
                    b = [dec[ch] for ch in piece]
            if b is None:
                b = list(self.text(tid).encode("utf-8"))
            self._bytes[tid] = b
        return b


def completion_logprobs(fmt: TokenFormatter, token_ids: list[int], logprobs: list[dict[int, float]],
                        text_offset: int = 0) -> dict:
    """Legacy completions format for generated tokens `token_ids` (one logprob dict each).
    text_offset: character offset of the first token in the choice's text (prompt length with
    echo, text already streamed otherwise)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for tid, lp in zip(token_ids, logprobs):
        text = fmt.text(tid)
        tokens.append(text)
        token_lps.append(_finite(lp.get(tid)))
        tops.append({fmt.text(k): _finite(v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])})
        offsets.append(off)
        off += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(fmt: TokenFormatter, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_n: int) -> dict:
    """Chat format: one entry per generated token, with its `top_n` best alternatives."""
    content = []
    for tid, lp in zip(token_ids, logprobs):
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": fmt.text(tid), "logprob": _finite(lp.get(tid)), "bytes": fmt.bytes(tid),
            "top_logprobs": [{"token": fmt.text(k), "logprob": _finite(v), "bytes": fmt.bytes(k)}
                             for k, v in best]})
    return {"content": content}
