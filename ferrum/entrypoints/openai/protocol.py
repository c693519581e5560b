"""Request bodies of the OpenAI-compatible API (pydantic 2) and their mapping to SamplingParams.

Every model forbids unknown fields (`extra="forbid"`): a field ferrum does not implement
(`suffix`, `best_of` above 1, ...) is answered with HTTP 400 naming it, never silently ignored; and
every model is strict, so a value of the wrong JSON type (`"max_tokens": "5"`, `"stream": 1`,
`"temperature": true`) is a 400 naming its field, not coerced. A JSON null for a field that has
a default means that default, as an absent field does (OpenAI marks its optional fields
nullable: `"n": null`, `"stream": null`, `"parallel_tool_calls": null`, ...), and so does a
null for an OpenAI field ferrum does not implement (a body's NULL_ONLY: `"suffix": null`,
`"prediction": null`, ...), which SDKs that send every field write for one left unset. Value
ranges (temperature >= 0, top_p in (0, 1], ...) are checked by `SamplingParams`, except
temperature's upper bound, OpenAI's 2, which only the server sets (`Temperature`); it raises
InvalidRequestError with the offending parameter; messages, tools, tool_choice and
response_format by `ferrum.entrypoints.chat_utils` (one checker for every API that takes
them), which names the field's path.

Field semantics follow the OpenAI API reference (completions, chat completions); the extra
sampling fields `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`min_tokens`, `allowed_token_ids`, `bad_words`, `include_stop_str_in_output`,
`skip_special_tokens` follow vLLM, as does
`prompt_logprobs` (top-N, 0..20, per prompt token; not with `stream`, which vLLM refuses too),
and so do the structured-output fields: `structured_outputs` (vLLM's current name: {"json" |
"regex" | "choice" | "grammar" | "json_object": ...}) and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, accepted as aliases (one constraint per
request).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from ferrum.entrypoints.chat_utils import PARALLEL_TOOL_CALLS, content_text, response_format_constraint
from ferrum.errors import InvalidRequestError
from ferrum.sampling_params import MAX_LOGPROBS, SamplingParams
from ferrum.structured_output import StructuredOutputsParams
from ferrum.structured_output.params import json_value


class _Strict(BaseModel):
    """A request body: unknown fields and values of the wrong JSON type are refused (strict:
    "5" is no integer, true no number, 1 no boolean; an integer is a valid float); a null for
    a field with a default is that default."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # OpenAI's fields of this body that ferrum does not implement: a null (what SDKs that send
    # every field write for one left unset) means unset and is dropped; any other value stays
    # an unknown field, a 400 naming it
    NULL_ONLY: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """Drop the null members of a body that name a field with a default (by name or
        alias) or one of NULL_ONLY, so the field's one default applies; a null for a required
        field, or for an unknown one, stays and is refused."""
        if not isinstance(data, dict):
            return data
        optional = {key for name, f in cls.model_fields.items() if not f.is_required()
                    for key in (name, f.alias) if key} | cls.NULL_ONLY
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class StreamOptions(_Strict):
    include_usage: bool = False     # one last chunk with `usage` and no choices
    # vLLM: with include_usage, every chunk also carries the usage of its choice so far
    continuous_usage_stats: bool = False


# OpenAI's temperature range is [0, 2]: the server refuses more (SamplingParams, offline, takes
# any temperature >= 0; its own check names a negative one).
Temperature = Annotated[float, Field(le=2.0, allow_inf_nan=False)]  # NaN / inf: "a finite number"

# OpenAI's `service_tier`: ferrum has one tier, which "auto" and "default" name ("flex",
# "priority", "scale": a 400 naming the field).
ServiceTier = Literal["auto", "default"]

# Sampling fields a client may leave out (null): the model's defaults (generation_config.json),
# else SamplingParams' apply.
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty")


