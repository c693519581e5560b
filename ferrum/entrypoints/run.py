"""`ferrum run`: one-shot generation from --prompt (or from piped stdin), else an interactive
chat that keeps the conversation through the model's chat template.

stdout carries only the answers; the `>>>` prompt, progress and speed go to stderr, so
`ferrum run ... > out.txt` or a pipe holds only generated text. The chat reads lines with
prompt_toolkit (history in $FERRUM_HOME/chat_history, pasted multi-line text stays one
message, `\"\"\"` starts and ends a multi-line message). Ctrl-C stops the current reply and
keeps the conversation (as ollama does); at the prompt it clears the line. Type /help in the
chat for the commands.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import sys
import threading
import time

from ferrum.entrypoints.args import config_from_args
from ferrum.errors import InvalidRequestError, RequestFailedError
from ferrum.sampling_params import SamplingParams

CHAT_HELP = """commands:
  /help                 this help
  /bye                  quit (Ctrl-D on an empty line quits too)
  /reset                forget the conversation (asks first)
  /set temperature T    sampling temperature (0 = greedy); also max_tokens N, top_p P,
                        top_k K, min_p P, repetition_penalty R, seed S, system TEXT
                        (system: resets the chat)
  /show                 the current settings
  \"\"\"                   start a multi-line message; a line ending in \"\"\" sends it
Pasted text stays one message. Ctrl-C stops a reply (the conversation keeps what was said);
at the prompt it clears the line. Up/down arrows recall earlier messages."""

# `/set NAME VALUE`: the SamplingParams field and how to parse its value
_SETTABLE = {"temperature": float, "max_tokens": int, "top_p": float, "top_k": int,
             "min_p": float, "seed": int, "repetition_penalty": float}


@contextlib.contextmanager
def sigint_flag():
    """While active, Ctrl-C (SIGINT) sets the yielded Event instead of raising
    KeyboardInterrupt, so a generation stops between engine steps, never inside one (an
    interrupted step could leave KV blocks or the scheduler half-updated)."""
    hit = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hit.set())
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, previous)


def _tokens(n: int) -> str:
    """'1 token', '3 tokens'."""
    return f"{n} token{'' if n == 1 else 's'}"


def stream(engine, prompt_ids: list[int], params: SamplingParams, out=None,
           stats: bool = True) -> tuple[str, bool]:
    """Generate and write the text to `out` (default stdout) as it comes. Returns (text,
    interrupted): Ctrl-C aborts the request at the next step boundary, frees its KV blocks
    and returns what was generated so far. With `stats`, prints tokens, TTFT and decode
    tokens/s to stderr. Raises RequestFailedError when the engine failed the request (a step
    running it raised; its blocks are freed): the text written so far is not an answer."""
    out = out or sys.stdout
    rid = engine.add_request(None, None, params, prompt_token_ids=prompt_ids)
    t0 = time.perf_counter()
    first = None
    text, n, interrupted, error, reason = "", 0, False, None, None
    with sigint_flag() as hit:
        try:
            while engine.has_unfinished_requests():
                if hit.is_set():
                    engine.abort_request(rid)
                    interrupted = True
                    break
                for o in engine.step():
                    c = o.outputs[0]
                    if first is None and c.token_ids:
                        first = time.perf_counter()
                    out.write(c.delta_text)
                    out.flush()
                    text, n = c.text, len(c.token_ids)
                    error, reason = o.error or error, c.finish_reason or reason
        except BaseException:
            engine.abort_request(rid)
            raise
    t1 = time.perf_counter()
    out.write("\n")
    out.flush()
    if error is not None:
        raise RequestFailedError(f"the request failed in the engine after {_tokens(n)} "
                                 f"(the text above is incomplete): {error}")
    # a "length" stop before max_tokens is the context's end: say so (the server's 400 cannot here)
    ctx_end = reason == "length" and (params.max_tokens is None or n < params.max_tokens)
    if ctx_end:
        print(f"[stopped at the context length, {engine.max_model_len} tokens (--ctx-size)]", file=sys.stderr)
    if stats and n:
        # one token has no decode step to time: no rate then (it printed "decode nan tokens/s")
        decode = f", decode {(n - 1) / (t1 - first):.1f} tokens/s" if n > 1 and t1 > first else ""
        print(f"[{_tokens(n)} in {t1 - t0:.2f} s; TTFT {1000 * (first - t0):.0f} ms"
              f"{decode}{'; interrupted' if interrupted else ''}]", file=sys.stderr)
    return text, interrupted


# Chat defaults of `ferrum run` where SamplingParams' (vLLM's: temperature 1.0, 16 tokens) suit
# an API more than a chat; the model's generation_config.json values come before them.
RUN_DEFAULTS = {"temperature": 0.7, "max_tokens": 256}
# `ferrum run`'s sampling flags (each None when left out)
_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def sampling_params(args, model_defaults: dict | None = None, seed: int | None = None) -> SamplingParams:
    """SamplingParams from `ferrum run`'s generation flags (validated: InvalidRequestError).
    A flag left out takes `model_defaults` (the engine's sampling_defaults, from the model's
    generation_config.json), else RUN_DEFAULTS, else SamplingParams' default. Without --seed
    the seed is `seed`, else drawn from the OS: the engine's own RNG starts from --engine-seed
    (0) in every process, so unseeded replies would repeat from run to run, which a chat
    command (as llama.cpp's --seed -1) should not do."""
    if args.seed is not None:
        seed = args.seed
    elif seed is None:
        seed = random.SystemRandom().randrange(2 ** 31)
    given = {name: value for name in _FLAGS if (value := getattr(args, name)) is not None}
    return SamplingParams(**{**RUN_DEFAULTS, **(model_defaults or {}), **given}, seed=seed, stop=args.stop)


def _check_utf8(text: str, source: str, param: str = "prompt") -> None:
    """Raise InvalidRequestError (`param`) when `text` holds bytes that were not UTF-8 (Python
    keeps them as lone surrogates: argv, and stdin under a C locale), naming their source."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{source} is not valid UTF-8: byte {ord(text[e.start]) & 0xFF:#04x} at "
                                  f"character {e.start}", param=param) from None


def _read_stdin() -> str:
    """Piped stdin as text, decoded as UTF-8 whatever the locale. Raises InvalidRequestError
    for bytes that are not UTF-8, before the model loads."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:                      # a text stream without bytes (tests, embedding)
        text = sys.stdin.read()
        _check_utf8(text, "stdin")
        return text
    data = raw.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"stdin is not valid UTF-8: byte {data[e.start]:#04x} at byte offset "
                                  f"{e.start}", param="prompt") from None


