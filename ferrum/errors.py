"""Named errors. Every error a user can cause derives from FerrumError; the CLI prints it
on one line and the server maps it to an OpenAI-style JSON body (status in `http_status`)."""
import difflib
from contextlib import contextmanager


class FerrumError(Exception):
    """Base of every ferrum error. `http_status` is what the server answers with."""

    http_status = 500
    error_type = "internal_error"


class InvalidRequestError(FerrumError, ValueError):
    """A request or parameter is out of range (bad sampling option, empty prompt, ...)."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt tokens (+ max_tokens) exceed the model's context length (`max_model_len`)."""


def check_prompt_len(num_prompt_tokens: int, max_model_len: int, param: str = "prompt") -> None:
    """Raise PromptTooLongError naming `param` (the request field the prompt came from:
    "prompt", chat's "messages", Responses' "input") unless the prompt leaves room for at
    least one generated token: at most max_model_len - 1 prompt tokens."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(f"{param}: the prompt has {num_prompt_tokens} tokens but "
                                 f"max_model_len is {max_model_len}: at most {max_model_len - 1} "
                                 "prompt tokens are allowed", param=param)


@contextmanager
def prompt_named(name: str, about: str = "prompt"):
    """Around `add_request` of one prompt of a batch: the engine checks one prompt and names
    it "prompt" (empty, too long, ids outside the vocabulary); re-raise such an error as the
    batch item `name` ("prompt[2]", "prompts[2]"), same type, the message led by the new name.
    `name` "prompt" (a single prompt) leaves errors as they are. `about`: the param renamed,
    with what follows it ("messages[1].content" -> "messages[3][1].content" for name
    "messages[3]", about "messages": a conversation of `LLM.chat`'s batch)."""
    try:
        yield
    except InvalidRequestError as e:
        param = e.param or ""
        if name == about or not (param == about or param.startswith((about + "[", about + "."))):
            raise
        renamed, msg = name + param[len(about):], str(e)
        # the message names the param first ("prompt: the prompt has ..."): rename it there
        msg = renamed + msg[len(param):] if msg.startswith(param + ": ") else f"{name}: {msg}"
        raise type(e)(msg, param=renamed) from e


class ConfigError(InvalidRequestError):
    """An engine option does not fit the model or the machine (max_model_len above the model's
    context, a chat template path that does not exist, ...); raised at start-up, `param`
    names the option."""


class ModelNotFoundError(FerrumError):
    """No model by that name, path or hub id."""

    http_status = 404
    error_type = "not_found_error"


class UnsupportedModelError(FerrumError):
    """The architecture, quantization type or a config option is not implemented."""

    http_status = 400
    error_type = "invalid_request_error"


class WeightLoadError(FerrumError):
    """A weight file is unreadable, truncated, or lacks a tensor the model needs."""


class OutOfKvCacheError(FerrumError):
    """A single request needs more KV blocks than the whole pool holds."""

    http_status = 400
    error_type = "invalid_request_error"


class CacheConfigError(FerrumError):
    """The KV pool cannot hold even one sequence of max_model_len."""


class StorageError(FerrumError):
    """ferrum's files under $FERRUM_HOME (model store, conversion caches) cannot be written:
    the folder is a file, read-only or full."""


class TensorParallelError(FerrumError):
    """Sizes do not divide over TP ranks, or a rank died / hung."""


class RequestFailedError(FerrumError):
    """A step running this request raised inside the engine; the request was dropped (its KV
    blocks freed) and the engine goes on serving the others."""

    error_type = "internal_error"


class EngineDeadError(FerrumError):
    """The engine loop or a worker rank failed; no further requests can be served."""


class ServerShuttingDownError(EngineDeadError):
    """`ferrum serve` is shutting down and this request did not finish within its
    --shutdown-timeout (or arrived after the engine stopped); 503, as a request the server
    cannot take now."""

    http_status = 503
    error_type = "service_unavailable"


class CannotListenError(FerrumError):
    """`ferrum serve` cannot listen on the host and port asked for (a host that does not
    resolve, or is not an address of this machine); raised before the model loads."""


class AddressInUseError(CannotListenError):
    """`ferrum serve`'s host and port are taken (another server listens there)."""


class QueueFullError(FerrumError):
    """Too many waiting requests; the server answers 503 with Retry-After."""

    http_status = 503
    error_type = "server_overloaded"


def did_you_mean(word: str, known, cutoff: float = 0.75) -> str:
    """" (did you mean 'x'?)" when `word` is close to one of `known` (difflib's ratio >=
    cutoff), else "": the hint a message about a misspelt name ends with."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""

