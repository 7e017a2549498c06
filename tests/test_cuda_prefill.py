"""Prefill on the CUDA engine (ds4py/cuda/prefill.py: a block of up to 2,048 tokens as one launch sequence) on the
CPU emulator, against the numpy reference:

- the golden v4-tiny over 130 positions in two blocks (the window ring wraps inside a block, the indexer keeps 8 of
  up to 32 compressed rows, the first ratio-128 row is emitted at 127 and attended after) and ds4-tiny in two
  blocks; synthetic models of two more shapes (other ratios, head dims, window sizes, expert formats) written as
  GGUFs the reference runs: every position's logits (top-1 >= 97%, logits within the scaled tolerance), then
  decode after the prefill;
- the products on tensor cores (the default: cu/gemm.cu with x as three bf16 pieces, exact) and on the GEMVs,
  and the experts on tensor cores (cu/moe_prefill.cu, bf16 x and h: a looser tolerance);
- the state after a prefill equals the state after the same tokens fed one at a time (counters exactly, rings and
  rows within fp32 rounding), and decoding continues the same from both; truncate, save / load after a prefill.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuda_engine_checks import check, compare, ids_for, run
from ds4py.cuda import emu

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")

SHAPE_A = dict(n_layers=3, dim=256, vocab_size=280, n_heads=4, head_dim=96, rope_dim=32, q_lora_rank=64,
               o_groups=2, o_lora_rank=64, n_experts=4, n_experts_used=2, expert_ff=256, index_heads=4,
               index_head_dim=64, index_topk=4, window=8, hash_layers=1, compress_ratios=[0, 4, 4])
SHAPE_B = dict(n_layers=4, dim=256, vocab_size=300, n_heads=8, head_dim=128, rope_dim=64, q_lora_rank=64,
               o_groups=2, o_lora_rank=64, n_experts=6, n_experts_used=3, expert_ff=256, index_heads=8,
               index_head_dim=64, index_topk=3, window=16, hash_layers=1, compress_ratios=[4, 0, 128, 4])


def synthetic(tmp_path, shape: dict, experts: str, seed: int):
    """A synthetic CudaModel on the emulator and the reference on the same weights (written as a GGUF)."""
    from gguf import GGMLQuantizationType as QT

    from ds4py import schema
    from ds4py.convert import OutTensor, gguf_metadata, write_gguf
    from ds4py.cuda import synth
    from ds4py.cuda.engine import CudaModel
    from ds4py.ref.engine import RefModel
    from ds4py.tiny import tiny_shape, tiny_tokenizer

    cfg = tiny_shape(**shape)
    kinds = synth.Q2_EXPERTS if experts == "q2" else (QT.MXFP4, QT.MXFP4)
    m = CudaModel.synthetic(cfg, seed=seed, experts=kinds, emulate=True)
    host = synth.to_host(m.w, cfg)
    tensors = [OutTensor(e.name, e.shape, host[e.name][0], (lambda a=host[e.name][1]: a)) for e in schema.entries(cfg)]
    path = str(tmp_path / f"synthetic-{seed}.gguf")
    write_gguf(path, "synthetic", gguf_metadata(cfg), tiny_tokenizer(cfg.vocab_size), tensors, progress=False)
    return m, RefModel(path, kernels="dequant")


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("prefill-a"), SHAPE_A, "q2", 5)


def test_v4_tiny_prefill_in_two_blocks_matches_the_reference(v4_gguf):
    """Without the fake quantisers: a backend's other summation order can move an FP8 / FP4 value to the
    neighbouring grid point, and a flipped compressed row shifts every later position's logits by ~1e-4 (the
    fake-quant numerics are checked over 96 + 40 positions in tests/test_cuda_engine.py)."""
    from ds4py.model import Numerics, open_model
    from ds4py.ref.engine import RefModel

    nx = Numerics(fake_quant=False)
    m, ref = open_model(v4_gguf, backend="cuda-emu", numerics=nx), RefModel(v4_gguf, numerics=nx, kernels="dequant")
    m.options = m.options.but(prefill_block=72)
    ids = ids_for(256, 132, seed=21)
    check(compare(run(m, ids, 130), run(ref, ids, 130)), "v4-tiny prefill 130 in blocks of 72, decode 2")


def test_ds4_tiny_prefill_in_two_blocks_matches_the_reference(golden):
    from ds4py.model import open_model
    from ds4py.ref.engine import RefModel

    path = str(golden / "ds4-tiny" / "tiny.gguf")
    m, ref = open_model(path, backend="cuda-emu"), RefModel(path, kernels="dequant")
    m.options = m.options.but(prefill_block=9, prefill_mma=False)   # the GEMV products (the emulated GEMM is slow)
    ids = ids_for(512, 19, seed=4)
    check(compare(run(m, ids, 18), run(ref, ids, 18)), "ds4-tiny prefill 18 in blocks of 9, decode 1")


def test_synthetic_shape_a_matches_the_reference(model_a):
    m, ref = model_a
    ids = ids_for(m.config.vocab_size, 44, seed=2)
    check(compare(run(m, ids, 40), run(ref, ids, 40)), "synthetic A (window 8, ratios 0/4/4, Q2 experts)")


def test_synthetic_shape_b_matches_the_reference(tmp_path):
    """The GEMV products (prefill_mma off), then the tensor-core experts (bf16 x and h: a looser tolerance)."""
    m, ref = synthetic(tmp_path, SHAPE_B, "mxfp4", 9)
    m.options = m.options.but(prefill_block=20, prefill_mma=False)
    ids = ids_for(m.config.vocab_size, 38, seed=3)
    want = run(ref, ids, 36)
    check(compare(run(m, ids, 36), want), "synthetic B (window 16, ratios 4/0/128/4, MXFP4, 2 blocks, GEMVs)")
    m.options = m.options.but(prefill_mma=True, prefill_expert_mma=True)
    a = compare(run(m, ids, 36), want)
    print(f"synthetic B, experts on tensor cores: {a}")
    assert a.top1 >= 0.9 and a.median_rel <= 2e-2, a


def test_state_after_a_prefill_equals_single_steps(model_a):
    """Counters exactly; every ring slot and every emitted row within fp32 rounding of the single-step state (the
    blob holds the same parts); the next decode steps agree."""
    m, _ = model_a
    ids = ids_for(m.config.vocab_size, 32, seed=6)
    a, b = m.new_state(), m.new_state()
    m.step([a], [ids[:30]])                               # longer than the window ring (8 + 16 slots)
    for t in ids[:30]:
        m.step([b], [[int(t)]])
    assert (a.n_tokens, a.n_written) == (b.n_tokens, b.n_written) == (30, 30)
    ea, eb = a.export(), b.export()
    assert ea.keys() == eb.keys()
    for key in ea:
        assert ea[key].shape == eb[key].shape, key
        scale = max(1.0, float(np.abs(eb[key]).max()))
        np.testing.assert_allclose(ea[key], eb[key], rtol=0, atol=1e-4 * scale, err_msg=key)
    for t in ids[30:]:
        la, lb = m.step([a], [[int(t)]])[0], m.step([b], [[int(t)]])[0]
        assert la.argmax() == lb.argmax()
        assert np.abs(la - lb).max() <= 1e-4 * np.abs(lb).max()


def test_truncate_and_save_load_after_a_prefill(model_a):
    m, ref = model_a
    ids = ids_for(m.config.vocab_size, 40, seed=8)
    s = m.new_state()
    m.step([s], [ids[:36]])
    blob = m.save_state(s)
    ahead = m.step([s], [ids[36:40]], all_logits=True)[0]
    s.truncate(30)                                        # back past the prefill's end, above the rollback floor
    again = m.step([s], [ids[30:40]], all_logits=True)[0]
    # positions 30..35 fed again by the rows path (the decode kernels) instead of the prefill: fp32 rounding apart
    check(compare(again[-4:], ahead), "synthetic A: rows after a truncation into the prefill")
    loaded = m.load_state(blob)
    np.testing.assert_array_equal(m.step([loaded], [ids[36:40]], all_logits=True)[0], ahead)
    loaded = m.load_state(blob)                           # the prefilled device state runs in the reference
    r = ref._import(loaded.n_tokens, loaded.n_written, loaded.export())
    want = ref.step([r], [ids[36:40]], all_logits=True)[0]
    check(compare(ahead, want), "synthetic A: reference decoding from the CUDA prefill's state")


def test_bench_prefill_rows(model_a):
    """bench's prefill rows (`bench --prefill-sizes`): a fresh prompt per size in one step, tokens/s; a size beyond
    the context is skipped with its reason; 'auto' off the GPU says in one line why there are none."""
    from ds4py import bench
    from ds4py.errors import Ds4Error

    from types import SimpleNamespace

    from ds4py.model import Capabilities

    def backend(name, **caps):
        return SimpleNamespace(backend=name, capabilities=Capabilities(**caps))
    gpu = backend("cuda", block_prefill=True)
    assert bench.prefill_sizes("auto", gpu) == (bench.PREFILL_SIZES, None)
    for other in (backend("ref"), backend("cuda-emu", block_prefill=True, emulated=True)):
        sizes, note = bench.prefill_sizes("auto", other)
        assert sizes == () and note.startswith("prefill rows skipped") and "\n" not in note
    assert bench.prefill_sizes("20,30", backend("ref")) == ((20, 30), None)
    assert bench.prefill_sizes("none", gpu) == ((), None)
    with pytest.raises(Ds4Error, match="prefill-sizes"):
        bench.prefill_sizes("2k", gpu)
    m, _ = model_a
    assert bench.prefill_sizes("auto", m)[0] == ()           # the emulator: skipped
    seen = []
    rows = bench.prefill_rates(m, list(range(2, 40)), [18, 2 ** 21], progress=seen.append)
    assert rows[0]["tokens"] == 18 and rows[0]["tokens_per_s"] > 0 and rows[0]["seconds"] > 0
    assert rows[1] == {"tokens": 2 ** 21, "skipped": f"{2 ** 21} tokens exceed the context length "
                                                     f"{m.config.context_length}"}
    assert seen[0].startswith("prefill 18: ") and "| 18 |" in bench.format_prefill(rows)


def test_the_prefill_bench_runs_on_the_emulator(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "cuda_prefill.json"
    r = subprocess.run([sys.executable, "bench/cuda_prefill.py", "--emu", "--sizes", "18", "--json", str(out)],
                       cwd=repo, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["emulated"] and set(res["modes"]) == {"dense_mma", "dense+experts_mma"}
    assert all(rows[0]["tokens"] == 18 and rows[0]["tokens_per_s"] > 0 for rows in res["modes"].values())
