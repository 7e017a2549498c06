"""The speculative scheduler's choices on a virtual clock: real drafts of the trained tiny V4 + MTP
(../shared/trained/v4-tiny-trained, CPU reference), every step's time given, so a run is deterministic and the
machine's load does not enter (docs/spec.md "Fourth session").

    python bench/spec_replay.py [--work DIR] [--prompts 6] [--gen-tokens 96] [--modes greedy,sampled]
                                [--costs plain,verify_row,draft,catch_up,chained,overhead] [--cold 12] [--slow 1.5]

Each main step of r rows advances the scheduler's clock (spec.CLOCK) by plain + (r − 1)·verify_row ms, a first
MTP draft step of r pending rows by draft + (r − 1)·catch_up, a chained one by chained, an MTP catch-up batch of r
rows by r·catch_up, a drafting round's host work by overhead (defaults: the CPU reference on the trained model,
measured interleaved at load ~2: plain 6.5, a verify row 3.05, first draft 1.27, catch-up 0.2 a row, chained 1.1,
overhead 0.5 ms). The first `--cold` main steps of the model's life cost `--slow` times more (a cold start or a
load burst: what a scheduler that never re-times a plain step keeps believing). The scheduler measures its costs
on that clock as it would on a real one (MeasuredCosts); the speed-up is the tokens' plain time (tokens x plain)
over the virtual time of the speculative requests. Variants: `sched` (the scheduler), `no-refresh` (the same
without re-timing a plain step while drafting, medians over the last WINDOW samples of a kind whatever their age:
the scheduler before issue 38's fourth session), `k=1` (fixed). The real drafts and acceptance come from the model:
greedy outputs are checked identical to plain.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py import mtp_spec, spec as spec_module, spec_schedule  # noqa: E402
from ds4py.model import open_mtp  # noqa: E402
from ds4py.ref.engine import RefModel  # noqa: E402
from ds4py.sampling import Sampler, SamplingParams  # noqa: E402

import spec_trained  # noqa: E402


class Clock:
    """The virtual clock and the steps that advance it (wrappers on one model and MTP block)."""

    def __init__(self, model, mtp, costs: list[float], cold: int, slow: float):
        self.t, self.main, self.cold, self.slow = 0.0, 0, cold, slow
        plain, row, draft, catch, chained, over = (c * 1e-3 for c in costs)
        step_hidden, mtp_step = model.step_hidden, mtp.step

        def main_step(states, chunks, all_logits=False):
            self.main += 1
            self.t += (plain + row * (len(chunks[0]) - 1)) * (slow if self.main <= cold else 1.0)
            return step_hidden(states, chunks, all_logits)

        def block_step(states, hidden, next_ids, all_logits=False, logits=True):
            r = len(next_ids[0])
            self.t += (draft + catch * (r - 1)) if logits else catch * r
            return mtp_step(states, hidden, next_ids, all_logits=all_logits, logits=logits)

        model.step_hidden, mtp.step = main_step, block_step
        nxt, finish = mtp_spec.MtpProposal.next, spec_module.SpecRequest.finish

        def chained_step(prop, token):
            self.t += chained - draft              # block_step charged a first step's cost
            return nxt(prop, token)

        def finished(req, *a):
            self.t += over
            return finish(req, *a)

        mtp_spec.MtpProposal.next, spec_module.SpecRequest.finish = chained_step, finished
        spec_module.CLOCK = lambda: self.t


def run(model, mtp, clock: Clock, dom: str, mode: str, variant: str, args, plain_costs: float) -> dict:
    ids = np.load(spec_trained.TRAINED / f"test_{dom}.ids.npy").astype(np.int64)
    params = SamplingParams(temperature=0.0) if mode == "greedy" else spec_trained.SAMPLED
    recent, span = spec_schedule.RECENT, spec_schedule.SPAN
    if variant == "no-refresh":
        spec_schedule.RECENT = spec_schedule.SPAN = spec_schedule.WINDOW
    try:
        spec = mtp_spec.MtpSpec(model, mtp, fixed_k=1 if variant == "k=1" else None)
        if variant == "no-refresh":
            spec.costs.plain_due = lambda: False
        clock.main, t, tokens, ks = 0, 0.0, 0, []
        for off in np.linspace(0, len(ids) - args.prompt_tokens - 1, args.prompts).astype(int):
            st = spec.new_state()
            logits = spec.step([st], [list(ids[off:off + args.prompt_tokens])])[0]
            want = (spec_trained.plain_probe(model, st.copy(), logits, args.gen_tokens, params) if mode == "greedy"
                    else None)
            req, sampler = spec.new_request(params, suppress=[spec_trained.EOS]), Sampler(params)
            out, t0 = [req._sample(logits, sampler)], clock.t
            while len(out) <= args.gen_tokens:
                r = req.round(st, out[-1], sampler, args.gen_tokens + 1 - len(out))
                ks.append(r.stats.drafted)
                out += r.tokens
            t += clock.t - t0
            tokens += args.gen_tokens
            if want is not None and out[:args.gen_tokens] != want:
                raise SystemExit(f"{dom} {variant}: speculative greedy output differs from plain")
        return {"speedup": tokens * plain_costs * 1e-3 / t, "rounds": spec.stats.rounds,
                "plain_steps": spec.stats.plain_steps, "mean_k": spec.stats.mean_k,
                "plain_estimate_ms": 1e3 * spec.costs.plain(), "ks": ks}
    finally:
        spec_schedule.RECENT, spec_schedule.SPAN = recent, span


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="folder for the converted files (default: a temporary one)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--domains", default="code,prose")
    ap.add_argument("--variants", default="sched,no-refresh,k=1")
    ap.add_argument("--costs", default="6.5,3.05,1.27,0.2,1.1,0.5",
                    help="ms: plain step, verify row, first draft step, catch-up row, chained draft step, overhead")
    ap.add_argument("--cold", type=int, default=12, help="main steps at the start that cost --slow times more")
    ap.add_argument("--slow", type=float, default=1.5)
    args = ap.parse_args()
    costs = [float(v) for v in args.costs.split(",")]
    if len(costs) != 6 or min(costs) < 0 or costs[0] <= 0:
        raise SystemExit("--costs takes six non-negative times in ms (plain > 0): plain, verify row, draft, "
                         "catch-up row, chained step, overhead")
    work = Path(args.work or tempfile.mkdtemp(prefix="spec_replay_"))
    work.mkdir(parents=True, exist_ok=True)
    main_f, mtp_f = spec_trained.convert(work)
    model = RefModel(main_f, threads=1)
    mtp = open_mtp(model, mtp_f)
    clock = Clock(model, mtp, costs, args.cold, args.slow)
    print(f"virtual costs (ms): plain {costs[0]}, verify row {costs[1]}, first draft {costs[2]}, catch-up row "
          f"{costs[3]}, chained {costs[4]}, overhead {costs[5]}; the first {args.cold} main steps x{args.slow}")
    print("| domain | mode | variant | speed-up (virtual) | rounds | plain steps | mean k | plain estimate at the end "
          "(ms) | k over the run (first 60 decisions) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for dom in args.domains.split(","):
            for v in args.variants.split(","):
                r = run(model, mtp, clock, dom, mode, v, args, costs[0])
                ks = "".join(str(min(k, 9)) for k in r["ks"][:60])
                print(f"| {dom} | {mode} | {v} | {r['speedup']:.3f} | {r['rounds']} | {r['plain_steps']} | "
                      f"{r['mean_k']:.2f} | {r['plain_estimate_ms']:.2f} | `{ks}` |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
