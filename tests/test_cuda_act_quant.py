"""The CUDA engine under the int8-activation numerics (Numerics.act_quant, = the reference's `--act-quant` mode) on
the CPU emulator, against the numpy reference in the same numerics:

- ds4-tiny (Q8_0 / F16 dense, IQ2_XXS / Q2_K experts: the int8 expert kernels, the rounded copies before the Q8_0
  GEMVs, the prefill block's GEMMs on rounded x) and v4-tiny (F32 dense: nothing rounded; MXFP4 experts: x and h
  rounded as Q8_0 before the fp32 kernels), prefill then decode: every position within fp32 noise of the reference,
  while the exact numerics are far outside that bound (so the check sees a missing or wrong rounding);
- rows = single steps: several sequences in one multi-row step, and a verify chunk, bit-identical to the same rows
  stepped one at a time (the int8 rows kernels are the decode kernels' arithmetic).

Why a share of the positions: a rounding to int8 is discontinuous, so a value within fp32 noise of a rounding
boundary (a code's half) takes one code in one backend and the next in the other, and that position and every later
one that sees the row is ~1e-2 off (the reference's own compiled int8 kernels leave its dequant path the same way:
ds4-tiny, 24 positions, 2.4e-2 median after the first flip, 1.5e-7 before). ds4-tiny rounds ~10^4 values a
position, so such a flip comes every few positions: the check takes 6 short prompts (a flip spreads only within its
own) and asks a share of the positions to agree at fp32 noise (measured on ds4-tiny: 14 of 32 at ~4e-7, the others
7e-4 .. 5e-2; v4-tiny, its experts the only rounded products: 29 of 32), which no position does with a rounding
missing or wrong (the exact numerics: none within 1e-4).

Budget: ~0.35 s of emulator per ds4-tiny token, ~0.15 s per v4-tiny token (2-core CPU time)."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_engine_checks import ids_for
from ds4py.cuda import emu
from ds4py.cuda.options import temporarily
from ds4py.model import Numerics, open_model
from ds4py.ref.engine import RefModel

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
AQ = Numerics(fake_quant=False, act_quant=True)        # no FP8 fake-quant: its own near-tie flips stay out
NEAR = 1e-4                                            # relative max |d logit| of a position (measured ~1.5e-7)
NEAR_SHARE = 0.25                                      # ... at this share of the positions at least
HORIZON = 1                                            # so that a 3-token prompt is a prefill block (BLOCK rows)
FLIP_REL = 0.1                                         # a position with a near-tie flip (measured <= 3e-2)


@pytest.fixture(scope="module")
def ds4_gguf(golden):
    return str(golden / "ds4-tiny" / "tiny.gguf")


@pytest.fixture(scope="module")
def ds4_aq(ds4_gguf):
    return open_model(ds4_gguf, backend="cuda-emu", numerics=AQ)


def _blocks(path: str):
    """path's act_quant CUDA model whose prompts of 3 and more tokens run as prefill blocks."""
    return open_model(path, backend="cuda-emu", numerics=AQ, rollback_horizon=HORIZON)


def _positions(model, prompts) -> np.ndarray:
    """Each prompt: its first len - 1 ids as one prefill step (all logits), then the last as a decode step."""
    out = []
    for ids in prompts:
        st = model.new_state()
        out.append(model.step([st], [ids[:-1]], all_logits=True)[0])
        out.append(model.step([st], [[int(ids[-1])]])[0][None])
    return np.concatenate(out)


def _rel(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - want).max(1) / np.abs(want).max(1)


@pytest.mark.parametrize("which", ["ds4-tiny", "v4-tiny"])
def test_act_quant_matches_the_reference(which, ds4_aq, ds4_gguf, v4_gguf):
    """Each prompt: 3 tokens through a prefill block (the GEMMs on rounded x, the int8 grouped rows experts), then a
    decode step (the int8 GEMVs and expert kernels)."""
    path = ds4_gguf if which == "ds4-tiny" else v4_gguf
    model = _blocks(path)
    assert model.numerics.act_quant
    V = model.config.vocab_size
    prompts = [ids_for(V, 4, seed=70 + j) for j in range(8)]
    got = _positions(model, prompts)
    want = _positions(RefModel(path, numerics=AQ, kernels="dequant", rollback_horizon=HORIZON), prompts)
    rel = _rel(got, want)
    print(f"{which} act_quant cuda-emu vs ref, per position: {np.array2string(rel, precision=1)}")
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9, f"{which}: top-1 differs at too many positions"
    assert (rel <= NEAR).mean() >= NEAR_SHARE, f"{which}: too few positions within fp32 noise of the reference"
    assert rel.max() <= FLIP_REL, f"{which}: a position off beyond a rounding flip: {rel.max():.2e}"
    exact = _positions(RefModel(path, numerics=Numerics(fake_quant=False), kernels="dequant",
                                rollback_horizon=HORIZON), prompts)
    assert not (_rel(exact, want) <= NEAR).any()         # the check sees the rounding


