"""The reference forward vs DeepSeek's official inference code (golden v4-tiny).

The official checkpoint is converted losslessly (dense F32, experts MXFP4 = the FP4 codes + e8m0 scales) once
per session, then every case is run in both official modes: `qat` (fake_quant=True) and `noquant`.
Tolerances follow the golden README: noquant ~1e-4 absolute on logits; qat the same for most positions with
isolated FP8/FP4 rounding-boundary flips (which then persist in the KV cache) allowed.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden_runs import CASES, logit_diffs, picks, reference_runs

NOQUANT_ATOL = 1e-4
# qat: the FP8/FP4 fake-quant turns ~1e-7 summation-order differences (BLAS vs torch) into occasional
# rounding flips that then persist in the KV cache (the official code's own prefill and decode differ by up
# to 0.105 on case c). Which positions flip depends on the BLAS, so the check is statistical per case:
QAT_MEDIAN = 0.05        # median over a case's positions of the row max |diff| (measured <= 0.004)
QAT_MAX = 1.0            # one row of case c moves by 0.62: an FP8 flip in layer 1's KV tips a near-tie in
                         # layer 6's router (docs/reference.md); indexer-pick swaps move rows by <= 0.06


@pytest.fixture(scope="session")
def gold(golden):
    return np.load(golden / "v4-tiny" / "cases.npz")


@pytest.fixture(scope="session")
def runs(v4_gguf, gold):
    return reference_runs(v4_gguf, gold)


def _suffix(fq):
    return "" if fq else "_noquant"


@pytest.mark.parametrize("fq", [True, False], ids=["qat", "noquant"])
@pytest.mark.parametrize("case", CASES)
def test_logits(runs, gold, case, fq):
    """Prefill-last, decode and consistency (fresh full prefill) logits; noquant row by row, qat pooled over
    the case's positions (a rounding-boundary flip moves one position and, through the cache, its followers)."""
    d = logit_diffs(runs[case, fq], gold, case, _suffix(fq), None if fq else NOQUANT_ATOL)
    if fq:
        assert d.max() <= QAT_MAX, f"max |diff| {d.max():.3f} > {QAT_MAX}"
        assert np.median(d) <= QAT_MEDIAN, f"median row max |diff| {np.median(d):.2e} > {QAT_MEDIAN}"


# Block outputs (qat run of case a; the golden has no noquant hidden states). Without a rounding flip every
# position matches to ~5e-6 of the row's RMS. Which FP8 rounding boundaries a ~1e-7 summation-order difference
# tips over depends on the BLAS kernel and thread count, and a flip in a compressed KV row moves every later
# position that attends to it (and, through a near-tie in a router, one row by up to 0.2 RMS). Measured over
# 10 OpenBLAS kernels x 1-2 threads: median <= 3.3e-3, 90th percentile <= 5.9e-3, max 0.2 (of the row RMS).
# The bounds leave 3-5x room for other machines; a wrong formula moves most positions by O(0.1-1).
HIDDEN_MEDIAN, HIDDEN_P90, HIDDEN_MAX = 1e-2, 3e-2, 0.5


def hidden_state_errors(trace_hc, hidden) -> list[np.ndarray]:
    """Per layer: each position's max |diff| over (hc, dim), relative to the golden row's RMS."""
    out = []
    for il in range(hidden.shape[0]):
        d = np.abs(trace_hc[il + 1] - hidden[il]).max(axis=(1, 2))
        out.append(d / np.sqrt((hidden[il].astype(np.float64) ** 2).mean(axis=(1, 2))))
    return out


def check_hidden_states(errors: list[np.ndarray]) -> None:
    for il, r in enumerate(errors):
        assert np.median(r) <= HIDDEN_MEDIAN, f"layer {il}: median relative error {np.median(r):.2e}"
        assert np.quantile(r, 0.9) <= HIDDEN_P90, f"layer {il}: 90th percentile {np.quantile(r, 0.9):.2e}"
        assert r.max() <= HIDDEN_MAX, f"layer {il}: max relative error {r.max():.2e}"


def test_prefill_hidden_states(runs, gold):
    """Every block's output state, with a criterion that holds under any BLAS summation order (see above)."""
    check_hidden_states(hidden_state_errors(runs["a", True]["trace"].hc, gold["a_prefill_hidden"]))


def test_hidden_state_criterion_catches_a_wrong_block(runs, gold):
    """Negative control: the same criterion fails on a state that is off by what a small formula error gives
    (every position of one layer moved by 5% of its RMS, as a mis-scaled residual branch would)."""
    hidden = gold["a_prefill_hidden"]
    hc = list(runs["a", True]["trace"].hc)
    rms = np.sqrt((hidden[3] ** 2).mean(axis=(1, 2), keepdims=True))
    hc[4] = hc[4] + 0.05 * rms * np.sign(np.random.default_rng(0).standard_normal(hc[4].shape))
    with pytest.raises(AssertionError, match="layer 3"):
        check_hidden_states(hidden_state_errors(hc, hidden))


@pytest.mark.parametrize("case", CASES)
def test_indexer_topk(runs, gold, case):
    """Indexer picks (qat): prefill indices are P + row, decode indices window + row (golden README)."""
    r = runs[case, True]
    cfg = r["model"].config
    P = int(gold[f"{case}_P"])
    total = mismatched = 0
    for il in (i for i in range(cfg.n_layers) if cfg.has_indexer(i)):
        want = gold[f"{case}_prefill_indexer_topk_L{il}"]
        sel = r["trace"].indexer_selected[il]
        for t in range(want.shape[0] if want.shape[1] else 0):
            total += 1
            mismatched += {P + int(g) for g in np.nonzero(sel[t])[0]} != picks(want[t])
        want = gold[f"{case}_decode_indexer_topk_L{il}"]
        for j, dtr in enumerate(r["dec_trace"]):
            total += 1
            mismatched += {cfg.window + int(g) for g in np.nonzero(dtr.indexer_selected[il][0])[0]} != picks(want[j])
    # near-ties after an FP4 flip may swap one pick; measured worst case: 44 of 816 rows (case d)
    assert mismatched <= max(1, 0.08 * total), f"{mismatched} of {total} indexer rows pick different rows"

