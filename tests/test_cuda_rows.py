"""Multi-row steps of the CUDA engine on the CPU emulator, v4-tiny (dense F32, MXFP4
experts; window 16, ratio-4 layers with the indexer, ratio-128 layers):

- several sequences decoding one token each in one `model.step`: each row's logits bit-identical to the same
  sequence stepped alone, and agreeing with the numpy reference (same top-1, fp32 noise);
- a chunk of 1 + k rows of one sequence (a speculative verify, all_logits) beside another sequence's row:
  bit-identical to position-by-position steps, the state left exactly where they leave it;
- graph replay = direct launches; fewer kernel launches than R single steps; the weight bytes per step.

tests/gpu/test_gpu_rows.py runs the bit-identity checks on a GPU. Budget: ~0.15 s of emulator per row.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuda_engine_checks import ids_for
from ds4py.cuda import emu
from ds4py.cuda.graph_cache import ROWS_STEP
from ds4py.cuda.layer import ROWS
from ds4py.cuda.options import temporarily
from test_cuda_driverless import rt, standin  # noqa: F401 (fixtures)
from ds4py.cuda.rows import MAX_ROWS, weight_bytes_per_step
from ds4py.model import open_model
from ds4py.ref.engine import RefModel

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")


@pytest.fixture(scope="module")
def v4(v4_gguf):
    return open_model(v4_gguf, backend="cuda-emu")


def _single(model, st, ids) -> np.ndarray:
    """Logits of each id fed one step at a time (the single-row decode graph)."""
    with temporarily(model, multirow=False):
        return np.stack([model.step([st], [[int(t)]])[0] for t in ids])


def _prompts(model, lengths, seed):
    """One state per prompt length, prefilled position by position, and a twin state with the same history."""
    V = model.config.vocab_size
    out = []
    for j, n in enumerate(lengths):
        ids = ids_for(V, n, seed=seed + j)
        a, b = model.new_state(), model.new_state()
        _single(model, a, ids)
        _single(model, b, ids)
        out.append((ids, a, b))
    return out


def test_batched_sequences_are_bit_identical_to_single_steps_and_match_the_reference(v4, v4_gguf):
    V = v4.config.vocab_size
    seqs = _prompts(v4, [5, 14, 2], seed=40)
    nxt = [ids_for(V, 3, seed=50 + j) for j in range(3)]
    ref = RefModel(v4_gguf, kernels="dequant")
    ref_states = []
    for ids, _, _ in seqs:
        rs = ref.new_state()
        ref.step([rs], [ids])
        ref_states.append(rs)
    for t in range(3):
        states = [a for _, a, _ in seqs]
        got = v4.step(states, [[int(n[t])] for n in nxt])
        for j, (_, a, b) in enumerate(seqs):
            alone = _single(v4, b, [nxt[j][t]])[0]
            assert got[j].tobytes() == alone.tobytes(), f"step {t} row {j}: batched != alone"
            assert a.n_tokens == b.n_tokens
            want = ref.step([ref_states[j]], [[int(nxt[j][t])]])[0]
            assert got[j].argmax() == want.argmax(), f"step {t} row {j}: top-1 differs from the reference"
            assert np.abs(got[j] - want).max() <= 1e-3 * np.abs(want).max(), f"step {t} row {j}: beyond fp32 noise"


def test_verify_chunk_beside_another_row_is_bit_identical(v4):
    V = v4.config.vocab_size
    (ids_a, a, a2), (ids_b, b, b2) = _prompts(v4, [9, 4], seed=60)
    draft, other = ids_for(V, 5, seed=61), ids_for(V, 1, seed=62)
    got_a, got_b = v4.step([a, b], [draft, other], all_logits=True)
    assert got_a.shape == (5, V) and got_b.shape == (1, V)
    assert got_a.tobytes() == _single(v4, a2, draft).tobytes(), "verify rows != position-by-position steps"
    assert got_b.tobytes() == _single(v4, b2, other).tobytes()
    assert (a.n_tokens, a.n_written) == (a2.n_tokens, a2.n_written)
    # after a rejected draft suffix: truncate, then decode on - still exact
    a.truncate(a.n_tokens - 3)
    a2.truncate(a2.n_tokens - 3)
    nxt = ids_for(V, 2, seed=63)
    assert v4.step([a], [nxt])[0].tobytes() == _single(v4, a2, nxt)[-1].tobytes()
    assert np.array_equal(v4._export(a)["2.win"], v4._export(a2)["2.win"])


def test_rows_graph_replay_equals_direct_launches_and_launches_fewer_kernels(v4_gguf):
    m = open_model(v4_gguf, backend="cuda-emu")
    d = open_model(v4_gguf, backend="cuda-emu", graphs=False, pdl=False)
    V = m.config.vocab_size
    outs = []
    for model in (m, d):
        sts = [model.new_state() for _ in range(3)]
        rows = [ids_for(V, 1, seed=70 + j) for j in range(3)]
        outs.append([model.step(sts, rows), model.step(sts, [ids_for(V, 1, seed=80 + j) for j in range(3)])])
    for x, y in zip(outs[0], outs[1]):
        assert all(p.tobytes() == q.tobytes() for p, q in zip(x, y))
    one = m.launches_per_step()
    for R in (1, 8):
        n = m.launches_per_rows_step(R)["total"]
        print(f"launches: {R} rows in one step {n}, {R} single steps {R * one['total']}")
        if R == 8:
            assert n < R * one["total"]
    b1, b8 = weight_bytes_per_step(m, 1), weight_bytes_per_step(m, 8)
    print(f"weight bytes per step: 1 row {b1}, 8 rows {b8}")
    assert b1["total"] == m.weight_bytes_per_token()
    assert b8["dense"] == b1["dense"] and b8["total"] < 8 * b1["total"]


def test_rows_crossing_a_context_bucket_recapture_and_stay_exact(v4_gguf):
    """Small buckets (8, 16, ...): rows steps cross them, the rows workspace grows (its old graphs dropped), and
    every row still equals its state's single steps, whose graphs grow the same way."""
    m = open_model(v4_gguf, backend="cuda-emu")
    m.options = m.options.but(min_bucket=8)
    V = m.config.vocab_size
    (_, a, a2), (_, b, b2) = _prompts(m, [5, 3], seed=95)
    versions = set()
    for t in range(6):
        ta, tb = ids_for(V, 1, seed=100 + t), ids_for(V, 1, seed=200 + t)
        got = m.step([a, b], [ta, tb])
        versions.add(m.runner.pool.get(ROWS).version)
        assert got[0].tobytes() == _single(m, a2, ta)[0].tobytes(), f"step {t}: row a"
        assert got[1].tobytes() == _single(m, b2, tb)[0].tobytes(), f"step {t}: row b"
    assert len(versions) == 2 and m.runner.pool.get(ROWS).bucket == 16 and m.runner.cache.count(ROWS_STEP) == 2


