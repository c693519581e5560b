"""How much the decode attention's row order costs, estimated without a GPU: list scheduling of
its programs over the SMs for the nano-vllm workload (256 requests, prompt and output lengths
U(100, 1024)), in arrival order and longest context first (`longest_decode_first`).

    python benchmarks/decode_waves.py [--slots 264 528] [--fixed 32]

Model: every running sequence has one program per KV head (grid (num_kv_heads, B, 1), KV heads
fastest, one split at 256 rows: `num_decode_splits`); a program costs its context length plus
`--fixed` tokens' worth of start-up; the GPU runs `--slots` programs at once (132 SMs x 2:
BLOCK_N 64, 3 stages, head_dim 128 take ~96 KB of shared memory each) and starts the next one
in grid order as one finishes. Printed: the summed step makespans over those of a perfectly
balanced schedule (total work / slots, or the longest program when that is longer), every 8th
step of the run. A scheduling model, not a timing: `bash benchmarks/gpu_run.sh lpt` measures.
"""
from __future__ import annotations

import argparse
import heapq
import random


def makespan(costs: list[int], slots: int) -> int:
    """Finish time of programs started in list order on `slots` parallel units (Graham 1966)."""
    free_at = [0] * slots
    for c in costs:
        heapq.heappush(free_at, heapq.heappop(free_at) + c)
    return max(free_at)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[264, 528], help="programs running at once")
    p.add_argument("--fixed", type=int, default=32, help="a program's start-up cost, in tokens")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompt = [rng.randint(100, 1024) for _ in range(256)]
    output = [rng.randint(100, 1024) for _ in range(256)]
    for slots in args.slots:
        ideal = arrival = longest = 0
        for t in range(0, max(output), 8):
            lens = [prompt[i] + t for i in range(256) if output[i] > t]   # arrival order
            costs = [n + args.fixed for n in lens for _ in range(args.kv_heads)]
            ideal += max(sum(costs) / slots, max(costs))
            arrival += makespan(costs, slots)
            longest += makespan(sorted(costs, reverse=True), slots)
        print(f"{slots} programs at once: arrival order {arrival / ideal:.3f}x the balanced time, "
              f"longest first {longest / ideal:.3f}x ({arrival / longest:.3f}x faster)")


if __name__ == "__main__":
    main()
