"""Corrupt GGUF files: each is one sentence naming the problem at load (GGUFError / ConfigError), from the loader,
`inspect`, `run` and `serve` (whose /health then carries the sentence), never a traceback, and never a model
that loads and then answers noise or NaN. Files are built with tests/gguf_tools.py from the golden ds4-tiny."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py.config import ModelConfig
from ds4py.errors import ConfigError, Ds4Error, GGUFError
from ds4py.gguf import GGUFFile
from gguf_tools import A, F32, I32, S, U32, Gguf
from helpers import REPO


@pytest.fixture(scope="module")
def base(golden) -> Gguf:
    return Gguf.read(golden / "ds4-tiny" / "tiny.gguf")


def load(path):
    """What every command does first: open the file, read and validate the config and the weights."""
    return ModelConfig.from_gguf(GGUFFile(path))


def one_sentence(err: Exception) -> str:
    msg = str(err)
    assert "\n" not in msg and "Traceback" not in msg and len(msg) < 400, msg
    return msg


def variant(base: Gguf, tmp_path, name: str, edit) -> str:
    import copy

    g = copy.deepcopy(base)
    edit(g)
    return str(g.write(tmp_path / f"{name}.gguf"))


def _nan_at(t, index: int = 0, value=np.nan):
    """Replace element `index` of an F32 / F16 tensor's data."""
    dt = {int(Q.F32): np.float32, int(Q.F16): np.float16}[t.qtype]
    arr = np.frombuffer(t.data, dt).copy()
    arr[index] = value
    t.data = arr.tobytes()


def _set(key, vt, val):
    return lambda g: g.kv.__setitem__(key, (vt, val))


def _offset(name, delta):
    def edit(g):
        off, at = {}, 0
        for t in g.tensors:                        # the default layout, then one offset moved
            at = (at + 31) // 32 * 32
            off[t.name] = at
            at += len(t.data)
        for t in g.tensors:
            t.offset = off[t.name]
        g.tensor(name).offset += delta
    return edit


def _same_offset(a, b):
    def edit(g):
        _offset(a, 0)(g)
        g.tensor(b).offset = g.tensor(a).offset
    return edit


def _relabel(name, qtype):
    def edit(g):
        g.tensor(name).qtype = int(qtype)
    return edit


def _huge_ne(name):
    def edit(g):
        g.tensor(name).ne = [256, 1 << 62]
    return edit


def _five_dims(name):
    def edit(g):
        g.tensor(name).ne = g.tensor(name).ne + [1, 1, 1, 1]
    return edit


def _nan_tensor(name, index=0):
    return lambda g: _nan_at(g.tensor(name), index)


CASES = [
    # (id, edit, error class, words the sentence contains)
    ("alignment-0", _set("general.alignment", U32, 0), GGUFError, "general.alignment is 0"),
    ("alignment-3", _set("general.alignment", U32, 3), GGUFError, "power of two"),
    ("alignment-string", _set("general.alignment", S, "32"), GGUFError, "general.alignment is '32'"),
    ("five-dims", _five_dims("output_norm.weight"), GGUFError, "dimensions"),
    ("absurd-ne", _huge_ne("token_embd.weight"), GGUFError, "token_embd.weight"),
    ("count-as-string", _set("deepseek4.block_count", S, "four"), ConfigError, "block_count is a string"),
    ("count-as-numeric-string", _set("deepseek4.block_count", S, "4"), ConfigError, "expected an integer"),
    ("count-as-float", _set("deepseek4.attention.head_count", F32, 16.0), ConfigError, "head_count"),
    ("ratios-as-string", _set("deepseek4.attention.compress_ratios", S, "0,0,4,128"), ConfigError,
     "compress_ratios is a string"),
    ("ratios-as-strings", _set("deepseek4.attention.compress_ratios", A, (S, ["0", "0", "4", "128"])), ConfigError,
     "array of integers"),
    ("eps-nan", _set("deepseek4.attention.layer_norm_rms_epsilon", F32, math.nan), ConfigError,
     "layer_norm_rms_epsilon"),
    ("hc-eps-inf", _set("deepseek4.hyper_connection.epsilon", F32, math.inf), ConfigError, "epsilon"),
    ("eps-zero", _set("deepseek4.attention.layer_norm_rms_epsilon", F32, 0.0), ConfigError, "norm eps"),
    ("groups-zero", _set("deepseek4.attention.output_group_count", U32, 0), ConfigError, "o groups"),
    ("window-absurd", _set("deepseek4.attention.sliding_window", U32, 4_000_000_000), ConfigError, "window"),
    ("eos-outside-vocab", _set("tokenizer.ggml.eos_token_id", U32, 100_000), ConfigError, "EOS"),
    ("misaligned-offset", _offset("blk.0.attn_norm.weight", 4), GGUFError, "not a multiple of the alignment"),
    ("overlapping-offsets", _same_offset("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"), GGUFError, "overlap"),
    ("nan-norm", _nan_tensor("blk.1.ffn_norm.weight", 7), GGUFError, "blk.1.ffn_norm.weight"),
    ("nan-sink", _nan_tensor("blk.0.attn_sinks.weight"), GGUFError, "NaN"),
    ("nan-embedding-row", _nan_tensor("token_embd.weight", 3), GGUFError, "token_embd.weight"),
    ("f16-relabelled-bf16", _relabel("token_embd.weight", Q.BF16), GGUFError, "relabelled"),
    ("f16-router-relabelled-bf16", _relabel("blk.3.ffn_gate_inp.weight", Q.BF16), GGUFError, "labelled BF16"),
    ("norm-relabelled-i32", _relabel("output_norm.weight", Q.I32), GGUFError, "expected"),
]


