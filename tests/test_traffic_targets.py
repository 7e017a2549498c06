"""Issue 34's coalescing target on the committed traffic report (bench/traffic/report.json, written by
`python3 -m ds4py.cuda.traffic`): every weight-streaming kernel reads its weight matrices with >= 95% of each
warp request's sector bytes used. A kernel still below it would be listed here with the reason (none is); the
list may only shrink (a listed kernel that reaches the target fails the test until it is removed), and a kernel
not listed that falls below fails. No emulator run: the report is the measurement (re-record it after changing
a kernel)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ds4py.cuda import traffic
from ds4py.quant import vq

REPORT = Path(__file__).resolve().parents[1] / "bench" / "traffic" / "report.json"

# kernel -> why it is still below the target (issue 34). Empty: every weight-streaming kernel meets it (the last two,
# moe_prefill_{gate_up,down}_vq13, stream their rows through per-row sector windows since the fifth session).
BELOW_TARGET: dict[str, str] = {}

GGML_EXPERTS = ("iq2_xxs", "q2_k", "q4_k", "mxfp4", "q8_0", "f16")
I8_EXPERTS = ("iq2_xxs", "q2_k", "q4_k")
VQ_WIDTHS = range(vq.MIN_BITS, vq.MAX_BITS + 1)  # every VQ-8 width quantize-vq writes (6 .. 13)


def below(report: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for (kernel, _arg), c in traffic.weight_coalescing(report).items():
        if c < traffic.COALESCING_TARGET:
            out[kernel] = min(c, out.get(kernel, 1.0))
    return out


def test_weight_streaming_kernels_meet_the_coalescing_target():
    report = json.loads(REPORT.read_text())
    got = below(report)
    new = {k: c for k, c in got.items() if k not in BELOW_TARGET}
    assert not new, f"weight coalescing below {traffic.COALESCING_TARGET:.0%}: {new}"
    held = set(report["kernels"]) | set(report["model_width"]["kernels"])
    fixed = sorted(k for k in BELOW_TARGET if k in held and k not in got)
    assert not fixed, f"these reach the target now: remove them from BELOW_TARGET: {fixed}"
    gone = sorted(k for k in BELOW_TARGET if k not in held)
    assert not gone, f"listed kernels missing from the report: {gone}"


def test_the_prefill_kernels_are_judged_at_the_model_width():
    """The dense prefill GEMMs (4,096 columns), the experts' token tiles and the tensor-core prefill experts (rows
    of 4,096 / 2,048 columns) are recorded at the model's width (the twin tests' short rows do not start on
    sectors) and meet the target there, every matrix byte read once per launch (the tensor-core experts: per
    block; a VQ-8 kernel's codebook at the head of its matrix is copied by every block, as the blocks the worst-case
    grid adds and that find no work item)."""
    report = json.loads(REPORT.read_text())
    wide = report["model_width"]["kernels"]
    mats = {f"gemm_{t}": ("W",) for t in ("f16", "f32", "q8_0", "q4_k")}
    for f in GGML_EXPERTS:
        mats.update({f"moe_gate_up_tile_{f}": ("Wg", "Wu"), f"moe_down_tile_{f}": ("W",)})
    for f in (*GGML_EXPERTS, *(f"vq{b}" for b in VQ_WIDTHS)):
        mats.update({f"moe_prefill_gate_up_{f}": ("Wg", "Wu"), f"moe_prefill_down_{f}": ("W",)})
    for kernel, args in mats.items():
        for arg in args:
            w = wide[kernel]["args"][arg]
            assert w["coalescing"] >= traffic.COALESCING_TARGET, (kernel, arg)
            if "_vq" not in kernel:
                assert w["reread"] <= traffic.REREAD_LIMIT, (kernel, arg)
    # VQ-8 at every width: past the codebook (8 << bits bytes), which every block of the launch copies from the head
    # of Wg / W, each matrix byte (streams, hi rows, gains) is read once
    for bits in VQ_WIDTHS:
        book = 8 << bits
        for kernel, args in ((f"moe_prefill_gate_up_vq{bits}", ("Wg", "Wu")), (f"moe_prefill_down_vq{bits}", ("W",))):
            for arg in args:
                w = wide[kernel]["args"][arg]
                copies = math.prod(w["largest_launch"]["grid"]) if arg != "Wu" else 0
                past = w["unique_bytes"] - (book if copies else 0)
                assert past == w["arg_bytes"] - book, (kernel, arg, "matrix bytes past the codebook unread")
                assert w["distinct_bytes"] - copies * book <= traffic.REREAD_LIMIT * past, (kernel, arg)


def test_the_decode_kernels_are_judged_at_the_model_width():
    """Every decode GEMV (each weight type; plain, hc_post and SwiGLU; one row and the `_rows` kernels; Q8_0's
    int8-activation kernels) and every exact-format decode expert kernel (gate + up and down, one token and the
    grouped `_rows`; fp32 and the int8-activation ones) is recorded at the model's width (rows of 4,096 columns,
    down 2,048) and meets the target there: every matrix byte read once per launch, and the GEMVs' weights start
    loading before pdl_wait (they never depend on the previous kernel)."""
    report = json.loads(REPORT.read_text())
    wide = report["model_width"]["kernels"]
    gemv = [f"gemv_{t}{epi}{rows}" for t in ("f16", "f32", "q4_k", "q4_k_i8", "q8_0", "q8_0_i8")
            for epi in ("", "_hc_post", "_swiglu") for rows in ("", "_rows")] + ["gemv_q8_0_i8_grouped",
                                                                                     "gemv_q4_k_i8_grouped"]
    experts = [f"moe_{m}{rows}_{f}" for m in ("gate_up", "down") for rows in ("", "_rows") for f in GGML_EXPERTS]
    experts += [f"moe_{m}{rows}_i8_{f}" for m in ("gate_up", "down") for rows in ("", "_rows") for f in I8_EXPERTS]
    for kernel in gemv + experts:
        args = {a: c for a, c in wide[kernel]["args"].items() if a in traffic.MATRIX_ARGS}
        assert args, kernel
        for arg, c in args.items():
            assert c["coalescing"] >= traffic.COALESCING_TARGET, (kernel, arg, c["coalescing"])
            assert c["reread"] <= traffic.REREAD_LIMIT, (kernel, arg, c["reread"])
            assert c["coverage"] == 1.0, (kernel, arg, c["coverage"])
            assert kernel in experts or c["pre_pdl_bytes"] > 0, (kernel, arg, "no weight load before pdl_wait")


def test_the_vq_decode_experts_are_judged_at_the_model_width():
    """VQ-8's decode experts at every width 6-13 bits (gate + up, down and their grouped `_rows`) are recorded at the
    model's width (rows of 4,096 columns, down 2,048) and meet the target there; past the codebook (8 << bits bytes
    at the head of Wg / W, copied into shared memory by every persistent block of the launch, also those that find
    no tile; the kernels read no codebook from Wu) every matrix byte - streams, hi rows, gains - is read, and read
    once."""
    report = json.loads(REPORT.read_text())
    wide = report["model_width"]["kernels"]
    for bits in VQ_WIDTHS:
        book = 8 << bits
        for m, mats in (("gate_up", ("Wg", "Wu")), ("down", ("W",))):
            for rows in ("", "_rows"):
                kernel = f"moe_{m}{rows}_vq{bits}"
                for arg in mats:
                    c = wide[kernel]["args"][arg]
                    assert c["coalescing"] >= traffic.COALESCING_TARGET, (kernel, arg, c["coalescing"])
                    copies = math.prod(c["largest_launch"]["grid"]) if arg != "Wu" else 0
                    past = c["unique_bytes"] - (book if copies else 0)
                    assert past == c["arg_bytes"] - book, (kernel, arg, "matrix bytes past the codebook unread")
                    assert c["distinct_bytes"] - copies * book <= traffic.REREAD_LIMIT * past, (kernel, arg)


def test_the_judge_prefers_the_model_width_and_ignores_small_arguments():
    arg = {"requests": 4, "coalescing": 0.5, "largest_launch": {"coalescing": 0.6}}
    report = {"kernels": {"gemv_x": {"args": {"W": arg, "norm_w": dict(arg, coalescing=0.1)}},
                          "gemm_q8_0": {"args": {"W": arg}}, "rmsnorm_f32": {"args": {"w": arg}}},
              "model_width": {"kernels": {"gemm_q8_0": {"args": {"W": {"requests": 1, "coalescing": 1.0}}},
                                          "moe_down_vq6": {"args": {"W": {"requests": 1, "coalescing": 0.9}}}}}}
    assert traffic.weight_coalescing(report) == {("gemv_x", "W"): 0.6, ("gemm_q8_0", "W"): 1.0,
                                                 ("moe_down_vq6", "W"): 0.9}     # no twin test launched it
    assert below(report) == {"gemv_x": 0.6, "moe_down_vq6": 0.9}
