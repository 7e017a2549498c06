"""VQ-8 experts: the format (bit layout, E4M3, header whitelist), the deterministic quantiser and a VQ model
loaded, scored, run and served. The tiny models are MXFP4-expert make-tiny files (the official-FP4 case)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py.config import ModelConfig
from ds4py.errors import GGUFError
from ds4py.gguf import GGUFFile
from ds4py.quant import vq
from ds4py.quant.official import E4M3
from ds4py.ref.engine import RefModel
from ds4py.tiny import make_tiny
from ds4py.vq import kmeans
from ds4py.vq.quantize import Options, QuantizeError, quantize_vq
from ds4py.vq.rulers import rulers

from helpers import REPO, start_serve

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
FAST = dict(rounds=6, train_per_code=1000)


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def ds4py(*argv, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4py", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env={**ENV, **(env or {})}, cwd=REPO)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vq")


@pytest.fixture(scope="module")
def teacher(work):
    """4 layers, dim 256, ff 256, 16 experts: 393,216 vectors per layer."""
    p = work / "teacher.gguf"
    make_tiny(str(p), seed=3, experts="mxfp4")
    return p


@pytest.fixture(scope="module")
def vq6(work, teacher):
    p = work / "vq6.gguf"
    return p, quantize_vq(str(teacher), str(p), Options(bits=6, **FAST), progress=False)


@pytest.fixture(scope="module")
def vq8(work, teacher):
    p = work / "vq8.gguf"
    return p, quantize_vq(str(teacher), str(p), Options(bits=8, **FAST), progress=False)


@pytest.fixture(scope="module")
def vq13(work):
    """Layer 0 at 13 bits ("12 + 1"), the other at 7, on a 2-layer, 8-expert model (a deliberately thin pool)."""
    src = work / "small.gguf"
    make_tiny(str(src), seed=5, experts="mxfp4", n_layers=2, n_experts=8, compress_ratios=[0, 4])
    p = work / "vq13.gguf"
    opts = Options(bits=7, bits_shallow=13, shallow_layers=1, min_pool=20, train_per_code=20, rounds=2)
    return src, p, quantize_vq(str(src), str(p), opts, progress=False)


# ---------------------------------------------------------------------------------------------- format
def ref_unpack(row: bytes, hi: bytes | None, bits: int, n: int) -> list[int]:
    """Bit-by-bit reading of the documented layout: LSB-first stream of Bs-bit fields, bit 12 in the plane."""
    sb = vq.stream_bits(bits)
    bit = lambda buf, i: (buf[i >> 3] >> (i & 7)) & 1                      # noqa: E731
    out = [sum(bit(row, j * sb + b) << b for b in range(sb)) for j in range(n)]
    if hi is not None:
        out = [x | bit(hi, j) << 12 for j, x in enumerate(out)]
    return out


@pytest.mark.parametrize("bits", range(6, 14))
def test_pack_unpack_roundtrip_every_width(bits):
    rng = np.random.default_rng(bits)
    idx = rng.integers(0, 1 << bits, (5, 3, 64))
    idx[0, 0] = (1 << bits) - 1                                             # all ones
    idx[0, 1] = 0
    stream, hi = vq.pack_indices(idx, bits)
    assert stream.shape == (5, 3, 64 // 8 * vq.stream_bits(bits))
    assert (hi is None) == (bits <= 12)
    assert np.array_equal(vq.unpack_indices(stream, hi, bits), idx)
    r = (2, 1)
    assert ref_unpack(stream[r].tobytes(), None if hi is None else hi[r].tobytes(), bits, 64) == idx[r].tolist()


def test_12bit_geometry_and_the_13bit_plane():
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 1 << 13, (2, 512))
    s12, none = vq.pack_indices(idx & 0xFFF, 12)
    assert none is None and s12.shape == (2, 768)                           # 256 indices = 384 bytes = 3 lines
    s13, hi = vq.pack_indices(idx, 13)
    assert np.array_equal(s13, s12)                                         # "12 + 1": the same 12-bit stream
    assert hi.shape == (2, 64)
    assert np.array_equal(np.unpackbits(hi, axis=1, bitorder="little"), idx >> 12)


def test_e4m3_encode_is_nearest_ties_to_even_and_saturating():
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F and c != 0x80], np.uint8)
    assert np.array_equal(vq.e4m3_encode(E4M3[finite]), finite)
    x = np.random.default_rng(1).standard_normal(20000) * 4
    got = E4M3[vq.e4m3_encode(x)].astype(np.float64)
    grid = np.unique(E4M3[finite].astype(np.float64))
    assert np.array_equal(np.abs(x - got), np.abs(x[:, None] - grid[None]).min(1))
    # ties: 1.0625 lies between 1.0 (code 0x38) and 1.125 (0x39); 1.1875 between 0x39 and 1.25 (0x3A)
    assert vq.e4m3_encode(np.array([1.0625, 1.1875, -1.0625, 1e6, -1e6, -1e-9])).tolist() == \
        [0x38, 0x3A, 0xB8, 0x7E, 0xFE, 0x00]


def test_header_is_checked():
    h = vq.Header(12).pack()
    assert h.tobytes()[:4] == b"DSVQ" and vq.Header.parse(h, "x") == vq.Header(12)
    bad = h.copy()
    bad[4] = 2
    with pytest.raises(GGUFError, match="VQ format version 2 is not supported by this ds4py"):
        vq.Header.parse(bad, "x")
    bad = h.copy()
    bad[:4] = np.frombuffer(b"DQV3", np.uint8)
    with pytest.raises(GGUFError, match="not a ds4py VQ-8 payload"):
        vq.Header.parse(bad, "x")
    bad = h.copy()
    bad[6] = 11                                                             # bits no longer match K
    with pytest.raises(GGUFError, match="corrupt VQ header"):
        vq.Header.parse(bad, "x")


# ---------------------------------------------------------------------------------------------- search, Lloyd
def test_search_is_the_exact_nearest_codeword_lowest_index_on_ties():
    rng = np.random.default_rng(2)
    c = rng.standard_normal((300, 8)).astype(np.float32)
    c[7] = c[3]                                                             # exact duplicate: 3 must win
    v = rng.standard_normal((20000, 8)).astype(np.float32)
    v[:50] = c[3] + rng.standard_normal((50, 8)).astype(np.float32) * 1e-3
    v[50:60] = (c[10] + c[11]) / 2                                          # (near) midpoints
    v[60:70] = 0
    s = kmeans.Searcher(c, workers=2)
    got = s(v)
    d = ((v.astype(np.float64)[:, None, :] - c.astype(np.float64)[None]) ** 2).sum(-1)
    assert np.array_equal(got, d.argmin(1))
    assert not (got == 7).any() and s.n_rechecked >= 50
    assert np.array_equal(kmeans.Searcher(c, workers=1)(v), got)            # threads / blocks do not matter


def test_lloyd_is_deterministic_and_improves():
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((6000, 8)).astype(np.float32)
    errs = []
    a = kmeans.lloyd(pool, 64, 5, report=lambda r, e: errs.append(e))
    assert np.array_equal(a, kmeans.lloyd(pool, 64, 5))
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.8 * errs[0]
    assert np.array_equal(kmeans.lloyd(pool, 64, 0), pool[np.arange(64) * 6000 // 64])   # equidistant start


# ---------------------------------------------------------------------------------------------- the file
def test_file_decodes_exactly_and_the_reported_error_is_the_engines(teacher, vq6):
    path, report = vq6
    f, src = GGUFFile(str(path)), GGUFFile(str(teacher))
    ModelConfig.from_gguf(f)                                                # loads: schema accepts VQ experts
    assert f.meta("general.alignment") == 128 and f.meta("ds4py.vq.version") == 1
    assert f.meta("tokenizer.ggml.tokens") == src.meta("tokenizer.ggml.tokens")
    assert all(t.offset % 128 == 0 for t in f.tensors.values())
    for name, t in src.tensors.items():                                    # everything else: byte for byte
        if "_exps." not in name:
            assert f.tensors[name].qtype == t.qtype and np.array_equal(f.tensors[name].raw_bytes(), t.raw_bytes())
    ex = vq.VQExperts(f)
    src_w = RefModel(str(teacher)).weights
    for layer in range(4):
        cb_codes = np.asarray(f.tensor(vq.codebook_name(layer)).raw).view(np.uint8)
        err = energy = 0.0
        for m in vq.MATRICES:
            name = vq.payload_name(layer, m)
            payload = f.tensor(name).raw_bytes()
            gains = np.asarray(f.tensor(vq.gain_name(name)).raw).astype(np.float32)
            for e in range(16):
                w = ex.expert(name, e)
                if m == "up" and e == 5:                                    # independent decode of one row
                    idx = ref_unpack(payload[e, 9].tobytes(), None, 6, 256 // 8)
                    row = (gains[e, 9] * E4M3[cb_codes[idx]]).reshape(-1)
                    assert np.array_equal(w[9], row)
                x = src_w.expert(src_w.f.tensor(name), e).astype(np.float64)
                err += ((x - w) ** 2).sum()
                energy += (x ** 2).sum()
        assert err / energy == pytest.approx(report["layers"][layer]["rel_err"], rel=1e-9)


def test_same_bytes_twice_and_under_another_blas_kernel(work, teacher, vq6):
    """The fixture ran in-process on this machine's own OpenBLAS kernel (Haswell or newer, one thread); the
    second run uses the SSE3 Prescott kernel (other summation order: the GEMM's distances differ in their last
    bits) and two BLAS threads."""
    path, _ = vq6
    out = work / "again.gguf"
    r = ds4py("quantize-vq", teacher, out, "--bits", 6, "--rounds", 6, "--train-per-code", 1000, "-q",
              env={"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "vectors/s" in r.stdout
    assert sha256(out) == sha256(path)


def test_more_bits_measure_closer_to_the_teacher(work, teacher, vq6, vq8):
    for a, b in zip(vq6[1]["layers"], vq8[1]["layers"]):
        assert b["rel_err"] < 0.85 * a["rel_err"]
    ids = np.random.default_rng(4).integers(2, 500, 40)
    logits = {}
    for name, path in (("t", teacher), ("6", vq6[0]), ("8", vq8[0])):
        model = RefModel(str(path))
        st = model.new_state()
        logits[name] = np.stack([model.prefill(st, ids[:8])] + [model.decode(st, int(t)) for t in ids[8:]])
    r6, r8 = (rulers(logits["t"], logits[k], ids, 8) for k in ("6", "8"))
    assert r8["sigma_min_mean"] > r6["sigma_min_mean"] + 0.03
    assert r8["kl_mean"] < 0.9 * r6["kl_mean"]
    assert rulers(logits["t"], logits["t"], ids, 8)["kl_mean"] == pytest.approx(0, abs=1e-12)


def test_thirteen_bit_layer_uses_the_12_plus_1_layout(vq13):
    src, path, report = vq13
    f = GGUFFile(str(path))
    ModelConfig.from_gguf(f)
    assert [r["bits"] for r in report["layers"]] == [13, 7]
    g0 = f.tensor("blk.0.ffn_gate_exps.weight")
    assert g0.shape == (8, 256, 256 // 64 * 12) and f.tensor("blk.0.ffn_gate_exps.vq_hi").shape == (8, 256, 4)
    assert "blk.1.ffn_gate_exps.vq_hi" not in f.tensors
    assert f.tensor("blk.1.ffn_down_exps.weight").shape == (8, 256, 256 // 64 * 7)
    cb = np.asarray(f.tensor("blk.0.ffn_vq.codebook").raw).view(np.uint8)
    gains = np.asarray(f.tensor("blk.0.ffn_down_exps.vq_gain").raw).astype(np.float32)
    row = ref_unpack(f.tensor("blk.0.ffn_down_exps.weight").raw_bytes()[3, 17].tobytes(),
                     f.tensor("blk.0.ffn_down_exps.vq_hi").raw_bytes()[3, 17].tobytes(), 13, 32)
    assert max(row) >= 4096                                                 # the plane is really used
    w = vq.VQExperts(f).expert("blk.0.ffn_down_exps.weight", 3)
    assert np.array_equal(w[17], (gains[3, 17] * E4M3[cb[row]]).reshape(-1))
    assert report["layers"][0]["rel_err"] < 0.6 * report["layers"][1]["rel_err"]


def test_row_gains_scale_at_load(vq6):
    f = GGUFFile(str(vq6[0]))
    ex = vq.VQExperts(f)
    name = "blk.2.ffn_down_exps.weight"
    base = ex.expert(name, 4)
    s = np.ones((16, 256), np.float32)
    s[4, :10] = 2
    ex.scale_rows(name, s)
    ex.scale_rows(name, s)
    w = ex.expert(name, 4)
    assert np.array_equal(w[:10], base[:10] * 4) and np.array_equal(w[10:], base[10:])
    with pytest.raises(GGUFError, match=r"must be \[16, 256\]"):
        ex.scale_rows(name, np.ones(3))


def test_unbiased_gains_undo_the_codebooks_shrinkage(work, teacher, vq6):
    """Unbiased gains (the default; --no-unbiased-gains: the k-means gains): the same codes, every expert tensor's
    row gains times one factor <w,w>/<q,w> > 1, so the decoded experts are no longer too small on average (slope
    1); the reported error is the engine's."""
    out, rep = vq6
    path = work / "vq6b.gguf"
    report = quantize_vq(str(teacher), str(path), Options(bits=6, unbias=False, **FAST), progress=False)
    assert "unbias_factor" not in report["layers"][0]
    f, f0 = GGUFFile(str(out)), GGUFFile(str(path))
    ex, src_w = vq.VQExperts(f), RefModel(str(teacher)).weights
    for layer in (0, 3):
        err = energy = cross = 0.0
        for m in vq.MATRICES:
            name = vq.payload_name(layer, m)
            assert np.array_equal(f.tensor(name).raw_bytes(), f0.tensor(name).raw_bytes())     # same codes
            factor = rep["layers"][layer]["unbias_factor"][m]
            assert 1.05 < factor < 2.5                                      # 6 bits, random weights: ~1.8
            g0 = np.asarray(f0.tensor(vq.gain_name(name)).raw)
            assert np.array_equal(np.asarray(f.tensor(vq.gain_name(name)).raw),
                                  (g0.astype(np.float32) * np.float32(factor)).astype(np.float16))
            for e in range(16):
                w = ex.expert(name, e).astype(np.float64)
                x = src_w.expert(src_w.f.tensor(name), e).astype(np.float64)
                err += ((x - w) ** 2).sum()
                energy += (x ** 2).sum()
                cross += (x * w).sum()
        assert cross / energy == pytest.approx(1.0, abs=2e-3)              # unbiased (LS gains: 1 - NMSE)
        assert err / energy == pytest.approx(rep["layers"][layer]["rel_err"], rel=1e-5)
        assert rep["layers"][layer]["rel_err"] > report["layers"][layer]["rel_err"]     # more weight error