def run(args) -> int:
    """`ferrum run`: returns the exit status (130 when a one-shot reply was interrupted)."""
    params = sampling_params(args)   # bad flags fail before anything loads
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = _read_stdin()       # `echo question | ferrum run`: stdin is the prompt
        if not prompt.strip():
            raise InvalidRequestError("stdin is empty: pipe a prompt, or give --prompt",
                                      param="prompt")
    elif prompt is not None:
        _check_utf8(prompt, "--prompt", "prompt")
    if args.system is not None:
        _check_utf8(args.system, "--system", "system")
    if prompt is not None and not prompt.strip():
        raise InvalidRequestError("--prompt is empty", param="prompt")
    print(f"ferrum: loading {args.model} ...", file=sys.stderr, flush=True)
    from ferrum.engine.llm_engine import LLMEngine
    engine = LLMEngine(config_from_args(args))
    try:
        if engine.sampling_defaults:   # the model's own, for the flags left out
            params = sampling_params(args, engine.sampling_defaults, seed=params.seed)
        if engine.tokenizer is None:
            raise InvalidRequestError(
                f"model {args.model!r} has no tokenizer files, so `ferrum run` cannot encode "
                "text; add tokenizer.json/tokenizer_config.json to its folder, or use the "
                "Python API with token-id prompts")
        if prompt is not None:
            tok = engine.tokenizer
            if args.raw or not tok.chat_template:
                ids = tok.encode(prompt)
            else:
                ids = tok.apply_chat_template(system_messages(args.system) +
                                              [{"role": "user", "content": prompt}])
            _, interrupted = stream(engine, ids, params)
            return 130 if interrupted else 0
        return Chat(engine, params, args.system, verbose=getattr(args, "verbose", False)).loop()
    finally:
        engine.shutdown()


def system_messages(system: str | None) -> list[dict]:
    """The conversation's opening: [] or one system message."""
    return [{"role": "system", "content": system}] if system else []


