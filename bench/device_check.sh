#!/usr/bin/env bash
# The device check: everything ds4py can learn from a few minutes on one GPU, in one command that ends by itself.
#
#   bash bench/device_check.sh                  on the GPU machine (bench/README.md "Device check": the exact call)
#   bash bench/device_check.sh --only STEPS     rerun chosen steps (comma-separated names or groups, below)
#   bash bench/device_check.sh --dry-run        here, without a GPU: a clean Python 3.12 venv with only the GPU
#                                               machine's packages (pip --no-index), then every step up to its
#                                               first GPU call (tests/test_device_check_script.py runs it in CI)
#
# Before the call, bench/device_wheels.sh fills .device/ (carried with the call): wheels for what the machine's
# Python lacks (bench/device_carry.txt) and the golden subset the GPU tests read. Steps, most valuable first, each
# with its own time limit (seconds; they add up to the budget, DS4PY_CHECK_BUDGET_S, default 380, and each is also
# cut to what is left of it, so the script ends inside 7 minutes; --plan prints them):
#   setup 15      carried wheels installed; every package the GPU path imports checked (one line names a missing one)
#   doctor 20     python -m ds4py doctor --json: driver, NVRTC, device, smoke kernel, bandwidth, auto's choice
#   build 32      every kernel for this GPU's arch (NVRTC, files in parallel), ptxas report
#   tests         each tests/gpu/test_*.py and tests/test_cu_emu_gpu.py in its own process, with its own limit;
#                 a file that loses its CUDA context is rerun once with CUDA_LAUNCH_BLOCKING=1 (names the kernel)
#   bench         cuda_decode 17 (also one direct decode step launch by launch: each kernel timed with CUDA events
#                 beside the GPU time model's number, summary.json's model_vs_measured), cuda_decode_v41 35 (a full-size V4.1 Flash, VQ-8 + Q4_K, ~112 GB synthesised on
#                 the device, Engram from a 138 MB synthetic table written to the scratch folder: tokens/s, bytes
#                 per token, GB/s), cuda_prefill 13, gemv_bandwidth 10, attn_moe 8
#   sanitizer     compute-sanitizer memcheck 25, racecheck 25, synccheck 10 over one tiny-model prefill block and
#                 two decode steps (bench/sanitize_tiny.py)
# Results: a scratch folder (DS4PY_CHECK_SCRATCH, default /tmp/ds4py-check) with every log and JSON; $OUT gets
# summary.json (every step and every test with its status, every bench's numbers) and results.tar.gz (the scratch
# folder), written on any exit, a failed step or the budget running out included. Exit status: 0 when every step
# passed (dry run: when every step passed or stopped only for want of a GPU), else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$(date +%s)
DRY=0
PLAN=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --plan) PLAN=1 ;;          # print "step group limit" per step and the budget, run nothing
    --only) ONLY="${2:-}"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "device_check: unknown argument $1 (--dry-run, --only STEP,..., --plan)"; exit 2 ;;
  esac
  shift
done
BUDGET="${DS4PY_CHECK_BUDGET_S:-380}"
[ -n "$ONLY" ] && BUDGET="${DS4PY_CHECK_BUDGET_S:-170}"       # a rerun of chosen steps: inside 3 minutes
BUILD_LIMIT=32                 # 16 files in parallel on the GPU machine's 16 cores
if [ "$DRY" = 1 ]; then        # a 2-core machine builds them one after another: the step is proven, not timed
  BUILD_LIMIT=240; BUDGET="${DS4PY_CHECK_BUDGET_S:-600}"
fi
SETUP_LIMIT=15
if [ "$PLAN" = 1 ]; then
  echo "budget $BUDGET"; echo "setup setup $SETUP_LIMIT"
  run_step() { wanted "$1" "$2" && echo "$1 $2 $3"; return 0; }
  wanted() { [ -z "$ONLY" ] && return 0; case ",$ONLY," in *",$1,"*|*",$2,"*) return 0 ;; esac; return 1; }
fi
SCRATCH="${DS4PY_CHECK_SCRATCH:-/tmp/ds4py-check}"
OUTDIR="${OUT:-$SCRATCH-out}"
CARRY="${DS4PY_CARRY_DIR:-$REPO/.device}"
if [ "$PLAN" = 0 ]; then
  rm -rf "$SCRATCH"
  mkdir -p "$SCRATCH/logs" "$OUTDIR"
fi
STEPS_TSV="$SCRATCH/steps.tsv"
[ "$PLAN" = 0 ] && : > "$STEPS_TSV"
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-4}"
export DS4PY_DEVICE_RESULTS="$SCRATCH"                     # tests/gpu/test_gpu_engine.py writes engine_e2e.json
[ -d "$CARRY/golden" ] && export DS4PY_GOLDEN="$CARRY/golden"
if [ "$DRY" = 1 ]; then
  export DS4PY_CACHE_DIR="${DS4PY_CACHE_DIR:-$HOME/.cache/ds4py}"    # reuse this machine's kernel caches
