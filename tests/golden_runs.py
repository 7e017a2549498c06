"""What the golden tests of the reference on V4 and V4.1 (tests/test_ref_v4_tiny.py, tests/test_ref_v41_tiny.py)
share: the runs of every case, and the comparison of their logits with the golden ones."""

from __future__ import annotations

import numpy as np

from ds4py.model import Numerics
from ds4py.ref.engine import RefModel

CASES = ("a", "b", "c", "d")


def reference_runs(gguf: str, gold) -> dict:
    """Per (case, fake_quant): prefill of ids[:P] (all positions, with trace), teacher-forced decode (traced),
    and a fresh full prefill (the consistency arrays)."""
    out = {}
    for fq in (True, False):
        model = RefModel(gguf, numerics=Numerics(fake_quant=fq))
        for c in CASES:
            ids, P = gold[f"{c}_ids"], int(gold[f"{c}_P"])
            st, tr = model.new_state(), model.new_trace()
            prefill = model.prefill(st, ids[:P], all_logits=True, trace=tr)
            dec, dec_tr = [], []
            for t in ids[P:]:
                dtr = model.new_trace()
                dec.append(model.decode(st, int(t), trace=dtr))
                dec_tr.append(dtr)
            full = model.prefill(model.new_state(), ids, all_logits=True)
            out[c, fq] = dict(prefill=prefill, trace=tr, decode=np.array(dec), dec_trace=dec_tr, full=full,
                              model=model)
    return out


def row_diffs(got, want) -> np.ndarray:
    return np.abs(np.atleast_2d(got) - np.atleast_2d(want)).max(1)


def logit_diffs(run: dict, gold, case: str, suffix: str, atol: float | None) -> np.ndarray:
    """Prefill-last, every decode step and every consistency position (a fresh prefill) of one run against the
    golden logits of `suffix`: the same top-1 everywhere, every row within atol where given (else unchecked
    here); the row max |diff| of all three, end to end."""
    pos = gold[f"{case}_consistency_positions{suffix}"]
    pairs = {"prefill last": (run["prefill"][-1], gold[f"{case}_prefill_last_logits{suffix}"]),
             "decode": (run["decode"], gold[f"{case}_decode_logits{suffix}"]),
             "consistency prefill": (run["full"][pos], gold[f"{case}_consistency_prefill_logits{suffix}"])}
    diffs = []
    for what, (got, want) in pairs.items():
        assert np.array_equal(np.atleast_2d(got).argmax(-1), np.atleast_2d(want).argmax(-1)), f"{what}: top-1 differs"
        d = row_diffs(got, want)
        if atol is not None:
            assert d.max() <= atol, f"{what}: max |diff| {d.max():.2e} > {atol}"
        diffs.append(d)
    return np.concatenate(diffs)


def picks(row) -> set:
    """The golden indexer's picks in one row (-1: none)."""
    return {int(x) for x in row if x >= 0}
