"""Decode a GGUF whose file is larger than the memory the process may hold: either inside a memory
cgroup whose limit is below the file size (Linux cgroup v1 or v2, as root), or, with --limit-mb 0, a file larger
than the machine's RAM with no limit at all. Its pages are demand-paged from the mapped file and dropped again
under pressure. Prints one JSON line: file size, limit, first-token (prefill) and per-token wall times, tokens/s,
peak RSS, private and file-backed RSS, major and minor faults, swap used (the process's VmSwap and the machine's
swap in use before / after), and whether the cgroup ever hit an OOM kill.

    python bench/cpu_paging.py MODEL.gguf --limit-mb 2048 [--tokens 6] [--kernels auto] [--mem-budget-mb 256]
                               [--threads 2] [--cold] [--madvise on|off] [--ds4 PATH/ds4-bench [--rounds N]]

--ds4: ds4's C CPU path in the same cgroup too (its default demand paging of the mapped file, no
--warm-weights), the two engines alternating for --rounds rounds, each run cold when --cold: a 4-token prompt
(ds4: the first 4 tokens of a fixed text; ds4py: ids 1..4), then --tokens greedy decodes, the same threads. Per
run: the cold first token (the 4-token prefill), steady decode s/token, peak RSS, major faults (os.wait4).

--cold drops the file's pages from the page cache first (posix_fadvise DONTNEED); --madvise switches the
memory-budget mode's paging hints (ds4py.ref.weights: random for the routed experts, will-need one layer ahead).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def child(args: argparse.Namespace) -> None:
    import numpy as np

    from ds4py.ref.engine import RefModel

    if args.cold:
        fd = os.open(args.model, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    t_open = time.perf_counter()
    m = RefModel(args.model, kernels=args.kernels, mem_budget_mb=args.mem_budget_mb, threads=args.threads,
                 madvise=args.madvise == "on")
    st = m.new_state()
    t1 = time.perf_counter()
    logits = m.prefill(st, [1, 2, 3, 4])
    times = [time.perf_counter() - t1]
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        logits = m.decode(st, int(np.argmax(logits)))
        times.append(time.perf_counter() - t0)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    st_ = proc_status()
    print(json.dumps({"open_s": round(t1 - t_open, 2), "prefill4_s": round(times[0], 2),
                      "decode_s": [round(t, 2) for t in times[1:]],
                      "tokens_per_s": round(len(times[1:]) / sum(times[1:]), 3) if times[1:] else None,
                      "peak_rss_mb": round(ru.ru_maxrss / 1024), "private_mb": round(st_.get("RssAnon", 0) / 2**20),
                      "file_rss_mb": round(st_.get("RssFile", 0) / 2**20), "swap_mb": round(st_.get("VmSwap", 0) / 2**20),
                      "major_faults": ru.ru_majflt, "minor_faults": ru.ru_minflt,
                      "cpu_s": round(ru.ru_utime + ru.ru_stime, 1), "loadavg": os.getloadavg()[0],
                      "finite": bool(np.isfinite(logits).all())}))


def proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "VmSwap"):
                out[k] = int(v.split()[0]) * 1024
    return out


def swap_used_mb() -> int:
    """The machine's swap in use (SwapTotal - SwapFree), MB."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            info[k] = int(v.split()[0])
    return round((info.get("SwapTotal", 0) - info.get("SwapFree", 0)) / 1024)


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
    ap.add_argument("--kernels", default="auto", choices=["auto", "jit", "fused", "dequant"])
    ap.add_argument("--ds4", help="ds4's ds4-bench binary: run it beside ds4py in the same cgroup")
    ap.add_argument("--rounds", type=int, default=1, help="with --ds4: rounds of (ds4py, ds4), order alternating")
    ap.add_argument("--mem-budget-mb", type=float, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the file's pages from the page cache first")
    ap.add_argument("--madvise", choices=["on", "off"], default="on")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    d, procs = cgroup(args.limit_mb << 20) if args.limit_mb > 0 else (None, None)
    if args.ds4:
        results = []
        for r in range(args.rounds):
            for eng in (("ds4py", "ds4") if r % 2 == 0 else ("ds4", "ds4py")):
                res = run_ds4py(args, procs) if eng == "ds4py" else run_ds4(args, procs)
                res.update(engine=eng, round=r, loadavg=round(os.getloadavg()[0], 1),
                           oom_kills=oom_kills(d) if d is not None else None)
                results.append(res)
                print(json.dumps(res), flush=True)
        print(json.dumps({"file_gb": round(os.path.getsize(args.model) / 1e9, 2), "limit_mb": args.limit_mb,
                          "runs": results}))
    else:
        res = run_ds4py(args, procs)
        res["oom_kills"] = oom_kills(d) if d is not None else None
        print(json.dumps(res))
    if d is not None:
        try:
            d.rmdir()
        except OSError:
            pass


def _in_cgroup(procs: Path | None):
    return None if procs is None else (lambda: procs.write_text(str(os.getpid())))


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def run_ds4py(args: argparse.Namespace, procs: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--child", args.model, "--tokens", str(args.tokens), "--kernels", args.kernels,
           "--mem-budget-mb", str(args.mem_budget_mb), "--threads", str(args.threads), "--madvise", args.madvise]
    if args.cold:
        cmd.append("--cold")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": REPO}
    swap0 = swap_used_mb()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_in_cgroup(procs))
    out, _ = p.communicate()
    res = {"file_gb": round(os.path.getsize(args.model) / 1e9, 2), "ram_gb": round(os.sysconf("SC_PHYS_PAGES")
           * os.sysconf("SC_PAGE_SIZE") / 1e9, 1), "limit_mb": args.limit_mb, "kernels": args.kernels,
           "mem_budget_mb": args.mem_budget_mb, "threads": args.threads, "cold": args.cold, "madvise": args.madvise,
           "returncode": p.returncode, "machine_swap_used_mb": [swap0, swap_used_mb()]}
    if p.returncode == 0:
        res.update(json.loads(out.strip().splitlines()[-1]))
    return res


