"""Memory-mapped weights, dequantised to float32 on use, or multiplied straight from their stored bytes.

The GGUF stays memory-mapped. Kernel sets sit behind one interface (`linear`, `grouped_linear`,
`expert_linear`, `rows`, `get`); "auto" (the default) picks "jit" where numba imports, else "fused":

* "dequant" (the oracle): a matrix is dequantised when a forward step needs it. A small LRU cache
  (default 512 MiB of float32) keeps recently used dequantised matrices: on the tiny models everything fits
  and decode does not re-dequantise; on the full model the cache holds a few layers and the reference simply
  re-dequantises. Routed experts are dequantised one expert at a time (only the experts a token was routed
  to); the embedding reads only the rows of the given ids; matrices too big for the cache (the 129280-row head)
  are streamed through in row chunks.
* "fused" (numpy decode kernels): a sequence's chunk of at most FUSED_MAX_ROWS rows (decode, a short verify;
  every row in row-stable mode) multiplies x with each matrix block by block straight from its stored bytes (ds4py.quant.dot, ds4py.ref.fused: no
  float32 copy of a matrix beyond a cache-sized scratch per thread, a small thread pool over row blocks).
  Longer steps (prefill) dequantise as "dequant" does, in row chunks bounded by the memory budget. Results
  equal "dequant" up to float32 summation order (tests/test_fused.py).
* "jit" (the compiled CPU path): "fused" with the numba kernels of ds4py.quant.jit for every format they cover
  (the numpy kernels for the rest). They compute each output row alone, so a step's rows go through in one
  call (the weights read once per step) and each row still equals itself stepped alone (tests/test_jit.py).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.errors import Ds4Error
from ds4py.gguf import TensorInfo
from ds4py.quant import dequantize, dot, jit, jit_i8, jit_i8_gemm
from ds4py.quant import vq
from ds4py.quant.vq import VQExperts, hi_name as vq_hi_name
from ds4py.ref.fused import Runner
from ds4py.ref.ops import mm, per_row, q8_0_round, q8_k_round

F32 = np.float32
DEFAULT_CACHE_BYTES = 512 << 20
# with the decode kernels (fused / jit) only prefill dequantises: a small cache for the small tensors (norms,
# hyper-connection and compressor parameters, the tiny models whole) and matrices streamed in chunks this size
LEAN_CACHE_BYTES = 32 << 20
LEAN_STREAM_BYTES = 16 << 20
STREAM_ROWS = 8192
KERNELS = ("auto", "dequant", "fused", "jit")
FUSED_MAX_ROWS = 8           # steps of up to this many rows use the fused kernels (decode, a short verify)
# ggml's CPU dot products quantise the activation side to Q8_0 (Q8_0 / MXFP4 weights) or Q8_K (K / IQ quants)
Q8_0_ACT = (Q.Q8_0, Q.MXFP4)
Q8_K_ACT = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS)
# with act_quant and the compiled kernels, these formats take the int8-activation kernels (ds4py.quant.jit_i8:
# x quantised inside, exact integer block sums) for every row count, prefill included; Q8_0 too for steps of up
# to jit_i8.DECODE_ROWS rows (its decode kernel, 8 float lanes per row: 1.5-2x the fp32 kernel's GB/s); the
# others, and Q8_0's longer steps, keep the fp32 kernels on the rounded x (faster there: an int8 Q8_0 or MXFP4
# block of 32 in the buffer kernels costs a horizontal sum each), except a prefill's dense Q8_0 products on
# AVX-512 VNNI and aarch64 sdot hosts (_dense_q8_0: jit_i8_gemm.q8_0_matmul, rows as vector lanes, ~3x BLAS)
INT8_KERNELS = (Q.IQ2_XXS, Q.Q2_K, Q.Q4_K)
INT8_DECODE_KERNELS = (Q.Q8_0,)


def _dequant_rows(t, raw_rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantise whole rows of tensor t (raw_rows: its typed or uint8 rows) to float32 `shape`."""
    if t.qtype in (Q.F32, Q.F16, Q.I32, Q.I16, Q.I8, Q.I64, Q.F64):
        return np.asarray(raw_rows).reshape(shape)
    return dequantize(np.ascontiguousarray(raw_rows).view(np.uint8), t.qtype, shape)


