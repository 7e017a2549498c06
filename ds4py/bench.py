"""Offline decode/prefill sweep: `python -m ds4py bench -m MODEL ...`.

One fixed token sequence is walked to each context frontier with incremental prefill (a row times only the
new interval), then a fixed greedy probe is generated (EOS suppressed) and the KV state is rolled back to the
frontier (state.truncate when the probe is within the model's rollback horizon, else a copy taken before it),
so the next row continues from exactly the prompt. Warm-up is excluded; with --repeat N every
row is measured N times from the same snapshot and reported as mean ± std.

Columns (comparable with ds4-bench):
  ctx_tokens              frontier reached by the prefill (positions in the KV state)
  prefill_tokens          tokens prefilled for this row (the interval since the previous frontier)
  prefill_tps             prefill_tokens / prefill seconds
  gen_tokens              greedy tokens generated at this frontier
  gen_tps                 gen_tokens / decode seconds (the first sampled token comes from the prefill logits)
  kv_bytes                bytes of KV/compressor state held at the frontier (state.nbytes(): what is allocated)
  weight_bytes_per_token  weight bytes one decode step reads (dense + 6 routed experts per layer + head)
  effective_gbps          (weight_bytes_per_token + kv_bytes) · gen_tps / 1e9: an upper bound of the bytes
                          a decode step touches, so it is comparable across machines
  pct_of_roofline         effective_gbps / bandwidth (only when a bandwidth is known)
With an MTP draft block (bench --mtp), the same probe is also decoded speculatively from the same state, its
tokens checked equal to the plain probe's (greedy identity), and four more columns report it:
  spec_tps                gen_tokens / seconds of the speculative probe
  spec_speedup            spec_tps / gen_tps: measured in the same run, on the same state
  spec_acceptance         accepted / verified drafts
  spec_tokens_per_round   tokens per verify round (accepted + 1)
  spec_mean_k             the draft length the scheduler chose per decode step (plain steps count as 0)
A V4.1 file with its DSpark draft speculates the same way (ds4py.dspark), without --mtp.
"""

from __future__ import annotations

import io
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ds4py.contract import device_generation, host_copy_bandwidth_gbps  # noqa: F401 (the bench's API)
from ds4py.errors import Ds4Error
from ds4py.sampling import SamplingParams

DEFAULT_PROMPT = Path(__file__).parent / "data" / "bench_prompt.txt"


COLUMNS = [
    "ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps",
    "kv_bytes", "weight_bytes_per_token", "effective_gbps", "pct_of_roofline",
]
SPEC_COLUMNS = ["spec_tps", "spec_speedup", "spec_acceptance", "spec_tokens_per_round", "spec_mean_k"]


@dataclass
class Row:
    ctx_tokens: int
    prefill_tokens: int
    prefill_tps: float
    gen_tokens: int
    gen_tps: float
    kv_bytes: int
    weight_bytes_per_token: int
    effective_gbps: float
    pct_of_roofline: float | None
    prefill_tps_std: float = 0.0
    gen_tps_std: float = 0.0
    spec_tps: float | None = None
    spec_speedup: float | None = None
    spec_acceptance: float | None = None
    spec_tokens_per_round: float | None = None
    spec_mean_k: float | None = None


@dataclass
class SweepResult:
    rows: list[Row]
    startup: dict[str, float | str | None] = field(default_factory=dict)
    info: dict[str, object] = field(default_factory=dict)


def frontiers(ctx_start: int, ctx_max: int, step_incr: int | None, step_mul: float | None) -> list[int]:
    """The context sizes to measure: ctx_start, then +step_incr (or ×step_mul) up to ctx_max inclusive."""
    if ctx_start < 1 or ctx_max < ctx_start:
        raise Ds4Error(f"need 1 <= --ctx-start ({ctx_start}) <= --ctx-max ({ctx_max})")
    if step_incr is not None and step_mul is not None:
        raise Ds4Error("give either --step-incr or --step-mul, not both")
    if step_mul is not None and step_mul <= 1.0:
        raise Ds4Error(f"--step-mul must be > 1 (got {step_mul})")
    if step_incr is not None and step_incr < 1:
        raise Ds4Error(f"--step-incr must be >= 1 (got {step_incr})")
    out = [ctx_start]
    while True:
        nxt = int(out[-1] * step_mul) if step_mul else out[-1] + (step_incr or ctx_start)
        if nxt <= out[-1] or nxt > ctx_max:
            break
        out.append(nxt)
    return out


