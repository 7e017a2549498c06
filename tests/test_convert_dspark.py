"""V4.1's DSpark draft in the GGUF: converted from the official checkpoint into the V4.1 file (golden
v41-tiny-dspark), declared by the weight schema, checked at load and by `inspect --verify`, quantised by
`quantize-vq` like the backbone's experts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4py import schema
from ds4py.config import ModelConfig
from ds4py.convert import ConvertError, convert_checkpoint
from ds4py.errors import Ds4Error
from ds4py.gguf import GGUFFile
from ds4py.quant import vq
from ds4py.ref.engine import RefModel

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4py", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_layout_metadata_and_exact_values(dspark_gguf, golden):
    """Every draft tensor of the schema, after the backbone, with the official values (dense F32 is lossless)."""
    from ds4py.convert import Checkpoint

    f = GGUFFile(dspark_gguf)
    cfg = ModelConfig.from_gguf(f)
    assert (cfg.dspark_stages, cfg.dspark_block, cfg.dspark_noise_id, cfg.dspark_targets, cfg.dspark_rank,
            cfg.dspark_experts, cfg.dspark_experts_used) == (3, 5, 511, (3, 4, 5), 32, 4, 2)
    names = list(f.tensors)
    want = [e.name for e in schema.dspark_entries(cfg)]
    assert names[-len(want):] == want and len(want) == 6 + 3 * 24
    assert set(schema.model_tensors(cfg)) == set(names)
    ck = Checkpoint(str(golden / "v41-tiny-dspark"))
    ck.fp8_block = 32
    for name, src in (("dspark.markov_embd.weight", "mtp.2.markov_head.embed.weight"),
                      ("dspark.confidence.weight", "mtp.2.confidence_head.proj.weight"),
                      ("dspark.main_proj.weight", "mtp.0.main_proj.weight"),
                      ("dspark.2.attn_sinks.weight", "mtp.2.attn.attn_sink"),
                      ("dspark.1.hc_ffn_base.weight", "mtp.1.hc_ffn_base")):
        x = ck.floats(src)
        assert np.array_equal(np.asarray(f.tensors[name].raw, np.float32).reshape(x.shape), x), name
    m = RefModel(dspark_gguf)
    full = m.weight_bytes_per_token()
    assert full < sum(t.nbytes for t in f.tensors.values()) - sum(
        f.tensors[n].nbytes for n in want), "the draft is not read by a main step"
    r = _cli("inspect", dspark_gguf, "--verify")
    assert r.returncode == 0 and "verify: OK" in r.stdout and "DSpark stages x block" in r.stdout, r.stderr


def test_a_missing_or_foreign_draft_tensor_is_refused(dspark_gguf, tmp_path):
    """Loading checks the draft's tensors like the backbone's: one left out, one of another shape."""
    from gguf_tools import Gguf

    g = Gguf.read(dspark_gguf)
    g.tensors = [t for t in g.tensors if t.name != "dspark.1.attn_kv.weight"]
    with pytest.raises(Ds4Error, match="dspark.1.attn_kv.weight"):
        RefModel(str(g.write(tmp_path / "missing.gguf")))
    g = Gguf.read(dspark_gguf)
    t = g.tensor("dspark.markov_head.weight")
    t.ne, t.data = [16, 512], t.data[:len(t.data) // 2]
    with pytest.raises(Ds4Error, match="dspark.markov_head.weight"):
        RefModel(str(g.write(tmp_path / "shape.gguf")))


def test_checkpoint_without_draft_config_or_tensors(golden, tmp_path):
    """A config without DSpark keys: the mtp.* tensors are skipped with a note; a config declaring a draft whose
    checkpoint has none: a GGUF without draft, with a note; --mtp on V4.1 is refused in one sentence."""
    src = golden / "v41-tiny-dspark"
    cfg = json.loads((src / "config.json").read_text())
    plain = {k: v for k, v in cfg.items() if not k.startswith("dspark_")}
    d = tmp_path / "nodraft"
    d.mkdir()
    os.symlink(src / "model.safetensors", d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(plain))
    r = _cli("convert", d, tmp_path / "x.gguf", "--dense", "f32", "--no-tokenizer")
    assert r.returncode == 0 and "skipping 166 tensors: DSpark draft stages" in r.stderr, r.stderr
    assert not ModelConfig.from_gguf(GGUFFile(tmp_path / "x.gguf")).has_dspark
    with pytest.raises(ConvertError, match="written into the V4.1 GGUF itself"):
        convert_checkpoint(str(src), str(tmp_path / "y.gguf"), dense="f32", mtp=str(tmp_path / "y.mtp.gguf"),
                           progress=False)
    bad = dict(cfg, compress_ratios=cfg["compress_ratios"][:6] + [0, 2, 0])
    (d / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConvertError, match="window only"):
        convert_checkpoint(str(d), str(tmp_path / "z.gguf"), dense="f32", progress=False)



def test_a_model_without_draft_says_so(v41_gguf):
    m = RefModel(v41_gguf)
    with pytest.raises(Ds4Error, match="no DSpark draft"):
        m.open_dspark()
    with pytest.raises(Ds4Error, match="no DSpark draft"):
        m.step_taps([m.new_state()], [[1, 2]])


def test_quantize_vq_takes_the_draft_stages(dspark_gguf, tmp_path):
    """The three stages' routed experts get VQ-8 (a header and codebook per stage, as per backbone layer); the
    quantised file loads, verifies and drafts."""
    out = tmp_path / "vq.gguf"
    # k-means' own gains: the bound below is for them; the default unbiased gains (x <w,w>/<q,w>) grow the error of
    # this deliberately poor codebook (6 bits, one round, 100 samples a code, random weights: q barely follows w)
    r = _cli("quantize-vq", dspark_gguf, out, "--bits", "6", "--min-pool", "100", "--rounds", "1",
             "--train-per-code", "100", "--no-unbiased-gains")
    assert r.returncode == 0, r.stderr
    assert "dspark.2: 6 bits" in r.stderr
    f = GGUFFile(out)
    for s in range(3):
        assert vq.is_vq(f, f"dspark.{s}.ffn_gate_exps.weight") and f"dspark.{s}.ffn_vq.codebook" in f.tensors
    assert vq.is_vq(f, "blk.2.ffn_up_exps.weight")
    r = _cli("inspect", out, "--verify")        # (quantize-vq writes no checksums: the structure checks pass)
    assert "VQ8x6" in r.stdout and "its structure and sampled values are fine" in r.stderr, r.stderr
    m, ref = RefModel(str(out)), RefModel(dspark_gguf)
    outs = []
    for model in (m, ref):
        draft, st = model.open_dspark(), model.new_state()
        ds = draft.new_state()
        (_,), (taps,) = model.step_taps([st], [list(range(40))])
        draft.feed([ds], [taps])
        outs.append(draft.block(ds, 7).base)
    assert np.isfinite(outs[0]).all() and 0 < np.abs(outs[0] - outs[1]).max() < 3 * np.abs(outs[1]).std()
