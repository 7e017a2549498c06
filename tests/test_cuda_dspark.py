"""V4.1's DSpark draft on the CUDA engine (`--backend cuda-emu`: the real kernels on the CPU emulator), golden
v41-tiny-dspark (ds4py/cuda/dspark.py; tests/test_dspark_golden.py checks the reference the same way):

- the draft in isolation (the stored taps and block tokens): logits, confidence and drafted ids against the official
  calls (`*_fp32_fixed_noquant` to 1e-4 with the very ids, `*_fp32_fixed` with FP8 flips allowed) and against
  the reference on the same rings (fp32 noise);
- the main step's taps (DECODE, ROWS, BLOCK row sets) equal the reference's, the logits equal a plain step's bit
  for bit, and a taps step launches a plain step's kernels plus one per target layer;
- greedy speculation on cuda-emu equals plain greedy token for token (fixed k and the scheduler), by default in
  `drafts.speculative`; `score --draft-out` on cuda-emu gives the official calls;
- the ring blob crosses backends (cuda-emu -> ref -> cuda-emu), the speculative pair too.

Budget: ~0.13 s per emulated draft call, ~0.15 s per emulated decode row (2-core CPU time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.dspark import CudaDSpark
from ds4py.drafts import speculative
from ds4py.dspark import DSparkSpec
from ds4py.errors import Ds4Error
from ds4py.model import Numerics, open_model
from ds4py.ref.dspark import DraftBlock, RefDSpark
from ds4py.ref.engine import RefModel
from ds4py.sampling import SamplingParams
from ds4py.session import Session, TokenEvent
from spec_fakes import NullTokenizer
from test_dspark_cli import _cli, chat_model  # noqa: F401  (the fixture: the draft file with a real vocabulary)
from test_dspark_golden import TOL, _sfx, _taps, assert_qat_spread, draft_errors, gold, golden_call_diff  # noqa: F401  (the golden tolerances, the stored taps, the golden and error checks, the fixture)

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
FP32_NOISE = 2e-5                   # cuda-emu vs the reference on the same rings (measured <= 2.7e-6)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cudas(dspark_gguf):
    return {fq: open_model(dspark_gguf, backend="cuda-emu", numerics=Numerics(fake_quant=fq)) for fq in (False, True)}


@pytest.fixture(scope="module")
def refs(dspark_gguf):
    return {fq: RefModel(dspark_gguf, numerics=Numerics(fake_quant=fq)) for fq in (False, True)}


def _calls(draft, gold, c, s, n=None):
    """Per official call: (logits with the stored chain's Markov inputs, confidence, our greedy ids, block)."""
    P, taps = int(gold[f"{c}_P"]), _taps(gold, c, s)
    st = draft.new_state()
    draft.feed([st], [taps[:P]])
    out = []
    for j, t in enumerate(gold[f"{c}_draft_positions"][:n]):
        draft.feed([st], [taps[t:t + 1]])
        tok = int(gold[f"{c}_draft_input_ids{s}"][j])
        blk = draft.block(st, tok)
        _, lg, cf = draft.greedy(blk, tok, ids=gold[f"{c}_draft_output_ids{s}"][j])
        out.append((lg, cf, draft.greedy(blk, tok)[0], blk))
    return out, st


@pytest.mark.parametrize("c,fq,n", [("a", False, None), ("d", False, None), ("c", True, 24)])
def test_isolated_draft_matches_official_and_reference(cudas, refs, gold, c, fq, n):
    s = _sfx(fq)
    draft = cudas[fq].open_dspark()
    assert isinstance(draft, CudaDSpark) and draft.backend == "cuda-emu"
    got, st = _calls(draft, gold, c, s, n)
    want, st_ref = _calls(refs[fq].open_dspark(), gold, c, s, n)
    diffs = []
    for j, ((lg, cf, ids, blk), (_, _, ids_r, blk_r)) in enumerate(zip(got, want)):
        assert np.abs(blk.base - blk_r.base).max() <= FP32_NOISE and np.abs(blk.hidden - blk_r.hidden).max() \
            <= FP32_NOISE, f"case {c} call {j}: cuda-emu vs the reference"
        assert np.array_equal(ids, ids_r), f"case {c} call {j}: drafted ids differ from the reference's"
        diffs.append(golden_call_diff(gold, c, s, fq, j, lg, cf, ids))
    d = np.array(diffs)
    assert len(d) == (n or len(gold[f"{c}_draft_positions"]))
    if fq:
        assert_qat_spread(d)
    ring, ring_r = st.export(), st_ref.export()
    assert set(ring) == set(ring_r) and all(np.abs(ring[k] - ring_r[k]).max() <= 0.1 if fq else
                                            np.abs(ring[k] - ring_r[k]).max() <= FP32_NOISE for k in ring)


def test_the_device_chain_equals_the_host_chain(cudas, gold):
    """The greedy chain computed on the device (Markov bias GEMV, add, argmax, confidence GEMV) equals
    DraftBlock.position's host computation from the same base and h (fp32 noise; the very ids); a prev off the
    chain is computed on the host."""
    draft = cudas[True].open_dspark()
    st = draft.new_state()
    draft.feed([st], [_taps(gold, "c", _sfx(True))[:12]])
    for tok in (5, 77, 300):
        blk = draft.block(st, tok)
        ids, lg, cf = draft.greedy(blk, tok)
        host = DraftBlock(blk.base, blk.hidden, blk.embed, blk.head, blk.confidence_w)
        ids_h, lg_h, cf_h = RefDSpark.greedy(None, host, tok)
        assert np.array_equal(ids, ids_h) and ids[0] == tok and len(ids) == draft.block_size + 1
        assert np.abs(lg - lg_h).max() <= FP32_NOISE and np.abs(cf - cf_h).max() <= FP32_NOISE
        off = (int(ids[2]) + 1) % lg.shape[1]                  # a prev off the chain: the host's row
        got, c = blk.position(1, off)
        want, c_h = host.position(1, off)
        assert np.array_equal(got, want) and c == c_h


def test_ring_rows_do_not_depend_on_the_chunking(cudas, gold):
    """A ring row has the same bits whether its position came in a prompt, among a round's rows or alone."""
    draft = cudas[True].open_dspark()
    taps = _taps(gold, "c", _sfx(True))[:12]
    whole, parts, single = draft.new_state(), draft.new_state(), draft.new_state()
    draft.feed([whole], [taps])
    draft.feed([parts], [taps[:5]])
    draft.feed([parts], [taps[5:]])
    for t in range(12):
        draft.feed([single], [taps[t:t + 1]])
    a, b, c = whole.export(), parts.export(), single.export()
    assert all(np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]) for k in a)