def prompt_tokens(encode: Callable[[str], list[int]], text: str, need: int) -> tuple[list[int], int]:
    """Tokenize `text` once; cycle it when it is shorter than `need`. Returns (tokens, times cycled)."""
    toks = encode(text)
    if not toks:
        raise Ds4Error("the prompt file tokenizes to nothing")
    cycles = 0
    out = list(toks)
    while len(out) < need:
        out.extend(toks)
        cycles += 1
    return out[:need], cycles


def _greedy_probe(model, state, logits: np.ndarray, n: int, eos: int | None) -> list[int]:
    """Generate n tokens greedily with EOS suppressed (fixed work per row, independent of the text): n decode
    steps; returns the n tokens fed. A backend with device-side generation (the CUDA engine) runs them as it
    decodes for real, the token never leaving the device (EOS then is only suppressed in the first token: the
    work is the same)."""
    if eos is not None:
        logits = logits.copy()
        logits[eos] = -np.inf
    gen = device_generation(model)
    if gen is not None and n > 0:
        out = [int(np.argmax(logits))]
        out += [int(t) for t in gen(state, out[0], SamplingParams(temperature=0), n)]
        return out[:n]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.step([state], [[out[-1]]])[0]
        if eos is not None:
            logits = logits.copy()
            logits[eos] = -np.inf
    return out


def _spec_probe(spec, state, logits: np.ndarray, n: int, eos: int | None):
    """The same probe decoded speculatively (ds4py.spec rounds, EOS suppressed): (tokens fed, its stats)."""
    from ds4py.sampling import Sampler

    req = spec.new_request(SamplingParams(temperature=0.0), suppress=[] if eos is None else [eos])
    sampler = Sampler(req.params)
    out = [req._sample(logits, sampler)]
    while len(out) <= n:                       # n fed, as the plain probe feeds n
        out += req.round(state, out[-1], sampler, n + 1 - len(out)).tokens
    return out[:n], req.stats


def device_step_stats(model, state=None, steps: int = 32) -> dict[str, float | int] | None:
    """For a backend with device-side decode graphs: launches per decode step and the host time per replayed
    step (the Python work of issuing one step: slot write, graph launches, the token's async read), from a
    greedy generation of `steps` tokens. None for other backends."""
    caps = model.capabilities
    if not (caps.launch_counts and caps.device_generation):
        return None
    st = state if state is not None else model.new_state()
    n = model.launches_per_step(st)
    steps = min(4 if caps.emulated else steps, model.config.context_length - st.n_tokens)
    for _ in model.generate(st, 1, SamplingParams(temperature=0), steps):
        pass
    g = model.last_generate
    return {"launches_per_step": n["total"], "launches_body": n["body"], "launches_head": n["head"],
            "launches_side_stream": n["side_stream"], "host_us_per_step": 1e6 * g["host_s"] / max(g["steps"], 1),
            "gen_tps": g["tokens"] / max(g["wall_s"], 1e-9), "emulated": caps.emulated}


VERIFY_K = (1, 2, 3, 4, 5)
BATCH_ROWS = (1, 2, 4, 8, 16)


