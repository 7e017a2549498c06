"""Domain sidecars on the trained tiny V4 (../shared/trained/v4-tiny-trained): a sidecar fitted on code and one on
prose, each stacked on the VQ-8 base and scored on both domains (docs/vq.md "Sidecars on the trained model").

    python bench/sidecar_trained.py [--work DIR] [--lambdas 0.01,0.1,1,10,100,1000] [--windows 3] [--biased]
                                    [--json out.json]

The folder ships no training text (corpus_split.json names the training files; they are not in it), only the
held-out test texts. So each test text is split honestly in two at a line boundary in the middle: the first half
fits the sidecar (`sidecar-fit --text`), the second half scores it (windows of its token ids). Base: VQ-8 of the
teacher's routed experts (quantize-vq's default unbiased gains, --min-pool 16; `--biased`: the k-means gains);
teacher: the lossless conversion (files: bench/trained_files.py, shared with bench/posttrain_trained.py). Reported per
sidecar and scored domain: the rulers of base and base + sidecar against the teacher (Σmin, same top-1, KL, PPL
ratio), the lift in same top-1 (points), the sidecar's bytes, the solver's time and the ridge values it chose.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from trained_files import LAMBDAS, TRAINED, halves, prepare, sidecar  # noqa: E402  (puts the repo on sys.path)
from ds4py.ref.engine import RefModel  # noqa: E402
from ds4py.vq.rulers import rulers  # noqa: E402


def logits(path: str, windows, sidecar: str | None = None) -> np.ndarray:
    m = RefModel(path, threads=1, sidecar=sidecar)
    return np.concatenate([m.prefill(m.new_state(), list(map(int, w)), all_logits=True) for w in windows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None)
    ap.add_argument("--lambdas", default=LAMBDAS)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--biased", action="store_true",
                    help="base = quantize-vq --no-unbiased-gains (the k-means gains, ~30%% too small at 8 bits: "
                         "most of what a sidecar then finds is that shrinkage)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work, teacher_p, base_p, tok = prepare(args.work, args.biased, "sidecar_trained_")
    evals, res = {}, {"sidecars": {}}
    for dom in ("code", "prose"):
        _, held = halves((TRAINED / f"test_{dom}.txt").read_text())
        ids = np.asarray(tok.encode(held), np.int64)
        offs = np.linspace(0, len(ids) - args.window - 1, args.windows).astype(int)
        wins = [ids[o:o + args.window] for o in offs]
        t = logits(str(teacher_p), wins)
        evals[dom] = (wins, t, np.concatenate(wins), logits(str(base_p), wins))
    print("| sidecar | scored on | Σmin base → +sidecar | same top-1 base → +sidecar (lift, points) | KL base → +sidecar "
          "| PPL ratio base → +sidecar |")
    print("|---|---|---|---|---|---|")
    for dom in ("code", "prose"):
        out, rep, seconds = sidecar(work, dom, args.biased, args.lambdas)
        r_dom = res["sidecars"].setdefault(dom, {})
        if seconds is not None:
            r_dom["fit_seconds"] = seconds
        r_dom["bytes"] = sum(f.stat().st_size for f in out.iterdir())
        r_dom["report"] = json.loads(rep.read_text()) if rep.exists() else None
        for scored, (wins, t, flat, b) in evals.items():
            s = logits(str(base_p), wins, sidecar=str(out))
            rb, rs = rulers(t, b, flat, 1), rulers(t, s, flat, 1)
            r_dom[scored] = {"base": rb, "sidecar": rs}
            print(f"| {dom} | {scored} | {rb['sigma_min_mean']:.4f} → {rs['sigma_min_mean']:.4f} | "
                  f"{rb['same_top1']:.4f} → {rs['same_top1']:.4f} ({100 * (rs['same_top1'] - rb['same_top1']):+.1f}) | "
                  f"{rb['kl_mean']:.4f} → {rs['kl_mean']:.4f} | {rb.get('ppl_ratio', 0):.4f} → "
                  f"{rs.get('ppl_ratio', 0):.4f} |", flush=True)
        print(f"|   sidecar {dom}: {r_dom['bytes']:,} bytes, fitted in {r_dom.get('fit_seconds', float('nan')):.1f} s |",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