class Chat:
    """The interactive chat: reads messages with prompt_toolkit, keeps the conversation,
    streams each reply to stdout. `loop()` returns the exit status."""

    def __init__(self, engine, params: SamplingParams, system: str | None, verbose: bool = False):
        self.engine, self.params, self.system, self.verbose = engine, params, system, verbose
        self.messages = system_messages(system)
        self.session = self._session()

    @staticmethod
    def _session():
        """A prompt_toolkit session drawing on stderr, with history in $FERRUM_HOME (in
        memory when that folder cannot be written)."""
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.output import create_output

        from ferrum.loader.cache import ferrum_home
        try:
            os.makedirs(ferrum_home(), exist_ok=True)
            history = FileHistory(os.path.join(ferrum_home(), "chat_history"))
        except OSError:
            history = InMemoryHistory()
        return PromptSession(history=history, output=create_output(stdout=sys.stderr))

    def say(self, text: str) -> None:
        """A line for the user on stderr (stdout carries only replies)."""
        print(text, file=sys.stderr, flush=True)

    def read_message(self) -> str:
        """One message: a line (a paste may hold several), or the lines between `\"\"\"`
        and a line ending in `\"\"\"`. Raises EOFError (Ctrl-D) and KeyboardInterrupt."""
        text = self.session.prompt(">>> ")
        if not text.lstrip().startswith('"""'):
            return text
        text = text.lstrip()[3:]
        lines = []
        while True:
            if text.rstrip().endswith('"""'):
                lines.append(text.rstrip()[:-3])
                return "\n".join(lines)
            lines.append(text)
            text = self.session.prompt("... ")

    def loop(self) -> int:
        """Read and answer messages until /bye or Ctrl-D; returns the exit status (0)."""
        self.say("ferrum chat: type a message, /help for commands, /bye or Ctrl-D to quit")
        while True:
            try:
                text = self.read_message()
            except KeyboardInterrupt:   # at the prompt: clear the line, keep chatting
                self.say("(Ctrl-C clears the line; /bye or Ctrl-D quits)")
                continue
            except EOFError:
                return 0
            if not text.strip():
                continue
            if text.strip().startswith("/"):
                if self.command(text.strip()) == "bye":
                    return 0
                continue
            self.reply(text)

    def reply(self, text: str) -> None:
        """Send `text` as the user's turn and stream the answer; a reply cut by Ctrl-C stays
        in the conversation as far as it went. A conversation too long for the context is
        refused and the turn dropped."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.engine.tokenizer.apply_chat_template(self.messages)
            answer, interrupted = stream(self.engine, ids, self.params, stats=self.verbose)
        except (InvalidRequestError, RequestFailedError) as e:
            # too long for the context, or the engine failed the reply: drop the turn
            self.say(f"ferrum: error: {e}")
            self.messages.pop()
            return
        if interrupted:
            self.say("(reply stopped; it stays in the conversation)")
        self.messages.append({"role": "assistant", "content": answer})

    def command(self, line: str) -> str | None:
        """Run a /command; returns "bye" to quit."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/bye", "/exit", "/quit"):
            return "bye"
        if name in ("/help", "/?"):
            self.say(CHAT_HELP)
        elif name == "/reset":
            if self.confirm("forget the whole conversation?"):
                self.messages = system_messages(self.system)
                self.say("conversation cleared")
        elif name == "/set":
            self.set(rest)
        elif name == "/show":
            p = self.params
            self.say(", ".join(f"{k} {getattr(p, k)}" for k in _SETTABLE)
                     + f"; system {self.system!r}; {len(self.messages)} messages")
        else:
            self.say(f"unknown command {name}; /help lists them")
        return None

    def confirm(self, question: str) -> bool:
        """Ask a yes/no question at the prompt; only y / yes is yes (Ctrl-C or Ctrl-D: no)."""
        try:
            return self.session.prompt(f"{question} [y/N] ").strip().lower() in ("y", "yes")
        except (KeyboardInterrupt, EOFError):
            return False

    def set(self, rest: str) -> None:
        """`/set NAME VALUE`: a sampling option (validated like SamplingParams) or the system
        message (which starts a new conversation)."""
        key, _, value = rest.partition(" ")
        key, value = key.replace("-", "_"), value.strip()
        if key == "system":
            self.system = value or None
            self.messages = system_messages(self.system)
            self.say("system message set; conversation cleared")
            return
        if key not in _SETTABLE or not value:
            self.say(f"usage: /set NAME VALUE with NAME one of {', '.join(_SETTABLE)}, system")
            return
        try:
            self.params = dataclasses.replace(self.params, **{key: _SETTABLE[key](value)})
        except ValueError as e:   # not a number, or out of range (InvalidRequestError)
            self.say(f"ferrum: error: {key}: {e}")
            return
        self.say(f"{key} = {getattr(self.params, key)}")
