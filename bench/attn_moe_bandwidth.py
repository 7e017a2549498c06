"""The attention / compressor / indexer / top-k / MoE decode kernels at V4 Flash shapes (needs a CUDA GPU; --emu
runs the same code on the CPU emulator at cut-down shapes, which checks it but measures nothing).

    python bench/attn_moe_bandwidth.py [--json out.json] [--reps 20] [--emu]

Each kernel sequence is captured `reps` times into one CUDA graph and replayed (no Python launch overhead), timed
with CUDA events. Experts are weight-bandwidth bound: their GB/s (expert bytes read / time) is set against the
device's copy bandwidth; the routed expert ids rotate through disjoint sets of 6 of 256, so no replay finds its
experts in the L2. Attention, the indexer and top-k are latency bound at batch 1: microseconds per call, at 4K and
64K context (ratio-4 layers attend to the window + the top 512 of up to 16K compressed rows, ratio-128 layers to
the window + every row).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from ds4py.cuda.ops import attention as ops_attn  # noqa: E402
from ds4py.cuda.ops import compressor as ops_comp  # noqa: E402
from ds4py.cuda.ops import experts as ops_moe  # noqa: E402
from ds4py.cuda.ops import indexer as ops_idx  # noqa: E402
from ds4py.cuda.ops import topk as ops_topk  # noqa: E402
from ds4py.cuda.probe import device_copy_bandwidth_gbps  # noqa: E402
from ds4py.cuda.ops.core import TokenRows  # noqa: E402
from ds4py.cuda.ops.experts import Experts, Slots  # noqa: E402
from ds4py.ref import ops as ref_ops  # noqa: E402
from gemv_bandwidth import bench_args, exit_timed, fill_tiled, run_and_close, timed_graph  # noqa: E402

D, FF, NX, K = 4096, 2048, 256, 6                   # V4 Flash MoE (--emu: 512 x 256, 24 experts)
H, HD, RD, W, RING, TOPK = 64, 512, 64, 128, 144, 512
IH, IHD = 64, 128
CONTEXTS = (4096, 65536)                             # --emu: 4096 only


def random_blocks(r: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """Valid random rows of a block format (f16 scales of a realistic size), as uint8 [rows, row_bytes]."""
    _, qk, nb = ops_moe.FORMATS[QT(qtype)]
    n = rows * cols // qk
    b = r.integers(0, 256, (n, nb), dtype=np.uint8)
    d = (r.random((n, 1)) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    off = {QT.IQ2_XXS: 0, QT.Q2_K: 80, QT.Q4_K: 0, QT.Q8_0: 0}.get(QT(qtype))
    if off is not None:
        b[:, off:off + 2] = d
    if QT(qtype) in (QT.Q2_K, QT.Q4_K):
        b[:, off + 2:off + 4] = d
    if QT(qtype) == QT.MXFP4:
        b[:, 0] = r.integers(118, 131, n)
    return b.reshape(rows, -1)


def expert_weights(rt, arena, r, qtype, n_exp, rows, cols):
    """A [n_exp, rows, cols] expert tensor filled with a tiled random pattern (whole rows)."""
    rb = ops_moe.row_bytes(qtype, cols)
    W = arena.weights(n_exp * rows * rb, np.uint8)
    fill_tiled(rt, W, random_blocks(r, qtype, max(1, (32 << 20) // rb), cols))
    return W


def bench_experts(rt, arena, r, reps, copy_gbs, res) -> None:
    for gate_t, down_t, label in [(QT.IQ2_XXS, QT.Q2_K, "q2 file (IQ2_XXS gate/up, Q2_K down)"),
                                  (QT.Q4_K, QT.Q4_K, "q4 file (Q4_K)")]:
        arena.reset_weights()
        arena.begin_step()
        Wg = expert_weights(rt, arena, r, gate_t, NX, FF, D)
        Wu = expert_weights(rt, arena, r, gate_t, NX, FF, D)
        Wd = expert_weights(rt, arena, r, down_t, NX, D, FF)
        sets = np.random.default_rng(1).permutation(NX)[: (NX // K) * K].reshape(-1, K).astype(np.int32)
        ids = [arena.weights(K, np.int32) for _ in range(reps)]
        for i, a in enumerate(ids):
            a.upload(sets[i % len(sets)])
        x, w = arena.scratch(D, np.float32), arena.scratch(K, np.float32)
        x.upload(r.standard_normal(D).astype(np.float32))
        w.upload(np.full(K, 0.25, np.float32))
        h, y = arena.scratch((K, FF), np.float32), arena.scratch(D, np.float32)
        slot = arena.scratch(1, np.int32)
        it = iter(range(10**9))
        gu_bytes = 2 * K * FF * ops_moe.row_bytes(gate_t, D)
        dn_bytes = K * D * ops_moe.row_bytes(down_t, FF)
        for name, nbytes, fn in [
            ("gate_up", gu_bytes,
             lambda i: ops_moe.moe_gate_up(rt,
                                           Experts(fmt=gate_t, n_experts=NX, ff=FF, dim=D, gate=Wg, up=Wu, clamp=10.0),
                                           x, h, Slots(ids=ids[i], weights=w, k=K))),
            ("down", dn_bytes, lambda i: ops_moe.moe_down(rt, Experts(fmt=down_t, n_experts=NX, ff=FF, dim=D, down=Wd),
                                                          TokenRows(x=h, y=y), Slots(ids=ids[i], k=K))),
        ]:
            ms = timed_graph(rt, lambda: fn(next(it) % reps), reps, slot)
            gbs = nbytes / ms / 1e6
            row = {"kernel": f"moe_{name}", "format": (gate_t if name == "gate_up" else down_t).name,
                   "MB": nbytes / 1e6, "us": ms * 1e3, "GBps": gbs, "of_copy": gbs / copy_gbs}
            res["experts"].append(row)
            print(f"{label:38} {name:8} 6 of {NX}: {nbytes / 1e6:6.1f} MB in {ms * 1e3:7.1f} us = {gbs:6.0f} GB/s "
                  f"({100 * gbs / copy_gbs:.0f}% of copy)")
    # the shared expert (Q8_0, one per layer: L2-resident when repeated, so it rotates over 8 copies)
    arena.reset_weights()
    arena.begin_step()
    copies = 8
    Wg = expert_weights(rt, arena, r, QT.Q8_0, copies, FF, D)
    Wu = expert_weights(rt, arena, r, QT.Q8_0, copies, FF, D)
    Wd = expert_weights(rt, arena, r, QT.Q8_0, copies, D, FF)
    ids = [arena.weights(1, np.int32) for _ in range(copies)]
    for i, a in enumerate(ids):
        a.upload(np.array([i], np.int32))
    x, hs, ys = arena.scratch(D, np.float32), arena.scratch(FF, np.float32), arena.scratch(D, np.float32)
    x.upload(r.standard_normal(D).astype(np.float32))
    slot = arena.scratch(1, np.int32)
    it = iter(range(10**9))

    def shared():
        i = next(it) % copies
        ops_moe.moe_gate_up(rt, Experts(fmt=QT.Q8_0, n_experts=copies, ff=FF, dim=D, gate=Wg, up=Wu, clamp=10.0), x, hs,
                            Slots(ids=ids[i]))
        ops_moe.moe_down(rt, Experts(fmt=QT.Q8_0, n_experts=copies, ff=FF, dim=D, down=Wd), TokenRows(x=hs, y=ys),
                         Slots(ids=ids[i]))

    nbytes = 3 * FF * ops_moe.row_bytes(QT.Q8_0, D)
    ms = timed_graph(rt, shared, reps, slot)
    gbs = nbytes / ms / 1e6
    res["experts"].append({"kernel": "shared_expert", "format": "Q8_0", "MB": nbytes / 1e6, "us": ms * 1e3,
                           "GBps": gbs, "of_copy": gbs / copy_gbs})
    print(f"{'shared expert (Q8_0)':38} all      : {nbytes / 1e6:6.1f} MB in {ms * 1e3:7.1f} us = {gbs:6.0f} GB/s "
          f"({100 * gbs / copy_gbs:.0f}% of copy)")


def bench_attention(rt, arena, r, reps, res) -> None:
    freqs_np = ref_ops.rope_freqs(RD, 160000.0, 16.0, 65536, 32.0, 1.0)
    for ctx in CONTEXTS:
        pos = ctx - 1
        arena.reset_weights()
        arena.begin_step()
        freqs = arena.weights(RD // 2, np.float32)
        freqs.upload(freqs_np)
        slot = arena.scratch(1, np.int32)
        slot.upload(np.array([pos], np.int32))
        q = arena.scratch((H, HD), np.float32)
        q.upload(r.standard_normal((H, HD)).astype(np.float32))
        win = arena.scratch((RING, HD), np.float32)
        win.upload(r.standard_normal((RING, HD)).astype(np.float32))
        sinks = arena.weights(H, np.float32)
        sinks.upload(r.standard_normal(H).astype(np.float32))
        n4 = (pos + 1) // 4
        comp = arena.scratch((n4, HD), np.float32)
        fill_tiled(rt, comp, r.standard_normal((min(n4, 4096), HD)).astype(np.float32))
        sel = arena.scratch(TOPK, np.int32)
        sel.upload(np.sort(r.choice(n4, TOPK, replace=False)).astype(np.int32))
        out = arena.scratch((H, HD), np.float32)
        for ratio in (4, 128):
            n_comp = min(TOPK, n4) if ratio == 4 else (pos + 1) // 128
            plan = ops_attn.attn_plan(H, HD, W + n_comp)
            po, pml = arena.scratch(plan.part_o_shape, np.float32), arena.scratch(plan.part_ml_shape, np.float32)
            s = sel if ratio == 4 else None
            layer = ops_attn.AttnLayer(freqs, sinks, H, RD, W, 1e-6, HD ** -0.5)
            keys = ops_attn.AttnKeys(win, comp, ratio, s, TOPK)
            bufs = ops_attn.DecodeBuffers(q, slot, po, pml, out)
            ms = timed_graph(rt, lambda: ops_attn.decode_attention(rt, plan, layer, keys, bufs, pdl=True), reps,
                             slot)
            row = {"kernel": "attention", "ctx": ctx, "ratio": ratio, "keys": W + n_comp, "splits": plan.splits,
                   "us": ms * 1e3}
            res["attention"].append(row)
            print(f"attention ctx {ctx:6} ratio {ratio:3}: {W + n_comp:4} keys, {plan.splits:3} splits: "
                  f"{ms * 1e3:6.1f} us")
        # the indexer of a ratio-4 layer at this context: scores over n4 keys, then the top 512
        keys = arena.scratch((n4, IHD), np.float32)
        fill_tiled(rt, keys, r.standard_normal((min(n4, 4096), IHD)).astype(np.float32))
        iq, wr = arena.scratch((IH, IHD), np.float32), arena.scratch(IH, np.float32)
        iq.upload(r.standard_normal((IH, IHD)).astype(np.float32))
        wr.upload(r.standard_normal(IH).astype(np.float32))
        scores, top = arena.scratch(n4, np.float32), arena.scratch(TOPK, np.int32)
        scorer, bufs = ops_idx.IndexScorer(IH, IHD, 0.01), ops_idx.ScoreBuffers(iq, wr, keys, slot, scores, n4)
        ms_s = timed_graph(rt, lambda: ops_idx.indexer_scores(rt, scorer, bufs, pdl=True), reps, slot)
        visible = ops_topk.Visible(pos_slot=slot)
        ms_t = timed_graph(rt, lambda: ops_topk.topk(rt, scores, TOPK, top, visible, pdl=True), reps, slot)
        res["indexer"].append({"ctx": ctx, "keys": n4, "scores_us": ms_s * 1e3, "topk_us": ms_t * 1e3,
                               "scores_GBps": n4 * IHD * 4 / ms_s / 1e6})
        print(f"indexer ctx {ctx:6}: scores over {n4:5} keys {ms_s * 1e3:6.1f} us "
              f"({n4 * IHD * 4 / ms_s / 1e6:5.0f} GB/s of keys), top-{TOPK} {ms_t * 1e3:6.1f} us")


def bench_compressor(rt, arena, r, reps, res) -> None:
    freqs_np = ref_ops.rope_freqs(RD, 160000.0, 16.0, 65536, 32.0, 1.0)
    for ratio, overlap, d, rotate in [(4, True, HD, False), (128, False, HD, False), (4, True, IHD, True)]:
        arena.reset_weights()
        arena.begin_step()
        width, cap = (1 + overlap) * d, ratio * (1 + overlap) + 16
        freqs, norm = arena.weights(RD // 2, np.float32), arena.weights(d, np.float32)
        freqs.upload(freqs_np)
        norm.upload(np.ones(d, np.float32))
        ape = arena.weights((ratio, width), np.float16)
        ape.upload(np.zeros((ratio, width), np.float16))
        kv_in, sc_in = arena.scratch(width, np.float32), arena.scratch(width, np.float32)
        kv_in.upload(r.standard_normal(width).astype(np.float32))
        sc_in.upload(r.standard_normal(width).astype(np.float32))
        rk, rs = arena.scratch((cap, width), np.float32), arena.scratch((cap, width), np.float32)
        rk.upload(r.standard_normal((cap, width)).astype(np.float32))
        rs.upload(r.standard_normal((cap, width)).astype(np.float32))
        rows = arena.scratch((1024, d), np.float32)
        slot = arena.scratch(1, np.int32)
        for emit in (True, False):
            slot.upload(np.array([ratio * 100 - 1 - (0 if emit else 1)], np.int32))
            layer = ops_comp.CompLayer(ape, norm, freqs, ratio, overlap, d, RD, 1e-6, rotate)
            state = ops_comp.CompState(rk, rs, rows)
            ms = timed_graph(rt, lambda: ops_comp.compressor_decode(rt, layer, state, kv_in, sc_in, slot, pdl=True),
                             reps, slot)
            kind = "indexer keys" if rotate else "attention"
            res["compressor"].append({"ratio": ratio, "d": d, "kind": kind, "emits": emit, "us": ms * 1e3})
            print(f"compressor {kind:12} ratio {ratio:3} d {d}: {'emitting' if emit else 'storing '} "
                  f"{ms * 1e3:6.1f} us")


def main(argv: list[str] | None = None) -> int:
    global D, FF, NX, CONTEXTS
    args = bench_args(__doc__, argv)
    if args.emu:
        from ds4py.cuda.emu_runtime import EmuRuntime

        rt = EmuRuntime(check_pdl=True)
        reps = min(args.reps, 2)
        D, FF, NX, CONTEXTS = 512, 256, 24, (4096,)
    else:
        from ds4py.cuda.runtime import Runtime

        rt = Runtime()
        reps = args.reps
    dev = rt.device
    print(f"device: {dev.name} ({dev.arch}), {dev.sm_count} SMs, {dev.l2_bytes >> 20} MB L2")
    copy_gbs = device_copy_bandwidth_gbps(rt, nbytes=(2 << 30) if not args.emu else (4 << 20),
                                          reps=10 if not args.emu else 2)
    print(f"copy (device to device, read + write): {copy_gbs:.0f} GB/s")
    res: dict = {"device": dev.name, "arch": dev.arch, "emulated": args.emu, "copy_GBps": copy_gbs, "experts": [],
                 "attention": [], "indexer": [], "compressor": []}
    r = np.random.default_rng(0)
    arena = rt.arena(weights_bytes=(4 << 30) if not args.emu else (192 << 20),
                     scratch_bytes=(256 << 20) if not args.emu else (64 << 20))
    return run_and_close(rt, arena, res, args.json, lambda: bench_experts(rt, arena, r, reps, copy_gbs, res),
                         lambda: bench_attention(rt, arena, r, reps, res),
                         lambda: bench_compressor(rt, arena, r, reps, res))


if __name__ == "__main__":
    exit_timed("attn_moe_bandwidth", main)
