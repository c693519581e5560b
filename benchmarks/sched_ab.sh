#!/usr/bin/env bash
# A scheduler change A/B on one machine: issue 16's 1000 x (1000 in, 1000 out) bf16 Llama-3-8B
# run, ferrum alone, from this tree (sched_new.json), then from the tree of an earlier commit in
# $AB_DIR (sched_old.json; carried: `git archive $AB_COMMIT ferrum | tar -x -C .old` here
# first), then this tree again (sched_new_b.json) when the first two took under $AB_THIRD_BEFORE_S
# (default 300; each run has 240 s, the device call 600).
#   OUT=DIR FERRUM_GIT_COMMIT=sha AB_COMMIT=sha [AB_DIR=.old] bash benchmarks/sched_ab.sh
# The wheels of .whl must be in /tmp/site (gpu_run.sh installs them). CPU dry run:
#   DEVICE=cpu CFG=benchmarks/configs/tiny_llama.json AB_N=8 AB_LEN=16 OUT=/tmp/o bash benchmarks/sched_ab.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
mkdir -p "$OUT"
AB_DIR=${AB_DIR:-.old}
[[ -d $AB_DIR/ferrum ]] || { echo "no $AB_DIR/ferrum: git archive <commit> ferrum | tar -x -C $AB_DIR" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
CFG=$(realpath "${CFG:-benchmarks/configs/llama3-8b.json}")
N=${AB_N:-1000}
LEN=${AB_LEN:-1000}
NEW=$PWD
OLD=$(cd "$AB_DIR" && pwd)
run() {  # run NAME TREE COMMIT; from inside TREE: `python3 -m` puts the working directory first on sys.path
    local name=$1 tree=$2 commit=$3
    (cd "$tree" && FERRUM_GIT_COMMIT=$commit PYTHONPATH=/tmp/site:$tree timeout -k 10 240 \
        python3 -m ferrum.entrypoints.cli bench throughput "$CFG" --load-format dummy --dtype bfloat16 \
        --device "${DEVICE:-cuda}" --num-prompts "$N" --input-len "$LEN" "$LEN" --output-len "$LEN" "$LEN" \
        --max-num-seqs 512 --max-num-batched-tokens 8192 --max-model-len $((2 * LEN + 16)) --no-sequential \
        --out "$OUT/sched_$name.json" >"$OUT/sched_$name.log" 2>&1)
    echo "== $name ($tree, $commit)"; tail -4 "$OUT/sched_$name.log"
}
start=$SECONDS
run new "$NEW" "${FERRUM_GIT_COMMIT:-new}"
run old "$OLD" "${AB_COMMIT:-old}"
if ((SECONDS - start < ${AB_THIRD_BEFORE_S:-300})); then run new_b "$NEW" "${FERRUM_GIT_COMMIT:-new}"; fi
