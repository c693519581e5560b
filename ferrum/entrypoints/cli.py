"""`ferrum run | serve | pull | list | bench`.

Every command that builds an engine takes the same engine flags (`add_engine_args`). Under
`torchrun` (WORLD_SIZE > 1), ranks other than 0 run the tensor-parallel worker loop instead of
the command, so every node runs the same command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from ferrum.errors import FerrumError


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = True) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default="smollm2",
                       help="model name (smollm2), HF folder, .gguf file, hub id org/name, or dummy:<config.json>")
    g = p.add_argument_group("engine")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool bytes per rank (CPU)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size in blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    from ferrum.config import CacheConfig, EngineConfig
    from ferrum.layers.quantization import QUANTIZATION_CHOICES
    fields = {f.name: f for f in dataclasses.fields(EngineConfig) + dataclasses.fields(CacheConfig)}
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                   help=fields["quantization"].metadata["help"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help=fields["kv_cache_dtype"].metadata["help"])
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch decode step n+1 before reading step n's tokens (default: on for CUDA, "
                        "off for CPU, where it only delays each token by one step)")
    g.add_argument("--startup-timeout-s", type=float, default=600.0,
                   help="seconds the tensor-parallel worker ranks may take to start (load the model)")
    g.add_argument("--chat-template", default=None, help="chat template that overrides the model's: a Jinja file path or the template text")
    g.add_argument("--split-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="encode special-token strings inside chat messages as text, so only the "
                        "chat template's markup yields control tokens (--no-split-special-tokens: "
                        "parse them, the old behaviour)")
    g.add_argument("--engine-seed", type=int, default=0, help="seed for dummy weights / global RNG")


def config_from_args(args):
    from ferrum.entrypoints.llm import engine_config
    model = args.model
    if args.load_format == "dummy" and not model.startswith("dummy:") and os.path.exists(model):
        model = f"dummy:{model}"
    return engine_config(
        model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, load_format=args.load_format,
        enforce_eager=args.enforce_eager, chat_template=args.chat_template, seed=args.engine_seed,
        async_scheduling=args.async_scheduling, split_special_tokens=args.split_special_tokens,
        startup_timeout_s=args.startup_timeout_s, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype)


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {port}")
    return port


def _cmd_pull(args) -> int:
    from ferrum.model_store import pull
    print(pull(args.name))
    return 0


def _cmd_list(args) -> int:
    from ferrum.model_store import list_models
    rows = list_models()
    if not rows:
        print("no models cached; try `ferrum pull smollm2`")
    for r in rows:
        print(f"{r['name']:<24} {r['format']:<12} {r['size'] / 2**20:8.1f} MiB  {r['path']}")
    return 0


def _cmd_run(args) -> int:
    from ferrum.entrypoints.run import run
    return run(args)


def _cmd_serve(args) -> int:
    from ferrum.entrypoints.openai.server import serve
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferrum", description="ferrum LLM inference engine")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate from a prompt, or chat interactively")
    add_engine_args(r)
    r.add_argument("--prompt", "-p", default=None, help="one-shot prompt (else interactive chat)")
    r.add_argument("--system", default=None, help="system message for chat")
    r.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.7)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=-1)
    r.add_argument("--min-p", type=float, default=0.0)
    r.add_argument("--repetition-penalty", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=None)
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-waiting", type=int, default=1024, help="queue limit; more gets HTTP 503")
    s.set_defaults(func=_cmd_serve)

    pl = sub.add_parser("pull", help="download a known model into the cache")
    pl.add_argument("name")
    pl.set_defaults(func=_cmd_pull)
    ls = sub.add_parser("list", help="list cached models")
    ls.set_defaults(func=_cmd_list)

    b = sub.add_parser("bench", help="benchmarks: latency | throughput | serve")
    bsub = b.add_subparsers(dest="bench", required=True)
    from ferrum.benchmarks import add_bench_parsers
    add_bench_parsers(bsub, add_engine_args)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from ferrum.executor.tp_rank import launched_by_torchrun
    if launched_by_torchrun() and int(os.environ.get("RANK", "0")) != 0 and hasattr(args, "tensor_parallel_size"):
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
