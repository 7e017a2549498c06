"""Every row length a format allows, on every CPU kernel path, against the dequantise-then-matmul oracle.

Real files are not multiples of 64 (head_dim 80 / 96, MoE widths of 96): the compiled F16 kernel once reshaped
its rows into blocks of 64 and crashed there. Properties over row lengths, per format:
* block formats: every multiple of the block up to 1,024, then every multiple of 256 up to 4,096;
* F16 / F32 / BF16: every length 1..300 and a few large odd ones;
* VQ-8: every multiple of its 64-weight row quantum up to 2,048 (12 and 13 bits).
Paths: the `--kernels` choices of the reference backend (ds4py.ref.weights.KERNELS): "auto" (= "jit" where numba
imports, else "fused"), "jit" (ds4py.ref.fused.Runner with the numba kernels), "fused" (the numpy kernels) and
"dequant" (ds4py.quant.dequantize + matmul, checked here against numpy's own float casts for the float formats;
for the block formats it is the oracle, bit-compared with the reference decoders' output elsewhere,
tests/test_quant.py). A kernel that cannot take a shape falls back with one stderr line, never a traceback.
End to end: a tiny model with head_dim 96 and F16 dense matrices (the shape that crashed) scores with the default
kernels as with the oracle; a head_dim-80 one (official-checkpoint conversion) too.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py import quant
from ds4py.quant import jit, vq
from ds4py.ref import fused
from ds4py.ref.fused import Runner
from ds4py.ref.weights import KERNELS, resolve_kernels
from test_fused import oracle, stored

F32 = np.float32
BLOCK_FORMATS = (Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.Q8_0, Q.MXFP4)
FLOAT_FORMATS = (Q.F16, Q.F32, Q.BF16)
PATHS = [k for k in KERNELS if k != "dequant"]           # dequant: its own test below
TOL = 1e-5                                               # relative to sum |w| |x|: float32 summation order


def lengths(qt: Q) -> list[int]:
    if qt in FLOAT_FORMATS:
        return list(range(1, 301)) + [509, 1001, 2049, 4097]
    block = quant.BLOCK[qt][0]
    step = max(block, 256)                   # beyond 1,024: every multiple of 256 (each super-block count)
    return list(range(block, 1025, block)) + list(range(1024 + step, 4097, step))


def _runner(path: str) -> Runner:
    if path in ("auto", "jit") and not jit.available():
        pytest.skip(f"numba unavailable: {jit.unavailable_reason()}")
    return Runner(threads=2, compiled=resolve_kernels(path) == "jit")


def _check(got: np.ndarray, want: np.ndarray, mag: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == F32, what
    err = (np.abs(got - want) / np.maximum(mag, 1e-30)).max()
    assert err < TOL, f"{what}: worst relative error {err:.2e}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qt", BLOCK_FORMATS + FLOAT_FORMATS, ids=lambda q: q.name)
def test_every_row_length_equals_the_oracle(qt, path, capsys):
    runner = _runner(path)
    rng = np.random.default_rng([int(qt), len(path)])
    try:
        for cols in lengths(qt):
            rows = int(rng.integers(1, 6))
            raw = stored(qt, rows, cols, rng)
            x = rng.standard_normal((2, cols)).astype(F32)
            want, mag = oracle(qt, raw, x, cols)
            _check(runner.matmul(qt, raw, x, cols), want, mag, f"{qt.name} {path} cols {cols}")
    finally:
        runner.close()
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("qt", BLOCK_FORMATS + FLOAT_FORMATS, ids=lambda q: q.name)
def test_dequant_takes_every_row_length(qt):
    rng = np.random.default_rng(int(qt))
    for cols in lengths(qt)[::3]:
        raw = stored(qt, 3, cols, rng)
        w = quant.dequantize(raw, qt, (3, cols))
        assert w.shape == (3, cols) and w.dtype == F32
        if qt in FLOAT_FORMATS:                  # an oracle independent of ds4py.quant: numpy's own casts
            want = {Q.F32: lambda: raw.view(F32),
                    Q.F16: lambda: raw.view(np.float16).astype(F32),
                    Q.BF16: lambda: (raw.view(np.uint16).astype(np.uint32) << 16).view(F32)}[qt]()
            np.testing.assert_array_equal(w, want)
        else:                                    # row r of the matrix = row r decoded alone
            np.testing.assert_array_equal(w[1], quant.dequantize(raw[1], qt, (cols,)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [12, 13])
def test_vq8_every_row_length_equals_its_decoded_matrix(bits, path):
    runner = _runner(path)
    rng = np.random.default_rng(bits)
    codebook = rng.standard_normal((1 << bits, vq.GROUP)).astype(F32)
    layer = vq.Layer(vq.Header(bits), codebook)
    try:
        for cols in range(vq.ROW_QUANTUM, 2049, vq.ROW_QUANTUM):
            rows = int(rng.integers(1, 6))
            stream, hi = vq.pack_indices(rng.integers(0, 1 << bits, size=(rows, cols // vq.GROUP)), bits)
            gains = rng.uniform(0.5, 2, rows).astype(F32)
            x = rng.standard_normal((2, cols)).astype(F32)
            w = vq.decode_rows(stream, hi, gains, codebook, bits).astype(np.float64)
            want, mag = x.astype(np.float64) @ w.T, np.abs(x.astype(np.float64)) @ np.abs(w).T
            _check(runner.vq_matmul(stream, hi, gains, layer, x), want, mag, f"VQ-{bits} {path} cols {cols}")
    finally:
        runner.close()


def test_a_shape_the_compiled_kernel_cannot_take_falls_back_with_one_line(monkeypatch, capsys):
    """A row length outside a kernel's reach (made so here: Q8_0 kernel declared for multiples of 64) runs the
    numpy kernels for that matrix, with one stderr line per shape, and the same answer."""
    if not jit.available():
        pytest.skip(f"numba unavailable: {jit.unavailable_reason()}")
    monkeypatch.setitem(jit._ROW_MULTIPLE, int(Q.Q8_0), 64)
    monkeypatch.setattr(fused, "_FELL_BACK", set())
    rng = np.random.default_rng(7)
    raw = stored(Q.Q8_0, 4, 96, rng)
    x = rng.standard_normal((1, 96)).astype(F32)
    want, mag = oracle(Q.Q8_0, raw, x, 96)
    runner = Runner(threads=1, compiled=True)
    for _ in range(3):
        _check(runner.matmul(Q.Q8_0, raw, x, 96), want, mag, "Q8_0 fallback")
    err = capsys.readouterr().err
    assert err.count("do not take Q8_0 rows of 96 weights") == 1 and "Traceback" not in err
    with pytest.raises(ValueError, match="does not take rows of 96"):        # the kernel itself refuses cleanly
        jit.matmul(Q.Q8_0, raw, x, 1)


def _logits(path: str, kernels: str, ids: list[int]) -> np.ndarray:
    from ds4py.ref.engine import RefModel

    m = RefModel(path, kernels=kernels, threads=2)
    st = m.new_state()
    out = [m.prefill(st, ids[:3])] + [m.decode(st, t) for t in ids[3:]]
    return np.stack(out)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_a_model_with_head_dim_not_a_multiple_of_64_decodes_like_the_oracle(golden, head_dim, tmp_path, monkeypatch):
    """An official-layout checkpoint converted with F16 dense matrices (rows of head_dim and heads x head_dim
    weights: the shape that crashed): the golden v4-tiny-mtp (head_dim 96) and a random one of head_dim 80.
    Every kernel path decodes like the oracle."""
    from ds4py.convert import convert_checkpoint
    from test_convert import synthetic_checkpoint

    monkeypatch.delenv("DS4PY_KERNELS", raising=False)
    if head_dim == 96:
        src = golden / "v4-tiny-mtp"
    else:
        src, _ = synthetic_checkpoint(golden, tmp_path / "ckpt", head_dim=head_dim, rope_head_dim=16, n_layers=3,
                                      compress_ratios=[0, 4, 128])
    p = str(tmp_path / f"hd{head_dim}.gguf")
    convert_checkpoint(str(src), p, dense="f16", progress=False)
    ids = [1, 5, 9, 2, 4, 8]
    want = _logits(p, "dequant", ids)
    assert np.isfinite(want).all()
    for kernels in PATHS:
        if kernels in ("auto", "jit") and not jit.available():
            continue
        got = _logits(p, kernels, ids)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), kernels
        assert (got.argmax(-1) == want.argmax(-1)).all(), kernels
