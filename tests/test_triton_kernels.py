"""Triton kernels (ferrum/ops/) against
float64 / torch references.

On CPU the kernels run in Triton's interpreter. TRITON_INTERPRET must be set before triton is
imported, so each check runs in a fresh subprocess (`_run_interpreted`) with
TRITON_INTERPRET=1 and FERRUM_FORCE_TRITON=1; this pytest process never imports triton and
other test modules are unaffected. The same `check_*` functions run in-process on CUDA in the
`gpu`-marked tests. Sizes are small: the interpreter is slow and the CI CPU has 2 cores.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _shim_interpreter() -> None:
    """Three fixes to Triton 3.6's interpreter, applied in the interpreter subprocess only.

    1. Scalars are shape-[1] numpy arrays and `__index__` is int(array), which numpy >= 2.4
       rejects ("only 0-dimensional arrays can be converted to Python scalars",
       triton-lang/triton#9171): `range(start, end)` with runtime bounds fails. Take the one
       element instead.
    2. Its float32 -> bfloat16 cast truncates the mantissa, and its float32 -> float8e4nv cast
       rounds wrongly (124.3 -> 64), while the GPU (cvt.rn.bf16.f32, cvt.rn.satfinite.e4m3x2.f32)
       and torch round to nearest even; convert with torch so interpreter results round like
       the GPU's and exact comparisons stay meaningful.
    3. Its tl.dot multiplies bfloat16 operands as their raw uint16 bit patterns; widen them
       to float32 first (exact), as the tensor cores do before accumulating in float32."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp
    if getattr(interp, "_ferrum_shim", False):
        return
    orig_patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    orig_convert = interp._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            t = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return orig_convert(input, input_dtype, output_dtype, rounding_mode)

    interp._convert_float = convert
    orig_dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            f32 = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interp.TensorHandle(f32, tl.float32)
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot
    interp._ferrum_shim = True


def _interp_main(name: str, path: str = HERE) -> None:
    """Entry point of the interpreter subprocess: run check `name` of the test module at
    `path` (this one by default) on CPU."""
    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _shim_interpreter()
    if path == HERE:
        check = globals()[name]
    else:
        spec = importlib.util.spec_from_file_location("_ferrum_checks", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        check = getattr(mod, name)
    check("cpu")
    print(f"{name}: ok")


def _run_interpreted(name: str, interpret: bool = True, path: str = HERE) -> str:
    """Run check `name` (a function of the test module at `path` taking a device) in a
    subprocess with TRITON_INTERPRET=1 (or 0: compile only) and FERRUM_FORCE_TRITON=1."""
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0", FERRUM_FORCE_TRITON="1",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    code = ("import importlib.util as u\n"
            f"s = u.spec_from_file_location('_ferrum_tk', {HERE!r}); m = u.module_from_spec(s)\n"
            f"s.loader.exec_module(m); m._interp_main({name!r}, {path!r})\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout}\n{r.stderr[-6000:]}"
    return r.stdout


@contextlib.contextmanager
def prefetched_checks(request, run, checks: dict):
    """Starts `run(check)` for each selected test of `request.module` that `checks` names (test
    function name -> check name, or None: its `check` parameter), two at a time, ahead of the
    tests, which then wait for their own: each interpreter subprocess is single-threaded and
    the CI box has 2 cores. Yields {check name: Future of run's result}."""
    names = [checks[it.originalname] or it.callspec.params["check"] for it in request.session.items
             if getattr(it, "module", None) is request.module and getattr(it, "originalname", None) in checks]
    pool = ThreadPoolExecutor(2)
    try:
        yield {name: pool.submit(run, name) for name in dict.fromkeys(names)}
    finally:
        pool.shutdown(cancel_futures=True)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOL[dtype]
    got, ref = got.double().cpu(), ref.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN in output"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got, ref, atol=tol, rtol=tol), f"{what}: max abs err {err:.3e} > {tol}"


def _md(is_prefill, slot_mapping, block_tables, seq_lens, query_lens=None, context_lens=None, cu=None):
    from ferrum.forward_context import AttentionMetadata
    return AttentionMetadata(is_prefill=is_prefill, slot_mapping=slot_mapping, block_tables=block_tables,
                             seq_lens=seq_lens, max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0,
                             query_lens=query_lens, context_lens=context_lens, cu_seqlens_q=cu)


def _paged_cache(seq_lens: list[int], Hkv: int, D: int, page: int, dtype, device, gen, M: int | None = None):
    """A poisoned paged cache: every slot is NaN except the first seq_len tokens of each
    sequence, which hold random values, so a kernel that reads a masked slot, a page past the
    table's end or a padded table entry produces NaN. Block 0 is never used by a sequence and
    is where padded table entries point. Blocks are a random permutation (non-contiguous).
    Returns kv_cache [2, NB, page, Hkv, D], block_tables [B, M] int64, clean float64 copy."""
    B = len(seq_lens)
    pages = [-(-L // page) for L in seq_lens]
    M = M or max(1, max(pages))
    NB = 1 + sum(pages) + 3
    perm = (torch.randperm(NB - 1, generator=gen) + 1).tolist()
    bt = torch.zeros(B, M, dtype=torch.int64)
    cache = torch.full((2, NB, page, Hkv, D), float("nan"), dtype=torch.float64)
    for b, L in enumerate(seq_lens):
        for p in range(pages[b]):
            blk = perm.pop()
            bt[b, p] = blk
            n = min(page, L - p * page)
            cache[:, blk, :n] = torch.randn(2, n, Hkv, D, generator=gen, dtype=torch.float64)
    cache = cache.to(dtype)
    clean = torch.nan_to_num(cache.double(), nan=0.0)  # the dtype-rounded values, NaN -> 0
    return cache.to(device), bt.to(device), clean


def _ref_attention(q, clean, bt, seq_lens, q_pos, scale, window=None):
    """float64 oracle. q: [B][n, H, D] list, q_pos: [B][n] positions; returns list of [n, H, D].
    With `window` W a query at position p sees keys p - W < k <= p (a mask on full attention)."""
    page, Hkv = clean.shape[2], clean.shape[3]
    outs = []
    for b, L in enumerate(seq_lens):
        qb = q[b].double().cpu()
        n, H, D = qb.shape
        if L == 0:
            outs.append(torch.zeros(n, H, D, dtype=torch.float64))
            continue
        idx = torch.arange(L)
        blk = bt[b].cpu()[idx // page]
        K = clean[0][blk, idx % page].repeat_interleave(H // Hkv, dim=1)  # [L, H, D]
        V = clean[1][blk, idx % page].repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("nhd,lhd->hnl", qb, K) * scale
        qp = torch.as_tensor(q_pos[b])[:, None]
        allowed = idx[None, :] <= qp  # [n, L]
        if window:
            allowed &= idx[None, :] > qp - window
        s = s.masked_fill(~allowed[None], float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), V))
    return outs


# ---------------------------------------------------------------------------------------------
# checks (run on "cpu" in the interpreter subprocess, or on "cuda" in-process)
# ---------------------------------------------------------------------------------------------
def check_write_kv(device: str) -> None:
    from ferrum.ops import attention_triton as tb
    gen = torch.Generator().manual_seed(1)
    for dtype, Hkv, D, page, head_major in [(torch.float32, 2, 64, 16, False), (torch.bfloat16, 3, 128, 8, False),
                                            (torch.bfloat16, 3, 128, 8, True)]:   # pages [Hkv, page, D]
        T, NB = 7, 5
        qkv = torch.randn(T, (4 + 2 * Hkv) * D, generator=gen).to(device)  # fused projection output
        k = qkv[:, 4 * D:(4 + Hkv) * D].view(T, Hkv, D)  # non-contiguous views, as in the model
        v = qkv[:, (4 + Hkv) * D:].view(T, Hkv, D)
        slots = torch.tensor([3, -1, 17, page * NB - 1, 0, -1, 2 * page + 5], device=device)
        cache = torch.randn(2, NB, page, Hkv, D, generator=gen).to(dtype).to(device)
        expect = cache.clone()
        if head_major:   # the same values, held head-major: write_kv writes through the strides
            cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
        keep = slots >= 0
        flat = expect.view(2, NB * page, Hkv, D)
        flat[0, slots[keep]] = k[keep].to(dtype)
        flat[1, slots[keep]] = v[keep].to(dtype)
        tb.write_kv(cache, k, v, slots)
        assert torch.equal(cache, expect), f"write_kv {dtype} Hkv={Hkv} D={D} page={page} head_major={head_major}"
        tb.write_kv(cache, k[:0], v[:0], slots[:0])  # T = 0 is a no-op


def _rope_kv_reference(q, k, v, pos, rot, norms, kind, cache, slots, scales):
    """The torch code of each step on CPU copies (independent of the Triton kernels): the q/k
    norm (`rms_norm_torch`, or Gemma's x / rms * (1 + w) rounded once), `rotate_torch`, the
    torch backend's write_kv of the rows with a slot -> (q, k, cache)."""
    from ferrum.ops import attention_torch
    from ferrum.ops.rms_norm import rms_norm_torch
    from ferrum.ops.rotary import rotate_torch
    q, k, v, pos, slots, cache = (x.detach().cpu().clone(memory_format=torch.contiguous_format)
                                  for x in (q, k, v, pos, slots, cache))
    if kind is not None:
        eps = norms[0].eps
        ws = [m.weight.detach().cpu() for m in norms]
        if kind == "rms":
            q, k = rms_norm_torch(q, ws[0], eps), rms_norm_torch(k, ws[1], eps)
        else:
            def gemma(x, w):
                xf = x.float()
                return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)
            q, k = gemma(q, ws[0]), gemma(k, ws[1])
    c, s = rot.cos.cpu()[pos.long()].unsqueeze(1), rot.sin.cpu()[pos.long()].unsqueeze(1)
    q, k = rotate_torch(q, c, s), rotate_torch(k, c, s)
    keep = slots >= 0
    attention_torch.write_kv(cache, k[keep], v[keep], slots[keep].long(),
                             **{n: t.cpu() for n, t in scales.items()})
    return q, k, cache


def check_rope_kv(device: str) -> None:
    """The fused q/k norm + RoPE + K/V store (ferrum/ops/rope_kv.py), through the Triton
    backend's `rope_write_kv`, against the torch code of each step (`_rope_kv_reference`) on
    views of a fused qkv output: no norm, Qwen3's RMSNorm and Gemma's (1 + w) norm; fp32 and
    bf16; a head_dim that is not a power of two; int32 positions and slots; an FP8 cache with
    values past +-448 (saturated: torch and the GPU's cvt.satfinite both clamp, so this checks
    the values, not that the kernel clamps itself); padded rows (slot -1) left unwritten. A norm module the
    kernel does not compute takes the unfused ops (same numbers). bf16 within one ulp."""
    from ferrum.layers.layernorm import RMSNorm
    from ferrum.layers.rotary_embedding import RotaryEmbedding
    from ferrum.models.gemma3 import GemmaRMSNorm
    from ferrum.ops import attention_triton as tb
    from ferrum.ops.rope_kv import RopeInputs, norm_rope_write_kv
    gen = torch.Generator().manual_seed(11)
    f32, bf16, fp8, i32 = torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32
    kinds = {None: None, RMSNorm: "rms", GemmaRMSNorm: "gemma"}
    for dtype, cache_dtype, H, Hkv, D, norm, idx, head_major in [
            (f32, f32, 4, 2, 64, None, torch.int64, False), (bf16, bf16, 6, 2, 128, RMSNorm, torch.int64, False),
            (bf16, fp8, 8, 2, 128, RMSNorm, i32, False), (f32, f32, 4, 4, 32, GemmaRMSNorm, torch.int64, False),
            (bf16, bf16, 5, 1, 80, GemmaRMSNorm, i32, False), (bf16, bf16, 3, 3, 80, None, torch.int64, False),
            (bf16, fp8, 8, 2, 128, RMSNorm, i32, True)]:   # pages held [Hkv, page, D]
        T, NB, page = 6, 4, 8
        rot = RotaryEmbedding(D, 256, 10000.0).to(device)
        norms = None
        if norm is not None:
            norms = (norm(D, 1e-6), norm(D, 1e-6))
            for m in norms:
                m.weight.data = (torch.randn(D, generator=gen) * 0.5 + (0 if norm is GemmaRMSNorm else 1)).to(dtype)
                m.to(device)
        pos = torch.tensor([0, 5, 17, 100, 3, 255], dtype=idx, device=device)
        slots = torch.tensor([3, -1, 17, page * NB - 1, 0, 9], dtype=idx, device=device)
        qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=gen) * 3).to(dtype).to(device)
        cache = torch.randn(2, NB, page, Hkv, D, generator=gen).to(cache_dtype).to(device)
        if head_major:
            cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
        # FP8: scales small enough that some K / V values pass 448 and saturate
        scales = (dict(k_scale=torch.tensor([0.004], device=device), v_scale=torch.tensor([0.02], device=device))
                  if cache_dtype == fp8 else {})

        def views(x):
            return (x[:, :H * D].view(T, H, D), x[:, H * D:(H + Hkv) * D].view(T, Hkv, D),
                    x[:, (H + Hkv) * D:].view(T, Hkv, D))
        rope = RopeInputs(pos, rot, *(norms or (None, None)))
        q, k, v = views(qkv)
        rq, rk, ref_cache = _rope_kv_reference(q, k, v, pos, rot, norms, kinds[norm], cache, slots, scales)
        what = f"rope_kv {dtype} cache {cache_dtype} H={H} Hkv={Hkv} D={D} norm={kinds[norm]} {idx} head_major={head_major}"
        assert norm_rope_write_kv(cache.clone(), q.clone(), k.clone(), v, slots, rope, **scales) is not None, \
            what + ": the fused kernel declined"
        out = tb.rope_write_kv(cache, q, k, v, slots, rope, **scales)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == f32 else dict(atol=1e-6, rtol=2 ** -7)
        torch.testing.assert_close(out[0].cpu(), rq, **tol, msg=what + " q")
        torch.testing.assert_close(out[1].cpu(), rk, **tol, msg=what + " k")
        assert out[0].data_ptr() == q.data_ptr() and out[1].data_ptr() == k.data_ptr(), what + ": rotated in place"
        got, ref = cache.float().cpu(), ref_cache.float()
        if cache_dtype == fp8:
            assert ref.abs().max() == 448 and got.abs().max() == 448, what + ": no saturated value"
        ctol = (dict(atol=1e-5, rtol=1e-5) if dtype == f32
                else dict(atol=1e-6, rtol=0.13 if cache_dtype == fp8 else 2 ** -7))   # 0.13: one e4m3 step
        torch.testing.assert_close(got, ref, **ctol, msg=what + " cache")
        # a norm module the kernel does not compute: the unfused ops, the same result
        if norm is not None:
            class Other(torch.nn.Module):   # the same math, not a kernel kind
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, x):
                    return self.m(x)
            odd = RopeInputs(pos, rot, Other(norms[0]), Other(norms[1]))
            q2, k2, v2 = views((torch.randn(T, (H + 2 * Hkv) * D, generator=gen) * 3).to(dtype).to(device))
            assert norm_rope_write_kv(cache, q2, k2, v2, slots, odd) is None, what + ": took a foreign norm"
            rq2, rk2, _ = _rope_kv_reference(q2, k2, v2, pos, rot, norms, kinds[norm], cache, slots, scales)
            o2 = tb.rope_write_kv(cache, q2, k2, v2, slots, odd, **scales)
            torch.testing.assert_close(o2[0].cpu(), rq2, **tol, msg=what + " unfused q")


