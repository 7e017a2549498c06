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

import contextlib
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ds4py.cuda.args import KernelArgumentError, pack_args
from ds4py.cuda.compiler import cache_dir as compiler_cache_dir
from ds4py.cuda.signature import Param, parse_kernels, strip_comments
from ds4py.errors import Ds4Error

CU_DIR = Path(__file__).resolve().parents[2] / "cu"
EMU_DIR = CU_DIR / "emu"
FLAGS = ("-std=c++17", "-O2", "-g0", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing",
         "-ffp-contract=off", "-Wl,-Bsymbolic", "-DDS4_EMU=1")
GENERATOR_VERSION = "ds4py-emu-v5"   # v5: template-local __shared__ moved into emu_shared
# The checker builds (docs/cuda-emu.md "Checker builds"), chosen with DS4PY_EMU_CHECK=race,asan (or `check=`):
# race: every access instrumented (-fsanitize=thread, routed to cu/emu/emu_check.h's shared-memory race detector,
#   no TSan runtime: compiled, then linked without it);
# asan: AddressSanitizer + UndefinedBehaviorSanitizer (global memory, the stacks, static __shared__ with redzones,
#   dynamic shared memory poisoned outside the launch's bytes); the process must load libasan first
#   (python -m ds4py.cuda.emu_check does that);
# traffic: the race build's instrumentation routed to a memory-traffic profile per launch (cu/emu/emu_check.h,
#   ds4py/cuda/traffic.py): coalescing per warp request, unique bytes, bytes before pdl_wait, bank conflicts;
#   -fno-tree-sra keeps a float4 / uint2 load one 16 / 8-byte access, as the GPU issues it (g++'s scalar
#   replacement of aggregates would split it into 4-byte loads: four requests at a quarter of the efficiency).
CHECKS = {
    "race": ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-DDS4_EMU_RACE=1"),
    "asan": ("-fsanitize=address,undefined", "-fsanitize-sections=emu_shared", "-fno-sanitize-recover=undefined",
             "-fno-omit-frame-pointer", "-DDS4_EMU_ASAN=1"),
    "traffic": ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-fno-tree-sra", "-DDS4_EMU_TRAFFIC=1"),
}
LINK_CHECKS = {"race": (), "asan": ("-fsanitize=address,undefined",), "traffic": ()}
ORDERS = {"forward": 0, "reverse": 1, "random": 2}

_loaded: dict[tuple[str, tuple[str, ...]], "EmuModule"] = {}


class EmuError(Ds4Error):
    """The CPU emulator could not build or run a kernel."""


class EmuCompileError(EmuError):
    """g++ rejected a kernel source under the emulator; the message carries its diagnostics."""


class EmuKernelError(EmuError):
    """The kernel misbehaved: barrier or warp divergence, deadlock, out-of-bounds access, bad launch."""


def cache_dir() -> Path:
    return compiler_cache_dir() / "emu"


