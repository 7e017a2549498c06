"""NVRTC compiles every cu/*.cu for sm_121 (DGX Spark) and sm_90 (Hopper; sm_90a for a source marked arch-specific)
without a GPU; the ptxas report shows no spills; the disk cache hits, misses when a byte of a source, a header or a
-D define changes, and works without NVRTC; errors carry file:line; geometry constants come from one table; every
kernel waits (pdl_wait)."""

from __future__ import annotations

import json

import re
import shutil
from pathlib import Path

import pytest

from nvrtc_build import NVRTC_ARCHS

from ds4py.cuda import compiler
from ds4py.cuda.signature import expand_lists, parse_kernels, strip_comments

REPO = Path(__file__).resolve().parents[1]
CU = REPO / "cu"
ARCHS = NVRTC_ARCHS          # ("sm_121", "sm_90"): what the nvrtc_kernels fixture compiles

# under pytest-xdist on the worker that also runs tests/test_cuda_driverless.py: the NVRTC build of every kernel
# (conftest's nvrtc_kernels, minutes) is made once and shared (conftest's standin_cache)
pytestmark = pytest.mark.xdist_group("nvrtc")


def _nvrtc_or_skip() -> None:
    try:
        compiler.nvrtc_version()
    except compiler.NvrtcUnavailableError as e:
        pytest.skip(f"NVRTC cannot load: {e}")


@pytest.fixture(scope="session")
def nvrtc_job(nvrtc_kernels) -> dict:
    """Every kernel file for every arch (ARCHS), compiled once per run into a fresh cache by compile_all (the
    session fixture nvrtc_kernels of tests/conftest.py, in a child process; it skips without NVRTC)."""
    return nvrtc_kernels


@pytest.fixture(scope="session")
def cache(nvrtc_job) -> Path:
    return nvrtc_job["cache"]


@pytest.fixture(scope="session")
def compiled(nvrtc_job) -> dict[str, dict[str, compiler.CompiledModule]]:
    assert set(nvrtc_job["compiled"]) == set(ARCHS)
    return nvrtc_job["compiled"]


def test_every_file_compiles_for_every_arch(compiled):
    stems = {p.stem for p in CU.glob("*.cu")}
    assert stems, "no kernels in cu/"
    for arch, mods in compiled.items():
        assert set(mods) == stems
        for m in mods.values():
            assert not m.cached and len(m.cubin) > 1000, (arch, m.source)
            assert m.cubin[:4] == b"\x7fELF", "NVRTC should emit a CUBIN (ELF), not PTX"


def test_ptxas_report_every_kernel_no_spills(compiled):
    lines = []
    for arch, mods in compiled.items():
        for m in mods.values():
            res = m.resources
            assert set(res) == set(m.kernels), f"{m.source.name}: ptxas report {sorted(res)} vs source {sorted(m.kernels)}"
            for r in res.values():
                lines.append(f"{arch:7} {r.name:20} {r.registers:3} regs {r.smem:5} B smem {r.stack_frame} B stack")
                assert 0 < r.registers <= 255
                assert r.spill_stores == 0 and r.spill_loads == 0, f"{arch} {r.name} spills: {r}"
                assert r.stack_frame == 0, f"{arch} {r.name} uses a {r.stack_frame}-byte stack frame (local memory)"
    print("\n" + "\n".join(lines))


# Kernels whose register count NVRTC gives one more or less from build to build, even one file at a time in a
# child process (tests/nvrtc_build.py): moe_gate_up_i8_iq2_xxs on sm_90 differed from the committed 60 in a
# fresh-clone CI run of 2026-12-07 while a fresh single-job build on the same machine gave 60 again; indexer_scores
# 55 / 56 earlier. Only these rows, only by one register, and only with every other field equal, are let through.
REGISTER_JITTER = {("sm_90", "moe_gate_up_i8_iq2_xxs"), ("sm_90", "indexer_scores")}