def _decode_case(device, dtype, H, Hkv, D, page, seq_lens, splits, gen, bt_dtype=torch.int64,
                 sl_dtype=torch.int32, M=None, head_major=False):
    from ferrum.ops import attention_triton as tb
    cache, bt, clean = _paged_cache(seq_lens, Hkv, D, page, dtype, device, gen, M=M)
    if head_major:   # the same values, pages held [Hkv, page, D]: the kernel reads through strides
        cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
    B = len(seq_lens)
    q = torch.randn(B, H, D, generator=gen).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=sl_dtype, device=device)
    md = _md(False, torch.zeros(B, dtype=torch.int64, device=device), bt.to(bt_dtype), sl)
    scale = D ** -0.5
    ref = torch.stack([o[0] for o in _ref_attention(list(q[:, None]), clean, bt, seq_lens,
                                                     [[L - 1] for L in seq_lens], scale)])
    for S in splits:
        out = tb.decode_attention(q, cache, md, scale, num_splits=S)
        assert out.shape == q.shape and out.dtype == q.dtype
        _assert_close(out, ref, dtype, f"decode {dtype} H={H} Hkv={Hkv} D={D} page={page} splits={S}")
        assert not out[torch.tensor(seq_lens, device=out.device) == 0].any(), "seq_len 0 must give zeros"


