"""`ferrum serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints:
  POST /v1/completions, POST /v1/chat/completions, POST /v1/responses   (JSON, or SSE with
       `stream: true`; Responses is stateless, see responses.py)
  GET  /v1/models, GET /v1/models/{id}   (404 for a name this server does not answer to)
  POST /tokenize  {prompt | messages} -> {tokens, count, max_model_len} (+ token_strs with
                  return_token_strs): the ids the
                  completions / chat endpoint would use for that prompt / those messages
  POST /detokenize {tokens} -> {prompt}: special tokens kept, so /tokenize's ids of a chat
                  prompt decode back to that prompt (as vLLM's /detokenize does)
  GET  /health    200 {"status": "ok"} | 503 {"status": "unhealthy", "error": why} once the
                  executor is broken (a dead TP rank, a device fault); a failed request is not
  GET|POST /ping  the same as /health (vLLM's alias, SageMaker's probe)
  GET  /version   {"version": ferrum's version}
  GET  /metrics   Prometheus text format (ferrum.metrics)
  GET  /status    engine.status() as JSON (debug: running/waiting, kv_blocks_free, ...)

With `--api-key KEY` the /v1/*, /tokenize and /detokenize endpoints want
`Authorization: Bearer KEY` (else 401); /health, /ping, /version, /metrics and /status stay open for probes
and scrapers. POST bodies must be JSON with `Content-Type: application/json` (else 400), of
at most `--max-request-body` bytes (default 8 MiB, else 413, read no further). Prompts are
rendered and tokenized in a worker thread, so a long one never stalls the event loop (/health
answers meanwhile).
`--allowed-origins` turns on CORS (Starlette's CORSMiddleware) for those browser origins.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`: bad
JSON or fields 400, unknown model 404, queue full 503 with Retry-After, engine failure 500;
other ferrum errors use their `http_status`.

Start-up (`serve`): the port is bound before the model loads (a busy port fails at once), the
"serving ..." line is printed once the socket listens, and uvicorn logs one access line per
request to stderr unless `--disable-log-requests`.

Shutdown (SIGTERM, Ctrl-C): the server stops accepting connections and lets open requests run
for `--shutdown-timeout` seconds (default 20); then it stops the engine, so a stream still
open ends with an error event (503, "service_unavailable") and `data: [DONE]`, and a waiting
non-streaming request gets that 503 as its body. A second signal quits at once.
"""
from __future__ import annotations

import asyncio
import copy
import errno
import hmac
import logging
import re
import signal
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from uvicorn.config import LOGGING_CONFIG

import ferrum
from ferrum.config import MAX_REQUEST_BODY, format_size, parse_body_limit
from ferrum.engine.async_engine import AsyncLLMEngine
from ferrum.entrypoints.chat_utils import prepare_chat
from ferrum.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                DetokenizeRequest, TokenizeRequest)
from ferrum.entrypoints.openai.responses import ResponsesRequest, add_routes as add_responses_routes
from ferrum.entrypoints.openai.serving import OpenAIServing, error_body, ferrum_error_body
from ferrum.errors import (AddressInUseError, CannotListenError, FerrumError, InvalidRequestError,
                           QueueFullError, ServerShuttingDownError, did_you_mean)
from ferrum.metrics import Metrics
from ferrum.structured_output.params import json_value

log = logging.getLogger("ferrum")

# the API's POST routes, whose bodies must be JSON (a POST elsewhere, e.g. /v1/models, is a 405)
_JSON_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"}
_COUNTED_PATHS = _JSON_PATHS | {"/v1/models", "/v1/models/{id}"}
_RETRY_AFTER_S = "1"
# after --shutdown-timeout ends the open requests: time for their last events to go out before
# uvicorn cancels what is left (a client that reads nothing)
_FLUSH_S = 5.0


class AuthenticationError(FerrumError):
    """Missing or wrong `Authorization: Bearer <key>` header."""

    http_status = 401
    error_type = "authentication_error"


class _CountRequests:
    """ASGI middleware: counts API responses by path and status code. (A plain ASGI wrapper,
    not BaseHTTPMiddleware, so that streaming responses and disconnects pass through as is.)"""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if path.startswith("/v1/models/"):  # one label for every model id (bounded cardinality)
            path = "/v1/models/{id}"
        if scope["type"] != "http" or path not in _COUNTED_PATHS:
            return await self.app(scope, receive, send)
        status, left = [None], [False]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def receive_watch():
            message = await receive()
            left[0] = left[0] or message["type"] == "http.disconnect"
            return message
        try:
            await self.app(scope, receive_watch, send_status)
        finally:
            # no response: 499 (nginx's "client closed request", as a request the client
            # cancels later) when the client left first, e.g. during its upload; else 500
            self.metrics.count_request(path, status[0] or (499 if left[0] else 500))


