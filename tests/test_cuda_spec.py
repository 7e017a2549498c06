"""Speculative decoding on the CUDA engine, on the CPU emulator (golden v4-tiny-mtp, converted with its MTP block):

- the MTP block on CUDA (ds4py/cuda/mtp.py) against DeepSeek's official block: fed the golden main states, prefill
  and decode rows within the README's 1e-4, argmax identical;
- step_hidden: the multi-row path's final residuals equal the single-row path's bit for bit, and the reference's
  within fp32 noise;
- greedy speculative decoding (the real MTP block with the scheduler and k = 3; oracle drafts that are accepted
  and rejected at chosen positions) gives plain greedy decoding's tokens byte for byte, the verify running as one
  multi-row step, and leaves both states where plain decoding leaves them (truncate after rejection).

The GPU runs the same checks in tests/gpu (bench/device_check.sh); here they run at tiny size, a few seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.options import Outputs
from ds4py.model import Numerics, open_model, open_mtp
from ds4py.ref.engine import RefModel
from ds4py.sampling import SamplingParams
from ds4py.session import Session, TokenEvent
from ds4py.spec import SpecState
from ds4py.mtp_spec import MtpSpec
from spec_fakes import NullTokenizer, OracleDraft

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
ATOL = 1e-4                  # the golden README's fp32 tolerance for the MTP logits


@pytest.fixture(scope="module")
def cuda(v4_mtp_gguf):
    m = open_model(v4_mtp_gguf[0], backend="cuda-emu")
    return m, open_mtp(m, v4_mtp_gguf[1])


@pytest.fixture(scope="module")
def gold(golden):
    return np.load(golden / "v4-tiny-mtp" / "cases.npz")


def _tokens(model, prompt, n=16):
    s = Session(model, NullTokenizer(), 1024)
    prm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    return [e.token_id for e in s.generate(prompt, prm) if isinstance(e, TokenEvent)], s


@pytest.mark.parametrize("fq", [True, False], ids=["qat", "noquant"])
def test_cuda_mtp_block_matches_the_official_block(v4_mtp_gguf, gold, fq):
    m = open_model(v4_mtp_gguf[0], backend="cuda-emu", numerics=Numerics(fake_quant=fq))
    mtp = open_mtp(m, v4_mtp_gguf[1])
    assert type(mtp).__name__ == "CudaMtp"
    s = "" if fq else "_noquant"
    ids, P, H = gold["a_ids"], int(gold["a_P"]), gold[f"a_main_hc_state{s}"]
    ds = mtp.new_state()
    (pre,), (out,) = mtp.step([ds], [H[:P]], [ids[1:P + 1]], all_logits=True)      # 4 multi-row steps of 16
    dec, outs = [], [out]
    for t in range(P, len(ids) - 1):
        (lg,), (o,) = mtp.step([ds], [H[t:t + 1]], [ids[t + 1:t + 2]])
        dec.append(lg)
        outs.append(o)
    assert ds.n_tokens == len(ids) - 1
    for what, got in (("prefill", pre), ("decode", np.array(dec))):
        want = gold[f"a_mtp_{what}_logits{s}"].reshape(got.shape)
        assert np.array_equal(got.argmax(-1), want.argmax(-1)), f"{what}: top-1 differs"
        assert np.abs(got - want).max() <= ATOL, f"{what}: max |diff| {np.abs(got - want).max():.2e}"
    want = gold[f"a_mtp_block_output{s}"]                 # the block's output state (what a chained draft reads)
    rel = np.abs(np.concatenate(outs) - want).max() / np.sqrt((want.astype(np.float64) ** 2).mean())
    assert rel <= 1e-4, f"MTP block output: max |diff| {rel:.2e} of its RMS"


def test_step_hidden_rows_equal_single_rows_and_the_reference(cuda, v4_mtp_gguf):
    m, _ = cuda
    ids = np.random.default_rng(5).integers(0, m.config.vocab_size, 14)
    a, b = m.new_state(), m.new_state()
    (la,), (ha,) = m.step_hidden([a], [ids[:9]], all_logits=True)          # a prompt: position by position
    m.step_hidden([b], [ids[:9]])
    (lr,), (hr,) = m.step_hidden([a], [ids[9:]], all_logits=True)          # 5 rows: one multi-row step
    one = [m.step_hidden([b], [[int(t)]]) for t in ids[9:]]
    assert np.array_equal(lr, np.stack([o[0][0] for o in one]))
    assert np.array_equal(hr, np.concatenate([o[1][0] for o in one]))
    ref = RefModel(v4_mtp_gguf[0], kernels="dequant")
    (_,), (h_ref,) = ref.step_hidden([ref.new_state()], [ids], all_logits=True)
    got = np.concatenate([ha, hr])
    assert got.shape == h_ref.shape and np.abs(got - h_ref).max() <= 1e-3 * np.abs(h_ref).max()


PROMPT = [0, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def plain(cuda):
    """Plain greedy decoding on the CUDA engine (device-side generation): tokens and the state afterwards."""
    return _tokens(cuda[0], PROMPT)


@pytest.mark.parametrize("k", [None, 3])
def test_greedy_with_the_cuda_mtp_block_is_byte_identical(cuda, plain, k):
    m, mtp = cuda
    rows = []
    real = m._step_rows
    m._step_rows = lambda st, ch, al: rows.append(sum(len(c) for c in ch)) or real(st, ch, al)
    try:
        spec = MtpSpec(m, mtp, fixed_k=k)
        got, s = _tokens(spec, PROMPT)
    finally:
        del m._step_rows
    assert got == plain[0]
    assert spec.stats.drafted >= 1 and isinstance(s.state, SpecState)
    assert max(rows) >= 2                        # the verify of 1 + k rows went through the multi-row step


def test_greedy_after_a_long_prompt_is_byte_identical(cuda):
    """A prompt longer than the rollback horizon + 1 runs through the prefill blocks in plain decoding; the
    speculative path must prefill it the same way (step_hidden), or the two states differ in the last bits."""
    m, mtp = cuda
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, m.config.vocab_size, m.rollback_horizon + 9)]
    used = []
    real = m.runner.prefill
    m.runner.prefill = lambda st, ids, al, out=Outputs.NONE: used.append(out) or real(st, ids, al, out)
    try:
        want, _ = _tokens(m, prompt, n=8)
        got, _ = _tokens(MtpSpec(m, mtp, fixed_k=3), prompt, n=8)
    finally:
        del m.runner.prefill
    assert used == [Outputs.NONE, Outputs.HIDDEN]   # plain and speculative prompts both went through the prefill
    assert got == want


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_with_accepted_and_rejected_drafts_is_byte_identical(cuda, plain, k):
    m, _ = cuda
    toks, ps = plain
    truth = PROMPT + toks
    spec = MtpSpec(m, OracleDraft(truth, m.config.vocab_size, {len(PROMPT) + 3, len(PROMPT) + 9}), fixed_k=k)
    got, s = _tokens(spec, PROMPT)
    assert got == toks
    assert 0 < spec.stats.accepted < spec.stats.drafted       # accepted runs and rejections (truncate)
    assert s.state.n_tokens == ps.state.n_tokens == len(truth) - 1
    a, b = ps.state.copy(), s.state.main                       # the same state: the same logits, bit for bit
    for t in (truth[-1], 7):
        assert np.array_equal(m.step([a], [[t]])[0], m.step([b], [[t]])[0])


def test_paired_cuda_state_rollback(cuda):
    m, mtp = cuda
    spec = MtpSpec(m, mtp)
    st = spec.new_state()
    n = spec.capacity + 4                                        # a chunk longer than the pending ring
    spec.step([st], [list(range(3, 3 + n))])
    assert st.n_tokens == n and st.draft.n_tokens == n - 1       # a long chunk: the MTP caught up
    for t in (5, 6, 7):
        spec.step([st], [[t]])
    snap = st.copy()
    st.truncate(n - 2)
    assert st.n_tokens == n - 2 and st.draft.n_tokens == n - 3
    assert snap.n_tokens == n + 3 and snap.draft.n_tokens == n - 1


def test_cuda_cost_model_has_the_references_numbers(v4_mtp_gguf, cuda):
    """The deterministic cost model of a seeded sampled request (SpecModel.byte_costs, from Model.weight_bytes)
    prices a CUDA verify exactly as the reference does: its k, and so its text, does not depend on the backend."""
    from ds4py.model import WeightBytes

    m, mtp = cuda
    ref = RefModel(v4_mtp_gguf[0])
    wc, wr = m.weight_bytes(), ref.weight_bytes()
    assert isinstance(wc, WeightBytes) and wc == wr
    assert 0 < wr.routed < wr.decode and 0 < wr.head < wr.decode          # a verify row is not a whole step
    c, r = MtpSpec(m, mtp).byte_costs(), MtpSpec(ref, open_mtp(ref, v4_mtp_gguf[1])).byte_costs()
    assert (c.main, c.routed, c.draft_b, c.head) == (r.main, r.routed, r.draft_b, r.head)
    assert [c.verify(n) for n in (1, 2, 5)] == [r.verify(n) for n in (1, 2, 5)] and c.plain() == r.plain()
