"""`sidecar-fit` (seed 000 §4.2, 反修): per layer, a router bias and one FP4 gain per expert and output channel of
the down projection, so that each quantised MoE block reproduces the teacher's block output on domain text.

    y_i = Σ_k rw_ik · (s_{e_ik} ⊙ ye_ik) + ysh_i          min_s Σ_i ‖y_i − y_i^teacher‖² + λ Σ_d d̄_d Σ_e (s_e[d] − 1)²

Layers are solved 0 → L−1 in one pass, layer l captured with layers < l already mounted (through the same loader
that serves the file, ds4py/vq/sidecar.py), on the engine's own prefill path (ds4py/vq/sidecar_capture.py).
Per layer: the router bias (selection-score gap accumulation, α chosen on held-out same-set rate, kept only if it
strictly improves), mount, recapture; then the gains (per-expert Gauss–Seidel with FP4 lattice-direct steps and
error feedback, λ chosen on held-out rows, kept only if the held-out gain beats `min_gain`). Held-out rows are
every 4th 128-token window of the fitting stream. docs/vq.md has the details and the measurements.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.quant import vq
from ds4py.vq import sidecar as fmt
from ds4py.vq.sidecar_capture import capture, router_scores, set_mask, top_k

F32 = np.float32


class FitError(Ds4Error):
    """sidecar-fit cannot run on these inputs."""


@dataclass(frozen=True)
class Options:
    seq_len: int = 512                  # tokens per prefill (a multiple of the window)
    window: int = 128                   # held-out stratification unit
    heldout_every: int = 4              # every n-th window is held out
    lambdas: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)
    alphas: tuple[float, ...] = (0.5, 1.0, 1.5, 2.5)
    min_events: int = 8                 # gap events before an expert's bias is armed
    min_gain: float = 0.005             # held-out gain a layer's gains must exceed to be mounted
    sweeps: int = 3                     # Gauss–Seidel sweeps over the experts
    bias: bool = True                   # solve router biases
    gains: bool = True                  # solve gains


# ---------------------------------------------------------------------------------------------- corpus
@dataclass
class Corpus:
    seqs: list[np.ndarray]              # prefill chunks, in order
    heldout: np.ndarray                 # bool per row (rows = the chunks' tokens, concatenated)
    sources: list[dict]


def make_corpus(sources: Sequence[tuple[str, np.ndarray]], opts: Options) -> Corpus:
    """Split each source into prefill chunks of seq_len tokens; window w (counted over the whole stream, a
    source starting a new window) is held out when w % heldout_every == heldout_every − 1."""
    if opts.seq_len < opts.window or opts.seq_len % opts.window:
        raise FitError(f"--seq-len {opts.seq_len} must be a positive multiple of the {opts.window}-token window")
    seqs, held, info, w0 = [], [], [], 0
    for name, ids in sources:
        ids = np.asarray(ids, np.int64)
        n_win = -(-len(ids) // opts.window)
        win = w0 + np.arange(len(ids)) // opts.window
        w0 += n_win
        held.append(win % opts.heldout_every == opts.heldout_every - 1)
        seqs += [ids[a:a + opts.seq_len] for a in range(0, len(ids), opts.seq_len)]
        info.append({"name": name, "tokens": int(len(ids)),
                     "blake2b": hashlib.blake2b(ids.astype("<i8").tobytes(), digest_size=16).hexdigest()})
    heldout = np.concatenate(held) if held else np.zeros(0, bool)
    if heldout.sum() < 1 or (~heldout).sum() < 1:
        raise FitError(f"the fitting corpus has {len(heldout)} tokens: it needs at least {opts.heldout_every} "
                       f"windows of {opts.window} tokens so that some rows are held out")
    return Corpus(seqs, heldout, info)


# ---------------------------------------------------------------------------------------------- router bias
def fit_bias(s: np.ndarray, b: np.ndarray, ours: np.ndarray, teacher: np.ndarray, train: np.ndarray,
             held: np.ndarray, opts: Options) -> tuple[np.ndarray | None, dict]:
    """Router bias Δb [X] for one layer (None when held-out same-set does not strictly improve).

    s [N, X]: the router's scores without bias, b [X]: the current bias, ours / teacher [N, k]: the chosen sets.
    For each train row, an expert the teacher chose and we did not adds thr − v_e, one we chose and the teacher
    did not subtracts v_e − thr (v = s + b, thr = our k-th selection score); the sums are averaged per expert
    over its events, armed after min_events, scaled by α (chosen on held-out rows)."""
    N, X = s.shape
    k = ours.shape[1]
    v = s + b
    O, T = set_mask(ours, X), set_mask(teacher, X)
    thr = np.take_along_axis(v, ours[:, k - 1:k], 1)                     # our k-th (ours is in score order)
    gap = np.where(T & ~O, thr - v, 0) - np.where(O & ~T, v - thr, 0)
    events = (T ^ O)[train].sum(0)
    import os
    denom = train.sum() if os.environ.get("BIASMODE") == "rows" else np.maximum(events, 1)
    mean = np.where(events >= opts.min_events, gap[train].sum(0, dtype=np.float64) / denom, 0)

    def same_set(bias: np.ndarray, rows: np.ndarray) -> float:
        beff = (b + bias).astype(F32)                                    # what the loader binds: fl32(b + Δb)
        got = set_mask(top_k(s[rows] + beff, k), X)
        return float((got == T[rows]).all(1).mean())

    before = same_set(np.zeros(X, F32), held)
    scores = {a: same_set((a * mean).astype(F32), held) for a in opts.alphas}
    alpha = max(opts.alphas, key=lambda a: (scores[a], -a))               # ties: the smaller step
    info = {"same_set_before": before, "same_set_by_alpha": {str(a): r for a, r in scores.items()},
            "alpha": alpha, "armed": int((events >= opts.min_events).sum()),
            "same_set_train_before": same_set(np.zeros(X, F32), train)}
    keep = scores[alpha] > before and info["armed"] > 0
    info["mounted"] = bool(keep)
    if not keep:
        return None, info
    delta = (alpha * mean).astype(F32)
    info["same_set_after"] = scores[alpha]
    return delta, info


# ---------------------------------------------------------------------------------------------- gains
def gauss_seidel(q: np.ndarray, idx: np.ndarray, r0: np.ndarray, X: int, lam: float,
                 sweeps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-channel least squares for d = s − 1 by per-expert Gauss–Seidel with FP4 lattice-direct steps.

    q [N, k, D]: rw·ye per row and slot; idx [N, k]; r0 [N, D] = y_teacher − y. Expert e's step solves its
    one-dimensional problem per channel against the current residual, d_e = Σ q·r / (A_e + λ d̄) (A_e: its
    energy per channel, d̄: the mean energy of all X experts per channel), projects d_e onto the FP4 lattice
    and updates the residual with the lattice value, so later experts absorb its rounding (error feedback).
    Returns (d float32 [X, D] = the decoded lattice values, blocks [X, D/32, 17], the final residual)."""
    N, k, D = q.shape
    rows = [np.nonzero(idx == e) for e in range(X)]
    Q = [q[t, sl] for t, sl in rows]
    A = np.stack([(Qe.astype(np.float64) ** 2).sum(0) for Qe in Q])       # [X, D]
    dbar = A.sum(0) / X
    R = r0.astype(F32, copy=True)
    d = np.zeros((X, D), F32)
    blocks = fmt.fp4_project(np.zeros((X, D)))
    for _ in range(sweeps):
        for e in range(X):
            t = rows[e][0]
            if not len(t):
                continue
            Qe = Q[e]
            Rr = R[t] + d[e] * Qe                                         # this expert's old share added back
            den = A[e] + lam * dbar
            num = (Qe.astype(np.float64) * Rr).sum(0)
            u = np.divide(num, den, out=np.zeros(D), where=den > 0)
            blocks[e] = fmt.fp4_project(u[None], den[None])[0]
            d[e] = fmt.fp4_decode(blocks[e][None])[0]
            R[t] = Rr - d[e] * Qe
    return d, blocks, R