class _RequireApiKey:
    """ASGI middleware: API paths need `Authorization: Bearer <key>`, else 401. (Checked before
    FastAPI reads the body, so an unauthenticated client learns nothing about its request.)"""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                e = AuthenticationError("missing or invalid API key: send 'Authorization: Bearer <key>'")
                return await JSONResponse(ferrum_error_body(e), status_code=e.http_status)(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestBodyTooLargeError(FerrumError):
    """A request body over the server's --max-request-body."""

    http_status = 413
    error_type = "invalid_request_error"


class _LimitBody:
    """ASGI middleware: a POST body over `max_bytes` is answered 413 before any of it is parsed
    or tokenized (a Content-Length over the limit at once, a chunked body once its chunks pass
    it; uvicorn drops the rest, and the client reads the answer). A body within the limit is
    read here and handed on whole; later receive() calls reach the server's own (the
    disconnect watch)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        declared = int(length) if length.isdigit() else 0
        chunks, received, more = [], 0, declared <= self.max_bytes
        while more and received <= self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":   # the client left: nobody to answer
                return
            more = message.get("more_body", False)
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
        size = max(declared, received)
        if size > self.max_bytes:
            e = RequestBodyTooLargeError(
                f"the request body has {size} bytes{' or more' if not length else ''}, over this "
                f"server's limit of {self.max_bytes} bytes ({format_size(self.max_bytes)}); send "
                "a shorter request, or start the server with a larger --max-request-body")
            return await JSONResponse(ferrum_error_body(e), status_code=e.http_status)(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.app(scope, replay, send)


class _RequireJson:
    """ASGI middleware: a POST to an API path must say `Content-Type: application/json`, else
    400 naming what it sent (FastAPI would otherwise report a confusing validation error
    about the body, e.g. for `curl -d` without `-H 'Content-Type: application/json'`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in _JSON_PATHS:
            ctype = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
            if ctype.split(";")[0].strip().lower() != "application/json":
                e = InvalidRequestError("the request body must be JSON with 'Content-Type: "
                                        f"application/json'; got Content-Type {ctype or 'none'!r}")
                return await JSONResponse(ferrum_error_body(e), status_code=400)(scope, receive, send)
        return await self.app(scope, receive, send)


# pydantic's name of a union branch, in the loc of the errors it gives for each branch
_UNION_BRANCH = re.compile(r"str|int|float|bool|(list|dict)\[.*\]")
_A = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}
_MANY = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans"}


def _branch(tag: str) -> str:
    """'list[str]' -> 'a list of strings', 'dict[str,any]' -> 'an object'."""
    if tag.startswith("dict["):
        return "an object"
    if tag.startswith("list["):
        inner = tag[5:-1]
        return "a list of " + (_MANY.get(inner) or ("objects" if inner.startswith("dict[") else "lists"))
    return _A.get(tag, tag)


def _merge_union_errors(errors: list[dict]) -> list[dict]:
    """The errors of a field of several types (`str | list[str]`) as one: pydantic gives one
    per branch ("stop.str: ...; stop.list[str].1: ..."). When the value is the container a
    branch takes and only an item is wrong, that branch's errors without its name (stop[1]);
    else one error that lists the types taken."""
    out, i = [], 0
    while i < len(errors):
        loc = [x for x in errors[i].get("loc", ()) if x != "body"]
        if len(loc) < 2 or not isinstance(loc[1], str) or not _UNION_BRANCH.fullmatch(loc[1]):
            out.append(errors[i])
            i += 1
            continue
        group = []
        while i < len(errors):
            other = [x for x in errors[i].get("loc", ()) if x != "body"]
            if other[:1] != loc[:1] or len(other) < 2 or not isinstance(other[1], str) \
                    or not _UNION_BRANCH.fullmatch(other[1]):
                break
            group.append((other, errors[i]))
            i += 1
        inside = [(l, e) for l, e in group if len(l) > 2]
        if inside:
            out += [{**e, "loc": [l[0], *l[2:]]} for l, e in inside]
        else:
            tags = list(dict.fromkeys(l[1] for l, _ in group))
            value = group[0][1].get("input")
            out.append({"loc": [loc[0]], "type": "union", "msg": "must be " + " or ".join(
                map(_branch, tags)) + f"; got {json_value(value)}"})
    return out


# each POST route's body: an unknown top-level field is matched against its fields (a typo)
_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def _validation_message(exc: RequestValidationError, path: str = "") -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic's error list (`path`:
    the request's, whose body's fields a misspelt field is matched against)."""
    parts, param = [], None
    for err in _merge_union_errors(list(exc.errors())):
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc).lstrip(".") or None
        param = param or (loc[0] if loc else None)
        if err.get("type") == "extra_forbidden":
            body = _BODIES.get(path)
            hint = did_you_mean(loc[0], body.model_fields, 0.8) if body and len(loc) == 1 else ""
            parts.append(f"unsupported field {name!r}: ferrum does not implement it{hint}")
        elif err.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON: {err.get('msg')}")
            param = None
        elif not loc:   # the body itself: empty, or JSON that is not an object
            parts.append("the request body is empty: it must be a JSON object" if err.get("type") == "missing"
                         else f"the request body must be a JSON object, got {type(err.get('input')).__name__}")
        else:
            parts.append(f"{name}: {err.get('msg')}" if name else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def build_app(engine: AsyncLLMEngine, model_names: list[str], api_key: str | None = None,
              allowed_origins: list[str] | None = None,
              max_request_body: int | str = MAX_REQUEST_BODY) -> FastAPI:
    """The FastAPI app over a running AsyncLLMEngine. model_names: accepted `model` values
    (the first is the one listed by /v1/models and reported in responses); api_key: None for
    no authentication; allowed_origins: browser origins CORS allows (`*` for any), None for no
    CORS headers; max_request_body: the largest POST body read (bytes, or a size such as
    "8MiB"; larger: 413)."""
    metrics = Metrics(model_names[0])
    serving = OpenAIServing(engine, model_names, metrics)
    app = FastAPI(title="ferrum", docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    app.add_middleware(_LimitBody, max_bytes=parse_body_limit(max_request_body))  # inside auth: 401 first
    if api_key is not None:
        app.add_middleware(_RequireApiKey, api_key=api_key)
    app.add_middleware(_RequireJson)
    app.add_middleware(_CountRequests, metrics=metrics)   # outside auth and JSON: counts 401s
    if allowed_origins:  # outermost: preflight OPTIONS and error responses get CORS headers too
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    created = int(time.time())

    @app.exception_handler(FerrumError)
    async def _ferrum_error(request, e: FerrumError):
        headers = {"Retry-After": _RETRY_AFTER_S} if isinstance(e, QueueFullError) else None
        if e.http_status >= 500:   # a 503 (full queue, draining) sheds load as designed: a warning
            log.log(logging.WARNING if e.http_status == 503 else logging.ERROR, "%s: %s", type(e).__name__, e)
        return JSONResponse(ferrum_error_body(e), status_code=e.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        msg, param = _validation_message(e, request.url.path)
        return JSONResponse(error_body(msg, "invalid_request_error", 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        detail = str(e.detail)
        if e.status_code == 400 and detail == "There was an error parsing the body":
            # FastAPI's text for a body json.loads fails on other than by a JSONDecodeError
            detail = ("request body is not JSON that can be read: not valid UTF-8, nested too deep, or an "
                      f"integer of more than {sys.get_int_max_str_digits()} digits")
        return JSONResponse(error_body(detail, kind, e.status_code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "internal_error", 500),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "ferrum",
                "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in model_names[:1]]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)   # 404 for a name this server does not answer to
        return model_card(model_id)

    add_responses_routes(app, serving)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        tok = engine.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        special = body.add_special_tokens   # None: true for a prompt, false for messages (vLLM)
        if body.prompt is not None:
            ids = await asyncio.to_thread(tok.encode, body.prompt,
                                          add_special_tokens=special is not False)
        else:
            ids = (await asyncio.to_thread(
                prepare_chat, tok, body.messages, tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                split_special_tokens=body.split_special_tokens,
                add_special_tokens=special is True,
                chat_template_kwargs=body.chat_template_kwargs)).prompt_token_ids
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if body.return_token_strs:   # vLLM's: each id's vocabulary string (e.g. "Ġworld")
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        if engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        vocab = engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                      param="tokens")
        # special tokens kept: the ids of a chat prompt (/tokenize with messages) must decode to
        # that prompt, <|im_start|> and all, not to its bare text
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        s = engine.status()
        if not s["healthy"]:
            return JSONResponse({"status": "unhealthy", "error": s.get("error")}, status_code=503)
        return {"status": "ok"}

    # vLLM's probe aliases: /ping (SageMaker's health check, GET or POST) answers as /health
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version():
        return {"version": ferrum.__version__}

    @app.get("/status")
    async def status():
        return engine.status()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(engine.status()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening: connections are refused until
    the server starts, and a port that is taken fails now, before the model loads. Raises
    AddressInUseError (taken) or CannotListenError (a host that does not resolve or is not
    this machine's)."""
    sock = None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        if isinstance(e, socket.gaierror):   # the name or address does not resolve
            hint = f"--host {host!r} is not a host name or address this machine can resolve"
        elif e.errno == errno.EADDRINUSE:
            hint = "is another server running there? Pick another --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            hint = f"{host} is not an address of this machine; pick another --host (0.0.0.0: all)"
        else:
            hint = "pick another --host or --port"
        cls = AddressInUseError if e.errno == errno.EADDRINUSE else CannotListenError
        raise cls(f"cannot listen on {host}:{port}: {e.strerror or e}; {hint}") from e
    return sock


