"""The seed's rulers on a real teacher: routed-expert formats of the trained tiny V4 (../shared/trained/
v4-tiny-trained) scored against its unquantised experts on both domains' held-out text (docs/vq.md "Trained").

    python bench/vq_trained.py [--work DIR] [--bits 8,10,11,12,13,12/13] [--windows 4] [--window 256] [--json out.json]

Teacher: the checkpoint converted losslessly (dense F16/F32, routed experts MXFP4 = the official FP4 codes, i.e.
the model as trained and shipped). Students change only the routed experts (everything else is the teacher's):
`convert --experts q4_k / q2_k / iq2_xxs / iq2_xxs_q2_k` (scalar re-quantisation of the dequantised FP4; IQ2_XXS
by ggml's algorithm without an importance matrix, the q2 mix = the public q2 file's IQ2_XXS gate/up + Q2_K down) and `quantize-vq --bits B` of the
teacher (--min-pool lowered to 16: this model has 196,608 expert vectors of 8 per layer, fewer than the default
1,000 per codeword from 8 bits on; `--bits 12/13` is the seed's split: 12 bits, the shallowest layer at 13). Each is scored by a full prefill of `--windows` evenly spaced windows of the
domain's test ids (all rows' logits) and compared with the teacher's by ds4py.vq.rulers (Σmin, same top-1, KL,
PPL ratio on the true next tokens). Bytes: the routed-expert tensors' bytes in the file, per weight (bits).
MXFP4 is the teacher itself (the official FP4 codes: 4.25 bits, rulers exact by construction). Files already in
--work are reused (the quantiser's time is then not reported). The VQ students are written with the k-means gains
(`quantize-vq --no-unbiased-gains`) and each is also scored with unbiased gains (what quantize-vq writes by
default): its row gains times <w,w>/<q,w> per expert tensor (one number each; applied at load through the
sidecars' row-gain path, no byte added), which undoes the k-means codebook's shrinkage toward zero.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds4py.convert import convert_checkpoint  # noqa: E402
from ds4py import quant  # noqa: E402
from ds4py.gguf import GGUFFile  # noqa: E402
from ds4py.quant import vq  # noqa: E402
from ds4py.ref.engine import RefModel  # noqa: E402
from ds4py.vq.rulers import rulers  # noqa: E402

TRAINED = Path(os.environ.get("DS4PY_TRAINED") or REPO.parent / "shared" / "trained" / "v4-tiny-trained")


# convert --experts NAME -> row label (ggml's scalar formats; IQ2_XXS without an importance matrix, as VQ has none)
SCALAR = {"q4_k": "Q4_K", "q2_k": "Q2_K", "iq2_xxs_q2_k": "IQ2_XXS gate/up + Q2_K down", "iq2_xxs": "IQ2_XXS"}


def expert_bits(path: str, teacher: str) -> float:
    """Bits per routed-expert weight in the file: every blk.*.ffn_*_exps.* tensor (codes, scales, VQ gains) and
    the VQ layers' blk.*.ffn_vq.* (codebook, header), over the teacher's routed-expert weight count."""
    f, t = GGUFFile(path), GGUFFile(teacher)
    nbytes = sum(x.nbytes for n, x in f.tensors.items() if "_exps." in n or ".ffn_vq." in n)
    weights = sum(int(np.prod(x.shape)) for n, x in t.tensors.items() if "_exps." in n)
    return 8.0 * nbytes / weights


def codebook_bits(path: str, teacher: str) -> float:
    """The VQ codebooks' share of expert_bits: 8192 x 8 bytes per layer at 13 bits is 16% of this tiny model's expert
    bytes, a negligible share of a real V4 layer's (millions of vectors share one codebook)."""
    f, t = GGUFFile(path), GGUFFile(teacher)
    nbytes = sum(x.nbytes for n, x in f.tensors.items() if n.endswith(".ffn_vq.codebook"))
    weights = sum(int(np.prod(x.shape)) for n, x in t.tensors.items() if "_exps." in n)
    return 8.0 * nbytes / weights


