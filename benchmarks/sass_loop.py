"""Instruction counts of the decode-attention kernel's main loop in its sm_90 SASS, compiled
with Triton's bundled ptxas: no GPU needed.

    python benchmarks/sass_loop.py [--kv bf16 fp8] [--block-n 64 128] [--splits 1]

For each (KV dtype, BLOCK_N): the longest loop's instructions, per token, and warp-instructions
per KV byte (x 4.8 TB/s = the issue rate the loop needs at the H200's spec bandwidth, against
~1.05 T/s: 132 SMs x 4 schedulers x ~1.98 GHz), with the most frequent opcodes. Llama-3-8B
shapes (GQA group 4, head_dim 128, 16-token pages). The compile helpers are the tests' (tests/
test_triton_kernels.py `sm90_sass`, `_sass_loops`).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

from ferrum.ops import attention_triton as tb  # noqa: E402
from test_triton_kernels import _sass_loops, sm90_sass  # noqa: E402

SPEC_BW = 4.8e12     # H200 HBM3e, bytes/s
ISSUE_RATE = 132 * 4 * 1.98e9  # warp-instructions/s an H200 can issue


def decode_loop(kv: str, block_n: int, splits: int, head_dim: int = 128) -> dict:
    """Counts for `_decode_split_kernel` with a `kv` ("bf16" / "fp8") cache and a bf16 query."""
    fp8 = kv == "fp8"
    _, warps, stages = tb._decode_config(head_dim, torch.bfloat16, splits, fp8)
    c = "*fp8e4nv" if fp8 else "*bf16"
    out = "*bf16" if splits == 1 else "*fp32"
    _, _, sass = sm90_sass(tb._decode_split_kernel,
                           dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=head_dim, PAGE=16, BLOCK_N=block_n,
                                NUM_SPLITS=splits, DIRECT_OUT=splits == 1, DOT_PREC="tf32", FP8=fp8,
                                USE_PDL=True, WINDOWED=False),
                           dict(q_ptr="*bf16", kc_ptr=c, vc_ptr=c, bt_ptr="*i32", seqlen_ptr="*i32",
                                ks_ptr="*fp32", vs_ptr="*fp32", o_ptr=out, lse_ptr=out), warps, stages)
    body = max(_sass_loops(sass), key=len)
    kv_bytes = block_n * head_dim * 2 * (1 if fp8 else 2)   # K and V of one tile
    per_byte = len(body) * warps / kv_bytes
    return {"kv": kv, "block_n": block_n, "warps": warps, "stages": stages, "loop_instructions": len(body),
            "per_token": len(body) / block_n, "warp_instr_per_byte": per_byte,
            "issue_share_at_spec_bw": per_byte * SPEC_BW / ISSUE_RATE,
            "top_opcodes": collections.Counter(i.split()[0] for i in body).most_common(12)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--splits", type=int, default=1)
    args = p.parse_args()
    for kv in args.kv:
        for bn in args.block_n:
            r = decode_loop(kv, bn, args.splits)
            print(f"decode {kv} KV, BLOCK_N {bn}, {r['warps']} warps, {r['stages']} stages: {r['loop_instructions']} "
                  f"instructions per loop, {r['warp_instr_per_byte']:.3f} warp-instructions per KV byte = "
                  f"{r['issue_share_at_spec_bw']:.0%} of the issue rate at 4.8 TB/s; {r['top_opcodes']}")


if __name__ == "__main__":
    main()
