"""The CUDA engine (ds4py/cuda/engine.py) end to end on the CPU emulator (`--backend cuda-emu`), against the numpy
reference in the numerics it mirrors (fp32 activations, the model's FP8 / FP4 fake-quant, optionally F16 KV):

- the golden v4-tiny (converted as tests/conftest.py does: dense F32, MXFP4 experts) over 136 positions: the
  window ring wraps, the indexer selects 8 of up to 34 compressed rows, the first ratio-128 row is emitted at
  position 127 and attended after; ds4-tiny (Q8_0 / F16 dense, IQ2_XXS / Q2_K experts, 512-wide heads) over 32;
- graph replay = direct launches = PDL off, in other thread orders, with the side stream held until its join,
  and with the pdl check on every launch: bit-identical; a bucket growth re-captures;
- truncate, copy, save / load on the device state exact, and the blob loads in the reference and back;
- device-side generation (greedy = argmax of step's logits; a closed iterator leaves the state consistent; bad
  logits raise) and the session using it.

Budget: the emulator costs ~0.15 s per v4-tiny token and ~0.35 s per ds4-tiny token (2-core CPU time).
"""

from __future__ import annotations

import numpy as np
import pytest

from cuda_engine_checks import check, check_allowing_flips, compare, ids_for, run
from ds4py.cuda import emu
from ds4py.cuda.options import temporarily
from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.model import Numerics, device_generation, open_model
from ds4py.ref.engine import RefModel
from ds4py.sampling import InvalidLogits, SamplingParams

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def v4(v4_gguf):
    return open_model(v4_gguf, backend="cuda-emu")


@pytest.fixture(scope="module")
def v4_ref(v4_gguf):
    return RefModel(v4_gguf, kernels="dequant")


@pytest.fixture(scope="module")
def ds4_gguf(golden):
    return str(golden / "ds4-tiny" / "tiny.gguf")


# ---- agreement with the reference --------------------------------------------------------------------------
def test_v4_tiny_matches_the_reference(v4, v4_ref):
    ids = ids_for(256, 136)
    assert v4.backend == "cuda-emu"
    check(compare(run(v4, ids, 96), run(v4_ref, ids, 96)), "v4-tiny cuda-emu vs ref (prefill 96, decode 40)")


def test_ds4_tiny_matches_the_reference(ds4_gguf):
    # fp32 numerics: every kernel and weight format within summation noise; then the model's FP8 / FP4
    # fake-quant, where a KV value within fp32 noise of an e4m3 tie may round the other way, and every later
    # position sees that row (cuda_engine_checks.FLIP_ROW_REL)
    ids = ids_for(512, 32)
    fp32 = Numerics(fake_quant=False)
    m, ref = open_model(ds4_gguf, backend="cuda-emu", numerics=fp32), RefModel(ds4_gguf, numerics=fp32, kernels="dequant")
    check(compare(run(m, ids, 20), run(ref, ids, 20)), "ds4-tiny cuda-emu vs ref, no fake-quant")
    m, ref = open_model(ds4_gguf, backend="cuda-emu"), RefModel(ds4_gguf, kernels="dequant")
    check_allowing_flips(compare(run(m, ids, 20), run(ref, ids, 20)),
                         "ds4-tiny cuda-emu vs ref (prefill 20, decode 12)")


def test_f16_kv_without_fake_quant_matches_the_reference(v4_gguf):
    nx = Numerics(fake_quant=False, kv_dtype="f16")
    m, ref = open_model(v4_gguf, backend="cuda-emu", numerics=nx), RefModel(v4_gguf, numerics=nx, kernels="dequant")
    ids = ids_for(256, 24, seed=3)
    check(compare(run(m, ids, 16), run(ref, ids, 16)), "v4-tiny f16 KV, no fake-quant")


# ---- graphs, PDL, streams --------------------------------------------------------------------------------
def _logits_of(model, ids) -> np.ndarray:
    return run(model, ids, 6)


