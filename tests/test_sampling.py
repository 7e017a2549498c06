"""Sampling: each truncation rule on known distributions (exact kept sets), the documented order, greedy,
seeded reproducibility and the empirical frequencies of many draws."""

import numpy as np
import pytest

from ds4py.sampling import (Sampler, SamplingParams, apply_min_p, apply_top_k, apply_top_p, softmax)

P4 = np.array([0.5, 0.3, 0.15, 0.05])


def kept(probs) -> set[int]:
    return set(np.flatnonzero(probs > 0).tolist())


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


@pytest.mark.parametrize("kw, name", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(seed=-3), "seed"), (dict(seed=1.5), "seed"), (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"), (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_params_raise_a_clear_error(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_param_normalisation():
    p = SamplingParams(stop="END", top_k=np.int64(3), temperature=1)
    assert p.stop == ["END"] and p.top_k == 3 and isinstance(p.temperature, float)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


def test_top_k_keeps_exactly_k_most_probable():
    assert kept(apply_top_k(np.array([0.1, 0.4, 0.2, 0.3]), 2)) == {1, 3}
    # ties at the boundary go to the lower id, so exactly k survive
    assert kept(apply_top_k(np.full(4, 0.25), 2)) == {0, 1}
    out = apply_top_k(np.array([0.1, 0.4, 0.2, 0.3]), 2)
    np.testing.assert_allclose(out[[1, 3]], [4 / 7, 3 / 7])
    assert apply_top_k(P4, 0) is P4 and apply_top_k(P4, 10) is P4


@pytest.mark.parametrize("p, expect", [(0.4, {0}), (0.5, {0}), (0.7, {0, 1}), (0.81, {0, 1, 2}),
                                       (0.96, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_prefix_reaching_p(p, expect):
    out = apply_top_p(P4, p)
    assert kept(out) == expect
    assert out.sum() == pytest.approx(1.0)


def test_top_p_candidate_shortcut_matches_full_sort():
    rng = np.random.default_rng(0)
    for peaked, p in [(True, 0.9), (False, 0.9), (False, 0.3), (True, 0.999)]:
        logits = rng.normal(size=5000) * (6.0 if peaked else 0.5)
        probs = softmax(logits)
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        assert kept(apply_top_p(probs, p)) == set(order[before < p].tolist())


@pytest.mark.parametrize("m, expect", [(0.3, {0, 1, 2}), (0.31, {0, 1}), (0.1, {0, 1, 2, 3}), (1.0, {0})])
def test_min_p_keeps_tokens_above_fraction_of_max(m, expect):
    assert kept(apply_min_p(P4, m)) == expect


def test_truncation_order_is_temperature_topk_topp_minp():
    # top-k first renormalises [0.4, 0.3] to [4/7, 3/7]; top-p 0.5 then keeps only token 0.
    # (top-p first would keep {0, 1}.)
    s = Sampler(SamplingParams(top_k=2, top_p=0.5))
    assert kept(s.distribution(logits_of([0.4, 0.3, 0.2, 0.1]))) == {0}
    # temperature before top-p: at T=1 top-p 0.6 keeps {0, 1}; at T=0.25 token 0 alone holds > 0.6
    lg = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(Sampler(SamplingParams(top_p=0.6)).distribution(lg)) == {0, 1}
    assert kept(Sampler(SamplingParams(top_p=0.6, temperature=0.25)).distribution(lg)) == {0}
    # no truncation: exactly softmax(logits / T)
    np.testing.assert_allclose(Sampler(SamplingParams(temperature=2.0)).distribution(lg),
                               softmax(lg.astype(np.float64) / 2.0), rtol=1e-12)


def test_greedy_is_argmax_lowest_id_and_does_not_consume_rng():
    s = Sampler(SamplingParams(temperature=0, seed=5))
    before = s.rng.bit_generator.state
    assert s.sample(np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)) == 1
    assert s.rng.bit_generator.state == before
    assert Sampler(SamplingParams(top_k=1, temperature=5.0)).sample(np.array([0.0, -1.0, 0.5])) == 2


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = np.random.default_rng(1).normal(size=512).astype(np.float32)

    def draws(seed):
        s = Sampler(SamplingParams(seed=seed, top_p=0.95))
        return [s.sample(logits) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_empirical_frequencies_match_the_truncated_distribution():
    probs = np.array([0.05, 0.4, 0.25, 0.2, 0.1])
    s = Sampler(SamplingParams(seed=123, top_k=4, min_p=0.3))     # top_k drops 0; min_p (0.12) drops 4
    want = s.distribution(logits_of(probs))
    assert kept(want) == {1, 2, 3}
    draws = np.array([s.sample(logits_of(probs)) for _ in range(20000)])
    freq = np.bincount(draws, minlength=5) / draws.size
    assert freq[0] == 0 and freq[4] == 0
    np.testing.assert_allclose(freq, want, atol=0.015)


def test_masked_logits_are_never_sampled():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
    s = Sampler(SamplingParams(seed=0))
    assert {s.sample(logits) for _ in range(200)} == {1, 3}


@pytest.mark.parametrize("bad", [np.array([0.0, np.nan]), np.array([-np.inf, -np.inf]), np.zeros((2, 2)),
                                 np.array([np.inf, 0.0])])
def test_invalid_logits_raise(bad):
    with pytest.raises(ValueError, match="logits"):
        Sampler(SamplingParams(seed=0)).sample(bad)


@pytest.mark.parametrize("t", [1e-320, 5e-324, 1e-309])
def test_subnormal_temperature_is_greedy(t):
    """A temperature that passes a 0..2 range check but cannot be divided by (1/t overflows) is greedy: argmax,
    lowest id on ties, no generator step; never a draw from NaN probabilities."""
    logits = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    s = Sampler(SamplingParams(temperature=t, seed=0, min_p=0.05))
    assert s.params.greedy
    d = s.distribution(logits)
    assert np.isfinite(d).all() and d.tolist() == [0, 1, 0, 0]
    state = s.rng.bit_generator.state
    assert [s.sample(logits) for _ in range(5)] == [1] * 5 and s.rng.bit_generator.state == state


@pytest.mark.parametrize("t", [1e-300, 1e-200, 1e-30, 1e-8])
def test_tiny_temperatures_give_a_finite_distribution(t):
    """Tiny but normal temperatures are applied as given: the distribution collapses onto the maximum (ties
    share it) and stays finite, because the maximum is subtracted before dividing."""
    logits = np.array([1.0, 3.0, 2.0, 3.0, -np.inf], np.float32)
    d = Sampler(SamplingParams(temperature=t, seed=0)).distribution(logits)
    assert np.isfinite(d).all() and d.tolist() == [0, 0.5, 0, 0.5, 0]
    assert np.isfinite(softmax(np.array([1e30, -1e30, 0.0]), t)).all()


def test_a_non_finite_distribution_is_never_sampled(monkeypatch):
    """The last line of defence: whatever produced it, a distribution with NaN is refused, not drawn from."""
    import ds4py.sampling as sampling

    monkeypatch.setattr(sampling, "softmax", lambda logits, t: np.full(np.asarray(logits).shape, np.nan))
    with pytest.raises(ValueError, match="not finite"):
        Sampler(SamplingParams(temperature=0.7, seed=0)).sample(np.zeros(4, np.float32))
