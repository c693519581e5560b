"""Instruction counts of a kernel's main loop in its sm_90 SASS, compiled with Triton's bundled
ptxas: no GPU needed. Where a loop needs more than the SMs can issue, it cannot stream its
bytes at the bandwidth, whatever the tiles.

    python benchmarks/sass_loop.py [--kv bf16 fp8] [--block-n 64 128] [--splits 1] [--gemv]

Decode attention, for each (KV dtype, BLOCK_N): the longest loop's instructions, per token, and
warp-instructions per KV byte (x 4.8 TB/s = the issue rate the loop needs at the H200's spec
bandwidth, against ~1.05 T/s: 132 SMs x 4 schedulers x ~1.98 GHz), with the most frequent
opcodes. Llama-3-8B shapes (GQA group 4, head_dim 128, 16-token pages). `--gemv`: the same for
the batch-1 Gluon GEMVs (ferrum/ops/gemv_gluon.py: bf16, FP8, 4-bit, Q4_K) at their default
configs on Llama-3-8B's gate_up matrix (bf16 / FP8 also on down_proj, with and without the
SiLU-mul folded into the x load), per weight byte, with the registers per thread. The
compile helpers are the tests'
(tests/test_triton_kernels.py `sm90_sass`, `_sass_loops`).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
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


def gemv_loop(kind: str, N: int = 28672, K: int = 4096, silu_mul: bool = False) -> dict:
    """Counts for the Gluon GEMV of `kind` (bf16 / fp8 / w4 / q4_k) over an [N, K] weight, one row
    of x (bf16; int8 for Q4_K, `gemv_gluon.q8_1`), at `gemv_gluon.default_config`; also the
    registers per thread. silu_mul (bf16 / fp8): x computed as silu(gate) * up in the loop."""
    from ferrum.ops import gemv_gluon as gg
    bn, warps, split = gg.default_config(kind, N, K, 1)
    common = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_C=32 * warps, HAS_BIAS=False, SPLIT_K=split, USE_PDL=True)
    y = "*bf16" if split == 1 else "*fp32"
    if kind == "q4_k":
        fn, consts = gg._q4k_gemv_kernel, common
        ptrs = dict(x_ptr="*i32", d_ptr="*fp32", w_ptr="*i32", b_ptr="*bf16", y_ptr=y)
        chunk_bytes = 32 + 16 / 8 * 2  # 64 values: 32 quant bytes + their share of the 144-byte block's header
    elif kind == "w4":
        fn, consts = gg._w4_gemv_kernel, dict(common, GROUP=128)
        ptrs = dict(x_ptr="*i32", d_ptr="*fp32", qw_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16", b_ptr="*fp16", y_ptr=y)
        chunk_bytes = 16
    else:
        fn, consts = gg._dense_gemv_kernel, dict(common, E=gg.ELEMENTS[kind], HAS_SCALE=kind == "fp8",
                                                 SILU_MUL=silu_mul)
        ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv" if kind == "fp8" else "*bf16", s_ptr="*fp32", b_ptr="*bf16",
                    y_ptr=y)
        chunk_bytes = 16
    _, res, sass = sm90_sass(fn, consts, ptrs, warps, 1, no_hint=("M",), maxnreg=gg.Q8_MAXNREG if kind == "q4_k" else None)
    body = max(_sass_loops(sass), key=len)
    # one iteration: BLOCK_N rows x BLOCK_C chunks per program, one chunk per thread
    tile_bytes = bn * 32 * warps * chunk_bytes
    per_byte = len(body) * warps / tile_bytes
    values = bn * 32 * warps * gg.ELEMENTS[kind]
    regs = re.search(r"REG:(\d+)", str(res))
    return {"kind": kind + (" silu-mul" if silu_mul else ""), "config": (bn, warps, split),
            "shape": (N, K), "loop_instructions": len(body),
            "registers": int(regs.group(1)) if regs else None,
            "per_value_per_thread": len(body) * 32 * warps / values, "warp_instr_per_byte": per_byte,
            "issue_share_at_spec_bw": per_byte * SPEC_BW / ISSUE_RATE,
            "top_opcodes": collections.Counter(i.split()[0] for i in body).most_common(10)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--splits", type=int, default=1)
    p.add_argument("--gemv", action="store_true", help="the Gluon GEMVs instead of the decode attention")
    args = p.parse_args()
    if args.gemv:
        runs = [(kind, 28672, 4096, False) for kind in ("bf16", "fp8", "w4", "q4_k")]
        runs += [(kind, 4096, 14336, silu) for kind in ("bf16", "fp8") for silu in (False, True)]  # down_proj
        for kind, n, k, silu in runs:
            r = gemv_loop(kind, n, k, silu)
            print(f"gemv {r['kind']} {n}x{k} {r['config']}, {r['registers']} registers: {r['loop_instructions']} instructions per loop, "
                  f"{r['per_value_per_thread']:.2f} per weight value, {r['warp_instr_per_byte']:.3f} warp-instructions "
                  f"per weight byte = {r['issue_share_at_spec_bw']:.0%} of the issue rate at 4.8 TB/s; {r['top_opcodes']}")
        return
    for kv in args.kv:
        for bn in args.block_n:
            r = decode_loop(kv, bn, args.splits)
            print(f"decode {kv} KV, BLOCK_N {bn}, {r['warps']} warps, {r['stages']} stages: {r['loop_instructions']} "
                  f"instructions per loop, {r['warp_instr_per_byte']:.3f} warp-instructions per KV byte = "
                  f"{r['issue_share_at_spec_bw']:.0%} of the issue rate at 4.8 TB/s; {r['top_opcodes']}")


if __name__ == "__main__":
    main()
