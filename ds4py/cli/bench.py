"""`python -m ds4py bench`: offline decode/prefill sweep, `bench serve` for a serving load test, or `bench gpu-model`
for the GPU time model (a model of GB10 / H200 from the planned launches, no GPU needed)."""

from __future__ import annotations

import argparse
import sys
import time

from ds4py.cli._options import add_engine_arguments, add_engram_dir, cpu_numerics, model_kwargs, say_numerics

NAME = "bench"
HELP = ("benchmark: prefill/decode sweep over context sizes (default), `bench serve` against a running server, or "
        "`bench gpu-model` (the modelled time of every kernel on GB10 / H200)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", nargs="?", choices=["sweep", "serve", "gpu-model"], default="sweep",
                   help="sweep (offline, default), serve (load test of a running server) or gpu-model (the GPU time "
                        "model: docs/cuda.md)")
    g = p.add_argument_group("sweep")
    g.add_argument("-m", "--model", dest="model_path", default=None,
                   help="GGUF model file or a pulled model's name (default: the pulled model, as serve uses; the "
                        "demo model when none is pulled)")
    add_engine_arguments(g)
    add_engram_dir(g)
    g.add_argument("--prompt-file", help="text walked to every frontier (default: bundled public-domain book)")
    g.add_argument("--ctx-start", type=int, default=None,
                   help="first context size measured, in tokens (default 2048; 256 on the demo model)")
    g.add_argument("--ctx-max", type=int, default=None,
                   help="last context size measured, in tokens (default 65536; 1024 on the demo model)")
    g.add_argument("--step-incr", type=int, default=None,
                   help="add this many tokens per row (default 2048; 256 on the demo model)")
    g.add_argument("--step-mul", type=float, default=None, help="multiply the frontier by this per row")
    g.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens per row, EOS suppressed (default 128)")
    g.add_argument("--repeat", type=int, default=1, help="measure every row N times: mean ± std (default 1)")
    g.add_argument("--mtp", metavar="MTP.gguf", default=None,
                   help="the model's MTP draft block: also decode each probe speculatively (identity-checked) and "
                        "report acceptance, tokens per round and the speed-up over plain decoding (docs/spec.md)")
    g.add_argument("--verify-k", default=None, metavar="K,K,...",
                   help="multi-row steps (CUDA backends): the cost of a speculative verify of 1 + k rows against one "
                        "decode step for these k (default 1,2,3,4,5 on cuda; off on cuda-emu unless given; 0 = off)")
    g.add_argument("--batch-rows", default=None, metavar="B,B,...",
                   help="multi-row steps (CUDA backends): aggregate decode tokens/s of B sequences stepped together "
                        "(default 1,2,4,8,16 on cuda; off on cuda-emu unless given; 0 = off)")
    g.add_argument("--bandwidth", default=None,
                   help="GB/s for pct_of_roofline, or 'auto' to measure (host copy for ref, device copy for cuda)")
    g.add_argument("--prefill-sizes", default="auto",
                   help="also time a fresh prompt of each of these token counts in one step (prefill tokens/s): "
                        "'auto' = 2048,12500,65536 on cuda (skipped with a one-line reason elsewhere), 'none', or a "
                        "comma-separated list")
    g.add_argument("--format", choices=["csv", "md", "json"], default="md", help="table format (default md)")
    g.add_argument("--out", help="write the table here as well as to stdout")
    g.add_argument("--plot", metavar="PNG", help="PNG of tokens/s vs context (needs matplotlib)")
    m = p.add_argument_group("gpu-model")
    m.add_argument("--device", default="gb10", help="gpu-model: the device profile, gb10 or h200 (default gb10)")
    m.add_argument("--shapes", default=None,
                   help="gpu-model: v4-flash-q2 (default), v4-flash-q4 or v41-flash-vq (real shapes, synthetic weights)")
    m.add_argument("--ctx", default=None, metavar="N[,N...]",
                   help="gpu-model: decode context(s) in tokens (default 2048,65536; verify and prefill at the first)")
    m.add_argument("--traffic", default=None, metavar="REPORT.json",
                   help="gpu-model: coalescing per kernel from this traffic report (python3 -m ds4py.cuda.traffic; "
                        "default bench/traffic/report.json when present, else 100%% assumed)")
    m.add_argument("--per-launch", action="store_true", help="gpu-model: also one line per launch of the first step")
    s = p.add_argument_group("serve")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    s.add_argument("--served-model", dest="served_model", default=None,
                   help="model id to request (default: the first of /v1/models)")
    s.add_argument("--concurrency", default="1",
                   help="requests in flight; a comma-separated list (1,4,8) runs each level and compares them (default 1)")
    s.add_argument("--requests", type=int, default=8, help="requests per concurrency level (default 8)")
    s.add_argument("--input-len", type=int, default=128, help="approximate prompt tokens per request (default 128)")
    s.add_argument("--output-len", type=int, default=32, help="max_tokens per request (default 32)")
    s.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    s.add_argument("--api-key", default=None, help="the server's API key, if it was started with one")
    s.add_argument("--seed", type=int, default=0, help="seed of the generated prompts (default 0)")
    s.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request generates output-len")
    p.add_argument("--json", nargs="?", const=True, default=None, metavar="F",
                   help="serve: print the summary as JSON; gpu-model: write the model as JSON to the file F")


