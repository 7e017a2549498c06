"""V4.1's DSpark draft on a GPU: the golden v41-tiny-dspark (converted as tests/conftest.py does; Engram tables from
the golden folder) with the stored taps feeding the draft against DeepSeek's official calls (`*_fp32_fixed_noquant`:
logits and confidence within 1e-4, the very drafted ids), a draft call replayed from its graph = its direct
launches bit for bit, and greedy speculation = plain greedy token for token. Skipped, with the reason, where the
golden data is not there (a device machine may hold only the repository)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_sizes import ON_EMULATOR

from helpers import GOLDEN, stub_tokenizer_json

TOL = 1e-4
# on the emulator (DS4PY_GPU_TESTS_ON_EMULATOR) tests/test_cuda_dspark.py runs the same checks in every suite (this
# file's code was checked on the emulator when written)
pytestmark = pytest.mark.skipif(ON_EMULATOR, reason="tests/test_cuda_dspark.py checks DSpark on the emulator")
S = "_fp32_fixed_noquant"


@pytest.fixture(scope="module")
def dspark(rt, tmp_path_factory):
    src = GOLDEN / "v41-tiny-dspark"
    if not (src / "model.safetensors").is_file():
        pytest.skip(f"no golden v41-tiny-dspark under {GOLDEN}")
    from ds4py.convert import convert_checkpoint
    from ds4py.cuda.engine import CudaModel
    from ds4py.model import Numerics

    d = tmp_path_factory.mktemp("dsparkgpu")
    path = str(d / "v41-tiny-dspark.gguf")
    convert_checkpoint(str(src), path, experts="mxfp4", dense="f32", tokenizer=stub_tokenizer_json(d / "tok.json"),
                       progress=False)
    m = CudaModel(path, runtime=rt, progress=False, engram_dir=str(src), numerics=Numerics(fake_quant=False))
    yield m, np.load(src / "cases.npz")
    m.close()


def test_dspark_draft_matches_the_official_calls(dspark):
    m, gold = dspark
    draft = m.open_dspark()
    P, h0, mh = int(gold["a_P"]), int(gold["a_main_hidden_start"]), gold[f"a_main_hidden{S}"]
    taps = np.zeros((h0 + len(mh), mh.shape[1]), np.float32)
    taps[h0:] = mh
    st = draft.new_state()
    draft.feed([st], [taps[:P]])
    for j, t in enumerate(gold["a_draft_positions"]):
        draft.feed([st], [taps[t:t + 1]])
        tok = int(gold[f"a_draft_input_ids{S}"][j])
        blk = draft.block(st, tok)
        _, lg, cf = draft.greedy(blk, tok, ids=gold[f"a_draft_output_ids{S}"][j])
        d = max(np.abs(lg - gold[f"a_draft_logits{S}"][j]).max(), np.abs(cf - gold[f"a_draft_confidence{S}"][j]).max())
        assert d <= TOL, f"call {j} on {m.rt.device.name}: |diff| {d:.2e}"
        assert np.array_equal(draft.greedy(blk, tok)[0], gold[f"a_draft_output_ids{S}"][j]), f"call {j}: ids"
    m.set_launch_mode(True, False)                  # direct launches: the same bits as the captured graph
    direct = m.open_dspark().block(st, 7).base
    m.set_launch_mode(True, True)
    graph = draft.block(st, 7)
    assert np.array_equal(draft.block(st, 7).base, graph.base) and np.array_equal(graph.base, direct)


def test_dspark_greedy_speculation_equals_plain(dspark):
    from ds4py.dspark import DSparkSpec

    m, gold = dspark
    prompt = [int(t) for t in gold["a_ids"][:20]]

    def greedy(model, n=12):
        st = model.new_state()
        lg, out = model.step([st], [prompt])[0], []
        for _ in range(n):
            out.append(int(np.argmax(lg)))
            lg = model.step([st], [[out[-1]]])[0]
        return out

    want = greedy(m)
    for k in (1, 4):
        from ds4py.sampling import SamplingParams
        from ds4py.session import Session, TokenEvent
        from spec_fakes import NullTokenizer

        spec = DSparkSpec(m, m.open_dspark(), fixed_k=k)
        prm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
        got = [e.token_id for e in Session(spec, NullTokenizer(), 256).generate(prompt, prm)
               if isinstance(e, TokenEvent)]
        assert got == want, f"k = {k} on {m.rt.device.name}"
