"""`python -m ds4py convert SRC_DIR OUT.gguf`: official V4 Flash safetensors -> ds4-layout GGUF."""

from __future__ import annotations

import argparse

NAME = "convert"
HELP = "convert an official DeepSeek V4 Flash checkpoint folder into a ds4-layout GGUF"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC_DIR", help="folder with config.json and *.safetensors (single or sharded)")
    p.add_argument("out", metavar="OUT.gguf", help="output file (written to a temporary file, renamed at the end)")
    p.add_argument("--experts", choices=["mxfp4", "q4_k", "q2_k", "iq2_xxs", "iq2_xxs_q2_k"], default="mxfp4",
                   help="routed experts: mxfp4 = lossless repack of the official FP4 (default); q4_k / q2_k / iq2_xxs "
                        "= smaller, lossy (iq2_xxs without an importance matrix); iq2_xxs_q2_k = IQ2_XXS gate / up, "
                        "Q2_K down (the public q2 file's mix)")
    p.add_argument("--dense", choices=["q8_0", "q4_k", "f16", "f32"], default="q8_0",
                   help="dense FP8 linears and head: q8_0 (default, lossy) | q4_k (smaller, lossy; Q8_0 where a row "
                        "is not a multiple of 256 wide) | f16 (lossless, F32 where F16 is not exact) | f32")
    p.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                   help="HF tokenizer.json to embed (default: SRC_DIR/tokenizer.json when present)")
    p.add_argument("--mtp", metavar="OUT_MTP.gguf",
                   help="also write the checkpoint's MTP draft block (mtp.0.*) as ds4's separate MTP GGUF here; "
                        "run / serve / bench --mtp OUT_MTP.gguf then decode speculatively (docs/spec.md)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="write the weights without a tokenizer when SRC_DIR has no tokenizer.json (run, chat and serve "
                        "then refuse the file; by default convert refuses such a folder)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar (shown on a terminal only) and no summary line on stderr")


def run(args: argparse.Namespace) -> int:
    from ds4py.convert import convert_checkpoint

    convert_checkpoint(args.src, args.out, experts=args.experts, dense=args.dense, tokenizer=args.tokenizer,
                       progress=not args.quiet, mtp=args.mtp, require_tokenizer=not args.no_tokenizer)
    return 0
