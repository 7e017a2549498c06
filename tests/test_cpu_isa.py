"""The CPU kernels' instruction-set levels (ds4py.quant.isa): the kernels choose their path from the features LLVM
compiles for, and the AVX2 path (the laptop case: AVX2 + FMA, no AVX-512), built on any AVX2 host by a feature
string without AVX-512, gives the bits of the default path and of the block-buffer (prefill) kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4py.quant import isa

ROOT = Path(__file__).resolve().parents[1]
F32 = np.float32


def _host_avx2() -> bool:
    from llvmlite import binding

    try:
        f = binding.get_host_cpu_features()
    except RuntimeError:
        return False
    return bool(f.get("avx2") and f.get("fma"))


def test_target_features_follow_numba_config(monkeypatch):
    """$NUMBA_CPU_FEATURES decides (what LLVM compiles with); $NUMBA_CPU_NAME alone is the portable IR."""
    import numba

    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx2,-avx512f,+fma")
    assert isa.target_features() == {"avx2": True, "avx512f": False, "fma": True}
    monkeypatch.setattr(numba.config, "CPU_FEATURES", None)
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")
    assert isa.target_features() == {}


def test_numba_env_levels():
    assert isa.numba_env("native") == {}
    assert isa.numba_env("portable") == {"NUMBA_CPU_NAME": "generic"}
    with pytest.raises(ValueError, match="unknown ISA level 'avx9'"):
        isa.numba_env("avx9")
    if not _host_avx2():
        with pytest.raises(ValueError, match="needs an x86-64 host with AVX2"):
            isa.numba_env("avx2")
        return
    feats = isa.numba_env("avx2")["NUMBA_CPU_FEATURES"].split(",")
    assert {"+avx2", "+fma", "+f16c"} <= set(feats)
    on = [f for f in feats if f.startswith("+")]
    assert not [f for f in on if f[1:].startswith(("avx512", "gfni", "avxvnni", "vpclmulqdq", "vaes"))], on


def test_bad_isa_is_one_sentence():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_kernel_gbs.py"), "--isa", "avx9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip() == "unknown ISA level 'avx9': choose one of native, avx2, neon, portable"


def test_neon_level_needs_an_aarch64_host_with_dotprod():
    """--isa neon: the sdot path (ds4py.quant.jit_neon) where the kernel reports the dot-product extension."""
    if not isa.aarch64_dotprod():
        with pytest.raises(ValueError, match="needs an aarch64 host with the dot-product extension"):
            isa.numba_env("neon")
        return
    feats = isa.numba_env("neon")["NUMBA_CPU_FEATURES"].split(",")
    assert {"+neon", "+dotprod"} <= set(feats)


# the decode kernels on random stored rows: T = 1 (one token: two blocks a call), 3 (a block's decode shared by the
# tokens), the routed experts with uneven pairs; row lengths with a tail block (odd block counts)
_CASES = r"""
import numpy as np
from gguf import GGMLQuantizationType as Q
from test_fused import stored
from ds4py.quant import jit_i8


def decode_cases(oracle=False):
    y = {}
    for qt in (Q.IQ2_XXS, Q.Q2_K):
        for cols in (256, 768, 1280):
            rng = np.random.default_rng([int(qt), cols])
            raw = stored(qt, 13, cols, rng)
            x = (rng.standard_normal((9, cols)) * rng.uniform(0.1, 10, (9, 1))).astype(np.float32)
            if oracle:                      # 9 tokens: the block-buffer kernels (a block unpacked once)
                y[f"{qt.name} {cols}"] = jit_i8.matmul(qt, raw, x, 1)
                continue
            for T in (1, 3):
                y[f"{qt.name} {cols} T{T}"] = jit_i8.matmul(qt, raw, x[:T], 1)
            raws = tuple(stored(qt, 3 * 5, cols, rng).reshape(3, 5, -1) for _ in range(2))
            ya, yb = jit_i8.experts_matmul(qt, raws, np.array([2, 0]), np.array([0, 1, 4]), np.array([3, 0, 5, 8]),
                                           x, 1)
            y[f"{qt.name} {cols} ex"] = np.stack([ya, yb])
    return y
"""
_CHILD = _CASES + r"""
import json
from ds4py.quant import jit_decode
print(json.dumps({"avx2": bool(jit_decode.AVX2), "avx512": bool(jit_decode.AVX512),
                  "y": {k: v.tolist() for k, v in decode_cases().items()}}))
"""


@pytest.mark.skipif(not _host_avx2(), reason="not an x86-64 host with AVX2 and FMA")
def test_the_avx2_path_gives_the_default_paths_bits(tmp_path):
    """Built without AVX-512 (isa.numba_env('avx2') in a child process with its own numba cache), the IQ2_XXS and
    Q2_K decode kernels take the AVX2 path and equal, bit for bit, the host's default build (the AVX-512 path on
    AVX-512 VBMI + GFNI + VNNI hosts) and the block-buffer kernels (9 tokens: a block unpacked once)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    env.update(isa.numba_env("avx2"), NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=900,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    avx2 = json.loads(r.stdout.strip().splitlines()[-1])
    assert avx2["avx2"] and not avx2["avx512"]
    scope: dict = {}
    exec(_CASES, scope)
    native, oracle = scope["decode_cases"](), scope["decode_cases"](oracle=True)
    assert native.keys() == avx2["y"].keys()
    for key, want in native.items():
        got = np.array(avx2["y"][key], F32)
        np.testing.assert_array_equal(got, want, err_msg=key)
        if " T" in key:
            np.testing.assert_array_equal(got, oracle[key.rsplit(" T", 1)[0]][:got.shape[0]], err_msg=key)
