"""Scheduler admission: the peak-footprint check after a preemption and the output share it
learns from finished sequences (ferrum/engine/scheduler.py), driven without a model."""
from __future__ import annotations

import importlib.util
import pathlib
import random

from ferrum import SamplingParams
from ferrum.config import SchedulerConfig
from ferrum.engine.block_manager import BlockManager
from ferrum.engine.scheduler import Footprints, Scheduler
from ferrum.engine.sequence import Request, Sequence


def load_sim():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sched_sim.py"
    spec = importlib.util.spec_from_file_location("sched_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    return sim


def make_scheduler(num_blocks=100, block_size=16, max_len=4096):
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=max_len)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_len)


def make_seq(i: int, prompt_len: int, max_tokens: int | None) -> Sequence:
    req = Request(str(i), None, [1 + (i * 7 + j) % 500 for j in range(prompt_len)],
                  SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    seq = Sequence(str(i), req, 0)
    req.seqs.append(seq)
    return seq


def test_peak_blocks_counts_each_sequence_until_it_finishes():
    """Two sequences of 16 and 32 tokens with 16 and 64 steps left, blocks of 16: when the short
    one finishes both hold (16 + 16) + (32 + 16) = 80 tokens (<= 2 + 80 / 16 = 7 blocks); when the
    long one does it alone holds 96 (<= 7)."""
    f = Footprints(16, [(64, 32), (16, 16)])
    assert f.peak_blocks() == max(1 + (32 + 64) / 16, 2 + (48 + 2 * 16) / 16) == 7.0
    assert f.final_blocks == 2 + (96 + 32) / 16
    # a third sequence finishing now adds its tokens to every bound (it is held at step 0)
    assert f.try_add(0, 160, 100) and f.entries == [(64, 32), (16, 16), (0, 160)]
    assert f.peak_blocks() == 3 + (208 + 0) / 16


def test_try_add_matches_a_step_by_step_footprint():
    """`Footprints.try_add` admits exactly when the blocks held at the worst future step,
    counted step by step (each sequence ceil((n + t) / block_size) blocks while t <= e), fit
    within the bound's rounding (at most one block per sequence); the sum-of-final-sizes shortcut
    never changes the answer; refused, the entries are unchanged."""
    rng = random.Random(0)
    for _ in range(300):
        bs = rng.choice([1, 8, 16])
        entries = sorted(((rng.randrange(0, 60), rng.randrange(1, 90)) for _ in range(rng.randrange(0, 12))),
                         reverse=True)
        e, n = rng.randrange(0, 60), rng.randrange(1, 90)
        both = entries + [(e, n)]
        exact = max(sum(-(-(n_ + t) // bs) for e_, n_ in both if t <= e_) for t in range(61))
        bound = max([k + (sum(n_ for _, n_ in sorted(both, reverse=True)[:k]) + k * e_) / bs
                     for k, (e_, _) in enumerate(sorted(both, reverse=True), 1)])
        assert exact <= bound < exact + len(both) + 1e-9
        for num_blocks in (int(bound) - 1, int(bound) + 1, 10_000):
            f = Footprints(bs, list(entries))
            assert f.try_add(e, n, num_blocks) == (bound <= num_blocks)
            assert f.entries == (sorted(both, reverse=True) if bound <= num_blocks else entries)


def test_output_share_learns_from_finished_sequences_only():
    """generated / (max_tokens capped at MAX_OUTPUT_ESTIMATE and the context) of sequences that
    stopped on their own: the mean of the first, aborted ones not counted. It is the reserve's
    floor only once a preemption has shown the pool short: before, admission is vLLM's
    admit-what-fits (a pool that never fills admits as before)."""
    sched = make_scheduler()
    a, b, c = make_seq(0, 8, 100), make_seq(1, 8, 100), make_seq(2, 8, 100)
    a.token_ids += [5] * 100           # ran to max_tokens
    b.token_ids += [5] * 20            # EOS after 20 of 100
    c.token_ids += [5] * 3
    sched.remove(a, completed=True)
    sched.remove(b, completed=True)
    sched.remove(c)                    # aborted: no say
    assert sched.num_finished == 2 and abs(sched.output_share - 0.6) < 1e-12
    sched.schedule()
    assert sched.new_token_ratio == 0.0            # no preemption yet: no reserve
    sched.num_preemptions = 1
    sched.new_token_ratio = 1.0                    # as after a preemption
    for _ in range(1000):              # 600 steps would take it to 0: it stops at the share
        sched.schedule()
    assert abs(sched.new_token_ratio - 0.6) < 1e-12


def test_no_reserve_in_a_pool_that_never_preempted():
    """8 sequences that ran to max_tokens (share 1), then 40 x (8 in, max_tokens 100) that stop
    at EOS after one token, in 64 blocks of 8, beside one running sequence: with the floor on
    from the first finish only ~4 were admitted a step (12 steps for the 40, none preempted);
    admit-what-fits takes them in one step."""
    sched = make_scheduler(num_blocks=64, block_size=8, max_len=512)
    for i in range(8):
        s = make_seq(1000 + i, 8, 4)
        s.token_ids += [5] * 4
        sched.remove(s, completed=True)
    assert sched.output_share == 1.0
    bg = make_seq(999, 8, 400)
    sched.add(bg)
    sched.schedule()
    bg.num_computed_tokens = bg.num_tokens
    bg.token_ids.append(5)
    for i in range(40):
        sched.add(make_seq(i, 8, 100))
    out = sched.schedule()
    assert len(out.prefills) == 40 and not out.preempted


def test_first_admission_on_an_idle_engine_counts_for_the_next():
    """20 x (8 in, 100 out, ignore_eos) in 24 blocks of 8: one such sequence needs 14 blocks, so
    two never fit together. After a first batch has preempted and taught share 1, a second batch
    on the idle engine used to admit two at once (the first, admitted with nothing running, was
    left out of the footprint) and preempt; now it runs them one at a time without preempting."""
    sim = load_sim()
    r = sim.simulate(20, 8, 100, kv_blocks=24, block_size=8, max_num_seqs=20, max_num_batched_tokens=4096)
    assert r["preemptions"] > 0 and r["output_share"] == 1.0      # the first batch: nothing known yet
    sched = r["scheduler"]
    before = sched.num_preemptions
    r2 = sim.run_workload(sched, 20, 8, 100)
    assert sched.num_preemptions == before and r2["free_blocks_at_end"] == 24


def test_admission_after_a_preemption_uses_the_peak_not_the_sum():
    """40 x (32 in, 700 out) in 500 blocks of 16 (8,000 slots: ~10.9 whole sequences). Once a
    preemption has set the reserve, keeping every running sequence's full output free at once
    (the reserve before the peak check) held 14 rows a step and took 1,928 steps; the peak of
    the staggered footprints admits more: 1,618 steps, no more preemptions, nothing leaked."""
    sim = load_sim()
    r = sim.simulate(40, 32, 700, kv_blocks=500, block_size=16, max_num_seqs=40, max_num_batched_tokens=8192)
    assert r["free_blocks_at_end"] == 500
    assert r["steps"] <= 1700, r["steps"]
    assert r["preemptions"] <= 31 and r["computed_tokens"] <= 1.4 * r["ideal_tokens"], r


def test_learned_share_keeps_a_full_output_workload_from_refilling_past_the_pool():
    """1,000 x (1,000 in, 1,000 out) scaled down 10x: 100 x (100 in, 100 out), ignore_eos, in a
    pool that holds ~40 whole sequences at 64 sequences a step. The first cohort over-fills the
    pool and preempts (nothing is known yet); the finishes then teach a share of 1, so the ratio
    no longer decays to 0 and later cohorts do not over-fill it again."""
    sim = load_sim()
    r = sim.simulate(100, 100, 100, kv_blocks=520, block_size=16, max_num_seqs=64, max_num_batched_tokens=1024)
    assert r["free_blocks_at_end"] == 520
    assert r["preemptions"] > 0
    assert r["output_share"] == 1.0, r


def test_remove_frees_a_sequence_caught_between_queues():
    """A Ctrl-C inside `schedule` between an admission's popleft and its running.append (or inside
    `_preempt` between running.remove and bm.free) leaves a sequence in neither queue with its
    blocks held; aborting it (`remove`) frees them anyway (it freed only a running sequence's)."""
    sched = make_scheduler(num_blocks=10)
    seq = make_seq(0, 40, 8)
    sched.add(seq)
    sched.schedule()
    assert sched.bm.num_free_blocks < 10
    sched.running.remove(seq)          # where the interrupt left it
    sched.remove(seq)
    assert sched.bm.num_free_blocks == 10 and not sched.running and not sched.waiting
