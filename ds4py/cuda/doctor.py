"""`python -m ds4py doctor`: what this machine can run, checked rather than assumed.

Each check gives a status — "ok", "fail", or "absent" (nothing to check here: no GPU, no compiler; not a
failure) — a one-line detail and its numbers. Without a GPU the device checks say so once and the NVRTC build
and the emulator are still checked. With a model (`-m`), a few prompt and decode positions run on the GPU (or
the emulator, `--backend cuda-emu`) and on the reference over the same ids, compared by top-1 and max |Δlogit|.
The JSON keys are documented in bench/README.md ("doctor").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ds4py.errors import CudaUnavailableError, Ds4Error

PACKAGES = ("numpy", "cuda-bindings", "cuda-pathfinder", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "gguf",
            "orjson", "safetensors", "regex", "pytest")
SMOKE_N = 1 << 20             # floats written by the smoke kernel on a GPU (the emulator: 2,048)
COPY_BYTES = 256 << 20        # per bandwidth measurement
COPY_REPS = 5


@dataclass
class Check:
    name: str
    status: str               # ok | fail | absent
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, status: str, detail: str, **data: Any) -> Check:
        c = Check(name, status, detail, data)
        self.checks.append(c)
        return c

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def as_json(self) -> dict[str, Any]:
        return {**self.info, "ok": self.ok,
                "checks": [{"name": c.name, "status": c.status, "detail": c.detail, **c.data} for c in self.checks]}


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _err(e: BaseException) -> str:
    return str(e).rstrip(".") if isinstance(e, Ds4Error) else f"{type(e).__name__}: {e}"


def check_packages(rep: Report) -> None:
    from ds4py import __version__
    from ds4py.ggml_types import FALLBACK

    rep.info.update(ds4py=__version__, python=platform.python_version(), platform=platform.platform(),
                    packages={p: _version(p) for p in PACKAGES})
    missing = [p for p in ("numpy", "cuda-bindings", "nvidia-cuda-nvrtc") if rep.info["packages"][p] is None]
    if missing:
        rep.add("packages", "fail", f"missing {', '.join(missing)} (pip install 'ds4py[cuda]')")
    else:
        gg = "gguf " + rep.info["packages"]["gguf"] if not FALLBACK else "no gguf (reading only: ds4py's own table)"
        rep.add("packages", "ok", f"numpy {rep.info['packages']['numpy']}, cuda-bindings "
                f"{rep.info['packages']['cuda-bindings']}, {gg}")


def check_driver(rep: Report) -> Any:
    """The driver and its device, or None (absent: no GPU here)."""
    from ds4py.cuda import driver

    try:
        driver.api()
    except CudaUnavailableError as e:
        rep.info["driver"] = None
        rep.add("gpu", "absent", f"no GPU: {_err(e)}")
        return None
    v = int(driver.call("cuDriverGetVersion"))
    dev = driver.Device.open(0)
    free, total = (int(x) for x in driver.call("cuMemGetInfo"))
    rep.info["driver"] = {"cuda_version": f"{v // 1000}.{v % 1000 // 10}", "raw": v}
    rep.info["device"] = {"name": dev.name, "compute_capability": f"{dev.cc[0]}.{dev.cc[1]}", "arch": dev.arch,
                          "sms": dev.sm_count, "threads_per_sm": dev.threads_per_sm, "l2_bytes": dev.l2_bytes,
                          "smem_per_block_optin": dev.smem_per_block_optin, "memory_total": total,
                          "memory_free": free}
    rep.add("gpu", "ok", f"{dev.name}, sm_{dev.cc[0]}{dev.cc[1]}, {dev.sm_count} SMs, {free / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB free, driver CUDA {v // 1000}.{v % 1000 // 10}")
    return dev


def check_numerics(rep: Report, dev: Any) -> None:
    """The activations the GPU runs unless told (--exact / --act-quant) and why: its device profile's declared
    default (ds4py.cuda.devices.default_numerics; docs/cuda.md "Activation numerics"); with no GPU, every
    profiled device's."""
    from ds4py.cuda.devices import PROFILES, default_numerics, profile_for_device

    def word(d: Any) -> str:
        return "int8" if d.act_quant else "fp32"

    if dev is None:
        declared = {p.key: default_numerics(p) for p in PROFILES.values()}
        rep.info["numerics"] = {k: {"act_quant": d.act_quant, "why": d.why} for k, d in declared.items()}
        rep.add("numerics", "absent", "no GPU; the profiled devices' default activations: "
                + ", ".join(f"{k} {word(d)}" for k, d in declared.items()) + " (docs/cuda.md 'Activation numerics')")
        return
    d = default_numerics(profile_for_device(dev))
    rep.info["numerics"] = {"act_quant": d.act_quant, "why": d.why}
    rep.add("numerics", "ok", f"the GPU runs {word(d)} activations unless told: {d.why}; "
            f"{'--exact for fp32' if d.act_quant else '--act-quant for int8'}", act_quant=d.act_quant)


