"""The int8-activation kernels (ds4py.quant.jit_i8) against the reference's int8-activation mode.

The reference's act_quant mode rounds x as ggml does (ds4py.ref.ops.q8_0_round / q8_k_round) and multiplies the
rounded x with the dequantised matrix in float; the int8 kernels quantise x to the same codes and scales and sum
exact integer products per block. So the two agree up to float32 rounding of the per-block scale products
(relative to sum |x| |W|: < 1e-5), over every row length of each format up to a few thousand columns; the
quantisers give bit-identical codes; and against the fp32 `dequant` oracle on the unrounded x the error stays
within the activation rounding's own bound (8-bit codes: < 1e-2 of sum |x| |W|). A row is the same bits alone,
in any batch and on any thread count. The integer dot product compiles to a SIMD multiply-add (vpmaddwd or
vpdpwssd on x86, an sdot / smlal family instruction on aarch64).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py.quant import jit, jit_i8
from ds4py.ref.ops import q8_0_round, q8_k_round

pytestmark = pytest.mark.skipif(not jit.available(), reason=f"numba unavailable: {jit.unavailable_reason()}")

F32 = np.float32
BLOCK = {Q.Q8_0: 32, Q.MXFP4: 32, Q.Q2_K: 256, Q.Q4_K: 256, Q.IQ2_XXS: 256}


def _fixtures():
    from test_fused import oracle, stored

    return stored, oracle


def _rounded(qt, x):
    return q8_0_round(x) if qt in jit_i8.Q8_0_ACT else q8_k_round(x)


def _lengths(qt):
    """Every multiple of the block up to 1,024 columns, then a few longer ones up to 4,096 (odd block counts)."""
    b = BLOCK[qt]
    return sorted({*range(b, 1025, b), 17 * b if b == 32 else 9 * b, 4096 + (b if b == 32 else 0),
                   3 * 256 * 5 if b == 256 else 32 * 99})


@pytest.mark.parametrize("tokens", [2, jit_i8.DECODE_ROWS + 1], ids=["decode", "prefill"])
@pytest.mark.parametrize("qt", jit_i8.FORMATS, ids=lambda q: q.name)
def test_equals_the_act_quant_reference_at_every_row_length(qt, tokens):
    """Both kernel families: the decode kernels (vector IR, ds4py.quant.jit_decode) up to DECODE_ROWS tokens,
    the block-buffer kernels above."""
    stored, oracle = _fixtures()
    for cols in _lengths(qt):
        rng = np.random.default_rng([int(qt), cols])
        raw = stored(qt, 9, cols, rng)
        x = (rng.standard_normal((tokens, cols)) * rng.uniform(0.1, 10, (tokens, 1))).astype(F32)
        want, mag = oracle(qt, raw, _rounded(qt, x), cols)
        got = jit_i8.matmul(qt, raw, x, 2)
        assert got.shape == (tokens, 9) and got.dtype == F32
        err = np.abs(got - want) / mag
        assert err.max() < 1e-5, f"{qt.name} cols={cols}: worst relative error {err.max():.2e}"
        loose, _ = oracle(qt, raw, x, cols)                      # the fp32 oracle on the unrounded activation
        assert (np.abs(got - loose) / mag).max() < 1e-2, f"{qt.name} cols={cols}: off the fp32 oracle"
        assert np.abs(want - loose).max() > 0                     # the activation rounding is really there


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K], ids=lambda q: q.name)
def test_a_row_is_the_same_alone_in_any_batch_and_on_any_thread_count(qt):
    stored, _ = _fixtures()
    rng = np.random.default_rng(int(qt))
    raw = stored(qt, 37, 512, rng)                              # 37 rows: uneven thread splits
    x = rng.standard_normal((5, 512)).astype(F32)
    batch = jit_i8.matmul(qt, raw, x, 2)
    for t in range(5):
        np.testing.assert_array_equal(jit_i8.matmul(qt, raw, x[t:t + 1], 1)[0], batch[t])


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K, Q.F16], ids=lambda q: q.name)
def test_the_pool_pieces_give_the_serial_bits(qt, monkeypatch):
    """Every product on numba's pool (the parallel decode kernels hand out CHUNKS_PER_THREAD row pieces a thread
    from an atomic counter): the same bits as the serial kernel, for row counts below, at and above the piece
    count, and more threads asked than the pool has."""
    from ds4py.quant import jit

    stored, _ = _fixtures()
    rng = np.random.default_rng(int(qt) + 11)
    cols = 512
    for rows in (1, 2, 15, 16, 37, 131):
        raw = (stored(qt, rows, cols, rng) if qt != Q.F16
               else rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8))
        x = rng.standard_normal((2, cols)).astype(F32)
        mm = jit_i8.matmul if qt != Q.F16 else jit.matmul
        monkeypatch.setattr(jit, "SERIAL_BYTES", 1 << 60)
        serial = [mm(qt, raw, x[t:t + 1], 1) for t in range(2)]
        monkeypatch.setattr(jit, "SERIAL_BYTES", 0)
        for threads in (2, 3):
            for t in range(2):
                np.testing.assert_array_equal(mm(qt, raw, x[t:t + 1], threads), serial[t], err_msg=f"{rows} rows")


@pytest.mark.parametrize("qt", [Q.IQ2_XXS, Q.Q2_K], ids=lambda q: q.name)
def test_the_decode_kernels_give_the_block_buffer_kernels_bits(qt, monkeypatch):
    """IQ2_XXS / Q2_K: the same exact integer block sums and float sequence, so a row is the same bits whichever
    family a step's token count picks (a decode step, a verify step, a prefill)."""
    stored, _ = _fixtures()
    rng = np.random.default_rng(int(qt) + 7)
    raw = stored(qt, 29, 1280, rng)
    x = (rng.standard_normal((jit_i8.DECODE_ROWS + 3, 1280)) * 4).astype(F32)
    x[0, :256] = 0                                                # a zero activation block
    decode = np.concatenate([jit_i8.matmul(qt, raw, x[t:t + 1], 2) for t in range(len(x))])
    monkeypatch.setattr(jit_i8, "DECODE_ROWS", 0)
    np.testing.assert_array_equal(decode, jit_i8.matmul(qt, raw, x, 2))


