"""Benchmarks behind `ferrum bench`: latency (batch-1 prefill/decode vs HF transformers and the
peers), ttft (time to first token over prompt lengths), throughput (offline batch vs
one-at-a-time, or the nano-vllm workload), sweep (decode over batch sizes, host share per
step), serve (HTTP load against a running server). One MBU definition (`mbu`), one way to run
peers (`peers`).
Each module defines `add_parser(subparsers, add_engine_args)` and `main(args) -> int`."""
import importlib

BENCHES = ("latency", "ttft", "throughput", "sweep", "serve")   # `ferrum bench` subcommands


class _SubparsersWithDefaults:
    """`subparsers` whose add_parser also passes `defaults` (the CLI's help formatter and
    shared -v flag), so each benchmark module keeps a plain add_parser call."""

    def __init__(self, subparsers, defaults: dict):
        self.subparsers, self.defaults = subparsers, defaults

    def add_parser(self, name: str, **kw):
        return self.subparsers.add_parser(name, **{**self.defaults, **kw})


def add_bench_parsers(sub, add_engine_args, **parser_defaults) -> None:
    """Add the BENCHES subcommands to the argparse subparsers `sub` (a benchmark whose
    imports fail is left out); parser_defaults go to every add_parser."""
    sub = _SubparsersWithDefaults(sub, parser_defaults)
    for name in BENCHES:
        try:
            mod = importlib.import_module(f"ferrum.benchmarks.{name}")
        except ImportError:
            continue
        mod.add_parser(sub, add_engine_args)
