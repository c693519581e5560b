"""StructuredOutputManager: the engine's grammar state, one matcher per constrained sequence.

Life of a constrained sequence (driven by LLMEngine):
  add_request -> `compile(params)` (a 400 for a bad schema before anything is queued);
  sequence created -> `add(seq_id, grammar)` (each of the n samples gets its own matcher);
  every step that samples it -> `bitmask(seq_ids)` gives the allowed tokens of its row
  (one llguidance call fills every constrained row), the sampler masks the rest;
  its token is known on the host -> `accept(seq_id, token)` advances the matcher (or raises
  GrammarFailedError: the engine fails the request), and `is_terminated(seq_id)` says the
  grammar is complete and admits nothing more (the engine then finishes it with finish_reason
  "stop");
  finished or aborted -> `release(seq_id)`.
A step with a constrained row is never overlapped with the next (async scheduling): the next
mask needs this step's token in the matcher.

The grammar compiler (which builds llguidance's view of the vocabulary, about a second) is
created on the first constrained request, so engines that never see one never pay for it;
llguidance itself is imported then too, so an engine runs (and benchmarks) where it is not
installed, and only a constrained request needs it.
`compile` and the compiler are thread-safe; everything else belongs to the engine thread.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

from typing import TYPE_CHECKING

import torch

from ferrum.errors import FerrumError, InvalidRequestError
from ferrum.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from ferrum.structured_output.grammar import CompiledGrammar, GrammarCompiler

log = logging.getLogger("ferrum")


class GrammarFailedError(FerrumError):
    """A constrained sequence's grammar rejected a token it had allowed (see `accept`)."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: bit j of word w allows token 32 * w + j."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """tokenizer: the engine's ferrum Tokenizer (None: constrained requests are refused);
    vocab_size: V, the logits' width; eos_token_ids: the model's EOS ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._executor = None       # llguidance's thread pool for filling masks
        self._fill_par = None       # llguidance.torch.fill_next_token_bitmask_par, with it
        self._pool: ThreadPoolExecutor | None = None   # runs bitmask_async
        self._pending: Future | None = None
        self.matchers: dict[str, object] = {}     # seq_id -> llguidance.LLMatcher

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                from ferrum.structured_output.grammar import GrammarCompiler
                self._compiler = GrammarCompiler(self.tokenizer.hf, self.vocab_size, self.eos_token_ids)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile (or fetch from the cache). Thread-safe: the server compiles in a worker
        thread before it queues a request, so the engine thread only finds it in the cache.
        Raises InvalidRequestError naming params.param (no tokenizer) or, for a constraint
        that does not compile, params.param_name() (e.g. structured_outputs.regex)."""
        if self.tokenizer is None:
            raise InvalidRequestError(f"{params.param}: structured outputs need the model's "
                                      "tokenizer, and this model has none", param=params.param)
        return self.compiler.compile(params)

    def add(self, seq_id: str, grammar: CompiledGrammar) -> None:
        self.matchers[seq_id] = grammar.matcher()

    def release(self, seq_id: str) -> None:
        """Forget a finished or aborted sequence's matcher (no-op for unconstrained ones)."""
        self.matchers.pop(seq_id, None)

    def bitmask(self, seq_ids: list[str]) -> tuple[list[int], torch.Tensor] | None:
        """Allowed tokens of the constrained rows among `seq_ids` (the sampler's rows).

        Returns None when no row is constrained, else (rows, bitmask): rows [G] are the row
        indices of the constrained sequences, bitmask [G, ceil(V / 32)] int32 on the CPU, bit
        j of word w set when token 32 * w + j is allowed (llguidance's layout). EOS ids are
        allowed exactly where the grammar may end."""
        rows = [i for i, s in enumerate(seq_ids) if s in self.matchers]
        if not rows:
            return None
        return self._fill(rows, [self.matchers[seq_ids[r]] for r in rows])

    def bitmask_async(self, seq_ids: list[str]) -> Future | None:
        """`bitmask(seq_ids)` computed in a worker thread, so that it overlaps the step's
        forward pass (llguidance fills masks without the GIL): a Future of bitmask's result,
        or None when no row is constrained. The matchers must not advance (`accept`) before
        the result is taken."""
        rows = [i for i, s in enumerate(seq_ids) if s in self.matchers]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ferrum-grammar")
        self._pending = self._pool.submit(self._fill, rows, [self.matchers[seq_ids[r]] for r in rows])
        return self._pending

    def _settle(self) -> None:
        """Wait for a mask fill still running (a step whose forward raised leaves one behind):
        a matcher must not advance while it is read."""
        if self._pending is not None:
            wait([self._pending])
            self._pending = None

    def _fill(self, rows: list[int], matchers: list) -> tuple[list[int], torch.Tensor]:
        mask = torch.empty(len(rows), bitmask_width(self.vocab_size), dtype=torch.int32)
        if self._executor is None:   # the first constrained step imports llguidance, once
            import llguidance
            import llguidance.torch as llt
            self._executor = llguidance.LLExecutor()
            self._fill_par = llt.fill_next_token_bitmask_par
        self._fill_par(self._executor, [(m, k) for k, m in enumerate(matchers)], mask)
        return rows, mask

    def accept(self, seq_id: str, token_id: int) -> None:
        """Advance `seq_id`'s matcher by a sampled token (no-op for an unconstrained sequence).
        Raises GrammarFailedError when the matcher rejects it: the mask allowed only grammar
        tokens, so the grammar engine failed (a lexer that ran out of its per-step budget on a
        grammar whose first steps passed `compile`), or something upstream is broken; the
        engine then fails the request, whose output would not match its constraint."""
        m = self.matchers.get(seq_id)
        if m is None:
            return
        self._settle()
        if not m.consume_token(token_id):
            raise GrammarFailedError(f"structured output: the grammar rejected token {token_id}: "
                                     f"{(m.get_error() or 'no reason given').splitlines()[0]}")

    def is_terminated(self, seq_id: str) -> bool:
        """The grammar is complete and admits no further token but EOS."""
        m = self.matchers.get(seq_id)
        return m is not None and m.is_stopped()

    @property
    def num_active(self) -> int:
        """Matchers held: one per running constrained sequence (0 when idle: no leak)."""
        return len(self.matchers)
