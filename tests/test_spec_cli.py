"""Speculative decoding through the commands: convert --mtp (ds4's MTP layout), run / serve / bench --mtp and
--no-spec, score --mtp-out, make-tiny --mtp; the errors a user meets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ds4py.errors import Ds4Error, GGUFError
from ds4py.gguf import GGUFFile
from helpers import start_serve

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}

# ds4.c mtp_weights_bind(): the 32 tensors ds4 requires of its MTP file (github.com/antirez/ds4)
DS4_MTP_TENSORS = {f"mtp.0.{n}" for n in (
    "hc_head_base.weight", "hc_head_fn.weight", "hc_head_scale.weight", "e_proj.weight", "h_proj.weight",
    "enorm.weight", "hnorm.weight", "norm.weight", "hc_attn_fn.weight", "hc_attn_scale.weight",
    "hc_attn_base.weight", "attn_norm.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight",
    "attn_kv.weight", "attn_kv_a_norm.weight", "attn_sinks.weight", "attn_output_a.weight",
    "attn_output_b.weight", "hc_ffn_fn.weight", "hc_ffn_scale.weight", "hc_ffn_base.weight", "ffn_norm.weight",
    "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_exps.weight",
    "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")}


def ds4py(*args, check=True, timeout=300):
    r = subprocess.run([sys.executable, "-m", "ds4py", *map(str, args)], capture_output=True, text=True, env=ENV,
                       cwd=REPO, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny model with a tokenizer and its random MTP draft file (make-tiny --mtp)."""
    d = tmp_path_factory.mktemp("tinymtp")
    ds4py("make-tiny", d / "t.gguf", "--mtp", d / "t.mtp.gguf", "--layers", 3, "--vocab", 512)
    return str(d / "t.gguf"), str(d / "t.mtp.gguf")


def test_convert_writes_ds4s_mtp_layout(v4_mtp_gguf):
    main, mtp = v4_mtp_gguf
    f = GGUFFile(mtp)
    assert set(f.tensors) == DS4_MTP_TENSORS
    assert not any(n.startswith("mtp.") for n in GGUFFile(main).tensors)
    assert f.meta("deepseek4.embedding_length") == GGUFFile(main).meta("deepseek4.embedding_length")


def test_convert_mtp_errors(golden, tmp_path, v4_mtp_gguf):
    r = ds4py("convert", golden / "v4-tiny", tmp_path / "a.gguf", "--mtp", tmp_path / "a.mtp.gguf", "-q",
              "--no-tokenizer", check=False)
    assert r.returncode != 0 and "no MTP block" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "a.gguf").exists()
    r = ds4py("convert", golden / "v4-tiny-mtp", tmp_path / "b.gguf", "--mtp", tmp_path / "b.gguf", "-q", check=False)
    assert r.returncode != 0 and "must not be the main output" in r.stderr


def test_mtp_file_checks(v4_mtp_gguf, tiny):
    from ds4py.ref.engine import RefModel
    from ds4py.ref.mtp import RefMtp

    main, mtp = v4_mtp_gguf
    m = RefModel(main)
    with pytest.raises(GGUFError, match="not an MTP draft file"):
        RefMtp(m, main)
    with pytest.raises(Ds4Error, match="another model"):
        RefMtp(m, tiny[1])


def test_run_with_mtp_gives_the_plain_greedy_answer(tiny):
    model, mtp = tiny
    args = ("run", "-m", model, "-p", "Hello there", "--temp", 0, "-n", 24, "--nothink", "--color", "never")
    plain = ds4py(*args, "--no-spec", "--mtp", mtp, "-v")
    fast = ds4py(*args, "--mtp", mtp, "-v")
    assert fast.stdout == plain.stdout and fast.stdout.strip()
    assert "[spec: " in fast.stderr and "speculative decoding with" in fast.stderr
    assert "[spec: " not in plain.stderr
    r = ds4py(*args, "--mtp", model, check=False)
    assert r.returncode != 0 and "not an MTP draft file" in r.stderr and "Traceback" not in r.stderr


def test_score_mtp_out_matches_the_golden_driver(golden, v4_mtp_gguf, tmp_path):
    g = np.load(golden / "v4-tiny-mtp" / "cases.npz")
    np.save(tmp_path / "ids.npy", g["b_ids"])
    main, mtp = v4_mtp_gguf
    ds4py("score", "-m", main, "--mtp", mtp, "--ids", tmp_path / "ids.npy", "--split", 1, "--out", tmp_path / "l.npy",
          "--mtp-out", tmp_path / "d.npy", "--no-fake-quant")
    want = np.concatenate([g["b_mtp_prefill_logits_noquant"], g["b_mtp_decode_logits_noquant"]])
    got = np.load(tmp_path / "d.npy")
    assert got.shape == (len(g["b_ids"]) - 1, 256) and np.abs(got - want).max() < 1e-4
    assert np.abs(np.load(tmp_path / "l.npy")[1:] - g["b_decode_logits_noquant"]).max() < 1e-4
    r = ds4py("score", "-m", main, "--mtp", mtp, "--ids", tmp_path / "ids.npy", "--split", 1, "--out",
              tmp_path / "l.npy", check=False)
    assert r.returncode != 0 and "--mtp-out" in r.stderr


def test_bench_reports_speculation_measured_against_plain(tiny):
    model, mtp = tiny
    r = ds4py("bench", "-m", model, "--mtp", mtp, "--ctx-start", 32, "--ctx-max", 32, "--gen-tokens", 12,
              "--format", "json")
    row = json.loads(r.stdout)["rows"][0]
    assert row["spec_tps"] > 0 and row["spec_speedup"] == pytest.approx(row["spec_tps"] / row["gen_tps"])
    assert 0 <= row["spec_acceptance"] <= 1 and row["spec_mean_k"] >= 0
    # random weights: the model's costs, measured from the warm-up probe on (a SpecModel's requests share them),
    # may rightly say no round of drafts pays here; a round that drafted yields at least one token
    assert row["spec_tokens_per_round"] >= 1 or row["spec_mean_k"] == 0


def test_serve_with_mtp_streams_the_plain_answer_and_reports_acceptance(tiny):
    model, mtp = tiny
    body = json.dumps({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 16, "temperature": 0, "thinking": {"type": "disabled"}}).encode()
    texts = []
    for extra in ([], ["--no-spec"]):
        proc, base = start_serve(["-m", model, "--mtp", mtp, "-v", *extra], env={"OPENBLAS_NUM_THREADS": "1"})
        try:
            req = urllib.request.Request(base + "/v1/chat/completions", body, {"content-type": "application/json"})
            texts.append(json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["message"])
            metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
        finally:
            proc.terminate()
            err = proc.communicate(timeout=30)[1]
        if not extra:
            lines = dict(ln.split() for ln in metrics.splitlines() if ln.startswith("ds4py_spec"))
            assert int(lines["ds4py_spec_rounds_total"]) >= 1 and int(lines["ds4py_spec_draft_tokens_total"]) >= 1
            assert "ds4py_spec_acceptance_ratio" in lines and "ds4py_spec_tokens_per_round" in lines
            assert "tokens/round" in err and "speculative decoding with" in err
        else:
            assert "ds4py_spec_rounds_total 0" in metrics
    assert texts[0] == texts[1]
