"""Twin of cu/argmax.cu: numpy.argmax (the first NaN if any, else the lowest index of the maximum)."""

from __future__ import annotations

import numpy as np


def argmax(x: np.ndarray) -> int:
    return int(np.argmax(np.asarray(x, np.float32)))
