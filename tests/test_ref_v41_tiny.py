"""The reference forward vs DeepSeek's official V4.1 inference code (golden v41-tiny).

The official checkpoint is converted losslessly once per session (tests/conftest.py: dense F32, experts MXFP4,
the golden run's stub vocabulary); its Engram tables are read from the golden folder's safetensors. Targets
(golden README): `*_fp32_fixed_noquant` (no fake-quant: ~1e-4 everywhere) and `*_fp32_fixed` (the full
semantics; rounding-boundary flips allowed). Both are the fixed (prefill-consistent) decode; the unmodified
official decode (`bf16` arrays, bug included) is compared at the level the README allows: which rows the
affected indexer picks.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.ref.engine import RefModel
from golden_runs import CASES, logit_diffs, picks, reference_runs, row_diffs

NOQUANT_ATOL = 1e-4      # measured <= 3.2e-6 over every position of every case (Haswell and Prescott kernels)
# fp32_fixed: a ~1e-7 summation-order difference can tip one FP8 / FP4 rounding of a cached row (the official
# prefill and decode differ by 4e-2 on case a that way); which position flips depends on the BLAS kernel (ours
# reproduces the official decode's flip under one kernel, and flips in the prefill instead under another).
# Per case: measured max 4.0e-2, median <= 7.4e-3 (case a under Prescott; <= 2.7e-6 elsewhere).
QAT_MAX, QAT_MEDIAN = 0.2, 0.02


def _suffix(fq: bool) -> str:
    return "_fp32_fixed" if fq else "_fp32_fixed_noquant"


@pytest.fixture(scope="module")
def gold(golden):
    return np.load(golden / "v41-tiny" / "cases.npz")


@pytest.fixture(scope="module")
def runs(v41_gguf, gold):
    return reference_runs(v41_gguf, gold)


@pytest.mark.parametrize("fq", [True, False], ids=["fp32_fixed", "noquant"])
@pytest.mark.parametrize("case", CASES)
def test_logits(runs, gold, case, fq):
    """Prefill-last, every decode step and every consistency position (a fresh prefill): identical top-1
    everywhere; noquant within 1e-4 row by row, fp32_fixed pooled over the case (flips allowed)."""
    r, P = runs[case, fq], int(gold[f"{case}_P"])
    d = logit_diffs(r, gold, case, _suffix(fq), None if fq else NOQUANT_ATOL)
    if fq:
        assert d.max() <= QAT_MAX, f"max |diff| {d.max():.3f} > {QAT_MAX}"
        assert np.median(d) <= QAT_MEDIAN, f"median row max |diff| {np.median(d):.2e} > {QAT_MEDIAN}"
    # decode agrees with our own prefill (the fixed index-key sharing): the prefill path's top-1 everywhere
    assert np.array_equal(r["decode"].argmax(-1), r["full"][P:].argmax(-1))
    if not fq:
        assert row_diffs(r["decode"], r["full"][P:]).max() <= NOQUANT_ATOL


@pytest.mark.parametrize("fq", [True, False], ids=["fp32_fixed", "noquant"])
def test_block_states_premix_and_engram(runs, gold, fq):
    """Case a's prefill: every block's output state, the pre-mix it hands on (lagged mHC) and the state after
    each Engram, relative to the golden row's RMS (measured <= 2.4e-6; fp32_fixed flips come after P here)."""
    s, tr = _suffix(fq), runs["a", fq]["trace"]
    hidden = gold[f"a_prefill_hidden{s}"]
    tol = 1e-4
    for il in range(hidden.shape[0]):
        rms = np.sqrt((hidden[il].astype(np.float64) ** 2).mean(axis=(1, 2)))
        rel = np.abs(tr.hc[il + 1] - hidden[il]).max(axis=(1, 2)) / rms
        assert np.quantile(rel, 0.9) <= tol and rel.max() <= 10 * tol, f"layer {il}: block output {rel.max():.2e}"
        assert np.abs(tr.premix[il] - gold[f"a_prefill_premix{s}"][il]).max() <= tol, f"layer {il}: pre-mix"
    for il in (0, 1):
        want = gold[f"a_prefill_engram_out_L{il}{s}"]
        rel = np.abs(tr.engram_out[il] - want).max() / np.sqrt((want.astype(np.float64) ** 2).mean())
        assert rel <= tol, f"Engram of layer {il}: {rel:.2e}"