def _patch(src, dst, tensor: str, at: int, data: bytes):
    shutil.copy(src, dst)
    off = GGUFFile(str(src)).tensors[tensor].offset + at
    with open(dst, "r+b") as fh:
        fh.seek(off)
        fh.write(data)


@pytest.mark.parametrize("at,data,msg", [(4, b"\x02\x00", "VQ format version 2 is not supported"),
                                         (0, b"DQV3", "not a ds4py VQ-8 payload")])
def test_wrong_version_or_magic_is_refused(work, vq6, at, data, msg):
    bad = work / "bad.gguf"
    _patch(vq6[0], bad, "blk.1.ffn_vq.header", at, data)
    with pytest.raises(GGUFError, match=msg):
        RefModel(str(bad))
    r = ds4py("run", "-m", bad, "-p", "hi", "-n", "1")
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_refusals_name_the_problem(work, teacher):
    out = work / "never.gguf"
    with pytest.raises(QuantizeError, match=r"layer 0 has 393,216 vectors for 1,024 codewords \(10 bits\): 384 "
                                            r"per codeword, fewer than --min-pool 1,000"):
        quantize_vq(str(teacher), str(out), Options(bits=10), progress=False)
    assert not out.exists() and not any(p.name.startswith(".never") for p in work.iterdir())
    r = ds4py("quantize-vq", teacher, out, "--bits", 14)
    assert r.returncode == 2 and "--bits 14 is outside 6..13" in r.stderr
    r = ds4py("quantize-vq", teacher, out, "--bits", 8, "--bits-shallow", 9)
    assert r.returncode == 2 and "go together" in r.stderr


