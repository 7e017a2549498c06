#!/usr/bin/env bash
# The CPU kernels on aarch64 without Arm hardware: qemu-aarch64 user mode, Debian's arm64 CPython and the aarch64
# wheels of ds4py's dependencies, then the int8 kernels' property tests with the NEON sdot path (ds4py.quant.jit_neon)
# and a bit-for-bit comparison of the sdot path with the portable one. A bench note (bench/README.md), not CI.
#
#   sudo bash bench/qemu_aarch64.sh [WORK_DIR]          # Debian / Ubuntu x86-64 host, root for apt; ~25 min loaded
#
# Each step's wall time is printed (the install cost). numba detects the host CPU from /proc/cpuinfo, which under
# qemu-user is the x86 host's, so LLVM sees no dot-product extension: the sdot path is chosen by --isa neon's
# environment (ds4py.quant.isa.numba_env("neon"): qemu's emulated CPU reports asimddp in AT_HWCAP).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${1:-/tmp/ds4py-aarch64}
mkdir -p "$W/debs" "$W/root"
t() { local s=$(date +%s.%N); "$@"; echo "[time] $(echo "$(date +%s.%N) - $s" | bc | cut -c1-6) s: $*" >&2; }

# 1. qemu-user and an arm64 CPython 3.11 from Debian's packages, unpacked into a sysroot (not installed)
t apt-get install -y -q qemu-user-static >/dev/null
dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64 && t apt-get update -q >/dev/null; }
PKGS="libc6 libbz2-1.0 libcrypt1 libdb5.3 libexpat1 libffi8 libgcc-s1 liblzma5 libmd0 libncursesw6 libnsl2
      libpython3.11-minimal libpython3.11-stdlib libreadline8 libsqlite3-0 libssl3 libstdc++6 libtinfo6 libtirpc3
      libuuid1 libzstd1 python3.11-minimal python3.11 zlib1g libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3
      libkrb5support0 libcom-err2"
(cd "$W/debs" && t apt-get download -q $(for p in $PKGS; do echo "$p:arm64"; done) >/dev/null)
t bash -c "for f in '$W'/debs/*.deb; do dpkg -x \"\$f\" '$W/root'; done"

# 2. ds4py's dependencies as aarch64 wheels (binary only), installed from this host into a folder
t python3 -m pip install -q --no-cache-dir --target "$W/site" --only-binary :all: --python-version 3.11 \
    --implementation cp --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux_2_28_aarch64 numpy numba "gguf>=0.10" "safetensors>=0.4" "aiohttp>=3.9" "orjson>=3.8" \
    "regex>=2023.0" "huggingface_hub>=2.4" pytest
du -sh "$W/site" "$W/root"

qpy() { qemu-aarch64-static -L "$W/root" "$W/root/usr/bin/python3.11" "$@"; }
export PYTHONPATH="$ROOT:$ROOT/tests:$W/site"
cd "$ROOT"
qpy -c "import platform, numba, numpy; print(platform.machine(), 'numba', numba.__version__, 'numpy', numpy.__version__)"
NEON_ENV=$(qpy -c "from ds4py.quant import isa; print(isa.numba_env('neon')['NUMBA_CPU_FEATURES'])")

# 3. the decode kernels' bits, sdot path and portable path (each its own numba cache), compared
cat > "$W/bits.py" <<'EOF'
import sys
import numpy as np
from gguf import GGMLQuantizationType as Q
from test_fused import stored
from ds4py.quant import jit_decode, jit_i8
print("NEON path", jit_decode.NEON, file=sys.stderr)
out = {}
for qt in (Q.IQ2_XXS, Q.Q2_K, Q.Q8_0):
    for cols in (256, 1280) if qt != Q.Q8_0 else (32, 96, 1280):
        rng = np.random.default_rng([int(qt), cols])
        raw = stored(qt, 13, cols, rng)
        x = (rng.standard_normal((3, cols)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
        for T in (1, 3):
            out[f"{qt.name}_{cols}_T{T}"] = jit_i8.matmul(qt, raw, x[:T], 2)
np.savez(sys.argv[1], **out)
EOF
NUMBA_CACHE_DIR="$W/cache-neon" NUMBA_CPU_FEATURES="$NEON_ENV" t qpy "$W/bits.py" "$W/neon.npz"
NUMBA_CACHE_DIR="$W/cache-portable" t qpy "$W/bits.py" "$W/portable.npz"
PYTHONPATH= python3 - "$W" <<'EOF'
import sys
import numpy as np
a, b = np.load(f"{sys.argv[1]}/neon.npz"), np.load(f"{sys.argv[1]}/portable.npz")
same = [k for k in a.files if np.array_equal(a[k], b[k])]
print(f"sdot vs portable: {len(same)} / {len(a.files)} products bit-identical", [k for k in a.files if k not in same])
EOF

# 4. the int8 kernels' property tests (against the dequant oracle and the reference's rounding) on the sdot path
# (test_jit_i8: every format and row length against the oracles, decode and block-buffer kernels; the dense
# Q8_0 prefill tile on sdot; the routed-expert calls; test_jit_neon on an aarch64 host)
NUMBA_CACHE_DIR="$W/cache-neon" NUMBA_CPU_FEATURES="$NEON_ENV" t qpy -m pytest -o addopts="" -p no:cacheprovider \
    -q tests/test_jit_i8.py tests/test_jit_neon.py tests/test_jit_i8_experts.py \
    tests/test_jit_i8_gemm.py::test_int8_q8_0_equals_the_act_quant_reference_at_every_row_length \
    -k "not a_model and not verify and not batched_moe and not grouped_and_paired"
