"""Run cu/*.cu kernels on the CPU: g++ builds the unmodified source against cu/emu/cuda_emu.h, each CUDA thread a
fiber, blocks one at a time (see cu/README.md). Test infrastructure, not a backend: it checks indexing,
synchronisation and arithmetic on tiny shapes; its timing means nothing.

    mod = EmuModule("cu/rmsnorm.cu")                   # compiled once per source hash, cached as a .so
    mod.launch("rmsnorm_f32", grid=4, block=128, args=[x, w, y, n, 1e-6])

Arrays are copied into guarded buffers (a PROT_NONE page right after each), launched, and non-const ones copied
back; scalars are checked against the kernel's parsed signature by the same packer as the GPU path.
Cache: $DS4PY_CACHE_DIR/emu or ~/.cache/ds4py/emu, one <stem>-<key>.so per source.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ds4py.cuda.args import KernelArgumentError, pack_args
from ds4py.cuda.compiler import cache_dir as compiler_cache_dir
from ds4py.cuda.signature import Param, parse_kernels, strip_comments
from ds4py.errors import Ds4Error

CU_DIR = Path(__file__).resolve().parents[2] / "cu"
EMU_DIR = CU_DIR / "emu"
FLAGS = ("-std=c++17", "-O1", "-g0", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing",
         "-ffp-contract=off", "-Wl,-Bsymbolic", "-DDS4_EMU=1")
GENERATOR_VERSION = "ds4py-emu-v2"
ORDERS = {"forward": 0, "reverse": 1, "random": 2}

_launch_lock = threading.Lock()      # the emulator's state is global per library, signal handlers per process
_loaded: dict[str, "EmuModule"] = {}


class EmuError(Ds4Error):
    """The CPU emulator could not build or run a kernel."""


class EmuCompileError(EmuError):
    """g++ rejected a kernel source under the emulator; the message carries its diagnostics."""


class EmuKernelError(EmuError):
    """The kernel misbehaved: barrier or warp divergence, deadlock, out-of-bounds access, bad launch."""


def cache_dir() -> Path:
    return compiler_cache_dir() / "emu"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


_EXTERN_SHARED = re.compile(r"\bextern(\s+(?:[^;\"{}]*?\s)?)__shared__\b([^;]*);")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def rewrite_source(src: str) -> tuple[str, list[str]]:
    """Dynamic shared memory for the emulator. Inside a function, `extern __shared__ T name[];` becomes a reference
    `T (&name)[]` to the launch's guarded dynamic shared memory (so overruns fault); at file scope it becomes
    `extern T name[];`, aliased by the launcher to one fixed buffer (no guard). Comments are blanked first,
    keeping their newlines: line numbers are unchanged. Returns the text and the file-scope array names.
    Headers are not rewritten: declare dynamic shared memory in the kernel's .cu file."""
    src = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), src)
    file_scope: list[str] = []
    count = 0

    def sub(m: re.Match) -> str:
        nonlocal count
        decl = m.group(2)
        nm = re.search(r"([A-Za-z_]\w*)\s*\[\s*\]\s*$", decl)
        if not nm:
            raise EmuCompileError(f"cannot read the dynamic shared memory declaration {m.group(0)!r}")
        name, prefix = nm.group(1), " ".join((m.group(1) + decl[: nm.start()]).split())
        before = src[: m.start()]
        if before.count("{") - before.count("}") == 0:
            file_scope.append(name)
            return f"extern{m.group(1)}{decl};"
        count += 1
        dummy = f"__emu_dyn_{count}"
        return (f"extern {prefix} {dummy}[]; {prefix} (&{name})[] = "
                f"*reinterpret_cast<decltype(&{dummy})>(::__emu::dyn_smem_ptr);")

    out = _EXTERN_SHARED.sub(sub, src)
    return out, file_scope


def generate(source: Path, src: str, kernels: dict[str, list[Param]]) -> str:
    """The translation unit g++ compiles: the kernel source (dynamic shared memory rewritten) + one launcher per
    kernel, `emu_launch_<name>(grid[3], block[3], dyn_smem, void** args, order, seed)`."""
    body, file_scope = rewrite_source(src)
    out = [f'#line 1 "{source}"', body, '#line 1 "<ds4py emu launcher>"']
    for n in dict.fromkeys(file_scope):
        out.append(f'asm(".globl {n}\\n.hidden {n}\\n.set {n}, __emu_dyn_smem");')
    static = "true" if file_scope else "false"
    for k in kernels:
        out.append(f"EMU_API int emu_launch_{k}(const unsigned* g, const unsigned* b, size_t smem, void** args, "
                   f"int order, uint64_t seed) {{ return ::__emu::launch_kernel({k}, g, b, smem, args, order, seed, "
                   f"{static}); }}")
    return "\n".join(out) + "\n"


