"""Options several commands share: --engram-dir (V4.1), --sidecar and --posttrain (docs/vq.md, "Sidecars"), the
reference backend's --kernels / --threads / --mem-budget-mb / --exact (docs/reference.md). Not a command: the leading
underscore keeps it out of the dispatcher."""

from __future__ import annotations

import argparse

from ds4py.cli import BACKENDS
from ds4py.errors import Ds4Error
from ds4py.backends import backend_options

CPU_OPTIONS = ("kernels", "threads", "mem_budget_mb")

ENGRAM_HELP = ("V4.1 models: the folder with the official checkpoint's safetensors shards that hold the Engram "
               "tables (model-00047/48-of-00048.safetensors and their index); default: the folder the model was "
               "converted from, as recorded in the GGUF")


def add_engram_dir(p) -> None:
    p.add_argument("--engram-dir", metavar="DIR", default=None, help=ENGRAM_HELP)


def model_kwargs(args: argparse.Namespace) -> dict:
    """open_model keyword arguments from the shared options (only those given, so that every backend accepts a V4
    model's defaults). The CPU options belong to the reference backend: with another one they are refused."""
    out = {k: getattr(args, k) for k in ("engram_dir", "sidecar", "posttrain", *CPU_OPTIONS)
           if getattr(args, k, None) is not None}
    if out.get("threads") is not None and out["threads"] < 1:
        raise Ds4Error(f"--threads must be at least 1, got {out['threads']}")
    backend = getattr(args, "backend", "ref")
    cpu = [k for k in CPU_OPTIONS if k in out and k not in backend_options(backend)]
    if cpu:
        flags = ", ".join("--" + k.replace("_", "-") for k in cpu)
        raise Ds4Error(f"{flags} apply to the reference backend only, not --backend {backend}")
    return out


def add_cpu_arguments(p, numerics: bool = True) -> None:
    """--kernels / --threads / --mem-budget-mb, and --exact where the command takes the default numerics
    (cpu_numerics; score states its own: --act-quant)."""
    p.add_argument("--kernels", choices=["auto", "dequant", "fused", "jit"], default=None,
                   help="reference backend: 'jit' decodes straight from the stored bytes with compiled (numba) "
                        "kernels, 'fused' the same with numpy kernels (steps of up to 8 rows; no float32 matrices), "
                        "'dequant' dequantises per use (the oracle); 'auto' = jit where numba imports, else fused "
                        "(default: $DS4PY_KERNELS, else auto)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="reference backend: worker threads of the decode kernels (default: the CPU count)")
    p.add_argument("--mem-budget-mb", type=float, default=None, metavar="MB",
                   help="reference backend: bound the dequantised-weight cache and streamed chunks (a model larger "
                        "than RAM runs from the mapped file)")
    if numerics:
        p.add_argument("--exact", action="store_true",
                       help="fp32 activations on any backend (DeepSeek's official numerics, the golden tests' "
                            "tolerances) instead of the default: int8 activations on the reference backend (ds4's "
                            "and llama.cpp's CPU numerics: each quantised matmul sees its activation rounded per "
                            "Q8_0 / Q8_K block, integer dot products; = score --act-quant), the device's declared "
                            "default on CUDA (int8 where fp32 misses its bandwidth target: H200)")
        p.add_argument("--act-quant", action="store_true",
                       help="int8 activations on any backend (ds4's numerics, = score --act-quant: each quantised "
                            "matmul sees its activation rounded per Q8_0 / Q8_K block, F16 KV): the reference "
                            "backend's default; on CUDA the default of a device where fp32 misses its bandwidth "
                            "target, else opt-in (docs/cuda.md 'Activation numerics')")


INT8_LINE = ("ds4py: numerics: int8 activations (each quantised matmul's input rounded per Q8_0 / Q8_K block, as "
             "ds4's and llama.cpp's CPU paths; F16 KV); --exact for fp32 activations")
EXACT_LINE = "ds4py: numerics: fp32 activations (--exact: DeepSeek's official numerics)"
OPT_IN_INT8_LINE = ("ds4py: numerics: int8 activations (--act-quant: each quantised matmul's input rounded per Q8_0 / "
                  "Q8_K block, as ds4's and llama.cpp's CPU paths; F16 KV); without it fp32 activations")


def device_line(act_quant: bool, why: str) -> str:
    """The numerics line of a model that ran its device's declared default (contract.DEVICE_NUMERICS)."""
    if act_quant:
        return f"ds4py: numerics: int8 activations: {why}; --exact for fp32"
    return f"ds4py: numerics: fp32 activations: {why}; --act-quant for int8"


def cpu_numerics(args: argparse.Namespace) -> dict:
    """The numerics for run / chat / serve / bench as an open_model keyword (ds4py.backends.cli_numerics: --exact /
    --act-quant on any backend; else int8 activations on the reference backend, the device's declared default on
    CUDA; {} for a backend that keeps its own). say_numerics prints the line once the model is open."""
    from ds4py.backends import cli_numerics

    numerics = cli_numerics(getattr(args, "backend", "ref"), bool(getattr(args, "exact", False)),
                            bool(getattr(args, "act_quant", False)))
    return {} if numerics is None else {"numerics": numerics}


def say_numerics(args: argparse.Namespace, model) -> None:
    """The one stderr line naming the numerics the opened `model` runs and why (after the open, so that a refused
    file is still one line): the flag's, the reference's default, or the device's declared default (the model's
    numerics_why; where auto fell back to the reference, that backend's int8 default)."""
    import sys

    from ds4py.contract import DEVICE_NUMERICS

    numerics = cpu_numerics(args).get("numerics")
    if isinstance(numerics, str) and numerics == DEVICE_NUMERICS:
        line = device_line(model.numerics.act_quant, model.numerics_why) if model.numerics_why else None
    elif numerics is not None:
        from ds4py.backends import cli_int8_default

        line = INT8_LINE if numerics.act_quant else EXACT_LINE
        if numerics.act_quant and not cli_int8_default(getattr(args, "backend", "ref")):
            line = OPT_IN_INT8_LINE
    else:
        line = None
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def add_engine_arguments(p, numerics: bool = True) -> None:
    """--backend, the stack on the model (add_stack_arguments) and the reference backend's options
    (add_cpu_arguments): what every command that opens a model for the engine takes."""
    p.add_argument("--backend", choices=BACKENDS, default="ref",
                   help="engine backend: ref (numpy, default), cuda (GPU), cuda-emu (the CUDA engine on the CPU "
                        "emulator: slow, for tests), auto (cuda where a GPU can run the model, else ref)")
    add_stack_arguments(p)
    add_cpu_arguments(p, numerics)


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sidecar", metavar="DIR", default=None,
                   help="domain sidecar directory (sidecar-fit): its gains fold into the VQ row gains and its router "
                        "bias into the selection scores at load; refused unless it was fitted for this model")
    p.add_argument("--posttrain", metavar="DIR", default=None,
                   help="post-training directory (posttrain-fit), stacked on the sidecar it was solved against")