def check_decode(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    f32, bf16 = torch.float32, torch.bfloat16
    # lengths: 0 (padded row), 1, not multiples of the page, exact multiples
    _decode_case(device, f32, 2, 2, 64, 16, [0, 1, 17, 61, 48], [1, 3, None], gen)         # group 1
    _decode_case(device, f32, 6, 2, 64, 16, [33, 0, 70], [2], gen, bt_dtype=torch.int32)   # group 3
    _decode_case(device, bf16, 8, 2, 128, 16, [5, 100, 0, 64], [1, 4], gen,
                 sl_dtype=torch.int64, M=9)                                                # group 4
    _decode_case(device, f32, 8, 1, 128, 8, [45, 9], [5], gen)                             # group 8, page 8
    _decode_case(device, torch.float16, 4, 2, 32, 32, [70, 3], [2], gen)                   # D 32, page 32
    _decode_case(device, bf16, 4, 2, 64, 16, [40, 0, 19], [1, 2], gen, head_major=True)   # pages [Hkv, page, D]
    # more splits than tiles: most programs see an empty range and must write neutral partials
    _decode_case(device, bf16, 4, 4, 64, 16, [0, 0, 2], [8], gen)
    # the sequences-first grid (DECODE_HEADS_FIRST False): the same results
    from ferrum.ops import attention_triton as tb
    tb.DECODE_HEADS_FIRST = False
    try:
        _decode_case(device, bf16, 8, 2, 128, 16, [5, 100, 0, 64], [1, 4], gen)
    finally:
        tb.DECODE_HEADS_FIRST = True


def _prefill_case(device, dtype, H, Hkv, D, page, ctx_lens, q_lens, gen, impl="triton", blocks=(None, None),
                  heavy_first=True, sdpa_min=0, pad=None):
    """impl "triton": `attention_triton.prefill_attention` with the given tile sizes and launch
    order (`PREFILL_HEAVY_FIRST`) and `KERNELS.sdpa_prefill_min_tokens` = sdpa_min (chunks of
    that many tokens without context take scaled_dot_product_attention, padded to multiples
    of `pad` (`SDPA_LEN_MULTIPLE`), the kernel the others); "torch": the torch backend (SDPA)
    on the same inputs. With sdpa_min, each sequence's output also equals its output alone."""
    from ferrum.config import KERNELS
    from ferrum.ops import attention_torch, attention_triton as tb
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    cache, bt, clean = _paged_cache(seq_lens, Hkv, D, page, dtype, device, gen)
    # this chunk's fresh K/V (what write_kv put in the cache), needed by the SDPA path
    pos = [torch.arange(c, c + n) for c, n in zip(ctx_lens, q_lens)]
    slots = torch.cat([bt[b].cpu()[p // page] * page + p % page for b, p in enumerate(pos)])
    k = cache[0].view(-1, Hkv, D)[slots.to(device)]
    v = cache[1].view(-1, Hkv, D)[slots.to(device)]
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=gen).to(dtype).to(device)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    md = _md(True, slots.to(device), bt, torch.tensor(seq_lens, dtype=torch.int32, device=device),
             query_lens=list(q_lens), context_lens=list(ctx_lens), cu=cu.to(device))
    ref = torch.cat(_ref_attention(list(q.split(q_lens)), clean, bt, seq_lens, [p.tolist() for p in pos], D ** -0.5))
    saved = (tb.PREFILL_BLOCK_M, tb.PREFILL_BLOCK_N, tb.PREFILL_HEAVY_FIRST, KERNELS.sdpa_prefill_min_tokens,
             tb.SDPA_LEN_MULTIPLE)
    tb.PREFILL_BLOCK_M, tb.PREFILL_BLOCK_N = blocks
    tb.PREFILL_HEAVY_FIRST = heavy_first
    KERNELS.sdpa_prefill_min_tokens = sdpa_min
    tb.SDPA_LEN_MULTIPLE = pad or tb.SDPA_LEN_MULTIPLE
    sixteen = dtype in (torch.bfloat16, torch.float16)   # float32 keeps the kernel
    want = [b for b, (c, n) in enumerate(zip(ctx_lens, q_lens)) if c == 0 and n >= sdpa_min] if sdpa_min and sixteen else []
    assert tb._sdpa_sequences(q, cache, md, k, None) == want
    try:
        backend = attention_torch if impl == "torch" else tb
        out = backend.prefill_attention(q, cache, md, D ** -0.5, k, v)
        if sdpa_min:   # a sequence's rows do not depend on the batch it is in
            for b, (c, n) in enumerate(zip(ctx_lens, q_lens)):
                r = slice(int(cu[b]), int(cu[b + 1]))
                one = _md(True, slots[r].to(device), bt[b:b + 1], md.seq_lens[b:b + 1], query_lens=[n],
                          context_lens=[c], cu=torch.tensor([0, n], device=device))
                alone = tb.prefill_attention(q[r], cache, one, D ** -0.5, k[r], v[r])
                assert torch.equal(alone, out[r]), f"sequence {b} differs alone ({'sdpa' if b in want else 'kernel'})"
    finally:
        (tb.PREFILL_BLOCK_M, tb.PREFILL_BLOCK_N, tb.PREFILL_HEAVY_FIRST, KERNELS.sdpa_prefill_min_tokens,
         tb.SDPA_LEN_MULTIPLE) = saved
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype, f"prefill[{impl}] {dtype} H={H} Hkv={Hkv} D={D} page={page} "
                                   f"ctx={ctx_lens} q={q_lens} blocks={blocks}")


def check_prefill(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    f32, bf16 = torch.float32, torch.bfloat16
    ctx, ql = [0, 37, 16, 50], [20, 5, 33, 1]  # fresh prompt, chunks with cached context, 1-token chunk
    _prefill_case(device, f32, 4, 1, 64, 16, ctx, ql, gen, blocks=(16, 16))   # group 4, many tiles
    _prefill_case(device, f32, 4, 1, 64, 16, ctx, ql, gen, blocks=(16, 16), heavy_first=False)  # grid (M, B, H)
    _prefill_case(device, f32, 3, 3, 64, 16, ctx[:2], ql[:2], gen)            # group 1, default tiles
    _prefill_case(device, bf16, 6, 2, 128, 8, [0, 21], [19, 12], gen, blocks=(16, 32))  # group 3, page 8
    _prefill_case(device, bf16, 8, 1, 64, 16, [30], [9], gen)                 # group 8
    # the torch backend with the same inputs (SDPA: flash path for ctx == 0, gather + mask otherwise)
    _prefill_case(device, f32, 4, 1, 64, 16, ctx, ql, gen, impl="torch")
    _prefill_case(device, bf16, 6, 2, 128, 8, [0, 21], [19, 12], gen, impl="torch")
    # chunks without cached context of >= sdpa_min tokens: scaled_dot_product_attention per
    # sequence (padded to the multiple), the kernel's SUBSET grid for the others
    _prefill_case(device, bf16, 8, 2, 128, 16, [0, 0, 0], [40, 1, 17], gen, sdpa_min=1)          # GQA, all SDPA
    _prefill_case(device, bf16, 4, 4, 64, 8, [0, 37, 0, 50], [16, 5, 17, 1], gen, sdpa_min=16, pad=8)  # MHA, mixed
    _prefill_case(device, bf16, 6, 2, 128, 8, [0, 21, 0], [19, 12, 18], gen, sdpa_min=19)  # 19: SDPA, 18: kernel
    _prefill_case(device, f32, 4, 1, 64, 16, ctx, ql, gen, sdpa_min=1)    # float32: all through the kernel


def check_attention_layer(device: str) -> None:
    """`Attention` with the Triton backend against the torch backend through a
    prefill chunk without context, a chunk with context (two sequences) and two decode steps,
    with metadata built as ModelRunner builds it (int64 tables, int32/int64 lengths)."""
    from ferrum.ops import attention_torch, attention_triton
    from ferrum.forward_context import AttentionMetadata, forward_context
    from ferrum.layers.attention import Attention
    gen = torch.Generator().manual_seed(7)
    H, Hkv, D, page, NB = 4, 2, 64, 16, 12
    tables = [[3, 7, 1], [10, 2, 5]]
    layers = {}
    backends = {"torch": attention_torch, "triton": attention_triton, "triton-head-major": attention_triton}
    for name in backends:
        a = Attention(H, Hkv, D, D ** -0.5)
        a.kv_cache = torch.zeros(2, NB, page, Hkv, D, device=device)
        if name == "triton-head-major":   # pages held [Hkv, page, D], the same view
            a.kv_cache = torch.zeros(2, NB, Hkv, page, D, device=device).transpose(2, 3)
        layers[name] = a
    lens = [0, 0]

    def step(qlens, is_prefill):
        bt = torch.tensor(tables, dtype=torch.int64)
        pos = torch.cat([torch.arange(lens[b], lens[b] + n) for b, n in enumerate(qlens)])
        seq = torch.repeat_interleave(torch.arange(2), torch.tensor(qlens))
        slots = bt[seq, pos // page] * page + pos % page
        T = len(pos)
        q = torch.randn(T, H * D, generator=gen).to(device)
        kv = torch.randn(T, 2 * Hkv * D, generator=gen).to(device)
        k, v = kv[:, :Hkv * D], kv[:, Hkv * D:]  # non-contiguous, as split from qkv_proj
        new_lens = [c + n for c, n in zip(lens, qlens)]
        cu = torch.tensor([0, qlens[0], qlens[0] + qlens[1]])
        md = AttentionMetadata(
            is_prefill=is_prefill, slot_mapping=slots.to(device), block_tables=bt.to(device),
            seq_lens=torch.tensor(new_lens, dtype=torch.int32 if is_prefill else torch.int64).to(device),
            max_seq_len=max(new_lens), query_lens=list(qlens) if is_prefill else None,
            context_lens=list(lens) if is_prefill else None, cu_seqlens_q=cu.to(device) if is_prefill else None)
        outs = {}
        for name, a in layers.items():
            with forward_context(md, backends[name]):
                outs[name] = a(q, k, v)
        lens[:] = new_lens
        for name in ("triton", "triton-head-major"):
            _assert_close(outs[name], outs["torch"], torch.float32, f"Attention layer {name} qlens={qlens}")
            assert torch.equal(layers[name].kv_cache, layers["torch"].kv_cache), name

    step([21, 9], True)   # fresh prompts
    step([12, 20], True)  # second chunks over cached context
    step([1, 1], False)
    step([1, 1], False)


def check_fused_ops(device: str) -> None:
    """The norm / SiLU*mul / RoPE kernels against their torch code (`*_torch`, run on CPU
    copies: the ops themselves dispatch to the kernels here, also on CPU in the interpreter)."""
    from ferrum.ops.activation import silu_and_mul, silu_and_mul_torch
    from ferrum.ops.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_torch
    from ferrum.ops.rotary import apply_rotary_emb, rotate_torch
    from ferrum.layers.rotary_embedding import RotaryEmbedding
    gen = torch.Generator().manual_seed(4)
    dev = lambda t: t.to(device)  # noqa: E731
    eps = 1e-5
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (96, 256):  # 96: not a power of two -> masked tail
            w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
            x = torch.randn(2, 3, hidden, generator=gen).to(dtype)
            r = torch.randn(2, 3, hidden, generator=gen).to(dtype)
            ref_r = x + r
            ref_n = rms_norm_torch(ref_r, w, eps)
            got_n, got_r = fused_add_rms_norm(dev(x), dev(r), dev(w), eps)
            assert got_n.dtype == ref_n.dtype and got_r.dtype == ref_r.dtype
            assert torch.equal(got_r.cpu(), ref_r), "residual sum must equal x + residual exactly"
            _assert_close(got_n, ref_n, dtype, f"fused_add_rms_norm {dtype} {hidden}")
            xd = dev(x)
            got_n, got_r = fused_add_rms_norm(xd, None, dev(w), eps)
            assert got_r is xd
            _assert_close(got_n, rms_norm_torch(x, w, eps), dtype, f"rms_norm(residual=None) {dtype} {hidden}")
            _assert_close(rms_norm(xd, dev(w), eps), rms_norm_torch(x, w, eps), dtype, f"rms_norm {dtype}")
        # q / k norm: [T, heads, D] views of a fused qkv output (row stride > heads * D), read in
        # place; 37 * 3 rows = several programs of ROWS rows with a masked tail
        D = 128
        w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
        qkv = torch.randn(37, 5 * D, generator=gen).to(dtype)
        q = dev(qkv)[:, :3 * D].reshape(37, 3, D)
        assert not q.is_contiguous()
        from ferrum.ops import rms_norm as rms_norm_module
        # 111 rows // 37 = 3 rows a program, rounded down to 2 (a power of two), masked tail
        min_programs, rms_norm_module._MIN_PROGRAMS = rms_norm_module._MIN_PROGRAMS, 37
        try:
            got = rms_norm(q, dev(w), eps)
        finally:
            rms_norm_module._MIN_PROGRAMS = min_programs
        assert got.shape == (37, 3, D)
        _assert_close(got, rms_norm_torch(qkv[:, :3 * D].reshape(37, 3, D), w, eps), dtype,
                      f"rms_norm strided heads {dtype}")
        if dtype == torch.bfloat16:  # float32 residual stream, 16-bit activations, float32 weight
            x16 = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
            r32 = torch.randn(4, 96, generator=gen)
            w32 = 1 + 0.1 * torch.randn(96, generator=gen)
            ref_r = x16 + r32
            ref_n = rms_norm_torch(ref_r, w32, eps)
            got_n, got_r = fused_add_rms_norm(dev(x16), dev(r32), dev(w32), eps)
            assert got_n.dtype == ref_n.dtype == torch.float32 and torch.equal(got_r.cpu(), ref_r)
            _assert_close(got_n, ref_n, torch.float32, "fused_add_rms_norm mixed dtypes")
        for d in (100, 64):
            x = torch.randn(3, 2, 2 * d, generator=gen).to(dtype)
            got = silu_and_mul(dev(x))
            assert got.shape == (3, 2, d) and got.dtype == dtype
            _assert_close(got, silu_and_mul_torch(x), dtype, f"silu_and_mul {dtype} d={d}")
        for D, hq, hk in ((64, 4, 2), (128, 3, 1)):
            rope = RotaryEmbedding(D, 64, 10000.0)  # only its cos/sin tables
            T = 5
            qkv_cpu = torch.randn(T, (hq + 2 * hk) * D, generator=gen).to(dtype)
            pos = torch.tensor([0, 7, 3, 63, 20])
            c, s = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
            ref_q = rotate_torch(qkv_cpu[:, :hq * D].reshape(T, hq, D), c, s)
            ref_k = rotate_torch(qkv_cpu[:, hq * D:(hq + hk) * D].reshape(T, hk, D), c, s)
            qkv = dev(qkv_cpu)
            q = qkv[:, :hq * D].view(T, hq, D)  # views into the fused projection, as in the model
            k = qkv[:, hq * D:(hq + hk) * D].view(T, hk, D)
            oq, ok = apply_rotary_emb(dev(pos), q, k, dev(rope.cos), dev(rope.sin))
            assert oq is q and ok is k, "the kernel rotates in place"
            _assert_close(q, ref_q, dtype, f"rope q {dtype} D={D}")
            _assert_close(k, ref_k, dtype, f"rope k {dtype} D={D}")
            assert torch.equal(qkv[:, (hq + hk) * D:].cpu(), qkv_cpu[:, (hq + hk) * D:]), "rope wrote outside q/k"


def check_gumbel_sampler(device: str) -> None:
    """The one-pass sampler (ferrum/ops/sampling.py): greedy rows are torch.argmax exactly
    (first maximum on ties, bf16 logits too); sampled frequencies follow softmax(logits / T);
    the Sampler takes it for temperature-only unseeded batches and keeps the torch race for
    seeded ones; torch.manual_seed repeats its draws."""
    from ferrum.layers import sampler as sampler_mod
    from ferrum.layers.sampler import Sampler, SamplingMetadata
    from ferrum.ops.sampling import gumbel_argmax
    from ferrum.sampling_params import SamplingParams
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 9000, generator=gen)
    x[0, 17] = x[0, 4000] = 60.0     # a tie across two 4096-wide blocks: the first wins
    x[2, 8999] = 60.0                # the maximum in the ragged last block
    for dtype in (torch.float32, torch.bfloat16):
        logits = x.to(device, dtype)
        ids = gumbel_argmax(logits, torch.ones(3, device=device), torch.ones(3, dtype=torch.bool, device=device), 5)
        assert ids.tolist() == logits.float().argmax(1).tolist() == [17, x[1].argmax().item(), 8999]

    n = 256 if device == "cpu" else 20000   # the interpreter runs one program per row
    p = torch.tensor([0.1, 1.0, -1.0, 0.5, 2.0, -3.0, 0.0])
    for temp in (0.5, 1.0):
        ids = gumbel_argmax(p.expand(n, 7).contiguous().to(device), torch.full((n,), temp, device=device),
                            torch.zeros(n, dtype=torch.bool, device=device), 11)
        freq = torch.bincount(ids.cpu(), minlength=7).float() / n
        want = (p / temp).softmax(0)
        err = (freq - want).abs().max().item()
        # 4 standard deviations of the largest-variance frequency (T=0.5 vs 1 moves p[4] by 0.3)
        assert err < 4 * (0.25 / n) ** 0.5, f"T={temp}: frequencies {freq} vs softmax {want}, max err {err:.3f}"

    calls = []
    real = sampler_mod.gumbel_argmax
    sampler_mod.gumbel_argmax = lambda *a: calls.append(1) or real(*a)
    try:
        V = 500
        logits = torch.randn(4, V, generator=gen).to(device)
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                  SamplingParams(temperature=1.2, logit_bias={3: 100.0}), SamplingParams(temperature=0.7)]
        md = SamplingMetadata.build(params, [[]] * 4, [[]] * 4, [None] * 4, [0], V, device)
        torch.manual_seed(1)
        first = Sampler()(logits, md).token_ids.tolist()
        torch.manual_seed(1)
        again = Sampler()(logits, md).token_ids.tolist()
        assert len(calls) == 2 and first == again
        assert first[0] == logits[0].argmax().item() and first[2] == 3
        seeded = [None, torch.Generator(device=device).manual_seed(3), None, None]
        md = SamplingMetadata.build(params, [[]] * 4, [[]] * 4, seeded, [0], V, device)
        Sampler()(logits, md)
        assert len(calls) == 2, "a seeded row must keep its own generator's noise"
    finally:
        sampler_mod.gumbel_argmax = real


def check_fp8_quant_rows(device: str) -> None:
    """The one-pass per-token FP8 activation quantization (ferrum/ops/fp8.py) against its torch
    code: scales equal, e4m3 bytes equal (on the GPU at most 0.1% may sit one e4m3 step away,
    should its float32 division round differently from torch's), dynamic and static scales, a
    zero row, a ragged K past one 4096 block."""
    from ferrum.config import KERNELS
    from ferrum.ops import fp8
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 4100, generator=gen) * 3).to(torch.bfloat16)
    x[1] = 0
    x[2, 7] = 1000.0
    x = x.to(device)
    for input_scale in (None, torch.tensor([0.05], device=device)):
        q, s = fp8.quantize_fp8_per_token(x, input_scale)
        force = KERNELS.force_triton
        KERNELS.force_triton = False
        try:
            q_ref, s_ref = fp8.quantize_fp8_per_token(x.cpu(), None if input_scale is None else input_scale.cpu())
        finally:
            KERNELS.force_triton = force
        assert q.dtype == fp8.FP8_DTYPE and s.shape == (6, 1)
        assert torch.equal(s.cpu(), s_ref), f"scales differ: {s.flatten()} vs {s_ref.flatten()}"
        diff = q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)
        if device == "cpu":
            assert not diff.any(), f"{int(diff.sum())} e4m3 values differ"
        else:
            step = torch.exp2(torch.floor(torch.log2(q_ref.float().abs().clamp(min=2 ** -6))) - 3)
            far = (q.cpu().float() - q_ref.float()).abs() > step
            assert diff.float().mean() <= 1e-3 and not far.any(), f"{int(diff.sum())} differ, {int(far.sum())} by > 1 step"


