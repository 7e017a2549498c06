"""The post-training file on the trained tiny V4 (../shared/trained/v4-tiny-trained): does `posttrain-fit` flip the
decision points it is solved on, keep every other position, and does it transfer to other requests (docs/vq.md
"Post-training on the trained model")?

    python bench/posttrain_trained.py --work DIR [--requests 4] [--train 2] [--prompt 96] [--gen 64] [--biased]
                                      [--json out.json]

Setup (seed 000 §4.3 on what this folder allows): base = VQ-8 of the routed experts (quantize-vq's default unbiased
gains; `--biased`: the k-means gains) + the domain's sidecar (bench/trained_files.py: the files
bench/sidecar_trained.py makes, reused from --work when there). A request = `--prompt`
tokens of the domain's held-out half (the half no sidecar saw) + the `--gen` tokens that follow in the text, scored
on the deployment path (prompt through prefill, the rest through decode, as posttrain-fit captures it).
Decision point: a continuation row where base + sidecar's top-1 differs from the unquantised teacher's; its target
is the teacher's top-1 ("the model should have written a, not b"). posttrain-fit (defaults: τ 0.5, ρ 1, ridge 1e-3,
gates flip ≥ 0.5 / keep ≥ 0.95; `--ridge` passed on) is solved on each of the first `--train` requests alone and scored by a real
forward on that request (flipped = decision rows whose top-1 became the target; kept = other rows whose top-1
stayed) and on the other requests (held out: their own decision points, kept rows, same top-1 vs the teacher).
`--generated`: the requests' continuations are base + sidecar's own greedy output instead of the text (the seed's
setting: decisions in what the model wrote), plus free greedy generation with the file from the request's prompt
(does the first decision point flip in generation; how often would the teacher pick the generated tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from trained_files import REPO, TRAINED, halves, prepare, sidecar  # noqa: E402  (puts the repo on sys.path)
from ds4py.ref.engine import RefModel  # noqa: E402


def score_rows(m: RefModel, ids: np.ndarray, P: int) -> np.ndarray:
    """Logits of rows P-1 .. T-1 (as `score --split P`): the prompt through prefill, the rest through decode."""
    st = m.new_state()
    first = m.prefill(st, list(map(int, ids[:P])), all_logits=False)
    rows = [np.asarray(first).reshape(-1)] + [m.decode(st, int(t)) for t in ids[P:]]
    return np.stack(rows).astype(np.float32)


def greedy(m: RefModel, prompt: np.ndarray, n: int) -> np.ndarray:
    """n tokens of greedy free generation after the prompt (prefill, then decode)."""
    st = m.new_state()
    lg, out = m.prefill(st, list(map(int, prompt)), all_logits=False), []
    for _ in range(n):
        out.append(int(np.argmax(lg)))
        lg = m.decode(st, out[-1])
    return np.asarray(out, np.int64)


def free_generation(m: RefModel, plain: RefModel, teacher: RefModel, req: np.ndarray, targets: np.ndarray,
                    P: int) -> dict:
    """Greedy free generation from the request's prompt, without and with the post-training file: does the first
    decision point's token flip in generation (the request must be plain's own greedy output for the first
    decision row to be reached), and how often would the teacher have chosen each generated token (teacher-forced
    on the generated text)?"""
    n = len(req) - P
    gens = {"before": greedy(plain, req[:P], n), "after": greedy(m, req[:P], n)}
    out = {}
    for k, g in gens.items():
        t = score_rows(teacher, np.concatenate([req[:P], g]), P)[:-1].argmax(1)
        out[f"teacher_agrees_{k}"] = float((t == g).mean())
    first = int(np.flatnonzero(targets >= 0)[0]) if (targets >= 0).any() else None   # score row = gen index
    out["first_decision_row"] = first
    if first is not None:
        out["prefix_kept"] = bool(np.array_equal(gens["after"][:first], gens["before"][:first]))
        out["first_decision_flipped"] = bool(gens["after"][first] == targets[first])
    out["diverged_at"] = int(np.argmax(gens["after"] != gens["before"])) if (gens["after"] != gens["before"]).any() \
        else None
    return out


def measure(student: np.ndarray, before: np.ndarray, teacher: np.ndarray, ids: np.ndarray, P: int) -> dict:
    """Rows of one request: decision rows = where `before` (base + sidecar) and the teacher disagree."""
    tb, ta, tt = before.argmax(1), student.argmax(1), teacher.argmax(1)
    dec = tb != tt
    truth = np.append(ids[P:], -1)                          # row P-1+j predicts ids[P+j]; the last row: none
    return {"rows": int(len(tt)), "decision_points": int(dec.sum()),
            "flipped": float((ta[dec] == tt[dec]).mean()) if dec.any() else None,
            "kept": float((ta[~dec] == tb[~dec]).mean()),
            "same_top1_before": float((tb == tt).mean()), "same_top1_after": float((ta == tt).mean()),
            "true_next_teacher": float((tt[:-1] == truth[:-1]).mean()),
            "true_next_before": float((tb[:-1] == truth[:-1]).mean()),
            "true_next_after": float((ta[:-1] == truth[:-1]).mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--train", type=int, default=2, help="fit one post-training file on each of the first N")
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--ridge", default="1e-3", help="posttrain-fit --ridge")
    ap.add_argument("--generated", action="store_true",
                    help="requests = the prompt + base + sidecar's own greedy continuation (not the text's), and "
                         "free greedy generation with the file on its own request")
    ap.add_argument("--biased", action="store_true",
                    help="base = quantize-vq --no-unbiased-gains (the k-means gains; the results in docs/vq.md "
                         "were measured on this base, before unbiased gains were the default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work, teacher_path, base_p, tok = prepare(args.work, args.biased, "posttrain_trained_")
    teacher_m = RefModel(str(teacher_path), threads=1)
    P, T = args.prompt, args.prompt + args.gen
    res: dict = {"prompt": P, "gen": args.gen, "ridge": args.ridge, "generated": args.generated, "domains": {}}
    print("| domain | fitted on | scored on | decision points | flipped | other rows kept | same top-1 vs teacher "
          "before → after | true next token before → after (teacher) | fit s | gate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dom in ("code", "prose"):
        sc, _, _ = sidecar(work, dom, args.biased)
        _, held = halves((TRAINED / f"test_{dom}.txt").read_text())
        ids_all = np.asarray(tok.encode(held), np.int64)
        offs = np.linspace(0, len(ids_all) - T, args.requests).astype(int)
        reqs = [ids_all[o:o + T] for o in offs]
        plain = RefModel(str(base_p), threads=1, sidecar=str(sc))
        if args.generated:                # the request = base + sidecar's own greedy answer to the prompt
            reqs = [np.concatenate([r[:P], greedy(plain, r[:P], args.gen)]) for r in reqs]
        before = [score_rows(plain, r, P) for r in reqs]
        teach = [score_rows(teacher_m, r, P) for r in reqs]
        rd = res["domains"].setdefault(dom, {"fits": []})
        for i in range(min(args.train, args.requests)):
            np.save(work / f"{dom}_req{i}.npy", reqs[i])      # (rewritten per run: --generated changes them)
            targets = np.where(before[i].argmax(1) != teach[i].argmax(1), teach[i].argmax(1), -1)
            np.save(work / f"{dom}_req{i}_targets.npy", targets)
            out = work / f"pt_{dom}_{i}_r{args.ridge}{'_gen' if args.generated else ''}"
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "ds4py", "posttrain-fit", "--base", str(base_p), "--sidecar",
                                str(sc), "--ids", str(work / f"{dom}_req{i}.npy"), "--split", str(P), "--targets",
                                str(work / f"{dom}_req{i}_targets.npy"), "--out", str(out), "--ridge", args.ridge],
                               capture_output=True, text=True, cwd=REPO)
            secs = time.perf_counter() - t0
            rejected = sorted((work / "rejected").glob(f"{out.name}-*")) if (work / "rejected").exists() else []
            where = out if out.exists() else (rejected[-1] if rejected else None)
            fit = {"request": i, "seconds": secs, "returncode": r.returncode, "kept_by_gate": out.exists(),
                   "stderr_tail": r.stderr.strip().splitlines()[-6:], "scores": {}}
            rd["fits"].append(fit)
            if where is None:
                print(f"| {dom} | request {i} | — | posttrain-fit wrote nothing (rc {r.returncode}) |", flush=True)
                continue
            m = RefModel(str(base_p), threads=1, sidecar=str(sc), posttrain=str(where))
            if args.generated:
                fg = free_generation(m, plain, teacher_m, reqs[i], targets, P)
                fit["free_generation"] = fg
                print(f"|   free generation, {dom} request {i}: first decision row {fg['first_decision_row']}, prefix "
                      f"kept {fg.get('prefix_kept')}, its token flipped {fg.get('first_decision_flipped')}, diverged at "
                      f"{fg['diverged_at']}; teacher agrees with the generated tokens {fg['teacher_agrees_before']:.1%} "
                      f"→ {fg['teacher_agrees_after']:.1%} |", flush=True)
            for j, req in enumerate(reqs):
                s = measure(score_rows(m, req, P), before[j], teach[j], req, P)
                fit["scores"][j] = s
                flip = "—" if s["flipped"] is None else f"{s['flipped']:.1%}"
                print(f"| {dom} | request {i} | {'itself' if i == j else f'request {j} (held out)'} | "
                      f"{s['decision_points']} / {s['rows']} | {flip} | {s['kept']:.1%} | "
                      f"{s['same_top1_before']:.1%} → {s['same_top1_after']:.1%} | {s['true_next_before']:.1%} → "
                      f"{s['true_next_after']:.1%} ({s['true_next_teacher']:.1%}) | {secs:.0f} | {'kept' if out.exists() else 'rejected'} |",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