@pytest.mark.parametrize("case", CASES)
def test_engram_hash_ids(runs, gold, case):
    """The n-gram hash ids of every prefill and decode position equal the reference's, exactly."""
    r = runs[case, True]
    assert np.array_equal(r["trace"].engram_ids, gold[f"{case}_prefill_hash_ids"])
    dec = np.concatenate([t.engram_ids for t in r["dec_trace"]])
    assert np.array_equal(dec, gold[f"{case}_decode_hash_ids"])


@pytest.mark.parametrize("fq", [True, False], ids=["fp32_fixed", "noquant"])
def test_decode_indexer_topk(runs, gold, fq):
    """The rows every index source picks in decode (layer 1: ratio 2, own keys; 3: ratio 1, candidate source;
    5: on layer 3's keys, inside its candidate blocks) equal the reference's: indices are window + row.
    Measured: all 870 rows equal in both modes; a flip may swap a near-tie, so 2% may differ."""
    s, total, bad = _suffix(fq), 0, 0
    for c in CASES:
        r = runs[c, fq]
        cfg = r["model"].config
        for il in (i for i in range(cfg.n_layers) if cfg.has_indexer(i)):
            want = gold[f"{c}_decode_indexer_topk_L{il}{s}"]
            for j, dtr in enumerate(r["dec_trace"]):
                sel = dtr.indexer_selected[il]
                got = set() if sel is None else {cfg.window + int(g) for g in np.nonzero(sel[0])[0]}
                total += 1
                bad += got != picks(want[j])
    assert total == 3 * sum(len(gold[f"{c}_ids"]) - int(gold[f"{c}_P"]) for c in CASES)
    assert bad <= max(1, 0.02 * total), f"{bad} of {total} decode indexer rows pick different rows"


def test_official_decode_bug_switch(v41_gguf, gold, runs):
    """official_decode_bug=True reproduces the official decode: on the steps where the ratio-2 key owner (layer 1)
    emits no row, its indexer scores the last publisher's keys (layer 3's). There its picks follow the unmodified
    official decode's (`bf16` arrays, bug included), and the fixed engine's follow the fixed reference's
    (`bf16_fixed`); bf16 vs fp32 allows only such pick-level agreement (measured 34 vs 8 of 71 steps, and 46 vs 8).
    The switch moves decode away from prefill by O(1), as the official code's own does (README pvd 1.2-2.1)."""
    bug = RefModel(v41_gguf, official_decode_bug=True)
    W, match = bug.config.window, {("bug", ""): 0, ("bug", "_bf16_fixed"): 0, ("fix", ""): 0, ("fix", "_bf16_fixed"): 0}
    steps, pvd = 0, []
    for c in CASES:
        ids, P = gold[f"{c}_ids"], int(gold[f"{c}_P"])
        st = bug.new_state()
        bug.prefill(st, ids[:P])
        for j, t in enumerate(ids[P:]):
            tr = bug.new_trace()
            pvd.append(np.abs(bug.decode(st, int(t), trace=tr) - runs[c, True]["full"][P + j]).max())
            if (P + j) % 2:                        # layer 1's compressor emits a row: no stale keys
                continue
            steps += 1
            got = {"bug": tr.indexer_selected[1], "fix": runs[c, True]["dec_trace"][j].indexer_selected[1]}
            for (mode, sfx) in match:
                sel = got[mode]
                chosen = set() if sel is None else {W + int(g) for g in np.nonzero(sel[0])[0]}
                match[mode, sfx] += chosen == picks(gold[f"{c}_decode_indexer_topk_L1{sfx}"][j])
    assert steps == 71
    assert match["bug", ""] >= 25 and match["fix", ""] <= 15, match
    assert match["fix", "_bf16_fixed"] >= 35 and match["bug", "_bf16_fixed"] <= 15, match
    assert np.median(pvd) > 0.05 and max(pvd) > 0.5


def test_fp32_fixed_criterion_catches_a_wrong_rounding(v41_gguf, gold, monkeypatch):
    """Negative control: the fp32_fixed criterion fails when the compressed rows are rounded like the indexer's
    (FP4 with power-of-two scales in blocks of 32) instead of the NVFP4-like e4m3-scaled blocks of 16."""
    from ds4py.ref import ops

    monkeypatch.setattr(ops, "nvfp4_fake_quant", lambda x, block=16: ops.fp4_fake_quant(x, 32))
    model = RefModel(v41_gguf)
    ids, P = gold["c_ids"], int(gold["c_P"])
    got = model.prefill(model.new_state(), ids, all_logits=True)[gold["c_consistency_positions_fp32_fixed"]]
    d = row_diffs(got, gold["c_consistency_prefill_logits_fp32_fixed"])
    assert np.median(d) > QAT_MEDIAN and d.max() > QAT_MAX
