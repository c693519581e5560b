"""Kernels: each op is one function that picks its implementation in one place and keeps its
torch code beside its Triton kernel.

- `linear.linear`: y = x W^T + b (batch-1 Triton GEMV in `gemv`, numpy BLAS in `cpu_blas`,
  else F.linear).
- `rms_norm.rms_norm` / `fused_add_rms_norm`, `rotary.apply_rotary_emb`,
  `activation.silu_and_mul`: Triton on CUDA (`triton_utils.use_triton`), torch elsewhere.
- `attention_torch` / `attention_triton`: paged attention backends with the same functions
  (`rope_write_kv`, `write_kv`, `prefill_attention`, `decode_attention`); the model runner
  picks one. `rope_kv`: the Triton kernel behind `rope_write_kv` (q/k norm, RoPE and the K/V
  store of a layer in one launch; also RoPE alone for `rotary.apply_rotary_emb`).
- `moe.fused_moe` / `moe.select_experts`: mixture-of-experts experts and routing (Triton
  grouped GEMM / batch-1 GEMV in `moe_triton` on CUDA, a loop over the chosen experts in torch).
- `triton_utils`: Triton availability and the programmatic-dependent-launch helpers.
- `fp8`, `int4`, `gguf`: linears over quantized weights (FP8 e4m3; GPTQ / AWQ 4-bit; GGUF
  blocks): Triton GEMV for 1-8 rows, a GEMM above, dequantize + F.linear on CPU.
- `sampling.gumbel_argmax`: one Triton pass over the logits for temperature-only sampling
  (the torch sampler in `ferrum.layers.sampler` covers everything else).

Layers (`ferrum.layers`) are thin modules that own parameters and call these.
"""
