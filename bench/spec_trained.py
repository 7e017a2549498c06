"""Speculative decoding on a model whose draft has learnt something: the trained tiny V4 + MTP
(../shared/trained/v4-tiny-trained, code and prose), CPU reference backend (docs/spec.md "Measured: trained").

    python bench/spec_trained.py [--work DIR] [--prompts 4] [--prompt-tokens 96] [--gen-tokens 64] [--repeat 1]
                                 [--modes greedy,sampled] [--ks sched,1,2] [--clock cpu] [--gpu-model gb10,h200]
                                 [--json out.json]

The checkpoint is converted losslessly with its tokenizer (dense F16, experts MXFP4; default compiled kernels).
Per domain, `--prompts` prompts are windows of the held-out test ids (evenly spaced offsets); from each prompt's
prefilled paired state every variant decodes `--gen-tokens` tokens (EOS suppressed): plain decoding (main
model only, as `--no-spec`), the scheduler, the scheduler with a fresh acceptance verdict per request
(`fresh`: how requests were scheduled before the verdict was pooled, issue 38's third session) and fixed k.
The variants of one prompt run back to back, in an order rotated per prompt (interleaved rounds, so slow
phases of the shared machine hit every variant alike); each probe's wall time and process CPU time are recorded. Greedy (temperature 0): every speculative output is
checked byte-identical to plain. Sampled: the model card's settings (temperature 1.0, top-p 1.0, docs/
generation.md), unseeded (the scheduler uses its measured costs, as a server request without a seed does).

Reported per domain, mode and variant: acceptance, tokens per round, mean k and k over time (per quarter of the
decode), speed-up over plain (min and median over prompts of the per-prompt wall-time and CPU-time ratios,
and the pooled CPU-time ratio: all prompts' plain CPU time over the variant's), the load average after each
domain x mode, and the cost model's break-even acceptance (MeasuredCosts of the scheduler's requests, pooled):
the first-draft acceptance where one round of k = 1 (a first draft step + a verify of 2 rows + the MTP
catch-up of its tokens + the round's measured overhead) yields as many tokens per second as plain steps. Then the
measured acceptance (first draft; chained, from the fixed k >= 2 variants) on the GPU time model's steps at V4
Flash q2 shapes (bench/spec_gpu_model.py; `--gpu-model none` skips it): the modelled speed-up per k on GB10 and
H200 and the break-even acceptance there. `--repeat N` decodes every prompt N times per variant in alternating
order (ABBA) and sums the times.

`--lockstep`: the A/B measurement that resolves a few percent on a shared machine. Per prompt (and repetition)
plain decoding and every variant run in one process with their own states, advanced alternately: the side that
has fed the fewest tokens goes next (ties in a rotating order), one plain step or one speculative round at a time,
and each side is charged only the process CPU time of its own steps. A load swing then lasts over many
alternations and hits every side alike (the back-to-back probes above each take a whole request, ~0.7 s, and the
machine's phases are that long). Reported per domain, mode and variant: the speed ratio plain CPU time / variant
CPU time for the same generated tokens (pooled over the prompt x repetition units), its 95% bootstrap interval
over those units and their min / median, the acceptance, tokens per round, mean k and k over time, and the cost
model's break-even first-draft acceptance beside the measured one; with k = 1 among the variants also the
break-even the lockstep itself measures (a k = 1 round costs tokens per round / ratio plain steps).
"""

from __future__ import annotations

import argparse
import json
import os

# One BLAS thread, set before numpy loads (and --threads 1 for the decode kernels by default): on a shared
# 2-core machine threaded kernels spin against other jobs, and a process's CPU time then counts the spinning.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py.convert import convert_checkpoint  # noqa: E402
from ds4py.model import open_mtp  # noqa: E402
from ds4py.ref.engine import RefModel  # noqa: E402
from ds4py.sampling import Sampler, SamplingParams  # noqa: E402
from ds4py import spec as spec_module  # noqa: E402
from ds4py.mtp_spec import MtpSpec  # noqa: E402
from ds4py.spec_schedule import StepCosts, Verdict, break_even_acceptance  # noqa: E402