def test_the_quantisers_give_the_reference_rounding_bit_for_bit():
    """The compiled quantisers (jit_decode) and numpy's give the same codes, scales and sums, and those are the
    reference's rounding; a non-finite activation takes numpy's path."""
    jit_i8._kernels()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 1024)) * np.array([[1e-3], [1], [50], [0]])).astype(F32)
    x[1, :256] = 0                                                # an all-zero block: scale 0, codes 0
    x[2, 256:512] = np.round(x[2, 256:512] * 2) / 2               # ties in the codes (rint: half to even)
    x[2, 300] = -x[2, 256:512].__abs__().max()                   # two values of largest magnitude, signs differ
    for y in (x, np.where(np.arange(1024) == 5, np.nan, x).astype(F32)):
        for fast, slow in ((jit_i8.quant_q8_0, jit_i8._quant_q8_0_numpy), (jit_i8.quant_q8_k, jit_i8._quant_q8_k_numpy)):
            with np.errstate(invalid="ignore"):                       # NaN codes: numpy's cast, either way
                for a, b in zip(fast(y), slow(y)):
                    np.testing.assert_array_equal(a, b)
    q, d = jit_i8.quant_q8_0(x)
    np.testing.assert_array_equal((q.reshape(4, -1, 32) * d[..., None]).reshape(4, -1).astype(F32), q8_0_round(x))
    q, d, bs = jit_i8.quant_q8_k(x)
    np.testing.assert_array_equal((q.reshape(4, -1, 256) * d[..., None]).reshape(4, -1).astype(F32), q8_k_round(x))
    np.testing.assert_array_equal(bs, q.reshape(4, -1, 16).sum(-1))


def test_the_integer_dot_product_compiles_to_a_simd_multiply_add():
    from numba import njit

    from ds4py.quant import jit_i8_kernels as k

    w = np.arange(256, dtype=np.int16) - 128
    xq = (np.arange(512, dtype=np.int64) % 255 - 127).astype(np.int8).reshape(2, 256)
    assert k._dot(w, xq[1]) == int(w.astype(np.int64) @ xq[1].astype(np.int64))
    fresh = njit(nogil=True, boundscheck=False)(k._dot.py_func)     # uncached: numba lists no cached code
    assert fresh(w, xq[1]) == k._dot(w, xq[1])
    asm = "\n".join(fresh.inspect_asm().values())
    arch = platform.machine().lower()
    want = ("vpmaddwd", "vpdpwssd", "pmaddwd") if arch in ("x86_64", "amd64") else ("sdot", "smlal", "sadalp")
    assert any(op in asm for op in want), f"no SIMD multiply-add in the int8 dot product on {arch}"


