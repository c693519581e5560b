"""Where an offline run's time goes, step by step (`ferrum bench throughput --step-log DIR`).

`StepLog(engine)` wraps one engine's `step` (and, inside it, the scheduler, the launch, the
processing of the previous step's samples and the executor's prefill / decode) and records one
row per step:

  wall_ms        the step call (what `LLM.generate` waits for)
  schedule_ms    Scheduler.schedule
  launch_ms      LLMEngine._launch: inputs, forward launches, sampler launch (on CPU the
                 forward itself, which runs synchronously there)
  wait_ms        the host waiting for the device's sampled ids (CUDA; 0 on CPU)
  finish_ms      processing the sampled ids: stop checks, detokenization (without wait_ms)
  other_ms       the rest: building RequestOutputs, bookkeeping
  kind           "prefill" (prefill chunks only), "mixed" (chunks and decodes), "decode", "empty"
  prefill_tokens, prefill_seqs, decode_rows, sampled (rows sampled: output tokens, and under
                 async scheduling one wasted row per sequence finished by the step before);
                 tokens_out: tokens delivered by this call (those of the step launched before)
  decode_ctx     KV tokens cached before the step for the decode rows (the sum of their
                 context lengths; each row also attends to the token it decodes)
  bucket         decode CUDA-graph batch size replayed (padded rows = bucket - decode_rows),
                 "eager" without graphs; prefill_graph: a prefill CUDA graph ran
  overlapped     launched while the previous step was still on the device (async scheduling)
  gpu_ms         CUDA: device time from the step's first device work (its prefill or decode
                 call) to the end of its sampler launch (CUDA events); when the device was idle
                 at that start it includes the host building that step's inputs
  idle_ms        CUDA: device time between the previous step's end and this step's start: the
                 host time the device waited for (0 when the step was queued in time)

`summary()` groups the rows into phases: steps containing a prefill chunk, decode steps that
ran synchronously (not overlapped), and overlapped decode steps by CUDA-graph bucket, with the
wall time, sampled rows and tok/s of each; `markdown()` writes them as a table.

`profile_kernels` runs the same workload again under torch.profiler for one prefill step and
a few decode steps at a target batch and context, and splits the device time into categories
(`kernel_category`): decode attention, prefill attention, GEMM/GEMV, norm + rope + activation,
KV store, embedding, sampler (every kernel launched by the sampler), copies, other, and the
idle gaps between kernels. On CPU it splits the host time of the same torch ops instead.
"""
from __future__ import annotations

import bisect
import statistics
import time

PHASE_PREFILL = "prefill-containing steps"
PHASE_SYNC = "decode, synchronous"
PHASE_ASYNC = "decode, overlapped"