TRAINED = Path(os.environ.get("DS4PY_TRAINED") or Path(__file__).resolve().parents[2] / "shared" / "trained" / "v4-tiny-trained")
SAMPLED = SamplingParams(temperature=1.0, top_p=1.0)        # the model card's settings (docs/generation.md)
SCHEDULED = ("sched", "fresh")      # the variants the scheduler decides (the others: a fixed k)
NAMES = {"sched": "scheduler", "fresh": "scheduler, verdict per request"}
EOS = 1


def convert(work: Path) -> tuple[str, str]:
    main, mtp = work / "v4-tiny-trained.gguf", work / "v4-tiny-trained.mtp.gguf"
    if not main.exists() or not mtp.exists():
        convert_checkpoint(str(TRAINED), str(main), experts="mxfp4", dense="f16", progress=False, mtp=str(mtp),
                           tokenizer=str(TRAINED / "tokenizer.json"))
    return str(main), str(mtp)


def plain_probe(model, state, logits: np.ndarray, n: int, params: SamplingParams) -> list[int]:
    """n tokens one main step each (the MTP block not run: what --no-spec does)."""
    sampler, out = Sampler(params), []
    for _ in range(n):
        lg = logits.copy()
        lg[EOS] = -np.inf
        out.append(sampler.sample(lg))
        logits = model.step([state.main], [[out[-1]]])[0]
    return out


def spec_probe(spec, state, logits: np.ndarray, n: int, params: SamplingParams):
    """n tokens fed in speculative rounds: (tokens, stats, k of every round in order, the request)."""
    req = spec.new_request(params, suppress=[EOS])
    sampler = Sampler(params)
    out, ks = [req._sample(logits, sampler)], []
    while len(out) <= n:
        r = req.round(state, out[-1], sampler, n + 1 - len(out))
        ks.append(r.stats.drafted)
        out += r.tokens
    return out[:n], req.stats, ks, req


def _add(a, b):
    """Two requests' SpecStats summed (a prompt's repetitions)."""
    out = type(a)()
    out.add(a)
    out.add(b)
    return out


class _PlainSide:
    """Lockstep: plain decoding (as plain_probe), one main step per advance."""

    def __init__(self, model, state, logits: np.ndarray, params: SamplingParams):
        self.model, self.state, self.logits = model, state, logits
        self.sampler, self.out = Sampler(params), []

    @property
    def fed(self) -> int:
        return len(self.out)

    def advance(self, n: int) -> None:
        lg = self.logits.copy()
        lg[EOS] = -np.inf
        self.out.append(self.sampler.sample(lg))
        self.logits = self.model.step([self.state.main], [[self.out[-1]]])[0]

    def tokens(self, n: int) -> list[int]:
        return self.out[:n]


class _SpecSide:
    """Lockstep: the speculative driver (as spec_probe), one round per advance; the first token (sampled from the
    prompt's logits, as plain's first) in the first advance."""

    def __init__(self, spec, state, logits: np.ndarray, params: SamplingParams):
        self.spec, self.state, self.logits, self.params = spec, state, logits, params
        self.req = self.sampler = None
        self.out, self.ks = [], []

    @property
    def fed(self) -> int:
        return max(len(self.out) - 1, 0)

    def advance(self, n: int) -> None:
        if self.req is None:
            self.req = self.spec.new_request(self.params, suppress=[EOS])
            self.sampler = Sampler(self.params)
            self.out.append(self.req._sample(self.logits, self.sampler))
        r = self.req.round(self.state, self.out[-1], self.sampler, n + 1 - len(self.out))
        self.ks.append(r.stats.drafted)
        self.out += r.tokens

    def tokens(self, n: int) -> list[int]:
        return self.out[:n]


