"""`ferrum run` interactive chat, driven through a pseudo-terminal (pexpect) as a user types:
an empty line does not quit, a bracketed paste of several lines is one message, /help, /set,
/show, /reset with its confirmation, Ctrl-C stops a reply and keeps the conversation, Ctrl-C
at the prompt clears the line, /bye quits with status 0, the history file is written."""
from __future__ import annotations

import os
import re
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"   # what a terminal sends around a paste


def _messages(child) -> int:
    """The conversation's length, from `/show`. Also the sync point after an action: the
    line is read only once the previous message's reply is done. (prompt_toolkit redraws
    the `>>>` prompt with cursor moves, so matching the prompt itself is unreliable.)"""
    child.sendline("/show")
    child.expect(r"(\d+) messages")
    return int(child.match.group(1))


def test_chat_session_through_a_pty(tiny_chat_model, tmp_path):
    env = {**os.environ, "FERRUM_HOME": str(tmp_path), "PROMPT_TOOLKIT_NO_CPR": "1",
           "TERM": "xterm", "COLUMNS": "200", "LINES": "50"}
    child = pexpect.spawn(sys.executable, ["-m", "ferrum.entrypoints.cli", "run", tiny_chat_model,
                                           "--temperature", "0", "--max-tokens", "4",
                                           "--max-model-len", "8192", "--threads", "1"],
                          env=env, encoding="utf-8", timeout=240, dimensions=(50, 200))
    try:
        child.expect(">>>")
        child.sendline("")                         # an empty line no longer quits
        assert _messages(child) == 0
        child.sendline("/help")
        child.expect("/reset")
        child.sendline("/set temperature 0")
        child.expect(r"temperature = 0\.0")
        child.sendline("/set max_tokens -3")
        child.expect("max_tokens must be an integer >= 1")
        assert _messages(child) == 0

        # a pasted block of three lines is one message (and never reaches a shell)
        child.send(f"{PASTE_START}first line\nsecond line\nthird line{PASTE_END}")
        child.send("\r")
        assert _messages(child) == 2               # one user turn + one reply

        # multi-line mode: lines between triple quotes are one message
        child.sendline('"""')
        child.sendline("alpha")
        child.sendline('beta"""')
        assert _messages(child) == 4

        # Ctrl-C stops a long reply; the conversation keeps the turn and the partial reply
        child.sendline("/set max_tokens 8000")
        child.expect("max_tokens = 8000")
        child.sendline("tell me a long story")
        time.sleep(3)
        child.sendintr()
        child.expect("reply stopped")
        assert _messages(child) == 6
        child.sendline("/set max_tokens 4")
        child.expect("max_tokens = 4")

        # Ctrl-C at the prompt clears the line and keeps the chat
        child.send("half typed")
        child.sendintr()
        child.expect("clears the line")
        assert _messages(child) == 6

        # /reset asks first
        child.sendline("/reset")
        child.expect(r"\[y/N\]")
        child.sendline("n")
        assert _messages(child) == 6
        child.sendline("/reset")
        child.expect(r"\[y/N\]")
        child.sendline("y")
        child.expect("conversation cleared")
        assert _messages(child) == 0

        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    # the line editor's history (up-arrow) is kept under $FERRUM_HOME
    history = (tmp_path / "chat_history").read_text()
    assert re.search(r"^\+tell me a long story$", history, re.M)
