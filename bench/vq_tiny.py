"""VQ-8 on a tiny random model: per-layer error, quantiser speed and the rulers against the teacher, next to
scalar formats at similar bytes (docs/vq.md "Measured").

    python bench/vq_tiny.py [--work DIR] [--bits 8,10,12] [--tokens 160 --split 32] [--json out.json]

Teacher: make-tiny --dim 512 --ff 512 --experts-n 16 --experts mxfp4 (1,572,864 vectors per layer). Students:
the teacher with its routed experts re-encoded (everything else byte-identical): VQ-8 at each --bits (the pool
rule is relaxed to what the layer holds: 384 vectors per codeword at 12 bits), a ternary scalar grid
{-a, 0, a} per weight with the same row gains (3^8 = 6,561 codewords: exactly representable in the 13-bit
container, so it is the scalar quantiser at the same bytes as 13-bit VQ), and Q2_K / Q4_K experts.
Rulers: `score`'s rows (prefill ids[:split], then teacher-forced decode) over the bundled book's first tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from ds4py import quant  # noqa: E402
from ds4py.gguf import GGUFFile  # noqa: E402
from ds4py.ref.engine import RefModel  # noqa: E402
from ds4py.tiny import make_tiny  # noqa: E402
from ds4py.tokenizer import Tokenizer  # noqa: E402
from ds4py.vq import kmeans  # noqa: E402
from ds4py.vq.quantize import Options, quantize_vq, source_rows  # noqa: E402
from ds4py.vq.rulers import rulers  # noqa: E402
from ds4py.vq.writer import StreamWriter, TensorPlan, kv_records  # noqa: E402

SHAPE = dict(dim=512, expert_ff=512, n_experts=16)
BOOK = Path(__file__).resolve().parents[1] / "ds4py" / "data" / "bench_prompt.txt"


def logits(path: Path, ids: np.ndarray, split: int) -> np.ndarray:
    m = RefModel(str(path))
    st = m.new_state()
    return np.stack([m.prefill(st, ids[:split])] + [m.decode(st, int(t)) for t in ids[split:]])


def expert_bits(path: Path, weights: int) -> float:
    """Bits per routed-expert weight, every byte that belongs to the experts (codebooks, gains) included."""
    f = GGUFFile(str(path))
    return 8 * sum(t.nbytes for n, t in f.tensors.items() if "_exps." in n or ".ffn_vq." in n) / weights


def rel_err(teacher: Path, student: Path) -> list[float]:
    ta, tb = RefModel(str(teacher)), RefModel(str(student))
    a, b = ta.weights, tb.weights
    out = []
    for la, lb in zip(ta.binding.layers, tb.binding.layers):
        err = energy = 0.0
        for m in ("gate", "up", "down"):
            ea, eb = getattr(la.ffn.experts, m), getattr(lb.ffn.experts, m)
            for e in range(16):
                x = a.expert(ea, e).astype(np.float64)
                err += ((x - b.expert(eb, e)) ** 2).sum()
                energy += (x * x).sum()
        out.append(err / energy)
    return out


def scalar_experts(src: Path, out: Path, qt: Q) -> None:
    """SRC with every routed expert re-encoded as qt (streamed, metadata copied)."""
    f = GGUFFile(str(src))
    plans = []
    for n, t in f.tensors.items():
        if n.endswith("_exps.weight"):
            X, rows, cols = t.shape
            plans.append(TensorPlan(n, t.shape, qt, X * rows * quant.row_nbytes(qt, cols)))
        else:
            plans.append(TensorPlan(n, t.shape, t.qtype, t.nbytes))
    w = StreamWriter(str(out) + ".tmp", [raw for _, raw in kv_records(str(src))], plans, 32)
    for n, t in f.tensors.items():
        if n.endswith("_exps.weight"):
            for e in range(t.shape[0]):
                w.write(n, quant.quantize(source_rows(t, e, t.shape[1:]), qt))
        else:
            w.write(n, t.raw_bytes())
    w.finish()
    os.replace(str(out) + ".tmp", out)


def ternary_codebook(pool: np.ndarray, k: int) -> np.ndarray:
    """The product grid {-a, 0, a}^8 (a: the Lloyd-Max ternary level of the pool's values), padded with zeros
    (duplicates of codeword 0 of the grid's zero vector never win: the search keeps the lowest index)."""
    x = np.abs(pool.astype(np.float64).reshape(-1))
    a = 1.0
    for _ in range(30):
        a = x[x > a / 2].mean()
    grid = np.array(list(itertools.product((-a, 0.0, a), repeat=8)), np.float32)
    return np.concatenate([grid, np.zeros((k - len(grid), 8), np.float32)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/ds4py-vq-bench")
    ap.add_argument("--bits", default="8,10,12")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--split", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    teacher = work / "teacher.gguf"
    if not teacher.exists():
        make_tiny(str(teacher), seed=0, experts="mxfp4", **SHAPE)
    tok = Tokenizer.from_gguf(str(teacher))
    ids = np.array(tok.encode(BOOK.read_text()[:20000])[:args.tokens])
    t_logits = logits(teacher, ids, args.split)
    result = {"teacher": str(teacher), "tokens": len(ids), "split": args.split, "rows": {},
              "search_vectors_per_s": {f"{k} codewords, {w} threads": round(kmeans.throughput(200_000, k, w))
                                       for k in (256, 1024, 4096, 8192) for w in (1, 2)}}
    weights = sum(int(np.prod(t.shape)) for n, t in GGUFFile(str(teacher)).tensors.items() if n.endswith("_exps.weight"))
    vectors = weights // 8 // 4                                  # per layer

    def student(label: str, path: Path, extra: dict) -> None:
        r = rulers(t_logits, logits(path, ids, args.split), ids, args.split)
        row = dict(expert_bits_per_weight=round(expert_bits(path, weights), 4), **extra,
                   **{k: round(v, 4) for k, v in r.items() if isinstance(v, float)})
        result["rows"][label] = row
        print(label, json.dumps(row), flush=True)

    for b in (int(x) for x in args.bits.split(",")):
        out = work / f"vq{b}.gguf"
        t0 = time.perf_counter()
        rep = quantize_vq(str(teacher), str(out), Options(bits=b, min_pool=min(1000, vectors >> b)), progress=True)
        student(f"VQ-8 {b} bits", out, dict(
            rel_err_per_layer=[round(x["rel_err"], 4) for x in rep["layers"]], quantize_s=round(time.perf_counter() - t0, 1),
            vectors_per_s=round(rep["vectors_per_s"]),
            assign_vectors_per_s=[round(x["vectors_per_s"]) for x in rep["layers"]]))
    out = work / "ternary13.gguf"
    rep = quantize_vq(str(teacher), str(out), Options(bits=13, min_pool=1, rounds=0, codebook=ternary_codebook),
                      progress=True)
    student("scalar ternary {-a,0,a} + row gain (13-bit container)", out,
            dict(rel_err_per_layer=[round(x["rel_err"], 4) for x in rep["layers"]]))
    for qt in (Q.Q2_K, Q.Q4_K):
        out = work / f"{qt.name.lower()}.gguf"
        scalar_experts(teacher, out, qt)
        student(f"{qt.name} experts", out, dict(rel_err_per_layer=[round(x, 4) for x in rel_err(teacher, out)]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["search_vectors_per_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
