"""Mixture-of-experts ops (ferrum/ops/moe.py, moe_triton.py) against independent oracles.

- Routing: `select_experts` against transformers' own Mixtral and Qwen3-MoE router modules.
- `moe_reference` (the CPU path) against a float64 loop over tokens and slots, including the
  pieces a tensor-parallel or expert-parallel rank computes, which must sum to the whole.
- The Triton kernels (grouped GEMM for many tokens, the GEMV pair for one token, the sort by
  expert) in Triton's interpreter on CPU (subprocess, as in test_triton_kernels.py) and on CUDA
  (`gpu`-marked), against the float64 oracle; their sm_90 compiles without register spills.
End-to-end MoE models against HF are in test_models.py, TP / EP against TP=1 in
test_tensor_parallel.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from test_triton_kernels import (HAS_CUDA, HAS_TRITON, _assert_close, _has_ptxas, _run_interpreted,
                                 prefetched_checks, sm90_compile)

HERE = os.path.abspath(__file__)


def _oracle(x, w13, w2, weights, ids, expert_start=0):
    """float64 loop: y[t] = sum_j w[t,j] * W2[e] (silu(G[e] x) * (U[e] x)) over slots whose
    expert e = ids[t,j] - expert_start is held (0 <= e < E_local)."""
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    E, two_i, _ = w13.shape
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - expert_start
            if not 0 <= e < E:
                continue
            h = w13[e] @ x[t]
            g, u = h[:two_i // 2], h[two_i // 2:]
            out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(g) * u))
    return out


def _problem(T, E, H, I, k, dtype, device, gen, ep_split=False):
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=gen) * I ** -0.5
    logits = torch.randn(T, E, generator=gen)
    from ferrum.ops.moe import select_experts
    weights, ids = select_experts(logits, k, True)
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device),
            weights.to(device), ids.to(device))


def test_select_experts_matches_hf_routers():
    """Mixtral (softmax, top-k, always renormalised) and Qwen3-MoE (norm_topk_prob on and off)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    from ferrum.ops.moe import select_experts
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(9, 32, generator=gen)
    w = torch.randn(6, 32, generator=gen)
    cases = [(MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=6, num_experts_per_tok=2)), True)]
    for norm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=32, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm)
        cases.append((Qwen3MoeTopKRouter(cfg), norm))
    for router, norm in cases:
        router.weight.data.copy_(w)
        _, ref_w, ref_ids = router(h)
        got_w, got_ids = select_experts(torch.nn.functional.linear(h, w), router.top_k, norm)
        assert torch.equal(got_ids, ref_ids), type(router).__name__
        torch.testing.assert_close(got_w, ref_w.float(), atol=1e-6, rtol=1e-6)
    # Mixtral's rule equals a softmax over the top-k logits
    logits = torch.nn.functional.linear(h, w)
    top, idx = logits.topk(2, dim=-1)
    got_w, got_ids = select_experts(logits, 2, True)
    assert torch.equal(got_ids, idx)
    torch.testing.assert_close(got_w, torch.softmax(top, -1), atol=1e-6, rtol=1e-6)


def test_moe_reference_and_its_tp_ep_parts_match_oracle():
    """The CPU path equals the float64 oracle; under TP the I-split halves of every expert sum
    to it, under EP the two ranks' expert halves sum to it (what the all-reduce computes)."""
    from ferrum.ops.moe import moe_reference
    gen = torch.Generator().manual_seed(1)
    T, E, H, I, k = 11, 6, 32, 24, 2
    x, w13, w2, wts, ids = _problem(T, E, H, I, k, torch.float32, "cpu", gen)
    ref = _oracle(x, w13, w2, wts, ids)
    _assert_close(moe_reference(x, w13, w2, wts, ids), ref, torch.float32, "moe_reference")
    h = I // 2
    tp = sum(moe_reference(x, torch.cat([w13[:, r * h:(r + 1) * h], w13[:, I + r * h:I + (r + 1) * h]], 1),
                           w2[:, :, r * h:(r + 1) * h].contiguous(), wts, ids) for r in range(2))
    _assert_close(tp, ref, torch.float32, "TP=2 partial sums")
    ep = [moe_reference(x, w13[r * 3:(r + 1) * 3], w2[r * 3:(r + 1) * 3], wts, ids, expert_start=r * 3)
          for r in range(2)]
    _assert_close(ep[0] + ep[1], ref, torch.float32, "EP=2 partial sums")
    assert ep[0].abs().sum() > 0 and ep[1].abs().sum() > 0
    one = moe_reference(x[:1], w13, w2, wts[:1], ids[:1])
    _assert_close(one, ref[:1], torch.float32, "one token")


