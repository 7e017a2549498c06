"""VQ-8 experts through the CUDA engine on the CPU emulator: a v4-tiny-shaped random model with 256-wide experts
(make-tiny, MXFP4 experts, a random MTP block; v4-tiny's own 96-wide experts are not whole 64-weight VQ runs)
quantised by `quantize-vq` with the seed's widths (layer 0 at 13 bits in the 12 + 1 layout, the rest at 12) on
cuda-emu against the reference on the same file (prefill blocks with the experts on tensor cores, cu/moe_prefill.cu's
VQ kernels, and through the grouped rows kernels; then decode): same top-1 everywhere, fp32 noise; a multi-row step's rows bit-identical to single steps; and speculative decoding with the V4 MTP block on the VQ-8
main file gives plain greedy decoding's tokens, with the MTP file's experts as made and VQ-8 quantised; and a V4.1
VQ-8 file (the golden v41-tiny at 12 bits) = the reference, its prefill experts on tensor cores. Budget: quantising ~20 s, ~0.15 s of emulator per token."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_engine_checks import V4_TINY, compare, ids_for, run
from ds4py.cuda import emu
from ds4py.cuda.options import temporarily
from ds4py.gguf import GGUFFile
from ds4py.model import Numerics, open_model, open_mtp
from ds4py.quant import vq
from ds4py.ref.engine import RefModel
from ds4py.sampling import SamplingParams
from ds4py.session import Session, TokenEvent
from ds4py.mtp_spec import MtpSpec
from spec_fakes import NullTokenizer

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
# the seed's widths on a tiny pool (98,304 vectors a layer): a thin codebook, fast Lloyd
SEED_WIDTHS = dict(bits=12, bits_shallow=13, shallow_layers=1, min_pool=5, train_per_code=5, rounds=1)


SHAPE = dict(V4_TINY, n_layers=3, compress_ratios=[0, 4, 128], hash_layers=1, expert_ff=256, n_experts=4,
             n_experts_used=2, vocab_size=320)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str, str]:
    """(VQ-8 main GGUF, its MTP GGUF (MXFP4 experts), that MTP GGUF through quantize-vq)."""
    from ds4py.tiny import make_tiny
    from ds4py.vq.quantize import Options, quantize_vq

    d = tmp_path_factory.mktemp("vqcuda")
    src, out, mtp, mtp_vq = d / "src.gguf", d / "vq.gguf", d / "vq.mtp.gguf", d / "vq.mtp.vq.gguf"
    make_tiny(str(src), seed=7, experts="mxfp4", mtp=str(mtp), **SHAPE)
    quantize_vq(str(src), str(out), Options(**SEED_WIDTHS), progress=False)
    quantize_vq(str(mtp), str(mtp_vq), Options(**SEED_WIDTHS), progress=False)
    return str(out), str(mtp), str(mtp_vq)


@pytest.fixture(scope="module")
def vq_gguf(files) -> str:
    return files[0]


@pytest.fixture(scope="module")
def vqm(vq_gguf):
    return open_model(vq_gguf, backend="cuda-emu")


def test_the_file_has_the_seeds_widths(vq_gguf):
    f = GGUFFile(vq_gguf)
    assert vq.read_layer(f, 0).header.bits == 13 and vq.read_layer(f, 2).header.bits == 12
    assert vq.is_vq(f, "blk.0.ffn_down_exps.weight") and vq.hi_name("blk.0.ffn_down_exps.weight") in f.tensors


def test_the_device_holds_one_aligned_copy_of_the_vq_bytes(vqm, vq_gguf):
    """Each VQ matrix is one re-laid copy, 128-byte aligned; the file's VQ tensors (streams, hi planes, gains,
    codebooks) are not uploaded beside it, and the weights region holds exactly the counted bytes."""
    from ds4py import schema
    from ds4py.cuda import synth, vq_layout
    from ds4py.cuda.ops.experts import vq_expert_bytes, vq_row_parts

    f, w = GGUFFile(vq_gguf), vqm.w
    vq_names = set()
    for e in schema.entries(vqm.config):
        if not e.spec.field.startswith("ffn.experts."):
            continue
        t = synth._lookup(w.binding, e)
        X, rows, nb = f.tensors[e.name].shape
        fmt, nbytes = vq_layout.plan(f, e.name)
        assert t.kernel_format == fmt and t.array.nbytes == nbytes and t.array.ptr % 128 == 0, e.name
        vq_names |= {e.name, vq.gain_name(e.name), vq.hi_name(e.name), vq.codebook_name(e.layer)}
    span = sum(t.nbytes for t in f.tensors.values())
    vq_file = sum(f.tensors[n].nbytes for n in vq_names if n in f.tensors)
    assert w.file_bytes <= span - vq_file + 256 * len(f.tensors)
    assert w.arena.weights_region.used <= w.file_bytes + w.extra_bytes
    # an expert's stream starts on a line, rows back to back: at V4 / V4.1 Flash's shapes no padding is needed
    # (the streams are whole 384-byte blocks), so the device streams are the file's bytes exactly
    assert vq_row_parts("vq12", 4096) == (768, 0) and vq_row_parts("vq13", 2048) == (384, 32)
    for rows, cols in ((2048, 4096), (4096, 2048), (2304, 5120), (5120, 2304)):
        assert vq_expert_bytes("vq12", rows, cols) == rows * cols // 64 * 12 and (rows * cols // 8) % 256 == 0


def test_vq_experts_match_the_reference(vq_gguf):
    """Without the model's FP8 / FP4 fake-quant (whose grid a value within rounding of a step may cross, as on
    every backend pair), so what differs is the kernels' fp32 summation order only: every position's logits within
    1e-4 of the largest, same top-1 - with the prefill block's experts on tensor cores (the default: x and h as
    three bf16 pieces; the prefill kernels of both widths ran, no rows kernel) and through the rows kernels."""
    nx = Numerics(fake_quant=False)
    ids = ids_for(256, 40, seed=5)
    want = run(RefModel(vq_gguf, numerics=nx), ids, 32)
    m = open_model(vq_gguf, backend="cuda-emu", numerics=nx)
    for mma in (True, False):
        m.rt.launch_counts.clear()
        m.options = m.options.but(prefill_vq_expert_mma=mma)
        got = run(m, ids, 32)
        ran = {k for k, n in m.rt.launch_counts.items() if n}
        prefill = {f"moe_prefill_{s}_vq{b}" for s in ("gate_up", "down") for b in (12, 13)}
        rows = {f"moe_{s}_rows_vq{b}" for s in ("gate_up", "down") for b in (12, 13)}
        assert (prefill <= ran, rows <= ran) == (mma, not mma), sorted(ran)
        a = compare(got, want)
        rel = (np.abs(got.astype(np.float64) - want).max(1) / np.abs(want).max(1)).max()
        print(f"VQ-8 (13/12-bit), cuda-emu vs ref, no fake-quant (prefill 32, decode 8), experts "
              f"{'on tensor cores' if mma else 'rows kernels'}: {a}; max relative {rel:.1e}")
        assert a.top1 == 1.0, a
        assert rel <= 1e-4 and a.median_rel <= 1e-5, a


@pytest.fixture(scope="module")
def odd_widths_gguf(tmp_path_factory) -> str:
    """The same source through quantize-vq at widths other than the seed's: 11 bits in layer 0, 7 after (index
    fields that cross bytes: 7 / 11 bytes per run of 8)."""
    from ds4py.tiny import make_tiny
    from ds4py.vq.quantize import Options, quantize_vq

    d = tmp_path_factory.mktemp("vqodd")
    src, out = d / "src.gguf", d / "vq7-11.gguf"
    make_tiny(str(src), seed=7, experts="mxfp4", **SHAPE)
    quantize_vq(str(src), str(out), Options(**dict(SEED_WIDTHS, bits=7, bits_shallow=11)), progress=False)
    return str(out)


def test_other_widths_match_the_reference(odd_widths_gguf):
    """quantize-vq writes 6 .. 13 bits and the CUDA engine reads them all (no refusal): a 11 / 7-bit file on
    cuda-emu = the reference as the seed's widths do (fp32 summation order only), the prefill block on the VQ
    tensor-core kernels and the decode steps on the persistent VQ kernels of both widths."""
    f = GGUFFile(odd_widths_gguf)
    assert [vq.read_layer(f, L).header.bits for L in range(3)] == [11, 7, 7]
    nx = Numerics(fake_quant=False)
    ids = ids_for(256, 40, seed=6)
    want = run(RefModel(odd_widths_gguf, numerics=nx), ids, 32)
    m = open_model(odd_widths_gguf, backend="cuda-emu", numerics=nx)
    got = run(m, ids, 32)
    ran = {k for k, n in m.rt.launch_counts.items() if n}
    need = {f"moe_prefill_{s}_vq{b}" for s in ("gate_up", "down") for b in (7, 11)}
    need |= {f"moe_{s}_vq{b}" for s in ("gate_up", "down") for b in (7, 11)}
    assert need <= ran, sorted(need - ran)
    a = compare(got, want)
    rel = (np.abs(got.astype(np.float64) - want).max(1) / np.abs(want).max(1)).max()
    print(f"VQ-8 (11/7-bit), cuda-emu vs ref, no fake-quant (prefill 32, decode 8): {a}; max relative {rel:.1e}")
    assert a.top1 == 1.0, a
    assert rel <= 1e-4 and a.median_rel <= 1e-5, a


def test_rows_are_bit_identical_to_single_steps(vqm):
    V = vqm.config.vocab_size
    prompts = [ids_for(V, n, seed=80 + n) for n in (4, 7)]
    nxt = ids_for(V, 2, seed=89)
    states, twins = [], []
    for p in prompts:
        a, b = vqm.new_state(), vqm.new_state()
        vqm.step([a], [p])
        vqm.step([b], [p])
        states.append(a)
        twins.append(b)
    got = vqm.step(states, [[int(t)] for t in nxt])
    with temporarily(vqm, multirow=False):
        for j, b in enumerate(twins):
            assert got[j].tobytes() == vqm.step([b], [[int(nxt[j])]])[0].tobytes(), f"row {j}: batched != alone"


def _tokens(model, prompt, n=10):
    s = Session(model, NullTokenizer(), 1024)
    prm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    return [e.token_id for e in s.generate(prompt, prm) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("which", ["mtp-mxfp4", "mtp-vq"])
def test_speculation_with_the_v4_mtp_block_on_a_vq_file(vqm, files, which):
    """Greedy speculative decoding = plain greedy, token for token, with the MTP block's experts as made and
    with them through quantize-vq too (the draft block at --bits: 12)."""
    path = files[1] if which == "mtp-mxfp4" else files[2]
    f = GGUFFile(path)
    assert vq.is_vq(f, "mtp.0.ffn_up_exps.weight") == (which == "mtp-vq")
    if which == "mtp-vq":
        assert vq.read_layer(f, "mtp.0").header.bits == 12
    prompt = [0, 17, 42, 99, 3]
    want = _tokens(vqm, prompt)
    spec = MtpSpec(vqm, open_mtp(vqm, path), fixed_k=3)
    assert _tokens(spec, prompt) == want
    assert spec.stats.drafted >= 1


def test_the_vq_mtp_block_matches_the_reference(vqm, files):
    """The VQ-8 MTP block's logits on cuda-emu = the reference's on the same file, to fp32 noise."""
    ref = RefModel(files[0])
    cm, rm = open_mtp(vqm, files[2]), open_mtp(ref, files[2])
    cfg = vqm.config
    H = np.random.default_rng(1).standard_normal((3, cfg.hc_mult, cfg.dim)).astype(np.float32)
    lc, hc = cm.step([cm.new_state()], [H], [[5, 7, 9]], all_logits=True)
    lr, hr = rm.step([rm.new_state()], [H], [[5, 7, 9]], all_logits=True)
    rel = float(np.abs(lc[0] - lr[0]).max() / np.abs(lr[0]).max())
    print(f"VQ-8 MTP block, cuda-emu vs ref (3 rows): max relative {rel:.1e}")
    assert rel <= 1e-4 and (lc[0].argmax(1) == lr[0].argmax(1)).all()


def _stack(vq_gguf):
    """A sidecar (gains on layer 2, a router bias on layer 1) and a post-training file stacked on it (gains on
    layer 1, a bias on layer 2), in memory as the fitters write them."""
    from ds4py.vq import sidecar as fmt

    base = RefModel(vq_gguf)
    cfg, r = base.config, np.random.default_rng(9)
    X, D = cfg.n_experts, cfg.dim
    shape = {"n_layers": cfg.n_layers, "n_experts": X, "dim": D}
    on = {"kind": "base", "fingerprint": base.fingerprint, "base_fingerprint": base.fingerprint}
    sc = fmt.Sidecar("sidecar", on, shape, {
        2: fmt.LayerEdit(gain_blocks=fmt.fp4_project(r.standard_normal((X, D)) * 0.3)),
        1: fmt.LayerEdit(bias=(r.standard_normal(X) * 0.5).astype(np.float32))})
    pt_on = {"kind": "sidecar", "fingerprint": sc.fingerprint, "base_fingerprint": base.fingerprint}
    pt = fmt.Sidecar("posttrain", pt_on, shape, {
        1: fmt.LayerEdit(gain_blocks=fmt.fp4_project(r.standard_normal((X, D)) * 0.2)),
        2: fmt.LayerEdit(bias=(r.standard_normal(X) * 0.5).astype(np.float32))})
    return base, sc, pt


def test_a_sidecar_and_post_training_stack_matches_the_reference(vq_gguf):
    base, sc, pt = _stack(vq_gguf)
    nx = Numerics(fake_quant=False)
    ids = ids_for(256, 24, seed=6)
    m = open_model(vq_gguf, backend="cuda-emu", numerics=nx, sidecar=sc, posttrain=pt)
    ref = RefModel(vq_gguf, numerics=nx, sidecar=sc, posttrain=pt)
    assert m.fingerprint == ref.fingerprint != base.fingerprint
    got, want = run(m, ids, 16), run(ref, ids, 16)
    a = compare(got, want)
    rel = (np.abs(got.astype(np.float64) - want).max(1) / np.abs(want).max(1)).max()
    print(f"VQ-8 + sidecar + post-training, cuda-emu vs ref (prefill 16, decode 8): {a}; max relative {rel:.1e}")
    assert a.top1 == 1.0 and rel <= 1e-4, a
    plain = run(RefModel(vq_gguf, numerics=nx), ids, 16)
    assert np.abs(plain - want).max() > 100 * np.abs(got - want).max()          # the stack changes the logits


def test_a_stale_pair_is_refused_in_one_sentence(vq_gguf):
    from ds4py.vq import sidecar as fmt

    _, sc, pt = _stack(vq_gguf)
    other = fmt.Sidecar("sidecar", sc.stacks_on, sc.shape, {2: fmt.LayerEdit(bias=np.ones(sc.shape["n_experts"],
                                                                                            np.float32))})
    with pytest.raises(fmt.SidecarError, match="was solved against another sidecar") as e:
        open_model(vq_gguf, backend="cuda-emu", sidecar=other, posttrain=pt)
    assert "\n" not in str(e.value)


def test_the_seeds_bytes_per_token_are_counted_as_the_engine_counts_them(tmp_path):
    """memory_plan.seed_bytes_per_token (no file) = the engine's weight_bytes_per_token() on a file made that way
    (make-tiny -> quantize-vq --dense q4_k at the seed's widths); then the count at V4 Flash's shapes."""
    from ds4py.config import ModelConfig
    from ds4py.cuda.memory_plan import seed_bytes_per_token
    from ds4py.tiny import make_tiny
    from ds4py.vq.quantize import Options, quantize_vq

    shape = dict(SHAPE, dim=512)
    src, out = tmp_path / "src.gguf", tmp_path / "seed.gguf"
    make_tiny(str(src), seed=8, experts="mxfp4", **shape)
    quantize_vq(str(src), str(out), Options(**SEED_WIDTHS, dense="q4_k"), progress=False)
    m = open_model(str(out), backend="cuda-emu")
    assert any(t.qtype.name == "Q4_K" for t in GGUFFile(str(out)).tensors.values())
    assert m.weight_bytes_per_token() == seed_bytes_per_token(m.config, shallow_layers=1)
    full = seed_bytes_per_token(ModelConfig.v4_flash(n_layers=43, dim=4096, vocab_size=129280, n_heads=64,
                                                     compress_ratios=[0, 0] + [4, 128] * 20 + [4]))
    print(f"V4 Flash, the seed's layout (VQ-8 13-bit x 14 layers, 12-bit the rest, q4_K dense): "
          f"{full / 1e9:.2f} GB per token")
    assert 3e9 < full < 9e9


def test_a_v41_vq_file_matches_the_reference(v41_gguf, tmp_path):
    """V4.1 (the golden v41-tiny, dim 256 and 128-wide experts: whole VQ runs) through quantize-vq at 12 bits (a
    thin codebook, no Lloyd round: ~10 s), without fake-quant: cuda-emu = the reference, the prefill block's experts
    on tensor cores (the default), then decode."""
    from ds4py.vq.quantize import Options, quantize_vq

    out = tmp_path / "v41-vq.gguf"
    quantize_vq(v41_gguf, str(out), Options(bits=12, min_pool=5, train_per_code=5, rounds=0), progress=False)
    nx = Numerics(fake_quant=False)
    ids = ids_for(512, 40, seed=5)
    m = open_model(str(out), backend="cuda-emu", numerics=nx)
    assert m.config.is_v41 and m.options.prefill_vq_expert_mma
    got = run(m, ids, 32)
    assert {"moe_prefill_gate_up_vq12", "moe_prefill_down_vq12"} <= {k for k, n in m.rt.launch_counts.items() if n}
    want = run(RefModel(str(out), numerics=nx), ids, 32)
    a = compare(got, want)
    rel = (np.abs(got.astype(np.float64) - want).max(1) / np.abs(want).max(1)).max()
    print(f"V4.1 VQ-8 (12-bit), cuda-emu vs ref, no fake-quant (prefill 32, decode 8): {a}; max relative {rel:.1e}")
    assert a.top1 == 1.0 and rel <= 1e-4 and a.median_rel <= 1e-5, a
