"""CPU decode side by side: ds4py's reference backend (default kernels: compiled) against ds4's C CPU path, on
the same GGUF, interleaved.

    python bench/cpu_vs_ds4.py --ds4 PATH/ds4-bench -m MODEL.gguf [--threads 2] [--ctx 16] [--gen 8]
                               [--rounds 3] [--kernels auto|jit|fused|dequant] [--prompt-file TEXT] [--json OUT.json]

Both engines read the same file, tokenize the same text (byte-level BPE from the file's own vocabulary; the
token counts are compared once), prefill its first --ctx tokens, then decode --gen tokens greedily (argmax,
EOS excluded), at the same thread count. ds4 runs as `ds4-bench --cpu -t T --prompt-file F --ctx-start N
--ctx-max N --gen-tokens G` (its own timer around the decode loop); ds4py in a child process of this script
(RefModel with --kernels, default auto, its own timer around the same loop; it reports the kernels that ran). Each round runs both, the order alternating
(A/B, B/A, ...), so a load change on a shared machine hits both; the summary gives min and median over rounds.
Per run: decode s/token (wall), decode CPU s/token (all threads; ds4py: process time around its loop; ds4:
the run's CPU minus that of the same run with one decoded token, over the difference in tokens), prefill
tokens/s, CPU seconds of the whole process (user + sys), peak RSS, major faults (os.wait4 of that child).

ds4 accepts exactly its compiled-in layer count (43); for a shallower real-width file (make-synthetic
--layers N) build it with that count, e.g. `sed -i 's/DS4_N_LAYER            = 43,/DS4_N_LAYER = N,/' ds4.c`
before `make cpu` (bench/README.md says how the published numbers were made).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from cpu_harness import in_turn, run_child, save, wait_child

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs about rivers "
         "and stone").split()


def default_text(n_words: int = 400) -> str:
    """Deterministic plain text (a fixed linear congruential pick of common words)."""
    out, s = [], 12345
    for _ in range(n_words):
        s = (s * 1103515245 + 12345) % 2**31
        out.append(WORDS[s % len(WORDS)])
    return " ".join(out) + "\n"


def child(a: argparse.Namespace) -> dict:
    import numpy as np

    from ds4py.ref.engine import RefModel
    from ds4py.tokenizer import Tokenizer

    text = open(a.prompt_file, encoding="utf-8").read()
    m = RefModel(a.model, kernels=a.kernels, threads=a.threads, mem_budget_mb=a.mem_budget_mb)
    ids = Tokenizer.from_gguf(m.gguf).encode(text)
    eos = m.config.eos_id
    st = m.new_state()
    t0 = time.perf_counter()
    logits = m.prefill(st, ids[:a.ctx])
    t1, c1 = time.perf_counter(), time.process_time()
    gen = []
    for _ in range(a.gen):
        lg = np.array(logits, dtype=np.float32, copy=True)
        lg[eos] = -np.inf
        tok = int(np.argmax(lg))
        gen.append(tok)
        logits = m.decode(st, tok)
    t2, c2 = time.perf_counter(), time.process_time()
    return {"prompt_tokens": len(ids), "prefill_tps": a.ctx / (t1 - t0), "decode_s": (t2 - t1) / a.gen,
            "decode_cpu_s": (c2 - c1) / a.gen, "generated": gen, "kernels": m.kernels_label}


def run_ds4(a: argparse.Namespace, tmp: str, gen: int | None = None) -> dict:
    out = os.path.join(tmp, "ds4.csv")
    gen = a.gen if gen is None else gen
    _, ru = wait_child([a.ds4, "-m", a.model, "--cpu", "-t", str(a.threads), "--prompt-file", a.prompt_file,
                        "--ctx-start", str(a.ctx), "--ctx-max", str(a.ctx), "--gen-tokens", str(gen), "--csv", out])
    with open(out) as f:
        row = next(csv.DictReader(f))
    r = {"engine": "ds4", "prefill_tps": float(row["prefill_tps"]), "decode_s": 1.0 / float(row["gen_tps"]), **ru}
    if gen == a.gen and a.gen > 1:
        # ds4 times its decode loop but not its CPU: the same run with one decoded token, subtracted
        base = run_ds4(a, tmp, 1)
        r["decode_cpu_s"] = (ru["cpu_s"] - base["cpu_s"]) / (a.gen - 1)
    return r


def run_ds4py(a: argparse.Namespace) -> dict:
    args = ["-m", a.model, "--threads", str(a.threads), "--ctx", str(a.ctx), "--gen", str(a.gen), "--prompt-file",
            a.prompt_file, "--kernels", a.kernels]
    if a.mem_budget_mb is not None:
        args += ["--mem-budget-mb", str(a.mem_budget_mb)]
    r, ru = run_child(__file__, args)
    return {"engine": "ds4py", **r, **ru}


def ds4_token_count(a: argparse.Namespace) -> int | None:
    """ds4's own token count of the prompt text (ds4-bench prints it when asked for a longer context)."""
    r = subprocess.run([a.ds4, "-m", a.model, "--cpu", "-t", "1", "--prompt-file", a.prompt_file,
                        "--ctx-start", "1", "--ctx-max", str(10**7), "--gen-tokens", "1"],
                       capture_output=True, text=True)
    m = re.search(r"prompt has (\d+) tokens", r.stderr)
    return int(m.group(1)) if m else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ds4", help="the ds4-bench binary (ds4's `make cpu`)")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=16, help="prompt tokens prefilled before the decode")
    p.add_argument("--gen", type=int, default=8, help="decoded tokens per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-file")
    p.add_argument("--mem-budget-mb", type=float, default=None)
    p.add_argument("--kernels", default="auto", help="ds4py's kernel set (default auto: compiled where numba imports)")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    if not a.ds4:
        p.error("--ds4 PATH (ds4's ds4-bench binary) is required")
    with tempfile.TemporaryDirectory() as tmp:
        if a.prompt_file is None:
            a.prompt_file = os.path.join(tmp, "prompt.txt")
            with open(a.prompt_file, "w") as f:
                f.write(default_text(max(400, a.ctx // 2 + 100)))     # ~2.3 tokens a word
        n_ds4 = ds4_token_count(a)
        rows = []
        for r in range(a.rounds):
            for eng in in_turn(("ds4", "ds4py"), r):
                row = run_ds4(a, tmp) if eng == "ds4" else run_ds4py(a)
                row.update(round=r, loadavg=os.getloadavg()[0])
                rows.append(row)
                print(f"round {r} {eng:<6s} decode {row['decode_s']:.3f} s/token "
                      f"(CPU {row.get('decode_cpu_s', float('nan')):.3f} s)  prefill {row['prefill_tps']:.2f} "
                      f"tok/s  cpu {row['cpu_s']:.1f} s  peak RSS {row['peak_rss'] / 2**20:.0f} MiB  "
                      f"major faults {row['major_faults']}  load {row['loadavg']:.1f}", flush=True)
    n_py = next(r["prompt_tokens"] for r in rows if r["engine"] == "ds4py")
    summary = {"model": a.model, "file_bytes": os.path.getsize(a.model), "threads": a.threads, "ctx": a.ctx,
               "gen": a.gen, "rounds": a.rounds, "prompt_tokens_ds4": n_ds4, "prompt_tokens_ds4py": n_py}
    for eng in ("ds4", "ds4py"):
        d = sorted(r["decode_s"] for r in rows if r["engine"] == eng)
        c = sorted(r["decode_cpu_s"] for r in rows if r["engine"] == eng and "decode_cpu_s" in r)
        summary[eng] = {"decode_s_min": d[0], "decode_s_median": d[len(d) // 2],
                        "decode_cpu_s_median": c[len(c) // 2] if c else None}
    summary["ratio_median"] = summary["ds4py"]["decode_s_median"] / summary["ds4"]["decode_s_median"]
    summary["ratio_min"] = summary["ds4py"]["decode_s_min"] / summary["ds4"]["decode_s_min"]
    cp, cd = summary["ds4py"]["decode_cpu_s_median"], summary["ds4"]["decode_cpu_s_median"]
    summary["cpu_ratio_median"] = cp / cd if cp and cd else None
    summary["ds4py_kernels"] = next(r.get("kernels") for r in rows if r["engine"] == "ds4py")
    print(f"ds4py kernels: {summary['ds4py_kernels']}")
    print(f"prompt tokens: ds4 {n_ds4}, ds4py {n_py}" + ("" if n_ds4 == n_py else "  (DIFFERENT tokenizations)"))
    for eng in ("ds4", "ds4py"):
        s = summary[eng]
        print(f"{eng:<6s} decode s/token min {s['decode_s_min']:.3f} median {s['decode_s_median']:.3f}"
              f"  CPU s/token median {s['decode_cpu_s_median'] or float('nan'):.3f}")
    print(f"ds4py / ds4: {summary['ratio_min']:.2f}x (min), {summary['ratio_median']:.2f}x (median)"
          + (f", CPU {summary['cpu_ratio_median']:.2f}x (median)" if summary["cpu_ratio_median"] else ""))
    save(a.json, summary, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
