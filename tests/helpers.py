"""Helpers shared by several test files (a plain module: `from conftest import` is ambiguous once tests/gpu/
has its own conftest): the V4.1 golden vocabulary, and starting `python -m ds4py serve` as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The golden data: ../shared/golden beside the repository, or DS4PY_GOLDEN (the subset that travels to a GPU
# machine, made by bench/device_wheels.sh; there a missing part skips the tests that need it).
GOLDEN = Path(os.environ.get("DS4PY_GOLDEN") or REPO.parent / "shared" / "golden")
# The trained tiny V4 + MTP (two domains, its own tokenizer, official outputs): beside the golden folder.
TRAINED = GOLDEN.parent / "trained" / "v4-tiny-trained"


def bench_module(name: str) -> Any:
    """bench/<name>.py imported as a module (bench/ is scripts, not a package), for tests of its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args: list[str], env: dict | None = None, ready_s: float = 60, **popen) -> tuple[subprocess.Popen, str]:
    """`python -m ds4py serve --port <free> ARGS` from the repo; returns (process, base URL) once /health is 200.
    stderr is piped (shown if the server dies first); extra keyword arguments go to Popen."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ds4py", "serve", "--port", str(port), *args],
                            cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **popen)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                return proc, base
        except OSError:
            pass
        assert time.monotonic() - t0 < ready_s, "server did not become ready"
        time.sleep(0.2)


def stub_tokenizer_json(path) -> str:
    """The vocabulary the V4.1 golden run used (tt-metal's StubTokenizer: token 2k decodes to "w{k}", 2k+1 to
    " W{k}") as a HF tokenizer.json, so that the converted GGUF carries it and Engram's token map is built from
    its strings."""
    import json

    vocab = {(f"w{i // 2}" if i % 2 == 0 else f"\u0120W{i // 2}"): i for i in range(512)}
    Path(path).write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}))
    return str(path)
