"""Multi-row steps on a GPU: the emulator's multi-row kernel tests again on the hardware
(where FMA contraction and real concurrency could break batch invariance if a row's arithmetic depended on the
launch), the Q8_0 `_rows` GEMV at the V4 Flash q_b shape bit-identical to single-row launches, and the engine's
multi-row step (several sequences, a verify chunk) bit-identical to single steps on the tiny models."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_engine_checks import ids_for
from gpu_sizes import shrink
from ds4py.cuda import ops, twins
from ds4py.cuda.ops.gemv import GEMV_MAX_X
from ds4py.cuda.ops.gemv import GemvX
from tests.cu_emu_device import gpu_devices
from tests.gpu.test_gpu_engine import _cuda, models  # noqa: F401 (fixture)
from test_cu_emu_rows import (test_gemv_rows_equal_single_rows,  # noqa: F401
                              test_gemv_rows_input_groups_and_the_widest_launch,
                              test_grouped_gate_up_and_rows_down_equal_single_rows, test_hc_post_and_swiglu_rows,
                              test_rows_wrapper_checks)

pytestmark = pytest.mark.gpu


@pytest.fixture
def kdev(rt):
    """The emulator tests' device factory on the GPU (64 MiB regions unless a test asks for more)."""
    yield from gpu_devices(rt, 64)


def test_q8_0_rows_gemv_at_the_q_b_shape_is_bit_identical_to_single_rows(rt, put, arena):
    rows, cols = shrink(32768, 256, 4), 1024
    r = np.random.default_rng(5)
    W = twins.quant_q8_0((r.standard_normal((rows, cols)) * 0.05).astype(np.float32)).reshape(rows, -1)
    x = r.standard_normal((GEMV_MAX_X, cols)).astype(np.float32)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dW, dnw = put(W), put(nw)
    y = arena.scratch(GEMV_MAX_X * rows, np.float32)
    ops.gemv(rt, [(dW, y, rows)], GemvX(put(x.reshape(-1), False), cols, nx=GEMV_MAX_X, norm=(dnw, 1e-6)))
    rt.synchronize()
    got = y.download().reshape(GEMV_MAX_X, rows)
    for n in (0, GEMV_MAX_X - 1):
        one = arena.scratch(rows, np.float32)
        ops.gemv(rt, [(dW, one, rows)], GemvX(put(x[n].copy(), False), cols, norm=(dnw, 1e-6)))
        rt.synchronize()
        assert got[n].tobytes() == one.download().tobytes(), f"row {n}"


def test_engine_rows_are_bit_identical_to_single_steps(models, rt):
    for name, path in models.items():
        m = _cuda(path, rt)
        V = m.config.vocab_size
        a, b, a2, b2 = (m.new_state() for _ in range(4))
        pa, pb = ids_for(V, 7, seed=1), ids_for(V, 3, seed=2)
        m.options = m.options.but(multirow=False)
        for st, ids in ((a, pa), (a2, pa), (b, pb), (b2, pb)):
            for t in ids:
                m.step([st], [[int(t)]])
        m.options = m.options.but(multirow=True)
        draft, other = ids_for(V, 4, seed=3), ids_for(V, 1, seed=4)
        got_a, got_b = m.step([a, b], [draft, other], all_logits=True)
        m.options = m.options.but(multirow=False)
        want_a = np.stack([m.step([a2], [[int(t)]])[0] for t in draft])
        want_b = m.step([b2], [[int(other[0])]])[0]
        assert got_a.tobytes() == want_a.tobytes(), f"{name}: verify rows differ from single steps"
        assert got_b[0].tobytes() == want_b.tobytes(), f"{name}: batched row differs from its single step"
        m.close()
