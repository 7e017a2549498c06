"""`posttrain-fit` (seed 000 §4.3): "at this position the model should have written a, not b" as linear equations
on the last layer's expert gains, solved together while every other position is pinned; stored as a third gain
table (the sidecar's format, stacked on the sidecar it was solved against).

Margin of row i: m_i = ℓ_a − ℓ_b. With the final collapse weights pre (hc_head) and the output RMSNorm factor
inv_i held fixed, a change Δ of the last MoE block's output moves it by

    Δm_i = inv_i · α_i · Σ_d γ_d (W_a − W_b)_d Δ_d,     α_i = Σ_j pre_ij · post_ij (post: the block's hc_post)
    Δ_i  = Σ_k (s_{e_ik} − 1) ⊙ q_ik                    (q: each routed expert's weighted output, as captured)

so Δm = R d is linear in d = s − 1 [X, D]. Decision rows (target ≥ 0; a = the target, b = the strongest other
token) ask Δm_i = τ − m_i; constraint rows (every other position; a, b = its top-1 and top-2) ask Δm = 0 with
weight ρ; a ridge λ. Solved matrix-free by conjugate gradient with a Jacobi preconditioner; FP4-aware: the
solution is projected onto the lattice, the margins re-predicted with the stored values, and decision rows that
fell below τ get more weight in the next solve. Every row is captured on the path that makes its decision
(prefill rows through prefill, generated rows through decode), and the candidate is checked by a real forward on
the same path before it is kept; one that fails a gate goes to rejected/, never deleted.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.quant import vq
from ds4py.ref import ops
from ds4py.vq import sidecar as fmt
from ds4py.vq.sidecar_capture import PathCapture, capture_path

F32 = np.float32


class PosttrainError(Ds4Error):
    """posttrain-fit cannot run on these inputs."""


@dataclass(frozen=True)
class Options:
    margin: float = 1.0                 # τ: the margin a decision point should reach (logits)
    rho: float = 1.0                    # weight of the constraint rows
    ridge: float = 1e-3                 # λ, relative to the mean diagonal of the data term
    rounds: int = 4                     # FP4 active-set rounds
    boost: float = 4.0                  # weight factor for a decision row that fell back below τ
    cg_iters: int = 500
    cg_tol: float = 1e-6                # relative residual of the normal equations
    min_flip: float = 0.5               # gate: share of decision rows whose argmax becomes the target
    min_keep: float = 0.95              # gate: share of other rows that keep their top-1


@dataclass
class Rows:
    """The linear system's rows: Δm = G·d[idx] (summed over slots), targets, weights."""
    G: np.ndarray                       # [N, k, D] coefficient of d[idx[n, j]] in row n
    idx: np.ndarray                     # [N, k]
    rhs: np.ndarray                     # [N] wanted Δm
    weight: np.ndarray                  # [N]
    m0: np.ndarray                      # [N] margins now
    decision: np.ndarray                # bool [N]


