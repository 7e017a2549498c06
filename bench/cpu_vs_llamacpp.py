"""CPU decode and prefill side by side: ds4py's reference backend (default kernels and numerics) against llama.cpp's
llama-bench, on the same GGUF, at the same thread count, interleaved.

    python bench/cpu_vs_llamacpp.py --llama-bench PATH/llama-bench -m MODEL.gguf [--threads 2] [--gen 8]
                                    [--prefill 128,512,2048] [--rounds 3] [--rounds-long 1] [--kernels auto]
                                    [--no-warm] [--json OUT.json] [--numerics default,exact] [--isa avx2]
    python bench/cpu_vs_llamacpp.py --llama-bench PATH/llama-bench -m MODEL.gguf --cgroup-mb 2048 [--gen 8]
                                    [--rounds 2] [--cgroup-prompt 4] [--numerics default]

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
--cgroup-mb N: the memory-cgroup case instead (issue 35 item 2, seed 002: a file larger than the memory it may
use). Both engines run in a memory cgroup of N MiB (cgroup v1 or v2, as root: bench/cpu_paging.cgroup), each run
cold (the file's pages dropped first, posix_fadvise DONTNEED; pages another process maps stay, so the resident
share before the run is printed): first token = process start to the logits of a --cgroup-prompt-token prompt
(llama.cpp: the wall time of llama-bench `-p P -n 0 -r 1 --no-warmup`, its load included), then steady decode
(ds4py: the median of --gen decode steps after the first one, same process; llama.cpp: `-p 0 -n G -r 1` right
after, warm-up run included, its tg rate). ds4py runs with its paging hints on (madvise: routed experts
MADV_RANDOM, each layer's dense tensors MADV_WILLNEED one layer ahead) and the lean private memory.
--isa avx2 builds ds4py's kernels without AVX-512 (ds4py.quant.isa: the laptop case measured on an AVX-512 host;
give --llama-bench an AVX2-only llama.cpp build, cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_AVX512=OFF, for the same comparison).
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
import time

from cpu_harness import in_turn, run_child, save, stats, wait_child


def child(a: argparse.Namespace) -> dict:
    """One ds4py run in this process: decode (--child-prefill 0) or one prefill of --child-prefill tokens."""
    import numpy as np

    from ds4py.ref.engine import RefModel

    from ds4py.model import Numerics

    t0 = time.perf_counter()
    numerics = Numerics() if a.child_numerics == "exact" else Numerics.ds4()
    m = RefModel(a.model, numerics=numerics, kernels=a.kernels, threads=a.threads,
                 madvise=True if a.child_cgroup else None)
    open_s = time.perf_counter() - t0
    populate_s = 0.0
    if m.populating is not None and not a.child_cgroup:    # as llama.cpp's load (MAP_POPULATE): before the clock
        t0 = time.perf_counter()
        m.populating.join()
        populate_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    st = m.new_state()
    from ds4py.quant import jit_decode                    # which ISA path the kernels took (--isa)
    out = {"kernels": m.kernels_label, "open_s": open_s, "populate_wait_s": populate_s,
           "isa_path": ("avx512" if jit_decode.AVX512 else "avx2" if jit_decode.AVX2
                        else "neon" if jit_decode.NEON else "portable")}
    if a.child_cgroup:                                     # memory-cgroup case: cold first token, then decode
        logits = m.prefill(st, [int(i) for i in rng.integers(0, vocab, a.cgroup_prompt)])
        out["first_token_at"] = time.time()
        steps = []
        for _ in range(a.gen):
            t0 = time.perf_counter()
            logits = m.decode(st, int(np.argmax(logits)))
            steps.append(time.perf_counter() - t0)
        out.update(decode_steps_ms=[round(1e3 * t, 1) for t in steps],
                   decode_ms=1e3 * statistics.median(steps[1:] if len(steps) > 1 else steps),
                   resident_mib=resident_by_kind(m))
        return out
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


def resident_by_kind(m) -> dict | None:
    """MiB of the mapped file in memory after the run, split into routed experts and everything else (mincore on
    each tensor's pages), with the totals: what the page cache kept under the cgroup's limit."""
    import ctypes
    import mmap as _mmap

    import numpy as np

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        tensors = m.weights.f.tensors
    except (OSError, AttributeError):
        return None
    page = _mmap.PAGESIZE
    out = {"experts": 0.0, "dense": 0.0, "experts_total": 0.0, "dense_total": 0.0}
    for name, t in tensors.items():
        raw = np.asarray(t.raw_bytes() if hasattr(t, "raw_bytes") else t.raw)
        addr = raw.ctypes.data
        start = addr - addr % page
        n = (addr + t.nbytes - start + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
            return None
        kind = "experts" if "_exps" in name else "dense"
        out[kind] += int((np.frombuffer(vec, np.uint8) & 1).sum()) * page / 2**20
        out[kind + "_total"] += t.nbytes / 2**20
    return {k: round(v) for k, v in out.items()}


def run_llama(a: argparse.Namespace, prefill: int) -> dict:
    n_p, n_g = (prefill, 0) if prefill else (0, a.gen)
    so, ru = wait_child([a.llama_bench, "-m", a.model, "-t", str(a.threads), "-p", str(n_p), "-n", str(n_g),
                         "-r", "1", "-o", "json", *a.llama_args.split()])
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
    res, ru = run_child(__file__, ["-m", a.model, "--threads", str(a.threads), "--gen", str(a.gen), "--kernels",
                                   a.kernels, "--child-prefill", str(prefill), "--child-numerics", numerics])
    return {"engine": ENGINES[numerics], **res, **ru}


def resident_share(path: str) -> float | None:
    """The share of the file's pages in the page cache (util-linux fincore), or None without it."""
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES,SIZE", path], capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0]) / max(1, int(out[1]))
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def cgroup_llama(a: argparse.Namespace, procs) -> dict:
    """llama.cpp in the cgroup, cold: load + a --cgroup-prompt prefill (first token), then a decode run."""
    # -lm mmap --repack 0: with its defaults llama-bench was OOM-killed in a 2,048 MiB cgroup on the 9.5 GB file
    # (its CPU backend repacks Q8_0 weights into anonymous buffers); mapped and not repacked, the weights stay
    # reclaimable file pages, as ds4py's are
    first, ru1 = wait_child([a.llama_bench, "-m", a.model, "-t", str(a.threads), "-p", str(a.cgroup_prompt),
                             "-n", "0", "-r", "1", "--no-warmup", "-lm", "mmap", "--repack", "0", "-o", "json"],
                            procs=procs)
    so, ru2 = wait_child([a.llama_bench, "-m", a.model, "-t", str(a.threads), "-p", "0", "-n", str(a.gen),
                          "-r", "1", "-lm", "mmap", "--repack", "0", "-o", "json"], procs=procs)
    tps = float(json.loads(so[so.index("["):])[0]["avg_ts"])
    return {"engine": "llama.cpp", "first_token_s": ru1["wall_s"], "decode_ms": 1e3 / tps,
            "major_faults": ru1["major_faults"] + ru2["major_faults"], "peak_rss": max(ru1["peak_rss"], ru2["peak_rss"]),
            "cpu_s": ru1["cpu_s"] + ru2["cpu_s"], "decode_run_major_faults": ru2["major_faults"]}


def cgroup_ds4py(a: argparse.Namespace, numerics: str, procs) -> dict:
    res, ru = run_child(__file__, ["--child-cgroup", "-m", a.model, "--threads", str(a.threads), "--gen", str(a.gen),
                                   "--kernels", a.kernels, "--child-numerics", numerics, "--cgroup-prompt",
                                   str(a.cgroup_prompt)], procs=procs)
    return {"engine": ENGINES[numerics], **res, **ru, "first_token_s": res["first_token_at"] - ru["start_at"]}


def run_cgroup(a: argparse.Namespace, variants: list[str]) -> dict:
    """The memory-cgroup case: every run cold, engines alternating, --rounds rounds."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_paging import cgroup, drop_cache, oom_kills

    try:
        d, procs = cgroup(a.cgroup_mb << 20)
    except OSError as e:
        raise SystemExit(f"cannot make a memory cgroup here ({e}): run as root on Linux with cgroup v1 or v2")
    engines = ["llama.cpp"] + variants
    rows = []
    try:
        for r in range(a.rounds):
            for eng in in_turn(engines, r):
                drop_cache(a.model)
                before = resident_share(a.model)
                try:
                    row = cgroup_llama(a, procs) if eng == "llama.cpp" else cgroup_ds4py(a, eng, procs)
                except SystemExit as e:                 # killed (the cgroup's OOM killer) or failed: say so, go on
                    row = {"engine": "llama.cpp" if eng == "llama.cpp" else ENGINES[eng], "error": str(e)[:300]}
                row.update(round=r, resident_before=before, loadavg=os.getloadavg()[0], oom_kills=oom_kills(d))
                rows.append(row)
                if "error" in row:
                    print(f"round {r} {row['engine']:<10s} cgroup {a.cgroup_mb} MiB: FAILED ({row['error'][:80]}), "
                          f"OOM kills {row['oom_kills']}", flush=True)
                    continue
                print(f"round {r} {row['engine']:<10s} cgroup {a.cgroup_mb} MiB, cold: first token "
                      f"{row['first_token_s']:.1f} s, decode {row['decode_ms']:.0f} ms/token, peak RSS "
                      f"{row['peak_rss'] / 2**20:.0f} MiB, major faults {row['major_faults']}, file resident before "
                      f"{'?' if before is None else f'{100 * before:.1f}%'}, OOM kills {row['oom_kills']}, "
                      + (f"resident after (MiB) {row['resident_mib']}, " if row.get("resident_mib") else "") +
                      f"load {row['loadavg']:.1f}", flush=True)
    finally:
        try:
            d.rmdir()
        except OSError:
            pass
    names = ["llama.cpp"] + [ENGINES[v] for v in variants]
    summary = {"model": a.model, "file_bytes": os.path.getsize(a.model), "cgroup_mb": a.cgroup_mb,
               "threads": a.threads, "gen": a.gen, "prompt": a.cgroup_prompt}
    for e in names:
        mine = [r for r in rows if r["engine"] == e and "error" not in r]
        if not mine:
            summary[e] = {"failed": sum(r["engine"] == e for r in rows)}
            print(f"{e:<10s} every run failed")
            continue
        summary[e] = {"first_token_s": stats([r["first_token_s"] for r in mine]),
                      "decode_ms": stats([r["decode_ms"] for r in mine])}
        print(f"{e:<10s} first token median {summary[e]['first_token_s']['median']:.1f} s (min "
              f"{summary[e]['first_token_s']['min']:.1f}), decode median {summary[e]['decode_ms']['median']:.0f} "
              f"ms/token (min {summary[e]['decode_ms']['min']:.0f})")
    return {"summary": summary, "runs": rows}


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (a CPU build)")
    p.add_argument("--llama-args", default="",
                   help="extra llama-bench arguments for the side-by-side runs, e.g. '--repack 0' where its default "
                        "build aborts at context creation (an Intel AMX host: ggml_backend_sched_split_graph)")
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
    p.add_argument("--isa", default="native",
                   help="instruction set ds4py's compiled kernels are built for: native (the host's), avx2 (AVX2 + FMA "
                        "without AVX-512: the laptop case on an AVX-512 host; pair it with an AVX2-only llama.cpp "
                        "build), neon (aarch64 with the dot-product extension: the sdot path), portable "
                        "(ds4py.quant.isa)")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-prefill", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-numerics", default="default", help=argparse.SUPPRESS)
    p.add_argument("--child-cgroup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cgroup-mb", type=int, default=0,
                   help="run the memory-cgroup case instead: both engines in a memory cgroup of this many MiB, cold")
    p.add_argument("--cgroup-prompt", type=int, default=4, help="prompt tokens before the first token (--cgroup-mb)")
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    if not a.llama_bench:
        p.error("--llama-bench PATH (llama.cpp's llama-bench binary) is required")
    from ds4py.quant import isa
    try:
        os.environ.update(isa.numba_env(a.isa))           # the ds4py children inherit it
    except ValueError as e:
        p.error(str(e))
    for path, what in ((a.llama_bench, "--llama-bench"), (a.model, "--model")):
        if not os.path.isfile(path):
            p.error(f"{what}: no such file: {path}")
    prefills = [int(s) for s in a.prefill.split(",") if s.strip()]
    variants = [v.strip() for v in a.numerics.split(",") if v.strip()]
    if a.cgroup_mb and variants == ["none"]:                 # the cgroup case for llama.cpp alone
        variants = []
    elif not variants or any(v not in ENGINES for v in variants):
        p.error(f"--numerics takes {', '.join(ENGINES)} (comma-separated), got {a.numerics!r}")
    engines = ["llama.cpp"] + [ENGINES[v] for v in variants]
    if a.cgroup_mb:
        out = run_cgroup(a, variants)
        save(a.json, out["summary"], out["runs"])
        return 0
    if not a.no_warm:
        print(f"page cache: read {os.path.getsize(a.model) / 1e9:.2f} GB in {warm(a.model):.1f} s", flush=True)
    tests = [0] + prefills
    rows = []
    for r in range(max(a.rounds, a.rounds_long)):
        for test in tests:
            if r >= (a.rounds_long if test > 512 else a.rounds):
                continue
            for eng in in_turn(engines, r):
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
    summary: dict = {"model": a.model, "file_bytes": os.path.getsize(a.model), "threads": a.threads, "isa": a.isa, "llama_args": a.llama_args,
                     "gen": a.gen, "rounds": a.rounds, "rounds_long": a.rounds_long, "decode_bytes": per_token,
                     "ds4py_kernels": next(r["kernels"] for r in rows if r["engine"] != "llama.cpp"),
                     "load": stats([r["loadavg"] for r in rows]),
                     "major_faults": {e: sum(r["major_faults"] for r in rows if r["engine"] == e) for e in engines}}
    summary["isa_path"] = sorted({r["isa_path"] for r in rows if "isa_path" in r})
    print(f"ds4py kernels: {summary['ds4py_kernels']} (--isa {a.isa}: {', '.join(summary['isa_path'])} path); "
          "load average over the runs "
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
    save(a.json, summary, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
