"""`python -m ds4py make-tiny OUT.gguf`: a random-weight V4 Flash GGUF (ds4 layout) of any small shape."""

from __future__ import annotations

import argparse

NAME = "make-tiny"
HELP = "write a small random-weight DeepSeek V4 Flash GGUF (ds4 layout, byte-level BPE tokenizer)"

# CLI flag -> ModelConfig field (defaults: ds4py.tiny.DEFAULTS, the ds4-tiny golden shape)
SHAPE_FLAGS = {
    "layers": "n_layers", "dim": "dim", "vocab": "vocab_size", "heads": "n_heads", "head_dim": "head_dim",
    "rope_dim": "rope_dim", "q_lora": "q_lora_rank", "o_lora": "o_lora_rank", "o_groups": "o_groups",
    "experts_n": "n_experts", "experts_used": "n_experts_used", "ff": "expert_ff",
    "index_heads": "index_heads", "index_dim": "index_head_dim", "index_topk": "index_topk",
    "window": "window", "hash_layers": "hash_layers",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--seed", type=int, default=0, help="weights are a deterministic function of the seed (default 0)")
    p.add_argument("--experts", choices=["iq2", "q4_k", "mxfp4"], default="iq2",
                   help="routed expert types: iq2 = gate/up IQ2_XXS + down Q2_K (default), q4_k, mxfp4")
    p.add_argument("--name", default="ds4py-tiny-random", help="general.name")
    for flag, field in SHAPE_FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int, metavar="N", help=f"{field}")
    p.add_argument("--compress-ratios", metavar="R,R,...",
                   help="per-layer ratios from {0,4,128} (default: 0,0 then alternating 4,128)")
    p.add_argument("--mtp", metavar="OUT_MTP.gguf", help="also write a random MTP draft block (ds4's mtp.0.* file)")
    p.add_argument("--v4-vocab", action="store_true",
                   help="DeepSeek V4's own 129,280-entry vocabulary (as the serve demo model) instead of a small "
                        "byte-level BPE learned from a sample text (--vocab N entries)")
    p.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")


def run(args: argparse.Namespace) -> int:
    from ds4py.errors import ConfigError
    from ds4py.tiny import make_tiny

    shape = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    if args.compress_ratios:
        try:
            shape["compress_ratios"] = [int(r) for r in args.compress_ratios.split(",")]
        except ValueError:
            raise ConfigError(f"--compress-ratios {args.compress_ratios!r} is not a comma-separated list of integers")
    make_tiny(args.out, seed=args.seed, experts=args.experts, name=args.name, progress=args.verbose,
              mtp=args.mtp, vocab="v4" if args.v4_vocab else "tiny", **shape)
    print(args.out)
    return 0
