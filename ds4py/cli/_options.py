"""Options several commands share (not a command: the leading underscore keeps it out of the dispatcher)."""

from __future__ import annotations

import argparse

ENGRAM_HELP = ("V4.1 models: the folder with the official checkpoint's safetensors shards that hold the Engram "
               "tables (model-00047/48-of-00048.safetensors and their index); default: the folder the model was "
               "converted from, as recorded in the GGUF")


def add_engram_dir(p) -> None:
    p.add_argument("--engram-dir", metavar="DIR", default=None, help=ENGRAM_HELP)


def model_kwargs(args: argparse.Namespace) -> dict:
    """open_model keyword arguments from the shared options (only those given, so that every backend accepts
    a V4 model's defaults)."""
    d = getattr(args, "engram_dir", None)
    return {"engram_dir": d} if d is not None else {}
