"""Decode a GGUF whose file is larger than the memory the process may hold: run it inside a memory cgroup whose
limit is below the file size (Linux cgroup v1 or v2, as root), so its pages are demand-paged from the mapped file
and dropped again under pressure (issue 14). Prints one JSON line: file size, limit, per-token wall time, peak
RSS, major faults, and whether the cgroup ever hit an OOM kill.

    python bench/cpu_paging.py MODEL.gguf --limit-mb 2048 [--tokens 6] [--kernels fused] [--mem-budget-mb 256]

Make a real-width file first, e.g. `python -m ds4py make-synthetic /tmp/syn2.gguf --layers 2` (5.55 GB).
The child process is this script with --child, moved into the cgroup before it opens the model."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    import numpy as np

    from ds4py.ref.engine import RefModel

    m = RefModel(args.model, kernels=args.kernels, mem_budget_mb=args.mem_budget_mb)
    st = m.new_state()
    t0 = time.perf_counter()
    logits = m.prefill(st, [1, 2, 3, 4])
    times = [time.perf_counter() - t0]
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        logits = m.decode(st, int(np.argmax(logits)))
        times.append(time.perf_counter() - t0)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"prefill4_s": round(times[0], 2), "decode_s": [round(t, 2) for t in times[1:]],
                      "peak_rss_mb": round(ru.ru_maxrss / 1024), "major_faults": ru.ru_majflt,
                      "finite": bool(np.isfinite(logits).all())}))


def cgroup(limit: int) -> tuple[Path, Path]:
    """(the cgroup folder, the file a pid is written to): v2 if mounted, else v1 memory."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "memory" in v2.read_text():
        d = Path("/sys/fs/cgroup/ds4py-paging")
        d.mkdir(exist_ok=True)
        (d / "memory.max").write_text(str(limit))
        (d / "memory.swap.max").write_text("0")
        return d, d / "cgroup.procs"
    d = Path("/sys/fs/cgroup/memory/ds4py-paging")
    d.mkdir(exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(str(limit))
    return d, d / "cgroup.procs"


def oom_kills(d: Path) -> int:
    for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
        f = d / name
        if f.exists():
            for line in f.read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--limit-mb", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--kernels", default="fused", choices=["fused", "dequant"])
    ap.add_argument("--mem-budget-mb", type=float, default=256)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    d, procs = cgroup(args.limit_mb << 20)
    cmd = [sys.executable, __file__, "--child", args.model, "--tokens", str(args.tokens), "--kernels", args.kernels,
           "--mem-budget-mb", str(args.mem_budget_mb)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: procs.write_text(str(os.getpid())))
    out, _ = p.communicate()
    res = {"file_gb": round(os.path.getsize(args.model) / 1e9, 2), "limit_mb": args.limit_mb,
           "kernels": args.kernels, "mem_budget_mb": args.mem_budget_mb, "returncode": p.returncode,
           "oom_kills": oom_kills(d)}
    if p.returncode == 0:
        res.update(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps(res))
    try:
        d.rmdir()
    except OSError:
        pass


if __name__ == "__main__":
    main()
