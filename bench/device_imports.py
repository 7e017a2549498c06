"""The device check's setup: every package the GPU path imports, checked before anything runs.

    python bench/device_imports.py VERSIONS.json      one line naming the first missing package, exit 1
    python bench/device_imports.py --carried-size REPO CARRY_DIR   what travels (< 64 MiB), exit 1 if over
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

# (module, distribution): what the GPU path and its tests import, outside the standard library
MODULES = [("numpy", "numpy"), ("cuda.bindings.driver", "cuda-bindings"), ("cuda.bindings.nvrtc", "cuda-bindings"),
           ("cuda.pathfinder", "cuda-pathfinder"), ("pytest", "pytest"), ("gguf", "gguf"), ("orjson", "orjson"),
           ("safetensors", "safetensors"), ("regex", "regex"), ("yaml", "pyyaml")]
DS4PY = ["ds4py.cuda.engine", "ds4py.cuda.runtime", "ds4py.cuda.doctor", "ds4py.ref.engine", "ds4py.convert",
         "ds4py.cuda.emu_runtime", "ds4py.tokenizer"]
CARRY_LIMIT = 64 << 20


def check_imports(out: str) -> int:
    versions = {"python": sys.version.split()[0], "executable": sys.executable}
    for mod, dist in MODULES:
        try:
            importlib.import_module(mod)
        except Exception as e:
            print(f"setup: missing Python package {dist} (import {mod}: {type(e).__name__}: {e}); add it to "
                  f"bench/device_carry.txt and rerun bench/device_wheels.sh")
            return 1
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "?"
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()       # loads libnvrtc from the nvidia-cuda-nvrtc wheel
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        print(f"setup: NVRTC cannot be loaded ({err}): package nvidia-cuda-nvrtc")
        return 1
    versions["nvrtc"] = f"{major}.{minor}"
    from ds4py.cuda.compiler import cuda_include_dir

    inc = cuda_include_dir()
    if inc is None:
        print("setup: the CUDA headers (cuda_fp16.h) are missing: package nvidia-cuda-runtime (or a CUDA toolkit)")
        return 1
    versions["cuda_include"] = inc
    for mod in DS4PY:
        try:
            importlib.import_module(mod)
        except Exception as e:
            print(f"setup: {mod} does not import: {type(e).__name__}: {e}")
            return 1
    from ds4py.ggml_types import FALLBACK

    versions["gguf_fallback"] = FALLBACK
    print("imports: " + ", ".join(f"{k} {v}" for k, v in versions.items() if k not in ("executable",)))
    Path(out).write_text(json.dumps(versions, indent=1))
    return 0


def carried_size(repo: str, carry: str) -> int:
    """What the device tool sends: tracked and untracked-not-ignored files, plus the carried folder."""
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True)
    if r.returncode != 0:
        print(f"carried size: not a git checkout ({r.stderr.decode().strip()})")
        return 1
    files = [Path(repo, f) for f in r.stdout.decode().split("\0") if f]
    tree = sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())
    extra = sum(p.stat().st_size for p in Path(carry).rglob("*") if p.is_file()) if os.path.isdir(carry) else 0
    total = tree + extra
    print(f"carried: working tree {tree / 2**20:.1f} MiB + {carry} {extra / 2**20:.1f} MiB = {total / 2**20:.1f} "
          f"MiB (limit {CARRY_LIMIT >> 20} MiB)")
    return 0 if total < CARRY_LIMIT else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--carried-size"]:
        sys.exit(carried_size(sys.argv[2], sys.argv[3]))
    sys.exit(check_imports(sys.argv[1]))
