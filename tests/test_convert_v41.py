"""`convert` of the official V4.1 layout (golden v41-tiny): the deepseek41 GGUF layout, exact values, both config
styles (ModelArgs inference/config.json and the HF config.json), errors; then score, inspect, run, bench and
serve on the converted model."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py import checksum, engram, quant
from ds4py.config import ARCH_V41, ModelConfig
from ds4py.convert import Checkpoint, ConvertError, convert_checkpoint, ds4_layout, shape_from_config
from ds4py.gguf import GGUFFile
from helpers import REPO, start_serve
from test_convert import write_safetensors

# the official ModelArgs names -> the HF config.json's text_config names (the real checkpoint's spelling)
HF_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "moe_inter_dim": "moe_intermediate_size", "n_activated_experts": "num_experts_per_tok",
            "norm_eps": "rms_norm_eps", "route_scale": "routed_scaling_factor", "window_size": "sliding_window",
            "rope_head_dim": "qk_rope_head_dim", "kv_source_layers": "kv_source_layer_ids",
            "index_source_layers": "index_source_layer_ids", "candidate_source_layer": "candidate_source_layer_id",
            "engram_pad_id": "engram_pad_token_id", "score_func": "scoring_func", "max_seq_len": "max_position_embeddings",
            "norm_topk_prob": "norm_topk_prob"}


def hf_config(golden) -> dict:
    """The golden ModelArgs config as the HF checkpoint spells it: {architectures, model_type, text_config}."""
    c = json.loads((golden / "v41-tiny" / "config.json").read_text())
    text = {"model_type": "deepseek_v41_text"}
    for k, v in c.items():
        if k in ("original_seq_len", "rope_factor", "beta_fast", "beta_slow"):
            continue
        text[HF_NAMES.get(k, k)] = v
    text["rope_scaling"] = {"rope_type": "yarn", "factor": c["rope_factor"], "beta_fast": c["beta_fast"],
                            "beta_slow": c["beta_slow"], "original_max_position_embeddings": c["original_seq_len"]}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
            "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}}


def checkpoint_copy(golden, dst, cfg: dict | None = None, tensors: dict | None = None):
    """A folder holding the golden checkpoint (a symlink, or `tensors` written out) and a config.json."""
    os.makedirs(dst, exist_ok=True)
    if tensors is None:
        os.symlink(golden / "v41-tiny" / "model.safetensors", dst / "model.safetensors")
    else:
        write_safetensors(dst / "model.safetensors", tensors)
    cfg = cfg if cfg is not None else json.loads((golden / "v41-tiny" / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_layout_metadata_and_exact_values(v41_gguf, golden):
    """The deepseek41 GGUF: the schema's tensors in its order, metadata equal to the config, dense F32 equal to the
    dequantised official values, experts the official FP4 codes (MXFP4 repack), Engram tables left in the shards."""
    f, ck = GGUFFile(v41_gguf), Checkpoint(str(golden / "v41-tiny"))
    cfg = ModelConfig.from_gguf(f)
    want = shape_from_config(json.loads((golden / "v41-tiny" / "config.json").read_text()))
    assert f.meta("general.architecture") == ARCH_V41 and cfg.is_v41
    assert np.float32(cfg.norm_eps) == np.float32(want.norm_eps) and np.float32(cfg.hc_eps) == np.float32(want.hc_eps)
    assert cfg == dataclasses.replace(want, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps)       # eps: stored as F32
    assert list(f.tensors) == [sp.name for sp in ds4_layout(cfg)]
    assert not any("engram.embed" in n or n.startswith("output_hc") for n in f.tensors)
    assert f.meta(f"{ARCH_V41}.attention.kv_source_layers") == [1, 3]
    assert f.meta(f"{ARCH_V41}.engram.table_rows") == [660, 864] and cfg.context_length == 256
    assert f.meta(f"{ARCH_V41}.engram.source_dir") == str(golden / "v41-tiny")
    assert len(f.meta(f"{ARCH_V41}.engram.table_digests")) == 2
    for sp in ds4_layout(cfg):
        t = f.tensors[sp.name]
        if sp.slot == "experts":
            assert t.qtype == QT.MXFP4
            got = quant.dequantize(t.raw_bytes()[3], QT.MXFP4, t.shape[1:])
            np.testing.assert_array_equal(got, ck.floats(sp.src[3]), err_msg=sp.name)
        else:
            assert t.qtype == QT.F32, sp.name
            np.testing.assert_array_equal(np.asarray(t.raw).reshape(sp.shape), ck.floats(sp.src).reshape(sp.shape),
                                          err_msg=sp.name)


def test_hf_style_config_gives_the_same_model(golden, tmp_path, v41_gguf):
    """The HF config.json (text_config, HF names, rope_scaling) describes the same model as inference/config.json:
    the same ModelConfig and, converted, the same tensors and metadata."""
    cfg = hf_config(golden)
    assert shape_from_config(cfg) == shape_from_config(json.loads((golden / "v41-tiny" / "config.json").read_text()))
    src = checkpoint_copy(golden, tmp_path / "hf", cfg)
    out = tmp_path / "hf.gguf"
    convert_checkpoint(str(src), str(out), dense="f32", progress=False)
    a, b = GGUFFile(out), GGUFFile(v41_gguf)
    assert list(a.tensors) == list(b.tensors)
    for n in a.tensors:
        assert np.array_equal(a.tensors[n].raw_bytes(), b.tensors[n].raw_bytes()), n
    skip = ("general.name", f"{ARCH_V41}.engram.source_dir", checksum.META_KEY)
    keys = [k for k in b.keys() if not k.startswith("tokenizer.") and k not in skip]
    assert {k: a.meta(k) for k in keys} == {k: b.meta(k) for k in keys}


def _fails(src, out, match, **kw):
    with pytest.raises(ConvertError, match=match) as e:
        convert_checkpoint(str(src), str(out), progress=False, **kw)
    assert "\n" not in str(e.value)
    assert not out.exists() and not [p for p in os.listdir(out.parent) if p.startswith(f".{out.name}.tmp")]


def test_bad_v41_checkpoints_are_one_line_errors(golden, tmp_path):
    out = tmp_path / "o.gguf"
    base = json.loads((golden / "v41-tiny" / "config.json").read_text())

    def cfg_case(name, match, **edit):
        _fails(checkpoint_copy(golden, tmp_path / name, {**base, **edit}), out, match)

    cfg_case("kv", "kv source layer 5 is not an index source", kv_source_layers=[1, 3, 5], index_source_layers=[1, 3])
    cfg_case("first", "compressed layer 1 has no kv source", kv_source_layers=[3])
    cfg_case("ratio", "reads rows or top-k of a layer with another ratio", kv_source_layers=[1], index_source_layers=[1])
    cfg_case("cand", "candidate_source_layer 2 is not an index source", candidate_source_layer=2)
    cfg_case("hash", "no hash-routed layers", n_hash_layers=2)
    cfg_case("score", "score_func 'softmax'", score_func="softmax")
    cfg_case("rows", r"Engram table 'layers.0.engram.embed.weight' is F8_E4M3 \[660, 32\], expected F8_E4M3 "
                     r"\[700, 32\]", engram_num_embeddings=[700, 864])
    ck = Checkpoint(str(golden / "v41-tiny"))
    tensors = {n: (ck.dtype(n), np.asarray(ck.raw(n))) for n in ck.entries}
    tensors["layers.9.attn.extra"] = ("F32", np.zeros(3, np.float32))
    _fails(checkpoint_copy(golden, tmp_path / "extra", None, tensors), out,
           r"'layers.9.attn.extra' is not part of the V4.1 Flash layout")
    tensors.pop("layers.9.attn.extra")
    w = np.asarray(ck.raw("layers.2.attn.wq_a.weight"))
    tensors["layers.2.attn.wq_a.scale"] = ("F8_E8M0", np.full((1, 2), 127, np.uint8))        # 128x128 tiles
    tensors["layers.2.attn.wq_a.weight"] = ("F8_E4M3", w)
    _fails(checkpoint_copy(golden, tmp_path / "tiles", None, tensors), out, r"uses 128x128 FP8 tiles; .* uses 32x32")


def test_cli_convert_notes_what_stays_out(golden, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ds4py", "convert", str(golden / "v41-tiny"), str(tmp_path / "x.gguf"),
                        "--dense", "f32", "--no-tokenizer"], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert "skipping 4 tensors: hash buffers" in r.stderr and "2 Engram tables stay in the checkpoint's shards" \
        in r.stderr
    assert GGUFFile(tmp_path / "x.gguf").meta("general.architecture") == ARCH_V41


def test_score_cli_matches_the_golden_decode(v41_gguf, golden, tmp_path):
    g = np.load(golden / "v41-tiny" / "cases.npz")
    ids, P = g["a_ids"], int(g["a_P"])
    np.save(tmp_path / "ids.npy", ids)
    r = subprocess.run([sys.executable, "-m", "ds4py", "score", "-m", v41_gguf, "--ids", str(tmp_path / "ids.npy"),
                        "--split", str(P), "--out", str(tmp_path / "o.npy"), "--no-fake-quant"],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    out = np.load(tmp_path / "o.npy")
    want = np.concatenate([g["a_prefill_last_logits_fp32_fixed_noquant"][None], g["a_decode_logits_fp32_fixed_noquant"]])
    assert out.shape == (len(ids) - P + 1, 512) and np.abs(out[:-1] - want[:-1]).max() <= 1e-4


# ---- a V4.1 model with a usable vocabulary: run, bench, serve ------------------------------------------------
def chat_tokenizer_json(path) -> list:
    """make-tiny's 511-token byte-level BPE vocabulary plus V4.1's <｜System｜>, as a HF tokenizer.json."""
    from ds4py.tiny import tiny_tokenizer

    tok = tiny_tokenizer(511)
    tokens, types = tok.tokens + ["<｜System｜>"], tok.token_types + [3]
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != 3}
    added = [{"id": i, "content": t, "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3]
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": tok.merges},
                                "added_tokens": added}))
    return [(t, ty == 3) for t, ty in zip(tokens, types)]


@pytest.fixture(scope="module")
def chat_model(golden, tmp_path_factory):
    """The golden V4.1 weights (q8_0 dense, the default) with a real BPE vocabulary: its compressed size goes into
    the config, as the official code requires (the hashes then differ from the golden run's)."""
    d = tmp_path_factory.mktemp("v41chat")
    vocab = chat_tokenizer_json(d / "tokenizer.json")
    n = engram.compressed_token_map([t for t, _ in vocab], [a for _, a in vocab])[1]
    cfg = json.loads((golden / "v41-tiny" / "config.json").read_text()) | {"engram_compressed_vocab_size": n}
    src = checkpoint_copy(golden, d / "ckpt", cfg)
    shutil.copy(d / "tokenizer.json", src / "tokenizer.json")
    convert_checkpoint(str(src), str(d / "v41-chat.gguf"), progress=False)
    return str(d / "v41-chat.gguf")


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4py", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_inspect_run_and_bench(chat_model):
    r = _cli("inspect", chat_model, "--verify")
    assert r.returncode == 0 and "kv source layers             1,3" in r.stdout and "Engram tables in" in r.stdout, \
        r.stdout + r.stderr
    r = _cli("run", "-m", chat_model, "-p", "Hello there", "--nothink", "-n", "6", "--temp", "0")
    assert r.returncode == 0, r.stderr
    r = _cli("bench", "-m", chat_model, "--ctx-start", "48", "--ctx-max", "48", "--gen-tokens", "3", "--format", "json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["rows"][0]
    assert row["ctx_tokens"] == 48 and row["gen_tokens"] == 3 and row["gen_tps"] > 0


def test_serve_answers_with_the_v41_chat_format(chat_model, tmp_path):
    """The server renders V4.1 prompts (<｜System｜> and the effort line in thinking mode) and answers."""
    import openai

    from ds4py.chat import chat_format
    from ds4py.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(chat_model)
    ids = chat_format("v41").encode_prompt([{"role": "user", "content": "hi"}], {"thinking_mode": "thinking"}, tok)
    assert ids[1] == tok.special_id("<｜System｜>")
    proc, base = start_serve(["-m", chat_model, "--ctx", "256"])
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        r = client.chat.completions.create(model="deepseek-v4-flash", max_tokens=6, temperature=0,
                                           messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "What is the weather?"}])
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        sent = tok.encode("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 50 (range 1-100, the higher the value, "
                          "the more thorough the reasoning)\n\nBe brief.<｜User｜>What is the weather?<｜Assistant｜>"
                          "<think>", special=True)
        assert r.usage.prompt_tokens == len(sent)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_quantize_vq_takes_a_v41_gguf(v41_gguf, tmp_path):
    """quantize-vq copies the metadata as it is: the VQ-8 file is a V4.1 model that finds its Engram tables and runs."""
    from ds4py.quant import vq
    from ds4py.ref.engine import RefModel

    out = tmp_path / "vq.gguf"
    r = _cli("quantize-vq", v41_gguf, str(out), "--bits", "6", "--min-pool", "100", "--rounds", "1",
             "--train-per-code", "100", "-q")
    assert r.returncode == 0, r.stderr
    f = GGUFFile(out)
    assert f.meta("general.architecture") == ARCH_V41 and vq.is_vq(f, "blk.3.ffn_up_exps.weight")
    m = RefModel(str(out))
    assert m.config.is_v41 and np.isfinite(m.prefill(m.new_state(), list(range(40)))).all()
