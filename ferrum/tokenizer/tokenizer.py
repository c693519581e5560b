"""Tokenizer: a thin wrapper over a Hugging Face fast tokenizer (transformers / tokenizers) plus
the model's chat template (Jinja, rendered by transformers' `apply_chat_template`).

Built from a HF folder (tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json), or by the GGUF loader (ferrum/loader/gguf.py) from the fast tokenizer
transformers converts out of a GGUF's `tokenizer.ggml.*` metadata.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterable

from ferrum.errors import ConfigError, InvalidRequestError
from ferrum.tokenizer.token_bytes import TokenBytes

# A value with any of these is Jinja text, never a file name (vLLM's rule for --chat-template).
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The chat template given as `--chat-template` / `LLM(chat_template=...)`: a path to a
    Jinja file, or the template text itself (as vLLM accepts).

    An existing file is read (UTF-8); a value holding `{`, `}` or a newline is the template
    itself, taken verbatim; anything else looks like a path, and a missing one is an error
    rather than a one-line template. The template must compile in the Jinja environment that
    transformers renders it with. Raises ConfigError (param "chat_template")."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as fh:
                template = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"chat_template file {value!r} cannot be read: {e}",
                              param="chat_template") from e
    elif any(c in value for c in _JINJA_CHARS):
        template = value
    else:
        raise ConfigError(f"chat_template {value!r} looks like a file path, but there is no such "
                          "file; give the path of a Jinja file or the template text itself",
                          param="chat_template")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private helper: without it the template is checked when first used
        return template
    try:
        _compile_jinja_template(template)
    except Exception as e:  # jinja2.TemplateSyntaxError (with the line) and kin
        line = getattr(e, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ConfigError(f"chat_template does not compile{where}: {type(e).__name__}: {e}",
                          param="chat_template") from e
    return template


def _flatten_content(content: Any, index: int) -> str:
    """OpenAI message content: a string, or a list of {"type": "text", "text": ...} parts
    (joined with newlines, as vLLM does)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}})"
                    f" are supported, got {part!r}", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text "
                              f"parts, got {type(content).__name__}", param="messages")


# Unicode noncharacters U+FDD0..U+FDEF are reserved for a program's internal use and never
# carry meaning in text a client sends; the placeholders below are made of them.
_NONCHARS = re.compile("[\ufdd0-\ufdef]")
_TYPED, _TYPED_END = "\ufdd0", "\ufdd1"     # wraps the index of a special-token string typed in text
_MARKUP, _MARKUP_END = "\ufdd2", "\ufdd3"   # spells a template's own special token (stand-in)


# bad_words lists a Tokenizer keeps tokenized (Tokenizer.bad_words_token_ids)
BAD_WORDS_CACHE = 64


def check_unicode(text: str, param: str = "prompt") -> str:
    """`text` if it is valid Unicode; raises InvalidRequestError (HTTP 400, naming `param`, the
    request field the text came from) for a lone UTF-16 surrogate (U+D800..U+DFFF, which JSON's
    `\\ud800` escape can carry), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{param}: the text holds a lone surrogate U+{ord(text[e.start]):04X} at character "
            f"{e.start}: text must be valid Unicode (a surrogate pair's two halves together)",
            param=param) from None
    return text


def check_unicode_in(value: Any, param: str) -> None:
    """`check_unicode` for every string (keys too) inside a JSON-like value (dicts, lists,
    strings; other values are skipped) given as request field `param`: the error names the
    string's path, e.g. "messages[2].content[0].text"."""
    stack = [(value, param)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            check_unicode(v, where)
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str):
                    check_unicode(k, where)
                stack.append((item, f"{where}.{k}"))
        elif isinstance(v, (list, tuple)):
            stack.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(v))))