def check_bindings(rep: Report, dev: Any) -> None:
    """cuda-bindings M.x calls the driver API of CUDA M: the driver must support CUDA >= M."""
    if dev is None:
        return
    have = rep.info["packages"].get("cuda-bindings") or "0"
    major = int(have.split(".")[0])
    drv = rep.info["driver"]["raw"] // 1000
    fits = major <= drv
    rep.info["bindings_fit_driver"] = fits
    rep.add("bindings", "ok" if fits else "fail",
            f"cuda-bindings {have} on a CUDA {drv} driver" + ("" if fits else
            f": install cuda-bindings=={drv}.* (and the CUDA {drv} NVRTC / runtime wheels)"))


def check_nvrtc(rep: Report, dev: Any) -> str | None:
    """NVRTC's version, the arch it would build for, and one real build of cu/fill.cu. Returns the arch."""
    from ds4py.cuda import compiler

    try:
        ver = compiler.nvrtc_version()
        archs = compiler.supported_archs()
    except Ds4Error as e:
        rep.add("nvrtc", "fail", _err(e))
        return None
    arch = dev.arch if dev is not None else "sm_90"
    rep.info["nvrtc"] = {"version": f"{ver[0]}.{ver[1]}", "arch": arch, "supported": archs}
    if int(arch[3:].rstrip("a")) not in archs:
        rep.add("nvrtc", "fail", f"NVRTC {ver[0]}.{ver[1]} cannot build {arch} (it builds sm_{min(archs)} to "
                f"sm_{max(archs)})")
        return None
    if dev is not None:
        try:
            compiler.check_driver_version(rep.info["driver"]["raw"], ver)
        except Ds4Error as e:
            rep.add("nvrtc", "fail", _err(e))
            return None
    src = compiler.CU_DIR / "fill.cu"
    t0 = time.perf_counter()
    try:
        mod = compiler.compile_file(src, arch, compiler.file_options(src), cache=False)
    except Ds4Error as e:
        rep.add("nvrtc", "fail", f"NVRTC {ver[0]}.{ver[1]} could not build fill.cu for {arch}: {_err(e)}")
        return None
    dt = time.perf_counter() - t0
    rep.add("nvrtc", "ok", f"NVRTC {ver[0]}.{ver[1]} builds {arch}{'' if dev else ' (no GPU: the H100/H200 arch)'}"
            f"; fill.cu in {dt:.2f} s ({len(mod.cubin)} bytes)", seconds=round(dt, 3))
    return arch


def _fill_only_dir() -> Path:
    """A kernel folder holding cu/fill.cu and the headers: a Runtime over it compiles and loads one file. One
    fixed folder per checkout (the emulator's cache key holds the source's path, so its build is reused)."""
    from ds4py.cuda.compiler import CU_DIR, cache_dir

    d = cache_dir() / "doctor-cu" / hashlib.sha256(str(CU_DIR.resolve()).encode()).hexdigest()[:12]
    d.mkdir(parents=True, exist_ok=True)
    for f in [CU_DIR / "fill.cu", *CU_DIR.glob("*.cuh")]:
        if not (d / f.name).is_file() or (d / f.name).read_bytes() != f.read_bytes():
            tmp = d / f".{f.name}.{os.getpid()}"
            shutil.copy(f, tmp)
            os.replace(tmp, d / f.name)
    return d


