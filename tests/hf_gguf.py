"""Transformers' own reading of a GGUF file, the oracle of the real-model GGUF tests
(test_gguf, test_engine, test_gemma3)."""
from __future__ import annotations

import os

import torch


def hf_gguf_reference(path: str):
    """(HF config, {HF name: float32 tensor}) from transformers' GGUF loader:
    `load_gguf_checkpoint(..., return_tensors=True)` is what `from_pretrained(gguf_file=...)`
    calls for the weights (from_pretrained itself additionally requires `accelerate`).
    Transformers parses the file's metadata twice (config, then tensors): one GGUFReader of the
    file serves both (~21 s per parse of Gemma 3's 262k-token vocabulary on the CI box)."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    real, reader = gguf.GGUFReader, gguf.GGUFReader(path)
    gguf.GGUFReader = lambda p, *a, **k: reader if os.path.abspath(p) == os.path.abspath(path) else real(p, *a, **k)
    try:
        folder, fname = os.path.split(path)
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    finally:
        gguf.GGUFReader = real
    return config, tensors


def hf_model_from(config, tensors):
    """The HF model of `config` in float32 holding `tensors` (its LM head tied to the
    embedding when the checkpoint has none)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    with no_init_weights():   # every weight is overwritten below: skip the random init
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.tie_weights()       # (no_init_weights skips the tying from_config does)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}   # tied to the embedding
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model