def multirow_stats(model, verify_k: Sequence[int] = VERIFY_K, batch_rows: Sequence[int] = BATCH_ROWS,
                   prompt: int = 8, reps: int = 5, progress: Callable[[str], None] | None = None) -> dict | None:
    """For a backend with multi-row steps (the CUDA engine): the cost of a speculative verify of 1 + k rows of one
    sequence relative to one decode step, and the aggregate decode tokens/s of B sequences stepped together (one
    row each). Every timed step is a model.step with the host reading its logits (what a verify and the
    server's batched decode do), after one warm-up step (graph capture); the states are rolled back after each
    step (truncate), so every sample sees the same context. Median of `reps`. None for other backends."""
    if not model.capabilities.multirow:
        return None
    V = model.config.vocab_size
    base = model.new_state()
    model.step([base], [[int(t) % V for t in range(2, 2 + prompt)]])
    n = base.n_tokens

    def timed(states, chunks, all_logits=False) -> float:
        out = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            model.step(states, chunks, all_logits)
            if i:
                out.append(time.perf_counter() - t0)
            for st in states:
                st.truncate(n)
        return statistics.median(out)

    decode = timed([base], [[3]])
    res: dict = {"emulated": model.capabilities.emulated, "context": n, "reps": reps,
                 "decode_step_ms": 1e3 * decode, "verify": [], "batched": []}
    for k in verify_k:
        t = timed([base], [[int(3 + j) % V for j in range(k + 1)]], all_logits=True)
        res["verify"].append({"k": int(k), "rows": int(k) + 1, "ms": 1e3 * t, "vs_decode": t / decode})
        if progress:
            progress(f"verify 1 + {k} rows: {1e3 * t:.2f} ms = {t / decode:.2f}x a decode step")
    states = [base] + [base.copy() for _ in range(max(batch_rows, default=1) - 1)]
    for B in batch_rows:
        t = timed(states[:B], [[int(3 + j) % V] for j in range(B)])
        res["batched"].append({"B": int(B), "ms": 1e3 * t, "tokens_per_s": B / t, "vs_one": (B / t) * decode})
        if progress:
            progress(f"batched decode B = {B}: {B / t:.1f} tokens/s aggregate = {(B / t) * decode:.2f}x one sequence")
    return res


def run_sweep(
    model,
    tokens: Sequence[int],
    points: list[int],
    gen_tokens: int,
    repeat: int = 1,
    bandwidth_gbps: float | None = None,
    eos: int | None = None,
    warmup_tokens: int = 16,
    progress: Callable[[str], None] | None = None,
    spec=None,
) -> list[Row]:
    """Measure every frontier in `points` (ascending) on one evolving state. See the module docstring.
    `spec` (a ds4py.spec.SpecModel of `model`): also the speculative probe, from the same state."""
    if repeat < 1:
        raise Ds4Error("--repeat must be >= 1")
    if spec is not None:
        return _run_spec_sweep(model, spec, tokens, points, gen_tokens, repeat, bandwidth_gbps, eos, warmup_tokens,
                               progress)
    wbytes = int(model.weight_bytes_per_token())

    # Warm-up (excluded): touch the code paths and the page cache once.
    warm = model.new_state()
    wl = model.step([warm], [list(tokens[: max(1, min(warmup_tokens, points[0]))])])[0]
    _greedy_probe(model, warm, wl, min(2, gen_tokens), eos)
    del warm

    state = model.new_state()
    rollback = gen_tokens <= model.rollback_horizon      # the probe can be undone by truncate
    cur = 0
    rows: list[Row] = []
    for frontier in points:
        base = state.copy() if repeat > 1 else None
        chunk = list(tokens[cur:frontier])
        p_times, g_times = [], []
        for r in range(repeat):
            st = state if r == 0 else base.copy()
            t0 = time.perf_counter()
            logits = model.step([st], [chunk])[0]
            p_times.append(time.perf_counter() - t0)
            snap = None if rollback else st.copy()     # the probe must not leak into the next row
            t0 = time.perf_counter()
            _greedy_probe(model, st, logits, gen_tokens, eos)
            g_times.append(time.perf_counter() - t0)
            if r == 0:
                if rollback:
                    st.truncate(frontier)
                kept = st if rollback else snap
        state = kept
        cur = frontier
        kv = int(state.nbytes())
        p_tps = [len(chunk) / t for t in p_times]
        g_tps = [gen_tokens / t for t in g_times] if gen_tokens else [0.0]
        gen_mean = statistics.fmean(g_tps)
        eff = (wbytes + kv) * gen_mean / 1e9
        rows.append(Row(
            ctx_tokens=frontier,
            prefill_tokens=len(chunk),
            prefill_tps=statistics.fmean(p_tps),
            gen_tokens=gen_tokens,
            gen_tps=gen_mean,
            kv_bytes=kv,
            weight_bytes_per_token=wbytes,
            effective_gbps=eff,
            pct_of_roofline=(100.0 * eff / bandwidth_gbps) if bandwidth_gbps else None,
            prefill_tps_std=statistics.pstdev(p_tps) if repeat > 1 else 0.0,
            gen_tps_std=statistics.pstdev(g_tps) if repeat > 1 else 0.0,
        ))
        if progress:
            progress(f"ctx {frontier}: prefill {rows[-1].prefill_tps:.1f} tok/s, gen {gen_mean:.2f} tok/s")
    return rows


