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
    margin: float = 0.5                 # τ: the margin a decision point should reach (logits)
    rho: float = 1.0                    # weight of the constraint rows
    ridge: float = 1e-3                 # λ, relative to the mean diagonal of the data term
    rounds: int = 6                     # active-set rounds
    boost: float = 4.0                  # weight factor for a decision row that fell back below τ
    guard: int = 16                     # competitors checked per position (its top tokens) for the active set
    checks: int = 3                     # real forwards: each one's mistakes join the active set for the next
    cg_iters: int = 200
    cg_tol: float = 1e-3                # relative residual of the normal equations (FP4 is coarser)
    min_flip: float = 0.5               # gate: share of decision rows whose argmax becomes the target
    min_keep: float = 0.95              # gate: share of other rows that keep their top-1


class Linear:
    """The margins' linear model at every captured position: Δm(p, a, b) = scale_p · Σ_d γ_d (W_a − W_b)_d Δ_p,d
    with scale_p = inv_p · α_p (the output RMSNorm factor and the final collapse through the block's hc_post,
    both held fixed) and Δ_p = Σ_k d[e_pk] ⊙ q_pk."""

    def __init__(self, model, cap: PathCapture):
        cfg, B, w = model.config, model.binding, model.weights
        self.w, self.head = w, B.head
        X = cap.hc
        fn, sc, bs = w.get(B.hc_head.fn), w.get(B.hc_head.scale), w.get(B.hc_head.base)
        pre = ops.sigmoid(ops.hc_mixes(X, fn, cfg.norm_eps) * sc[0] + bs) + F32(cfg.hc_eps)  # hc_head's weights
        y = ops.hc_head(X, fn, sc, bs, cfg.norm_eps, cfg.hc_eps)
        inv = 1 / np.sqrt(np.mean(y.astype(np.float64) ** 2, 1) + cfg.norm_eps)
        self.scale = inv * (pre * cap.layer.post).sum(1)                   # [T]
        self.gamma = w.get(B.output_norm).astype(np.float64)
        self.q, self.idx = cap.layer.parts, cap.layer.idx
        self.logits = cap.logits.astype(np.float64)
        self._rows: dict[int, np.ndarray] = {}

    def wg(self, toks: np.ndarray) -> np.ndarray:
        """γ ⊙ W_t for tokens toks [n] -> [n, D] (head rows dequantised once, by the engine's own reader)."""
        need = [int(t) for t in np.unique(toks) if int(t) not in self._rows]
        if need:
            for t, r in zip(need, self.w.rows(self.head, np.array(need)).astype(np.float64)):
                self._rows[t] = r * self.gamma
        return np.stack([self._rows[int(t)] for t in toks]) if len(toks) else np.zeros((0, len(self.gamma)))

    def coefficients(self, pos: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """G [n, k, D]: Δm of row n = Σ_j G[n, j] · d[idx[pos_n, j]]."""
        c = self.scale[pos, None] * (self.wg(a) - self.wg(b))
        return (c[:, None, :] * self.q[pos]).astype(F32)

    def delta(self, d: np.ndarray) -> np.ndarray:
        """Δ [T, D]: the last block's output change a gain table d = s − 1 makes."""
        return np.einsum("nkd,nkd->nd", d[self.idx], self.q, dtype=np.float64)

    def change(self, delta: np.ndarray, pos: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.scale[pos] * ((self.wg(a) - self.wg(b)) * delta[pos]).sum(1)

    def margin(self, pos: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.logits[pos, a] - self.logits[pos, b]


@dataclass
class Rows:
    """The system's rows: at position pos, token a should lead token b by m0 + rhs (rhs = 0: keep the margin)."""
    pos: np.ndarray
    a: np.ndarray
    b: np.ndarray
    rhs: np.ndarray
    weight: np.ndarray
    decision: np.ndarray                # bool: a decision point's row (else a constraint row)
    m0: np.ndarray

    def add(self, pos, a, b, rhs, weight, decision, m0) -> None:
        for name, v in (("pos", pos), ("a", a), ("b", b), ("rhs", rhs), ("weight", weight), ("decision", decision),
                        ("m0", m0)):
            setattr(self, name, np.concatenate([getattr(self, name), np.asarray(v, getattr(self, name).dtype)]))


def initial_rows(lin: Linear, targets: np.ndarray, opts: Options) -> Rows:
    """Decision points: a = the target, b = the strongest other token, Δm = τ − m0 (0 if already beyond τ);
    every other position: its top-1 over its top-2, Δm = 0 with weight ρ."""
    T = len(targets)
    order = np.argsort(-lin.logits, 1, kind="stable")[:, :2]
    dec = targets >= 0
    a = np.where(dec, targets, order[:, 0])
    b = np.where(order[:, 0] == a, order[:, 1], order[:, 0])
    pos = np.arange(T)
    m0 = lin.margin(pos, a, b)
    return Rows(pos, a, b, np.where(dec, np.maximum(opts.margin - m0, 0), 0.0), np.where(dec, 1.0, opts.rho), dec, m0)


class System:
    """min_d Σ_n w_n (Σ_j G_nj · d[idx_nj] − rhs_n)² + λ Σ d²  (d [X, D]), matrix-free."""

    def __init__(self, G: np.ndarray, idx: np.ndarray, rhs: np.ndarray, X: int):
        self.G, self.idx, self.rhs, self.X = G, idx, rhs, X
        N, k, D = G.shape
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")
        self.experts, self.starts = np.unique(flat[order], return_index=True)
        self.Gflat = G.reshape(N * k, D)[order]
        self.row_of = (np.arange(N * k) // k)[order]
        self.D = D

    def apply(self, d: np.ndarray) -> np.ndarray:
        """R d: [N]."""
        return np.einsum("nkd,nkd->n", self.G, d[self.idx], dtype=np.float64)

    def apply_t(self, u: np.ndarray) -> np.ndarray:
        """Rᵀ u: [X, D]."""
        out = np.zeros((self.X, self.D))
        out[self.experts] = np.add.reduceat(self.Gflat * u[self.row_of][:, None], self.starts, axis=0)
        return out

    def diag(self, weight: np.ndarray) -> np.ndarray:
        out = np.zeros((self.X, self.D))
        contrib = self.Gflat.astype(np.float64) ** 2 * weight[self.row_of][:, None]
        out[self.experts] = np.add.reduceat(contrib, self.starts, axis=0)
        return out

    def solve(self, weight: np.ndarray, ridge_rel: float, x0: np.ndarray, iters: int,
              tol: float) -> tuple[np.ndarray, np.ndarray, int]:
        """Jacobi-preconditioned CG on (Rᵀ W R + λ I) d = Rᵀ W rhs, λ = ridge_rel · the mean data diagonal;
        returns (d, the preconditioner's diagonal, iterations)."""
        dg = self.diag(weight)
        lam = ridge_rel * (float(dg[dg > 0].mean()) if (dg > 0).any() else 1.0)
        M = dg + lam
        A = lambda v: self.apply_t(weight * self.apply(v)) + lam * v          # noqa: E731
        b = self.apply_t(weight * self.rhs)
        x = x0.astype(np.float64).copy()
        r = b - A(x)
        z = r / M
        p = z.copy()
        rz = float((r * z).sum())
        bn = float(np.sqrt((b * b).sum())) or 1.0
        it = 0
        for it in range(1, iters + 1):
            if np.sqrt((r * r).sum()) < tol * bn:
                break
            Ap = A(p)
            step = rz / float((p * Ap).sum())
            x += step * p
            r -= step * Ap
            z = r / M
            rz, rz_old = float((r * z).sum()), rz
            p = z + (rz / rz_old) * p
        return x, M, it


def competitors(lin: Linear, winners: np.ndarray, guard: int) -> np.ndarray:
    """Per position its `guard` strongest tokens other than its winner [T, guard]."""
    top = np.argsort(-lin.logits, 1, kind="stable")[:, :guard + 1]
    keep = top != winners[:, None]
    return np.stack([row[k][:guard] for row, k in zip(top, keep)])


class Solver:
    """The rounds of one solve: CG, FP4 projection, re-prediction with the stored values; decision rows that
    fell below τ get `boost` more weight, and a rival that the prediction shows overtaking a position joins the
    active set as a new row (other positions: a rival that would take half their lead; decision points: one
    within τ of the target). Keeps the solution (warm start) and the rows between calls."""

    def __init__(self, lin: Linear, rows: Rows, rivals: tuple, dec: np.ndarray, X: int, D: int, opts: Options, say):
        self.lin, self.rows, self.dec, self.opts, self.say = lin, rows, dec, opts, say
        self.P, self.A, self.C = rivals
        self.m0 = lin.margin(self.P, self.A, self.C)
        self.have = set(zip(rows.pos.tolist(), rows.b.tolist()))
        self.d = np.zeros((X, D))
        self.X = X

    def _add(self, sel: np.ndarray, weight_factor: float = 1.0) -> int:
        sel = [i for i in sel if (int(self.P[i]), int(self.C[i])) not in self.have]
        if not sel:
            return 0
        self.have.update((int(self.P[i]), int(self.C[i])) for i in sel)
        sel = np.array(sel)
        nd = self.dec[self.P[sel]]
        self.rows.add(self.P[sel], self.A[sel], self.C[sel], np.where(nd, np.maximum(self.opts.margin - self.m0[sel], 0), 0.0),
                      np.where(nd, 1.0, self.opts.rho) * weight_factor, nd, self.m0[sel])
        return len(sel)

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        """Up to opts.rounds rounds; the best candidate's (blocks, predicted Δ [T, D])."""
        o, rows, lin = self.opts, self.rows, self.lin
        T = len(self.dec)
        best = None
        for rnd in range(o.rounds):
            system = System(lin.coefficients(rows.pos, rows.a, rows.b), lin.idx[rows.pos], rows.rhs, self.X)
            self.d, M, iters = system.solve(rows.weight, o.ridge, self.d, o.cg_iters, o.cg_tol)
            blocks = fmt.fp4_project(self.d, M)                            # FP4-aware: judge the stored values
            delta = lin.delta(fmt.fp4_decode(blocks).astype(np.float64))
            m = rows.m0 + lin.change(delta, rows.pos, rows.a, rows.b)
            m_all = self.m0 + lin.change(delta, self.P, self.A, self.C)
            lead = m_all.reshape(T, -1).min(1)                              # over every rival
            pred_flip = float((lead[self.dec] > 0).mean())
            pred_keep = float((lead[~self.dec] > 0).mean()) if (~self.dec).any() else 1.0
            fell = rows.decision & (m < o.margin)
            rows.weight = np.where(fell, rows.weight * o.boost, rows.weight)
            threat = np.where(self.dec[self.P], m_all < o.margin, m_all < 0.5 * self.m0)
            n_rows = len(rows.pos)
            added = self._add(np.flatnonzero(threat))
            self.say(f"round {rnd + 1}: CG {iters} iterations on {n_rows} rows; predicted with the FP4 values: "
                     f"{pred_flip:.1%} of decision points lead, {pred_keep:.1%} of other positions keep their top-1 "
                     f"against their {o.guard} strongest rivals; {int(fell.sum())} rows below the margin, "
                     f"{added} rows added")
            key = (pred_flip >= o.min_flip and pred_keep >= o.min_keep, pred_keep + pred_flip)
            if best is None or key > best[0]:
                best = (key, blocks, delta)
            if not fell.any() and not added:
                break
        return best[1], best[2]

    def feedback(self, positions: np.ndarray, real_top: np.ndarray) -> None:
        """Positions a real forward got wrong: their rows weigh `boost` times more, and the rival that really
        won joins the rows (if it is among the checked rivals)."""
        if not len(positions):
            return
        bad = np.isin(self.rows.pos, positions)
        self.rows.weight = np.where(bad, self.rows.weight * self.opts.boost, self.rows.weight)
        win = real_top[self.P]
        self._add(np.flatnonzero(np.isin(self.P, positions) & (self.C == win)), self.opts.boost)


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


def fit_posttrain(base: str, sidecar: "str | fmt.Sidecar | None", ids: np.ndarray, split: int, targets: np.ndarray,
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
    lin = Linear(model, cap)
    rows = initial_rows(lin, tg, opts)
    X, D = cfg.n_experts, cfg.dim
    base_top1 = cap.logits.argmax(1)
    before = evaluate(cap.logits, base_top1, tg)
    say(f"{before['decision_rows']} decision points ({before['flipped']:.1%} already right), "
        f"{before['other_rows']} constraint rows; unknowns {X} x {D}")
    dec = tg >= 0
    winners = np.where(dec, tg, base_top1)
    rivals = competitors(lin, winners, opts.guard)                          # [T, guard]
    rv = (np.repeat(np.arange(T), rivals.shape[1]), np.repeat(winners, rivals.shape[1]), rivals.reshape(-1))
    solver = Solver(lin, rows, rv, dec, X, D, opts, say)
    on = ({"kind": "sidecar", "fingerprint": model.stack.sidecar.fingerprint, "base_fingerprint": model.base_fingerprint,
           "name": os.path.basename(os.path.normpath(model.stack.sidecar.path or "in-memory"))}
          if model.stack is not None
          else {"kind": "base", "fingerprint": model.base_fingerprint, "base_fingerprint": model.base_fingerprint,
                "name": os.path.basename(base)})
    n = np.arange(T)
    winners_b = rows.b[:T].copy()                                           # the initial rows: one per position
    best = None
    solve_s = check_s = 0.0
    for check_round in range(1, opts.checks + 1):
        t0 = time.perf_counter()
        blocks, delta = solver.run()
        solve_s += time.perf_counter() - t0
        cand = fmt.Sidecar("posttrain", on, {"n_layers": cfg.n_layers, "n_experts": X, "dim": cfg.dim},
                           {last: fmt.LayerEdit(gain_blocks=blocks)},
                           meta={"solver": {"tool": "ds4py posttrain-fit", **asdict(opts)},
                                 "requests": {"tokens": T, "split": split, "decision_points": int(dec.sum())}})
        # the real forward on the same path, with the candidate mounted
        t0 = time.perf_counter()
        real = capture_path(RefModel(base, sidecar=sidecar, posttrain=cand), ids, split, last)
        check_s += time.perf_counter() - t0
        after = evaluate(real.logits, base_top1, tg)
        lg = real.logits.astype(np.float64)
        dp = lin.change(delta, n, winners, winners_b)                       # predicted margin changes
        dr = lg[n, winners] - lg[n, winners_b] - rows.m0[:T]                # real ones
        corr = float(np.corrcoef(dp, dr)[0, 1]) if dp.std() > 0 and dr.std() > 0 else float("nan")
        passed = bool(after["flipped"] >= opts.min_flip and after["kept"] >= opts.min_keep)
        say(f"real forward {check_round}: {after['flipped']:.1%} of decision points flipped to their target (before "
            f"{before['flipped']:.1%}), {after['kept']:.1%} of other positions keep their top-1; predicted vs real "
            f"margin change: correlation {corr:.4f} (mean |change| {np.abs(dr).mean():.3f} real, "
            f"{np.abs(dp).mean():.3f} predicted)")
        key = (passed, after["kept"] + after["flipped"])
        if best is None or key > best[0]:
            best = (key, cand, after, corr, check_round)
        if passed:
            break
        # what the real forward shows joins the active set: a position that changed its top-1, a decision point
        # that did not reach its target
        top = lg.argmax(1)
        solver.feedback(np.flatnonzero((~dec & (top != base_top1)) | (dec & (top != tg))), top)
    _, cand, after, corr, used = best
    report = {"before": before, "after": after, "predicted_margin_corr": corr, "solve_s": solve_s,
              "check_s": check_s, "total_s": time.perf_counter() - t_all, "real_checks": check_round,
              "kept_check": used, "gates": {"min_flip": opts.min_flip, "min_keep": opts.min_keep}}
    report["passed"] = bool(after["flipped"] >= opts.min_flip and after["kept"] >= opts.min_keep)
    cand.layers[last].info = {"flipped": after["flipped"], "kept": after["kept"],
                              "flipped_before": before["flipped"], "predicted_margin_corr": corr}
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
