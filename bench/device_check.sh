#!/usr/bin/env bash
# Device check for the CUDA backend, on one GPU (sized for one H200: the step limits add up to under 9 minutes).
#   bench/device_check.sh            results and logs go to $OUT (the device runner's folder) or /tmp/ds4py-device-check
# Steps: set up deps -> compile every kernel for this GPU (ptxas report, JSON) -> every GPU test (tests/gpu: each
# kernel vs its twin at emulator and real V4 Flash shapes, PDL / graph bit-identity; tests/test_cu_emu_gpu.py:
# the emulator's own value tests on hardware) -> the CPU-side CUDA tests -> decode-kernel bandwidth at the real
# shapes (bench/gemv_bandwidth.py) -> summary.json with every step's status and time.
# Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
RES="${OUT:-/tmp/ds4py-device-check}"
mkdir -p "$RES"
export DS4PY_CACHE_DIR="${DS4PY_CACHE_DIR:-$RES/cache}"
PY="${PYTHON:-python3}"
declare -A STATUS SECS
STEPS=()

step() { echo; echo "== $1 ($(( $(date +%s) - T0 )) s)"; STEP_T0=$(date +%s); }
done_step() { STATUS[$1]=$2; SECS[$1]=$(( $(date +%s) - STEP_T0 )); STEPS+=("$1"); }

step "setup"
# The device machine is offline: pip may fail on deps it cannot fetch (gguf, orjson). Then fall back to a
# no-deps editable install, then to the source tree on PYTHONPATH. Wheels in $DS4PY_WHEELS are used if given.
# DS4PY_SKIP_SETUP=1 skips the installs (a machine that has them; or a dry run without a GPU).
if [ -n "${DS4PY_SKIP_SETUP:-}" ]; then
  echo "setup skipped (DS4PY_SKIP_SETUP)"
elif [ -n "${DS4PY_WHEELS:-}" ] && [ -d "$DS4PY_WHEELS" ]; then
  $PY -m pip install -q --no-index --find-links "$DS4PY_WHEELS" "$DS4PY_WHEELS"/*.whl >"$RES/pip-wheels.log" 2>&1 || true
fi
if [ -n "${DS4PY_SKIP_SETUP:-}" ]; then
  :
elif $PY -m pip install -q --disable-pip-version-check --retries 0 --timeout 5 -e '.[cuda,test]' >"$RES/pip.log" 2>&1; then
  echo "pip install -e .[cuda,test]: ok"
elif $PY -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >>"$RES/pip.log" 2>&1; then
  echo "pip install -e . (no deps; offline): ok"
else
  echo "pip install failed (see $RES/pip.log); using the source tree on PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"     # this checkout, whatever an editable install points at
$PY - "$RES/versions.json" <<'PY' || { echo "missing numpy / cuda-bindings / pytest: cannot run the device check"; exit 2; }
import json, sys
import numpy, pytest
from cuda.bindings import driver, nvrtc
try:
    drv = driver.cuDriverGetVersion()[1]
except Exception as e:                      # no driver: the GPU steps will say so
    drv = f"none ({type(e).__name__})"
v = {"numpy": numpy.__version__, "pytest": pytest.__version__, "nvrtc": ".".join(map(str, nvrtc.nvrtcVersion()[1:])),
     "driver_cuda": drv, "python": sys.version.split()[0]}
print(v)
json.dump(v, open(sys.argv[1], "w"), indent=1)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null | tee "$RES/nvidia-smi.txt" || true
done_step setup 0

step "build: NVRTC -> cubin for this GPU, ptxas report"
timeout 120 $PY -m ds4py.cuda.compiler --json "$RES/ptxas.json" 2>&1 | tee "$RES/ptxas.txt"
done_step build "${PIPESTATUS[0]}"

step "GPU tests (tests/gpu, and the emulator's value tests on the hardware: portable.cuh's PTX paths)"
timeout 240 $PY -m pytest tests/gpu tests/test_cu_emu_gpu.py -q -rs -p no:cacheprovider --junitxml="$RES/gpu-tests.xml" 2>&1 \
  | tee "$RES/gpu-tests.txt"
rc=${PIPESTATUS[0]}
if grep -q "no CUDA device" "$RES/gpu-tests.txt"; then rc=skipped; fi
done_step gpu_tests "$rc"

step "CPU-side CUDA tests (NVRTC, signatures, twins, stand-in driver)"
timeout 90 $PY -m pytest tests/test_cuda_compile.py tests/test_cuda_signature.py tests/test_cuda_twins.py \
  tests/test_cuda_driverless.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$RES/cpu-tests.txt"
done_step cpu_tests "${PIPESTATUS[0]}"

step "decode-kernel bandwidth at the V4 Flash shapes"
timeout 150 $PY bench/gemv_bandwidth.py --json "$RES/gemv_bandwidth.json" 2>&1 | tee "$RES/gemv_bandwidth.txt"
done_step bandwidth "${PIPESTATUS[0]}"
step "attention / MoE kernels at V4 Flash shapes"; timeout 60 $PY bench/attn_moe_bandwidth.py --json "$RES/attn_moe_bandwidth.json" 2>&1 | tee "$RES/attn_moe_bandwidth.txt"; done_step attn_moe "${PIPESTATUS[0]}"

step "summary"
grep -E "^(device|copy)" "$RES/gemv_bandwidth.txt" 2>/dev/null
grep -E "best:|per call|chain" "$RES/gemv_bandwidth.txt" 2>/dev/null || true
tail -1 "$RES/gpu-tests.txt" 2>/dev/null
rc=0
json="{"
for k in "${STEPS[@]}"; do
  printf '%-10s %-14s %4s s\n' "$k" "$([ "${STATUS[$k]}" = 0 ] && echo ok || echo "FAILED (${STATUS[$k]})")" "${SECS[$k]}"
  [ "${STATUS[$k]}" = 0 ] || rc=1
  json="$json\"$k\": {\"status\": \"${STATUS[$k]}\", \"seconds\": ${SECS[$k]}}, "
done
echo "${json}\"total_seconds\": $(( $(date +%s) - T0 ))}" > "$RES/summary.json"
echo "total $(( $(date +%s) - T0 )) s; logs and JSON (summary, versions, ptxas, gemv_bandwidth) in $RES"
exit $rc
