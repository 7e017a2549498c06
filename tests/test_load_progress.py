"""Load time shown: the weight upload of a synthetic file feeds the process's load meter (ds4py.progress.LOAD) and
draws one progress line (bytes uploaded / total, rate); the server's /health answers "loading" with the
percentage while the model loads, 200 once it is ready (vllm-router only reads the status code)."""

from __future__ import annotations

import io
import json
import threading
import urllib.error
import urllib.request

import pytest

from ds4py.progress import LOAD, Transfer


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> str:
    from ds4py.tiny import make_tiny

    p = tmp_path_factory.mktemp("load") / "tiny.gguf"
    make_tiny(str(p), seed=5)
    return str(p)


def test_the_upload_feeds_the_meter_and_the_bar(synthetic, monkeypatch, capsys):
    from ds4py.cuda import gguf_upload
    from ds4py.cuda.emu_runtime import EmuRuntime
    from ds4py.gguf import GGUFFile

    g = GGUFFile(synthetic)
    total = sum(end - start for start, end, _ in gguf_upload.runs(g, None))
    rt = EmuRuntime()
    seen = []
    add = LOAD.add
    monkeypatch.setattr(LOAD, "add", lambda n: (add(n), seen.append(LOAD.snapshot()["fraction"])))
    monkeypatch.setattr(gguf_upload, "Transfer", lambda *a, **k: Transfer(*a, **{**k, "every": 0.0}))
    up = rt.uploader(chunk_bytes=1 << 20)
    try:
        gguf_upload.upload_gguf(g, rt.arena(gguf_upload.weights_bytes(g) + (1 << 20)), up, progress=True)
    finally:
        up.close()
    snap = LOAD.snapshot()
    assert snap["done"] == snap["total"] == total and snap["label"] == synthetic and snap["rate"] > 0
    assert len(seen) >= total >> 20 and seen == sorted(seen) and seen[-1] == 1.0 and seen[0] < 0.2
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith("ds4py: loading tiny.gguf: ") and "(100%)" in err[-2] and "/s" in err[-2], err
    assert err[-1].startswith(f"ds4py: uploaded {total / 1e9:.2f} GB of weights in ") and err[-1].endswith("GB/s)")


def test_transfer_draws_a_bar_on_a_terminal_and_lines_elsewhere():
    out = io.StringIO()
    t = Transfer("x", 2_000_000, initial=500_000, stream=out, tty=True, min_interval=0.0)
    t.update(1_000_000)
    drawn = out.getvalue()
    assert drawn.startswith("\rx [") and "1.0 MB of 2.0 MB (50%)" in drawn and "left" in drawn
    log = io.StringIO()
    t = Transfer("y", 100, stream=log, tty=False, every=3600)
    t.update(10)                                   # within the minute: nothing
    t.update(100)                                  # done: always one line
    assert log.getvalue().count("\n") == 1 and "100 B of 100 B (100%)" in log.getvalue()


def _health(url: str) -> tuple[int, dict]:
    try:
        r = urllib.request.urlopen(url + "/health", timeout=10)
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_says_loading_with_the_percentage(tmp_path):
    from ds4py.server.app import BackgroundServer, ServerConfig, ServerState

    state = ServerState(ServerConfig())
    uploading, finish = threading.Event(), threading.Event()

    def make_engine():
        LOAD.begin("model.gguf", 80_000_000_000)
        LOAD.add(33_600_000_000)
        uploading.set()
        finish.wait(30)
        raise RuntimeError("stop here")            # the engine itself is not this test's subject
    with BackgroundServer(state) as srv:
        assert _health(srv.base_url)[0] == 503
        state.load_in_background(make_engine)
        assert uploading.wait(10)
        code, body = _health(srv.base_url)
        assert code == 503 and body["status"] == "loading" and body["progress"] == 0.42, body
        assert body["detail"] == "uploading weights: 42% of 80.00 GB" and body["total_bytes"] == 80_000_000_000
        root = json.loads(urllib.request.urlopen(srv.base_url + "/", timeout=10).read())
        assert root["status"] == "loading" and root["progress"] == 0.42
        finish.set()
