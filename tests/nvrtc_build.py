"""Every cu/*.cu compiled by NVRTC for NVRTC_ARCHS into a fresh cache, in a child process (nothing the test process
monkeypatches can reach it): the session fixture `nvrtc_kernels` (tests/conftest.py) runs it once per run, in the
foreground, when a test asks for it (tests/test_cuda_compile.py; tests/test_cuda_driverless.py reuses its cache)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# sm_90a is not a pass of its own: compile_all targets it (source_arch) for exactly the sources marked
# `// ds4py: arch-specific`, so the sm_90 pass already compiles every file the way a Hopper GPU loads it
NVRTC_ARCHS = ("sm_121", "sm_90")
NO_NVRTC = 3      # the child's exit status when NVRTC cannot load (the message on stdout)


def nvrtc_kernels(work: Path) -> dict:
    """{"cache": Path, "compiled": {arch: {stem: CompiledModule}}} for every kernel file and arch, compiled by
    compiler.compile_all into work/ds4py-cache. Raises NvrtcUnavailableError when NVRTC cannot load."""
    from ds4py.cuda import compiler

    cache, out = work / "ds4py-cache", work / "compiled.pickle"
    # one file at a time (DS4PY_NVRTC_JOBS=1): concurrent NVRTC compiles in one process were seen to give a kernel
    # one register more or less from run to run (indexer_scores 55 / 56, moe_gate_up_i8_iq2_xxs, both sm_90), while
    # sequential builds agree with each other and with the committed tables (resources / sass --write from such a
    # build)
    r = subprocess.run([sys.executable, __file__, str(REPO / "cu"), str(cache), str(out), *NVRTC_ARCHS],
                       capture_output=True, text=True, timeout=3600,
                       env={**os.environ, "PYTHONPATH": str(REPO), "DS4PY_NVRTC_JOBS": "1"})
    if r.returncode == NO_NVRTC:
        raise compiler.NvrtcUnavailableError(r.stdout.strip())
    if r.returncode != 0:
        raise RuntimeError(f"the NVRTC build failed (exit {r.returncode}):\n{r.stdout[-4000:]}{r.stderr[-6000:]}")
    return {"cache": cache, "compiled": pickle.loads(out.read_bytes())}


def _child(cu: str, cache: str, out: str, *archs: str) -> int:
    sys.path.insert(0, str(REPO))
    from ds4py.cuda import compiler

    try:
        compiler.nvrtc_version()
    except compiler.NvrtcUnavailableError as e:
        print(e)
        return NO_NVRTC
    compiled = {a: compiler.compile_all(a, Path(cu), cache=Path(cache), progress=lambda m: None) for a in archs}
    Path(out).write_bytes(pickle.dumps(compiled))
    return 0


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:]))