def test_committed_resource_table_is_this_build(compiled):
    """ds4py/data/kernel_resources.json (the registers the emulator and the plan-only runtime check launches with)
    and docs/cuda.md's table are this build's ptxas report."""
    from ds4py.cuda import resources

    built, have = resources.from_modules(compiled), resources.committed()
    for arch, name in REGISTER_JITTER:          # within one register of the committed row: the committed row stands
        b, h = built.get(arch, {}).get(name), have.get(arch, {}).get(name)
        if b and h and abs(b["registers"] - h["registers"]) <= 1 and {**b, "registers": 0} == {**h, "registers": 0}:
            built[arch][name] = h
    stale = sorted({f"{a} {k}" for a in set(built) | set(have) for k in set(built.get(a, {})) | set(have.get(a, {}))
                    if built.get(a, {}).get(k) != have.get(a, {}).get(k)})
    assert not stale, (f"the committed resource table differs from the build for {len(stale)} kernels "
                       f"({', '.join(stale[:8])}...): run python3 -m ds4py.cuda.resources --write")
    doc = resources.DOC.read_text()
    assert resources.docs_with_table(doc, built) == doc, "docs/cuda.md's resource table is stale: run " \
        "python3 -m ds4py.cuda.resources --write"


def test_vq_kernels_fit_gb10_shared_memory(compiled):
    """The ptxas report's static shared memory of the VQ-8 expert kernels at every width: cu/experts.cu's within
    ops/experts.STATIC_RESERVE (what the hosts' plans add to codebook + stage, tests/test_cu_emu_vq.py checks those
    at the real shapes), cu/moe_prefill.cu's static tiles + the codebook (their whole dynamic shared memory) within
    GB10's 101,376 B per block."""
    from ds4py.cuda.ops import experts as ops_moe

    assert len(ops_moe.VQ_FORMATS) == 8
    for arch, mods in compiled.items():
        for fmt in ops_moe.VQ_FORMATS:
            for kind in ("gate_up", "down", "gate_up_rows", "down_rows"):
                r = mods["experts"].resources[f"moe_{kind}_{fmt}"]
                assert r.smem <= ops_moe.STATIC_RESERVE, f"{arch} moe_{kind}_{fmt}: {r.smem} B static"
            for kind in ("gate_up", "down"):
                r = mods["moe_prefill"].resources[f"moe_prefill_{kind}_{fmt}"]
                total = r.smem + ops_moe.codebook_bytes(fmt)
                assert total <= ops_moe.SMEM_LIMIT, f"{arch} moe_prefill_{kind}_{fmt}: {total:,} B"


def test_warm_start_reads_the_cache(compiled, cache):
    src = CU / "rmsnorm.cu"
    again = compiler.compile_file(src, "sm_90", cache=cache)
    assert again.cached and again.cubin == compiled["sm_90"]["rmsnorm"].cubin
    assert again.resources == compiled["sm_90"]["rmsnorm"].resources   # the ptxas report is cached too


def test_cache_key_covers_sources_headers_options_and_arch(tmp_path):
    _nvrtc_or_skip()
    work = tmp_path / "cu"
    shutil.copytree(CU, work, ignore=shutil.ignore_patterns("emu"))
    src = work / "rmsnorm.cu"
    v = compiler.nvrtc_version()
    opts = compiler.BASE_OPTIONS
    k0 = compiler.cache_key(src, "sm_90", opts, v)
    assert compiler.cache_key(src, "sm_90", opts, v) == k0
    assert compiler.cache_key(src, "sm_121", opts, v) != k0
    assert compiler.cache_key(src, "sm_90", opts + ("-DX=1",), v) != k0
    assert compiler.cache_key(src, "sm_90", opts, (v[0], v[1] + 1)) != k0
    (work / "reduce.cuh").write_bytes((work / "reduce.cuh").read_bytes() + b"\n")    # one header byte
    k1 = compiler.cache_key(src, "sm_90", opts, v)
    assert k1 != k0
    src.write_bytes(src.read_bytes() + b" ")                                        # one source byte
    assert compiler.cache_key(src, "sm_90", opts, v) != k1
    # and the cache really misses after a change, then hits
    cache = tmp_path / "cache"
    a = compiler.compile_file(src, "sm_90", cache=cache)
    b = compiler.compile_file(src, "sm_90", cache=cache)
    src.write_bytes(src.read_bytes() + b"\n")
    c = compiler.compile_file(src, "sm_90", cache=cache)
    assert (a.cached, b.cached, c.cached) == (False, True, False)


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4PY_CACHE_DIR", str(tmp_path / "x"))
    assert compiler.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("DS4PY_CACHE_DIR")
    assert compiler.cache_dir() == Path.home() / ".cache" / "ds4py"


