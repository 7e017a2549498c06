"""VQ-8 experts and Q4_K dense weights on a GPU, through the device check's synthetic V4.1 stack at v41-tiny's layer
map (bench/cuda_decode.py EMU_V41: VQ-8 13-bit layer 0 and 12-bit after, Q4_K where quantize-vq puts it, Engram
from a small synthetic table; no golden data needed): a prefill block (the grouped VQ rows kernels) leaves the
logits and state single decode steps (the VQ decode kernels) leave, to fp32 noise; a multi-row step's rows are
single steps bit for bit; graph + PDL = direct launches bit for bit. Skipped on the emulator, where
tests/test_cuda_engine_synth.py runs the same model (this file was run there, random thread order, when written)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from gpu_sizes import ON_EMULATOR

REPO = Path(__file__).resolve().parents[2]
REL = 1e-4              # of the largest |logit| (cuda-emu measures <= 1e-6); a layout or format error is O(1)
pytestmark = pytest.mark.skipif(ON_EMULATOR, reason="tests/test_cuda_engine_synth.py checks it on the emulator")


def _shapes() -> dict:
    spec = importlib.util.spec_from_file_location("cuda_decode_bench", REPO / "bench" / "cuda_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.EMU_V41


@pytest.fixture(scope="module")
def model(rt, tmp_path_factory):
    from ds4py.config import ModelConfig
    from ds4py.cuda import synth
    from ds4py.cuda.engine import CudaModel

    cfg = ModelConfig.v41_flash(**_shapes())
    rows = 512
    table = synth.write_engram_table(str(tmp_path_factory.mktemp("vq") / "engram.bin"), cfg, rows, seed=3)
    m = CudaModel.synthetic(cfg, runtime=rt, seed=2, vq=synth.VqWidths(12, 13, 1), dense="q4_k",
                            engram_table=(table, rows))
    yield m
    m.close()


def _ids(m, n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, m.config.vocab_size, n)]


def test_vq8_q4k_prefill_block_equals_single_steps(model):
    m = model
    assert m.vq_experts
    ids = _ids(m, 20, 5)                                    # > rollback horizon + 1: one prefill block
    block_st, steps_st = m.new_state(), m.new_state()
    block = m.step([block_st], [ids])[0]
    single = [m.step([steps_st], [[t]])[0] for t in ids][-1]
    assert np.isfinite(block).all() and single.std() > 0.1
    scale = max(1.0, float(np.abs(single).max()))
    d = np.abs(block - single).max() / scale
    nxt = [int(single.argmax())]
    a, b = m.step([block_st], [nxt])[0], m.step([steps_st], [nxt])[0]
    print(f"VQ-8 + Q4_K V4.1 synthetic on {m.rt.device.name}: block vs single steps max relative {d:.2e}, "
          f"the step after {np.abs(a - b).max() / scale:.2e}")
    assert d <= REL and np.abs(a - b).max() <= REL * scale


def test_vq8_rows_and_launch_modes_are_bit_identical(model):
    m = model
    ids = _ids(m, 4, 6)
    outs = {}
    for mode in ((True, True), (True, False)):
        m.set_launch_mode(*mode)
        st = m.new_state()
        outs[mode] = np.stack([m.step([st], [[t]])[0] for t in ids])
    m.set_launch_mode(True, True)
    assert np.array_equal(outs[(True, True)], outs[(True, False)])
    st, twin = m.new_state(), m.new_state()
    rows = [m.step([st, twin], [[t], [t]]) for t in ids]
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for (a, b), c in zip(rows, outs[(True, True)]))
