"""Bench smoke tests on the golden tiny model (numpy backend, CI-sized settings)."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from ds4py import bench
from ds4py.errors import Ds4Error
from helpers import free_port, start_serve

COLS = bench.COLUMNS + ["prefill_tps_std", "gen_tps_std"]


def test_frontiers():
    assert bench.frontiers(32, 96, 32, None) == [32, 64, 96]
    assert bench.frontiers(32, 100, 32, None) == [32, 64, 96]
    assert bench.frontiers(16, 128, None, 2.0) == [16, 32, 64, 128]
    with pytest.raises(Ds4Error):
        bench.frontiers(64, 32, 32, None)
    with pytest.raises(Ds4Error):
        bench.frontiers(32, 64, 8, 2.0)


def test_prompt_tokens_cycles_short_text():
    toks, cycles = bench.prompt_tokens(lambda t: [ord(c) for c in t], "abc", 8)
    assert toks == [97, 98, 99] * 2 + [97, 98] and cycles == 2


def test_sweep_csv_on_golden_tiny(golden, tmp_path):
    model = golden / "ds4-tiny" / "tiny.gguf"
    prompt = tmp_path / "p.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "rows.csv"
    r = subprocess.run(
        [sys.executable, "-m", "ds4py", "bench", "-m", str(model), "--prompt-file", str(prompt),
         "--ctx-start", "32", "--ctx-max", "96", "--step-incr", "32", "--gen-tokens", "3",
         "--repeat", "2", "--bandwidth", "10", "--format", "csv", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "startup model_open_s" in r.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert list(rows[0].keys()) == COLS
    assert [int(x["ctx_tokens"]) for x in rows] == [32, 64, 96]
    assert [int(x["prefill_tokens"]) for x in rows] == [32, 32, 32]
    for row in rows:
        for c in ("prefill_tps", "gen_tps", "kv_bytes", "weight_bytes_per_token", "effective_gbps",
                  "pct_of_roofline"):
            v = float(row[c])
            assert math.isfinite(v) and v > 0, (c, row)
        assert int(row["gen_tokens"]) == 3
    # KV state grows with the frontier (window ring fills, compressed rows appear)
    assert int(rows[-1]["kv_bytes"]) >= int(rows[0]["kv_bytes"])
    assert r.stdout == out.read_text()


def test_sweep_json_format(golden, tmp_path):
    model = golden / "ds4-tiny" / "tiny.gguf"
    prompt = tmp_path / "p.txt"
    prompt.write_text("Numbers 12345 and words, words, words. " * 30)
    r = subprocess.run(
        [sys.executable, "-m", "ds4py", "bench", "-m", str(model), "--prompt-file", str(prompt),
         "--ctx-start", "16", "--ctx-max", "32", "--step-mul", "2", "--gen-tokens", "2", "--format", "json"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [row["ctx_tokens"] for row in data["rows"]] == [16, 32]
    assert data["startup"]["model_open_s"] > 0
    assert data["rows"][0]["pct_of_roofline"] is None
    # which kernels ran: the default ones (compiled where numba imports, else the numpy fused ones)
    from ds4py.quant import jit

    want = "compiled (numba)" if jit.available() else "numpy fused"
    assert data["info"]["kernels_used"].startswith(want) and f"kernels: {want}" in r.stderr


def test_sweep_md_header_names_the_kernels(golden, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Numbers 12345 and words. " * 20)
    r = subprocess.run(
        [sys.executable, "-m", "ds4py", "bench", "-m", str(golden / "ds4-tiny" / "tiny.gguf"), "--prompt-file",
         str(prompt), "--ctx-start", "8", "--ctx-max", "8", "--gen-tokens", "1", "--format", "md", "--kernels",
         "dequant"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "ds4py bench: backend ref, kernels oracle (dequantise + BLAS)"


@pytest.mark.parametrize("horizon", [16, 2], ids=["truncate", "copy"])
def test_sweep_state_restored_between_rows(golden, horizon):
    """The probe must not leak into the next row, rolled back by truncate (probe within the rollback horizon)
    or from a copy (deeper): each row's prefill starts exactly at the previous frontier."""
    from ds4py.model import open_model

    m = open_model(str(golden / "ds4-tiny" / "tiny.gguf"), rollback_horizon=horizon)
    toks = [(7 * i + 3) % 500 + 2 for i in range(48)]
    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, k):
            return getattr(self.inner, k)

        def step(self, states, chunks, all_logits=False):
            out = self.inner.step(states, chunks, all_logits)
            if len(chunks[0]) > 1:                           # a prefill (the probe steps one token)
                seen.append(states[0].n_tokens - len(chunks[0]))
                logits.append(out[0])
            return out

    logits = []
    bench.run_sweep(Spy(m), toks, [16, 32, 48], gen_tokens=4, warmup_tokens=4)
    # warm-up prefill starts at 0, then each row starts exactly at the previous frontier ...
    assert seen == [0, 0, 16, 32]
    # ... with exactly the state the rows' prefills alone give (no trace of the probes)
    st = m.new_state()
    for got, (a, b) in zip(logits[1:], ((0, 16), (16, 32), (32, 48))):
        np.testing.assert_array_equal(got, m.prefill(st, toks[a:b]))


