"""A/B of the SDPA prefill path's padding (SDPA_LEN_MULTIPLE 256 vs 1) at Llama-3-8B attention
shapes, contiguous q/k/v and strided views of one fused qkv tensor as the model passes them;
torch's own backend choice (torch._fused_sdp_choice) and each backend forced. us per call
(median of 10). Writes $OUT/probe_sdpa.json. Run on the GPU: python3 benchmarks/probe_sdpa.py"""
import contextlib, json, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_attention as ta
from torch.nn.attention import SDPBackend, sdpa_kernel
from ferrum.config import KERNELS
from ferrum.ops import attention_triton as tb
KERNELS.sdpa_prefill_min_tokens = 1
gen = torch.Generator(device="cuda").manual_seed(0)
forced = {"torch_default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}
res = {}
for L in (7500, 5000, 2100, 2048):
    q, kv, k, v, md, flops = ta._prefill_inputs(1, L, gen)
    qkv = torch.cat([q.reshape(L, -1), k.reshape(L, -1), v.reshape(L, -1)], 1)
    qs, ks, vs = qkv.split([ta.H * ta.D, ta.HKV * ta.D, ta.HKV * ta.D], 1)
    strided = (qs.view(L, ta.H, ta.D), ks.view(L, ta.HKV, ta.D), vs.view(L, ta.HKV, ta.D))
    for layout, (qq, kk, vv) in (("contig", (q, k, v)), ("strided", strided)):
        for pad in (L, -(-L // 256) * 256):
            a, b, c = ((t if pad == L else torch.cat([t, t.new_zeros(pad - L, *t.shape[1:])])).transpose(0, 1)[None]
                       for t in (qq, kk, vv))
            res[f"{L}/{layout}/len{pad}/choice"] = int(torch._fused_sdp_choice(a, b, c, is_causal=True, enable_gqa=True))
            print(f"{L}/{layout}/len{pad} torch's choice:", res[f"{L}/{layout}/len{pad}/choice"],
                  "(0 math, 1 flash, 2 efficient, 3 cudnn, 4 overrideable)", flush=True)
        for mult in (256, 1):
            tb.SDPA_LEN_MULTIPLE = mult
            for name, be in forced.items():
                def run():
                    with sdpa_kernel([be]) if be is not None else contextlib.nullcontext():
                        return tb.prefill_attention(qq, kv, md, ta.D ** -0.5, kk, vv)
                key = f"{L}/{layout}/pad{mult}/{name}"
                try:
                    us = ta._time(run, iters=10)
                    res[key] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1)}
                except Exception as e:
                    res[key] = {"error": str(e).splitlines()[0][:120]}
                print(key, res[key], flush=True)
tb.SDPA_LEN_MULTIPLE = 1
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_sdpa.json"), "w"), indent=1)
