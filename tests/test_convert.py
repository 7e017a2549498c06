"""convert_checkpoint on the v4-tiny golden checkpoint: exact values, ds4 names/orientations/types, errors."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py import quant
from ds4py.quant import official
from ds4py.convert import Checkpoint, ConvertError, convert_checkpoint, ds4_layout, load_hf_tokenizer, shape_from_config
from ds4py.gguf import GGUFFile


def write_safetensors(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Minimal safetensors writer: {name: (dtype string, array of the stored bytes)}."""
    header, blobs, off = {}, [], 0
    for name, (dt, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def copy_ckpt(golden, dst, edit=None, cfg_edit=None, shards=1):
    """Copy v4-tiny into dst, optionally editing tensors ({name: None | (dtype, array)}) or config."""
    src = golden / "v4-tiny"
    ck = Checkpoint(str(src))
    tensors = {n: (ck.dtype(n), np.asarray(ck.raw(n))) for n in ck.entries}
    for n, v in (edit or {}).items():
        if v is None:
            tensors.pop(n)
        else:
            tensors[n] = v
    os.makedirs(dst, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        write_safetensors(dst / "model.safetensors", tensors)
    else:
        wmap = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            write_safetensors(dst / fname, part)
            wmap.update({n: fname for n in part})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(cfg_edit or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def converted(golden, tmp_path_factory):
    d = tmp_path_factory.mktemp("conv")
    out = {}
    for dense in ("f32", "f16", "q8_0"):
        out[dense] = d / f"{dense}.gguf"
        convert_checkpoint(str(golden / "v4-tiny"), str(out[dense]), dense=dense, progress=False)
    return out


def reference(ck, sp):
    if sp.slot == "experts":
        return np.stack([ck.floats(n) for n in sp.src])
    return ck.floats(sp.src).reshape(sp.shape)


@pytest.mark.parametrize("dense", ["f32", "f16"])
def test_lossless_modes_are_exact(golden, converted, dense):
    ck = Checkpoint(str(golden / "v4-tiny"))
    shape = shape_from_config(json.loads((golden / "v4-tiny" / "config.json").read_text()))
    f = GGUFFile(converted[dense])
    layout = ds4_layout(shape)
    assert set(f.tensors) == {sp.name for sp in layout}
    types = set()
    for sp in layout:
        t = f.tensor(sp.name, shape=sp.shape)
        types.add(t.qtype)
        if sp.slot == "i32":
            assert t.qtype == QT.I32
            assert np.array_equal(np.asarray(t.raw).reshape(t.shape), ck.raw(sp.src))
            continue
        got = quant.dequantize(t.raw_bytes(), t.qtype, t.shape)
        assert np.array_equal(got, reference(ck, sp)), sp.name
    assert f.tensor("blk.2.ffn_gate_exps.weight").qtype == QT.MXFP4
    if dense == "f32":
        assert types == {QT.F32, QT.MXFP4, QT.I32}
    else:
        assert QT.F16 in types and QT.Q8_0 not in types
        assert f.tensor("blk.0.attn_q_a.weight").qtype == QT.F16   # FP8 x 2^k fits F16 exactly here


def test_q4_k_dense(golden, tmp_path):
    """--dense q4_k: the Q8 linears whose rows are a multiple of 256 wide in Q4_K (ds4py.quant's quantiser on the
    official values), the narrower ones in Q8_0, the F16 slots as q8_0 mode writes them."""
    out = tmp_path / "q4k.gguf"
    convert_checkpoint(str(golden / "v4-tiny"), str(out), dense="q4_k", progress=False)
    ck = Checkpoint(str(golden / "v4-tiny"))
    shape = shape_from_config(json.loads((golden / "v4-tiny" / "config.json").read_text()))
    f = GGUFFile(str(out))
    seen = set()
    for sp in ds4_layout(shape):
        if sp.slot != "q8":
            continue
        t = f.tensor(sp.name, shape=sp.shape)
        want = QT.Q4_K if sp.shape[-1] % 256 == 0 else QT.Q8_0
        assert t.qtype == want, sp.name
        seen.add(want)
        assert np.array_equal(t.raw_bytes().reshape(-1), quant.quantize(reference(ck, sp), want).reshape(-1)), sp.name
    assert seen == {QT.Q4_K, QT.Q8_0}
    assert f.tensor("blk.0.attn_q_a.weight").qtype == QT.Q4_K


def test_metadata_matches_config(golden, converted):
    cfg = json.loads((golden / "v4-tiny" / "config.json").read_text())
    f = GGUFFile(converted["q8_0"])
    A = "deepseek4."
    want = {
        "general.architecture": "deepseek4", A + "block_count": cfg["n_layers"], A + "embedding_length": cfg["dim"],
        A + "vocab_size": cfg["vocab_size"], A + "attention.head_count": cfg["n_heads"],
        A + "attention.head_count_kv": 1, A + "attention.key_length": cfg["head_dim"],
        A + "attention.value_length": cfg["head_dim"], A + "rope.dimension_count": cfg["rope_head_dim"],
        A + "attention.q_lora_rank": cfg["q_lora_rank"], A + "attention.output_lora_rank": cfg["o_lora_rank"],
        A + "attention.output_group_count": cfg["o_groups"], A + "expert_count": cfg["n_routed_experts"],
        A + "expert_used_count": cfg["n_activated_experts"], A + "expert_feed_forward_length": cfg["moe_inter_dim"],
        A + "expert_shared_count": cfg["n_shared_experts"], A + "hash_layer_count": cfg["n_hash_layers"],
        A + "attention.sliding_window": cfg["window_size"], A + "attention.indexer.head_count": cfg["index_n_heads"],
        A + "attention.indexer.key_length": cfg["index_head_dim"], A + "attention.indexer.top_k": cfg["index_topk"],
        A + "hyper_connection.count": cfg["hc_mult"], A + "hyper_connection.sinkhorn_iterations": cfg["hc_sinkhorn_iters"],
        A + "attention.compress_ratios": cfg["compress_ratios"], A + "swiglu_clamp_exp": [cfg["swiglu_limit"]] * 7,
        A + "rope.scaling.original_context_length": cfg["original_seq_len"], A + "rope.freq_base": cfg["rope_theta"],
        A + "rope.scaling.factor": cfg["rope_factor"], A + "rope.scaling.yarn_beta_fast": cfg["beta_fast"],
        A + "rope.scaling.yarn_beta_slow": cfg["beta_slow"], A + "attention.compress_rope_freq_base": cfg["compress_rope_theta"],
        A + "expert_weights_scale": cfg["route_scale"], A + "expert_weights_norm": True,
        A + "context_length": cfg["original_seq_len"] * cfg["rope_factor"],
    }
    for k, v in want.items():
        assert f.meta(k) == pytest.approx(v), k
    for k in (A + "attention.layer_norm_rms_epsilon", A + "hyper_connection.epsilon"):
        assert f.meta(k) == pytest.approx(1e-6, rel=1e-6)


def test_default_types_follow_ds4_tiny_layout(golden, converted):
    """Layers 0-3 of v4-tiny have ds4-tiny's ratios (0,0,4,128): same names, same types except the experts."""
    ours = GGUFFile(converted["q8_0"])
    ref = GGUFFile(golden / "ds4-tiny" / "tiny.gguf")
    mine = {n: t for n, t in ours.tensors.items() if not n.startswith(("blk.4.", "blk.5.", "blk.6."))}
    assert set(mine) == set(ref.tensors)
    for n, t in mine.items():
        r = ref.tensors[n]
        assert len(t.shape) == len(r.shape), n
        if "_exps" in n:
            assert t.qtype == QT.MXFP4
        else:
            assert t.qtype == r.qtype, n
    ck = Checkpoint(str(golden / "v4-tiny"))
    w = quant.dequantize(ours.tensor("blk.3.attn_q_b.weight").raw_bytes(), QT.Q8_0, (384, 64))
    x = ck.floats("layers.3.attn.wq_b.weight")
    assert np.abs(w - x).max() <= np.abs(x).max() / 127        # Q8_0 error <= half a step of the worst block


@pytest.mark.parametrize("experts,gate_qt,bound", [("q4_k", QT.Q4_K, 0.12), ("q2_k", QT.Q2_K, 0.5),
                                                   ("iq2_xxs", QT.IQ2_XXS, 0.45)])
def test_lossy_expert_types(golden, tmp_path, experts, gate_qt, bound):
    out = tmp_path / "e.gguf"
    convert_checkpoint(str(golden / "v4-tiny"), str(out), experts=experts, progress=False)
    ck = Checkpoint(str(golden / "v4-tiny"))
    f = GGUFFile(out)
    # gate/up rows are dim=256 wide: K-quant; down rows are moe_inter_dim=96 wide: the Q8_0 fallback
    for name, w, qt in (("ffn_gate_exps", "w1", gate_qt), ("ffn_down_exps", "w2", QT.Q8_0)):
        t = f.tensor(f"blk.4.{name}.weight")
        assert t.qtype == qt
        got = quant.dequantize(t.raw_bytes(), t.qtype, t.shape)
        ref = np.stack([ck.floats(f"layers.4.ffn.experts.{e}.{w}.weight") for e in range(8)])
        assert np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)) < bound


def test_sharded_checkpoint_gives_identical_file(golden, tmp_path, converted):
    src = copy_ckpt(golden, tmp_path / "sharded", shards=3)
    out = tmp_path / "s.gguf"
    convert_checkpoint(str(src), str(out), dense="f32", progress=False)
    a, b = GGUFFile(out), GGUFFile(converted["f32"])
    assert list(a.tensors) == list(b.tensors)
    for n in a.tensors:
        assert np.array_equal(a.tensors[n].raw_bytes(), b.tensors[n].raw_bytes()), n


def test_progress_goes_to_stderr(golden, tmp_path, capsys, monkeypatch):
    import io
    import sys

    convert_checkpoint(str(golden / "v4-tiny"), str(tmp_path / "p.gguf"), dense="f32")
    cap = capsys.readouterr()            # not a terminal: no bar, one summary line
    assert cap.out == "" and cap.err == f"wrote {tmp_path / 'p.gguf'}: 212 tensors, 12.4 MiB in " + \
        cap.err.split(" in ")[-1] and cap.err.endswith(" s\n")

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stderr", Tty())
    convert_checkpoint(str(golden / "v4-tiny"), str(tmp_path / "q.gguf"), dense="f32")
    err = sys.stderr.getvalue()          # a terminal: one bar rewritten in place, then the summary
    assert "\r" in err and "100% [" in err and "212/212" in err and "\n" not in err.rsplit("\r", 1)[0]
    assert err.rstrip("\n").rsplit("\r", 1)[-1].startswith(f"wrote {tmp_path / 'q.gguf'}: 212 tensors")


def _fails(src, out, match, **kw):
    with pytest.raises(ConvertError, match=match):
        convert_checkpoint(str(src), str(out), progress=False, **kw)
    assert not [p for p in os.listdir(out.parent) if p.startswith(f".{out.name}.tmp")]


def test_errors_name_the_problem_and_leave_no_file(golden, tmp_path):
    out = tmp_path / "o.gguf"
    _fails(copy_ckpt(golden, tmp_path / "a", edit={"layers.2.attn.wkv.weight": None}), out,
           r"tensor 'layers.2.attn.wkv.weight' is missing")
    bad = np.zeros((90, 256), np.uint8)
    _fails(copy_ckpt(golden, tmp_path / "b", edit={"layers.1.attn.wkv.weight": ("F8_E4M3", bad)}), out,
           r"'layers.1.attn.wkv.weight' has shape \[90, 256\], expected \[96, 256\]")
    _fails(copy_ckpt(golden, tmp_path / "c", edit={"norm.weight": ("C64", np.zeros((256, 8), np.uint8))}), out,
           r"'norm.weight' has dtype C64")
    _fails(copy_ckpt(golden, tmp_path / "d", cfg_edit={"kv_source_layers": [2]}), out, "V4.1")
    _fails(copy_ckpt(golden, tmp_path / "e", edit={"layers.9.extra": ("F32", np.zeros(3, np.float32))}), out,
           r"'layers.9.extra' is not part of the V4 Flash layout")
    nan = np.asarray(Checkpoint(str(golden / "v4-tiny")).raw("layers.0.attn.q_norm.weight")).copy()
    nan[3] = 0x7FC0
    _fails(copy_ckpt(golden, tmp_path / "f", edit={"layers.0.attn.q_norm.weight": ("BF16", nan)}), out, "NaN")
    assert not out.exists()
    _fails(tmp_path / "nowhere", out, "not a folder")
    _fails(golden / "v4-tiny", out, "--experts 'q3_k'", experts="q3_k")
    # a failed conversion never touches an existing output
    out.write_bytes(b"keep me")
    _fails(copy_ckpt(golden, tmp_path / "a", edit={"layers.2.attn.wkv.weight": None}), out, "missing")
    assert out.read_bytes() == b"keep me"


def test_cli_reports_one_line(golden, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ds4py", "convert", str(tmp_path / "none"), str(tmp_path / "x.gguf")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a folder" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ds4py", "convert", str(golden / "v4-tiny"), str(tmp_path / "y.gguf"),
                        "--dense", "f32", "-q", "--no-tokenizer"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "" and GGUFFile(tmp_path / "y.gguf").meta("deepseek4.block_count") == 7


def test_hf_tokenizer_arrays(golden):
    tok = load_hf_tokenizer(str(golden / "tokenizer" / "tokenizer.json"), 129280)
    special = json.loads((golden / "tokenizer" / "special_tokens.json").read_text())
    assert len(tok.tokens) == len(tok.token_types) == 129280
    assert len(tok.merges) == special["merges"] and tok.merges[0] == "Ġ t"
    for k in special["key_tokens"]:
        assert tok.tokens[k["id"]] == k["content"] and tok.token_types[k["id"]] == 3
    assert (tok.bos, tok.eos) == (0, 1)
    assert tok.token_types[5000] == 1
    with pytest.raises(ConvertError, match="129280 ids but the model's vocab has 256 rows"):
        load_hf_tokenizer(str(golden / "tokenizer" / "tokenizer.json"), 256)


def test_tokenizer_is_embedded(golden, tmp_path):
    src = tmp_path / "ck"
    shutil.copytree(golden / "v4-tiny", src)
    vocab = {f"t{i}": i for i in range(250)}
    tj = {"model": {"type": "BPE", "vocab": vocab, "merges": [["t", "1"], "t 2"]},
          "added_tokens": [{"id": 0, "content": "<｜begin▁of▁sentence｜>"}, {"id": 252, "content": "<think>"}]}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    convert_checkpoint(str(src), str(tmp_path / "t.gguf"), dense="f32", progress=False)
    f = GGUFFile(tmp_path / "t.gguf")
    toks = f.meta("tokenizer.ggml.tokens")
    assert len(toks) == 256 and toks[0] == "<｜begin▁of▁sentence｜>" and toks[252] == "<think>" and toks[7] == "t7"
    assert toks[251] == "[PAD251]" and f.meta("tokenizer.ggml.token_type")[251] == 5
    assert f.meta("tokenizer.ggml.merges") == ["t 1", "t 2"] and f.meta("tokenizer.ggml.model") == "gpt2"
    assert f.meta("tokenizer.ggml.bos_token_id") == 0 and f.meta("tokenizer.ggml.eos_token_id") == 1


def test_f32_scales_and_u8_packed_experts_are_accepted(golden, tmp_path, converted):
    """Some exports store e8m0 scales as float32 powers of two, or packed FP4 as U8: same values, same file."""
    ck = Checkpoint(str(golden / "v4-tiny"))
    s = np.asarray(ck.raw("layers.2.attn.wq_b.scale"))
    es = np.asarray(ck.raw("layers.2.ffn.experts.1.w2.scale"))
    edit = {"layers.2.attn.wq_b.scale": ("F32", np.ldexp(np.float32(1), s.astype(np.int32) - 127)),
            "layers.2.ffn.experts.1.w2.scale": ("F32", np.ldexp(np.float32(1), es.astype(np.int32) - 127)),
            "layers.2.ffn.experts.1.w2.weight": ("U8", np.asarray(ck.raw("layers.2.ffn.experts.1.w2.weight")).view(np.uint8))}
    src = copy_ckpt(golden, tmp_path / "f32s", edit=edit)
    out = tmp_path / "f.gguf"
    convert_checkpoint(str(src), str(out), dense="f32", progress=False)
    a, b = GGUFFile(out), GGUFFile(converted["f32"])
    for n in ("blk.2.attn_q_b.weight", "blk.2.ffn_down_exps.weight"):
        assert np.array_equal(a.tensors[n].raw_bytes(), b.tensors[n].raw_bytes())
    bad = edit["layers.2.attn.wq_b.scale"][1] * np.float32(1.5)
    _fails(copy_ckpt(golden, tmp_path / "g", edit={"layers.2.attn.wq_b.scale": ("F32", bad)}), out,
           "'layers.2.attn.wq_b.scale' holds values that are not powers of two")


def test_bad_checkpoint_files_are_one_line_errors(golden, tmp_path):
    """Truncated / foreign safetensors, no config.json: a ConvertError naming the file, no output and no
    temporary left behind (V4.1 checkpoints convert: tests/test_convert_v41.py)."""
    out = tmp_path / "o.gguf"
    blob = (golden / "v4-tiny" / "model.safetensors").read_bytes()
    for name, data, match in (("cut_data", blob[: len(blob) // 2], "lies beyond the end of the file"),
                              ("cut_header", blob[:2000], "not a safetensors file, or truncated"),
                              ("foreign", b"\x89PNG\r\n\x1a\n" + bytes(200), "not a safetensors file"),
                              ("bad_json", struct.pack("<Q", 8) + b"{nojson}", "not valid JSON")):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(golden / "v4-tiny" / "config.json", d)
        (d / "model.safetensors").write_bytes(data)
        _fails(d, out, match)
    d = tmp_path / "noconfig"
    d.mkdir()
    shutil.copy(golden / "v4-tiny" / "model.safetensors", d)
    _fails(d, out, "config.json is missing")
    assert not out.exists()
    r = subprocess.run([sys.executable, "-m", "ds4py", "convert", str(tmp_path / "cut_data"), str(out),
                        "--no-tokenizer"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "truncated" in r.stderr and not out.exists()


def synthetic_checkpoint(golden, dst, shards=1, **cfg_edit):
    """A random official-layout checkpoint of any shape (FP8 + e8m0 linears, FP4 experts, BF16, F32, I64)."""
    from ds4py.convert import scale_name
    cfg = json.loads((golden / "v4-tiny" / "config.json").read_text()) | cfg_edit
    s = shape_from_config(cfg)
    rng = np.random.default_rng(0)
    t = {}
    for sp in ds4_layout(s):
        shp = sp.shape[1:] if sp.slot == "experts" else sp.shape
        for n in sp.src if isinstance(sp.src, list) else [sp.src]:
            if sp.slot == "q8":
                t[n] = ("F8_E4M3", rng.integers(0, 0x7F, shp, dtype=np.uint8) | np.uint8(0x80) * rng.integers(0, 2, shp, dtype=np.uint8))
                t[scale_name(n)] = ("F8_E8M0", np.full((-(-shp[0] // 128), -(-shp[1] // 128)), 120, np.uint8))
            elif sp.slot == "experts":
                t[n] = ("I8", rng.integers(-128, 128, (shp[0], shp[1] // 2), dtype=np.int8))
                t[scale_name(n)] = ("F8_E8M0", np.full((shp[0], shp[1] // 32), 124, np.uint8))
            elif sp.slot == "i32":
                t[n] = ("I64", np.argsort(rng.random((shp[0], s.n_experts)), 1)[:, :shp[1]].astype(np.int64))
            elif sp.slot == "f16":
                t[n] = ("BF16", (rng.standard_normal(shp, np.float32).view(np.uint32) >> 16).astype(np.uint16))
            else:
                t[n] = ("F32", rng.standard_normal(shp, np.float32))
    os.makedirs(dst, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    names, wmap = list(t), {}
    for k in range(shards):
        fname = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: t[n] for n in names[k::shards]}
        write_safetensors(dst / fname, part)
        wmap.update({n: fname for n in part})
    if shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return dst, t


# VmHWM (peak RSS of this process image; ru_maxrss would include the forking parent's, pytest's, peak)
MEASURE = """
import sys
from ds4py.convert import convert_checkpoint
kb = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
base = kb()
convert_checkpoint(sys.argv[1], sys.argv[2], dense="f32", progress=False)
print(base, kb())
"""


def test_peak_memory_is_bounded_by_the_largest_tensor(golden, tmp_path):
    """Peak RSS growth while converting a sharded 110 MB checkpoint stays within about one output tensor (and
    its float32 working copy) + one source tensor: tensors are built, written and dropped one at a time, and
    the memory-mapped sources are unmapped after each (otherwise every page read stays resident: measured
    +42 MiB with, +122 MiB without)."""
    src, t = synthetic_checkpoint(golden, tmp_path / "ck", shards=2, dim=512, vocab_size=8192, moe_inter_dim=512,
                                  n_routed_experts=32)
    out = tmp_path / "big.gguf"
    r = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(out)], capture_output=True, text=True,
                       check=True)
    base, peak = (int(v) << 10 for v in r.stdout.split())
    f = GGUFFile(out)
    largest_out = max(x.nbytes for x in f.tensors.values())              # F32 embedding / head: 16 MiB
    largest_src = max(a.nbytes for _, a in t.values())                    # BF16 embedding: 8 MiB
    total_src = sum(a.nbytes for _, a in t.values())                      # 113 MiB
    bound = 2 * largest_out + largest_src + (16 << 20)
    assert total_src + largest_out > 1.5 * bound                          # holding everything would fail
    assert peak - base <= bound, f"peak RSS grew by {(peak - base) >> 20} MiB (bound {bound >> 20} MiB)"
    up = f.tensor("blk.1.ffn_up_exps.weight")
    got = quant.dequantize(up.raw_bytes(), up.qtype, up.shape)[3]
    want = official.dequant_fp4(t["layers.1.ffn.experts.3.w3.weight"][1], t["layers.1.ffn.experts.3.w3.scale"][1])
    assert np.array_equal(got, want)


def test_bad_output_paths_fail_before_any_work(golden, tmp_path, monkeypatch):
    from ds4py import convert
    from ds4py.tiny import make_tiny

    monkeypatch.setattr(convert._Converter, "plan", lambda self: pytest.fail("planned despite a bad OUT"))
    for out, match in ((tmp_path, "is a folder"), (tmp_path / "no" / "x.gguf", "output folder .* does not exist")):
        with pytest.raises(ConvertError, match=match):
            convert_checkpoint(str(golden / "v4-tiny"), str(out), progress=False)
        with pytest.raises(ConvertError, match=match):
            make_tiny(str(out))
    assert list(tmp_path.iterdir()) == []


def test_bf16_and_f32_checkpoints_convert_like_the_fp8_one(golden, tmp_path):
    """A dequantised export (FP8 linears as BF16 or F32, FP4 experts as BF16, no .scale tensors) holds the
    same values (e4m3 and e2m1 times a power of two fit BF16 exactly), so it must give the same GGUF; MXFP4
    output needs the FP4 codes and is refused with a pointer to --experts q4_k."""
    ck = Checkpoint(str(golden / "v4-tiny"))
    edit = {}
    for n in ck.entries:
        if n.endswith(".scale"):
            edit[n] = None
        elif ck.dtype(n) in ("F8_E4M3", "I8"):
            x = ck.floats(n)
            if ".experts." in n or n.endswith("wq_a.weight"):
                edit[n] = ("BF16", (x.view(np.uint32) >> 16).astype(np.uint16))
            else:
                edit[n] = ("F32", x)
    src = copy_ckpt(golden, tmp_path / "bf16", edit=edit)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert_checkpoint(str(src), str(a), experts="q4_k", dense="f32", progress=False)
    convert_checkpoint(str(golden / "v4-tiny"), str(b), experts="q4_k", dense="f32", progress=False)
    fa, fb = GGUFFile(a), GGUFFile(b)
    assert list(fa.tensors) == list(fb.tensors)
    for n in fa.tensors:
        assert fa.tensors[n].qtype == fb.tensors[n].qtype and np.array_equal(fa.tensors[n].raw_bytes(), fb.tensors[n].raw_bytes()), n
    _fails(src, tmp_path / "c.gguf", "not packed FP4; MXFP4 output needs the official FP4 experts")
