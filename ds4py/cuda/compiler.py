"""NVRTC: compile cu/*.cu straight to CUBIN for one GPU arch, with a disk cache and the ptxas resource report.

Runs without a GPU driver (CI compiles every kernel for sm_121, sm_90 and sm_90a). One module per .cu file.
Cache: $DS4PY_CACHE_DIR or ~/.cache/ds4py, file cubin/<arch>/<stem>-<source key>-<toolchain key>.cubin (+ .log
with the ptxas report, + .nvrtc with the NVRTC version that built it). The source key is a sha256 of the .cu
bytes, every .cuh beside it, the options (the -D defines included) and the arch; the toolchain key covers the
NVRTC version and the CUDA wheel versions. Without NVRTC installed a cached cubin with the right source key is
still used (the newest one). A cold compile prints per-file progress and the total time; a warm start reads cubins.

-D defines, two kinds, both in the key:
  geometry  each kernel file's constants (chunk sizes, rows per warp) from the DEFINES table of its host wrapper
            ds4py/cuda/ops/<stem>.py, so the .cu and the wrapper cannot disagree;
  model     per-model shapes (model_defines(cfg)), passed only to the files that mention them.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ds4py.cuda.signature import Param, parse_kernels
from ds4py.errors import CudaUnavailableError, Ds4Error, exit_with

CU_DIR = Path(os.environ.get("DS4PY_CU_DIR") or Path(__file__).resolve().parents[2] / "cu")
# --fmad=false: no multiply-add contraction, as the emulator's g++ build (-ffp-contract=off). The bit-identity
# properties (a multi-row step's rows = single steps, speculative greedy = plain greedy) need the two kernels of
# each pair to round alike; with contraction each instantiation's own schedule decides where a*b + c becomes one
# rounding, so rows could differ from single steps on the GPU while the emulator says they are equal. Kernels
# that want a fused multiply-add write fmaf() / __fmaf_rn(), which both worlds compute exactly (docs/cuda-emu.md).
BASE_OPTIONS = ("-std=c++17", "-lineinfo", "--ptxas-options=-v", "--fmad=false")
CACHE_FORMAT = b"ds4py-cubin-v2"

# Per-model shape constants a kernel may need at compile time (register / shared-memory array sizes), with the
# V4 Flash values as defaults. A file gets the ones it mentions.
MODEL_DEFINES = {
    "DS4_HC": 4,                     # hyper-connection copies (hc_mult); the mix has (2 + hc) * hc rows
}


class KernelCompileError(Ds4Error):
    """NVRTC rejected a kernel source; the message carries NVRTC's log with file and line."""


class NvrtcUnavailableError(CudaUnavailableError):
    """NVRTC (cuda-bindings + nvidia-cuda-nvrtc) cannot be loaded."""


@dataclass(frozen=True)
class KernelResources:
    """One entry function's line of the ptxas report."""
    name: str
    registers: int = 0
    spill_stores: int = 0     # bytes
    spill_loads: int = 0      # bytes
    stack_frame: int = 0      # bytes of local memory per thread
    smem: int = 0             # static shared memory, bytes
    barriers: int = 0


@dataclass
class CompiledModule:
    source: Path
    arch: str
    cubin: bytes
    log: str                  # NVRTC log, including the ptxas report
    key: str
    cached: bool              # True: read from the disk cache
    seconds: float            # compile (or load) time
    kernels: dict[str, list[Param]] = field(default_factory=dict)
    nvrtc: tuple[int, int] = (0, 0)   # the NVRTC version that built the cubin

    @property
    def resources(self) -> dict[str, KernelResources]:
        return parse_ptxas_report(self.log)


def cache_dir() -> Path:
    return Path(os.environ.get("DS4PY_CACHE_DIR") or Path.home() / ".cache" / "ds4py")


def _nvrtc():
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(str(err))
    except Exception as e:  # ImportError, or the wheel's library cannot be loaded
        raise NvrtcUnavailableError(
            f"NVRTC is not available ({type(e).__name__}: {e}); install the CUDA extra: pip install 'ds4py[cuda]'"
        ) from None
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    _, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


def supported_archs() -> list[int]:
    nvrtc = _nvrtc()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    return [int(a) for a in archs]


