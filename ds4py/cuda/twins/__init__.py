"""numpy twins of the CUDA kernels, one module per kernel file in cu/ (core: the tolerance and format helpers).
Each twin calls ds4py/ref/ops.py for the math (one reference) and adds only the kernel's layout and rounding."""

from ds4py.cuda.twins.argmax import argmax  # noqa: F401
from ds4py.cuda.twins.core import (Q8_0_BYTES, assert_close_scaled, dequant_q8_0, q8_0_matrix,  # noqa: F401
                                   quant_q8_0, weight_values)
from ds4py.cuda.twins.embed import embed, embed_f16  # noqa: F401
from ds4py.cuda.twins.rmsnorm import rmsnorm  # noqa: F401


def gemv_f16(W, x):
    """y = W x for an F16 matrix (the old two-argument form, used by the runtime tests and the bench)."""
    from ds4py.cuda.twins.gemv import gemv

    return gemv(W, x, W.shape[0], W.shape[1])


def gemv_q8_0(raw, x, rows, cols):
    from ds4py.cuda.twins.gemv import gemv

    return gemv(raw, x, rows, cols)
