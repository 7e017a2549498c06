"""`quantize-vq`: a ds4-layout GGUF whose routed experts are in any format -> the same model with VQ-8 experts (the
backbone layers', a DSpark draft's and a V4 MTP block's, in the model file or ds4's separate MTP file).

Per layer (one layer's experts in flight at a time; the output is written as it is produced):
  1. every expert row of gate, up and down is dequantised, its gain g = f16(RMS(row)) and its vectors w/g
     computed; an equidistant (odd-stride) sample of the layer's vectors is the training pool;
  2. Lloyd rounds on the pool (ds4py.vq.kmeans: equidistant start, fixed rounds, float64 update);
  3. the codebook is rounded to E4M3, then every vector is assigned with that codebook and the f16 gains, and
     the error is measured on the packed bytes decoded by the engine's own decoder (ds4py.quant.vq).
Same input, same options -> the same bytes (no random source; the search does not depend on the BLAS kernel).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py import quant, schema
from ds4py.config import ModelConfig
from ds4py.errors import Ds4Error
from ds4py.gguf import GGUFFile, row_nbytes
from ds4py.quant import vq
from ds4py.vq import kmeans
from ds4py.vq.writer import StreamWriter, TensorPlan, kv_record, kv_records

ALIGNMENT = 128                   # every tensor (so every 12-bit index row of the real model) on a 128-byte line
DENSE_MODES = ("keep", "q4_k")
# --dense q4_k: the attention projections, the shared expert and the output head (seed 000 §4.1's table)
Q4K_SUFFIXES = ("attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight",
                "attn_output_b.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
Q4K_FROM = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)          # only ever requantise down
ROW_CHUNK = 2048
# keys not copied from the source: ours, and the source's checksums (ds4py.checksum), which describe its tensors
OWN_KEYS = ("general.alignment", "ds4py.vq.version", "ds4py.vq.quantizer", "ds4py.tensor_sha256",
            "ds4py.metadata_sha256", "general.file_type")


class QuantizeError(Ds4Error):
    """A source model or option that quantize-vq cannot use."""


@dataclass
class Options:
    bits: int
    bits_shallow: int | None = None
    shallow_layers: int = 0
    dense: str = "keep"
    min_pool: int = 1000          # vectors per codeword a layer must have
    train_per_code: int = 2048    # Lloyd pool: at most this many vectors per codeword (0 = every vector)
    rounds: int = 10
    workers: int | None = None
    # a fixed codebook (pool, K) -> float32 [K, 8] instead of Lloyd: for baselines such as a scalar grid
    codebook: Callable[[np.ndarray, int], np.ndarray] | None = None
    # scale each expert tensor's row gains by <w,w> / <q,w> after assignment: k-means decodes every cell to its mean,
    # so the decoded matrix is (1 - NMSE) too small on average; this removes that bias (more weight error, far
    # less output damage: on the trained tiny V4, VQ-13 Σmin 0.898 -> 0.940, KL 0.041 -> 0.014; docs/vq.md
    # "Trained"). The default; False (--no-unbiased-gains) writes the k-means gains as before
    unbias: bool = True

    def layer_bits(self, layer: int) -> int:
        return self.bits_shallow if self.bits_shallow is not None and layer < self.shallow_layers else self.bits

    def check(self, n_layers: int) -> None:
        for flag, b in (("--bits", self.bits), ("--bits-shallow", self.bits_shallow)):
            if b is not None and not vq.MIN_BITS <= b <= vq.MAX_BITS:
                raise QuantizeError(f"{flag} {b} is outside {vq.MIN_BITS}..{vq.MAX_BITS}")
        if (self.bits_shallow is None) != (self.shallow_layers == 0):
            raise QuantizeError("--bits-shallow and --shallow-layers go together (both or neither)")
        if not 0 <= self.shallow_layers <= n_layers:
            raise QuantizeError(f"--shallow-layers {self.shallow_layers} is outside 0..{n_layers} (the model's layers)")
        if self.dense not in DENSE_MODES:
            raise QuantizeError(f"--dense {self.dense!r} is not one of {', '.join(DENSE_MODES)}")
        if self.min_pool < 1:
            raise QuantizeError(f"--min-pool {self.min_pool} must be at least 1")
        if self.train_per_code and self.train_per_code < self.min_pool:
            raise QuantizeError(f"--train-per-code {self.train_per_code} is below --min-pool {self.min_pool}")
        if self.rounds < 0:
            raise QuantizeError(f"--rounds {self.rounds} must be >= 0")

    def describe(self) -> str:
        s = f"bits={self.bits}"
        if self.bits_shallow is not None:
            s += f" bits_shallow={self.bits_shallow} shallow_layers={self.shallow_layers}"
        s += f" rounds={self.rounds} train_per_code={self.train_per_code} min_pool={self.min_pool} dense={self.dense}"
        return s + (" codebook=fixed" if self.codebook else "")


class Progress:
    """One status line on stderr: redrawn in place on a terminal, only stage-final lines otherwise."""

    def __init__(self, enabled: bool, stream=sys.stderr):
        self.on, self.stream = enabled, stream
        self.tty = enabled and stream.isatty()
        self.last = 0.0

    def bar(self, label: str, done: int, total: int, extra: str = "") -> None:
        if not self.tty or (time.monotonic() - self.last < 0.2 and done < total):
            return
        self.last = time.monotonic()
        n = int(30 * done / max(total, 1))
        self.stream.write(f"\r{label} [{'#' * n}{'.' * (30 - n)}] {done}/{total} {extra}\033[K")
        self.stream.flush()

    def line(self, text: str) -> None:
        if self.on:
            self.stream.write(("\r" if self.tty else "") + text + ("\033[K" if self.tty else "") + "\n")
            self.stream.flush()


# ----------------------------------------------------------------------------------------------- source side
def source_rows(t, rows: slice | int, shape: tuple[int, int]) -> np.ndarray:
    """Rows of a source tensor (a row slice, or expert e of a stacked tensor) as float32 `shape`."""
    if t.qtype in (Q.F32, Q.F16):
        return np.asarray(t.raw[rows], dtype=np.float32).reshape(shape)
    return quant.dequantize(np.ascontiguousarray(t.raw_bytes()[rows]), t.qtype, shape)


def row_gains(w: np.ndarray, where: str) -> np.ndarray:
    """f16 RMS of each row (float64 accumulation)."""
    if not np.isfinite(w).all():
        raise QuantizeError(f"{where} holds NaN or inf weights")
    w64 = w.astype(np.float64)
    g = np.sqrt((w64 * w64).sum(1) / w.shape[1]).astype(np.float16)
    if not np.isfinite(g).all():
        raise QuantizeError(f"{where}: a row's RMS overflows the f16 gain")
    return g


def normalise(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Vectors [rows * cols/8, 8] of w / g (float32; all-zero rows stay zero)."""
    g32 = g.astype(np.float32)[:, None]
    v = np.divide(w, g32, out=np.zeros_like(w), where=g32 > 0)
    return v.reshape(-1, vq.GROUP)


