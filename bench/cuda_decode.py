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
    python bench/cuda_decode.py --kernel-times   # also one direct decode step launch by launch: each kernel timed
                                             # with CUDA events, beside the GPU time model's number for it
                                             # (ds4py/cuda/kernel_times.py; the device check runs it)
    python bench/cuda_decode.py --v41 [--engram-table PATH --engram-rows N]
        # a synthetic full-size V4.1 Flash in the seed's layout instead (40 layers, D 5120, VQ-8 experts 13-bit in
        # the first 14 layers and 12-bit after, Q4_K dense: ~110 GB written on the device), its Engram reading a
        # small synthetic table written to PATH first (default: a temporary file of 2 x 262,144 rows, 138 MB).
        # An Engram model samples on the host (docs/cuda.md "V4.1"), so its tokens/s are of step() with a host
        # argmax per token; reported with the bytes a step reads and the GB/s that makes.
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
# V4.1 Flash (MODEL.md §1; the V4.1 values not given come from ModelConfig.v41_flash)
V41_FLASH = dict(n_layers=40, dim=5120, vocab_size=129280, n_heads=64, compress_ratios=[0, 0] + [2] * 18 + [1] * 20)
# cut down for the emulator: v41-tiny's layer map (ratios 0, 2, 2, 1, 1, 1, kv / index / candidate sources,
# Engram on 0 and 1) at widths the VQ-8 and Q4_K kernels take
EMU_V41 = dict(n_layers=6, dim=256, vocab_size=512, context_length=256, n_heads=4, head_dim=64, rope_dim=16,
               q_lora_rank=64, o_lora_rank=64, o_groups=2, window=16, compress_ratios=[0, 2, 2, 1, 1, 1],
               rope_factor=4.0, rope_orig_ctx=32, index_heads=16, index_head_dim=64, index_topk=8, n_experts=8,
               n_experts_used=3, expert_ff=256, kv_source_layers=[1, 3], index_source_layers=[1, 3, 5],
               candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=4, engram_layers=[0, 1],
               engram_rows=[660, 864], engram_heads=2, engram_head_dim=32, engram_bucket_base=100,
               engram_compressed_vocab=256)


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def measure_host(model, mode: tuple[bool, bool], prompt: list[int], tokens: int) -> dict:
    """measure() for a model that samples on the host (Engram): greedy step() by step(), argmax on the host."""
    model.set_launch_mode(*mode)
    st = model.new_state()
    t0 = time.perf_counter()
    logits = model.step([st], [prompt])[0]
    prefill_s = time.perf_counter() - t0
    for _ in range(2):                                          # warm: graphs captured, code paths run
        logits = model.step([st], [[int(logits.argmax())]])[0]
    feed, before = model.engram, dict(model.engram.stats)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = model.step([st], [[int(logits.argmax())]])[0]
    wall = time.perf_counter() - t0
    n = model.launches_per_step(st)
    per = {k: (feed.stats[k] - before[k]) / tokens for k in ("bytes", "hash_s", "gather_s")}
    return {"tokens_per_s": tokens / wall, "ms_per_token": 1e3 * wall / tokens, "launches_per_step": n["total"],
            "side_stream_launches": n["side_stream"], "prefill_tokens_per_s": len(prompt) / prefill_s,
            "engram_bytes_per_token": per["bytes"], "engram_hash_ms_per_token": 1e3 * per["hash_s"],
            "engram_gather_ms_per_token": 1e3 * per["gather_s"]}


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
    p.add_argument("--kernel-times", action="store_true",
                   help="also time each kernel of one direct decode step and write it beside the time model's number")
    p.add_argument("--v41", action="store_true", help="a synthetic V4.1 Flash, VQ-8 + Q4_K, Engram from a table")
    p.add_argument("--engram-table", default=None, help="--v41: where to write the synthetic Engram table")
    p.add_argument("--engram-rows", type=int, default=None, help="--v41: rows per table (default 262144; emu 4096)")
    a = p.parse_args()
    from ds4py.cuda import synth
    from ds4py.cuda.engine import CudaModel

    tokens = a.tokens or (2 if a.emu else 64)
    n_prompt = a.prompt or (3 if a.emu else 32)
    t0 = time.perf_counter()
    if a.v41:
        import tempfile

        if a.rows:
            p.error("--rows times multi-row steps of the V4 model only")
        cfg = ModelConfig.v41_flash(**(EMU_V41 if a.emu else V41_FLASH))
        rows = a.engram_rows or (4096 if a.emu else 262144)
        table = a.engram_table or os.path.join(tempfile.mkdtemp(prefix="ds4py-engram-"), "engram.bin")
        synth.write_engram_table(table, cfg, rows, seed=1)
        table_s = time.perf_counter() - t0
        model = CudaModel.synthetic(cfg, seed=1, emulate=a.emu, vq=synth.VqWidths(12, 13, 1 if a.emu else 14),
                                    dense="q4_k", engram_table=(table, rows))
    else:
        cfg = ModelConfig.v4_flash(**(EMU_SHAPES if a.emu else V4_FLASH_Q2))
        model = CudaModel.synthetic(cfg, seed=1, emulate=a.emu)
    out = {"device": model.rt.device.name, "model": "V4.1 VQ-8 + Q4_K" if a.v41 else "V4 q2", "layers": cfg.n_layers,
           "emulated": a.emu,
           "weights_gb": model.startup["weights_gb"], "fill_s": time.perf_counter() - t0,
           "weight_bytes_per_token": model.weight_bytes_per_token(), "tokens": tokens, "modes": {}}
    if a.v41:
        out["engram_table"] = {"path": table, "rows": rows, "bytes": os.path.getsize(table), "write_s": table_s}
    print(f"synthetic {cfg.n_layers}-layer {out['model']} model: {_size(out['weights_gb'] * 1e9)} of weights written "
          f"on the device in {out['fill_s']:.1f} s; a decode step reads {_size(out['weight_bytes_per_token'])}",
          flush=True)
    if not a.emu:
        from ds4py.cuda.probe import device_copy_bandwidth_gbps

        out["copy_gbps"] = device_copy_bandwidth_gbps(model.rt)
    prompt = [int(t) % cfg.vocab_size for t in range(2, 2 + n_prompt)]
    for name, mode in MODES.items():
        r = (measure_host if a.v41 else measure)(model, mode, prompt, tokens)
        r["gbps"] = out["weight_bytes_per_token"] * r["tokens_per_s"] / 1e9      # weight bytes read per second
        if "copy_gbps" in out:
            r["pct_of_copy_roofline"] = 100 * out["weight_bytes_per_token"] * r["tokens_per_s"] / 1e9 / out["copy_gbps"]
        out["modes"][name] = r
        extra = f", {r['gbps']:.3g} GB/s of weights"
        extra += f", {r['pct_of_copy_roofline']:.0f}% of copy bandwidth" if "pct_of_copy_roofline" in r else ""
        if "engram_bytes_per_token" in r:
            extra += (f"; Engram {r['engram_bytes_per_token']:.0f} B/token, hash {r['engram_hash_ms_per_token']:.3f} + "
                      f"gather {r['engram_gather_ms_per_token']:.3f} ms/token")
        host = f"host {r['host_us_per_step']:.1f} us per replayed step; " if "host_us_per_step" in r else ""
        print(f"{name:10s} {r['tokens_per_s']:8.2f} tokens/s ({r['ms_per_token']:.2f} ms/token{extra}); "
              f"{host}{r['launches_per_step']} launches per step{' (emulated)' if a.emu else ''}", flush=True)
    if a.kernel_times:
        from ds4py.cuda import kernel_times

        model.set_launch_mode(True, False)
        st = model.new_state()
        model.step([st], [prompt])
        prof = model.rt.profile           # every runtime (GPU, emulator) carries the profile it checks launches against
        try:      # the calibration must not cost the numbers above (the JSON is written below)
            out["kernel_times"] = kernel_times.time_decode_step(model, st, prof, out.get("copy_gbps"))
            print(kernel_times.format_times(out["kernel_times"]) + (" (emulated: CPU time)" if a.emu else ""),
                  flush=True)
        except Exception as e:  # e.g. an arch the committed tables do not cover
            out["kernel_times"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"kernel times: not measured ({type(e).__name__}: {e})", flush=True)
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
    if a.v41 and a.engram_table is None:           # our temporary table (the memory map keeps it readable until exit)
        os.remove(table)
        os.rmdir(os.path.dirname(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