else
  export DS4PY_CACHE_DIR="$SCRATCH/cache"                  # left out of the archive
fi

# ---- the step machinery ------------------------------------------------------------------------------------------
if [ "$PLAN" = 0 ]; then
# wanted NAME GROUP: is the step selected by --only (a name or its group)?
wanted() { [ -z "$ONLY" ] && return 0; case ",$ONLY," in *",$1,"*|*",$2,"*) return 0 ;; esac; return 1; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# run_step NAME GROUP LIMIT CMD...: run CMD with its log in logs/NAME.txt, limited to LIMIT or what is left.
run_step() {
  local name=$1 group=$2 limit=$3; shift 3
  wanted "$name" "$group" || return 0
  local l; l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 3 ]; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" out_of_time "" 0 "$limit" "no time left in the budget" >> "$STEPS_TSV"
    echo "== $name: no time left"; return 0
  fi
  echo; echo "== $name (limit $limit s, at $(( $(date +%s) - T0 )) s)"
  local s0; s0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$SCRATCH/logs/$name.txt" 2>&1
  local rc=$?
  local secs=$(( $(date +%s) - s0 ))
  tail -n 4 "$SCRATCH/logs/$name.txt"
  classify "$name" "$rc" "$secs" "$limit"
}
fi
NO_GPU='no NVIDIA driver was found|found no usable GPU|reports no CUDA device|no CUDA device'
STICKY='CUDA_ERROR_ILLEGAL_ADDRESS|CUDA_ERROR_MISALIGNED_ADDRESS|CUDA_ERROR_LAUNCH_FAILED|CUDA_ERROR_ILLEGAL_INSTRUCTION|CUDA_ERROR_HARDWARE_STACK_ERROR|CUDA_ERROR_INVALID_PC|CUDA_ERROR_ASSERT'
# classify NAME RC SECS LIMIT: ok | failed | timeout | no_gpu (a GPU step on a machine without one) | not_installed
classify() {
  local name=$1 rc=$2 secs=$3 limit=$4 status reason="" log="$SCRATCH/logs/$1.txt"
  if [ "$rc" = 0 ]; then
    status=ok
    if grep -Eq "SKIPPED.*($NO_GPU)" "$log"; then
      status=no_gpu; reason="GPU tests skipped: no CUDA device"
    fi
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status=timeout; reason="ran past its $limit s limit"
  elif grep -Eq "$NO_GPU" "$log"; then
    status=no_gpu; reason="$(grep -Eo "($NO_GPU)[^\"]*" "$log" | head -1 | cut -c1-160)"
  elif [ "$rc" = 99 ]; then
    status=failed; reason="compute-sanitizer reported errors"
  else
    status=failed
    reason="$(grep -E "Error|error|ERROR|FAILED|failed|missing" "$log" | tail -1 | cut -c1-200)"
    [ -z "$reason" ] && reason="$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$limit" "$reason" >> "$STEPS_TSV"
  echo "-- $name: $status ($secs s)"
}

finish() {
  local rc=$?
  trap - EXIT INT TERM
  # the summary and the archive: Python if it works, else the step table as it is
  if ! timeout 30 "${PY:-python3}" "$REPO/bench/device_summary.py" "$SCRATCH" "$OUTDIR" "$DRY" "$BUDGET" \
       "$(( $(date +%s) - T0 ))"; then
    echo "device_summary.py failed: writing the step table only"
    { printf '{"summary_failed": true, "steps_tsv": '; sed 's/"/\\"/g; s/\t/ | /g' "$STEPS_TSV" \
      | awk 'BEGIN{printf "["} {printf "%s\"%s\"", (NR>1?",":""), $0} END{printf "]"}'; printf '}\n'; } \
      > "$OUTDIR/summary.json"
    tar -czf "$OUTDIR/results.tar.gz" -C "$SCRATCH" --exclude=./cache --exclude=./site --exclude=./venv . 2>/dev/null
    exit 1
  fi
  exit "$(cat "$SCRATCH/exit_status" 2>/dev/null || echo 1)"
}
if [ "$PLAN" = 0 ]; then
  trap finish EXIT
  trap 'exit 1' INT TERM
fi