def margin_rows(model, cap: PathCapture, targets: np.ndarray, opts: Options) -> tuple[Rows, np.ndarray]:
    """The rows of every position (decision or constraint) and the b token of each."""
    cfg, B, w = model.config, model.binding, model.weights
    lc = cap.layer
    X = cap.hc
    pre = ops.sigmoid(ops.hc_mixes(X, w.get(B.hc_head.fn), cfg.norm_eps) * w.get(B.hc_head.scale)[0]
                      + w.get(B.hc_head.base)) + F32(cfg.hc_eps)              # hc_head's collapse weights
    alpha = (pre * lc.post).sum(1)
    y = ops.hc_head(X, w.get(B.hc_head.fn), w.get(B.hc_head.scale), w.get(B.hc_head.base), cfg.norm_eps,
                    cfg.hc_eps)
    inv = 1 / np.sqrt(np.mean(y.astype(np.float64) ** 2, 1) + cfg.norm_eps)
    gamma = w.get(B.output_norm)
    logits = cap.logits.astype(np.float64)
    decision = targets >= 0
    order = np.argsort(-logits, 1, kind="stable")[:, :2]
    a = np.where(decision, targets, order[:, 0])
    top_other = np.where(order[:, 0] == a, order[:, 1], order[:, 0])       # the strongest token that is not a
    b = top_other
    m0 = logits[np.arange(len(a)), a] - logits[np.arange(len(a)), b]
    toks = np.unique(np.concatenate([a, b]))
    W = w.rows(B.head, toks).astype(np.float64)
    pos = {int(t): i for i, t in enumerate(toks)}
    dW = W[[pos[int(t)] for t in a]] - W[[pos[int(t)] for t in b]]
    c = (inv * alpha)[:, None] * gamma[None] * dW                             # [N, D]
    G = (c[:, None, :] * lc.parts).astype(F32)
    rhs = np.where(decision, np.maximum(opts.margin - m0, 0), 0.0)
    weight = np.where(decision, 1.0, opts.rho)
    return Rows(G, lc.idx, rhs, weight, m0, decision), b


