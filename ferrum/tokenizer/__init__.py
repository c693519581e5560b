"""Tokenizer (text <-> ids, chat templates); the incremental detokenizer lives in detokenizer.py."""
from ferrum.tokenizer.tokenizer import Tokenizer, load_chat_template

__all__ = ["Tokenizer", "load_chat_template"]
