"""CPU decode and prefill side by side: ds4py's reference backend (default kernels and numerics) against llama.cpp's
llama-bench, on the same GGUF, at the same thread count, interleaved.

    python bench/cpu_vs_llamacpp.py --llama-bench PATH/llama-bench -m MODEL.gguf [--threads 2] [--gen 8]
                                    [--prefill 128,512,2048] [--rounds 3] [--rounds-long 1] [--kernels auto]
                                    [--no-warm] [--json OUT.json]

llama.cpp loads ds4's GGUF layout (architecture `deepseek4`); a ds4py-written file loads there once it carries
the keys llama.cpp requires (deepseek4.expert_gating_func, rope.scaling.type: written since issue 35).

Protocol. The file is read once first (page cache warm; skip with --no-warm), then each round runs every test on
both engines, the order alternating (A/B, B/A, ...), so a load change on a shared machine hits both:
- decode: llama-bench `-p 0 -n G -r 1` (G tokens from an empty context, its own warm-up run first); ds4py: a
  child process that prefills one token and decodes G tokens greedily (argmax), timed around the decode loop.
- prefill P (each of --prefill): llama-bench `-p P -n 0 -r 1`; ds4py: a child that prefills P tokens in one
  call (timed) after one warm-up decode step. Prompt tokens are pseudo-random ids (llama-bench's are random
  too: on the same weights the token values do not change the work).
Prefills longer than 512 tokens run --rounds-long rounds (default 1: ds4py's prefill is slow).
Per run: ms / decoded token or prefill tokens / s, the child's CPU seconds, peak RSS and major page faults
(os.wait4), and the 1-minute load average when it ended. The summary gives min and median over the rounds and
ds4py / llama.cpp ratios (decode time, prefill rate), plus the weight bytes one decode step reads (the file's
matrices a token touches: ds4py.model's WeightBytes) and the GB/s that makes for each engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def child(a: argparse.Namespace) -> dict:
    """One ds4py run in this process: decode (--child-prefill 0) or one prefill of --child-prefill tokens."""
    import numpy as np

    from ds4py.ref.engine import RefModel

    from ds4py.model import Numerics

    t0 = time.perf_counter()
    numerics = Numerics() if a.child_numerics == "exact" else Numerics.ds4()
    m = RefModel(a.model, numerics=numerics, kernels=a.kernels, threads=a.threads)
    open_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    st = m.new_state()
    out = {"kernels": m.kernels_label, "open_s": open_s}
    if a.child_prefill:
        m.decode(st, int(rng.integers(vocab)))                 # warm-up: first calls (kernel loads) not timed
        ids = [int(i) for i in rng.integers(0, vocab, a.child_prefill)]
        t0, c0 = time.perf_counter(), time.process_time()
        m.prefill(st, ids)
        t1, c1 = time.perf_counter(), time.process_time()
        out.update(prefill_tokens=a.child_prefill, prefill_tps=a.child_prefill / (t1 - t0),
                   prefill_cpu_s=c1 - c0)
        return out
    logits = m.prefill(st, [int(rng.integers(vocab))])
    logits = m.decode(st, int(np.argmax(logits)))            # warm-up step, not timed
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(a.gen):
        logits = m.decode(st, int(np.argmax(logits)))
    t1, c1 = time.perf_counter(), time.process_time()
    out.update(decode_ms=1e3 * (t1 - t0) / a.gen, decode_cpu_ms=1e3 * (c1 - c0) / a.gen)
    return out


def wait_child(cmd: list[str], env: dict | None = None) -> tuple[str, dict]:
    """Run cmd; its stdout and its own rusage (CPU s, peak RSS bytes, major faults, wall s)."""
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        so, se = out.read(), err.read()
    if code != 0:
        raise SystemExit(f"{os.path.basename(cmd[0])} failed ({code}):\n{se[-3000:]}")
    return so, {"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss": ru.ru_maxrss * 1024,
                "major_faults": ru.ru_majflt, "wall_s": time.perf_counter() - t}


def run_llama(a: argparse.Namespace, prefill: int) -> dict:
    n_p, n_g = (prefill, 0) if prefill else (0, a.gen)
    so, ru = wait_child([a.llama_bench, "-m", a.model, "-t", str(a.threads), "-p", str(n_p), "-n", str(n_g),
                         "-r", "1", "-o", "json"])
    res = json.loads(so[so.index("["):])[0]
    tps = float(res["avg_ts"])
    r = {"engine": "llama.cpp", **ru}
    if prefill:
        r.update(prefill_tokens=prefill, prefill_tps=tps)
    else:
        r.update(decode_ms=1e3 / tps)
    return r


# ds4py's numerics -> the engine's label: the default (int8 activations, as run / chat / serve / bench use on the
# reference backend: Numerics.ds4()) and --exact (fp32 activations: Numerics())
ENGINES = {"default": "ds4py", "exact": "ds4py-exact"}


def run_ds4py(a: argparse.Namespace, prefill: int, numerics: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "-m", a.model, "--threads", str(a.threads),
           "--gen", str(a.gen), "--kernels", a.kernels, "--child-prefill", str(prefill), "--child-numerics", numerics]
    so, ru = wait_child(cmd, {**os.environ, "PYTHONPATH": REPO})
    return {"engine": ENGINES[numerics], **json.loads(so.strip().splitlines()[-1]), **ru}


def warm(path: str) -> float:
    """Read the whole file once (into the page cache); seconds taken."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def decode_bytes(model: str) -> int | None:
    """Weight bytes one decode step reads (ds4py's own count), or None if the model does not say."""
    try:
        from ds4py.ref.engine import RefModel

        return int(RefModel(model, kernels="dequant").weight_bytes_per_token())
    except Exception:                        # the count is a nicety of the summary, not the measurement
        return None