def test_a_model_with_int8_activations_equals_the_act_quant_oracle(golden, monkeypatch):
    """ds4-tiny (routed IQ2_XXS / Q2_K, dense Q8_0, F16) in ds4's numerics: the compiled path (int8 kernels for
    the routed experts, in steps of up to DECODE_ROWS rows one call a projection for all of them, and in such
    steps the dense Q8_0 matrices) against the
    dequantise-then-matmul oracle of the same numerics, prefill then decode.
    Each int8 product the model makes is checked against the exact (float64) act_quant product of its own
    activation: < 1e-6 of sum |x| |W| (measured <= 7e-8). The logits are then a sanity bound only: the int8
    rounding is discontinuous, so float-order noise upstream flips a code now and then, and the logits move by
    1-3e-2 of their range (the numpy fused kernels on the same rounded x: 1.59e-2 on Haswell, 3.60e-2 with a
    top-1 flip under OPENBLAS_CORETYPE=Prescott; this path 2.80e-2 on Haswell since Q8_0 joined it, from
    1.28e-2); a wrong kernel is O(1) away. The golden comparison with ds4's C engine (tests/test_ref_ds4_tiny.py,
    act_quant cases) runs through this path too."""
    from ds4py.model import Numerics
    from ds4py.ref import weights
    from ds4py.ref.engine import RefModel

    worst: dict = {}
    int8_matmul = weights.Weights._int8_matmul

    def checked(self, t, raw, x):
        y = int8_matmul(self, t, raw, x)
        raw = np.asarray(raw)
        w = weights._dequant_rows(t, raw, (raw.shape[0], t.shape[-1])).astype(np.float64)
        xr = self.act(t, x).astype(np.float64)
        err = np.abs(y - xr @ w.T) / np.maximum(np.abs(xr) @ np.abs(w).T, 1e-30)
        worst[t.qtype.name] = max(worst.get(t.qtype.name, 0.0), float(err.max()))
        return y

    experts_linear = weights.Weights.experts_linear

    def checked_experts(self, tensors, ex, gs, xr, x):         # a step's routed experts in one call a projection
        ys = experts_linear(self, tensors, ex, gs, xr, x)
        for t, y in zip(tensors, ys):
            for e, a, b in zip(ex, gs[:-1], gs[1:]):
                raw = np.asarray(t.raw_bytes()[e])
                w = weights._dequant_rows(t, raw, (raw.shape[0], t.shape[-1])).astype(np.float64)
                xe = self.act(t, x[xr[a:b]]).astype(np.float64)
                err = np.abs(y[a:b] - xe @ w.T) / np.maximum(np.abs(xe) @ np.abs(w).T, 1e-30)
                worst[t.qtype.name] = max(worst.get(t.qtype.name, 0.0), float(err.max()))
        return ys

    linear_many = weights.Weights.linear_many

    def checked_many(self, tensors, x, seg=None):                 # a step's products of one x in one call
        ys = linear_many(self, tensors, x, seg)
        for t, y in zip(tensors, ys):
            if self._int8(t, x.shape[0]):
                raw = np.asarray(t.raw_bytes())
                w = weights._dequant_rows(t, raw, (raw.shape[0], t.shape[-1])).astype(np.float64)
                xr = self.act(t, x).astype(np.float64)
                err = np.abs(y - xr @ w.T) / np.maximum(np.abs(xr) @ np.abs(w).T, 1e-30)
                worst[t.qtype.name] = max(worst.get(t.qtype.name, 0.0), float(err.max()))
        return ys

    path = str(golden / "ds4-tiny" / "tiny.gguf")
    ids = [3, 17, 250, 9, 88, 41, 5, 120, 7, 64]
    out = {}
    for kernels in ("jit", "fused", "dequant"):
        if kernels == "jit":
            monkeypatch.setattr(weights.Weights, "_int8_matmul", checked)
            monkeypatch.setattr(weights.Weights, "experts_linear", checked_experts)
            monkeypatch.setattr(weights.Weights, "linear_many", checked_many)
        m = RefModel(path, numerics=Numerics.ds4(), kernels=kernels, threads=2)
        st = m.new_state()
        steps = [m.prefill(st, ids[:8])]
        steps += [m.decode(st, t) for t in ids[8:]]
        out[kernels] = np.stack([np.asarray(s, np.float32).reshape(-1) for s in steps])
        monkeypatch.undo()
    assert m.weights.act_quant
    assert set(worst) == {"IQ2_XXS", "Q2_K", "Q8_0"}, worst
    assert max(worst.values()) < 1e-6, f"an int8 product off the exact act_quant product: {worst}"
    want = out["dequant"]
    err, fused = (np.abs(out[k] - want).max() / np.abs(want).max() for k in ("jit", "fused"))
    assert err <= max(5e-2, 2 * fused), f"int8 path vs act_quant oracle: relative error {err:.2e} " \
                                        f"(the fused kernels on the same rounded x: {fused:.2e})"


