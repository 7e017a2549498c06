"""The aarch64 NEON path of the decode kernels (ds4py.quant.jit_neon), checked on any host.

1. Each decode intrinsic of ds4py.quant.jit_decode (the very codegen numba inlines into the kernels) is built with
   the NEON path on, optimised and compiled by llvmlite for aarch64-unknown-linux-gnu with +neon,+dotprod, and its
   assembly holds the sdot instructions the path emits (in the loop, for the looped ones); built with the portable
   path it holds none (LLVM does not form sdot from it: why the path exists), so a kernel turned scalar or
   portable fails here.
2. The NEON builders' integer results equal the portable path's, run on this host: the same IR with sdot
   replaced by a function that does what Arm's manual says sdot does, JIT-compiled for the host and called on
   random bytes (Q8_0: the 8 partial sums lane by lane, as q8_0_row converts them to float; IQ2_XXS / Q2_K: the
   block sums).
The run on an aarch64 CPU (qemu-aarch64, the kernels' property tests against the dequant oracle) is a bench note:
bench/README.md.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from ds4py.quant import jit

pytestmark = pytest.mark.skipif(not jit.available(), reason=f"numba unavailable: {jit.unavailable_reason()}")

TRIPLE = "aarch64-unknown-linux-gnu"


def _aarch64_machine():
    from llvmlite import binding as llvm

    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    try:
        target = llvm.Target.from_triple(TRIPLE)
    except RuntimeError as e:
        pytest.skip(f"llvmlite is built without the AArch64 target: {e}")
    return target.create_target_machine(cpu="generic", features="+neon,+dotprod", opt=3)


@pytest.fixture
def paths(monkeypatch):
    """set(neon): jit_decode's codegen takes the NEON path (True) or the portable one (False), x86's off."""
    from ds4py.quant import jit_decode

    def set_path(neon: bool):
        monkeypatch.setattr(jit_decode, "AVX2", False)
        monkeypatch.setattr(jit_decode, "AVX512", False)
        monkeypatch.setattr(jit_decode, "NEON", neon)
    return set_path


def _intrinsic_ir(intr, argtys) -> str:
    """A module with one function `k` whose body is the numba intrinsic's codegen on its arguments."""
    from llvmlite import ir
    from numba import types
    from numba.core.registry import cpu_target

    ctx = cpu_target.target_context
    sig, codegen = intr._defn(ctx.typing_context, *argtys)
    mod = ir.Module(name="neon_check")
    void = sig.return_type == types.none
    fnty = ir.FunctionType(ir.VoidType() if void else ctx.get_value_type(sig.return_type),
                           [ctx.get_value_type(t) for t in sig.args])
    fn = ir.Function(mod, fnty, name="k")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    out = codegen(ctx, builder, sig, list(fn.args))
    builder.ret_void() if void else builder.ret(out)
    return str(mod)


def _compile(text: str, tm) -> str:
    """The module optimised (O3, as numba does) and compiled by `tm` -> its assembly."""
    from llvmlite import binding as llvm

    m = llvm.parse_assembly(text)
    m.triple = tm.triple
    m.data_layout = str(tm.target_data)
    m.verify()
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(m, pb)
    return tm.emit_assembly(m)


def _loops(asm: str) -> list[str]:
    """The bodies of the assembly's loops: from a label to the last branch back to it."""
    lines = asm.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\.LBB\w+):", line)
        if m:
            back = [j for j in range(i + 1, len(lines)) if re.search(rf"\bb(\.\w+)?\s+{re.escape(m.group(1))}$",
                                                                     lines[j].strip())]
            if back:
                out.append("\n".join(lines[i:back[-1] + 1]))
    return out


