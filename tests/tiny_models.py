"""Tiny random HF models saved as folders (config.json + model.safetensors +
generation_config.json), so tests compare ferrum against transformers with no download."""
from __future__ import annotations

import os

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def make_tiny_model(folder: str, family: str = "llama", *, num_heads: int = 4, num_kv_heads: int = 2,
                    hidden: int = 64, layers: int = 2, vocab: int = 128, inter: int = 96,
                    tie: bool = False, head_dim: int | None = None, rope_scaling: dict | None = None,
                    seed: int = 0, max_pos: int = 512, **extra) -> str:
    """Writes a random HF model to `folder` and returns it. eos_token_id is 1. `extra` goes to
    the HF config as is (sliding_window, num_experts, ...)."""
    import transformers
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    cfg_cls = getattr(transformers, FAMILIES[family][0])
    model_cls = getattr(transformers, FAMILIES[family][1])
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=max_pos,
              tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5, rope_theta=10000.0)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if rope_scaling is not None:
        kw["rope_scaling"] = rope_scaling
    kw["pad_token_id"] = 0
    kw.update(extra)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    with torch.no_grad():  # larger than init std so that attention patterns are non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_model(folder: str):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    return m.eval()


JSON_CORPUS = ['{"w": ["a", "b", "c"], "k": 42}', '{"name": "x", "ok": true, "n": null}',
               "Describe a cat. Paris, JSON please? 1 2 3 x y z", "[1, 2.5, -3e4]"] * 4


def byte_level_bpe(corpus: list[str], vocab: int, special_tokens: list[str]):
    """A byte-level BPE `tokenizers.Tokenizer` (GPT-2 / Llama-3 style: every byte a token)
    with merges learnt on `corpus` up to `vocab` entries; the special tokens get the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special_tokens, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def save_byte_level_tokenizer(folder: str, vocab: int = 300) -> str:
    """Trains a byte-level BPE tokenizer (merges learnt on JSON-like text; ids 0 / 1 =
    <|bos|> / <|eos|>, as `make_tiny_model`'s config) and saves it to `folder`: a tokenizer
    for tests that must run with no download (the GPU machine has no PyPI)."""
    from transformers import PreTrainedTokenizerFast
    tok = byte_level_bpe(JSON_CORPUS, vocab, ["<|bos|>", "<|eos|>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>").save_pretrained(folder)
    return folder
