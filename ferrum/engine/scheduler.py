"""Iteration-level scheduler (Orca, Yu et al. 2022; vLLM): each step takes running decodes
first (so inter-token latency stays flat), then continues chunked prefills, then admits
waiting sequences, within a token budget (`max_num_batched_tokens`) and a cap on running
sequences (`max_num_seqs`); `long_prefill_token_threshold` caps one prompt's chunk per step.
When blocks run out it preempts by recompute: the
latest-arrived running sequence gives up its blocks and goes back to the front of the queue.

Admission keeps room for what is admitted to finish: a waiting sequence is admitted beside
running ones only if the free blocks hold its whole prompt and, with every sequence generating
`new_token_ratio` x the output tokens it may still generate (after SGLang's "new token ratio"),
the running sequences and it fit the pool at the step their footprints peak (a sequence frees
its blocks when it finishes, so staggered ones need less than the sum of their final sizes).
The ratio is 1 after a step preempts, then decays over 600 steps to its floor, `output_share`:
the mean share of its output estimate (max_tokens, at most MAX_OUTPUT_ESTIMATE) that a finished
sequence generated, over the recent finishes. The floor holds once a preemption has shown the
pool short (before, the ratio stays 0: a pool that never fills admits as before, vLLM's
admit-what-fits). A pool that has filled up stops admitting instead of preempting and
recomputing again and again; when requests run to their max_tokens (share 1) it keeps room for
all of it, so later cohorts do not over-fill it again; when they stop early (EOS) the floor is
low. Holding the floor from the first finish instead avoided the first cohort's preemptions too
(1.014x on an H100's 1000 x 1000 bf16 run) but halved the rows of short-prompt, long-output
workloads where recomputing is cheap (benchmarks/sched_sim.py: 40 x (32 in, 700 out) 1.6x the
steps); figures: benchmarks/results/README.md.

With `longest_decode_first` the decode rows go out longest context first (Graham's
longest-processing-time-first list scheduling): the decode attention's programs start in row
order, so with mixed lengths the long ones no longer start last and leave SMs idle at the end.
"""
from __future__ import annotations

import bisect
from collections import deque
from operator import attrgetter
from dataclasses import dataclass, field

from ferrum.config import SchedulerConfig
from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sequence import Sequence, SequenceStatus


# Sequence.arrival without the property call (the decode loop sorts every running sequence)
_arrival = attrgetter("request.metrics.arrival_time")


def _minus_context_len(chunk) -> int:
    """Sort key of a decode row, longest context first (`longest_decode_first`)."""
    return -len(chunk.seq.token_ids)

# Admission reserve: the expected share of max_tokens still to come. SGLang
# (python/sglang/srt/managers/scheduler.py) starts it at 0.7 and decays it to 0.1; we keep
# vLLM's admit-what-fits (0) until a preemption shows the pool is short, and decay it to what
# finished requests used rather than to a constant. At most 4096 output
# tokens count per sequence (SGLang's clip too: a request without max_tokens may run to the
# context length but rarely does).
NEW_TOKEN_RATIO_DECAY = 1 / 600     # per step, from 1 after a preemption
MAX_OUTPUT_ESTIMATE = 4096
OUTPUT_SHARE_WINDOW = 64            # finishes the output share averages over (exponentially)


@dataclass
class ScheduledChunk:
    """`num_tokens` of `seq` computed in this step, starting at seq.num_computed_tokens."""

    seq: Sequence
    num_tokens: int          # tokens computed for this sequence in this step

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last token: its logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step: decodes (one token each), prefill chunks, and the sequences preempted to
    make room (their blocks are freed; they wait again at the front of the queue)."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in the step (decodes + prefill chunk lengths)."""
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.decodes and not self.prefills


class Footprints:
    """Admission's view of the running sequences: (decode steps left e, tokens now n) each,
    longest first, growing a token a step until e and then freeing their blocks."""

    def __init__(self, block_size: int, entries: list[tuple[int, int]]):
        self.block_size = block_size
        self.entries = entries                      # sorted by (e, n), descending
        # sum of the final sizes in blocks: an upper bound of the peak, kept in O(1) per admission
        self.final_blocks = sum(1 + (n + e) / block_size for e, n in entries)

    def peak_blocks(self) -> float:
        """The most blocks they hold together at any future step: when the k-th longest (steps
        e) finishes, the k longest hold sum(n) + k e tokens, at most k + that / block_size
        blocks. (Shared prefix blocks count once per sequence: an over-estimate.)"""
        bs = self.block_size
        peak = 0.0
        tokens = 0
        for k, (e, n) in enumerate(self.entries, 1):
            tokens += n
            peak = max(peak, k + (tokens + k * e) / bs)
        return peak

    def try_add(self, e: int, n: int, num_blocks: int | None) -> bool:
        """Add a sequence (e, n) if all of them then fit `num_blocks` at their peak (None: add
        it unchecked); the sum of final sizes decides without the O(len) peak while it fits
        (many admissions in a step)."""
        final = self.final_blocks + 1 + (n + e) / self.block_size
        key = (-e, -n)
        i = bisect.bisect_left(self.entries, key, key=lambda d: (-d[0], -d[1]))
        self.entries.insert(i, (e, n))
        if num_blocks is not None and final > num_blocks and self.peak_blocks() > num_blocks:
            del self.entries[i]
            return False
        self.final_blocks = final
        return True


