"""Batched sampler: logits [B, V] -> one token id per sequence.

Pipeline, per row (the order of vLLM's v1 sampler):

1. logit_bias: `logits[t] += bias[t]` (OpenAI `logit_bias`).
2. repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858 section 4.1): for every token
   seen in the prompt or the output so far, a positive logit is divided by the penalty and a
   negative one multiplied by it (the sign rule of HF transformers / vLLM); the result is kept
   within +-1e30, so that an extreme penalty (1e-50, 1e50) leaves every logit finite.
3. presence / frequency penalties (OpenAI API reference, "Parameter details" of the text
   generation guide): `logits[t] -= presence * (count[t] > 0) + frequency * count[t]`, where
   `count` counts the *output* tokens only.
4. bans (vLLM's allowed_token_ids, bad_words and min_tokens): every token outside
   `allowed_token_ids` gets -inf; so does the last token of each bad word whose other tokens
   end the output (a one-token word always); and while `len(output) < min_tokens`, every token
   that would stop the sequence (the EOS ids unless `ignore_eos`, and `stop_token_ids`). With
   `ignore_eos` the EOS does not stop, so it is not masked (as in vLLM). A row the bans and its
   grammar (5) leave without any token drops bad_words and min_tokens first, keeping
   `allowed_token_ids` (holding only the EOS under min_tokens, it samples the EOS), and
   `allowed_token_ids` too where the grammar allows none of them: a grammar wins (as its
   completion stops a sequence under min_tokens), and a row is never left with nothing to
   sample (NaN) nor given a token its `allowed_token_ids` exclude while it has another way.
5. structured outputs: rows under a grammar get -inf on every token their bitmask does not
   allow (the bitmask comes from `ferrum.structured_output`; one gather + index_add covers all
   of them, see `bitmask_bias`).
   -> these are the *processed logits*; requested logprobs are the log-softmax of them.
6. greedy rows (temperature < 1e-5, see `SamplingParams.greedy`) take the argmax.
   Other rows: divide by temperature; min-p (drop tokens with prob < min_p * max prob); top-k
   (keep the tokens at or above the k-th largest logit: ties at the k-th place all stay); top-p
   (renormalise, keep the smallest prefix of the sorted distribution whose mass is >= top_p;
   the top token is always kept); sample.

Sampling uses the exponential race (argmax of p_i / E_i with E_i ~ Exp(1) is distributed as p),
with the noise of each seeded row drawn from that request's own `torch.Generator`. A row's noise
therefore depends only on its generator and V, so a seeded request produces the same tokens
whatever else is in the batch. Unseeded rows share the global torch RNG. On CUDA, a batch whose
sampled rows use temperature only and no seed takes one Triton pass over the logits instead
(`ferrum.ops.sampling.gumbel_argmax`: the same race in logs, the Gumbel-max trick).

Everything here is tensor ops over [B, V]; the only Python loops are over the batch (building
the metadata, drawing noise for seeded rows, formatting logprobs) and over each request's own
token ids (penalty counts), never over the vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.errors import InvalidRequestError
from ferrum.ops.sampling import gumbel_argmax
from ferrum.ops.triton_utils import use_triton
from ferrum.outputs import Logprob, logprob_entry
from ferrum.sampling_params import SamplingParams


# Rows the general path (processing, top-k/p, min-p, the race, logprobs) takes at once: a batch
# of more rows goes through in slices of this many, so its [rows, vocab] float32 temporaries are
# this many rows wide whatever the batch, and the KV pool's reserve for them with it
# (`ferrum.executor.memory`: 512 sequences of Llama-3's 128k vocabulary reserved 4.2 GB for a
# batch-wide pipeline).
SAMPLE_CHUNK_ROWS = 64

_NEG_INF = float("-inf")

# The bound of a repetition-penalised logit. A penalty near 0 (1e-40; 1e-50 is 0 in float32)
# overflows a seen logit to inf, and an inf logit makes the softmax NaN; 1e30 stays finite
# divided by the smallest sampled temperature (1e-5), below float32's 3.4e38.
_MAX_PENALISED_LOGIT = 1e30
_FLOAT32_MAX = torch.finfo(torch.float32).max


_SHOWN_IDS = 10   # out-of-vocabulary ids a validation error lists


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Check the token ids a request names (logit_bias keys, stop_token_ids, allowed_token_ids,
    the tokens of its bad_words) against the vocab.

    Call it when a request is added: an out-of-range id would otherwise fail inside a batched
    decode step and take every other request in the batch down with it.
    Raises InvalidRequestError naming the parameter and the allowed range [0, vocab_size).
    """
    for name, ids in (("logit_bias", list(params.logit_bias or {})),
                      ("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or []),
                      ("bad_words", [t for ids in params.bad_words_token_ids or [] for t in ids])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:  # how many, and the range: a client fixes its request in one round trip
            # (not every one: 1,000,000 allowed_token_ids past the vocabulary made an 8 MB 400)
            more = f" and {len(bad) - _SHOWN_IDS} more" if len(bad) > _SHOWN_IDS else ""
            raise InvalidRequestError(
                f"{name} has token ids {bad[:_SHOWN_IDS]}{more} outside the vocabulary "
                f"[0, {vocab_size})", param=name)


def _counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """Per-row token counts: [B, V] float32, from B lists of ids (padded with the id V, which
    lands in an extra column that is dropped)."""
    width = max(1, max(len(t) for t in token_lists))
    padded = [t + [vocab_size] * (width - len(t)) for t in token_lists]
    idx = _to_device(padded, torch.long, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab_size]


def _to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.tensor(values) on `device` without waiting for the device: a plain
    torch.tensor(..., device="cuda") synchronizes the stream, which would stall the host
    until the step's forward pass ends (async scheduling overlaps them)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _column(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """[B, 1] tensor, shaped to broadcast against [B, V] logits."""
    return _to_device(values, dtype, device).unsqueeze(1)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for a batch of B sequences, as tensors on the logits' device.

    A tensor is None when no request in the batch needs it, so an all-greedy batch without
    penalties does nothing but argmax. Shapes: [B, 1] for per-row scalars (they broadcast over
    V), [B, V] for per-token data.

    greedy:             [B] bool, rows that take the argmax (`any_greedy`: whether any does).
    temperature:        [B, 1] float32 (1.0 on greedy rows); None when all rows are greedy.
    top_k:              [B, 1] int64, V where disabled; None when no row uses it.
    top_p, min_p:       [B, 1] float32 (1.0 / 0.0 where disabled); None when unused.
    repetition_penalty: [B, 1] float32 and `seen` [B, V] bool (token in prompt or output).
    presence_penalty, frequency_penalty: [B, 1] float32 and `output_counts` [B, V] float32.
    logit_bias:         [B, V] float32 (zeros where unset).
    allowed:            [B, V] bool, False on the tokens outside a row's allowed_token_ids (rows
                        without them all True); None when no row has them.
    banned_rows, banned_cols: [M] int64, the (row, token) pairs set to -inf (bad words,
                        min_tokens).
    grammar_rows:       [G] int64, the rows under a grammar (structured outputs), and
    grammar_bitmask:    [G, ceil(V / 32)] int32, bit j of word w set when token 32 * w + j is
                        allowed in that row (set with `set_grammar_bitmask`).
    generators:         B entries, a torch.Generator on the logits' device or None (global RNG).
    num_logprobs:       B entries, top-N wanted per row (None = no logprobs for that row).
    """

    vocab_size: int
    greedy: torch.Tensor
    all_greedy: bool
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_cols: torch.Tensor | None = None
    any_greedy: bool = True   # build() sets it; True is the safe default (rows checked)
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # host copies for `rows`: greedy per row, the banned (row, token) pairs, the grammar's
    # rows and CPU bitmask (slicing the device tensors by row would wait for the device)
    greedy_host: list[bool] | None = None
    banned_host: tuple[list[int], list[int]] | None = None
    grammar_host: tuple[list[int], torch.Tensor] | None = None

    @property
    def unprocessed(self) -> bool:
        """True when `process_logits` has nothing to apply (no bias, penalty or mask)."""
        return (self.logit_bias is None and self.repetition_penalty is None and self.output_counts is None
                and self.allowed is None and self.banned_rows is None and self.grammar_rows is None)

    @property
    def max_num_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_ids: list[list[int]],
              output_ids: list[list[int]], generators: list[torch.Generator | None],
              eos_token_ids: list[int], vocab_size: int, device) -> "SamplingMetadata":
        """Build the metadata for one step.

        params, prompt_ids, output_ids, generators: one entry per row, in the logits' row order.
        output_ids[i] are the tokens sequence i generated so far (before this step); read by
            the penalties, min_tokens and bad_words (their token ids: bad_words_token_ids).
        generators[i]: None for an unseeded request; for a request with `seed`, the caller
            creates `torch.Generator(device=device).manual_seed(seed)` once when the sequence
            starts and passes the same object every step (its state advances as it samples).
            With n > 1 each sample needs its own generator (e.g. seeded with seed + index).
        eos_token_ids: the model's EOS ids (generation_config / tokenizer), shared by all rows.
        vocab_size: V, the width of the logits this metadata will be applied to.
        Token ids must lie in [0, V) (see `validate_token_ids`); IndexError otherwise.
        """
        batch = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(generators) == batch):
            raise ValueError("params, prompt_ids, output_ids and generators must have one entry "
                             f"per row; got {batch}, {len(prompt_ids)}, {len(output_ids)}, "
                             f"{len(generators)}")
        greedy = [p.greedy for p in params]
        metadata = cls(vocab_size=vocab_size,
                       greedy=_to_device(greedy, torch.bool, device),
                       all_greedy=all(greedy), any_greedy=any(greedy), generators=list(generators),
                       num_logprobs=[p.logprobs for p in params], greedy_host=greedy)

        if not metadata.all_greedy:
            # Sampling options of greedy rows are ignored: they take the argmax anyway.
            # at most float32's max: 1e39 would be inf there, and a masked logit -inf / inf NaN
            metadata.temperature = _column([1.0 if g else min(p.temperature, _FLOAT32_MAX)
                                            for p, g in zip(params, greedy)], torch.float32, device)
            # a top_k of V or more keeps every token (as vLLM): V, which also keeps 2**63 out
            # of the int64 column
            top_k = [min(p.top_k, vocab_size) if (p.top_k > 0 and not g) else vocab_size
                     for p, g in zip(params, greedy)]
            if any(k < vocab_size for k in top_k):
                metadata.top_k = _column(top_k, torch.long, device)
            top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
            if any(v < 1.0 for v in top_p):
                metadata.top_p = _column(top_p, torch.float32, device)
            min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
            if any(v > 0.0 for v in min_p):
                metadata.min_p = _column(min_p, torch.float32, device)

        if any(p.repetition_penalty != 1.0 for p in params):
            # at most float32's max: a penalty of 1e50 would be inf, and a seen logit 0 * inf NaN
            metadata.repetition_penalty = _column([min(p.repetition_penalty, _FLOAT32_MAX) for p in params],
                                                  torch.float32, device)
            metadata.seen = _counts([pr + out if p.repetition_penalty != 1.0 else []
                                     for p, pr, out in zip(params, prompt_ids, output_ids)],
                                    vocab_size, device) > 0
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            metadata.presence_penalty = _column([p.presence_penalty for p in params],
                                                torch.float32, device)
            metadata.frequency_penalty = _column([p.frequency_penalty for p in params],
                                                 torch.float32, device)
            metadata.output_counts = _counts([out if (p.presence_penalty or p.frequency_penalty)
                                              else [] for p, out in zip(params, output_ids)],
                                             vocab_size, device)

        if any(p.logit_bias for p in params):
            rows, cols, vals = [], [], []
            for i, p in enumerate(params):
                for tok, bias in (p.logit_bias or {}).items():
                    rows.append(i), cols.append(tok), vals.append(bias)
            metadata.logit_bias = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
            metadata.logit_bias.index_put_((_to_device(rows, torch.long, device),
                                            _to_device(cols, torch.long, device)),
                                           _to_device(vals, torch.float32, device))

        if any(p.allowed_token_ids for p in params):
            rows, cols = [], []
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    rows += [i] * len(p.allowed_token_ids)
                    cols += p.allowed_token_ids
            restricted = _to_device(sorted(set(rows)), torch.long, device)
            metadata.allowed = torch.ones(batch, vocab_size, dtype=torch.bool, device=device)
            metadata.allowed[restricted] = False
            metadata.allowed[_to_device(rows, torch.long, device), _to_device(cols, torch.long, device)] = True

        rows, cols = [], []
        for i, (p, out) in enumerate(zip(params, output_ids)):
            banned = set()
            for word in p.bad_words_token_ids or ():
                # the output ends with the word's other tokens: its last one would complete it
                if len(word) == 1 or (len(out) >= len(word) - 1 and list(out[len(out) - len(word) + 1:]) == word[:-1]):
                    banned.add(word[-1])
            if len(out) < p.min_tokens:
                banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            rows += [i] * len(banned)
            cols += sorted(banned)
        if rows:
            metadata.banned_rows = _to_device(rows, torch.long, device)
            metadata.banned_cols = _to_device(cols, torch.long, device)
            metadata.banned_host = (rows, cols)
        return metadata

    def rows(self, start: int, end: int) -> "SamplingMetadata":
        """The metadata of rows [start, end) alone (row i of it is row start + i here), for
        sampling a slice of the batch's logits. Views of the [B, ...] tensors; the sparse
        (row, token) pairs re-indexed from the host copies, without waiting for the device.
        Needs a metadata from `build`."""
        sl = slice(start, end)
        cut = lambda t: None if t is None else t[sl]   # noqa: E731
        greedy = self.greedy_host[sl]
        md = SamplingMetadata(
            vocab_size=self.vocab_size, greedy=self.greedy[sl], all_greedy=all(greedy), any_greedy=any(greedy),
            generators=self.generators[sl], num_logprobs=self.num_logprobs[sl],
            temperature=cut(self.temperature), top_k=cut(self.top_k), top_p=cut(self.top_p), min_p=cut(self.min_p),
            repetition_penalty=cut(self.repetition_penalty), seen=cut(self.seen),
            presence_penalty=cut(self.presence_penalty), frequency_penalty=cut(self.frequency_penalty),
            output_counts=cut(self.output_counts), logit_bias=cut(self.logit_bias), allowed=cut(self.allowed),
            greedy_host=greedy)
        device = self.greedy.device
        if self.banned_host is not None:
            pairs = [(r - start, c) for r, c in zip(*self.banned_host) if start <= r < end]
            if pairs:
                md.banned_host = ([r for r, _ in pairs], [c for _, c in pairs])
                md.banned_rows = _to_device(md.banned_host[0], torch.long, device)
                md.banned_cols = _to_device(md.banned_host[1], torch.long, device)
        if self.grammar_host is not None:
            rows, bitmask = self.grammar_host
            keep = [i for i, r in enumerate(rows) if start <= r < end]
            if keep:
                md.set_grammar_bitmask([rows[i] - start for i in keep], bitmask[keep])
        return md

    def set_grammar_bitmask(self, rows: list[int], bitmask: torch.Tensor) -> None:
        """Constrain `rows` (G row indices) to the tokens their bitmask allows: bitmask is
        [G, ceil(V / 32)] int32 on the CPU (llguidance's layout), moved to the logits' device
        here without waiting for it."""
        device = self.greedy.device
        self.grammar_rows = _to_device(rows, torch.long, device)
        self.grammar_bitmask = bitmask.to(device, non_blocking=True)
        self.grammar_host = (list(rows), bitmask)


@dataclass
class SamplerOutput:
    """token_ids: [B] int64, on the logits' device.
    logprobs: None when no row asked for logprobs; else one entry per row: None for rows that
    did not ask, else {token id: Logprob} with the top-N tokens in descending order followed by
    the chosen token if it is not among them (N = that row's `SamplingParams.logprobs`); their
    `rank` is their place in the top N, the chosen token's its rank in the vocabulary."""

    token_ids: torch.Tensor
    logprobs: list[dict[int, Logprob] | None] | None = None


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 token bitmask -> [G, V] float32 additive mask: 0.0 where the token is
    allowed, -inf elsewhere (bit j of word w is token 32 * w + j; padding bits past V dropped).

    Each byte of the mask indexes a 256 x 8 table of biases (one gather, no per-token branch:
    masked_fill with an irregular mask costs several times more on CPU). Assumes a
    little-endian layout, where byte k of word w holds tokens 32 * w + 8 * k .. + 7."""
    bits = (torch.arange(256, device=bitmask.device)[:, None]
            >> torch.arange(8, device=bitmask.device)) & 1                # [256, 8]
    table = torch.zeros(256, 8, device=bitmask.device).masked_fill_(bits == 0, float("-inf"))
    by_byte = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table)  # [G, 4W, 8]
    return by_byte.flatten(1)[:, :vocab_size]


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 1-5 of the module docstring: logit_bias, repetition, presence/frequency penalties,
    bans (allowed_token_ids, bad_words, min_tokens), grammar mask. logits: [B, V], not
    modified; returns [B, V] float32: a new tensor, or `logits` itself when it is float32 and
    nothing applies (a batch-256 copy of a 128k vocab is 131 MB of traffic per step for
    nothing)."""
    if metadata.unprocessed:
        return logits.float()
    logits = logits.to(torch.float32, copy=True)
    if metadata.logit_bias is not None:
        logits += metadata.logit_bias
    if metadata.repetition_penalty is not None:
        penalised = torch.where(logits > 0, logits / metadata.repetition_penalty,
                                logits * metadata.repetition_penalty)
        penalised.clamp_(-_MAX_PENALISED_LOGIT, _MAX_PENALISED_LOGIT)
        logits = torch.where(metadata.seen, penalised, logits)
    if metadata.output_counts is not None:
        logits -= (metadata.frequency_penalty * metadata.output_counts
                   + metadata.presence_penalty * (metadata.output_counts > 0))
    # the bans yield to a grammar that allows only tokens they mask (EOS where the grammar
    # ends, a stop token the grammar forces), as min_tokens yields to a grammar's completion
    # (the engine stops such a sequence), and to each other where together they mask every
    # token (a row left with nothing to sample drew NaN): first bad_words and min_tokens
    # (allowed_token_ids=[EOS] under min_tokens samples the EOS), then allowed_token_ids (against a
    # grammar). Falling back past allowed_token_ids at once sampled the row from the whole
    # vocabulary: tokens the request had excluded
    fallbacks = []   # the logits to fall back on, the first that leaves a token wins
    if metadata.allowed is not None or metadata.banned_rows is not None:
        fallbacks.append(logits.clone())
        if metadata.allowed is not None:
            logits.masked_fill_(~metadata.allowed, float("-inf"))
            if metadata.banned_rows is not None:
                fallbacks.insert(0, logits.clone())   # allowed_token_ids alone
        if metadata.banned_rows is not None:
            logits[metadata.banned_rows, metadata.banned_cols] = float("-inf")
    if metadata.grammar_rows is not None:
        grammar = bitmask_bias(metadata.grammar_bitmask, metadata.vocab_size)
        for t in (logits, *fallbacks):
            t.index_add_(0, metadata.grammar_rows, grammar)
    for fallback in fallbacks:
        logits = torch.where(torch.isneginf(logits).all(-1, keepdim=True), fallback, logits)
    return logits


def sampling_probs(processed: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Step 6: the distribution each row is sampled from. processed: [B, V] float32 (output of
    `process_logits`); returns [B, V] float32 probabilities, zeros on filtered-out tokens; greedy
    rows are one-hot on their argmax."""
    if metadata.all_greedy:
        return torch.nn.functional.one_hot(processed.argmax(-1), metadata.vocab_size).float()
    logits = processed / metadata.temperature
    if metadata.min_p is not None:
        # before top-k/top-p, as vLLM (its min_p processor runs right after temperature), so
        # top_p renormalises over min_p's survivors. p < min_p * p_max in logs: a min_p of 0
        # is a bound of -inf, which drops nothing
        bound = logits.max(dim=-1, keepdim=True).values + metadata.min_p.log()
        logits = logits.masked_fill(logits < bound, float("-inf"))
    if metadata.top_k is not None or metadata.top_p is not None:
        # One sort (descending) serves both filters.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if metadata.top_k is not None:
            # below the k-th largest value, so a tie at the k-th place keeps all its tokens
            # (vLLM's apply_top_k_top_p and HF's TopKLogitsWarper)
            drop |= sorted_logits < sorted_logits.gather(1, metadata.top_k - 1)
        if metadata.top_p is not None:
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            # Mass strictly before each rank: a token is kept while the tokens above it hold
            # less than top_p, which keeps the smallest prefix reaching top_p (and rank 0).
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            drop |= mass_before >= metadata.top_p
            # the top token stays whatever top_p is (vLLM keeps it so too): a top_p below
            # float32's least (1e-50 is 0 there) dropped it, and a row of no token sampled NaN
            drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if not metadata.any_greedy:   # no row to overwrite: skip a [B, V] one-hot and a [B, V] select
        return probs
    one_hot = torch.nn.functional.one_hot(processed.argmax(-1), metadata.vocab_size).float()
    return torch.where(metadata.greedy.unsqueeze(1), one_hot, probs)


def _exponential_race(probs: torch.Tensor,
                      generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one id per row of probs [B, V]: argmax(p / E), E ~ Exp(1) (equivalent to the Gumbel
    max trick). Seeded rows draw their V noise values from their own generator."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    # Exp(1) can return 0 in float32; clamp so p / E never becomes 0/0 = nan.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(-1)


def _fused_ok(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
    """Whether the one-pass Triton sampler (`ferrum.ops.sampling`) draws this batch: Triton
    runs on logits' device, some row samples, no row filters (top-k/top-p/min-p: they need the
    sorted distribution) and no row has its own generator (`seed`: its noise must come from
    that generator)."""
    return (use_triton(logits) and not metadata.all_greedy and metadata.top_k is None
            and metadata.top_p is None and metadata.min_p is None
            and all(g is None for g in metadata.generators))


def _format_logprobs(processed: torch.Tensor, token_ids: torch.Tensor,
                     metadata: SamplingMetadata) -> list[dict[int, Logprob] | None]:
    logprobs = processed.log_softmax(-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    # the chosen token's vocabulary rank (vLLM's: how many logprobs are >= its own)
    ranks = (logprobs >= chosen).sum(-1).tolist()
    chosen = chosen.squeeze(1).tolist()
    ids = token_ids.tolist()
    top_n = metadata.max_num_logprobs or 0
    top_vals, top_ids = [[]] * len(ids), [[]] * len(ids)
    if top_n:
        values, indices = logprobs.topk(top_n, dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    result: list[dict[int, Logprob] | None] = []
    for i, n in enumerate(metadata.num_logprobs):
        if n is None:
            result.append(None)
            continue
        vals = top_vals[i][:n]
        # tokens a mask ruled out (-inf, sorted last) are not alternatives: a grammar may allow
        # fewer than n
        if vals and vals[-1] == _NEG_INF:
            vals = vals[:vals.index(_NEG_INF)]
        result.append(logprob_entry(top_ids[i], vals, ids[i], chosen[i], ranks[i]))
    return result


class Sampler:
    """`Sampler()(logits, metadata) -> SamplerOutput`.

    logits: [B, V] float32 (any float dtype is upcast), on CPU or CUDA; not modified.
    metadata: `SamplingMetadata.build(...)` for the same B rows and V.
    Logprobs (when any row asks): log-softmax of the processed logits, i.e. after logit_bias,
    penalties, the bans and the grammar mask but before temperature, top-k, top-p
    and min-p, so they describe the model's (penalised, constrained) distribution rather than
    the truncated one sampled from; masked-out tokens are left out of the top-N. (vLLM's default
    logprobs_mode, raw_logprobs, takes them before logit_bias, penalties and min_tokens: the two
    differ on requests that use those; the README says so.)
    Batches of more than SAMPLE_CHUNK_ROWS rows that take the general path (any option but
    temperature alone, or logprobs) go through it in slices of that many rows: the same tokens
    for greedy and seeded rows, one global-RNG draw per slice for the others.
    Raises ValueError when the shapes of logits and metadata disagree.
    """

    def warmup(self, vocab_size: int, device) -> None:
        """Compile the one-pass Triton sampler for float32 logits of width vocab_size on
        `device` (what the executors return), so its JIT does not land in the first sampled
        step; nothing to do where Triton does not run."""
        logits = torch.zeros(1, vocab_size, device=device)
        if use_triton(logits):
            metadata = SamplingMetadata.build([SamplingParams(temperature=1.0)], [[]], [[]], [None], [],
                                              vocab_size, device)
            self(logits, metadata)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (metadata.greedy.shape[0], metadata.vocab_size):
            raise ValueError(f"logits must be [{metadata.greedy.shape[0]}, {metadata.vocab_size}], "
                             f"got {list(logits.shape)}")
        fused = _fused_ok(logits, metadata)
        light = (fused or metadata.all_greedy) and metadata.unprocessed and metadata.max_num_logprobs is None
        B = logits.shape[0]
        if not light and B > SAMPLE_CHUNK_ROWS and metadata.greedy_host is not None:
            outs = [self(logits[a:a + SAMPLE_CHUNK_ROWS], metadata.rows(a, min(a + SAMPLE_CHUNK_ROWS, B)))
                    for a in range(0, B, SAMPLE_CHUNK_ROWS)]
            logprobs = None if metadata.max_num_logprobs is None else [e for o in outs for e in o.logprobs]
            return SamplerOutput(token_ids=torch.cat([o.token_ids for o in outs]), logprobs=logprobs)
        if light:
            processed = logits   # nothing to add or mask: skip the [B, V] float32 copy
        else:
            processed = process_logits(logits, metadata)
        if metadata.all_greedy:
            token_ids = processed.argmax(-1)   # exact in any float dtype
        elif fused:
            seed = int(torch.randint(2**31 - 1, ()))   # torch's CPU generator: manual_seed holds
            token_ids = gumbel_argmax(processed, metadata.temperature, metadata.greedy, seed)
        else:
            token_ids = _exponential_race(sampling_probs(processed, metadata), metadata.generators)
        logprobs = (_format_logprobs(processed, token_ids, metadata)
                    if metadata.max_num_logprobs is not None else None)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
