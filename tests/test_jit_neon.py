"""The aarch64 NEON path of the decode kernels (ds4py.quant.jit_neon), checked on any host.

1. Each decode intrinsic of ds4py.quant.jit_decode (the very codegen numba inlines into the kernels) is built with
   the NEON path on, optimised and compiled by llvmlite for aarch64-unknown-linux-gnu with +neon,+dotprod, and its
   assembly holds the sdot instructions the path emits (in the loop, for the looped ones); built with the portable
   path it holds none (LLVM does not form sdot from it: why the path exists), so a kernel turned scalar or
   portable fails here.
2. The NEON path runs on this host: the kernels compiled afresh with the NEON path on and sdot emitted as
   portable IR doing what Arm's manual says sdot does (lane i += the 4 products of bytes 4i..4i+3), against
   the kernels built here (IQ2_XXS, Q2_K: the same bits on every path), a numpy replay of the portable Q8_0 row
   (q8_0_row's 8 float lanes: the lanes' integers must be the portable path's) and the block-buffer Q8_0
   kernel (the dense prefill tile: the same float sequence per block).
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
    """set(neon): the decode and dense-prefill codegen take the NEON path (True) or the portable one (False),
    x86's off."""
    from ds4py.quant import jit_decode, jit_q8_0_vnni

    def set_path(neon: bool):
        monkeypatch.setattr(jit_decode, "AVX2", False)
        monkeypatch.setattr(jit_decode, "AVX512", False)
        monkeypatch.setattr(jit_decode, "NEON", neon)
        monkeypatch.setattr(jit_q8_0_vnni, "NEON", neon)
        monkeypatch.setattr(jit_q8_0_vnni, "TOKENS", 2 if neon else 4)
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
    from ds4py.quant import jit_q8_0_vnni as v

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
        # the dense prefill tile: 8 pieces of 4 bytes a block x 2 tokens x 4 registers of 4 rows
        "q8_0_tile": (v.q8_0_tile, (a(u8, 4), a(types.int32, 2), a(f32, 2), a(u8, 2), a(f32, 2), a(i64, 1),
                                    a(f32, 2)), 64, True),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_each_neon_kernel_compiles_to_sdot_for_aarch64(name, paths):
    tm = _aarch64_machine()
    intr, argtys, want, looped = _cases()[name]
    paths(True)
    asm = _compile(_intrinsic_ir(intr, argtys), tm)
    body = max(_loops(asm), key=len) if looped else asm
    assert body.count("\tsdot\t") == want, f"{name}: {body.count(chr(9) + 'sdot' + chr(9))} sdot, want {want}\n{body}"
    if name != "q8_0_tile":                         # (x86 only off NEON: vpdpbusd)
        paths(False)                               # the portable IR: LLVM forms no sdot of its own
        assert "sdot" not in _compile(_intrinsic_ir(intr, argtys), tm), name


def test_enabled_only_on_aarch64_with_dotprod():
    from ds4py.quant import jit_neon

    assert jit_neon.enabled("aarch64", {"dotprod": True, "neon": True})
    assert jit_neon.enabled("arm64", {"dotprod": True})
    assert not jit_neon.enabled("aarch64", {"neon": True, "dotprod": False})
    assert not jit_neon.enabled("aarch64", {})                     # a cross-target build: the portable IR
    assert not jit_neon.enabled("x86_64", {"dotprod": True, "avx2": True})


# ---- 2. the NEON path run on this host, sdot emulated ----------------------------------------------------------
def _sdot_emulated(builder, acc, a, b):
    """Arm's sdot in portable IR: acc lane i + sum_k a[4i + k] * b[4i + k] (signed bytes)."""
    from llvmlite import ir

    v16 = ir.VectorType(ir.IntType(32), 16)
    p = builder.mul(builder.sext(a, v16), builder.sext(b, v16))
    for k in range(4):
        acc = builder.add(acc, builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(ir.IntType(32), 4),
                                                                         [4 * i + k for i in range(4)])))
    return acc


