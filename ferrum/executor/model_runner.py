"""Builds the model on one device (one TP rank), owns its paged KV cache and its attention
backend, and runs one forward pass for a prefill batch or a decode batch (inputs from
`model_inputs`, decode through CUDA graphs from `cuda_graph` when captured). Used by the
single-device executor and by every rank of the tensor-parallel executor."""
from __future__ import annotations

import dataclasses
import logging

import torch

from ferrum.config import KERNELS, ModelConfig, resolve_kv_cache_dtype
from ferrum.errors import CacheConfigError
from ferrum.distributed.parallel_state import get_tp
from ferrum.executor.cuda_graph import DecodeCudaGraphs, graph_batch_sizes
from ferrum.executor.memory import compute_memory_requirements
from ferrum.executor.model_inputs import prepare_decode, prepare_prefill, take_prev_sampled
from ferrum.executor.prefill_graph import PrefillCudaGraphs, PrefillGraphInputs, prefill_graph_buckets
from ferrum.executor.prompt_logprobs import compute_prompt_logprobs
from ferrum.forward_context import forward_context
from ferrum.interfaces import KvCacheHandle, PromptLogprobs
from ferrum.layers.attention import Attention
from ferrum.layers.linear import LinearBase
from ferrum.layers.quantization import get_quant_config
from ferrum.layers.vocab_embedding import ParallelLMHead
from ferrum.loader.base import ModelSource
from ferrum.loader.model_loader import init_dummy_weights, load_weights
from ferrum.models.registry import get_model_class
from ferrum.ops import attention_torch, attention_triton
from ferrum.ops import cpu_blas, cpu_packed
from ferrum.ops.triton_utils import HAS_TRITON

log = logging.getLogger("ferrum")


def _column_major_weights(model: torch.nn.Module) -> None:
    """CPU only: store every F.linear weight [out, in] with out >= in column-major (an [in, out]
    buffer; same shape, values and dtype, only strides change), so y = x W^T is a plain
    x @ (W^T) GEMM. MKL runs the usual transposed-B form through a slow path when x has 1-2
    rows; at batch >= 4 column-major is a little slower, and for out < in (down_proj) row-major
    is faster at every batch, so those stay (figures: benchmarks/results/README.md). A tied
    embedding shares the LM head's buffer: its row lookups become strided.
    Off with `KERNELS.cpu_column_major_weights` False (FERRUM_CPU_COLUMN_MAJOR_WEIGHTS=0)."""
    for mod in model.modules():
        packed = isinstance(mod, LinearBase) and mod.quant_method.name != "unquantized"
        if isinstance(mod, (LinearBase, ParallelLMHead)) and not packed:  # kernels want packed rows
            w = mod.weight
            if w.dim() == 2 and w.shape[0] >= w.shape[1] and w.is_contiguous():
                w.data = w.data.t().contiguous().t()


def _pack_weights(model: torch.nn.Module) -> None:
    """CPU float32, one process: give every unquantized linear layer and the LM head a
    oneDNN-packed copy of its weight (`weight_packed`, `ferrum.ops.cpu_packed`), which
    `ferrum.ops.linear` uses for forwards of more than one token. The plain weight stays (one-
    token forwards and a tied embedding read it). Skipped when the copies would take more than
    half of the memory available (`cpu_packed.fits`)."""
    mods = [mod for mod in model.modules()
            if isinstance(mod, (LinearBase, ParallelLMHead)) and mod.weight.dtype == torch.float32
            and not (isinstance(mod, LinearBase) and mod.quant_method.name != "unquantized")]
    extra = sum(mod.weight.numel() * mod.weight.element_size() for mod in mods)
    if not cpu_packed.fits(extra):
        log.info("CPU linears: no oneDNN-packed weight copies (%.1f GiB would exceed half of the "
                 "memory available); batched forwards use the plain weights", extra / 2**30)
        return
    for mod in mods:
        mod.weight_packed = cpu_packed.pack(mod.weight.data)


