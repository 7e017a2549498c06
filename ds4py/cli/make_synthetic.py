"""`python -m ds4py make-synthetic OUT.gguf --layers N`: a random-weight GGUF at V4 Flash's real widths.

The benchmark sibling of make-tiny: dim 4096, 64 x 512 heads, 256 experts x 2048, vocab 129,280 (about 1.7 GB
per layer with the q2 mix, 2.1 GB more for the embedding and head), streamed to disk one chunk at a time.
"""

from __future__ import annotations

import argparse

from ds4py.cli.make_tiny import SHAPE_FLAGS

NAME = "make-synthetic"
HELP = "write a random-weight GGUF at DeepSeek V4 Flash's real widths (benchmarks; streamed, any depth)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--seed", type=int, default=0, help="weights are a deterministic function of the seed (default 0)")
    p.add_argument("--experts", choices=["iq2", "q4_k", "mxfp4"], default="iq2",
                   help="routed expert types: iq2 = the public q2 file's IQ2_XXS gate/up + Q2_K down (default)")
    p.add_argument("--name", default="ds4py-synthetic-v4-flash", help="general.name")
    p.add_argument("--gaussian", action="store_true",
                   help="quantise Gaussian dense weights as make-tiny does (slow) instead of random codes")
    for flag, field in SHAPE_FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int, metavar="N",
                       help=f"{field}" + (" (default 4)" if flag == "layers" else " (default: V4 Flash's)"))
    p.add_argument("--compress-ratios", metavar="R,R,...",
                   help="per-layer ratios from {0,4,128} (default: 0,0 then alternating 4,128)")
    p.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")


def run(args: argparse.Namespace) -> int:
    from ds4py.errors import ConfigError
    from ds4py.tiny import make_synthetic

    shape = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    layers = shape.pop("n_layers", 4)
    if args.compress_ratios:
        try:
            shape["compress_ratios"] = [int(r) for r in args.compress_ratios.split(",")]
        except ValueError:
            raise ConfigError(f"--compress-ratios {args.compress_ratios!r} is not a comma-separated list of integers")
    make_synthetic(args.out, n_layers=layers, seed=args.seed, experts=args.experts, name=args.name,
                   progress=args.verbose, fast=not args.gaussian, **shape)
    print(args.out)
    return 0