def predict(d: np.ndarray, q: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Σ_k d[e_k] ⊙ q_k: the change of the block output a gain table makes (d = s − 1)."""
    return np.einsum("nkd,nkd->nd", d[idx], q, dtype=F32)


def fit_gains(q: np.ndarray, idx: np.ndarray, r0: np.ndarray, train: np.ndarray, held: np.ndarray, X: int,
              opts: Options) -> tuple[np.ndarray, dict]:
    """Solve for every λ on the train rows; pick λ by the held-out gain 1 − ‖r(s)‖² / ‖r(1)‖²."""
    e_train, e_held = float((r0[train].astype(np.float64) ** 2).sum()), float((r0[held].astype(np.float64) ** 2).sum())
    best = None
    by_lam = {}
    for lam in opts.lambdas:
        d, blocks, R = gauss_seidel(q[train], idx[train], r0[train], X, lam, opts.sweeps)
        rh = r0[held] - predict(d, q[held], idx[held])
        g_held = 1 - float((rh.astype(np.float64) ** 2).sum()) / e_held if e_held > 0 else 0.0
        g_train = 1 - float((R.astype(np.float64) ** 2).sum()) / e_train if e_train > 0 else 0.0
        by_lam[str(lam)] = g_held
        if best is None or g_held > best[0]:
            best = (g_held, g_train, lam, blocks, d)
    g_held, g_train, lam, blocks, d = best
    return blocks, {"lambda": lam, "heldout_gain": g_held, "train_gain": g_train, "heldout_by_lambda": by_lam,
                    "changed": float(np.mean(d != 0)), "mounted": bool(g_held > opts.min_gain)}


# ---------------------------------------------------------------------------------------------- the pass
def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(((a.astype(np.float64) - ref) ** 2).sum() / max((ref.astype(np.float64) ** 2).sum(), 1e-300))


def fit_sidecar(base: str, teacher: str, sources: Sequence[tuple[str, np.ndarray]], opts: Options = Options(),
                progress: Callable[[str], None] | None = None, times: dict | None = None) -> fmt.Sidecar:
    """Fit a sidecar of VQ base `base` against `teacher` (the same model before quantisation) on `sources`
    ((name, token ids) each); returns it unwritten (Sidecar.write puts it on disk, decoding every file back).
    `times`, if given, receives the wall times (kept out of the manifest, which is the same for the same input)."""
    from ds4py.ref.engine import RefModel

    say = progress or (lambda _m: None)
    t_all = time.perf_counter()
    tm, bm = RefModel(teacher), RefModel(base)
    cfg = bm.config
    for what in ("n_layers", "n_experts", "n_experts_used", "dim", "vocab_size"):
        if getattr(tm.config, what) != getattr(cfg, what):
            raise FitError(f"the teacher {teacher} and the base {base} differ in {what} "
                           f"({getattr(tm.config, what)} vs {getattr(cfg, what)}): the teacher must be the same "
                           f"model before quantisation")
    plain = [l for l in range(cfg.n_layers) if not vq.is_vq(bm.gguf, fmt.down_name(l))]
    if plain and opts.gains:
        raise FitError(f"the base {base} has no VQ-8 experts in layer {plain[0]}: sidecar gains rescale VQ row "
                       f"gains (quantize-vq the model first)")
    corpus = make_corpus(sources, opts)
    held, train = corpus.heldout, ~corpus.heldout
    V = cfg.vocab_size
    for ids in corpus.seqs:
        if ids.min() < 0 or ids.max() >= V:
            raise FitError(f"a fitting token id is outside the vocabulary (0..{V - 1})")
    L, X, k = cfg.n_layers, cfg.n_experts, cfg.n_experts_used
    say(f"fixture: teacher {os.path.basename(teacher)} on {len(held)} tokens ({int(held.sum())} held out) in "
        f"{len(corpus.seqs)} chunks")
    t0 = time.perf_counter()
    fixture, _ = capture(tm, corpus.seqs, range(L), parts=False)
    times = {} if times is None else times
    times["fixture_s"], times["layers_s"] = time.perf_counter() - t0, []
    say(f"fixture: {L} layers in {times['fixture_s']:.1f} s")
    teacher_fp = tm.fingerprint
    del tm

    sc = fmt.Sidecar("sidecar", {"kind": "base", "fingerprint": bm.fingerprint, "base_fingerprint": bm.fingerprint,
                                 "name": os.path.basename(base)},
                     {"n_layers": L, "n_experts": X, "dim": cfg.dim},
                     meta={"corpus": {"sources": corpus.sources, "tokens": int(len(held)),
                                      "heldout_tokens": int(held.sum()), "seq_len": opts.seq_len,
                                      "window": opts.window, "heldout_every": opts.heldout_every},
                           "teacher": {"name": os.path.basename(teacher), "fingerprint": teacher_fp},
                           "solver": {"tool": "ds4py sidecar-fit", **asdict(opts)}})
    del bm
    predicted = None                                    # (layer, predicted y) of the last mounted gains
    for l in range(L):
        t0 = time.perf_counter()
        info: dict = {}
        model = RefModel(base, sidecar=sc)
        want = [l] if predicted is None else [predicted[0], l]
        caps, _ = capture(model, corpus.seqs, want, stop_after=l)        # parts of l-1 are not needed
        if predicted is not None:                       # the mounted file does what the solver predicted
            err = rel_err(caps[predicted[0]].y, predicted[1])
            sc.layers[predicted[0]].info["mount_check"] = err
            if err > 1e-6:
                raise FitError(f"layer {predicted[0]}: the mounted gains give a block output {err:.2e} (relative) "
                               f"away from the solver's prediction")
        c = caps[l]
        yt, tidx = fixture[l].y, fixture[l].idx
        info["error_before"] = rel_err(c.y[held], yt[held])
        words = []
        if cfg.is_hash_layer(l):
            info["router_fit"] = "hash"
        elif opts.bias:
            s, b = router_scores(model, l, c.x)
            pred = top_k(s + b, k)
            match = float((set_mask(pred, X) == set_mask(c.idx, X)).all(1).mean())
            if match < 0.99:
                raise FitError(f"layer {l}: the router recomputed from the captured inputs matches the engine's "
                               f"choice on only {match:.1%} of rows")
            delta, rinfo = fit_bias(s, b, c.idx, tidx, train, held, opts)
            info["router_fit"] = rinfo
            words.append(f"same-set {rinfo['same_set_before']:.1%} -> "
                         + (f"{rinfo['same_set_after']:.1%} (alpha {rinfo['alpha']}, {rinfo['armed']} armed)"
                            if delta is not None else "unchanged (no bias)"))
            if delta is not None:
                sc.layers[l] = fmt.LayerEdit(bias=delta, info=info)
                model = RefModel(base, sidecar=sc)
                c = capture(model, corpus.seqs, [l], stop_after=l)[0][l]
                want_idx = set_mask(top_k(s + (b + delta).astype(F32), k), X)
                if float((set_mask(c.idx, X) == want_idx).all(1).mean()) < 0.99:
                    raise FitError(f"layer {l}: the mounted router bias does not route as the solver predicted")
                info["error_after_bias"] = rel_err(c.y[held], yt[held])
        predicted = None
        if opts.gains:
            r0 = yt - c.y
            blocks, ginfo = fit_gains(c.parts, c.idx, r0, train, held, X, opts)
            info["gain_fit"] = ginfo
            words.append(f"gains lambda {ginfo['lambda']:g}: held-out {ginfo['heldout_gain']:+.2%} "
                         f"(train {ginfo['train_gain']:+.2%}) " + ("mounted" if ginfo["mounted"] else
                                                                   f"not mounted (<= {opts.min_gain:.1%})"))
            if ginfo["mounted"]:
                ed = sc.layers.setdefault(l, fmt.LayerEdit(info=info))
                ed.gain_blocks = blocks
                d = ed.scale() - 1
                predicted = (l, c.y + predict(d, c.parts, c.idx))
        sc.layers.setdefault(l, fmt.LayerEdit(info=info)).info = info
        times["layers_s"].append(time.perf_counter() - t0)
        say(f"layer {l + 1}/{L}: block error {info['error_before']:.4f}; " + "; ".join(words)
            + f"; {time.perf_counter() - t0:.1f} s")
    if predicted is not None:                           # the last layer's gains, mounted, on the same check
        caps, _ = capture(RefModel(base, sidecar=sc), corpus.seqs, [predicted[0]], stop_after=predicted[0],
                          parts=False)
        err = rel_err(caps[predicted[0]].y, predicted[1])
        sc.layers[predicted[0]].info["mount_check"] = err
        if err > 1e-6:
            raise FitError(f"layer {predicted[0]}: the mounted gains give a block output {err:.2e} (relative) away "
                           f"from the solver's prediction")
    times["total_s"] = time.perf_counter() - t_all
    say(f"done: {sc.summary()} in {times['total_s']:.1f} s")
    return sc

