"""Decode speed of the CUDA engine on a synthetic full-size V4 Flash: 43 layers at the real shapes in the public q2
file's types (Q8_0 dense, F16 compressors / indexer / router, IQ2_XXS + Q2_K experts), random weights written on
the device (ds4py/cuda/synth.py: no 80 GB file). For graph + PDL, graph without PDL, and direct launches: tokens/s
of greedy decode (the token stays on the device), host time per replayed step, launches per step, and the
weight bytes a step reads against the device's copy bandwidth.

    python bench/cuda_decode.py [--tokens 64] [--prompt 32] [--json OUT]
    python bench/cuda_decode.py --emu        # the same code on the CPU emulator, cut-down shapes (CI; numbers
                                             # mean nothing there)
    python bench/cuda_decode.py --rows       # also multi-row steps (ds4py.bench.multirow_stats): a verify of
                                             # 1 + k rows (k = 1..5) vs one decode step, and aggregate decode
                                             # tokens/s of B = 1, 2, 4, 8, 16 sequences stepped together
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds4py.config import ModelConfig  # noqa: E402
from ds4py.sampling import SamplingParams  # noqa: E402

MODES = {"graph+pdl": (True, True), "graph": (False, True), "direct": (True, False)}
V4_FLASH_Q2 = dict(n_layers=43, dim=4096, vocab_size=129280, n_heads=64, compress_ratios=[0, 0] + [4, 128] * 20 + [4])
# cut down for the emulator: every layer kind (window, ratio 4 + indexer, ratio 128), hash and biased routing
EMU_SHAPES = dict(n_layers=4, dim=256, vocab_size=320, n_heads=4, head_dim=128, rope_dim=64, q_lora_rank=64,
                  o_groups=2, o_lora_rank=64, n_experts=8, n_experts_used=3, expert_ff=256, index_heads=4,
                  index_head_dim=64, index_topk=4, window=8, hash_layers=2, compress_ratios=[0, 4, 128, 4])


def measure(model, mode: tuple[bool, bool], prompt: list[int], tokens: int) -> dict:
    model.set_launch_mode(*mode)
    st = model.new_state()
    t0 = time.perf_counter()
    logits = model.step([st], [prompt])[0]
    prefill_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0)
    for _ in model.generate(st, int(logits.argmax()), greedy, 2):      # warm: graphs captured, code paths run
        pass
    for _ in model.generate(st, 1, greedy, tokens):
        pass
    g = model.last_generate
    n = model.launches_per_step(st)
    return {"tokens_per_s": g["tokens"] / g["wall_s"], "host_us_per_step": 1e6 * g["host_s"] / g["steps"],
            "ms_per_token": 1e3 * g["wall_s"] / g["tokens"], "launches_per_step": n["total"],
            "side_stream_launches": n["side_stream"], "prefill_tokens_per_s": len(prompt) / prefill_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--emu", action="store_true", help="run on the CPU emulator at cut-down shapes")
    p.add_argument("--tokens", type=int, default=None, help="greedy tokens per mode (default 64; emulator 2)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens before decoding (default 32; emulator 3)")
    p.add_argument("--rows", action="store_true", help="also time multi-row steps (verify 1 + k rows, B sequences)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    from ds4py.cuda.engine import CudaModel

    tokens = a.tokens or (2 if a.emu else 64)
    n_prompt = a.prompt or (3 if a.emu else 32)
    cfg = ModelConfig.v4_flash(**(EMU_SHAPES if a.emu else V4_FLASH_Q2))
    t0 = time.perf_counter()
    model = CudaModel.synthetic(cfg, seed=1, emulate=a.emu)
    out = {"device": model.rt.device.name, "layers": cfg.n_layers, "emulated": a.emu,
           "weights_gb": model.startup["weights_gb"], "fill_s": time.perf_counter() - t0,
           "weight_bytes_per_token": model.weight_bytes_per_token(), "tokens": tokens, "modes": {}}
    print(f"synthetic {cfg.n_layers}-layer model: {out['weights_gb']:.1f} GB of weights written on the device in "
          f"{out['fill_s']:.1f} s; a decode step reads {out['weight_bytes_per_token'] / 1e9:.2f} GB", flush=True)
    if not a.emu:
        from ds4py.cuda.probe import device_copy_bandwidth_gbps

        out["copy_gbps"] = device_copy_bandwidth_gbps(model.rt)
    prompt = [int(t) % cfg.vocab_size for t in range(2, 2 + n_prompt)]
    for name, mode in MODES.items():
        r = measure(model, mode, prompt, tokens)
        if "copy_gbps" in out:
            r["pct_of_copy_roofline"] = 100 * out["weight_bytes_per_token"] * r["tokens_per_s"] / 1e9 / out["copy_gbps"]
        out["modes"][name] = r
        extra = f", {r['pct_of_copy_roofline']:.0f}% of copy bandwidth" if "pct_of_copy_roofline" in r else ""
        print(f"{name:10s} {r['tokens_per_s']:8.2f} tokens/s ({r['ms_per_token']:.2f} ms/token{extra}); host "
              f"{r['host_us_per_step']:.1f} us per replayed step; {r['launches_per_step']} launches per step",
              flush=True)
    if a.rows:
        from ds4py import bench

        model.set_launch_mode(True, True)
        ks, bs = ((1,), (1, 2)) if a.emu else (bench.VERIFY_K, bench.BATCH_ROWS)
        label = " (emulator: CPU time, not a GPU number)" if a.emu else ""
        out["multirow"] = bench.multirow_stats(model, ks, bs, prompt=n_prompt, reps=1 if a.emu else 5,
                                               progress=lambda m: print(f"multi-row: {m}{label}", flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
