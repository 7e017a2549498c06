"""Where a CPU decode token's time goes besides the weight products, and what compiling the rest would buy.

    python bench/cpu_attention.py [-m MODEL.gguf] [--ctx 8192,65536] [--threads 1]

With -m: one sequence, an 8-token prefill, a warm-up decode, then 2 decodes under cProfile (process CPU clock)
on the default kernels; reported per token: the compiled products, the attention / compressor / indexer work
(ds4py.ref.forward: attend, compress, index_scores, index_picks, index_topk, window) and the rest.
Always: the per-layer attention pieces of one decode row at V4 Flash's widths (64 × 512 heads, window 128,
indexer 64 × 128, top-k 512, ratio 4) over --ctx tokens of context, numpy (the path every kernel set runs),
beside a numba indexer scorer (4 keys per pass, one accumulator per head; written here only to compare) at
--threads.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

F32 = np.float32
PARTS = ("attend", "compress", "index_scores", "index_picks", "index_topk", "window")


def best_ms(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best * 1e3


def decode_split(model: str, threads: int) -> None:
    from ds4py.ref.engine import RefModel

    m = RefModel(model, threads=threads)
    st = m.new_state()
    m.prefill(st, [1, 5, 9, 2, 3, 4, 6, 7])
    m.decode(st, 8)
    pr = cProfile.Profile(time.process_time)
    pr.enable()
    for tok in (10, 11):
        m.decode(st, tok)
    pr.disable()
    stats = pstats.Stats(pr).stats

    def cum(name: str, file: str) -> float:
        return sum(v[3] for k, v in stats.items() if k[2] == name and file in k[0]) / 2

    total = cum("decode", "ref/engine.py")
    products = sum(cum(n, "ref/weights.py") for n in ("linear", "expert_linear", "grouped_linear"))
    compiled = cum("matmul", "quant/jit.py") + cum("vq_matmul", "quant/jit.py")
    parts = {n: cum(n, "ref/forward.py") for n in PARTS}
    other = sum(parts.values())
    print(f"decode, {m.kernels_label}: {total:.3f} s CPU per token; products {products:.3f} s "
          f"({100 * products / total:.1f}%, compiled {compiled:.3f}); attention / compressor / indexer "
          f"{other * 1e3:.1f} ms ({100 * other / total:.2f}%: "
          + ", ".join(f"{n} {v * 1e3:.2f}" for n, v in parts.items())
          + f"); rest {total - products - other:.3f} s")


def compiled_scorer():
    from ds4py.quant import jit

    if not jit.available():
        return None
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, nogil=True, boundscheck=False)
    def scores(qt, wts, keys, out, parts):     # qt [D, IH], wts [IH], keys [N, D] -> out [N]; 4 keys per pass
        D, IH = qt.shape
        N = keys.shape[0]
        for p in prange(parts):
            d0, d1, d2, d3 = np.empty(IH, F32), np.empty(IH, F32), np.empty(IH, F32), np.empty(IH, F32)
            lo, hi = p * N // parts, (p + 1) * N // parts
            for g in range(lo, hi, 4):
                g1, g2, g3 = min(g + 1, hi - 1), min(g + 2, hi - 1), min(g + 3, hi - 1)
                d0[:] = 0
                d1[:] = 0
                d2[:] = 0
                d3[:] = 0
                for i in range(D):
                    k0, k1, k2, k3 = keys[g, i], keys[g1, i], keys[g2, i], keys[g3, i]
                    for h in range(IH):
                        qv = qt[i, h]
                        d0[h] += qv * k0
                        d1[h] += qv * k1
                        d2[h] += qv * k2
                        d3[h] += qv * k3
                a0 = a1 = a2 = a3 = F32(0)
                for h in range(IH):
                    a0 += wts[h] * max(d0[h], F32(0))
                    a1 += wts[h] * max(d1[h], F32(0))
                    a2 += wts[h] * max(d2[h], F32(0))
                    a3 += wts[h] * max(d3[h], F32(0))
                out[g] = a0
                out[g1] = a1                      # a tail's duplicates rewrite the last key's own value
                out[g2] = a2
                out[g3] = a3
    return scores


def layer_parts(contexts: list[int], threads: int) -> None:
    from ds4py.ref import forward as F
    from ds4py.ref import ops

    H, hd, W, IH, IHD, K = 64, 512, 128, 64, 128, 512
    rng = np.random.default_rng(0)
    scorer = compiled_scorer()
    if scorer is not None:
        import numba
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    for ctx in contexts:
        nc, pos = ctx // 4, np.array([ctx])
        q = rng.standard_normal((1, H, hd)).astype(F32)
        win, wp = rng.standard_normal((W, hd)).astype(F32), np.arange(ctx - W + 1, ctx + 1)
        comp = rng.standard_normal((nc, hd)).astype(F32)
        keys = rng.standard_normal((nc, IHD)).astype(F32)
        iq, iw = rng.standard_normal((1, IH, IHD)).astype(F32), rng.standard_normal((1, IH)).astype(F32)
        sink = rng.standard_normal(H).astype(F32)
        sc = F.indexer_scores(iq, iw, pos, keys, 4)
        picks = F.index_picks(sc, pos, 4, K, F.DENSE_ROWS)
        c128, sel = comp[:ctx // 128], np.ones((1, ctx // 128), bool)
        line = (f"ctx {ctx}: indexer scores {best_ms(lambda: F.indexer_scores(iq, iw, pos, keys, 4)):.2f} ms "
                f"(its BLAS product {best_ms(lambda: iq @ keys.T):.2f}), top-k {best_ms(lambda: F.index_picks(sc, pos, 4, K, F.DENSE_ROWS)):.2f}, "
                f"attend window + {K} picks {best_ms(lambda: F.attend(q, win, wp, comp, None, pos, sink, W, 4, picks)):.2f}, "
                f"attend window + {ctx // 128} ratio-128 rows {best_ms(lambda: F.attend(q, win, wp, c128, sel, pos, sink, W, 128)):.2f}")
        if scorer is not None:
            qt, out = np.ascontiguousarray(iq[0].T), np.empty(nc, F32)
            scorer(qt, iw[0], keys, out, threads)                     # compile outside the timing
            diff = np.abs(out - sc[0, :nc]).max() / np.abs(sc[0, :nc]).max()
            line += (f"; numba indexer scorer, {threads} thread(s) "
                     f"{best_ms(lambda: scorer(qt, iw[0], keys, out, threads)):.2f} ms (rel. diff {diff:.1e})")
        print(line)
    kv, s = rng.standard_normal((4, 1024)).astype(F32), rng.standard_normal((4, 1024)).astype(F32)
    kv2, s2 = rng.standard_normal((128, 512)).astype(F32), rng.standard_normal((128, 512)).astype(F32)
    print(f"compressor pooling of one completed group: ratio 4 overlapped "
          f"{best_ms(lambda: ops.compress_pool(kv, s, 4, True, kv, s), 20):.3f} ms, ratio 128 "
          f"{best_ms(lambda: ops.compress_pool(kv2, s2, 128, False), 20):.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--ctx", default="8192,65536")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.model:
        decode_split(a.model, a.threads)
    layer_parts([int(c) for c in a.ctx.split(",")], a.threads)


if __name__ == "__main__":
    main()
