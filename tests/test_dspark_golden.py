"""The DSpark draft (ds4py/ref/dspark.py) vs DeepSeek's official V4.1 code with DSpark on (golden v41-tiny-dspark).

Isolation first, as the golden README says: the stored main-model taps (`X_main_hidden*`, zeros before h0) and block
tokens drive our draft alone (ring seed, one ring write and one call per decode position); then end to end: our
own main model's taps (`step_taps`) and `score --draft-out`. Targets: `*_fp32_fixed_noquant` to ~1e-4 (measured
<= 3.9e-6), `*_fp32_fixed` per call with FP8 rounding-boundary flips allowed (README tolerance guidance).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4py.errors import Ds4Error
from ds4py.model import Numerics
from ds4py.ref.engine import RefModel

CASES = ("a", "b", "c", "d", "f")
TOL = 1e-4
# fp32_fixed: an FP8 rounding flip of one ring / block key moves a call by ~1e-3 here (measured max 1.6e-3, on
# cases c and d); the README allows ~1e-2..1e-1 per affected call
QAT_MAX, QAT_CLEAN = 5e-2, 0.75       # max over calls; the share of calls within TOL
REPO = Path(__file__).resolve().parents[1]


def _sfx(fq: bool) -> str:
    return "_fp32_fixed" if fq else "_fp32_fixed_noquant"


@pytest.fixture(scope="module")
def gold(golden):
    return np.load(golden / "v41-tiny-dspark" / "cases.npz")


@pytest.fixture(scope="module")
def models(dspark_gguf):
    return {fq: RefModel(dspark_gguf, numerics=Numerics(fake_quant=fq)) for fq in (True, False)}


def _taps(gold, c, s):
    """The stored taps of every position (zeros before h0: those rows never reach a draft call)."""
    h0, mh = int(gold[f"{c}_main_hidden_start"]), gold[f"{c}_main_hidden{s}"]
    full = np.zeros((h0 + len(mh), mh.shape[1]), np.float32)
    full[h0:] = mh
    return full


def _isolated(model, gold, c, s):
    """Per call: (logits with the stored chain's Markov inputs, confidence, our own greedy chain), and the rings
    after the prompt."""
    draft = model.open_dspark()
    P, taps = int(gold[f"{c}_P"]), _taps(gold, c, s)
    st = draft.new_state()
    draft.feed([st], [taps[:P]])
    rings = np.stack([st.ring(k, "win") for k in range(draft.config.n_layers)])
    out = []
    for j, t in enumerate(gold[f"{c}_draft_positions"]):
        draft.feed([st], [taps[t:t + 1]])
        tok = int(gold[f"{c}_draft_input_ids{s}"][j])
        blk = draft.block(st, tok)
        _, lg, cf = draft.greedy(blk, tok, ids=gold[f"{c}_draft_output_ids{s}"][j])
        ids, _, _ = draft.greedy(blk, tok)
        out.append((lg, cf, ids, blk))
    return out, rings, P


@pytest.mark.parametrize("fq", [False, True], ids=["noquant", "fp32_fixed"])
def test_isolated_draft_matches_the_official_calls(models, gold, fq):
    s = _sfx(fq)
    diffs = []
    for c in CASES:
        calls, rings, P = _isolated(models[fq], gold, c, s)
        want = gold[f"{c}_dspark_window_after_prefill{s}"]          # [S, W, hd], slot = p mod W
        W = want.shape[1]
        kept = np.arange(max(0, P - W), P)
        ring_d = np.abs(rings[:, kept % rings.shape[1]] - want[:, kept % W])
        if fq:        # an FP8 rounding flip moves one value by one E4M3 step
            assert ring_d.max() <= 0.1 and (ring_d > TOL).mean() <= 0.01, f"case {c}: ring after the prompt"
        else:
            assert ring_d.max() <= TOL, f"case {c}: ring after the prompt"
        diffs += [golden_call_diff(gold, c, s, fq, j, lg, cf, ids) for j, (lg, cf, ids, _) in enumerate(calls)]
    d = np.array(diffs)
    assert len(d) == 22 + 38 + 39 + 2 + 24
    if fq:
        assert_qat_spread(d)


def golden_call_diff(gold, c: str, s: str, fq: bool, j: int, lg, cf, ids) -> float:
    """Draft call j of case c against the official code: the largest |diff| of its logits and confidences; noquant,
    also within TOL and the same drafted ids (tests/test_cuda_dspark.py checks the CUDA draft with it)."""
    d = max(np.abs(lg - gold[f"{c}_draft_logits{s}"][j]).max(),
            np.abs(cf - gold[f"{c}_draft_confidence{s}"][j]).max())
    if not fq:
        assert d <= TOL, f"case {c} call {j}: |diff| {d:.2e}"
        assert np.array_equal(ids, gold[f"{c}_draft_output_ids{s}"][j]), f"case {c} call {j}: drafted ids"
    return d


def assert_qat_spread(d: np.ndarray) -> None:
    """fp32_fixed draft calls: every |diff| within QAT_MAX and at least QAT_CLEAN of them within TOL."""
    assert d.max() <= QAT_MAX and (d <= TOL).mean() >= QAT_CLEAN, (d.max(), (d <= TOL).mean())


def test_case_a_intermediates(models, gold):
    """main_x, the last stage's hidden state and the base logits (before the Markov bias), noquant."""
    s = _sfx(False)
    draft = models[False].open_dspark()
    taps = _taps(gold, "a", s)
    calls, _, _ = _isolated(models[False], gold, "a", s)
    main_x = draft.weights.linear(draft.binding.main_proj, taps[gold["a_draft_positions"]])
    from ds4py.ref import ops

    main_x = ops.rmsnorm(main_x, draft.weights.get(draft.binding.main_norm), draft.config.norm_eps)
    assert np.abs(main_x - gold[f"a_draft_main_x{s}"]).max() <= TOL
    for j, (_, _, _, blk) in enumerate(calls):
        assert np.abs(blk.hidden - gold[f"a_draft_hidden{s}"][j]).max() <= TOL
        assert np.abs(blk.base - gold[f"a_draft_base_logits{s}"][j]).max() <= TOL


def test_main_model_taps_match_the_official_main_hidden(models, gold):
    """step_taps over prefill and decode gives the rows the official forward collected (noquant, relative)."""
    s, m = _sfx(False), models[False]
    for c in ("a", "b"):
        ids, P, h0 = gold[f"{c}_ids"], int(gold[f"{c}_P"]), int(gold[f"{c}_main_hidden_start"])
        st = m.new_state()
        (_,), (t0,) = m.step_taps([st], [ids[:P]])
        rows = [t0] + [m.step_taps([st], [[int(t)]])[1][0] for t in ids[P:]]
        got = np.concatenate(rows)[h0:]
        want = gold[f"{c}_main_hidden{s}"]
        assert np.abs(got - want).max() <= TOL * np.abs(want).max(), c


def ds4py(*args, check=True):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "ds4py", *map(str, args)], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.parametrize("case,fq", [("a", False), ("f", False), ("c", True)])
def test_score_draft_out_end_to_end(dspark_gguf, gold, tmp_path, case, fq):
    """`score --draft-out`: our main model's taps feed the draft (the chain end to end); case f's block tokens
    are our own greedy outputs, which must be the official ones."""
    s = _sfx(fq)
    ids, P = gold[f"{case}_ids"], int(gold[f"{case}_P"])
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "draft.npz"
    ds4py("score", "-m", dspark_gguf, "--ids", tmp_path / "ids.npy", "--split", P, "--out", tmp_path / "l.npy",
          "--draft-out", out, *([] if fq else ["--no-fake-quant"]))
    got = np.load(out)
    n = len(ids) - 1 - P
    assert got["positions"].tolist() == list(range(P, len(ids) - 1)) == gold[f"{case}_draft_positions"][:n].tolist()
    assert got["logits"].shape == (n, 5, 512) and got["logits"].dtype == np.float32
    assert got["output_ids"].shape == (n, 6) and got["confidence"].shape == (n, 5)
    assert np.array_equal(got["input_ids"], ids[P + 1:])
    if case == "f":       # official flow: block token 0 = the main model's greedy output at t
        main = np.load(tmp_path / "l.npy")
        assert np.array_equal(main[1:n + 1].argmax(-1), gold[f"f_draft_input_ids{s}"][:n])
        return
    want_l, want_c = gold[f"{case}_draft_logits{s}"], gold[f"{case}_draft_confidence{s}"]
    d = np.maximum(np.abs(got["logits"] - want_l).max((1, 2)), np.abs(got["confidence"] - want_c).max(1))
    if fq:
        assert d.max() <= QAT_MAX and (d <= TOL).mean() >= QAT_CLEAN
    else:
        assert d.max() <= TOL
        assert np.array_equal(got["output_ids"], gold[f"{case}_draft_output_ids{s}"])


