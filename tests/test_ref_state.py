"""Our own properties of the reference engine: prefill == decode, chunked prefill == one prefill, state
snapshots are independent, bad input gets a clear error, and the score command."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ds4py.__main__ import main
from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.model import Model, Numerics, State
from ds4py.ref.engine import RefModel

# fake_quant off: FP8/FP4 rounding boundaries would turn ~1e-7 summation-order differences into flips
ATOL = 2e-3


@pytest.fixture(scope="module")
def model(golden):
    return RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), numerics=Numerics(fake_quant=False))


@pytest.fixture(scope="module")
def ids(golden):
    return np.load(golden / "ds4-tiny" / "cases.npz")["rand_300_p200/ids"][:150]


@pytest.fixture(scope="module")
def whole(model, ids):
    st = model.new_state()
    return model.prefill(st, ids, all_logits=True), st


def check_engine_contract(model, ids) -> None:
    """What ds4py.model promises beyond attribute names (all a runtime_checkable isinstance looks at): the
    signatures, the shapes and dtypes returned, a state that advances by the tokens consumed, and a copy that is
    independent of its original."""
    import inspect

    assert isinstance(model, Model) and isinstance(model.new_state(), State)
    for name in ("new_state", "step", "prefill", "decode", "save_state", "load_state", "weight_bytes_per_token"):
        want = list(inspect.signature(getattr(Model, name)).parameters)[1:]
        got = list(inspect.signature(getattr(model, name)).parameters)
        assert got[:len(want)] == want, f"{name}{tuple(got)} does not take {tuple(want)}"
    V = model.config.vocab_size
    st = model.new_state()
    assert st.n_tokens == 0
    last = model.prefill(st, ids[:5])
    assert last.shape == (V,) and last.dtype == np.float32 and np.isfinite(last).all() and st.n_tokens == 5
    snap = st.copy()
    rows = model.prefill(st, ids[5:8], all_logits=True)
    assert rows.shape == (3, V) and rows.dtype == np.float32 and st.n_tokens == 8
    step = model.decode(st, int(ids[8]))
    assert step.shape == (V,) and st.n_tokens == 9
    assert snap.n_tokens == 5                                   # the copy did not move with its original
    np.testing.assert_allclose(model.prefill(snap, ids[5:8], all_logits=True), rows, atol=ATOL)
    both = model.step([st, snap], [ids[9:11], ids[8:9]])        # several sequences in one call
    assert [b.shape for b in both] == [(V,), (V,)] and (st.n_tokens, snap.n_tokens) == (11, 9)
    st.truncate(9)                                              # exact rollback within the horizon
    assert st.n_tokens == 9 and st.rollback_floor <= 9
    loaded = model.load_state(model.save_state(st))
    assert loaded.n_tokens == 9 and loaded is not st
    assert isinstance(st.nbytes(), int) and st.nbytes() > 0
    w = model.weight_bytes_per_token()
    assert isinstance(w, int) and w > 0


def test_protocols(model, ids):
    check_engine_contract(model, ids)


def test_contract_check_fails_on_a_lookalike(model, ids):
    """Negative control: an object with every attribute name of the protocol, but a state that does not advance
    and logits of the wrong dtype, passes isinstance yet fails the contract check."""
    class Lookalike:
        config, path, backend = model.config, "x", "fake"
        numerics, rollback_horizon, fingerprint, layout = model.numerics, 16, "0", model.layout

        def new_state(self):
            return model.new_state()

        def step(self, states, chunks, all_logits=False):
            return [np.zeros(model.config.vocab_size, np.float64) for _ in states]

        def save_state(self, state):
            return b""

        def load_state(self, data):
            return model.new_state()

        def prefill(self, state, ids, all_logits=False):
            return np.zeros(model.config.vocab_size, np.float64)

        def decode(self, state, token):
            return np.zeros(model.config.vocab_size, np.float64)

        def weight_bytes_per_token(self):
            return 1

        def __getattr__(self, name):     # the protocol's other members, as the real model has them
            return getattr(model, name)
    assert isinstance(Lookalike(), Model)
    with pytest.raises(AssertionError):
        check_engine_contract(Lookalike(), ids)


def test_prefill_equals_decode(model, ids, whole):
    """Decode crosses the 128-row window and the first ratio-128 row (position 127)."""
    st = model.new_state()
    rows = [model.prefill(st, ids[:110])] + [model.decode(st, int(t)) for t in ids[110:]]
    ref = whole[0][109:]
    np.testing.assert_allclose(np.array(rows), ref, atol=ATOL)
    assert st.n_tokens == len(ids)


def test_chunked_prefill_equals_one_prefill(model, ids, whole):
    st = model.new_state()
    parts = [model.prefill(st, ids[a:b], all_logits=True) for a, b in ((0, 37), (37, 130), (130, 150))]
    np.testing.assert_allclose(np.concatenate(parts), whole[0], atol=ATOL)
    model.max_chunk = 64                                     # long prompts are split automatically
    try:
        np.testing.assert_allclose(model.prefill(model.new_state(), ids, all_logits=True), whole[0], atol=ATOL)
    finally:
        del model.max_chunk
    ws = whole[1]
    for p in model.layout.parts:                             # same KV state afterwards
        np.testing.assert_allclose(st.view(p.layer, p.name), ws.view(p.layer, p.name), atol=ATOL)


def test_state_copy_is_independent(model, ids):
    st = model.new_state()
    model.prefill(st, ids[:50])
    snap = st.copy()
    first = model.decode(st, int(ids[50]))
    model.decode(st, int(ids[51]))
    assert (snap.n_tokens, st.n_tokens) == (50, 52)
    np.testing.assert_array_equal(model.decode(snap, int(ids[50])), first)
    assert model.new_state().nbytes() < snap.nbytes()           # compressed rows and buffers count


def test_bad_input(model):
    st = model.new_state()
    with pytest.raises(Ds4Error, match="outside the vocabulary"):
        model.prefill(st, [1, 2, 512])
    with pytest.raises(Ds4Error, match="non-empty"):
        model.prefill(st, [])
    with pytest.raises(Ds4Error, match="integers"):
        model.prefill(st, [1.5])
    assert st.n_tokens == 0                                  # nothing consumed by a rejected call


def test_context_length(golden):
    m = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"))
    m.config = dataclasses.replace(m.config, context_length=8)
    st = m.new_state()
    m.prefill(st, [0, 5, 6, 7, 8, 9])
    with pytest.raises(ContextLengthError, match="exceed the context length 8"):
        m.prefill(st, [10, 11, 12])


def test_score_command(golden, tmp_path, capsys):
    gguf = str(golden / "ds4-tiny" / "tiny.gguf")
    ids = np.load(golden / "ds4-tiny" / "cases.npz")["chat_short/ids"][:12]
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "logits.npy"
    assert main(["score", "-m", gguf, "--ids", str(tmp_path / "ids.npy"), "--split", "9", "--out", str(out)]) == 0
    got = np.load(out)
    m = RefModel(gguf)
    st = m.new_state()
    want = [m.prefill(st, ids[:9])] + [m.decode(st, int(t)) for t in ids[9:]]
    assert got.dtype == np.float32 and got.shape == (4, 512)
    np.testing.assert_array_equal(got, np.array(want))

    assert main(["score", "-m", gguf, "--ids", str(tmp_path / "ids.npy"), "--split", "13", "--out", str(out)]) == 2
    assert "--split 13 is out of range" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.array([0, 600]))
    assert main(["score", "-m", gguf, "--ids", str(tmp_path / "bad.npy"), "--split", "1", "--out", str(out)]) == 2
    assert "token id 600 at index 1 is outside the vocabulary" in capsys.readouterr().err
    args = ["score", "-m", gguf, "--ids", str(tmp_path / "ids.npy"), "--split", "0", "--out", str(tmp_path / "o.npy")]
    assert main(args) == 2 and "--split 0 is out of range" in capsys.readouterr().err
    args[-1] = str(tmp_path / "missing" / "o.npy")          # checked before any compute
    assert main(args[:-3] + ["1", "--out", args[-1]]) == 2 and "does not exist" in capsys.readouterr().err
    assert main(args[:-3] + ["1", "--out", str(tmp_path)]) == 2 and "is a folder" in capsys.readouterr().err
    assert main(["score", "-m", str(tmp_path / "ids.npy"), "--ids", str(tmp_path / "ids.npy"), "--split", "1",
                 "--out", str(tmp_path / "o.npy")]) == 2 and "not a GGUF" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npy", "ids.npy", "logits.npy"]   # nothing partial
    # the exact name given, even without .npy (np.save would append one)
    assert main(["score", "-m", gguf, "--ids", str(tmp_path / "ids.npy"), "--split", "11", "--out",
                 str(tmp_path / "l.bin")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "l.bin"), got[2:], atol=1e-3)   # row 0: prefill, not decode
