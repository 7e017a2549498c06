"""Graph captures of `serve --sessions 4` on the CUDA engine (cuda-emu, the golden v4-tiny-mtp converted):
4 greedy requests arriving 0.4 s apart (prompts of 3 / 10 / 17 / 24 tokens, 16 / 19 / 22 / 25 answer tokens,
prefill chunks of 16), plain and with the MTP block; counts, per kind of step (ROWS, DECODE body, head, MTP), the
steps run and the graph captures. About 5 minutes of CPU on the emulator.

    python bench/cuda_serve_graphs.py
"""

from __future__ import annotations

import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from ds4py.cuda import graph  # noqa: E402
from ds4py.cuda.step_run import BODY, StepRun  # noqa: E402

counts: collections.Counter = collections.Counter()


def kind(run) -> str:
    """The step's kind as the output names it (GraphKey.kind; a BODY is a decode step)."""
    return "decode" if run.tag.kind == BODY else run.tag.kind


_run, _capture = StepRun.run, StepRun._capture


def run(self, values):
    counts[("steps", kind(self))] += 1
    self._capturing = self.graph is not None and self.graph._stale()
    return _run(self, values)


def capture(self):
    if getattr(self, "_capturing", False):
        counts[("captures", kind(self))] += 1
        self._capturing = False
    return _capture(self)


StepRun.run, StepRun._capture = run, capture


def serve(model, tok, prompts, n):
    from test_sessions import completion, post, serving

    counts.clear()
    out = [None] * len(prompts)
    with serving(model, tok, n=4, prefill_chunk=16) as srv:
        def one(i):
            time.sleep(0.4 * i)
            out[i] = post(srv, completion(prompts[i], n=n + 3 * i))["choices"][0]["text"]
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
    return out, {k: (counts[("steps", k)], counts[("captures", k)]) for k in ("rows", "decode", "head", "mtp")
                 if counts[("steps", k)]}


def main() -> None:
    from test_cuda_sessions import IdsTokenizer

    from ds4py.convert import convert_checkpoint
    from ds4py.cuda.mtp import CudaMtp
    from ds4py.model import open_model
    from ds4py.mtp_spec import MtpSpec

    d = Path(tempfile.mkdtemp())
    main_f, mtp_f = d / "m.gguf", d / "m.mtp.gguf"
    convert_checkpoint(str(REPO.parent / "shared" / "golden" / "v4-tiny-mtp"), str(main_f), experts="mxfp4",
                       dense="f32", progress=False, mtp=str(mtp_f))
    m = open_model(str(main_f), backend="cuda-emu")
    tok = IdsTokenizer()
    prompts = [np.random.default_rng(50 + i).integers(3, 256, 3 + 7 * i).tolist() for i in range(4)]
    plain, c = serve(m, tok, prompts, 16)
    print("plain:", "; ".join(f"{k} {s} steps, {n} captures" for k, (s, n) in c.items()), flush=True)
    got, c = serve(MtpSpec(m, CudaMtp(m, str(mtp_f))), tok, prompts, 16)
    print("speculative:", "; ".join(f"{k} {s} steps, {n} captures" for k, (s, n) in c.items()), flush=True)
    print("speculative answers == plain:", got == plain)


if __name__ == "__main__":
    main()
