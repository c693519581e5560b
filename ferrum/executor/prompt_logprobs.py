"""Prompt logprobs inside a prefill step: the logprob of each prompt token given the tokens
before it (vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs`), computed on the device so
that only [rows, K] numbers, never [rows, vocab] logits, leave it."""
from __future__ import annotations

from typing import Callable

import torch

from ferrum.interfaces import PromptLogprobs

# Rows whose logits exist at once: bounds the [rows, vocab] float32 logits and their
# log-softmax (256 rows x 152k vocab x 4 B = 156 MB each) whatever the chunk length.
ROWS_PER_SLICE = 256


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
                            hidden: torch.Tensor, chunk_starts: list[int],
                            targets: list[list[int]], num_top: int) -> PromptLogprobs | None:
    """Logprobs of `targets` (see `PrefillInput.prompt_logprob_targets`) from a prefill's
    hidden states.

    compute_logits: the model's LM head, hidden [N, H] -> logits [N, V] on TP rank 0 (None on
        the other ranks, which must still call it for the same rows: it gathers the logits).
    hidden: [T, H], the step's final hidden states (all chunks, concatenated).
    chunk_starts: row of `hidden` where chunk i starts (num_seqs entries).
    targets[i]: ids following rows 0 .. len - 1 of chunk i. num_top: K >= 0.
    Returns PromptLogprobs on rank 0 (R = sum of len(targets[i]) rows), None elsewhere.
    """
    rows = [start + j for start, t in zip(chunk_starts, targets) for j in range(len(t))]
    ids = [tok for t in targets for tok in t]
    dev = hidden.device
    token_lps, top_ids, top_lps, ranks = [], [], [], []
    for s in range(0, len(rows), ROWS_PER_SLICE):
        idx = torch.tensor(rows[s:s + ROWS_PER_SLICE]).to(dev, non_blocking=True)
        logits = compute_logits(hidden[idx])
        if logits is None:
            continue
        logprobs = logits.float().log_softmax(-1)
        tgt = torch.tensor(ids[s:s + ROWS_PER_SLICE]).to(dev, non_blocking=True)
        token_lp = logprobs.gather(1, tgt.unsqueeze(1))
        token_lps.append(token_lp.squeeze(1))
        ranks.append((logprobs >= token_lp).sum(-1))
        values, indices = logprobs.topk(num_top, dim=-1)
        top_lps.append(values)
        top_ids.append(indices)
    if not token_lps:
        return None
    return PromptLogprobs(torch.cat(token_lps), torch.cat(top_ids), torch.cat(top_lps), torch.cat(ranks))
