"""`convert` on malformed inputs (config.json, the shard index) and when it is killed: one sentence, no
traceback, no output and no hidden temporary file left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ds4py.convert import ConvertError, convert_checkpoint
from helpers import REPO


def _src(golden, tmp_path, name, config=None, index=None, raw_config=None, drop=()):
    d = tmp_path / name
    d.mkdir()
    (d / "model.safetensors").symlink_to(golden / "v4-tiny" / "model.safetensors")
    if raw_config is not None:
        (d / "config.json").write_bytes(raw_config)
    else:
        cfg = json.loads((golden / "v4-tiny" / "config.json").read_text())
        cfg.update(config or {})
        for k in drop:
            cfg.pop(k)
        (d / "config.json").write_text(json.dumps(cfg))
    if index is not None:
        (d / "model.safetensors.index.json").write_bytes(index)
    return d


CONFIGS = [
    ("not-json", dict(raw_config=b"{dim: 256"), "config.json is not valid JSON"),
    ("a-list", dict(raw_config=b"[1, 2]"), "config.json must be a JSON object"),
    ("a-string", dict(raw_config=b'"dim"'), "must be a JSON object"),
    ("dim-string", dict(config={"dim": "256"}), "'dim' is \"256\", expected an integer"),
    ("layers-float", dict(config={"n_layers": 7.5}), "'n_layers' is 7.5, expected an integer"),
    ("ratios-string", dict(config={"compress_ratios": "0,0,4,128,4,128,4"}), "expected a list of integers"),
    ("ratios-of-strings", dict(config={"compress_ratios": ["0"] * 7}), "expected a list of integers"),
    ("eps-string", dict(config={"norm_eps": "1e-6"}), "'norm_eps' is \"1e-6\", expected a number"),
    ("groups-zero", dict(config={"o_groups": 0}), "'o_groups' is 0, expected a positive number"),
    ("heads-negative", dict(config={"n_heads": -4}), "'n_heads' is -4"),
    ("rope-scaling-string", dict(config={"rope_scaling": "yarn"}), "'rope_scaling' must be an object"),
    ("rope-factor-string", dict(config={"rope_scaling": {"factor": "16"}}, drop=["rope_factor"]),
     "'rope_factor' is \"16\", expected a number"),
    ("index-not-json", dict(index=b"{\"weight_map\": "), "the shard index is not valid JSON"),
    ("index-a-list", dict(index=b"[]"), "the shard index must be a JSON object"),
    ("index-no-weight-map", dict(index=b'{"metadata": {}}'), "no 'weight_map'"),
    ("index-bad-weight-map", dict(index=b'{"weight_map": {"embed.weight": 5}}'), "no 'weight_map'"),
]


@pytest.mark.parametrize("name,kw,match", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_malformed_config_or_index_is_one_sentence(golden, tmp_path, name, kw, match):
    src = _src(golden, tmp_path, name, **kw)
    out = tmp_path / "o.gguf"
    with pytest.raises(ConvertError) as e:
        convert_checkpoint(str(src), str(out), progress=False)
    assert match in str(e.value) and "\n" not in str(e.value), e.value
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_the_command_prints_one_line(golden, tmp_path):
    src = _src(golden, tmp_path, "bad", raw_config=b"[]")
    r = subprocess.run([sys.executable, "-m", "ds4py", "convert", str(src), str(tmp_path / "o.gguf")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "JSON object" in r.stderr, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_convert_removes_its_temporary_file(golden, tmp_path, sig):
    """SIGTERM (kill, a service manager, a CI timeout) cleans up like Ctrl-C: the process is frozen as soon as its
    hidden temporary file appears, signalled, then resumed, so the signal always lands mid-write."""
    out = tmp_path / "o.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "ds4py", "convert", str(golden / "v4-tiny"), str(out),
                             "--experts", "q4_k", "-q", "--no-tokenizer"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    tmp = tmp_path / f".o.gguf.tmp-{proc.pid}"
    t0 = time.monotonic()
    while not tmp.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() - t0 < 60
        time.sleep(0.002)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (128 + sig, 130), (proc.returncode, err)
    assert not tmp.exists() and not out.exists()
    assert "Traceback" not in err, err