def _log_config(verbose: bool, log_requests: bool) -> dict:
    """uvicorn's logging config with every line on stderr: its own messages at INFO only
    with -v, one access line per request (client, request line, status) unless disabled."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    config["loggers"]["uvicorn"]["level"] = "INFO" if verbose else "WARNING"
    config["loggers"]["uvicorn.error"]["level"] = "INFO" if verbose else "WARNING"
    config["loggers"]["uvicorn.access"]["level"] = "INFO" if log_requests else "WARNING"
    return config


def serve(args) -> int:
    """Bind the port, build the engine from the CLI flags, then serve until SIGTERM / Ctrl-C
    (and drain, see the module docstring). Raises AddressInUseError when the port is taken,
    CannotListenError for a host it cannot listen on (both before loading anything)."""
    from ferrum.engine.llm_engine import LLMEngine
    from ferrum.entrypoints.args import config_from_args

    sock = bind_socket(args.host, args.port)
    print(f"ferrum: loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        engine = AsyncLLMEngine(LLMEngine(config_from_args(args)))
    except BaseException:
        sock.close()
        raise
    # Clients must name the served name; without --served-model-name the model argument as
    # given (e.g. "smollm2" or a path) and the store's name for it are both accepted.
    names = ([args.served_model_name] if args.served_model_name else
             list(dict.fromkeys(n for n in (args.model, engine.engine.model_name) if n)))
    app = build_app(engine, names, args.api_key, args.allowed_origins, args.max_request_body)
    log_requests = not args.disable_log_requests
    config = uvicorn.Config(app, timeout_graceful_shutdown=args.shutdown_timeout + _FLUSH_S,
                            access_log=log_requests,
                            log_config=_log_config(getattr(args, "verbose", False), log_requests))
    ready = (f"ferrum: serving {names[0]!r} on http://{args.host}:{args.port}/v1 "
             f"(max_model_len {engine.max_model_len})")
    # uvicorn handles SIGTERM while it serves (the drain), then raises it again for the handler
    # it found. The default one would kill the process before engine.shutdown() below (TP ranks
    # would then die of their parent-death SIGKILL); a no-op lets serve return 0 instead.
    in_main = threading.current_thread() is threading.main_thread()   # signals are the main thread's
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None) if in_main else None
    try:
        _Server(config, ready, engine, args.shutdown_timeout).run(sockets=[sock])
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        engine.shutdown()
        sock.close()
    return 0


class _Server(uvicorn.Server):
    """uvicorn.Server that prints `ready` to stderr once its socket listens (uvicorn's own
    start-up line is an INFO log, hidden without -v), and shuts down gracefully: on SIGTERM /
    Ctrl-C uvicorn stops accepting connections and waits for the open requests; those still
    running after `drain_s` seconds are ended by stopping the engine, so each stream ends with
    an error event and [DONE] (`OpenAIServing._stream_errors`; Responses: response.failed) and
    each non-streaming request gets a 503, instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, ready: str, engine: AsyncLLMEngine, drain_s: float):
        super().__init__(config)
        self.ready, self.engine, self.drain_s = ready, engine, drain_s

    async def shutdown(self, sockets=None) -> None:
        error = ServerShuttingDownError(
            f"the server is shutting down: this request did not finish within its "
            f"--shutdown-timeout of {self.drain_s:g} s")
        deadline = asyncio.get_running_loop().call_later(self.drain_s, self.engine.stop, error)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            deadline.cancel()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(self.ready, file=sys.stderr, flush=True)