def _cases():
    from numba import types

    from ds4py.quant import jit_decode as d

    i64 = types.int64
    a = lambda dt, nd: types.Array(dt, nd, "C")                                          # noqa: E731
    u8, i8, f32, u64 = types.uint8, types.int8, types.float32, types.uint64
    tabs = (a(u64, 1), a(u64, 1))
    # (intrinsic, argument types, sdot a call, whether they sit in a loop of the intrinsic)
    return {
        "iq2_block": (d.iq2_block, (a(u8, 3), i64, a(i8, 2), i64, *tabs), 16, False),
        "iq2_block2": (d.iq2_block2, (a(u8, 3), i64, a(i8, 2), i64, *tabs), 32, False),
        "iq2_block_pairs": (d.iq2_block_pairs, (a(u8, 3), i64, f32, i64, a(i8, 2), a(types.int64, 1), i64, i64,
                                                a(f32, 2), a(f32, 1), *tabs), 16, True),
        "q2k_block": (d.q2k_block, (a(u8, 3), i64, a(i8, 2), i64), 16, False),
        "q2k_block2": (d.q2k_block2, (a(u8, 3), i64, a(i8, 2), i64, a(types.int32, 2), i64), 32, False),
        "q8_0_row": (d.q8_0_row, (a(u8, 3), i64, a(i8, 2), i64, a(f32, 2), i64, i64, a(f32, 1)), 2, True),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_each_neon_kernel_compiles_to_sdot_for_aarch64(name, paths):
    tm = _aarch64_machine()
    intr, argtys, want, looped = _cases()[name]
    paths(True)
    asm = _compile(_intrinsic_ir(intr, argtys), tm)
    body = max(_loops(asm), key=len) if looped else asm
    assert body.count("\tsdot\t") == want, f"{name}: {body.count(chr(9) + 'sdot' + chr(9))} sdot, want {want}\n{body}"
    paths(False)                                   # the portable IR: LLVM forms no sdot of its own
    assert "sdot" not in _compile(_intrinsic_ir(intr, argtys), tm), name


def test_enabled_only_on_aarch64_with_dotprod():
    from ds4py.quant import jit_neon

    assert jit_neon.enabled("aarch64", {"dotprod": True, "neon": True})
    assert jit_neon.enabled("arm64", {"dotprod": True})
    assert not jit_neon.enabled("aarch64", {"neon": True, "dotprod": False})
    assert not jit_neon.enabled("aarch64", {})                     # a cross-target build: the portable IR
    assert not jit_neon.enabled("x86_64", {"dotprod": True, "avx2": True})


# ---- 2. the NEON builders' integers against the portable path's, run on this host ---------------------------
_SDOT_EMULATED = """
define internal <4 x i32> @sdot_emulated(<4 x i32> %acc, <16 x i8> %a, <16 x i8> %b) alwaysinline {
  %a32 = sext <16 x i8> %a to <16 x i32>
  %b32 = sext <16 x i8> %b to <16 x i32>
  %p = mul <16 x i32> %a32, %b32
  %p0 = shufflevector <16 x i32> %p, <16 x i32> poison, <4 x i32> <i32 0, i32 4, i32 8, i32 12>
  %p1 = shufflevector <16 x i32> %p, <16 x i32> poison, <4 x i32> <i32 1, i32 5, i32 9, i32 13>
  %p2 = shufflevector <16 x i32> %p, <16 x i32> poison, <4 x i32> <i32 2, i32 6, i32 10, i32 14>
  %p3 = shufflevector <16 x i32> %p, <16 x i32> poison, <4 x i32> <i32 3, i32 7, i32 11, i32 15>
  %s01 = add <4 x i32> %p0, %p1
  %s23 = add <4 x i32> %p2, %p3
  %s = add <4 x i32> %s01, %s23
  %r = add <4 x i32> %acc, %s
  ret <4 x i32> %r
}
"""


def _host_functions(build):
    """build(module) adds functions to a fresh module; it is compiled for this host (sdot calls -> sdot_emulated)
    -> the execution engine (keep it alive) and a lookup of function addresses."""
    from llvmlite import binding as llvm
    from llvmlite import ir

    from ds4py.quant import jit_neon

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = ir.Module(name="neon_host")
    build(mod)
    text = str(mod).replace(f"declare <4 x i32> @\"{jit_neon.SDOT}\"", "; sdot: defined below")
    text = text.replace(f"declare <4 x i32> @{jit_neon.SDOT}", "; sdot: defined below")
    text = re.sub(r"^declare .*@\"?llvm\.aarch64\.neon\.sdot[^\n]*$", "", text, flags=re.M)
    text = text.replace(f"@\"{jit_neon.SDOT}\"", "@sdot_emulated").replace(f"@{jit_neon.SDOT}", "@sdot_emulated")
    m = llvm.parse_assembly(text + _SDOT_EMULATED)
    m.verify()
    tm = llvm.Target.from_default_triple().create_target_machine()
    ee = llvm.create_mcjit_compiler(m, tm)
    ee.finalize_object()
    return ee, ee.get_function_address


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def test_neon_integer_results_equal_the_portable_paths(paths):
    from llvmlite import ir

    from ds4py.quant import iq2, jit_decode as d

    I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    p8, p32, p64 = I8.as_pointer(), I32.as_pointer(), I64.as_pointer()
    b32 = ir.VectorType(I8, 32)

    def fn(mod, name, args):
        f = ir.Function(mod, ir.FunctionType(ir.VoidType(), args), name=name)
        return f, ir.IRBuilder(f.append_basic_block("entry"))

    def build(mod):
        for neon in (True, False):
            paths(neon)
            tag = "neon" if neon else "portable"
            # Q8_0: out[0:8] = _dot_s8s8(w, x) (the lanes q8_0_row converts)
            f, b = fn(mod, f"q8_{tag}", [p8, p8, p32])
            v = d._dot_s8s8(b, d._vload(b, f.args[0], ir.Constant(I64, 0), b32),
                            d._vload(b, f.args[1], ir.Constant(I64, 0), b32))
            b.store(v, b.bitcast(f.args[2], v.type.as_pointer()), align=4)
            b.ret_void()
            # Q2_K: out[0] = the block sum of the 84-byte block at p against 256 bytes of x
            f, b = fn(mod, f"q2k_{tag}", [p8, p8, p32])
            b.store(d._hsum(b, d._q2k_sum_vec(b, f.args[0], f.args[1], ir.Constant(I64, 0))), f.args[2])
            b.ret_void()
            # IQ2_XXS: out[0] = the block sum of 8 groups (8 bytes each at p) against 256 bytes of x
            f, b = fn(mod, f"iq2_{tag}", [p8, p8, p64, p64, p32])
            acc = None
            for g in range(8):
                gv, m, ls = d._iq2_gather(b, b.gep(f.args[0], [ir.Constant(I64, 8 * g)]), f.args[2], f.args[3])
                v = d._iq2_signed_dot(b, gv, m, d._vload(b, f.args[1], ir.Constant(I64, 32 * g), b32), ls)
                acc = v if acc is None else b.add(acc, v)
            b.store(d._hsum(b, acc), f.args[4])
            b.ret_void()

    ee, addr = _host_functions(build)
    vp = ctypes.c_void_p
    call3 = ctypes.CFUNCTYPE(None, vp, vp, vp)
    call5 = ctypes.CFUNCTYPE(None, vp, vp, vp, vp, vp)
    grid8 = np.ascontiguousarray(iq2.GRID.astype(np.uint8)).view(np.uint64).ravel()
    sign8 = np.where(iq2.SIGNS < 0, np.uint8(0xFF), np.uint8(1)).astype(np.uint8).view(np.uint64).ravel()
    rng = np.random.default_rng(35)
    for trial in range(50):
        x = rng.integers(-127, 128, 256, dtype=np.int8)
        if trial == 0:
            x[:] = -127                                          # the extremes
        w = rng.integers(-128, 128, 32, dtype=np.int8)
        if trial == 1:
            w[:] = -128
        outs = {}
        for tag in ("neon", "portable"):
            o8, o2, oi = np.zeros(8, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32)
            call3(addr(f"q8_{tag}"))(_ptr(w), _ptr(x), _ptr(o8))
            q2 = rng.integers(0, 256, 84, dtype=np.uint8) if tag == "neon" else q2
            call3(addr(f"q2k_{tag}"))(_ptr(q2), _ptr(x), _ptr(o2))
            g = rng.integers(0, 256, 64, dtype=np.uint8) if tag == "neon" else g
            call5(addr(f"iq2_{tag}"))(_ptr(g), _ptr(x), _ptr(grid8), _ptr(sign8), _ptr(oi))
            outs[tag] = (o8, o2, oi)
        for got, want, what in zip(outs["neon"], outs["portable"], ("Q8_0 lanes", "Q2_K sum", "IQ2_XXS sum")):
            np.testing.assert_array_equal(got, want, err_msg=f"{what}, trial {trial}")
        # and the portable path is the arithmetic it says: Q8_0 lane i = bytes 2i, 2i+1, 2i+16, 2i+17
        p = w.astype(np.int32) * x[:32].astype(np.int32)
        np.testing.assert_array_equal(outs["portable"][0], p[0:16:2] + p[1:16:2] + p[16::2] + p[17::2])
    del ee