def lockstep(sides: dict, n: int, first: int) -> dict[str, float]:
    """Advance every side until each has fed n tokens: the one that has fed the fewest goes next (ties in the
    order of `sides` rotated by `first`); each side charged the process CPU time of its own advances."""
    names = list(sides)
    names = names[first % len(names):] + names[:first % len(names)]
    cpu = dict.fromkeys(names, 0.0)
    while True:
        todo = [v for v in names if sides[v].fed < n]
        if not todo:
            return cpu
        v = min(todo, key=lambda v: sides[v].fed)          # min keeps the first of equals: the rotated order
        c0 = time.process_time()
        sides[v].advance(n)
        cpu[v] += time.process_time() - c0


def bootstrap(plain: list[float], spec: list[float], reps: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% interval of Σ plain / Σ spec over the units (prompt x repetition), resampled with replacement."""
    p, s = np.asarray(plain), np.asarray(spec)
    idx = np.random.default_rng(seed).integers(0, len(p), (reps, len(p)))
    r = p[idx].sum(1) / s[idx].sum(1)
    return float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))


def run_domain_lockstep(model, mtp, dom: str, args, variants: list[str], mode: str) -> dict:
    """run_domain's report, measured in lockstep (module docstring)."""
    ids = np.load(TRAINED / f"test_{dom}.ids.npy").astype(np.int64)
    params = SamplingParams(temperature=0.0) if mode == "greedy" else SAMPLED
    specs = {v: MtpSpec(model, mtp, fixed_k=None if v in SCHEDULED else int(v)) for v in variants}
    if "fresh" in specs:
        specs["fresh"].verdict = lambda params: Verdict()
    offs = np.linspace(0, len(ids) - args.prompt_tokens - 1, args.prompts).astype(int)
    n = args.gen_tokens
    units = {v: [] for v in ["plain"] + variants}          # CPU seconds per prompt x repetition
    per = {v: {"acc": [0, 0], "rounds": 0, "tokens": 0, "plain": 0, "ks": []} for v in variants}
    reqs, scheds = [], []
    base = specs[variants[0]]
    turn = 0
    for i, off in enumerate(offs):
        st0 = base.new_state()
        logits = base.step([st0], [list(ids[off:off + args.prompt_tokens])])[0]
        for rep in range(args.repeat):
            sides = {"plain": _PlainSide(model, st0.copy(), logits, params)}
            sides |= {v: _SpecSide(specs[v], st0.copy(), logits, params) for v in variants}
            cpu = lockstep(sides, n, turn)
            turn += 1
            plain = sides["plain"].tokens(n)
            for v in ["plain"] + variants:
                units[v].append(cpu[v])
            for v in variants:
                sd = sides[v]
                if mode == "greedy" and sd.tokens(n) != plain:
                    raise SystemExit(f"{dom} prompt {i} {v}: speculative greedy output differs from plain")
                stats, p = sd.req.stats, per[v]
                p["acc"][0] += stats.accepted
                p["acc"][1] += stats.drafted
                p["rounds"] += stats.rounds
                p["tokens"] += stats.spec_tokens
                p["plain"] += stats.plain_steps
                if rep == 0:
                    p["ks"].append(sd.ks)
                scheds.append((v, sd.req.scheduler))
                if v == "sched":
                    reqs.append(sd.req)
    out = {"plain_cpu_ms_per_token": 1e3 * sum(units["plain"]) / (n * len(units["plain"])), "variants": {},
           "units": len(units["plain"])}
    for v in variants:
        p = per[v]
        steps = p["rounds"] + p["plain"]
        ratios = [a / b for a, b in zip(units["plain"], units[v])]
        lo, hi = bootstrap(units["plain"], units[v])
        out["variants"][v] = {
            "acceptance": p["acc"][0] / max(p["acc"][1], 1), "drafted": p["acc"][1],
            "tokens_per_round": p["tokens"] / max(p["rounds"], 1), "mean_k": p["acc"][1] / max(steps, 1),
            "plain_steps": p["plain"], "rounds": p["rounds"], "k_over_time": [quarters(k) for k in p["ks"]],
            "ratio": sum(units["plain"]) / sum(units[v]), "ratio_ci95": [lo, hi], "ratio_min": min(ratios),
            "ratio_median": statistics.median(ratios), "unit_ratios": ratios,
            "cpu_ms_per_token": 1e3 * sum(units[v]) / (n * len(units[v]))}
    out["measured_acceptance"] = measured_acceptance(scheds)
    if reqs and any(r.scheduler.costs.known() for r in reqs):
        out["cost_model"] = break_even(reqs)
    if "1" in out["variants"]:      # k = 1 measured: a round costs tokens/round / ratio plain steps, so it breaks
        k1 = out["variants"]["1"]   # even at the first-draft acceptance that cost - 1 (one draft a round)
        out["lockstep_break_even"] = k1["tokens_per_round"] / k1["ratio"] - 1
    out["load_after"] = os.getloadavg()
    return out


def warm_up(model, mtp) -> None:
    """Lockstep: compile and touch every step kind once (plain, verify of 1..3 rows, draft, catch-up) on a
    throwaway pair, so the first measured side does not pay for it."""
    spec = MtpSpec(model, mtp, fixed_k=2)
    st = spec.new_state()
    logits = spec.step([st], [list(range(2, 34))])[0]
    plain = _PlainSide(model, st.copy(), logits, SamplingParams(temperature=0.0))
    side = _SpecSide(spec, st, logits, SamplingParams(temperature=0.0))
    lockstep({"plain": plain, "spec": side}, 8, 0)


def timed(f):
    w0, c0 = time.perf_counter(), time.process_time()
    out = f()
    return out, time.perf_counter() - w0, time.process_time() - c0


def quarters(ks: list[int]) -> list[float]:
    """Mean k per quarter of the request's rounds (k over time)."""
    if not ks:
        return []
    parts = np.array_split(np.asarray(ks, float), min(4, len(ks)))
    return [round(float(p.mean()), 2) for p in parts]


def break_even(reqs) -> dict:
    """From the scheduler requests' measured costs (pooled medians): the plain step, the first draft step, the
    verify of 2 rows, the MTP catch-up per token m, and the first-draft acceptance a* where
    (1 + a*) / (draft + verify(2) + m·(1 + a*) + overhead) = 1 / plain (spec_schedule.break_even_acceptance)."""
    known = [r.scheduler.costs for r in reqs if r.scheduler.costs.known()]
    plain = statistics.median(r.scheduler.costs.plain() for r in reqs)
    draft = statistics.median(c.draft(True) for c in known)
    v2 = statistics.median(c.verify(2) for c in known)
    m = statistics.median(c.catch_up() for c in known)
    o = statistics.median(c.overhead() for c in known)
    costs = StepCosts(plain, {2: v2}, draft, draft + m, o)
    return {"plain_ms": 1e3 * plain, "draft_ms": 1e3 * draft, "verify2_ms": 1e3 * v2, "catch_up_ms": 1e3 * m,
            "overhead_ms": 1e3 * o, "break_even_acceptance": break_even_acceptance(costs)}


def measured_acceptance(scheds) -> dict:
    """Pooled over a domain x mode's speculative requests ((variant, Scheduler) pairs): the first position's
    acceptance (every round of every variant, known from verify row 0 even at k = 0: [argmax p = argmax q]
    greedy, Σ min(p, q) sampled) and a chained position's, from the fixed-k variants only (every position i >= 2
    a verify reached; None without a fixed k >= 2): the scheduler reaches a chained position only after confident
    drafts, so its chained acceptance ("chained_scheduler") is selected, not what a fixed k would meet."""
    rounds = sum(s.first_rounds for _, s in scheds)
    fixed = [s for v, s in scheds if v not in SCHEDULED]
    sched = [s for v, s in scheds if v == "sched"]
    n_fixed, n_sched = sum(s.chained_n for s in fixed), sum(s.chained_n for s in sched)
    return {"first": sum(s.first_hits for _, s in scheds) / max(rounds, 1), "first_rounds": rounds,
            "chained": sum(s.chained_hits for s in fixed) / n_fixed if n_fixed else None,
            "chained_positions": n_fixed,
            "chained_scheduler": sum(s.chained_hits for s in sched) / n_sched if n_sched else None,
            "chained_scheduler_positions": n_sched}


def run_domain(model, mtp, dom: str, args, variants: list[str], mode: str) -> dict:
    ids = np.load(TRAINED / f"test_{dom}.ids.npy").astype(np.int64)
    params = SamplingParams(temperature=0.0) if mode == "greedy" else SAMPLED
    specs = {v: MtpSpec(model, mtp, fixed_k=None if v in SCHEDULED else int(v)) for v in variants}
    if "fresh" in specs:        # every request starts from no verdict (its own calibration and probes)
        specs["fresh"].verdict = lambda params: Verdict()
    offs = np.linspace(0, len(ids) - args.prompt_tokens - 1, args.prompts).astype(int)
    per = {v: {"wall": [], "cpu": [], "ratio": [], "cpu_ratio": [], "acc": [0, 0], "rounds": 0, "tokens": 0,
               "plain": 0, "ks": []} for v in variants}
    plain_t = {"wall": [], "cpu": []}
    reqs, scheds = [], []
    base = specs[variants[0]]
    for i, off in enumerate(offs):
        st0 = base.new_state()
        logits = base.step([st0], [list(ids[off:off + args.prompt_tokens])])[0]
        order = ["plain"] + variants
        order = order[i % len(order):] + order[:i % len(order)]
        got, times = {}, {v: (0.0, 0.0) for v in order}
        for rep in range(args.repeat):          # each repetition in the reverse order of the one before (ABBA)
            for v in (order if rep % 2 == 0 else order[::-1]):
                st = st0.copy()
                if v == "plain":
                    out, w, c = timed(lambda: plain_probe(model, st, logits, args.gen_tokens, params))
                else:
                    out, w, c = timed(lambda: spec_probe(specs[v], st, logits, args.gen_tokens, params))
                    scheds.append((v, out[3].scheduler))
                if rep and mode == "greedy" and (out if v == "plain" else out[0]) != (
                        got[v] if v == "plain" else got[v][0]):
                    raise SystemExit(f"{dom} prompt {i} {v}: greedy output changed between repetitions")
                if rep == 0 or v == "plain":
                    got[v] = out
                else:                                # statistics summed; k over time from the first repetition
                    got[v] = (got[v][0], _add(got[v][1], out[1]), got[v][2], out[3])
                times[v] = (times[v][0] + w, times[v][1] + c)
        plain_t["wall"].append(times["plain"][0])
        plain_t["cpu"].append(times["plain"][1])
        for v in variants:
            toks, stats, ks, req = got[v]
            if mode == "greedy" and toks != got["plain"]:
                raise SystemExit(f"{dom} prompt {i} {v}: speculative greedy output differs from plain")
            p = per[v]
            p["wall"].append(times[v][0])
            p["cpu"].append(times[v][1])
            p["ratio"].append(times["plain"][0] / times[v][0])
            p["cpu_ratio"].append(times["plain"][1] / times[v][1])
            p["acc"][0] += stats.accepted
            p["acc"][1] += stats.drafted
            p["rounds"] += stats.rounds
            p["tokens"] += stats.spec_tokens
            p["plain"] += stats.plain_steps
            p["ks"].append(ks)
            if v == "sched":
                reqs.append(req)
    n = args.gen_tokens * args.repeat
    out = {"plain_tps_median": n / statistics.median(plain_t["wall"]),
           "plain_cpu_ms_per_token": 1e3 * statistics.median(plain_t["cpu"]) / n, "variants": {}}
    for v in variants:
        p = per[v]
        steps = p["rounds"] + p["plain"]
        out["variants"][v] = {
            "acceptance": p["acc"][0] / max(p["acc"][1], 1), "drafted": p["acc"][1],
            "tokens_per_round": p["tokens"] / max(p["rounds"], 1), "mean_k": p["acc"][1] / max(steps, 1),
            "plain_steps": p["plain"], "rounds": p["rounds"],
            "k_over_time": [quarters(k) for k in p["ks"]],
            "speedup_min": min(p["ratio"]), "speedup_median": statistics.median(p["ratio"]),
            "cpu_speedup_min": min(p["cpu_ratio"]), "cpu_speedup_median": statistics.median(p["cpu_ratio"]),
            "cpu_speedup_pooled": sum(plain_t["cpu"]) / sum(p["cpu"]), "cpu_ratios": p["cpu_ratio"],
            "spec_tps_median": n / statistics.median(p["wall"])}
    out["measured_acceptance"] = measured_acceptance(scheds)
    if reqs and any(r.scheduler.costs.known() for r in reqs):
        out["cost_model"] = break_even(reqs)
    out["load_after"] = os.getloadavg()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="folder for the converted files (default: a temporary one)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per domain (windows of the test ids)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1,
                    help="decode each prompt this many times per variant, the order reversed every time (ABBA): "
                         "a prompt's times are the sums (slow phases of a shared machine hit every variant alike)")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--domains", default="code,prose")
    ap.add_argument("--ks", default="sched,1,2", help="variants: sched (the scheduler), fresh (the scheduler, a "
                    "fresh acceptance verdict per request) and fixed k values")
    ap.add_argument("--kernels", default=None, help="reference kernels (default: the default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="the scheduler's cost clock: wall (as served) or cpu (process time: as on a machine of "
                         "its own; the speed-ups are then read from the CPU-time column)")
    ap.add_argument("--threads", type=int, default=1, help="decode kernel threads (default 1, see above)")
    ap.add_argument("--gpu-model", default="gb10,h200",
                    help="also model the measured acceptance on these devices' GPU time model at V4 Flash q2 "
                         "shapes (bench/spec_gpu_model.py; 'none': skip)")
    ap.add_argument("--lockstep", action="store_true",
                    help="plain and every variant advanced alternately in one process, each charged its own CPU "
                         "time (see the module docstring): resolves a few percent on a shared machine")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    variants = [v.strip() for v in args.ks.split(",") if v.strip()]
    bad = [v for v in variants if v not in SCHEDULED and not (v.isdigit() and int(v) >= 1)]
    if bad or not variants:
        ap.error(f"--ks takes sched, fresh and fixed draft lengths >= 1, got {args.ks!r}")
    if min(args.prompts, args.gen_tokens, args.repeat) < 1:
        ap.error("--prompts, --gen-tokens and --repeat take counts >= 1")
    if args.clock == "cpu":
        spec_module.CLOCK = time.process_time
    work = Path(args.work or tempfile.mkdtemp(prefix="spec_trained_"))
    work.mkdir(parents=True, exist_ok=True)
    main_f, mtp_f = convert(work)
    model = RefModel(main_f, kernels=args.kernels, threads=args.threads)
    mtp = open_mtp(model, mtp_f)
    load0 = os.getloadavg()
    res = {"config": vars(args) | {"kernels_in_use": str(model.kernels)}, "load_before": load0, "runs": {}}
    print(f"load average before: {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f} (2 cores shared with other jobs)",
          flush=True)
    if args.lockstep:
        warm_up(model, mtp)
        print("| domain | mode | variant | acceptance | tokens/round | mean k | k over time (quarters, prompt 1) | "
              "speed-up (lockstep CPU time, pooled) | 95% bootstrap interval | per-unit min / median | "
              "plain ms/token | load |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| domain | mode | variant | acceptance | tokens/round | mean k | k over time (quarters, prompt 1) | "
              "wall speed-up min | wall speed-up median | CPU-time speed-up min | CPU-time speed-up median | "
              "CPU-time speed-up pooled | plain tok/s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for dom in args.domains.split(","):
            r = (run_domain_lockstep if args.lockstep else run_domain)(model, mtp, dom, args, variants, mode)
            res["runs"][f"{dom}/{mode}"] = r
            for v, s in r["variants"].items():
                head = (f"| {dom} | {mode} | {NAMES.get(v, 'k=' + v)} | {s['acceptance']:.3f} | "
                        f"{s['tokens_per_round']:.2f} | {s['mean_k']:.2f} | {s['k_over_time'][0]} | ")
                if args.lockstep:
                    print(head + f"**{s['ratio']:.3f}** | {s['ratio_ci95'][0]:.3f}–{s['ratio_ci95'][1]:.3f} | "
                          f"{s['ratio_min']:.3f} / {s['ratio_median']:.3f} | {r['plain_cpu_ms_per_token']:.2f} | "
                          f"{r['load_after'][0]:.1f} |", flush=True)
                    continue
                print(head + f"{s['speedup_min']:.2f} | {s['speedup_median']:.2f} | {s['cpu_speedup_min']:.2f} | "
                      f"{s['cpu_speedup_median']:.2f} | {s['cpu_speedup_pooled']:.2f} | "
                      f"{r['plain_tps_median']:.1f} |", flush=True)
            ma = r["measured_acceptance"]
            print(f"|   measured acceptance ({dom}, {mode}), pooled over the speculative requests: first draft "
                  f"{ma['first']:.3f} ({ma['first_rounds']} rounds), chained (fixed k) "
                  + (f"{ma['chained']:.3f} ({ma['chained_positions']} positions)" if ma["chained"] is not None
                     else "not measured (no fixed k >= 2 in --ks)")
                  + (f", chained where the scheduler went ({ma['chained_scheduler']:.3f}, "
                     f"{ma['chained_scheduler_positions']} positions: selected by confidence)"
                     if ma["chained_scheduler"] is not None else "") + " |", flush=True)
            if "lockstep_break_even" in r:
                print(f"|   measured in lockstep ({dom}, {mode}): a k = 1 round costs "
                      f"{r['variants']['1']['tokens_per_round'] / r['variants']['1']['ratio']:.2f} plain steps: "
                      f"break-even first-draft acceptance {r['lockstep_break_even']:.2f}, measured "
                      f"{r['measured_acceptance']['first']:.2f} |", flush=True)
            if "cost_model" in r:
                c = r["cost_model"]
                print(f"|   cost model ({dom}, {mode}; load {r['load_after'][0]:.1f}): plain {c['plain_ms']:.1f} ms, "
                      f"first draft {c['draft_ms']:.1f} ms, verify(2) {c['verify2_ms']:.1f} ms, MTP catch-up "
                      f"{c['catch_up_ms']:.1f} ms/token, round overhead {c['overhead_ms']:.2f} ms: break-even "
                      f"first-draft acceptance "
                      f"{c['break_even_acceptance']:.2f}, measured {ma['first']:.2f}: "
                      + ("drafting can pay" if ma["first"] > c["break_even_acceptance"] else
                         "below break-even, plain is the right choice") + " |", flush=True)
    res["load_after"] = os.getloadavg()
    print(f"load average after: {res['load_after'][0]:.1f} {res['load_after'][1]:.1f} {res['load_after'][2]:.1f}")
    devices = [d.strip() for d in args.gpu_model.split(",") if d.strip() and d.strip() != "none"]
    if devices:                 # the measured acceptance on the GPU time model's steps (bench/spec_gpu_model.py)
        import spec_gpu_model

        acc = {k: (r["measured_acceptance"]["first"], r["measured_acceptance"]["chained"])
               for k, r in res["runs"].items()}
        res["gpu_model"] = spec_gpu_model.model(acc, devices, "v4-flash-q2", 2048, 4)
        print(spec_gpu_model.report(res["gpu_model"], 4))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
