"""`python -m ds4py sidecar-fit`: solve a domain sidecar of a VQ base against its teacher (docs/vq.md)."""

from __future__ import annotations

import argparse

NAME = "sidecar-fit"
HELP = "fit a domain sidecar (router bias + FP4 down-projection gains per layer) of a VQ base against its teacher"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, metavar="VQ.gguf", help="the VQ-8 base the sidecar will stack on")
    p.add_argument("--teacher", required=True, metavar="TEACHER.gguf",
                   help="the same model before quantisation (e.g. the MXFP4 = official FP4 file)")
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="fitting text (UTF-8; tokenized with the base's tokenizer, BOS first); repeat for sources")
    p.add_argument("--ids", action="append", default=[], metavar="IDS.npy",
                   help="fitting token ids (1-D integer .npy); repeat for sources")
    p.add_argument("--out", required=True, metavar="DIR", help="the sidecar directory to write (must not exist)")
    p.add_argument("--seq-len", type=int, default=512, metavar="N",
                   help="tokens per prefill chunk, a multiple of 128 (default 512)")
    p.add_argument("--min-gain", type=float, default=0.005, metavar="G",
                   help="mount a layer's gains only if their held-out gain exceeds G (default 0.005 = 0.5%%)")
    p.add_argument("--lambdas", default="0.01,0.1,1,10,100,1000", metavar="L,L,...",
                   help="ridge values tried per layer, chosen on held-out rows (default 0.01,0.1,1,10,100,1000)")
    p.add_argument("--no-bias", action="store_true", help="gains only: solve no router bias")
    p.add_argument("--report", metavar="FILE.json", help="also write the manifest's per-layer numbers and times")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-layer progress on stderr")


def read_sources(args) -> list:
    from ds4py.cli.score import load_ids
    from ds4py.errors import Ds4Error
    from ds4py.tokenizer import Tokenizer

    sources = [(path, load_ids(path)) for path in args.ids]
    if args.text:
        tok = Tokenizer.from_gguf(args.base)
        for path in args.text:
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError) as e:
                raise Ds4Error(f"cannot read --text {path}: {getattr(e, 'strerror', None) or e}") from None
            ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)
            sources.append((path, ids))
    if not sources:
        raise Ds4Error("give the fitting corpus with --text FILE or --ids IDS.npy")
    return sources


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import sys
    import time

    import numpy as np

    from ds4py.cli._options import check_new_out
    from ds4py.errors import Ds4Error
    from ds4py.vq.sidecar_fit import Options, fit_sidecar

    check_new_out(args.out)
    sources = [(os.path.basename(n), np.asarray(ids, np.int64)) for n, ids in read_sources(args)]
    try:
        lambdas = tuple(float(x) for x in args.lambdas.split(","))
        if not lambdas or min(lambdas) <= 0:
            raise ValueError
    except ValueError:
        raise Ds4Error(f"--lambdas {args.lambdas!r} must be a comma-separated list of positive numbers") from None
    opts = Options(seq_len=args.seq_len, min_gain=args.min_gain, bias=not args.no_bias, lambdas=lambdas)
    t0 = time.perf_counter()
    say = None if args.quiet else (lambda m: print(f"sidecar-fit: {m}", file=sys.stderr, flush=True))
    times: dict = {}
    sc = fit_sidecar(args.base, args.teacher, sources, opts, progress=say, times=times)
    sc.write(args.out)
    seconds = time.perf_counter() - t0
    if args.report:
        with open(args.report, "w") as fh:
            json.dump({"seconds": seconds, **times, "layers": {l: e.info for l, e in sorted(sc.layers.items())}},
                      fh, indent=1)
    size = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    print(f"wrote {args.out}: {sc.summary()}, {size:,} bytes, fingerprint {sc.fingerprint[:12]}, {seconds:.1f} s")
    return 0
