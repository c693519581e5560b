"""The model's keep_rows (the last layer attends and runs o_proj / MLP only for each chunk's
last row, `AttentionMetadata.last_tokens_only`) against the full forward: a 5-prompt prefill
over non-consecutive blocks, prompts with cached context (one past the sliding window), a
NaN-poisoned cache, float32 and an FP8 cache; with the torch backend, and with the
Triton backend in the interpreter (plus the prefill-graph buffers, context_lens None)."""
import os
import sys

import pytest
import torch

from ferrum.config import EngineConfig
from ferrum.executor.model_inputs import prepare_prefill
from ferrum.executor.single import SingleDeviceExecutor
from ferrum.forward_context import forward_context
from ferrum.interfaces import KvCacheHandle
from ferrum.loader.resolve import resolve_model
from tiny_models import make_tiny_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_triton_kernels import HAS_TRITON, _run_interpreted  # noqa: E402

FAMILIES = {"llama": dict(family="llama", seed=1),
            "mistral-swa8": dict(family="mistral", sliding_window=8, seed=5),
            "gemma3": dict(family="gemma3", layers=3, num_kv_heads=1, head_dim=32, tie=True,
                           layer_types=["full_attention", "full_attention", "sliding_attention"],
                           sliding_window=8, query_pre_attn_scalar=24, seed=9)}


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_keep_rows_torch_backend(tmp_path, name, kv_dtype):
    """Torch backend, float32 CPU: kept rows == the full forward's rows within 1e-5, no NaN."""
    kw = dict(FAMILIES[name])
    folder = make_tiny_model(str(tmp_path / "m"), kw.pop("family"), **kw)
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu", max_model_len=128,
                                   num_kv_blocks=40, block_size=8, kv_cache_dtype=kv_dtype)
    runner = SingleDeviceExecutor(resolve_model(folder), cfg, progress=False).runner
    gen = torch.Generator().manual_seed(0)
    lens, ctxs = [13, 1, 30, 7, 20], [0, 12, 0, 19, 5]
    ids = [torch.randint(2, 128, (c + n,), generator=gen).tolist() for c, n in zip(ctxs, lens)]

    def run(keep):
        for layer in runner.attn_layers:
            layer.kv_cache.view(torch.uint8).fill_(0x7F if kv_dtype == "fp8" else 0xFF)   # NaN
        tables, start = [], 1
        for c, n in zip(ctxs, lens):
            nb = -(-(c + n) // 8)
            tables.append(list(range(start + nb - 1, start - 1, -1)))   # non-consecutive blocks
            start += nb
        for i, c in enumerate(ctxs):
            if c:
                runner.prefill([ids[i][:c]], [KvCacheHandle(f"s{i}", tables[i], 0, 8)])
        window = runner.cfg.sliding_window if name == "mistral-swa8" else None
        if window:   # blocks before the chunk's first query's window are released (-1), as the engine does
            tables = [[-1 if (b + 1) * 8 <= c - window + 1 else x for b, x in enumerate(t)]
                      for t, c in zip(tables, ctxs)]
            assert any(-1 in t for t in tables)
        handles = [KvCacheHandle(f"s{i}", t, c, 8) for i, (t, c) in enumerate(zip(tables, ctxs))]
        tok, pos, md, cu = prepare_prefill([x[c:] for x, c in zip(ids, ctxs)], handles, 8, runner.device)
        with torch.inference_mode(), forward_context(md, runner.attn_backend):
            h = runner.model(tok, pos, cu[1:] - 1 if keep else None)
        return h if keep else h[cu[1:] - 1]

    full = run(False)
    kept = run(True)
    assert not torch.isnan(kept).any()
    diff = (kept - full).abs().max().item()
    assert diff < 1e-5, f"{name} {kv_dtype}: kept rows differ by {diff:.3e}"


HERE = os.path.abspath(__file__)


def check_keep_rows_triton(device: str) -> None:
    """Triton (in the interpreter here) and torch backends, with and without keep_rows, and the
    prefill-graph buffers: the logits of each chunk's last row agree within 1e-3, no NaN."""
    import json
    import tempfile
    from ferrum.distributed.parallel_state import init_tensor_parallel
    from ferrum.executor.model_inputs import prepare_prefill
    from ferrum.executor.model_runner import ModelRunner
    from ferrum.executor.prefill_graph import PrefillGraphInputs
    from ferrum.forward_context import forward_context
    from ferrum.interfaces import KvCacheHandle
    from ferrum.loader.resolve import resolve_model
    from ferrum.ops import attention_torch, attention_triton
    init_tensor_parallel(0, 1, None)
    gen = torch.Generator().manual_seed(3)
    for window, kvd in ((12, "fp8"),):   # (window, FP8 cache and cached context: the hard case)
        cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 128,
               "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
               "sliding_window": window}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cfg, f)
        r = ModelRunner(resolve_model(f"dummy:{f.name}"), device, torch.float32, "dummy", 0,
                        progress=False, kv_cache_dtype=kvd)
        r.allocate_kv_cache(24, 16)
        # 5 sequences (CSR size on the torch side), one with 20 cached tokens (crosses the window)
        lens, ctxs = [9, 30, 4, 17, 25], [0, 0, 0, 20, 3]
        tables = [[1], [2, 3], [4], [5, 6, 7], [8, 9]]
        ids = [torch.randint(0, 128, (c + n,), generator=gen).tolist() for c, n in zip(ctxs, lens)]
        res = {}
        for backend in (attention_triton, attention_torch):
            r.attn_backend = backend
            for keep in (False, True):
                for layer in r.attn_layers:
                    layer.kv_cache.view(torch.uint8).fill_(0x7F if kvd == "fp8" else 0xFF)  # NaN
                # cached context first (full forward)
                for i, c in enumerate(ctxs):
                    if c:
                        h = KvCacheHandle(f"s{i}", tables[i], 0, 16)
                        r.prefill([ids[i][:c]], [h])
                handles = [KvCacheHandle(f"s{i}", t, c, 16) for i, (t, c) in enumerate(zip(tables, ctxs))]
                chunks = [x[c:] for x, c in zip(ids, ctxs)]
                tok, pos, md, cu = prepare_prefill(chunks, handles, 16, r.device)
                with torch.inference_mode(), forward_context(md, backend):
                    hid = r.model(tok, pos, cu[1:] - 1 if keep else None)
                    if not keep:
                        hid = hid[cu[1:] - 1]
                    res[(backend.__name__, keep)] = r.model.compute_logits(hid).float()
            # prefill-graph buffers (context_lens None), Triton only: sequence 3's chunk
            if backend is attention_triton:
                inp = PrefillGraphInputs(r, 32, 4)
                inp.fill(chunks[3], handles[3], 32)
                with torch.inference_mode():
                    res[("graph", True)] = inp.forward(32)
        base = res[("ferrum.ops.attention_triton", False)]
        for key, val in res.items():
            if key[0] == "graph":
                d = (val[0] - base[3]).abs().max().item()
            else:
                d = (val - base).abs().max().item()
            print(window, kvd, key, f"{d:.2e}")
            assert not torch.isnan(val).any(), (window, kvd, key)
            assert d < 1e-3, (window, kvd, key, d)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_keep_rows_triton_interpreter():
    print(_run_interpreted("check_keep_rows_triton", path=HERE))