def stats(vals: list[float]) -> dict:
    v = sorted(vals)
    return {"min": v[0], "median": statistics.median(v), "max": v[-1], "n": len(v)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (a CPU build)")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gen", type=int, default=8, help="decoded tokens per decode run")
    p.add_argument("--prefill", default="128,512,2048", help="prefill lengths, comma-separated ('' for none)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rounds-long", type=int, default=1, help="rounds for prefills longer than 512 tokens")
    p.add_argument("--kernels", default="auto", help="ds4py's kernel set (default auto)")
    p.add_argument("--numerics", default="default",
                   help="ds4py runs, comma-separated: default (int8 activations as ds4 and llama.cpp: Numerics.ds4(), "
                        "the CLI's default; ds4py.quant.jit_i8 / jit_decode) and / or exact (fp32 activations: "
                        "--exact, Numerics())")
    p.add_argument("--no-warm", action="store_true", help="skip reading the file into the page cache first")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-prefill", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-numerics", default="default", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    if not a.llama_bench:
        p.error("--llama-bench PATH (llama.cpp's llama-bench binary) is required")
    for path, what in ((a.llama_bench, "--llama-bench"), (a.model, "--model")):
        if not os.path.isfile(path):
            p.error(f"{what}: no such file: {path}")
    prefills = [int(s) for s in a.prefill.split(",") if s.strip()]
    variants = [v.strip() for v in a.numerics.split(",") if v.strip()]
    if not variants or any(v not in ENGINES for v in variants):
        p.error(f"--numerics takes {', '.join(ENGINES)} (comma-separated), got {a.numerics!r}")
    engines = ["llama.cpp"] + [ENGINES[v] for v in variants]
    if not a.no_warm:
        print(f"page cache: read {os.path.getsize(a.model) / 1e9:.2f} GB in {warm(a.model):.1f} s", flush=True)
    tests = [0] + prefills
    rows = []
    for r in range(max(a.rounds, a.rounds_long)):
        order = engines if r % 2 == 0 else engines[::-1]
        for test in tests:
            if r >= (a.rounds_long if test > 512 else a.rounds):
                continue
            for eng in order:
                row = (run_llama(a, test) if eng == "llama.cpp"
                       else run_ds4py(a, test, next(v for v in variants if ENGINES[v] == eng)))
                row.update(round=r, test=f"pp{test}" if test else f"tg{a.gen}", loadavg=os.getloadavg()[0])
                rows.append(row)
                what = (f"prefill {test}: {row['prefill_tps']:.2f} tok/s" if test
                        else f"decode: {row['decode_ms']:.1f} ms/token")
                print(f"round {r} {eng:<10s} {what}  cpu {row['cpu_s']:.1f} s  peak RSS "
                      f"{row['peak_rss'] / 2**20:.0f} MiB  major faults {row['major_faults']}  "
                      f"load {row['loadavg']:.1f}", flush=True)
    per_token = decode_bytes(a.model)
    summary: dict = {"model": a.model, "file_bytes": os.path.getsize(a.model), "threads": a.threads,
                     "gen": a.gen, "rounds": a.rounds, "rounds_long": a.rounds_long, "decode_bytes": per_token,
                     "ds4py_kernels": next(r["kernels"] for r in rows if r["engine"] != "llama.cpp"),
                     "load": stats([r["loadavg"] for r in rows]),
                     "major_faults": {e: sum(r["major_faults"] for r in rows if r["engine"] == e) for e in engines}}
    print(f"ds4py kernels: {summary['ds4py_kernels']}; load average over the runs "
          f"{summary['load']['min']:.1f}..{summary['load']['max']:.1f}; major faults "
          + ", ".join(f"{e} {n}" for e, n in summary["major_faults"].items()))
    for test in tests:
        name = f"pp{test}" if test else f"tg{a.gen}"
        key = "prefill_tps" if test else "decode_ms"
        s = {e: stats([r[key] for r in rows if r["engine"] == e and r["test"] == name]) for e in engines}
        ll = s["llama.cpp"]
        if test:
            print(f"prefill {test:>5d} tok/s    llama.cpp median {ll['median']:.2f} (best {ll['max']:.2f})")
        else:
            print(f"decode ms/token      llama.cpp median {ll['median']:.1f} (min {ll['min']:.1f})"
                  + (f"  {per_token / (ll['median'] / 1e3) / 1e9:.1f} GB/s of {per_token / 1e6:.0f} MB a token"
                     if per_token else ""))
        for e in engines[1:]:
            v = s[e]
            if test:      # a rate: ds4py / llama.cpp >= 1 is the goal
                v["ratio_median"], v["ratio_best"] = v["median"] / ll["median"], v["max"] / ll["max"]
                print(f"                     {e:<10s} median {v['median']:.2f} (best {v['max']:.2f})  rate vs "
                      f"llama.cpp {v['ratio_median']:.3f}x median, {v['ratio_best']:.3f}x best")
            else:         # a time: ds4py / llama.cpp <= 1 is the goal
                v["ratio_median"], v["ratio_min"] = v["median"] / ll["median"], v["min"] / ll["min"]
                print(f"                     {e:<10s} median {v['median']:.1f} (min {v['min']:.1f})  time vs "
                      f"llama.cpp {v['ratio_median']:.2f}x median, {v['ratio_min']:.2f}x min"
                      + (f"  {per_token / (v['median'] / 1e3) / 1e9:.1f} GB/s" if per_token else ""))
        summary[name] = s
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
