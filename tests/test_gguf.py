"""GGUF loader: tiny GGUFs written here with gguf.GGUFWriter, and the real SmolLM2 Q4_1 GGUF
checked tensor by tensor against Hugging Face transformers' own GGUF loader."""
import contextlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrum.loader.gguf as gguf_loader
from ferrum.errors import UnsupportedModelError, WeightLoadError
from ferrum.loader.gguf import _unpermute_rows, load_gguf

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half rows -> interleaved rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_weights(arch: str, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16,
               vocab=64, tied=True, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": r(hidden)}
    if not tied:
        w["lm_head.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
              p + "mlp.gate_proj.weight": r(inter, hidden),
              p + "mlp.up_proj.weight": r(inter, hidden),
              p + "mlp.down_proj.weight": r(hidden, inter),
              p + "input_layernorm.weight": r(hidden),
              p + "post_attention_layernorm.weight": r(hidden)}
        if arch == "qwen2":
            w |= {p + "self_attn.q_proj.bias": r(heads * head_dim),
                  p + "self_attn.k_proj.bias": r(kv_heads * head_dim),
                  p + "self_attn.v_proj.bias": r(kv_heads * head_dim)}
        if arch == "qwen3":
            w |= {p + "self_attn.q_norm.weight": r(head_dim),
                  p + "self_attn.k_norm.weight": r(head_dim)}
    return w


_TO_GGUF = {v: k for k, v in gguf_loader._LAYER_NAMES.items()}
_TO_GGUF_GLOBAL = {v: k for k, v in gguf_loader._GLOBAL_NAMES.items()}


def gguf_name(name: str) -> str:
    if name in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[name]
    _, _, i, *mid, suffix = name.split(".")
    return f"blk.{i}.{_TO_GGUF['.'.join(mid)]}.{suffix}"


def write_gguf(path, arch="llama", weights=None, qtype=QT.F32, heads=4, kv_heads=2,
               head_dim=16, hidden=64, raw_override=None, inter=96):
    """Write a GGUF the way llama.cpp's converter does (Q/K permuted for llama). 2-D tensors
    in `qtype`, 1-D in F32. raw_override: {hf_name: (uint8 bytes, QT)}."""
    weights = weights if weights is not None else hf_weights(arch, heads=heads, head_dim=head_dim)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(64)
    w.add_bos_token_id(5)
    w.add_eos_token_id(6)
    w.add_eot_token_id(7)
    w.add_chat_template(TEMPLATE)
    for name, t in weights.items():
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, heads)
        if arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, kv_heads)
        a = t.numpy().astype(np.float32)
        if raw_override and name in raw_override:
            raw, rq = raw_override[name]
            w.add_tensor(gguf_name(name), raw, raw_dtype=rq)
        elif a.ndim == 2 and qtype != QT.F32:
            w.add_tensor(gguf_name(name), quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ---------------------------------------------------------------- tiny files

@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private $FERRUM_HOME, so the loader's per-file cache of tiny files stays in tmp."""
    monkeypatch.setenv("FERRUM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dequant_cache", [True, False])
def test_tiny_gguf_names_config_and_exact_f32_values(tmp_path, home, arch, dequant_cache):
    head_dim = 32 if arch == "qwen3" else 16    # qwen3: key_length != hidden / heads
    ref = hf_weights(arch, head_dim=head_dim)
    src = load_gguf(write_gguf(tmp_path / "m.gguf", arch, ref, head_dim=head_dim), dequant_cache)
    c = src.config
    assert c.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, head_dim)
    assert (c.max_position_embeddings, c.rope_theta) == (256, 500000.0)
    assert c.rms_norm_eps == pytest.approx(1e-6)
    assert c.tie_word_embeddings and c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert c.bos_token_id == 5 and c.eos_token_id == [6, 7]
    assert src.eos_token_ids == [6, 7] and src.chat_template == TEMPLATE and src.fmt == "gguf"
    ws = src.weights()
    assert sorted(ws.names()) == sorted(ref)            # no lm_head when tied
    for name, t in ref.items():
        got = ws.get(name)
        assert got.shape == tuple(t.shape), name
        assert torch.equal(got.load(), t), name          # permuted Q/K restored exactly