def cuda_include_dir() -> str | None:
    """Headers (cuda_fp16.h, ...): the nvidia-cuda-runtime wheel via cuda.pathfinder, else a wheel layout on
    sys.path, else a toolkit ($CUDA_HOME, /usr/local/cuda)."""
    try:
        from cuda import pathfinder

        for lib in ("cudart", "nvrtc"):
            d = pathfinder.find_nvidia_header_directory(lib)
            if d and (Path(d) / "cuda_fp16.h").is_file():
                return str(d)
    except Exception:  # an older cuda-pathfinder without header lookup
        pass
    candidates = [Path(p) / "nvidia" / sub / "include" for p in sys.path if p
                  for sub in ("cu13", "cu12", "cuda_runtime")]
    candidates += [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_fp16.h").is_file():
            return str(c)
    return None


ARCH_SPECIFIC = re.compile(r"^\s*//\s*ds4py:\s*arch-specific\b", re.M)


def source_arch(arch: str, source_text: str) -> str:
    """The target for one source: the arch-specific 'a' variant (sm_90a: wgmma, setmaxnreg) only for a source
    that asks for it with a line `// ds4py: arch-specific`; every other file keeps the portable target."""
    return arch + "a" if ARCH_SPECIFIC.search(source_text) and not arch.endswith("a") else arch


def _wheel_versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "cuda-bindings"):
        try:
            out.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist}=none")
    return ";".join(out)


def source_key(source: Path, arch: str, options: Sequence[str]) -> str:
    """sha256 of what the cubin is built from: the source, every header beside it, the options and the arch."""
    h = hashlib.sha256(CACHE_FORMAT)
    h.update(f"|{arch}|".encode())
    for o in options:
        h.update(o.encode() + b"\0")
    files = [source] + sorted(source.parent.glob("*.cuh"))
    for f in files:
        h.update(f.name.encode() + b"\0")
        data = f.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def toolchain_key(version: tuple[int, int]) -> str:
    return hashlib.sha256(f"{version[0]}.{version[1]}|{_wheel_versions()}".encode()).hexdigest()


def cache_key(source: Path, arch: str, options: Sequence[str], version: tuple[int, int]) -> str:
    """The whole key (as in the cache file name): source key, then toolchain key."""
    return f"{source_key(source, arch, options)[:32]}-{toolchain_key(version)[:12]}"


# ---- -D defines ----------------------------------------------------------------------------------------------
def geometry_defines(stem: str) -> dict[str, int]:
    """The DEFINES table of ds4py/cuda/ops/<stem>.py (the kernel file's launch-geometry constants), or {}."""
    import importlib

    try:
        mod = importlib.import_module(f"ds4py.cuda.ops.{stem}")
    except ModuleNotFoundError as e:
        if e.name != f"ds4py.cuda.ops.{stem}":
            raise
        return {}
    return dict(getattr(mod, "DEFINES", {}))


def model_defines(cfg) -> dict[str, int]:
    """Per-model compile-time shapes from a ModelConfig (see MODEL_DEFINES)."""
    return {"DS4_HC": int(cfg.hc_mult)}


def file_defines(stem: str, source_text: str, model: dict[str, int] | None = None) -> dict[str, int]:
    """Every -D value one kernel file is compiled with: its geometry table, plus the model constants its source
    mentions (defaults from MODEL_DEFINES, overridden by `model`)."""
    out = geometry_defines(stem)
    values = {**MODEL_DEFINES, **(model or {})}
    unknown = set(model or {}) - set(MODEL_DEFINES)
    if unknown:
        raise Ds4Error(f"unknown model defines {sorted(unknown)}; known: {sorted(MODEL_DEFINES)}")
    for name, v in values.items():
        if re.search(rf"\b{name}\b", source_text):
            out[name] = v
    return out


def define_options(defines: dict[str, int]) -> tuple[str, ...]:
    for k, v in defines.items():
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", k) or isinstance(v, bool) or not isinstance(v, int):
            raise Ds4Error(f"define {k}={v!r}: names are upper-case identifiers and values integers")
    return tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def file_options(source: Path, model: dict[str, int] | None = None,
                 base: Sequence[str] = BASE_OPTIONS) -> tuple[str, ...]:
    """The NVRTC options for one kernel file: `base` and its -D defines."""
    source = Path(source)
    return tuple(base) + define_options(file_defines(source.stem, source.read_text(), model))