def test_graph_replay_direct_launches_and_pdl_are_bit_identical(v4, v4_gguf):
    """One recording, three ways to launch it, on runtimes that shuffle what a GPU may shuffle: replayed graphs
    with PDL (the default), direct launches without PDL in random thread order with the side stream held until
    its join, graphs with the pdl check on every kernel in reverse thread order. The positions cross a bucket
    (min bucket 8: captured at 8, then 16) so a growth re-captures."""
    from ds4py.cuda.emu_runtime import EmuRuntime

    ids = ids_for(256, 12, seed=5)
    with temporarily(v4, min_bucket=8):
        base = _logits_of(v4, ids)
    rt_b = EmuRuntime(order="random", seed=9, defer_side=True)
    b = open_model(v4_gguf, backend="cuda-emu", runtime=rt_b, pdl=False, graphs=False)
    b.options = b.options.but(min_bucket=8)
    rt_c = EmuRuntime(order="reverse", check_pdl=True)
    c = open_model(v4_gguf, backend="cuda-emu", runtime=rt_c)
    c.options = c.options.but(min_bucket=8)
    st = c.new_state()
    got_c = np.concatenate([c.step([st], [ids[:6]], all_logits=True)[0]] + [c.step([st], [[int(t)]])[0][None]
                                                                           for t in ids[6:]])
    assert np.array_equal(_logits_of(b, ids), base), "direct launches / no PDL / other order differ from graphs"
    assert np.array_equal(got_c, base), "graphs under the pdl check in reverse order differ"
    assert st.graph[0].captures == 1 and st.graph[0].tag.bucket == 16, "the bucket growth did not re-capture once"


def test_launches_per_step_and_the_side_stream(v4):
    n = v4.launches_per_step()
    cfg = v4.config
    assert n["head"] == 3 and n["side_stream"] > 0
    assert n["body"] <= 1 + 26 * cfg.n_layers, n          # the per-layer launch budget (docs/cuda.md)
    print(f"v4-tiny: {n}")


# ---- the state: truncate, copy, save / load -----------------------------------------------------------------
def test_truncate_copy_save_load_are_exact(v4):
    ids = ids_for(256, 30, seed=8)
    s = v4.new_state()
    v4.step([s], [ids[:20]])
    blob, c = v4.save_state(s), s.copy()
    ahead = v4.step([s], [ids[20:26]], all_logits=True)[0]
    s.truncate(20)
    assert np.array_equal(v4.step([s], [ids[20:26]], all_logits=True)[0], ahead), "truncate is not exact"
    assert np.array_equal(v4.step([c], [ids[20:26]], all_logits=True)[0], ahead), "copy is not exact"
    loaded = v4.load_state(blob)
    assert loaded.n_tokens == 20 and v4.save_state(loaded) == blob, "a save / load round trip changed the blob"
    assert np.array_equal(v4.step([loaded], [ids[20:26]], all_logits=True)[0], ahead), "load_state is not exact"
    assert s.nbytes() == c.nbytes() > 0
    with pytest.raises(Ds4Error, match="earliest"):
        s.truncate(s.rollback_floor - 1)


def test_states_move_between_backends(v4, v4_ref):
    """A blob saved by cuda-emu continues in the reference and vice versa, as close as the backends agree."""
    ids = ids_for(256, 26, seed=4)
    s, r = v4.new_state(), v4_ref.new_state()
    v4.step([s], [ids[:20]])
    v4_ref.step([r], [ids[:20]])
    want = v4_ref.step([r.copy()], [ids[20:]], all_logits=True)[0]
    from_cuda = v4_ref.step([v4_ref.load_state(v4.save_state(s))], [ids[20:]], all_logits=True)[0]
    from_ref = v4.step([v4.load_state(v4_ref.save_state(r))], [ids[20:]], all_logits=True)[0]
    for got in (from_cuda, from_ref):
        assert np.array_equal(got.argmax(1), want.argmax(1))
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_several_states_in_one_step(v4):
    ids = ids_for(256, 20, seed=6)
    a, b = v4.new_state(), v4.new_state()
    la, lb = v4.step([a, b], [ids[:7], ids[7:10]])
    assert np.array_equal(la, v4.step([v4.new_state()], [ids[:7]])[0])
    assert np.array_equal(lb, v4.step([v4.new_state()], [ids[7:10]])[0])
    assert (a.n_tokens, b.n_tokens) == (7, 3)