class Scheduler:
    """Owns the waiting queue and the running list; `schedule` picks each step's work and
    allocates its KV blocks through the block manager `bm`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.new_token_ratio = 0.0      # admission reserve; see the module docstring
        self.output_share = 0.0         # its floor: recent finishes' generated / output estimate
        self.num_finished = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq` as waiting, at the back (new requests) or the front (preempted)."""
        seq.status = SequenceStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def num_waiting_requests(self) -> int:
        """Requests waiting to start or to resume: sample 0 of each (new, or preempted). The
        samples of an n above max_num_seqs that wait for a slot belong to a running request."""
        return sum(s.index == 0 for s in self.waiting)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample whose blocks are already allocated (n > 1)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence, completed: bool = False) -> None:
        """Drop a finished or aborted sequence and free its blocks; `completed` (it stopped on
        its own: EOS, a stop string, max_tokens) updates `output_share`."""
        if completed:
            self._record_share(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # also when it is in neither queue: a Ctrl-C inside `schedule` can leave an admitted or
        # preempted sequence there with its blocks (unknown ids are ignored: waiting ones hold none)
        self.bm.free(seq.seq_id)

    def _record_share(self, seq: Sequence) -> None:
        """Fold generated / estimate of a sequence that stopped on its own into `output_share`
        (the mean of the first finishes, then an exponential average over OUTPUT_SHARE_WINDOW)."""
        estimate = self._output_left(seq, generated=0)
        if estimate <= 0:
            return
        share = min(1.0, (seq.num_tokens - seq.num_prompt_tokens) / estimate)
        self.num_finished += 1
        self.output_share += (share - self.output_share) / min(self.num_finished, OUTPUT_SHARE_WINDOW)
        self.new_token_ratio = max(self.new_token_ratio, self._ratio_floor())   # from the next step

    def _ratio_floor(self) -> float:
        """What new_token_ratio decays to: `output_share` once a step has preempted, else 0."""
        return self.output_share if self.num_preemptions else 0.0

    def _output_left(self, seq: Sequence, generated: int | None = None) -> int:
        """Tokens `seq` may still generate after `generated` output tokens (default: those it
        has): its max_tokens (or the context) left, at most MAX_OUTPUT_ESTIMATE."""
        if generated is None:
            generated = seq.num_tokens - seq.num_prompt_tokens
        left = min(self.max_model_len - seq.num_prompt_tokens - generated, MAX_OUTPUT_ESTIMATE)
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - generated)
        return max(left, 0)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.add(seq, front=True)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _reserve(self, seq: Sequence, total: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Make room for `seq` to cover `total` slots, preempting the latest-arrived running
        sequences not yet scheduled this step (possibly `seq` itself). False if `seq` cannot
        run this step."""
        while not self.bm.can_append(seq.seq_id, total):
            victims = [s for s in self.running if s.seq_id not in scheduled]
            if not victims:
                return False
            victim = max(victims, key=lambda s: (s.arrival, s.index))
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        """This step's work within `max_num_batched_tokens` and `max_num_seqs`: running
        decodes (oldest first), then running chunked prefills, then waiting sequences (FCFS,
        stopping at the first that does not fit), allocating or appending their KV blocks;
        out of blocks, it preempts the latest-arrived running sequences (recompute)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. Decodes: running sequences with exactly one uncomputed token, oldest first.
        #    (This loop runs for every running sequence every step: keep it lean.)
        running = sorted(self.running, key=_arrival)
        RUNNING = SequenceStatus.RUNNING
        for seq in running:
            n = len(seq.token_ids)
            if n - seq.num_computed_tokens != 1 or seq.status is not RUNNING:
                continue
            if budget < 1:
                break
            if not self.bm.try_append_slots(seq.seq_id, n):
                # out of blocks: preempt later arrivals (or this one), then try again
                if not self._reserve(seq, n, scheduled, out):
                    continue
                self.bm.append_slots(seq.seq_id, n)
            out.decodes.append(ScheduledChunk(seq, 1))
            scheduled.add(seq.seq_id)
            budget -= 1
        if self.config.longest_decode_first:
            # Row order is free (each row is computed alone) and the decode attention starts its
            # programs in row order: longest first balances the SMs. Stable: ties keep arrival
            # order, and rows that all grow by one keep their order from step to step.
            out.decodes.sort(key=_minus_context_len)

        # 2. Running sequences in the middle of a (chunked) prefill.
        for seq in running:
            if budget <= 0:
                break
            if seq.seq_id in scheduled or seq.num_uncomputed <= 1 or seq.status != SequenceStatus.RUNNING:
                continue  # one-token steps are decodes (step 1)
            n = self._chunk(seq.num_uncomputed, budget, first=not out.prefills)
            if n == 0:
                continue
            total = seq.num_computed_tokens + n
            if not self._reserve(seq, total, scheduled, out):
                continue
            self.bm.append_slots(seq.seq_id, total)
            out.prefills.append(ScheduledChunk(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n

        # 3. Admit waiting sequences (FCFS; stop at the first that does not fit). A request
        #    with n > 1 samples forks them after its prefill: keep their slots free too (at
        #    most max_num_seqs in all; `LLMEngine._fork` queues the samples beyond that).
        cap = self.config.max_num_seqs
        reserved = 0
        # the running sequences' future footprint (None: admit what fits now; see `_demands`)
        demands = None
        if self.waiting:
            reserved = sum(min(s.request.params.n, cap) - 1 for s in self.running
                           if s.index == 0 and not s.request.forked)
            demands = self._demands()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            slots = min(seq.request.params.n, cap) if seq.index == 0 and not seq.request.forked else 1
            if len(self.running) + reserved + slots > cap:
                break
            # A prefix-cache hit means fewer tokens to compute; the budget counts computed ones.
            reuse = not seq.needs_prompt_logprobs
            cached = self.bm.lookup_prefix(seq.token_ids, reuse, seq.request.cache_root)
            n = self._chunk(seq.num_tokens - cached, budget, first=not out.prefills)
            if not n or not self._room_for(seq, cached, n, demands):
                break
            self.waiting.popleft()
            cached = self.bm.allocate(seq.seq_id, seq.token_ids, cached + n, reuse, seq.request.cache_root)
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens is None:   # not a re-admission after preemption
                seq.num_cached_tokens = cached
            total = cached + n
            self.bm.append_slots(seq.seq_id, total)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            reserved += slots - 1
            out.prefills.append(ScheduledChunk(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        self.new_token_ratio = (1.0 if out.preempted
                                else max(self._ratio_floor(), self.new_token_ratio - NEW_TOKEN_RATIO_DECAY))
        return out

    def _demands(self) -> Footprints | None:
        """The running sequences' `Footprints`, each generating new_token_ratio x what it may
        still generate (`_output_left`); None while the ratio is 0 (admission then asks only
        for the prompt's blocks)."""
        ratio = self.new_token_ratio
        if not ratio:
            return None
        return Footprints(self.bm.block_size,
                          sorted(((int(ratio * self._output_left(s)), s.num_tokens) for s in self.running),
                                 reverse=True))

    def _room_for(self, seq: Sequence, cached: int, n: int, demands: Footprints | None) -> bool:
        """Whether waiting `seq` can be admitted with `n` tokens computed now after a
        `cached`-token prefix hit: the free blocks hold its whole prompt (its first chunk only
        when nothing runs), and, while new_token_ratio is above 0 (`demands` not None), the
        running sequences and it fit the pool at their peak (`Footprints.peak_blocks`), each
        generating that share of what it may. Admitted, it joins `demands`."""
        rest = seq.num_tokens - cached - n if self.running else 0
        if not self.bm.can_allocate(seq.token_ids, n + rest, not seq.needs_prompt_logprobs,
                                    seq.request.cache_root):
            return False
        if demands is None:
            return True
        # alone it always runs (max_model_len fits the pool), but it counts for the next ones
        return demands.try_add(int(self.new_token_ratio * self._output_left(seq)), seq.num_tokens,
                               self.bm.num_blocks if self.running else None)

    def would_admit_next(self) -> bool:
        """Whether the next `schedule` could admit the first waiting sequence with the blocks
        free now (its first chunk and the admission reserve; the sequence cap is the caller's
        check). The async engine overlaps a step only when it could not."""
        if not self.waiting:
            return False
        seq = self.waiting[0]
        cached = self.bm.lookup_prefix(seq.token_ids, not seq.needs_prompt_logprobs, seq.request.cache_root)
        n = self._chunk(seq.num_tokens - cached, self.config.max_num_batched_tokens, first=True)
        return self._room_for(seq, cached, n, self._demands())

    def _chunk(self, remaining: int, budget: int, first: bool) -> int:
        """Tokens to compute now: with chunked prefill what the budget and
        `long_prefill_token_threshold` allow. Without it a prompt goes whole, and may exceed
        the budget only when it is the step's first prefill (else it waits for a step)."""
        if self.config.enable_chunked_prefill:
            return min(remaining, budget, self.config.long_prefill_token_threshold or budget)
        if remaining <= budget or first:
            return remaining
        return 0
