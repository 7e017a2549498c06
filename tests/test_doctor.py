"""`python -m ds4py doctor` on a machine without a GPU (it says so, still builds with NVRTC and runs the emulator,
exits 0), `doctor -m` on the emulator against the reference, and the checks behind `--backend auto`: free device
memory, a file alignment the kernels' 16-byte loads need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4py.errors import Ds4Error

REPO = Path(__file__).resolve().parents[1]


def doctor(*args: str, timeout: int = 300) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run([sys.executable, "-m", "ds4py", "doctor", "--json", "-", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
    return r, json.loads(r.stdout) if r.stdout.startswith("{") else {}


def test_doctor_without_a_gpu_says_so_and_checks_what_it_can():
    pytest.importorskip("cuda.bindings.nvrtc", reason="doctor's NVRTC check needs cuda-bindings")
    from ds4py.cuda import driver

    if driver.available():
        pytest.skip("this machine has a GPU: tests/gpu and the device check cover doctor there")
    r, rep = doctor()
    checks = {c["name"]: c for c in rep["checks"]}
    assert r.returncode == 0 and rep["ok"], r.stdout + r.stderr
    assert checks["gpu"]["status"] == "absent" and "no GPU" in checks["gpu"]["detail"]
    assert checks["nvrtc"]["status"] == "ok" and rep["nvrtc"]["arch"] == "sm_90" and checks["nvrtc"]["seconds"] > 0
    assert checks["smoke_emulator"]["status"] == "ok" and checks["smoke_emulator"]["mismatches"] == 0
    assert rep["auto"]["backend"] == "ref" and rep["driver"] is None and "bandwidth_gbps" not in rep
    from ds4py.cuda.devices import PROFILES

    assert checks["numerics"]["status"] == "absent" and set(rep["numerics"]) == set(PROFILES)   # each declared one
    assert all(rep["numerics"][k]["act_quant"] == (p.act_numerics == "int8") for k, p in PROFILES.items())
    r = subprocess.run([sys.executable, "-m", "ds4py", "doctor"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) <= 12 and lines[-1] == "every check that can run here passed", r.stdout
    assert any(ln.startswith("--    gpu") for ln in lines)


def test_doctor_model_on_the_emulator_matches_the_reference(golden):
    r, rep = doctor("-m", str(golden / "ds4-tiny" / "tiny.gguf"), "--backend", "cuda-emu", "--positions", "4,1")
    assert r.returncode == 0 and rep["ok"], r.stdout[-2000:] + r.stderr[-2000:]
    m = rep["model"]
    assert m["backend"] == "cuda-emu" and len(m["positions"]) == 5 and m["top1_equal"] == 5
    # the emulator's own device (no $DS4PY_EMU_DEVICE) declares nothing: fp32, as the reference here
    assert m["act_quant"] is False and m["numerics_why"].startswith("the emulator's default")
    assert [p["kind"] for p in m["positions"]] == ["prompt"] * 4 + ["decode"]
    # ds4-tiny's FP8 KV fake-quant may round a near-tie value the other way (tests/cuda_engine_checks.py)
    assert 0 < m["max_abs_delta"] < 1e-3, m


def test_doctor_positions_are_checked():
    r = subprocess.run([sys.executable, "-m", "ds4py", "doctor", "--positions", "x"], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and r.stderr.strip().startswith("ds4py doctor: error: --positions takes")
    r = subprocess.run([sys.executable, "-m", "ds4py", "doctor", "--exact", "--act-quant"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "contradict each other" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_auto_falls_back_when_the_model_does_not_fit_in_free_memory(monkeypatch, golden):
    from ds4py.cuda import compiler, driver, probe

    monkeypatch.setattr(driver, "api", lambda: object())
    monkeypatch.setattr(driver, "call", lambda name, *a: 13000 if name == "cuDriverGetVersion" else None)
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (13, 0))
    tiny = str(golden / "ds4-tiny" / "tiny.gguf")
    need = probe.model_device_bytes(tiny)
    monkeypatch.setattr(probe, "device_memory", lambda ordinal=0: (need - 1, 80 << 30))
    pick, why = probe.auto_choice(tiny)
    assert pick == "ref" and why.startswith("the GPU has") and "needs about" in why
    monkeypatch.setattr(probe, "device_memory", lambda ordinal=0: (need, 80 << 30))
    assert probe.auto_choice(tiny)[0] == "cuda"
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (14, 0))      # a driver older than NVRTC: ref
    pick, why = probe.auto_choice(tiny)
    assert pick == "ref" and "update the driver" in why


def test_cuda_refuses_a_file_alignment_the_vector_loads_cannot_use():
    from ds4py.cuda.gguf_upload import check_alignment
    from ds4py.model import UnsupportedByBackend

    class File:
        path = "odd.gguf"

        def __init__(self, align):
            self.align = align

        def meta(self, key, default=None):
            assert key == "general.alignment"
            return self.align

    for ok in (16, 32, 64):
        check_alignment(File(ok))
    with pytest.raises(UnsupportedByBackend, match=r"^odd.gguf: general.alignment is 8; the CUDA backend needs a "
                       r"multiple of 16") as e:
        check_alignment(File(8))
    assert isinstance(e.value, Ds4Error) and "\n" not in str(e.value)


def test_reading_a_model_needs_no_gguf_package(golden):
    """The GPU machine has no `gguf`: config, the reader, the engines and the experts' wrapper import without it."""
    code = ("import sys; sys.modules['gguf'] = None\n"
            "import ds4py.ggml_types as t; assert t.FALLBACK\n"
            "import ds4py.cuda.engine, ds4py.ref.engine, ds4py.cuda.ops.experts, ds4py.cuda.doctor\n"
            "from ds4py.gguf import GGUFFile; from ds4py.config import ModelConfig\n"
            f"f = GGUFFile({str(golden / 'ds4-tiny' / 'tiny.gguf')!r}); ModelConfig.from_gguf(f)\n"
            "print(sorted({t.qtype.name for t in f.tensors.values()}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and "Q8_0" in r.stdout, r.stderr[-2000:]


def test_fallback_type_table_equals_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    import ds4py.ggml_types as t

    src = Path(t.__file__).read_text()
    table = eval(src[src.index("_TYPES = {") + len("_TYPES = "): src.index("}", src.index("_TYPES = {")) + 1])
    for name, (code, block, size) in table.items():
        q = gguf.GGMLQuantizationType[name]
        assert q.value == code and gguf.GGML_QUANT_SIZES[q] == (block, size), name
