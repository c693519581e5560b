"""CPU linears: which forwards run on numpy's OpenBLAS (`ferrum.ops.cpu_blas`, one-token
forwards only) and which on oneDNN with weights packed at load (`ferrum.ops.cpu_packed`), and
that every path gives the numbers of a float64 product."""
from __future__ import annotations

import pytest
import torch

from ferrum.ops import cpu_blas, cpu_packed

from tiny_models import make_tiny_model


@pytest.mark.parametrize("rows", [1, 2, 5, 32])
@pytest.mark.parametrize("column_major", [False, True])
def test_blas_linear_matches_float64(rows, column_major):
    """blas_linear (sgemv at 1 row, sgemm above) and F.linear both within 1e-4 of float64,
    for row- and column-major weights, with a bias."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(160, 96, generator=gen)
    if column_major:
        w = w.t().contiguous().t()
    b = torch.randn(160, generator=gen)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    err_blas = (cpu_blas.blas_linear(x, w, b).double() - ref).abs().max().item()
    err_torch = (torch.nn.functional.linear(x, w, b).double() - ref).abs().max().item()
    assert err_blas < 1e-4 and err_torch < 1e-4, (err_blas, err_torch)
    if cpu_packed.available():   # packed for PACK_ROWS rows, correct at any row count
        packed = cpu_packed.pack(w)
        for bias in (b, None):
            want = ref if bias is not None else torch.nn.functional.linear(x.double(), w.double())
            err = (cpu_packed.packed_linear(x, packed, bias).double() - want).abs().max().item()
            assert err < 1e-4, err


def test_linear_uses_blas_only_inside_an_active_forward():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    assert not cpu_blas.can_use(x, w, True)
    with cpu_blas.cpu_blas_forward(True):
        assert cpu_blas.can_use(x, w, True)
        assert not cpu_blas.can_use(x, w, False)              # TP ranks share the cores
        assert not cpu_blas.can_use(x.double(), w.double(), True)
        assert torch.get_num_threads() == 1                    # torch's pool parked meanwhile
    assert not cpu_blas.can_use(x, w, True)
    with cpu_blas.cpu_blas_forward(False):
        assert not cpu_blas.can_use(x, w, True)
    assert cpu_blas.use_for(1) and not cpu_blas.use_for(2) and not cpu_blas.use_for(32)


def test_only_one_token_forwards_run_on_openblas(tmp_path):
    """In an engine run (prefills of 5-9 tokens, decode batches of 3 down to 1) every
    blas_linear call has one row, every multi-row linear runs on its packed weight, and the
    greedy tokens of the batch equal each prompt's alone (batch 1 decodes on OpenBLAS, the
    batch on oneDNN)."""
    from ferrum.entrypoints.llm import LLM
    from ferrum.sampling_params import SamplingParams
    folder = make_tiny_model(str(tmp_path / "tiny"), hidden=64, inter=192, vocab=256)
    rows_seen, packed_rows = [], []
    real, real_packed = cpu_blas.blas_linear, cpu_packed.packed_linear

    def spy(x, weight, bias=None):
        rows_seen.append(x.shape[0])
        return real(x, weight, bias)

    def spy_packed(x, packed, bias=None):
        packed_rows.append(x.shape[0])
        return real_packed(x, packed, bias)

    prompts = [[5 + i, 9, 23, 7, 11 + i] + [3] * i for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
    with LLM(folder, progress=False, device="cpu", dtype="float32", max_model_len=64) as llm:
        try:
            cpu_blas.blas_linear, cpu_packed.packed_linear = spy, spy_packed
            batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            blas_in_batch = len(rows_seen)
            alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        finally:
            cpu_blas.blas_linear, cpu_packed.packed_linear = real, real_packed
    assert rows_seen and set(rows_seen) == {1}
    assert blas_in_batch > 0          # the batch's tail decoded one sequence alone
    if cpu_packed.available():
        assert packed_rows and max(packed_rows) > 1   # (1 row: a one-prompt prefill's LM head)
    assert batch == alone


def test_packed_copies_skipped_when_memory_is_short(tmp_path, monkeypatch):
    """The oneDNN copies double the linear weights' memory: with less than twice their size
    available the runner keeps the plain weights only, and greedy tokens stay the same."""
    from ferrum.entrypoints.llm import LLM
    from ferrum.layers.linear import LinearBase
    from ferrum.sampling_params import SamplingParams
    assert cpu_packed.fits(0)
    monkeypatch.setattr(cpu_packed, "available_memory_bytes", lambda: 2 * 1000 - 1)
    assert not cpu_packed.fits(1000)
    monkeypatch.setattr(cpu_packed, "available_memory_bytes", lambda: 2 * 1000)
    assert cpu_packed.fits(1000)
    folder = make_tiny_model(str(tmp_path / "tiny"), hidden=64, inter=192, vocab=256)
    prompts = [[5, 9, 23, 7], [11, 3, 3]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for free in (None, 1000):   # unknown (packs) / far too little (does not)
        monkeypatch.setattr(cpu_packed, "available_memory_bytes", lambda free=free: free)
        with LLM(folder, progress=False, device="cpu", dtype="float32", max_model_len=64) as llm:
            model = llm.engine.executor.runner.model
            linears = [m for m in model.modules() if isinstance(m, LinearBase)]
            has_copy = {m.weight_packed is not None for m in linears}
            tokens[free] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert has_copy == {free is None and cpu_packed.available()}, (free, has_copy)
    assert tokens[None] == tokens[1000]