def sampling_defaults(defaults: dict | None, given: dict) -> dict:
    """The sampling fields a request `given` with the model's `defaults` (the engine's
    sampling_defaults) for those it left out; max_tokens is not among them (each API has its
    own rule: OpenAIServing._max_tokens)."""
    return {**{k: v for k, v in (defaults or {}).items() if k in _OPTIONAL_SAMPLING}, **given}


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = SamplingParams.n
    temperature: Temperature | None = None    # None: SamplingParams' default (1.0, OpenAI's too)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a string key) -> bias in [-100, 100]
    ignore_eos: bool = SamplingParams.ignore_eos
    min_tokens: int = SamplingParams.min_tokens
    allowed_token_ids: list[StrictInt] | None = None   # vLLM: sample only among these ids
    bad_words: list[str] | None = None                 # vLLM: words the output must not hold
    include_stop_str_in_output: bool = SamplingParams.include_stop_str_in_output
    skip_special_tokens: bool = SamplingParams.skip_special_tokens
    user: str | None = None                      # accepted for API compatibility; only logged
    # logprobs name every token `token_id:<id>` (vLLM), so tokens with equal text stay apart
    return_tokens_as_token_ids: bool = False
    # vLLM: the prompt's token ids and each choice's generated ids beside the text (a stream:
    # the prompt's in its first chunk, each chunk's new ids in it)
    return_token_ids: bool = False
    # vLLM: keep the prompt's last k tokens (-1: max_model_len of them); the start is dropped
    truncate_prompt_tokens: int | None = None
    # vLLM: the answer's id is "cmpl-<request_id>" / "chatcmpl-<request_id>" (else the
    # X-Request-Id header's, else a random one), for tracing a request across services
    request_id: str | None = None
    # vLLM: the request's rank under --scheduling-policy priority; ferrum's scheduler is first
    # come first served (vLLM's default, which refuses any other value too)
    priority: int = 0
    # vLLM: the request shares cached prompt blocks only with requests of the same salt (a
    # tenant's secret), so another tenant cannot learn by timing which prompts it sent
    cache_salt: str | None = None
    # vLLM: each prompt token's logprob with the top-N (0..20) (completions: on each choice;
    # chat: on the response, as vLLM puts them)
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured outputs (vLLM); response_format (OpenAI) is read by each request type. Any:
    # StructuredOutputsParams checks their types (one checker for these and the offline API),
    # and its 400 names the key, the type given and the one expected (pydantic's answer to
    # `"guided_json": true` listed its union's branches: "guided_json.dict[str,any]: ...")
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    response_format: dict[str, Any] | None = None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint given by `structured_outputs` or one guided_* alias (None if none).
        Raises InvalidRequestError naming the field when two are given or one is invalid."""
        given = [(name, getattr(self, name)) for name in (
            "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give one of {given[0][0]} and {given[1][0]}, not both",
                                      param=given[1][0])
        if not given:
            return None
        name, value = given[0]
        if name == "structured_outputs":
            return StructuredOutputsParams.from_dict(value)
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value}, param=name)

    def _params(self, max_tokens: int | None, logprobs: int | None,
                defaults: dict | None) -> SamplingParams:
        """SamplingParams for this request; sampling fields it leaves out take `defaults` (the
        model's), else SamplingParams' own. Raises InvalidRequestError (param named)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true",
                                      param="stream_options")
        if self.priority != 0:
            raise InvalidRequestError("priority scheduling is not enabled: the scheduler serves "
                                      "requests first come first served (send priority 0 or leave it out)",
                                      param="priority")
        if self.prompt_logprobs is not None and self.stream:   # vLLM refuses them there too
            raise InvalidRequestError("prompt_logprobs is not available with stream: true; send "
                                      "the request without stream", param="prompt_logprobs")
        # A field the client left out (None) takes the model's default, else SamplingParams' own
        given = {name: value for name in _OPTIONAL_SAMPLING
                 if (value := getattr(self, name)) is not None}
        return SamplingParams(
            n=self.n, **sampling_defaults(defaults, given), logit_bias=self.logit_bias, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=self.stop,
            stop_token_ids=self.stop_token_ids, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=self._structured_outputs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _is_token_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_token_ids(ids: list, name: str) -> list[int]:
    for j, t in enumerate(ids):
        if not _is_token_id(t):
            raise InvalidRequestError(f"{name}[{j}]: a token id must be an integer; got {json_value(t)}",
                                      param=f"{name}[{j}]")
    return list(ids)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `logprobs`: top-N (0..20) per generated token; `echo`: the prompt
    text is prepended to each choice's text, and with `logprobs` the prompt tokens' logprobs
    come first (the first token's are null). `max_tokens: 0` is allowed with `echo` only
    (scoring a prompt, as vLLM allows): nothing is generated."""

    # text, a list of texts, token ids, or a list of token-id lists (one request each), checked
    # by `prompts` (Any: a wrong type is named by its index, not by pydantic's union branches)
    prompt: Any
    # 16, OpenAI's documented default too, for a null max_tokens as for an absent one
    max_tokens: int = SamplingParams.max_tokens
    logprobs: int | None = None
    echo: bool = False
    # 1 (OpenAI's default) is a no-op; more candidates per choice are not implemented (vLLM V1 neither)
    best_of: int | None = None
    NULL_ONLY = frozenset({"suffix"})

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """max_tokens: what the engine generates (1 for echo_only; its token is dropped);
        defaults: the model's sampling defaults, for the fields left out."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                                      param="logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be an integer >= 1, got 0 (0 is allowed with "
                                      "echo: true, which scores the prompt)", param="max_tokens")
        if self.best_of is not None and self.best_of != 1:
            raise InvalidRequestError(f"best_of {self.best_of} is not supported (only 1, the default: "
                                      "use n for several choices)", param="best_of")
        if self.best_of == 1 and self.n > 1:
            raise InvalidRequestError(f"best_of (1) must be at least n ({self.n})", param="best_of")
        params = self._params(max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:   # the echoed tokens' logprobs: the larger top-N
            params.prompt_logprobs = max(self.prompt_logprobs or 0, self.logprobs)
        fmt = response_format_constraint(self.response_format)
        if fmt is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError(f"response_format cannot be combined with "
                                          f"{params.structured_outputs.param}", param="response_format")
            params.structured_outputs = fmt
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids). Raises
        InvalidRequestError for an empty list or a value of the wrong type, named by its index
        (prompt[1], prompt[1][0])."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list):
            raise InvalidRequestError("prompt must be a string, a list of strings, a list of token "
                                      f"ids or a list of token-id lists; got {json_value(p)}",
                                      param="prompt")
        if not p:
            raise InvalidRequestError("prompt is an empty list", param="prompt")
        if _is_token_id(p[0]):
            return [_check_token_ids(p, "prompt")]
        out = []
        for i, x in enumerate(p):
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, list):
                out.append(_check_token_ids(x, f"prompt[{i}]"))
            else:
                raise InvalidRequestError(f"prompt[{i}]: must be a string or a list of token ids; "
                                          f"got {json_value(x)}", param=f"prompt[{i}]")
        return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `logprobs`: return the chosen token's logprob; `top_logprobs`
    (0..20, needs logprobs) adds that many alternatives. `max_completion_tokens` is the newer
    name of `max_tokens`; without either the answer may run to max_model_len. `messages`,
    `tools`, `tool_choice`, `parallel_tool_calls`, `response_format`: OpenAI's, and vLLM's
    `chat_template_kwargs`, checked by `ferrum.entrypoints.chat_utils.prepare_chat`."""

    NULL_ONLY = frozenset({"modalities", "audio", "prediction", "reasoning_effort", "verbosity",
                           "web_search_options", "functions", "function_call", "prompt_cache_retention"})

    messages: list[Any] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = PARALLEL_TOOL_CALLS
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # special-token strings in message text: encoded as text (true), or parsed as control
    # tokens (false); null: the server's --[no-]split-special-tokens
    split_special_tokens: bool | None = None
    continue_final_message: bool = False    # vLLM: continue the last (assistant) message
    # vLLM: the answer starts with the last message's text when that message has the answer's
    # role (assistant; with add_generation_prompt false, the last message's own), e.g. the
    # message continue_final_message continues
    echo: bool = False
    # vLLM: BOS etc. as the tokenizer's encode adds them, on top of the template's own markup
    add_special_tokens: bool = False
    # vLLM: extra variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM / transformers: retrieved documents for a RAG chat template (its `documents`
    # variable), each an object of strings such as {"title": ..., "text": ...}
    documents: list[dict[str, str]] | None = None
    store: bool | None = None               # OpenAI's stored completions: true is refused
    metadata: dict[str, str] | None = None  # accepted; unused (OpenAI tags stored completions)
    safety_identifier: str | None = None    # accepted; unused (as in /v1/responses)
    prompt_cache_key: str | None = None     # accepted; the prefix cache needs no key
    service_tier: ServiceTier | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with `documents` among them (the template's variable of that
        name, as transformers' apply_chat_template passes it). Raises InvalidRequestError when
        both set documents."""
        if self.documents is None:
            return self.chat_template_kwargs
        kwargs = self.chat_template_kwargs
        if isinstance(kwargs, dict) and "documents" in kwargs:
            raise InvalidRequestError("give documents or chat_template_kwargs.documents, not both",
                                      param="documents")
        return {**(kwargs or {}), "documents": self.documents}

    def echoed_text(self) -> str:
        """What `echo` puts before the answer: the last message's text (its text parts joined
        with newlines, as vLLM's echo) when it has the answer's role, else "". Call it after
        prepare_chat has checked the messages."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        if last.get("role") != ("assistant" if self.add_generation_prompt else last.get("role")):
            return ""
        return content_text(last.get("content"), f"messages[{len(self.messages) - 1}].content") or ""

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not both",
                                      param="max_completion_tokens")
        if self.max_completion_tokens is None:
            return self.max_tokens
        # checked here, not only by SamplingParams, whose error would name max_tokens: a field
        # this client did not send
        if self.max_completion_tokens < 1:
            raise InvalidRequestError(f"max_completion_tokens must be an integer >= 1, got "
                                      f"{self.max_completion_tokens}", param="max_completion_tokens")
        return self.max_completion_tokens

    def sampling_params(self, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """defaults: the model's sampling defaults, for the fields left out."""
        if self.store:
            raise InvalidRequestError("store: true is not supported: ferrum stores no "
                                      "completions (send store: false or leave it out)", param="store")
        top = self.top_logprobs
        if top is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                                      param="top_logprobs")
        return self._params(max_tokens, (top or 0) if self.logprobs else None, defaults)


class TokenizeRequest(_Strict):
    """POST /tokenize: `prompt` text (encoded as /v1/completions encodes it: special-token
    strings in it are parsed), or chat `messages` rendered with the chat template (encoded as
    /v1/chat/completions does, `split_special_tokens` included). add_special_tokens (BOS etc.
    as the tokenizer adds them) defaults, as in vLLM, to true for `prompt` and to false for
    `messages`, whose template writes its own; set, it is honored in both forms.
    return_token_strs: also answer each id's vocabulary string (`token_strs`, as vLLM)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    split_special_tokens: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize: token ids -> text."""

    model: str | None = None
    tokens: list[StrictInt]
