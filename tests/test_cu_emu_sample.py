"""cu/sample.cu on the CPU emulator against the CPU sampler (ds4py.sampling): the kept set is exactly the CPU's
(top-k, top-p, min-p and their combinations, cuts inside runs of equal logits), the draws follow its distribution
(chi-square over thousands of draws in one launch), the random stream is Philox4x32-10 (known-answer vectors,
and token for token where the masses are exact), replays with the position in a device slot repeat their
draws, and bad rows give -1."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cu_fixtures import arena, fresh_arena, put, putter, requires_emulator, rng, rt  # noqa: F401 (fixtures)
from ds4py.cuda import ops
from ds4py.cuda.graph import StepGraph
from ds4py.cuda.ops.sample import SampleRows, SampleRule
from ds4py.cuda.twins import sample as ts
from ds4py.errors import Ds4Error

pytestmark = requires_emulator


def test_philox_known_answers():
    """Random123's published vectors for Philox4x32-10."""
    assert ts.philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert ts.philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert ts.philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def run(rt, arena, put, logits, threads=64, rows=1, kept=True, pos_slot=None, pos_offset=0, seed=7, **prm):
    n = len(logits)
    out = arena.scratch(rows, np.int32)
    km = arena.scratch((rows, n), np.uint8) if kept else None
    ops.sample(rt, SampleRule(seed=seed, **prm), put(np.asarray(logits, np.float32), False), out,
               SampleRows(n=n, rows=rows, row_stride=0 if rows > 1 else n, pos_slot=pos_slot, pos_offset=pos_offset,
                          kept=km), threads=threads)
    return out.download(), (km.download().astype(bool) if kept else None)


PARAMS = [dict(temperature=1.0), dict(temperature=0.7, top_k=10), dict(temperature=1.0, top_k=1),
          dict(temperature=1.0, top_p=0.5), dict(temperature=1.3, min_p=0.1), dict(temperature=0.9, top_k=3),
          dict(temperature=0.8, top_k=40, top_p=0.8, min_p=0.02), dict(temperature=1.0, top_k=7, top_p=0.3),
          dict(temperature=0.0), dict(temperature=2.0, top_p=0.95)]


def logit_cases():
    r = rng(1)
    plain = (2 * r.standard_normal(300)).astype(np.float32)
    ties = plain.copy()
    top = np.argsort(-plain)
    ties[top[1:9]] = plain[top[1]]               # a run of 8 equal logits right below the maximum
    flat = np.zeros(257, np.float32)              # everything tied
    flat[[3, 100]] = 1.0
    peaked = np.full(1000, -5.0, np.float32)
    peaked[[10, 500, 999]] = [3.0, 2.5, 3.0]
    return {"plain": plain, "ties": ties, "flat": flat, "peaked": peaked}


def non_degenerate(logits, prm):
    """No prefix mass within float rounding of top_p (there the kept set is a coin flip of rounding)."""
    if prm.get("top_p", 1.0) >= 1 or prm.get("temperature", 1.0) == 0:
        return True
    p = ts.distribution(logits, ts.params(prm["temperature"], prm.get("top_k", 0)))
    order = np.lexsort((np.arange(len(p)), -p))
    before = np.cumsum(p[order]) - p[order]
    return np.min(np.abs(before - prm["top_p"])) > 1e-5


@pytest.mark.parametrize("name", ["plain", "ties", "flat", "peaked"])
@pytest.mark.parametrize("threads", [32, 256])
def test_kept_set_is_the_cpu_samplers(rt, arena, put, name, threads):
    logits = logit_cases()[name]
    for prm in PARAMS:
        assert non_degenerate(logits, prm), (name, prm)
        tok, keep = run(rt, arena, put, logits, threads=threads, **prm)
        want = ts.kept(logits, ts.params(**prm))
        assert (keep[0] == want).all(), f"{name} {prm}: kept {np.flatnonzero(keep[0])} vs {np.flatnonzero(want)}"
        assert want[tok[0]], f"{name} {prm}: drew {tok[0]}, outside the kept set"


def test_cut_inside_a_run_of_ties_keeps_the_lowest_ids(rt, arena, put):
    logits = np.zeros(64, np.float32)
    logits[[7, 20, 33, 50, 61]] = 2.0
    _, keep = run(rt, arena, put, logits, top_k=3, temperature=1.0)
    assert list(np.flatnonzero(keep[0])) == [7, 20, 33]
    # top-p cutting inside the run: each of the 5 holds 1/5 of the top-5 mass; p = 0.5 keeps 3 (mass before < p)
    _, keep = run(rt, arena, put, logits, top_k=5, top_p=0.5, temperature=1.0)
    assert list(np.flatnonzero(keep[0])) == [7, 20, 33]


