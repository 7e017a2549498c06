"""Speculative decoding on the trained tiny V4 + MTP (../shared/trained/v4-tiny-trained): a draft that has learnt
something (teacher-forced agreement ~0.5), so rounds accept drafts, the scheduler's calibration has a signal, and
greedy identity is checked on accepted runs of real drafts, not only on rejections. Timing is a bench
(bench/spec_trained.py); this checks behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.model import open_mtp
from ds4py.ref.engine import RefModel
from ds4py.sampling import Sampler, SamplingParams
from ds4py.spec import Scheduler, SpecModel, _Calibration

GEN = 32
EOS = 1


@pytest.fixture(scope="module")
def pair(trained_gguf):
    model = RefModel(trained_gguf[0])
    return model, open_mtp(model, trained_gguf[1])


@pytest.fixture(scope="module")
def prompts(trained):
    return {d: np.load(trained / f"test_{d}.ids.npy")[1000:1064].astype(np.int64) for d in ("code", "prose")}


def _plain(model, prompt) -> list[int]:
    st = model.new_state()
    lg, out = model.step([st], [list(prompt)])[0], []
    for _ in range(GEN):
        lg = lg.copy()
        lg[EOS] = -np.inf
        out.append(int(np.argmax(lg)))
        lg = model.step([st], [[out[-1]]])[0]
    return out


def _spec(spec, prompt):
    st = spec.new_state()
    lg = spec.step([st], [list(prompt)])[0]
    req = spec.new_request(SamplingParams(temperature=0.0), suppress=[EOS])
    sampler = Sampler(req.params)
    out, ks = [req._sample(lg, sampler)], []
    while len(out) <= GEN:
        r = req.round(st, out[-1], sampler, GEN + 1 - len(out))
        ks.append(r.stats.drafted)
        out += r.tokens
    return out[:GEN], req, ks


@pytest.mark.parametrize("dom", ["code", "prose"])
@pytest.mark.parametrize("k", [None, 1, 3], ids=["scheduler", "k1", "k3"])
def test_greedy_speculation_is_plain_decoding(pair, prompts, dom, k):
    """Byte-identical to plain greedy decoding, with drafts accepted (a learnt draft) as well as rejected."""
    model, mtp = pair
    got, req, ks = _spec(SpecModel(model, mtp, fixed_k=k), prompts[dom])
    assert got == _plain(model, prompts[dom])
    if k is not None:                     # (the scheduler's k follows the clock: it may decode plainly here)
        assert 0 < req.stats.accepted < req.stats.drafted
        assert 0.15 <= req.stats.acceptance <= 0.9, req.stats.summary()


def test_scheduler_bootstraps_short_and_calibrates(pair, prompts):
    """The first round drafts BOOTSTRAP_DRAFTS (not k_max), the next is a plain step (neither depends on the
    clock). With k = 1 every round records its first position (no clock either): the first-position line has a
    positive slope on this draft's prose (more confident drafts are accepted more often), and chained positions
    are recorded only when a round has them."""
    model, mtp = pair
    _, req, ks = _spec(SpecModel(model, mtp), prompts["prose"])
    assert ks[:2] == [Scheduler.BOOTSTRAP_DRAFTS, 0]
    assert req.scheduler.first.n >= 1
    for dom in ("code", "prose"):
        _, req, _ = _spec(SpecModel(model, mtp, fixed_k=1), prompts[dom])
        sch = req.scheduler
        assert sch.first.n == req.stats.rounds and sch.chained.n == 0
        if dom == "prose":                # (on the 32 code positions here the fitted slope is 0: no signal)
            assert sch.first.line is not None and sch.first.line[1] > 0, sch.first.line
        _, req, _ = _spec(SpecModel(model, mtp, fixed_k=3), prompts[dom])
        assert req.scheduler.chained.n > 0


def test_calibration_line():
    """_Calibration recovers an affine acceptance law from (σ, hit) samples, clips it to [0, 1], keeps c1 >= 0,
    and is ρ·σ before two σ differ."""
    c = _Calibration()
    assert np.allclose(c([0.5]), 0.5)                           # ρ = 1 before any sample
    c.add(0.4, 0.6)
    assert c.line is None and np.allclose(c([0.2]), 0.3)        # ρ = 1.5
    rng = np.random.default_rng(0)
    for s in rng.random(4000):
        c.add(float(s), float(rng.random() < 0.3 + 0.6 * s))
    c0, c1 = c.line
    assert abs(c0 - 0.3) < 0.05 and abs(c1 - 0.6) < 0.08
    assert c([0.0, 1.0, 5.0]).tolist() == pytest.approx([c0, c0 + c1, 1.0])
    d = _Calibration()
    for s in (0.1, 0.9, 0.2, 0.8):                             # falling with σ: slope held at 0
        d.add(s, 1.0 - s)
    assert d.line[1] == 0.0 and np.allclose(d([0.1, 0.9]), 0.5)
