"""vLLM as the peer of ferrum's GGUF Q4_K batch-1 latency (benchmarks/quant_bench.py latency, format
gguf_q4_k; issue 15: "GGUF Q4_K >= 1.15x vLLM with the same format, in the same run"): a
Llama-3-8B-shaped GGUF file whose linear weights are random Q4_K blocks drawn as ferrum's dummy
`--quantization gguf_q4_k` draws them, timed with ../shared/peers/vllm_bench.py's latency method,
run where vLLM 0.22.1 is importable (see ../shared/peers/README.md):

    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 OUT=$OUT setsid python3 benchmarks/vllm_gguf_peer.py

Options --gguf PATH, --write-only. The file (`write_gguf`, when PATH is absent or not of these
shapes; default /tmp/models/llama3-8b-q4_k.gguf, ~6 GB): shapes of benchmarks/configs/llama3-8b.json, llama.cpp
tensor names, every attn_q/k/v/output and ffn_gate/up/down weight Q4_K (random bytes, then each
144-byte block's fp16 d and dmin at bytes 0 and 2 set to U(0.0005, 0.002), as `init_dummy` in
ferrum/layers/quantization/gguf.py), norms F32 ones, output F16 (small random) and token_embd Q4_K,
so the bytes read per decode step are those of ferrum's dummy gguf_q4_k model (bf16 LM head; a
decode step reads one embedding row, 2.3 KB in Q4_K, 8 KB in ferrum's bf16). token_embd is Q4_K, as
in llama.cpp's Q4_K_M files, because vLLM 0.22.1 builds Llama's embedding with an empty module
prefix, so its GGUF loader never finds an F16 token_embd among the unquantized modules and fails
(KeyError: 'embed_tokens.weight'). No tokenizer in the file: the metadata holds the llama.* keys and llama.vocab_size.
`--write-only` writes the file and exits (no vLLM), e.g. to time it.

vLLM: the file as the model (vLLM picks quantization / load_format "gguf" for a GGUF file; both
are also passed), the config from a folder holding the benchmark config.json (`hf_config_path`;
vLLM's speculators check still parses the GGUF metadata with transformers, hence the llama.* keys),
skip_tokenizer_init, bf16 activations (VB_DTYPE overrides), and vllm_bench.py's latency settings (batch 1, 128-token
random token-id prompt, max_model_len prompt + 600, gpu_memory_utilization 0.85, max_num_seqs 8;
TTFT = best of 3 one-token requests, decode tok/s = 511 / (best of 3 times for 512 tokens - TTFT)).
Prints one `VLLMPEER {json}` line and writes $OUT/vllm_latency_gguf_q4_k_p128_tp1.json in
vllm_bench.py's schema plus the file's path, size and tensor types (vLLM leaves workers behind:
run it under `setsid` and kill its group after).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL, QUANT = "llama3-8b", "gguf_q4_k"
P_LAT = int(os.environ.get("VB_P", 128))   # vllm_bench.py's latency prompt length
Q4_K_BLOCK, Q4_K_BYTES = 256, 144          # weights and bytes per Q4_K block (gguf.GGML_QUANT_SIZES)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def load_config(name: str = MODEL) -> dict:
    with open(os.path.join(HERE, "configs", f"{name}.json")) as f:
        return json.load(f)


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
    """[(llama.cpp tensor name, torch shape [out, in] / [n], "Q4_K" | "F16" | "F32")] in the order
    llama.cpp writes them. llama.cpp's converter (convert_hf_to_gguf.py LlamaModel.permute) stores
    attn_q / attn_k rows permuted for interleaved RoPE (vLLM then runs GPT-J-style RoPE on GGUF llama,
    vllm/model_executor/models/llama.py `is_neox_style = False`; ferrum's loader un-permutes the rows):
    with random weights the order of rows changes nothing the benchmark measures."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_gate": (inter, h), "ffn_up": (inter, h), "ffn_down": (h, inter)}
    plan = [("token_embd.weight", (v, h), "Q4_K")]   # not F16: see the module docstring
    for i in range(cfg["num_hidden_layers"]):
        plan.append((f"blk.{i}.attn_norm.weight", (h,), "F32"))
        plan += [(f"blk.{i}.{n}.weight", shapes[n], "Q4_K") for n in LINEARS[:4]]
        plan.append((f"blk.{i}.ffn_norm.weight", (h,), "F32"))
        plan += [(f"blk.{i}.{n}.weight", shapes[n], "Q4_K") for n in LINEARS[4:]]
    plan += [("output_norm.weight", (h,), "F32")]
    if not cfg.get("tie_word_embeddings", False):
        plan.append(("output.weight", (v, h), "F16"))
    return plan