class StepLog:
    """Per-step rows of one engine's steps (see the module docstring). `gpu_events`: record
    CUDA events around each launch (device time and idle gaps; needs a CUDA engine).
    Call `unwrap()` to restore the engine's methods; `finalize()` (also called by `summary`)
    reads the CUDA events once the device is done."""

    def __init__(self, engine, gpu_events: bool = False):
        import torch
        self.engine = engine
        self.rows: list[dict] = []
        self.gpu_events = gpu_events and torch.cuda.is_available()
        self._events: list[tuple] = []       # (row, start event, end event) until finalize
        self._t0 = time.perf_counter()
        eng, ex = engine, engine.executor
        caps = ex.capabilities()
        from ferrum.executor.cuda_graph import graph_batch_sizes
        self._buckets = graph_batch_sizes(caps.max_batch_size) if caps.cuda_graphs else None
        runner = getattr(ex, "runner", None)
        self._prefill_graphs = getattr(runner, "prefill_graphs", None)
        self._orig = {"step": eng.step, "_launch": eng._launch, "_finish": eng._finish,
                      "schedule": eng.scheduler.schedule, "prefill": ex.prefill, "decode": ex.decode}
        # which of them were wrappers already (instance attributes): unwrap puts those back
        self._own = {k for obj, k in ((eng, "step"), (eng, "_launch"), (eng, "_finish"), (eng.scheduler, "schedule"),
                                      (ex, "prefill"), (ex, "decode")) if k in obj.__dict__}
        self._row: dict | None = None
        self._start = None                   # CUDA event at the step's first device work
        orig = self._orig

        def timed(key, fn):
            def call(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if self._row is not None:
                        self._row[key] += 1e3 * (time.perf_counter() - t)
            return call

        def mark_start():
            # the step's first device work: its prefill or decode call (what the host does in
            # `_launch` before it, handles and grammar masks, counts as idle when it stalls)
            if self.gpu_events and self._start is None:
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()

        def launch(sched):
            row = self._row
            self._start = None
            t = time.perf_counter()
            launched = None
            try:
                launched = orig["_launch"](sched)
                return launched
            finally:
                if row is not None:
                    row["launch_ms"] += 1e3 * (time.perf_counter() - t)
                    row["sampled"] += len(launched.seqs) if launched is not None else 0
                    if self._start is not None:
                        end = torch.cuda.Event(enable_timing=True)
                        end.record()
                        self._events.append((row, self._start, end))
                        self._start = None

        def finish(touched):
            in_flight = eng._in_flight
            row = self._row
            if in_flight is not None and in_flight.ready is not None and row is not None:
                t = time.perf_counter()
                in_flight.ready.synchronize()     # _finish would wait here: time it apart
                row["wait_ms"] += 1e3 * (time.perf_counter() - t)
            t = time.perf_counter()
            try:
                return orig["_finish"](touched)
            finally:
                if row is not None:
                    row["finish_ms"] += 1e3 * (time.perf_counter() - t)

        def prefill(inp):
            row = self._row
            mark_start()
            if row is not None:
                row["prefill_tokens"] += sum(map(len, inp.token_ids))
                row["prefill_seqs"] += len(inp.token_ids)
                if self._prefill_graphs is not None and inp.prompt_logprob_targets is None:
                    row["prefill_graph"] = bool(self._prefill_graphs.can_run(inp.token_ids))
            return orig["prefill"](inp)

        def decode(inp):
            row = self._row
            mark_start()
            if row is not None:
                n = len(inp.token_ids)
                row["decode_rows"] += n
                row["decode_ctx"] += sum(h.num_tokens for h in inp.kv)
                b = self._buckets
                row["bucket"] = (b[bisect.bisect_left(b, n)] if b and n <= b[-1] else "eager")
            return orig["decode"](inp)

        def step(*a, **k):
            overlapped0 = eng.stats["overlapped_steps"]
            steps0 = eng.stats["steps"]
            gen0 = eng.stats["generation_tokens"]
            row = {"i": len(self.rows), "t_s": time.perf_counter() - self._t0, "wall_ms": 0.0,
                   "schedule_ms": 0.0, "launch_ms": 0.0, "wait_ms": 0.0, "finish_ms": 0.0,
                   "prefill_tokens": 0, "prefill_seqs": 0, "decode_rows": 0, "decode_ctx": 0,
                   "sampled": 0, "bucket": None, "prefill_graph": False, "gpu_ms": None, "idle_ms": None}
            self._row = row
            t = time.perf_counter()
            try:
                return orig["step"](*a, **k)
            finally:
                row["wall_ms"] = 1e3 * (time.perf_counter() - t)
                self._row = None
                row["other_ms"] = row["wall_ms"] - sum(row[k] for k in ("schedule_ms", "launch_ms", "wait_ms",
                                                                      "finish_ms"))
                row["overlapped"] = eng.stats["overlapped_steps"] > overlapped0
                row["launched"] = eng.stats["steps"] > steps0
                # tokens processed in this call (those of the step launched by the call before)
                row["tokens_out"] = eng.stats["generation_tokens"] - gen0
                row["running"] = len(eng.scheduler.running)
                row["waiting"] = len(eng.scheduler.waiting)
                row["kind"] = ("empty" if not row["launched"] else
                               "mixed" if row["prefill_tokens"] and row["decode_rows"] else
                               "prefill" if row["prefill_tokens"] else "decode")
                self.rows.append(row)

        eng.step, eng._launch, eng._finish = step, launch, finish
        eng.scheduler.schedule = timed("schedule_ms", orig["schedule"])
        ex.prefill, ex.decode = prefill, decode

    def unwrap(self) -> None:
        """Restore the engine's methods as they were (an earlier wrapper stays in place)."""
        eng, ex = self.engine, self.engine.executor
        for obj, name, key in ((eng, "step", "step"), (eng, "_launch", "_launch"), (eng, "_finish", "_finish"),
                               (eng.scheduler, "schedule", "schedule"), (ex, "prefill", "prefill"),
                               (ex, "decode", "decode")):
            if key in self._own:
                setattr(obj, name, self._orig[key])
            else:
                obj.__dict__.pop(name, None)

    def finalize(self) -> None:
        """Read the CUDA events (waits for the device): gpu_ms of each launched step and
        idle_ms, the device's wait between the previous launched step's end and this one's
        start."""
        if not self._events:
            return
        import torch
        torch.cuda.synchronize()
        prev_end = None
        for row, start, end in self._events:
            row["gpu_ms"] = start.elapsed_time(end)
            row["idle_ms"] = max(0.0, prev_end.elapsed_time(start)) if prev_end is not None else None
            prev_end = end
        self._events = []

    # ---- aggregation -----------------------------------------------------------------------
    @staticmethod
    def phase_of(row: dict) -> str | None:
        """The phase a row counts in (see the module docstring); None for an empty step."""
        if row["kind"] in ("prefill", "mixed"):
            return PHASE_PREFILL
        if row["kind"] == "decode":
            return f"{PHASE_ASYNC}, bucket {row['bucket']}" if row["overlapped"] else PHASE_SYNC
        return None

    def summary(self) -> dict:
        """Phases -> {steps, wall_s, share (of the summed step wall time), sampled_rows (rows
        sampled by the steps launched there: output tokens, plus under async scheduling one
        wasted row per sequence that the step before had finished), tok_s (sampled_rows /
        wall_s), prefill_tokens, decode_rows,
        padded_rows, mean ms per step of wall / schedule / launch / wait / finish / other,
        mean decode batch and context, and on CUDA gpu_ms / idle_ms per step}, plus totals
        (output_tokens: the tokens the engine delivered)."""
        self.finalize()
        total_wall = sum(r["wall_ms"] for r in self.rows) / 1e3
        groups: dict[str, list[dict]] = {}
        for r in self.rows:
            groups.setdefault(self.phase_of(r) or "empty steps", []).append(r)

        def order(name):
            rows = groups[name]
            b = rows[0]["bucket"]
            return (name.startswith(PHASE_ASYNC), -(b if isinstance(b, int) else 10**9), name)

        phases = {}
        for name in sorted(groups, key=order):
            rows = groups[name]
            wall = sum(r["wall_ms"] for r in rows) / 1e3
            sampled = sum(r["sampled"] for r in rows)
            decode = [r for r in rows if r["decode_rows"]]
            p = {"steps": len(rows), "wall_s": wall, "share": wall / total_wall if total_wall else 0.0,
                 "sampled_rows": sampled, "tok_s": sampled / wall if wall else 0.0,
                 "prefill_tokens": sum(r["prefill_tokens"] for r in rows),
                 "decode_rows": sum(r["decode_rows"] for r in rows),
                 "padded_rows": sum(r["bucket"] - r["decode_rows"] for r in decode if isinstance(r["bucket"], int)),
                 "mean_decode_batch": statistics.fmean(r["decode_rows"] for r in decode) if decode else 0.0,
                 "mean_decode_context": (sum(r["decode_ctx"] for r in decode) / sum(r["decode_rows"] for r in decode)
                                         if decode else 0.0)}
            for key in ("wall_ms", "schedule_ms", "launch_ms", "wait_ms", "finish_ms", "other_ms"):
                p[f"{key}_per_step"] = statistics.fmean(r[key] for r in rows)
            gpu = [r for r in rows if r["gpu_ms"] is not None]
            if gpu:
                p["gpu_ms_per_step"] = statistics.fmean(r["gpu_ms"] for r in gpu)
                idle = [r["idle_ms"] for r in gpu if r["idle_ms"] is not None]
                p["idle_ms_per_step"] = statistics.fmean(idle) if idle else 0.0
                p["gpu_s"] = sum(r["gpu_ms"] for r in gpu) / 1e3
                p["idle_s"] = sum(idle) / 1e3
            phases[name] = p
        totals = {"steps": len(self.rows), "wall_s": total_wall,
                  "output_tokens": sum(r["tokens_out"] for r in self.rows),
                  "sampled_rows": sum(r["sampled"] for r in self.rows),
                  "overlapped_steps": sum(r["overlapped"] for r in self.rows)}
        totals["tok_s"] = totals["output_tokens"] / total_wall if total_wall else 0.0
        if any(r["gpu_ms"] is not None for r in self.rows):
            totals["gpu_s"] = sum(r["gpu_ms"] or 0.0 for r in self.rows) / 1e3
            totals["idle_s"] = sum(r["idle_ms"] or 0.0 for r in self.rows) / 1e3
        return {"phases": phases, "totals": totals}

    def markdown(self, summary: dict | None = None) -> str:
        """The summary as a markdown table (times in seconds and ms per step)."""
        s = summary or self.summary()
        gpu = "gpu_s" in s["totals"]
        head = ["phase", "steps", "wall s", "share", "sampled rows", "tok/s", "prefill tok", "mean batch",
                "mean ctx", "padded rows", "ms/step", "sched", "launch", "wait", "finish", "other"]
        if gpu:
            head += ["gpu ms/step", "idle ms/step"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, p in s["phases"].items():
            cells = [name, p["steps"], f"{p['wall_s']:.3f}", f"{100 * p['share']:.1f}%", p["sampled_rows"],
                     f"{p['tok_s']:.0f}", p["prefill_tokens"], f"{p['mean_decode_batch']:.1f}",
                     f"{p['mean_decode_context']:.0f}", p["padded_rows"]]
            cells += [f"{p[k + '_per_step']:.3f}" for k in ("wall_ms", "schedule_ms", "launch_ms", "wait_ms",
                                                            "finish_ms", "other_ms")]
            if gpu:
                cells += [f"{p.get('gpu_ms_per_step', 0):.3f}", f"{p.get('idle_ms_per_step', 0):.3f}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        t = s["totals"]
        tail = (f"\nTotal: {t['steps']} steps, {t['wall_s']:.3f} s, {t['output_tokens']} output tokens, "
                f"{t['tok_s']:.0f} tok/s, {t['overlapped_steps']} overlapped")
        if gpu:
            tail += f"; device busy {t['gpu_s']:.3f} s, idle between steps {t['idle_s']:.3f} s"
        return "\n".join(lines) + tail + "\n"


# ---- kernel profile ----------------------------------------------------------------------------
RANGES = ("ferrum::prefill", "ferrum::decode", "ferrum::sampler")


def kernel_category(name: str, launched_in: str | None = None) -> str:
    """Category of one device kernel (or, on CPU, one torch op) by its name; every kernel the
    sampler launched (`launched_in` "ferrum::sampler") is "sampler"."""
    n = name.lower()
    if launched_in == "ferrum::sampler":
        return "sampler"
    if "memcpy" in n or "memset" in n or n in ("aten::copy_", "aten::to", "aten::_to_copy"):
        return "copies"
    if "decode_split" in n or "decode_merge" in n:
        return "decode attention"
    if "prefill_kernel" in n or "attention" in n or "flash" in n or "sdpa" in n:
        return "prefill attention" if launched_in != "ferrum::decode" else "decode attention"
    if "write_kv" in n or "index_put" in n:
        return "kv store"
    if any(k in n for k in ("gemv", "gemm", "nvjet", "cutlass", "xmma", "splitk", "aten::mm", "aten::addmm",
                            "aten::linear", "aten::matmul", "aten::bmm", "blas")):
        return "gemm/gemv"
    if any(k in n for k in ("rms", "norm", "rope", "rotary", "silu", "gelu", "act_and_mul")):
        return "norm+rope+act"
    if "embedding" in n or "index_select" in n or "indexselect" in n:
        return "embedding"
    if "one_shot" in n or "all_reduce" in n or "nccl" in n:
        return "communication"
    return "other"


def _range_of(event) -> str | None:
    e = event
    while e is not None:
        if e.name in RANGES:
            return e.name
        e = e.cpu_parent
    return None


def split_profile(prof, steps: int, on_cuda: bool) -> dict:
    """Device time (CUDA) or torch-op self time (CPU) of a torch.profiler window, per step:
    {categories_us, kernels_us (top 25 names), busy_us (union of kernel intervals), span_us
    (first kernel start to last end), idle_us (span - busy: gaps between kernels), steps}."""
    from torch.autograd import DeviceType
    cats: dict[str, float] = {}
    names: dict[str, float] = {}
    intervals = []
    events = prof.events()
    if on_cuda:
        # a kernel's linked_correlation_id names the launch call (cudaLaunchKernel,
        # cudaGraphLaunch, ...), a CPU event under one of our ranges; torch builds without that
        # field (2.11) categorise by kernel name alone
        launch_range = {e.id: _range_of(e) for e in events
                        if e.device_type == DeviceType.CPU and (e.kernels or e.name.startswith("cu"))}
        for e in events:
            if e.device_type != DeviceType.CUDA or e.name in RANGES or getattr(e, "is_user_annotation", False):
                continue
            us = e.time_range.end - e.time_range.start
            c = kernel_category(e.name, launch_range.get(getattr(e, "linked_correlation_id", None)))
            cats[c] = cats.get(c, 0.0) + us
            names[e.name] = names.get(e.name, 0.0) + us
            intervals.append((e.time_range.start, e.time_range.end))
    else:
        for e in events:
            if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and not e.cpu_children:
                # leaf torch ops: their own host time (the CPU "kernels")
                c = kernel_category(e.name, _range_of(e))
                cats[c] = cats.get(c, 0.0) + e.self_cpu_time_total
                names[e.name] = names.get(e.name, 0.0) + e.self_cpu_time_total
                intervals.append((e.time_range.start, e.time_range.end))
    busy, span = 0.0, 0.0
    if intervals:
        intervals.sort()
        cur_s, cur_e = intervals[0]
        for s, e in intervals[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        span = max(e for _, e in intervals) - intervals[0][0]
    n = max(steps, 1)
    return {"steps": steps, "unit": "us per step, device time" if on_cuda else "us per step, CPU op time",
            "categories_us": {k: v / n for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "kernels_us": {k: v / n for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:25]},
            "busy_us": busy / n, "span_us": span / n, "idle_us": (span - busy) / n}


def profile_kernels(llm, prompts, params, decode_batch: int, decode_context: int, decode_steps: int = 3) -> dict:
    """Run `prompts` again under torch.profiler windows: the first step (prompt chunks only,
    up to the token budget), and `decode_steps` consecutive decode-only steps
    once at least `decode_batch` rows decode at a mean context of at least `decode_context`
    tokens (else the first decode step of the largest batch seen when the running batch starts
    shrinking). Each window begins and ends with a device sync, so it holds exactly the
    steps launched inside it (the gaps inside are inflated by the profiler's own host work).
    The remaining requests are aborted after the decode window. Returns {"prefill": ...,
    "decode": ...}, each `split_profile` plus what the window ran."""
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile
    eng = llm.engine
    ex = eng.executor
    on_cuda = str(ex.info().device).startswith("cuda")
    orig = {"prefill": ex.prefill, "decode": ex.decode, "sampler": eng.sampler}
    own = {name for obj, name in ((ex, "prefill"), (ex, "decode"), (eng, "sampler")) if name in obj.__dict__}
    launched = {"prefill": 0, "decode": 0, "prefill_tokens": 0, "decode_rows": 0, "decode_ctx": 0}

    def ranged(key, fn):
        def call(*a, **k):
            with record_function(f"ferrum::{key}"):
                return fn(*a, **k)
        return call

    def prefill(inp):
        launched["prefill"] += 1
        launched["prefill_tokens"] += sum(map(len, inp.token_ids))
        return ranged("prefill", orig["prefill"])(inp)

    def decode(inp):
        launched["decode"] += 1
        launched["decode_rows"] += len(inp.token_ids)
        launched["decode_ctx"] += sum(h.num_tokens for h in inp.kv)
        return ranged("decode", orig["decode"])(inp)

    ex.prefill, ex.decode, eng.sampler = prefill, decode, ranged("sampler", orig["sampler"])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    def window(n_steps: int) -> dict:
        sync()
        for k in launched:
            launched[k] = 0
        steps0 = eng.stats["steps"]
        with profile(activities=acts) as prof:
            for _ in range(n_steps):
                eng.step(final_only=True)
            sync()
        res = split_profile(prof, eng.stats["steps"] - steps0, on_cuda)
        res["launched"] = dict(launched)
        if launched["decode_rows"]:
            res["mean_decode_context"] = launched["decode_ctx"] / launched["decode_rows"]
        return res

    ids = []
    out: dict = {"prefill": None, "decode": None}
    try:
        for p, sp in zip(prompts, params):
            ids.append(eng.add_request(None, None, sp, prompt_token_ids=list(p)))
        out["prefill"] = window(1)
        best = 0
        while eng.has_unfinished_requests():
            running = eng.scheduler.running
            decoding = running and not eng.scheduler.waiting and all(
                s.num_uncomputed <= 1 for s in running)
            if decoding:
                ctx = sum(s.num_computed_tokens for s in running) / len(running)
                shrinking = len(running) < best
                if (len(running) >= decode_batch and ctx >= decode_context) or shrinking:
                    out["decode"] = window(decode_steps)
                    out["decode"]["target_reached"] = not shrinking
                    break
                best = max(best, len(running))
            eng.step(final_only=True)
    finally:
        for obj, name in ((ex, "prefill"), (ex, "decode"), (eng, "sampler")):
            if name in own:
                setattr(obj, name, orig[name])
            else:
                obj.__dict__.pop(name, None)
        for rid in ids:
            eng.abort_request(rid)
    return out


def profile_markdown(prof: dict) -> str:
    """The kernel split of `profile_kernels` as a markdown table (us per step)."""
    lines = []
    for name, res in prof.items():
        if not res:
            lines.append(f"\n{name}: not reached\n")
            continue
        la = res["launched"]
        what = (f"{la['prefill_tokens']} prefill tokens" if name == "prefill" else
                f"{la['decode_rows'] / max(res['steps'], 1):.0f} rows at mean context "
                f"{res.get('mean_decode_context', 0):.0f}")
        lines.append(f"\n{name} ({res['steps']} step(s), {what}; {res['unit']}):\n")
        lines.append("| category | us/step | share of busy |")
        lines.append("|---|---|---|")
        busy = sum(res["categories_us"].values()) or 1.0
        for c, us in res["categories_us"].items():
            lines.append(f"| {c} | {us:.0f} | {100 * us / busy:.1f}% |")
        lines.append(f"| idle gaps between kernels (under the profiler) | {res['idle_us']:.0f} | |")
        lines.append(f"| span | {res['span_us']:.0f} | |")
    return "\n".join(lines) + "\n"
