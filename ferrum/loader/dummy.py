"""`dummy:<config>` models: the real config of a model (an HF folder or a config.json path),
random weights (see model_loader.init_dummy_weights). For speed work without weights."""
from __future__ import annotations

import json
import os

from ferrum.config import ModelConfig
from ferrum.errors import ModelNotFoundError, UnsupportedModelError
from ferrum.loader.base import ModelSource


def load_dummy(spec: str) -> ModelSource:
    """A ModelSource with random weights of the shape in `spec` (an HF folder or its
    config.json path); the folder's tokenizer when it has one. Raises ModelNotFoundError when
    the config is missing, UnsupportedModelError when it cannot be read or used."""
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.exists(path):
        raise ModelNotFoundError(f"dummy model config {path} not found (give an HF folder or a config.json)")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:   # not JSON, a directory, unreadable: one line
        raise UnsupportedModelError(f"dummy model config {path} cannot be read as JSON: {e}") from None
    cfg = ModelConfig.from_hf_dict(d)
    folder = os.path.dirname(os.path.abspath(path))

    def load_tokenizer():
        from ferrum.tokenizer.tokenizer import Tokenizer
        return Tokenizer.from_folder(folder)

    has_tok = any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    tok = load_tokenizer if has_tok else None
    return ModelSource(name=f"dummy-{cfg.architecture}", config=cfg, weights=lambda: None,
                       tokenizer_loader=tok, eos_token_ids=list(cfg.eos_token_id), path=path, fmt="dummy")
