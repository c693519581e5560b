"""python3 benchmarks/probe_blas.py (GPU): F.linear at Llama-3-8B's prefill GEMM shapes (1,024
and 7,500 rows) under torch's two BLAS back-ends, cuBLAS and cuBLASLt: median of 20
CUDA-event timings and TFLOP/s. Writes $OUT/probe_blas.json."""
import json, os, statistics, torch
import torch.nn.functional as F
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
res = {}
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    for M in (1024, 7500):
        for name, (N, K) in SHAPES.items():
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(3):
                F.linear(x, w)
            ts = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); F.linear(x, w); b.record(); b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            us = statistics.median(ts)
            res[f"{lib}/{M}/{name}"] = {"us": round(us, 1), "tflops": round(2 * M * N * K / us / 1e6, 1)}
            print(lib, M, name, res[f"{lib}/{M}/{name}"], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_blas.json"), "w"), indent=1)
