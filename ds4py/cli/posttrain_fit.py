"""`python -m ds4py posttrain-fit`: solve a post-training gain table from a request's decision points (docs/vq.md)."""

from __future__ import annotations

import argparse

NAME = "posttrain-fit"
HELP = "solve last-layer gains that flip chosen decisions (targets) while pinning every other position"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, metavar="VQ.gguf", help="the VQ-8 base")
    p.add_argument("--sidecar", metavar="DIR", help="the sidecar it stacks on (leave out for the bare base)")
    p.add_argument("--ids", required=True, metavar="IDS.npy", help="the request's token ids (prompt + generated)")
    p.add_argument("--split", type=int, required=True, metavar="P",
                   help="ids[:P] is the prompt (captured through prefill), the rest through decode")
    p.add_argument("--targets", required=True, metavar="T.npy",
                   help="int array, one entry per position (T) or per score row (T-P+1): the token the model "
                        "should have chosen there, -1 elsewhere")
    p.add_argument("--out", required=True, metavar="DIR", help="the post-training directory (must not exist); "
                   "a candidate that fails a gate goes to rejected/ beside it instead")
    p.add_argument("--margin", type=float, default=0.5, metavar="TAU", help="target margin in logits (default 0.5)")
    p.add_argument("--rho", type=float, default=1.0, help="weight of the rows that must keep their margin (default 1)")
    p.add_argument("--ridge", type=float, default=1e-3, help="ridge, relative to the mean data diagonal (default 1e-3)")
    p.add_argument("--min-flip", type=float, default=0.5, metavar="F",
                   help="gate: share of decision points that must end on their target (default 0.5)")
    p.add_argument("--min-keep", type=float, default=0.95, metavar="K",
                   help="gate: share of other positions that must keep their top-1 (default 0.95)")
    p.add_argument("--rounds", type=int, default=6, help="active-set rounds per solve (default 6)")
    p.add_argument("--checks", type=int, default=3,
                   help="real forwards; each one's mistakes join the active set of the next solve (default 3)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    import sys

    import numpy as np

    from ds4py.cli.score import load_ids
    from ds4py.cli._options import check_new_out
    from ds4py.errors import Ds4Error
    from ds4py.vq.posttrain_fit import Options, fit_posttrain, keep_or_reject

    check_new_out(args.out)
    ids = load_ids(args.ids)
    try:
        targets = np.load(args.targets, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise Ds4Error(f"cannot read --targets {args.targets}: {e}") from None
    if args.rounds < 1 or args.checks < 1:
        raise Ds4Error("--rounds and --checks must be at least 1")
    opts = Options(margin=args.margin, rho=args.rho, ridge=args.ridge, min_flip=args.min_flip, min_keep=args.min_keep,
                   rounds=args.rounds, checks=args.checks)
    say = None if args.quiet else (lambda m: print(f"posttrain-fit: {m}", file=sys.stderr, flush=True))
    cand, report = fit_posttrain(args.base, args.sidecar, ids, args.split, targets, opts, progress=say)
    where = keep_or_reject(cand, report, args.out)
    a = report["after"]
    if not report["passed"]:
        print(f"rejected: {a['flipped']:.1%} of decision points flipped (gate {opts.min_flip:.0%}), {a['kept']:.1%} "
              f"of other positions kept their top-1 (gate {opts.min_keep:.0%}); the candidate is in {where}",
              file=sys.stderr)
        return 1
    print(f"wrote {where}: {a['flipped']:.1%} of {a['decision_rows']} decision points flipped, {a['kept']:.1%} of "
          f"{a['other_rows']} other positions kept their top-1, fingerprint {cand.fingerprint[:12]}, "
          f"{report['total_s']:.1f} s")
    return 0