def check_gemv(device: str) -> None:
    """Batch-1 GEMV against F.linear in float64, on unmasked (even) and masked tiles, with and
    without bias."""
    from ferrum.ops import gemv
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        for N, K, bias, cfg in ((64, 256, False, (8, 128, 4, 1)), (70, 200, True, (8, 64, 4, 1)),
                                (48, 512, True, (16, 512, 4, 2))):
            x = torch.randn(1, K, generator=gen).to(dtype)
            w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
            b = torch.randn(N, generator=gen).to(dtype) if bias else None
            got = gemv.gemv(x.to(device), w.to(device), None if b is None else b.to(device), config=cfg)
            ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            assert got.shape == (1, N) and got.dtype == dtype
            _assert_close(got, ref, dtype, f"gemv {dtype} N={N} K={K} bias={bias} cfg={cfg}")


def check_prefill_graph(device: str) -> None:
    """A single sequence's prefill through the padded static buffers of the prefill CUDA graphs
    (captured and replayed on CUDA; run directly, uncaptured, in the interpreter): the logits
    and K/V of the eager prefill, for a fresh prompt padded 23 -> 32 rows and for a chunk after
    23 cached tokens (10 -> 16), with no slot outside the sequence written."""
    import json
    import tempfile
    from ferrum.distributed.parallel_state import init_tensor_parallel
    from ferrum.executor.model_runner import ModelRunner
    from ferrum.executor.prefill_graph import PrefillCudaGraphs, PrefillGraphInputs
    from ferrum.interfaces import KvCacheHandle
    from ferrum.loader.resolve import resolve_model
    from ferrum.ops import attention_triton
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    init_tensor_parallel(0, 1, None)
    runners = []
    for head_major in (False, True):   # the same dummy weights (seed 0), each with its own NaN-poisoned cache
        r = ModelRunner(resolve_model(f"dummy:{f.name}"), device, torch.float32, "dummy", 0, progress=False)
        r.allocate_kv_cache(12, 16)
        for layer in r.attn_layers:
            layer.kv_cache.fill_(float("nan"))
            if head_major:   # the graph runner's pages held [Hkv, 16, D]: the kernels read through strides
                layer.kv_cache = layer.kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
        r.attn_backend = attention_triton
        runners.append(r)
    ref, run = runners
    M = 16
    if device == "cuda":
        graphs = PrefillCudaGraphs(run, [16, 32, 64], M)

        def prefill(ids, h):
            return graphs.run(ids, h)
    else:
        inputs = PrefillGraphInputs(run, 64, M)

        def prefill(ids, h):
            bucket = 32 if len(ids) > 16 else 16
            inputs.fill(ids, h, bucket)
            return inputs.forward(bucket)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (33,), generator=gen).tolist()
    table = [7, 2, 9]
    for lo, hi in ((0, 23), (23, 33)):
        h = KvCacheHandle("s", table, lo, 16)
        want, _ = ref.prefill([ids[lo:hi]], [h])
        got = prefill(ids[lo:hi], h)
        _assert_close(got, want, torch.float32, f"prefill graph logits, tokens {lo}..{hi}")
        for a, b in zip(ref.attn_layers, run.attn_layers):
            assert torch.equal(a.kv_cache.isnan(), b.kv_cache.isnan()), "a padded row wrote the cache"
            _assert_close(torch.nan_to_num(b.kv_cache), torch.nan_to_num(a.kv_cache), torch.float32,
                          f"prefill graph K/V, tokens {lo}..{hi}")
    # the start-up warm-up forward (all rows padding) stores nothing and changes no later result
    before = [layer.kv_cache.clone() for layer in run.attn_layers]
    from ferrum.executor import model_runner
    shapes, real = [], model_runner.PrefillGraphInputs

    def recording(runner, tokens, blocks):
        shapes.append((tokens, blocks))
        return real(runner, tokens, blocks)
    model_runner.PrefillGraphInputs = recording
    try:
        run.warmup_prefill(50)
    finally:
        model_runner.PrefillGraphInputs = real
    # one chunk per class of Triton's integer specialization (multiple of 16, other)
    assert [(t % 16 == 0, b % 16 == 0) for t, b in shapes] == [(True, True), (False, False)], shapes
    assert all(t <= 50 and b > 1 for t, b in shapes), shapes
    for layer, kv in zip(run.attn_layers, before):
        assert torch.equal(layer.kv_cache.isnan(), kv.isnan()) and torch.equal(
            torch.nan_to_num(layer.kv_cache), torch.nan_to_num(kv)), "warmup_prefill wrote the cache"
    h = KvCacheHandle("s", table, 23, 16)
    _assert_close(prefill(ids[23:33], h), ref.prefill([ids[23:33]], [h])[0], torch.float32,
                  "prefill after warmup_prefill")


