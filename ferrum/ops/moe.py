"""Mixture-of-experts ops: the router's top-k selection and the experts' SwiGLU FFNs.

    fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start)[t]
        = sum_j topk_weights[t, j] * W2[e] (silu(G[e] x[t]) * (U[e] x[t])),
          e = topk_ids[t, j] - expert_start, over the slots j whose expert is held here
          (0 <= e < num_local_experts), with w13[e] = [G[e]; U[e]] stacked by rows.

Expert weights live in two stacked tensors per layer (vLLM's layout): w13 [E, 2*I, H]
(gate rows then up rows) and w2 [E, H, I]. Under tensor parallelism every expert's I is split
over the ranks (column/row parallel, like the dense MLP); under expert parallelism each rank
holds E / tp whole experts starting at `expert_start`. Either way the caller sums the ranks'
outputs with one all-reduce.

Dispatch (`fused_moe`): on CUDA tensors (or with FERRUM_FORCE_TRITON=1, tests under
TRITON_INTERPRET=1) the Triton kernels of `ferrum/ops/moe_triton.py`: for one token a GEMV
pair that reads only the top-k selected experts' weights, otherwise the (token, slot) pairs
sorted by expert and one grouped GEMM per projection. Else `moe_reference`, a loop over the
experts that received tokens (it too reads only those experts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.ops.triton_utils import use_triton


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of Mixtral / Qwen2-MoE / Qwen3-MoE (HF `*TopKRouter`).

    router_logits: [T, E] (any float dtype). Softmax over all E experts in float32, keep the
    top_k largest probabilities, and with `renormalize` divide them by their sum (Mixtral always
    does; for it this equals a softmax over the top-k logits). Returns (weights [T, top_k]
    float32, ids [T, top_k] int64), slots in descending probability order."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """The torch path of `fused_moe` (same arguments and result): the (token, slot) pairs are
    grouped by expert with one argsort, then per expert that received any, one GEMM for gate+up,
    SwiGLU, one GEMM for down, scaled by the routing weights and added into the output rows.
    Experts nobody chose are never touched, so a one-token step reads top_k experts. Sums in
    float32; returns x's dtype."""
    T, H = x.shape
    E = w13.shape[0]
    k = topk_ids.shape[1]
    local = (topk_ids - expert_start).flatten()
    local = torch.where((local >= 0) & (local < E), local, E)   # E: held by another rank
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=E + 1)[:E].tolist()
    flat_w = topk_weights.flatten().float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        h = F.linear(x[tokens], w13[e])
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y.float() * flat_w[pairs, None])
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """The experts of one sparse MoE block (formula in the module docstring).

    x: [T, H]; w13: [E_local, 2*I, H]; w2: [E_local, H, I] (x's dtype, unit stride on the
    last dim); topk_weights: [T, k] float32; topk_ids: [T, k] int64 global expert ids;
    expert_start: the global id of local expert 0 (expert parallelism; 0 otherwise).
    Returns [T, H] in x's dtype: this rank's partial sum (all-reduce it under TP / EP)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if use_triton(x):
        from ferrum.ops import moe_triton
        return moe_triton.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start)
    return moe_reference(x, w13, w2, topk_weights, topk_ids, expert_start)
