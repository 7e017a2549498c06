"""NVRTC compiles every cu/*.cu for sm_121 (DGX Spark) and sm_90 (Hopper) without a GPU; the ptxas report shows
no spills; the disk cache hits, and misses when a byte of a source or header changes; errors carry file:line."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ds4py.cuda import compiler
from ds4py.cuda.signature import parse_kernels, strip_comments

REPO = Path(__file__).resolve().parents[1]
CU = REPO / "cu"
ARCHS = ("sm_121", "sm_90")


def _nvrtc_or_skip() -> None:
    try:
        compiler.nvrtc_version()
    except compiler.NvrtcUnavailableError as e:
        pytest.skip(f"NVRTC cannot load: {e}")


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ds4py-cache")


@pytest.fixture(scope="session")
def compiled(cache) -> dict[str, dict[str, compiler.CompiledModule]]:
    """Every kernel file for every arch, compiled once per session into a fresh cache."""
    _nvrtc_or_skip()
    return {arch: compiler.compile_all(arch, CU, cache=cache, progress=lambda m: None) for arch in ARCHS}


def test_every_file_compiles_for_both_archs(compiled):
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
                lines.append(f"{arch:7} {r.name:18} {r.registers:3} regs {r.smem:5} B smem {r.stack_frame} B stack")
                assert 0 < r.registers <= 255
                assert r.spill_stores == 0 and r.spill_loads == 0, f"{arch} {r.name} spills: {r}"
                assert r.stack_frame == 0, f"{arch} {r.name} uses a {r.stack_frame}-byte stack frame (local memory)"
    print("\n" + "\n".join(lines))


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
            kernels = parse_kernels(text)
            assert kernels, f"{path.name} defines no kernel"
            assert len(re.findall(r"__global__", code)) == len(kernels), f"{path.name}: a kernel is not extern \"C\""
            for name in kernels:
                before = text[: text.index(f"void {name}(")]
                comment = before[before.rstrip().rfind("\n\n") if "\n\n" in before else 0:]
                assert "Launch:" in comment, f"{path.name}: kernel {name} lacks a 'Launch:' geometry comment"


def test_q8_constants_match_the_kernel():
    from ds4py.cuda import ops

    text = (CU / "gemv.cu").read_text()
    chunk = int(re.search(r"#define Q8_CHUNK_BLOCKS (\d+)", text).group(1))
    assert chunk == ops.Q8_CHUNK_BLOCKS
    assert ops.Q8_STAGE_BYTES == chunk * 34 + 16
    assert "#define Q8_STAGE_BYTES (Q8_CHUNK_BLOCKS * Q8_BLOCK_BYTES + 16)" in text
