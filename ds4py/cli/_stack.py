"""`--sidecar DIR` and `--posttrain DIR`, shared by run, chat, serve, score and bench (docs/vq.md, "Sidecars")."""

from __future__ import annotations

import argparse


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sidecar", metavar="DIR", default=None,
                   help="domain sidecar directory (sidecar-fit): its gains fold into the VQ row gains and its router "
                        "bias into the selection scores at load; refused unless it was fitted for this model")
    p.add_argument("--posttrain", metavar="DIR", default=None,
                   help="post-training directory (posttrain-fit), stacked on the sidecar it was solved against")


def stack_kwargs(args: argparse.Namespace) -> dict:
    """open_model keyword arguments for the given flags (none when neither is given)."""
    return {k: getattr(args, k) for k in ("sidecar", "posttrain") if getattr(args, k, None) is not None}


def describe(model) -> str:
    """' + sidecar DIR (gains on 3 layers, router bias on 1)' or ''."""
    stack = getattr(model, "stack", None)
    return f" + {stack.describe()}" if stack is not None else ""
