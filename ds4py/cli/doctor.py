"""`python -m ds4py doctor`: driver, CUDA, NVRTC, device, a kernel smoke test, copy bandwidth, the emulator and
what `--backend auto` would pick; with -m, a model's first positions on the GPU against the reference."""

from __future__ import annotations

import argparse
import json

NAME = "doctor"
HELP = "check this machine: GPU, driver, NVRTC, a kernel smoke test, bandwidth, the emulator (-m: a model vs ref)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", metavar="MODEL.gguf",
                   help="also run a few prompt and decode positions on the GPU and on the reference, same ids")
    p.add_argument("--backend", choices=("cuda", "cuda-emu"), default="cuda",
                   help="where -m runs against the reference: the GPU (default) or the CPU emulator")
    p.add_argument("--positions", default="8,3", metavar="PROMPT,DECODE",
                   help="with -m: how many prompt positions and greedy decode steps to compare (default 8,3)")
    p.add_argument("--exact", action="store_true",
                   help="with -m: fp32 activations on the GPU and the reference (default: the device's declared "
                        "default, docs/cuda.md 'Activation numerics')")
    p.add_argument("--act-quant", action="store_true",
                   help="with -m: int8 activations on the GPU and the reference (Numerics.ds4())")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write the report as JSON (to FILE, or to standard output instead of the table)")


def run(args: argparse.Namespace) -> int:
    from ds4py.cuda import doctor

    from ds4py.errors import Ds4Error

    try:
        n_prompt, n_decode = (int(x) for x in args.positions.split(","))
        if n_prompt < 1 or n_decode < 0:
            raise ValueError
    except ValueError:
        raise Ds4Error(f"--positions takes PROMPT,DECODE (at least 1 and 0), got {args.positions!r}") from None
    from ds4py.backends import cli_numerics

    numerics = cli_numerics(args.backend, args.exact, args.act_quant)     # both: one sentence
    rep = doctor.run(args.model, args.backend, n_prompt, n_decode, numerics)
    if args.json == "-":
        print(json.dumps(rep.as_json(), indent=1))
    else:
        print(doctor.render(rep))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rep.as_json(), f, indent=1)
    return 0 if rep.ok else 1
