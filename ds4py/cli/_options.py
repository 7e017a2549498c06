"""Options several commands share: --engram-dir (V4.1), --sidecar and --posttrain (docs/vq.md, "Sidecars") (not a command: the leading underscore keeps it out of the dispatcher)."""

from __future__ import annotations

import argparse

ENGRAM_HELP = ("V4.1 models: the folder with the official checkpoint's safetensors shards that hold the Engram "
               "tables (model-00047/48-of-00048.safetensors and their index); default: the folder the model was "
               "converted from, as recorded in the GGUF")


def add_engram_dir(p) -> None:
    p.add_argument("--engram-dir", metavar="DIR", default=None, help=ENGRAM_HELP)


def model_kwargs(args: argparse.Namespace) -> dict:
    """open_model keyword arguments from the shared options (--engram-dir, --sidecar, --posttrain; only those
    given, so that every backend accepts a V4 model's defaults)."""
    return {k: getattr(args, k) for k in ("engram_dir", "sidecar", "posttrain") if getattr(args, k, None) is not None}

def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sidecar", metavar="DIR", default=None,
                   help="domain sidecar directory (sidecar-fit): its gains fold into the VQ row gains and its router "
                        "bias into the selection scores at load; refused unless it was fitted for this model")
    p.add_argument("--posttrain", metavar="DIR", default=None,
                   help="post-training directory (posttrain-fit), stacked on the sidecar it was solved against")


def describe(model) -> str:
    """' + sidecar DIR (gains on 3 layers, router bias on 1)' or ''."""
    stack = getattr(model, "stack", None)
    return f" + {stack.describe()}" if stack is not None else ""