def checks(check: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The checker modes of a build: `check` ("race", "asan", "race,asan" or a sequence), else DS4PY_EMU_CHECK."""
    if check is None:
        check = os.environ.get("DS4PY_EMU_CHECK", "")
    names = [c.strip() for c in (check.split(",") if isinstance(check, str) else check) if c.strip()]
    bad = [c for c in names if c not in CHECKS]
    if bad:
        raise EmuError(f"unknown emulator check {bad[0]!r} (DS4PY_EMU_CHECK takes {', '.join(CHECKS)})")
    if len(set(names)) > 1:
        raise EmuError(f"the {' and '.join(sorted(set(names)))} checks are separate builds: run one, then the other")
    return tuple(sorted(set(names)))


def asan_loaded() -> bool:
    """Whether this process runs with the AddressSanitizer runtime (LD_PRELOAD), which an asan build needs."""
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


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
                   f"int order, uint64_t seed) {{ ::__emu::L.kernel = \"{k}\"; return ::__emu::launch_kernel({k}, g, "
                   f"b, smem, args, order, seed, {static}); }}")
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


def build(source: Path, extra_flags: Sequence[str] = (),
          progress: Callable[[str], None] | None = None,
          check: str | Sequence[str] | None = None) -> tuple[Path, dict[str, list[Param]]]:
    """Compile `source` for the emulator (or find it in the cache). Returns the .so path and the kernels.
    progress: told about a build that really runs g++ (about a second per file). check: the checker builds
    (see CHECKS; default DS4PY_EMU_CHECK)."""
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
    modes = checks(check)
    extra_flags = (*[f for m in modes for f in CHECKS[m]], *extra_flags)
    h = hashlib.sha256(f"{GENERATOR_VERSION}|{_compiler_version(cxx)}|{' '.join((*FLAGS, *extra_flags))}|".encode())
    h.update(unit.encode())
    for f in _header_files(source):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    key = h.hexdigest()[:24]
    out = cache_dir() / f"{source.stem}{''.join('-' + m for m in modes)}-{key}.so"
    if out.is_file():
        return out, kernels
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if out.is_file():          # another process (or thread) built it while this one waited
            return out, kernels
        _compile(cxx, source, unit, extra_flags, out, progress, modes)
    return out, kernels


@contextlib.contextmanager
def _build_lock(out: Path):
    """One g++ build per library at a time across processes (the test suite's background jobs, CLI subprocesses):
    a second builder of the same key waits for the first and then finds its .so, instead of compiling it again."""
    with open(out.with_name(f".{out.stem}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(cxx: str, source: Path, unit: str, extra_flags: Sequence[str], out: Path,
             progress: Callable[[str], None] | None, modes: Sequence[str] = ()) -> None:
    tmp_src = out.with_name(f".{out.stem}.{os.getpid()}.cpp")
    tmp_so = out.with_name(f".{out.stem}.{os.getpid()}.so")
    tmp_obj = out.with_name(f".{out.stem}.{os.getpid()}.o")
    tmp_src.write_text(unit)
    t0 = time.perf_counter()
    cmd = [cxx, *FLAGS, *extra_flags, f"-I{EMU_DIR / 'include'}", f"-I{source.parent}", f"-I{CU_DIR}",
           "-include", str(EMU_DIR / "cuda_emu.h"), "-x", "c++", str(tmp_src)]
    # Compiled, then its template-local __shared__ arrays moved into emu_shared (_move_template_shared), then
    # linked; the race and traffic builds link without the sanitizer (its hooks are in the library itself, no
    # TSan runtime).
    link = [cxx, "-shared", "-fPIC", "-Wl,-Bsymbolic", *[f for m in modes for f in LINK_CHECKS[m]], str(tmp_obj),
            "-o", str(tmp_so)]
    try:
        for c in (cmd + ["-c", "-o", str(tmp_obj)], None, link):
            if c is None:
                _move_template_shared(tmp_obj, unit, source.name)
                continue
            r = subprocess.run(c, capture_output=True, text=True)
            if r.returncode != 0:
                raise EmuCompileError(f"the emulator could not compile {source.name}:\n{r.stderr.strip()}")
        os.replace(tmp_so, out)
        if progress is not None:
            progress(f"ds4py: emulator built {source.name} in {time.perf_counter() - t0:.1f} s")
    finally:
        tmp_src.unlink(missing_ok=True)
        tmp_so.unlink(missing_ok=True)
        tmp_obj.unlink(missing_ok=True)


_LOCAL_STATIC_SECTION = re.compile(r"\]\s+\.(?:bss|data)\.(_ZZ\S+)\s")


def _move_template_shared(obj: Path, unit: str, name: str) -> None:
    """Put every `__shared__` array declared inside a function template into the emu_shared section, where the
    runtime's shared-memory ranges (__start/__stop_emu_shared: the race detector's shadow, the traffic profile's
    classifier, the poisoning at block start, static_smem_bytes) look for it. g++ (12) ignores a section attribute
    on a static local of a template instantiation and gives it its own COMDAT section `.bss.<mangled name>`
    instead, so `__shared__` (cu/emu/cuda_emu.h: static + section("emu_shared")) alone leaves such arrays as
    unclassified host memory. A static local whose (unqualified) name the source declares `__shared__` somewhere
    is taken to be that array: device code has no other function-local statics. The moved sections get contents
    (PROGBITS, like the attribute's own emu_shared): a NOBITS one would make the linker emit a second output
    section of that name, and __start/__stop_emu_shared would bracket only one of the two."""
    readelf, objcopy, demangle = shutil.which("readelf"), shutil.which("objcopy"), shutil.which("c++filt")
    if not (readelf and objcopy and demangle):
        raise EmuCompileError("the emulator needs binutils (readelf, objcopy, c++filt) to place template-local "
                              "__shared__ arrays")
    r = subprocess.run([readelf, "-SW", str(obj)], capture_output=True, text=True, check=True)
    sections = [m.group(1) for line in r.stdout.splitlines() if (m := _LOCAL_STATIC_SECTION.search(line))]
    if not sections:
        return
    d = subprocess.run([demangle], input="\n".join(sections), capture_output=True, text=True, check=True)
    code = _COMMENT.sub("", unit)
    renames = []
    for mangled, plain in zip(sections, d.stdout.splitlines()):
        var = plain.rsplit("::", 1)[-1]
        if not plain.startswith("__emu::") and re.search(rf"\b__shared__\b[^;]*\b{re.escape(var)}\b", code):
            kind = "bss" if f".bss.{mangled}" in r.stdout else "data"
            renames += ["--rename-section", f".{kind}.{mangled}=emu_shared,alloc,load,contents,data"]
    if renames:
        c = subprocess.run([objcopy, *renames, str(obj)], capture_output=True, text=True)
        if c.returncode != 0:
            raise EmuCompileError(f"the emulator could not place the __shared__ arrays of {name}:\n{c.stderr.strip()}")


# ---- guarded host buffers ------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = os.sysconf("SC_PAGE_SIZE")
_PROT_NONE, _PROT_READ, _PROT_RW = 0, 1, 3
_MAP_PRIVATE_ANON = 0x02 | 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_guarded(body: int) -> int:
    """`body` bytes (a whole number of pages) of read-write memory between two PROT_NONE pages; returns the
    address of the first body byte."""
    base = _libc.mmap(None, body + 2 * PAGE, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
    if base in (None, _MAP_FAILED):
        raise EmuError(f"cannot map {body} bytes of host memory for the emulator")
    _libc.mprotect(base, PAGE, _PROT_NONE)
    _libc.mprotect(base + PAGE + body, PAGE, _PROT_NONE)
    return base + PAGE


def unmap_guarded(start: int, body: int) -> None:
    _libc.munmap(start - PAGE, body + 2 * PAGE)


def protect(start: int, body: int, readonly: bool) -> None:
    _libc.mprotect(start, body, _PROT_READ if readonly else _PROT_RW)


def _padded(n: int) -> int:
    return (n + 15) // 16 * 16


def _body(n: int) -> int:
    return max(PAGE, (_padded(n) + PAGE - 1) // PAGE * PAGE)


class GuardedBuffer:
    """Host bytes ending (after up to 15 bytes of padding) right below a PROT_NONE page: the first access past
    the end faults. `ptr` is 16-byte aligned, as a vector load needs."""
    __slots__ = ("start", "body", "ptr", "nbytes", "readonly")

    def __init__(self, start: int, body: int):
        self.start, self.body, self.ptr, self.nbytes, self.readonly = start, body, start, 0, False

    def place(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ptr = self.start + self.body - _padded(nbytes)

    def set_readonly(self, ro: bool) -> None:
        if ro != self.readonly:
            protect(self.start, self.body, ro)
            self.readonly = ro

    @property
    def padding(self) -> int:
        return _padded(self.nbytes) - self.nbytes


class BufferPool:
    """Guarded buffers reused from launch to launch (a mapping costs system calls; a reuse costs none)."""

    def __init__(self, keep: int = 64):
        self.free: dict[int, list[GuardedBuffer]] = {}
        self.keep = keep

    def get(self, nbytes: int) -> GuardedBuffer:
        body = _body(nbytes)
        bufs = self.free.get(body)
        buf = bufs.pop() if bufs else GuardedBuffer(map_guarded(body), body)
        buf.place(nbytes)
        return buf

    def put(self, buf: GuardedBuffer) -> None:
        buf.set_readonly(False)
        bufs = self.free.setdefault(buf.body, [])
        if len(bufs) < self.keep:
            bufs.append(buf)
        else:
            unmap_guarded(buf.start, buf.body)


_pool = BufferPool()


# ---- staging: every pointer argument in its own guarded copy ----------------------------------------------------
class Staged:
    """What pack_args sees for one staged pointer argument: the guarded copy's address, dtype and writability."""
    __slots__ = ("ptr", "dtype", "readonly")

    def __init__(self, ptr: int, dtype: Any, readonly: bool):
        self.ptr, self.dtype, self.readonly = ptr, dtype, readonly


class _Group:
    """One host extent [addr, addr + nbytes) that one or more arguments point at (the same array twice)."""
    __slots__ = ("addr", "nbytes", "names", "writes", "buf", "cached", "memory", "weight")

    def __init__(self, addr: int, nbytes: int, name: str, writes: bool, memory: Any, weight: bool = False):
        self.addr, self.nbytes, self.names, self.writes = addr, nbytes, [name], writes
        self.weight = weight          # read-only at the source (the arena's weights region): what the traffic
                                      # profile reports as a weight
        self.buf: GuardedBuffer | None = None
        self.cached = False
        self.memory = memory


class Staging:
    """The guarded copies of one launch's pointer arguments.

    Each argument's bytes are copied into a buffer that ends at a guard page (const ones mapped read-only), the
    kernel runs on the copies, and the written ones are copied back (after checking the alignment padding).
    A const argument whose memory offers `const_copy` (the EmuRuntime's host arena) is taken from its cache of
    read-only copies instead: weights are copied once, not once per launch."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.groups: list[_Group] = []

    def add(self, p: Param, addr: int, nbytes: int, dtype: Any, src_readonly: bool, memory: Any = None) -> Staged:
        writes = not p.is_const
        for g in self.groups:                         # the same array twice (in-place kernels) shares a buffer
            if g.addr == addr and g.nbytes == nbytes:
                g.names.append(p.name)
                g.writes |= writes
                return Staged(0, dtype, src_readonly)   # pointer filled in by place()
            if nbytes and g.nbytes and addr < g.addr + g.nbytes and g.addr < addr + nbytes:
                raise KernelArgumentError(f"{self.kernel}: argument {p.name!r} partly overlaps argument "
                                          f"{g.names[0]!r}; pass separate arrays")
        self.groups.append(_Group(addr, nbytes, p.name, writes, memory, bool(src_readonly)))
        return Staged(0, dtype, src_readonly)

    def place(self, staged: list[tuple[int, int, Staged]]) -> None:
        """Copy every group into its buffer and point each Staged at it; staged: (addr, nbytes, Staged)."""
        for g in self.groups:
            if not g.writes and g.memory is not None and g.nbytes:
                g.buf, g.cached = g.memory.const_copy(g.addr, g.nbytes), True
                continue
            buf = g.buf = _pool.get(g.nbytes)
            if g.nbytes:
                ctypes.memmove(buf.ptr, g.addr, g.nbytes)
            if buf.padding:
                ctypes.memset(buf.ptr + g.nbytes, 0xFF, buf.padding)   # poison the alignment padding
            if not g.writes:
                buf.set_readonly(True)                       # a store through a const pointer faults
        where = {(g.addr, g.nbytes): g.buf.ptr for g in self.groups}
        for addr, nbytes, s in staged:
            s.ptr = where[(addr, nbytes)]

    def finish(self) -> None:
        """After a successful launch: check the padding of written buffers, then copy them back."""
        for g in self.groups:
            if not g.writes:
                continue
            buf = g.buf
            if buf.padding and ctypes.string_at(buf.ptr + g.nbytes, buf.padding) != b"\xff" * buf.padding:
                raise EmuKernelError(f"{self.kernel}: wrote past the end of argument {g.names[0]!r} "
                                     f"({g.nbytes} bytes)")
        for g in self.groups:
            if g.writes and g.nbytes:
                ctypes.memmove(g.addr, g.buf.ptr, g.nbytes)
                if g.memory is not None:
                    g.memory.invalidate(g.addr, g.nbytes)

    def release(self) -> None:
        for g in self.groups:
            if g.buf is not None and not g.cached:
                _pool.put(g.buf)
            g.buf = None

    def writable(self) -> list[GuardedBuffer]:
        return [g.buf for g in self.groups if g.writes and g.buf is not None]

    def describe_fault(self, msg: str, addr: int) -> str:
        for g in self.groups:
            buf = g.buf
            if buf is None:
                continue
            end = buf.ptr + _padded(g.nbytes)
            if buf.ptr <= addr < end and "pdl_wait" in msg:
                return f"{msg}: to argument {g.names[0]!r} (byte {addr - buf.ptr} of {g.nbytes})"
            if buf.ptr <= addr < end:
                return f"{msg}: a write to const argument {g.names[0]!r} (byte {addr - buf.ptr} of {g.nbytes})"
            if end <= addr < end + PAGE:
                return f"{msg}: {addr - buf.ptr - g.nbytes} bytes past the end of argument {g.names[0]!r} " \
                       f"({g.nbytes} bytes)"
        return msg


def _dim3(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    t = (int(v),) if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3 or any(x < 1 or x >= 2**32 for x in t):
        raise KernelArgumentError(f"{what} must be 1 to 3 positive sizes, got {v!r}")
    return t + (1,) * (3 - len(t))


class EmuModule:
    """One .cu file compiled for the CPU emulator; `launch` runs one of its kernels on numpy arrays (the
    EmuRuntime runs them on its host arena through `run`)."""

    def __init__(self, source: str | Path, extra_flags: Sequence[str] = (),
                 progress: Callable[[str], None] | None = None, check: str | Sequence[str] | None = None):
        self.source = Path(source).resolve()
        self.extra_flags = tuple(extra_flags)
        self.checks = checks(check)
        if "asan" in self.checks and not asan_loaded():
            raise EmuError("the asan emulator build needs the AddressSanitizer runtime loaded first: run it through "
                           "python -m ds4py.cuda.emu_check asan (it sets LD_PRELOAD)")
        self.path, self.kernels = build(self.source, self.extra_flags, progress, self.checks)
        self.max_threads = launch_bounds(self.source.read_text())
        self._lib = ctypes.CDLL(str(self.path))
        lib = self._lib
        lib.emu_message.restype = ctypes.c_char_p
        lib.emu_fault_address.restype = ctypes.c_void_p
        lib.emu_static_smem_bytes.restype = ctypes.c_size_t
        lib.emu_pdl_check.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._poison = None
        if "asan" in self.checks:
            lib.emu_asan_poison.argtypes = lib.emu_asan_unpoison.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            self._poison = (lib.emu_asan_poison, lib.emu_asan_unpoison)
        if "traffic" in self.checks:
            lib.emu_traffic_begin.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            lib.emu_traffic_read.argtypes = [ctypes.c_void_p]
        self._launchers = {}
        for k in self.kernels:
            fn = getattr(lib, f"emu_launch_{k}")
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int,
                           ctypes.c_uint64]
            self._launchers[k] = fn

    def _name_static_shared(self, msg: str) -> str:
        """Name the static __shared__ variable a race report's address falls in (from the library's symbols)."""
        m = re.search(r"\(address (0x[0-9a-f]+)\)", msg)
        nm = shutil.which("nm")
        if not m or not nm:
            return msg
        r = subprocess.run([nm, "-C", "-S", "--defined-only", str(self.path)], capture_output=True, text=True)
        syms = {}
        for line in r.stdout.splitlines():
            parts = line.split(maxsplit=3)
            if len(parts) == 4 and all(c in "0123456789abcdef" for c in parts[0] + parts[1]):
                syms[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
        if "emu_message" not in syms:
            return msg
        base = ctypes.cast(self._lib.emu_message, ctypes.c_void_p).value - syms["emu_message"][0]
        addr = int(m.group(1), 16) - base
        for sym, (at, size) in syms.items():
            if at <= addr < at + size:
                return msg.replace(m.group(0), f"({m.group(0)[1:-1]}: byte {addr - at} of {sym}, {size} bytes)")
        return msg

    @property
    def static_smem_bytes(self) -> int:
        """Static __shared__ bytes of all kernels in the file together."""
        return int(self._lib.emu_static_smem_bytes())

    def check(self, name: str, block: tuple[int, int, int], order: str) -> list[Param]:
        if name not in self.kernels:
            raise KernelArgumentError(f"{self.source.name} has no kernel {name!r} (it has {', '.join(self.kernels)})")
        if order not in ORDERS:
            raise KernelArgumentError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        if name in self.max_threads and block[0] * block[1] * block[2] > self.max_threads[name]:
            raise EmuKernelError(f"{name}: block of {block[0] * block[1] * block[2]} threads exceeds its "
                                 f"__launch_bounds__({self.max_threads[name]})")
        return self.kernels[name]

    def run(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
            params_address: int | None, order: str, seed: int, staging: Staging, pdl_check: bool = False) -> None:
        """One launch with packed parameters (pointers already into `staging`'s buffers). Call under
        `launch_lock`; raises EmuKernelError naming thread, block and line when the kernel misbehaves.
        pdl_check: a thread that stores to an argument, or returns, before calling pdl_wait() fails the launch."""
        watched = staging.writable() if pdl_check else []
        if pdl_check:
            if len(watched) > 32:
                raise EmuError(f"{name}: the pdl check watches at most 32 written arguments")
            starts = (ctypes.c_void_p * max(1, len(watched)))(*[b.start for b in watched])
            lens = (ctypes.c_size_t * max(1, len(watched)))(*[b.body for b in watched])
            self._lib.emu_pdl_check(len(watched), starts, lens)
        profiled = [g for g in staging.groups if g.buf is not None] if "traffic" in self.checks else []
        if "traffic" in self.checks:
            los = (ctypes.c_void_p * max(1, len(profiled)))(*[g.buf.ptr for g in profiled])
            lens = (ctypes.c_size_t * max(1, len(profiled)))(*[g.nbytes for g in profiled])
            if self._lib.emu_traffic_begin(len(profiled), los, lens) != 0:
                raise EmuError(f"{name}: the traffic profile takes at most 64 pointer arguments")
        bufs = [g.buf for g in staging.groups if g.buf is not None] if self._poison else []
        for b in bufs:              # the asan build: every byte of an argument's buffer outside the argument
            pre, post = b.ptr - b.start, b.start + b.body - (b.ptr + b.nbytes)
            self._poison[0](b.start, pre)
            self._poison[0](b.ptr + b.nbytes, post)
        try:
            rc = self._launchers[name]((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), int(shared_mem),
                                       params_address, ORDERS[order], int(seed) & (2**64 - 1))
        finally:
            for b in bufs:
                self._poison[1](b.start, b.body)
            if pdl_check:
                self._lib.emu_pdl_check(-1, None, None)
                for b in watched:                          # the launch may have left them read-only
                    protect(b.start, b.body, False)
        if "traffic" in self.checks:
            from ds4py.cuda import traffic_record as traffic
            counters = (ctypes.c_uint64 * (len(profiled) * self._lib.emu_traffic_counters() + 6))()
            self._lib.emu_traffic_read(counters)
            self._lib.emu_traffic_begin(-1, None, None)
            if rc == 0:
                traffic.record(traffic.launch_record(name, grid, block, shared_mem, profiled, list(counters)))
        if rc != 0:
            msg = self._lib.emu_message().decode(errors="replace")
            if rc == 2:
                msg = staging.describe_fault(msg, self._lib.emu_fault_address() or 0)
            if "static __shared__ byte" in msg:
                msg = self._name_static_shared(msg)
            raise EmuKernelError(f"{name}: {msg}")

    def launch(self, name: str, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any],
               shared_mem: int = 0, order: str = "forward", seed: int = 0) -> None:
        """Run kernel `name` over `grid` x `block`. Pointer parameters take C-contiguous numpy arrays (or None for
        a null pointer); arrays passed to non-const pointers are updated in place. `order` picks the thread and
        block order ("forward", "reverse" or seeded "random") to shake out order-dependent results."""
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        params = self.check(name, b, order)
        if len(args) != len(params):
            pack_args(name, params, args)                  # raises the count error with the signature
        staging = Staging(name)
        staged: list[tuple[int, int, Staged]] = []
        values = []
        for p, v in zip(params, args):
            if p.is_pointer and isinstance(v, np.ndarray):
                if not v.flags.c_contiguous:
                    raise KernelArgumentError(f"{name}: argument {p.name!r} must be a C-contiguous array")
                s = staging.add(p, v.ctypes.data, v.nbytes, v.dtype, not v.flags.writeable)
                staged.append((v.ctypes.data, v.nbytes, s))
                v = s
            values.append(v)
        with launch_lock:
            try:
                staging.place(staged)
                packed = pack_args(name, params, values)
                self.run(name, g, b, shared_mem, packed.address or None, order, seed, staging)
                staging.finish()
            finally:
                staging.release()


launch_lock = threading.Lock()      # the emulator's state is global per library, signal handlers per process


def load(source: str | Path, extra_flags: Sequence[str] = (),
         progress: Callable[[str], None] | None = None) -> EmuModule:
    """EmuModule for `source` (and flags, e.g. -D defines), shared within the process (rebuilt when the source or
    headers change)."""
    source = Path(source).resolve()
    key = (str(source), tuple(extra_flags), checks())
    mod = _loaded.get(key)
    if mod is None or build(source, extra_flags)[0] != mod.path:
        mod = _loaded[key] = EmuModule(source, extra_flags, progress)
    return mod
