"""The engine contract's costs on a model: prefill, decode, a batched decode step of B sequences against B
separate decodes, truncate, copy, and the save_state blob (size, save and load time).

    python bench/engine_bench.py -m MODEL.gguf [--backend ref] [--batch 4] [--ctx 230] [--json]

Times are best-of-N; `--clock cpu` (the default) measures this process's CPU time, which on a shared machine
is far steadier than wall time (with one BLAS thread the two agree on an idle machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ds4py.model import open_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--backend", default="ref")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ctx", type=int, default=230, help="context of the decode measurements")
    p.add_argument("--prefill", type=int, default=300, help="prefill length")
    p.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    clock = time.process_time if a.clock == "cpu" else time.perf_counter

    def best(f) -> float:
        ts = []
        for _ in range(a.repeat):
            t0 = clock()
            f()
            ts.append(clock() - t0)
        return min(ts)

    m = open_model(a.model, backend=a.backend)
    ids = np.random.default_rng(0).integers(2, m.config.vocab_size, a.ctx + a.prefill + a.steps * a.batch)
    m.prefill(m.new_state(), ids[:16])                                   # warm the weight cache
    out = {"model": a.model, "backend": a.backend, "clock": a.clock, "batch": a.batch, "ctx": a.ctx}
    t = best(lambda: m.prefill(m.new_state(), ids[:a.prefill]))
    out["prefill_tok_s"] = a.prefill / t

    bases = []
    for b in range(a.batch):
        st = m.new_state()
        m.prefill(st, ids[b:b + a.ctx])
        bases.append(st)
    toks = ids[a.ctx:a.ctx + a.steps * a.batch].reshape(a.steps, a.batch)

    def separate():
        sts = [s.copy() for s in bases]
        for row in toks:
            for s, tk in zip(sts, row):
                m.step([s], [[int(tk)]])

    def batched():
        sts = [s.copy() for s in bases]
        for row in toks:
            m.step(sts, [[int(tk)] for tk in row])

    copies = best(lambda: [s.copy() for s in bases])          # taken inside both timings
    t_sep = (best(separate) - copies) / a.steps
    t_bat = (best(batched) - copies) / a.steps
    out["decode_ms"] = 1e3 * t_sep / a.batch
    out[f"separate_{a.batch}_decodes_ms"] = 1e3 * t_sep
    out[f"step_B{a.batch}_ms"] = 1e3 * t_bat
    out["step_speedup"] = t_sep / t_bat

    st = bases[0].copy()
    for tk in toks[:, 0]:
        m.step([st], [[int(tk)]])
    n = st.n_tokens
    depth = min(m.rollback_horizon, a.steps)
    pool = [st.copy() for _ in range(200)]
    t0 = time.perf_counter()
    for s in pool:
        s.truncate(n - depth)
    out["truncate_us"] = 1e6 * (time.perf_counter() - t0) / len(pool)
    out["copy_ms"] = 1e3 * best(st.copy)
    out["state_nbytes"] = st.nbytes()
    blob = m.save_state(st)
    out["blob_bytes"] = len(blob)
    out["save_ms"] = 1e3 * best(lambda: m.save_state(st))
    out["load_ms"] = 1e3 * best(lambda: m.load_state(blob))
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k:>24s}  {v:.3f}" if isinstance(v, float) else f"{k:>24s}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
