"""`ds4py pull` / `ds4py list` and the model picked without -m, against a mock of the Hub's file endpoints
(tests/mock_hub.py on 127.0.0.1; HF_ENDPOINT points every test at it, so nothing reaches the network)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, start_serve
from mock_hub import COMMIT, MockHub

from ds4py import hub as hubmod
from ds4py.__main__ import main

REPO_ID = "antirez/deepseek-v4-gguf"
Q2 = hubmod.CATALOGUE["v4-flash-q2"].files[0]
Q4 = hubmod.CATALOGUE["v4-flash-q4"].files[0]
MTP = hubmod.CATALOGUE["v4-flash-mtp"].files[0]
CHUNK = 10 * 1024 * 1024          # huggingface_hub writes what it received in chunks of this size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[bytes, bytes]:
    """A tiny V4 GGUF (22 MB, more than one of the library's write chunks) and its MTP block, as bytes."""
    from ds4py.tiny import make_tiny

    d = tmp_path_factory.mktemp("tiny")
    make_tiny(str(d / "m.gguf"), seed=3, mtp=str(d / "m.mtp.gguf"))
    return (d / "m.gguf").read_bytes(), (d / "m.mtp.gguf").read_bytes()


@pytest.fixture
def hub(tiny, tmp_path, monkeypatch):
    h = MockHub({REPO_ID: {Q2: tiny[0], Q4: tiny[0][: len(tiny[0]) // 2], MTP: tiny[1], "README.md": b"# cards\n"},
                 "someone/models": {"sub/other.gguf": tiny[0]},
                 "deepseek-ai/DeepSeek-V4.1-Flash": {"config.json": b'{"n_layers": 40}', "README.md": b"card",
                                                     "model-00001-of-00002.safetensors": os.urandom(3000),
                                                     "model-00002-of-00002.safetensors": os.urandom(2000),
                                                     "model.safetensors.index.json": b"{}",
                                                     "inference/convert.py": b"print()"}})
    for k in ("HF_HUB_OFFLINE", "HF_TOKEN", "DS4PY_MODEL", "HF_HUB_CACHE"):
        monkeypatch.delenv(k, raising=False)
    env = {"HF_ENDPOINT": h.url, "HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(hubmod, "device_memory", lambda: None)      # the CPU reference: nothing refused
    h.env = env
    yield h
    h.close()


def file_gets(h: MockHub, name: str) -> list:
    return [r for r in h.requests if r[0] == "GET" and r[1].endswith("/" + name)]


def blob_dir(tmp_path) -> Path:
    return tmp_path / "hf" / "hub" / "models--antirez--deepseek-v4-gguf" / "blobs"


def test_pull_list_and_the_model_picked_without_m(hub, tiny, tmp_path, capsys):
    t0 = time.monotonic()
    assert main(["pull", "v4-flash-q2"]) == 0
    err = capsys.readouterr().err
    sha = hashlib.sha256(tiny[0]).hexdigest()
    path = tmp_path / "hf" / "hub" / "models--antirez--deepseek-v4-gguf" / "snapshots" / COMMIT / Q2
    assert path.read_bytes() == tiny[0] and os.path.realpath(path).endswith("/blobs/" + sha)
    assert "memory plan: no GPU here" in err and "sha256 matched the Hub's" in err and "22.9 MB" in err, err
    # the Hub cache's own layout: huggingface_hub finds the file offline
    from huggingface_hub import try_to_load_from_cache

    assert try_to_load_from_cache(REPO_ID, Q2, cache_dir=str(tmp_path / "hf" / "hub")) == str(path)
    choice = hubmod.choose(None)
    assert (choice.path, choice.name, choice.why, choice.mtp) == (str(path), "v4-flash-q2", "the one pulled model",
                                                                 None)
    # a second pull: already here, nothing downloaded, nothing hashed again
    n = len(file_gets(hub, Q2))
    assert main(["pull", "v4-flash-q2"]) == 0
    assert "already in" in capsys.readouterr().err and len(file_gets(hub, Q2)) == n
    # the MTP block pairs with it; list shows both and the choice
    assert main(["pull", "v4-flash-mtp"]) == 0
    capsys.readouterr()
    assert hubmod.choose(None).mtp == str(path.parent / MTP)
    assert hubmod.choose("v4-flash-q2").path == str(path)            # -m NAME
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "v4-flash-q2" in out and "v4-flash-mtp" in out and "0.0 GB" in out and "or the CPU reference" in out
    assert "without -m: v4-flash-q2 (the one pulled model; MTP" in out, out
    assert time.monotonic() - t0 < 60


def test_several_models_the_env_var_and_the_config_choose(hub, tmp_path, capsys, monkeypatch):
    assert main(["pull", "v4-flash-q2"]) == 0
    assert main(["pull", "someone/models/sub/other.gguf"]) == 0
    capsys.readouterr()
    c = hubmod.choose(None)
    assert c.name == "someone/models/sub/other.gguf" and "most recently pulled of 2" in c.why and "DS4PY_MODEL" in c.why
    assert main(["list", "--default", "v4-flash-q2"]) == 0
    assert hubmod.choose(None).name == "v4-flash-q2" and hubmod.choose(None).why.endswith("config.json")
    monkeypatch.setenv("DS4PY_MODEL", "someone/models/sub/other.gguf")
    assert hubmod.choose(None).why == "$DS4PY_MODEL"
    monkeypatch.setenv("DS4PY_MODEL", "v4-flash-q4")
    with pytest.raises(Exception, match=r"v4-flash-q4 \(\$DS4PY_MODEL\) is not pulled: run `ds4py pull v4-flash-q4`"):
        hubmod.choose(None)
    assert main(["list", "--default", "nope"]) == 2
    assert "nope is not a pulled model" in capsys.readouterr().err


def test_a_cut_connection_resumes_with_a_range(hub, tiny, tmp_path, capsys):
    hub.cut_once[Q2] = CHUNK + 4096           # one library chunk written, then the connection drops
    assert main(["pull", "v4-flash-q2"]) == 0
    gets = file_gets(hub, Q2)
    assert [g[2] for g in gets] == [None, f"bytes={CHUNK}-"], gets
    assert (blob_dir(tmp_path) / hashlib.sha256(tiny[0]).hexdigest()).read_bytes() == tiny[0]


def test_ctrl_c_keeps_the_partial_file_and_the_next_pull_resumes(hub, tiny, tmp_path, capsys):
    hub.stall[Q2] = CHUNK + 100_000            # the transfer stops after a chunk: the user presses Ctrl-C
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "ds4py", "pull", "v4-flash-q2"], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True)
    part = blob_dir(tmp_path) / (hashlib.sha256(tiny[0]).hexdigest() + ".incomplete")
    t0 = time.monotonic()
    while not (part.is_file() and part.stat().st_size >= CHUNK):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() - t0 < 60, "the partial file never grew"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=30)[1]
    assert proc.returncode == 130, err
    assert "interrupted: 10.5 MB of 22.9 MB kept in" in err and "again to resume" in err, err
    assert "Traceback" not in err and part.stat().st_size == CHUNK
    hub.release.set()                          # the stalled connection ends
    assert main(["list"]) == 0
    assert f"partial download: {REPO_ID}, 0.01 GB in {part}" in capsys.readouterr().out
    assert main(["pull", "v4-flash-q2"]) == 0
    assert "resuming at 10.5 MB of 22.9 MB" in capsys.readouterr().err
    assert file_gets(hub, Q2)[-1][2] == f"bytes={CHUNK}-"
    assert not part.exists() and hubmod.choose(None).name == "v4-flash-q2"
    assert Path(hubmod.choose(None).path).read_bytes() == tiny[0]


def test_a_download_that_does_not_match_the_hubs_sha256_is_refused(hub, tmp_path, capsys):
    hub.corrupt.add(Q2)
    assert main(["pull", "v4-flash-q2"]) == 2
    err = capsys.readouterr().err
    assert "the download does not match the Hub's checksum (sha256:" in err and "it was deleted" in err, err
    assert err.count("\n") <= 8 and "Traceback" not in err
    assert not any(blob_dir(tmp_path).iterdir()) and hubmod.load_registry() == {}
    assert hubmod.choose(None).path is None                       # still the demo model


def test_a_corrupt_file_is_found_by_inspect_verify_and_refetched_on_request(hub, tiny, tmp_path, capsys):
    assert main(["pull", "v4-flash-q2"]) == 0
    assert main(["inspect", "v4-flash-q2", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify: OK: the whole file's sha256 matches the Hub's for v4-flash-q2" in out, out
    path = Path(hubmod.choose(None).path)
    blob = Path(os.path.realpath(path))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1                                     # one flipped bit in the tensor data
    blob.write_bytes(bytes(data))
    assert main(["inspect", str(path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "does not match the Hub's sha256:" in err and "`ds4py pull v4-flash-q2 --force` fetches it again" in err
    assert main(["pull", "v4-flash-q2"]) == 2                      # the changed file is hashed again
    assert "the copy in the cache" in capsys.readouterr().err
    with open(blob, "r+b") as fh:                                  # truncated
        fh.truncate(1000)
    assert main(["inspect", "v4-flash-q2", "--verify"]) == 2
    assert "has 1,000 bytes, the Hub's file" in capsys.readouterr().err
    assert main(["list"]) == 0
    assert "truncated " + Q2 in capsys.readouterr().out
    with pytest.raises(Exception, match="the pulled model v4-flash-q2 is not usable: truncated .* --force"):
        hubmod.choose(None)                                        # not the demo model, silently
    assert main(["pull", "v4-flash-q2", "--force"]) == 0
    assert path.read_bytes() == tiny[0] and hubmod.load_registry()["v4-flash-q2"].state() == "ok"


def test_disk_full_is_refused_before_downloading(hub, capsys, monkeypatch):
    monkeypatch.setattr(hubmod, "free_bytes", lambda folder: 5_000_000)
    assert main(["pull", "v4-flash-q2"]) == 2
    err = capsys.readouterr().err
    assert "v4-flash-q2 needs 0.0 GB more on the disk of" in err and "but only 0.0 GB are free" in err, err
    assert file_gets(hub, Q2) == []


def test_the_memory_plan_refuses_q4_on_a_128_gb_spark(hub, capsys, monkeypatch):
    entry = hubmod.CATALOGUE["v4-flash-q4"]
    line, refusal = hubmod.memory_line(entry, int(153.3 * 2**30), ("NVIDIA GB10", 128 * 10**9))
    assert "memory plan: weights 164.6 GB + KV 0.48 GB at 32,768 tokens" in line
    assert refusal.startswith("v4-flash-q4 does not fit this machine: it needs about 167 GB") and \
        "NVIDIA GB10 has 128 GB; pull v4-flash-q2 instead" in refusal
    assert hubmod.memory_line(hubmod.CATALOGUE["v4-flash-q2"], int(80.8 * 2**30), ("NVIDIA GB10", 128 * 10**9))[1] \
        is None
    # through the command, on a GPU smaller than the mock's file
    monkeypatch.setattr(hubmod, "device_memory", lambda: ("a small GPU", 1_000_000))
    assert main(["pull", "v4-flash-q4"]) == 2
    err = capsys.readouterr().err
    assert "v4-flash-q4 does not fit this machine" in err and "pull v4-flash-q2 instead" in err
    assert file_gets(hub, Q4) == []
    assert main(["pull", "v4-flash-q4", "--skip-memory-check"]) == 0


def test_offline_mode_uses_only_what_is_here(hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["pull", "v4-flash-q2"]) == 2
    assert "v4-flash-q2 is not here and HF_HUB_OFFLINE is set: unset it to download" in capsys.readouterr().err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert main(["pull", "v4-flash-q2"]) == 0
    n = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["pull", "v4-flash-q2"]) == 0
    assert "offline (HF_HUB_OFFLINE): already here" in capsys.readouterr().err
    # a file another tool put in the Hub cache (no ds4py record): found, checked against its blob's sha256
    hubmod.registry_path().unlink()
    assert main(["pull", "v4-flash-q2"]) == 0
    assert "found in the Hub cache and checked" in capsys.readouterr().err
    assert len(hub.requests) == n and hubmod.choose(None).name == "v4-flash-q2"


@pytest.mark.parametrize("name, says", [
    ("nope", "'nope' is neither a catalogue name (v4-flash-q2, "),
    ("ghost/repo/x.gguf", "no repository ghost/repo on http://127.0.0.1:"),
    ("antirez/deepseek-v4-gguf/missing.gguf", "has no file missing.gguf"),
])
def test_bad_names_get_one_sentence(hub, capsys, name, says):
    assert main(["pull", name]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_an_unreachable_hub_is_one_sentence(hub, capsys, monkeypatch):
    from helpers import free_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert main(["pull", "v4-flash-q2"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:" in err and "HF_HUB_OFFLINE=1" in err and err.count("\n") == 1, err


def test_run_and_serve_use_the_pulled_model_and_say_so(hub, tiny, tmp_path, capsys):
    assert main(["pull", "v4-flash-q2"]) == 0
    assert main(["pull", "v4-flash-mtp"]) == 0
    capsys.readouterr()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "ds4py", "run", "-p", "hi", "-n", "2", "--temp", "0"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    path = hubmod.choose(None).path
    assert r.returncode == 0, r.stderr
    assert f"ds4py run: model: v4-flash-q2 = {path} (the one pulled model; MTP {Path(path).parent / MTP} paired)" \
        in r.stderr, r.stderr
    assert "demo model" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "ds4py", "run", "-m", "v4-flash-q2", "--no-spec", "-p", "hi", "-n",
                        "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"ds4py run: model: v4-flash-q2 = {path} (-m)" in r.stderr, r.stderr
    proc, _base = start_serve([], env=env)
    proc.terminate()
    err = proc.communicate(timeout=60)[1]
    assert f"ds4py serve: model: v4-flash-q2 = {path} (the one pulled model; MTP" in err, err


def test_hf_token_is_sent_and_the_record_is_json(hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert main(["pull", "v4-flash-mtp"]) == 0
    assert hub.auth and set(hub.auth) == {"Bearer hf_test_token"}, hub.auth
    raw = json.loads(hubmod.registry_path().read_text())
    f = raw["models"]["v4-flash-mtp"]["files"][0]
    assert f["checksum"].startswith("sha256:") and f["verified_at"] > 0
    assert raw["models"]["v4-flash-mtp"]["kind"] == "mtp"


def test_the_v41_checkpoint_folder_for_the_recipe(hub, tmp_path, capsys):
    assert main(["pull", "v41-flash-official"]) == 0
    err = capsys.readouterr().err
    assert "5 files" in err and "git-sha1 and sha256 of every file matched the Hub's" in err, err
    m = hubmod.load_registry()["v41-flash-official"]
    folder = Path(m.path)
    assert folder.name == COMMIT and sorted(p.name for p in folder.rglob("*") if p.is_file()) == \
        ["config.json", "convert.py", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
         "model.safetensors.index.json"]                               # not the README
    assert {f.checksum.split(":")[0] for f in m.files} == {"sha256", "git-sha1"}
    assert main(["list"]) == 0 and "convert first (docs/v41.md)" in capsys.readouterr().out
    with pytest.raises(Exception, match="is a checkpoint folder, not a GGUF: convert it first"):
        hubmod.choose("v41-flash-official")
    assert hubmod.choose(None).path is None                         # a checkpoint is no model to serve
