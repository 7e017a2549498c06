"""`python -m ds4py quantize-vq SRC.gguf OUT.gguf --bits B`: routed experts -> VQ-8 (docs/vq.md)."""

from __future__ import annotations

import argparse

NAME = "quantize-vq"
HELP = "re-encode a GGUF's routed experts as VQ-8 (one E4M3 codebook per layer, f16 row gains); deterministic"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC.gguf", help="a ds4-layout GGUF, experts in any format (MXFP4 = official FP4)")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--bits", type=int, required=True, metavar="B", help="index bits per 8 weights, 6..13")
    p.add_argument("--bits-shallow", type=int, metavar="B2", help="bits for the first --shallow-layers layers")
    p.add_argument("--shallow-layers", type=int, default=0, metavar="N")
    p.add_argument("--dense", choices=("keep", "q4_k"), default="keep",
                   help="keep every other tensor as it is (default), or re-encode attention, shared-expert and "
                        "head matrices as Q4_K")
    p.add_argument("--min-pool", type=int, default=1000, metavar="N",
                   help="refuse a layer with fewer than N vectors per codeword (default 1000)")
    p.add_argument("--train-per-code", type=int, default=2048, metavar="N",
                   help="Lloyd trains on at most N vectors per codeword, an equidistant sample (default 2048; 0 = all)")
    p.add_argument("--rounds", type=int, default=10, metavar="R", help="Lloyd rounds (default 10)")
    p.add_argument("--workers", type=int, metavar="N", help="search threads (default: CPU count, at most 8)")
    p.add_argument("--unbiased-gains", action=argparse.BooleanOptionalAction, default=True,
                   help="scale each expert tensor's row gains by <w,w>/<q,w> (undo the codebook's shrinkage toward "
                        "zero: more weight error, much less output damage; docs/vq.md \"Trained\"); the default. "
                        "--no-unbiased-gains writes the k-means gains as quantize-vq did before")
    p.add_argument("--report", metavar="FILE.json", help="also write the per-layer report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    import json

    from ds4py.vq.quantize import Options, quantize_vq

    opts = Options(bits=args.bits, bits_shallow=args.bits_shallow, shallow_layers=args.shallow_layers,
                   dense=args.dense, min_pool=args.min_pool, train_per_code=args.train_per_code,
                   rounds=args.rounds, workers=args.workers, unbias=args.unbiased_gains)
    report = quantize_vq(args.src, args.out, opts, progress=not args.quiet)
    if args.report:
        with open(args.report, "w") as fh:
            json.dump(report, fh, indent=1)
    n = sum(r["vectors"] for r in report["layers"])
    err = sum(r["rel_err"] * r["vectors"] for r in report["layers"]) / max(n, 1)
    print(f"wrote {report['output']}: {len(report['layers'])} VQ layers, mean rel. error {err:.4f}, "
          f"{report['vectors_per_s'] / 1e3:,.0f}k vectors/s, {report['seconds']:.1f} s")
    return 0