def random_q4_k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols // 256 * 144] uint8: random Q4_K blocks whose fp16 d and dmin (bytes 0-1, 2-3 of
    each block) are U(0.0005, 0.002), as ferrum's GGUFLinearMethod.init_dummy draws them."""
    if cols % Q4_K_BLOCK:
        raise ValueError(f"Q4_K needs whole blocks of {Q4_K_BLOCK} input features, got {cols}")
    nb = cols // Q4_K_BLOCK
    n = rows * nb * Q4_K_BYTES
    raw = rng.integers(0, 2**64 - 1, n // 8, dtype=np.uint64, endpoint=True).view(np.uint8)
    raw = raw.reshape(rows, nb, Q4_K_BYTES)
    scales = rng.uniform(0.0005, 0.002, size=(rows, nb, 2)).astype(np.float16)
    raw[:, :, 0:4] = scales.view(np.uint8).reshape(rows, nb, 4)
    return raw.reshape(rows, nb * Q4_K_BYTES)


def random_f16(rng: np.random.Generator, shape, scale: float = 0.02, chunk: int = 1 << 24) -> np.ndarray:
    """Small uniform values in [-scale, scale), drawn in chunks (the 8B embedding is 525M values)."""
    out = np.empty(int(np.prod(shape)), np.float16)
    for s in range(0, out.size, chunk):
        e = min(out.size, s + chunk)
        out[s:e] = rng.random(e - s, dtype=np.float32) * (2 * scale) - scale
    return out.reshape(shape)


def gguf_metadata(cfg: dict) -> dict:
    """The llama.* keys (gguf.Keys.LLM / Attention / Rope) that transformers' GGUF config parser
    (transformers/integrations/ggml.py GGUF_CONFIG_MAPPING["llama"]) and ferrum's gguf_config read."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "rope.freq_base": float(cfg.get("rope_theta", 500000.0)),
            "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
            "vocab_size": cfg["vocab_size"], "rope.dimension_count": hd}


def write_gguf(path: str, cfg: dict, seed: int = 0, name: str = "ferrum-dummy") -> dict:
    """Write a llama-arch GGUF of `cfg`'s shapes (see the module docstring), one tensor at a time
    (GGUFWriter: header, KV, tensor infos, then write_tensor_data in the same order), to path + ".tmp"
    then renamed, so an interrupted run leaves no partial file at `path`. Returns {"bytes", "write_s",
    "tensor_types"}."""
    import gguf
    from gguf import GGMLQuantizationType as QT
    t0 = time.perf_counter()
    plan = tensor_plan(cfg)
    w = gguf.GGUFWriter(path + ".tmp", "llama")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_S)   # every quantized tensor Q4_K
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, val in gguf_metadata(cfg).items():
        if isinstance(val, float):
            w.add_float32(f"llama.{key}", val)
        else:
            w.add_uint32(f"llama.{key}", int(val))
    for tname, shape, kind in plan:
        if kind == "Q4_K":   # raw blocks: the byte shape [out, in // 256 * 144], which the writer
            rows, cols = shape   # turns into the element shape [out, in] (quant_shape_from_byte_shape)
            nbytes = rows * cols // Q4_K_BLOCK * Q4_K_BYTES
            w.add_tensor_info(tname, (rows, cols // Q4_K_BLOCK * Q4_K_BYTES), np.dtype(np.uint8), nbytes,
                              raw_dtype=QT.Q4_K)
        else:
            dt = np.dtype(np.float16 if kind == "F16" else np.float32)
            w.add_tensor_info(tname, shape, dt, int(np.prod(shape)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, shape, kind in plan:
        if kind == "Q4_K":
            w.write_tensor_data(random_q4_k(rng, *shape))
        elif kind == "F16":
            w.write_tensor_data(random_f16(rng, shape))
        else:
            w.write_tensor_data(np.ones(shape, np.float32))
    w.close()
    os.replace(path + ".tmp", path)
    types: dict[str, int] = {}
    for _, _, kind in plan:
        types[kind] = types.get(kind, 0) + 1
    return {"bytes": os.path.getsize(path), "write_s": time.perf_counter() - t0, "tensor_types": types}


def check_gguf(path: str, cfg: dict) -> dict | None:
    """{"bytes", "tensor_types"} when `path` is a GGUF with exactly `tensor_plan(cfg)`'s names, types
    and shapes, else None (metadata only: GGUFReader memory-maps the tensors)."""
    import gguf
    if not os.path.isfile(path):
        return None
    try:
        reader = gguf.GGUFReader(path)
    except Exception:   # noqa: BLE001  truncated or not a GGUF: written again
        return None
    have = {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    want = {n: (k, tuple(s)) for n, s, k in tensor_plan(cfg)}
    if have != want:
        return None
    types: dict[str, int] = {}
    for kind, _ in have.values():
        types[kind] = types.get(kind, 0) + 1
    return {"bytes": os.path.getsize(path), "write_s": None, "tensor_types": types}


def config_dir(path: str, cfg: dict) -> str:
    """A folder with the benchmark's config.json, vLLM's `hf_config_path`: vLLM then builds the model
    config from it (vllm/config/model.py: get_config(self.hf_config_path or self.model)) instead of
    from the GGUF metadata through transformers."""
    d = os.path.splitext(path)[0] + "-config"
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def run_vllm(path: str, cfg_dir: str) -> dict:
    """vllm_bench.py's latency section on the GGUF file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # no hub on the GPU machine: fail fast, never wait
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = dict(hf_config_path=cfg_dir, quantization="gguf", load_format="gguf",
              dtype=os.environ.get("VB_DTYPE", "bfloat16"),
              tensor_parallel_size=1, max_model_len=P_LAT + 600, skip_tokenizer_init=True,
              gpu_memory_utilization=0.85, max_num_seqs=8)
    llm = LLM(path, **kw)
    rng = random.Random(2)
    p = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 128000) for _ in range(P_LAT)])]

    def run(n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(p, sp, use_tqdm=False)
        return time.perf_counter() - t

    run(16)
    run(16)
    t1 = min(run(1) for _ in range(3))
    tn = min(run(512) for _ in range(3))
    return dict(prompt_len=P_LAT, ttft_ms=1e3 * t1, decode_tok_s=511 / (tn - t1), e2e_512_s=tn,
                vllm_args={k: v for k, v in kw.items() if k != "hf_config_path"})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=f"/tmp/models/{MODEL}-q4_k.gguf", help="the GGUF file (written if absent)")
    ap.add_argument("--config", default=MODEL, help="benchmarks/configs/<name>.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-only", action="store_true", help="write the file and exit")
    args = ap.parse_args()
    cfg = load_config(args.config)
    os.makedirs(os.path.dirname(os.path.abspath(args.gguf)), exist_ok=True)
    info = check_gguf(args.gguf, cfg)
    if info is None:
        info = write_gguf(args.gguf, cfg, args.seed, name=f"ferrum-dummy-{args.config}-q4_k")
        print(f"# wrote {args.gguf}: {info['bytes'] / 1e9:.2f} GB in {info['write_s']:.1f} s", flush=True)
    else:
        print(f"# reusing {args.gguf} ({info['bytes'] / 1e9:.2f} GB)", flush=True)
    if args.write_only:
        return
    out = {"peer": "vllm", "section": "latency", "tp": 1, "quant": QUANT, "model": args.config,
           **run_vllm(args.gguf, config_dir(args.gguf, cfg)),
           "gguf_file": os.path.abspath(args.gguf), "gguf_bytes": info["bytes"], "gguf_write_s": info["write_s"],
           "tensor_types": info["tensor_types"]}
    print("VLLMPEER", json.dumps(out), flush=True)
    d = os.environ.get("OUT")
    if d:
        with open(os.path.join(d, f"vllm_latency_{QUANT}_p{P_LAT}_tp1.json"), "w") as f:
            f.write(json.dumps(out, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # vLLM's engine core and workers: don't wait on them (the caller kills the group)


if __name__ == "__main__":
    main()
