"""Time the Triton paged decode-attention kernel over its tuning knobs on the GPU.

    python benchmarks/tune_attention.py --out $OUT

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token pages,
block tables shuffled over the pool as a long-running server leaves them). For each
(batch, context) case every (BLOCK_N, num_warps, num_stages, splits) config is timed with CUDA
events (median of 20 after warm-up) and reported as us per call and the KV bytes read per
second (the kernel's useful traffic: B x context x 8 heads x 128 x 2 (K, V) x 2 bytes, over
the 4.35 TB/s roofline; 1 byte with --kv-dtype fp8). The current defaults (`_decode_config`,
`num_decode_splits`) are the baseline row. --prefill-cases also times the prefill kernel
(`tune_prefill`); --prefill-sdpa times it against the scaled_dot_product_attention path of
prompts without cached context (`time_prefill_sdpa`). `--default-only` times just the baseline
row (an A/B of two kernel versions run one after the other). Writes tune_attention.json (tune_attention_fp8.json; `--tag T` appends _T).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ferrum.benchmarks.mbu import cuda_event_median_us  # noqa: E402
from ferrum.forward_context import AttentionMetadata  # noqa: E402
from ferrum.ops import attention_triton as tb  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 16


def _case(B, ctx, gen, fp8=False, head_major=False):
    M = -(-ctx // PAGE)
    pool = B * M + 1
    if head_major:   # pages [Hkv, PAGE, D] in memory, seen as [PAGE, Hkv, D] (--layouts)
        kv = torch.randn(2, pool, HKV, PAGE, D, device="cuda", dtype=torch.bfloat16,
                         generator=gen).transpose(2, 3)
    else:
        kv = torch.randn(2, pool, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    if fp8:   # the --kv-cache-dtype fp8 cache: e4m3 values, scales [1] float32 (1.0 here)
        kv = kv.to(torch.float8_e4m3fn)
    perm = torch.randperm(pool - 1, device="cuda", generator=gen) + 1
    bt = perm[:B * M].view(B, M).to(torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    md = AttentionMetadata(is_prefill=False, slot_mapping=torch.empty(0, device="cuda"),
                           block_tables=bt, seq_lens=seq, max_seq_len=ctx)
    return q, kv, md


def _prefill_inputs(B: int, L: int, gen):
    """q [B*L, H, D], the paged cache, this step's k / v [B*L, HKV, D] (the cache's rows, as
    write_kv left them), metadata, and the causal FLOPs 2 x 2 x H x D x L^2 / 2 per sequence."""
    M = -(-L // PAGE)
    kv = torch.randn(2, B * M + 1, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    bt = (torch.randperm(B * M, device="cuda", generator=gen) + 1).view(B, M)
    k, v = (kv[i][bt].reshape(B, M * PAGE, HKV, D)[:, :L].reshape(B * L, HKV, D) for i in (0, 1))
    q = torch.randn(B * L, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(0, B * L + 1, L, device="cuda")
    md = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, device="cuda"), block_tables=bt,
                           seq_lens=torch.full((B,), L, dtype=torch.int32, device="cuda"), max_seq_len=L,
                           query_lens=[L] * B, context_lens=[0] * B, cu_seqlens_q=cu)
    return q, kv, k, v, md, B * 2 * 2 * H * D * L * L / 2


def time_prefill_sdpa(cases: str, gen) -> dict:
    """For cases "BxL" (B prompts of L tokens, no cached context): `prefill_attention` through
    the Triton kernel (KERNELS.sdpa_prefill_min_tokens 0) and through its
    scaled_dot_product_attention path with torch's choice of backend and with each backend
    forced (`torch.nn.attention.sdpa_kernel`); us per call, TFLOP/s, max |diff| vs the kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from ferrum.config import KERNELS
    saved = KERNELS.sdpa_prefill_min_tokens
    out = {}
    forced = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}
    try:
        for case in cases.split(","):
            B, L = map(int, case.split("x"))
            q, kv, k, v, md, flops = _prefill_inputs(B, L, gen)
            KERNELS.sdpa_prefill_min_tokens = 0
            ref = tb.prefill_attention(q, kv, md, D ** -0.5, k, v)
            rows = {}
            for name in ("triton", "sdpa", *forced):
                KERNELS.sdpa_prefill_min_tokens = 0 if name == "triton" else 1

                def run():
                    with sdpa_kernel([forced[name]]) if name in forced else contextlib.nullcontext():
                        return tb.prefill_attention(q, kv, md, D ** -0.5, k, v)
                try:
                    err = (run().float() - ref.float()).abs().max().item()
                    us = cuda_event_median_us(run, iters=10)
                except Exception as e:  # a backend that does not take these inputs
                    rows[name] = {"error": str(e).splitlines()[0][:200]}
                    continue
                rows[name] = {"us": us, "tflops": flops / us / 1e6, "max_abs_diff_vs_triton": err}
            out[case] = rows
            print("prefill sdpa", case,
                  {n: round(r["us"], 1) if "us" in r else r["error"][:60] for n, r in rows.items()}, flush=True)
    finally:
        KERNELS.sdpa_prefill_min_tokens = saved
    return out