# ---- driver compatibility ----------------------------------------------------------------------------------------
def check_driver_version(driver_version: int, nvrtc: tuple[int, int]) -> None:
    """A cubin from NVRTC M.m loads on a driver of CUDA major version >= M (minor versions are compatible);
    an older driver gets one sentence instead of a failed module load. driver_version: cuDriverGetVersion()."""
    major, minor = driver_version // 1000, driver_version % 1000 // 10
    if nvrtc[0] and major < nvrtc[0]:
        raise CudaUnavailableError(
            f"the NVIDIA driver supports CUDA {major}.{minor} but the kernels are built by NVRTC "
            f"{nvrtc[0]}.{nvrtc[1]}: update the driver, or install the CUDA {major} wheels "
            f"(pip install nvidia-cuda-nvrtc-cu{major} nvidia-cuda-runtime-cu{major})")


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARS = re.compile(r"used (\d+) barriers")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Registers, spills, stack frame and static shared memory per entry function from `ptxas -v` output."""
    fields: dict[str, dict[str, int]] = {}
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            fields.setdefault(entry, {})
            continue
        if m := _PROPS.search(line):
            props = m.group(1)
            continue
        if (m := _FRAME.search(line)) and props in fields:
            fields[props].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        if (m := _USED.search(line)) and entry is not None:
            f = fields[entry]
            f["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                f["smem"] = int(s.group(1))
            if b := _BARS.search(line):
                f["barriers"] = int(b.group(1))
            entry = None
    return {name: KernelResources(name, **f) for name, f in fields.items()}


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _run_nvrtc(source: Path, arch: str, options: Sequence[str], include_dirs: Sequence[str]) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(source.read_bytes(), _display(source).encode(), 0, [], [])
    if err != ok:
        raise KernelCompileError(f"NVRTC could not create a program for {source.name}: {err}")
    try:
        opts = [f"--gpu-architecture={arch}", *options, *(f"-I{d}" for d in include_dirs)]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        if result != ok:
            raise KernelCompileError(f"NVRTC could not compile {_display(source)} for {arch}:\n{log.strip()}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != ok or size == 0:
            raise KernelCompileError(f"NVRTC produced no CUBIN for {_display(source)} ({arch}): {err}")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _cached(cdir: Path, arch: str, stem: str, skey: str, tkey: str | None) -> Path | None:
    """The cubin for this source key: built by this toolchain (tkey), or, with tkey None (no NVRTC), the newest."""
    d = cdir / "cubin" / arch
    if tkey is not None:
        p = d / f"{stem}-{skey[:32]}-{tkey[:12]}.cubin"
        return p if p.is_file() and p.with_suffix(".log").is_file() else None
    found = [p for p in d.glob(f"{stem}-{skey[:32]}-*.cubin") if p.with_suffix(".log").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _read_version(path: Path) -> tuple[int, int]:
    try:
        major, minor = path.with_suffix(".nvrtc").read_text().split(".")[:2]
        return int(major), int(minor)
    except (OSError, ValueError):
        return (0, 0)


def compile_file(source: Path, arch: str, options: Sequence[str] = BASE_OPTIONS,
                 cache: Path | None | bool = True) -> CompiledModule:
    """Compile one .cu for `arch` (e.g. "sm_90") with exactly `options` (file_options() adds its defines), or
    read it from the cache. cache: a directory, True for the default location, False/None to bypass it.
    Without NVRTC a cached cubin is still found; a miss then raises NvrtcUnavailableError."""
    source = Path(source)
    t0 = time.perf_counter()
    try:
        version: tuple[int, int] | None = nvrtc_version()
    except NvrtcUnavailableError:
        if not cache:
            raise
        version = None
    skey = source_key(source, arch, options)
    kernels = parse_kernels(source.read_text())
    cdir = (cache_dir() if cache is True else Path(cache)) if cache else None
    tkey = toolchain_key(version) if version is not None else None
    hit = _cached(cdir, arch, source.stem, skey, tkey) if cdir is not None else None
    if hit is not None:
        cubin = hit.read_bytes()
        log = hit.with_suffix(".log").read_text()
        return CompiledModule(source, arch, cubin, log, hit.stem.split("-", 1)[1], True, time.perf_counter() - t0,
                              kernels, _read_version(hit) if version is None else version)
    if version is None:
        raise NvrtcUnavailableError(f"{source.name} has no cached cubin for {arch} and NVRTC is not available to "
                                    f"build it; install the CUDA extra: pip install 'ds4py[cuda]'")
    cuda_inc = cuda_include_dir()
    if cuda_inc is None:
        raise NvrtcUnavailableError("the CUDA headers (cuda_fp16.h) were not found; install nvidia-cuda-runtime "
                                    "(pip install 'ds4py[cuda]') or set CUDA_HOME")
    includes = [str(source.parent), cuda_inc]
    cubin, log = _run_nvrtc(source, arch, options, includes)
    key = f"{skey[:32]}-{tkey[:12]}"
    if cdir is not None:
        cubin_path = cdir / "cubin" / arch / f"{source.stem}-{key}.cubin"
        try:
            cubin_path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(cubin_path.with_suffix(".nvrtc"), f"{version[0]}.{version[1]}".encode())
            _write_atomic(cubin_path.with_suffix(".log"), log.encode())
            _write_atomic(cubin_path, cubin)
        except OSError as e:
            print(f"ds4py: warning: cannot write the kernel cache at {cdir} ({e})", file=sys.stderr)
    return CompiledModule(source, arch, cubin, log, key, False, time.perf_counter() - t0, kernels, version)


def kernel_sources(cu_dir: Path = CU_DIR) -> list[Path]:
    files = sorted(Path(cu_dir).glob("*.cu"))
    if not files:
        raise Ds4Error(f"no CUDA kernel sources found in {cu_dir} (set DS4PY_CU_DIR to the repository's cu/)")
    return files


def compile_all(arch: str, cu_dir: Path = CU_DIR, cache: Path | None | bool = True,
                progress: Callable[[str], None] | None = None,
                defines: dict[str, int] | None = None) -> dict[str, CompiledModule]:
    """Every cu/*.cu for `arch`, keyed by file stem, each with its geometry defines and the model `defines` it
    uses (file_options). Prints progress for files that really compile."""
    if progress is None:
        def progress(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    sources = kernel_sources(cu_dir)

    def one(src: Path) -> CompiledModule:
        return compile_file(src, source_arch(arch, src.read_text()), file_options(src, defines), cache=cache)

    # NVRTC releases the GIL while it compiles: the files build in parallel threads (16 cores on the test GPU
    # machine: the whole set in about the time of the slowest file).
    workers = max(1, min(len(sources), int(os.environ.get("DS4PY_NVRTC_JOBS") or os.cpu_count() or 1)))
    with ThreadPoolExecutor(workers) as pool:
        built = list(pool.map(one, sources))
    modules: dict[str, CompiledModule] = {}
    for src, mod in zip(sources, built):
        if not mod.cached:
            progress(f"ds4py: compiled {src.name} for {mod.arch} in {mod.seconds:.2f} s")
        modules[src.stem] = mod
    fresh = sum(not m.cached for m in modules.values())
    if fresh:
        progress(f"ds4py: compiled {fresh} of {len(modules)} kernel files for {arch} "
                 f"in {time.perf_counter() - t0:.1f} s (cache: {cache_dir() if cache is True else cache})")
    return modules


def resource_table(modules: dict[str, CompiledModule]) -> str:
    """Text table of the ptxas report: one line per kernel."""
    lines = [f"{'kernel':<24} {'regs':>5} {'smem':>6} {'stack':>6} {'spill st/ld':>12}"]
    for mod in modules.values():
        for r in mod.resources.values():
            lines.append(f"{r.name:<24} {r.registers:>5} {r.smem:>6} {r.stack_frame:>6} "
                         f"{r.spill_stores:>5}/{r.spill_loads:<6}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """python -m ds4py.cuda.compiler [--json FILE] [ARCH ...]: compile every kernel and print the ptxas report
    (and write it as JSON: arch -> kernel -> resources). Without an arch: the local GPU's, or sm_90, sm_90a and
    sm_121 when there is none."""
    import json

    out = None
    if argv[:1] == ["--json"]:
        if len(argv) < 2:
            raise Ds4Error("--json needs a file name")
        out, argv = Path(argv[1]), argv[2:]
    archs = argv
    if not archs:
        from ds4py.cuda import driver

        if driver.available():
            d = driver.Device.open(0)
            archs = [d.arch]
            print(f"device: {d.name} ({d.arch}, {d.sm_count} SMs, {d.l2_bytes >> 20} MB L2)")
        else:
            archs = ["sm_90", "sm_90a", "sm_121"]
    report: dict = {}
    for a in archs:
        print(f"== {a} (NVRTC {'.'.join(map(str, nvrtc_version()))})")
        mods = compile_all(a)
        print(resource_table(mods))
        report[a] = {r.name: {"module": stem, "registers": r.registers, "spill_stores": r.spill_stores,
                              "spill_loads": r.spill_loads, "stack_frame": r.stack_frame, "smem": r.smem}
                     for stem, m in mods.items() for r in m.resources.values()}
    if out is not None:
        out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    exit_with(lambda: main(sys.argv[1:]))