def draft_errors(model):
    """The refusals of `model`'s DSpark draft (a block before any fed position, taps of the wrong width, a token
    outside the vocabulary, another model's state), each one sentence; returns the draft and its state (2 positions
    fed). tests/test_cuda_dspark.py runs it on the CUDA draft."""
    draft = model.open_dspark()
    st = draft.new_state()
    with pytest.raises(Ds4Error, match="at least one fed main position"):
        draft.block(st, 3)
    with pytest.raises(Ds4Error, match=r"taps must be \[T, 768\]"):
        draft.feed([st], [np.zeros((2, 5), np.float32)])
    draft.feed([st], [np.zeros((2, 768), np.float32)])
    with pytest.raises(Ds4Error, match="outside the vocabulary"):
        draft.block(st, 512)
    with pytest.raises(Ds4Error, match="state from this draft"):
        draft.block(model.new_state(), 1)
    return draft, st


def test_draft_errors(models, dspark_gguf, v41_gguf, tmp_path):
    draft, st = draft_errors(models[False])
    assert st.n_tokens == 2 and draft.load_state(draft.save_state(st)).n_tokens == 2
    np.save(tmp_path / "ids.npy", np.arange(8))
    r = ds4py("score", "-m", dspark_gguf, "--ids", tmp_path / "ids.npy", "--split", 4, "--out", tmp_path / "l.npy",
              "--draft-out", tmp_path / "d.npz", "--mtp-out", tmp_path / "m.npy", check=False)
    assert r.returncode != 0 and "do not go together" in r.stderr and "Traceback" not in r.stderr
    r = ds4py("score", "-m", v41_gguf, "--ids", tmp_path / "ids.npy", "--split", 4, "--out", tmp_path / "l.npy",
              "--draft-out", tmp_path / "d.npz", check=False)
    assert r.returncode != 0 and "no DSpark draft" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "d.npz").exists()


def test_a_stale_ring_is_caught(models, gold):
    """Negative control: a call whose position t never reached the rings (what the official code's one write
    per call leaves after a step that fed several tokens) misses the official logits by far more than TOL."""
    s, m = _sfx(False), models[False]
    draft = m.open_dspark()
    P, taps = int(gold["a_P"]), _taps(gold, "a", s)
    st = draft.new_state()
    draft.feed([st], [taps[:P]])
    draft.feed([st], [np.zeros((1, taps.shape[1]), np.float32)])        # position P fed with another row
    tok = int(gold[f"a_draft_input_ids{s}"][0])
    _, lg, _ = draft.greedy(draft.block(st, tok), tok, ids=gold[f"a_draft_output_ids{s}"][0])
    assert np.abs(lg - gold[f"a_draft_logits{s}"][0]).max() > 100 * TOL
