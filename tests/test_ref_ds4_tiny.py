"""The reference forward vs antirez/ds4's CPU engine (golden ds4-tiny), with the golden's own metrics.

ds4 rounds activations to int8 (Q8_0 / Q8_K) before every quantised matmul and stores KV as F16; the fp32
reference does not, so it differs from ds4 by that quantisation error on top of ds4's own noise:
  * act_quant=True (the reference mirroring those roundings) must pass the README's LOOSE tolerances;
  * act_quant=False (the fp32 oracle, pinned to the official code by test_ref_v4_tiny) is held to the
    bounds measured here (FP32_TOL, about 1.3x the worst of the cases tested here; over all 11 cases the
    7-row tiny_p1 is worse: kl_mean 0.017, 4/7 rows KL > 0.01; see docs/reference.md).
Plus the intermediates the README suggests: layer-0 sublayer inputs, expert choices, indexer selections.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ds4py.model import Numerics
from ds4py.ref.engine import RefModel

# chat_short: intermediates; rand_160_p100: decode crosses the window; rand_300_p200: ratio-128 rows at 127
# (prefill) and 255 (decode), selective indexer, intermediates; handoff_p255: the ratio-128 row is emitted
# by the first decoded token.
CASES = ("chat_short", "rand_160_p100", "rand_300_p200", "handoff_p255")
# decode is the slow part (one Python pass per token): each mode decodes two cases; the fp32 decode path is
# also pinned token by token to the official code in test_ref_v4_tiny
DECODE = {True: ("rand_160_p100", "handoff_p255"), False: ("chat_short", "handoff_p255")}
FP32_TOL = dict(bad_row_kl=0.01, bad_row_frac=0.55, kl_mean=0.015, median_row_max_abs=0.6, mean_abs=0.16,
                max_abs=4.0, top1_min=0.8)


@pytest.fixture(scope="module")
def cl(golden):
    spec = importlib.util.spec_from_file_location("compare_logits", golden / "ds4-tiny" / "compare_logits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gold(golden):
    return np.load(golden / "ds4-tiny" / "cases.npz")


@pytest.fixture(scope="module")
def runs(golden, gold):
    out = {}
    for aq in (False, True):
        model = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), numerics=Numerics.ds4() if aq else Numerics())
        for c in CASES:
            ids, P = gold[f"{c}/ids"], int(gold[f"{c}/P"])
            tr, full_state = model.new_trace(), model.new_state()
            prefill = model.prefill(full_state, ids, all_logits=True, trace=tr)
            out[c, aq] = dict(prefill=prefill, trace=tr, full_state=full_state)
            if c in DECODE[aq]:
                st = model.new_state()
                dec = [model.prefill(st, ids[:P])] + [model.decode(st, int(t)) for t in ids[P:]]
                out[c, aq]["decode"] = np.array(dec)
    return out


def test_loads_as_is(golden):
    model = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"))
    assert model.backend == "ref" and model.config.n_layers == 4
    assert 0 < model.weight_bytes_per_token() < model.gguf.tensor_bytes()


@pytest.mark.parametrize("aq", [True, False], ids=["act_quant", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_logits(runs, gold, cl, case, aq):
    tol = cl.LOOSE_TOL if aq else FP32_TOL
    for kind in ("prefill_logits", "decode_logits")[: 1 + (case in DECODE[aq])]:
        m = cl.compare(gold[f"{case}/{kind}"], runs[case, aq][kind.split("_")[0]])
        ok, why = cl.check(m, tol)
        assert ok, f"{case}/{kind}: {why}"


@pytest.mark.parametrize("aq", [True, False], ids=["act_quant", "fp32"])
@pytest.mark.parametrize("case", ("chat_short", "rand_300_p200"))
def test_intermediates(runs, gold, case, aq):
    tr = runs[case, aq]["trace"]
    g = lambda k: gold[f"{case}/{k}"]                                         # noqa: E731
    # layer 0 sees no upstream differences: its attention input is exact; its FFN input differs by ds4's
    # activation rounding inside attention (measured 0.04 fp32, 0.018 with act_quant)
    assert np.abs(tr.attn_in[0] - g("prefill_attn_in")[0]).max() < 1e-4
    assert np.abs(tr.ffn_in[0] - g("prefill_ffn_in")[0]).max() < (0.03 if aq else 0.06)
    experts = g("prefill_experts")
    for il in range(3):                                                       # hash layers: exact
        np.testing.assert_array_equal(tr.experts[il], experts[il])
        np.testing.assert_allclose(tr.expert_weights[il], g("prefill_expert_weights")[il], atol=0.03)
    same = np.mean([set(a) == set(b) for a, b in zip(tr.experts[3], experts[3])])
    assert same >= (0.9 if aq else 0.75), f"layer-3 expert sets agree on {same:.2f} of positions"
    # indexer: rows with <= top_k visible candidates select all of them (exact); beyond, near-ties swap
    sel, mine = g("prefill_indexer_selected").astype(bool), tr.indexer_selected[2]
    assert not sel[:, mine.shape[1]:].any()
    sel = sel[:, :mine.shape[1]]
    few = mine.sum(1) < 16
    np.testing.assert_array_equal(mine[few], sel[few])
    overlap = (mine & sel).sum() / sel.sum()
    assert overlap >= 0.9, f"indexer picks overlap {overlap:.3f}"


def test_kv_cache_rows_with_act_quant(runs, gold):
    """Layer 0's raw KV rows (FP8 + F16) equal ds4's up to isolated FP8 steps when activations match."""
    case = "rand_300_p200"
    ref = gold[f"{case}/cache_after_prefill/l0_raw"]                          # oldest first
    n, W = len(gold[f"{case}/ids"]), ref.shape[0]
    rows = runs[case, True]["full_state"].view(0, "win")[-W:]
    assert np.mean(rows == ref) > 0.9                                          # measured 0.94
    assert np.mean(np.abs(rows - ref) <= 0.01 * np.abs(ref) + 1e-3) > 0.98     # measured 0.994


def test_every_other_case_act_quant_is_loose(golden, gold, cl, capsys):
    """The remaining 7 golden cases (prefill of all N and prefill-P-then-decode), act_quant vs ds4: LOOSE."""
    model = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), numerics=Numerics.ds4())
    names = sorted({k.split("/")[0] for k in gold.files} - set(CASES))
    assert len(names) + len(CASES) == 11
    for c in names:
        ids, P = gold[f"{c}/ids"], int(gold[f"{c}/P"])
        prefill = model.prefill(model.new_state(), ids, all_logits=True)
        st = model.new_state()
        dec = np.array([model.prefill(st, ids[:P])] + [model.decode(st, int(t)) for t in ids[P:]])
        for kind, mine in (("prefill_logits", prefill), ("decode_logits", dec)):
            ok, why = cl.check(cl.compare(gold[f"{c}/{kind}"], mine), cl.LOOSE_TOL)
            assert ok, f"{c}/{kind}: {why}"
    with capsys.disabled():
        print(f"\n  ds4-tiny act_quant: {len(names)} more cases within LOOSE, prefill and decode "
              f"(the other {len(CASES)} in test_logits)")