def decoded_experts(path: str, teacher: str):
    """(name, teacher's, student's float32 [X, rows, cols]) for every routed-expert tensor."""
    f, t = GGUFFile(path), GGUFFile(teacher)
    experts = vq.VQExperts(f)
    for name, tt in t.tensors.items():
        if "_exps.weight" not in name:
            continue
        ref = quant.dequantize(tt.raw_bytes(), tt.qtype, tt.shape)
        if vq.is_vq(f, name):
            got = np.stack([experts.expert(name, e) for e in range(ref.shape[0])])
        else:
            st = f.tensor(name)
            got = quant.dequantize(st.raw_bytes(), st.qtype, st.shape)
        yield name, ref, got


def unbias_scales(path: str, teacher: str) -> dict[str, np.ndarray]:
    """Per VQ expert tensor, the row-gain factor <w,w> / <q,w> (one number per tensor, as [X, rows]) that undoes
    Lloyd's shrinkage: an MSE-optimal code reconstructs each cell's mean, so <q,w> = <q,q> = (1 − NMSE) <w,w> and
    the decoded matrix is (1 − NMSE) too small on average; this scales it back (more MSE, no bias)."""
    f = GGUFFile(path)
    return {name: np.full(ref.shape[:2], float((ref * ref).sum() / (got * ref).sum()), np.float32)
            for name, ref, got in decoded_experts(path, teacher) if vq.is_vq(f, name)}


def weight_error(path: str, teacher: str, scales: dict[str, np.ndarray] | None = None) -> float:
    """sqrt(Σ (student − teacher)² / Σ teacher²) over every routed-expert weight (quantize-vq's "rel. error" is the
    squared ratio, per layer)."""
    num = den = 0.0
    for name, ref, got in decoded_experts(path, teacher):
        if scales and name in scales:
            got = got * scales[name][..., None]
        num += float(((got - ref) ** 2).sum())
        den += float((ref ** 2).sum())
    return (num / den) ** 0.5


