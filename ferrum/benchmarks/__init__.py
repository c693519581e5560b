"""Benchmarks behind `ferrum bench`: latency (batch-1 prefill/decode vs HF transformers),
throughput (offline batch vs one-at-a-time), serve (HTTP load against a running server).
Each module defines `add_parser(subparsers, add_engine_args)` and `main(args) -> int`."""
import importlib

_BENCHES = ("latency", "throughput", "serve")


def add_bench_parsers(sub, add_engine_args) -> None:
    """Add `latency`, `throughput`, `serve` subcommands to the argparse subparsers `sub`
    (a benchmark whose imports fail is left out)."""
    for name in _BENCHES:
        try:
            mod = importlib.import_module(f"ferrum.benchmarks.{name}")
        except ImportError:
            continue
        mod.add_parser(sub, add_engine_args)