def sm90_compile(fn, consts: dict, ptrs: dict, warps: int, stages: int, what: str,
                 no_hint: tuple[str, ...] = (), loop_without_barrier: bool = False, maxnreg: int | None = None) -> None:
    """Compile Triton (or Gluon) kernel `fn` for sm_90 (H100/H200) without a GPU (Triton's
    bundled ptxas) and assert no register spills and shared memory within the 227 KB an sm_90
    block may use. consts: constexpr values; ptrs: pointer argument -> "*bf16" etc. (others
    are i32, or fp32 for qk_scale / eps). Integer and pointer arguments carry the
    divisible-by-16 hint the JIT adds at run time for such values, except those named in
    `no_hint` (e.g. a row count). `loop_without_barrier`: also assert that no loop of the SASS
    (a backward branch's range) holds a BAR or a shared-memory access. `maxnreg`: the
    launch's register cap, as the kernel's launcher passes it."""
    k, usage, sass = sm90_sass(fn, consts, ptrs, warps, stages, no_hint, maxnreg, dump_sass=loop_without_barrier)
    if loop_without_barrier:
        for body in _sass_loops(sass):
            bad = [i for i in body if i.split()[0].split(".")[0] in ("BAR", "LDS", "STS", "STSM", "LDSM")]
            assert not bad, f"{what}: the loop moves data through shared memory: {bad[:4]}"
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    print(f"sm_90 {what}: shared {k.metadata.shared} B, {line.split()[0]}, {line.split()[1]}")
    assert "STACK:0 " in line + " ", f"{what}: register spills: {line}"
    assert k.metadata.shared <= 227 * 1024, f"{what}: shared memory {k.metadata.shared}"