def tune_prefill(cases: str, gen, small: bool = False) -> dict:
    """Time `prefill_attention` over (BLOCK_M, BLOCK_N, num_warps, num_stages, launch order
    `PREFILL_HEAVY_FIRST`) for cases "BxL" (B sequences of L new tokens, no cached context),
    causal FLOPs 2 x 2 x H x D x L^2 / 2 per sequence reported as TFLOP/s. The first row is the
    default (`_prefill_config`). small: 3 tile shapes instead of 6 (24 configs)."""
    out = {}
    scale = D ** -0.5
    for case in cases.split(","):
        B, L = map(int, case.split("x"))
        q, kv, _, _, md, flops = _prefill_inputs(B, L, gen)

        def run():
            return tb.prefill_attention(q, kv, md, scale, None, None)
        ref = run()
        rows = []
        tiles = [(64, 64), (128, 64), (128, 128)] if small else list(itertools.product((64, 128), (32, 64, 128)))
        grid = [(None, None, None, None, True)] + [
            (bm, bn, w, st, heavy) for (bm, bn), w, st, heavy in itertools.product(tiles, (4, 8), (2, 3), (True, False))]
        for bm, bn, warps, stages, heavy in grid:
            tb.PREFILL_BLOCK_M, tb.PREFILL_BLOCK_N, tb.PREFILL_NUM_WARPS, tb.PREFILL_NUM_STAGES = bm, bn, warps, stages
            tb.PREFILL_HEAVY_FIRST = heavy
            cfg = {"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "heavy_first": heavy}
            try:
                err = (run().float() - ref.float()).abs().max().item()
                us = cuda_event_median_us(run, iters=10)
            except Exception as e:  # out of shared memory / registers for this config
                rows.append({**cfg, "error": str(e).splitlines()[0][:200]})
                continue
            rows.append({**cfg, "us": us, "tflops": flops / us / 1e6, "max_abs_diff_vs_default": err})
        tb.PREFILL_BLOCK_M = tb.PREFILL_BLOCK_N = tb.PREFILL_NUM_WARPS = tb.PREFILL_NUM_STAGES = None
        tb.PREFILL_HEAVY_FIRST = True
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        out[case] = {"default": rows[0], "best": ok[:5], "all": rows}
        print("prefill", case, "default", {k: rows[0].get(k) for k in ("us", "tflops")}, "best",
              [{k: r[k] for k in ("block_m", "block_n", "warps", "stages", "heavy_first", "us", "tflops")}
               for r in ok[:3]], flush=True)
    return out


def main():
    global H, HKV
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--cases", default="256x1536,256x512,64x1536,1x640")
    p.add_argument("--heads", default=f"{H},{HKV}", help="query heads,KV heads (Qwen3-0.6B: 16,8)")
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"], help="KV cache dtype (fp8: e4m3)")
    p.add_argument("--small-grid", action="store_true",
                   help="decode: BLOCK_N 32/64/128 (and 256 with --kv-dtype fp8) x warps 4/8 x stages 2/3 x "
                   "the two smallest split counts (24 / 32 configs); prefill: 3 tile shapes (24 configs with the launch orders)")
    p.add_argument("--default-only", action="store_true",
                   help="decode: time only the default config (an A/B of two kernel versions, run one after the other)")
    p.add_argument("--grid-orders", default="default", choices=["default", "both"],
                   help="decode: time each config in the default grid order only, or heads-first "
                   "(Hkv, B, S) and sequences-first (B, Hkv, S) both (DECODE_HEADS_FIRST)")
    p.add_argument("--layouts", default="token-major", choices=["token-major", "both"],
                   help="decode: the cache's pages as the engine holds them, [PAGE, Hkv, D] (token-major), "
                   "or also [Hkv, PAGE, D] (head-major: one program's rows of a page contiguous), "
                   "seen through strides by the same kernel; the JSON's case keys get '/head-major'")
    p.add_argument("--tag", default="", help="suffix of the JSON's name (tune_attention[_fp8][_TAG].json)")
    p.add_argument("--prefill-cases", default="",
                   help="also time prefill_attention for these BxL cases (e.g. 1x7500,16x1024)")
    p.add_argument("--prefill-sdpa", default="",
                   help="time the prefill kernel against the scaled_dot_product_attention path "
                   "(each SDPA backend) for these BxL cases (time_prefill_sdpa)")
    args = p.parse_args()
    fp8 = args.kv_dtype == "fp8"
    one = torch.ones(1, device="cuda")
    kw = dict(k_scale=one, v_scale=one) if fp8 else {}
    H, HKV = map(int, args.heads.split(","))
    gen = torch.Generator("cuda").manual_seed(0)
    res = {"shapes": dict(H=H, HKV=HKV, D=D, page=PAGE, dtype="bfloat16", kv_dtype=args.kv_dtype), "cases": {}}
    scale = D ** -0.5
    default_order = tb.DECODE_HEADS_FIRST
    layouts = [False] if args.layouts == "token-major" else [False, True]
    for case, head_major in itertools.product(filter(None, args.cases.split(",")), layouts):   # --cases "": prefill only
        B, ctx = map(int, case.split("x"))
        q, kv, md = _case(B, ctx, gen, fp8, head_major)
        case += "/head-major" if head_major else ""
        kv_bytes = B * ctx * HKV * D * 2 * kv.element_size()
        ref = tb.decode_attention(q, kv, md, scale, **kw)
        base_s = tb.num_decode_splits(B, HKV, md.block_tables.shape[1], PAGE, q.device)
        rows = []
        splits = sorted({1, 2, 4, base_s}) if B >= 64 else sorted({base_s, max(1, base_s // 2), base_s * 2})
        tiles = (32, 64, 128, 256) if fp8 else (32, 64, 128)   # an FP8 tile of 256 tokens: bf16's 128 in bytes
        grid = (tiles, (4, 8), (2, 3), splits[:2]) if args.small_grid else (tiles, (4, 8), (2, 3, 4), splits)
        configs = [(None, None, None, base_s)] + ([] if args.default_only else list(itertools.product(*grid)))
        orders = [default_order] if args.grid_orders == "default" else [default_order, not default_order]
        for (bn, warps, stages, s), heads_first in itertools.product(configs, orders):
            tb.DECODE_BLOCK_N, tb.DECODE_NUM_WARPS, tb.DECODE_NUM_STAGES = bn, warps, stages
            tb.DECODE_HEADS_FIRST = heads_first
            try:
                out = tb.decode_attention(q, kv, md, scale, num_splits=s, **kw)
                err = (out.float() - ref.float()).abs().max().item()
                us = cuda_event_median_us(lambda: tb.decode_attention(q, kv, md, scale, num_splits=s, **kw))
            except Exception as e:  # out of shared memory / registers for this config
                rows.append({"block_n": bn, "warps": warps, "stages": stages, "splits": s,
                             "heads_first": heads_first, "error": str(e).splitlines()[0][:200]})
                continue
            rows.append({"block_n": bn, "warps": warps, "stages": stages, "splits": s,
                         "heads_first": heads_first, "us": us,
                         "kv_TBps": kv_bytes / us / 1e6, "frac_roofline": kv_bytes / us / 1e6 / 4.35,
                         "max_abs_diff_vs_default": err})
        tb.DECODE_BLOCK_N = tb.DECODE_NUM_WARPS = tb.DECODE_NUM_STAGES = None
        tb.DECODE_HEADS_FIRST = default_order
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        res["cases"][case] = {"default": rows[0], "best": ok[:5], "all": rows}
        keys = ("block_n", "warps", "stages", "splits", "heads_first", "us", "kv_TBps")
        print(case, "default", {k: rows[0].get(k) for k in ("splits", "us", "kv_TBps")},
              "best", [{k: r[k] for k in keys} for r in ok[:3]], flush=True)
        if len(orders) == 2:   # the default config in the other grid order
            print(case, "default config, other grid order", {k: rows[1].get(k) for k in keys}, flush=True)
    if args.prefill_cases:
        res["prefill"] = tune_prefill(args.prefill_cases, gen, args.small_grid)
    if args.prefill_sdpa:
        res["prefill_sdpa"] = time_prefill_sdpa(args.prefill_sdpa, gen)
    os.makedirs(args.out, exist_ok=True)
    import json
    name = "tune_attention" + ("_fp8" if fp8 else "") + (f"_{args.tag}" if args.tag else "")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"command": " ".join([sys.executable] + sys.argv), "gpu": torch.cuda.get_device_name(0),
                   "torch": torch.__version__, **res}, f, indent=1)


if __name__ == "__main__":
    main()
