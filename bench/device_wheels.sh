#!/usr/bin/env bash
# Fill .device/ — what travels with the device check besides the repository (`carry: [".device"]`):
#   .device/wheels   the packages the GPU machine's Python 3.12 lacks (bench/device_carry.txt), as wheels
#   .device/golden   the golden data the GPU tests read: ds4-tiny's GGUF, the v4-tiny and v4-tiny-mtp checkpoints,
#                    and of v4-tiny-mtp/cases.npz only the four arrays tests/gpu/test_gpu_spec.py reads; v41-tiny's
#                    checkpoint (its Engram tables inside) and the cases.npz arrays tests/gpu/test_gpu_v41.py reads;
#                    v41-tiny-dspark's checkpoint and the case-a arrays tests/gpu/test_gpu_dspark.py reads
#
#   bash bench/device_wheels.sh                 (network to PyPI; golden from ../shared/golden or $DS4PY_GOLDEN_SRC)
#   bash bench/device_wheels.sh --env [DIR]     also the GPU machine's own packages (bench/device_packages.txt) for
#                                               the dry run's venv, into DIR (default ~/.cache/ds4py/device-env/cp312)
# Downloads are cached under ~/.cache/ds4py/device-env (a second run with the same lists downloads nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CARRY="${DS4PY_CARRY_DIR:-$REPO/.device}"
CACHE="${DS4PY_DEVICE_ENV_DIR:-$HOME/.cache/ds4py/device-env}"
ENV_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --env) ENV_DIR="${2:-}"; if [ -n "$ENV_DIR" ] && [ "${ENV_DIR#--}" = "$ENV_DIR" ]; then shift; else ENV_DIR="$CACHE/cp312"; fi ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "device_wheels: unknown argument $1"; exit 2 ;;
  esac
  shift
done
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
pins() { grep -v '^\s*#' "$1" | sed 's/#.*//' | awk 'NF {print $1}'; }
# download LIST DIR [--no-deps]: wheels for CPython 3.12 on x86-64 Linux, cached by the list's content
download() {
  local list=$1 dir=$2; shift 2
  local key; key=$(cat "$list" | sha256sum | cut -c1-16)
  if [ -f "$dir/.complete-$key" ]; then echo "$dir: up to date"; return 0; fi
  rm -rf "$dir"; mkdir -p "$dir"
  # shellcheck disable=SC2086
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d "$dir" "$@" $(pins "$list")
  touch "$dir/.complete-$key"
}

mkdir -p "$CARRY" "$CACHE"

download bench/device_carry.txt "$CACHE/carry-cp312" --no-deps
rm -rf "$CARRY/wheels"; mkdir -p "$CARRY/wheels"
cp "$CACHE"/carry-cp312/*.whl "$CARRY/wheels/"
echo "wheels: $(ls "$CARRY/wheels" | tr '\n' ' ')"

SRC="${DS4PY_GOLDEN_SRC:-$REPO/../shared/golden}"
if [ -d "$SRC" ]; then
  G="$CARRY/golden"
  rm -rf "$G"; mkdir -p "$G/ds4-tiny" "$G/v4-tiny" "$G/v4-tiny-mtp" "$G/v41-tiny" "$G/v41-tiny-dspark"
  cp "$SRC/ds4-tiny/tiny.gguf" "$G/ds4-tiny/"
  for d in v4-tiny v4-tiny-mtp v41-tiny v41-tiny-dspark; do
    cp "$SRC/$d/config.json" "$SRC/$d/model.safetensors" "$G/$d/"
    [ -f "$SRC/$d/config_checkpoint.json" ] && cp "$SRC/$d/config_checkpoint.json" "$G/$d/"
  done
  chmod -R u+w "$G"
  python3 - "$SRC/v4-tiny-mtp/cases.npz" "$G/v4-tiny-mtp/cases.npz" <<'PY'
import sys
import numpy as np
keys = ("a_ids", "a_P", "a_main_hc_state", "a_mtp_prefill_logits")   # what tests/gpu/test_gpu_spec.py reads
g = np.load(sys.argv[1])
np.savez(sys.argv[2], **{k: g[k] for k in keys})
PY
  python3 - "$SRC/v41-tiny/cases.npz" "$G/v41-tiny/cases.npz" <<'PY'
import sys
import numpy as np
keys = ("a_ids", "a_P", "a_prefill_last_logits_fp32_fixed", "a_decode_logits_fp32_fixed", "b_ids",
        "b_prefill_last_logits_fp32_fixed", "b_decode_logits_fp32_fixed", "c_ids")   # tests/gpu/test_gpu_v41.py
g = np.load(sys.argv[1])
np.savez(sys.argv[2], **{k: g[k] for k in keys})
PY
  python3 - "$SRC/v41-tiny-dspark/cases.npz" "$G/v41-tiny-dspark/cases.npz" <<'PY'
import sys
import numpy as np
s = "_fp32_fixed_noquant"                  # what tests/gpu/test_gpu_dspark.py reads (0.35 MB)
keys = ("a_ids", "a_P", "a_main_hidden_start", "a_main_hidden" + s, "a_draft_positions", "a_draft_input_ids" + s,
        "a_draft_output_ids" + s, "a_draft_logits" + s, "a_draft_confidence" + s)
g = np.load(sys.argv[1])
np.savez(sys.argv[2], **{k: g[k] for k in keys})
PY
  echo "golden subset: $(du -sh "$G" | cut -f1) in $G"
else
  echo "no golden data at $SRC: the GPU tests that need it will skip, saying so"
fi

if [ -n "$ENV_DIR" ]; then
  download bench/device_packages.txt "$ENV_DIR"
  echo "the GPU machine's packages for the dry run: $(ls "$ENV_DIR" | wc -l) wheels in $ENV_DIR"
fi
du -sh "$CARRY"