def test_block_keys_never_reach_the_ring(cudas, gold):
    """A draft call writes nothing into the rings: two calls with other tokens leave them bit for bit."""
    draft = cudas[False].open_dspark()
    st = draft.new_state()
    draft.feed([st], [_taps(gold, "a", _sfx(False))[:9]])
    before = st.export()
    b1 = draft.block(st, 3)
    draft.block(st, 400)
    after = st.export()
    assert all(np.array_equal(before[k], after[k]) for k in before) and st.n_tokens == 9
    assert np.array_equal(draft.block(st, 3).base, b1.base)     # the second call replays the captured graph


@pytest.mark.parametrize("chunks", [[20], [3], [1, 1]], ids=["block", "rows", "decode"])
def test_taps_equal_the_reference_and_plain_logits(cudas, refs, gold, chunks):
    cm, rm = cudas[False], refs[False]
    ids = [int(t) for t in gold["a_ids"]]
    sc, sr, sp = cm.new_state(), rm.new_state(), cm.new_state()
    at = 0
    for n in chunks:
        part = ids[at:at + n]
        lc, tc = cm.step_taps([sc], [part], all_logits=True)
        lr, tr = rm.step_taps([sr], [part], all_logits=True)
        lp = cm.step([sp], [part], all_logits=True)
        assert tc[0].shape == (n, cm.config.dspark_tap_dim) and tc[0].dtype == np.float32
        assert np.abs(tc[0] - tr[0]).max() <= TOL * np.abs(tr[0]).max()
        assert np.array_equal(lc[0], lp[0]), "a taps step's logits differ from a plain step's"
        assert np.abs(lc[0] - lr[0]).max() <= TOL
        at += n


