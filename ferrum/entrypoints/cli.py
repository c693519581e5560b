"""`ferrum run | serve | pull | list | bench`.

Every command that builds an engine takes the same engine flags, generated from the config
dataclasses (`ferrum/entrypoints/args.py`). Under `torchrun` (WORLD_SIZE > 1), ranks other
than 0 run the tensor-parallel worker loop instead of the command, so every node runs the same
command line. stdout carries only answers (generated text, a pulled model's path, the model
list); progress, prompts and errors go to stderr.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ferrum.config import MAX_REQUEST_BODY, SHUTDOWN_TIMEOUT_S, parse_body_limit
from ferrum.entrypoints.args import (HelpFormatter, _as_argparse_type, add_engine_args,
                                     config_from_args)
from ferrum.entrypoints.run import RUN_DEFAULTS
from ferrum.errors import FerrumError
from ferrum.sampling_params import SamplingParams


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {port}")
    return port


def _seconds(text: str) -> float:
    seconds = float(text)
    if not seconds >= 0:   # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return seconds


def _cmd_pull(args) -> int:
    from ferrum.model_store import pull
    print(pull(args.name))
    return 0


def _cmd_list(args) -> int:
    from ferrum.model_store import list_models
    rows = list_models()
    if not rows:
        print("no models cached; try `ferrum pull smollm2`", file=sys.stderr)
    for r in rows:
        print(f"{r['name']:<24} {r['format']:<12} {r['size'] / 2**20:8.1f} MiB  {r['path']}")
    return 0


def _cmd_run(args) -> int:
    from ferrum.entrypoints.run import run
    return run(args)


def _cmd_serve(args) -> int:
    from ferrum.entrypoints.openai.server import serve
    return serve(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ferrum-infer")
    except PackageNotFoundError:  # running from a source tree that was never installed
        import ferrum
        return ferrum.__version__


def _choose(parser: argparse.ArgumentParser, dest: str, what: str):
    """`parser.add_subparsers(dest=dest)`, not argparse-required: argparse would report a missing
    choice before an unknown flag (`ferrum --bogus`, `ferrum bench --bogus`), so `main` names
    the flag first and a missing choice runs this default func, which lists the choices."""
    sub = parser.add_subparsers(dest=dest)
    parser.set_defaults(func=lambda args: parser.error(f"choose a {what}: {', '.join(sub.choices)}"))
    return sub


def build_parser() -> argparse.ArgumentParser:
    """The `ferrum` parser. `-v` is accepted before or after the subcommand."""
    from ferrum.model_store import known_names

    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log what the engine does (to stderr)")
    p = argparse.ArgumentParser(prog="ferrum", description="ferrum LLM inference engine",
                                formatter_class=HelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log what the engine does (to stderr)")
    p.add_argument("--version", action="version", version=f"ferrum {_version()}")
    sub = _choose(p, "command", "command")

    def command(name: str, help: str, **kw) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=kw.pop("description", help),
                           formatter_class=HelpFormatter, parents=[verbose], **kw)
        c.set_defaults(_subparser=c)   # reports arguments it does not know (main)
        return c

    r = command("run", "generate from a prompt, or chat interactively",
                description="Generate from --prompt (or from stdin when it is not a terminal), "
                            "else chat interactively (type /help in the chat). A sampling flag "
                            "left out takes the model's generation_config.json value (see "
                            "--generation-config), else this command's chat defaults "
                            "(temperature 0.7, 256 tokens; the Python API's SamplingParams() "
                            "defaults are vLLM's, 1.0 and 16 tokens).")
    add_engine_args(r)
    g = r.add_argument_group("generation")
    g.add_argument("--prompt", "-p", default=None,
                   help="one-shot prompt (default: read stdin when it is piped, else chat)")
    g.add_argument("--system", default=None, help="system message (default: none)")
    g.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    # default None: the model's generation_config.json value, else RUN_DEFAULTS / SamplingParams'
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens per reply (default: {RUN_DEFAULTS['max_tokens']})")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature, 0 = greedy (default: {RUN_DEFAULTS['temperature']})")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the top tokens "
                   f"whose probabilities sum to this (default: {SamplingParams.top_p})")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"keep the k most likely tokens; -1 = all (default: {SamplingParams.top_k})")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens less likely than this "
                   f"fraction of the most likely one (default: {SamplingParams.min_p})")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages tokens already in the prompt or output "
                        f"(default: {SamplingParams.repetition_penalty})")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for repeatable replies (default: random)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop the reply at this text; repeat for several (default: none)")
    r.set_defaults(func=_cmd_run)

    s = command("serve", "OpenAI-compatible HTTP server")
    add_engine_args(s)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 exposes it")
    g.add_argument("--port", type=_port, default=8000, help="TCP port")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on the API (default: no key)")
    g.add_argument("--served-model-name", default=None,
                   help="the `model` name clients send (default: the model argument as given)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no access-log line per request on stderr")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed by CORS, e.g. http://localhost:3000 or * "
                        "(default: none, no CORS headers)")
    g.add_argument("--max-request-body", type=_as_argparse_type(parse_body_limit),
                   default=MAX_REQUEST_BODY, metavar="SIZE",
                   help="largest request body read, with a unit; a larger one is answered 413 "
                        "before it is parsed or tokenized")
    g.add_argument("--shutdown-timeout", type=_seconds, default=SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: stop accepting connections, let open requests run "
                        "this long, then end those left with an error (a stream: an error event "
                        "and [DONE]); a second signal quits at once")
    s.set_defaults(func=_cmd_serve)

    names = ", ".join(known_names())
    pl = command("pull", "download a known model into the cache and print its path",
                 description=f"Download a known model into the cache ($FERRUM_HOME or "
                             f"~/.cache/ferrum) and print its path. Known models: {names}.")
    pl.add_argument("name", help=f"one of: {names}")
    pl.set_defaults(func=_cmd_pull)
    ls = command("list", "list cached models")
    ls.set_defaults(func=_cmd_list)

    from ferrum.benchmarks import BENCHES, add_bench_parsers
    b = command("bench", "benchmarks: " + " | ".join(BENCHES))
    bsub = _choose(b, "bench", "benchmark")
    add_bench_parsers(bsub, add_engine_args, parents=[verbose], formatter_class=HelpFormatter)
    return p


def _is_torchrun_worker() -> bool:
    """A rank > 0 started by torchrun (checked from the environment, before importing torch)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0


def main(argv: list[str] | None = None) -> int:
    """Run `ferrum <command>` with `argv` (default: sys.argv[1:]); returns the exit status:
    0, 1 for a ferrum error (printed on one stderr line), 130 when interrupted."""
    try:
        parser = build_parser()   # reads the FERRUM_* environment for the flags' defaults
    except FerrumError as e:
        print(f"ferrum: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # said by the subcommand, with its usage (argparse leaves them to `ferrum`)
        getattr(args, "_subparser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    args._argv = list(sys.argv[1:] if argv is None else argv)   # benchmark records quote the command
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if _is_torchrun_worker() and hasattr(args, "tensor_parallel_size"):
        from ferrum.executor.tp_worker import run_spmd_worker
        try:
            run_spmd_worker(config_from_args(args))
        except FerrumError as e:
            print(f"ferrum: error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        return args.func(args) or 0
    except FerrumError as e:
        print(f"ferrum: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
