"""Host-side kernel wrappers, one module per kernel file in cu/ (core: rmsnorm, gemv, embed, argmax).

Each wrapper checks shapes and picks the launch geometry its kernel's comment documents; `rt` is a Runtime
(GPU) or an EmuRuntime (CPU emulator) — the same calls run on both.
"""

from ds4py.cuda.ops.core import *  # noqa: F401,F403
from ds4py.cuda.ops.core import Q8_0_BLOCK_BYTES, Q8_CHUNK_BLOCKS, Q8_STAGE_BYTES  # noqa: F401
