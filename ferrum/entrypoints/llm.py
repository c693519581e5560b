"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`.
All prompts go through the continuous-batching engine at once; a tqdm bar shows progress."""
from __future__ import annotations

import numbers
import threading
import time

from tqdm.auto import tqdm

from ferrum.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.errors import EngineDeadError, InvalidRequestError, prompt_named
from ferrum.entrypoints.chat_utils import PARALLEL_TOOL_CALLS, apply_tool_calls, prepare_chat
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import SamplingParams


class LLM:
    """An engine for offline batches.

    model: as in EngineConfig (a name, HF folder, .gguf file, hub id or dummy:<config>).
    progress: show weight-loading and generation progress bars.
    kwargs: any engine option, named as its field in `ferrum/config.py` (the `ferrum run`
    flags without dashes): tensor_parallel_size, dtype, device, max_model_len, threads,
    kv_cache_memory ("2GiB" or bytes), ... An unknown name raises TypeError.
    Calls from several threads run one after another (each call steps the engine until its
    own requests finish); after `shutdown` they raise EngineDeadError.
    """

    def __init__(self, model: str = "smollm2", progress: bool = True, **kwargs):
        self._start(EngineConfig.from_kwargs(model=model, **kwargs), progress)

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False) -> "LLM":
        """An LLM over a ready EngineConfig (`ferrum bench` builds one from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config, progress)
        return llm

    def _start(self, config: EngineConfig, progress: bool) -> None:
        self.engine = LLMEngine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()   # one generate at a time steps the engine
        self._closed = False

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine encodes and decodes with (vLLM's
        `LLM.get_tokenizer()`): a transformers tokenizer. For a HF folder, what
        `AutoTokenizer.from_pretrained` loads from it (a `PreTrainedTokenizerFast`, or the
        model's subclass of it such as `GPT2TokenizerFast`, wherever a fast tokenizer exists);
        for a GGUF model, a `PreTrainedTokenizerFast` that transformers converts from the
        file's `tokenizer.ggml.*` metadata, with the GGUF's chat template set on it
        (transformers 5 names that class `TokenizersBackend`). `encode(prompt)` gives the ids
        `generate` uses for that text prompt, and its `chat_template` is the one `chat`
        renders (the model's, or `LLM(chat_template=...)`). `apply_chat_template(...,
        tokenize=True)` (a BatchEncoding in transformers 5: its "input_ids") gives `chat`'s
        ids unless a message holds a special-token string: `chat` encodes those as text
        (split_special_tokens), transformers as control tokens. It is the engine's own object,
        not a copy: a change to it (added tokens, say) reaches the engine's tokenization too.
        `LLM.tokenizer` is ferrum's wrapper around it (ferrum.tokenizer.Tokenizer). Raises
        InvalidRequestError for a model without a tokenizer (only token-id prompts work)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer (its folder has no tokenizer files, "
                                      "or its GGUF's could not be converted); pass prompt token ids")
        return self.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: SamplingParams() with
        the model's generation_config.json sampling defaults (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens) under the engine option
        generation_config="auto"; plain SamplingParams() with "vllm". As vLLM's."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: str | dict | list[str | dict] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or token-id lists, or
        vLLM's dicts {"prompt": text} / {"prompt_token_ids": ids};
        sampling_params is one SamplingParams for all (default: `get_default_sampling_params()`)
        or a list with one per prompt. All are queued first, so they run concurrently (continuous
        batching). Raises InvalidRequestError when prompts are of another type (param
        "prompts" / "prompts[i]"; an empty, too long or out-of-vocabulary prompt of several is
        named "prompts[i]" too), sampling_params is not a SamplingParams or a list of them
        with one per prompt, plus what `LLMEngine.add_request` raises (nothing is left queued
        then), and EngineDeadError after `shutdown`."""
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts), "prompt", self.get_default_sampling_params)
        return self._generate(prompts, params, use_tqdm, "prompts" if len(prompts) > 1 else "prompt")

    def _generate(self, prompts: list, params: list[SamplingParams], use_tqdm: bool,
                  item: str) -> list[RequestOutput]:
        """Queue every prompt, then run them to the end. item: what the engine's errors about
        one prompt are named ("prompt", or item[i] for a batch's "prompts" / "messages")."""
        with self._lock:
            if self._closed:
                raise EngineDeadError("this LLM was shut down; create a new one")
            if not prompts:
                return []
            ids = []
            try:
                for i, (p, sp) in enumerate(zip(prompts, params)):
                    with prompt_named(f"{item}[{i}]" if len(prompts) > 1 else item):
                        if isinstance(p, str):
                            ids.append(self.engine.add_request(None, p, sp))
                        else:
                            ids.append(self.engine.add_request(None, None, sp, prompt_token_ids=list(p)))
            except Exception:
                for rid in ids:
                    self.engine.abort_request(rid)
                raise
            return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        t0, gen0 = time.perf_counter(), self.engine.stats["generation_tokens"]
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(final_only=True):
                    done[out.request_id] = out
                    bar.update(1)
                gen = self.engine.stats["generation_tokens"] - gen0
                bar.set_postfix_str(f"{gen / max(time.perf_counter() - t0, 1e-9):.1f} tok/s, "
                                    f"running {len(self.engine.scheduler.running)}", refresh=False)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = PARALLEL_TOOL_CALLS,
             response_format: dict | None = None, tool_parser: str | None = None,
             chat_template: str | None = None, split_special_tokens: bool | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate.

        sampling_params: one SamplingParams for all conversations, or a list with one per
        conversation (as `generate` takes them per prompt). Messages, tools, tool_choice,
        parallel_tool_calls and response_format as in OpenAI's
        chat completions (`ferrum.entrypoints.chat_utils`); tool_parser: "auto" or a name in
        `ferrum.tool_parsers.TOOL_PARSERS` (None: the engine's `tool_call_parser`). With tools,
        each CompletionOutput's `tool_calls` holds the parsed calls (OpenAI form) and `text`
        the remaining content. split_special_tokens: see Tokenizer.apply_chat_template (None:
        the engine's setting). add_generation_prompt / continue_final_message as in
        `Tokenizer.render_chat` (to continue the last message, pass add_generation_prompt=False
        too, as in vLLM). Raises InvalidRequestError naming the bad field (in a batch, under
        its conversation: "messages[2][0].content"; a too long one is "messages[2]")."""
        # a list of conversations (lists), else one conversation (prepare_chat checks it)
        convs = messages if isinstance(messages, list) and (
            not messages or isinstance(messages[0], list)) else [messages]
        params = _params_list(sampling_params, len(convs), "conversation", self.get_default_sampling_params)
        parser = self.engine.config.tool_call_parser if tool_parser is None else tool_parser
        chats = []
        for i, c in enumerate(convs):   # in a batch, a bad conversation is named messages[i]
            with prompt_named(f"messages[{i}]" if len(convs) > 1 else "messages", about="messages"):
                chats.append(prepare_chat(self.tokenizer, c, tools=tools, tool_choice=tool_choice,
                                          parallel_tool_calls=parallel_tool_calls,
                                          response_format=response_format, tool_parser=parser,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message,
                                          chat_template=chat_template,
                                          split_special_tokens=split_special_tokens))
        outs = self._generate([c.prompt_token_ids for c in chats],
                              [c.sampling_params(sp) for c, sp in zip(chats, params)], use_tqdm, "messages")
        for chat, out in zip(chats, outs):
            for completion in out.outputs:
                apply_tool_calls(chat.tool_parser, completion)
        return outs

    def shutdown(self) -> None:
        """Stop the engine: worker ranks exit and device memory is freed (once; later calls
        do nothing)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _prompt_list(prompts) -> list:
    """`LLM.generate`'s prompts as a list of single prompts (a string or a list of token ids
    each). vLLM's dict prompts are taken too: {"prompt": text} (TextPrompt) and
    {"prompt_token_ids": [...]} (TokensPrompt). Raises InvalidRequestError naming "prompts"
    or "prompts[i]" for anything else (None, a number, a list holding one, a dict with other
    keys such as multi_modal_data)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], numbers.Integral)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError("prompts must be a string, a list of token ids or a list of "
                                  f"them (strings / token-id lists); got {type(prompts).__name__}",
                                  param="prompts")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            # a vLLM user's prompt form (vLLM takes token ids only this way); other keys
            # (multi_modal_data, cache_salt, ...) ask for what ferrum does not do: named, not dropped
            if len(p) != 1 or not p.keys() <= {"prompt", "prompt_token_ids"}:
                raise InvalidRequestError(
                    f"prompts[{i}]: a dict prompt holds exactly one of \"prompt\" (text) or "
                    f"\"prompt_token_ids\"; got the keys {sorted(map(str, p))}", param=f"prompts[{i}]")
            ((key, p),) = p.items()
            if isinstance(p, str) != (key == "prompt"):
                raise InvalidRequestError(f"prompts[{i}].{key} must be "
                                          f"{'a string' if key == 'prompt' else 'a list of token ids'}; "
                                          f"got {p!r:.80}", param=f"prompts[{i}].{key}")
        # plain ints first, in one C-level pass: the numbers.Integral check (an ABC, per token)
        # was a visible part of a long prompt's time to first token
        if not (isinstance(p, str) or (isinstance(p, (list, tuple)) and (
                set(map(type, p)) <= {int}
                or all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p)))):
            raise InvalidRequestError(f"prompts[{i}] must be a string or a list of token ids "
                                      f"(ints); got {p!r:.80}", param=f"prompts[{i}]")
        out.append(p)
    return out


def _params_list(sampling_params, n: int, what: str, default) -> list[SamplingParams]:
    """One SamplingParams per prompt (`what` = "prompt") or conversation: `sampling_params` is
    one for all (None: `default()`) or a list of n. Raises InvalidRequestError naming
    "sampling_params" / "sampling_params[i]" for a wrong length or type."""
    if isinstance(sampling_params, (list, tuple)):   # vLLM takes any sequence of them
        if len(sampling_params) != n:
            raise InvalidRequestError(
                f"got {len(sampling_params)} SamplingParams for {n} {what}s: give one "
                f"SamplingParams for all, or a list with one per {what}", param="sampling_params")
        params = list(sampling_params)
    else:   # `is None`, not `or`: a falsy wrong value ({}, 0) is named below, not replaced
        params = [default() if sampling_params is None else sampling_params] * n
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            where = "sampling_params" if sp is sampling_params else f"sampling_params[{i}]"
            raise InvalidRequestError(f"{where} must be a SamplingParams, got {type(sp).__name__}",
                                      param=where)
    return params
