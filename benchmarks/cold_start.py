"""Cold start of `ferrum run` against the imports it cannot avoid, in one run.

Times, as fresh processes, alternating so that load changes hit both alike:
  A  python -c "import torch, transformers"
  B  ferrum run MODEL --prompt hi --max-tokens 4   (model already pulled; its GGUF cache warm)
and prints the medians, min / max and the ratio B / A (goal: <= 2). Before the timed runs
it runs B once to build the per-file cache (metadata, tokenizer, dequantized weights) and
reports that first start separately (`--fresh-cache` empties $FERRUM_HOME/gguf first).

    python benchmarks/cold_start.py --reps 5 [--model smollm2] [--fresh-cache]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--fresh-cache", action="store_true", help="empty $FERRUM_HOME/gguf first")
    args = p.parse_args()
    imports = [sys.executable, "-c", "import torch, transformers"]
    run = [sys.executable, "-m", "ferrum.entrypoints.cli", "run", args.model, "--prompt", "hi",
           "--max-tokens", "4"]
    from ferrum.loader.cache import ferrum_home
    if args.fresh_cache:
        shutil.rmtree(os.path.join(ferrum_home(), "gguf"), ignore_errors=True)
    load0 = os.getloadavg()
    first = timed(run)
    a, b = [], []
    for _ in range(args.reps):
        a.append(timed(imports))
        b.append(timed(run))
    load1 = os.getloadavg()

    def fmt(xs):
        return f"{statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"
    print(f"first start (builds the cache if needed): {first:.2f} s")
    print(f"A  import torch, transformers : {fmt(a)}")
    print(f"B  ferrum run {args.model} --prompt hi --max-tokens 4 : {fmt(b)}")
    print(f"B / A (medians): {statistics.median(b) / statistics.median(a):.2f}  "
          f"(per pair: {', '.join(f'{y / x:.2f}' for x, y in zip(a, b))})")
    print(f"1-min load average {load0[0]:.1f} before, {load1[0]:.1f} after, on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