# ---------------------------------------------------------------------------------------------
# Triton checks (run on "cpu" in the interpreter subprocess, or on "cuda" in-process)
# ---------------------------------------------------------------------------------------------
def check_moe_align(device: str) -> None:
    """Every held pair appears exactly once, in the m-blocks of its expert; pairs of other
    ranks' experts are dropped; padding rows hold the invalid id T*k."""
    from ferrum.ops.moe_triton import moe_align
    gen = torch.Generator().manual_seed(2)
    for T, k, E, start, bm in ((1, 2, 4, 0, 16), (37, 2, 8, 0, 16), (50, 4, 5, 3, 32), (3, 8, 16, 8, 16)):
        ids = torch.randint(0, 16, (T, k), generator=gen).to(device)
        sorted_ids, block_expert = moe_align(ids, E, start, bm)
        sorted_ids, block_expert, ids = sorted_ids.cpu(), block_expert.cpu(), ids.cpu()
        n = T * k
        assert sorted_ids.numel() % bm == 0 and block_expert.numel() == sorted_ids.numel() // bm
        flat = ids.flatten() - start
        want = sorted(p for p in range(n) if 0 <= flat[p] < E)
        got = sorted(int(p) for p in sorted_ids if p < n)
        assert got == want, (T, k, E, start)
        for b, e in enumerate(block_expert.tolist()):
            rows = sorted_ids[b * bm:(b + 1) * bm]
            real = rows[rows < n]
            if e < 0:
                assert real.numel() == 0
            else:
                assert (flat[real.long()] == e).all()


def check_moe_kernels(device: str) -> None:
    """fused_moe through the Triton kernels (grouped GEMM for T > 1, the GEMV pair for T = 1),
    fp32 and bf16, with and without expert parallelism, against the float64 oracle."""
    from ferrum.ops import moe_triton
    gen = torch.Generator().manual_seed(3)
    cases = [(1, 8, 64, 32, 2, torch.float32, None), (1, 8, 64, 32, 2, torch.bfloat16, None),
             (5, 4, 64, 48, 2, torch.float32, None), (33, 8, 64, 32, 2, torch.bfloat16, None),
             (20, 6, 32, 16, 3, torch.float32, (2, 3)), (1, 6, 32, 16, 3, torch.float32, (3, 3))]
    for T, E, H, I, k, dtype, ep in cases:
        x, w13, w2, wts, ids = _problem(T, E, H, I, k, dtype, device, gen)
        start = 0
        if ep is not None:  # this rank holds experts [start, start + n)
            start, n = ep
            w13, w2 = w13[start:start + n].contiguous(), w2[start:start + n].contiguous()
        ref = _oracle(x, w13, w2, wts.cpu(), ids.cpu(), start)
        got = moe_triton.fused_moe(x, w13, w2, wts, ids, start)
        assert got.shape == x.shape and got.dtype == dtype
        _assert_close(got, ref, dtype, f"fused_moe T={T} E={E} k={k} {dtype} ep={ep}")
        if T > 1:  # the grouped path also serves one-token rows, with another block size
            got = moe_triton.moe_grouped(x, w13, w2, wts, ids, start, config=(32, 32, 32, 4, 2))
            _assert_close(got, ref, dtype, f"moe_grouped cfg 32 T={T} {dtype} ep={ep}")


def check_moe_sm90_compile(device: str) -> None:
    """The MoE kernels' default configurations compile for sm_90 without spills."""
    from ferrum.ops import moe_triton as mt
    for pairs, E in ((8, 128), (2048, 128), (32768, 128)):
        bm, bn, bk, w, st = mt.gemm_config(pairs, E)
        for div, mul in ((8, False), (1, True)):
            sm90_compile(mt._moe_gemm_kernel,
                         dict(A_ROW_DIV=div, MUL_WEIGHT=mul, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC="tf32"),
                         dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", w_ptr="*fp32",
                              sorted_ids_ptr="*i32", block_expert_ptr="*i32"), w, st,
                         f"moe gemm pairs={pairs} mul={mul}")
    bn, bk, w = mt.gemv_config(1536, 2048)
    sm90_compile(mt._moe_gemv_gate_up_kernel, dict(BLOCK_N=bn, BLOCK_K=bk),
                 dict(x_ptr="*bf16", w_ptr="*bf16", ids_ptr="*i64", y_ptr="*fp32"), w, 1, "moe gemv gate_up")
    bn, bk, w = mt.gemv_config(2048, 768)
    sm90_compile(mt._moe_gemv_down_kernel, dict(TOP_K=8, BLOCK_N=bn, BLOCK_K=bk),
                 dict(h_ptr="*fp32", w_ptr="*bf16", ids_ptr="*i64", wts_ptr="*fp32", y_ptr="*bf16"),
                 w, 1, "moe gemv down")


interp = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


@interp
@pytest.mark.parametrize("check", ["check_moe_align", "check_moe_kernels"])
def test_moe_kernel_in_interpreter(check, interpreted):
    interpreted[check].result()