def _q8_0_portable_rows(raw, xq, xd, f16):
    """q8_0_row's float sequence on the portable path, in numpy float32: per block, lane i's integer (bytes 2i,
    2i+1, 2i+16, 2i+17) times d_w * d_x added to float lane i, the 8 lanes summed by halving at the end."""
    R, nb, _ = raw.shape
    T = xq.shape[0]
    w = raw[:, :, 2:].view(np.int8).astype(np.int32)                        # [R, nb, 32]
    d = f16[raw[:, :, 0].astype(np.int32) | (raw[:, :, 1].astype(np.int32) << 8)]
    y = np.empty((T, R), np.float32)
    for t in range(T):
        p = w * xq[t].reshape(nb, 32).astype(np.int32)
        lanes = (p[..., 0:16:2] + p[..., 1:16:2] + p[..., 16::2] + p[..., 17::2]).astype(np.float32)
        acc = np.zeros((R, 8), np.float32)
        for b in range(nb):
            acc = acc + lanes[:, b] * (d[:, b] * xd[t, b])[:, None]
        for n in (4, 2, 1):
            acc = acc[:, :n] + acc[:, n:2 * n]
        y[t] = acc[:, 0]
    return y


def test_the_neon_path_run_here_gives_the_portable_bits(paths, monkeypatch):
    from gguf import GGMLQuantizationType as Q
    from numba import njit

    from ds4py.quant import jit_decode, jit_i8, jit_neon, jit_q8_0_vnni
    from test_fused import stored

    jit_i8._kernels()
    f16, tabs = jit._state["f16"], (jit_i8._tables["grid8"], jit_i8._tables["sign8"])
    paths(True)
    monkeypatch.setattr(jit_neon, "sdot", _sdot_emulated)
    fresh = lambda f: njit(nogil=True, boundscheck=False)(f.py_func)          # noqa: E731  (compiled now: NEON)
    iq2, q2k, q8 = fresh(jit_decode._iq2_xxs_pairs), fresh(jit_decode._q2_k_pairs), fresh(jit_decode._q8_0_pairs)
    tile = fresh(jit_q8_0_vnni.q8_0_vnni)
    rng = np.random.default_rng(35)
    for cols in (256, 768, 1280):
        x = (rng.standard_normal((3, cols)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
        x[1, :256] = 0
        xr, R = np.arange(3), 7
        xq, xd, xbs = jit_i8.quant_q8_k(x)
        for qt, nbytes in ((Q.IQ2_XXS, 66), (Q.Q2_K, 84)):
            raw = stored(qt, R, cols, rng)
            for T in (1, 3):                              # one token (two blocks a call) and a block's pairs
                y = np.empty((T, R), np.float32)
                w = raw.reshape(R, cols // 256, nbytes)
                if qt == Q.IQ2_XXS:
                    iq2(w, xq[:T], xd[:T], xr[:T], 0, T, y, f16, *tabs, 0, R)
                else:
                    q2k(w, xq[:T], xd[:T], xbs[:T], xr[:T], 0, T, y, f16, 0, R)
                np.testing.assert_array_equal(y, jit_i8.matmul(qt, raw, x[:T], 1), err_msg=f"{qt.name} {cols} T{T}")
        raw = stored(Q.Q8_0, R, cols, rng)
        if cols == 256:
            raw.reshape(R, -1, 34)[0, 0, 2:] = 0x80                    # -128 codes
        w = raw.reshape(R, cols // 32, 34)
        xq, xd = jit_i8.quant_q8_0(x)
        y = np.empty((3, R), np.float32)
        q8(w, xq, xd, xr, 0, 3, y, f16, 0, R)
        np.testing.assert_array_equal(y, _q8_0_portable_rows(w, xq, xd, f16), err_msg=f"Q8_0 row {cols}")
        y = np.empty((3, R), np.float32)                # the dense prefill tile: the block-buffer kernel's bits
        tile(w, xq.view(np.uint8) ^ np.uint8(0x80), xd, y, f16, 1)
        k = jit_i8._tables["mod"]
        want = np.empty((3, R), np.float32)
        k.q8_0(w, w.view(np.int8), xq, xd, want, f16, 1)
        np.testing.assert_array_equal(y, want, err_msg=f"Q8_0 tile {cols}")
