"""The CUDA engine's memory plan (ds4py/cuda/memory_plan.py): counted before the upload (the weights as the arena
gets them, one sequence's KV at the asked context, the step workspaces), printed in one line, a model that does
not fit refused in one sentence - on the emulator with a small pretend device, and through `--backend auto` on
the stand-in driver, which then falls back to the reference saying why; the weight upload drops the file's
pages from the page cache chunk by chunk."""

from __future__ import annotations

import os

import pytest

from ds4py.cuda import emu
from ds4py.cuda.emu_runtime import EmuDevice, EmuRuntime
from ds4py.cuda.memory_plan import kv_bytes
from ds4py.model import UnsupportedByBackend, open_model
from test_cuda_driverless import rt, standin  # noqa: F401 (fixtures)

needs_gxx = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")


@needs_gxx
def test_the_plan_is_counted_printed_and_refuses_what_does_not_fit(golden, capsys):
    from ds4py.cuda.engine import CudaModel

    path = str(golden / "ds4-tiny" / "tiny.gguf")
    m = CudaModel(path, emulate=True, ctx=700, progress=True)
    plan = m.memory_plan
    assert plan.ctx == 700 and plan.kv == kv_bytes(m.layout, 700) > 0
    assert plan.weights == m.w.file_bytes + m.w.extra_bytes and plan.scratch > 0
    line = [ln for ln in capsys.readouterr().err.splitlines() if "memory plan" in ln]
    assert line == [f"ds4py: {plan.line()}"] and "at 700 tokens" in line[0]
    small = EmuRuntime(device=EmuDevice(total_mem=plan.need - 1), defines=m.rt.defines)
    with pytest.raises(UnsupportedByBackend, match="does not fit the GPU: weights .* but .* GB are free") as e:
        CudaModel(path, runtime=small, ctx=700)
    assert "\n" not in str(e.value)
    ok = EmuRuntime(device=EmuDevice(total_mem=plan.need), defines=m.rt.defines)
    assert CudaModel(path, runtime=ok, ctx=700).memory_plan.left == 0


def test_auto_falls_back_with_the_reason(standin, golden, monkeypatch, capsys):  # noqa: F811
    real = standin._result
    monkeypatch.setattr(standin, "_result", lambda name, args: (real(name, args)[0], 1 << 20, 141 << 30)
                        if name == "cuMemGetInfo" else real(name, args))
    try:
        m = open_model(str(golden / "ds4-tiny" / "tiny.gguf"), backend="auto", ctx=512)
    except Exception as e:                                   # no NVRTC here: the runtime cannot start
        pytest.skip(f"the stand-in runtime did not start: {e}")
    err = capsys.readouterr().err
    assert m.backend == "ref"
    # the probe (ds4py.cuda.probe) sees the free memory before the engine's own memory plan is made
    assert "backend auto: the GPU has 0.0 GiB free of 141.0 GiB and this model needs about" in err
    assert "using the reference backend" in err


def test_the_upload_drops_the_files_pages(rt, tmp_path, monkeypatch):  # noqa: F811
    data = os.urandom(3 * 4096 + 100)
    p = tmp_path / "blob.bin"
    p.write_bytes(b"x" * 64 + data)
    seen = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: seen.append((off, n, advice)))
    up = rt.uploader(chunk_bytes=4096)
    try:
        up.upload_file(str(p), 64, len(data), rt.arena(1 << 20, 1 << 20).weights(len(data), "u1"), progress=False)
    finally:
        up.close()
    assert [(o, n) for o, n, _ in seen] == [(64, 4096), (4160, 4096), (8256, 4096), (12352, 100)]
    assert {a for _, _, a in seen} == {os.POSIX_FADV_DONTNEED}