def sm90_sass(fn, consts: dict, ptrs: dict, warps: int, stages: int, no_hint: tuple[str, ...] = (),
              maxnreg: int | None = None, dump_sass: bool = True):
    """(compiled kernel, cuobjdump -res-usage text, SASS text) of `fn` compiled for sm_90 with
    Triton's bundled ptxas, no GPU needed; arguments as `sm90_compile`'s (which checks the
    result; benchmarks/sass_loop.py counts its loops' instructions). `dump_sass=False` leaves
    the SASS text empty: cuobjdump takes ~0.3-0.6 s per kernel to print it (-res-usage ~3 ms),
    most of the compile tests' time when the kernels are in Triton's cache."""
    import subprocess as sp
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sig = {}
    for n in fn.arg_names:
        sig[n] = "constexpr" if n in consts else ptrs.get(n, "fp32" if n in ("qk_scale", "eps") else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32") and n not in no_hint}
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    k = triton.compile(source(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {})))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = sp.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = sp.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True,
                      check=True).stdout if dump_sass else ""
    return k, usage, sass


def _sass_loops(sass: str) -> list[list[str]]:
    """The instructions (opcode first, predicate dropped) of each loop in cuobjdump SASS: the
    range from a backward branch's target to the branch."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())))
    loops = []
    for addr, text in ins:
        m = re.match(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append([t for a, t in ins if int(m.group(1), 16) <= a <= addr])
    return loops


def check_sm90_compile(device: str) -> None:
    """The default configurations of the attention and fused-op kernels compile for sm_90
    without spills (`sm90_compile`)."""
    from ferrum.ops import attention_triton as tb
    from ferrum.ops import activation, rms_norm
    bf16, f32 = torch.bfloat16, torch.float32
    tname = {bf16: "bf16", f32: "fp32"}
    build = sm90_compile

    # (q dtype, head_dim, FP8 KV cache)
    for dtype, D, fp8 in ((bf16, 128, False), (bf16, 256, False), (f32, 128, False), (bf16, 128, True)):
        t = "*" + tname[dtype]
        c = "*fp8e4nv" if fp8 else t
        for splits, windowed in ((4, False), (1, False), (4, True)):
            bn, w, st = tb._decode_config(D, dtype, splits, fp8)
            build(tb._decode_split_kernel,
                  dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=D, PAGE=16, BLOCK_N=bn, NUM_SPLITS=splits,
                       DIRECT_OUT=splits == 1, DOT_PREC=tb._dot_precision(dtype), FP8=fp8, USE_PDL=True,
                       WINDOWED=windowed),
                  dict(q_ptr=t, kc_ptr=c, vc_ptr=c, bt_ptr="*i32", seqlen_ptr="*i32", ks_ptr="*fp32",
                       vs_ptr="*fp32", o_ptr=t if splits == 1 else "*fp32", lse_ptr=t if splits == 1 else "*fp32"),
                  w, st, f"decode {dtype} D={D} splits={splits} fp8_kv={fp8} windowed={windowed}")
        bm, bn, w, st = tb._prefill_config(D, dtype)
        for windowed, subset in ((False, False), (True, False), (False, True)):
            build(tb._prefill_kernel,
                  dict(GROUP=4, HEAD_DIM=D, PAGE=16, BLOCK_M=bm, BLOCK_N=bn,
                       DOT_PREC=tb._dot_precision(dtype), FP8=fp8, HEAVY_FIRST=tb.PREFILL_HEAVY_FIRST,
                       WINDOWED=windowed, SUBSET=subset),
                  dict(q_ptr=t, kc_ptr=c, vc_ptr=c, o_ptr=t, bt_ptr="*i64", seqlen_ptr="*i32", cu_q_ptr="*i64",
                       ks_ptr="*fp32", vs_ptr="*fp32", seq_idx_ptr="*i32"),
                  w, st, f"prefill {dtype} D={D} fp8_kv={fp8} windowed={windowed} subset={subset}")
    for bits in (0, 8, 16):
        build(tb._decode_merge_kernel, dict(NUM_SPLITS=5, SPLITS_PAD=8, HEAD_DIM=128, QBITS=bits, USE_PDL=True),
              dict(o_part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", qx_ptr={16: "*i16"}.get(bits, "*i8"),
                   dx_ptr="*fp32"), 4, 2, f"decode merge qbits {bits}")
    for c in ("*bf16", "*fp8e4nv"):
        build(tb._write_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, FP8=c != "*bf16",
                                        USE_PDL=True),
              dict(k_ptr="*bf16", v_ptr="*bf16", kc_ptr=c, vc_ptr=c, slot_ptr="*i64", ks_ptr="*fp32", vs_ptr="*fp32"),
              4, 2, f"write_kv {c}")
    for bits in (0, 8, 16):  # the int8 / int16 copy for a Q4_K / 4-bit GEMV (ferrum/ops/act_quant.py)
        q = {16: "*i16"}.get(bits, "*i8")
        build(rms_norm._add_rms_norm_kernel, dict(HAS_RES=True, BLOCK=8192, ROWS=1, QBITS=bits, USE_PDL=True),
              dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", q_ptr=q,
                   d_ptr="*fp32"), 8, 2, f"rmsnorm qbits {bits}")
        build(activation._silu_and_mul_kernel, dict(BLOCK=1024, QBITS=bits, USE_PDL=True),
              dict(x_ptr="*bf16", out_ptr="*bf16", q_ptr=q, d_ptr="*fp32"), 4, 2, f"silu_and_mul qbits {bits}")
    norm_ptrs = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16",
                     q_ptr="*i8", d_ptr="*fp32")
    build(rms_norm._add_rms_norm_kernel, dict(HAS_RES=False, BLOCK=128, ROWS=32, QBITS=0, USE_PDL=True),
          norm_ptrs, 8, 2, "rmsnorm q/k heads")
    from ferrum.ops import gemv
    bn, bk, w, st = gemv.gemv_config(4096, 4096)
    build(gemv._gemv_kernel, dict(HAS_BIAS=False, EVEN=True, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=True),
          dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16"), w, st, "gemv")
    from ferrum.ops import fp8
    build(fp8._quant_fp8_rows_kernel, dict(STATIC=False, BLOCK=4096),
          dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", in_scale_ptr="*fp32"), 4, 1, "fp8 row quant")
    from ferrum.ops import sampling
    build(sampling._gumbel_argmax_kernel, dict(BLOCK=sampling.BLOCK),
          dict(logits_ptr="*bf16", temp_ptr="*fp32", greedy_ptr="*i1", val_ptr="*fp32", idx_ptr="*i32"), 8, 1,
          "gumbel sampler", no_hint=("splits", "seed", "V"))
    from ferrum.ops import rope_kv
    for norm, c, store in ((0, "*bf16", False), (0, "*bf16", True), (1, "*bf16", True), (1, "*fp8e4nv", True),
                           (2, "*bf16", True)):
        build(rope_kv._norm_rope_kv_kernel, dict(HQ=32, HK=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=64, NORM=norm,
                                                 FP8=c != "*bf16", STORE_KV=store, USE_PDL=True),
              dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
                   qw_ptr="*bf16", kw_ptr="*bf16", kc_ptr=c, vc_ptr=c, slot_ptr="*i64", ks_ptr="*fp32",
                   vs_ptr="*fp32"), 4, 2, f"rope_kv norm {norm} cache {c}" if store else "rope")


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
interp = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


@interp
@pytest.mark.parametrize("check", ["check_write_kv", "check_rope_kv", "check_decode", "check_prefill",
                                   "check_attention_layer", "check_fused_ops", "check_gemv", "check_prefill_graph",
                                   "check_gumbel_sampler", "check_fp8_quant_rows"])
def test_kernel_in_interpreter(check, interpreted):
    interpreted[check].result()


@pytest.fixture(scope="module")
def interpreted(request):
    with prefetched_checks(request, _run_interpreted, {"test_kernel_in_interpreter": None}) as futures:
        yield futures


def _has_ptxas() -> bool:
    if not HAS_TRITON:
        return False
    spec = importlib.util.find_spec("triton")
    return os.path.exists(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _has_ptxas(), reason="needs triton with its bundled ptxas")
def test_kernels_compile_for_sm90_without_spills():
    """Catches compile errors and register spills of the default tile configurations on a
    machine without a GPU (subprocess: no interpreter, no CUDA needed)."""
    print(_run_interpreted("check_sm90_compile", interpret=False))


def test_decode_attn_config_overrides_the_default_tile():
    """--decode-attn-config / FERRUM_DECODE_ATTN_CONFIG replaces `_decode_config`'s choice for
    every call (a tile to time end to end); the module knobs (tune_attention.py's sweep) still
    win over it."""
    from ferrum.config import KERNELS
    from ferrum.ops import attention_triton as tb
    saved = KERNELS.decode_attn_config
    try:
        assert tb._decode_config(128, torch.bfloat16, 1, fp8=True) == (128, 4, 3)
        KERNELS.decode_attn_config = (256, 8, 2)
        assert tb._decode_config(128, torch.bfloat16, 1, fp8=True) == (256, 8, 2)
        assert tb._decode_config(128, torch.bfloat16, 4) == (256, 8, 2)
        tb.DECODE_NUM_STAGES = 4
        assert tb._decode_config(128, torch.bfloat16, 1) == (256, 8, 4)
    finally:
        KERNELS.decode_attn_config = saved
        tb.DECODE_NUM_STAGES = None


def test_sdpa_prefill_gate():
    """`attention_triton._sdpa_sequences`: chunks without cached context of at least
    sdpa_prefill_min_tokens, and none for 0, float32, an FP8 cache, a sliding window, no fresh
    K/V or no context list (a prefill graph's capture); the plan a step's metadata keeps
    (`_prefill_plan`) follows the threshold when it changes between calls."""
    from ferrum.config import KERNELS
    from ferrum.forward_context import AttentionMetadata
    from ferrum.ops import attention_triton as tb
    q, k = torch.zeros(60, 4, 16, dtype=torch.bfloat16), torch.zeros(60, 2, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 8, 16, 2, 16, dtype=torch.bfloat16)

    def md(ctx):
        return AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0), block_tables=torch.zeros(3, 2),
                                 seq_lens=torch.zeros(3), max_seq_len=32, query_lens=[20, 19, 21], context_lens=ctx)
    saved = KERNELS.sdpa_prefill_min_tokens
    try:
        KERNELS.sdpa_prefill_min_tokens = 20
        assert tb._sdpa_sequences(q, cache, md([0, 0, 0]), k, None) == [0, 2]
        assert tb._sdpa_sequences(q, cache, md([0, 0, 5]), k, None) == [0]
        assert tb._sdpa_sequences(q, cache, md(None), k, None) == []
        assert tb._sdpa_sequences(q, cache, md([0, 0, 0]), k, 64) == []
        assert tb._sdpa_sequences(q, cache, md([0, 0, 0]), None, None) == []
        assert tb._sdpa_sequences(q, cache.to(torch.float8_e4m3fn), md([0, 0, 0]), k, None) == []
        assert tb._sdpa_sequences(q.float(), cache.float(), md([0, 0, 0]), k.float(), None) == []
        KERNELS.sdpa_prefill_min_tokens = 0
        assert tb._sdpa_sequences(q, cache, md([0, 0, 0]), k, None) == []
        # the step's plan, kept in its metadata, follows a threshold changed between calls
        step = md([0, 0, 0])
        for least, want in ((20, [(0, 20), (39, 21)]), (0, []), (19, [(0, 20), (20, 19), (39, 21)])):
            KERNELS.sdpa_prefill_min_tokens = least
            assert tb._prefill_plan(q, cache, step, k, None)[0] == want, least
    finally:
        KERNELS.sdpa_prefill_min_tokens = saved


def test_ops_run_torch_code_on_cpu():
    """Without CUDA (and without FORCE_TRITON) each op takes its torch code: the same values
    as the `*_torch` functions, and RoPE returns new tensors instead of rotating in place."""
    if HAS_TRITON and os.environ.get("FERRUM_FORCE_TRITON") == "1":
        pytest.skip("FORCE_TRITON set")
    from ferrum.ops.activation import silu_and_mul, silu_and_mul_torch
    from ferrum.ops.rms_norm import fused_add_rms_norm, rms_norm_torch
    from ferrum.ops.rotary import apply_rotary_emb, rotate_torch
    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    n, s = fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(n, rms_norm_torch(x + r, w, 1e-6))
    assert torch.equal(silu_and_mul(x), silu_and_mul_torch(x))
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    cos, sin = torch.rand(10, 4), torch.rand(10, 4)
    pos = torch.tensor([0, 9, 4])
    rq, rk = apply_rotary_emb(pos, q, k, cos, sin)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    assert rq is not q and torch.equal(rq, rotate_torch(q, c, s)) and torch.equal(rk, rotate_torch(k, c, s))


@pytest.mark.parametrize("check", ["check_write_kv", "check_rope_kv", "check_decode", "check_prefill",
                                   "check_attention_layer",
                                   "check_fused_ops", "check_gemv", "check_prefill_graph",
                                   "check_gumbel_sampler", "check_fp8_quant_rows"])
@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
def test_kernel_on_gpu(check):
    globals()[check]("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
def test_decode_large_on_gpu():
    """Llama-3-8B attention shape per rank (32 q heads, 8 KV heads, D 128), long sequences."""
    gen = torch.Generator().manual_seed(5)
    _decode_case("cuda", torch.bfloat16, 32, 8, 128, 16, [4000, 1, 0, 2048, 777, 3100, 16, 1500],
                 [1, 7, None], gen)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
def test_decode_in_cuda_graph():
    """Capture write_kv + decode once with static B and M, replay with other lengths / tables:
    the split count and all bounds must come from static shapes or device tensors."""
    from ferrum.ops import attention_triton as tb
    gen = torch.Generator().manual_seed(6)
    B, H, Hkv, D, page, M = 4, 8, 2, 128, 16, 16
    dtype, dev = torch.bfloat16, "cuda"
    lens_a, lens_b = [1, 200, 0, 37], [250, 3, 17, 0]
    NB = 1 + 2 * B * M
    cache = torch.randn(2, NB, page, Hkv, D, generator=gen).to(dtype).to(dev)
    bt = torch.zeros(B, M, dtype=torch.int32, device=dev)
    sl = torch.zeros(B, dtype=torch.int32, device=dev)
    q = torch.zeros(B, H, D, dtype=dtype, device=dev)
    kn = torch.zeros(B, Hkv, D, dtype=dtype, device=dev)
    slots = torch.full((B,), -1, dtype=torch.int64, device=dev)
    md = _md(False, slots, bt, sl)

    def load(lens):
        perm = (torch.randperm(NB - 1, generator=gen) + 1)[: B * M].view(B, M)
        bt.copy_(perm)
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(B, H, D, generator=gen).to(dtype))
        kn.copy_(torch.randn(B, Hkv, D, generator=gen).to(dtype))
        s = [int(perm[b, (L - 1) // page]) * page + (L - 1) % page if L > 0 else -1 for b, L in enumerate(lens)]
        slots.copy_(torch.tensor(s))

    def step():
        tb.write_kv(cache, kn, kn, slots)
        return tb.decode_attention(q, cache, md, D ** -0.5)

    load(lens_a)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for lens in (lens_a, lens_b):
        load(lens)
        g.replay()
        torch.cuda.synchronize()
        clean = cache.double().cpu()
        ref = torch.stack([o[0] for o in _ref_attention(list(q[:, None]), clean, bt, lens,
                                                         [[L - 1] for L in lens], D ** -0.5)])
        _assert_close(out, ref, dtype, f"graph replay lens={lens}")


def test_torch_decode_reads_consecutive_blocks_in_place():
    """The CPU decode path reads K/V in place when every sequence's blocks are consecutive and
    gathers otherwise; both must equal the padded, masked form (no Python context lengths)."""
    from ferrum.ops import attention_torch as tb
    from ferrum.forward_context import AttentionMetadata
    gen = torch.Generator().manual_seed(6)
    bs, Hkv, H, D = 4, 2, 6, 16
    cache = torch.randn(2, 40, bs, Hkv, D, generator=gen)
    q = torch.randn(2, H, D, generator=gen)
    lens = [9, 14]  # context lengths before this step; +1 token each
    for tables, runs in (([[3, 4, 5, 0], [10, 11, 12, 13]], True),     # consecutive
                         ([[3, 7, 5, 0], [10, 11, 12, 13]], False)):    # row 0 is not
        bt = torch.tensor(tables)
        md = AttentionMetadata(False, torch.zeros(2, dtype=torch.int64), bt,
                               torch.tensor([n + 1 for n in lens]), max(lens) + 1, [1, 1], lens)
        got = tb.decode_attention(q, cache, md, 0.25)
        assert (md.decode_plan[None][0] is None) == runs  # blocks None: read in place
        padded = AttentionMetadata(False, md.slot_mapping, bt, md.seq_lens, md.max_seq_len)
        torch.testing.assert_close(got, tb.decode_attention(q, cache, padded, 0.25), atol=1e-6, rtol=1e-5)


def test_torch_batched_decode_reads_pages_in_place():
    """From CSR_MIN_BATCH sequences on, CPU float32 decode runs the sparse in-place path: equal
    to float64 attention over each sequence's own blocks (scattered, shared, GQA groups of 3,
    lengths crossing block boundaries), one plan per step for every layer, and no K/V copy."""
    from ferrum.forward_context import AttentionMetadata
    from ferrum.ops import attention_torch as tb
    gen = torch.Generator().manual_seed(11)
    bs, Hkv, H, D = 4, 2, 6, 16
    cache = torch.randn(2, 64, bs, Hkv, D, generator=gen)
    lens = [0, 3, 4, 17, 9, 30]        # context before this step (+1 token each)
    tables = [[5], [9, 2], [40, 41], [7, 1, 33, 12, 60], [3, 9, 8], [20, 21, 22, 23, 24, 25, 26, 27]]
    M = max(map(len, tables))
    bt = torch.tensor([t + [0] * (M - len(t)) for t in tables])
    q = torch.randn(len(lens), H, D, generator=gen)
    md = AttentionMetadata(False, torch.zeros(len(lens), dtype=torch.int64), bt,
                           torch.tensor([n + 1 for n in lens]), max(lens) + 1, [1] * len(lens), lens)
    assert len(lens) >= tb.CSR_MIN_BATCH
    copies = []
    real_index_select = torch.Tensor.index_select
    try:   # the in-place path must not gather K/V blocks
        torch.Tensor.index_select = lambda self, *a, **k: copies.append(a) or real_index_select(self, *a, **k)
        got = tb.decode_attention(q, cache, md, 0.3)
        again = tb.decode_attention(q, cache, md, 0.3)    # the next layer reuses the plan
    finally:
        torch.Tensor.index_select = real_index_select
    assert not copies and md.decode_plan is None and len(md.csr_plan) == 1
    torch.testing.assert_close(got, again, atol=0, rtol=0)
    for i, (n, table) in enumerate(zip(lens, tables)):
        slots = [table[p // bs] * bs + p % bs for p in range(n + 1)]
        k = cache[0].reshape(-1, Hkv, D)[slots].double()          # [n+1, Hkv, D]
        v = cache[1].reshape(-1, Hkv, D)[slots].double()
        kh = k.repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, n+1, D]
        vh = v.repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
        w = (torch.einsum("hd,hnd->hn", q[i].double(), kh) * 0.3).softmax(-1)
        ref = torch.einsum("hn,hnd->hd", w, vh)
        torch.testing.assert_close(got[i].double(), ref, atol=2e-6, rtol=1e-5)
