"""q4_K dense weights through the CUDA engine on the CPU emulator: v4-tiny converted with `--dense q4_k` (q_a, kv,
the compressors' and indexer's projections, the shared expert's gate / up and the head in Q4_K; the narrower
matrices in Q8_0) on cuda-emu against the reference on the same file: prefill on tensor cores (cu/gemm.cu's
gemm_q4_k) and decode (gemv_q4_k*), same top-1 at every position and fp32 noise; a multi-row step's rows
bit-identical to single steps. Budget: ~0.15 s of emulator per token."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cuda_engine_checks import compare, ids_for, run
from ds4py.cuda import emu
from ds4py.cuda.options import temporarily
from ds4py.gguf import GGUFFile
from ds4py.model import open_model
from ds4py.ref.engine import RefModel

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")


@pytest.fixture(scope="module")
def q4k_gguf(golden, tmp_path_factory) -> str:
    from ds4py.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("q4k") / "v4-tiny-q4k.gguf"
    convert_checkpoint(str(golden / "v4-tiny"), str(out), experts="mxfp4", dense="q4_k", progress=False)
    return str(out)


@pytest.fixture(scope="module")
def q4k(q4k_gguf):
    return open_model(q4k_gguf, backend="cuda-emu")


def test_the_file_has_q4_k_dense_matrices(q4k_gguf):
    types = {n: QT(int(t.qtype)) for n, t in GGUFFile(q4k_gguf).tensors.items()}
    assert types["output.weight"] == types["blk.0.attn_q_a.weight"] == types["blk.0.ffn_gate_shexp.weight"] == QT.Q4_K


def test_q4_k_dense_matches_the_reference(q4k, q4k_gguf):
    ids = ids_for(256, 40)
    a = compare(run(q4k, ids, 32), run(RefModel(q4k_gguf), ids, 32))
    print(f"v4-tiny q4_K dense, cuda-emu vs ref (prefill 32, decode 8): {a}")
    assert a.top1 == 1.0, a
    assert a.within == 1.0 and a.median_rel <= 1e-5, a


def test_rows_are_bit_identical_to_single_steps(q4k):
    V = q4k.config.vocab_size
    ids = [ids_for(V, n, seed=70 + n) for n in (3, 6)]
    nxt = ids_for(V, 2, seed=79)
    states, twins = [], []
    for p in ids:
        a, b = q4k.new_state(), q4k.new_state()
        q4k.step([a], [p])
        q4k.step([b], [p])
        states.append(a)
        twins.append(b)
    got = q4k.step(states, [[int(t)] for t in nxt])
    with temporarily(q4k, multirow=False):
        for j, b in enumerate(twins):
            alone = q4k.step([b], [[int(nxt[j])]])[0]
            assert got[j].tobytes() == alone.tobytes(), f"row {j}: batched != alone"
    assert np.isfinite(got).all()
