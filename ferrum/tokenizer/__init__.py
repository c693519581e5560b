"""Tokenizer (text <-> ids, chat templates); the incremental detokenizer lives in detokenizer.py."""
from ferrum.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