def _prompt_text(path: str | None) -> str:
    from ds4py.bench import DEFAULT_PROMPT
    from ds4py.errors import Ds4Error

    p = path or DEFAULT_PROMPT
    try:
        return open(p, encoding="utf-8").read()
    except OSError as e:
        raise Ds4Error(f"cannot read prompt file {p}: {e.strerror}") from e


def run_gpu_model(args: argparse.Namespace) -> int:
    """`bench gpu-model`: the modelled step times (ds4py/cuda/timemodel.py), every line labelled `model`."""
    import json

    from ds4py.cuda import timemodel
    from ds4py.cuda.devices import PROFILES
    from ds4py.cuda.plan import SHAPES
    from ds4py.errors import Ds4Error

    if args.model_path:
        raise Ds4Error("bench gpu-model plans a step at the shapes of a model family (--shapes "
                       f"{' | '.join(SHAPES)}); modelling a GGUF file's own tensors (-m) is not built yet")
    if args.json is True:
        raise Ds4Error("bench gpu-model --json needs a file name: --json F")
    device = str(args.device).lower()
    if device not in PROFILES:
        raise Ds4Error(f"--device must be one of {', '.join(PROFILES)} (got {args.device!r})")
    shapes = args.shapes or "v4-flash-q2"
    if shapes not in SHAPES:
        raise Ds4Error(f"--shapes must be one of {', '.join(SHAPES)} (got {shapes!r})")
    ctxs = timemodel.DEFAULT_CTX
    if args.ctx is not None:
        try:
            ctxs = tuple(int(v) for v in str(args.ctx).split(",") if v.strip())
        except ValueError:
            raise Ds4Error(f"--ctx must be a comma-separated list of token counts (got {args.ctx!r})") from None
        if not ctxs or any(c < 1 or c > 1 << 20 for c in ctxs):
            raise Ds4Error(f"--ctx values must be between 1 and {1 << 20} tokens (got {args.ctx!r})")
    models = timemodel.run(device, shapes, ctxs, coalescing=timemodel.load_coalescing(args.traffic))
    print(f"model | ds4py GPU time model: {device}, {shapes} -- modelled from the planned launches, not measured "
          "(assumptions: docs/cuda.md, 'The GPU time model')")
    for mdl in models:
        sys.stdout.write(timemodel.format_step(mdl))
    # the other numerics: int8 activations (Numerics.ds4()), decode as the engine plans it under them (the CLI's
    # default on a device where fp32 misses its decode target: devices.py act_numerics, docs/cuda.md "Activation
    # numerics")
    quant = timemodel.run(device, shapes, ctxs, coalescing=timemodel.load_coalescing(args.traffic),
                          steps=("decode",), numerics="act_quant")
    for mdl in quant:
        sys.stdout.write(timemodel.format_step(mdl, top=4))
    if args.per_launch:
        sys.stdout.write(timemodel.format_kernels(models[0]))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(timemodel.bench_json(models, quant), f, indent=1)
        except OSError as e:
            raise Ds4Error(f"cannot write {args.json}: {e.strerror}") from None
        print(f"model | wrote {args.json}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    from ds4py.errors import Ds4Error

    if args.mode == "gpu-model":
        return run_gpu_model(args)
    if args.mode == "serve":
        from ds4py import bench_serve

        levels = bench_serve.parse_levels(args.concurrency)
        runs = bench_serve.run_serve_sweep(
            args.url, levels, model=args.served_model, requests=args.requests,
            input_len=args.input_len, output_len=args.output_len, request_rate=args.request_rate,
            api_key=args.api_key, seed=args.seed, prompt_text=_prompt_text(args.prompt_file),
            ignore_eos=args.ignore_eos)
        if args.json:
            sys.stdout.write(bench_serve.dumps(runs[0] if len(runs) == 1 else runs))
        else:
            sys.stdout.write("".join(bench_serve.format_summary(s) for s in runs))
            if len(runs) > 1:
                sys.stdout.write(bench_serve.format_sweep(runs))
        return 0 if all(s["failed_requests"] == 0 for s in runs) else 1

    from ds4py import bench
    from ds4py.backends import open_model
    from ds4py.tokenizer import Tokenizer

    if args.plot:                  # before the sweep, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise Ds4Error("--plot needs matplotlib (python3 -m pip install matplotlib); checked before the sweep "
                           "so that no run is wasted") from None
    from ds4py.cli._options import choose_model

    # a pulled model when no -m is given (its MTP block only with --mtp: speculative probes are a choice)
    choose_model(args, "bench", attr="model_path", pair=False)
    demo = not args.model_path            # smaller defaults: a sweep the numpy reference ends in minutes, not hours
    args.ctx_start = args.ctx_start if args.ctx_start is not None else (256 if demo else 2048)
    args.ctx_max = args.ctx_max if args.ctx_max is not None else (1024 if demo else 65536)
    if demo:
        from ds4py.cli.serve import ensure_demo_model

        args.model_path = str(ensure_demo_model())
        print(f"note: no -m given: benchmarking the demo model (random weights) {args.model_path}", file=sys.stderr)
    bw = None
    if args.bandwidth not in (None, "auto"):
        try:
            bw = float(args.bandwidth)
        except ValueError:
            raise Ds4Error(f"--bandwidth must be a number of GB/s or 'auto' (got {args.bandwidth!r})") from None

    step_incr = args.step_incr if (args.step_incr or args.step_mul) else (256 if demo else 2048)
    points = bench.frontiers(args.ctx_start, args.ctx_max, step_incr if not args.step_mul else None, args.step_mul)
    t0 = time.perf_counter()
    model = open_model(args.model_path, backend=args.backend, **model_kwargs(args), **cpu_numerics(args))
    say_numerics(args, model)
    startup = {"model_open_s": time.perf_counter() - t0}
    startup.update(model.startup)
    if args.bandwidth == "auto":
        bw = model.copy_bandwidth_gbps()
        print(f"bandwidth (measured copy): {bw:.1f} GB/s", file=sys.stderr)
    tok = Tokenizer.from_gguf(args.model_path)
    pf_sizes, pf_note = bench.prefill_sizes(args.prefill_sizes, model)
    tokens, cycles = bench.prompt_tokens(lambda t: tok.encode(t), _prompt_text(args.prompt_file),
                                         max([points[-1], *pf_sizes]))
    if cycles:
        print(f"note: the prompt file is shorter than {points[-1]} tokens; it was repeated {cycles}x",
              file=sys.stderr)

    for k, v in startup.items():
        print(f"startup {k}: {v:.3f}" if isinstance(v, float) else f"startup {k}: {v}", file=sys.stderr)
    from ds4py.drafts import speculative
    from ds4py.spec import SpecModel

    spec = speculative(model, args.mtp)
    rows = bench.run_sweep(model, tokens, points, args.gen_tokens, repeat=args.repeat, bandwidth_gbps=bw,
                           eos=tok.eos_id, progress=lambda m: print(m, file=sys.stderr),
                           spec=spec if spec is not model else None)
    info = {"model": args.model_path, "backend": args.backend, **model_kwargs(args), "kernels_used": model.kernels_label,
            "gen_tokens": args.gen_tokens, "repeat": args.repeat, "bandwidth_gbps": bw,
            "mtp": spec.drafter.path if isinstance(spec, SpecModel) and spec.drafter.kind == "mtp" else None,
            "draft": spec.drafter.kind if isinstance(spec, SpecModel) else None}
    dev = bench.device_step_stats(model)
    if dev is not None:
        info.update(dev)
        note = " (emulator: CPU time, not a GPU number)" if dev["emulated"] else " (target <= 30 us)"
        print(f"decode step: {dev['launches_per_step']} launches ({dev['launches_body']} body + {dev['launches_head']} "
              f"head, {dev['launches_side_stream']} on the side stream); host time per replayed step "
              f"{dev['host_us_per_step']:.1f} us{note}", file=sys.stderr)
    multi = _multirow(args, model, bench)
    if multi is not None:
        info["multirow"] = multi
    if pf_note:
        print(pf_note, file=sys.stderr)
    pf_rows = bench.prefill_rates(model, tokens, pf_sizes, repeat=args.repeat,
                                  progress=lambda m: print(m, file=sys.stderr)) if pf_sizes else []
    info["prefill"] = pf_rows
    result = bench.SweepResult(rows, startup=startup, info=info)
    text = bench.format_rows(result, args.format)
    print(f"kernels: {model.kernels_label}", file=sys.stderr)
    if args.format == "md":
        label = " (emulated: CPU time on the CUDA emulator, not a GPU number)" if model.capabilities.emulated else ""
        text = f"ds4py bench: backend {model.backend}, kernels {model.kernels_label}{label}\n\n" + text
    if pf_rows and args.format == "md":
        text += "\n" + bench.format_prefill(pf_rows)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.plot:
        bench.plot_rows(rows, args.plot, f"ds4py {args.backend}: {args.model_path}")
    return 0


