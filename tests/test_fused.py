"""The fused CPU kernels (ds4py.quant.dot, ds4py.ref.fused) against the dequantise-then-matmul oracle.

Every format the fused path covers, on random rows: equal to `dequantize` + matmul up to float32 summation
order (a relative tolerance on the dot's magnitude, sum |w| |x|), the inf / NaN scale cases included; the
threaded runner equals one thread; a whole model decoded with kernels='fused' equals kernels='dequant'.
The chunked GGUF writer (make_synthetic's streaming) is checked here too: chunks give the same file as one piece.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py import quant
from ds4py.quant import dot
from ds4py.ref.fused import Runner

F32 = np.float32
COLS = 512                               # two 256-weight super-blocks, sixteen 32-weight blocks


def stored(qt: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Random stored rows of format qt: uint8 [rows, row_nbytes]."""
    x = rng.standard_normal((rows, cols)).astype(F32)
    if qt == Q.F32:
        return x.view(np.uint8).reshape(rows, -1)
    if qt == Q.F16:
        return x.astype(np.float16).view(np.uint8).reshape(rows, -1)
    if qt == Q.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    if qt in (Q.IQ2_XXS, Q.Q2_K):            # any bytes are valid codes; scales set to finite f16 values
        return random_codes(qt, rows, cols, rng)
    if qt == Q.MXFP4:                        # 16 bytes of FP4 codes after one e8m0 scale byte near 2^0
        blk = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
        blk[:, :, 0] = rng.integers(122, 130, size=(rows, cols // 32))
        return blk.reshape(rows, -1)
    return np.ascontiguousarray(quant.quantize(x, qt)).view(np.uint8).reshape(rows, -1)


def random_codes(qt: Q, rows: int, cols: int, rng) -> np.ndarray:
    size = quant.BLOCK[qt][1]
    blk = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scale = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)   # noqa: E731
    if qt == Q.IQ2_XXS:
        blk[:, :, 0:2] = scale(0.01)
    else:                                    # Q2_K: d, dmin at the block's end
        blk[:, :, 80:82] = scale(0.02)
        blk[:, :, 82:84] = scale(0.005)
    return blk.reshape(rows, -1)


def oracle(qt: Q, raw: np.ndarray, x: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W.T in float64 from the dequantised W, the magnitude sum |x| |W| the error scales with)."""
    if qt == Q.F32:
        w = raw.view(F32)
    elif qt == Q.F16:
        w = raw.view(np.float16).astype(F32)
    elif qt == Q.BF16:
        w = (raw.view(np.uint16).astype(np.uint32) << 16).view(F32)
    else:
        w = quant.dequantize(np.ascontiguousarray(raw), qt, (raw.shape[0], cols))
    w = np.asarray(w, np.float64).reshape(raw.shape[0], cols)
    return x.astype(np.float64) @ w.T, np.abs(x.astype(np.float64)) @ np.abs(w).T


@pytest.mark.parametrize("qt", dot.FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 3])
def test_every_format_equals_dequantise_then_matmul(qt, T):
    rng = np.random.default_rng([int(qt), T])
    raw = stored(qt, 40, COLS, rng)
    x = rng.standard_normal((T, COLS)).astype(F32)
    want, mag = oracle(qt, raw, x, COLS)
    got = dot.dot_rows(qt, raw, dot.prepare(qt, x), dot.Scratch())
    assert got.shape == (T, 40) and got.dtype == F32
    err = np.abs(got - want) / mag
    assert err.max() < 1e-5, f"{qt.name}: worst relative error {err.max():.2e}"
    # not trivially equal to something else: a wrong sign or scale is far outside that
    assert np.abs(want).max() > 100 * 1e-5 * mag.max()


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K, Q.Q2_K, Q.IQ2_XXS, Q.F16], ids=lambda q: q.name)
def test_inf_and_nan_scales_make_the_same_rows_non_finite(qt):
    rng = np.random.default_rng(int(qt))
    raw = stored(qt, 8, COLS, rng)
    assert dot.scales_finite(qt, raw)
    h = raw.reshape(-1).view(np.uint16)
    first = {Q.Q8_0: 0, Q.Q4_K: 0, Q.Q2_K: 40, Q.IQ2_XXS: 0, Q.F16: 5}[qt]
    row_words = raw.shape[1] // 2
    h[first] = 0x7C00                      # row 0: +inf scale (or weight)
    h[row_words * 3 + first] = 0x7E00      # row 3: NaN
    assert not dot.scales_finite(qt, raw)
    x = rng.standard_normal((1, COLS)).astype(F32)
    with np.errstate(all="ignore"):
        want, _ = oracle(qt, raw, x, COLS)
        got = dot.dot_rows(qt, raw, dot.prepare(qt, x), dot.Scratch())
    # the same rows are non-finite (an inf scale over a zero code is NaN in the dequantised matrix, while the
    # fused product scales a finite partial sum: inf there; either is refused downstream)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    assert not np.isfinite(got[0, 0]) and np.isnan(got[0, 3])
    ok = np.isfinite(want)
    assert np.allclose(got[ok], want[ok], rtol=1e-4, atol=1e-3)


def test_threaded_runner_equals_one_thread_and_covers_every_row():
    rng = np.random.default_rng(7)
    rows, cols = 1100, 1024                # several blocks per worker, a ragged last block
    raw = stored(Q.Q8_0, rows, cols, rng)
    x = rng.standard_normal((2, cols)).astype(F32)
    one, three = Runner(1), Runner(3)
    try:
        a = one.matmul(Q.Q8_0, raw, x, cols)
        b = three.matmul(Q.Q8_0, raw, x, cols)
    finally:
        one.close()
        three.close()
    np.testing.assert_array_equal(a, b)    # the same blocks, the same arithmetic, whichever thread ran them
    want, mag = oracle(Q.Q8_0, raw, x, cols)
    assert (np.abs(a - want) / mag).max() < 1e-5


@pytest.fixture(scope="module")
def tiny_iq2(tmp_path_factory) -> str:
    from ds4py.tiny import make_tiny

    p = tmp_path_factory.mktemp("fused") / "tiny-iq2.gguf"
    make_tiny(str(p), seed=5)
    return str(p)


@pytest.mark.parametrize("model", ["tiny_iq2", "v4_gguf"])
def test_a_decoded_model_is_the_same_with_fused_kernels(model, request):
    """Prefill (dequant path in both) then decode steps: the logits agree at float32 noise."""
    from ds4py.ref.engine import RefModel

    path = request.getfixturevalue(model)
    ref, fused = RefModel(path, kernels="dequant"), RefModel(path, kernels="fused", threads=2)
    ids = [1, 5, 9, 2, 7, 3]
    sr, sf = ref.new_state(), fused.new_state()
    lr, lf = ref.prefill(sr, ids), fused.prefill(sf, ids)
    for tok in (4, 8, 6):
        lr, lf = ref.decode(sr, tok), fused.decode(sf, tok)
        scale = np.abs(lr).max()
        assert np.abs(lf - lr).max() <= 1e-4 * scale, f"{model}: decode drifted {np.abs(lf - lr).max():.3e}"
        assert int(np.argmax(lf)) == int(np.argmax(lr))
    assert fused.weights.runner is not None and ref.weights.runner is None


def test_cli_kernels_flag_scores_like_the_oracle_and_is_refused_elsewhere(tiny_iq2, tmp_path):
    """score --kernels fused --threads 2 (6 ids: one step of <= 8 rows takes the fused kernels) agrees with the
    dequant oracle; the CPU flags with another backend, or --threads 0, are one-sentence errors."""
    import os
    import subprocess
    import sys

    np.save(tmp_path / "ids.npy", np.array([1, 5, 9, 2, 7, 3]))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("DS4PY_KERNELS", None)

    def score(*extra, out="l.npy"):
        return subprocess.run([sys.executable, "-m", "ds4py", "score", "-m", tiny_iq2, "--ids", str(tmp_path / "ids.npy"),
                               "--split", "1", "--out", str(tmp_path / out), *extra], capture_output=True, text=True,
                              env=env, timeout=300)
    r = score("--kernels", "dequant", out="dequant.npy")
    assert r.returncode == 0, r.stderr
    r = score("--kernels", "fused", "--threads", "2", out="fused.npy")
    assert r.returncode == 0, r.stderr
    want, got = np.load(tmp_path / "dequant.npy"), np.load(tmp_path / "fused.npy")
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert not np.array_equal(got, want)        # the flag took effect: the fused kernels sum in their own order
    for extra, words in ((["--backend", "cuda-emu", "--kernels", "fused"], "apply to the reference backend only"),
                         (["--threads", "0"], "--threads must be at least 1")):
        r = score(*extra)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_chunked_tensors_write_the_same_file(tmp_path, monkeypatch):
    """make_tiny with every large tensor streamed in chunks (as make_synthetic writes real widths) loads and
    decodes; its chunk generators are deterministic (two writes are byte-identical)."""
    from ds4py import checksum, tiny
    from ds4py.gguf import GGUFFile
    from ds4py.ref.engine import RefModel

    monkeypatch.setattr(tiny, "CHUNK_BYTES", 4096)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    tiny.make_tiny(str(a), seed=2, fast=True)
    tiny.make_tiny(str(b), seed=2, fast=True)
    assert a.read_bytes() == b.read_bytes()
    f = GGUFFile(str(a))
    assert sum(t.nbytes > 4096 for t in f.tensors.values()) > 10        # many tensors went out in chunks
    # the digests hashed chunk by chunk as they were written are those of the bytes on disk
    assert checksum.stored_digests(f) == [checksum.tensor_digest(t) for t in f.tensors.values()]
    m = RefModel(str(a))
    st = m.new_state()
    logits = m.prefill(st, [1, 2, 3])
    assert np.isfinite(logits).all()


def test_make_synthetic_cli_writes_a_loadable_file_and_refuses_bad_flags(tmp_path, capsys):
    """The real-width writer's command, shrunk by its shape flags to seconds: a file the engine decodes, named
    as a synthetic one; a malformed flag is one line, not a traceback, and leaves no file."""
    from ds4py.__main__ import main
    from ds4py.gguf import GGUFFile
    from ds4py.ref.engine import RefModel

    small = ["--layers", "2", "--dim", "256", "--vocab", "512", "--heads", "2", "--o-groups", "2", "--q-lora", "256",
             "--o-lora", "128", "--experts-n", "16", "--ff", "256", "--index-heads", "4", "--index-topk", "16",
             "--hash-layers", "1"]
    out = tmp_path / "syn.gguf"
    assert main(["make-synthetic", str(out), *small]) == 0
    assert GGUFFile(str(out)).meta("general.name") == "ds4py-synthetic-v4-flash"
    m = RefModel(str(out), kernels="fused", threads=1)
    st = m.new_state()
    m.prefill(st, [1, 2])
    assert np.isfinite(m.decode(st, 3)).all()
    bad = tmp_path / "bad.gguf"
    assert main(["make-synthetic", str(bad), *small, "--compress-ratios", "0,x"]) == 2
    assert "--compress-ratios" in capsys.readouterr().err
    assert not bad.exists()


def test_paging_hints_follow_the_layers_and_the_routed_experts_and_change_nothing(tiny_iq2, monkeypatch):
    """With a memory budget the mapped file gets madvise hints: random for every routed-expert tensor, will-need
    for the next layer's dense tensors and for exactly the routed experts' slices; the logits are bit-identical
    to the same model without hints."""
    import mmap

    from ds4py.gguf import GGUFFile
    from ds4py.ref import forward
    from ds4py.ref.engine import RefModel

    if not hasattr(mmap, "MADV_WILLNEED"):
        pytest.skip("no madvise on this platform")
    calls = []
    real = GGUFFile.advise
    monkeypatch.setattr(GGUFFile, "advise", lambda self, off, n, adv: calls.append((off, n, adv)) or real(self, off, n,
                                                                                                          adv))
    hinted = RefModel(tiny_iq2, kernels="fused", threads=1, mem_budget_mb=64)
    plain = RefModel(tiny_iq2, kernels="fused", threads=1, mem_budget_mb=64, madvise=False)
    f = hinted.gguf
    exps = {t.offset: t for t in f.tensors.values() if "_exps" in t.name}
    assert {off for off, _, adv in calls if adv == mmap.MADV_RANDOM} == set(exps) and len(calls) == len(exps)
    calls.clear()
    sh, sp = hinted.new_state(), plain.new_state()
    hinted.prefill(sh, [1, 5, 9]), plain.prefill(sp, [1, 5, 9])
    calls.clear()
    picked = {}                                       # layer -> (its FFN weights, the experts the router picked)
    real_route = forward.route

    def spy(w, cfg, ro, Fw, x, ids, seg, *rest):       # rest: the router's logits when computed with others
        idx, wts = real_route(w, cfg, ro, Fw, x, ids, seg, *rest)
        picked[ro.layer] = (Fw, set(int(e) for e in np.unique(idx)))
        return idx, wts

    monkeypatch.setattr(forward, "route", spy)
    lh = hinted.decode(sh, 4)
    monkeypatch.setattr(forward, "route", real_route)
    lp = plain.decode(sp, 4)
    np.testing.assert_array_equal(lh, lp)
    need = [(off, n) for off, n, adv in calls if adv == mmap.MADV_WILLNEED]
    want = set()
    for Fw, experts in picked.values():
        for t in (Fw.experts.gate, Fw.experts.up, Fw.experts.down):
            per = t.nbytes // t.shape[0]
            want |= {(t.offset + e * per, per) for e in experts}
    expert_asks = {(off, n) for off, n in need if any(t.offset <= off < t.offset + t.nbytes for t in exps.values())}
    assert expert_asks == want
    dense = {(off, n) for off, n in need} - expert_asks
    layer_dense = {(t.offset, t.nbytes) for t in f.tensors.values()
                   if t.name.startswith("blk.") and "_exps" not in t.name}
    assert dense == layer_dense                       # every layer's dense tensors, asked for one layer ahead