def test_any_source_format_and_dense_q4_k(work, golden):
    """The ds4-tiny golden file (IQ2_XXS gate/up, Q2_K down experts; Q8_0 attention) -> 6-bit VQ + Q4_K."""
    out = work / "ds4tiny-vq.gguf"
    report = quantize_vq(str(golden / "ds4-tiny" / "tiny.gguf"), str(out),
                         Options(bits=6, dense="q4_k", **FAST), progress=False)
    f = GGUFFile(str(out))
    assert f.tensor("blk.0.attn_q_a.weight").qtype == Q.Q4_K and f.tensor("output.weight").qtype == Q.Q4_K
    assert f.tensor("blk.0.ffn_gate_inp.weight").qtype == GGUFFile(str(golden / "ds4-tiny" / "tiny.gguf")) \
        .tensor("blk.0.ffn_gate_inp.weight").qtype                          # the router stays as shipped
    # unbiased gains (the default) turn a k-means error N into about N / (1 - N): 0.3..0.6 -> 0.43..1.5
    assert all(0.43 < r["rel_err"] < 1.5 for r in report["layers"])
    m = RefModel(str(out))
    assert np.isfinite(m.prefill(m.new_state(), [0, 5, 9])).all()


def test_inspect_gguf_reader_and_bench_bytes(teacher, vq6):
    import gguf

    path, _ = vq6
    r = ds4py("inspect", path)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("VQ8x6"))
    n, bpw = int(line.split()[1]), float(line.split()[-1])
    assert n == 4 * 8                                                       # header, codebook, 3 x (stream, gain)
    assert bpw == pytest.approx(6 / 8 + 16 / 256 + 64 * 8 * 8 / (3 * 16 * 256 * 256) + 256 / (3 * 16 * 256 * 256),
                                abs=0.005)                                  # printed with 2 decimals
    reader = gguf.GGUFReader(str(path))                                     # the gguf package opens it too
    t = {x.name: x for x in reader.tensors}
    assert t["blk.0.ffn_gate_exps.weight"].tensor_type == Q.I8
    f, s = GGUFFile(str(path)), GGUFFile(str(teacher))
    cfg = ModelConfig.from_gguf(f)
    k = cfg.n_experts_used / cfg.n_experts
    drop = sum(s.tensors[n].nbytes - f.tensors[n].nbytes - f.tensors[vq.gain_name(n)].nbytes
               for n in s.tensors if n.endswith("_exps.weight"))
    shared = sum(f.tensors[n].nbytes for n in f.tensors if ".ffn_vq." in n)
    assert RefModel(str(path)).weight_bytes_per_token() == RefModel(str(teacher)).weight_bytes_per_token() \
        - int(drop * k) + shared