class TemplateTextEncoder:
    """Encodes a chat template's rendering so that only the template's own markup yields
    special tokens: a special-token string inside any string the template was given (message
    contents, text parts, tool calls and results, names, tool schemas) is encoded as ordinary
    text, as HF's `split_special_tokens=True` encodes it, merged with the text around it.

    hf: a transformers fast tokenizer. Special tokens are its added tokens marked `special`
    (`<|im_start|>`, `<|eot_id|>`, ...); non-special added tokens are vocabulary, parsed
    everywhere, as transformers does.

    1. `protect(value)`: a copy of a JSON-like value (dicts, lists, strings) in which every
       str, dict keys included, has each special-token string replaced by the placeholder
       U+FDD0 <index> U+FDD1. Keys are client text too: a tool's parameter names and the keys
       of a past call's arguments reach the rendering through `tojson` in templates with tool
       support (Qwen, Hermes, Llama 3.1); a key the template looks up ("role", "content",
       "function") holds no special-token string, so it stays as it is. Noncharacters
       U+FDD0..U+FDEF typed in the strings become U+FFFD first, so no client can type a
       placeholder.
    2. The template renders the protected values: every special-token string left in the
       rendering is markup.
    3. `encode(rendering)`: the markup's special tokens are spelled as stand-ins
       (U+FDD2 <index> U+FDD3), added as tokens with the same lstrip / rstrip / single_word /
       normalized flags to a private copy of the tokenizer that does not parse special tokens;
       the placeholders turn back into the typed text. One call of that copy encodes it all:
       it splits the text at the stand-ins exactly where the original splits at special
       tokens (same added-token rules, same offsets), and the stand-ins' ids map back to the
       special tokens' ids. With no special-token string typed anywhere, the ids equal a plain
       encode of the rendering.

    A special token that a template builds by joining a typed string with its own text
    (typed "<|im_" + template "end|>") is not caught; no known template emits a fragment.
    """

    def __init__(self, hf):
        self.hf = hf
        special = {t.content: (tid, t) for tid, t in hf.added_tokens_decoder.items()
                   if t.special and t.content}
        self.strings = sorted(special, key=len, reverse=True)   # longest match first
        self._index = {text: i for i, text in enumerate(self.strings)}
        self._ids = [special[text][0] for text in self.strings]
        self._flags = [special[text][1] for text in self.strings]
        alternatives = "|".join(map(re.escape, self.strings))
        self._special = re.compile(alternatives) if self.strings else None
        # one pass over a rendering: a typed placeholder, or a special token of the markup
        typed = f"{_TYPED}(\\d+){_TYPED_END}"
        self._rendered = re.compile(f"{typed}|({alternatives})" if self.strings else typed)
        self._copy = None   # (tokenizer copy, stand-in id -> special id), built on first use

    def protect(self, value):
        """A copy of `value` whose strings carry no special-token string (see the class)."""
        if isinstance(value, str):
            if _NONCHARS.search(value):
                value = _NONCHARS.sub("\ufffd", value)
            if self._special is None:
                return value
            return self._special.sub(lambda m: f"{_TYPED}{self._index[m.group()]}{_TYPED_END}", value)
        if isinstance(value, dict):
            return {self.protect(k) if isinstance(k, str) else k: self.protect(v)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect(v) for v in value]
        return value

    def encode(self, rendering: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a rendering of protected values; add_special_tokens adds BOS / EOS
        etc. as the tokenizer's own encode would (on top of the template's markup)."""
        check_unicode(rendering, "messages")
        if _TYPED not in rendering:   # nothing typed looked like a special token
            return self.hf.encode(rendering, add_special_tokens=add_special_tokens)
        if not hasattr(self.hf, "backend_tokenizer"):  # a slow (Python) tokenizer
            ids = self._encode_pieces(rendering)
            return self.hf.build_inputs_with_special_tokens(ids) if add_special_tokens else ids
        return self._encode_with_copy(rendering, add_special_tokens)

    def _encode_with_copy(self, rendering: str, add_special_tokens: bool = False) -> list[int]:
        copy, to_special = self._tokenizer_copy()
        text = self._rendered.sub(
            lambda m: (self.strings[int(m.group(1))] if m.group(1) is not None
                       else f"{_MARKUP}{self._index[m.group(2)]}{_MARKUP_END}"), rendering)
        # encode_batch, not encode: it lets go of the GIL while it runs (seconds for a long
        # text), so the server's event loop runs beside a prompt tokenized in a thread; the
        # copy keeps the original's post-processor, so add_special_tokens adds the same BOS
        ids = copy.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return [to_special.get(i, i) for i in ids]

    def _encode_pieces(self, rendering: str) -> list[int]:
        """Slow tokenizers: the text between the markup's special tokens is encoded piece by
        piece without parsing special tokens (exact except where a pre-tokenizer treats a
        piece's start as the start of the text, e.g. a SentencePiece dummy prefix)."""
        ids, pos = [], 0
        for m in self._rendered.finditer(rendering):
            if m.group(1) is not None:
                continue                  # a typed placeholder: text, restored below
            ids += self._encode_text(rendering[pos:m.start()])
            ids.append(self._ids[self._index[m.group(2)]])
            pos = m.end()
        return ids + self._encode_text(rendering[pos:])

    def _encode_text(self, piece: str) -> list[int]:
        text = self._rendered.sub(lambda m: self.strings[int(m.group(1))], piece)
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

    def _tokenizer_copy(self):
        if self._copy is None:
            from tokenizers import AddedToken
            from tokenizers import Tokenizer as RustTokenizer
            copy = RustTokenizer.from_str(self.hf.backend_tokenizer.to_str())
            copy.encode_special_tokens = True   # special tokens in the text are text
            stand_ins = [f"{_MARKUP}{i}{_MARKUP_END}" for i in range(len(self.strings))]
            copy.add_tokens([AddedToken(s, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                        normalized=t.normalized, special=False)
                             for s, t in zip(stand_ins, self._flags)])
            self._copy = (copy, {copy.token_to_id(s): i for s, i in zip(stand_ins, self._ids)})
        return self._copy


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt.

    hf: the underlying transformers tokenizer. vocab_size: len(hf) (base + added tokens).
    eos_token_ids: ids that end generation (GGUF metadata or generation_config.json, plus the
    tokenizer's eos token). chat_template: Jinja source or None.
    split_special_tokens: the default of `apply_chat_template`'s argument of that name (the
    engine sets it from EngineConfig.split_special_tokens).
    """

    def __init__(self, hf, eos_token_ids: Iterable[int] = (), chat_template: str | None = None):
        self.hf = hf
        self.split_special_tokens = True
        self._template_text: TemplateTextEncoder | None = None
        self._token_bytes: TokenBytes | None = None
        # the last BAD_WORDS_CACHE bad_words lists tokenized (AsyncLLMEngine tokenizes a
        # request's list off the engine thread; the engine thread then finds it here)
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}
        if chat_template is not None and not getattr(hf, "chat_template", None):
            hf.chat_template = chat_template
        self.chat_template: str | None = getattr(hf, "chat_template", None) or chat_template
        ids = [int(i) for i in eos_token_ids]
        if hf.eos_token_id is not None and hf.eos_token_id not in ids:
            ids.append(int(hf.eos_token_id))
        self.eos_token_ids: list[int] = ids
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)

    @classmethod
    def from_folder(cls, folder: str, eos_token_ids: Iterable[int] | None = None) -> "Tokenizer":
        """From a HF model folder. EOS ids: `eos_token_ids`, by default generation_config.json's
        `eos_token_id` (read by transformers' GenerationConfig), then the tokenizer's eos
        token. Raises OSError if the folder has no tokenizer."""
        from transformers import AutoTokenizer

        from ferrum.config import generation_eos_token_ids
        hf = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)   # never the folder's own code
        if eos_token_ids is None:
            eos_token_ids = generation_eos_token_ids(folder) or []
        return cls(hf, eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS etc. as the tokenizer config says.
        Raises InvalidRequestError naming `param` (the request field of the text) for text
        that is not valid Unicode (a lone surrogate)."""
        return self.hf.encode(check_unicode(text, param), add_special_tokens=add_special_tokens)

    def bad_words_token_ids(self, words: Iterable[str]) -> list[list[int]]:
        """SamplingParams.bad_words as token id sequences: each word as it reads at the start of
        a text and after a space ("word", " word"; leading spaces of the word dropped first), as
        vLLM's SamplingParams.update_from_tokenizer spells them, without duplicates. A word is
        text: a special token's spelling is encoded as its characters. vLLM keeps the spaced
        spelling only when it has as many tokens as the other; both are kept here (a spaced
        spelling of more tokens only bans what the other already covers). Raises
        InvalidRequestError (param bad_words) for text that is not valid Unicode.

        Linear in the number of words: one batched encode and a set for the duplicates (a
        list lookup per word and one encode call each took 10 s for 20,000 words, on the
        engine thread, stalling every open stream). The last BAD_WORDS_CACHE lists are kept."""
        key = tuple(words)
        if (hit := self._bad_words.get(key)) is not None:
            return [list(ids) for ids in hit]
        texts = [t for word in words for t in (word.lstrip(), " " + word.lstrip())]
        for text in texts:
            check_unicode(text, "bad_words")
        if not texts:
            return []
        encoded = self.hf(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for ids in encoded:
            if ids and (t := tuple(ids)) not in seen:
                seen.add(t)
                out.append(list(ids))
        if len(self._bad_words) >= BAD_WORDS_CACHE:
            self._bad_words.pop(next(iter(self._bad_words)))   # the oldest
        self._bad_words[key] = out
        return [list(ids) for ids in out]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD); special tokens dropped unless asked."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary pieces of `ids` (byte-level BPE spells bytes as `Ġ`, `Ã`, ...)."""
        return self.hf.convert_ids_to_tokens(list(ids))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, continue_final_message: bool = False,
                    **template_kwargs) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": str | text parts}]).
        `chat_template` overrides the model's. add_generation_prompt: end with the header of a
        new assistant turn. continue_final_message (vLLM / transformers): end inside the last
        message, without its end-of-turn tokens, so the model continues it (an assistant
        "prefill"); it excludes add_generation_prompt. `template_kwargs` (e.g. `tools`, OpenAI
        function tools) reach the template as `apply_chat_template(..., tools=...)` passes
        them. Raises InvalidRequestError when both are set, there is no template, a message is
        malformed, or the template rejects the conversation."""
        return self._render(self._messages(messages), add_generation_prompt, chat_template,
                            continue_final_message, **template_kwargs)

    def _messages(self, messages: list[dict]) -> list[dict]:
        """Validated messages with text parts joined (see _flatten_content)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'",
                                          param="messages")
            msgs.append({**m, "content": _flatten_content(m.get("content"), i)})
        return msgs

    def _render(self, msgs: list[dict], add_generation_prompt: bool, chat_template: str | None,
                continue_final_message: bool = False, **template_kwargs) -> str:
        """Render validated messages; `template_kwargs` (e.g. tools) go to the template."""
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the final message",
                param="continue_final_message")
        template = chat_template or self.chat_template
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; pass --chat-template (a Jinja file or string) "
                "to set one, or use the completions API with a plain prompt", param="messages")
        try:
            return self.hf.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               **template_kwargs)
        except Exception as e:  # jinja2 TemplateError, raise_exception() inside templates
            raise InvalidRequestError(f"chat template failed on these messages: {e}",
                                      param="messages") from e

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None,
                            split_special_tokens: bool | None = None,
                            continue_final_message: bool = False, add_special_tokens: bool = False,
                            **template_kwargs) -> list[int]:
        """Token ids of the rendered conversation, by default without added BOS / EOS (the
        template writes them when the model wants them); add_special_tokens=True adds them on
        top, as the tokenizer's encode does (vLLM's /tokenize and chat `add_special_tokens`).

        split_special_tokens (None: `self.split_special_tokens`, True unless configured):
        True encodes a special-token string inside any string of the conversation (message
        contents, text parts, and every string in `template_kwargs`, e.g. tools) as text, so
        only the template's markup yields special tokens (TemplateTextEncoder); False parses
        them as control tokens wherever they appear (the old behaviour: a user could close
        their turn with `<|im_end|>` and write the assistant's). continue_final_message: see
        render_chat. Same errors as render_chat."""
        msgs = self._messages(messages)
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        if not split:
            text = self._render(msgs, add_generation_prompt, chat_template, continue_final_message,
                                **template_kwargs)
            return self.encode(text, add_special_tokens=add_special_tokens, param="messages")
        guard = self.template_text
        text = self._render(guard.protect(msgs), add_generation_prompt, chat_template,
                            continue_final_message, **guard.protect(template_kwargs))
        return guard.encode(text, add_special_tokens)

    @property
    def token_bytes(self) -> TokenBytes:
        """The UTF-8 bytes of single tokens (see token_bytes.py), built on first use."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.hf)
        return self._token_bytes

    @property
    def template_text(self) -> TemplateTextEncoder:
        """The TemplateTextEncoder of this tokenizer (built on first use)."""
        if self._template_text is None:
            self._template_text = TemplateTextEncoder(self.hf)
        return self._template_text
