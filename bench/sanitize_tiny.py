"""One prefill block and a few decode steps of a tiny model on the GPU: the workload the device check runs under
compute-sanitizer (memcheck, racecheck, synccheck), small enough to finish under each tool.

    python bench/sanitize_tiny.py [--model tiny.gguf] [--what prefill,decode] [--prompt 20] [--tokens 2]

The model: --model, else the golden ds4-tiny ($DS4PY_GOLDEN or ../shared/golden), else a make-tiny model.
A prompt longer than the rollback horizon + 1 runs through the prefill blocks (cu/gemm.cu, prefill_attn.cu,
moe_prefill.cu, ...); the decode steps replay the step graph (every decode kernel). Exit 0 when both ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_model() -> str:
    golden = Path(os.environ.get("DS4PY_GOLDEN") or Path(__file__).resolve().parents[2] / "shared" / "golden")
    path = golden / "ds4-tiny" / "tiny.gguf"
    if path.is_file():
        return str(path)
    from ds4py.tiny import make_tiny

    out = os.path.join(tempfile.mkdtemp(prefix="ds4py-sanitize-"), "tiny.gguf")
    make_tiny(out, seed=1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--what", default="prefill,decode")
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cuda-emu"))
    a = ap.parse_args(argv)
    import numpy as np

    from ds4py.model import open_model

    t0 = time.perf_counter()
    m = open_model(a.model or tiny_model(), backend=a.backend)
    what = set(a.what.split(","))
    ids = [int(x) for x in np.random.default_rng(1).integers(0, m.config.vocab_size, a.prompt)]
    st = m.new_state()
    if "prefill" in what:
        logits = m.step([st], [ids])[0]                     # > rollback horizon + 1 rows: the prefill blocks
    else:
        logits = m.step([st], [ids[:1]])[0]
    print(f"prompt of {len(ids) if 'prefill' in what else 1} tokens: top-1 {int(np.argmax(logits))}", flush=True)
    if "decode" in what:
        for _ in range(a.tokens):
            logits = m.step([st], [[int(np.argmax(logits))]])[0]
        print(f"{a.tokens} decode steps: top-1 {int(np.argmax(logits))}", flush=True)
    if not np.all(np.isfinite(logits)):
        print("non-finite logits", file=sys.stderr)
        return 1
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
