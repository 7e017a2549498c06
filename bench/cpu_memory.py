"""Private memory and open time of the CPU reference backend, as `run` / `serve` use it (bench, not a test).

    python bench/cpu_memory.py -m MODEL.gguf [--kernels auto] [--threads 2] [--prompt 64] [--gen 8]
                               [--rounds 2] [--compare PATH/OTHER/CHECKOUT] [--json OUT.json] [--open-only]

Each run is a fresh child process (its memory its own): import ds4py, open the model (RefModel, timed wall and
CPU), load the tokenizer from the file (what `run` / `serve` also do), prefill --prompt tokens, decode --gen
tokens greedily. Private memory is the process's anonymous resident memory (RssAnon: what the page cache, and
so the mapped weights, lose to ds4py); it is read after each phase and sampled every 2 ms for its peak. The KV
cache is the state's own bytes (state.nbytes()); "above KV" = peak private - KV. File-backed RSS (the mapped
weights, shared with the page cache) and the peak total RSS are reported beside it.
--compare PATH runs the same protocol with the ds4py of another checkout (e.g. the main branch: the numbers
before a change), the two interleaved round by round, so a busy machine hits both. --open-only: each child stops
after the open (many short rounds: the open's wall / CPU min and median, and the opening thread's own CPU,
without the background threads the open starts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, threading, time
a = json.loads(sys.argv[1])

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out

peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], status()["RssAnon"])
        stop.wait(0.002)
threading.Thread(target=sample, daemon=True).start()
out = {"start_private": status()["RssAnon"]}
w, c = time.perf_counter(), time.process_time()
from ds4py.ref.engine import RefModel
from ds4py.tokenizer import Tokenizer
out["import_s"], out["import_cpu_s"] = time.perf_counter() - w, time.process_time() - c
w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
m = RefModel(a["model"], kernels=a["kernels"], threads=a["threads"])
out["open_s"], out["open_cpu_s"] = time.perf_counter() - w, time.process_time() - c
out["open_thread_cpu_s"] = time.thread_time() - t
out["open_private"] = status()["RssAnon"]
out["load"] = os.getloadavg()[0]
if a["open_only"]:
    print("RESULT " + json.dumps(out))
    sys.exit(0)
w = time.perf_counter()
tok = Tokenizer.from_gguf(m.gguf)
out["tokenizer_s"] = time.perf_counter() - w
out["tokenizer_private"] = status()["RssAnon"]
vocab = m.config.vocab_size
ids = [(7 + 31 * i) % vocab for i in range(a["prompt"])]
st = m.new_state()
w = time.perf_counter()
logits = m.prefill(st, ids)
out["prefill_s"] = time.perf_counter() - w
out["prefill_private"] = status()["RssAnon"]
w = time.perf_counter()
for _ in range(a["gen"]):
    logits = m.decode(st, int(logits.argmax()))
out["decode_s_per_token"] = (time.perf_counter() - w) / max(1, a["gen"])
stop.set()
s = status()
out.update(end_private=s["RssAnon"], peak_private=max(peak[0], s["RssAnon"]), file_rss=s["RssFile"],
           peak_rss=s["VmHWM"], kv_bytes=int(st.nbytes()), kernels=m.kernels)
out["above_kv"] = out["peak_private"] - out["kv_bytes"]
print("RESULT " + json.dumps(out))
"""


def run_child(repo: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": repo, "OPENBLAS_NUM_THREADS": "1"}
    spec = json.dumps({"model": args.model, "kernels": args.kernels, "threads": args.threads,
                       "prompt": args.prompt, "gen": args.gen, "open_only": args.open_only})
    r = subprocess.run([sys.executable, "-c", CHILD, spec], capture_output=True, text=True, env=env, cwd="/")
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"cpu_memory: the run with {repo} failed:\n{r.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64, help="prefill tokens (default 64)")
    ap.add_argument("--gen", type=int, default=8, help="decoded tokens (default 8)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compare", metavar="PATH", help="another checkout's root: its ds4py runs interleaved")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--open-only", action="store_true", help="stop each run after the open")
    args = ap.parse_args()
    repos = [("this", REPO)] + ([("compare", os.path.abspath(args.compare))] if args.compare else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in repos}
    for rnd in range(args.rounds):
        for name, repo in (repos if rnd % 2 == 0 else repos[::-1]):
            r = run_child(repo, args)
            runs[name].append(r)
            print(f"round {rnd + 1} {name}: open {r['open_s']:.3f} s (cpu {r['open_cpu_s']:.3f})" + (
                "" if args.open_only else f", peak private {r['peak_private'] / 2**20:.0f} MiB"),
                file=sys.stderr, flush=True)
    mib = lambda v: f"{v / 2**20:.0f}"                                              # noqa: E731
    med = lambda rs, k: statistics.median(r[k] for r in rs)                        # noqa: E731
    if args.open_only:
        loads = [r["load"] for rs in runs.values() for r in rs]
        print(f"model {args.model}, open only, {args.rounds} rounds, load {min(loads):.1f}-{max(loads):.1f}\n")
        print("| ds4py | open wall s min / median | open CPU s min / median | opening thread CPU s median |")
        print("|---|---|---|---|")
        for name, repo in repos:
            rs = runs[name]
            print(f"| {name} ({repo}) | {min(r['open_s'] for r in rs):.3f} / {med(rs, 'open_s'):.3f} | "
                  f"{min(r['open_cpu_s'] for r in rs):.3f} / {med(rs, 'open_cpu_s'):.3f} | "
                  f"{med(rs, 'open_thread_cpu_s'):.3f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "runs": runs}, f, indent=1)
        return
    print(f"model {args.model}, kernels {args.kernels}, {args.threads} threads, prefill {args.prompt}, "
          f"decode {args.gen}, {args.rounds} rounds (medians)\n")
    print("| ds4py | open s (wall / cpu) | tokenizer s | private MiB: open / +tokenizer / after prefill / end / peak "
          "| KV MiB | peak above KV MiB | file RSS MiB | peak RSS MiB | prefill s | decode s/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, repo in repos:
        rs = runs[name]
        print(f"| {name} ({repo}) | {med(rs, 'open_s'):.3f} / {med(rs, 'open_cpu_s'):.3f} | "
              f"{med(rs, 'tokenizer_s'):.2f} | {mib(med(rs, 'open_private'))} / {mib(med(rs, 'tokenizer_private'))} / "
              f"{mib(med(rs, 'prefill_private'))} / {mib(med(rs, 'end_private'))} / {mib(med(rs, 'peak_private'))} | "
              f"{med(rs, 'kv_bytes') / 2**20:.1f} | {mib(med(rs, 'above_kv'))} | {mib(med(rs, 'file_rss'))} | "
              f"{mib(med(rs, 'peak_rss'))} | {med(rs, 'prefill_s'):.1f} | {med(rs, 'decode_s_per_token'):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