def test_the_decode_kernels_compile_to_byte_multiply_adds():
    """The explicit vector IR (ds4py.quant.jit_decode) reaches the byte multiply-adds: vpdpbusd on AVX-512 VBMI +
    VNNI hosts, pmaddubsw (+ pmaddwd or vpdpwssd) on AVX2 hosts, sdot on aarch64 with dotprod; elsewhere the
    portable IR, checked for a SIMD multiply-add of the target."""
    from numba import njit

    from ds4py.quant import jit_decode

    stored, _ = _fixtures()
    rng = np.random.default_rng(11)
    raw = stored(Q.Q2_K, 3, 512, rng)
    x = rng.standard_normal((1, 512)).astype(F32)
    xq, xd, xbs = jit_i8.quant_q8_k(x)
    y = np.empty((1, 3), F32)
    serial = njit(nogil=True, boundscheck=False)(jit_decode.q2_k_dec.py_func)   # uncached: inspectable
    serial(raw.reshape(3, 2, 84), xq, xd, xbs, y, jit._state["f16"], 1)
    np.testing.assert_array_equal(y, jit_i8.matmul(Q.Q2_K, raw, x, 1))
    asm = "\n".join(serial.inspect_asm().values())
    arch = platform.machine().lower()
    if jit_decode.AVX512:
        want = ("vpdpbusd",)
    elif jit_decode.AVX2:
        want = ("vpmaddubsw",)
    elif jit_decode.NEON:                                   # aarch64 with dotprod (ds4py.quant.jit_neon)
        want = ("sdot",)
    elif arch in ("x86_64", "amd64"):
        want = ("pmaddwd", "pmaddubsw", "pmullw")
    else:
        want = ("sdot", "smlal", "sadalp", "smull", "umull", "mla")
    assert any(op in asm for op in want), f"no byte multiply-add in the Q2_K decode kernel on {arch}"


def test_iq2_xxs_decodes_in_vector_registers_on_avx512():
    """On AVX-512 VBMI + GFNI + VNNI hosts the IQ2_XXS decode kernel decodes a block's signs, scales and grid rows
    with vector instructions (vpmultishiftqb, vgf2p8affineqb, vpshufbitqmb), not scalar table loads, and gives
    the serial kernel's bits (the other tests: the block-buffer kernels' and the reference's)."""
    from numba import njit

    from ds4py.quant import jit_decode

    if not jit_decode.AVX512:
        pytest.skip("not an AVX-512 VBMI + GFNI + VNNI host")
    stored, _ = _fixtures()
    rng = np.random.default_rng(12)
    raw = stored(Q.IQ2_XXS, 3, 512, rng)
    x = rng.standard_normal((1, 512)).astype(F32)
    xq, xd, _ = jit_i8.quant_q8_k(x)
    y = np.empty((1, 3), F32)
    serial = njit(nogil=True, boundscheck=False)(jit_decode.iq2_xxs_dec.py_func)   # uncached: inspectable
    t = jit_i8._tables
    serial(raw.reshape(3, 2, 66), xq, xd, y, jit._state["f16"], t["grid8"], t["sign8"], 1)
    np.testing.assert_array_equal(y, jit_i8.matmul(Q.IQ2_XXS, raw, x, 1))
    asm = "\n".join(serial.inspect_asm().values())
    for op in ("vpmultishiftqb", "vgf2p8affineqb", "vpshufbitqmb", "vpdpbusd"):
        assert op in asm, op


def _ds4_tiny(golden):
    from ds4py.model import Numerics
    from ds4py.ref.engine import RefModel

    return RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), numerics=Numerics.ds4(), kernels="jit", threads=2)


def test_a_verify_step_keeps_the_decode_steps_bits(golden):
    """ds4-tiny in ds4's numerics: a row-stable step of 12 rows (a speculative verify, more rows than
    DECODE_ROWS) equals 12 one-row decode steps bit for bit, logits and state: its dense Q8_0 rows take the int8
    decode kernel as a decode step does (they took the fp32 kernel on the rounded x before: ~1e-3 off)."""
    m = _ds4_tiny(golden)
    assert m.stable_rows >= 12
    ids = np.random.default_rng(13).integers(1, 250, 5 + 12)
    a = m.new_state()
    m.step([a], [ids[:5]])
    b = a.copy()
    rows = m.step([a], [ids[5:]], all_logits=True)[0]
    one = np.stack([m.step([b], [[int(t)]])[0] for t in ids[5:]])
    np.testing.assert_array_equal(rows, one)
    for key, arr in a.arrays.items():
        np.testing.assert_array_equal(arr, b.arrays[key], err_msg=key)
