"""The engine contract (ds4py.model): batched steps equal separate calls, truncate is exact (across compressor
group boundaries of every ratio and the window ring's edge), saved states continue exactly and bad blobs are
refused, bad steps change no state, the declared state layout follows the config's predicates.

The first section runs on every backend (`backend` parameter: ref, and the CUDA engine on the CPU emulator,
cuda-emu, kept cheap: golden v4-tiny, a few dozen tokens); the rest are the reference's deeper checks (long
prompts, every ratio's boundaries, dequantisation counts)."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import numpy as np
import pytest

import ds4py.ref.weights as ref_weights
from ds4py.config import ModelConfig
from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.fingerprint import file_fingerprint
from ds4py.kv import RING, ROWS, state_layout
from ds4py.model import Capabilities, Numerics, WeightBytes, open_model
from ds4py.ref.engine import RefModel
from ds4py.tiny import make_tiny

ATOL = 2e-3              # fake_quant off: batched vs separate differ by float summation order only
FP32 = Numerics(fake_quant=False)


@pytest.fixture(scope="module")
def ds4_gguf(golden):
    return str(golden / "ds4-tiny" / "tiny.gguf")


@pytest.fixture(scope="module")
def v4_ids(golden):
    return np.load(golden / "v4-tiny" / "cases.npz")["c_ids"]              # 300 ids


@pytest.fixture(scope="module")
def ds4_ids(golden):
    return np.load(golden / "ds4-tiny" / "cases.npz")["rand_300_p200/ids"]


# ---- the contract on every backend ------------------------------------------------------------------------------
def _emulator_missing() -> str | None:
    from ds4py.cuda import emu

    return None if emu.compiler() is not None else "the CUDA emulator (cuda-emu) needs g++"


BACKENDS = [pytest.param("ref"),
            pytest.param("cuda-emu", marks=pytest.mark.skipif(_emulator_missing() is not None,
                                                               reason=str(_emulator_missing())))]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def contract_model(backend, v4_gguf):
    """golden v4-tiny (window 16, ratios 0,0,4,128,4,128,4) opened with `backend`, default numerics."""
    return open_model(v4_gguf, backend=backend)


def test_every_backend_declares_the_contract(contract_model):
    m = contract_model
    assert isinstance(m.capabilities, Capabilities) and m.stable_rows >= 1
    w = m.weight_bytes()
    assert isinstance(w, WeightBytes) and w.decode == m.weight_bytes_per_token() and 0 < w.routed < w.decode
    assert m.gguf is not None and m.has_mtp_block() is False       # v4-tiny's file holds no mtp.0.* tensors
    assert m.new_request(None) is None                             # a backend decodes plainly; SpecModel speculates


def test_batched_step_equals_separate_calls_on_every_backend(contract_model, v4_ids):
    """Three prompts of different lengths in one step, then their decode rows together, with a fourth prompt
    joining the second decode step: every sequence's logits equal its separate calls bit for bit."""
    m, ids = contract_model, v4_ids
    seqs, P, D = [ids[0:], ids[40:], ids[90:]], [9, 5, 1], 2
    want = separate(m, seqs, P, D)
    late, late_p = ids[200:], 6
    want_late = m.prefill(m.new_state(), late[:late_p])
    states = [m.new_state() for _ in seqs]
    got = [[r] for r in m.step(states, [s[:p] for s, p in zip(seqs, P)])]
    late_state = m.new_state()
    for j in range(D):
        sts, chunks = states, [[int(s[p + j])] for s, p in zip(seqs, P)]
        if j == 1:
            sts, chunks = states + [late_state], chunks + [late[:late_p]]
        res = m.step(sts, chunks)
        for i in range(len(seqs)):
            got[i].append(res[i])
        if j == 1:
            np.testing.assert_array_equal(res[-1], want_late)
    for i in range(len(seqs)):
        np.testing.assert_array_equal(np.array(got[i]), np.array(want[i]), err_msg=f"sequence {i}")
        assert states[i].n_tokens == P[i] + D
    rows = m.step([m.new_state(), m.new_state()], [seqs[0][:4], seqs[1][:2]], all_logits=True)
    assert [r.shape for r in rows] == [(4, m.config.vocab_size), (2, m.config.vocab_size)]


