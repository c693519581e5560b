"""`ferrum run`: one-shot generation with --prompt, else an interactive chat that keeps the
conversation through the model's chat template. Tokens stream to the terminal as they come;
decode speed is printed at the end (to stderr, so stdout holds only the answer)."""
from __future__ import annotations

import sys
import time

from ferrum.engine.llm_engine import LLMEngine
from ferrum.errors import InvalidRequestError
from ferrum.sampling_params import SamplingParams


def stream(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, out=sys.stdout) -> str:
    """Generate and print as it goes; returns the text. Prints tokens/s to stderr."""
    rid = engine.add_request(None, None, params, prompt_token_ids=prompt_ids)
    t0 = time.perf_counter()
    first = None
    text, n = "", 0
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                c = o.outputs[0]
                if first is None and c.token_ids:
                    first = time.perf_counter()
                out.write(c.delta_text)
                out.flush()
                text, n = c.text, len(c.token_ids)
    except BaseException:
        engine.abort_request(rid)
        raise
    t1 = time.perf_counter()
    out.write("\n")
    if n:
        decode = (n - 1) / (t1 - first) if n > 1 and t1 > first else float("nan")
        print(f"[{n} tokens in {t1 - t0:.2f} s; TTFT {1000 * (first - t0):.0f} ms, "
              f"decode {decode:.1f} tokens/s]", file=sys.stderr)
    return text


def run(args) -> int:
    from ferrum.entrypoints.cli import config_from_args
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, max_tokens=args.max_tokens)
    if args.prompt is not None and not args.prompt.strip():  # before loading anything
        raise InvalidRequestError("--prompt is empty", param="prompt")
    engine = LLMEngine(config_from_args(args))
    tok = engine.tokenizer
    if tok is None:
        engine.shutdown()
        raise InvalidRequestError(f"model {args.model!r} has no tokenizer files, so `ferrum run` cannot "
                                  "encode text; add tokenizer.json/tokenizer_config.json to its folder, "
                                  "or use the Python API with token-id prompts")
    try:
        if args.prompt is not None:
            if not args.prompt.strip():
                raise InvalidRequestError("--prompt is empty", param="prompt")
            if args.raw or not tok.chat_template:
                ids = tok.encode(args.prompt)
            else:
                msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
                       [{"role": "user", "content": args.prompt}]
                ids = tok.apply_chat_template(msgs)
            stream(engine, ids, params)
            return 0
        return chat_loop(engine, params, args.system)
    finally:
        engine.shutdown()


def chat_loop(engine: LLMEngine, params: SamplingParams, system: str | None) -> int:
    tok = engine.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    print("ferrum chat; empty line or Ctrl-D to quit, /reset to clear the conversation", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = stream(engine, tok.apply_chat_template(messages), params)
        except InvalidRequestError as e:  # e.g. conversation longer than max_model_len
            print(f"ferrum: error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
