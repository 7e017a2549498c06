"""`ds4py pull NAME`: download a model from the Hugging Face Hub, resumably and checked (docs/pull.md)."""

from __future__ import annotations

import argparse
import sys

NAME = "pull"
HELP = "download a model from the Hugging Face Hub (v4-flash-q2, v4-flash-q4, v4-flash-mtp, v41-flash-official, " \
       "or REPO/FILE), resumable and checked against the Hub's sha256"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ds4py.hub import CATALOGUE

    names = "; ".join(f"{e.name}: {e.about}" for e in CATALOGUE.values())
    p.add_argument("name", metavar="NAME", help=f"a catalogue name ({names}) or OWNER/REPO/FILE for any file")
    p.add_argument("--force", action="store_true",
                   help="fetch the files again even when they are here (a corrupt or truncated copy)")
    p.add_argument("--revision", default="main", help="branch, tag or commit on the Hub (default main)")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="download even when the memory plan says this machine cannot run the model")


def run(args) -> int:
    from ds4py.pull import Interrupted, pull

    try:
        pull(args.name, force=args.force, skip_memory_check=args.skip_memory_check, revision=args.revision)
    except Interrupted as e:
        print(f"ds4py pull {args.name}: {e}", file=sys.stderr, flush=True)
        return 130
    return 0
