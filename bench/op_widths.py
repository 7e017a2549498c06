"""Parameters of every public op in ds4py/cuda/ops (issue 36: no op wider than MAX_PARAMS), widest first, from the AST:

    python3 bench/op_widths.py [--min 10]

A parameter is anything in the signature (rt, stream and pdl included; a *args or **kwargs counts one). tests/
test_op_widths.py fails when an op grows past MAX_PARAMS: a wider op groups its shapes and pointers into a small
named struct (a layer's shapes and arrays, a call's buffers; see docs/cuda.md "ops/").
"""

from __future__ import annotations

import argparse
import ast
import pathlib

OPS = pathlib.Path(__file__).resolve().parent.parent / "ds4py" / "cuda" / "ops"
MAX_PARAMS = 8


def widths() -> list[tuple[int, str]]:
    """(parameter count, module.function) of every public top-level function of ds4py/cuda/ops."""
    rows = []
    for p in sorted(OPS.glob("*.py")):
        for n in ast.parse(p.read_text()).body:
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"):
                a = n.args
                k = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                rows.append((k, f"{p.stem}.{n.name}"))
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min", type=int, default=0, help="list only ops with at least this many parameters")
    a = ap.parse_args()
    rows = widths()
    for k, name in rows:
        if k >= a.min:
            print(f"{k:3} {name}")
    print(f"{sum(k >= 10 for k, _ in rows)} ops take >= 10 parameters, {sum(k >= 14 for k, _ in rows)} take >= 14, "
          f"{sum(k > MAX_PARAMS for k, _ in rows)} more than {MAX_PARAMS}")


if __name__ == "__main__":
    main()
