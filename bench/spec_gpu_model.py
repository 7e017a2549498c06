"""Speculative decoding modelled on the GPU: the speed-up over plain decoding that the MTP draft's measured
acceptance would give on GB10 / H200 at V4 Flash shapes, per k, from the scheduler's own cost model fed with the
GPU time model's step times (modelled, not measured: no GPU here; docs/spec.md "Modelled for GB10 / H200").

    python bench/spec_gpu_model.py [--from spec_trained.json] [--acceptance 0.6[,0.4]] [--devices gb10,h200]
                                   [--shapes v4-flash-q2] [--ctx 2048] [--k-max 4] [--overhead-ms 0] [--json out.json]

Step times (ds4py/cuda/timemodel.py, planned with the plan-only runtime): a decode step, a verify of 2 .. k_max + 1
rows of one sequence, and the MTP draft step of 1 and 2 rows (the MTP block at the main model's storage types and
the main model's head). They become the scheduler's costs (spec_schedule.StepCosts: plain, verify(r), a draft
step g + m·r in its pending rows), and Scheduler.expected_round gives each k's tokens and cost from per-position
acceptances: a_1 (the first draft's) and a_c (a chained draft's, given the ones before it were accepted).
Acceptances come from a bench/spec_trained.py --json run (per domain and mode, pooled over its requests: the
first position's from every round, the chained positions' from every chained position a verify reached; where
no chained position was reached, a_c = a_1, marked "assumed") or from --acceptance A1[,AC].
The break-even acceptance is the first-draft acceptance at which k = 1 pays for itself
(spec_schedule.break_even_acceptance). What the model leaves out: the host side of a draft step (the engine
uploads the hidden rows, downloads the block's output and logits and synchronises, ~tens of µs a step) and the
round's host work (draft distributions, decisions, acceptance: `--overhead-ms` charges it); both count against
speculation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py.cuda import timemodel  # noqa: E402
from ds4py.spec_schedule import Scheduler, StepCosts, break_even_acceptance  # noqa: E402


def costs_of(t: timemodel.SpecStepTimes, overhead_ms: float = 0.0) -> StepCosts:
    """The scheduler's costs (seconds) from the modelled step times (µs), plus a round's host overhead (ms)."""
    return StepCosts(t.decode_us / 1e6, {r: v / 1e6 for r, v in t.verify_us.items()}, t.draft_us[1] / 1e6,
                     t.draft_us[2] / 1e6, overhead_ms / 1e3)


def speedups(costs: StepCosts, a1: float, ac: float, k_max: int) -> dict[int, dict]:
    """Per k = 1..k_max: expected tokens per round, round cost (ms) and speed-up over plain steps."""
    sched = Scheduler(costs, k_max)
    out = {}
    for k in range(1, k_max + 1):
        E, cost = sched.expected_round([a1] + [ac] * (k - 1))
        out[k] = {"tokens_per_round": E, "round_ms": 1e3 * cost, "speedup": E * costs.plain() / cost}
    return out


def model(acceptance: dict[str, tuple[float, float | None]], devices: list[str], shapes: str, ctx: int,
          k_max: int, overhead_ms: float = 0.0) -> dict:
    """Per device: the step times, the break-even acceptance and, per acceptance row, each k's speed-up."""
    res = {}
    for dev in devices:
        t = timemodel.spec_step_times(dev, shapes, ctx, k_max)
        c = costs_of(t, overhead_ms)
        rows = {}
        for name, (a1, ac) in acceptance.items():
            rows[name] = {"a1": a1, "ac": a1 if ac is None else ac, "ac_assumed": ac is None,
                          "k": speedups(c, a1, a1 if ac is None else ac, k_max)}
            best = max(rows[name]["k"].items(), key=lambda kv: kv[1]["speedup"])
            rows[name]["best_k"], rows[name]["best_speedup"] = best[0], best[1]["speedup"]
        res[dev] = {"shapes": shapes, "ctx": ctx, "decode_ms": t.decode_us / 1e3,
                    "verify_ms": {r: v / 1e3 for r, v in t.verify_us.items()},
                    "draft_ms": {r: v / 1e3 for r, v in t.draft_us.items()},
                    "catch_up_ms": 1e3 * c.catch_up(), "overhead_ms": overhead_ms,
                    "break_even_acceptance": break_even_acceptance(c),
                    "rows": rows}
    return res


def report(res: dict, k_max: int) -> str:
    L = []
    for dev, d in res.items():
        v = ", ".join(f"verify({r}) {ms:.2f}" for r, ms in d["verify_ms"].items())
        L.append(f"model | {dev} {d['shapes']} ctx {d['ctx']} (GPU time model, not measured): decode "
                 f"{d['decode_ms']:.2f} ms, {v} ms, MTP draft {d['draft_ms'][1]:.3f} ms (1 row) / "
                 f"{d['draft_ms'][2]:.3f} ms (2 rows, catch-up {d['catch_up_ms']:.3f} ms/row)"
                 + (f", host overhead {d['overhead_ms']:.2f} ms a round" if d["overhead_ms"] else "") + ": break-even "
                 f"first-draft acceptance {d['break_even_acceptance']:.2f}")
        L.append("| device | acceptance from | a_1 | a_chained | " + " | ".join(f"k={k}" for k in range(1, k_max + 1))
                 + " | best |")
        L.append("|---|---|---|---|" + "---|" * k_max + "---|")
        for name, r in d["rows"].items():
            ks = " | ".join(f"{r['k'][k]['speedup']:.2f}x" for k in range(1, k_max + 1))
            ac = f"{r['ac']:.3f}" + (" (assumed = a_1)" if r["ac_assumed"] else "")
            L.append(f"| {dev} | {name} | {r['a1']:.3f} | {ac} | {ks} | k={r['best_k']} "
                     f"{r['best_speedup']:.2f}x |")
    return "\n".join(L)


def acceptance_from_run(path: str) -> dict[str, tuple[float, float | None]]:
    """Per domain/mode of a bench/spec_trained.py --json file: (a_1, a_c or None)."""
    d = json.loads(Path(path).read_text())
    out = {}
    for key, r in d["runs"].items():
        m = r.get("measured_acceptance")
        if m is None:
            raise SystemExit(f"{path}: run {key} has no measured_acceptance (written by an older spec_trained.py)")
        out[key] = (m["first"], m["chained"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", default=None, help="a bench/spec_trained.py --json file")
    ap.add_argument("--acceptance", default=None, help="A1[,AC]: first-draft (and chained) acceptance")
    ap.add_argument("--devices", default="gb10,h200")
    ap.add_argument("--shapes", default="v4-flash-q2")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--overhead-ms", type=float, default=0.0,
                    help="a drafting round's host work beyond its steps, charged to every round (default 0: the "
                         "model's kernels only; the CPU reference measured ~1 ms a round under load)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    acc: dict[str, tuple[float, float | None]] = {}
    if a.src:
        acc.update(acceptance_from_run(a.src))
    if a.acceptance:
        v = [float(x) for x in a.acceptance.split(",")]
        acc[f"--acceptance {a.acceptance}"] = (v[0], v[1] if len(v) > 1 else None)
    if not acc:
        raise SystemExit("give the acceptance: --from spec_trained.json and/or --acceptance A1[,AC]")
    res = model(acc, [d.strip() for d in a.devices.split(",") if d.strip()], a.shapes, a.ctx, a.k_max, a.overhead_ms)
    print(report(res, a.k_max))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
