"""Launch counts per step, listed so a refactor of the engine's wiring can be checked to change none of them:
for each full-size shape (ds4py/cuda/plan.py, a PlanRuntime: recorded, never run) the decode step (body + head
with the sampler), a 4-row verify step and a 2,048-token prefill block, at two contexts: the number of launches,
how many on the side stream, a digest of the whole sequence (kernel, grid, block, shared memory, stream, pdl) and
one of every launch's arguments (the pointers by the plan runtime's labels and sizes, the scalars by value).

    python3 bench/launch_counts.py [--device h200] > before.txt   # then again after, and diff
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds4py.cuda.plan import plan_step  # noqa: E402

CASES = [("v4-flash-q2", k, ctx) for k in ("decode", "rows", "prefill") for ctx in (300, 4096)] + \
        [("v41-flash-vq", k, ctx) for k in ("decode", "rows", "prefill") for ctx in (300, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h200")
    a = ap.parse_args()
    print(f"{'shapes':14} {'kind':8} {'ctx':>5} {'launches':>8} {'side':>5}  {'digest':16}  args")
    for shapes, kind, ctx in CASES:
        ls = plan_step(shapes, kind, a.device, ctx=ctx, rows=4, block=2048)
        h = hashlib.sha256(repr([(x.kernel, x.grid, x.block, x.smem, x.stream, x.pdl) for x in ls]).encode())
        args = hashlib.sha256(repr([(x.kernel, x.args, x.scalars) for x in ls]).encode())
        side = sum(x.stream == "side" for x in ls)
        print(f"{shapes:14} {kind:8} {ctx:5} {len(ls):8} {side:5}  {h.hexdigest()[:16]}  {args.hexdigest()[:16]}",
              flush=True)


if __name__ == "__main__":
    main()
