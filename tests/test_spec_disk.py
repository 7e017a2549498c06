"""The paired main + MTP state on disk (ds4py/spec.py encode_pair / SpecModel.save_state): a round trip continues
exactly, a stale or foreign blob is refused in one sentence, and the disk KV cache (`--kv-disk-dir`) works with
speculation: a cold checkpoint survives a restart and the answer is plain greedy decoding's, a continued one
resumes a conversation. Reference backend (v4-tiny-mtp) and the CUDA engine on the emulator."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.errors import Ds4Error
from ds4py.disk_cache import DiskCache, KVCachePolicy
from ds4py.model import Numerics, open_model, open_mtp
from ds4py.sampling import SamplingParams
from ds4py.session import Session, TokenEvent
from ds4py.spec import SpecModel, decode_pair, encode_pair
from ds4py.mtp_spec import MtpSpec
from spec_fakes import NullTokenizer

POLICY = KVCachePolicy(min_tokens=16, trim_tokens=4, align_tokens=16, continued_interval=32)


@pytest.fixture(scope="module")
def ref(v4_mtp_gguf):
    m = open_model(v4_mtp_gguf[0])
    return m, open_mtp(m, v4_mtp_gguf[1])


def _answer(session, prompt, n=8):
    prm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    return [e.token_id for e in session.generate(prompt, prm) if isinstance(e, TokenEvent)]


def _disk(path, model):
    return DiskCache(path, 64.0, model, policy=POLICY, asynchronous=False)


def test_paired_state_round_trip_and_refusals(ref, v4_mtp_gguf):
    m, mtp = ref
    spec = MtpSpec(m, mtp)
    st = spec.new_state()
    spec.step([st], [list(range(3, 30))])
    for t in (4, 5):
        spec.step([st], [[t]])
    blob = spec.save_state(st)
    back = spec.load_state(blob)
    assert (back.n_tokens, back.n_written, back.draft.n_tokens) == (st.n_tokens, st.n_written, st.draft.n_tokens)
    assert np.array_equal(back.h, st.h) and np.array_equal(back.ids, st.ids)
    assert np.array_equal(spec.step([back], [[9]])[0], spec.step([st], [[9]])[0])
    # the draft states agree too: the next draft's logits, bit for bit
    a = spec.mtp.step([back.draft], [back.h[[back.draft.n_tokens % spec.capacity]]], [[9]])[0][0]
    b = spec.mtp.step([st.draft], [st.h[[st.draft.n_tokens % spec.capacity]]], [[9]])[0][0]
    assert np.array_equal(a, b)
    with pytest.raises(Ds4Error, match="main model alone"):
        spec.load_state(m.save_state(st.main))
    with pytest.raises(Ds4Error, match="checksum"):
        spec.load_state(blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])
    with pytest.raises(Ds4Error, match="truncated"):
        spec.load_state(blob[:-8])
    other = MtpSpec(open_model(v4_mtp_gguf[0], numerics=Numerics(fake_quant=False)), mtp)
    with pytest.raises(Ds4Error, match="numerics"):             # the inner blob checks its own numerics
        other.load_state(encode_pair(other.fingerprint, *decode_pair(blob, spec.fingerprint)))
    stale = encode_pair("0" * 40, *decode_pair(blob, spec.fingerprint))
    with pytest.raises(Ds4Error, match="another main model or MTP block") as e:
        spec.load_state(stale)
    assert str(e.value).count(".") <= 1 and "\n" not in str(e.value)
    with pytest.raises(Ds4Error, match="bytes"):
        spec.load_state("nope")
    assert spec.fingerprint not in (m.fingerprint, mtp.fingerprint)


def test_disk_cache_with_speculation_cold_and_continued(tmp_path, ref):
    m, mtp = ref
    prompt = np.random.default_rng(7).integers(2, 256, 40).tolist()
    plain = _answer(Session(m, NullTokenizer(), 1024), prompt)
    s = Session(MtpSpec(m, mtp), NullTokenizer(), 1024, disk=_disk(tmp_path, MtpSpec(m, mtp)))
    assert _answer(s, prompt) == plain
    assert [(e.n_tokens, e.reason) for e in s.disk.entries()] == [(32, "cold")]
    s.close()                                            # shutdown: the live paired state
    again = Session(MtpSpec(m, mtp), NullTokenizer(), 1024, disk=_disk(tmp_path, MtpSpec(m, mtp)))
    assert _answer(again, prompt) == plain
    # the shutdown checkpoint (prompt + answer[:-1]) runs past the prompt by less than the rollback horizon: it is
    # loaded and truncated (the paired state too), serving all but the prompt's last token
    assert again.last_source == "disk" and again.last_cached == len(prompt) - 1
    follow = prompt + plain[:-1] + [7, 8]                # the conversation goes on from the shutdown checkpoint
    third = Session(MtpSpec(m, mtp), NullTokenizer(), 1024, disk=_disk(tmp_path, MtpSpec(m, mtp)))
    want = _answer(Session(m, NullTokenizer(), 1024), follow)
    assert _answer(third, follow) == want
    assert third.last_source == "disk" and third.last_cached == len(prompt) + len(plain) - 1
    # the main model alone does not see the pair's checkpoints (another fingerprint), nor the other way round
    assert _disk(tmp_path, m).best(prompt) is None


def test_disk_cache_with_speculation_on_the_cuda_engine(tmp_path, v4_mtp_gguf):
    from ds4py.cuda import emu

    if emu.compiler() is None:
        pytest.skip("the CUDA emulator needs g++")
    m = open_model(v4_mtp_gguf[0], backend="cuda-emu")
    spec = MtpSpec(m, open_mtp(m, v4_mtp_gguf[1]))
    prompt = np.random.default_rng(8).integers(2, 256, 20).tolist()
    plain = _answer(Session(m, NullTokenizer(), 1024), prompt, 3)
    s = Session(spec, NullTokenizer(), 1024, disk=_disk(tmp_path, spec))
    assert _answer(s, prompt, 3) == plain and [e.reason for e in s.disk.entries()] == ["cold"]
    again = Session(spec, NullTokenizer(), 1024, disk=_disk(tmp_path, spec))
    assert _answer(again, prompt, 3) == plain and again.last_source == "disk" and again.last_cached == 16


def test_serve_builds_a_speculative_engine_with_the_disk_cache(tmp_path):
    """`serve --mtp … --kv-disk-dir …` is no longer refused: the engine's session decodes speculatively and its
    disk cache is keyed by the pair's fingerprint; with `--sessions` the pool's sessions are speculative too."""
    from ds4py.cli.serve import make_engine
    from ds4py.server.toolmemory import ToolMemory
    from ds4py.tiny import make_tiny

    path, mtp = str(tmp_path / "t.gguf"), str(tmp_path / "t.mtp.gguf")
    make_tiny(path, seed=3, mtp=mtp, fast=True)
    engine = make_engine(path, "ref", 256, ToolMemory(), mtp=mtp, kv_disk_dir=str(tmp_path / "kv"))
    assert isinstance(engine.session.model, SpecModel)
    assert engine.session.disk is not None and engine.session.disk.fingerprint == engine.session.model.fingerprint
    pooled = make_engine(path, "ref", 256, ToolMemory(), mtp=mtp, sessions=2, kv_disk_dir=str(tmp_path / "kv"))
    assert isinstance(pooled.pool.model, SpecModel) and pooled.pool.disk is not None   # rounds inside the batches