def test_long_chunks_and_many_rows_take_the_single_row_path(v4):
    """More rows than MAX_ROWS (a prompt) are stepped position by position: no multi-row graph is made."""
    before = v4.runner.cache.count(ROWS_STEP)
    st = v4.new_state()
    v4.step([st], [ids_for(v4.config.vocab_size, MAX_ROWS + 1, seed=90)])
    assert v4.runner.cache.count(ROWS_STEP) == before and st.n_tokens == MAX_ROWS + 1


def test_full_size_rows_step_on_the_stand_in_driver(rt, standin):  # noqa: F811
    """V4 Flash's 43 layers at real shapes on the stand-in driver: a step of 8 sequences is launched directly the
    first time, then captured with no host synchronisation inside the capture; launches and weight bytes per step for 1, 8 and 16 rows (printed)."""
    from test_cuda_engine_standin import SYNC_CALLS, captures

    from ds4py.config import ModelConfig
    from ds4py.cuda.engine import CudaModel

    cfg = ModelConfig.v4_flash(n_layers=43, dim=4096, vocab_size=129280, n_heads=64,
                               compress_ratios=[0, 0] + [4, 128] * 20 + [4])
    m = CudaModel.synthetic(cfg, runtime=rt)
    sts = [m.new_state() for _ in range(8)]
    before = len(captures(standin))
    m.step(sts, [[1]] * 8)
    assert len(captures(standin)) == before                 # a row set's first step: direct launches
    m.step(sts, [[1]] * 8)
    new = captures(standin)[before:]
    assert len(new) == 1 and not SYNC_CALLS & set(new[0])   # seen again: captured
    one = m.launches_per_step(sts[0])["total"]
    n = m.runner.rows_run([(st, st.n_tokens, 1) for st in sts])[0].count()[0]
    print(f"V4 Flash 8 rows: {n} launches per step (8 single steps: {8 * one})")
    assert n < 8 * one / 2
    for R in (1, 8, 16):
        b = weight_bytes_per_step(m, R)
        print(f"V4 Flash {R} rows: weights read {b['total'] / 1e9:.2f} GB per step ({R} single steps: "
              f"{R * m.weight_bytes_per_token() / 1e9:.2f} GB): {b}")
    assert weight_bytes_per_step(m, 1)["total"] == m.weight_bytes_per_token()
    assert weight_bytes_per_step(m, 8)["dense"] == weight_bytes_per_step(m, 1)["dense"]
