"""python3 benchmarks/probe_blas.py (GPU): F.linear at Llama-3-8B's prefill GEMM shapes under
torch's two BLAS back-ends, cuBLAS and cuBLASLt: median of 20 CUDA-event timings and TFLOP/s.
PROBE_ROWS (default "1024 7500") picks the row counts, PROBE_LIBS (default "cublas cublaslt")
the back-ends; PROBE_SPLIT=1 also times each GEMM as two launches split at the last multiple of
256 rows (does the partial last tile row or wave cost more than a second launch?). Writes
$OUT/probe_blas.json."""
import json, os, sys, torch
import torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ferrum.benchmarks.mbu import cuda_event_median_us  # noqa: E402
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [int(m) for m in os.environ.get("PROBE_ROWS", "1024 7500").split()]
LIBS = os.environ.get("PROBE_LIBS", "cublas cublaslt").split()
SPLIT = os.environ.get("PROBE_SPLIT") == "1"


res = {}
for lib in LIBS:
    torch.backends.cuda.preferred_blas_library(lib)
    for M in ROWS:
        for name, (N, K) in SHAPES.items():
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            variants = {"one": lambda: torch.mm(x, w.t(), out=out)}
            m1 = M // 256 * 256
            if SPLIT and 0 < m1 < M:
                variants["split"] = lambda: (torch.mm(x[:m1], w.t(), out=out[:m1]), torch.mm(x[m1:], w.t(), out=out[m1:]))
            for v, fn in variants.items():
                us = cuda_event_median_us(fn)
                key = f"{lib}/{M}/{name}" + ("" if v == "one" else f"/{v}")
                res[key] = {"us": round(us, 1), "tflops": round(2 * M * N * K / us / 1e6, 1)}
                print(key, res[key], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_blas.json"), "w"), indent=1)
