"""Decode on the numpy backend: the fused kernels against the dequantise path, with the memory they keep.

    python bench/cpu_fused.py -m MODEL.gguf [-m ...] [--kernels dequant,fused,jit] [--threads 2] [--steps 4]
                              [--mem-budget-mb 1024] [--cold] [--json OUT.json]
    python bench/cpu_fused.py --tiny        # the golden ds4-tiny model and a make-tiny file (q4_k experts)

Each (model, kernels) pair runs in a fresh child process, so its peak RSS and page faults are its own: a short
prefill, one first decode (cold when --cold: the file's pages are dropped from the page cache first with
posix_fadvise, no root needed), then --steps timed decodes. Reported: ms per decode token (wall, min and
median; and the median CPU time of all threads, steadier on a shared machine), the first decode, peak RSS
(VmHWM), private memory (RssAnon at the end), file-backed RSS, major faults, swap, and
the largest difference of the last logits between the kernel sets (max |a - b| / max |a|).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

PROMPT = [1, 5, 9, 2]
TOKENS = [4, 8, 6, 3, 7, 11, 10, 12, 13, 14, 15, 16]


def proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "VmSwap"):
                out[k] = int(v.split()[0]) * 1024
    return out


def child(a: argparse.Namespace) -> dict:
    from ds4py.ref.engine import RefModel

    if a.cold:
        fd = os.open(a.model[0], os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    t0 = time.perf_counter()
    m = RefModel(a.model[0], kernels=a.kernels, threads=a.threads, mem_budget_mb=a.mem_budget_mb)
    st = m.new_state()
    m.prefill(st, PROMPT)
    t1 = time.perf_counter()
    logits = m.decode(st, TOKENS[0])
    t2 = time.perf_counter()
    times, cpu = [], []
    for tok in TOKENS[1:1 + a.steps]:
        s, c = time.perf_counter(), time.process_time()
        logits = m.decode(st, tok)
        times.append(time.perf_counter() - s)
        cpu.append(time.process_time() - c)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    np.save(a.logits_out, logits)
    return {"model": os.path.basename(a.model[0]), "file_bytes": os.path.getsize(a.model[0]), "kernels": a.kernels,
            "threads": a.threads, "mem_budget_mb": a.mem_budget_mb, "cold": a.cold,
            "load_prefill_s": t1 - t0, "first_decode_s": t2 - t1,
            "decode_ms_min": 1e3 * min(times), "decode_ms_median": 1e3 * float(np.median(times)),
            "decode_cpu_ms_median": 1e3 * float(np.median(cpu)), "steps": len(times),
            "loadavg": os.getloadavg()[0], "major_faults": ru.ru_majflt - faults0, **proc_status()}


def run_one(model: str, kernels: str, a: argparse.Namespace, tmp: str) -> tuple[dict, np.ndarray]:
    out = os.path.join(tmp, f"{os.path.basename(model)}.{kernels}.npy")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "-m", model, "--kernels", kernels,
           "--threads", str(a.threads), "--steps", str(a.steps), "--logits-out", out]
    if a.mem_budget_mb is not None:
        cmd += ["--mem-budget-mb", str(a.mem_budget_mb)]
    if a.cold:
        cmd.append("--cold")
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    if r.returncode != 0:
        raise SystemExit(f"{model} ({kernels}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), np.load(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", action="append", default=[])
    p.add_argument("--tiny", action="store_true", help="also the golden ds4-tiny model and a make-tiny q4_k file")
    p.add_argument("--kernels", default="dequant,fused,jit")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mem-budget-mb", type=float, default=None)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--logits-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        models = list(a.model)
        if a.tiny:
            from ds4py.tiny import make_tiny

            models.insert(0, os.path.join(REPO, "..", "shared", "golden", "ds4-tiny", "tiny.gguf"))
            q4 = os.path.join(tmp, "tiny-q4_k.gguf")
            make_tiny(q4, seed=0, experts="q4_k")
            models.insert(1, q4)
        rows = []
        for model in models:
            logits = {}
            for k in a.kernels.split(","):
                r, logits[k] = run_one(model, k, a, tmp)
                rows.append(r)
            if len(logits) > 1:
                ref = logits[a.kernels.split(",")[0]]
                for k, v in logits.items():
                    rel = float(np.abs(v - ref).max() / np.abs(ref).max())
                    next(r for r in rows if r["model"] == os.path.basename(model) and r["kernels"] == k)[
                        "logits_rel_diff"] = rel
        hdr = (f"{'model':<24s} {'GB':>5s} {'kernels':<8s} {'first s':>8s} {'ms/tok min':>10s} {'median':>8s} "
               f"{'cpu ms':>8s} {'peak RSS':>9s} {'private':>8s} {'file RSS':>9s} {'maj flt':>8s} {'swap':>5s} "
               f"{'logit diff':>10s}")
        print(hdr)
        mb = lambda b: f"{b / 2**20:.0f}M"   # noqa: E731
        for r in rows:
            print(f"{r['model'][:24]:<24s} {r['file_bytes'] / 1e9:5.2f} {r['kernels']:<8s} {r['first_decode_s']:8.2f} "
                  f"{r['decode_ms_min']:10.1f} {r['decode_ms_median']:8.1f} "
                  f"{r['decode_cpu_ms_median']:8.1f} {mb(r['VmHWM']):>9s} "
                  f"{mb(r['RssAnon']):>8s} {mb(r['RssFile']):>9s} {r['major_faults']:8d} {mb(r.get('VmSwap', 0)):>5s} "
                  f"{r.get('logits_rel_diff', 0.0):10.2e}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
