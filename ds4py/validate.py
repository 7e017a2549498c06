"""Cheap checks of a GGUF's weight values at load, so that a corrupt file is one sentence at start-up and not a
"logits contain NaN" (or plain noise) at the first request.

Never a scan of the whole file (80 GB): only
  * small float tensors (norms, biases, sinks, hyper-connection scales and bases, up to SMALL_ELEMS values),
    decoded in full: finite, and norm gains within a plausible range;
  * a few rows of every other tensor (first, middle, last), decoded: finite;
  * every F16 / BF16 matrix's sample: its magnitudes must look like weights in the type it is labelled with
    (see _label_mismatch: a tensor relabelled F16 <-> BF16 keeps its bytes and reads as garbage);
  * the stored checksums (ds4py.checksum): the metadata's, and the smallest tensors' up to CHECKSUM_BUDGET bytes.
`python -m ds4py inspect --verify` checks every checksum.
"""

from __future__ import annotations

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py import checksum
from ds4py.errors import GGUFError

SMALL_ELEMS = 1 << 20                 # decoded in full
SAMPLE_ROWS = 3
CHECKSUM_BUDGET = 64 << 20
CHECKSUM_MAX_TENSOR = 16 << 20
NORM_RANGE = (1e-4, 1e4)              # median |gain| of an RMSNorm weight
MAX_ABS = 1e6                         # any small float tensor (hc scales, biases, sinks, ape)
FLOATS = (Q.F32, Q.F16, Q.BF16, Q.F64)
# log2-magnitude spread of a trained weight matrix's values: ~1.6 for Gaussian values, ~1.9 Laplacian; an F16
# matrix read as BF16 spreads over ~13 octaves, a BF16 one read as F16 collapses into [0.5, 2) (spread < 0.5)
SPREAD_RANGE = (0.8, 6.0)
SPREAD_MIN_VALUES = 4096


def check_weights(f) -> None:
    """GGUFError naming the first tensor whose sampled values are not finite or not plausible, else the first whose
    checksum does not match. (The checksums on a second thread while the values are sampled: no gain on a loaded
    2-core host, median open wall 0.57 vs 0.46 s at load 8, bench/cpu_memory.py --open-only: one thread.)"""
    _check_values(f)
    checksum.verify_metadata(f)
    checksum.verify(f, max_tensor_bytes=CHECKSUM_MAX_TENSOR, budget_bytes=CHECKSUM_BUDGET)


def _check_values(f) -> None:
    for t in f.tensors.values():
        if t.qtype in (Q.I8, Q.I16, Q.I32, Q.I64):
            continue
        n = int(np.prod(t.shape, dtype=np.int64))
        if t.qtype in FLOATS and n <= SMALL_ELEMS:
            x = _decode(t, None)
            _check_small(f, t, x)
        else:
            x = _decode(t, _sample_rows(t))
            if not np.isfinite(x).all():
                raise GGUFError(f"{f.path}: tensor {t.name!r} holds NaN or infinite values (in the rows sampled at "
                                f"load): the file is corrupt")
        if t.qtype in (Q.F16, Q.BF16) and len(t.shape) >= 2 and t.name.endswith(".weight"):
            why = _label_mismatch(t)
            if why:
                raise GGUFError(f"{f.path}: tensor {t.name!r} is labelled {t.qtype.name} but {why}: was it written "
                                f"in another type and relabelled?")


def _check_small(f, t, x: np.ndarray) -> None:
    if not x.size:
        return
    hi, lo = float(x.max()), float(x.min())          # NaN propagates through both; no temporary arrays
    if not (np.isfinite(hi) and np.isfinite(lo)):
        raise GGUFError(f"{f.path}: tensor {t.name!r} holds NaN or infinite values: the file is corrupt")
    amax = max(abs(hi), abs(lo))
    if amax > MAX_ABS:
        raise GGUFError(f"{f.path}: tensor {t.name!r} holds a value of magnitude {amax:.3g}, far beyond any "
                        f"weight (> {MAX_ABS:g}): the file is corrupt or a tensor was relabelled")
    if t.name.endswith("norm.weight"):
        med = float(np.median(np.abs(x)))
        lo, hi = NORM_RANGE
        if not lo <= med <= hi:
            raise GGUFError(f"{f.path}: norm weight {t.name!r} has median |gain| {med:.3g}, outside the plausible "
                            f"{lo:g}..{hi:g}: the file is corrupt or the tensor was relabelled")


def _sample_rows(t) -> np.ndarray:
    rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
    # sorted(set()), not np.unique: numpy 2's unique imports numpy.ma on first use (~10 ms of CPU at the open)
    return np.array(sorted({min(max(r, 0), max(rows - 1, 0)) for r in (0, rows // 2, rows - 1)[:SAMPLE_ROWS]}),
                    dtype=np.int64)


def _decode(t, rows: np.ndarray | None) -> np.ndarray:
    """The values of the whole tensor (rows None) or of some of its rows (flattened leading dims): float32 (F64
    as itself; F32 the mapped values themselves: a check reads them, it need not copy them)."""
    from ds4py.quant import dequantize

    if t.qtype in (Q.F32, Q.F16, Q.F64):
        flat = np.asarray(t.raw).reshape(-1, t.shape[-1])
        sel = flat if rows is None else flat[rows]
        return sel.astype(np.float32) if sel.dtype == np.float16 else sel
    raw = t.raw_bytes().reshape(-1, t.raw_bytes().shape[-1])
    sel = raw if rows is None else raw[rows]
    return dequantize(np.ascontiguousarray(sel), t.qtype, (sel.shape[0], t.shape[-1]))


def _spread(bits: np.ndarray, as_bf16: bool) -> tuple[float, float] | None:
    """(std of log2 |x|, fraction of negative values) of the non-zero values, read as BF16 or F16."""
    x = (bits.astype(np.uint32) << 16).view(np.float32) if as_bf16 else bits.view(np.float16).astype(np.float32)
    x = x[np.isfinite(x) & (x != 0)].astype(np.float64)
    return (float(np.std(np.log2(np.abs(x)))), float((x < 0).mean())) if x.size >= SPREAD_MIN_VALUES else None


def _label_mismatch(t) -> str | None:
    """Why a weight matrix's sampled values look like the other 2-byte float type, or None. Flagged only when the
    swapped reading is plausible and the labelled one is not: spread over far too many octaves (F16 read as
    BF16), or collapsed into one octave while the values have both signs (BF16 read as F16: a weight matrix has
    both; a narrow range of positive values, such as gains, is left alone)."""
    raw = t.raw.view(np.uint16) if t.qtype == Q.F16 else t.raw_bytes().view(np.uint16)
    flat = raw.reshape(-1, raw.shape[-1])
    k = min(flat.shape[0], max(1, 4 * SPREAD_MIN_VALUES // flat.shape[1]))     # ~16k values, evenly spaced rows
    bits = flat[np.linspace(0, flat.shape[0] - 1, k).astype(np.int64)].reshape(-1)
    a, b = _spread(bits, as_bf16=t.qtype == Q.BF16), _spread(bits, as_bf16=t.qtype != Q.BF16)
    lo, hi = SPREAD_RANGE
    if a is None or b is None or not lo <= b[0] <= hi:
        return None
    (mine, negative), other = a, b[0]
    if not (mine > hi or (mine < lo and 0.2 <= negative <= 0.8)):
        return None
    alt = "F16" if t.qtype == Q.BF16 else "BF16"
    return (f"its values' magnitudes spread over {mine:.1f} octaves (trained weights: {lo:g}..{hi:g}); read as "
            f"{alt} they spread over {other:.1f}")
