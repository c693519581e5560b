#!/usr/bin/env bash
# Issue 15's GPU session in four device calls of one lease (each under the 600 s call limit;
# the machine stays warm 30 s between calls, so send the next call at once). Each call carries
# one vLLM chunk (../shared/peers/build_vllm_peer.sh .peers/vc); call 1 also the wheels, which
# it installs into /tmp/site for the later calls (PYTHONPATH=/tmp/site in front of them):
#
#   call 1: carry .whl .peers/vllm_bench.py .peers/vc/part.00        bash benchmarks/quant_gpu_session.sh 1
#   call 2: carry .old .peers/vc/part.01                             bash benchmarks/quant_gpu_session.sh 2
#   call 3: carry .peers/vllm_bench.py .peers/vc/part.02 .peers/vc/bin       ... 3
#   call 4: carry .peers/vllm_bench.py                               bash benchmarks/quant_gpu_session.sh 4
#
# with OUT set by the device tool and FERRUM_GIT_COMMIT=<sha> in front. The tree (~6 MB) plus
# what a call carries must stay under 64 MiB (on 2026-12-05 .whl + .old + part.01 did not).
# Until 3c3d8b1 every call needed the wheels installed (the engine imported llguidance; 12-05b
# lost its first call to that); since then only the tests and the GGUF writer do. Call 1's
# tests compile every kernel config they check, most of their time (they outran 420-470 s twice):
# it packs Triton's cache into $OUT/triton_cache.part.* (TRITON_CACHE_OUT, gpu_run.sh); copy those
# into .triton_cache here and carry it in the next lease's call 1.
#   1: the GPU tests of the decode path and the quantized GEMVs, while the Llama-3-8B-shape
#      Q4_K GGUF for vLLM is written to /tmp/models.
#   2: ferrum batch-1 latency in $AB_FORMATS (default "bf16 awq") from the tree of $AB_BASE
#      (required: `git archive $AB_BASE ferrum benchmarks | tar -x -C .old` here first) and
#      from this tree in one command; decode profiles of AWQ, FP8 and GGUF Q4_K
#      (profile_decode.py engine, batch 1).
#   3: vLLM unpacked; vLLM GGUF Q4_K and FP8, then ferrum bf16 / FP8 / Q4_K (one command:
#      gguf_q4_k_vs_vllm, fp8_vs_vllm, *_speedup_vs_bf16).
#   4: vLLM AWQ, then ferrum bf16 / AWQ / GPTQ (w4a16_vs_vllm, w4a16_speedup_vs_bf16).
#
# The lease of 2026-12-05c (issue 15's GPU suite, the re-timed GEMV table end to end, the FP8-KV
# decode tile), three calls, each carrying .whl too (a call on a fresh machine needs it):
#   5: carry .whl .peers/vllm_bench.py .peers/vc/part.00: `pytest -m gpu tests/test_quant_kernels.py`,
#      then the FP8-KV decode attention over its tiles at 512 and 256 sequences x 1,536 tokens
#      (tune_attention.py --kv-dtype fp8 --small-grid); the fastest one-split tile at 512 x 1,536,
#      when >= 2% faster than the default, goes to /tmp/attn_best.txt for step 7.
#   6: carry .whl .peers/vc/part.01: batch-1 latency of every format with FERRUM_SILU_GEMV=0, then
#      bf16 / FP8 with 1 and again with 0 (A/B/A), and Llama-3-70B FP8 on an H200.
#   7: carry .whl .peers/vllm_bench.py .peers/vc/part.02 .peers/vc/bin: vLLM unpacked; FP8 + FP8 KV
#      1000 x (1000 in, 1000 out), ferrum then vLLM in one command (gpu_run.sh fp8), then ferrum
#      alone with /tmp/attn_best.txt's tile (FERRUM_DECODE_ATTN_CONFIG; $OUT/tuned/fp8.json).
#
# The lease of 2026-12-06 (issue 15's whole GPU suite on an H200, the end-to-end table with vLLM
# in one command, profiles at the current GEMV table), four calls:
#   8: carry .whl .peers/vllm_bench.py .peers/vc/part.00: every -m gpu test but
#      test_structured_output (it needs the SmolLM2 GGUF): the kernel tests over 8 pytest-xdist
#      workers (the pytest_xdist and execnet wheels in .whl: compiling is most of their time, and
#      the machine has 16 cores), then test_gpu.py alone; meanwhile the Q4_K GGUF for vLLM is written.
#   9: carry .whl .peers/vc/part.01: decode profiles of FP8 / AWQ / GGUF Q4_K / bf16 at batch 1
#      (profile_decode.py engine), then Llama-3-70B FP8 on one H200 (quant_bench.py big). (On
#      2026-12-06 steps 9 and 12 also timed the decode attention's merge folded into its split
#      kernel, A/B/A; it lost and was removed.)
#  10: carry .whl .peers/vllm_bench.py .peers/vc/part.02 .peers/vc/bin: vLLM unpacked; vLLM FP8,
#      AWQ and GGUF Q4_K, then ferrum bf16 / FP8 / AWQ / GGUF Q4_K in one command.
#  11: carry .whl .peers/vllm_bench.py: issue 16's nano-vllm workload vs vLLM (gpu_run.sh nanovllm).
#  12: carry .whl: step 8's tests in one call, without the GGUF writer (the budget after failed
#      starts).
#
# The lease of 2026-12-06 (a fresh 1,800 s budget): call 12 carrying .whl .peers/vc/part.00, then
#  13: carry .whl .peers/vc/part.01: step 9's profiles without the 70B run, then 10 carrying .whl .peers/vllm_bench.py .peers/vc/part.02 .peers/vc/bin.
#
# Issue 16's admission A/B at main (after h100-2026-12-06d, whose timed policy main changed), after
# call 12 (carry .whl .peers/vllm_bench.py .peers/vc/part.00) on the same warm machine:
#  14: carry .old .peers/vc/part.01 (`git archive 2d19606 ferrum | tar -x -C .old` here first):
#      benchmarks/sched_ab.sh, main / 2d19606 / main, 1000 x 1000 bf16, ferrum alone.
#  15: carry .peers/vllm_bench.py .peers/vc/part.02 .peers/vc/bin: vLLM unpacked, then
#      `gpu_run.sh tput` (ferrum, then vLLM: output_tok_s_vs_vllm).
#  16: the decode attention over both page layouts (tune_attention.py --layouts both), Qwen3-0.6B's
#      decode graph at 1-64 rows (profile_decode.py replay), then the nano-vllm workload, ferrum
#      alone, with --step-log (a call that can carry a vLLM chunk).
# (Steps 17-18 of 2026-12-07 timed KV pages head-major, no faster, and were removed:
# benchmarks/results/h100-2026-12-07.)
# (Steps 17-18 of 2026-12-07b/c timed Qwen3-0.6B's decode linears at 2-256 rows, cuBLAS against a
# Triton tile GEMM, then the nano-vllm workload with the table of Triton's wins: decode no faster,
# removed with the kernel: benchmarks/results/h100-2026-12-07c.)
# The next lease (after h100-2026-12-07d, which ran 12 at 76c7b21, all passed, and ferrum alone
# at main: no vLLM chunk could follow in its budget): on an H200, 10 (the quantized
# table against vLLM) in three calls that carry one vLLM chunk each (the machine stays warm 30 s):
# 12 carrying .whl_test .peers/vc/part.00, 13 carrying .whl .peers/vc/part.01 (or .peers/vc/part.01
# alone when .whl and it do not fit), then 10 carrying .peers/vllm_bench.py .peers/vc/part.02
# .peers/vc/bin.
# 2026-12-07e (H100): 12 at 414bb44 took 489 s (Triton compiles ~1.7x slower than 12-07d's host;
# the kernels stopped at 280 s with 34 of 35 passed, hence 330 now, LIMIT_kernels to change it), then
# part.01, then part.02 + unpack + `gpu_run.sh nanovllm ttft`, then `gpu_run.sh tput`: 1,605 s in all.
# Next lease: 10 (the quantized table against vLLM) needs the three chunks first, then ~500 s.
# The lease plan since 3c3d8b1 (no wheels for the benchmarks; .whl + a chunk did not fit one call
# on 2026-12-06e): 14 carrying .old .peers/vc/part.00, 16 carrying .peers/vc/part.01, 15 carrying
# .peers/vllm_bench.py .peers/vc/part.02 .peers/vc/bin, then 12 carrying .whl (the tests).
# 2026-12-08 (a session whose first hour got no machine): 17 carrying .whl_test .peers/vc/part.00,
# 18 carrying .peers/vc/part.01, then 10 carrying .peers/vllm_bench.py .peers/vc/part.02 .peers/vc/bin.
# Steps 14-16 need no wheels since 3c3d8b1 (older trees in .old do: patch their
# ferrum/structured_output/manager.py with this one, which only moves the llguidance import).
set -u -o pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step=${1:?step 1-18}
mkdir -p /tmp/vc
for p in .peers/vc/part.*; do [[ -f $p ]] && cp "$p" /tmp/vc/; done
[[ -d .peers/vc/bin ]] && cp -r .peers/vc/bin /tmp/vc/
# batch-1 decode profiles of FP8 / AWQ / GGUF Q4_K / bf16 (profile_decode.py engine)
profiles() {
    for q in fp8 awq gguf_q4_k none; do
        local qa=(--quantization "$q"); [[ $q == none ]] && qa=()
        timeout -k 10 100 python3 benchmarks/profile_decode.py engine --tp 1 --engine-batches 1 --async-modes on \
            --steps 64 "${qa[@]}" --out "$OUT" >"$OUT/profile_$q.log" 2>&1
    done
}
case $step in
    1)
        # the GGUF writer needs the gguf wheel, which gpu_run.sh installs into /tmp/site first
        (sleep 25; PYTHONPATH=/tmp/site python3 benchmarks/vllm_gguf_peer.py --write-only >/tmp/gguf_write.log 2>&1) &
        q=tests/test_quant_kernels.py
        GPU_TESTS="tests/test_gpu.py tests/test_triton_kernels.py tests/test_sliding_window.py \
$q::test_gluon_gemv_llama3_8b_shapes_on_gpu $q::test_kernel_on_gpu \
$q::test_quantized_models_on_gpu $q::test_fp8_kv_attention_on_gpu" LIMIT_tests=470 TRITON_CACHE_OUT=1 \
            bash benchmarks/gpu_run.sh tests
        wait
        cp /tmp/gguf_write.log "$OUT/" 2>/dev/null
        ;;
    2)
        AB_BASE=${AB_BASE:?set AB_BASE to the commit unpacked in .old} AB_FORMATS=${AB_FORMATS:-bf16 awq} LIMIT_ab=300 \
            bash benchmarks/gpu_run.sh ab
        for q in awq fp8 gguf_q4_k; do
            python3 benchmarks/profile_decode.py engine --tp 1 --engine-batches 1 --async-modes on --steps 64 \
                --quantization $q --out "$OUT" >"$OUT/profile_$q.log" 2>&1
        done
        ;;
    3)
        if [[ ! -d /tmp/vsite ]]; then
            mkdir -p /tmp/vsite && cat /tmp/vc/part.* | LD_LIBRARY_PATH=/tmp/vc/bin /tmp/vc/bin/zstd -dq | tar -x -C /tmp/vsite
        fi
        QUANT_VLLM="gguf_q4_k fp8" QUANT_FORMATS="bf16 fp8 gguf_q4_k" QUANT_BIG=0 bash benchmarks/gpu_run.sh quant
        ;;
    4)
        QUANT_VLLM=awq QUANT_FORMATS="bf16 awq gptq" QUANT_BIG=0 bash benchmarks/gpu_run.sh quant
        ;;
    5)
        GPU_TESTS="tests/test_quant_kernels.py" LIMIT_tests=380 bash benchmarks/gpu_run.sh tests
        PYTHONPATH=/tmp/site timeout -k 10 150 python3 benchmarks/tune_attention.py --kv-dtype fp8 --small-grid \
            --cases 512x1536,256x1536 --out "$OUT" >"$OUT/attntune.log" 2>&1
        python3 - "$OUT/tune_attention_fp8.json" <<'PY' | tee -a "$OUT/attntune.log"
