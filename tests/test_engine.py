"""Continuous batching: greedy outputs do not depend on batching, chunking, prefix caching or
preemption; scheduler / block manager / executor invariants hold on every step; errors are
named and leave nothing behind. Tiny random Llama (fp32, CPU, token-id prompts, no tokenizer)
plus a few checks on the real SmolLM2."""
from __future__ import annotations

import random

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.errors import (CacheConfigError, ConfigError, InvalidRequestError, ModelNotFoundError,
                           OutOfKvCacheError, PromptTooLongError, QueueFullError)
from tiny_models import make_tiny_model

VOCAB = 128
MAX_LEN = 128


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("engine") / "llama"), "llama", num_heads=4,
                           num_kv_heads=2, hidden=64, layers=2, vocab=VOCAB, seed=7)


def make_llm(folder, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": MAX_LEN, **kw}
    return LLM(folder, progress=False, **kw)


def workload(n: int = 64, seed: int = 0):
    """n token-id prompts of 1..70 tokens (a third share a 40-token prefix, a few repeat
    exactly) and per-prompt greedy params with 1..24 new tokens, half of them stopping at EOS."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB) for _ in range(40)]
    prompts, params = [], []
    for i in range(n):
        if i % 3 == 0:
            p = shared + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))]
        elif i % 10 == 1 and prompts:
            p = list(prompts[0])
        else:
            p = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 71))]
        prompts.append(p)
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 25), ignore_eos=i % 2 == 0))
    return prompts, params


class Watch:
    """Wraps scheduler.schedule and engine.step to check invariants on every step."""

    def __init__(self, llm: LLM):
        self.llm = llm
        eng = llm.engine
        self.eng, self.sched, self.bm, self.ex = eng, eng.scheduler, eng.block_manager, eng.executor
        self.free0 = self.bm.num_free_blocks
        self.max_running = 0
        self.max_tokens_seen = 0
        self.steps = 0
        self.reordered = 0   # steps whose decode rows are not in arrival order
        cfg = eng.config.scheduler
        orig_schedule, orig_step = self.sched.schedule, eng.step

        def schedule():
            out = orig_schedule()
            n = out.num_batched_tokens
            self.max_tokens_seen = max(self.max_tokens_seen, n)
            if cfg.enable_chunked_prefill:
                assert n <= cfg.max_num_batched_tokens, f"{n} tokens > budget {cfg.max_num_batched_tokens}"
                cap = cfg.long_prefill_token_threshold
                assert cap is None or all(c.num_tokens <= cap for c in out.prefills), "chunk above the threshold"
            else:  # whole prompts only; only the step's first prefill may exceed the budget
                for c in out.prefills:
                    assert c.num_tokens == c.seq.num_uncomputed, "a prompt was chunked with chunking off"
                if n > cfg.max_num_batched_tokens:
                    assert len(out.prefills) == 1
            assert len(self.sched.running) <= cfg.max_num_seqs
            ids = [c.seq.seq_id for c in out.decodes + out.prefills]
            assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
            lens = [len(c.seq.token_ids) for c in out.decodes]
            if cfg.longest_decode_first:
                assert lens == sorted(lens, reverse=True), f"decode rows not longest first: {lens}"
            arrivals = [c.seq.arrival for c in out.decodes]
            self.reordered += arrivals != sorted(arrivals)
            return out

        def step(**kw):
            outs = orig_step(**kw)
            self.steps += 1
            self.max_running = max(self.max_running, len(self.sched.running))
            if hasattr(self.bm, "check_invariants"):
                self.bm.check_invariants()
            st = self.ex.status()
            # The executor may only track sequences that hold blocks (running ones): a
            # preempted or finished sequence must have been released.
            live = {s.seq_id for s in self.sched.running}
            assert st.running_sequences <= len(live), (st.running_sequences, len(live))
            return outs

        self.sched.schedule = schedule
        eng.step = step

    def assert_drained(self):
        st = self.ex.status()
        assert not self.eng.requests and not self.sched.running and not self.sched.waiting
        assert self.bm.num_free_blocks == self.free0, f"leaked {self.free0 - self.bm.num_free_blocks} blocks"
        assert st.running_sequences == 0


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(folder):
    """Greedy outputs of each prompt run alone (one request at a time, no prefix caching)."""
    prompts, params = workload()
    llm = make_llm(folder, enable_prefix_caching=False)
    w = Watch(llm)
    ref = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert w.max_running == 1
    w.assert_drained()
    for t, sp in zip(ref, params):
        assert 1 <= len(t) <= sp.max_tokens
        if sp.ignore_eos:
            assert len(t) == sp.max_tokens
    return ref


BATCH_CONFIGS = {
    "default": dict(),
    "no-prefix-no-chunk": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "chunked-budget-16": dict(max_num_batched_tokens=16),
    "chunked-budget-16-no-prefix": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "no-chunk-budget-32-block-8": dict(enable_chunked_prefill=False, max_num_batched_tokens=32, block_size=8),
    "max-seqs-5": dict(max_num_seqs=5, max_num_batched_tokens=40, block_size=8),
    "long-prefill-threshold-8": dict(max_num_batched_tokens=40, long_prefill_token_threshold=8),
    # async scheduling (default on CUDA): step n+1 launched before step n's tokens are read
    "async": dict(async_scheduling=True),
    "async-max-seqs-5": dict(max_num_seqs=5, max_num_batched_tokens=40, block_size=8, async_scheduling=True),
    # decode rows longest context first (the decode attention's load balance): same tokens
    "longest-decode-first": dict(longest_decode_first=True),
    "async-longest-decode-first": dict(longest_decode_first=True, async_scheduling=True),
}


def test_long_prefill_threshold_lets_others_share_the_steps():
    """A 200-token prompt queued before a 5-token one, budget 64: whole-budget chunks keep the
    short prompt waiting for the long one's 4 chunks; with long_prefill_token_threshold 16 both
    run in the first step, and a running decode keeps its token in every step."""
    from ferrum.config import SchedulerConfig
    from ferrum.engine.block_manager import BlockManager
    from ferrum.engine.scheduler import Scheduler
    from ferrum.engine.sequence import Request, Sequence

    def first_steps(threshold):
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=threshold),
                          BlockManager(64, 16, enable_prefix_caching=False), 512)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for i, n in enumerate((200, 5)):
            req = Request(str(i), None, list(range(2, 2 + n)), sp)
            seq = Sequence(str(i), req, 0)
            req.seqs.append(seq)
            sched.add(seq)
        steps = []
        for _ in range(3):
            out = sched.schedule()
            steps.append(([(c.seq.seq_id, c.num_tokens) for c in out.prefills], len(out.decodes)))
            for c in out.decodes + out.prefills:
                c.seq.num_computed_tokens += c.num_tokens
                if c.seq.num_computed_tokens == c.seq.num_tokens:
                    c.seq.token_ids.append(5)
        return steps
    assert first_steps(None) == [([("0", 64)], 0), ([("0", 64)], 0), ([("0", 64)], 0)]
    assert first_steps(16) == [([("0", 16), ("1", 5)], 0), ([("0", 16)], 1), ([("0", 16)], 1)]
    with pytest.raises(ConfigError):
        SchedulerConfig(long_prefill_token_threshold=0)


@pytest.mark.parametrize("cfg", list(BATCH_CONFIGS))
def test_batch_matches_alone(folder, reference, cfg):
    """64 mixed-length prompts at once give the same greedy tokens as each prompt alone."""
    prompts, params = workload()
    llm = make_llm(folder, **BATCH_CONFIGS[cfg])
    w = Watch(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=lambda r: int(r.split("-")[1]))
    got = tokens(outs)
    bad = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    assert not bad, f"{cfg}: prompts {bad} differ from running alone, e.g. {got[bad[0]]} vs {reference[bad[0]]}"
    assert all(o.finished for o in outs)
    assert w.max_running > 1, "the batch never ran concurrently"
    if "budget-16" in cfg:
        assert w.max_tokens_seen == 16
        assert llm.engine.executor.status().prefill_steps > 64   # prompts were chunked
    if cfg.endswith("max-seqs-5"):
        assert w.max_running == 5
    # default (None): on for CUDA, so off here on CPU
    assert llm.engine.scheduler.config.longest_decode_first is cfg.endswith("longest-decode-first")
    if cfg.endswith("longest-decode-first"):
        assert w.reordered > 0, "the decode rows never left arrival order"
    else:
        assert w.reordered == 0, "decode rows out of arrival order without longest_decode_first"
    if cfg.startswith("async"):
        assert llm.engine.status()["overlapped_steps"] > 0, "no step overlapped the one before"
    else:
        assert llm.engine.status()["overlapped_steps"] == 0
    if cfg in ("chunked-budget-16", "max-seqs-5", "async-max-seqs-5"):
        # Admission is spread over steps, so later prompts hit the shared 40-token prefix
        # (with the whole batch admitted in one step nothing is cached yet).
        assert llm.engine.status()["prefix_cache_hit_rate"] > 0
        assert any(o.num_cached_tokens >= 32 for o in outs)
    w.assert_drained()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_admission_keeps_room_for_running_outputs_instead_of_thrashing(folder, async_scheduling):
    """40 prompts of 32 tokens x 32 new tokens (ignore_eos) in a pool of 40 blocks of 8 (320
    slots: 5 full sequences) with max_num_seqs 40: admitting every prompt that fits now (the
    scheduler before the new-token reserve) preempted 20 times and computed 3,265 tokens for
    2,560; keeping room for the running outputs once a preemption has happened: 5 preemptions,
    2,712 tokens (261 steps instead of 221: fewer sequences at once). The outputs are those of
    an unpressured run. With async scheduling, steps overlap while the waiting prompts cannot
    be admitted (Scheduler.would_admit_next), not only when the queue is empty."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(32)] for _ in range(40)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with make_llm(folder, enable_prefix_caching=False) as llm:
        want = tokens(llm.generate(prompts, sp, use_tqdm=False))
    llm = make_llm(folder, num_kv_blocks=40, block_size=8, max_num_seqs=40, enable_prefix_caching=False,
                   async_scheduling=async_scheduling)
    computed = []
    orig = llm.engine.scheduler.schedule

    def schedule():
        out = orig()
        computed.append(out.num_batched_tokens)
        return out
    llm.engine.scheduler.schedule = schedule
    w = Watch(llm)
    assert tokens(llm.generate(prompts, sp, use_tqdm=False)) == want
    ideal = 40 * 64
    assert sum(computed) <= 1.1 * ideal, (sum(computed), ideal)
    assert llm.engine.status()["num_preemptions"] <= 8
    stats = llm.engine.stats
    # 40 prompts in waves of ~5: most decode steps have a waiting queue they cannot admit from
    assert (stats["overlapped_steps"] > stats["steps"] // 2) == async_scheduling, stats
    w.assert_drained()


@pytest.mark.parametrize("cfg", ["prefix-chunked", "no-prefix-no-chunk", "async"])
def test_preemption_under_kv_pressure(folder, reference, cfg):
    """A pool of 24 blocks of 8 (192 tokens; one max_model_len sequence needs 16) for 64
    prompts: sequences are preempted and recomputed, and every output is unchanged. The
    scheduler's learned output share is kept at 0 (admission then fills the pool after each
    preemption's reserve decays, as before it learned), else its reserve avoids the preemptions
    this test is about (tests/test_scheduler.py tests the reserve)."""
    prompts, params = workload()
    extra = {"prefix-chunked": dict(max_num_batched_tokens=48),
             "no-prefix-no-chunk": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
             "async": dict(max_num_batched_tokens=48, async_scheduling=True)}[cfg]
    llm = make_llm(folder, num_kv_blocks=24, block_size=8, **extra)
    llm.engine.scheduler._record_share = lambda seq: None
    w = Watch(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.status()["num_preemptions"] > 0
    got = tokens(outs)
    bad = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    assert not bad, f"prompts {bad} differ under preemption"
    w.assert_drained()


def test_prefix_cache_hit(folder):
    """The same 100-token prompt twice: the second run reuses 96 tokens (6 blocks of 16)
    from the prefix cache, computes only 4, and produces the same tokens."""
    llm = make_llm(folder)
    w = Watch(llm)
    p = [random.Random(3).randrange(2, VOCAB) for _ in range(100)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([p], sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert llm.engine.status()["prefix_cache_hit_rate"] == 0
    before = llm.engine.executor.status().prefill_tokens
    second = llm.generate([p], sp, use_tqdm=False)[0]
    assert second.num_cached_tokens == 96
    assert llm.engine.executor.status().prefill_tokens - before == 4
    assert llm.engine.status()["prefix_cache_hit_rate"] > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    w.assert_drained()


def test_cached_tokens_are_the_first_admissions_hit_not_a_readmission_after_preemption(folder):
    """num_cached_tokens (usage.prompt_tokens_details.cached_tokens) is the prompt's prefix-cache
    hit when the request is first scheduled. Two 3-token prompts x 80 tokens in a pool of one
    128-token sequence: the second is preempted holding 65 tokens, the first evicts only the tail of
    its cached blocks, and the readmission hits the 40 tokens of its own prompt + output that
    are left. That hit was reported as 40 cached tokens of a 3-token prompt (vLLM counts the
    first scheduling only)."""
    llm = make_llm(folder, num_kv_blocks=16, block_size=8)
    w = Watch(llm)
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [9, 10, 11]], sp, use_tqdm=False)
    assert llm.engine.status()["num_preemptions"] > 0
    assert llm.engine.block_manager.prefix_cache_hits > 0     # the readmission did hit
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    w.assert_drained()


def test_n_samples_seeded_fork_shares_blocks(folder):
    """n=4 with a seed: samples differ, the same seed reproduces them, another seed does not;
    samples 1..3 share the prompt's full blocks with sample 0 (fork) and compute only the
    rest of the prompt."""
    llm = make_llm(folder)
    w = Watch(llm)
    eng = llm.engine
    p = [random.Random(5).randrange(2, VOCAB) for _ in range(40)]   # 2 full blocks + 8 tokens
    sp = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    rid = eng.add_request("fork", None, sp, prompt_token_ids=p)
    eng.step()   # prefill of sample 0, sampling forks 1..3
    req = eng.requests[rid]
    assert len(req.seqs) == 4
    tables = [list(eng.block_manager.block_table(s.seq_id)) for s in req.seqs]
    for t in tables[1:]:
        assert t[:2] == tables[0][:2], "forked samples do not share the prompt's full blocks"
    assert [s.num_computed_tokens for s in req.seqs[1:]] == [32, 32, 32]
    assert eng.status()["kv_blocks_free"] == eng.num_blocks - 3   # 3 blocks for sample 0 only
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert eng.executor.status().prefill_tokens == 40 + 3 * 8
    samples = [c.token_ids for c in outs[-1].outputs]
    assert outs[-1].finished and len(samples) == 4 and all(len(s) == 16 for s in samples)
    assert len({tuple(s) for s in samples}) == 4, "samples of one request are identical"
    again = llm.generate([p], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples
    other = llm.generate([p], SamplingParams(n=4, temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in other.outputs] != samples
    # A seeded request is reproducible inside a batch of other requests as well.
    prompts, params = workload(16, seed=1)
    batch = llm.generate([p] + prompts, [sp] + params, use_tqdm=False)
    assert [c.token_ids for c in batch[0].outputs] == samples
    w.assert_drained()


@pytest.mark.parametrize("prefix_caching, async_scheduling", [(True, False), (False, True)])
def test_n_above_max_num_seqs_queues_the_rest(folder, prefix_caching, async_scheduling):
    """n=5 samples with max_num_seqs=2: sample 1 forks, samples 2..4 wait and prefill the
    prompt when admitted (from the prefix cache when on), and every sample equals the one
    drawn with room for all five (as vLLM, which schedules n above its sequence cap)."""
    p = [random.Random(6).randrange(2, VOCAB) for _ in range(40)]
    sp = SamplingParams(n=5, temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)
    wide = make_llm(folder).generate([p], sp, use_tqdm=False)[0]
    llm = make_llm(folder, max_num_seqs=2, enable_prefix_caching=prefix_caching,
                   async_scheduling=async_scheduling)
    w = Watch(llm)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    narrow = llm.generate([p, [5, 6, 7]], [sp, greedy], use_tqdm=False)
    assert [c.index for c in narrow[0].outputs] == list(range(5))
    assert [c.token_ids for c in narrow[0].outputs] == [c.token_ids for c in wide.outputs]
    assert len(narrow[1].outputs[0].token_ids) == 6
    assert w.max_running == 2
    w.assert_drained()


def test_async_scheduling_matches_sync(folder):
    """Seeded sampling (n=2, top-k/top-p), penalties and logprobs (which read output ids on
    the host, so the step after them waits) give identical outputs with async scheduling."""
    prompts, _ = workload(24, seed=4)
    params = []
    for i in range(len(prompts)):
        kw = dict(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i, max_tokens=4 + i % 13,
                  n=2 if i % 4 == 0 else 1)
        if i % 6 == 1:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.5)
        if i % 6 == 2:
            kw.update(logprobs=3)
        params.append(SamplingParams(**kw))
    runs = {}
    for mode in (False, True):
        llm = make_llm(folder, max_num_seqs=6, async_scheduling=mode)
        w = Watch(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[mode] = [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]
        assert (llm.engine.stats["overlapped_steps"] > 0) == mode
        w.assert_drained()
    for sync, overlapped in zip(runs[False], runs[True]):
        assert [c[:2] for c in overlapped] == [c[:2] for c in sync]
        # logprobs: same tokens; values may differ in the last bits, since a step that
        # overlaps carries the rows of sequences finished by the step before it (batch size)
        for (_, _, a), (_, _, b) in zip(sync, overlapped):
            assert (a is None) == (b is None)
            for da, db in zip(a or [], b or []):
                assert list(da) == list(db)
                assert max(abs(da[t] - db[t]) for t in da) < 1e-5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_blocks(folder, async_scheduling):
    llm = make_llm(folder, max_num_batched_tokens=32, block_size=8, async_scheduling=async_scheduling)
    w = Watch(llm)
    eng = llm.engine
    prompts, _ = workload(12, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [eng.add_request(None, None, sp, prompt_token_ids=p) for p in prompts]
    for _ in range(4):
        eng.step()
    assert eng.block_manager.num_free_blocks < w.free0
    running = [r for r in ids if eng.requests[r].seqs[0] in eng.scheduler.running]
    waiting = [r for r in ids if eng.requests[r].seqs[0] in eng.scheduler.waiting]
    assert running and waiting
    for r in running[::2] + waiting[:1]:
        assert eng.abort_request(r)
    assert not eng.abort_request(running[0])   # already gone
    assert eng.status()["requests_aborted"] == len(running[::2]) + 1
    while eng.has_unfinished_requests():
        eng.step()
    w.assert_drained()
    for r in list(ids):
        eng.abort_request(r)
    w.assert_drained()


def test_errors_are_named_and_leave_nothing_behind(folder):
    llm = make_llm(folder)
    w = Watch(llm)
    eng = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], greedy, use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.generate([[5] * MAX_LEN], greedy, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[5, VOCAB]], greedy, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="this model has no tokenizer"):
        llm.generate("hello", greedy, use_tqdm=False)
    # in a batch the bad prompt is named by its index, as the server does; the good ones before
    # it are not left queued (w.assert_drained below)
    for batch, kind, what in [([[5], []], InvalidRequestError, "prompt is empty"),
                              ([[5], [6], [5] * MAX_LEN], PromptTooLongError, "max_model_len"),
                              ([[5], [5, VOCAB]], InvalidRequestError, "vocabulary")]:
        with pytest.raises(kind, match=rf"^prompts\[{len(batch) - 1}\]: .*{what}") as e:
            llm.generate(batch, greedy, use_tqdm=False)
        assert e.value.param == f"prompts[{len(batch) - 1}]"
    # arguments of the wrong type are named errors, not a TypeError from deep inside
    for prompts, param in [(None, "prompts"), (5, "prompts"), ([[5, 6], None], "prompts[1]"),
                           ([[5, 6], [7, 8.0]], "prompts[1]"), ([[True]], "prompts[0]")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(prompts, greedy, use_tqdm=False)
        assert e.value.param == param, prompts
    for params, param in [({"temperature": 0}, "sampling_params"),
                          ([greedy, None], "sampling_params[1]")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([[5, 6], [7, 8]], params, use_tqdm=False)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(None, greedy)
    assert e.value.param == "messages"
    for kw, param in [(dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
                      (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
                      (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
                      (dict(seed=2**64), "seed"), (dict(seed=2**64 - 1, n=2), "seed"),
                      (dict(prompt_logprobs=21), "prompt_logprobs"),
                      (dict(prompt_logprobs=-1), "prompt_logprobs"),
                      (dict(prompt_logprobs=True), "prompt_logprobs"),
                      (dict(logprobs=21), "logprobs")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == param
    # A bad prompt in the middle of a batch: the good ones queued before it are withdrawn.
    with pytest.raises(PromptTooLongError):
        llm.generate([[5, 6], [7, 8, 9], [5] * (MAX_LEN + 3)], greedy, use_tqdm=False)
    w.assert_drained()
    # The engine still works afterwards.
    assert len(llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4
    w.assert_drained()


def test_chat_takes_one_sampling_params_per_conversation(offline):
    """`LLM.chat(conversations, [params, ...])`, which vLLM takes (as `generate` does per
    prompt), failed with "sampling_params[0] must be a SamplingParams, got list": the list went
    into every conversation as one SamplingParams. Now each conversation gets its own; a wrong
    length or element is named."""
    conv = [{"role": "user", "content": "hi"}]
    short, longer = SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)
    outs = offline.chat([conv, conv], [short, longer])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    (out,) = offline.chat(conv, (longer,))   # one conversation, a sequence of one
    assert len(out.outputs[0].token_ids) == 5
    for conversations, params, param in [([conv, conv], [short], "sampling_params"),
                                         ([conv], [{"max_tokens": 2}], "sampling_params[0]"),
                                         (conv, {}, "sampling_params")]:
        with pytest.raises(InvalidRequestError) as e:
            offline.chat(conversations, params)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError, match="got dict") as e:   # {} was taken as no params
        offline.generate("hi", {}, use_tqdm=False)


def test_chat_names_the_bad_conversation_of_a_batch(offline):
    """A bad or too long conversation in `LLM.chat`'s batch is named messages[i] (param and
    message), as `generate` names prompts[i]; alone it is "messages" (its too long prompt was
    called "prompt", the conversations in a batch were not told apart). Nothing stays queued."""
    from live_server import MAX_MODEL_LEN
    conv = [{"role": "user", "content": "hi"}]
    long = [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]
    sp = SamplingParams(max_tokens=2)
    cases = [([conv, [{"role": "user"}]], r"^messages\[1\]\[0\]\.content: is required", "messages[1][0]"),
             ([conv, conv, long], r"^messages\[2\]: the prompt has .*max_model_len", "messages[2]"),
             (long, r"^messages: the prompt has .*max_model_len", "messages")]
    for conversations, match, param in cases:
        with pytest.raises(InvalidRequestError, match=match) as e:
            offline.chat(conversations, sp)
        assert e.value.param.startswith(param), (e.value.param, param)
        assert not offline.engine.has_unfinished_requests()
    assert len(offline.chat([conv, conv], sp)) == 2


def test_generate_takes_vllm_dict_prompts(offline):
    """vLLM's prompt dicts, {"prompt": text} and {"prompt_token_ids": ids} (vLLM takes token
    ids only this way), were refused ("got dict"); now they give what the plain string / id
    list gives. Other keys (multi_modal_data) and a wrong value type are named errors."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = offline.tokenizer.encode("The sky is")
    plain = offline.generate(["The sky is", ids], greedy, use_tqdm=False)
    dicts = offline.generate([{"prompt": "The sky is"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == "The sky is" and dicts[1].prompt_token_ids == ids
    (one,) = offline.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)   # a single dict
    assert one.outputs[0].token_ids == plain[1].outputs[0].token_ids
    for prompts, param in [({"prompt": "x", "multi_modal_data": {}}, "prompts[0]"),
                           ([ids, {}], "prompts[1]"),
                           ({"prompt_token_ids": "The sky"}, "prompts[0].prompt_token_ids"),
                           ({"prompt": ids}, "prompts[0].prompt")]:
        with pytest.raises(InvalidRequestError) as e:
            offline.generate(prompts, greedy, use_tqdm=False)
        assert e.value.param == param, prompts


def chat_template_ids(hf, messages) -> list[int]:
    """transformers' apply_chat_template(tokenize=True): a list of ids (4.x) or a BatchEncoding (5.x)."""
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_get_tokenizer_is_the_hf_tokenizer_the_engine_uses(offline, folder):
    """vLLM's `LLM.get_tokenizer()` (users call it for encode / apply_chat_template) was
    missing. It returns the transformers tokenizer the engine holds: its ids for a text prompt
    and a conversation are the ones generate and chat use. A model without a tokenizer: a
    named error."""
    from transformers import PreTrainedTokenizerFast
    tok = offline.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast) and tok is offline.tokenizer.hf
    sp = SamplingParams(max_tokens=1)
    prompt = "The capital of France is"
    assert tok.encode(prompt) == offline.generate(prompt, sp, use_tqdm=False)[0].prompt_token_ids
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    assert chat_template_ids(tok, conv) == offline.chat(conv, sp)[0].prompt_token_ids
    assert tok.decode(tok.encode(prompt)) == prompt
    with make_llm(folder) as llm, pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.get_tokenizer()


def test_cache_too_small_and_unknown_model(folder):
    # max_model_len 128 needs 8 blocks of 16.
    with pytest.raises(CacheConfigError, match="not even one sequence"):
        make_llm(folder, num_kv_blocks=7)
    with pytest.raises(CacheConfigError):
        make_llm(folder, kv_cache_memory=1024)
    with pytest.raises(ModelNotFoundError):
        LLM("no-such-model-xyz", progress=False)
    with pytest.raises(ModelNotFoundError):
        LLM(str(folder) + "-missing/", progress=False)


def test_kv_pool_larger_than_the_machine_is_a_cache_config_error(folder):
    """`--kv-cache-memory 100GB` on a smaller box ended in the allocator's RuntimeError
    traceback; now a CacheConfigError sizes the pool and names the flag to lower. 1 PB fails
    on any machine (an overcommitting kernel may grant 100 GB of untouched memory)."""
    with pytest.raises(CacheConfigError, match="cannot allocate the KV cache.*--kv-cache-memory"):
        make_llm(folder, kv_cache_memory="1PB")
    assert len(make_llm(folder).generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_max_model_len_shrinks_to_a_small_pool_unless_set(folder, caplog):
    """A KV pool smaller than one sequence at the model's max_position_embeddings (512) makes
    an unset max_model_len shrink to the pool's whole capacity (a block multiple), with one
    log line naming both values and the flags; a max_model_len the user set is kept and the
    named error says which flags to change."""
    # 2 layers x 2 KV heads x head_dim 16 x (K, V) x 4 bytes = 512 bytes a token, 8 KiB a block
    with caplog.at_level("WARNING", logger="ferrum"):
        llm = LLM(folder, progress=False, device="cpu", kv_cache_memory=10 * 8192 + 100)
    try:
        assert llm.engine.max_model_len == 160 and llm.engine.num_blocks == 10
        assert llm.engine.executor.capabilities().max_seq_len == 160
        lines = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
        assert len(lines) == 1 and "512 -> 160" in lines[0], lines
        assert "--max-model-len" in lines[0] and "--kv-cache-memory" in lines[0]
        out = llm.generate([[5] * 150], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 10 and out.finish_reason == "length"   # 150 + 10 = 160
        with pytest.raises(PromptTooLongError):
            llm.generate([[5] * 160], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(CacheConfigError) as info:
        LLM(folder, progress=False, device="cpu", max_model_len=512, kv_cache_memory=10 * 8192)
    msg = str(info.value)
    assert "--max-model-len to at most 160" in msg and "--kv-cache-memory to at least 256KiB" in msg, msg
    with pytest.raises(CacheConfigError) as info:
        LLM(folder, progress=False, device="cpu", max_model_len=512, num_kv_blocks=7)
    assert "--max-model-len to at most 112" in str(info.value)
    assert "--num-kv-blocks to at least 32" in str(info.value)


def test_request_that_can_never_fit_fails_alone(folder):
    """A request whose KV cache could never fit the pool is refused at add_request with
    OutOfKvCacheError; requests already queued are unaffected.

    With the default max_model_len such a request cannot exist (the engine refuses a pool
    smaller than one max_model_len sequence), so the pool is shrunk behind the engine's back
    to the smallest legal one and max_model_len is raised above it."""
    llm = make_llm(folder, num_kv_blocks=8)     # exactly one 128-token sequence
    w = Watch(llm)
    eng = llm.engine
    good = eng.add_request("good", None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           prompt_token_ids=[3, 4, 5])
    eng.max_model_len = 200   # as if the model allowed longer sequences than the pool holds
    with pytest.raises(OutOfKvCacheError, match="pool holds 128"):
        eng.add_request("big", None, SamplingParams(max_tokens=90), prompt_token_ids=[5] * 100)
    assert "big" not in eng.requests and eng.scheduler.waiting[0].request.request_id == good
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    w.assert_drained()


# ---- SmolLM2 (real weights) --------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_gguf_path):
    return LLM("smollm2", progress=False, max_model_len=512)


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_batch_of_64_runs_concurrently(smol):
    tok = smol.tokenizer
    prompts = [f"{i} plus {i} equals" for i in range(64)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    w = Watch(smol)
    outs = smol.generate(prompts, sp, use_tqdm=False)
    assert w.max_running == 64, w.max_running
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    alone = [smol.generate(prompts[i], sp, use_tqdm=False)[0] for i in (0, 17, 63)]
    for i, a in zip((0, 17, 63), alone):
        assert a.outputs[0].token_ids == outs[i].outputs[0].token_ids, (i, tok.decode(a.outputs[0].token_ids))
        assert a.outputs[0].text == outs[i].outputs[0].text
    w.assert_drained()


def test_smollm2_get_tokenizer_is_the_gguf_tokenizer(smol):
    """A GGUF model's get_tokenizer(): the fast tokenizer transformers converts from the
    file, with the GGUF's chat template; its ids are the engine's."""
    from transformers import PreTrainedTokenizerFast
    tok = smol.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.chat_template and tok.chat_template == smol.tokenizer.chat_template
    prompt = "The capital of France is"
    assert tok.encode(prompt) == smol.generate(prompt, SamplingParams(max_tokens=1),
                                               use_tqdm=False)[0].prompt_token_ids
    assert chat_template_ids(tok, CAPITAL) == smol.chat(CAPITAL, SamplingParams(max_tokens=1))[0].prompt_token_ids


def test_smollm2_capital_of_france(smol):
    out = smol.chat(CAPITAL, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"   # ends with <|im_end|>, not max_tokens


def test_smollm2_greedy_matches_hf(smol, smollm2_hf_reference):
    """SmolLM2 GGUF vs HF transformers loading the same GGUF (its GGUF loader's config and
    tensors, shared with test_gguf): prefill logits within 1e-3 and 32 greedy tokens identical,
    for 3 prompts (one through the chat template)."""
    from hf_gguf import hf_model_from
    from ferrum.interfaces import KvCacheHandle, PrefillInput
    hf = hf_model_from(*smollm2_hf_reference)
    tok = smol.tokenizer
    prompts = [tok.apply_chat_template(CAPITAL), tok.encode("The three primary colors are"),
               tok.encode("def fibonacci(n):\n")]
    eng = smol.engine
    for i, ids in enumerate(prompts):
        # prefill logits through the executor, on blocks lent by the block manager
        eng.block_manager.allocate("probe", ids, len(ids))
        h = KvCacheHandle("probe", eng.block_manager.block_table("probe"), 0, eng.block_size)
        got = eng.executor.prefill(PrefillInput([ids], [h])).logits[0]
        eng.block_manager.free("probe")
        eng.executor.release_cache("probe")
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        diff = (got - ref).abs().max().item()
        print(f"[smollm2] prompt {i}: max abs prefill logit diff vs HF {diff:.2e}")
        assert diff < 1e-3, f"prompt {i}: max abs prefill logit diff vs HF {diff:.2e}"
    outs = smol.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_async_launches_no_step_for_sequences_that_length_finishes(folder, reference):
    """Async scheduling launches the next decode before reading the in-flight tokens, but not
    when those tokens surely end every running sequence (max_tokens reached): with
    max_tokens=1 (a TTFT measurement) each request is one prefill step, no wasted decode step
    that the next request would wait behind; longer requests still overlap, tokens unchanged."""
    prompts, params = workload()
    llm = make_llm(folder, async_scheduling=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for p in prompts[:5]:
        llm.generate([p], one, use_tqdm=False)
    assert llm.engine.stats["steps"] == 5 and llm.engine.stats["overlapped_steps"] == 0
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts[:8], params[:8])]
    assert [o.outputs[0].token_ids for o in outs] == reference[:8]
    assert llm.engine.stats["overlapped_steps"] > 0
    wasted = sum(max(0, len(o.outputs[0].token_ids) - 1) for o in outs)   # decode steps needed
    assert llm.engine.stats["steps"] - 5 <= len(outs) + wasted + sum(1 for o in outs if o.outputs[0].finish_reason == "stop")


def test_generate_from_threads_and_after_shutdown(folder):
    """LLM.generate from several threads at once: each call gets its own prompts' tokens, as
    alone (calls run one after another; before, each stepped the shared engine and took the
    others' outputs, and steps failed on mixed batches). After shutdown (or leaving `with`),
    generate raises EngineDeadError instead of returning empty "error" outputs; shutdown again
    does nothing."""
    import threading
    from ferrum.errors import EngineDeadError
    rng = random.Random(11)
    prompts = [[[rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(3)] for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with make_llm(folder) as llm:
        want = [tokens(llm.generate(p, sp, use_tqdm=False)) for p in prompts]
        got, errors = [None] * len(prompts), []

        def work(i):
            try:
                got[i] = tokens(llm.generate(prompts[i], sp, use_tqdm=False))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and got == want
    with pytest.raises(EngineDeadError):
        llm.generate(prompts[0], sp, use_tqdm=False)
    llm.shutdown()


def test_offline_batch_larger_than_the_queue_limit(folder):
    """max_waiting is the server's back-pressure (QueueFullError, HTTP 503): an offline batch of
    more prompts than it queues them all (it raised QueueFullError at prompt max_waiting + 1)."""
    prompts = [[5 + i, 6, 7] for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with make_llm(folder) as llm:
        want = tokens(llm.generate(prompts, sp, use_tqdm=False))
    with make_llm(folder, max_waiting=2) as llm:
        assert tokens(llm.generate(prompts, sp, use_tqdm=False)) == want


def test_queue_limit_counts_requests_not_queued_samples(folder):
    """max_waiting counts waiting requests, not the samples of a running n above max_num_seqs
    that wait for a slot (n=6 at max_num_seqs=2 queued 4 samples, and the server answered every
    other request 503 "4 requests are waiting (limit 2)" while it ran)."""
    sp = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    with make_llm(folder, max_num_seqs=2, max_waiting=2) as llm:
        eng = llm.engine
        eng.add_request("wide", [5, 6, 7], sp, queue_limit=True)
        eng.step()                          # the prefill forks: 1 sample runs, 4 wait
        assert len(eng.scheduler.waiting) == 4
        eng.add_request("a", [8, 9], SamplingParams(max_tokens=2), queue_limit=True)
        eng.add_request("b", [8, 9], SamplingParams(max_tokens=2), queue_limit=True)
        with pytest.raises(QueueFullError, match="2 requests are waiting"):
            eng.add_request("c", [8, 9], SamplingParams(max_tokens=2), queue_limit=True)
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        assert sorted(done) == ["a", "b", "wide"]
        assert [c.index for c in done["wide"].outputs] == list(range(6))
