"""cu/topk.cu under the CPU emulator against its twin (ds4py/cuda/twins/topk.py): the exact top-k by radix select
is the set of ref/forward.topk_mask when the threshold has no ties, ties go to the lowest indices, the output is
ascending; registers-only and re-read sizes, n <= k, extreme values, in forward, reverse and random thread order."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.twins import topk as twin_topk
from ds4py.cuda.ops.topk import Visible
from ds4py.errors import Ds4Error
from ds4py.ref.forward import topk_mask
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

ORDERS = ("forward", "reverse", "random")


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([17, *seed])


def tie_scores(r, n: int) -> np.ndarray:
    """Scores with many exact ties (a few distinct values), including at any threshold."""
    return r.choice(np.array([-2.5, -0.0, 0.0, 0.5, 1.0, 3.0, 7.25], np.float32), n)


@pytest.mark.parametrize("n,k", [(10, 16), (300, 16), (3000, 512), (20000, 512), (5, 5), (1025, 1024)])
@pytest.mark.parametrize("order", ORDERS)
def test_topk(kdev, n, k, order):
    r = rng(n, k)
    s = r.standard_normal(n).astype(np.float32)
    dev = kdev(order, n)
    d_out = dev.var(np.full(k + 3, -7, np.int32))
    pos = 4 * n + 2                                       # (pos + 1) // 4 = n visible rows
    ops_topk.topk(dev.rt, dev.const(s), k, d_out, Visible(pos_slot=dev.const(np.array([pos], np.int32))))
    out = d_out.download()
    m = min(n, k)
    np.testing.assert_array_equal(out[:m], twin_topk.topk(s, k))
    assert np.all(out[m:] == -7)
    np.testing.assert_array_equal(np.flatnonzero(topk_mask(s[None], k)[0]), out[:m])   # the reference's set


@pytest.mark.parametrize("n,k", [(700, 16), (17000, 512), (64, 63)])
def test_topk_ties_go_to_the_lowest_indices(kdev, n, k):
    r = rng(n, k, 2)
    s = tie_scores(r, n)
    dev = kdev("random", 1)
    d_out = dev.var(np.zeros(k, np.int32))
    ops_topk.topk(dev.rt, dev.const(s), k, d_out, Visible(n=n))
    out = d_out.download()
    want = twin_topk.topk(s, k)
    np.testing.assert_array_equal(out, want)
    kth = np.sort(s)[::-1][k - 1]
    assert np.all(s[out] >= kth) and np.sum(s > kth) <= k   # the same values as any top-k: only ties differ


def test_topk_extreme_values(kdev):
    s = np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, 1.0], np.float32)
    dev = kdev()
    d_s = dev.const(s)
    for k in range(1, len(s)):
        d_out = dev.var(np.zeros(k, np.int32))
        ops_topk.topk(dev.rt, d_s, k, d_out, Visible(n=len(s)))
        np.testing.assert_array_equal(d_out.download(), twin_topk.topk(s, k), err_msg=f"k={k}")


def test_topk_wrapper_rejects_bad_shapes():
    with pytest.raises(Ds4Error, match="room for k"):
        ops_topk.topk(None, np.zeros(10, np.float32), 8, np.zeros(4, np.int32), Visible(n=10))