def _run_spec_sweep(model, spec, tokens, points, gen_tokens, repeat, bandwidth_gbps, eos, warmup_tokens,
                    progress) -> list[Row]:
    """run_sweep with a paired (main + MTP) state: every probe starts from a copy of the frontier state."""
    wbytes = int(model.weight_bytes_per_token())
    warm = spec.new_state()
    wl = spec.step([warm], [list(tokens[: max(1, min(warmup_tokens, points[0]))])])[0]
    _greedy_probe(model, warm.copy().main, wl, min(2, gen_tokens), eos)
    _spec_probe(spec, warm, wl, min(2, gen_tokens), eos)
    del warm
    state, cur, rows = spec.new_state(), 0, []
    for frontier in points:
        chunk = list(tokens[cur:frontier])
        t0 = time.perf_counter()
        logits = spec.step([state], [chunk])[0]
        p_time = time.perf_counter() - t0
        g_tps, s_tps, stats = [], [], None
        for _ in range(repeat):
            st = state.copy()
            t0 = time.perf_counter()
            plain = _greedy_probe(model, st.main, logits, gen_tokens, eos)
            g_tps.append(gen_tokens / (time.perf_counter() - t0))
            st = state.copy()
            t0 = time.perf_counter()
            fast, stats = _spec_probe(spec, st, logits, gen_tokens, eos)
            s_tps.append(gen_tokens / (time.perf_counter() - t0))
            if fast != plain:
                at = next(i for i, (a, b) in enumerate(zip(fast, plain)) if a != b)
                raise Ds4Error(f"speculative greedy decoding diverged from plain decoding at token {at} of the "
                               f"probe at context {frontier} (a bug: please report it)")
        cur = frontier
        kv = int(state.main.nbytes())
        gen_mean, spec_mean = statistics.fmean(g_tps), statistics.fmean(s_tps)
        eff = (wbytes + kv) * gen_mean / 1e9
        rows.append(Row(
            ctx_tokens=frontier, prefill_tokens=len(chunk), prefill_tps=len(chunk) / p_time, gen_tokens=gen_tokens,
            gen_tps=gen_mean, kv_bytes=kv, weight_bytes_per_token=wbytes, effective_gbps=eff,
            pct_of_roofline=(100.0 * eff / bandwidth_gbps) if bandwidth_gbps else None,
            gen_tps_std=statistics.pstdev(g_tps) if repeat > 1 else 0.0,
            spec_tps=spec_mean, spec_speedup=spec_mean / gen_mean, spec_acceptance=stats.acceptance,
            spec_tokens_per_round=stats.tokens_per_round, spec_mean_k=stats.mean_k))
        if progress:
            progress(f"ctx {frontier}: prefill {rows[-1].prefill_tps:.1f} tok/s, gen {gen_mean:.2f} tok/s, "
                     f"speculative {spec_mean:.2f} tok/s (x{spec_mean / gen_mean:.2f}; {stats.summary()})")
    return rows


# ---- output ---------------------------------------------------------------------------------------------

def _fmt(v, repeat_std: float | None = None) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        s = f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"
        return f"{s} ± {repeat_std:.3f}" if repeat_std else s
    return str(v)


def format_rows(result: SweepResult, fmt: str) -> str:
    rows = result.rows
    columns = COLUMNS + (SPEC_COLUMNS if any(r.spec_tps is not None for r in rows) else [])
    if fmt == "json":
        return json.dumps({"rows": [asdict(r) for r in rows], "startup": result.startup, "info": result.info},
                          indent=2) + "\n"
    std = {"prefill_tps": "prefill_tps_std", "gen_tps": "gen_tps_std"}
    if fmt == "csv":
        cols = columns + ["prefill_tps_std", "gen_tps_std"]
        buf = io.StringIO()
        buf.write(",".join(cols) + "\n")
        for r in rows:
            d = asdict(r)
            buf.write(",".join("" if d[c] is None else (f"{d[c]:.6g}" if isinstance(d[c], float) else str(d[c]))
                               for c in cols) + "\n")
        return buf.getvalue()
    if fmt == "md":
        lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
        for r in rows:
            d = asdict(r)
            lines.append("| " + " | ".join(_fmt(d[c], d.get(std.get(c, ""), None)) for c in columns) + " |")
        return "\n".join(lines) + "\n"
    raise Ds4Error(f"unknown --format {fmt!r} (csv, md or json)")