def test_truncate_then_redecode_is_exact_on_every_backend(contract_model, v4_ids):
    """Decode across ratio-4 group ends and the window ring's wrap (16 + R = 32 slots), roll back within the
    horizon, decode again: bit-identical logits; truncate changes only the counters; below the floor refused."""
    m, ids = contract_model, v4_ids
    P, end = 26, 34
    st = m.new_state()
    m.prefill(st, ids[:P])
    first = decode_all(m, st, ids[P:end])
    assert st.rollback_floor == end - m.rollback_horizon
    for n in (end - 6, end - 1):
        again = st.copy()
        again.truncate(n)
        for k, got in enumerate(decode_all(m, again, ids[n:end])):
            np.testing.assert_array_equal(got, first[n - P + k], err_msg=f"truncate({n}), position {n + k}")
    with pytest.raises(Ds4Error, match="earliest"):
        st.truncate(st.rollback_floor - 1)
    st.truncate(end - 2)
    assert (st.n_tokens, st.n_written) == (end - 2, end)


def test_save_load_and_bad_blobs_on_every_backend(contract_model, v4_gguf, v4_ids):
    m, ids = contract_model, v4_ids
    st = m.new_state()
    m.prefill(st, ids[:30])
    decode_all(m, st, ids[30:34])
    st.truncate(32)                                             # n_written 34 > n_tokens 32: the blob keeps both
    blob = m.save_state(st)
    loaded = m.load_state(blob)
    assert (loaded.n_tokens, loaded.n_written) == (32, 34) and m.save_state(loaded) == blob
    np.testing.assert_array_equal(np.array(decode_all(m, loaded, ids[32:35])),
                                  np.array(decode_all(m, st.copy(), ids[32:35])))
    for bad, match in ((blob[:len(blob) // 2], "truncated"), (blob[:20] + bytes([blob[20] ^ 1]) + blob[21:],
                                                                "corrupted|truncated or padded"),
                       ("a string", "is bytes")):
        with pytest.raises(Ds4Error, match=match):
            m.load_state(bad)
    with pytest.raises(Ds4Error, match="other numerics"):
        RefModel(v4_gguf, numerics=FP32).load_state(blob)
    with pytest.raises(Ds4Error, match="layout differs"):
        RefModel(v4_gguf, rollback_horizon=4).load_state(blob)
    ref = RefModel(v4_gguf)                                      # the blob is backend-neutral
    moved = ref.load_state(blob)
    assert (moved.n_tokens, moved.n_written) == (32, 34)
    assert int(np.argmax(ref.decode(moved, int(ids[32])))) == int(np.argmax(m.decode(m.load_state(blob),
                                                                                    int(ids[32]))))


def test_bad_steps_are_refused_and_change_no_state_on_every_backend(contract_model):
    m = contract_model
    a, b = m.new_state(), m.new_state()
    m.prefill(a, [0, 5, 6])
    V = m.config.vocab_size
    cases = [(([a, b], [[1]]), "one chunk per state"), (([a, a], [[1], [2]]), "same state appears twice"),
             (([a, b], [[1], [2, V]]), f"sequence 1: token id {V} at index 1 is outside the vocabulary"),
             (([a, b], [[1], []]), "sequence 1: token ids must be a non-empty"),
             (([a], [[1.5]]), "integers"), (([object()], [[1]]), "expected a "), (([], []), "at least one state"),
             (([a, b], [[1] * (m.config.context_length - 2), [3]]), "sequence 0: 3 \\+ ")]
    for (states, chunks), match in cases:
        with pytest.raises(Ds4Error, match=match):
            m.step(states, chunks)
    assert (a.n_tokens, b.n_tokens) == (3, 0)
    with pytest.raises(Ds4Error, match="expected a "):
        m.save_state("state")
    if not m.capabilities.device_generation:
        with pytest.raises(Ds4Error, match="no device-side generation"):
            m.generate(a, 1, None, 1)
    if not m.capabilities.launch_counts:
        with pytest.raises(Ds4Error, match="no kernels"):
            m.launches_per_step()


def separate(model, ids_list, n_prompt, n_decode):
    """Per sequence: prefill ids[:P_i], then decode n_decode tokens teacher-forced; logits per call."""
    out = []
    for ids, P in zip(ids_list, n_prompt):
        st = model.new_state()
        out.append([model.prefill(st, ids[:P])] + [model.decode(st, int(t)) for t in ids[P:P + n_decode]])
    return out


# ---- batched step -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["ds4", "v4"])
def test_batched_step_equals_separate_calls(which, ds4_gguf, v4_gguf, ds4_ids, v4_ids):
    """Four sequences of different lengths (one crossing a ratio-128 boundary, one of a single token) are
    prefilled in one step, then decoded together; a fifth joins mid-way (its prefill beside the others'
    decodes). Every logit row equals the separate calls bit for bit (batch invariance: BLAS would otherwise
    give a row beside others different last bits than alone), so greedy tokens never depend on neighbours."""
    model = RefModel(ds4_gguf if which == "ds4" else v4_gguf, numerics=FP32)
    ids = ds4_ids if which == "ds4" else v4_ids
    seqs = [ids[o:] for o in (0, 7, 40, 90)]
    P, D = [130, 37, 1, 64], 6
    want = separate(model, seqs, P, D)
    states = [model.new_state() for _ in seqs]
    got = [[r] for r in model.step(states, [s[:p] for s, p in zip(seqs, P)])]
    late, late_p = ids[200:], 21
    late_state = model.new_state()
    for j in range(D):
        sts, chunks = states, [[int(s[p + j])] for s, p in zip(seqs, P)]
        if j == 2:                                          # a prefill joins the decode step
            sts, chunks = states + [late_state], chunks + [late[:late_p]]
        res = model.step(sts, chunks)
        for i in range(len(seqs)):
            got[i].append(res[i])
        if j == 2:
            late_logits = res[-1]
    for i in range(len(seqs)):
        np.testing.assert_array_equal(np.array(got[i]), np.array(want[i]), err_msg=f"sequence {i}")
        assert states[i].n_tokens == P[i] + D
    np.testing.assert_array_equal(late_logits, model.prefill(model.new_state(), late[:late_p]))


def test_batched_all_logits_and_long_chunks(ds4_gguf, ds4_ids):
    """all_logits gives each sequence's rows; chunks longer than max_chunk are split across passes."""
    model = RefModel(ds4_gguf, numerics=FP32)
    a, b = ds4_ids[:150], ds4_ids[150:190]
    wa = model.prefill(model.new_state(), a, all_logits=True)
    wb = model.prefill(model.new_state(), b, all_logits=True)
    model.max_chunk = 64                                    # 190 rows: passes of 64, both sequences in the first
    try:
        ga, gb = model.step([model.new_state(), model.new_state()], [a, b], all_logits=True)
    finally:
        del model.max_chunk
    assert ga.shape == (150, 512) and gb.shape == (40, 512)
    np.testing.assert_allclose(ga, wa, atol=ATOL)
    np.testing.assert_allclose(gb, wb, atol=ATOL)


def test_passes_of_a_long_chunk_do_not_depend_on_its_neighbours(ds4_gguf, ds4_ids):
    """A chunk longer than max_chunk is cut from its own start whatever else the step holds: beside decode
    rows that take part of a pass's budget, it gives the same bits as alone (and the decode rows too)."""
    model = RefModel(ds4_gguf, numerics=FP32)
    model.max_chunk = 48
    try:
        long, short = ds4_ids[:130], ds4_ids[200:230]
        alone = model.prefill(model.new_state(), long, all_logits=True)
        s = model.new_state()
        model.prefill(s, short)
        want_short = model.decode(s.copy(), 7)
        got_short, got_long = model.step([s, model.new_state()], [[7], long], all_logits=True)
    finally:
        del model.max_chunk
    np.testing.assert_array_equal(got_long, alone)
    np.testing.assert_array_equal(got_short[0], want_short)


@pytest.mark.parametrize("kernels", ["dequant", "jit"])
def test_a_batched_decode_reads_each_weight_once(ds4_gguf, ds4_ids, monkeypatch, kernels):
    """With the cache off every use dequantises again: a step of 4 decodes dequantises each dense matrix as
    often as a step of one, and each routed expert once for all the sequences routed to it. The compiled decode
    kernels likewise read each matrix once per step (one call for every row of it)."""
    from ds4py.quant import jit

    if kernels == "jit" and not jit.available():
        pytest.skip(f"numba unavailable: {jit.unavailable_reason()}")
    model = RefModel(ds4_gguf, numerics=FP32, cache_bytes=0, kernels=kernels)
    states = []
    for o in (0, 50, 100, 150):
        st = model.new_state()
        model.prefill(st, ds4_ids[o:o + 20])
        states.append(st)
    toks = [[int(t)] for t in ds4_ids[250:254]]
    routed = defaultdict(set)                               # layer -> experts some sequence routes to
    for st, t in zip(states, toks):
        tr = model.new_trace()
        model.decode(st.copy(), t[0], trace=tr)
        for il in range(model.config.n_layers):
            routed[il] |= set(tr.experts[il].ravel().tolist())
    seen = Counter()
    if kernels == "dequant":
        real = ref_weights._dequant_rows

        def spy(t, raw, shape):
            seen[t.name] += 1
            return real(t, raw, shape)

        monkeypatch.setattr(ref_weights, "_dequant_rows", spy)
    else:
        real_rows = ref_weights.Weights._fused_rows

        def spy_rows(self, t, raw, x, key):
            seen[t.name] += 1
            return real_rows(self, t, raw, x, key)

        monkeypatch.setattr(ref_weights.Weights, "_fused_rows", spy_rows)
    model.step([states[0].copy()], [toks[0]])
    one = {k: v for k, v in seen.items() if "_exps." not in k}
    seen.clear()
    model.step(states, toks)
    assert {k: v for k, v in seen.items() if "_exps." not in k} == one
    for il in range(model.config.n_layers):
        n = sum(v for k, v in seen.items() if k.startswith(f"blk.{il}.") and "_exps." in k)
        assert n == 3 * len(routed[il]) < 3 * 4 * model.config.n_experts_used, (il, n, routed[il])


def test_bad_steps_change_no_state(ds4_gguf):
    model = RefModel(ds4_gguf)
    a, b = model.new_state(), model.new_state()
    model.prefill(a, [0, 5, 6])
    other = RefModel(ds4_gguf, rollback_horizon=4).new_state()
    cases = [(([a, b], [[1]]), "one chunk per state"), (([a, a], [[1], [2]]), "same state appears twice"),
             (([a, b], [[1], [2, 600]]), "sequence 1: token id 600 at index 1 is outside the vocabulary"),
             (([a, b], [[1], []]), "sequence 1: token ids must be a non-empty"),
             (([a], [[1.5]]), "integers"), (([object()], [[1]]), "expected a RefState"),
             (([a, other], [[1], [2]]), "another state layout"), (([], []), "at least one state")]
    for (states, chunks), match in cases:
        with pytest.raises(Ds4Error, match=match):
            model.step(states, chunks)
    assert (a.n_tokens, b.n_tokens) == (3, 0)
    short = RefModel(ds4_gguf)
    short.config = dataclasses.replace(short.config, context_length=5)
    with pytest.raises(ContextLengthError, match="sequence 0: 3 \\+ 3 tokens exceed the context length 5"):
        short.step([a, b], [[1, 2, 3], [4]])
    assert (a.n_tokens, b.n_tokens) == (3, 0)


# ---- truncate -------------------------------------------------------------------------------------------------
def decode_all(model, st, ids):
    return [model.decode(st, int(t)) for t in ids]


@pytest.mark.parametrize("which", ["v4", "ds4"])
def test_truncate_then_redecode_equals_the_original(which, ds4_gguf, v4_gguf, ds4_ids, v4_ids):
    """Decode past every kind of boundary, then roll back to each of the last R positions and decode again:
    the logits are bit-identical to the first time (the same computations on the same rows).
    v4-tiny (window 16: its ring of 32 wraps many times) crosses ratio-4 groups and the ratio-128 group
    completed at position 255; ds4-tiny (window 128) crosses its window ring's wrap at 144 and ratio-4 groups."""
    model = RefModel(v4_gguf if which == "v4" else ds4_gguf)   # default numerics: FP8/FP4 fake-quant on
    ids = v4_ids if which == "v4" else ds4_ids
    P, end = (240, 270) if which == "v4" else (128, 152)
    R = model.rollback_horizon
    st = model.new_state()
    model.prefill(st, ids[:P])
    first = decode_all(model, st, ids[P:end])                 # first[k]: logits after position P + k
    arrays = dict(st.arrays)
    assert st.rollback_floor == end - R
    for n in range(end - R, end):
        again = st.copy()
        again.truncate(n)
        assert again.n_tokens == n
        for k, got in enumerate(decode_all(model, again, ids[n:end])):
            np.testing.assert_array_equal(got, first[n - P + k], err_msg=f"truncate({n}), position {n + k}")
    st.truncate(end - R)                                      # in place: no part is copied or replaced
    assert st.n_tokens == end - R and all(st.arrays[k] is a for k, a in arrays.items())
    np.testing.assert_array_equal(decode_all(model, st, ids[end - R:end])[-1], first[-1])


def test_truncate_floor_follows_the_high_water_mark(v4_gguf, v4_ids):
    """After a rollback the ring slots above n_tokens still hold the abandoned positions' rows, so the floor
    stays n_written - R; a rollback to exactly the floor after a partial re-feed is still exact."""
    model = RefModel(v4_gguf, numerics=FP32, rollback_horizon=8)
    st = model.new_state()
    model.prefill(st, v4_ids[:60])
    ref = decode_all(model, st, v4_ids[60:80])                 # n_written 80: floor 72
    st.truncate(74)
    decode_all(model, st, v4_ids[74:77])                       # n_tokens 77, still n_written 80
    assert (st.n_tokens, st.n_written, st.rollback_floor) == (77, 80, 72)
    with pytest.raises(Ds4Error, match="72 is the earliest"):
        st.truncate(77 - 8)                                    # within R of n_tokens, below the floor
    st.truncate(72)
    chunk = st.copy()
    for k, got in enumerate(decode_all(model, st, v4_ids[72:80])):
        np.testing.assert_array_equal(got, ref[72 - 60 + k])
    # re-fed as one chunk: the same up to summation order
    np.testing.assert_allclose(model.prefill(chunk, v4_ids[72:80], all_logits=True), ref[12:20], atol=ATOL)
    for bad, match in ((81, "only removes tokens"), (-1, "only removes tokens"), (2.0, "integer"), (True, "integer")):
        with pytest.raises(Ds4Error, match=match):
            st.truncate(bad)
    with pytest.raises(Ds4Error, match="rollback horizon"):
        st.truncate(10)


# ---- save / load ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(v4_gguf, v4_ids):
    model = RefModel(v4_gguf)
    st = model.new_state()
    model.prefill(st, v4_ids[:200])
    decode_all(model, st, v4_ids[200:210])
    st.truncate(205)                                           # n_written 210 > n_tokens 205: the blob keeps both
    return model, st, model.save_state(st)


def test_saved_state_continues_exactly(saved, v4_ids):
    model, st, blob = saved
    loaded = model.load_state(blob)
    assert (loaded.n_tokens, loaded.n_written, loaded.rollback_floor) == (205, 210, 194)
    assert loaded.nbytes() <= st.nbytes()                      # rows re-grown only to what is used
    want = decode_all(model, st.copy(), v4_ids[205:230])
    got = decode_all(model, loaded, v4_ids[205:230])
    np.testing.assert_array_equal(np.array(got), np.array(want))
    again = model.load_state(blob)                             # and the loaded state rolls back like the original
    again.truncate(194)
    ref = st.copy()
    ref.truncate(194)
    np.testing.assert_array_equal(decode_all(model, again, v4_ids[194:198]), decode_all(model, ref, v4_ids[194:198]))
    assert model.save_state(model.load_state(blob)) == blob    # a round trip is byte-identical


def test_bad_blobs_are_refused(saved, v4_gguf, ds4_gguf, tmp_path):
    model, st, blob = saved
    rng = np.random.default_rng(0)

    def refused(data, match):
        with pytest.raises(Ds4Error, match=match) as e:
            model.load_state(data)
        assert "\n" not in str(e.value)

    for cut in (0, 10, 40, len(blob) // 2, len(blob) - 1):
        refused(blob[:cut], "shorter than its header|truncated")
    refused(blob + b"\0", "truncated or padded")
    for i in list(range(64)) + rng.integers(64, len(blob), 200).tolist():
        bad = bytearray(blob)
        bad[i] ^= 1 << int(rng.integers(0, 8))
        refused(bytes(bad), "corrupted|bad magic|format version|truncated or padded")
    refused("a string", "is bytes")
    refused(b"GGUF" + bytes(100), "bad magic")
    refused(model.save_state(RefModel(v4_gguf).new_state())[:-4] + b"\0\0\0\0", "corrupted")
    # another model (same shape, other weights), other numerics, another rollback horizon: refused
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    shape = dict(n_layers=3, n_heads=2, head_dim=128, q_lora_rank=64, o_lora_rank=64, o_groups=2, n_experts=4,
                 n_experts_used=2, index_heads=2, index_head_dim=64, index_topk=4, window=8, vocab_size=300,
                 compress_ratios=[0, 4, 128])
    make_tiny(str(a), seed=0, **shape)
    make_tiny(str(b), seed=1, **shape)
    ma, mb = RefModel(str(a)), RefModel(str(b))
    sa = ma.new_state()
    ma.prefill(sa, [0, 5, 6, 7, 8])
    with pytest.raises(Ds4Error, match="saved by another model"):
        mb.load_state(ma.save_state(sa))
    with pytest.raises(Ds4Error, match="saved by another model"):
        RefModel(ds4_gguf).load_state(blob)
    with pytest.raises(Ds4Error, match="other numerics"):
        RefModel(v4_gguf, numerics=Numerics(fake_quant=False)).load_state(blob)
    with pytest.raises(Ds4Error, match="other numerics"):
        RefModel(v4_gguf, numerics=Numerics.ds4()).load_state(blob)
    with pytest.raises(Ds4Error, match="layout differs"):
        RefModel(v4_gguf, rollback_horizon=4).load_state(blob)
    with pytest.raises(Ds4Error, match="expected a RefState"):
        model.save_state("state")
    assert RefModel(v4_gguf).load_state(blob).n_tokens == 205   # the same file opened again: accepted


# ---- the declared layout, copy, nbytes ------------------------------------------------------------------------
def test_layout_follows_the_predicates(v4_gguf):
    model = RefModel(v4_gguf)
    cfg, R = model.config, model.rollback_horizon
    parts = {p.key: p for p in model.layout.parts}
    assert parts["0.win"].capacity == cfg.window + R and "0.comp_kv" not in parts
    assert parts["2.comp_kv"].capacity == 4 * 2 + R and parts["2.comp_kv"].width == 2 * cfg.head_dim
    assert parts["3.comp_kv"].capacity == 128 + R and parts["3.comp_kv"].width == cfg.head_dim
    assert parts["2.idx_keys"].kind == ROWS and parts["2.idx_keys"].period == 4 and "3.idx_keys" not in parts
    assert parts["3.comp_rows"].period == 128 and parts["3.comp_rows"].capacity == 0

    class V41Like(ModelConfig):
        """V4.1's roles (MODEL.md §3): ratios 2 and 1 without overlap, layers 3.. read layer 2's rows,
        only layer 2 indexes. The same declaration gives its state with no change to the layout code."""

        def compress_overlap(self, layer):
            return 0

        def kv_source(self, layer):
            return 2 if layer >= 2 else layer

        def has_indexer(self, layer):
            return layer == 2

        def index_overlap(self, layer):
            return 0

    v41 = V41Like(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    v41 = dataclasses.replace(v41, compress_ratios=(0, 0, 2, 2, 1, 1, 1))
    parts = {p.key: p for p in state_layout(v41, R).parts}
    assert parts["2.comp_kv"].capacity == 2 + R and parts["2.comp_rows"].period == 2
    assert not any(k.startswith(("3.comp", "4.comp", "5.comp")) for k in parts)      # they read layer 2's
    assert parts["2.idx_kv"].capacity == 2 + R and "4.idx_kv" not in parts


def test_copy_nbytes_and_growth(v4_gguf, v4_ids):
    model = RefModel(v4_gguf)
    st = model.new_state()
    rings = sum(p.capacity * p.width * 4 for p in model.layout.parts if p.kind == RING)
    assert st.nbytes() == rings                                # a fresh state holds its rings only
    model.prefill(st, v4_ids[:300])
    rows = {p.key: st.arrays[p.key].shape[0] for p in model.layout.parts if p.kind == ROWS}
    assert rows["2.comp_rows"] == 128 and rows["3.comp_rows"] == 16    # 75 rows -> 128; 2 rows -> the minimum 16
    assert st.nbytes() == sum(a.nbytes for a in st.arrays.values())
    snap = st.copy()
    assert snap.nbytes() == st.nbytes() and all(snap.arrays[k] is not a for k, a in st.arrays.items())
    a = model.decode(st, 3)
    model.decode(st, 4)
    np.testing.assert_array_equal(model.decode(snap, 3), a)
    assert snap.n_tokens == 301 and st.n_tokens == 302


def test_fingerprint_is_cheap_and_content_based(tmp_path, ds4_gguf):
    import shutil
    import time

    a = tmp_path / "a.gguf"
    shutil.copy(ds4_gguf, a)
    assert file_fingerprint(a) == file_fingerprint(ds4_gguf)   # a copy: same contents, same fingerprint
    assert RefModel(str(a)).fingerprint == RefModel(ds4_gguf).fingerprint
    data = bytearray(a.read_bytes())
    fp = file_fingerprint(a)
    for at in (100, len(data) - 10):                           # in the header, and in the last sample
        b = tmp_path / f"b{at}.gguf"
        edited = bytearray(data)
        edited[at] ^= 0xFF
        b.write_bytes(edited)
        assert file_fingerprint(b) != fp
    big = tmp_path / "sparse.bin"                              # 8 GB, sparse: only the samples are read
    with open(big, "wb") as fh:
        fh.truncate(8 << 30)
    t0 = time.perf_counter()
    file_fingerprint(big)
    assert time.perf_counter() - t0 < 5
