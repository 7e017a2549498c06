"""Host-side kernel wrappers, one module per kernel file in cu/ (core: the checks and sizing they share).

Each wrapper checks shapes and picks the launch geometry its kernel's comment documents; `rt` is a Runtime
(GPU) or an EmuRuntime (CPU emulator) — the same calls run on both. A module's DEFINES table holds its kernel
file's geometry constants (compiled in with -D; see ds4py/cuda/compiler.py).

The names below are the functions (ops.gemv is the function gemv, not the module) and the structs they take:
take a module's constants from its path, `from ds4py.cuda.ops.gemv import DEFINES`.
"""

from ds4py.cuda.ops.argmax import ArgmaxParts, argmax  # noqa: F401
from ds4py.cuda.ops.embed import Embedding, embed  # noqa: F401
from ds4py.cuda.ops.gemv import GemvX, SwiGlu, gemv, gemv_f16, gemv_hc_post, gemv_q8_0, gemv_swiglu  # noqa: F401
from ds4py.cuda.ops.mhc import HcResidual, HcRows, hc_collapse_norm, hc_mix, hc_post  # noqa: F401
from ds4py.cuda.ops.rmsnorm import rmsnorm  # noqa: F401
from ds4py.cuda.ops.sample import SampleRows, SampleRule, sample  # noqa: F401