def _ints(text: str | None, what: str) -> tuple[int, ...]:
    from ds4py.errors import Ds4Error

    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise Ds4Error(f"{what} must be a comma-separated list of integers (got {text!r})") from None
    if any(v < 0 or v > 16 for v in vals):
        raise Ds4Error(f"{what} values must be between 0 and 16 (the multi-row step's rows), got {text!r}")
    return tuple(v for v in vals if v > 0)


def _multirow(args, model, bench):
    """bench.multirow_stats on a CUDA backend (the GPU by default, the emulator when asked), printed and returned."""
    if not model.capabilities.multirow:
        if args.verify_k or args.batch_rows:
            print(f"note: --verify-k / --batch-rows time the CUDA engine's multi-row steps; the {model.backend} "
                  "backend has none, so they are skipped", file=sys.stderr)
        return None
    emulated = model.capabilities.emulated
    ks = _ints(args.verify_k if args.verify_k is not None else ("" if emulated else "1,2,3,4,5"), "--verify-k")
    bs = _ints(args.batch_rows if args.batch_rows is not None else ("" if emulated else "1,2,4,8,16"), "--batch-rows")
    if any(k + 1 > 16 for k in ks):
        from ds4py.errors import Ds4Error

        raise Ds4Error("--verify-k: a verify of 1 + k rows must fit one multi-row step (k <= 15)")
    if not ks and not bs:
        return None
    label = " (emulator: CPU time, not a GPU number)" if emulated else ""
    res = bench.multirow_stats(model, ks, bs, reps=1 if emulated else 5,
                               progress=lambda m: print(f"multi-row: {m}{label}", file=sys.stderr))
    res["label"] = label.strip(" ()") or "device"
    return res
