"""Token text, token bytes and the two OpenAI logprobs formats.

The engine gives, per generated token, a dict token id -> logprob holding the top-N tokens and
the chosen one (ferrum.layers.sampler), and the text each token added to the answer
(`CompletionOutput.token_text_ends`). Completions want
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (legacy API); chat wants
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
vLLM's `prompt_logprobs` are the engine's prompt logprobs in vLLM's JSON form: per prompt token
(null for the first) `{"<token id>": {"logprob", "rank", "decoded_token"}}`.

A chosen token is shown as the text it added, so the tokens join to exactly the returned text:
a stop or EOS token (not in the text) is "", a token cut by a stop string keeps what is left,
and of the tokens sharing one character the last carries it. Alternatives are shown as their
own decoded text. With vLLM's `return_tokens_as_token_ids` every token is `token_id:<id>`
instead, which also keeps apart tokens whose texts are equal.
"""
from __future__ import annotations

from ferrum.tokenizer.detokenizer import IncrementalDetokenizer, token_bytes_of


def _finite(v: float | None) -> float | None:
    """JSON has no -inf (a masked token's logprob): report -9999.0 instead, as vLLM does. A
    plain float: the engine's values are `ferrum.outputs.Logprob`s, which the response only
    needs the number of."""
    return None if v is None else max(float(v), -9999.0)


def token_texts(text: str, ends: list[int] | None, start: int, stop: int) -> list[str] | None:
    """Texts added by tokens start..stop-1 (CompletionOutput.token_text_ends); None without
    ends (a model without tokenizer)."""
    if ends is None:
        return None
    return [text[ends[i - 1] if i else 0:ends[i]] for i in range(start, stop)]


def ready_tokens(ends: list[int] | None, start: int, num_tokens: int, streamed: int,
                 finished: bool) -> int:
    """Streaming: how many tokens' logprobs can go out, counting from 0: those whose text lies
    in the `streamed` characters already sent (text after them may still be cut by a stop
    string), or all once finished."""
    if finished or ends is None:
        return num_tokens
    n = start
    while n < num_tokens and ends[n] <= streamed:
        n += 1
    return n


class TokenFormatter:
    """Text and UTF-8 bytes of single tokens, cached per id. Without a tokenizer a token is
    shown as `token_id:<id>`. Bytes come from the vocabulary's spelling (byte-level BPE,
    byte fallback: ferrum.tokenizer.token_bytes), so a token holding part of a character has
    its true bytes."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes = token_bytes_of(tokenizer) if tokenizer is not None else None

    def text(self, tid: int) -> str:
        """The token decoded alone, special tokens included (`token_id:<id>` without a
        tokenizer)."""
        t = self._text.get(tid)
        if t is None:
            t = (f"token_id:{tid}" if self.tok is None
                 else self.tok.decode([tid], skip_special_tokens=False))
            self._text[tid] = t
        return t

    def bytes(self, tid: int) -> list[int]:
        """The token's UTF-8 bytes (see TokenBytes.piece_bytes)."""
        if self._bytes is None:
            return list(self.text(tid).encode("utf-8"))
        return list(self._bytes.piece_bytes(tid))

    def chosen_bytes(self, tid: int, added: str) -> list[int]:
        """Bytes of a chosen token that added `added` to the text: its own bytes when it added
        its own text, else the bytes of what it added (so the bytes join to the text too)."""
        return self.bytes(tid) if added == self.text(tid) else list(added.encode("utf-8"))


def _name(fmt: TokenFormatter, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else fmt.text(tid)


def completion_logprobs(fmt: TokenFormatter, token_ids: list[int], logprobs: list[dict[int, float]],
                        texts: list[str] | None, text_offset: int = 0,
                        as_ids: bool = False) -> dict:
    """Legacy completions format for tokens `token_ids` (one logprob dict each; None for the
    first prompt token with echo, which has no logprob: its entries are null, as OpenAI's).
    texts: what each token added to the choice's text (`token_texts`; None: its own text).
    text_offset: character offset of the first token in the choice's text (0 for echoed prompt
    tokens, prompt length with echo, text already streamed otherwise). as_ids:
    return_tokens_as_token_ids.

    `top_logprobs[i]` is keyed by token text, best first. Equal texts (byte tokens that decode
    to U+FFFD) collide: the chosen token's key always carries its own logprob, and otherwise
    the higher-ranked token keeps the key."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        added = texts[i] if texts is not None else fmt.text(tid)   # what it added to the text
        text = _name(fmt, tid, True) if as_ids else added
        tokens.append(text)
        offsets.append(off)
        off += len(added)   # offsets index the choice's text, whatever the tokens are named
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(lp.get(tid)))
        top: dict[str, float | None] = {}
        for k, v in sorted(lp.items(), key=lambda kv: -kv[1]):
            key = text if k == tid else _name(fmt, k, as_ids)
            if key in top or (key == text and k != tid):
                continue
            top[key] = _finite(v)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def top_n(entries: list[dict | None], token_ids: list[int], n: int) -> list[dict | None]:
    """Each position's logprobs dict cut to its top `n` (ranks 1..n) and its own token: prompt
    logprobs computed for a larger N (echo's `logprobs` and `prompt_logprobs` share one engine
    request, which takes the larger) as they would be for N = n."""
    return [None if lp is None else {k: v for k, v in lp.items() if k == tid or v.rank <= n}
            for tid, lp in zip(token_ids, entries)]


def prompt_logprobs_json(fmt: TokenFormatter, token_ids: list[int], entries: list[dict | None],
                         n: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` for a prompt: per token null (the first) or {str(token id):
    {"logprob", "rank", "decoded_token"}} of the top `n` and the prompt token itself (rank: its
    place in the vocabulary, 1 = most likely; decoded_token: the token decoded alone, null
    without a tokenizer)."""
    def one(k, v):
        return {"logprob": _finite(v), "rank": v.rank,
                "decoded_token": fmt.text(k) if fmt.tok is not None else None}
    return [None if lp is None else {str(k): one(k, v) for k, v in lp.items()}
            for lp in top_n(entries, token_ids, n)]


def prompt_token_texts(tokenizer, token_ids: list[int]) -> list[str] | None:
    """What each prompt token adds to the prompt's decoded text (special tokens kept), so echoed
    prompt tokens join to the echoed text like generated ones do; None without a tokenizer."""
    if tokenizer is None:
        return None
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    texts = [detok.add(t) for t in token_ids]
    if texts:
        texts[-1] += detok.flush()
    return texts


def chat_logprobs(fmt: TokenFormatter, token_ids: list[int], logprobs: list[dict[int, float]],
                  texts: list[str] | None, top_n: int, as_ids: bool = False) -> dict:
    """Chat format: one entry per generated token, with its `top_n` best alternatives.
    texts / as_ids as in completion_logprobs; `bytes` of the chosen tokens join to the text."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        added = texts[i] if texts is not None else fmt.text(tid)
        name = _name(fmt, tid, True) if as_ids else added
        chosen_bytes = fmt.chosen_bytes(tid, added)
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": name, "logprob": _finite(lp.get(tid)), "bytes": chosen_bytes,
            "top_logprobs": [{"token": name if k == tid else _name(fmt, k, as_ids),
                              "logprob": _finite(v),
                              "bytes": chosen_bytes if k == tid else fmt.bytes(k)}
                             for k, v in best]})
    return {"content": content}