def _header_files(source: Path) -> list[Path]:
    files = sorted(EMU_DIR.rglob("*.h")) + sorted(source.parent.glob("*.cuh")) + sorted(source.parent.glob("*.h"))
    if source.parent.resolve() != CU_DIR.resolve():
        files += sorted(CU_DIR.glob("*.cuh"))
    return files


_BOUNDS = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\(\s*(\w+)[^)]*\)\s+)?void\s+'
                     r"(?:__launch_bounds__\s*\(\s*(\w+)[^)]*\)\s+)?([A-Za-z_]\w*)\s*\(")


def launch_bounds(src: str) -> dict[str, int]:
    """Kernels declared with `__launch_bounds__(N)` (a literal N): the most threads a block may have."""
    out = {}
    for m in _BOUNDS.finditer(strip_comments(src)):
        n = m.group(1) or m.group(2)
        if n and n.isdigit():
            out[m.group(3)] = int(n)
    return out


_cxx_version: dict[str, str] = {}


def _compiler_version(cxx: str) -> str:
    if cxx not in _cxx_version:
        r = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        _cxx_version[cxx] = r.stdout.splitlines()[0] if r.stdout else "?"
    return _cxx_version[cxx]


def build(source: Path, extra_flags: Sequence[str] = ()) -> tuple[Path, dict[str, list[Param]]]:
    """Compile `source` for the emulator (or find it in the cache). Returns the .so path and the kernels."""
    source = Path(source).resolve()
    if not source.is_file():
        raise EmuError(f"kernel source {source} does not exist")
    cxx = compiler()
    if cxx is None:
        raise EmuError("the CUDA emulator needs a host C++ compiler (g++ not found; set CXX)")
    src = source.read_text()
    kernels = parse_kernels(src)
    if not kernels:
        raise EmuError(f'{source.name} declares no extern "C" __global__ kernels')
    unit = generate(source, src, kernels)
    h = hashlib.sha256(f"{GENERATOR_VERSION}|{_compiler_version(cxx)}|{' '.join((*FLAGS, *extra_flags))}|".encode())
    h.update(unit.encode())
    for f in _header_files(source):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    key = h.hexdigest()[:24]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out, kernels
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_src = out.with_name(f".{out.stem}.{os.getpid()}.cpp")
    tmp_so = out.with_name(f".{out.stem}.{os.getpid()}.so")
    tmp_src.write_text(unit)
    cmd = [cxx, *FLAGS, *extra_flags, f"-I{EMU_DIR / 'include'}", f"-I{source.parent}", f"-I{CU_DIR}",
           "-include", str(EMU_DIR / "cuda_emu.h"), "-x", "c++", str(tmp_src), "-o", str(tmp_so)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise EmuCompileError(f"the emulator could not compile {source.name}:\n{r.stderr.strip()}")
        os.replace(tmp_so, out)
    finally:
        tmp_src.unlink(missing_ok=True)
        tmp_so.unlink(missing_ok=True)
    return out, kernels


@dataclass
class _Buffer:
    """A guarded copy of one array, shaped like a device buffer for `pack_args` (ptr, dtype, readonly)."""
    ptr: int
    dtype: np.dtype
    readonly: bool
    nbytes: int
    array: np.ndarray
    names: list[str]
    written: bool = False

    @property
    def padded(self) -> int:
        return (self.nbytes + 15) // 16 * 16


def _dim3(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    t = (int(v),) if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3 or any(x < 1 or x >= 2**32 for x in t):
        raise KernelArgumentError(f"{what} must be 1 to 3 positive sizes, got {v!r}")
    return t + (1,) * (3 - len(t))


class EmuModule:
    """One .cu file compiled for the CPU emulator; `launch` runs one of its kernels on numpy arrays."""

    def __init__(self, source: str | Path, extra_flags: Sequence[str] = ()):
        self.source = Path(source).resolve()
        self.path, self.kernels = build(self.source, extra_flags)
        self.max_threads = launch_bounds(self.source.read_text())
        self._lib = ctypes.CDLL(str(self.path))
        lib = self._lib
        lib.emu_alloc.restype = ctypes.c_void_p
        lib.emu_alloc.argtypes = [ctypes.c_size_t]
        lib.emu_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.emu_protect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.emu_message.restype = ctypes.c_char_p
        lib.emu_fault_address.restype = ctypes.c_void_p
        lib.emu_static_smem_bytes.restype = ctypes.c_size_t
        self._launchers = {}
        for k in self.kernels:
            fn = getattr(lib, f"emu_launch_{k}")
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int,
                           ctypes.c_uint64]
            self._launchers[k] = fn

    @property
    def static_smem_bytes(self) -> int:
        """Static __shared__ bytes of all kernels in the file together."""
        return int(self._lib.emu_static_smem_bytes())

    def launch(self, name: str, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any],
               shared_mem: int = 0, order: str = "forward", seed: int = 0) -> None:
        """Run kernel `name` over `grid` x `block`. Pointer parameters take C-contiguous numpy arrays (or None for
        a null pointer); arrays passed to non-const pointers are updated in place. `order` picks the thread and
        block order ("forward", "reverse" or seeded "random") to shake out order-dependent results."""
        if name not in self.kernels:
            raise KernelArgumentError(f"{self.source.name} has no kernel {name!r} (it has {', '.join(self.kernels)})")
        if order not in ORDERS:
            raise KernelArgumentError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        params = self.kernels[name]
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        if name in self.max_threads and b[0] * b[1] * b[2] > self.max_threads[name]:
            raise EmuKernelError(f"{name}: block of {b[0] * b[1] * b[2]} threads exceeds its "
                                 f"__launch_bounds__({self.max_threads[name]})")
        if len(args) != len(params):
            pack_args(name, params, args)                  # raises the count error with the signature
        buffers: list[_Buffer] = []
        with _launch_lock:
            try:
                values = [self._stage(name, p, v, buffers) if p.is_pointer else v for p, v in zip(params, args)]
                packed = pack_args(name, params, values)
                for buf in buffers:                         # a store through a const pointer faults
                    if not buf.written and buf.nbytes:
                        self._lib.emu_protect(buf.ptr, buf.nbytes, 1)
                rc = self._launchers[name]((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), int(shared_mem),
                                           packed.address or None, ORDERS[order], int(seed))
                if rc != 0:
                    raise EmuKernelError(f"{name}: {self._describe_failure(rc, buffers)}")
                for buf in buffers:
                    self._finish(name, buf)
            finally:
                for buf in buffers:
                    self._lib.emu_free(buf.ptr, buf.nbytes)

    def _stage(self, kernel: str, p: Param, v: Any, buffers: list[_Buffer]) -> Any:
        if v is None or not isinstance(v, np.ndarray):
            return v                                        # None (null), or something pack_args will reject
        if not v.flags.c_contiguous:
            raise KernelArgumentError(f"{kernel}: argument {p.name!r} must be a C-contiguous array")
        addr = v.ctypes.data
        for buf in buffers:                                 # the same array twice (in-place kernels) shares a buffer
            a0 = buf.array.ctypes.data
            if a0 == addr and buf.nbytes == v.nbytes:
                buf.names.append(p.name)
                buf.written |= not p.is_const
                return buf
            if v.nbytes and buf.nbytes and addr < a0 + buf.nbytes and a0 < addr + v.nbytes:
                raise KernelArgumentError(
                    f"{kernel}: argument {p.name!r} partly overlaps argument {buf.names[0]!r}; pass separate arrays")
        ptr = self._lib.emu_alloc(v.nbytes)
        if not ptr:
            raise EmuError(f"{kernel}: cannot map {v.nbytes} bytes for argument {p.name!r}")
        buf = _Buffer(ptr, v.dtype, not v.flags.writeable, v.nbytes, v, [p.name], not p.is_const)
        buffers.append(buf)
        ctypes.memmove(ptr, addr, v.nbytes)
        ctypes.memset(ptr + v.nbytes, 0xFF, buf.padded - v.nbytes)   # poison the alignment padding
        return buf

    def _finish(self, kernel: str, buf: _Buffer) -> None:
        pad = ctypes.string_at(buf.ptr + buf.nbytes, buf.padded - buf.nbytes)
        if pad != b"\xff" * len(pad):
            raise EmuKernelError(f"{kernel}: wrote past the end of argument {buf.names[0]!r} ({buf.nbytes} bytes)")
        if buf.written:
            ctypes.memmove(buf.array.ctypes.data, buf.ptr, buf.nbytes)

    def _describe_failure(self, rc: int, buffers: list[_Buffer]) -> str:
        msg = self._lib.emu_message().decode(errors="replace")
        if rc != 2:
            return msg
        addr = self._lib.emu_fault_address() or 0
        page = os.sysconf("SC_PAGE_SIZE")
        for buf in buffers:
            end = buf.ptr + buf.padded
            if buf.ptr <= addr < end:
                return f"{msg}: a write to const argument {buf.names[0]!r} (byte {addr - buf.ptr} of {buf.nbytes})"
            if end <= addr < end + page:
                return f"{msg}: {addr - buf.ptr - buf.nbytes} bytes past the end of argument {buf.names[0]!r} " \
                       f"({buf.nbytes} bytes)"
        return msg


def load(source: str | Path) -> EmuModule:
    """EmuModule for `source`, shared within the process (rebuilt when the source or headers change)."""
    source = Path(source).resolve()
    key = str(source)
    mod = _loaded.get(key)
    if mod is None or build(source)[0] != mod.path:
        mod = _loaded[key] = EmuModule(source)
    return mod
