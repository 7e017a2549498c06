"""`ds4py serve` start-up: an empty API key is refused (it would silently turn authentication off), and the key
can come from a file or the environment, out of the process list."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from helpers import REPO, start_serve


def serve_fails(args, env=None) -> str:
    r = subprocess.run([sys.executable, "-m", "ds4py", "serve", "--port", "1", *args], cwd=REPO, text=True,
                       capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4py serve: error:"), r.stderr
    return lines[0]


def test_empty_api_key_is_refused_at_start_up(tmp_path, monkeypatch):
    from argparse import Namespace

    from ds4py.cli.serve import api_key
    from ds4py.errors import Ds4Error

    assert "empty API key" in serve_fails(["--api-key", ""])              # the command: exit 2, one line

    def refused(api_key_arg=None, key_file=None, env=None) -> str:
        monkeypatch.delenv("DS4PY_API_KEY", raising=False)
        if env is not None:
            monkeypatch.setenv("DS4PY_API_KEY", env)
        with pytest.raises(Ds4Error) as e:
            api_key(Namespace(api_key=api_key_arg, api_key_file=key_file))
        return str(e.value)
    assert "DS4PY_API_KEY" in refused(env="")
    (tmp_path / "empty").write_text("\n")
    assert "empty API key" in refused(key_file=str(tmp_path / "empty"))
    assert "printable ASCII" in refused(api_key_arg="two words")
    assert "printable ASCII" in refused(api_key_arg="caf\u00e9")
    assert "not both" in refused(api_key_arg="k", key_file=str(tmp_path / "empty"))
    assert "cannot read" in refused(key_file=str(tmp_path / "missing"))
    monkeypatch.delenv("DS4PY_API_KEY", raising=False)
    assert api_key(Namespace(api_key=None, api_key_file=None)) == (None, "")     # no key at all: no auth, allowed


def _status(url, key=None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("how", ["file", "env"])
def test_api_key_from_a_file_or_the_environment_stays_out_of_the_process_list(golden, tmp_path, how):
    key = "file-key-123" if how == "file" else "env-key-456"
    keyfile = tmp_path / "key"
    keyfile.write_text(key + "\n")
    args = ["-m", str(golden / "ds4-tiny" / "tiny.gguf"), "--ctx", "64"]
    proc, base = start_serve(args + (["--api-key-file", str(keyfile)] if how == "file" else []),
                             env={"DS4PY_API_KEY": key} if how == "env" else {})
    try:
        assert _status(base + "/v1/models") == 401
        assert _status(base + "/v1/models", key) == 200
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read() if os.path.exists(f"/proc/{proc.pid}") else b""
        assert key.encode() not in cmdline
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "API key required" in err and "process list" not in err       # no warning: the key is not on argv


def test_max_tokens_must_be_positive():
    assert "--max-tokens must be at least 1, got 0" in serve_fails(["--max-tokens", "0"])