@pytest.mark.parametrize("case,edit,cls,words", CASES, ids=[c[0] for c in CASES])
def test_corrupt_file_is_one_sentence_at_load(base, tmp_path, case, edit, cls, words):
    path = variant(base, tmp_path, case, edit)
    with pytest.raises(cls) as e:
        load(path)
    assert words in one_sentence(e.value), e.value


def test_the_unedited_round_trip_loads(base, tmp_path):
    """The control for every case above: the file rewritten without an edit loads and runs."""
    from ds4py.ref.engine import RefModel

    m = RefModel(str(base.write(tmp_path / "same.gguf")))
    assert np.isfinite(m.prefill(m.new_state(), [1, 2, 3])).all()


def test_a_real_bf16_matrix_loads_and_its_relabel_to_f16_is_refused(base, tmp_path):
    """BF16 data labelled F16 is caught too (its values collapse into [0.5, 2)); the same bytes labelled BF16 load."""
    def to_bf16(g):
        t = g.tensor("token_embd.weight")
        x = np.frombuffer(t.data, np.float16).astype(np.float32)
        t.data = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        t.qtype = int(Q.BF16)
    good = variant(base, tmp_path, "bf16", to_bf16)
    load(good)
    bad = variant(base, tmp_path, "bf16-as-f16", lambda g: (to_bf16(g), _relabel("token_embd.weight", Q.F16)(g)))
    with pytest.raises(GGUFError, match="labelled F16 but"):
        load(bad)


def test_an_inconsistent_truncated_header_is_cheap_to_refuse(base, tmp_path):
    """Counts that cannot fit the file are refused before any loop runs over them."""
    path = tmp_path / "counts.gguf"
    data = bytearray(base.write(tmp_path / "x.gguf").read_bytes())
    data[8:16] = struct.pack("<Q", 1 << 60)            # n_tensors
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="cannot fit"):
        GGUFFile(path)
    data = bytearray(base.write(tmp_path / "x.gguf").read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4               # vtype ARRAY, element type STRING, then the count
    data[at:at + 8] = struct.pack("<Q", 1 << 61)
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="array of"):
        GGUFFile(path)


# ---- checksums ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A make-tiny file: written by our writer, so it carries per-tensor checksums."""
    from ds4py.tiny import make_tiny

    p = tmp_path_factory.mktemp("ck") / "tiny.gguf"
    make_tiny(str(p), seed=3)
    return p


def _patched(src, dst, name, edit_bytes=None, qtype=None):
    """Copy of src with one tensor's bytes edited in place (offset and size unchanged) or its type code changed."""
    f = GGUFFile(src)
    t = f.tensor(name)
    data = bytearray(open(src, "rb").read())
    if edit_bytes is not None:
        data[t.offset: t.offset + t.nbytes] = edit_bytes(bytes(data[t.offset: t.offset + t.nbytes]))
    if qtype is not None:
        key = struct.pack("<Q", len(name)) + name.encode()
        at = data.index(key) + len(key)
        n_dims = struct.unpack_from("<I", data, at)[0]
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, int(qtype))
    open(dst, "wb").write(bytes(data))
    return str(dst)


def test_checksums_written_and_verified(made, tmp_path, capsys):
    from ds4py.cli.inspect import verify

    f = GGUFFile(made)
    verify(f)
    assert "checksums match" in capsys.readouterr().out
    # a plausible edit (one norm gain 1.0 -> 1.5) only a checksum can see: refused at load
    def gain(b):
        a = np.frombuffer(b, np.float32).copy()
        a[0] = 1.5
        return a.tobytes()
    edited = _patched(made, tmp_path / "gain.gguf", "blk.0.attn_norm.weight", gain)
    with pytest.raises(GGUFError, match="does not match its checksum"):
        load(edited)
    # F16 -> BF16 relabel of a small matrix: caught by its checksum even where the values would pass
    relabelled = _patched(made, tmp_path / "rel.gguf", "blk.0.hc_attn_fn.weight", qtype=Q.BF16)
    with pytest.raises(GGUFError, match="blk.0.hc_attn_fn.weight"):
        load(relabelled)