def plot_rows(rows: list[Row], path: str, title: str) -> None:
    """tokens/s vs context; matplotlib is optional and imported only here."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise Ds4Error("--plot needs matplotlib (pip install matplotlib); the sweep itself does not") from e
    x = [r.ctx_tokens for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r.prefill_tps for r in rows], marker="o", label="prefill tok/s")
    ax.plot(x, [r.gen_tps for r in rows], marker="s", label="decode tok/s")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- prefill rows: a fresh state's prompt of N tokens in one step ---------------------------------------
PREFILL_SIZES = (2048, 12500, 65536)


def prefill_sizes(spec: str, model) -> tuple[tuple[int, ...], str | None]:
    """(sizes, note) for --prefill-sizes: 'auto' = 2k / 12.5k / 64k on a backend with block prefill on its device,
    none (with a one-line reason) elsewhere; 'none'; or a comma-separated list of token counts (any backend)."""
    if spec == "none":
        return (), None
    if spec == "auto":
        caps = model.capabilities
        if caps.block_prefill and not caps.emulated:
            return PREFILL_SIZES, None
        if caps.block_prefill:
            return (), ("prefill rows skipped: the emulator's CPU time means nothing at 2k / 12.5k / 64k tokens "
                        "(give --prefill-sizes for a tiny one)")
        return (), (f"prefill rows skipped: block prefill is the cuda backend's (the {model.backend} backend's "
                    f"prefill speed is the sweep's prefill_tps column)")
    try:
        sizes = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise Ds4Error(f"--prefill-sizes must be 'auto', 'none' or token counts like 2048,12500 (got {spec!r})") \
            from None
    if not sizes or min(sizes) < 1:
        raise Ds4Error(f"--prefill-sizes needs positive token counts (got {spec!r})")
    return sizes, None


def prefill_rates(model, tokens: Sequence[int], sizes: Sequence[int], repeat: int = 1,
                  progress: Callable[[str], None] | None = None, warmup: bool = True) -> list[dict]:
    """Per size n: a fresh state's prefill of tokens[:n] in one step (last logits only), tokens/s (mean of
    `repeat`, after one warm-up run at the smallest size unless warmup=False); a size the context (or the token
    list) cannot hold is reported with a one-line reason instead."""
    out = []
    ctx = model.config.context_length
    fit = [n for n in sizes if n <= min(ctx, len(tokens))]
    if fit and warmup:                                     # warm-up: kernels loaded, workspaces allocated
        model.step([model.new_state()], [list(tokens[:min(fit)])])
    for n in sizes:
        if n > ctx or n > len(tokens):
            why = f"{n} tokens exceed the context length {ctx}" if n > ctx else f"only {len(tokens)} prompt tokens"
            out.append({"tokens": n, "skipped": why})
            if progress:
                progress(f"prefill {n}: skipped ({why})")
            continue
        secs = []
        for _ in range(max(1, repeat)):
            st = model.new_state()
            t0 = time.perf_counter()
            model.step([st], [list(tokens[:n])])
            secs.append(time.perf_counter() - t0)
            del st
        row = {"tokens": n, "seconds": statistics.mean(secs), "tokens_per_s": n / statistics.mean(secs)}
        out.append(row)
        if progress:
            progress(f"prefill {n}: {row['tokens_per_s']:.1f} tokens/s ({row['seconds']:.2f} s)")
    return out


def format_prefill(rows: list[dict]) -> str:
    lines = ["| prefill_tokens | prefill_tps | seconds |", "|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['tokens']} | skipped: {r['skipped']} | |")
        else:
            lines.append(f"| {r['tokens']} | {r['tokens_per_s']:.1f} | {r['seconds']:.3f} |")
    return "\n".join(lines) + "\n"
