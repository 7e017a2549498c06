#!/usr/bin/env bash
# The dry run's Python: a clean venv of Python 3.12 (the GPU machine's) holding only bench/device_packages.txt,
# installed with pip --no-index from the wheels bench/device_wheels.sh --env downloaded. Made once per package
# list and interpreter under ~/.cache/ds4py/device-env/ and linked at DEST (bench/device_check.sh --dry-run).
#   bash bench/device_venv.sh DEST
# Without any Python 3.12 here, the local python3 is used and the wheels must be for it: the run says so.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$1
CACHE="${DS4PY_DEVICE_ENV_DIR:-$HOME/.cache/ds4py/device-env}"
WHEELS="${DS4PY_DEVICE_ENV_WHEELS:-$CACHE/cp312}"
py312() {
  local c
  for c in "${DS4PY_PY312:-}" python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 \
           /usr/local/bin/python3.12 "$(uv python find 3.12 2>/dev/null || true)"; do
    [ -n "$c" ] && "$c" -c 'import sys, venv, ensurepip; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
      && { command -v "$c" || echo "$c"; return 0; }
  done
  return 1
}
if PY=$(py312); then
  echo "dry-run interpreter: $PY ($("$PY" -V 2>&1), as on the GPU machine)"
else
  PY=$(command -v python3)
  echo "dry-run interpreter: no Python 3.12 here; using $PY ($("$PY" -V 2>&1)) with wheels for it (DS4PY_DEVICE_ENV_WHEELS)"
fi
[ -d "$WHEELS" ] || { echo "no wheels at $WHEELS: run bash bench/device_wheels.sh --env first"; exit 1; }
key=$( (cat bench/device_packages.txt; "$PY" -VV; ls "$WHEELS") | sha256sum | cut -c1-16)
VENV="$CACHE/venv-$key"
if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # no index, no pip.conf: only these wheels can be installed
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q --no-index --disable-pip-version-check \
    --find-links "$WHEELS" $(grep -v '^\s*#' bench/device_packages.txt | sed 's/#.*//' | awk 'NF {print $1}')
  touch "$VENV/.complete"
fi
rm -rf "$DEST"
ln -s "$VENV" "$DEST"
echo "venv: $VENV: $("$VENV/bin/python" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null | tr '\n' ' ')"
