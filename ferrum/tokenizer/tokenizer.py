"""Tokenizer: a thin wrapper over a Hugging Face fast tokenizer (transformers / tokenizers) plus
the model's chat template (Jinja, rendered by transformers' `apply_chat_template`).

Built from a HF folder (tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json) or from a GGUF file, whose `tokenizer.ggml.*` metadata transformers
converts into a fast tokenizer (transformers/integrations/ggml.py).
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

from ferrum.errors import ConfigError, InvalidRequestError

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


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt.

    hf: the underlying transformers tokenizer. vocab_size: len(hf) (base + added tokens).
    eos_token_ids: ids that end generation (GGUF metadata or generation_config.json, plus the
    tokenizer's eos token). chat_template: Jinja source or None.
    """

    def __init__(self, hf, eos_token_ids: Iterable[int] = (), chat_template: str | None = None):
        self.hf = hf
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
    def from_folder(cls, folder: str) -> "Tokenizer":
        """From a HF model folder. EOS ids: generation_config.json `eos_token_id` (int or list)
        first, then the tokenizer's eos token. Raises OSError if the folder has no tokenizer."""
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(folder)
        eos: list[int] = []
        gen = os.path.join(folder, "generation_config.json")
        if os.path.exists(gen):
            with open(gen) as f:
                v = json.load(f).get("eos_token_id")
            eos = [] if v is None else [v] if isinstance(v, int) else list(v)
        return cls(hf, eos)

    @classmethod
    def from_gguf(cls, path: str, eos_token_ids: Iterable[int] | None = None,
                  chat_template: str | None = None) -> "Tokenizer":
        """From the tokenizer embedded in a GGUF file (`tokenizer.ggml.*`, converted by
        transformers). eos_token_ids / chat_template default to the GGUF metadata
        (`tokenizer.ggml.{eos,eot,eom}_token_id`, `tokenizer.chat_template`).
        Raises WeightLoadError for an unreadable file."""
        from transformers import AutoTokenizer

        if eos_token_ids is None or chat_template is None:
            from ferrum.loader.gguf import gguf_eos_token_ids, gguf_field, open_reader
            reader = open_reader(path)
            if eos_token_ids is None:
                eos_token_ids = gguf_eos_token_ids(reader)
            if chat_template is None:
                chat_template = gguf_field(reader, "tokenizer.chat_template")
        path = os.path.abspath(path)
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        return cls(hf, eos_token_ids, chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS etc. as the tokenizer config says."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": str | text parts}]).
        `chat_template` overrides the model's. Raises InvalidRequestError when there is no
        template, a message is malformed, or the template rejects the conversation."""
        template = chat_template or self.chat_template
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; pass --chat-template (a Jinja file or string) "
                "to set one, or use the completions API with a plain prompt", param="messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'",
                                          param="messages")
            msgs.append({**m, "content": _flatten_content(m.get("content"), i)})
        try:
            return self.hf.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2 TemplateError, raise_exception() inside templates
            raise InvalidRequestError(f"chat template failed on these messages: {e}",
                                      param="messages") from e

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        """Token ids of `render_chat(...)`, encoded without adding special tokens (the template
        writes BOS itself when the model wants one). Same errors as render_chat."""
        text = self.render_chat(messages, add_generation_prompt, chat_template)
        return self.encode(text, add_special_tokens=False)