def test_cold_compile_reports_progress_and_total(tmp_path):
    _nvrtc_or_skip()
    work = tmp_path / "cu"
    work.mkdir()
    for f in ("embed.cu", "portable.cuh", "types.cuh", "reduce.cuh"):
        shutil.copy(CU / f, work / f)
    msgs: list[str] = []
    compiler.compile_all("sm_90", work, cache=tmp_path / "c", progress=msgs.append)
    assert any("embed.cu" in m and " s" in m for m in msgs) and "1 of 1 kernel files" in msgs[-1]
    msgs.clear()
    compiler.compile_all("sm_90", work, cache=tmp_path / "c", progress=msgs.append)
    assert msgs == []          # warm start: nothing compiled, nothing to report


def test_compile_error_names_file_and_line(tmp_path):
    _nvrtc_or_skip()
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* y) {\n    y[0] = 1.0f;\n    y[1] = undefined_name;\n}\n')
    with pytest.raises(compiler.KernelCompileError) as e:
        compiler.compile_file(bad, "sm_90", cache=False)
    msg = str(e.value)
    assert "bad.cu(3)" in msg and "undefined_name" in msg and "sm_90" in msg


def test_parse_ptxas_report():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperPf
ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'gemv' for 'sm_90'
ptxas info    : Function properties for gemv
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 256 bytes smem, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'plain' for 'sm_90'
ptxas info    : Function properties for plain
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers, 364 bytes cmem[0]
"""
    r = compiler.parse_ptxas_report(log)
    assert set(r) == {"gemv", "plain"}            # the non-entry helper is not a kernel
    assert r["gemv"] == compiler.KernelResources("gemv", 40, 4, 12, 8, 256, 1)
    assert r["plain"] == compiler.KernelResources("plain", 10, 0, 0, 0, 0, 0)


def test_source_arch():
    assert compiler.source_arch("sm_90", "") == "sm_90"
    assert compiler.source_arch("sm_121", "// a comment\n") == "sm_121"
    assert compiler.source_arch("sm_90", "// ds4py: arch-specific (wgmma)\n") == "sm_90a"
    assert compiler.source_arch("sm_90a", "// ds4py: arch-specific\n") == "sm_90a"


def test_supported_archs_include_targets():
    _nvrtc_or_skip()
    assert {90, 120, 121} <= set(compiler.supported_archs())


def _my_sources() -> list[Path]:
    return sorted(p for p in list(CU.glob("*.cu")) + list(CU.glob("*.cuh")) if p.name != "portable.cuh")


def test_kernel_conventions():
    """extern "C" kernels with a launch-geometry comment; PTX only through portable.cuh; no toolkit headers."""
    allowed = {"cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h", "stdint.h"}
    for path in _my_sources():
        text = path.read_text()
        code = strip_comments(text)
        assert "asm" not in re.findall(r"\b\w+\b", code), f"{path.name}: inline PTX belongs in portable.cuh"
        for inc in re.findall(r"#include\s*<([^>]+)>", code):
            assert inc in allowed, f"{path.name} includes <{inc}>"
        if path.suffix == ".cu":
            assert '#include "portable.cuh"' in text
            text = expand_lists(text)                   # entry points generated from a list: one per entry
            code = strip_comments(text)
            kernels = parse_kernels(text)
            assert kernels, f"{path.name} defines no kernel"
            assert len(re.findall(r"__global__", code)) == len(kernels), f"{path.name}: a kernel is not extern \"C\""
            for name in kernels:
                before = text[: text.index(f"void {name}(")]
                comment = before[before.rstrip().rfind("\n\n") if "\n\n" in before else 0:]
                assert "Launch:" in comment, f"{path.name}: kernel {name} lacks a 'Launch:' geometry comment"


def test_geometry_defines_come_from_the_ops_tables():
    """Each kernel file's constants are -D values from its wrapper's DEFINES table (the .cu refuses to compile
    without them), and what the wrapper derives from them is what the kernel derives."""
    from ds4py.cuda.ops.gemv import DEFINES, Q8_PIECE_BYTES, Q8_WARP_SMEM

    for src in sorted(CU.glob("*.cu")):
        table = compiler.geometry_defines(src.stem)
        text = src.read_text()
        for name in table:
            assert re.search(rf"#ifndef {name}\n#error", text), f"{src.name}: {name} has no #error guard"
        opts = compiler.file_options(src)
        assert all(f"-D{k}={v}" in opts for k, v in table.items())
    text = (CU / "gemv.cu").read_text()
    env = dict(DEFINES)
    for name in ("Q8_BLOCK_BYTES", "Q8_PIECE_BYTES", "Q8_WARP_SMEM"):       # evaluate the kernel's #defines
        expr = re.search(rf"#define {name} (.+?)(?:\s*//.*)?$", text, re.M).group(1)
        env[name] = eval(expr, {}, env)                                     # noqa: S307 (our own source)
    assert env["Q8_WARP_SMEM"] == Q8_WARP_SMEM and env["Q8_PIECE_BYTES"] == Q8_PIECE_BYTES


def test_model_defines_are_in_the_key_only_where_used(tmp_path):
    mhc, embed = CU / "mhc.cu", CU / "embed.cu"
    assert "-DDS4_HC=4" in compiler.file_options(mhc)
    assert compiler.file_options(mhc, {"DS4_HC": 2}) != compiler.file_options(mhc)
    assert compiler.file_options(embed, {"DS4_HC": 2}) == compiler.file_options(embed)   # embed does not use it
    v = (13, 0)
    assert compiler.cache_key(mhc, "sm_90", compiler.file_options(mhc, {"DS4_HC": 2}), v) != \
        compiler.cache_key(mhc, "sm_90", compiler.file_options(mhc), v)
    with pytest.raises(Exception, match="unknown model defines"):
        compiler.file_options(mhc, {"DS4_NOPE": 1})
    with pytest.raises(Exception, match="upper-case"):
        compiler.define_options({"x": 1})


def test_the_cubin_cache_works_without_nvrtc(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    src = CU / "embed.cu"
    opts = compiler.file_options(src)
    built = compiler.compile_file(src, "sm_90", opts, cache=tmp_path)

    def missing():
        raise compiler.NvrtcUnavailableError("NVRTC is not available (test)")

    monkeypatch.setattr(compiler, "nvrtc_version", missing)
    hit = compiler.compile_file(src, "sm_90", opts, cache=tmp_path)
    assert hit.cached and hit.cubin == built.cubin
    assert hit.nvrtc == built.nvrtc and hit.nvrtc[0] >= 12            # the version that built it, from the cache
    with pytest.raises(compiler.NvrtcUnavailableError, match="no cached cubin for sm_121"):
        compiler.compile_file(src, "sm_121", opts, cache=tmp_path)


def test_driver_too_old_for_nvrtc_is_one_sentence():
    compiler.check_driver_version(13000, (13, 5))      # same major: CUBIN minor-version compatibility
    compiler.check_driver_version(12080, (12, 4))
    with pytest.raises(compiler.CudaUnavailableError) as e:
        compiler.check_driver_version(12040, (13, 0))
    msg = str(e.value)
    assert "CUDA 12.4" in msg and "NVRTC 13.0" in msg and "\n" not in msg


def _functions(text: str) -> dict[str, str]:
    """name -> body of every function defined in a (comment-free) source."""
    text = re.sub(r"__launch_bounds__\s*\([^)]*\)", " ", text)     # not a function: `(...) void name(...) {`
    out = {}
    for m in re.finditer(r"([A-Za-z_]\w*)\s*\([^;{}]*\)\s*(?:const\s*)?\{", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if m.group(1) not in ("if", "for", "while", "switch", "return", "sizeof"):
            out.setdefault(m.group(1), text[m.end(): i - 1])
    return out


def test_every_kernel_waits_for_its_predecessor():
    """Static half of the PDL rule: every kernel reaches pdl_wait() (directly or through its helpers). The
    emulator's pdl check (EmuRuntime(check_pdl=True), on in every kernel test) catches stores and returns
    before it at run time."""
    headers = "\n".join(strip_comments(h.read_text()) for h in sorted(CU.glob("*.cuh")))
    for src in sorted(CU.glob("*.cu")):
        text = strip_comments(expand_lists(src.read_text()))
        funcs = _functions(headers + "\n" + text)
        macros = dict(re.findall(r"#define (\w+)(?:\([^)]*\))?((?:.*\\\n)*.*)", text))

        def waits(body: str, seen: set) -> bool:
            if "pdl_wait()" in body:
                return True
            for name in re.findall(r"\b([A-Za-z_]\w*)\b", body):
                if name in seen:
                    continue
                seen.add(name)
                inner = funcs.get(name) or macros.get(name)
                if inner is not None and waits(inner, seen):
                    return True
            return False

        for name in parse_kernels(src.read_text()):
            assert waits(funcs[name], {name}), f"{src.name}: kernel {name} never calls pdl_wait()"


def test_sass_loop_table_equals_the_build(compiled):
    """The GPU time model's committed SASS inner-loop table (ds4py/data/gpu_sass_loops.json, instructions per
    weight by class) is what nvdisasm finds in this build's cubins: a kernel change without
    `python3 -m ds4py.cuda.sass --write` fails here."""
    from ds4py.cuda import sass

    try:
        sass.nvdisasm()
    except sass.SassUnavailableError as e:
        pytest.skip(str(e))
    built = sass.table_from(compiled)
    # the rows as committed: table_from leaves out a zero prologue, which LoopCount (load_table) fills in
    committed = json.loads(sass.TABLE.read_text())["archs"] if sass.TABLE.is_file() else {}
    assert set(built) == set(ARCHS)
    for arch in ARCHS:
        want = committed.get(arch) or {}
        assert set(built[arch]) == set(want), (
            f"{arch}: the committed SASS table lists other kernels than the build: run python3 -m ds4py.cuda.sass --write")
        off = {k: (built[arch][k], want[k]) for k in want if not _same_loop(built[arch][k], want[k])}
        assert not off, f"{arch}: the committed SASS table differs from the build: run python3 -m ds4py.cuda.sass --write: {off}"
        assert any(k.startswith("gemv_") for k in built[arch]) and any(k.startswith("moe_down_") for k in built[arch])


def _same_loop(got: dict, want: dict) -> bool:
    """Equal, but for one instruction per class: NVRTC's SASS for one kernel (sm_90 moe_gate_up_i8_iq2_xxs) moves an
    instruction between classes from build to build (control 164 / memory 286 vs 165 / 285, sequential builds in
    fresh caches), which no edit of the kernel explains; any real change of a loop moves more than that."""
    if set(got) != set(want):
        return False
    for f, v in want.items():
        g = got[f]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if abs(g - v) > 1:
                return False
        elif g != v:
            return False
    return True
