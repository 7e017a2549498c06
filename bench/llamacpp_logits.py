"""Does llama.cpp load a ds4py-written GGUF, and do its logits agree with ds4py's int8-activation mode? (by hand)

    python bench/llamacpp_logits.py -m MODEL.gguf --llama-lib DIR --bindings DIR [--prompt 1,5,9,2] [--forced 20]
                                    [--threads 2] [--json OUT.json]

--llama-lib: the folder holding a built libllama.so (llama.cpp with the `deepseek4` architecture, e.g. the copy
vendored by llama-cpp-python, built from source); --bindings: that llama-cpp-python's `llama_cpp` package folder
(its ctypes declarations of the same version; only `llama_cpp.llama_cpp` is imported, not the package, so its
optional dependencies are not needed). Not part of CI: llama.cpp is built by hand.

llama.cpp runs in a child process: load the file (no metadata overrides), decode the prompt, then --forced
tokens one at a time, keeping the last logits of each step. The forced tokens are ds4py's own greedy
continuation in its int8-activation mode (`Numerics.ds4()`, `--act-quant`), so both engines see the same ids.
ds4py computes the same rows in that mode and in fp32 (`--kernels dequant`); the rows are compared with the
golden ds4-tiny metrics (../shared/golden/ds4-tiny/compare_logits.py: max / mean |diff|, KL, top-1 agreement,
its STRICT and LOOSE tolerances). A file llama.cpp refuses is reported with llama.cpp's own message.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GOLDEN = os.path.join(os.path.dirname(REPO), "shared", "golden", "ds4-tiny")

CHILD = r"""
import json, os, sys, types
import numpy as np
a = json.loads(sys.argv[1])
os.environ["LLAMA_CPP_LIB_PATH"] = a["lib"]
pkg = types.ModuleType("llama_cpp"); pkg.__path__ = [a["bindings"]]; sys.modules["llama_cpp"] = pkg
import llama_cpp.llama_cpp as L
L.llama_backend_init()
model = L.llama_model_load_from_file(a["model"].encode(), L.llama_model_default_params())
if not model:
    print("REFUSED"); sys.exit(3)
cp = L.llama_context_default_params()
n = len(a["prompt"]) + len(a["forced"]) + 8
cp.n_ctx = cp.n_batch = cp.n_ubatch = max(64, n)
cp.n_threads = cp.n_threads_batch = a["threads"]
ctx = L.llama_init_from_model(model, cp)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
def step(ids):
    arr = (L.llama_token * len(ids))(*ids)
    rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(ids)))
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
rows = [step(a["prompt"])] + [step([t]) for t in a["forced"]]
np.save(a["out"], np.stack(rows))
print("LOADED")
"""


def ds4py_rows(path: str, prompt: list[int], forced: list[int] | None, numerics, threads: int):
    """Logit rows of prompt then forced (None: ds4py's own greedy continuation of n tokens) and the ids fed."""
    from ds4py.ref.engine import RefModel

    m = RefModel(path, numerics=numerics, kernels="dequant", threads=threads)
    s = m.new_state()
    rows = [m.prefill(s, prompt)]
    fed = []
    for i in range(len(forced) if isinstance(forced, list) else forced):
        t = forced[i] if isinstance(forced, list) else int(np.argmax(rows[-1]))
        fed.append(t)
        rows.append(m.decode(s, t))
    return np.stack(rows), fed


def metrics(ref: np.ndarray, got: np.ndarray) -> dict:
    sys.path.insert(0, GOLDEN)
    import compare_logits as C

    m = C.compare(ref, got)
    m["strict"] = C.check(m, C.STRICT_TOL)
    m["loose"] = C.check(m, C.LOOSE_TOL)
    return m


def main() -> None:
    from ds4py.model import Numerics

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-lib", required=True, help="folder with libllama.so")
    ap.add_argument("--bindings", required=True, help="llama-cpp-python's llama_cpp package folder")
    ap.add_argument("--prompt", default="1,5,9,2")
    ap.add_argument("--forced", type=int, default=20, help="teacher-forced tokens after the prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    prompt = [int(x) for x in args.prompt.split(",")]
    aq, forced = ds4py_rows(args.model, prompt, args.forced, Numerics.ds4(), args.threads)
    fp32, _ = ds4py_rows(args.model, prompt, forced, Numerics(), args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "llama.npy")
        spec = json.dumps({"model": os.path.abspath(args.model), "lib": args.llama_lib, "bindings": args.bindings,
                           "prompt": prompt, "forced": forced, "threads": args.threads, "out": out})
        r = subprocess.run([sys.executable, "-c", CHILD, spec], capture_output=True, text=True, errors="replace")
        if "LOADED" not in r.stdout:
            why = [x for x in r.stderr.splitlines() if "error" in x.lower()]
            print(f"llama.cpp refused {args.model}: {why[-1] if why else r.stderr[-500:]}")
            sys.exit(1)
        llama = np.load(out)
    report = {"model": args.model, "prompt": prompt, "forced": forced, "loaded": True}
    print(f"llama.cpp loaded {args.model} (no overrides); {len(llama)} logit rows (prompt {prompt} + "
          f"{len(forced)} teacher-forced tokens)")
    for name, rows in (("ds4py int8-activation (Numerics.ds4)", aq), ("ds4py fp32", fp32)):
        m = metrics(rows, llama)
        report[name] = m
        print(f"vs {name}: max |d| {m['max_abs']:.3f}, mean |d| {m['mean_abs']:.4f}, median row max "
              f"{m['median_row_max_abs']:.3f}, KL mean {m['kl_mean']:.2e}, top-1 {m['top1_agree']:.3f}; "
              f"STRICT {'pass' if m['strict'][0] else 'fail ' + '; '.join(m['strict'][1])}; "
              f"LOOSE {'pass' if m['loose'][0] else 'fail ' + '; '.join(m['loose'][1])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