def describe(model) -> str:
    """' + sidecar DIR (gains on 3 layers, router bias on 1)' or ''."""
    return f" + {model.stack.describe()}" if model.stack is not None else ""


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (docs/spec.md)")
    g.add_argument("--mtp", metavar="MTP.gguf", default=None,
                   help="the model's MTP draft block (ds4's MTP GGUF, or convert --mtp): decode speculatively, "
                        "same tokens (greedy) or same distribution (sampled), faster when drafts are accepted")
    g.add_argument("--no-spec", action="store_true",
                   help="decode one token a step even when the model has an MTP block")


def choose_model(args: argparse.Namespace, command: str, attr: str = "model", pair: bool = True) -> bool:
    """Resolve -m (a path or a pulled model's name) or, without it, the pulled model to use ($DS4PY_MODEL, the
    config's default, the one pulled, ds4py.hub.choose); set args.<attr> to its file (None: the demo model, which
    the caller announces) and, with pair, a pulled MTP block unless --mtp or --no-spec is given. Prints the one line
    naming the file, except for a path given with -m. Returns True for the demo model."""
    import dataclasses
    import sys

    from ds4py.hub import announce, choose

    given = getattr(args, attr)
    choice = choose(given)
    if choice.path is None:
        return True
    paired = choice.mtp if (pair and getattr(args, "mtp", "absent") is None and not getattr(args, "no_spec", False)) \
        else None
    choice = dataclasses.replace(choice, mtp=paired)
    setattr(args, attr, choice.path)
    if paired:
        args.mtp = paired
    if choice.why != "-m" or choice.name:
        print(announce(command, choice), file=sys.stderr, flush=True)
    return False


def check_new_out(path: str, flag: str = "--out") -> None:
    """A directory a command will create: refused in one sentence when it exists already or its folder does not
    exist or is not writable (before any work starts)."""
    import os

    if os.path.exists(path):
        raise Ds4Error(f"{flag} {path}: already exists; remove it or choose another name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise Ds4Error(f"{flag} {path}: the folder {parent} does not exist or is not writable")
