"""`resolve_model`: what a user typed (a known name, a path, `dummy:<config.json>` or a Hugging
Face Hub id) -> the ModelSource that loads it. Known names come from ferrum/model_store.py."""
from __future__ import annotations

import os
import re

from ferrum.errors import ModelNotFoundError, did_you_mean
from ferrum.loader.base import ModelSource
from ferrum.model_store import known_model, known_names, pull


def load_gguf(path: str) -> ModelSource:
    """ferrum.loader.gguf.load_gguf, imported on use: only GGUF files need the gguf package."""
    from ferrum.loader.gguf import load_gguf as _load_gguf
    return _load_gguf(path)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _from_folder(folder: str) -> ModelSource:
    from ferrum.loader.safetensors import load_hf_folder
    if os.path.exists(os.path.join(folder, "config.json")):
        return load_hf_folder(folder)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return load_gguf(os.path.join(folder, ggufs[0]))
    if ggufs:
        raise ModelNotFoundError(f"{folder} holds several GGUF files ({', '.join(ggufs)}); "
                                 "pass the path of one")
    raise ModelNotFoundError(f"{folder} has neither config.json nor a .gguf file")


def _from_hub(repo_id: str) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError
    from ferrum.loader.safetensors import load_hf_folder
    try:
        folder = snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"])
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"no model {repo_id!r} on the Hugging Face Hub "
                                 "(or it is gated/private)") from e
    except Exception as e:  # connection errors, offline mode, HTTP errors
        first = (str(e).strip().splitlines() or [""])[0][:200]  # hub errors run to many lines
        raise ModelNotFoundError(f"could not fetch {repo_id!r}: the Hugging Face Hub could not be "
                                 f"reached ({type(e).__name__}: {first})") from e
    return load_hf_folder(folder)


def resolve_model(name_or_path: str) -> ModelSource:
    """Turn what a user typed into a ModelSource, trying in order:

    - `dummy:<path-or-config.json>`: random weights (ferrum.loader.dummy.load_dummy);
    - a `.gguf` file; a folder with config.json (HF safetensors); a folder with one `.gguf`;
    - a known name (`smollm2`, ...): pulled into the cache on first use, then loaded;
    - a Hugging Face Hub id `org/name`: snapshot_download (weights, config, tokenizer files).

    Raises ModelNotFoundError for anything else (and when the hub cannot be reached),
    plus the loaders' WeightLoadError / UnsupportedModelError.
    """
    if name_or_path.startswith("dummy:"):
        from ferrum.loader.dummy import load_dummy
        return load_dummy(name_or_path[len("dummy:"):])
    path = os.path.expanduser(name_or_path)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"{path} is a file but not a .gguf; pass a .gguf file or a "
                                     "Hugging Face model folder")
        return load_gguf(path)
    if os.path.isdir(path):
        return _from_folder(path)
    m = known_model(name_or_path)
    if m is not None:
        source = load_gguf(pull(m.name))
        source.name = m.name
        return source
    if _HUB_ID.match(name_or_path) and not name_or_path.startswith((".", "~")):
        return _from_hub(name_or_path)
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found{did_you_mean(name_or_path, known_names())}. Accepted: a known name ({', '.join(known_names())}), "
        "a .gguf file, a Hugging Face model folder (config.json + *.safetensors), a Hub id "
        "'org/name', or 'dummy:<config.json>' for random weights")
