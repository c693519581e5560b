#!/usr/bin/env bash
# Issue 16's GPU run: the -m gpu tests, then ferrum against vLLM and gpt-fast through
# `ferrum bench` (one harness), on an H200 machine, every log and JSON under $OUT.
#
#   OUT=DIR [PEERS_DIR=.peers] [VLLM_SITE=/tmp/vsite] [FERRUM_GIT_COMMIT=sha] \
#       bash benchmarks/gpu_run.sh SECTION...
#
# Sections, run in the order given, each under its own time limit (LIMIT_<section> seconds
# overrides it); a section that fails or runs out of time is recorded and the next one runs:
#   tests     (a) pytest -m gpu -rA over $GPU_TESTS (default tests/test_gpu.py, test_sampler.py,
#             test_triton_kernels.py, test_quant_kernels.py, test_moe.py, test_sliding_window.py,
#             test_structured_output.py                    limit 480 s
#   latency   (b) Llama-3-8B (dummy bf16) batch 1, 128 in / 512 out: decode tok/s, TTFT, MBU
#             (spec 4.8 TB/s and the measured GEMV roofline), vLLM and gpt-fast side by side   330 s
#   ttft      (c) TTFT at 128 / 1024 / 7500-token prompts, cached and cold, vLLM cold        300 s
#   nanovllm  (d) nano-vllm's workload on Qwen3-0.6B (dummy bf16) vs vLLM                  240 s
#   sweep     issue 16 goal 2: decode over batch sizes $SWEEP_BATCHES on Qwen3-0.6B (dummy
#             bf16), SWEEP_IN_LEN in / SWEEP_OUT_LEN out: step time, the host's share of each
#             step (CUDA-graph replay vs wall), sampler time, MBU; a PNG beside the JSON       240 s
#   tp2       (e) Llama-3-8B batch 1 at TP=1 and TP=2 (tp2_speedup), vLLM at TP=2; skipped
#             with fewer than 2 GPUs                                                     240 s
#   quantkern issue 15: every batch-1 GEMV (bf16, FP8, 4-bit, GGUF) at the Llama-3-8B matrices
#             over a grid of tile configs (benchmarks/quant_bench.py kernels)            180 s
#   quant     issue 15: vLLM batch 1 in each format of $QUANT_VLLM (default awq; fp8, and
#             gguf_q4_k through benchmarks/vllm_gguf_peer.py), then ferrum in $QUANT_FORMATS
#             (default all five) and, QUANT_BIG=1, Llama-3-70B FP8 on one GPU (quant_bench.py
#             latency big, *_vs_vllm)                                                    420 s
#   ab        ferrum batch-1 latency in $AB_FORMATS (bf16 awq) from commit $AB_BASE's tree in
#             $AB_DIR (carried: `git archive $AB_BASE ferrum benchmarks | tar -x -C .old`), then
#             from this tree, in one command                                             400 s
#   moe       issue 17: vLLM on the Qwen3-30B-A3B shape (benchmarks/vllm_moe_peer.py), then
#             ferrum (benchmarks/moe_bench.py latency batch256 nanovllm, *_vs_vllm)      480 s
#   tput      issue 16: 1000 x (1000 in, 1000 out), bf16, ferrum at TPUT_SEQS (512) sequences
#             per step, then vLLM, in one `ferrum bench throughput` (output_tok_s_vs_vllm) 480 s
#   fp8       issue 15: the same with FP8 weights + FP8 KV cache, vLLM with VB_QUANT=fp8
#             VB_KV=fp8 (its driver: quantization="fp8", kv_cache_dtype="fp8")           480 s
#   lpt       issue 16 goal 2: the nano-vllm workload (no peer) with decode rows in arrival order,
#             longest context first, arrival order again (FERRUM_LONGEST_DECODE_FIRST=0/1/0;
#             nanovllm_lpt{0,1,0b}.json)                                                  150 s
#   silu      the SiLU-mul folded into down_proj's GEMV: its GPU tests, then batch-1 latency in bf16
#             and FP8 with FERRUM_SILU_GEMV=0 and =1 in one section (quant_latency_silu{0,1}.json)  300 s
#   gluon     issue 15: the Gluon GEMVs' GPU tests, their sweep at 1 and 4 rows against the Triton
#             GEMVs (quant_bench.py kernels --grid gluon), GLUON_GEMV_CONFIGS pasted from it into
#             this tree, then batch-1 latency in bf16 / FP8 / AWQ / GGUF Q4_K with the Gluon GEMVs
#             off and on (FERRUM_GLUON_GEMV=0/1, quant_latency_gluon{0,1}.json) and Llama-3-70B
#             FP8 (quant_bench.py big; GLUON_AB=1 skips the off run); $OUT/gemv_gluon.py is the pasted table to commit  540 s
#   w4        issue 15: the 4-bit Gluon GEMV (int16 x, dp2a): GPU tests, sweep at 1 and 4 rows
#             (pasted, merged), batch-1 bf16 / AWQ latency, AWQ on the Triton GEMV; vLLM's
#             AWQ first when it is here (*_vs_vllm)                                       560 s
#   attntune  decode attention over an FP8 cache (256 x 1536) and the prefill kernel at 1 x
#             7500 / 16 x 1024 tokens, over their tile configs and launch orders
#             (tune_attention.py --small-grid)                                           300 s
# Groups: `bench` = latency ttft nanovllm tp2; `all` = tests + bench. Planned as two commands
# of <= 9 min: `tests latency` and `ttft nanovllm` (+ `tp2` on a 2-GPU machine).
#
# Peers: PEERS_DIR holds copies of ../shared/peers/vllm_bench.py and gptfast/ (untracked,
# carried); vLLM unpacked into VLLM_SITE beforehand (../shared/peers/README.md). A peer that
# is missing is left out of that section and said so; ferrum's figures still come.
# Extra wheels the GPU machine lacks, for the tests (benchmarks of unconstrained generation need
# none: llguidance is imported by a first constrained request) (llguidance; gguf, the GGUF kernel test's reference decoder;
# pytest-xdist + execnet (-n N in GPU_TESTS for the kernel tests); jsonschema with attrs, referencing, jsonschema-specifications and rpds-py (cp312), which
# test_structured_output imports): *.whl in WHEELS (default .whl) are installed to /tmp/site first. Outside git (a copied tree) the records name
# $FERRUM_GIT_COMMIT.
#
# Triton's compiled kernels (a fresh machine compiles every config the GPU tests check: most of
# their time): parts of a cache tarball in TRITON_CACHE_IN (default .triton_cache, carried) seed
# TRITON_CACHE_DIR (/tmp/triton_cache), which every process of the run uses; TRITON_CACHE_OUT=1
# packs that cache at the end into $OUT/triton_cache.part.* (15 MB each, at most 4: what the device
# tool returns), to copy into .triton_cache here and carry in a later lease's first call.
#
# Files under $OUT: <section>.log per section (with a header: date, commit, command, hardware,
# versions), <section>.json per benchmark, tests.xml (JUnit), summary.txt; if more than 8
# files result, the logs are packed into logs.tar.gz (the device tool returns at most 8).
#
# Dry run on a CPU (tiny models, fake peers; what tests/test_gpu_run.py does):
#   DEVICE=cpu LLAMA=tiny_llama.json SMALL=tiny_qwen3.json LAT_OUT_LEN=16 PEERS_DIR=fake VLLM_SITE=fake
#   TTFT_LENS="16 64" FORCE_TP2=1 OUT=/tmp/o bash benchmarks/gpu_run.sh all
set -u -o pipefail
SCRIPT_ARGS="$*"
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the logs and JSON}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
PEERS_DIR=${PEERS_DIR:-.peers}
VLLM_SITE=${VLLM_SITE:-/tmp/vsite}
WHEELS=${WHEELS:-.whl}
LLAMA=${LLAMA:-benchmarks/configs/llama3-8b.json}
SMALL=${SMALL:-benchmarks/configs/qwen3-0.6b.json}
LAT_IN_LEN=${LAT_IN_LEN:-128}
LAT_OUT_LEN=${LAT_OUT_LEN:-512}
TTFT_LENS=${TTFT_LENS:-128 1024 7500}   # 7500: see ferrum bench ttft --help
# tput / fp8: TPUT_N prompts x (TPUT_LEN in, TPUT_LEN out), ferrum at TPUT_SEQS sequences per step
# (vLLM's LLM class defaults to 1024 on an H200: its KV pool is then the limit)
TPUT_N=${TPUT_N:-1000}
TPUT_LEN=${TPUT_LEN:-1000}
TPUT_SEQS=${TPUT_SEQS:-512}
SWEEP_BATCHES=${SWEEP_BATCHES:-1 8 32 64 128 256}
SWEEP_IN_LEN=${SWEEP_IN_LEN:-128}
SWEEP_OUT_LEN=${SWEEP_OUT_LEN:-64}
GLUON_AB=${GLUON_AB:-0 1}   # gluon: the FERRUM_GLUON_GEMV values whose batch-1 latency is measured
QUANT_VLLM=${QUANT_VLLM:-awq}                               # quant: vLLM's formats (fp8 awq gguf_q4_k)
QUANT_FORMATS=${QUANT_FORMATS:-bf16 fp8 awq gptq gguf_q4_k}  # quant: ferrum's formats
QUANT_BIG=${QUANT_BIG:-1}                                   # quant: also Llama-3-70B FP8 (1) or not (0)
AB_BASE=${AB_BASE:-base}; AB_DIR=${AB_DIR:-.old}; AB_FORMATS=${AB_FORMATS:-bf16 awq}   # ab
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on the shared H200 hosts (KINDS.md), in every process we start
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FERRUM_GIT_COMMIT=${FERRUM_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export FERRUM_GIT_COMMIT

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TRITON_CACHE_IN=${TRITON_CACHE_IN:-.triton_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G "$TRITON_CACHE_IN/triton_cache.part.*" >/dev/null; then
    cat "$TRITON_CACHE_IN"/triton_cache.part.* | tar -xz -C "$TRITON_CACHE_DIR" \
        && echo "== Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files from $TRITON_CACHE_IN"
fi
# The real SmolLM2 GGUF for the GPU tests that need it (test_structured_output): the GPU machine
# cannot download it, so carry it in pieces (`split -b 50000000 <its file> .peers/sm/part.`, one
# piece per transfer) and copy each to $SMOLLM2_PARTS; it is joined into the model cache here
# (`ferrum pull` then finds it and checks its sha256).
SMOLLM2_PARTS=${SMOLLM2_PARTS:-/tmp/sm}
if compgen -G "$SMOLLM2_PARTS/part.*" >/dev/null; then
    export FERRUM_HOME=${FERRUM_HOME:-/tmp/ferrum_home}
    smollm2=$("$PY" -c "import os; from ferrum.model_store import known_model, models_dir; m = known_model('smollm2'); print(os.path.join(models_dir(), m.name, m.filename))")
    if [[ ! -f $smollm2 ]]; then
        mkdir -p "$(dirname "$smollm2")" && cat "$SMOLLM2_PARTS"/part.* >"$smollm2.partial" && mv "$smollm2.partial" "$smollm2"
    fi
fi
FERRUM=("$PY" -m ferrum.entrypoints.cli)
UNIGNORE_INT='import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])'

sections=()
for s in "${@:-all}"; do
    case $s in
        all) sections+=(tests latency ttft nanovllm tp2) ;;
        bench) sections+=(latency ttft nanovllm tp2) ;;
        tests|latency|ttft|nanovllm|lpt|sweep|tp2|tput|quantkern|quant|moe|fp8|attntune|gluon|silu|w4|ab) sections+=("$s") ;;
        *) echo "unknown section $s (tests latency ttft nanovllm lpt sweep tp2 tput quantkern quant moe fp8 attntune gluon silu w4 ab | bench | all)" >&2; exit 2 ;;
    esac