def test_a_vq_model_scores_runs_and_serves(work, vq6):
    import openai

    path, _ = vq6
    np.save(work / "ids.npy", np.arange(2, 14))
    r = ds4py("score", "-m", path, "--ids", work / "ids.npy", "--split", 4, "--out", work / "s.npy")
    assert r.returncode == 0, r.stderr
    r = ds4py("rulers", work / "s.npy", work / "s.npy", "--ids", work / "ids.npy", "--split", 4)
    assert r.returncode == 0 and json.loads(r.stdout)["same_top1"] == 1.0
    r = ds4py("run", "-m", path, "-p", "Hello", "--nothink", "--temp", "0", "-n", "4", "-v")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    proc, base = start_serve(["-m", str(path), "--ctx", "256"])
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        resp = c.chat.completions.create(model="deepseek-v4-flash", max_tokens=3,
                                         messages=[{"role": "user", "content": "hi"}])
        assert resp.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_decode_dequantises_only_the_routed_experts(vq6, monkeypatch):
    seen = []
    real = vq.VQExperts.expert
    monkeypatch.setattr(vq.VQExperts, "expert", lambda self, name, e: seen.append((name, int(e))) or real(self, name, e))
    m = RefModel(str(vq6[0]), cache_bytes=0, kernels="dequant")   # the oracle dequantises per routed expert
    st = m.new_state()
    m.prefill(st, [0, 5, 9, 11])
    seen.clear()
    tr = m.new_trace()
    m.decode(st, 7, trace=tr)
    want = sorted((vq.payload_name(layer, mm), int(e)) for layer in range(4) for e in tr.experts[layer][0]
                  for mm in vq.MATRICES)
    assert sorted(seen) == want and len(want) == 4 * 6 * 3