def check_smoke(rep: Report, rt: Any, label: str, n: int = SMOKE_N) -> None:
    """Compile + launch + readback of fill_f32_uniform against its numpy twin."""
    from ds4py.cuda.ops import fill as ops_fill
    from ds4py.host import fill as twin

    t0 = time.perf_counter()
    arena = rt.arena(weights_bytes=4 * n + 4096, scratch_bytes=1 << 16)
    try:
        a = arena.weights(n, np.float32)
        a.readonly = False
        a.upload(np.full(n, np.nan, np.float32))               # poisoned: every element must be written
        t1 = time.perf_counter()
        ops_fill.fill_uniform(rt, a, -2.0, 3.0, 7)
        got = a.download()
        t2 = time.perf_counter()
    finally:
        arena.close()
    want = twin.uniform(n, -2.0, 3.0, 7, np.float32)
    bad = int(np.count_nonzero(~np.isclose(got, want, rtol=1e-6, atol=1e-6)))     # NaN (unwritten) is never close
    inexact = int(np.count_nonzero(got != want))     # --fmad=false: the GPU rounds like the twin, bit for bit
    data = {"seconds": round(t2 - t0, 4), "launch_readback_seconds": round(t2 - t1, 4), "mismatches": bad,
            "not_bit_exact": inexact}
    if bad:
        rep.add(f"smoke{label}", "fail", f"fill_f32_uniform: {bad} of {n} values differ from the twin", **data)
    else:
        rep.add(f"smoke{label}", "ok", f"fill_f32_uniform: {n} values = twin ({inexact} not bit-exact), "
                f"launch + readback {1e3 * (t2 - t1):.1f} ms", **data)


def check_bandwidth(rep: Report, rt: Any) -> None:
    from ds4py.cuda.memory import PinnedBuffer

    mem = rt.memory
    host = PinnedBuffer(COPY_BYTES)
    a, b = mem.alloc(COPY_BYTES), mem.alloc(COPY_BYTES)
    out: dict[str, float] = {}
    try:
        from ds4py.cuda.driver import call

        host.array[:] = 1
        timer = rt.timer()
        for name, fn, count in (
                ("h2d", lambda: call("cuMemcpyHtoDAsync", a, host.ptr, COPY_BYTES, rt.main), 1),
                ("d2h", lambda: call("cuMemcpyDtoHAsync", host.ptr, a, COPY_BYTES, rt.main), 1),
                ("d2d", lambda: rt.copy_d2d(b, a, COPY_BYTES), 2)):          # d2d: bytes read + written
            fn()
            timer.start()
            for _ in range(COPY_REPS):
                fn()
            ms = timer.stop() / COPY_REPS
            out[name] = round(count * COPY_BYTES / max(ms, 1e-6) / 1e6, 1)
        timer.close()
    finally:
        rt.synchronize()
        mem.free(a)
        mem.free(b)
        host.free()
    rep.info["bandwidth_gbps"] = out
    rep.add("bandwidth", "ok", f"host->device {out['h2d']:.0f} GB/s, device->host {out['d2h']:.0f} GB/s, "
            f"device copy {out['d2d']:.0f} GB/s (read + write, {COPY_BYTES >> 20} MiB)", **out)


def check_gpu_runtime(rep: Report, dev: Any, arch: str | None) -> None:
    if dev is None or arch is None:
        return
    from ds4py.cuda.runtime import Runtime

    d = _fill_only_dir()
    try:
        rt = Runtime(cu_dir=d, cache=False)
    except Ds4Error as e:
        rep.add("smoke", "fail", f"the runtime could not start: {_err(e)}")
        return
    try:
        check_smoke(rep, rt, "")
        check_bandwidth(rep, rt)
    except Ds4Error as e:
        rep.add("smoke", "fail", _err(e))
    finally:
        rt.close()


def check_emulator(rep: Report) -> None:
    from ds4py.cuda import emu

    if emu.compiler() is None:
        rep.add("emulator", "absent", "no host C++ compiler (g++): the CPU emulator (--backend cuda-emu) cannot run")
        return
    from ds4py.cuda.emu_runtime import EmuRuntime

    d = _fill_only_dir()
    try:
        rt = EmuRuntime(cu_dir=d)
        t0 = time.perf_counter()
        check_smoke(rep, rt, "_emulator", 2048)
        rep.checks[-1].detail += f" (emulator, {time.perf_counter() - t0:.1f} s with its g++ build)"
    except Ds4Error as e:
        rep.add("smoke_emulator", "fail", _err(e))


def check_auto(rep: Report, model: str | None) -> None:
    from ds4py.cuda.probe import auto_choice

    pick, why = auto_choice(model)
    rep.info["auto"] = {"backend": pick, "why": why}
    rep.add("auto", "ok", f"--backend auto picks {pick}: {why}")