# ---- device-side generation ---------------------------------------------------------------------------------
def test_greedy_generation_equals_argmax_of_step(v4):
    ids = ids_for(256, 10, seed=2)
    g, h = v4.new_state(), v4.new_state()
    v4.step([g], [ids[:-1]])
    v4.step([h], [ids[:-1]])
    got = list(v4.generate(g, int(ids[-1]), GREEDY, 5))
    want, tok = [], int(ids[-1])
    for _ in range(5):
        tok = int(np.argmax(v4.step([h], [[tok]])[0]))
        want.append(tok)
    assert got == want
    assert g.n_tokens == h.n_tokens == 9 + 5      # ids[-1] and 4 sampled tokens: the last one is not fed
    # the state after generation continues exactly like the state fed by step()
    g2, h2 = v4.new_state(), v4.new_state()
    v4.step([g2], [ids[:-1]])
    v4.step([h2], [ids[:-1]])
    toks = list(v4.generate(g2, int(ids[-1]), GREEDY, 3))
    v4.step([h2], [[int(ids[-1])] + toks[:-1]])
    assert np.array_equal(v4.step([g2], [[toks[-1]]])[0], v4.step([h2], [[toks[-1]]])[0])


def test_closing_a_generation_early_and_sampling(v4):
    s = v4.new_state()
    v4.step([s], [[1, 2, 3]])
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    it = v4.generate(s, 4, params, 10)
    first = [next(it), next(it)]
    with pytest.raises(Ds4Error, match="being generated"):
        v4.step([s], [[1]])
    it.close()
    assert s.n_tokens == 3 + 2 and not s.busy
    again = v4.new_state()
    v4.step([again], [[1, 2, 3]])
    assert list(v4.generate(again, 4, params, 2)) == first       # seeded: the same draws
    assert all(0 <= t < 256 for t in first)
    with pytest.raises(ContextLengthError):
        v4.generate(s, 1, params, v4.config.context_length)
    with pytest.raises(Ds4Error, match="vocabulary"):
        v4.generate(s, 256, params, 1)


def test_invalid_logits_raise(v4_gguf):
    m = open_model(v4_gguf, backend="cuda-emu")
    norm = m.w.binding.output_norm.array
    norm.upload(np.full(norm.shape, np.nan, np.float32))
    s = m.new_state()
    with pytest.raises(InvalidLogits):
        list(m.generate(s, 3, GREEDY, 3))
    assert s.n_tokens == 0 and not s.busy


def test_the_session_generates_on_the_device(v4, v4_ref):
    from ds4py.session import Session, TokenEvent

    class Tok:                                                   # token ids as text
        eos_id = 1

        def stream(self):
            class S:
                def push(self, t):
                    return f"<{t}>"

                def flush(self):
                    return ""
            return S()

    assert device_generation(v4) is not None and device_generation(v4_ref) is None
    prompt = [int(t) for t in ids_for(256, 9, seed=12) if t != 1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = {}
    for name, model in (("cuda", v4), ("ref", v4_ref)):
        sess = Session(model, Tok(), ctx_size=512)
        ev = list(sess.generate(prompt, params))
        out[name] = [e.token_id for e in ev if isinstance(e, TokenEvent)]
        assert sess.state.n_tokens == len(sess.tokens) == len(prompt) + 5
        assert sess.stats.decoded_tokens == 5
    assert out["cuda"] == out["ref"]
    # the next turn reuses the live state (prompt + completion[:-1])
    sess = Session(v4, Tok(), ctx_size=512)
    first = [e.token_id for e in sess.generate(prompt, params) if isinstance(e, TokenEvent)]
    nxt = prompt + first + [5]
    list(sess.generate(nxt, SamplingParams(temperature=0, max_tokens=2)))
    assert sess.stats.cached_tokens == len(prompt) + len(first) - 1