def _single(model, st, ids) -> np.ndarray:
    with temporarily(model, multirow=False):
        return np.stack([model.step([st], [[int(t)]])[0] for t in ids])


def test_act_quant_rows_are_bit_identical_to_single_steps(ds4_aq):
    m = ds4_aq
    V = m.config.vocab_size
    seqs = []
    for j, n in enumerate([3, 5]):
        ids = ids_for(V, n, seed=80 + j)
        a, b = m.new_state(), m.new_state()
        _single(m, a, ids)
        _single(m, b, ids)
        seqs.append((a, b))
    nxt = [ids_for(V, 2, seed=90 + j) for j in range(2)]
    for t in range(2):                                   # two sequences, one row each, in one step
        got = m.step([a for a, _ in seqs], [[int(n[t])] for n in nxt])
        for j, (_, b) in enumerate(seqs):
            assert got[j].tobytes() == _single(m, b, [nxt[j][t]])[0].tobytes(), f"step {t} row {j}: rows != alone"
    (a, a2), (b, b2) = seqs
    draft, other = ids_for(V, 3, seed=95), ids_for(V, 1, seed=96)
    got_a, got_b = m.step([a, b], [draft, other], all_logits=True)      # a verify chunk beside another row
    assert got_a.tobytes() == _single(m, a2, draft).tobytes(), "verify rows != position-by-position steps"
    assert got_b.tobytes() == _single(m, b2, other).tobytes()


def test_run_act_quant_on_cuda_emu_is_the_in_process_model(ds4_gguf):
    """`run --backend cuda-emu --act-quant`: the greedy continuation of the CUDA engine under Numerics.ds4()
    in-process, one stderr line naming the numerics; the emulator made as a device whose declared default is
    int8 ($DS4PY_EMU_DEVICE; H200's while fp32 misses its target) runs the same without the flag, its line saying
    why; --exact with --act-quant is one sentence."""
    import os
    import subprocess
    import sys

    from ds4py.cli._options import OPT_IN_INT8_LINE, device_line
    from ds4py.cuda.devices import PROFILES, default_numerics
    from ds4py.sampling import SamplingParams
    from ds4py.session import Session, TokenEvent
    from ds4py.tokenizer import Tokenizer

    prompt = "Hello there"
    tok = Tokenizer.from_gguf(ds4_gguf)
    ids = [tok.bos_id] + list(tok.encode(prompt))
    session = Session(open_model(ds4_gguf, backend="cuda-emu", numerics=Numerics.ds4()), tok, 256)
    want = "".join(e.text for e in session.generate(ids, SamplingParams(temperature=0, max_tokens=4))
                   if isinstance(e, TokenEvent))

    def cli(*argv, device=None):
        env = {k: v for k, v in os.environ.items() if k != "DS4PY_EMU_DEVICE"}
        return subprocess.run([sys.executable, "-m", "ds4py", "run", "--raw", "-m", ds4_gguf, "--backend", "cuda-emu",
                               *argv, "-p", prompt, "--temp", "0", "-n", "4"], capture_output=True, text=True,
                              timeout=600, env={**env, **({"DS4PY_EMU_DEVICE": device} if device else {})})

    out = cli("--act-quant")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    assert out.stderr.count("ds4py: numerics:") == 1 and OPT_IN_INT8_LINE in out.stderr, out.stderr
    int8 = [k for k, p in PROFILES.items() if p.act_numerics == "int8"]
    if int8:                    # the device-default path of the CLI, end to end (plan-only rule: devices.py)
        out = cli(device=int8[0])
        assert out.returncode == 0, out.stderr
        assert out.stdout == want + "\n"
        line = device_line(True, default_numerics(PROFILES[int8[0]], emulated=True).why)
        assert out.stderr.count("ds4py: numerics:") == 1 and line in out.stderr, out.stderr
    bad = cli("--act-quant", "--exact")
    assert bad.returncode == 2 and "contradict" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