def test_inspect_verify_reads_every_tensor(made, tmp_path, monkeypatch):
    """At load only the smallest tensors are hashed (a budget); `inspect --verify` hashes them all."""
    import ds4py.validate as validate

    flipped = _patched(made, tmp_path / "flip.gguf", "blk.0.ffn_gate_exps.weight",
                       lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:])
    monkeypatch.setattr(validate, "CHECKSUM_MAX_TENSOR", 1024)        # as on a full-size model: big ones skipped
    load(flipped)
    r = subprocess.run([sys.executable, "-m", "ds4py", "inspect", flipped, "--verify"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ffn_gate_exps" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_inspect_verify_on_a_file_without_checksums_says_so(golden):
    r = subprocess.run([sys.executable, "-m", "ds4py", "inspect", str(golden / "ds4-tiny" / "tiny.gguf"),
                        "--verify"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "carries no checksums" in r.stderr


# ---- the commands ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["alignment-0", "ratios-as-string", "nan-norm", "f16-relabelled-bf16"])
def test_commands_print_one_line(base, tmp_path, case):
    edit = next(c[1] for c in CASES if c[0] == case)
    path = variant(base, tmp_path, case, edit)
    for argv in (["inspect", path, "--verify"], ["run", "-m", path, "-p", "hi", "-n", "1"]):
        r = subprocess.run([sys.executable, "-m", "ds4py", *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, (argv, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in r.stderr, r.stderr


def _fetch(srv, path: str, body: dict | None = None) -> tuple[int, dict]:
    """A GET (or, with a body, a JSON POST) to the background server: the status and the JSON answer, 5xx too."""
    req = urllib.request.Request(srv.base_url + path, data=body and json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        r = urllib.request.urlopen(req, timeout=30)
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_reports_the_reason_on_health_and_every_request(base, tmp_path):
    """serve keeps its port (so the reason can be read) but is never healthy with a broken model."""
    from ds4py.cli.serve import make_engine
    from ds4py.server.app import BackgroundServer, ServerConfig, ServerState
    from ds4py.server.toolmemory import ToolMemory

    path = variant(base, tmp_path, "nan", _nan_tensor("blk.1.ffn_norm.weight", 7))
    state = ServerState(ServerConfig())
    with BackgroundServer(state) as srv:
        state.load_in_background(lambda: make_engine(path, "ref", 256, ToolMemory())).join(60)
        status, body = _fetch(srv, "/health")
        assert status == 503 and body["status"] == "error" and "blk.1.ffn_norm.weight" in body["error"]
        assert "NaN" in body["error"] and not body["error"].startswith("GGUFError")
        status, body = _fetch(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and "blk.1.ffn_norm.weight" in body["error"]["message"]


def test_a_model_that_turns_out_broken_while_serving_is_reported_on_health(golden):
    """Non-finite logits (a corrupt weight outside the rows sampled at load): that request fails with the reason,
    /health stops saying ok, and later requests get the same reason as a 503 instead of a 500 each."""
    from types import SimpleNamespace

    from ds4py.server.app import BackgroundServer, ServerConfig, ServerState
    from ds4py.server.worker import Engine
    from ds4py.session import Session
    from ds4py.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(str(golden / "ds4-tiny" / "tiny.gguf"))

    class State:
        n_tokens = 0

        @property
        def rollback_floor(self):                 # no rollback
            return self.n_tokens

        def copy(self):
            return State()

        def nbytes(self):
            return 0

    from spec_fakes import FakeContract

    class NaNModel(FakeContract):
        config = SimpleNamespace(vocab_size=tok.vocab_size, context_length=512)

        def new_state(self):
            return State()

        def step(self, states, chunks, all_logits=False):
            for st, ids in zip(states, chunks):
                st.n_tokens += len(ids)
            return [np.full(tok.vocab_size, np.nan, np.float32) for _ in states]

    state = ServerState(ServerConfig())
    state.set_engine(Engine(Session(NaNModel(), tok, ctx_size=512), tok))
    with BackgroundServer(state) as srv:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert _fetch(srv, "/health")[0] == 200
        status, body = _fetch(srv, "/v1/chat/completions", chat)
        assert status == 503 and "invalid logits" in body["error"]["message"], body
        status, body = _fetch(srv, "/health")
        assert status == 503 and body["status"] == "error" and "inspect" in body["error"]
        status, body = _fetch(srv, "/v1/messages", chat)
        assert status == 503 and "weights are corrupt" in body["error"]["message"]


def test_metadata_checksum_catches_a_plausible_edit(made, tmp_path):
    """A metadata value changed to another valid one (an epsilon, a token's type): only the checksum sees it."""
    f = GGUFFile(made)
    data = bytearray(open(made, "rb").read())
    a, b = f.kv_spans["deepseek4.attention.layer_norm_rms_epsilon"]
    struct.pack_into("<f", data, b - 4, 1e-5)                        # 1e-6 -> 1e-5: in range, wrong
    (tmp_path / "eps.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="metadata does not match its checksum"):
        load(tmp_path / "eps.gguf")
    assert GGUFFile(tmp_path / "eps.gguf").meta("deepseek4.attention.layer_norm_rms_epsilon") == \
        pytest.approx(1e-5)                                          # the edit is there, and plausible
