"""make_tiny: ds4 layout (same names/types/metadata as the ds4-tiny golden file), determinism, tokenizer,
weight magnitudes; the make-tiny and inspect commands."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py import quant
from ds4py.convert import ConvertError, ds4_layout
from ds4py.gguf import GGUFFile
from ds4py.tiny import SPECIAL_TAIL, make_tiny, tiny_shape, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    make_tiny(str(p), seed=0)
    return p


def test_default_shape_has_ds4_tiny_layout(golden, tiny):
    ours, ref = GGUFFile(tiny), GGUFFile(golden / "ds4-tiny" / "tiny.gguf")
    assert list(ours.tensors) == list(ref.tensors)                  # same names in the same order
    for n, t in ours.tensors.items():
        assert (t.qtype, t.shape) == (ref.tensors[n].qtype, ref.tensors[n].shape), n
    # ds4py.* keys are ours (the content checksums that inspect --verify checks); every other key is ds4's: those
    # of this golden file plus those of ds4's public files it lacks (tests/test_gguf_compat.py)
    compat = {"deepseek4.expert_gating_func", "deepseek4.rope.scaling.type", "general.type", "general.file_type",
              "general.quantization_version"}
    assert {k for k in ours.keys() if not k.startswith("ds4py.")} == set(ref.keys()) | compat
    for k in ref.keys():
        if k.startswith("deepseek4.") or k in ("general.architecture", "tokenizer.ggml.model",
                                               "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            assert ours.meta(k) == ref.meta(k), k


def test_deterministic_per_seed(tiny, tmp_path):
    make_tiny(str(tmp_path / "a.gguf"), seed=0)
    make_tiny(str(tmp_path / "b.gguf"), seed=1)
    assert (tmp_path / "a.gguf").read_bytes() == tiny.read_bytes()
    a, b = GGUFFile(tmp_path / "a.gguf"), GGUFFile(tmp_path / "b.gguf")
    assert not np.array_equal(a.tensor("blk.1.attn_kv.weight").raw_bytes(), b.tensor("blk.1.attn_kv.weight").raw_bytes())


@pytest.mark.parametrize("experts", ["mxfp4", "q4_k"])
def test_other_shapes_and_expert_types(tmp_path, experts):
    kw = dict(n_layers=5, dim=512, vocab_size=700, n_heads=8, q_lora_rank=128, o_lora_rank=64, n_experts=4,
              n_experts_used=2, expert_ff=256, index_heads=2, index_topk=8)
    p = tmp_path / "m.gguf"
    make_tiny(str(p), seed=3, experts=experts, **kw)
    f = GGUFFile(p)
    s = tiny_shape(**kw)
    assert [sp.name for sp in ds4_layout(s)] == list(f.tensors)
    for sp in ds4_layout(s):
        assert f.tensors[sp.name].shape == sp.shape
    assert f.meta("deepseek4.block_count") == 5 and f.meta("deepseek4.embedding_length") == 512
    assert f.meta("deepseek4.attention.compress_ratios") == [0, 0, 4, 128, 4]
    assert len(f.meta("tokenizer.ggml.tokens")) == 700
    t = f.tensor("blk.4.ffn_up_exps.weight")
    assert t.qtype == QT[experts.upper()]
    w = quant.dequantize(t.raw_bytes(), t.qtype, t.shape)
    assert abs(w.std() * np.sqrt(512) / 1.5 - 1) < 0.1               # N(0, 1.5^2/fan_in) after quantisation


def test_weight_magnitudes_follow_ds4_tiny(tiny):
    f = GGUFFile(tiny)

    def w(name):
        t = f.tensor(name)
        return quant.dequantize(t.raw_bytes(), t.qtype, t.shape) if t.qtype != QT.I32 else np.asarray(t.raw)

    assert abs(w("token_embd.weight").std() - 1) < 0.02
    assert abs(w("output.weight").std() * 8 - 1) < 0.05             # 2/sqrt(256)
    assert abs(w("blk.2.attn_q_b.weight").std() * 16 - 1) < 0.05    # 1/sqrt(q_lora 256)
    sinks = w("blk.0.attn_sinks.weight")
    assert 2.5 < sinks.mean() < 5.5
    assert abs(w("blk.3.attn_compressor_norm.weight").mean() - 2) < 0.2   # ratio-128 layer: mean 2
    assert abs(w("blk.2.attn_compressor_norm.weight").mean() - 1) < 0.1
    gate = w("blk.1.ffn_gate_shexp.weight")                          # 4 hot channels at 6x
    norms = np.sort(np.linalg.norm(gate, axis=1))
    assert norms[-4] > 4 * np.median(norms) and norms[-5] < 2 * np.median(norms)
    tid = w("blk.0.ffn_gate_tid2eid.weight").reshape(512, 6)
    assert all(len(set(r)) == 6 for r in tid) and tid.min() >= 0 and tid.max() < 16
    up = w("blk.3.ffn_up_exps.weight")                               # IQ2 codes with ~1/sqrt(fan_in) spread
    assert 0.03 < up.std() < 0.15


def test_tokenizer_layout_and_compact_text(tiny):
    from ds4py.tokenizer import Tokenizer

    tok = tiny_tokenizer(512)
    assert tok.tokens[:2] == ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    assert tok.tokens[-len(SPECIAL_TAIL):] == SPECIAL_TAIL
    assert len(set(tok.tokens)) == 512 and len(tok.merges) == 512 - 2 - 256 - len(SPECIAL_TAIL)
    known = set(tok.tokens[2:258])
    for m in tok.merges:                     # every merge joins two earlier symbols into the next token
        a, b = m.split(" ")
        assert a in known and b in known
        known.add(a + b)
    t = Tokenizer.from_gguf(str(tiny))
    text = "Hello! The weather in Paris is sunny today, and the answer is 42."
    ids = t.encode(text)
    assert t.decode(ids) == text and len(ids) < len(text.encode()) / 2
    ids = t.encode("<｜User｜>hi<｜Assistant｜><think>", special=True)
    assert ids[0] == t.special_id("<｜User｜>") and ids[-1] == t.special_id("<think>")
    assert t.decode(t.encode("naïve 日本 🚀")) == "naïve 日本 🚀"    # every byte is reachable


def test_bad_shapes_are_refused(tmp_path):
    with pytest.raises(ConvertError, match="dim 300 must be a multiple of 256"):
        make_tiny(str(tmp_path / "x.gguf"), dim=300)
    with pytest.raises(ConvertError, match="vocab 200 is too small"):
        make_tiny(str(tmp_path / "x.gguf"), vocab_size=200)
    with pytest.raises(ConvertError, match="unknown shape option"):
        make_tiny(str(tmp_path / "x.gguf"), layerz=3)
    with pytest.raises(ConvertError, match="not V4 Flash ratios"):
        make_tiny(str(tmp_path / "x.gguf"), n_layers=2, compress_ratios=[0, 2])
    # shapes the loader (ModelConfig) would reject are refused before anything is written
    with pytest.raises(ConvertError, match="not a multiple of the FP8 block"):
        make_tiny(str(tmp_path / "x.gguf"), head_dim=128, rope_dim=32)
    with pytest.raises(ConvertError, match="indexer key_length 48 must be a power of two"):
        make_tiny(str(tmp_path / "x.gguf"), index_head_dim=48)
    assert not list(tmp_path.iterdir())


def test_cli_make_tiny_and_inspect(tmp_path, tiny):
    out = tmp_path / "c.gguf"
    r = subprocess.run([sys.executable, "-m", "ds4py", "make-tiny", str(out), "--layers", "2", "--vocab", "300",
                        "--experts-n", "8", "--seed", "5"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert GGUFFile(out).meta("deepseek4.expert_count") == 8
    r = subprocess.run([sys.executable, "-m", "ds4py", "inspect", str(tiny)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    f = GGUFFile(tiny)
    assert f"tensors: {len(f.tensors)}" in r.stdout and "compress ratios" in r.stdout and "0,0,4,128" in r.stdout
    for qt in ("Q8_0", "F16", "IQ2_XXS", "Q2_K", "I32", "F32"):
        n = sum(t.qtype.name == qt for t in f.tensors.values())
        nb = sum(t.nbytes for t in f.tensors.values() if t.qtype.name == qt)
        assert any(line.split()[:2] == [qt, str(n)] for line in r.stdout.splitlines()), qt
        assert nb > 0
    assert f"({f.tensor_bytes()} bytes)" in r.stdout and "blk.0.attn_q_b.weight" in r.stdout
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    r = subprocess.run([sys.executable, "-m", "ds4py", "inspect", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "bad.gguf" in r.stderr


def test_v4_vocab_is_the_official_tokenizer(golden, tmp_path):
    """The packaged compact V4 vocabulary (ds4py/data, what the demo model gets) is the official tokenizer.json
    entry for entry, and written into a GGUF it tokenizes every golden string to the official ids."""
    import gguf

    from ds4py.tiny import V4_VOCAB_SIZE, v4_tokenizer
    from ds4py.tokenizer import Tokenizer

    tj = json.loads((golden / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))
    t = v4_tokenizer()
    assert len(t.tokens) == V4_VOCAB_SIZE and (t.bos, t.eos) == (0, 1)
    want = {i: s for s, i in tj["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tj["added_tokens"]}
    assert t.tokens == [want[i] for i in range(V4_VOCAB_SIZE)]
    assert t.merges == [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    added = {a["id"] for a in tj["added_tokens"]}
    assert [i for i, ty in enumerate(t.token_types) if ty == 3] == sorted(added)

    p = tmp_path / "v4vocab.gguf"
    w = gguf.GGUFWriter(str(p), "deepseek4")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(t.pre)
    w.add_token_list(t.tokens)
    w.add_token_types(t.token_types)
    w.add_token_merges(t.merges)
    w.add_bos_token_id(t.bos)
    w.add_eos_token_id(t.eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = Tokenizer.from_gguf(str(p))
    cases = json.loads((golden / "tokenizer" / "tokenizer_cases.json").read_text(encoding="utf-8"))["cases"]
    for c in cases:
        assert tok.encode(c["text"], special=True) == c["ids"], c["id"]
    assert tok.special_id("<｜User｜>") == 128803 and tok.special_id("<think>") == 128821


def test_make_tiny_v4_vocab_refuses_another_size(tmp_path):
    with pytest.raises(ConvertError, match="129280"):
        make_tiny(str(tmp_path / "x.gguf"), vocab="v4", vocab_size=512)
    with pytest.raises(ConvertError, match="vocab 'big'"):
        make_tiny(str(tmp_path / "x.gguf"), vocab="big")
