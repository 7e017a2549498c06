"""numpy twins of the CUDA kernels, one module per kernel file in cu/ (core: rmsnorm, gemv, embed, argmax)."""

from ds4py.cuda.twins.core import *  # noqa: F401,F403
from ds4py.cuda.twins.core import Q8_0_BYTES  # noqa: F401