class System:
    """min_d Σ_n w_n (Σ_j G_nj · d[idx_nj] − rhs_n)² + ridge Σ d²  (d [X, D]), matrix-free."""

    def __init__(self, rows: Rows, X: int):
        self.r, self.X = rows, X
        N, k, D = rows.G.shape
        flat = rows.idx.reshape(-1)
        self.order = np.argsort(flat, kind="stable")
        self.experts, self.starts = np.unique(flat[self.order], return_index=True)
        self.Gflat = rows.G.reshape(N * k, D)[self.order]
        self.row_of = (np.arange(N * k) // k)[self.order]
        self.D = D

    def apply(self, d: np.ndarray) -> np.ndarray:
        """R d: [N]."""
        return np.einsum("nkd,nkd->n", self.r.G, d[self.r.idx], dtype=np.float64)

    def apply_t(self, u: np.ndarray) -> np.ndarray:
        """Rᵀ u: [X, D]."""
        out = np.zeros((self.X, self.D))
        contrib = self.Gflat * u[self.row_of][:, None]
        out[self.experts] = np.add.reduceat(contrib, self.starts, axis=0)
        return out

    def diag(self, weight: np.ndarray) -> np.ndarray:
        out = np.zeros((self.X, self.D))
        contrib = self.Gflat.astype(np.float64) ** 2 * weight[self.row_of][:, None]
        out[self.experts] = np.add.reduceat(contrib, self.starts, axis=0)
        return out

    def solve(self, weight: np.ndarray, ridge_rel: float, x0: np.ndarray, iters: int, tol: float) -> tuple[np.ndarray, np.ndarray, int]:
        """Preconditioned CG on (Rᵀ W R + λ I) d = Rᵀ W rhs; returns (d, the diagonal, iterations)."""
        dg = self.diag(weight)
        lam = ridge_rel * (float(dg[dg > 0].mean()) if (dg > 0).any() else 1.0)
        M = dg + lam
        A = lambda v: self.apply_t(weight * self.apply(v)) + lam * v          # noqa: E731
        b = self.apply_t(weight * self.r.rhs)
        x = x0.astype(np.float64).copy()
        r = b - A(x)
        z = r / M
        p = z.copy()
        rz = float((r * z).sum())
        bn = float(np.sqrt((b * b).sum())) or 1.0
        it = 0
        for it in range(1, iters + 1):
            Ap = A(p)
            step = rz / float((p * Ap).sum())
            x += step * p
            r -= step * Ap
            if np.sqrt((r * r).sum()) < tol * bn:
                break
            z = r / M
            rz, rz_old = float((r * z).sum()), rz
            p = z + (rz / rz_old) * p
        return x, M, it


def evaluate(logits: np.ndarray, base_top1: np.ndarray, targets: np.ndarray) -> dict:
    top1 = logits.argmax(1)
    dec = targets >= 0
    return {"flipped": float((top1[dec] == targets[dec]).mean()) if dec.any() else 0.0,
            "kept": float((top1[~dec] == base_top1[~dec]).mean()) if (~dec).any() else 1.0,
            "decision_rows": int(dec.sum()), "other_rows": int((~dec).sum())}


def load_targets(targets: np.ndarray, T: int, split: int) -> np.ndarray:
    """Targets per position [T]: given as T entries (position t = the distribution after ids[t]) or as the
    T − split + 1 rows `score` writes (row j = position split − 1 + j); −1 = not a decision point."""
    t = np.asarray(targets)
    if t.ndim != 1 or not np.issubdtype(t.dtype, np.integer):
        raise PosttrainError(f"--targets must be a 1-D integer array, got {t.dtype} {list(t.shape)}")
    if len(t) == T:
        return t.astype(np.int64)
    if len(t) == T - split + 1:
        return np.concatenate([np.full(split - 1, -1), t]).astype(np.int64)
    raise PosttrainError(f"--targets has {len(t)} entries; expected {T} (one per position) or {T - split + 1} "
                         f"(one per score row of --split {split})")


def fit_posttrain(base: str, sidecar: str | None, ids: np.ndarray, split: int, targets: np.ndarray,
                  opts: Options = Options(), progress: Callable[[str], None] | None = None
                  ) -> tuple[fmt.Sidecar, dict]:
    """Solve a post-training gain table for the last layer; returns (candidate, report with the real-forward
    check). The caller keeps or rejects it (`keep_or_reject`)."""
    from ds4py.ref.engine import RefModel

    say = progress or (lambda _m: None)
    t_all = time.perf_counter()
    model = RefModel(base, sidecar=sidecar)
    cfg = model.config
    ids = np.asarray(ids, np.int64)
    T = len(ids)
    if not 1 <= split <= T:
        raise PosttrainError(f"--split {split} is out of range: it must be between 1 and the number of ids ({T})")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise PosttrainError(f"a token id is outside the vocabulary (0..{cfg.vocab_size - 1})")
    tg = load_targets(targets, T, split)
    if (tg >= cfg.vocab_size).any():
        raise PosttrainError(f"a target is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if not (tg >= 0).any():
        raise PosttrainError("--targets marks no decision point (every entry is negative)")
    last = cfg.n_layers - 1
    if not vq.is_vq(model.gguf, fmt.down_name(last)):
        raise PosttrainError(f"the base {base} has no VQ-8 experts in its last layer {last}: post-training gains "
                             f"rescale VQ row gains")
    t0 = time.perf_counter()
    cap = capture_path(model, ids, split, last)
    say(f"captured {T} positions ({split} through prefill, {T - split} through decode) in "
        f"{time.perf_counter() - t0:.1f} s")
    rows, b = margin_rows(model, cap, tg, opts)
    X = cfg.n_experts
    system = System(rows, X)
    base_top1 = cap.logits.argmax(1)
    before = evaluate(cap.logits, base_top1, tg)
    say(f"{before['decision_rows']} decision points ({before['flipped']:.1%} already right), "
        f"{before['other_rows']} constraint rows; unknowns {X} x {cfg.dim}")

    weight = rows.weight.copy()
    d = np.zeros((X, cfg.dim))
    best = None
    t0 = time.perf_counter()
    for rnd in range(opts.rounds):
        d, M, iters = system.solve(weight, opts.ridge, d, opts.cg_iters, opts.cg_tol)
        blocks = fmt.fp4_project(d, M)
        dq = fmt.fp4_decode(blocks).astype(np.float64)
        m = rows.m0 + system.apply(dq)
        pred_flip = float(np.mean(m[rows.decision] > 0))
        pred_keep = float(np.mean(m[~rows.decision] > 0)) if (~rows.decision).any() else 1.0
        fell = rows.decision & (m < opts.margin)
        say(f"round {rnd + 1}: CG {iters} iterations; predicted with the FP4 values: {pred_flip:.1%} of decision "
            f"points ahead, {pred_keep:.1%} of other rows keep top-1/top-2 order; {int(fell.sum())} below the margin")
        score = (pred_flip, pred_keep)
        if best is None or score > best[0]:
            best = (score, blocks, m)
        if not fell.any():
            break
        weight = np.where(fell, weight * opts.boost, weight)
    solve_s = time.perf_counter() - t0
    _, blocks, m_pred = best
    on = ({"kind": "sidecar", "fingerprint": model.stack.sidecar.fingerprint, "base_fingerprint": model.base_fingerprint,
           "name": os.path.basename(os.path.normpath(sidecar))} if model.stack is not None
          else {"kind": "base", "fingerprint": model.base_fingerprint, "base_fingerprint": model.base_fingerprint,
                "name": os.path.basename(base)})
    cand = fmt.Sidecar("posttrain", on, {"n_layers": cfg.n_layers, "n_experts": X, "dim": cfg.dim},
                       {last: fmt.LayerEdit(gain_blocks=blocks)},
                       meta={"solver": {"tool": "ds4py posttrain-fit", **asdict(opts)},
                             "requests": {"tokens": T, "split": split, "decision_points": int((tg >= 0).sum())}})

    # the real forward on the same path, with the candidate mounted
    t0 = time.perf_counter()
    check = RefModel(base, sidecar=sidecar, posttrain=cand)
    real = capture_path(check, ids, split, last)
    after = evaluate(real.logits, base_top1, tg)
    lg = real.logits.astype(np.float64)
    n = np.arange(T)
    a = np.where(tg >= 0, tg, base_top1)
    m_real = lg[n, a] - lg[n, b]
    # how well the linear model predicted the real margin changes, over every row
    dp, dr = m_pred - rows.m0, m_real - rows.m0
    corr = float(np.corrcoef(dp, dr)[0, 1]) if dp.std() > 0 and dr.std() > 0 else float("nan")
    report = {"before": before, "after": after, "predicted_margin_corr": corr, "solve_s": solve_s,
              "check_s": time.perf_counter() - t0, "total_s": time.perf_counter() - t_all,
              "gates": {"min_flip": opts.min_flip, "min_keep": opts.min_keep}}
    report["passed"] = bool(after["flipped"] >= opts.min_flip and after["kept"] >= opts.min_keep)
    cand.layers[last].info = {"flipped": after["flipped"], "kept": after["kept"],
                              "flipped_before": before["flipped"], "predicted_margin_corr": corr}
    say(f"real forward: {after['flipped']:.1%} of decision points flipped to their target (before "
        f"{before['flipped']:.1%}), {after['kept']:.1%} of other rows keep their top-1; predicted vs real margin "
        f"change: correlation {corr:.4f} (mean |change| {np.abs(dr).mean():.3f} real, {np.abs(dp).mean():.3f} "
        f"predicted)")
    return cand, report


def keep_or_reject(cand: fmt.Sidecar, report: dict, out_dir: str) -> str:
    """Write a candidate that passed its gates to out_dir; one that failed goes to rejected/ beside it (with
    gate.json saying why). Returns the directory written."""
    if report["passed"]:
        cand.write(out_dir)
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    rej = os.path.join(parent, "rejected")
    os.makedirs(rej, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = os.path.join(rej, f"{os.path.basename(os.path.abspath(out_dir))}-{stamp}")
    k = 1
    while os.path.exists(dest):
        dest = os.path.join(rej, f"{os.path.basename(os.path.abspath(out_dir))}-{stamp}-{k}")
        k += 1
    cand.write(dest)
    with open(os.path.join(dest, "gate.json"), "w") as fh:
        json.dump(report, fh, indent=1, sort_keys=True)
    return dest
