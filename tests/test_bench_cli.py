"""`ferrum bench latency` and `ferrum bench throughput` end to end on a tiny random model: they
run, write their JSON, and the throughput run counts every generated token."""
from __future__ import annotations

import json

from ferrum.entrypoints.cli import main
from tiny_models import make_tiny_model


def test_bench_latency_and_throughput_cli(tmp_path):
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", folder, "--input-len", "16", "--output-len", "8", "--num-iters", "1",
                 "--no-hf", "--threads", "1", "--out", str(out)]) == 0
    lat = json.loads(out.read_text())
    assert lat["ferrum"]["decode_tok_s"] > 0 and lat["ferrum"]["ttft_s"] > 0
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", folder, "--num-prompts", "4", "--threads", "1",
                 "--out", str(out)]) == 0
    thr = json.loads(out.read_text())
    for mode in ("batched", "sequential"):
        r = thr[mode]
        assert r["output_tokens"] == thr["total_output_tokens"]
        assert r["timeline"][-1][1] == thr["total_output_tokens"]  # every token counted
    assert thr["batched"]["max_running_sequences"] == 4 and thr["sequential"]["max_running_sequences"] == 1