import json, sys
case = json.load(open(sys.argv[1]))["cases"]["512x1536"]
rows = [r for r in case["all"][1:] if "us" in r and r["splits"] == 1]
best = min(rows, key=lambda r: r["us"])
print("default", case["default"]["us"], "us; best one-split tile", best)
if best["us"] < 0.98 * case["default"]["us"]:
    open("/tmp/attn_best.txt", "w").write(f"{best['block_n']},{best['warps']},{best['stages']}")
PY
        ;;
    6)
        export PYTHONPATH=/tmp/site:$PWD
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        {
            mkdir -p "$OUT/s0" "$OUT/s1" "$OUT/s0b"
            FERRUM_SILU_GEMV=0 python3 benchmarks/quant_bench.py latency --formats bf16 fp8 awq gptq gguf_q4_k --out "$OUT/s0"
            FERRUM_SILU_GEMV=1 python3 benchmarks/quant_bench.py latency --formats bf16 fp8 --out "$OUT/s1"
            FERRUM_SILU_GEMV=0 python3 benchmarks/quant_bench.py latency --formats bf16 fp8 --out "$OUT/s0b"
            if nvidia-smi -L | grep -q H200; then python3 benchmarks/quant_bench.py big --out "$OUT"; fi
        } >"$OUT/latency.log" 2>&1
        ;;
    7)
        if [[ ! -d /tmp/vsite ]]; then
            mkdir -p /tmp/vsite && cat /tmp/vc/part.* | LD_LIBRARY_PATH=/tmp/vc/bin /tmp/vc/bin/zstd -dq | tar -x -C /tmp/vsite
        fi
        LIMIT_fp8=400 bash benchmarks/gpu_run.sh fp8
        if [[ -f /tmp/attn_best.txt ]]; then
            mkdir -p "$OUT/tuned"
            OUT=$OUT/tuned VLLM_SITE=/nonexistent FERRUM_DECODE_ATTN_CONFIG=$(cat /tmp/attn_best.txt) \
                LIMIT_fp8=150 bash benchmarks/gpu_run.sh fp8
        fi
        ;;
    8)
        (sleep 25; PYTHONPATH=/tmp/site python3 benchmarks/vllm_gguf_peer.py --write-only >/tmp/gguf_write.log 2>&1) &
        # the kernel tests over 8 workers; test_gpu.py's engines size their KV pool from the GPU's
        # free memory, so they run alone, after
        OUT=$OUT/kernels GPU_TESTS="-n 8 tests/test_sampler.py tests/test_triton_kernels.py tests/test_quant_kernels.py \
tests/test_moe.py tests/test_sliding_window.py" LIMIT_tests=330 bash benchmarks/gpu_run.sh tests
        OUT=$OUT/engine GPU_TESTS="tests/test_gpu.py" LIMIT_tests=200 bash benchmarks/gpu_run.sh tests
        wait
        cp /tmp/gguf_write.log "$OUT/" 2>/dev/null
        ;;
    9)
        export PYTHONPATH=/tmp/site:$PWD
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        profiles
        if nvidia-smi -L | grep -q H200; then   # 70 GB of FP8 weights: not on an 80 GB H100
            timeout -k 10 240 python3 benchmarks/quant_bench.py big --out "$OUT" >"$OUT/big.log" 2>&1
        fi
        ;;
    10)
        if [[ ! -d /tmp/vsite ]]; then
            mkdir -p /tmp/vsite && cat /tmp/vc/part.* | LD_LIBRARY_PATH=/tmp/vc/bin /tmp/vc/bin/zstd -dq | tar -x -C /tmp/vsite
        fi
        LIMIT_quant_vllm_fp8=150 LIMIT_quant_vllm_awq=150 LIMIT_quant_vllm_gguf_q4_k=170 LIMIT_quant=150 \
            QUANT_VLLM="fp8 awq gguf_q4_k" QUANT_FORMATS="bf16 fp8 awq gguf_q4_k" QUANT_BIG=0 bash benchmarks/gpu_run.sh quant
        ;;
    11)
        LIMIT_nanovllm=300 bash benchmarks/gpu_run.sh nanovllm
        ;;
    12)
        # step 8's tests in one call, without the GGUF writer (when the budget is short)
        OUT=$OUT/kernels GPU_TESTS="-n 8 tests/test_sampler.py tests/test_triton_kernels.py tests/test_quant_kernels.py \
tests/test_moe.py tests/test_sliding_window.py" LIMIT_tests=${LIMIT_kernels:-330} bash benchmarks/gpu_run.sh tests
        OUT=$OUT/engine GPU_TESTS="tests/test_gpu.py" LIMIT_tests=240 bash benchmarks/gpu_run.sh tests
        ;;
    13)
        export PYTHONPATH=/tmp/site:$PWD
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        profiles
        ;;
    14)
        AB_COMMIT=${AB_COMMIT:-2d19606} bash benchmarks/sched_ab.sh
        ;;
    15)
        if [[ ! -d /tmp/vsite ]]; then
            mkdir -p /tmp/vsite && cat /tmp/vc/part.* | LD_LIBRARY_PATH=/tmp/vc/bin /tmp/vc/bin/zstd -dq | tar -x -C /tmp/vsite
        fi
        PYTHONPATH=/tmp/site LIMIT_tput=470 bash benchmarks/gpu_run.sh tput
        ;;
    16)
        # the decode attention over both page layouts (token-major [PAGE, Hkv, D] as the engine
        # holds them, head-major [Hkv, PAGE, D] seen through strides), Qwen3-0.6B and Llama-3-8B heads
        for heads in 16,8 32,8; do
            timeout -k 10 80 python3 benchmarks/tune_attention.py --heads $heads --default-only --layouts both \
                --grid-orders both --cases 256x640,128x1100,256x1536,32x1024 --tag "layout_${heads/,/_}" \
                --out "$OUT" >>"$OUT/tune_layout.log" 2>&1
        done
        # Qwen3-0.6B's decode graph at the nano-vllm workload's tail batches (1-64 rows at 1,500
        # tokens of context): GPU ms per step and its kernels (12-01c's step log: 2.5 ms per step
        # at 13 rows against 0.95 at 1, ~3x their bytes at spec)
        timeout -k 10 150 python3 benchmarks/profile_decode.py replay --model qwen3-0.6b --tp 1 --gemv-modes 1 \
            --batches 1 2 4 8 16 32 64 --context 1500 --out "$OUT" >"$OUT/replay_qwen3.log" 2>&1
        # the nano-vllm workload, ferrum alone, with its step log and kernel profile: where the
        # decode steps' time goes (decode_mbu in nanovllm_steplog.json; steplog/step_log.md)
        timeout -k 10 240 python3 -m ferrum.entrypoints.cli bench throughput benchmarks/configs/qwen3-0.6b.json \
            --load-format dummy --dtype bfloat16 --device cuda --max-num-seqs 256 --max-model-len 4096 \
            --max-num-batched-tokens 16384 --workload nanovllm --step-log "$OUT/steplog" \
            --out "$OUT/nanovllm_steplog.json" >"$OUT/nanovllm_steplog.log" 2>&1
        ;;
    17)
        # the engine's GPU tests and the sampler's (the bans of 2d86e47 on CUDA), then ferrum's
        # batch-1 table alone: what a call that carries .peers/vc/part.00 can run in ~300 s
        OUT=$OUT/engine GPU_TESTS="tests/test_gpu.py tests/test_sampler.py" LIMIT_tests=240 bash benchmarks/gpu_run.sh tests
        timeout -k 10 200 python3 benchmarks/quant_bench.py latency --formats bf16 fp8 awq gguf_q4_k --out "$OUT" \
            >"$OUT/quant.log" 2>&1
        ;;
    18)
        # Llama-3-70B FP8 on one H200 (70 GB of weights: not on an 80 GB H100), for a call
        # that carries .peers/vc/part.01
        if nvidia-smi -L | grep -q H200; then
            timeout -k 10 300 python3 benchmarks/quant_bench.py big --out "$OUT" >"$OUT/big.log" 2>&1
        else
            echo "not an H200: Llama-3-70B FP8 skipped" | tee "$OUT/big.log"
        fi
        ;;
    *) echo "step 1-18" >&2; exit 2 ;;
esac
# the device tool returns at most 8 files: pack them all when there are more
# (Triton's cache parts stay out: each is at most 15 MB, the limit of one returned file being 16 MiB)
if (($(find "$OUT" -type f | wc -l) > 8)); then
    (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name 'triton_cache.part.*' ! -name "step$step.tar.gz" -print0 \
        | tar -czf "step$step.tar.gz" --remove-files --null -T -)
fi
ls -la "$OUT"