done

# Peers present on this machine: vLLM needs its driver and its unpacked site, gpt-fast its driver.
peers=()
peer_flags=()
if [[ -f $PEERS_DIR/vllm_bench.py && -d $VLLM_SITE ]]; then peers+=(vllm); fi
if [[ -f $PEERS_DIR/gptfast/peer_bench.py ]]; then peers+=(gpt-fast); fi
peer_flags=(--peers-dir "$PEERS_DIR" --peer-env "PYTHONPATH=$VLLM_SITE" --peer-env VLLM_USE_FLASHINFER_SAMPLER=0)
has_peer() { [[ " ${peers[*]} " == *" $1 "* ]]; }
# the peers of $@ that are here, as `--peers ...` (nothing when none is)
peers_of() {
    local here=()
    for p in "$@"; do has_peer "$p" && here+=("$p"); done
    ((${#here[@]})) && echo "--peers ${here[*]}"
}

ngpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

header() {   # $1: section, $2...: its command
    local sec=$1; shift
    echo "== section $sec, $(date -u +%FT%TZ), commit $FERRUM_GIT_COMMIT"
    echo "== command: $*"
    echo "== script: benchmarks/gpu_run.sh $SCRIPT_ARGS (OUT=$OUT PEERS_DIR=$PEERS_DIR VLLM_SITE=$VLLM_SITE DEVICE=$DEVICE)"
    echo "== peers here: ${peers[*]:-none}; GPUs: $ngpus"
    "$PY" - "$DEVICE" <<'EOF' 2>&1
import json, subprocess, sys
from ferrum.benchmarks.run_record import environment_vars, hardware, software_versions
dev = sys.argv[1]
try:
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    gpus = None
print("== info:", json.dumps({"hardware": hardware(dev), "software": software_versions(),
                             "environment": environment_vars(), "nvidia_smi_L": gpus}))
EOF
}

# Kill what a section left on the GPU (vLLM workers outlive their driver; the machine is ours alone).
free_gpu() {
    command -v nvidia-smi >/dev/null || return 0
    local pids
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
    if [[ -n $pids ]]; then
        echo "== killing processes left on the GPU: $pids"
        kill -9 $pids 2>/dev/null
        sleep 3
    fi
}

declare -A LIMIT=([sweep]=240 [gluon]=540 [quant_vllm_awq]=200 [quant_vllm_fp8]=200 [quant_vllm_gguf_q4_k]=300 [ab]=400 [moe_vllm]=300 [tests]=480 [latency]=330 [ttft]=300 [nanovllm]=240 [lpt]=150 [tp2]=240 [quantkern]=240 [quant]=420 [moe]=480 [tput]=480 [fp8]=480 [attntune]=300 [w4]=560 [silu]=300)
summary=$OUT/summary.txt
echo "gpu_run.sh ${sections[*]} at commit $FERRUM_GIT_COMMIT, $(date -u +%FT%TZ), device $DEVICE, $ngpus GPU(s), peers: ${peers[*]:-none}" >>"$summary"

run_section() {   # $1: section, $2...: command; SIGINT at the limit (pytest and the peers' clean-up act on it)
    local sec=$1; shift
    local var=LIMIT_$sec limit=${LIMIT[$sec]}
    limit=${!var:-$limit}
    local log=$OUT/$sec.log t0=$SECONDS rc
    { header "$sec" "$@"; echo "== limit ${limit} s"; } >"$log"
    echo "[$(date -u +%T)] $sec (limit ${limit} s): $*"
    # SIGINT at the limit: pytest prints its summary, `ferrum bench` kills its peer's process
    # group. A job started in the background inherits SIGINT ignored, and Python then ignores
    # it too: reset it to the default before exec, so Python installs its handler.
    timeout -s INT -k 30 "$limit" "$PY" -c "$UNIGNORE_INT" "$@" >>"$log" 2>&1
    rc=$?
    free_gpu >>"$log" 2>&1
    local how="exit $rc"
    ((rc == 124 || rc == 137)) && how="TIMED OUT after ${limit} s (exit $rc)"
    echo "$sec: $how, $((SECONDS - t0)) s" | tee -a "$summary"
    tail -n 25 "$log"
}

for sec in "${sections[@]}"; do
    case $sec in
    tests)
        # GPU_TESTS (space-separated files or test ids) replaces the default list
        read -r -a tests <<<"${GPU_TESTS:-tests/test_gpu.py tests/test_sampler.py tests/test_triton_kernels.py tests/test_quant_kernels.py tests/test_moe.py tests/test_sliding_window.py tests/test_structured_output.py}"
        extra=()
        # per test: check_int4_gemv alone compiles for ~140 s; one of 8 xdist workers it was cut
        # off at 150 (h100-2026-12-07c; it passed alone). TEST_TIMEOUT overrides.
        "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout "${TEST_TIMEOUT:-240}")
        if ! "$PY" -c "import gguf" 2>/dev/null; then
            # its reference decoder is the gguf package: carry its wheel in $WHEELS to run it
            extra+=(--deselect "tests/test_quant_kernels.py::test_kernel_on_gpu[check_gguf_gemv]")
            echo "tests: check_gguf_gemv deselected (no gguf package here; carry its wheel in $WHEELS)" | tee -a "$summary"
        fi
        # a module that cannot be imported (a missing wheel: jsonschema on 2026-12-02) is one
        # error in the report, and the other modules still run
        run_section tests "$PY" -m pytest -m gpu -rA -v --durations=25 -p no:cacheprovider --continue-on-collection-errors \
            --junitxml="$OUT/tests.xml" "${extra[@]}" "${tests[@]}"
        ;;
    latency)
        # shellcheck disable=SC2046
        run_section latency "${FERRUM[@]}" bench latency "$LLAMA" --load-format dummy --dtype bfloat16 \
            --device "$DEVICE" --max-num-seqs 8 --max-model-len $((LAT_IN_LEN + LAT_OUT_LEN + 16)) \
            --input-len "$LAT_IN_LEN" --output-len "$LAT_OUT_LEN" --num-iters 3 --no-hf \
            $(peers_of vllm gpt-fast) "${peer_flags[@]}" --peer-timeout 200 --out "$OUT/latency.json"
        ;;
    ttft)
        # shellcheck disable=SC2086,SC2046
        run_section ttft "${FERRUM[@]}" bench ttft "$LLAMA" --load-format dummy --dtype bfloat16 \
            --device "$DEVICE" --max-num-seqs 8 --prompt-lens $TTFT_LENS --modes cached cold \
            --vllm-modes cold --num-iters 5 $(peers_of vllm) "${peer_flags[@]}" --peer-timeout 120 \
            --out "$OUT/ttft.json"
        ;;
    nanovllm)
        # shellcheck disable=SC2046
        run_section nanovllm "${FERRUM[@]}" bench throughput "$SMALL" --load-format dummy --dtype bfloat16 \
            --device "$DEVICE" --max-num-seqs 256 --max-model-len 4096 --max-num-batched-tokens 16384 \
            --workload nanovllm $(peers_of vllm) "${peer_flags[@]}" --peer-timeout 180 --out "$OUT/nanovllm.json"
        ;;
    lpt)
        run_section lpt bash -c "for v in 0 1 0b; do FERRUM_LONGEST_DECODE_FIRST=\${v%b} ${FERRUM[*]} bench throughput \
            '$SMALL' --load-format dummy --dtype bfloat16 --device '$DEVICE' --max-num-seqs 256 --max-model-len 4096 \
            --max-num-batched-tokens 16384 --workload nanovllm --out '$OUT'/nanovllm_lpt\$v.json || exit 1; done"
        ;;
    sweep)
        # shellcheck disable=SC2086
        run_section sweep "${FERRUM[@]}" bench sweep "$SMALL" --load-format dummy --dtype bfloat16 \
            --device "$DEVICE" --max-num-seqs 256 --batch-sizes $SWEEP_BATCHES --input-len "$SWEEP_IN_LEN" \
            --output-len "$SWEEP_OUT_LEN" --plot "$OUT/sweep.png" --out "$OUT/sweep.json"
        ;;
    tp2)
        if ((ngpus < 2)) && [[ -z ${FORCE_TP2:-} ]]; then
            echo "tp2: skipped, $ngpus GPU(s) visible" | tee -a "$summary"
            continue
        fi
        # shellcheck disable=SC2046
        run_section tp2 "${FERRUM[@]}" bench latency "$LLAMA" --load-format dummy --dtype bfloat16 \
            --device "$DEVICE" --max-num-seqs 8 --max-model-len $((LAT_IN_LEN + LAT_OUT_LEN + 16)) \
            --input-len "$LAT_IN_LEN" --output-len "$LAT_OUT_LEN" --num-iters 3 --no-hf --tp-sizes 1 2 \
            --peer-tp-sizes 2 $(peers_of vllm) "${peer_flags[@]}" --peer-timeout 200 --out "$OUT/tp2.json"
        ;;
    quantkern)
        run_section quantkern "$PY" benchmarks/quant_bench.py kernels --out "$OUT"
        ;;
    quant)
        # vLLM's batch-1 figure in each format of QUANT_VLLM first (each in its own process
        # group, killed by free_gpu; gguf_q4_k through benchmarks/vllm_gguf_peer.py, which writes
        # its Q4_K file first), then ferrum in QUANT_FORMATS (+ Llama-3-70B FP8 with QUANT_BIG=1),
        # reading vLLM's files from $OUT for the *_vs_vllm ratios
        if has_peer vllm; then
            for f in $QUANT_VLLM; do
                if [[ $f == gguf_q4_k ]]; then
                    run_section quant_vllm_$f env "PYTHONPATH=$VLLM_SITE:${PYTHONPATH:-}" VLLM_USE_FLASHINFER_SAMPLER=0 \
                        OUT="$OUT" setsid "$PY" benchmarks/vllm_gguf_peer.py
                else
                    run_section quant_vllm_$f env "PYTHONPATH=$VLLM_SITE" VLLM_USE_FLASHINFER_SAMPLER=0 VB_QUANT=$f \
                        PEER_CONFIGS=benchmarks/configs OUT="$OUT" setsid "$PY" "$PEERS_DIR/vllm_bench.py" latency 1
                fi
            done
        fi
        big=()
        [[ $QUANT_BIG == 1 ]] && big=(big)
        # shellcheck disable=SC2086
        run_section quant "$PY" benchmarks/quant_bench.py latency "${big[@]}" --formats $QUANT_FORMATS --out "$OUT" \
            --vllm-dir "$OUT"
        ;;
    ab)
        # the same batch-1 latency (AB_FORMATS) from the tree of commit AB_BASE, unpacked (git
        # archive of ferrum/ and benchmarks/) in AB_DIR and carried, then from this tree: the
        # ratio of one change in one command (quant_latency_base.json, quant_latency.json)
        # shellcheck disable=SC2086
        run_section ab bash -c "mkdir -p '$OUT/base' && cd '$AB_DIR' && PYTHONPATH='$PWD/$AB_DIR:/tmp/site' FERRUM_GIT_COMMIT=$AB_BASE \
            '$PY' benchmarks/quant_bench.py latency --formats $AB_FORMATS --out '$OUT/base' \
            && mv '$OUT/base/quant_latency.json' '$OUT/quant_latency_base.json'; cd '$PWD' \
            && '$PY' benchmarks/quant_bench.py latency --formats $AB_FORMATS --out '$OUT'"
        ;;
    tput)
        # shellcheck disable=SC2046
        run_section tput "${FERRUM[@]}" bench throughput "$LLAMA" --load-format dummy --dtype bfloat16 \
            --device "$DEVICE" --num-prompts $TPUT_N --input-len $TPUT_LEN $TPUT_LEN --output-len $TPUT_LEN $TPUT_LEN \
            --max-num-seqs $TPUT_SEQS --max-num-batched-tokens 8192 --max-model-len $((2 * TPUT_LEN + 16)) \
            --no-sequential $(peers_of vllm) "${peer_flags[@]}" --peer-timeout 300 --out "$OUT/tput.json"
        ;;
    fp8)
        # shellcheck disable=SC2046
        run_section fp8 "${FERRUM[@]}" bench throughput "$LLAMA" --load-format dummy --dtype bfloat16 \
            --device "$DEVICE" --quantization fp8 --kv-cache-dtype fp8 --num-prompts $TPUT_N \
            --input-len $TPUT_LEN $TPUT_LEN --output-len $TPUT_LEN $TPUT_LEN --max-num-seqs $TPUT_SEQS \
            --max-num-batched-tokens 8192 --max-model-len $((2 * TPUT_LEN + 16)) --no-sequential $(peers_of vllm) \
            "${peer_flags[@]}" --peer-env VB_QUANT=fp8 --peer-env VB_KV=fp8 --peer-timeout 300 --out "$OUT/fp8.json"
        ;;
    silu)
        run_section silu bash -c "'$PY' -m pytest -m gpu -rA -q -p no:cacheprovider tests/test_quant_kernels.py \
            -k 'silu'; for v in 0 1; do mkdir -p '$OUT'/s\$v && FERRUM_SILU_GEMV=\$v '$PY' benchmarks/quant_bench.py \
            latency --formats bf16 fp8 --out '$OUT'/s\$v && mv '$OUT'/s\$v/quant_latency.json \
            '$OUT'/quant_latency_silu\$v.json; done"
        ;;
    gluon)
        run_section gluon bash -c "'$PY' -m pytest -m gpu -rA -q -p no:cacheprovider tests/test_quant_kernels.py -k gluon; \
            '$PY' benchmarks/quant_bench.py kernels --grid gluon --rows 1 4 --gemm-rows --kernels bf16 gbf16 fp8 gfp8 \
            w4 gw4 gguf_12 gq4_k --out '$OUT' && '$PY' benchmarks/paste_gemv_configs.py '$OUT/quant_kernels.json' \
            --tables GLUON_GEMV_CONFIGS && cp ferrum/ops/gemv_gluon.py '$OUT/' && for g in $GLUON_AB; do mkdir -p '$OUT'/g\$g; \
            FERRUM_GLUON_GEMV=\$g '$PY' benchmarks/quant_bench.py latency --formats bf16 fp8 awq gguf_q4_k \
            --out '$OUT'/g\$g && mv '$OUT'/g\$g/quant_latency.json '$OUT'/quant_latency_gluon\$g.json; done; \
            '$PY' benchmarks/quant_bench.py big --out '$OUT'"
        ;;
    w4)
        # vLLM's AWQ figure first when it is here (as in `quant`), then in one section: the GPU
        # tests of the Gluon GEMVs and the integer copies of x, the 4-bit sweep at 1 and 4 rows
        # (Triton w4 at its config, Gluon gw4 over its grid) pasted into GLUON_GEMV_CONFIGS
        # (merged), batch-1 latency of bf16 and AWQ (*_vs_vllm when vLLM ran), then AWQ on the
        # Triton GEMV (FERRUM_GLUON_GEMV=0: quant_latency_awq_triton.json)
        if has_peer vllm; then
            run_section quant_vllm_awq env "PYTHONPATH=$VLLM_SITE" VLLM_USE_FLASHINFER_SAMPLER=0 VB_QUANT=awq \
                PEER_CONFIGS=benchmarks/configs OUT="$OUT" setsid "$PY" "$PEERS_DIR/vllm_bench.py" latency 1
        fi
        run_section w4 bash -c "'$PY' -m pytest -m gpu -rA -q -p no:cacheprovider tests/test_quant_kernels.py \
            -k 'gluon or act_quant'; '$PY' benchmarks/quant_bench.py kernels --grid gluon --rows 1 4 --gemm-rows \
            --kernels w4 gw4 --out '$OUT' && '$PY' benchmarks/paste_gemv_configs.py '$OUT/quant_kernels.json' \
            --tables GLUON_GEMV_CONFIGS --merge && cp ferrum/ops/gemv_gluon.py '$OUT/'; \
            '$PY' benchmarks/quant_bench.py latency --formats bf16 awq --out '$OUT' --vllm-dir '$OUT'; mkdir -p '$OUT/t' \
            && FERRUM_GLUON_GEMV=0 '$PY' benchmarks/quant_bench.py latency --formats awq --out '$OUT/t' \
            && mv '$OUT/t/quant_latency.json' '$OUT/quant_latency_awq_triton.json'"
        ;;
    attntune)
        run_section attntune bash -c "'$PY' benchmarks/tune_attention.py --kv-dtype fp8 --small-grid \
            --cases 256x1536 --out '$OUT' && '$PY' benchmarks/tune_attention.py --cases '' --small-grid \
            --prefill-cases 1x7500,16x1024 --out '$OUT'"
        ;;
    moe)
        if has_peer vllm; then
            run_section moe_vllm env "PYTHONPATH=$VLLM_SITE" VLLM_USE_FLASHINFER_SAMPLER=0 OUT="$OUT" \
                setsid "$PY" benchmarks/vllm_moe_peer.py latency batch256 nanovllm
        fi
        run_section moe "$PY" benchmarks/moe_bench.py latency batch256 nanovllm --out "$OUT" --vllm-dir "$OUT"
        ;;
    esac
done

if [[ ${TRITON_CACHE_OUT:-0} == 1 ]]; then
    tar -czf - -C "$TRITON_CACHE_DIR" . | split -b 15000000 -a 1 - "$OUT/triton_cache.part."
    parts=$(find "$OUT" -maxdepth 1 -name 'triton_cache.part.*' | wc -l)
    if ((parts > 4)); then   # past what comes back: keep none rather than a torn tarball
        rm -f "$OUT"/triton_cache.part.*
        echo "Triton cache: $parts parts of 15 MB, more than 4: not kept" | tee -a "$summary"
    else
        echo "Triton cache: $parts part(s) in $OUT (copy them into .triton_cache to carry)" | tee -a "$summary"
    fi
fi
# the device tool returns at most 8 files: pack the logs when there are more
if (($(find "$OUT" -maxdepth 1 -type f | wc -l) > 8)); then
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.xml 2>/dev/null && rm -f ./*.log ./*.xml)
    echo "packed the logs into $OUT/logs.tar.gz" | tee -a "$summary"
fi
cat "$summary"