def logits(path: str, windows: list[np.ndarray], scales: dict[str, np.ndarray] | None = None) -> np.ndarray:
    m = RefModel(path, threads=1)
    for name, s in (scales or {}).items():       # the sidecars' load-time row-gain path (no file change)
        m.weights.vq.scale_rows(name, s)
    return np.concatenate([m.prefill(m.new_state(), list(map(int, w)), all_logits=True) for w in windows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None)
    ap.add_argument("--bits", default="8", help="VQ index bits to try, comma-separated (6..13; D/S: D bits, the "
                                                  "shallowest layer at S)")
    ap.add_argument("--min-pool", type=int, default=16,
                    help="quantize-vq --min-pool: this model has 196,608 vectors per layer, 24 per codeword at 13 "
                         "bits (the real model: millions), so high widths nearly memorise it")
    ap.add_argument("--no-unbias", action="store_true",
                    help="leave out the VQ students with unbiased gains (row gains x <w,w>/<q,w> per tensor, at load)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="vq_trained_"))
    work.mkdir(parents=True, exist_ok=True)
    TEACHER_PATH = str(work / "teacher.gguf")
    students: dict[str, str] = {}
    if not Path(TEACHER_PATH).exists():
        convert_checkpoint(str(TRAINED), TEACHER_PATH, experts="mxfp4", dense="f16", progress=False,
                           tokenizer=str(TRAINED / "tokenizer.json"))
    secs = {}
    for fmt, name in SCALAR.items():
        out = work / f"{fmt}.gguf"
        if not out.exists():
            t0 = time.perf_counter()
            convert_checkpoint(str(TRAINED), str(out), experts=fmt, dense="f16", progress=False,
                               tokenizer=str(TRAINED / "tokenizer.json"))
            secs[name] = time.perf_counter() - t0
        students[name] = str(out)
    for spec in [x.strip() for x in args.bits.split(",") if x.strip()]:
        deep, _, shallow = spec.partition("/")         # "12/13": 12 bits, the shallowest layer at 13 (seed's split)
        extra = ["--bits-shallow", shallow, "--shallow-layers", "1"] if shallow else []
        name = f"VQ-{deep}" + (f" (layer 0 at {shallow})" if shallow else "")
        out = work / f"vq{deep}{'s' + shallow if shallow else ''}.gguf"
        if not out.exists():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ds4py", "quantize-vq", TEACHER_PATH, str(out), "--bits", deep,
                            *extra, "--min-pool", str(args.min_pool), "--workers", "1", "--no-unbiased-gains", "-q"],
                           check=True, cwd=REPO)
            secs[name] = time.perf_counter() - t0
        students[name] = str(out)
    scales: dict[str, dict[str, np.ndarray]] = {}
    if not args.no_unbias:
        for name, path in [kv for kv in students.items() if kv[0].startswith("VQ-")]:
            scales[name + ", unbiased gains"] = unbias_scales(path, TEACHER_PATH)
            students[name + ", unbiased gains"] = path
    res = {"students": {}, "quantize_seconds": secs,
           "unbias_factors": {k: sorted({float(x.flat[0]) for x in v.values()}) for k, v in scales.items()}}
    print("| format | expert bits/weight | without codebooks | domain | Σmin mean | Σmin p5 | same top-1 | KL (nats) | "
          "PPL ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dom in ("code", "prose"):
        ids = np.load(TRAINED / f"test_{dom}.ids.npy").astype(np.int64)
        offs = np.linspace(0, len(ids) - args.window - 1, args.windows).astype(int)
        wins = [ids[o:o + args.window] for o in offs]
        teacher = logits(TEACHER_PATH, wins)
        # ids = the windows' tokens joined: row j's target is token j + 1 (rulers with split 1); a window's last
        # row is thereby scored against the next window's first token, for teacher and student alike (one row
        # in `window`; it cancels in the PPL ratio up to that row)
        flat = np.concatenate(wins)
        for name, path in [("MXFP4 (teacher)", TEACHER_PATH)] + list(students.items()):
            st = teacher if path == TEACHER_PATH else logits(path, wins, scales.get(name))
            r = rulers(teacher, st, flat, 1)
            bits = expert_bits(path, TEACHER_PATH)
            bare = bits - codebook_bits(path, TEACHER_PATH)
            res["students"].setdefault(name, {})[dom] = dict(r, bits=bits, bits_without_codebooks=bare)
            print(f"| {name} | {bits:.2f} | {bare:.2f} | {dom} | {r['sigma_min_mean']:.4f} | {r['sigma_min_p5']:.4f} | "
                  f"{r['same_top1']:.4f} | {r['kl_mean']:.4f} | {r.get('ppl_ratio', float('nan')):.4f} |", flush=True)
    # the seed's form: the bit-width curve, both domains averaged, cheapest first
    # with the weights' relative RMS error: equal weight error need not mean equal rulers
    print("\n| format | bits/w (file) | without codebooks | weight rel. RMS error | Σmin | same top-1 | KL | PPL ratio |")
    print("|---|---|---|---|---|---|---|---|")
    paths = dict(students, **{"MXFP4 (teacher)": TEACHER_PATH})
    for name, r in sorted(res["students"].items(), key=lambda kv: kv[1]["code"]["bits"]):
        mean = lambda k: (r["code"][k] + r["prose"][k]) / 2      # noqa: E731
        r["weight_error"] = weight_error(paths[name], TEACHER_PATH, scales.get(name))
        print(f"| {name} | {r['code']['bits']:.2f} | {r['code']['bits_without_codebooks']:.2f} | "
              f"{r['weight_error']:.3f} | "
              f"{mean('sigma_min_mean'):.3f} | {mean('same_top1'):.3f} | {mean('kl_mean'):.4f} | "
              f"{mean('ppl_ratio'):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