def test_bad_bandwidth_is_a_clear_error(golden, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ds4py", "bench", "-m", str(golden / "ds4-tiny" / "tiny.gguf"),
                        "--ctx-start", "8", "--ctx-max", "8", "--gen-tokens", "1", "--bandwidth", "fast"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--bandwidth" in r.stderr and "Traceback" not in r.stderr


def test_serve_mode_against_the_real_server(golden, tmp_path):
    """`bench serve` drives a real `ds4py serve` (tiny model, numpy backend) and reports sane numbers."""
    server, base = start_serve(["-m", str(golden / "ds4-tiny" / "tiny.gguf")], ready_s=120, stdout=subprocess.DEVNULL)
    try:
        prompt = tmp_path / "p.txt"
        prompt.write_text("alpha beta gamma delta epsilon zeta eta theta " * 50)
        r = subprocess.run(
            [sys.executable, "-m", "ds4py", "bench", "serve", "--url", base,
             "--concurrency", "2", "--requests", "3", "--input-len", "16", "--output-len", "4",
             "--request-rate", "50", "--prompt-file", str(prompt), "--json"],
            capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        s = json.loads(r.stdout)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert s["successful_requests"] == 3 and s["failed_requests"] == 0
    assert 0 < s["total_output_tokens"] <= 12 and s["total_input_tokens"] > 3 * 8
    for k in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        assert math.isfinite(s[k]) and s[k] > 0, k
    for k in ("ttft_ms", "e2e_ms"):
        st = s[k]
        assert 0 < st["p50"] <= st["p90"] <= st["p99"] and math.isfinite(st["mean"]), (k, st)
    assert s["e2e_ms"]["mean"] >= s["ttft_ms"]["mean"]


def test_serve_mode_concurrency_sweep_against_sessions(golden, tmp_path):
    """`bench serve --concurrency 1,3` against `serve --sessions 3`: one summary per level and the table."""
    server, base = start_serve(["-m", str(golden / "ds4-tiny" / "tiny.gguf"), "--sessions", "3"], ready_s=120,
                               stdout=subprocess.DEVNULL)
    try:
        cmd = [sys.executable, "-m", "ds4py", "bench", "serve", "--url", base, "--concurrency", "1,3",
               "--requests", "3", "--input-len", "8", "--output-len", "3", "--ignore-eos"]
        r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        runs = json.loads(r.stdout)
        t = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert [s["concurrency"] for s in runs] == [1, 3]
    assert all(s["successful_requests"] == 3 and s["total_output_tokens"] == 9 for s in runs)
    assert t.returncode == 0 and "| concurrency |" in t.stdout and "\n| 3 | 3 |" in t.stdout
    bad = subprocess.run([sys.executable, "-m", "ds4py", "bench", "serve", "--concurrency", "1,x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--concurrency" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_mode_counts_failures(tmp_path):
    """A server that fails every generation: every request counted failed, exit status 1, errors named. A server
    that is not there at all is one sentence (exit 2), not N failures."""
    import http.server
    import threading

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "x"}]}')

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "the model is still loading"}}')

        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "ds4py", "bench", "serve", "--url", f"http://127.0.0.1:{srv.server_port}",
             "--requests", "2", "--json"], capture_output=True, text=True, timeout=120)
    finally:
        srv.shutdown()
    assert r.returncode == 1, r.stderr
    s = json.loads(r.stdout)
    assert s["successful_requests"] == 0 and s["failed_requests"] == 2 and s["errors"]
    r = subprocess.run([sys.executable, "-m", "ds4py", "bench", "serve", "--url", f"http://127.0.0.1:{free_port()}",
                        "--served-model", "x", "--requests", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot reach the server" in r.stderr and "Traceback" not in r.stderr
