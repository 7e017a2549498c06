"""The domain sidecar and the post-training file on a tiny random model (docs/vq.md "Sidecars: measured").

    python bench/sidecar_tiny.py [--work DIR] [--bits 6] [--fit-tokens 1536] [--words 96 --fanout 4] [--lambdas L,..]
        [--json out.json]

Teacher: make-tiny with MXFP4 experts (3 layers, the first hash-routed, 32 experts, dim 256); base: its VQ-8 at
--bits. The "domain" is a sparse Markov chain over --words vocabulary ids (ds4py/vq/sidecar_synth.py); the
sidecar is fitted on one walk of it (held-out: every 4th 128-token window) and judged on two other walks, on a
second chain of the same shape ("other domain") and on uniform random ids ("uniform"), each 2 x 256 tokens,
prefill logits against the teacher's. Rows: the bare base, the base + the sidecar's gains only (its router
biases dropped), the whole sidecar. Then a post-training file: 8 decision points (the 2nd-4th choice) on a
160-token request (96 prompt, 64 decoded), checked by `score` on the serving path.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py.ref.engine import RefModel  # noqa: E402
from ds4py.tiny import make_tiny  # noqa: E402
from ds4py.vq import sidecar as fmt  # noqa: E402
from ds4py.vq.posttrain_fit import fit_posttrain  # noqa: E402
from ds4py.vq.quantize import Options, quantize_vq  # noqa: E402
from ds4py.vq.rulers import rulers  # noqa: E402
from ds4py.vq.sidecar_fit import Options as FitOptions  # noqa: E402
from ds4py.vq.sidecar_fit import fit_sidecar  # noqa: E402
from ds4py.vq.sidecar_synth import decision_request, domain_text  # noqa: E402

SHAPE = dict(n_layers=3, hash_layers=1, n_heads=8, head_dim=128, o_groups=4, n_experts=32)
V = 512


def prefill_logits(model, texts) -> np.ndarray:
    return np.concatenate([model.prefill(model.new_state(), t, all_logits=True) for t in texts])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=None)
    ap.add_argument("--bits", type=int, default=6)
    ap.add_argument("--fit-tokens", type=int, default=1536)
    ap.add_argument("--words", type=int, default=96)
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument("--lambdas", default=None, help="ridge grid, e.g. 10,100,1000 (default: sidecar-fit's)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="sidecar-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    chain = dict(n_words=a.words, fanout=a.fanout)
    teacher, base = work / "teacher.gguf", work / f"base{a.bits}.gguf"
    if not teacher.exists():
        make_tiny(str(teacher), seed=3, experts="mxfp4", **SHAPE)
    if not base.exists():
        quantize_vq(str(teacher), str(base), Options(bits=a.bits, rounds=4, train_per_code=1000), progress=False)
    fit = domain_text(V, a.fit_tokens, walk=0, **chain)
    times: dict = {}
    fo = FitOptions() if not a.lambdas else FitOptions(lambdas=tuple(float(x) for x in a.lambdas.split(",")))
    sc = fit_sidecar(str(base), str(teacher), [("fit", fit)], fo, progress=print, times=times)
    gains = fmt.Sidecar(sc.kind, sc.stacks_on, sc.shape,
                        {l: fmt.LayerEdit(gain_blocks=e.gain_blocks) for l, e in sc.layers.items()})
    slices = {"domain (held-out walks)": [domain_text(V, 256, walk=w, **chain) for w in (1, 2)],
              "other domain": [domain_text(V, 256, walk=w, domain=5, **chain) for w in (1, 2)],
              "uniform ids": [np.random.default_rng(w).integers(2, V - 20, 256) for w in (1, 2)]}
    models = {"base": RefModel(str(base)), "base + gains only": RefModel(str(base), sidecar=gains),
              "base + sidecar": RefModel(str(base), sidecar=sc)}
    out = {"times": times, "sidecar": sc.summary(), "layers": {l: e.info for l, e in sc.layers.items()}, "rulers": {}}
    tm = RefModel(str(teacher))
    print("| text | model | Σmin mean / median / p5 | KL | same top-1 |\n|---|---|---|---|---|")
    for name, texts in slices.items():
        t = prefill_logits(tm, texts)
        for mname, m in models.items():
            r = rulers(t, prefill_logits(m, texts))
            out["rulers"][f"{name} / {mname}"] = r
            print(f"| {name} | {mname} | {r['sigma_min_mean']:.3f} / {r['sigma_min_median']:.3f} / "
                  f"{r['sigma_min_p5']:.3f} | {r['kl_mean']:.3f} | {r['same_top1']:.1%} |")
    for l, e in sorted(sc.layers.items()):
        s = e.scale()
        if s is not None:
            print(f"layer {l}: s mean {s.mean():.3f}, std {s.std():.3f}, range [{s.min():g}, {s.max():g}], "
                  f"{(s != 1).mean():.1%} of gains changed")

    # post-training on a request
    P = 96
    ids, tg, _ = decision_request(models["base + sidecar"], V, 160, P, 8, **chain)
    t0 = time.perf_counter()
    cand, rep = fit_posttrain(str(base), sc, ids, P, tg, progress=print)
    rep["wall_s"] = time.perf_counter() - t0
    out["posttrain"] = rep
    print(f"post-training: {rep['after']['flipped']:.1%} of 8 decision points flipped, {rep['after']['kept']:.1%} of "
          f"the other positions kept their top-1, margin-change correlation {rep['predicted_margin_corr']:.4f}; "
          f"solve {rep['solve_s']:.1f} s, real checks {rep['check_s']:.1f} s ({rep['real_checks']}), total "
          f"{rep['total_s']:.1f} s")
    print(f"sidecar fit: fixture {times['fixture_s']:.1f} s, layers " + ", ".join(f"{x:.1f}" for x in times["layers_s"])
          + f" s, total {times['total_s']:.1f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