def test_a_taps_step_launches_a_plain_steps_kernels_and_one_per_target(cudas):
    """Plain steps keep their launch counts (the tap kernel is recorded only for step_taps); the verify step of a
    round (ROWS with taps) is the rows step plus one launch per target layer, and so is the decode body."""
    m = cudas[False]
    targets = len(m.config.dspark_targets)
    for n in (2, 5):
        sts = [m.new_state() for _ in range(n)]
        plain, _ = m.runner.rows_run([(st, 0, 0) for st in sts])
        taps, _ = m.runner.rows_run([(st, 0, 0) for st in sts], taps=True)
        assert plain.count()[0] + targets == taps.count()[0]
        assert m.launches_per_rows_step(n)["total"] == plain.count()[0]
    st = m.new_state()
    plain_body = m.runner.body(st, 0).count()[0]
    assert m.runner.body(st, 0, taps=True).count()[0] == plain_body + targets
    assert m.launches_per_step(m.new_state())["body"] == plain_body


def _tokens(model, prompt, n, **kw):
    prm = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": n, **kw})
    return [e.token_id for e in Session(model, NullTokenizer(), 256).generate(prompt, prm)
            if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("prompt", [[7, 301, 12], list(range(40, 62))], ids=["short", "block"])
def test_greedy_speculation_equals_plain_greedy(cudas, prompt):
    m = cudas[True]
    want = _tokens(m, prompt, 10)
    spec = speculative(m)
    assert isinstance(spec, DSparkSpec) and isinstance(spec.draft, CudaDSpark)
    assert _tokens(spec, prompt, 10) == want                  # the scheduler
    for k in (1, 4):
        sp = DSparkSpec(m, spec.draft, fixed_k=k)
        assert _tokens(sp, prompt, 10) == want, f"k = {k}"
        assert sp.stats.rounds > 0


def test_ring_blob_crosses_backends(cudas, refs, gold):
    """A ring saved on cuda-emu loads on the reference (the same arrays, the same draft call) and back."""
    dc, dr = cudas[False].open_dspark(), refs[False].open_dspark()
    taps = _taps(gold, "b", _sfx(False))
    st = dc.new_state()
    dc.feed([st], [taps[:6]])
    on_ref = dr.load_state(dc.save_state(st))
    assert on_ref.n_tokens == 6
    ring = st.export()
    assert all(np.array_equal(ring[k], on_ref.export()[k]) for k in ring)
    assert np.abs(dr.block(on_ref, 5).base - dc.block(st, 5).base).max() <= FP32_NOISE
    dr.feed([on_ref], [taps[6:9]])
    back = dc.load_state(dr.save_state(on_ref))
    assert back.n_tokens == 9 and all(np.array_equal(v, on_ref.export()[k]) for k, v in back.export().items())
    with pytest.raises(Ds4Error):
        dc.load_state(cudas[True].open_dspark().save_state(cudas[True].open_dspark().new_state()))


def test_speculative_pair_state_crosses_backends(cudas, refs):
    sc, sr = DSparkSpec(cudas[False], cudas[False].open_dspark()), DSparkSpec(refs[False], refs[False].open_dspark())
    assert sc.fingerprint == sr.fingerprint
    st = sc.new_state()
    sc.step([st], [[7, 301, 12, 9]])
    moved = sr.load_state(sc.save_state(st))
    assert moved.n_tokens == 4 and moved.draft.n_tokens == 4
    a, b = sc.step([st], [[44]])[0], sr.step([moved], [[44]])[0]
    assert np.abs(a - b).max() <= TOL


def test_draft_errors(cudas, v41_gguf):
    draft_errors(cudas[False])
    with pytest.raises(Ds4Error, match="no DSpark draft"):
        open_model(v41_gguf, backend="cuda-emu").open_dspark()


def test_score_draft_out_on_cuda_emu(dspark_gguf, gold, tmp_path):
    """`score --draft-out --backend cuda-emu`: the main model's taps feed the draft end to end (case a, noquant:
    the official calls within 1e-4, the very drafted ids)."""
    s, c = _sfx(False), "a"
    P = int(gold[f"{c}_P"])
    ids = gold[f"{c}_ids"][:P + 8]                 # 7 draft calls after the prompt
    np.save(tmp_path / "ids.npy", ids)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "ds4py", "score", "-m", dspark_gguf, "--backend", "cuda-emu", "--ids",
                        str(tmp_path / "ids.npy"), "--split", str(P), "--out", str(tmp_path / "l.npy"),
                        "--draft-out", str(tmp_path / "d.npz"), "--no-fake-quant"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(tmp_path / "d.npz")
    n = len(ids) - 1 - P
    assert got["positions"].tolist() == gold[f"{c}_draft_positions"][:n].tolist()
    d = np.maximum(np.abs(got["logits"] - gold[f"{c}_draft_logits{s}"][:n]).max((1, 2)),
                   np.abs(got["confidence"] - gold[f"{c}_draft_confidence{s}"][:n]).max(1))
    assert d.max() <= TOL
    assert np.array_equal(got["output_ids"], gold[f"{c}_draft_output_ids{s}"][:n])


def test_run_on_cuda_emu_speculates_by_default_with_the_plain_answer(chat_model):
    """`run --backend cuda-emu` with a DSpark V4.1 file speculates (no --no-spec needed) and answers as --no-spec."""
    args = ("run", "-m", chat_model, "--backend", "cuda-emu", "-p", "Hello there", "--nothink", "-n", "8", "--temp",
            "0", "-v")
    spec, plain = _cli(*args), _cli(*args, "--no-spec")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr[-3000:] + plain.stderr[-3000:]
    assert spec.stdout == plain.stdout
    assert "[spec:" in spec.stderr and "[spec:" not in plain.stderr


def test_a_vq8_draft_matches_the_reference(dspark_gguf, tmp_path):
    """quantize-vq takes the stages' routed experts to VQ-8 (12 / 13 bits, the widths the CUDA kernels read): the
    draft's upload re-lays them as the main layers' (vq12 / vq13), and a call equals the reference's on that file."""
    from ds4py.vq.quantize import Options, quantize_vq

    out = str(tmp_path / "vq.gguf")
    quantize_vq(dspark_gguf, out, Options(bits=12, bits_shallow=13, shallow_layers=1, min_pool=5, train_per_code=5,
                                          rounds=1), progress=False)
    got, nx = [], Numerics(fake_quant=False)       # (with FP8 on, a flip of one quant step moves a call by ~1e-3)
    for m in (open_model(out, backend="cuda-emu", numerics=nx), RefModel(out, numerics=nx)):
        draft, st = m.open_dspark(), m.new_state()
        ds = draft.new_state()
        (_,), (taps,) = m.step_taps([st], [list(range(20))])
        draft.feed([ds], [taps])
        got.append((draft, draft.block(ds, 7)))
    (dc, bc), (_, br) = got
    assert {L.ffn.experts.gate.fmt for L in dc.binding.stages} == {"vq12"}
    assert np.abs(bc.base - br.base).max() <= FP32_NOISE and np.abs(bc.hidden - br.hidden).max() <= FP32_NOISE