def resolve_kernels(kernels: str) -> str:
    """The kernel set a request names: auto -> jit where numba looks importable (imported at the first compiled
    product, Weights._check_jit), else fused (saying so once on stderr); jit without numba is refused in one
    sentence."""
    if kernels not in KERNELS:
        raise Ds4Error(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "jit" and not jit.available():
        raise Ds4Error(f"--kernels jit needs numba, which does not import here ({jit.unavailable_reason()}); "
                       f"install it (python3 -m pip install numba) or use --kernels fused")
    if kernels == "auto" and not jit.importable():
        _note_numpy_fallback()
        return "fused"
    return "jit" if kernels == "auto" else kernels


def _note_numpy_fallback() -> None:
    why = jit.unavailable_reason()
    _note_once(f"ds4py: numba does not import ({why}); the CPU decode uses the numpy fused kernels")


_NOTED: set[str] = set()


def _note_once(line: str) -> None:
    import sys

    if line not in _NOTED:
        _NOTED.add(line)
        print(line, file=sys.stderr, flush=True)


# what `bench` and logs call each kernel set
KERNEL_LABELS = {"dequant": "oracle (dequantise + BLAS)", "fused": "numpy fused", "jit": "compiled (numba)"}


class Weights:
    """The GGUF's tensors for the forward: every method takes a tensor handle from the typed binding
    (ds4py.schema.bind over GGUFFile.tensor: a TensorInfo), never a name assembled in the math."""

    def __init__(self, gguf, cache_bytes: int = DEFAULT_CACHE_BYTES, act_quant: bool = False,
                 kernels: str = "dequant", threads: int | None = None, stream_bytes: int | None = None,
                 advise: bool = False, lean: bool = False):
        kernels = resolve_kernels(kernels)
        self.lean = lean                   # lean memory (memory_plan): experts larger than a chunk are streamed too
        self.f = gguf
        self.act_quant = act_quant         # emulate ds4 / ggml activation rounding before quantised matmuls
        self.cache_bytes = cache_bytes
        self.kernels = kernels
        self._jit_checked = kernels != "jit"   # numba imported (or found broken) at the first product, not at open
        # float32 bytes of one streamed chunk of a matrix too big for the cache (None: STREAM_ROWS rows)
        self.stream_bytes = stream_bytes
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._cached = 0
        self.vq = VQExperts(gguf)          # decodes VQ-8 experts; its row gains can be rescaled at load
        self.runner = Runner(threads, compiled=kernels == "jit") if kernels != "dequant" else None
        self._finite: dict = {}            # matrix or (matrix, expert) -> its f16 scales hold no inf / NaN
        self._many_plans: dict = {}        # (matrix names, rows) -> linear_many's plan (views only), or None
        self._raws: dict = {}              # matrix name -> its stored rows as a plain ndarray view (_raw)
        self._layer_spans: dict[int, list[tuple[int, int]]] | None = self._advise_init() if advise else None

    # ---- paging hints (the memory-budget mode) ------------------------------------------------------------
    def _advise_init(self) -> dict[int, list[tuple[int, int]]] | None:
        """MADV_RANDOM on the routed-expert tensors (a token reads 6 of 256 experts: readahead around a fault
        would fetch the neighbours' bytes); each layer's other tensors as (offset, nbytes) spans for
        MADV_WILLNEED one layer ahead. None where the platform has no madvise."""
        import mmap

        if not hasattr(mmap, "MADV_WILLNEED"):
            return None
        spans: dict[int, list[tuple[int, int]]] = {}
        for name, t in self.f.tensors.items():
            parts = name.split(".")
            if parts[0] != "blk" or not parts[1].isdigit():
                continue
            if "_exps" in name:
                if not self.f.advise(t.offset, t.nbytes, mmap.MADV_RANDOM):
                    return None
            else:
                spans.setdefault(int(parts[1]), []).append((t.offset, t.nbytes))
        return spans

    def entering_layer(self, il: int) -> None:
        """A forward step is about to run layer il: ask the kernel to read layer il + 1's dense tensors in the
        background (and layer il's when it is the first), so the page faults of the next layer overlap this
        one's compute. A no-op unless paging hints are on."""
        if self._layer_spans is None:
            return
        import mmap

        for j in ((0, 1) if il == 0 else (il + 1,)):
            for off, n in self._layer_spans.get(j, ()):
                self.f.advise(off, n, mmap.MADV_WILLNEED)

    def will_need_experts(self, tensors, experts) -> None:
        """The router picked `experts`: ask for their slices of the stacked expert tensors at once, so the reads
        of the later ones overlap the products of the first. A no-op unless paging hints are on."""
        if self._layer_spans is None:
            return
        import mmap

        for t in tensors:
            per = t.nbytes // t.shape[0]
            for e in experts:
                self.f.advise(t.offset + int(e) * per, per, mmap.MADV_WILLNEED)

    # ---- cache -------------------------------------------------------------------------------------------
    def _get_cached(self, key: tuple, make) -> np.ndarray:
        a = self._cache.get(key)
        if a is not None:
            self._cache.move_to_end(key)
            return a
        a = make()
        if a.nbytes <= self.cache_bytes:
            self._cache[key] = a
            self._cached += a.nbytes
            while self._cached > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes
        return a

    # ---- access ------------------------------------------------------------------------------------------
    def get(self, t: TensorInfo) -> np.ndarray:
        """The whole tensor as float32 (ints stay ints: tid2eid)."""
        def make() -> np.ndarray:
            if t.qtype in (Q.I32, Q.I16, Q.I8, Q.I64):
                return np.asarray(t.raw).reshape(t.shape).astype(np.int64)
            if t.qtype in (Q.F32, Q.F16, Q.F64):
                return np.asarray(t.raw).reshape(t.shape).astype(F32)
            return _dequant_rows(t, t.raw_bytes(), t.shape).astype(F32, copy=False)

        return self._get_cached(("all", t.name), make)

    def rows(self, t: TensorInfo, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D matrix (the embedding lookup), without dequantising the rest."""
        raw = t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes()
        ids = np.asarray(ids, dtype=np.int64)
        return _dequant_rows(t, raw[ids], (len(ids), t.shape[-1])).astype(F32, copy=False)

    def expert(self, t: TensorInfo, e: int) -> np.ndarray:
        """Expert e's [out, in] matrix of a stacked [X, out, in] expert tensor: the one place routed experts
        are dequantised."""
        def make() -> np.ndarray:
            if t.qtype == Q.I8:                                   # VQ-8 index stream (ds4py.quant.vq)
                return self.vq.expert(t.name, e)
            raw = t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes()
            return _dequant_rows(t, raw[e], t.shape[1:]).astype(F32, copy=False)

        return self._get_cached(("expert", t.name, int(e)), make)

    def _raw(self, t: TensorInfo) -> np.ndarray:
        """t.raw_bytes() as a plain ndarray view, made once: a memmap view runs Python (__array_finalize__) at
        every slice and reshape, on the decode path's every product."""
        v = self._raws.get(t.name)
        if v is None:
            v = self._raws[t.name] = np.asarray(t.raw_bytes())
        return v

    def _int8(self, t: TensorInfo, rows: int) -> bool:
        """Whether t's product with `rows` activation rows takes the int8-activation kernels (act_quant numerics,
        compiled kernels)."""
        return self.act_quant and self.kernels == "jit" and (
            t.qtype in INT8_KERNELS or (t.qtype in INT8_DECODE_KERNELS and rows <= jit_i8.DECODE_ROWS))

    def _int8_matmul(self, t: TensorInfo, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x (unrounded) @ W.T through jit_i8: every row on its own (row-stable, batch-invariant), one call.
        Over FUSED_MAX_ROWS rows (prefill) jit_i8_gemm's tiled kernels, bit for bit the same products."""
        if x.shape[0] > FUSED_MAX_ROWS and jit_i8_gemm.supported(t.qtype):
            return jit_i8_gemm.matmul(t.qtype, np.asarray(raw), x, self.runner.threads)
        return jit_i8.matmul(t.qtype, np.asarray(raw), x, self.runner.threads)

    def _dense_prefill(self, t: TensorInfo) -> bool:
        """Whether a prefill's product with dense matrix t takes jit_i8_gemm.dense_q8_0 (act_quant numerics with
        the compiled kernels: the rounded x times the dequantised Q8_0 matrix, as _dequant_linear computes it,
        dequantised by a compiled loop a tile at a time and spread over the threads)."""
        return self.act_quant and self.kernels == "jit" and t.qtype == Q.Q8_0

    def act(self, t: TensorInfo, x: np.ndarray) -> np.ndarray:
        """The activation as a quantised matmul with `t` sees it: unchanged unless act_quant is on."""
        if self.act_quant:
            if t.qtype in Q8_0_ACT:
                return q8_0_round(x)
            if t.qtype in Q8_K_ACT:
                return q8_k_round(x)
        return x

    def _act_unless_int8(self, t: TensorInfo, x: np.ndarray) -> np.ndarray:
        """act(t, x), except where every product of t quantises x itself (dense Q8_0 under act_quant with the
        compiled kernels on an AVX-512 VNNI host: the int8 decode kernel for a few rows, q8_0_matmul for a
        prefill): quantising q8_0_round(x) gives x's own codes and scales back (tests/test_jit_i8_gemm.py), so
        the rounding pass would only cost time (a 2,048-token prefill spent ~7 s of CPU in it)."""
        if self._dense_prefill(t) and jit_i8_gemm.q8_0_int8():
            return x
        return self.act(t, x)

    # ---- matmuls -----------------------------------------------------------------------------------------
    def _check_jit(self) -> None:
        """The first product of a "jit" set: import numba now; where it turns out broken (found by name at open,
        then failing to import), the numpy fused kernels take over, saying so once."""
        self._jit_checked = True
        if not jit.available():
            _note_numpy_fallback()
            self.runner.compiled = False
            self.kernels = "fused"

    def _fuse(self, t: TensorInfo) -> bool:
        """Whether this matrix's few-row products take the decode kernels (a format they cover)."""
        if not self._jit_checked:
            self._check_jit()
        return self.runner is not None and (dot.supported(t.qtype) or t.qtype == Q.I8)

    def _split(self, x: np.ndarray, seg: list[slice] | None, fast, slow) -> np.ndarray:
        """One product over token rows, the kernels chosen per sequence by its own rows only (never by what else
        the step holds, nor by what a cache happens to hold: batch invariance, and the same result whatever ran
        before): a sequence of at most FUSED_MAX_ROWS rows (decode, a short verify), and every row in row-stable
        mode (seg: one group per row), goes through fast(x, segs) (the decode kernels), a longer one (prefill)
        through slow(x, segs)."""
        segs = seg if seg is not None and len(seg) > 1 else [slice(0, x.shape[0])]
        take = [s.stop - s.start <= FUSED_MAX_ROWS for s in segs]
        if all(take):
            return fast(x, seg)
        if not any(take):
            return slow(x, seg)
        return np.concatenate([fast(x[s], None) if k else slow(x[s], None) for s, k in zip(segs, take)])

    def _fused(self, t: TensorInfo, raw: np.ndarray, x: np.ndarray, key, seg: list[slice] | None = None) -> np.ndarray:
        """x @ W.T from W's stored rows `raw` (uint8 [rows, row_nbytes]) through the decode kernels; `key` names
        the rows (the tensor, or one group of it) for the once-only inf / NaN check of their f16 scales (None:
        checked block by block).
        Per row group (seg: per sequence, or per row in a row-stable step), like every other product over token
        rows; the compiled kernels compute every row on its own already, so all rows go in one call."""
        raw = np.asarray(raw)
        if self.runner.compiled and jit.supported(t.qtype):
            return self._fused_rows(t, raw, x, key)
        return per_row(lambda r: self._fused_rows(t, raw, r, key), x, seg)

    def _fused_rows(self, t: TensorInfo, raw: np.ndarray, x: np.ndarray, key) -> np.ndarray:
        if self.act_quant and self.kernels == "jit" and t.qtype in INT8_DECODE_KERNELS:
            # a few-row sequence inside a longer step, or row-stable rows: the int8 decode kernel the rows get
            # stepped alone (_int8 decides by the whole step's rows), not the fp32 kernel on the rounded x; x is
            # rounded already (act), and quantising it again gives its own codes and scales back
            n = jit_i8.DECODE_ROWS
            return np.concatenate([jit_i8.matmul(t.qtype, raw, x[a:a + n], self.runner.threads)
                                   for a in range(0, x.shape[0], n)]) if x.shape[0] else \
                np.empty((0, raw.shape[0]), F32)
        if t.qtype == Q.F32:                                 # nothing to decode: BLAS on the mapped rows
            return np.ascontiguousarray(x, dtype=F32) @ raw.view(F32).T
        if self.runner.compiled and jit.supported(t.qtype):  # inf / NaN scales: exact through the f16 table
            return self.runner.matmul(t.qtype, raw, x, t.shape[-1])
        # key None (a routed expert: a new one nearly every token): each block checks its own scales, cheaper
        # than a pass over the whole expert before the product reads it
        finite = False if key is None else self._finite.get(key)
        if finite is None:
            finite = self._finite[key] = dot.scales_finite(t.qtype, raw)
        if t.qtype == Q.F16 and not finite:                  # inf / NaN weights: numpy's exact cast
            return x @ raw.view(np.float16).astype(F32).T
        return self.runner.matmul(t.qtype, raw, x, t.shape[-1], finite)

    def linear(self, t: TensorInfo, x: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
        """x @ W.T for a [out, in] matrix W, one product per sequence's rows `seg` (ops.mm: batch
        invariance); a matrix larger than the cache is streamed in row chunks."""
        if self._int8(t, x.shape[0]):
            return self._int8_matmul(t, self._raw(t), x)
        fuse = self._fuse(t)
        x = self._act_unless_int8(t, x)
        if fuse:
            return self._split(x, seg, lambda r, sg: self._fused(t, t.raw_bytes(), r, t.name, sg),
                               lambda r, sg: self._dequant_linear(t, r, sg))
        return self._dequant_linear(t, x, seg)

    def linear_pair(self, a: TensorInfo, b: TensorInfo, x: np.ndarray,
                    seg: list[slice] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(linear(a, x), linear(b, x)) for two matrices reading one x (the shared expert's gate and up): in a
        decode step on the int8 kernels, x quantised once and one kernel call for both (the same bits)."""
        T = x.shape[0]
        if (a.qtype == b.qtype and a.shape == b.shape and jit_i8.experts_supported(a.qtype, T)
                and self._int8(a, T)):
            ys = jit_i8.experts_matmul(a.qtype, (self._raw(a)[None], self._raw(b)[None]), np.zeros(1),
                                       np.array([0, T]), np.arange(T), x, self.runner.threads)
            return ys[0], ys[1]
        return self.linear(a, x, seg), self.linear(b, x, seg)

    def linear_many(self, tensors: list[TensorInfo], x: np.ndarray,
                    seg: list[slice] | None = None) -> list[np.ndarray]:
        """[linear(t, x, seg) for t in tensors] for matrices that read one x (a layer's projections of its input):
        in a decode step on the int8 kernels, the Q8_0 and F16 ones in one kernel call with x quantised once
        (jit_i8.matmul_many: the same bits, matrix by matrix); the others one by one, or two of one format and
        shape by linear_pair."""
        T = x.shape[0]
        key = (tuple(t.name for t in tensors), T)
        plan = self._many_plans.get(key, False)
        if plan is False:                  # which matrices go in the one call, and their kernel views: once
            many = [t for t in tensors if len(t.shape) == 2 and self._many_format(t, T)]
            q8 = [t for t in many if t.qtype == Q.Q8_0]
            h16 = [t for t in many if t.qtype == Q.F16]
            plan = None
            if len(many) >= 2 and jit_i8.many_supported(len(q8), len(h16), T):
                plan = (q8, h16, jit_i8.many_plan([t.raw_bytes() for t in q8], [t.raw_bytes() for t in h16],
                                                  tensors[0].shape[-1]))
            self._many_plans[key] = plan
        out: dict = {}
        if plan is not None:
            q8, h16, prepared = plan
            yq, yh = jit_i8.many_run(prepared, x, self.runner.threads)
            out = dict(zip(map(id, q8), yq)) | dict(zip(map(id, h16), yh))
        rest = [t for t in tensors if id(t) not in out]
        i = 0
        while i < len(rest):
            a = rest[i]
            b = rest[i + 1] if i + 1 < len(rest) else None
            if b is not None and b.qtype == a.qtype and b.shape == a.shape:
                out[id(a)], out[id(b)] = self.linear_pair(a, b, x, seg)
                i += 2
            else:
                out[id(a)] = self.linear(a, x, seg)
                i += 1
        return [out[id(t)] for t in tensors]

    def _many_format(self, t: TensorInfo, rows: int) -> bool:
        """Whether linear(t, x) of `rows` rows runs jit_decode's q8_0 / f16 row kernels (so matmul_many gives its
        bits): Q8_0 on the int8 decode kernel, F16 on the compiled decode kernel, act_quant numerics."""
        if not self._jit_checked:
            self._check_jit()
        if not (self.act_quant and self.kernels == "jit" and rows <= FUSED_MAX_ROWS):
            return False
        if t.qtype == Q.Q8_0:
            return self._int8(t, rows)
        return t.qtype == Q.F16 and self._fuse(t) and self.runner.compiled and jit.takes(t.qtype, t.shape[-1])

    def _dense_q8_0(self, raw: np.ndarray, x: np.ndarray, seg: list[slice] | None) -> np.ndarray:
        """A prefill sequence's product with dense Q8_0 rows, x rounded (act): int8 on AVX-512 VNNI and aarch64
        sdot hosts (jit_i8_gemm.q8_0_matmul; quantising the rounded x gives its own codes and scales back), else the
        dequantised tiles + BLAS. Chosen here, per sequence by _split, so a sequence's bits never depend on what
        else the step holds, and row-stable steps keep the decode kernels."""
        if jit_i8_gemm.q8_0_int8():
            return jit_i8_gemm.q8_0_matmul(raw, x, self.runner.threads)
        return jit_i8_gemm.dense_q8_0(raw, x, self.runner.threads, seg)

    def _dequant_linear(self, t: TensorInfo, x: np.ndarray, seg: list[slice] | None) -> np.ndarray:
        if self._dense_prefill(t):
            return self._dense_q8_0(t.raw_bytes(), x, seg)
        out_rows, ncols = t.shape
        if ("all", t.name) in self._cache or out_rows * ncols * 4 <= self.cache_bytes:
            return mm(x, self.get(t).T, seg)
        return self._streamed(t, t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes(), x, seg)

    def _streamed(self, t: TensorInfo, raw: np.ndarray, x: np.ndarray, seg: list[slice] | None) -> np.ndarray:
        """x @ W.T for the stored rows `raw` of matrix t (or of one expert of it), dequantised a chunk of rows
        at a time (STREAM_ROWS rows, or stream_bytes of float32): never a float32 copy of the whole matrix."""
        out_rows, ncols = raw.shape[0], t.shape[-1]
        y = np.empty((x.shape[0], out_rows), F32)
        step = STREAM_ROWS if self.stream_bytes is None else max(1, self.stream_bytes // (4 * ncols))
        for a in range(0, out_rows, step):
            b = min(a + step, out_rows)
            w = _dequant_rows(t, raw[a:b], (b - a, ncols)).astype(F32, copy=False)
            y[:, a:b] = mm(x, w.T, seg)
        return y

    def grouped_linear(self, t: TensorInfo, x: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
        """The grouped projection u_g = W_g @ x_g for x [T, G, in_g] and W [G*rank, in_g] (rows g*rank.. = W_g):
        [T, G, rank]."""
        if self._int8(t, x.shape[0]):
            T, G, _ = x.shape
            rank = t.shape[0] // G
            raw = self._raw(t)
            if jit_i8.experts_supported(t.qtype, T):      # a decode step: the groups as experts, one call
                y, = jit_i8.experts_matmul(t.qtype, (raw.reshape(G, rank, -1),), np.arange(G),
                                           np.arange(0, G * T + 1, T), np.arange(T * G).reshape(T, G).T.ravel(),
                                           x.reshape(T * G, -1), self.runner.threads)
                return y.reshape(G, T, rank).transpose(1, 0, 2)
            return np.stack([self._int8_matmul(t, raw[g * rank:(g + 1) * rank], np.ascontiguousarray(x[:, g]))
                             for g in range(G)], axis=1)
        fuse = self._fuse(t)
        x = self._act_unless_int8(t, x)
        if fuse:
            return self._split(x, seg, lambda r, sg: self._fused_grouped(t, r, sg),
                               lambda r, sg: self._dequant_grouped(t, r, sg))
        return self._dequant_grouped(t, x, seg)

    def _fused_grouped(self, t: TensorInfo, x: np.ndarray, seg: list[slice] | None) -> np.ndarray:
        T, G, _ = x.shape
        rank = t.shape[0] // G
        raw = np.asarray(t.raw_bytes())
        u = np.empty((T, G, rank), F32)
        for g in range(G):
            u[:, g] = self._fused(t, raw[g * rank:(g + 1) * rank], np.ascontiguousarray(x[:, g]), (t.name, g), seg)
        return u

    def _dequant_grouped(self, t: TensorInfo, x: np.ndarray, seg: list[slice] | None) -> np.ndarray:
        G = x.shape[1]
        rank = t.shape[0] // G
        if self._dense_prefill(t):
            raw = np.asarray(t.raw_bytes())
            return np.stack([self._dense_q8_0(raw[g * rank:(g + 1) * rank], np.ascontiguousarray(x[:, g]), seg)
                             for g in range(G)], axis=1)
        if ("all", t.name) in self._cache or t.shape[0] * t.shape[1] * 4 <= self.cache_bytes:
            wT = self.get(t).reshape(G, rank, -1).transpose(0, 2, 1)
            return per_row(lambda r: (r.transpose(1, 0, 2) @ wT).transpose(1, 0, 2), x, seg)
        # larger than the cache: one group's rows at a time (a group's product is the same matmul either way)
        raw = t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes()
        u = np.empty((x.shape[0], G, rank), F32)
        for g in range(G):
            w = _dequant_rows(t, raw[g * rank:(g + 1) * rank], (rank, t.shape[1])).astype(F32, copy=False)
            u[:, g] = per_row(lambda r: r @ w.T, np.ascontiguousarray(x[:, g]), seg)
        return u

    def expert_linear(self, t: TensorInfo, e: int, x: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
        """x @ W_e.T for routed expert e of a stacked [X, out, in] expert tensor (seg: the rows of each sequence
        among x's, which are the rows routed to e)."""
        if self._int8(t, x.shape[0]):
            return self._int8_matmul(t, self._raw(t)[e], x)
        x = self.act(t, x)
        if self._fuse(t):
            return self._split(x, seg, lambda r, sg: self._fused_expert(t, e, r, sg),
                               lambda r, sg: self._dequant_expert(t, e, r, sg))
        return mm(x, self.expert(t, e).T, seg)

    def _dequant_expert(self, t: TensorInfo, e: int, x: np.ndarray, seg: list[slice] | None) -> np.ndarray:
        """A prefill's product with routed expert e: the dequantised expert (cached), or with lean memory and an
        expert larger than one streamed chunk, its rows streamed like a large matrix's."""
        key = ("expert", t.name, int(e))
        if (not self.lean or key in self._cache or t.qtype == Q.I8
                or t.shape[1] * t.shape[2] * 4 <= self.stream_bytes):
            return mm(x, self.expert(t, e).T, seg)
        return self._streamed(t, (t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes())[e], x, seg)

    def _fused_expert(self, t: TensorInfo, e: int, x: np.ndarray, seg: list[slice] | None) -> np.ndarray:
        if t.qtype == Q.I8:                                   # VQ-8 index stream
            lay = self.vq.layer(vq.block_of(t.name))
            hi = self.f.tensor(vq_hi_name(t.name)).raw_bytes()[e] if lay.header.bits == 13 else None
            gains = self.vq.gains(t.name, e)
            if self.runner.compiled:                          # every row on its own: one call
                return self.runner.vq_matmul(t.raw_bytes()[e], hi, gains, lay, x)
            return per_row(lambda r: self.runner.vq_matmul(t.raw_bytes()[e], hi, gains, lay, r), x, seg)
        return self._fused(t, t.raw_bytes()[e], x, None, seg)

    def each(self, fn, n: int) -> None:
        """fn(i) for i in range(n), spread over the kernels' threads where there are several (Runner.each: the
        results do not depend on the thread count), else in order on the calling thread (the dequant oracle)."""
        if self.runner is None:
            for i in range(n):
                fn(i)
            return
        self.runner.each(fn, n)

    def small_blas(self, rows: int) -> bool:
        """Whether a step whose longest chunk has `rows` rows leaves BLAS only small products (the decode kernels
        make all the matrix products): then it runs BLAS on one thread (ds4py.ref.blas)."""
        return self.runner is not None and rows <= FUSED_MAX_ROWS

    # ---- a step's routed experts in one call per projection ----------------------------------------------------
    def experts_batched(self, tensors, rows: int) -> bool:
        """Whether a step of `rows` token rows takes experts_linear for these stacked expert tensors (gate, up,
        down): act_quant numerics, the compiled kernels and, for each tensor, a format whose per-expert products
        at this row count are the experts kernels' bits (jit_i8.experts_supported: a decode step, or a prefill
        of IQ2_XXS / Q2_K experts), so the results are expert_linear's bits."""
        if not (self.act_quant and self.kernels == "jit"):
            return False
        if not self._jit_checked:
            self._check_jit()
        return self.kernels == "jit" and all(
            jit_i8.experts_supported(t.qtype, rows) and self._int8(t, rows) for t in tensors)

    def experts_linear(self, tensors, ex: np.ndarray, gs: np.ndarray, xr: np.ndarray,
                       x: np.ndarray) -> list[np.ndarray]:
        """x[xr[j]] @ W_e.T for each stacked tensor (one, or two of one format and shape sharing x: gate and up)
        and each pair j of group g (e = ex[g], pairs gs[g]..gs[g+1]) -> [len(xr), out] per tensor: one kernel call
        for a layer's routed experts (jit_i8.experts_matmul), each row expert_linear's bits."""
        if len(tensors) == 2 and (tensors[0].qtype != tensors[1].qtype or tensors[0].shape != tensors[1].shape):
            return [y for t in tensors for y in self.experts_linear((t,), ex, gs, xr, x)]
        return jit_i8.experts_matmul(tensors[0].qtype, tuple(self._raw(t) for t in tensors), ex, gs, xr, x,
                                     self.runner.threads)

    def experts_linear_and(self, tensors, ex: np.ndarray, gs: np.ndarray, xr: np.ndarray, x: np.ndarray,
                           other: TensorInfo, other_x: np.ndarray,
                           seg: list[slice] | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """(experts_linear(tensors, ex, gs, xr, x), linear(other, other_x, seg)): the shared expert's down
        projection with the routed experts' gate and up, in one launch where the kernels allow it (a decode step:
        jit_i8.experts_matmul's `plain`), the same bits either way."""
        T = other_x.shape[0]
        if (len(tensors) == 2 and tensors[0].qtype == tensors[1].qtype and tensors[0].shape == tensors[1].shape
                and other.qtype == Q.Q8_0 and len(other.shape) == 2 and T <= FUSED_MAX_ROWS
                and jit_i8.plain_supported(tensors[0].qtype, 2, T) and self._int8(other, T)):
            raws = tuple(self._raw(t) for t in tensors)
            if jit_i8.experts_pooled(tensors[0].qtype, raws, len(ex), self.runner.threads):   # else no launch saved
                *ys, y = jit_i8.experts_matmul(tensors[0].qtype, raws, ex, gs, xr, x, self.runner.threads,
                                               plain=(self._raw(other), other_x))
                return ys, y
        y = self.linear(other, other_x, seg)
        return self.experts_linear(tensors, ex, gs, xr, x), y