# ---- setup: the Python that runs everything -------------------------------------------------------------------
PY="${PYTHON:-python3}"
SITE="$SCRATCH/site"
setup() {
  if [ "$DRY" = 1 ]; then
    bash "$REPO/bench/device_venv.sh" "$SCRATCH/venv" || return 1
    PY="$SCRATCH/venv/bin/python"
  fi
  echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  if compgen -G "$CARRY/wheels/*.whl" > /dev/null; then
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --upgrade \
      --target "$SITE" "$CARRY"/wheels/*.whl || { echo "could not install the carried wheels in $CARRY/wheels"; return 1; }
    echo "carried wheels: $(cd "$CARRY/wheels" && ls *.whl | tr '\n' ' ')"
  else
    echo "no carried wheels in $CARRY/wheels (bench/device_wheels.sh makes them)"
  fi
  export PYTHONPATH="$REPO:$SITE"
  timeout "$SETUP_LIMIT" "$PY" "$REPO/bench/device_imports.py" "$SCRATCH/versions.json" || return 1
  [ "$DRY" = 1 ] && { "$PY" "$REPO/bench/device_imports.py" --carried-size "$REPO" "$CARRY" || return 1; }
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv \
    > "$SCRATCH/nvidia-smi.txt" 2>&1 || echo "nvidia-smi: not available"
  return 0
}
if [ "$PLAN" = 0 ]; then
echo "== setup"
s0=$(date +%s)
setup > "$SCRATCH/logs/setup.txt" 2>&1
rc=$?
[ "$DRY" = 1 ] && PY="$SCRATCH/venv/bin/python"
export PYTHONPATH="$REPO:$SITE"
cat "$SCRATCH/logs/setup.txt"
classify setup "$rc" "$(( $(date +%s) - s0 ))" "$SETUP_LIMIT"
if [ "$rc" != 0 ]; then
  echo "setup failed: no other step can run"
  exit 1
fi
fi

# ---- the steps --------------------------------------------------------------------------------------------------
run_step doctor doctor 20 "$PY" -m ds4py doctor --json "$SCRATCH/doctor.json"
ARCH=$("$PY" -c "import json; print(json.load(open('$SCRATCH/doctor.json'))['nvrtc']['arch'])" 2>/dev/null || echo sm_90)
run_step build build "$BUILD_LIMIT" "$PY" -m ds4py.cuda.compiler --json "$SCRATCH/ptxas.json" "$ARCH"

# one process on the one GPU: -o addopts= drops pyproject's `-n auto` (the machine has no pytest-xdist)
# name:limit of each GPU test file, most basic first (the runtime and the core kernels before the engine)
TESTS="tests/gpu/test_cuda_runtime.py:20 tests/gpu/test_kernels_core.py:20 tests/gpu/test_cuda_attn_moe.py:15
tests/gpu/test_gpu_mma.py:15 tests/gpu/test_gpu_rows.py:15 tests/gpu/test_gpu_engine.py:30 tests/gpu/test_gpu_spec.py:10
tests/gpu/test_gpu_v41.py:10 tests/gpu/test_gpu_dspark.py:10 tests/gpu/test_gpu_vq.py:15 tests/test_cu_emu_gpu.py:10"
for entry in $TESTS; do
  f=${entry%%:*}; limit=${entry##*:}; name=$(basename "$f" .py)
  run_step "$name" tests "$limit" "$PY" -m pytest "$f" -q -rs -o addopts= -p no:cacheprovider \
    --junitxml="$SCRATCH/$name.xml"
  if grep -Eq "$STICKY" "$SCRATCH/logs/$name.txt" 2>/dev/null; then
    run_step "${name}_blocking" tests "$limit" env CUDA_LAUNCH_BLOCKING=1 "$PY" -m pytest "$f" -q -rs -x \
      -o addopts= -p no:cacheprovider --junitxml="$SCRATCH/${name}_blocking.xml"
  fi
done

run_step cuda_decode bench 17 "$PY" bench/cuda_decode.py --tokens 32 --rows --kernel-times --json "$SCRATCH/cuda_decode.json"
run_step cuda_decode_v41 bench 35 "$PY" bench/cuda_decode.py --v41 --tokens 16 --prompt 8 \
  --engram-table "$SCRATCH/engram-table.bin" --json "$SCRATCH/cuda_decode_v41.json"
rm -f "$SCRATCH/engram-table.bin"                         # 138 MB: kept out of the archive
run_step cuda_prefill bench 13 "$PY" bench/cuda_prefill.py --json "$SCRATCH/cuda_prefill.json"
run_step gemv_bandwidth bench 10 "$PY" bench/gemv_bandwidth.py --json "$SCRATCH/gemv_bandwidth.json"
run_step attn_moe bench 8 "$PY" bench/attn_moe_bandwidth.py --json "$SCRATCH/attn_moe_bandwidth.json"

SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
for entry in memcheck:25 racecheck:25 synccheck:10; do
  tool=${entry%%:*}; limit=${entry##*:}
  if [ -n "$SAN" ] || [ "$PLAN" = 1 ]; then
    run_step "$tool" sanitizer "$limit" "$SAN" --tool "$tool" --error-exitcode 99 --print-limit 20 \
      "$PY" bench/sanitize_tiny.py
  elif [ "$DRY" = 1 ] && [ "$tool" = memcheck ]; then    # no sanitizer here: the workload still must reach the GPU
    run_step "$tool" sanitizer "$limit" "$PY" bench/sanitize_tiny.py
  elif wanted "$tool" sanitizer; then
    printf '%s\t%s\t\t0\t%s\t%s\n' "$tool" not_installed "$limit" "compute-sanitizer is not installed" >> "$STEPS_TSV"
    echo "== $tool: compute-sanitizer is not installed"
  fi
done
exit 0
