"""AsyncLLMEngine: the LLMEngine behind asyncio, for the HTTP server.

One background thread owns the LLMEngine (which is not thread-safe) and runs its step loop, so
the event loop never waits for a forward pass. Requests and aborts reach that thread through a
thread-safe command queue it drains between steps; outputs go back to each request's
`asyncio.Queue` via `loop.call_soon_threadsafe`. While no request is unfinished the thread
blocks on the command queue (no polling, no CPU).

A step that fails for some requests ends only their streams (their last output has
finish_reason "error" and `error` set; the server turns it into an error body). If `step()`
itself raises (the executor is broken: a dead TP rank, a device fault), the engine is dead:
every open stream raises EngineDeadError, and so does every later `add_request`;
`status()["healthy"]` turns False with the reason in `status()["error"]` (the server answers
/health 503 with it). A broken executor is also reported while the loop is idle.
`stop(error)` ends the loop the same way on purpose (a server whose drain time ran out): every
open stream raises `error` at once (not after the step running then, which may outlast the
server's last seconds) and every later `add_request` raises it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import uuid
import weakref

from ferrum.errors import EngineDeadError
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import SamplingParams

log = logging.getLogger("ferrum")

_END = object()            # pushed to a stream whose request was aborted: the iterator stops


class _Stream:
    """One request's output channel: the engine thread puts, one asyncio task gets."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        """Thread-safe. `item`: a RequestOutput, an exception to raise, or _END."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
    """Hand a step's outputs to the queues of one event loop in a single thread-safe call."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    """Complete an add_request future from the engine thread (it may be cancelled already)."""
    def done():
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(None)
    try:
        fut.get_loop().call_soon_threadsafe(done)
    except RuntimeError:
        pass


class RequestStream:
    """The outputs of one request of an AsyncLLMEngine, as an async iterator of RequestOutput.

    Leaving before the final output aborts the request (its KV blocks are freed): aclose() /
    close(), a cancel while waiting for the next output, or dropping the stream. A class, not an
    async generator, so that this also holds for a stream never iterated: a generator that has
    not started runs no clean-up when closed, and a server response that a client abandons
    before its first read (Starlette then cancels it before the body is iterated) would leave
    its request generating, unread, to max_tokens."""

    def __init__(self, engine: "AsyncLLMEngine", stream: _Stream):
        self._engine, self._stream, self._done = engine, stream, False
        self.request_id = stream.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:   # cancelled while waiting: the consumer left
            self.close()
            raise
        if item is _END:
            self._finish()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    def _finish(self) -> None:
        self._done = True
        self._engine._open.discard(self._stream)

    def close(self) -> None:
        """Abort the request unless its stream has ended (idempotent, returns at once)."""
        if not self._done:
            self._finish()
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
            pass


class AsyncLLMEngine:
    """Wraps an LLMEngine (or anything with its add_request / abort_request / step /
    has_unfinished_requests / status / shutdown) and starts its step thread.

    `await add_request(...)` -> a RequestStream, an async iterator of RequestOutput (cumulative
    text and ids, plus `delta_text` / `num_delta_tokens` for streaming); the last output has
    `finished=True`. Leaving it early (aclose, a cancelled task, a client gone, dropping it,
    also unread) aborts the request and frees its KV blocks. `abort(request_id)` ends a request
    from outside; its iterator then stops without a final output.
    """

    def __init__(self, engine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}    # touched by the engine thread only
        # asyncio side, for stop(): streams of requests sent to the engine thread, and the futures
        # of adds it has not taken yet (queued behind a long step)
        self._open: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self._pending: set[asyncio.Future] = set()
        self._closed: EngineDeadError | None = None     # stop()'s error: refuses new requests at once
        self._lock = threading.Lock()             # orders "dead" against new commands
        self._dead: BaseException | None = None
        self._stopping: EngineDeadError | None = None   # set by a stop command: the loop ends with it
        self._status = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="ferrum-engine", daemon=True)
        self._thread.start()

    # ---- properties of the wrapped engine (read-only after construction, so thread-safe) --------
    @property
    def tokenizer(self):
        """The wrapped engine's Tokenizer (None for a model without one)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Context length in tokens (prompt + output)."""
        return self.engine.max_model_len

    @property
    def max_waiting(self) -> int:
        """Most queued requests (`--max-waiting`); more raise QueueFullError."""
        return self.engine.config.scheduler.max_waiting

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""
        return self.engine.vocab_size

    # ---- asyncio side ---------------------------------------------------------------------------
    async def add_request(self, request_id: str | None, prompt: str | None,
                          params: SamplingParams | None = None,
                          prompt_token_ids: list[int] | None = None,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request (text `prompt` or `prompt_token_ids`) and return its output stream;
        cache_salt: see LLMEngine.add_request.

        Raises what LLMEngine.add_request raises (InvalidRequestError, PromptTooLongError,
        OutOfKvCacheError, QueueFullError, ...) and EngineDeadError once the engine failed."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        structured = getattr(self.engine, "structured", None)
        if structured is not None and params is not None and params.structured_outputs is not None:
            # compile the grammar here, not in the engine thread (which would stall every
            # running request meanwhile): the engine then finds it in the cache
            await asyncio.to_thread(structured.compile, params.structured_outputs)
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is not None and params is not None and params.bad_words:
            # the same for bad_words (20,000 words tokenize in ~0.7 s): the engine thread then
            # finds them in the tokenizer's cache. A bad word's error raises here, as there
            await asyncio.to_thread(tokenizer.bad_words_token_ids, params.bad_words)
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop)
        accepted = loop.create_future()
        self._send(("add", (request_id, prompt, params, prompt_token_ids, cache_salt), stream, accepted))
        self._open.add(stream)
        self._pending.add(accepted)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added just before the cancel
            raise
        finally:
            self._pending.discard(accepted)
        return RequestStream(self, stream)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once; the engine thread frees its blocks
        before its next step). Unknown or finished ids are ignored."""
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass

    def _send(self, cmd: tuple) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead_error()
            if self._closed is not None and cmd[0] == "add":
                raise type(self._closed)(str(self._closed))
            self._cmds.put(cmd)

    def _dead_error(self) -> EngineDeadError:
        cause = self._dead
        if isinstance(cause, EngineDeadError):   # a fresh one per stream, of the same kind
            return type(cause)(str(cause))
        err = EngineDeadError(f"the engine loop failed: {type(cause).__name__}: {cause}")
        err.__cause__ = cause
        return err

    def status(self) -> dict:
        """A snapshot of LLMEngine.status() (executor status as a dict) taken by the engine
        thread after every step, when it goes idle and when work arrives at an idle engine
        (LLMEngine.status() itself must not run concurrently with a step), plus `healthy`
        (bool) and `error` (str, once dead).
        Thread-safe."""
        status = dict(self._status)
        broken = self._executor_broken()   # the root cause, when the loop died of it
        if broken is None and self._dead is not None:
            broken = self._dead_error()
        if broken is None and self._closed is not None:   # stopped; the step thread may still end its step
            broken = self._closed
        status["healthy"] = broken is None
        if broken is not None:
            status["error"] = str(broken)
        return status

    def _executor_broken(self) -> str | None:
        """Why the executor can run no more steps, asked now (thread-safe), or None."""
        health = getattr(self.engine, "health", None)
        reason = health() if health is not None else None
        return None if reason is None else f"the executor is broken: {reason}"

    def stop(self, error: EngineDeadError | None = None) -> None:
        """Stop the step thread once the step running now ends, without waiting (thread-safe):
        every open stream and every add_request still waiting for the engine thread raise
        `error` now (default EngineDeadError "the engine was shut down"), every later
        add_request at once. A stopped or dead engine ignores it."""
        error = error or EngineDeadError("the engine was shut down")
        with self._lock:
            if self._dead is not None or self._closed is not None:
                return
            self._closed = error
            self._cmds.put(("stop", error))
        for fut in list(self._pending):   # adds still queued behind the running step
            _resolve(fut, type(error)(str(error)))
        for stream in list(self._open):   # their requests cannot finish any more
            stream.put(type(error)(str(error)))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step thread (open streams get EngineDeadError) and shut the engine down."""
        self.stop()
        self._thread.join(timeout)
        self.engine.shutdown()

    # ---- engine thread ------------------------------------------------------------------------
    def _snapshot(self) -> dict:
        status = dict(self.engine.status())
        ex = status.get("executor")
        if dataclasses.is_dataclass(ex):
            status["executor"] = dataclasses.asdict(ex)
        return status

    def _run(self) -> None:
        try:
            while self._stopping is None:
                if not self.engine.has_unfinished_requests():
                    self._status = self._snapshot()
                    self._handle(self._cmds.get())      # idle: block until there is work
                    self._drain()
                    self._status = self._snapshot()     # the new work shows while its first step runs
                self._drain()
                if self._stopping is not None or not self.engine.has_unfinished_requests():
                    continue
                deliveries: dict[asyncio.AbstractEventLoop, list] = {}
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    deliveries.setdefault(stream.loop, []).append((stream.queue, out))
                # One wake-up of each event loop per step, not one per request.
                for loop, items in deliveries.items():
                    _deliver(loop, items)
                self._status = self._snapshot()   # ~0.1 ms: cheap next to a step
        except BaseException as e:  # noqa: BLE001 - any failure of the engine kills it
            log.exception("engine loop failed")
            self._die(e)
            return
        self._die(self._stopping)

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            self._handle(cmd)

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, args, stream, fut = cmd
            try:
                request_id, prompt, params, prompt_token_ids, cache_salt = args
                self.engine.add_request(request_id, prompt, params, prompt_token_ids, queue_limit=True,
                                        cache_salt=cache_salt)
            except Exception as e:  # bad request: the caller gets it, the engine goes on
                _resolve(fut, e)
                return
            self._streams[stream.request_id] = stream
            _resolve(fut, None)
        elif kind == "abort":
            try:
                self.engine.abort_request(cmd[1])
            except Exception:  # noqa: BLE001 - one request's clean-up must not stop the loop
                log.exception("aborting request %s failed", cmd[1])
            stream = self._streams.pop(cmd[1], None)
            if stream is not None:
                stream.put(_END)
        elif kind == "stop":
            self._stopping = cmd[1]

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self._dead = error
        # Nothing can be queued any more: fail what is queued and every open stream.
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _resolve(cmd[3], self._dead_error())
        for stream in self._streams.values():
            stream.put(self._dead_error())
        self._streams.clear()
        try:
            self._status = self._snapshot()
        except Exception:  # noqa: BLE001 - a broken engine may not report; keep the last one
            pass
