"""benchmarks/vllm_gguf_peer.py's GGUF writer on a tiny config (CPU, no vLLM): the names, types and
shapes vLLM's GGUF loader maps, Q4_K blocks with ferrum's dummy d / dmin, and ferrum's own loader
reading the file back without a tokenizer."""
import importlib.util
import pathlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from ferrum.loader.gguf import load_gguf
from ferrum.ops.gguf import gguf_dequantize

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_gguf_peer.py"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("vllm_gguf_peer", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)   # imports no vLLM: that happens in run_vllm only
    return mod


@pytest.fixture
def tiny(peer, tmp_path, monkeypatch):
    monkeypatch.setenv("FERRUM_HOME", str(tmp_path / "home"))
    cfg = dict(peer.load_config("llama3-8b"), hidden_size=256, intermediate_size=512, vocab_size=512,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = str(tmp_path / "tiny-q4_k.gguf")
    info = peer.write_gguf(path, cfg, seed=1)
    return cfg, path, info


def test_names_types_shapes_and_metadata(peer, tiny):
    cfg, path, info = tiny
    r = GGUFReader(path)
    got = {t.name: (t.tensor_type, tuple(int(d) for d in reversed(t.shape))) for t in r.tensors}
    want = {"token_embd.weight": (QT.Q4_K, (512, 256)), "output.weight": (QT.F16, (512, 256)),
            "output_norm.weight": (QT.F32, (256,))}
    for i in range(2):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (QT.F32, (256,)), b + "ffn_norm.weight": (QT.F32, (256,)),
                 b + "attn_q.weight": (QT.Q4_K, (256, 256)), b + "attn_k.weight": (QT.Q4_K, (128, 256)),
                 b + "attn_v.weight": (QT.Q4_K, (128, 256)), b + "attn_output.weight": (QT.Q4_K, (256, 256)),
                 b + "ffn_gate.weight": (QT.Q4_K, (512, 256)), b + "ffn_up.weight": (QT.Q4_K, (512, 256)),
                 b + "ffn_down.weight": (QT.Q4_K, (256, 512))}
    assert got == want
    assert info["tensor_types"] == {"F16": 1, "F32": 5, "Q4_K": 15}
    assert info["bytes"] == pathlib.Path(path).stat().st_size
    assert peer.check_gguf(path, cfg)["tensor_types"] == info["tensor_types"]   # reused, not rewritten
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "llama" and f["llama.vocab_size"] == 512
    assert (f["llama.block_count"], f["llama.embedding_length"], f["llama.feed_forward_length"]) == (2, 256, 512)
    assert (f["llama.attention.head_count"], f["llama.attention.head_count_kv"]) == (4, 2)
    assert f["llama.rope.dimension_count"] == 64 and f["llama.rope.freq_base"] == 500000.0
    assert not any(k.startswith("tokenizer.") for k in f)
    t = {t.name: t for t in r.tensors}
    assert np.all(t["output_norm.weight"].data == 1.0)
    head = t["output.weight"].data.astype(np.float32)
    assert np.isfinite(head).all() and 0 < np.abs(head).max() <= 0.0201   # 0.02 rounded to fp16
    emb = gguf_dequantize(torch.from_numpy(np.asarray(t["token_embd.weight"].data).copy()), QT.Q4_K, 256)
    assert emb.shape == (512, 256) and torch.isfinite(emb).all()


def test_q4_k_blocks_have_ferrums_dummy_scales(tiny):
    cfg, path, _ = tiny
    t = {t.name: t for t in GGUFReader(path).tensors}["blk.1.ffn_down.weight"]
    raw = np.asarray(t.data)                                   # [256 rows, 2 blocks * 144 bytes]
    assert raw.shape == (256, 2 * 144) and raw.dtype == np.uint8
    dd = raw.reshape(256, 2, 144)[:, :, :4].copy().view(np.float16).astype(np.float32)   # d, dmin
    assert np.isfinite(dd).all() and dd.min() >= 0.0004 and dd.max() <= 0.0021
    w = gguf_dequantize(torch.from_numpy(raw.copy()), QT.Q4_K, 512)
    assert w.shape == (256, 512) and torch.isfinite(w).all()
    # |w| = |d * scale * q - dmin * min| <= 0.002 * 63 * 15 + 0.002 * 63 (6-bit scales, 4-bit q)
    assert 0.05 < w.abs().mean() < 1.0 and w.abs().max() <= 2.02


def test_ferrum_loader_reads_it_without_a_tokenizer(tiny):
    cfg, path, _ = tiny
    src = load_gguf(path, dequant_cache=False)
    c = src.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("LlamaForCausalLM", 512, 256, 512)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 4, 2, 64)
    assert c.rope_theta == 500000.0 and not c.tie_word_embeddings
    ws = src.weights()
    assert "lm_head.weight" in ws.names() and len(ws.names()) == 21
    up = ws.get("model.layers.0.mlp.up_proj.weight").load()
    assert up.shape == (512, 256) and torch.isfinite(up).all()