@pytest.mark.parametrize("n,threads", [(37, 32), (37, 64), (1000, 128)])
def test_draws_are_philox_token_for_token(rt, arena, put, n, threads):
    """Equal logits: every mass is exactly 2^32, so the twin's fixed-point draw is exact."""
    rows, seed, pos0 = 200, 123456789123, 1000
    toks, _ = run(rt, arena, put, np.full(n, 0.25, np.float32), threads=threads, rows=rows, kept=False, seed=seed,
                  pos_offset=pos0, temperature=0.9)
    keep = np.ones(n, bool)
    want = [ts.draw(np.full(n, 0.25, np.float32), keep, 0.9, seed, pos0 + i, threads) for i in range(rows)]
    assert list(toks) == want


def chi2_tail(x: float, df: int) -> float:
    """P(chi2_df >= x), Wilson-Hilferty."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("prm", [dict(temperature=1.0), dict(temperature=0.6, top_k=5),
                                 dict(temperature=1.0, top_p=0.7), dict(temperature=1.5, min_p=0.15),
                                 dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05)])
def test_distribution_matches_the_cpu_sampler(prm):
    """4000 draws of one distribution in one launch (positions 0..3999): the counts fit the CPU sampler's
    probabilities (chi-square, p > 1e-6) and nothing outside its support is ever drawn."""
    from ds4py.cuda.emu_runtime import EmuRuntime

    rt = EmuRuntime()
    logits = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.2, -1.0, 1.45, 0.9, -3.0, 0.5, 1.0], np.float32)
    N = 4000
    with fresh_arena(rt, 1 << 20, 1 << 20) as arena:
        toks, _ = run(rt, arena, putter(arena), logits, threads=32, rows=N, kept=False, seed=2024, **prm)
    p = ts.distribution(logits, ts.params(**prm))
    counts = np.bincount(toks, minlength=len(logits))
    assert counts[p == 0].sum() == 0, f"drew outside the support: {counts} vs {p}"
    support = p > 0
    expect = N * p[support]
    chi2 = float(((counts[support] - expect) ** 2 / expect).sum())
    df = int(support.sum()) - 1
    if df >= 1:
        assert chi2_tail(chi2, df) > 1e-6, f"chi2 {chi2:.1f} on {df} dof: {counts} vs {np.round(expect)}"
        wrong = np.roll(p[support], 1) * N                    # the test can tell a wrong distribution
        assert chi2_tail(float(((counts[support] - wrong) ** 2 / wrong).sum()), df) < 1e-6


def test_replays_repeat_their_draws(rt, arena, put):
    """The position comes from a device slot: a graph replayed at one position draws the same token."""
    n, seed, threads = 50, 99, 64
    logits = put(np.full(n, 1.0, np.float32), False)
    slot = arena.weights(2, np.int32)
    slot.readonly = False
    out = arena.scratch(1, np.int32)

    def record():
        ops.sample(rt, SampleRule(1.0, seed=seed), logits, out, SampleRows(n=n, pos_slot=slot.view(4, 1)),
                   threads=threads)

    g = StepGraph(rt, record, slot)
    got = {}
    for pos in (5, 6, 5, 1234, 6):
        g.replay([0, pos])
        tok = int(out.download()[0])
        assert got.setdefault(pos, tok) == tok
        assert tok == ts.draw(np.full(n, 1.0, np.float32), np.ones(n, bool), 1.0, seed, pos, threads)
    assert g.captures == 1


def test_bad_rows_and_greedy(rt, arena, put):
    base = np.arange(20, dtype=np.float32)
    for bad in (np.nan, np.inf):
        x = base.copy()
        x[3] = bad
        assert run(rt, arena, put, x, kept=False, temperature=1.0)[0][0] == -1
    assert run(rt, arena, put, np.full(20, -np.inf, np.float32), kept=False, temperature=1.0)[0][0] == -1
    x = base.copy()
    x[[4, 12]] = 50.0
    for prm in (dict(temperature=0.0), dict(temperature=1.0, top_k=1)):
        tok, keep = run(rt, arena, put, x, **prm)
        assert tok[0] == 4 and list(np.flatnonzero(keep[0])) == [4]
    x = np.full(30, -np.inf, np.float32)
    x[[9, 21]] = [0.0, -1.0]                     # -inf tokens are never kept with mass
    toks, keep = run(rt, arena, put, x, rows=50, kept=False, temperature=1.0)
    assert set(toks) <= {9, 21}


def test_wrapper_checks(rt, arena, put):
    x = put(np.zeros(8, np.float32), False)
    out = arena.scratch(1, np.int32)
    with pytest.raises(Ds4Error, match="power of two"):
        ops.sample(rt, SampleRule(1.0), x, out, SampleRows(n=8), threads=96)
    with pytest.raises(Ds4Error, match="top_p"):
        ops.sample(rt, SampleRule(1.0, top_p=0.0), x, out, SampleRows(n=8))
    with pytest.raises(Ds4Error, match="every row"):
        ops.sample(rt, SampleRule(1.0), x, out, SampleRows(n=8, rows=2))
