"""DSpark through the CLI and the server: a V4.1 file with its draft speculates by default (run, serve, bench), the
answer equals --no-spec's, and -v, /metrics, the request log and bench report acceptance, tokens per round and the
chosen k."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ds4py import engram
from ds4py.convert import convert_checkpoint
from helpers import start_serve
from test_convert_v41 import chat_tokenizer_json

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4py", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def chat_model(golden, tmp_path_factory):
    """golden v41-tiny-dspark (backbone and draft) with a real BPE vocabulary, its compressed size in the config."""
    d = tmp_path_factory.mktemp("dsparkchat")
    vocab = chat_tokenizer_json(d / "tokenizer.json")
    n = engram.compressed_token_map([t for t, _ in vocab], [a for _, a in vocab])[1]
    src = d / "ckpt"
    src.mkdir()
    os.symlink(golden / "v41-tiny-dspark" / "model.safetensors", src / "model.safetensors")
    cfg = json.loads((golden / "v41-tiny-dspark" / "config.json").read_text()) | {"engram_compressed_vocab_size": n}
    (src / "config.json").write_text(json.dumps(cfg))
    shutil.copy(d / "tokenizer.json", src / "tokenizer.json")
    convert_checkpoint(str(src), str(d / "dspark-chat.gguf"), progress=False)
    return str(d / "dspark-chat.gguf")


def test_run_speculates_by_default_with_the_plain_answer(chat_model):
    args = ("run", "-m", chat_model, "-p", "Hello there", "--nothink", "-n", "12", "--temp", "0", "-v")
    spec, plain = _cli(*args), _cli(*args, "--no-spec")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout == plain.stdout
    assert "[spec:" in spec.stderr and "mean k" in spec.stderr and "[spec:" not in plain.stderr
    r = _cli("run", "-m", chat_model, "-p", "x", "--mtp", chat_model, "-n", "2")
    assert r.returncode != 0 and "drop --mtp" in r.stderr and "Traceback" not in r.stderr


def test_bench_reports_dspark(chat_model):
    r = _cli("bench", "-m", chat_model, "--ctx-start", "32", "--ctx-max", "32", "--gen-tokens", "6", "--format",
             "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    row = out["rows"][0]
    assert out["info"]["draft"] == "dspark" and row["spec_tps"] > 0 and row["spec_mean_k"] is not None
    assert 0 <= row["spec_acceptance"] <= 1


def test_serve_speculates_and_reports_it(chat_model):
    import openai

    answers = {}
    for flag in ([], ["--no-spec"]):
        proc, base = start_serve(["-m", chat_model, "--ctx", "256", "-v", *flag])
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x")
            r = client.chat.completions.create(model="deepseek-chat", max_tokens=10, temperature=0,
                                               messages=[{"role": "user", "content": "What is the weather?"}],
                                               extra_body={"thinking": {"type": "disabled"}})
            answers[bool(flag)] = r.choices[0].message.content
            metrics = urllib.request.urlopen(base + "/metrics").read().decode()
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        m = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln and not ln.startswith("#")}
        steps = m["ds4py_spec_rounds_total"] + m["ds4py_spec_plain_steps_total"]
        if flag:
            assert steps == 0 and "mean k" not in err
        else:
            assert steps >= 9 and "ds4py_spec_mean_k" in m and "mean k" in err, err[-2000:]
    assert answers[True] == answers[False]
