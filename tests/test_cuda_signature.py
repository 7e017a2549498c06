"""Kernel signatures parsed from source, and argument packing checked against them before any launch."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ds4py.cuda.args import SLOT_BYTES, KernelArgumentError, pack_args
from ds4py.cuda.launch import check_geometry
from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.signature import KernelSignatureError, Param, parse_kernels

CU = Path(__file__).resolve().parents[1] / "cu"

SRC = r'''
// extern "C" __global__ void commented_out(int x) {}
/* extern "C" __global__ void also_commented(int x) {} */
extern "C" __global__ void plain(const float* __restrict__ x, float *y, int n, unsigned m, float eps) {}
extern "C" __global__ __launch_bounds__(256, 1) void bounded(const __half* w, const uint8_t* q,
                                                             const int* ids, unsigned int k) {}
extern "C" __global__ void noargs() {}
extern "C" __global__ void voidargs(void) {}
__global__ void not_extern_c(int x) {}
__device__ float helper(float a, float b) { return a + b; }
extern "C" __global__ void wide(long long a, uint64_t b, double c, const __nv_bfloat16* bf) {}
'''


def test_parse_kernels():
    k = parse_kernels(SRC)
    assert list(k) == ["plain", "bounded", "noargs", "voidargs", "wide"]
    assert k["plain"] == [
        Param("x", "float", True, True), Param("y", "float", True, False),
        Param("n", "int", False, False), Param("m", "unsigned int", False, False), Param("eps", "float", False, False),
    ]
    assert k["bounded"] == [
        Param("w", "__half", True, True), Param("q", "uint8_t", True, True),
        Param("ids", "int", True, True), Param("k", "unsigned int", False, False),
    ]
    assert k["noargs"] == [] and k["voidargs"] == []
    assert [p.ctype for p in k["wide"]] == ["long long", "uint64_t", "double", "__nv_bfloat16"]


@pytest.mark.parametrize("bad", [
    'extern "C" __global__ void k(float** p) {}',
    'extern "C" __global__ void k(float& p) {}',
    'extern "C" __global__ void k(float p[4]) {}',
    'extern "C" __global__ void k(MyStruct s) {}',
    'extern "C" __global__ void k(int a, int a) {}',
    'extern "C" __global__ void k(int) {}',
])
def test_parse_rejects_what_cannot_be_packed(bad):
    with pytest.raises(KernelSignatureError):
        parse_kernels(bad)


def test_every_repo_kernel_parses():
    names = {}
    for f in CU.glob("*.cu"):
        for name, params in parse_kernels(f.read_text()).items():
            assert name not in names, f"{name} defined in {names.get(name)} and {f.name}"
            names[name] = f.name
            assert params, name
    assert {"rmsnorm_f32", "gemv_f16", "gemv_q8_0", "embed_f16", "argmax_f32", "hc_mix_f16", "sample_f32"} <= set(names)


PLAIN = parse_kernels(SRC)["plain"]


def dev(ptr: int, dtype, n: int = 4, readonly: bool = False) -> DeviceArray:
    return DeviceArray(ptr, (n,), np.dtype(dtype), readonly)


def test_pack_layout():
    p = pack_args("plain", PLAIN, [dev(0x1000, np.float32), 0x2000, 7, 3, 0.5])
    assert p.data.nbytes == 5 * SLOT_BYTES and p.pointers.dtype == np.uint64
    base = p.data.ctypes.data
    assert [int(a) - base for a in p.pointers] == [0, 16, 32, 48, 64]
    assert p.address == p.pointers.ctypes.data
    raw = p.data.tobytes()
    assert struct.unpack_from("<Q", raw, 0)[0] == 0x1000
    assert struct.unpack_from("<Q", raw, 16)[0] == 0x2000
    assert struct.unpack_from("<i", raw, 32)[0] == 7
    assert struct.unpack_from("<I", raw, 48)[0] == 3
    assert struct.unpack_from("<f", raw, 64)[0] == 0.5


def test_pack_null_pointer_and_no_args():
    p = pack_args("plain", PLAIN, [None, dev(64, np.float32), -1, 0, 1])
    assert struct.unpack_from("<Q", p.data.tobytes(), 0)[0] == 0
    assert pack_args("noargs", [], []).address == 0


@pytest.mark.parametrize("args, fragment", [
    ([dev(0, np.float32), dev(0, np.float32), 1, 2], "takes 5 arguments, got 4"),
    ([dev(0, np.float32), dev(0, np.float32), 1, 2, 3.0, 4], "takes 5 arguments, got 6"),
    ([np.zeros(4, np.float32), dev(0, np.float32), 1, 2, 3.0], "host numpy array"),
    ([dev(0, np.float16), dev(0, np.float32), 1, 2, 3.0], "declared float* but the buffer holds float16"),
    ([dev(0, np.float32), dev(0, np.float32, readonly=True), 1, 2, 3.0], "read-only"),
    ([dev(0, np.float32), dev(0, np.float32), 1.5, 2, 3.0], "is a int"),
    ([dev(0, np.float32), dev(0, np.float32), True, 2, 3.0], "is a int"),
    ([dev(0, np.float32), dev(0, np.float32), 2**31, 2, 3.0], "does not fit"),
    ([dev(0, np.float32), dev(0, np.float32), 1, -1, 3.0], "does not fit in unsigned int"),
    ([dev(0, np.float32), dev(0, np.float32), 1, 2, "x"], "is a float"),
    ([dev(0, np.float32), 1.0, 1, 2, 3.0], "must be a device pointer"),
    ([dev(0, np.float32), -5, 1, 2, 3.0], "not a valid device address"),
])
def test_pack_rejects(args, fragment):
    with pytest.raises(KernelArgumentError) as e:
        pack_args("plain", PLAIN, args)
    assert fragment in str(e.value) and "plain" in str(e.value)


def test_pack_accepts_numpy_scalars():
    p = pack_args("plain", PLAIN, [0, 0, np.int32(5), np.uint64(9), np.float32(1.25)])
    raw = p.data.tobytes()
    assert struct.unpack_from("<i", raw, 32)[0] == 5 and struct.unpack_from("<f", raw, 64)[0] == 1.25


def test_geometry_checks():
    g, b = check_geometry("k", 10, (32, 4), 0, 1024, 48 * 1024)
    assert g == (10, 1, 1) and b == (32, 4, 1)
    check_geometry("k", 1, 32, 40 * 1024, 1024, 48 * 1024, static_smem=8 * 1024)       # exactly the limit
    with pytest.raises(KernelArgumentError, match=r"\+ 8193 static"):
        check_geometry("k", 1, 32, 40 * 1024, 1024, 48 * 1024, static_smem=8193)
    with pytest.raises(KernelArgumentError, match="device limits"):
        check_geometry("k", 1, (1, 1, 65), 0, 1024, 48 * 1024)
    for grid, block, smem, frag in [(0, 32, 0, "positive"), (1, 2048, 0, "exceeds this kernel's limit"),
                                    (1, 32, 1 << 20, "shared memory"), ((1, 70000), 32, 0, "device limits"),
                                    (1, (1, 2, 3, 4), 0, "1 to 3")]:
        with pytest.raises(KernelArgumentError, match=frag):
            check_geometry("k", grid, block, smem, 1024, 48 * 1024)


def test_entry_points_come_from_one_format_list():
    """MOE_FORMATS (cu/moe_formats.cuh) is the one list of expert formats: every entry point of experts.cu and
    moe_prefill.cu is generated from it, and the host's FORMATS is it, so a new format is one entry (plus its
    decoder)."""
    from ds4py.cuda.ops.experts import FORMATS
    from ds4py.cuda.signature import CU_DIR, expand_lists, list_of

    entries = list_of("MOE_FORMATS", (CU_DIR / "moe_formats.cuh").read_text())
    assert [FORMATS[q][0] for q in FORMATS] == [e[0] for e in entries]
    kernels = {**parse_kernels((CU_DIR / "experts.cu").read_text()),
               **parse_kernels((CU_DIR / "moe_prefill.cu").read_text())}
    for name, *_ in entries:
        for kind in ("moe_gate_up", "moe_down", "moe_dequant", "moe_gate_up_rows", "moe_down_rows",
                     "moe_prefill_gate_up", "moe_prefill_down"):
            assert f"{kind}_{name}" in kernels
    assert kernels["moe_gate_up_q8_0"] == kernels["moe_gate_up_f16"]

    src = ('#define FMTS(X) \\\n    X(aa, 1, 7) \\\n    X(bb, 2, 9)\n\n// Launch: one block\n'
           '#define ENTRY(name, F, N) \\\nextern "C" __global__ void k_##name(const float* x, int n) { \\\n'
           '    body<F>(x, n, N); \\\n}\n\nFMTS(ENTRY)\n')
    out = expand_lists(src)
    assert set(parse_kernels(src)) == {"k_aa", "k_bb"} and "body<2>(x, n, 9);" in out
    assert out.count('// Launch: one block\nextern "C"') == 2 and out.count("__global__") == 2
    mid = src.replace("k_##name(", "k_##name##_rows(")            # a paste on both sides (gemv_##name##_rows)
    assert set(parse_kernels(mid)) == {"k_aa_rows", "k_bb_rows"} and "##" not in expand_lists(mid)


def test_shared_kernel_templates_expand_as_the_preprocessor_would():
    """A template used on a line of its own (HC_MIX(hc_mix_f16, __half)) and a per-list template whose body is
    such a use (MOE_GATE_UP_I8 -> MOE_GATE_UP_KERNEL) become kernels, each behind its contract; the template's
    own #define lines never do, and a line that expands to no kernel stays as written."""
    from ds4py.cuda.signature import expand_lists

    src = ('#define FMTS(X) \\\n    X(aa, 1) \\\n    X(bb, 2)\n\n'
           '// shared body\n#define KERNEL(kname, F, ACT) \\\n'
           'extern "C" __global__ void kname(const float* x, int n) { \\\n    body<F, ACT>(x, n); \\\n}\n\n'
           '// Launch: per format\n#define ENTRY_I8(name, F) \\\n    KERNEL(k_i8_##name, F, ActI8)\n\n'
           'FMTS(ENTRY_I8)\n\n// Launch: a direct use\nKERNEL(k_plain, 3, ActF)\nhelper(a, b)\n')
    out = expand_lists(src)
    assert list(parse_kernels(src)) == ["k_i8_aa", "k_i8_bb", "k_plain"]
    assert "body<2, ActI8>(x, n);" in out and "body<3, ActF>(x, n);" in out and "#define" not in out.split("FMTS")[-1]
    assert out.count('// Launch: per format\nextern "C"') == 2 and out.count("__global__") == 3
    assert "helper(a, b)" in out and "k_i8_name" not in out
