"""Speculative decoding on a GPU (golden v4-tiny-mtp): the CUDA MTP block against DeepSeek's official block (README
tolerance 1e-4), greedy speculative decoding byte-identical to plain greedy decoding (the real MTP block with a
fixed k, and oracle drafts accepted and rejected at chosen positions: truncate of both states), and the bench's
multi-row timings. tests/test_cuda_spec.py runs the same checks on the emulator in CI."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_sizes import ON_EMULATOR, shrink
from ds4py.model import open_mtp
from ds4py.sampling import SamplingParams
from ds4py.session import Session, TokenEvent
from ds4py.mtp_spec import MtpSpec
from spec_fakes import NullTokenizer, OracleDraft
from tests.gpu.test_gpu_engine import _cuda

PROMPT = [0, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def cuda(rt, v4_mtp_gguf):
    m = _cuda(v4_mtp_gguf[0], rt)
    return m, open_mtp(m, v4_mtp_gguf[1])


def _tokens(model, n):
    s = Session(model, NullTokenizer(), 1024)
    prm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    return [e.token_id for e in s.generate(PROMPT, prm) if isinstance(e, TokenEvent)]


def test_gpu_mtp_block_matches_the_official_block(cuda, golden):
    _, mtp = cuda
    gold = np.load(golden / "v4-tiny-mtp" / "cases.npz")
    ids, P, H = gold["a_ids"], int(gold["a_P"]), gold["a_main_hc_state"]
    ds = mtp.new_state()
    (pre,), _ = mtp.step([ds], [H[:P]], [ids[1:P + 1]], all_logits=True)
    want = gold["a_mtp_prefill_logits"]
    assert np.array_equal(pre.argmax(-1), want.argmax(-1)) and np.abs(pre - want).max() <= 1e-4


def test_gpu_greedy_speculation_is_byte_identical(cuda):
    m, mtp = cuda
    n = shrink(24, 4)
    plain = _tokens(m, n)                                       # device-side generation
    spec = MtpSpec(m, mtp, fixed_k=3)
    assert _tokens(spec, n) == plain and spec.stats.drafted > 0
    truth = PROMPT + plain
    for k in (2,) if ON_EMULATOR else (2, 5):
        spec = MtpSpec(m, OracleDraft(truth, m.config.vocab_size, {len(PROMPT) + 2}), fixed_k=k)
        assert _tokens(spec, n) == plain
        assert 0 < spec.stats.accepted < spec.stats.drafted


def test_gpu_multirow_timings(cuda):
    from ds4py import bench

    m, _ = cuda
    ks, bs = ((1,), (2,)) if ON_EMULATOR else ((1, 5), (1, 4, 16))
    res = bench.multirow_stats(m, ks, bs, reps=shrink(5, 5), prompt=4)
    print({"decode_ms": res["decode_step_ms"], "verify": res["verify"], "batched": res["batched"]})
    assert [v["k"] for v in res["verify"]] == list(ks) and all(b["tokens_per_s"] > 0 for b in res["batched"])