@pytest.fixture(scope="module")
def interpreted(request):
    with prefetched_checks(request, lambda name: _run_interpreted(name, path=HERE),
                           {"test_moe_kernel_in_interpreter": None}) as futures:
        yield futures


@pytest.mark.skipif(not _has_ptxas(), reason="needs triton with its bundled ptxas")
def test_moe_kernels_compile_for_sm90_without_spills():
    print(_run_interpreted("check_moe_sm90_compile", interpret=False, path=HERE))


@interp
def test_moe_gemm_config_takes_the_tuned_table(monkeypatch):
    """gemm_config looks up MOE_GEMM_CONFIGS by (experts, 2 * intermediate, hidden, pairs rounded
    up to a power of two) and falls back to the heuristic for shapes the table lacks."""
    from ferrum.ops import moe_triton as mt
    heuristic = mt.gemm_config(200, 128, 1536, 2048)
    monkeypatch.setattr(mt, "MOE_GEMM_CONFIGS", {(128, 1536, 2048, 256): (64, 128, 64, 8, 4)})
    assert mt.gemm_config(200, 128, 1536, 2048) == (64, 128, 64, 8, 4)    # 200 pairs -> bucket 256
    assert mt.gemm_config(256, 128, 1536, 2048) == (64, 128, 64, 8, 4)
    assert mt.gemm_config(257, 128, 1536, 2048) == mt.gemm_config(257, 128)   # bucket 512: not tuned
    assert mt.gemm_config(200, 128) == heuristic                             # no shape: heuristic


@pytest.mark.parametrize("check", ["check_moe_align", "check_moe_kernels"])
@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
def test_moe_kernel_on_gpu(check):
    globals()[check]("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
def test_moe_qwen3_30b_layer_shape_on_gpu():
    """One Qwen3-30B-A3B MoE layer (128 experts of 768, top-8, hidden 2048), bf16, at the decode
    batch sizes of the benchmark (1, 256) and a 2048-token prefill; also inside a CUDA graph."""
    from ferrum.ops import moe_triton
    gen = torch.Generator().manual_seed(4)
    for T in (1, 256, 2048):
        x, w13, w2, wts, ids = _problem(T, 128, 2048, 768, 8, torch.bfloat16, "cuda", gen)
        ref = _oracle(x[:4], w13, w2, wts[:4].cpu(), ids[:4].cpu())
        got = moe_triton.fused_moe(x, w13, w2, wts, ids)
        _assert_close(got[:4], ref, torch.bfloat16, f"qwen3-30b layer T={T}")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe_triton.fused_moe(x, w13, w2, wts, ids)
        g.replay()
        torch.cuda.synchronize()
        _assert_close(out[:4], ref, torch.bfloat16, f"qwen3-30b layer in a CUDA graph T={T}")


def test_moe_under_quantization(tmp_path):
    """`--quantization fp8` on an MoE model quantizes the shared expert and attention (rounded
    to e4m3 per output channel, dequantized once on CPU) and leaves the stacked experts in the
    model dtype, exactly the checkpoint's; a checkpoint whose config.json says its weights are
    quantized is refused with a named error before any weight is read."""
    import json
    import shutil

    from tiny_models import make_tiny_model
    from ferrum.config import EngineConfig
    from ferrum.errors import UnsupportedModelError
    from ferrum.executor.single import SingleDeviceExecutor
    from ferrum.loader.resolve import resolve_model
    folder = make_tiny_model(str(tmp_path / "m"), "qwen2_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48, seed=7)

    def model(**kw):
        cfg = EngineConfig.from_kwargs(model=folder, device="cpu", dtype="float32", num_kv_blocks=8, **kw)
        return SingleDeviceExecutor(resolve_model(folder), cfg, progress=False).runner.model

    plain, fp8 = model(), model(quantization="fp8")
    checked = {"kept": 0, "rounded": 0}
    for name, p in plain.named_parameters():
        q = dict(fp8.named_parameters())[name]
        if ".experts." in name or name.endswith(".mlp.gate.weight"):
            assert torch.equal(p, q), f"{name} changed under --quantization fp8"
            checked["kept"] += 1
        elif name.endswith(("shared_expert.gate_up_proj.weight", "qkv_proj.weight")):
            rel = ((p - q).abs().max() / p.abs().max()).item()
            assert 0 < rel < 0.07, f"{name}: relative change {rel:.2e} is not e4m3 rounding"
            checked["rounded"] += 1
    assert checked == {"kept": 2 * 3, "rounded": 2 * 2}, checked   # 2 layers: w13, w2, router
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    quantized = str(tmp_path / "q")
    shutil.copytree(folder, quantized)
    json.dump(cfg, open(os.path.join(quantized, "config.json"), "w"))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts checkpoints quantized with 'fp8'"):
        SingleDeviceExecutor(resolve_model(quantized), EngineConfig.from_kwargs(
            model=quantized, device="cpu", dtype="float32", num_kv_blocks=8), progress=False)
