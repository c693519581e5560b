"""Completions and chat completions over an AsyncLLMEngine: prompt handling, engine requests,
OpenAI response bodies and SSE streams.

One API request becomes one engine request per prompt (the `n` samples of a prompt share one
engine request). Choice index = prompt index * n + sample index. `usage.prompt_tokens` counts
each prompt once; `usage.completion_tokens` counts every generated token of every choice,
including a final EOS / stop token (as vLLM does).

A client that goes away aborts its engine requests: streaming responses (EventStream) are
cancelled by Starlette when the client disconnects and close their engine streams; non-streaming
ones watch the connection themselves.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ferrum.engine.async_engine import AsyncLLMEngine
from ferrum.entrypoints.openai.logprobs import (TokenFormatter, chat_logprobs, completion_logprobs,
                                                prompt_logprobs_json, prompt_token_texts, ready_tokens,
                                                token_texts, top_n)
from ferrum.entrypoints.chat_utils import prepare_chat
from ferrum.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from ferrum.errors import (FerrumError, InvalidRequestError, ModelNotFoundError, PromptTooLongError,
                           RequestFailedError, check_prompt_len, prompt_named)
from ferrum.metrics import Metrics
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import MAX_N, SamplingParams
from ferrum.tool_parsers import ToolCallStreamer, ToolParser


class ClientDisconnectedError(FerrumError):
    """The client went away before the answer was ready (nobody receives this status)."""

    http_status = 499
    error_type = "client_closed_request"


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict:
    """OpenAI-style error: {"error": {"message", "type", "param", "code"}}. code is the HTTP
    status (an int), as vLLM sends it (its ErrorInfo.code); OpenAI sends a string or null there,
    and its Python client turns any value into one (APIError.code: "400")."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def ferrum_error_body(e: FerrumError) -> dict:
    return error_body(str(e), e.error_type, e.http_status, getattr(e, "param", None))


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def system_fingerprint(config) -> str:
    """OpenAI's `system_fingerprint`: names the backend configuration that produced an answer
    (with `seed`, equal fingerprints mean equal set-ups). Here "fp_" + 12 hex digits of the
    SHA-256 of the ferrum version and the whole EngineConfig (model, dtype, device, TP size,
    cache and scheduler settings)."""
    import dataclasses
    import hashlib
    from ferrum import __version__
    text = json.dumps([__version__, dataclasses.asdict(config)], sort_keys=True, default=str)
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:12]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI `usage`; `prompt_tokens_details.cached_tokens`: prompt tokens served from the
    prefix cache (`RequestOutput.num_cached_tokens`)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class _Prompt:
    """One prompt: its text (None when given as token ids and there is no tokenizer) and ids.
    cut_from: the prompt's length before truncate_prompt_tokens cut it (None: not cut)."""

    def __init__(self, text: str | None, token_ids: list[int], cut_from: int | None = None):
        self.text, self.token_ids, self.cut_from = text, token_ids, cut_from


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output). Closing or cancelling the
    merged iterator cancels every inner one, which aborts their requests."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s):
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer below
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class EventStream(StreamingResponse):
    """An SSE response (text/event-stream) over `body` that closes the engine streams it reads
    when it ends, however it ends. A client gone before the first chunk makes Starlette cancel
    the response before `body` is iterated; the generators' own clean-up never runs then, and
    the requests would generate, unread, to max_tokens. Closing a stream that ended does nothing."""

    def __init__(self, body: AsyncIterator[str], streams: list[AsyncIterator[RequestOutput]]):
        super().__init__(body, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                await s.aclose()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection. The body has been read already, so the
    server's receive() only ever answers with http.disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """The handlers behind /v1/completions and /v1/chat/completions.

    engine: a running AsyncLLMEngine. model_names: names accepted in `model` (the first is
    reported in responses). metrics: where latencies and token counts go. Tool calls under
    tool_choice "auto" are read with the engine's `tool_call_parser` (see `ferrum.tool_parsers`).
    """

    def __init__(self, engine: AsyncLLMEngine, model_names: list[str], metrics: Metrics):
        self.engine = engine
        self.model_names = model_names
        self.metrics = metrics
        self.tool_parser = engine.engine.config.tool_call_parser
        self.tokenizer = engine.tokenizer
        self.fmt = TokenFormatter(self.tokenizer)
        self.system_fingerprint = system_fingerprint(engine.engine.config)
        # the model's generation_config.json defaults (--generation-config): fields a request
        # leaves unset take them (max_tokens too, for requests where it may be left out)
        self.sampling_defaults = engine.engine.sampling_defaults

    # ---- shared ----------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The served name for `model`; raises ModelNotFoundError (404) for another name."""
        if model is not None and model not in self.model_names:
            raise ModelNotFoundError(f"model {model!r} does not exist; this server serves "
                                     f"{', '.join(repr(m) for m in self.model_names)}")
        return self.model_names[0]

    def _prompt(self, p: str | list[int], need_text: bool = False, param: str = "prompt") -> _Prompt:
        """Tokenize a text prompt; decode token ids only when the text is needed (echo).
        param: the prompt's field, named in errors ("prompt", "prompt[1]")."""
        if isinstance(p, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send the prompt as token ids",
                                          param="prompt")
            return _Prompt(p, self.tokenizer.encode(p, param=param))
        text = (self.tokenizer.decode(p, skip_special_tokens=False)
                if need_text and self.tokenizer else None)
        return _Prompt(text, list(p))

    @staticmethod
    def _response_id(prefix: str, req, raw: Request | None) -> str:
        """The answer's id: `prefix`-<the body's request_id, else the X-Request-Id header's, else
        a random hex>, as vLLM names it. The engine's own ids stay unique (`_start` adds to a
        random one), so two requests may share a client's id. Raises InvalidRequestError for an
        id of more than 256 characters or with control characters (it goes into logs)."""
        given = req.request_id
        param = "request_id"
        if given is None and raw is not None and (given := raw.headers.get("x-request-id")) is not None:
            param = "X-Request-Id"
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not 1 <= len(given) <= 256 or not given.isprintable():
            raise InvalidRequestError(f"{param} must be 1 to 256 printable characters, got {given[:40]!r}"
                                      f"{'...' if len(given) > 40 else ''}", param=param)
        return f"{prefix}-{given}"

    def _truncation(self, req) -> int | None:
        """vLLM's truncate_prompt_tokens as a token count (-1: max_model_len), checked before
        any prompt is tokenized. Raises InvalidRequestError for 0, below -1 or above
        max_model_len."""
        k, limit = req.truncate_prompt_tokens, self.engine.max_model_len
        if k is not None and (k == 0 or k < -1 or k > limit):
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, "
                                      f"max_model_len {limit}], got {k}", param="truncate_prompt_tokens")
        return limit if k == -1 else k

    def _truncate(self, k: int | None, prompt: _Prompt, encoded: bool = False) -> _Prompt:
        """The prompt's last k tokens (`_truncation`; None: the prompt as it is), its text
        decoded from them when it had one (echo shows what the model read). encoded: the ids
        are the tokenizer's encoding of a text prompt, whose BOS stays first (k tokens in all),
        as vLLM's left truncation inside the tokenizer keeps it; a prompt of token ids, or a
        rendered chat, keeps just its last k."""
        if k is None or len(prompt.token_ids) <= k:
            return prompt
        ids = prompt.token_ids[-k:]
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if encoded and k > 1 and bos is not None and prompt.token_ids[0] == bos:
            ids = [bos] + prompt.token_ids[-(k - 1):]
        text = self.tokenizer.decode(ids, skip_special_tokens=False) if prompt.text is not None else None
        return _Prompt(text, ids, cut_from=len(prompt.token_ids))

    def _max_tokens(self, num_prompt: int, requested: int | None, param: str,
                    prompt_param: str = "prompt", cut_from: int | None = None) -> int | None:
        """max_tokens for a prompt of `num_prompt` tokens: `requested`, or when None what is
        left of the context, at most the model's default max_tokens (generation_config.json's
        max_new_tokens, as vLLM). Raises PromptTooLongError when they do not fit in
        max_model_len, naming `prompt_param` (the prompt's field) or `param` (the max_tokens
        field); or truncate_prompt_tokens when it cut the prompt (`cut_from`: the length
        before), as that field set the prompt's length and the client may not shorten it."""
        limit = self.engine.max_model_len
        if cut_from is not None:
            room = limit - (requested if isinstance(requested, int) and requested > 0 else 1)
            if num_prompt > room:
                what = prompt_param if prompt_param.startswith("prompt[") else prompt_param.split("[")[0]
                asked = (f" and {param} is {requested}" if room < limit - 1 else
                         " (at least one generated token must fit)")
                raise PromptTooLongError(
                    f"truncate_prompt_tokens cut {what} from {cut_from} to its last {num_prompt} tokens"
                    f"{asked}, which exceeds max_model_len {limit}: set truncate_prompt_tokens to at "
                    f"most {room}", param="truncate_prompt_tokens")
        check_prompt_len(num_prompt, limit, prompt_param)
        if requested is None:
            return min(limit - num_prompt, self.sampling_defaults.get("max_tokens", limit))
        if isinstance(requested, int) and requested > 0 and num_prompt + requested > limit:
            # which prompt of a batch: prompt[i] (a single one, or messages / input: "prompt")
            what = prompt_param if prompt_param.startswith("prompt[") else "prompt"
            raise PromptTooLongError(
                f"{what} has {num_prompt} tokens and {param} is {requested}: {num_prompt} + "
                f"{requested} = {num_prompt + requested} tokens exceed max_model_len {limit}; "
                f"lower {param} to at most {limit - num_prompt}", param=param)
        return requested

    async def _start(self, request_id: str, prompts: list[_Prompt], params: list[SamplingParams],
                     names: list[str] | None = None,
                     cache_salt: str | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Add one engine request per prompt; if one is refused, abort those already added.
        More prompts than the queue holds could never all be admitted: InvalidRequestError
        (400), not QueueFullError's 503 "retry later". names: each prompt's field ("prompt[1]"),
        which names the engine's errors about that prompt (it checks one prompt, "prompt")."""
        if len(prompts) > self.engine.max_waiting:
            raise InvalidRequestError(f"{len(prompts)} prompts in one request exceed the server's queue "
                                      f"limit (--max-waiting {self.engine.max_waiting}): send at most "
                                      f"{self.engine.max_waiting} per request", param="prompt")
        samples = sum(sp.n for sp in params)
        if samples > MAX_N:   # n is capped per prompt; 4,096 prompts x n 16,384 would still OOM the server
            raise InvalidRequestError(f"{len(prompts)} prompts x n {params[0].n} = {samples} samples in one "
                                      f"request exceed {MAX_N}: lower n or send fewer prompts", param="n")
        streams = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                with prompt_named(names[i] if names else "prompt"):
                    streams.append(await self.engine.add_request(f"{request_id}-{i}", None, sp,
                                                                 prompt_token_ids=p.token_ids,
                                                                 cache_salt=cache_salt))
        except BaseException:
            for i in range(len(streams)):
                self.engine.abort(f"{request_id}-{i}")
            raise
        self.metrics.add_tokens(prompt=sum(len(p.token_ids) for p in prompts))
        return streams

    async def _tracked(self, streams, t0: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """merge_streams plus metrics: TTFT, TPOT, e2e, token counts, finish reasons. Raises
        RequestFailedError (HTTP 500, or an SSE error event) for an output the engine failed;
        the other prompts' requests are then aborted."""
        first: dict[int, float] = {}               # stream -> time of its first token
        done: set[tuple[int, int]] = set()         # (stream, sample) already finished
        async for i, out in merge_streams(streams):
            if out.error is not None:  # the engine failed this request: an error body / event
                raise RequestFailedError(f"the request failed in the engine: {out.error}")
            now = time.perf_counter()
            new = sum(c.num_delta_tokens for c in out.outputs)
            if new:
                self.metrics.add_tokens(generated=new)
                if i not in first:
                    first[i] = now
                    self.metrics.observe_ttft(now - t0)
            for c in out.outputs:  # samples of n > 1 finish at different steps
                if c.finished and (i, c.index) not in done:
                    done.add((i, c.index))
                    self.metrics.observe_finish(c.finish_reason)
                    if len(c.token_ids) > 1 and i in first:
                        self.metrics.observe_tpot((now - first[i]) / (len(c.token_ids) - 1))
            if out.finished:
                self.metrics.observe_e2e(now - t0)
            yield i, out

    async def _collect(self, streams, t0: float, raw: Request) -> list[RequestOutput]:
        """The final output of each stream; aborts everything if the client disconnects."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def consume():
            async for i, out in self._tracked(streams, t0):
                finals[i] = out

        consumer = asyncio.create_task(consume())
        watcher = asyncio.create_task(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():  # the client left (or we were cancelled): abort the requests
                consumer.cancel()
                for s in streams:    # also those the consumer has not started reading
                    await s.aclose()
        if not consumer.done():
            raise ClientDisconnectedError("the client closed the connection; request aborted")
        consumer.result()  # re-raise an engine error
        return finals

    def _usage(self, prompts: list[_Prompt], completion_tokens: int,
               outputs: list[RequestOutput | None]) -> dict:
        """usage over a request's prompts; `outputs`: the latest output of each prompt."""
        return usage(sum(len(x.token_ids) for x in prompts), completion_tokens,
                     sum(o.num_cached_tokens for o in outputs if o is not None))

    def _chunk_usage(self, req, prompt: _Prompt, out: RequestOutput | None, completion_tokens: int) -> dict:
        """The `usage` member of a stream chunk that holds a choice: none without
        stream_options.include_usage; null with it (OpenAI: usage comes in one last chunk);
        with continuous_usage_stats too (vLLM), the choice's prompt and its tokens so far."""
        if not req.include_usage:
            return {}
        if not req.stream_options.continuous_usage_stats:
            return {"usage": None}
        return {"usage": usage(len(prompt.token_ids), completion_tokens,
                               out.num_cached_tokens if out is not None else 0)}

    async def _stream_errors(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """An error after the 200 header went out becomes an SSE error event, then [DONE]."""
        try:
            async for chunk in gen:
                yield chunk
        except FerrumError as e:
            yield _sse(ferrum_error_body(e))
            yield _sse("[DONE]")

    # ---- /v1/completions ------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        t0 = time.perf_counter()
        model = self.check_model(req.model)
        # tokenizing a long prompt takes seconds: in a thread, so the event loop serves on
        many = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
        given = req.prompts()
        keep = self._truncation(req)
        names = [f"prompt[{i}]" if many else "prompt" for i in range(len(given))]
        prompts = await asyncio.to_thread(lambda: [
            self._truncate(keep, self._prompt(p, req.echo, name), isinstance(p, str))
            for p, name in zip(given, names)])
        max_tokens = 1 if req.echo_only else req.max_tokens
        # a prompt too long is named as its other errors are: prompt[i] of a batch of prompts
        params = [req.sampling_params(self._max_tokens(len(p.token_ids), max_tokens, "max_tokens", name,
                                                       p.cut_from), self.sampling_defaults)
                  for p, name in zip(prompts, names)]
        rid = self._response_id("cmpl", req, raw)
        streams = await self._start(f"cmpl-{uuid.uuid4().hex}", prompts, params, names, req.cache_salt)
        if req.stream:
            return EventStream(self._stream_errors(
                self._completion_stream(rid, model, req, prompts, streams, t0)), streams)
        finals = await self._collect(streams, t0, raw)
        choices, ntok = [], 0
        for i, (p, out) in enumerate(zip(prompts, finals)):
            prompt_lps = self._prompt_logprobs(req, p.token_ids, out)   # one list, every choice
            for c in out.outputs:
                ids, text, reason, stop = c.token_ids, c.text, c.finish_reason, c.stop_reason
                if req.echo_only:  # the one token generated is not part of the answer
                    ids, text, reason, stop = [], "", "length", None
                ntok += len(ids)
                prefix = (p.text or "") if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(
                        self.fmt, ids, (c.logprobs or [])[:len(ids)],
                        token_texts(c.text, c.token_text_ends, 0, len(ids)), len(prefix),
                        req.return_tokens_as_token_ids)
                    if req.echo:  # the prompt tokens' logprobs first
                        echoed = self._echo_logprobs(p, out, req)
                        lp = {k: echoed[k] + lp[k] for k in lp}
                choices.append({"index": i * req.n + c.index, "text": prefix + text,
                                "logprobs": lp, "finish_reason": reason, "stop_reason": stop,
                                "prompt_logprobs": prompt_lps,
                                **_token_ids(req, {"prompt_token_ids": p.token_ids, "token_ids": ids})})
        choices.sort(key=lambda c: c["index"])
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": model, "system_fingerprint": self.system_fingerprint,
                             "choices": choices, "usage": self._usage(prompts, ntok, finals)})

    def _echo_logprobs(self, p: _Prompt, out: RequestOutput, req: CompletionRequest) -> dict:
        """Completions-format logprobs of the echoed prompt tokens (text offsets from 0; the
        first token's are null): the top `logprobs` of the engine's prompt logprobs, which a
        larger `prompt_logprobs` may have asked more of."""
        return completion_logprobs(self.fmt, p.token_ids,
                                   top_n(out.prompt_logprobs or [], p.token_ids, req.logprobs),
                                   prompt_token_texts(self.tokenizer, p.token_ids), 0,
                                   req.return_tokens_as_token_ids)

    def _prompt_logprobs(self, req, token_ids: list[int], out: RequestOutput) -> list | None:
        """vLLM's `prompt_logprobs` of a finished request (None when not asked for)."""
        if req.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(self.fmt, token_ids, out.prompt_logprobs or [],
                                    req.prompt_logprobs)

    async def _completion_stream(self, rid, model, req: CompletionRequest, prompts, streams, t0):
        created = int(time.time())

        fingerprint = self.system_fingerprint

        latest: list[RequestOutput | None] = [None] * len(prompts)

        sent_ids: dict[int, int] = {}        # choice index -> token ids already streamed

        def chunk(index, text, logprobs=None, finish_reason=None, stop_reason=None, completion_tokens=0,
                  token_ids=()):
            ids = {}
            if req.return_token_ids:   # the prompt's ids in a choice's first chunk (vLLM)
                ids = {"token_ids": list(token_ids)}
                if index not in sent_ids:
                    ids["prompt_token_ids"] = prompts[index // req.n].token_ids
                sent_ids[index] = sent_ids.get(index, 0) + len(token_ids)
            return _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "system_fingerprint": fingerprint,
                         "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish_reason, "stop_reason": stop_reason, **ids}],
                         **self._chunk_usage(req, prompts[index // req.n], latest[index // req.n],
                                             completion_tokens)})

        n = req.n
        sent_tokens: dict[int, int] = {}     # choice index -> tokens already streamed
        text_len: dict[int, int] = {}        # choice index -> characters already streamed
        finished: set[int] = set()
        echo_len = [len(p.text or "") if req.echo else 0 for p in prompts]
        ntok = 0
        async for i, out in self._tracked(streams, t0):
            latest[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                if idx in finished:
                    continue
                if req.echo and idx not in text_len:  # the prompt first, with its logprobs
                    p = prompts[i]
                    text_len[idx] = echo_len[i]
                    yield chunk(idx, p.text or "",
                                self._echo_logprobs(p, out, req)
                                if req.logprobs is not None else None)
                if req.echo_only:
                    if c.finished:
                        finished.add(idx)
                        yield chunk(idx, "", None, "length", completion_tokens=len(c.token_ids))
                    continue
                start = sent_tokens.get(idx, 0)
                streamed = text_len.get(idx, 0) + len(c.delta_text)
                ready = start
                if req.logprobs is not None:  # tokens whose text is final and sent
                    ready = ready_tokens(c.token_text_ends, start, len(c.token_ids),
                                         streamed - echo_len[i], c.finished)
                if not c.delta_text and not c.finished and ready == start:
                    continue
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(
                        self.fmt, c.token_ids[start:ready], (c.logprobs or [])[start:ready],
                        token_texts(c.text, c.token_text_ends, start, ready),
                        echo_len[i] + (c.token_text_ends[start - 1] if start and c.token_text_ends else 0),
                        req.return_tokens_as_token_ids)
                sent_tokens[idx] = ready
                text_len[idx] = streamed
                if c.finished:
                    finished.add(idx)
                    ntok += len(c.token_ids)
                # only when asked: a slice from the choice's start, per chunk, grows with the answer
                new_ids = (c.token_ids[sent_ids.get(idx, 0):ready if req.logprobs is not None else None]
                           if req.return_token_ids else ())
                yield chunk(idx, c.delta_text, lp, c.finish_reason, c.stop_reason, len(c.token_ids), new_ids)
        if req.include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "system_fingerprint": fingerprint, "choices": [],
                        "usage": self._usage(prompts, ntok, latest)})
        yield _sse("[DONE]")

    # ---- /v1/chat/completions -------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request):
        t0 = time.perf_counter()
        model = self.check_model(req.model)
        keep = self._truncation(req)
        chat = await asyncio.to_thread(   # rendering + tokenizing, off the event loop
            prepare_chat, self.tokenizer, req.messages, tools=req.tools,
            tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
            response_format=req.response_format, tool_parser=self.tool_parser,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            split_special_tokens=req.split_special_tokens, add_special_tokens=req.add_special_tokens,
            chat_template_kwargs=req.template_kwargs())
        prompts = [self._truncate(keep, _Prompt(None, chat.prompt_token_ids))]
        ids = prompts[0].token_ids
        requested = req.requested_max_tokens()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = chat.sampling_params(req.sampling_params(
            self._max_tokens(len(ids), requested, param, "messages", prompts[0].cut_from),
            self.sampling_defaults))
        rid = self._response_id("chatcmpl", req, raw)
        streams = await self._start(f"chatcmpl-{uuid.uuid4().hex}", prompts, [params],
                                    cache_salt=req.cache_salt)
        top_n = req.top_logprobs or 0
        if req.stream:
            return EventStream(self._stream_errors(
                self._chat_stream(rid, model, req, prompts, streams, t0, top_n, chat.tool_parser)),
                streams)
        (out,) = await self._collect(streams, t0, raw)
        echoed = req.echoed_text()
        choices = [{"index": c.index, **chat_message(chat.tool_parser, c.text, c.finish_reason, echoed),
                    "stop_reason": c.stop_reason, **_token_ids(req, {"token_ids": c.token_ids}),
                    "logprobs": (chat_logprobs(
                        self.fmt, c.token_ids, c.logprobs or [],
                        token_texts(c.text, c.token_text_ends, 0, len(c.token_ids)), top_n,
                        req.return_tokens_as_token_ids) if req.logprobs else None)}
                   for c in out.outputs]
        ntok = sum(len(c.token_ids) for c in out.outputs)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": model, "system_fingerprint": self.system_fingerprint,
                             "choices": choices, "usage": self._usage(prompts, ntok, [out]),
                             # vLLM puts them on the response: the choices share one prompt
                             "prompt_logprobs": self._prompt_logprobs(req, ids, out),
                             **_token_ids(req, {"prompt_token_ids": ids})})

    async def _chat_stream(self, rid, model, req: ChatCompletionRequest, prompts, streams, t0, top_n,
                           tool_parser: ToolParser | None):
        created = int(time.time())

        fingerprint = self.system_fingerprint

        latest: list[RequestOutput | None] = [None]

        sent_ids: dict[int, int] = {}        # choice index -> token ids already streamed

        def chunk(index, delta, logprobs=None, finish_reason=None, stop_reason=None, completion_tokens=0,
                  token_ids=()):
            ids, first = {}, {}
            if req.return_token_ids:   # the prompt's ids in the stream's first chunk (vLLM)
                ids = {"token_ids": list(token_ids)}
                if not sent_ids:
                    first = {"prompt_token_ids": prompts[0].token_ids}
                sent_ids[index] = sent_ids.get(index, 0) + len(token_ids)
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "system_fingerprint": fingerprint, **first,
                         "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish_reason, "stop_reason": stop_reason, **ids}],
                         **self._chunk_usage(req, prompts[0], latest[0], completion_tokens)})

        echoed = req.echoed_text()
        for j in range(req.n):  # the role comes first, as OpenAI sends it (then vLLM's echo)
            yield chunk(j, {"role": "assistant", "content": ""})
            if echoed:
                yield chunk(j, {"content": echoed})
        streamers = {j: ToolCallStreamer(tool_parser) for j in range(req.n)} if tool_parser else {}
        sent_tokens: dict[int, int] = {}
        streamed: dict[int, int] = {}       # choice index -> characters already streamed
        finished: set[int] = set()
        ntok = 0
        async for _, out in self._tracked(streams, t0):
            latest[0] = out
            for c in out.outputs:
                if c.index in finished:
                    continue
                start = sent_tokens.get(c.index, 0)
                streamed[c.index] = streamed.get(c.index, 0) + len(c.delta_text)
                ready = start
                if req.logprobs:  # tokens whose text is final and sent
                    ready = ready_tokens(c.token_text_ends, start, len(c.token_ids),
                                         streamed[c.index], c.finished)
                if not c.delta_text and not c.finished and ready == start:
                    continue
                lp = (chat_logprobs(self.fmt, c.token_ids[start:ready], (c.logprobs or [])[start:ready],
                                    token_texts(c.text, c.token_text_ends, start, ready), top_n,
                                    req.return_tokens_as_token_ids) if req.logprobs else None)
                sent_tokens[c.index] = ready
                content, calls = c.delta_text, []
                finish_reason = c.finish_reason
                streamer = streamers.get(c.index)
                if streamer is not None:
                    content, calls = streamer.feed(c.delta_text, final=c.finished)
                    if c.finished:
                        # as the non-streamed answer (chat_message): "tool_calls" only when the
                        # whole output holds calls, not for a call that broke off after its
                        # first deltas were sent (a stop string or EOS inside its JSON)
                        finish_reason = tool_parser.finish_reason(finish_reason, streamer.calls_found)
                if c.finished:
                    finished.add(c.index)
                    ntok += len(c.token_ids)
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = calls
                if not delta and not c.finished and lp is None:
                    continue
                new_ids = (c.token_ids[sent_ids.get(c.index, 0):ready if req.logprobs else None]
                           if req.return_token_ids else ())
                yield chunk(c.index, delta, lp, finish_reason, c.stop_reason, len(c.token_ids), new_ids)
        if req.include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "system_fingerprint": fingerprint, "choices": [],
                        "usage": self._usage(prompts, ntok, latest)})
        yield _sse("[DONE]")


def _token_ids(req, ids: dict[str, list[int]]) -> dict:
    """vLLM's return_token_ids members of a whole (not streamed) answer: the ids, or null
    members when not asked for (vLLM's answers always carry them)."""
    return {k: (list(v) if req.return_token_ids else None) for k, v in ids.items()}


def chat_message(tool_parser: ToolParser | None, text: str, finish_reason: str | None,
                 echoed: str = "") -> dict:
    """{"message": {...}, "finish_reason": ...} of a finished chat choice: with a tool parser,
    the calls found in `text` go to message.tool_calls (content: the rest, or null; see
    `ToolParser.extract`) and the finish_reason is `ToolParser.finish_reason`'s. `echoed`
    (vLLM's echo) goes before the content."""
    message = {"role": "assistant", "content": text}
    if tool_parser is not None:
        content, calls = tool_parser.extract(text)
        message["content"] = content
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
            finish_reason = tool_parser.finish_reason(finish_reason, called=True)
    if echoed:
        message["content"] = echoed + (message["content"] or "")
    return {"message": message, "finish_reason": finish_reason}