def compare_model(rep: Report, path: str, backend: str, n_prompt: int = 8, n_decode: int = 3,
                  numerics: Any = None) -> None:
    """The same ids through `backend` and the reference: every prompt position and a few greedy decode steps
    (the reference's tokens fed to both), top-1 and max |Δlogit| per position. numerics: the backend's (default:
    DEVICE_NUMERICS, the device's declared default, as run / chat / serve open it); the reference runs the same."""
    from ds4py.backends import open_model
    from ds4py.contract import DEVICE_NUMERICS

    t0 = time.perf_counter()
    try:
        dev = open_model(path, backend=backend, numerics=DEVICE_NUMERICS if numerics is None else numerics)
        ref = open_model(path, backend="ref", numerics=dev.numerics)
    except Ds4Error as e:
        rep.add("model", "fail" if backend != "cuda" or not isinstance(e, CudaUnavailableError) else "absent",
                f"{Path(path).name}: {_err(e)}")
        return
    vocab = ref.config.vocab_size
    ids = [int(x) for x in np.random.default_rng(0).integers(0, vocab, n_prompt)]
    rs, ds = ref.new_state(), dev.new_state()
    lr = np.asarray(ref.step([rs], [ids], all_logits=True)[0], np.float64)
    ld = np.asarray(dev.step([ds], [ids], all_logits=True)[0], np.float64)
    rows_r, rows_d = list(lr), list(ld)
    for _ in range(n_decode):
        tok = int(np.argmax(rows_r[-1]))
        rows_r.append(np.asarray(ref.step([rs], [[tok]])[0], np.float64))
        rows_d.append(np.asarray(dev.step([ds], [[tok]])[0], np.float64))
    positions = []
    for p, (r, d) in enumerate(zip(rows_r, rows_d)):
        delta = float(np.max(np.abs(r - d)))
        tr, td = int(np.argmax(r)), int(np.argmax(d))
        # a different top-1 is a tie within the error when the reference's margin between the two is smaller
        tie = tr != td and r[tr] - r[td] <= 2 * delta
        positions.append({"position": p, "kind": "prompt" if p < n_prompt else "decode", "top1_ref": tr,
                          "top1": td, "max_abs_delta": delta, "ref_max_abs": float(np.max(np.abs(r))),
                          "agree": tr == td or tie})
    worst = max(x["max_abs_delta"] for x in positions)
    scale = max(x["ref_max_abs"] for x in positions)
    agree = sum(x["agree"] for x in positions)
    same = sum(x["top1"] == x["top1_ref"] for x in positions)
    tol = 1e-2 * max(1.0, scale)
    ok = agree == len(positions) and worst <= tol
    act = "int8" if dev.numerics.act_quant else "fp32"
    rep.info["model"] = {"path": path, "backend": dev.backend, "act_quant": dev.numerics.act_quant,
                         "numerics_why": dev.numerics_why, "positions": positions, "top1_equal": same,
                         "max_abs_delta": worst, "tolerance": tol, "seconds": round(time.perf_counter() - t0, 2)}
    rep.add("model", "ok" if ok else "fail",
            f"{Path(path).name} on {dev.backend} vs ref ({act} activations on both): top-1 equal at {same} of "
            f"{len(positions)} positions "
            f"({n_prompt} prompt, {n_decode} decode), max |Δlogit| {worst:.2e} (tolerance {tol:.1e})")


def run(model: str | None = None, backend: str = "cuda", n_prompt: int = 8, n_decode: int = 3,
        numerics: Any = None) -> Report:
    """Every check; with `model`, compare_model on `backend` under `numerics` (default: the device's)."""
    rep = Report()
    check_packages(rep)
    dev = None
    try:
        dev = check_driver(rep)
    except Ds4Error as e:
        rep.add("gpu", "fail", _err(e))
    check_numerics(rep, dev)
    check_bindings(rep, dev)
    arch = check_nvrtc(rep, dev)
    check_gpu_runtime(rep, dev, arch)
    if dev is not None:
        dev.close()
    check_emulator(rep)
    check_auto(rep, model)
    if model is not None:
        compare_model(rep, model, backend, n_prompt, n_decode, numerics)
    return rep


def render(rep: Report) -> str:
    words = {"ok": "ok", "fail": "FAIL", "absent": "--"}
    lines = [f"ds4py {rep.info.get('ds4py')} doctor (Python {rep.info.get('python')}, {sys.platform})"]
    for c in rep.checks:
        lines.append(f"{words[c.status]:<5} {c.name:<15} {c.detail}")
    lines.append("every check that can run here passed" if rep.ok else "some checks FAILED (see above)")
    return "\n".join(lines)
