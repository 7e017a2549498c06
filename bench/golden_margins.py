"""How close each golden reference tolerance is under this machine's BLAS: the measured value of every criterion
of tests/test_ref_v4_tiny.py and tests/test_ref_ds4_tiny.py (logits), as a fraction of its bound. Run it under
several kernels and thread counts to see which bound is tight:

    for c in Haswell Prescott Sandybridge; do for t in 1 2; do
        OPENBLAS_CORETYPE=$c OPENBLAS_NUM_THREADS=$t python bench/golden_margins.py; done; done

One line per run: the worst value / bound of each criterion (1.0 = at the bound; > 1 fails).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
GOLDEN = REPO.parent / "shared" / "golden"


def v4(out: dict) -> None:
    import test_ref_v4_tiny as t
    from ds4py.convert import convert_checkpoint
    from ds4py.model import Numerics
    from ds4py.ref.engine import RefModel

    gold = np.load(GOLDEN / "v4-tiny" / "cases.npz")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "v4.gguf")
        convert_checkpoint(str(GOLDEN / "v4-tiny"), path, experts="mxfp4", dense="f32", progress=False)
        for fq in (True, False):
            m = RefModel(path, numerics=Numerics(fake_quant=fq))
            s = "" if fq else "_noquant"
            diffs, top1 = [], True
            for c in t.CASES:
                ids, P = gold[f"{c}_ids"], int(gold[f"{c}_P"])
                st, tr = m.new_state(), m.new_trace()
                pre = m.prefill(st, ids[:P], all_logits=True, trace=tr)
                dec = np.array([m.decode(st, int(x)) for x in ids[P:]])
                full = m.prefill(m.new_state(), ids, all_logits=True)
                pos = gold[f"{c}_consistency_positions{s}"]
                case = []
                for got, want in ((pre[-1], gold[f"{c}_prefill_last_logits{s}"]), (dec, gold[f"{c}_decode_logits{s}"]),
                                  (full[pos], gold[f"{c}_consistency_prefill_logits{s}"])):
                    top1 &= bool(np.array_equal(np.argmax(got, -1), np.argmax(want, -1)))
                    case.append(np.abs(np.atleast_2d(got) - np.atleast_2d(want)).max(1))
                d = np.concatenate(case)
                diffs.append(d)
                if fq:
                    out.setdefault("v4 qat median", []).append(np.median(d) / t.QAT_MEDIAN)
                    out.setdefault("v4 qat max", []).append(d.max() / t.QAT_MAX)
                else:
                    out.setdefault("v4 noquant max", []).append(d.max() / t.NOQUANT_ATOL)
                if fq and c == "a":
                    errs = t.hidden_state_errors(tr.hc, gold["a_prefill_hidden"])
                    out["v4 hidden median"] = [max(np.median(r) for r in errs) / t.HIDDEN_MEDIAN]
                    out["v4 hidden p90"] = [max(np.quantile(r, 0.9) for r in errs) / t.HIDDEN_P90]
                    out["v4 hidden max"] = [max(r.max() for r in errs) / t.HIDDEN_MAX]
            out.setdefault("v4 top-1 differs", []).append(0.0 if top1 else 2.0)


def ds4(out: dict) -> None:
    import test_ref_ds4_tiny as t
    from ds4py.model import Numerics
    from ds4py.ref.engine import RefModel

    spec = importlib.util.spec_from_file_location("cl", GOLDEN / "ds4-tiny" / "compare_logits.py")
    cl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cl)
    gold = np.load(GOLDEN / "ds4-tiny" / "cases.npz")
    for aq in (True, False):
        m = RefModel(str(GOLDEN / "ds4-tiny" / "tiny.gguf"), numerics=Numerics.ds4() if aq else Numerics())
        tol = cl.LOOSE_TOL if aq else t.FP32_TOL
        name = "ds4 act_quant" if aq else "ds4 fp32"
        for c in t.CASES:
            ids = gold[f"{c}/ids"]
            r = cl.compare(gold[f"{c}/prefill_logits"], m.prefill(m.new_state(), ids, all_logits=True))
            allowed = max(2, int(np.ceil(tol["bad_row_frac"] * r["rows"])))
            for k, v in (("bad rows", r["bad_rows"] / allowed), ("kl_mean", r["kl_mean"] / tol["kl_mean"]),
                         ("median row max", r["median_row_max_abs"] / tol["median_row_max_abs"]),
                         ("mean_abs", r["mean_abs"] / tol["mean_abs"]), ("max_abs", r["max_abs"] / tol["max_abs"])):
                out.setdefault(f"{name} {k}", []).append(v)


def main() -> None:
    out: dict[str, list[float]] = {}
    v4(out)
    ds4(out)
    env = f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '')} threads={os.environ.get('OPENBLAS_NUM_THREADS', '')}"
    worst = {k: round(float(max(v)), 3) for k, v in out.items()}
    print(env, json.dumps(worst))


if __name__ == "__main__":
    main()
