"""Hugging Face folder loader: config.json, model.safetensors or a sharded
model.safetensors.index.json, generation_config.json, tokenizer files.

Tensors are opened with `safetensors.safe_open` and read lazily; `narrow` reads only the
requested slice from disk (safetensors `get_slice`), so a TP rank never reads the whole model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from ferrum.config import ModelConfig, generation_eos_token_ids
from ferrum.errors import ModelNotFoundError, UnsupportedModelError, WeightLoadError
from ferrum.loader.base import ModelSource


@dataclass
class SafetensorsWeight:
    """A LazyWeight over tensor `name` of the file `path` (read through safetensors slices)."""

    path: str
    name: str
    shape: tuple[int, ...]

    def _slice(self, whole: bool = False):
        try:
            f = safe_open(self.path, framework="pt")
            return f.get_tensor(self.name) if whole else f.get_slice(self.name)
        except Exception as e:  # truncated or corrupt file
            raise WeightLoadError(f"cannot read tensor {self.name!r} from {self.path}: {e}") from e

    def load(self) -> torch.Tensor:
        """The whole tensor, in its stored dtype (also 0-dim tensors such as FP8 scales, which
        slices reject). Raises WeightLoadError on an unreadable file."""
        return self._slice(whole=True)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Only [start, start + length) along dim, read from the file without the rest."""
        idx = [slice(None)] * len(self.shape)
        idx[dim] = slice(start, start + length)
        return self._slice()[tuple(idx)]


class SafetensorsSource:
    """All tensors of a folder, by name."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            try:   # a half-downloaded or hand-edited index: named, not a JSONDecodeError / KeyError
                with open(index) as f:
                    files = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise WeightLoadError(f"cannot read {index}: {type(e).__name__}: {e}; it must be JSON "
                                      "with a \"weight_map\" of tensor name -> file name") from None
        else:
            files = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
        if not files:
            raise WeightLoadError(f"no .safetensors files in {folder}")
        self._weights: dict[str, SafetensorsWeight] = {}
        for fn in files:
            path = os.path.join(folder, fn)
            try:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        if name in self._weights:   # else the file sorted last won without a word
                            raise WeightLoadError(
                                f"tensor {name!r} is in both {os.path.basename(self._weights[name].path)} "
                                f"and {fn} in {folder}; remove the file that is not this model's")
                        self._weights[name] = SafetensorsWeight(path, name, tuple(f.get_slice(name).get_shape()))
            except WeightLoadError:
                raise
            except Exception as e:
                raise WeightLoadError(f"cannot read safetensors file {path}: {e}; "
                                      "the file is unreadable or truncated") from e

    def names(self) -> list[str]:
        """Every tensor name of the folder's files."""
        return list(self._weights)

    def get(self, name: str) -> SafetensorsWeight:
        """The tensor `name` (KeyError when absent)."""
        return self._weights[name]


# sizes every checkpoint's config.json states (head_dim and num_key_value_heads have
# defaults that real configs rely on)
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")


def _first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (transformers' run to a paragraph),
    with the next one when it ends in a colon (a validation error names the field, then why)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    return " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]


def load_hf_folder(folder: str) -> ModelSource:
    """Resolve a local HF model folder into a ModelSource: config.json through transformers'
    AutoConfig, EOS ids from generation_config.json (read as JSON), else config.json.
    Raises ModelNotFoundError when the folder has no config.json, UnsupportedModelError for
    an unknown architecture, a config.json without one of `_REQUIRED_FIELDS`, or a
    config.json that transformers cannot read or a generation_config.json that is not a JSON
    object (values of the wrong type, EOS ids that are not integers), on one line."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise ModelNotFoundError(f"{folder} has no config.json; not a Hugging Face model folder")
    from transformers import AutoConfig
    try:
        # never the folder's own Python (`auto_map`): transformers would otherwise ask on stdin,
        # and a piped prompt or a "y" there would run it
        hf = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except OSError as e:   # transformers' "not a valid JSON file" (and unreadable files)
        raise UnsupportedModelError(f"{folder}/config.json cannot be read as a model config: "
                                    f"{_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001  unknown model_type, custom code, and what transformers'
        # config classes raise on values of the wrong type or range (`null`, "4" heads, 0 heads)
        raise UnsupportedModelError(f"{folder}/config.json: {type(e).__name__}: {_first_line(e)}") from None
    config = ModelConfig.from_hf_config(hf)
    # transformers fills a size config.json lacks with its class default (Llama: 4096 hidden,
    # 32 layers), which then failed as "270 tensors missing" or a shape error of some tensor
    with open(os.path.join(folder, "config.json")) as f:
        given = json.load(f)
    missing = [k for k in _REQUIRED_FIELDS if k not in given]
    if missing:
        raise UnsupportedModelError(f"{folder}/config.json lacks {', '.join(missing)}; a model "
                                    "config must give its sizes")
    try:
        eos = generation_eos_token_ids(folder) or list(config.eos_token_id)
    except Exception as e:  # noqa: BLE001  not JSON, not an object, EOS ids not ints (1.5: TypeError)
        raise UnsupportedModelError(f"{folder}/generation_config.json cannot be read: "
                                    f"{type(e).__name__}: {_first_line(e)}") from None

    def tokenizer_loader():
        from ferrum.tokenizer.tokenizer import Tokenizer
        try:
            return Tokenizer.from_folder(folder, eos)
        except (OSError, ValueError) as e:
            # a folder without tokenizer files still serves token-id prompts (the engine warns);
            # a tokenizer.json that is there but broken is a damaged download: say so at load,
            # not as "this model has no tokenizer" on every text prompt
            if os.path.exists(os.path.join(folder, "tokenizer.json")):
                raise UnsupportedModelError(f"{folder}/tokenizer.json cannot be loaded: "
                                            f"{type(e).__name__}: {_first_line(e)}") from None
            raise

    return ModelSource(
        name=os.path.basename(os.path.normpath(folder)),
        config=config,
        weights=lambda: SafetensorsSource(folder),
        tokenizer_loader=tokenizer_loader,
        eos_token_ids=eos,
        path=folder,
        fmt="safetensors",
    )
