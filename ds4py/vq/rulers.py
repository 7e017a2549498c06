"""The seed's rulers (000 §4.5): how close a student's next-token distributions are to a teacher's.

    same_top1          share of rows where both argmaxes agree (lowest index on ties)
    sigma_min_*        per row Σ_v min(p_teacher(v), p_student(v)): mean, median, 5th percentile
    kl_mean            mean over rows of KL(teacher ‖ student) in nats
    ppl_ratio          exp(mean NLL_student − mean NLL_teacher) of the true next tokens (needs the ids)

Inputs are `score` outputs: float32 [T − P + 1, vocab], row j = logits after ids[P−1+j], so row j's target is
ids[P+j] for j < T − P (the last row has no target and counts only for the distribution rulers). Everything is
computed in float64, a block of rows at a time (memory-mapped inputs of any length).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4py.errors import Ds4Error

ROW_BLOCK = 256


class RulerError(Ds4Error):
    """Logits or ids that cannot be compared."""


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def check_inputs(teacher: np.ndarray, student: np.ndarray, ids: np.ndarray | None = None,
                 split: int | None = None) -> None:
    for what, a in (("teacher", teacher), ("student", student)):
        if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] < 2:
            raise RulerError(f"{what} logits must be a 2-D [rows, vocab] array, got shape {list(a.shape)}")
        if not np.issubdtype(a.dtype, np.floating):
            raise RulerError(f"{what} logits must be floating point, got {a.dtype}")
    if teacher.shape != student.shape:
        raise RulerError(f"teacher logits {list(teacher.shape)} and student logits {list(student.shape)} differ in shape")
    if (ids is None) != (split is None):
        raise RulerError("--ids and --split go together (the split places the targets)")
    if ids is not None:
        rows, vocab = teacher.shape
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise RulerError(f"ids must be a 1-D integer array, got {ids.dtype} {list(ids.shape)}")
        T = len(ids)
        if not 1 <= split <= T:
            raise RulerError(f"--split {split} is out of range: it must be between 1 and the number of ids ({T})")
        if T - split + 1 != rows:
            raise RulerError(f"--split {split} of {T} ids gives {T - split + 1} scored rows, but the logits have "
                             f"{rows} (score writes T - P + 1 rows)")
        tail = ids[split:]
        if len(tail) and (tail.min() < 0 or tail.max() >= vocab):
            raise RulerError(f"a target id is outside the logits' vocabulary (0..{vocab - 1})")


def rulers(teacher: np.ndarray, student: np.ndarray, ids: np.ndarray | None = None,
           split: int | None = None) -> dict[str, Any]:
    """The rulers of student against teacher (both [rows, vocab]); ppl_ratio only with ids and split."""
    check_inputs(teacher, student, ids, split)
    rows = teacher.shape[0]
    top1 = np.empty(rows, bool)
    smin = np.empty(rows)
    kl = np.empty(rows)
    n_targets = rows - 1 if ids is not None else 0
    nll_t = nll_s = 0.0
    for a in range(0, rows, ROW_BLOCK):
        b = min(a + ROW_BLOCK, rows)
        t, s = np.asarray(teacher[a:b]), np.asarray(student[a:b])
        if not (np.isfinite(t).all() and np.isfinite(s).all()):
            bad = a + int(np.argmin(np.isfinite(t).all(1) & np.isfinite(s).all(1)))
            raise RulerError(f"the logits hold NaN or inf (first in row {bad})")
        lt, ls = _log_softmax(t), _log_softmax(s)
        pt, ps = np.exp(lt), np.exp(ls)
        top1[a:b] = t.argmax(1) == s.argmax(1)
        smin[a:b] = np.minimum(pt, ps).sum(1)
        kl[a:b] = (pt * (lt - ls)).sum(1)
        if n_targets:
            r = np.arange(a, min(b, n_targets))
            tgt = ids[split + r]
            nll_t -= float(lt[r - a, tgt].sum())
            nll_s -= float(ls[r - a, tgt].sum())
    out: dict[str, Any] = dict(rows=rows, same_top1=float(top1.mean()), sigma_min_mean=float(smin.mean()),
                               sigma_min_median=float(np.median(smin)), sigma_min_p5=float(np.percentile(smin, 5)),
                               kl_mean=float(kl.mean()))
    if ids is not None:
        out["targets"] = n_targets
        out["ppl_ratio"] = float(np.exp((nll_s - nll_t) / n_targets)) if n_targets else None
    return out