def pool_stride(total: int, target: int, groups: list[int]) -> int:
    """Stride of the equidistant pool sample: >= total/target and coprime to every row's group count, so the
    sample walks through all columns instead of hitting the same few in every row."""
    s = max(1, total // max(target, 1))
    while s > 1 and any(math.gcd(s, n) != 1 for n in groups):
        s += 1
    return s


# ----------------------------------------------------------------------------------------------- one layer
@dataclass
class LayerJob:
    layer: int                              # backbone layer; DSpark stage s: n_layers + s (as the official ids)
    bits: int
    tensors: dict[str, Any]                 # matrix -> source TensorInfo
    block: str = ""                         # the tensors' block prefix: "blk.L" or "dspark.S" (ds4py.quant.vq)
    gains: dict[str, np.ndarray] = field(default_factory=dict)     # matrix -> f16 [X, rows]
    codebook: np.ndarray | None = None      # E4M3 codes [K, 8]
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def n_vectors(self) -> int:
        return sum(int(np.prod(t.shape)) // vq.GROUP for t in self.tensors.values())


def train_layer(job: LayerJob, opts: Options, prog: Progress) -> None:
    """Steps 1 and 2: gains, pool, Lloyd, E4M3 codebook (job.gains, job.codebook, job.report)."""
    K = 1 << job.bits
    total = job.n_vectors
    target = total if not opts.train_per_code else min(total, opts.train_per_code * K)
    groups = [t.shape[2] // vq.GROUP for t in job.tensors.values()]
    stride = pool_stride(total, target, groups)
    pool, base = [], 0
    t0 = time.perf_counter()
    label = f"{_label(job)} gains+pool"
    steps = sum(t.shape[0] for t in job.tensors.values())
    step = 0
    for m, t in job.tensors.items():
        X, rows, cols = t.shape
        g = np.empty((X, rows), np.float16)
        for e in range(X):
            w = source_rows(t, e, (rows, cols))
            g[e] = row_gains(w, f"{t.name} expert {e}")
            v = normalise(w, g[e])
            first = (-base) % stride
            pool.append(v[first::stride])
            base += len(v)
            step += 1
            prog.bar(label, step, steps)
        job.gains[m] = g
    pool = np.concatenate(pool)
    t_pool = time.perf_counter() - t0
    errs: list[float] = []
    energy = float(kmeans.sq_error(pool, np.zeros((1, vq.GROUP), np.float32), np.zeros(len(pool), np.int64)).mean())

    def report(r: int, err: float) -> None:                 # the pool's relative error before round r's update
        errs.append(err / energy if energy else 0.0)
        prog.bar(f"{_label(job)} lloyd", r + 1, opts.rounds, f"pool rel. error {errs[-1]:.4f}")

    t1 = time.perf_counter()
    c = opts.codebook(pool, K) if opts.codebook else kmeans.lloyd(pool, K, opts.rounds, opts.workers, report)
    t_lloyd = time.perf_counter() - t1
    job.codebook = vq.e4m3_encode(c)
    job.report.update(pool=len(pool), pool_stride=stride, pool_rel_err=errs, seconds_pool=t_pool,
                      seconds_lloyd=t_lloyd, lloyd_vectors=len(pool) * opts.rounds)


def assign_layer(job: LayerJob, opts: Options, prog: Progress, write: Callable[[str, np.ndarray], None]) -> None:
    """Step 3: assign every vector with the stored codebook and gains; write payload, hi plane and gains."""
    cb = vq.E4M3_F32[job.codebook]
    search = kmeans.Searcher(cb, opts.workers)
    err_all = energy_all = 0.0
    t0, t_search, n_vec = time.perf_counter(), 0.0, 0
    per_matrix = {}
    for m, t in job.tensors.items():
        X, rows, cols = t.shape
        name = vq.payload_name(job.block, m)
        hi_plane = np.empty((X, rows, cols // vq.ROW_QUANTUM), np.uint8) if job.bits == 13 else None
        err = energy = 0.0
        # per row: <w,q>, <q,q>, <w,w> (only with opts.unbias)
        wb, bb, ww = (np.zeros((X, rows) if opts.unbias else (0, 0)) for _ in range(3))
        for e in range(X):
            w = source_rows(t, e, (rows, cols))
            g = job.gains[m][e]
            v = normalise(w, g)
            ts = time.perf_counter()
            idx = search(v).reshape(rows, cols // vq.GROUP)
            t_search += time.perf_counter() - ts
            n_vec += len(v)
            stream, hi = vq.pack_indices(idx, job.bits)
            write(name, stream)
            if hi_plane is not None:
                hi_plane[e] = hi
            back = vq.decode_rows(stream, hi, g.astype(np.float32), cb, job.bits)   # what the engine will see
            d = (w - back).astype(np.float64)
            err += float((d * d).sum())
            energy += float((w.astype(np.float64) ** 2).sum())
            if opts.unbias:
                w64, b64 = w.astype(np.float64), back.astype(np.float64)
                wb[e], bb[e], ww[e] = (w64 * b64).sum(1), (b64 * b64).sum(1), (w64 * w64).sum(1)
            prog.bar(f"{_label(job)} assign {m:<4s}", e + 1, X)
        if hi_plane is not None:
            write(vq.hi_name(name), hi_plane)
        gains = job.gains[m]
        if opts.unbias and wb.sum() > 0:
            factor = float(ww.sum() / wb.sum())
            scaled = (gains.astype(np.float32) * np.float32(factor)).astype(np.float16)
            # the decode is linear in a row's gain: the error of the stored gains from the per-row sums
            r = np.where(gains != 0, scaled.astype(np.float64) / np.where(gains != 0, gains, 1), 0.0)
            err = float((ww - 2 * r * wb + r * r * bb).sum())
            gains = job.gains[m] = scaled
            job.report.setdefault("unbias_factor", {})[m] = factor
        write(vq.gain_name(name), gains)
        per_matrix[m] = err / energy if energy else 0.0
        err_all += err
        energy_all += energy
    job.report.update(rel_err=err_all / energy_all if energy_all else 0.0, rel_err_matrix=per_matrix,
                      seconds_assign=time.perf_counter() - t0, assign_vectors=n_vec,
                      vectors_per_s=n_vec / t_search if t_search else 0.0, rechecked=search.n_rechecked)


# ----------------------------------------------------------------------------------------------- the file
def _plan_layer(layer: str, bits: int, tensors: dict[str, Any]) -> list[TensorPlan]:
    K = 1 << bits
    out = [TensorPlan(vq.header_name(layer), (vq.HEADER_BYTES,), Q.I8, vq.HEADER_BYTES),
           TensorPlan(vq.codebook_name(layer), (K, vq.GROUP), Q.I8, K * vq.GROUP)]
    for m, t in tensors.items():
        X, rows, cols = t.shape
        name = vq.payload_name(layer, m)
        rb = vq.row_bytes(cols, bits)
        out.append(TensorPlan(name, (X, rows, rb), Q.I8, X * rows * rb))
        if bits == 13:
            out.append(TensorPlan(vq.hi_name(name), (X, rows, cols // vq.ROW_QUANTUM), Q.I8,
                                  X * rows * cols // vq.ROW_QUANTUM))
        out.append(TensorPlan(vq.gain_name(name), (X, rows), Q.F16, X * rows * 2))
    return out


def _dense_type(name: str, t, mode: str) -> Q:
    if (mode == "q4_k" and (name == "output.weight" or name.endswith(Q4K_SUFFIXES)) and t.qtype in Q4K_FROM
            and len(t.shape) == 2 and t.shape[1] % 256 == 0):
        return Q.Q4_K
    return t.qtype


def _write_dense(w: StreamWriter, t, qt: Q) -> None:
    if qt == t.qtype:
        w.write(t.name, t.raw_bytes())
        return
    rows, cols = t.shape
    for a in range(0, rows, ROW_CHUNK):
        b = min(a + ROW_CHUNK, rows)
        w.write(t.name, quant.quantize(source_rows(t, slice(a, b), (b - a, cols)), qt))


def _expert_layer(name: str, n_layers: int) -> tuple[int, str] | None:
    """(layer, matrix) of a routed-expert tensor name, else None: a backbone layer's ("blk.L"), a DSpark draft
    stage's ("dspark.S") or a V4 MTP block's ("mtp.S", in the model file or ds4's separate MTP file); the draft
    blocks are numbered n_layers + S as the official code numbers them (so they take --bits, not the shallow
    width)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] in ("blk", "dspark", "mtp") and parts[1].isdigit() and parts[3] == "weight":
        for m in vq.MATRICES:
            if parts[2] == f"ffn_{m}_exps":
                return int(parts[1]) + (0 if parts[0] == "blk" else n_layers), m
    return None


def _label(job: "LayerJob", aligned: bool = True) -> str:
    if job.block.startswith("blk."):
        return f"layer {job.layer:3d}" if aligned else f"layer {job.layer}"
    return f"{job.block:>9s}" if aligned else job.block


def _compat_records(arch: str, present: set[str]) -> list[bytes]:
    """The keys of ds4's public files a source written before ds4py carried them lacks (convert.general_metadata,
    convert.gguf_metadata's constants); the file type is ggml's "guessed": no ggml type describes VQ-8 experts."""
    from ds4py.config import GATING_SQRTSOFTPLUS, ROPE_SCALING
    from ds4py.convert import FILE_TYPE_GUESSED, QUANTIZATION_VERSION

    want = [(f"{arch}.expert_gating_func", GATING_SQRTSOFTPLUS), (f"{arch}.rope.scaling.type", ROPE_SCALING),
            ("general.type", "model"), ("general.quantization_version", QUANTIZATION_VERSION)]
    return [kv_record(k, v) for k, v in want if k not in present] + [kv_record("general.file_type", FILE_TYPE_GUESSED)]


def quantize_vq(src: str, out: str, opts: Options, progress: bool = True) -> dict[str, Any]:
    """Write OUT: SRC with VQ-8 routed experts. Returns the report (per-layer errors, timings)."""
    from ds4py.convert import output_paths

    f = GGUFFile(src)
    mtp_file = schema.MTP_PREFIX + "e_proj.weight" in f and "token_embd.weight" not in f     # ds4's separate MTP GGUF
    cfg = ModelConfig.from_gguf(f, validate=not mtp_file)
    if mtp_file:                  # the block's tensors as the MTP loader wants them (its experts: checked below)
        for name, (shape, types) in schema.expected_mtp_tensors(cfg).items():
            if not name.endswith("_exps.weight"):
                f.tensor(name, types=types, shape=shape)
    opts.check(cfg.n_layers)
    out, tmp = output_paths(out)
    if os.path.abspath(src) == out:
        raise QuantizeError(f"{out}: the output would overwrite the source model")
    prog = Progress(progress)

    jobs: dict[str, LayerJob] = {}                           # by block prefix
    for name, t in f.tensors.items():
        hit = _expert_layer(name, cfg.n_layers)
        if hit is None:
            continue
        layer, m = hit
        if vq.is_vq(f, name):
            raise QuantizeError(f"{src}: {name} is already VQ-8; quantise from the original experts")
        if t.shape[2] % vq.ROW_QUANTUM:
            raise QuantizeError(f"{src}: {name} rows are {t.shape[2]} weights, not a multiple of {vq.ROW_QUANTUM}")
        block = vq.block_of(name)
        jobs.setdefault(block, LayerJob(layer, opts.layer_bits(layer), {}, block)).tensors[m] = t
    for job in jobs.values():                                # refuse a thin pool before any work
        K = 1 << job.bits
        per = job.n_vectors // K
        if per < opts.min_pool:
            raise QuantizeError(f"{_label(job, False)} has {job.n_vectors:,} vectors for {K:,} codewords "
                                f"({job.bits} bits): {per:,} per codeword, fewer than --min-pool {opts.min_pool:,}; use fewer bits "
                                f"or a smaller --min-pool")

    plans: list[TensorPlan] = []
    order: list[tuple[str, Any]] = []                        # ("dense", TensorInfo) | ("layer", LayerJob)
    for name, t in f.tensors.items():
        hit = _expert_layer(name, cfg.n_layers)
        if hit is not None:
            job = jobs[vq.block_of(name)]
            if hit[1] == next(iter(job.tensors)):
                plans += _plan_layer(job.block, job.bits, job.tensors)
                order.append(("layer", job))
            continue
        qt = _dense_type(name, t, opts.dense)
        nbytes = t.nbytes if qt == t.qtype else t.shape[0] * row_nbytes(qt, t.shape[1])
        plans.append(TensorPlan(name, t.shape, qt, nbytes))
        order.append(("dense", (t, qt)))
    source = kv_records(src)
    records = [raw for key, raw in source if key not in OWN_KEYS]
    records += _compat_records(str(f.meta("general.architecture", "deepseek4")), {key for key, _ in source})
    records += [kv_record("general.alignment", ALIGNMENT), kv_record("ds4py.vq.version", vq.VERSION),
                kv_record("ds4py.vq.quantizer", f"ds4py quantize-vq {opts.describe()}")]

    t_start = time.perf_counter()
    layers: list[dict[str, Any]] = []
    w = StreamWriter(tmp, records, plans, ALIGNMENT)
    try:
        for kind, item in order:
            if kind == "dense":
                t, qt = item
                _write_dense(w, t, qt)
                continue
            job = item
            t0 = time.perf_counter()
            train_layer(job, opts, prog)
            w.write(vq.header_name(job.block), vq.Header(job.bits).pack())
            w.write(vq.codebook_name(job.block), job.codebook)
            assign_layer(job, opts, prog, w.write)
            r = dict(layer=job.layer, block=job.block, bits=job.bits, vectors=job.n_vectors,
                     seconds=time.perf_counter() - t0, **job.report)
            layers.append(r)
            mat = " ".join(f"{m} {e:.4f}" for m, e in r["rel_err_matrix"].items())
            prog.line(f"{_label(job)}: {job.bits} bits, rel. error {r['rel_err']:.4f} ({mat}), "
                      f"{job.n_vectors:,} vectors, pool {r['pool']:,}, {r['seconds']:.1f} s, "
                      f"{r['vectors_per_s'] / 1e3:,.0f}k vectors/s")
            job.gains.clear()
        w.finish()
        os.replace(tmp, out)
    except BaseException as e:
        w.abort()
        if isinstance(e, OSError):
            raise QuantizeError(f"{out}: {e.strerror or e}") from e
        raise
    searched = sum(r["lloyd_vectors"] + r["assign_vectors"] for r in layers)
    t_search = sum(r["seconds_lloyd"] + r["assign_vectors"] / max(r["vectors_per_s"], 1e-9) for r in layers)
    report = dict(source=src, output=out, options=opts.describe(), layers=layers,
                  seconds=time.perf_counter() - t_start, vectors_per_s=searched / t_search if t_search else 0.0,
                  bytes=os.path.getsize(out))
    return report
