#!/usr/bin/env bash
# Device check for the CUDA backend, on one GPU (sized for one H200 in <= 10 minutes: every step's limit is also
# capped by what is left of DS4PY_CHECK_BUDGET_S, default 570 s, so the whole script ends in time).
#   bench/device_check.sh            results and logs go to $OUT (the device runner's folder) or /tmp/ds4py-device-check
# Steps, most valuable first: set up deps -> compile every kernel for this GPU (ptxas report, JSON) -> every GPU
# test (tests/gpu: each kernel vs its twin at emulator and real V4 Flash shapes, PDL / graph bit-identity, the
# CUDA engine end to end on the tiny models vs the reference (engine_e2e.json) and a full-size synthetic step;
# tests/test_cu_emu_gpu.py: the emulator's own value tests on hardware) -> synthetic 43-layer q2 decode,
# graph + PDL / graph / direct (bench/cuda_decode.py: tokens/s, host us per step, launches, % of copy; --rows: a
# verify of 1 + k rows vs one decode step, aggregate tokens/s of B = 1..16 sequences stepped together) ->
# synthetic prefill of 2k / 12.5k tokens (bench/cuda_prefill.py: tokens/s, experts exact / on tensor cores) ->
# decode-kernel bandwidth at the real shapes (bench/gemv_bandwidth.py, bench/attn_moe_bandwidth.py) ->
# compute-sanitizer memcheck + racecheck on a subset, where it is installed -> the CPU-side CUDA tests ->
# summary.json with every step's status and time.
# Exit status: 0 only if every step passed (a compute-sanitizer that is not installed is reported, not failed;
# GPU tests skipped for want of a device are a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
RES="${OUT:-/tmp/ds4py-device-check}"
mkdir -p "$RES"
export DS4PY_CACHE_DIR="${DS4PY_CACHE_DIR:-$RES/cache}"
PY="${PYTHON:-python3}"
declare -A STATUS SECS
STEPS=()

BUDGET="${DS4PY_CHECK_BUDGET_S:-570}"
export DS4PY_DEVICE_RESULTS="$RES"        # tests/gpu/test_gpu_engine.py writes engine_e2e.json here
step() { echo; echo "== $1 ($(( $(date +%s) - T0 )) s)"; STEP_T0=$(date +%s); }
# lim N: N seconds, or what is left of the budget (at least 1) if that is less
lim() { local left=$(( BUDGET - ($(date +%s) - T0) )); [ "$left" -lt 1 ] && left=1; [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }
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
timeout "$(lim 90)" $PY -m ds4py.cuda.compiler --json "$RES/ptxas.json" 2>&1 | tee "$RES/ptxas.txt"
done_step build "${PIPESTATUS[0]}"

step "GPU tests (tests/gpu, and the emulator's value tests on the hardware: portable.cuh's PTX paths)"
timeout "$(lim 210)" $PY -m pytest tests/gpu tests/test_cu_emu_gpu.py -q -rs -p no:cacheprovider --junitxml="$RES/gpu-tests.xml" 2>&1 \
  | tee "$RES/gpu-tests.txt"
rc=${PIPESTATUS[0]}
if grep -q "no CUDA device" "$RES/gpu-tests.txt"; then rc=skipped; fi
done_step gpu_tests "$rc"

step "synthetic 43-layer q2 decode: graph + PDL / graph / direct; multi-row: verify 1 + k rows, B = 1..16 rows"
timeout "$(lim 130)" $PY bench/cuda_decode.py --rows --json "$RES/cuda_decode.json" 2>&1 | tee "$RES/cuda_decode.txt"
done_step cuda_decode "${PIPESTATUS[0]}"
step "synthetic 43-layer q2 prefill: 2k / 12.5k tokens, experts exact / on tensor cores"; timeout "$(lim 80)" $PY bench/cuda_prefill.py --json "$RES/cuda_prefill.json" 2>&1 | tee "$RES/cuda_prefill.txt"; done_step cuda_prefill "${PIPESTATUS[0]}"

step "decode-kernel bandwidth at the V4 Flash shapes"
timeout "$(lim 90)" $PY bench/gemv_bandwidth.py --json "$RES/gemv_bandwidth.json" 2>&1 | tee "$RES/gemv_bandwidth.txt"
done_step bandwidth "${PIPESTATUS[0]}"
step "attention / MoE kernels at V4 Flash shapes"; timeout "$(lim 45)" $PY bench/attn_moe_bandwidth.py --json "$RES/attn_moe_bandwidth.json" 2>&1 | tee "$RES/attn_moe_bandwidth.txt"; done_step attn_moe "${PIPESTATUS[0]}"

step "compute-sanitizer memcheck + racecheck on a subset (the decode chain and the side-stream join)"
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
if [ -z "$SAN" ]; then
  echo "compute-sanitizer is not installed: skipped" | tee "$RES/sanitizer.txt"
  done_step sanitizer not_installed
else
  rc=0
  timeout "$(lim 30)" "$SAN" --tool memcheck --error-exitcode 99 $PY -m pytest tests/gpu/test_cuda_runtime.py \
    -q -p no:cacheprovider -k "step_matches_twins or side_stream" >"$RES/sanitizer-memcheck.txt" 2>&1 || rc=$?
  tail -3 "$RES/sanitizer-memcheck.txt"
  timeout "$(lim 30)" "$SAN" --tool racecheck --error-exitcode 99 $PY -m pytest tests/gpu/test_cuda_runtime.py \
    -q -p no:cacheprovider -k "step_matches_twins" >"$RES/sanitizer-racecheck.txt" 2>&1 || rc=$?
  tail -3 "$RES/sanitizer-racecheck.txt"
  done_step sanitizer "$rc"
fi

step "CPU-side CUDA tests (NVRTC, signatures, twins, stand-in driver)"
timeout "$(lim 60)" $PY -m pytest tests/test_cuda_compile.py tests/test_cuda_signature.py tests/test_cuda_twins.py \
  tests/test_cuda_driverless.py tests/test_cuda_engine_standin.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$RES/cpu-tests.txt"
done_step cpu_tests "${PIPESTATUS[0]}"

step "summary"
grep -E "^(device|copy)" "$RES/gemv_bandwidth.txt" 2>/dev/null
grep -E "best:|per call|chain" "$RES/gemv_bandwidth.txt" 2>/dev/null || true
grep -E "tokens/s|synthetic|multi-row" "$RES/cuda_decode.txt" 2>/dev/null || true
grep -E "prefill" "$RES/cuda_prefill.txt" 2>/dev/null || true
tail -1 "$RES/gpu-tests.txt" 2>/dev/null
rc=0
json="{"
for k in "${STEPS[@]}"; do
  case "${STATUS[$k]}" in 0) word=ok ;; not_installed) word="not installed" ;; *) word="FAILED (${STATUS[$k]})"; rc=1 ;; esac
  printf '%-11s %-14s %4s s\n' "$k" "$word" "${SECS[$k]}"
  json="$json\"$k\": {\"status\": \"${STATUS[$k]}\", \"seconds\": ${SECS[$k]}}, "
done
echo "${json}\"total_seconds\": $(( $(date +%s) - T0 ))}" > "$RES/summary.json"
echo "total $(( $(date +%s) - T0 )) s; logs and JSON (summary, versions, ptxas, engine_e2e, cuda_decode, cuda_prefill, gemv_bandwidth, attn_moe_bandwidth) in $RES"
exit $rc
