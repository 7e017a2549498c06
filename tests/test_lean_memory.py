"""Lean memory on the CPU reference backend (the measurements are bench/cpu_memory.py's; these are the structure).

* Opening a model materialises no weights: numpy's allocations while RefModel opens (tracemalloc: numpy reports
  its buffers to it) stay far below the file's size, the dequantised-tensor cache is empty, the long tokenizer
  arrays are not decoded, and numba is not imported until the first compiled product.
* With the decode kernels (the default) a prefill dequantises in bounded chunks (matrices, grouped projections
  and routed experts larger than one chunk are streamed): the same logits as the oracle with its whole-matrix
  cache, and a peak of numpy allocations bounded by the chunk sizes, not by the matrices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ds4py.ref import engine as ref_engine
from ds4py.ref.engine import RefModel

REPO = Path(__file__).resolve().parents[1]
IDS = [3, 17, 250, 9, 44, 1021, 7, 600, 12, 88, 5, 31]           # 12 rows: a prefill (> FUSED_MAX_ROWS)


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> str:
    """A 55 MB file whose matrices (4 MiB float32 and up) dwarf the chunks the test sets."""
    from ds4py.tiny import make_tiny

    p = str(tmp_path_factory.mktemp("lean") / "medium.gguf")
    make_tiny(p, seed=1, fast=True, dim=1024, n_layers=2, n_heads=8, vocab_size=4096, n_experts=16,
              n_experts_used=2, expert_ff=1024, q_lora_rank=256, o_lora_rank=128, o_groups=4, index_heads=4,
              index_topk=16)
    return p


def _numpy_peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_opening_materialises_no_weights(medium):
    m, peak = _numpy_peak(lambda: RefModel(medium, threads=1))
    size = os.path.getsize(medium)
    assert peak < size // 8, f"{peak / 2**20:.1f} MiB allocated while opening a {size / 2**20:.0f} MiB file"
    assert m.weights._cached == 0 and not m.weights._cache
    lazy = m.gguf._meta["tokenizer.ggml.tokens"]
    assert type(lazy).__name__ == "_LazyStrings"                  # decoded when a tokenizer asks
    assert len(m.gguf.meta("tokenizer.ggml.tokens")) == m.config.vocab_size


def test_numba_is_imported_at_the_first_compiled_product_not_at_open(medium):
    code = ("import sys; from ds4py.ref.engine import RefModel; m = RefModel(sys.argv[1], threads=1); "
            "print(m.kernels, 'numba' in sys.modules); s = m.new_state(); m.prefill(s, [1, 2]); "
            "print(m.kernels, 'numba' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DS4PY_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", code, medium], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    from ds4py.quant import jit

    if jit.available():
        assert r.stdout.split() == ["jit", "False", "jit", "True"]
    else:
        assert r.stdout.split()[::2] == ["fused", "fused"]


def test_a_lean_prefill_streams_in_chunks_and_equals_the_oracle(medium, monkeypatch):
    oracle = RefModel(medium, kernels="dequant", threads=1)          # the whole-matrix 512 MiB cache
    want, oracle_peak = _numpy_peak(lambda: oracle.prefill(oracle.new_state(), IDS))
    cache, chunk = 1 << 20, 256 << 10
    monkeypatch.setattr(ref_engine, "LEAN_CACHE_BYTES", cache)
    monkeypatch.setattr(ref_engine, "LEAN_STREAM_BYTES", chunk)
    lean = RefModel(medium, kernels="fused", threads=1)
    assert lean.weights.lean and lean.weights.cache_bytes == cache and lean.weights.stream_bytes == chunk
    got, peak = _numpy_peak(lambda: lean.prefill(lean.new_state(), IDS))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert int(got.argmax()) == int(want.argmax())
    assert lean.weights._cached <= cache
    # 370 MiB of float32 matrices cached by the oracle here, 7 MiB at the lean peak (chunks, decoder temporaries,
    # the activations): bounded by the chunk sizes, not by the matrices
    assert peak < 16 << 20 and peak * 20 < oracle_peak, (peak, oracle_peak)


def test_numba_found_at_open_but_broken_at_the_first_product_falls_back_in_one_line(medium, monkeypatch, capsys):
    from ds4py.quant import jit
    from ds4py.ref import weights

    monkeypatch.delenv("DS4PY_KERNELS", raising=False)
    monkeypatch.setattr(jit, "importable", lambda: True)
    monkeypatch.setattr(jit, "available", lambda: False)
    monkeypatch.setattr(jit, "unavailable_reason", lambda: "ImportError: llvmlite mismatch")
    monkeypatch.setattr(weights, "_NOTED", set())
    m = RefModel(medium, threads=1)
    assert m.kernels == "jit"                                  # resolved by name at open, nothing imported
    s = m.new_state()
    got = m.prefill(s, [1, 2])
    assert m.kernels == "fused" and not m.weights.runner.compiled
    err = capsys.readouterr().err
    assert err.count("numba does not import (ImportError: llvmlite mismatch)") == 1
    ref = RefModel(medium, kernels="fused", threads=1)
    np.testing.assert_array_equal(got, ref.prefill(ref.new_state(), [1, 2]))