def test_untied_gguf_has_lm_head(tmp_path, home):
    ref = hf_weights("llama", tied=False)
    src = load_gguf(write_gguf(tmp_path / "m.gguf", "llama", ref))
    assert not src.config.tie_word_embeddings
    assert torch.equal(src.weights().get("lm_head.weight").load(), ref["lm_head.weight"])


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.F16])
def test_quantized_narrow_matches_full_load(tmp_path, home, qtype):
    ref = hf_weights("llama")
    ws = load_gguf(write_gguf(tmp_path / "m.gguf", "llama", ref, qtype=qtype), dequant_cache=False).weights()
    q = ws.get("model.layers.1.self_attn.q_proj.weight")
    full = q.load()
    tol = {QT.Q8_0: 0.05, QT.Q4_1: 0.6, QT.F16: 2e-3}[qtype]
    assert full.dtype == torch.float32
    assert (full - ref["model.layers.1.self_attn.q_proj.weight"]).abs().max() < tol
    for start, length in [(0, 16), (16, 32), (48, 16), (5, 20)]:   # last: not head-aligned
        assert torch.equal(q.narrow(0, start, length), full[start:start + length])
    assert torch.equal(q.narrow(1, 32, 32), full[:, 32:])
    down = ws.get("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(down.narrow(1, 48, 48), down.load()[:, 48:])
    with pytest.raises(IndexError):
        q.narrow(0, 60, 8)


@settings(max_examples=30, deadline=None)
@given(n_head=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(1, 5),
       data=st.data())
def test_unpermute_inverts_llama_cpp_permute_on_head_aligned_slices(n_head, half, cols, data):
    hd = 2 * half
    w = torch.randn(n_head * hd, cols)
    p = llama_cpp_permute(w, n_head)
    assert not torch.equal(p, w) or half == 1
    assert torch.equal(_unpermute_rows(p, hd), w)
    a = data.draw(st.integers(0, n_head - 1))
    b = data.draw(st.integers(a + 1, n_head))
    assert torch.equal(_unpermute_rows(p[a * hd:b * hd], hd), w[a * hd:b * hd])


def test_truncated_or_garbage_file_raises_weight_load_error(tmp_path, home):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    data = open(path, "rb").read()
    for i, cut in enumerate([len(data) - 100, len(data) // 2, 200]):
        bad = tmp_path / f"cut{i}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(WeightLoadError, match="truncated"):
            load_gguf(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(WeightLoadError):
        load_gguf(str(junk))


def test_unknown_architecture_raises_unsupported(tmp_path, home):
    path = write_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(UnsupportedModelError, match="mamba.*supported.*llama"):
        load_gguf(path)


def test_unsupported_quant_type_is_named(tmp_path, home):
    # IQ4_NL: 32 values in 18 bytes; gguf can decode it but ferrum does not accept it.
    raw = np.random.default_rng(0).integers(0, 255, size=(32, 64 // 32 * 18), dtype=np.uint8)
    path = write_gguf(tmp_path / "m.gguf", "llama",
                      raw_override={"model.layers.0.self_attn.v_proj.weight": (raw, QT.IQ4_NL)})
    with pytest.raises(UnsupportedModelError, match="IQ4_NL.*supported.*Q4_1.*Q6_K"):
        load_gguf(path)



def test_zero_heads_is_a_named_error(tmp_path, home):
    """A GGUF whose attention.head_count is 0 (and no key_length) ended in a ZeroDivisionError
    from the head_dim default; now it is ModelConfig's UnsupportedModelError naming the field."""
    w = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_head_count, 0),
                   (w.add_feed_forward_length, 96), (w.add_vocab_size, 64)]:
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((64, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="num_attention_heads must be a whole number >= 1, got 0"):
        load_gguf(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0])
def test_tensor_larger_than_the_metadata_says_is_refused(tmp_path, home, qtype):
    """A q_proj of 8 heads' rows in a GGUF whose metadata says 4 heads loaded its first 64
    rows without a word (the check only asked that the rows a rank reads exist); now the
    shape must be the metadata's, and the error names the tensor."""
    from ferrum import LLM
    w = hf_weights("llama")
    w["model.layers.0.self_attn.q_proj.weight"] = torch.randn(128, 64)
    path = write_gguf(tmp_path / "m.gguf", "llama", weights=w, qtype=qtype)
    with pytest.raises(WeightLoadError, match=r"q_proj.weight: tensor has shape \(128, 64\), expected \(64, 64\)"):
        LLM(path, max_model_len=64)


# ---------------------------------------------------------------- the per-file cache

def _exit_this_process():
    """Drop the shared locks by which this process marks the cache entries it loaded as in use
    (`cache.use`), as if it had exited, so that a later write may evict them."""
    from ferrum.loader import cache
    for fd in getattr(cache, "_in_use", {}).values():
        os.close(fd)
    getattr(cache, "_in_use", {}).clear()


@contextlib.contextmanager
def flocked_by_another_process(path):
    """A child process holding an exclusive flock on `path` until the block ends."""
    child = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; "
                              f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT); "
                              "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); "
                              "sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n"
        yield
    finally:
        child.communicate("")


def test_gguf_cache_rewritten_file_replaces_its_entry(tmp_path, home):
    path = write_gguf(tmp_path / "m.gguf", weights=hf_weights("llama", seed=1))
    old, _ = gguf_loader.prepare_gguf(path)
    _exit_this_process()
    write_gguf(path, weights=hf_weights("llama", seed=2))   # new contents, size and mtime
    new, _ = gguf_loader.prepare_gguf(path)
    assert new != old
    assert os.listdir(home / "gguf") == [os.path.basename(new)]   # no old entry, no lock files


def test_gguf_cache_drops_entries_of_deleted_files_unless_in_use(tmp_path, home):
    a, b, c = (write_gguf(tmp_path / f"{n}.gguf", weights=hf_weights("llama", seed=i))
               for i, n in enumerate("abc"))
    gone, _ = gguf_loader.prepare_gguf(a)
    _exit_this_process()
    loaded, _ = gguf_loader.prepare_gguf(b)   # still loaded by this process: kept
    os.remove(a)
    os.remove(b)
    new, _ = gguf_loader.prepare_gguf(c)
    assert sorted(os.listdir(home / "gguf")) == sorted(os.path.basename(f) for f in (loaded, new))
    assert gguf_loader._read_meta(loaded) is not None


def test_gguf_cache_keeps_what_another_process_holds_locked(tmp_path, home):
    a, b, c = (write_gguf(tmp_path / f"{n}.gguf", weights=hf_weights("llama", seed=i))
               for i, n in enumerate("abc"))
    stale, _ = gguf_loader.prepare_gguf(a)
    _exit_this_process()
    os.remove(a)
    with flocked_by_another_process(stale + ".lock"):   # as while it builds the entry
        gguf_loader.prepare_gguf(b)
        assert os.path.isdir(stale) and os.path.exists(stale + ".lock")
    new, _ = gguf_loader.prepare_gguf(c)   # the lock is free now: the next write drops both
    assert not os.path.exists(stale) and not os.path.exists(stale + ".lock")
    assert os.path.isdir(new)


def test_gguf_cache_build_removes_scratch_of_killed_builds_only(tmp_path, home):
    """A build killed mid-way (SIGKILL, OOM) left its `.tmp-*` folder in $FERRUM_HOME/gguf
    forever. Now the next build removes it, and leaves alone the one of a build still running."""
    import signal
    build = ("import os, signal, sys\n"
             "from ferrum.loader.cache import staged_folder\n"
             "with staged_folder(sys.argv[1]):\n"
             "    print('building', flush=True)\n"
             "    if sys.stdin.readline() == 'die\\n':\n"
             "        os.kill(os.getpid(), signal.SIGKILL)\n"
             "    raise SystemExit   # a failed build: nothing is renamed into place\n")
    builds, scratch = [], []
    try:
        for key in ("killed", "running"):   # one at a time, to tell their scratch folders apart
            builds.append(subprocess.Popen([sys.executable, "-c", build, str(home / "gguf" / key)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            assert builds[-1].stdout.readline() == "building\n"
            scratch += set(os.listdir(home / "gguf")) - set(scratch)
        (dead, live), (killed, running) = scratch, builds
        killed.communicate("die\n")
        assert killed.returncode == -signal.SIGKILL
        assert sorted(os.listdir(home / "gguf")) == sorted([dead, live])   # left behind
        new, _ = gguf_loader.prepare_gguf(write_gguf(tmp_path / "m.gguf"))
        assert sorted(os.listdir(home / "gguf")) == sorted([live, os.path.basename(new)])
    finally:
        for b in builds:
            if b.returncode is None:
                b.communicate("")
    assert running.returncode == 0
    assert os.listdir(home / "gguf") == [os.path.basename(new)]   # it removed its own


@pytest.mark.parametrize("cut", ["header", "data"])
def test_gguf_cache_rebuilds_an_unreadable_dequantized_file(tmp_path, home, cut):
    """A cached model.safetensors that cannot be read (cut short by a disk error or an
    interrupted copy of $FERRUM_HOME) is built again from the GGUF: every later start failed
    with WeightLoadError "cannot read safetensors file ...: the file is unreadable or
    truncated" until it was deleted by hand."""
    ref = hf_weights("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", ref)
    load_gguf(path).weights()
    folder, _ = gguf_loader.prepare_gguf(path)
    target = os.path.join(folder, "model.safetensors")
    os.truncate(target, 1000 if cut == "header" else os.path.getsize(target) - 8)
    ws = load_gguf(path).weights()
    for name, t in ref.items():
        assert torch.equal(ws.get(name).load(), t), name
    assert sorted(os.listdir(folder)) == ["meta.json", "model.safetensors"]   # no scratch, no lock


def test_gguf_cache_leaves_no_orphan_lock_files(tmp_path, home):
    orphan = home / "gguf" / "0123456789abcdef01234567.lock"   # as a killed process leaves it
    orphan.parent.mkdir(parents=True)
    orphan.touch()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(WeightLoadError):
        gguf_loader.prepare_gguf(str(junk))
    assert sorted(os.listdir(home / "gguf")) == [orphan.name]   # the failed read left no lock
    new, _ = gguf_loader.prepare_gguf(write_gguf(tmp_path / "m.gguf"))
    assert os.listdir(home / "gguf") == [os.path.basename(new)]


# ---------------------------------------------------------------- real SmolLM2 file

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    """SmolLM2 with its weights dequantized from the file on each read (not the loader's cache)."""
    return load_gguf(smollm2_gguf_path, dequant_cache=False)


def test_smollm2_cache_converts_an_unreadable_tokenizer_again(smollm2_gguf_path, home):
    """The cached tokenizer.json cut short (or deleted) is converted again from the GGUF and
    rewritten: the model had no tokenizer on every later start ("no usable tokenizer (Expecting
    value: ...)", then `ferrum run`'s "add tokenizer.json/tokenizer_config.json to its folder")."""
    want = load_gguf(smollm2_gguf_path).tokenizer_loader().encode("The capital of France")
    folder, _ = gguf_loader.prepare_gguf(smollm2_gguf_path)
    cached = os.path.join(folder, "tokenizer", "tokenizer.json")
    size = os.path.getsize(cached)
    os.truncate(cached, 100)
    assert load_gguf(smollm2_gguf_path).tokenizer_loader().encode("The capital of France") == want
    assert os.path.getsize(cached) == size
    assert sorted(os.listdir(folder)) == ["meta.json", "tokenizer"]   # no scratch, no lock


def test_smollm2_config_matches_transformers(smollm2, smollm2_hf_reference):
    hf, c = smollm2_hf_reference[0], smollm2.config
    assert c.architecture == "LlamaForCausalLM" and c.family == "llama"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        49152, 576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.max_position_embeddings, c.rope_theta, c.tie_word_embeddings) == (8192, 100000.0, True)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert (c.bos_token_id, c.eos_token_id, smollm2.eos_token_ids) == (1, [2], [2])
    for ours, theirs in [(c.vocab_size, hf.vocab_size), (c.hidden_size, hf.hidden_size),
                         (c.intermediate_size, hf.intermediate_size),
                         (c.num_hidden_layers, hf.num_hidden_layers),
                         (c.num_attention_heads, hf.num_attention_heads),
                         (c.num_key_value_heads, hf.num_key_value_heads),
                         (c.head_dim, hf.head_dim), (c.rms_norm_eps, hf.rms_norm_eps),
                         (c.rope_theta, hf.rope_parameters["rope_theta"]),
                         (c.max_position_embeddings, hf.max_position_embeddings),
                         (c.tie_word_embeddings, hf.tie_word_embeddings)]:
        assert ours == theirs
    assert smollm2.chat_template.startswith("{% for message in messages %}")
    assert "<|im_start|>" in smollm2.chat_template


@pytest.mark.parametrize("dequant_cache", [False, True])
def test_smollm2_every_tensor_equals_transformers(smollm2_gguf_path, smollm2_hf_reference, dequant_cache):
    """Dequantized from the file, and read from the loader's float32 cache: bit-identical to
    transformers' GGUF loader."""
    ref = smollm2_hf_reference[1]
    ws = load_gguf(smollm2_gguf_path, dequant_cache).weights()
    assert all((ws.get(n).dense is not None) == dequant_cache for n in ws.names())
    assert sorted(ws.names()) == sorted(ref) and len(ref) == 1 + 30 * 9 + 1
    worst = 0.0
    for name in ws.names():
        got = ws.get(name).load()
        assert got.dtype == torch.float32 and got.shape == ref[name].shape == ws.get(name).shape
        worst = max(worst, (got - ref[name]).abs().max().item())
    assert worst == 0.0
    # values are real weights, not zeros: Q4_1 attention weights have a spread
    assert ref["model.layers.0.self_attn.q_proj.weight"].std() > 0.01


def test_smollm2_tp_slices_read_only_their_rows(smollm2, smollm2_hf_reference, monkeypatch):
    ref, ws = smollm2_hf_reference[1], smollm2.weights()
    rows_seen = []
    real = gguf_loader.dequantize

    def spy(raw, qtype):
        rows_seen.append(raw.shape[0])
        return real(raw, qtype)

    monkeypatch.setattr(gguf_loader, "dequantize", spy)
    tp = 3                                   # 9 q heads / 3 kv heads -> 3 and 1 per rank
    for layer in (0, 17):
        for proj, rows in [("self_attn.q_proj", 576), ("self_attn.k_proj", 192),
                           ("self_attn.v_proj", 192), ("mlp.gate_proj", 1536)]:
            name = f"model.layers.{layer}.{proj}.weight"
            n = rows // tp
            for rank in range(tp):
                rows_seen.clear()
                got = ws.get(name).narrow(0, rank * n, n)
                assert rows_seen == [n], name     # dequantized only this rank's rows
                assert torch.equal(got, ref[name][rank * n:(rank + 1) * n]), name
        name = f"model.layers.{layer}.self_attn.o_proj.weight"   # row-parallel: split columns
        for rank in range(tp):
            assert torch.equal(ws.get(name).narrow(1, rank * 192, 192),
                               ref[name][:, rank * 192:(rank + 1) * 192])
    emb = ws.get("model.embed_tokens.weight")                 # vocab-parallel embedding
    assert torch.equal(emb.narrow(0, 24576, 24576), ref["model.embed_tokens.weight"][24576:])


def test_smollm2_truncated_copy_raises(smollm2_gguf_path, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(50_000_000))
    with pytest.raises(WeightLoadError, match="truncated"):
        load_gguf(str(bad))


# ---------------------------------------------------------------- more families (issue 17)

def _llama3_rope_freqs(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel (Llama 3.1): the llama3 rope scaling as per-frequency
    divisors of the inverse frequencies (`rope_freqs.weight`)."""
    import math
    rs, base = cfg.rope_parameters, cfg.rope_parameters["rope_theta"]
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    lo, hi, old = rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(rs["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf_from_hf(path, hf, arch: str) -> str:
    """Write an HF model the way llama.cpp's converter does: tensor names, Q/K row permutation
    (llama / Mixtral), stacked experts, 1 + w norms (gemma3), rope_freqs (Llama 3.1), metadata."""
    cfg = hf.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters.get("rope_theta", cfg.rope_parameters.get(
        "full_attention", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    to_gguf = {v: k for k, v in (gguf_loader._GEMMA3_LAYER_NAMES if arch == "gemma3"
                                 else gguf_loader._LAYER_NAMES).items()}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.detach().float()
        if name in _TO_GGUF_GLOBAL:
            gname = _TO_GGUF_GLOBAL[name]
        else:
            _, _, i, *mid, suffix = name.split(".")
            mid = ".".join(mid)
            if mid == "mlp.experts" and suffix == "gate_up_proj":   # [E, 2I, H]: gate rows first
                half = t.shape[1] // 2
                w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", t[:, :half].contiguous().numpy())
                w.add_tensor(f"blk.{i}.ffn_up_exps.weight", t[:, half:].contiguous().numpy())
                continue
            if mid == "mlp.experts" and suffix == "down_proj":
                w.add_tensor(f"blk.{i}.ffn_down_exps.weight", t.numpy())
                continue
            gname = f"blk.{i}.{to_gguf[mid]}.{suffix}"
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, heads)
        if arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0
        w.add_tensor(gname, t.contiguous().numpy())
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


GGUF_FAMILIES = {
    "llama3.1-rope-freqs": ("llama", "llama", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mixtral": ("llama", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3moe": ("qwen3moe", "qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                                moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2moe-shared": ("qwen2moe", "qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=48)),
    "gemma3": ("gemma3", "gemma3", dict(layers=6, num_kv_heads=1, head_dim=32, tie=True,
                                        sliding_window=20, query_pre_attn_scalar=32,
                                        rope_theta=1e6)),
}


@pytest.mark.parametrize("case", list(GGUF_FAMILIES))
def test_gguf_family_matches_hf(tmp_path, case):
    """A tiny HF model written as llama.cpp writes that family, loaded back by ferrum: config
    fields and logits of prefill + decode equal the HF model's (fp32, 1e-4)."""
    import random
    from tiny_models import hf_model, make_tiny_model
    from ferrum.config import EngineConfig
    from ferrum.executor.single import SingleDeviceExecutor
    from test_models import _hf_logits, _run_executor
    arch, family, kw = GGUF_FAMILIES[case]
    hf = hf_model(make_tiny_model(str(tmp_path / "hf"), family, seed=31, **kw))
    path = write_gguf_from_hf(tmp_path / "m.gguf", hf, arch)
    src = load_gguf(path)
    c = src.config
    assert c.architecture == type(hf).__name__
    if family == "gemma3":   # llama.cpp's default pattern: every 6th layer global
        assert c.layer_types == hf.config.layer_types and c.sliding_window == 20
        assert (c.rope_theta, c.rope_local_theta) == (1e6, 10000.0)
    if case.startswith("llama3.1"):
        assert c.rope_scaling["rope_type"] == "gguf_rope_freqs"
    if c.num_experts:
        assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (
            getattr(hf.config, "num_local_experts", None) or hf.config.num_experts, 2,
            getattr(hf.config, "norm_topk_prob", True))
    rng = random.Random(31)
    prompts = [[rng.randrange(2, 128) for _ in range(n)] for n in (37, 70)]
    cfg = EngineConfig.from_kwargs(model=path, dtype="float32", device="cpu", max_model_len=256,
                                   num_kv_blocks=64, block_size=16)
    ex = SingleDeviceExecutor(src, cfg, progress=False)
    logits, toks = _run_executor(ex, prompts, 12, None, seed=31)
    worst = 0.0
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf, p + toks[i][:12])[len(p) - 1:]
        diff = (logits[i] - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff < 1e-4, f"{case} prompt {len(p)}: max abs logits diff {diff:.3e}"
        assert toks[i] == ref.argmax(-1).tolist()
    print(f"GGUF {case}: max abs logits diff vs HF = {worst:.3e}")
