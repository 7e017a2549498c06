"""Prefill speed of the CUDA engine on the synthetic full-size V4 Flash (the 43-layer q2 stack of
bench/cuda_decode.py, random weights written on the device): a fresh prompt of each size in one step
(prefill blocks of up to 2,048 tokens, cuda/prefill.py), tokens/s, with the dense products on tensor cores and the
experts on the exact kernels (the engine's default), then with the experts on tensor cores too
(prefill_expert_mma: bf16 x and h). Results go to the JSON after every row (a budget cut keeps what ran).

    python bench/cuda_prefill.py [--sizes 2048,12500] [--json OUT]
    python bench/cuda_prefill.py --emu        # the same code on the CPU emulator at cut-down shapes (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds4py.config import ModelConfig  # noqa: E402

V4_FLASH_Q2 = dict(n_layers=43, dim=4096, vocab_size=129280, n_heads=64, compress_ratios=[0, 0] + [4, 128] * 20 + [4])
EMU_SHAPES = dict(n_layers=3, dim=256, vocab_size=300, n_heads=4, head_dim=128, rope_dim=64, q_lora_rank=64,
                  o_groups=2, o_lora_rank=64, n_experts=8, n_experts_used=3, expert_ff=256, index_heads=4,
                  index_head_dim=64, index_topk=4, window=8, hash_layers=1, compress_ratios=[0, 4, 4])
MODES = {"dense_mma": False, "dense+experts_mma": True}      # prefill_expert_mma


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--emu", action="store_true", help="run on the CPU emulator at cut-down shapes")
    p.add_argument("--sizes", default=None, help="prompt sizes (default 2048,12500; emulator 20)")
    p.add_argument("--json", default=None, help="write the results here (after every row)")
    a = p.parse_args()
    from ds4py import bench
    from ds4py.cuda.engine import CudaModel

    sizes = [int(s) for s in (a.sizes or ("20" if a.emu else "2048,12500")).split(",")]
    cfg = ModelConfig.v4_flash(**(EMU_SHAPES if a.emu else V4_FLASH_Q2))
    t0 = time.perf_counter()
    model = CudaModel.synthetic(cfg, seed=1, emulate=a.emu)
    out = {"device": model.rt.device.name, "layers": cfg.n_layers, "emulated": a.emu,
           "weights_gb": model.startup["weights_gb"], "fill_s": time.perf_counter() - t0, "modes": {}}
    print(f"synthetic {cfg.n_layers}-layer model: {out['weights_gb']:.1f} GB of weights written in "
          f"{out['fill_s']:.1f} s", flush=True)
    tokens = [2 + (7 * i) % (cfg.vocab_size - 2) for i in range(max(sizes))]

    def save() -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)

    for name, expert_mma in MODES.items():
        model.options = model.options.but(prefill_expert_mma=expert_mma)
        rows = out["modes"][name] = []
        for i, n in enumerate(sizes):               # one warm-up per mode, at the first size
            rows.extend(bench.prefill_rates(model, tokens, [n], warmup=i == 0,
                                            progress=lambda m: print(f"{name:18s} {m}", flush=True)))
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
