"""Speculative decoding measured on the tiny official MTP model (docs/spec.md "Measured").

    python bench/spec_tiny.py [--work DIR] [--ctx 64,160] [--gen-tokens 32] [--repeat 3] [--json out.json]

The golden v4-tiny-mtp checkpoint (DeepSeek's official MTP block, random weights, vocab 256) is converted with
convert --mtp, then on the reference backend:
  - draft agreement: over the golden case ids, teacher-forced, how often the MTP block's argmax at position j
    (from h_j and token j+1) is the main model's argmax at position j+1 (what greedy acceptance of a first draft
    would be on that text);
  - the verify cost line: the fastest of 7 timings of one main step of r = 1..5 rows (row-stable, as a verify runs) on a copy of
    the same state;
  - the bench sweep (ds4py.bench.run_sweep with the MTP model): the plain and the speculative probe from the
    same state, identity-checked, for the scheduler's own k and for fixed k = 1, 3.
The prompt is golden case c's ids (the file has no tokenizer); the probes suppress no token (no EOS).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py import bench  # noqa: E402
from ds4py.convert import convert_checkpoint  # noqa: E402
from ds4py.model import open_mtp  # noqa: E402
from ds4py.ref.engine import RefModel  # noqa: E402
from ds4py.mtp_spec import MtpSpec  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "v4-tiny-mtp"


def agreement(model: RefModel, mtp, ids: np.ndarray) -> float:
    """Teacher-forced: fraction of j with argmax(MTP row j) == argmax(main row j + 1)."""
    state, ds = model.new_state(), mtp.new_state()
    (main,), (h,) = model.step_hidden([state], [ids], all_logits=True)
    (draft,), _ = mtp.step([ds], [h[:-1]], [ids[1:]], all_logits=True)
    return float(np.mean(draft.argmax(-1) == main[1:].argmax(-1)))


def verify_line(model: RefModel, ids: np.ndarray, reps: int = 7) -> dict[int, float]:
    """Fastest of `reps` timings (the least disturbed by other load) of one main step of r rows after the prompt,
    r = 1..5."""
    state = model.new_state()
    model.step([state], [ids])
    out = {}
    for r in range(1, 6):
        ts = []
        for _ in range(reps):
            s = state.copy()
            t0 = time.perf_counter()
            model.step_hidden([s], [ids[:r]], all_logits=True)
            ts.append(time.perf_counter() - t0)
        out[r] = float(min(ts))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="folder for the converted files (default: a temporary one)")
    ap.add_argument("--ctx", default="64,160", help="bench frontiers (ascending, at most 192)")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="probes per row (mean; the machine may be loaded)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="spec_tiny_"))
    work.mkdir(parents=True, exist_ok=True)
    main_path, mtp_path = work / "v4-tiny-mtp.gguf", work / "v4-tiny-mtp.mtp.gguf"
    if not main_path.exists() or not mtp_path.exists():
        convert_checkpoint(str(GOLDEN), str(main_path), experts="mxfp4", dense="f32", progress=False,
                           mtp=str(mtp_path))
    g = np.load(GOLDEN / "cases.npz")
    model = RefModel(str(main_path))
    mtp = open_mtp(model, str(mtp_path))
    res: dict = {"agreement": {c: agreement(model, mtp, g[f"{c}_ids"].astype(np.int64)) for c in "abc"}}
    print("teacher-forced draft agreement (argmax MTP j == argmax main j+1):",
          ", ".join(f"case {c} {v:.3f}" for c, v in res["agreement"].items()), flush=True)
    ids = g["c_ids"].astype(np.int64)
    line = verify_line(model, ids[:64])
    res["verify_seconds"] = line
    print("verify step of r rows: " + ", ".join(f"r={r} {t * 1e3:.1f} ms ({t / line[1]:.2f}x)"
                                                for r, t in line.items()), flush=True)
    points = [int(x) for x in args.ctx.split(",")]
    res["sweeps"] = {}
    for label, k in (("scheduler", None), ("k=1", 1), ("k=3", 3)):
        spec = MtpSpec(model, mtp, fixed_k=k)
        rows = bench.run_sweep(model, list(map(int, ids)), points, args.gen_tokens, repeat=args.repeat, spec=spec)
        res["sweeps"][label] = [{c: getattr(r, c) for c in ("ctx_tokens", "gen_tps", *bench.SPEC_COLUMNS)}
                                for r in rows]
        for r in rows:
            print(f"{label:9s} ctx {r.ctx_tokens:4d}: plain {r.gen_tps:6.2f} tok/s, speculative {r.spec_tps:6.2f} "
                  f"tok/s (x{r.spec_speedup:.2f}), acceptance {r.spec_acceptance:.3f}, "
                  f"{r.spec_tokens_per_round:.2f} tokens/round", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
