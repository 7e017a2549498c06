"""The GGML tensor type codes and block sizes, with or without the `gguf` package.

Reading a model needs only these two tables. They come from `gguf` when it is installed (the same enum objects
everywhere, so values from `gguf.GGUFReader` compare equal); without it (a GPU machine with a fixed package set,
where only writing GGUF files — convert, make-tiny — needs the package) the table below, copied from the GGUF
specification's type list (gguf-py 0.19: gguf/constants.py), stands in. tests/test_gguf.py checks the two agree.
"""

from __future__ import annotations

from enum import IntEnum

try:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
except ImportError:                    # reading only: the spec's codes, (elements, bytes) per block
    _TYPES = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
              "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q8_1": (9, 32, 40), "Q2_K": (10, 256, 84),
              "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
              "Q8_K": (15, 256, 292), "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98),
              "IQ1_S": (19, 256, 50), "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110), "IQ2_S": (22, 256, 82),
              "IQ4_XS": (23, 256, 136), "I8": (24, 1, 1), "I16": (25, 1, 2), "I32": (26, 1, 4), "I64": (27, 1, 8),
              "F64": (28, 1, 8), "IQ1_M": (29, 256, 56), "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54),
              "TQ2_0": (35, 256, 66), "MXFP4": (39, 32, 17)}
    GGMLQuantizationType = IntEnum("GGMLQuantizationType", {k: v[0] for k, v in _TYPES.items()})  # type: ignore[misc]
    GGML_QUANT_SIZES = {GGMLQuantizationType[k]: v[1:] for k, v in _TYPES.items()}

FALLBACK = GGMLQuantizationType.__module__ == __name__     # True when `gguf` is not installed

__all__ = ["GGML_QUANT_SIZES", "GGMLQuantizationType", "FALLBACK"]