class ModelRunner:
    """One rank's model: built from `source` on `device` in `dtype` (real weights, or random
    ones with load_format "dummy"), its paged KV cache (`allocate_kv_cache`), its attention
    backend (`attn_backend`: Triton on CUDA, torch elsewhere) and its decode CUDA graphs
    (`capture_cuda_graphs`). `prefill` / `decode` run one forward pass each and return float32
    logits on TP rank 0. Raises what the loader raises (WeightLoadError,
    UnsupportedModelError)."""

    def __init__(self, source: ModelSource, device: str, dtype: torch.dtype,
                 load_format: str = "auto", seed: int = 0, progress: bool = True,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 max_model_len: int | None = None):
        self.cfg: ModelConfig = dataclasses.replace(source.config, max_model_len=max_model_len)
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        dummy = load_format == "dummy" or source.fmt == "dummy"
        self.quant_config = get_quant_config(self.cfg.quantization_config, quantization, dummy, source.fmt)
        cls = get_model_class(self.cfg)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with self.device:
                self.model = cls(self.cfg, self.quant_config).eval()
        finally:
            torch.set_default_dtype(prev)
        if dummy:
            init_dummy_weights(self.model, seed)
        else:
            load_weights(self.model, source.weights(), progress=progress)
        if self.device.type == "cpu" and KERNELS.cpu_column_major_weights:
            _column_major_weights(self.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # the paged attention every layer calls (through the forward context): Triton on CUDA
        self.attn_backend = attention_triton if HAS_TRITON and self.device.type == "cuda" else attention_torch
        # CPU fp32, one process: one-token forwards' linears run on numpy's BLAS
        # (ferrum/ops/cpu_blas.py), the others on weights packed for oneDNN (ops/cpu_packed.py)
        self.tp = get_tp()
        self.cpu_blas = self.device.type == "cpu" and dtype == torch.float32 and self.tp.size == 1
        if self.cpu_blas and KERNELS.cpu_packed_weights and cpu_packed.available():
            _pack_weights(self.model)
        self.block_size = 0   # set with the pool by allocate_kv_cache (CacheConfig.block_size)
        self.num_blocks = 0
        self.graphs = None
        self.prefill_graphs = None

    def memory_requirements(self, tp: int):
        """MemoryRequirements per rank of this model: its quantization and KV cache dtype."""
        bits = self.quant_config.weight_bits() if self.quant_config else None
        return compute_memory_requirements(self.cfg, self.dtype, tp, self.kv_cache_dtype, bits)

    def release(self) -> None:
        """Drop graphs, KV cache and weights so the device memory is free at once."""
        self.graphs = self.prefill_graphs = None
        for layer in self.attn_layers:
            layer.kv_cache = torch.empty(0)
        self.attn_layers = []
        self.model = None
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int,
                            max_prefill_tokens: int | None = None) -> None:
        """Capture decode graphs for batch sizes up to max_num_seqs and, with the Triton
        attention backend, single-sequence prefill graphs for chunks of up to
        max_prefill_tokens (the step's token budget; `prefill_graph`) (all TP ranks together)."""
        blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeCudaGraphs(self, graph_batch_sizes(max_num_seqs), blocks)
        buckets = prefill_graph_buckets(min(max_prefill_tokens or max_model_len, max_model_len))
        if self.attn_backend is attention_triton and buckets:
            self.prefill_graphs = PrefillCudaGraphs(self, buckets, blocks, pool=self.graphs.pool)

    def warmup_prefill(self, num_tokens: int) -> None:
        """Throw-away forwards of prefill chunks of up to `num_tokens` rows (every row padding:
        token 0, slot -1, query length 0 on the device, so nothing is stored and attention does
        no work), so that Triton compiles the kernels of long prefill chunks at start-up instead
        of inside the first long requests (on the H200 that cost the first nano-vllm run ~2 s:
        benchmarks/results/h200-2026-12-01c). Triton's JIT compiles one variant per class of
        each integer argument (1, a multiple of 16, other), so two chunks run: token count and
        block-table width multiples of 16, then neither. All TP ranks together."""
        full = num_tokens // 16 * 16
        try:
            for tokens, blocks in ((full, 16), (full - 1, 3)):
                if tokens > 1:
                    PrefillGraphInputs(self, tokens, blocks).forward(tokens)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError:
            # one process: start anyway (the memory plan reserves activations for this chunk,
            # so this is not expected); the kernels then compile on the first long request.
            # Under TP the other ranks wait in this forward's all-reduces: fail the start-up.
            if self.tp.size > 1:
                raise
            log.warning("warm-up prefill of %d tokens ran out of device memory; skipped", num_tokens)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def graph_replay_stats(self, bs: int, iters: int = 50, profile_steps: int = 0) -> dict | None:
        """See DecodeCudaGraphs.replay_stats; None without graphs (eager / CPU)."""
        if self.graphs is None or bs not in self.graphs.graphs:
            return None
        return self.graphs.replay_stats(bs, iters, profile_steps)

    def enable_symm_mem_all_reduce(self, allowed: bool = True) -> bool:
        """Every rank gets the same `allowed` (rank 0 decides, see symm_mem.py)."""
        from ferrum.distributed.symm_mem import try_enable_symm_mem
        if not allowed or KERNELS.disable_symm_mem:
            return False
        tp = get_tp()
        return tp.size > 1 and try_enable_symm_mem(tp.group, self.device, self.dtype)

    # ---- KV cache ---------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One [2, num_blocks, block_size, kv_heads_per_rank, head_dim] tensor per layer, in
        the KV cache dtype (float8_e4m3fn with --kv-cache-dtype fp8: K and V are stored
        divided by the layer's k_scale / v_scale), left uninitialised: zero-filling a 1 GiB CPU
        pool took seconds of start-up, and the attention backends never let a slot that was
        not written contribute (they read only positions < seq_len, or mask with `where`;
        tests/test_kv_cache_garbage.py fills the pool with NaN)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        a = self.attn_layers[0]
        shape = (2, num_blocks, block_size, a.num_kv_heads, a.head_dim)
        try:
            for layer in self.attn_layers:
                layer.kv_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        except RuntimeError as e:   # a --kv-cache-memory above what the machine has (CPU or GPU OOM)
            for layer in self.attn_layers:
                layer.kv_cache = None
            per_layer = torch.Size(shape).numel() * self.kv_cache_dtype.itemsize
            raise CacheConfigError(
                f"cannot allocate the KV cache on {self.device}: {len(self.attn_layers)} layers x "
                f"{per_layer / 2**30:.2f} GiB ({num_blocks} blocks of {block_size} tokens): "
                f"{str(e).splitlines()[0][:200]}; lower --kv-cache-memory") from None

    # ---- forward ------------------------------------------------------------------------
    def _cpu_blas_forward(self, num_tokens: int):
        """The `cpu_blas.cpu_blas_forward` context for a forward of `num_tokens` tokens: active
        on a single-process CPU float32 model when `cpu_blas.use_for(num_tokens)`."""
        return cpu_blas.cpu_blas_forward(self.cpu_blas and cpu_blas.use_for(num_tokens))

    @torch.inference_mode()
    def prefill(self, token_ids: list[list[int]], kv: list[KvCacheHandle],
                prompt_logprob_targets: list[list[int]] | None = None, num_top_logprobs: int = 0
                ) -> tuple[torch.Tensor | None, PromptLogprobs | None]:
        """Returns (logits [num_seqs, vocab] float32 of each chunk's last token, prompt
        logprobs of the rows that `prompt_logprob_targets` names (see PrefillInput)); both
        None on TP ranks > 0, the second also when no targets are given. One sequence's
        short chunk without prompt logprobs replays a prefill CUDA graph."""
        if (prompt_logprob_targets is None and self.prefill_graphs is not None
                and self.prefill_graphs.can_run(token_ids)):
            return self.prefill_graphs.run(token_ids[0], kv[0]), None
        dev = self.device
        ids, pos, attn_metadata, cu = prepare_prefill(token_ids, kv, self.block_size, dev)
        last = (cu[1:] - 1).to(dev, non_blocking=True)   # a blocking copy would wait for the stream
        with forward_context(attn_metadata, self.attn_backend), self._cpu_blas_forward(len(ids)):
            prompt_lps = None
            if prompt_logprob_targets is None:
                # only the chunks' last rows are sampled: the last layer computes just those
                logits = self.model.compute_logits(self.model(ids, pos.to(dev, non_blocking=True), last))
            else:
                hidden = self.model(ids, pos.to(dev, non_blocking=True))
                logits = self.model.compute_logits(hidden[last])
                prompt_lps = compute_prompt_logprobs(self.model.compute_logits, hidden, cu[:-1].tolist(),
                                                     prompt_logprob_targets, num_top_logprobs)
        return (None if logits is None else logits.float()), prompt_lps

    def prev_sampled_ids(self, prev_sampled: torch.Tensor | None, num_prev: int) -> torch.Tensor:
        """The previous step's sampled ids [num_prev] int64 on this rank's device (async
        scheduling): rank 0 holds them (the engine's sampler output), the other ranks receive
        them with one broadcast on the TP group, queued on the stream like the forward."""
        if self.tp.size == 1:
            return prev_sampled
        import torch.distributed as dist
        buf = (prev_sampled.contiguous() if self.tp.rank == 0 else
               torch.empty(num_prev, dtype=torch.int64, device=self.device))
        dist.broadcast(buf, src=0, group=self.tp.group)
        return buf

    @torch.inference_mode()
    def decode(self, token_ids: list[int], kv: list[KvCacheHandle],
               prev_sampled: torch.Tensor | None = None, prev_rows: list[int] | None = None,
               num_prev: int = 0) -> torch.Tensor | None:
        """One token per sequence; returns logits [num_seqs, vocab] float32 (TP rank 0).
        With prev_rows (async scheduling, see DecodeInput), row i whose prev_rows[i] >= 0 takes
        its input token from the previous step's sampled ids instead of token_ids[i]; on ranks
        > 0 prev_sampled is None and num_prev gives its length."""
        prev = None
        if prev_rows is not None:
            prev = self.prev_sampled_ids(prev_sampled, num_prev or len(prev_sampled))
        if self.graphs is not None and self.graphs.can_run(len(kv)):
            return self.graphs.run(token_ids, kv, prev, prev_rows)
        dev = self.device
        ids, pos, attn_metadata = prepare_decode(token_ids, kv, self.block_size, dev)
        if prev is not None:
            ids = take_prev_sampled(ids, prev, torch.tensor(prev_rows).to(dev, non_blocking=True))
        with forward_context(attn_metadata, self.attn_backend), self._cpu_blas_forward(len(ids)):
            hidden = self.model(ids, pos.to(dev, non_blocking=True))
            logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()
