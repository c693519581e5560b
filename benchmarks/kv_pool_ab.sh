#!/usr/bin/env bash
# The KV pool's activation reserve (46f0fca: logits per sampled row, not per batched token), A/B
# on one machine: issue 16's 1000 x (1000 in, 1000 out) bf16 Llama-3-8B run, ferrum alone, with
# the pool this commit sizes (kv_pool_new.json), then with the pool the old reserve left,
# --num-kv-blocks = that pool - (old reserve - new reserve) / bytes per block (kv_pool_old.json).
#   OUT=DIR [FERRUM_GIT_COMMIT=sha] bash benchmarks/kv_pool_ab.sh
# The wheels of .whl must be in /tmp/site (gpu_run.sh installs them).
set -u -o pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
CFG=benchmarks/configs/llama3-8b.json
run() {  # run NAME [flags]
    local name=$1; shift
    timeout -k 10 280 python3 -m ferrum.entrypoints.cli bench throughput $CFG --load-format dummy --dtype bfloat16 \
        --device cuda --num-prompts 1000 --input-len 1000 1000 --output-len 1000 1000 --max-num-seqs 512 \
        --max-num-batched-tokens 8192 --max-model-len 2016 --no-sequential "$@" --out "$OUT/kv_pool_$name.json" \
        >"$OUT/kv_pool_$name.log" 2>&1
    tail -3 "$OUT/kv_pool_$name.log"
}
run new
old=$(python3 - "$OUT/kv_pool_new.json" "$CFG" <<'PY'
import json, sys, torch
from ferrum.config import ModelConfig
from ferrum.executor.memory import activation_reserve_bytes, compute_memory_requirements
blocks = json.load(open(sys.argv[1]))["engine"]["kv_blocks"]
m = compute_memory_requirements(ModelConfig.from_hf_dict(json.load(open(sys.argv[2]))), torch.bfloat16, 1)
old_reserve = 4 * (m.activation_bytes_per_token + m.logits_bytes_per_row) * 8192   # before 46f0fca
print(blocks - (old_reserve - activation_reserve_bytes(m, 8192, 512)) // m.kv_bytes_per_block(16))
PY
)
echo "old pool: $old blocks"
run old --num-kv-blocks "$old"
