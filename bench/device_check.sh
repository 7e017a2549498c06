#!/usr/bin/env bash
# Device check for the CUDA backend, on one GPU (sized for one H200: the step limits add up to 8 minutes).
#   bench/device_check.sh            results and logs go to $OUT (the device runner's folder) or /tmp/ds4py-device-check
# Steps: set up deps -> compile every kernel for this GPU (ptxas report) -> every GPU test -> the CPU-side CUDA
# tests -> GEMV bandwidth probe; then a summary. Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
RES="${OUT:-/tmp/ds4py-device-check}"
mkdir -p "$RES"
export DS4PY_CACHE_DIR="${DS4PY_CACHE_DIR:-$RES/cache}"
PY="${PYTHON:-python3}"
declare -A STATUS

step() { echo; echo "== $1 ($(( $(date +%s) - T0 )) s)"; }

step "setup"
# The device machine is offline: pip may fail on deps it cannot fetch (gguf, orjson). Then fall back to a
# no-deps editable install, then to the source tree on PYTHONPATH. Wheels in $DS4PY_WHEELS are used if given.
if [ -n "${DS4PY_WHEELS:-}" ] && [ -d "$DS4PY_WHEELS" ]; then
  $PY -m pip install -q --no-index --find-links "$DS4PY_WHEELS" "$DS4PY_WHEELS"/*.whl >"$RES/pip-wheels.log" 2>&1 || true
fi
if $PY -m pip install -q --disable-pip-version-check --retries 0 --timeout 5 -e '.[cuda,test]' >"$RES/pip.log" 2>&1; then
  echo "pip install -e .[cuda,test]: ok"
elif $PY -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >>"$RES/pip.log" 2>&1; then
  echo "pip install -e . (no deps; offline): ok"
else
  echo "pip install failed (see $RES/pip.log); using the source tree on PYTHONPATH"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY - <<'PY' || { echo "missing numpy / cuda-bindings / pytest: cannot run the device check"; exit 2; }
import numpy, pytest
from cuda.bindings import driver, nvrtc
print("numpy", numpy.__version__, "| nvrtc", nvrtc.nvrtcVersion()[1:], "| driver API", driver.cuDriverGetVersion()[1])
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true

step "build: NVRTC -> cubin for this GPU, ptxas report"
timeout 90 $PY -m ds4py.cuda.compiler 2>&1 | tee "$RES/ptxas.txt"
STATUS[build]=${PIPESTATUS[0]}

step "GPU tests (tests/gpu, and the emulator's value tests on the hardware: portable.cuh's PTX paths)"
timeout 210 $PY -m pytest tests/gpu tests/test_cu_emu_gpu.py -q -rs -p no:cacheprovider --junitxml="$RES/gpu-tests.xml" 2>&1 \
  | tee "$RES/gpu-tests.txt"
STATUS[gpu_tests]=${PIPESTATUS[0]}
if grep -q "no CUDA device" "$RES/gpu-tests.txt"; then STATUS[gpu_tests]=skipped; fi

step "CPU-side CUDA tests (NVRTC, signatures, twins)"
timeout 60 $PY -m pytest tests/test_cuda_compile.py tests/test_cuda_signature.py tests/test_cuda_twins.py \
  tests/test_cuda_driverless.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$RES/cpu-tests.txt"
STATUS[cpu_tests]=${PIPESTATUS[0]}

step "GEMV bandwidth probe"
timeout 120 $PY bench/gemv_bandwidth.py --json "$RES/gemv_bandwidth.json" 2>&1 | tee "$RES/gemv_bandwidth.txt"
STATUS[bandwidth]=${PIPESTATUS[0]}
step "attention / MoE kernels at V4 Flash shapes"; timeout 90 $PY bench/attn_moe_bandwidth.py --json "$RES/attn_moe_bandwidth.json" 2>&1 | tee "$RES/attn_moe_bandwidth.txt"; STATUS[attn_moe]=${PIPESTATUS[0]}

step "summary"
grep -E "^(device|copy)" "$RES/gemv_bandwidth.txt" 2>/dev/null
grep -E "best:|^gemv_|chain" "$RES/gemv_bandwidth.txt" 2>/dev/null | grep -E "best|chain" || true
tail -1 "$RES/gpu-tests.txt" 2>/dev/null
rc=0
for k in build gpu_tests cpu_tests bandwidth attn_moe; do
  printf '%-10s %s\n' "$k" "$([ "${STATUS[$k]}" = 0 ] && echo ok || echo "FAILED (${STATUS[$k]})")"
  [ "${STATUS[$k]}" = 0 ] || rc=1
done
echo "total $(( $(date +%s) - T0 )) s; logs in $RES"
exit $rc