def run_ds4(args: argparse.Namespace, procs: Path | None) -> dict:
    """ds4-bench in the cgroup: a 4-token prefill (the cold first token), then --tokens decodes."""
    import csv
    import tempfile

    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split() * 4
    with tempfile.TemporaryDirectory() as tmp:
        prompt, out = os.path.join(tmp, "p.txt"), os.path.join(tmp, "ds4.csv")
        Path(prompt).write_text(" ".join(words) + "\n")
        if args.cold:
            drop_cache(args.model)
        t = time.perf_counter()
        p = subprocess.Popen([args.ds4, "-m", args.model, "--cpu", "-t", str(args.threads), "--prompt-file", prompt,
                              "--ctx-start", "4", "--ctx-max", "4", "--gen-tokens", str(args.tokens), "--csv", out],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_in_cgroup(procs))
        _, status, ru = os.wait4(p.pid, 0)
        err = p.stderr.read().decode(errors="replace")
        res = {"returncode": os.waitstatus_to_exitcode(status), "wall_s": round(time.perf_counter() - t, 1),
               "peak_rss_mb": round(ru.ru_maxrss / 1024), "major_faults": ru.ru_majflt,
               "cpu_s": round(ru.ru_utime + ru.ru_stime, 1), "threads": args.threads, "cold": args.cold}
        if res["returncode"] == 0:
            row = next(csv.DictReader(open(out)))
            res.update(prefill4_s=round(4 / float(row["prefill_tps"]), 2),
                       decode_s_per_token=round(1 / float(row["gen_tps"]), 3))
        else:
            res["stderr"] = err[-500:]
    return res


if __name__ == "__main__":
    main()
