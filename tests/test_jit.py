"""The compiled CPU kernels (ds4py.quant.jit, numba) against the dequantise-then-matmul oracle.

Every format they cover, on random rows: equal to `dequantize` + matmul up to float32 summation order (also
re-run under a second OpenBLAS kernel, tests/test_blas_kernels.py), inf / NaN scales included; each output row
bit-identical whatever the other rows of x and the thread count (row stability, batch invariance); VQ-8 rows;
a decoded model (kernels="auto" = the compiled path) equal to the oracle at float32 noise, a batched step equal
to separate steps bit for bit; auto without numba falls back to the numpy kernels in one line, an explicit jit
is refused; the first compile says so and a second process reuses the disk cache.
Each test compiles only the kernels it needs (a few seconds each, once per cache folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py.quant import jit, vq

pytestmark = pytest.mark.skipif(not jit.available(), reason=f"numba unavailable: {jit.unavailable_reason()}")

F32 = np.float32
COLS = 512
REPO = Path(__file__).resolve().parents[1]


def _stored_and_oracle():
    from test_fused import oracle, stored

    return stored, oracle


@pytest.mark.parametrize("qt", jit.FORMATS, ids=lambda q: q.name)
def test_every_format_equals_the_dequantised_matrix(qt):
    stored, oracle = _stored_and_oracle()
    rng = np.random.default_rng([int(qt), 29])
    raw = stored(qt, 40, COLS, rng)
    x = rng.standard_normal((3, COLS)).astype(F32)
    want, mag = oracle(qt, raw, x, COLS)
    got = jit.matmul(qt, raw, x, 2)
    assert got.shape == (3, 40) and got.dtype == F32
    err = np.abs(got - want) / mag
    assert err.max() < 1e-5, f"{qt.name}: worst relative error {err.max():.2e}"
    assert np.abs(want).max() > 100 * 1e-5 * mag.max()          # a wrong sign or scale is far outside that


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K], ids=lambda q: q.name)
def test_a_row_is_the_same_alone_in_any_batch_and_on_any_thread_count(qt):
    stored, _ = _stored_and_oracle()
    rng = np.random.default_rng(int(qt))
    raw = stored(qt, 37, COLS, rng)                               # 37 rows: uneven thread splits
    x = rng.standard_normal((5, COLS)).astype(F32)
    batch = jit.matmul(qt, raw, x, 2)
    for t in range(5):
        np.testing.assert_array_equal(jit.matmul(qt, raw, x[t:t + 1], 1)[0], batch[t])
    np.testing.assert_array_equal(jit.matmul(qt, raw, x, 3), batch)
    np.testing.assert_array_equal(jit.matmul(qt, raw[5:9], x, 2), batch[:, 5:9])   # other rows of W neither


def test_inf_and_nan_scales_make_the_same_rows_non_finite():
    stored, oracle = _stored_and_oracle()
    rng = np.random.default_rng(3)
    raw = stored(Q.Q8_0, 8, COLS, rng)
    h = raw.reshape(-1).view(np.uint16)
    h[0] = 0x7C00                                   # row 0: +inf scale
    h[raw.shape[1] // 2 * 3] = 0x7E00               # row 3: NaN scale
    x = rng.standard_normal((1, COLS)).astype(F32)
    with np.errstate(all="ignore"):
        want, _ = oracle(Q.Q8_0, raw, x, COLS)
        got = jit.matmul(Q.Q8_0, raw, x, 1)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    ok = np.isfinite(want)
    assert np.allclose(got[ok], want[ok], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [12, 13])
def test_vq8_rows_equal_their_decoded_matrix(bits):
    rng = np.random.default_rng(bits)
    rows, cols = 24, 256
    idx = rng.integers(0, 1 << bits, size=(rows, cols // vq.GROUP))
    stream, hi = vq.pack_indices(idx, bits)
    codebook = rng.standard_normal((1 << bits, vq.GROUP)).astype(F32)
    gains = rng.uniform(0.5, 2, rows).astype(F32)
    x = rng.standard_normal((2, cols)).astype(F32)
    w = vq.decode_rows(stream, hi, gains, codebook, bits).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    got = jit.vq_matmul(stream, hi, gains, codebook, bits, x, 2)
    assert (np.abs(got - want) / (np.abs(x) @ np.abs(w).T)).max() < 1e-5
    np.testing.assert_array_equal(jit.vq_matmul(stream, hi, gains, codebook, bits, x[1:], 1)[0], got[1])


@pytest.fixture(scope="module")
def tiny_iq2(tmp_path_factory) -> str:
    from ds4py.tiny import make_tiny

    p = tmp_path_factory.mktemp("jit") / "tiny-iq2.gguf"
    make_tiny(str(p), seed=5)
    return str(p)


def test_the_default_decodes_with_compiled_kernels_like_the_oracle_and_batches_invariantly(tiny_iq2, monkeypatch):
    """Default kernels (auto: compiled here) vs dequant: decode logits at float32 noise, same argmax; a step of
    two sequences equals each stepped alone, bit for bit."""
    from ds4py.ref.engine import RefModel

    monkeypatch.delenv("DS4PY_KERNELS", raising=False)
    ref, fast = RefModel(tiny_iq2, kernels="dequant"), RefModel(tiny_iq2, threads=2)
    assert fast.kernels == "jit" and "compiled" in fast.kernels_label and ref.kernels_label.startswith("oracle")
    sr, sf = ref.new_state(), fast.new_state()
    lr, lf = ref.prefill(sr, [1, 5, 9, 2]), fast.prefill(sf, [1, 5, 9, 2])
    for tok in (4, 8, 6):
        lr, lf = ref.decode(sr, tok), fast.decode(sf, tok)
        assert np.abs(lf - lr).max() <= 1e-4 * np.abs(lr).max()
        assert int(np.argmax(lf)) == int(np.argmax(lr))
    a, b = fast.new_state(), fast.new_state()
    fast.prefill(a, [3, 1]), fast.prefill(b, [7, 7, 2])
    a1, b1 = a.copy(), b.copy()
    both = fast.step([a, b], [[4], [5]])
    np.testing.assert_array_equal(both[0], fast.step([a1], [[4]])[0])
    np.testing.assert_array_equal(both[1], fast.step([b1], [[5]])[0])


def test_auto_without_numba_runs_the_numpy_kernels_and_says_so_once(tiny_iq2, monkeypatch, capsys):
    from ds4py.errors import Ds4Error
    from ds4py.ref import weights
    from ds4py.ref.engine import RefModel

    monkeypatch.setattr(jit, "_state", {"error": "ModuleNotFoundError: No module named 'numba'"})
    monkeypatch.setattr(weights, "_NOTED", set())
    m = RefModel(tiny_iq2, kernels="auto", threads=1)
    RefModel(tiny_iq2, kernels="auto", threads=1)
    assert m.kernels == "fused" and m.kernels_label.startswith("numpy fused")
    err = capsys.readouterr().err
    assert err.count("numba does not import") == 1 and "numpy fused kernels" in err
    with pytest.raises(Ds4Error, match="--kernels jit needs numba"):
        RefModel(tiny_iq2, kernels="jit")


def test_a_first_compile_says_so_and_the_next_process_reuses_the_cache(tmp_path):
    code = ("import numpy as np; from gguf import GGMLQuantizationType as Q; from ds4py.quant import jit; "
            "raw = np.zeros((4, 17), np.uint8); "
            "print(jit.matmul(Q.MXFP4, raw, np.ones((1, 32), np.float32), 1).sum()); "
            "s = jit._state['mod'].mxfp4.stats; print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "compiling the CPU kernel mxfp4" in first.stderr and str(tmp_path / "cache") in first.stderr
    assert first.stdout.split()[1:] == ["0", "1"]                # compiled: one cache miss
    assert any((tmp_path / "cache").rglob("*.nbi"))              # numba's cache index, on disk
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[1:] == ["1", "0"]                # loaded from the disk cache, not compiled


def test_the_default_cache_folder_changes_with_any_kernel_source(tmp_path, monkeypatch):
    """numba checks only a kernel's own file: the default cache folder is keyed on every source it inlines from."""
    import shutil

    from ds4py.quant import jit

    src = Path(jit.__file__).parent
    for name in jit._KERNEL_SOURCES:
        shutil.copy(src / name, tmp_path / name)
    assert jit.source_tag(tmp_path) == jit.source_tag()
    before = jit.source_tag(tmp_path)
    (tmp_path / "jit_i8_kernels.py").write_text((src / "jit_i8_kernels.py").read_text() + "\n# an edit\n")
    assert jit.source_tag(tmp_path) != before
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert jit.cache_dir().endswith(str(Path("ds4py") / "numba" / jit.source_tag()))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert jit.cache_dir() == str(tmp_path / "mine")
