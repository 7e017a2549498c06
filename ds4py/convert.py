"""Official DeepSeek V4 Flash checkpoint (safetensors) -> GGUF in the ds4 layout (MODEL.md §5, §6).

The conversion streams: tensor infos are planned first (names, shapes, types), then each GGUF tensor is
built from its official source(s), written, and dropped, so peak memory is about one output tensor plus a
row chunk of float32 work space. The output goes to a temporary file that is renamed only on success.

Types written (`dense` = the FP8 linears' mode; F16/F32 "slots" are the tensors ds4 keeps unquantised):
    slot        q8_0 (default)           q4_k (the VQ seed's dense)          f16 (lossless)                   f32 (lossless)
    Q8 linear   Q8_0 (lossy, ~0.4%)      Q4_K (lossy; Q8_0 where a row is    F16 if every value is exact, else F32    F32
                                         not a multiple of 256 wide)
    F16 slot    F16 (rounded)            F16 (rounded)                       F16 if every value is exact, else F32    F32
    F32 slot    F32                      F32                                 F32                              F32
    experts     --experts mxfp4 (lossless repack of FP4+e8m0) | q4_k | q2_k | iq2_xxs | iq2_xxs_q2_k (lossy)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py import checksum, quant, schema
from ds4py.checkpoint import (CONFIG_ALIASES, OFFICIAL_FIELDS, ST_DTYPES, ConvertError,  # noqa: F401
                              official_config, read_json, read_safetensors_header)
from ds4py.config import GATING_SQRTSOFTPLUS, ROPE_SCALING, ModelConfig
from ds4py.progress import Bar
from ds4py.quant import official

ARCH = "deepseek4"
# --experts NAME -> (gate / up type, down type); iq2_xxs_q2_k is the public q2 file's mix
EXPERT_TYPES = {"mxfp4": (QT.MXFP4, QT.MXFP4), "q4_k": (QT.Q4_K, QT.Q4_K), "q2_k": (QT.Q2_K, QT.Q2_K),
                "iq2_xxs": (QT.IQ2_XXS, QT.IQ2_XXS), "iq2_xxs_q2_k": (QT.IQ2_XXS, QT.Q2_K)}
DENSE_MODES = ("q8_0", "q4_k", "f16", "f32")
ROW_CHUNK = 2048          # rows converted at a time (a multiple of every FP8 tile size)

# Keys ds4's public V4 Flash GGUFs carry that other engines read and ds4py's shape does not vary: llama.cpp's
# deepseek4 loader requires expert_gating_func (llama_expert_gating_func_type: 4 = sqrt(softplus), the official
# score_func) and takes rope.scaling.type "yarn" (without it, linear scaling: wrong output on a real model).
QUANTIZATION_VERSION = 2  # ggml's, as llama.cpp's quantiser writes it
FILE_TYPE_GUESSED = 1024  # llama_ftype LLAMA_FTYPE_GUESSED: no ggml "mostly" type describes the file (VQ-8 experts)
# general.file_type: llama.cpp's llama_ftype of the routed experts' type (the bulk of the file, as ds4's files)
FILE_TYPES = {QT.F32: 0, QT.F16: 1, QT.Q8_0: 7, QT.Q2_K: 10, QT.Q4_K: 15, QT.IQ2_XXS: 19, QT.BF16: 32,
              QT.MXFP4: 38}


# ----------------------------------------------------------------------------------------------- shape
def check_shape(s: ModelConfig) -> None:
    """What the converter (and make-tiny) refuse before writing anything."""
    bad = sorted({r for r in s.compress_ratios if r not in (0, 4, 128)})
    if bad:
        raise ConvertError(f"config: compress ratios {bad} are not V4 Flash ratios (0, 4, 128), and the config "
                           "has none of V4.1's source layers")
    if s.n_heads % s.o_groups:
        raise ConvertError(f"config: n_heads {s.n_heads} is not a multiple of o_groups {s.o_groups}")


def shape_from_config(cfg: dict[str, Any]) -> ModelConfig:
    """An official config.json -> the ModelConfig the GGUF will describe (V4 Flash defaults for absent keys)."""
    if not isinstance(cfg, dict):
        raise ConvertError(f"config.json must be a JSON object, not {type(cfg).__name__}")
    from ds4py import convert_v41

    if convert_v41.is_v41_config(cfg):                      # V4.1 Flash (docs/v41.md)
        return convert_v41.shape_from_config(cfg)
    c = official_config(cfg, ("n_layers", "dim", "vocab_size", "n_heads"))
    if not c.get("compress_ratios"):
        raise ConvertError("config.json lacks compress_ratios")
    fields = {OFFICIAL_FIELDS[k]: v for k, v in c.items() if k in OFFICIAL_FIELDS}
    n = int(fields["n_layers"])
    if len(fields["compress_ratios"]) < n:
        raise ConvertError(f"config: compress_ratios has {len(fields['compress_ratios'])} entries for {n} layers")
    fields["compress_ratios"] = [int(r) for r in fields["compress_ratios"][:n]]
    fields["swiglu_clamp"] = (float(c.get("swiglu_limit", 10.0)),) * n
    shape = ModelConfig.v4_flash(**fields)
    check_shape(shape)
    return shape


def gguf_metadata(s: ModelConfig) -> list[tuple[str, str, Any]]:
    """(key, type, value) in ds4's order; types: u32, f32, bool, i32[], f32[]."""
    A = ARCH + "."
    return [
        (A + "block_count", "u32", s.n_layers),
        (A + "context_length", "u32", s.context_length),
        (A + "embedding_length", "u32", s.dim),
        (A + "vocab_size", "u32", s.vocab_size),
        (A + "attention.head_count", "u32", s.n_heads),
        (A + "attention.head_count_kv", "u32", 1),
        (A + "attention.key_length", "u32", s.head_dim),
        (A + "attention.value_length", "u32", s.head_dim),
        (A + "rope.dimension_count", "u32", s.rope_dim),
        (A + "attention.q_lora_rank", "u32", s.q_lora_rank),
        (A + "attention.output_lora_rank", "u32", s.o_lora_rank),
        (A + "attention.output_group_count", "u32", s.o_groups),
        (A + "expert_count", "u32", s.n_experts),
        (A + "expert_used_count", "u32", s.n_experts_used),
        (A + "expert_feed_forward_length", "u32", s.expert_ff),
        (A + "expert_shared_count", "u32", s.n_shared_experts),
        (A + "hash_layer_count", "u32", s.hash_layers),
        (A + "expert_group_count", "u32", 0),
        (A + "expert_group_used_count", "u32", 0),
        (A + "attention.sliding_window", "u32", s.window),
        (A + "attention.indexer.head_count", "u32", s.index_heads),
        (A + "attention.indexer.key_length", "u32", s.index_head_dim),
        (A + "attention.indexer.top_k", "u32", s.index_topk),
        (A + "hyper_connection.count", "u32", s.hc_mult),
        (A + "hyper_connection.sinkhorn_iterations", "u32", s.sinkhorn_iters),
        (A + "hyper_connection.epsilon", "f32", s.hc_eps),
        (A + "attention.compress_ratios", "i32[]", list(s.compress_ratios)),
        (A + "swiglu_clamp_exp", "f32[]", list(s.swiglu_clamp)),
        (A + "rope.scaling.original_context_length", "u32", s.rope_orig_ctx),
        (A + "rope.freq_base", "f32", s.rope_base),
        (A + "rope.scaling.factor", "f32", s.rope_factor),
        (A + "rope.scaling.yarn_beta_fast", "f32", s.beta_fast),
        (A + "rope.scaling.yarn_beta_slow", "f32", s.beta_slow),
        (A + "attention.compress_rope_freq_base", "f32", s.compress_rope_base),
        (A + "expert_weights_scale", "f32", s.route_scale),
        (A + "expert_weights_norm", "bool", s.route_norm),
        (A + "expert_gating_func", "u32", GATING_SQRTSOFTPLUS),
        (A + "rope.scaling.type", "str", ROPE_SCALING),
        (A + "attention.layer_norm_rms_epsilon", "f32", s.norm_eps),
    ]


def general_metadata(tensors: list[tuple[str, Any]]) -> list[tuple[str, str, Any]]:
    """The `general.*` keys beside the name: type, file type (from the routed experts' type, else the type
    holding the most tensors; `tensors`: (name, qtype) pairs) and the ggml quantisation version."""
    gate = [q for n, q in tensors if n.endswith("ffn_gate_exps.weight")]
    if not gate:
        counts: dict = {}
        for _, q in tensors:
            counts[q] = counts.get(q, 0) + 1
        gate = [max(counts, key=counts.get)] if counts else []
    file_type = FILE_TYPES.get(QT(int(gate[0])), FILE_TYPE_GUESSED) if gate else FILE_TYPE_GUESSED
    return [("general.type", "str", "model"), ("general.file_type", "u32", file_type),
            ("general.quantization_version", "u32", QUANTIZATION_VERSION)]


# ----------------------------------------------------------------------------------------------- layout
@dataclass
class Spec:
    """One GGUF tensor: name, numpy shape (reversed ne), slot kind, official source name(s)."""
    name: str
    shape: tuple[int, ...]
    slot: str               # "q8" | "f16" | "f32" | "experts" | "i32"
    src: str | list[str]    # official tensor name (per-expert list for "experts")


def ds4_layout(s: ModelConfig) -> list[Spec]:
    """Every tensor of the ds4 GGUF, in ds4's order, with its official source (the weight schema, ds4py.schema)."""
    return [Spec(e.name, e.shape, e.spec.slot, e.src) for e in schema.entries(s)]


def dspark_layout(s: ModelConfig) -> list[Spec]:
    """V4.1's DSpark draft, written after the backbone into the same GGUF (docs/dspark.md); [] without one."""
    return [Spec(e.name, e.shape, e.spec.slot, e.src) for e in schema.dspark_entries(s)] if s.has_dspark else []


def mtp_layout(s: ModelConfig) -> list[Spec]:
    """Every tensor of the MTP draft GGUF (ds4's `mtp.0.*` file) of the model `s`, from the weight schema."""
    return [Spec(e.name, e.shape, e.spec.slot, e.src) for e in schema.mtp_entries(s)]


# ----------------------------------------------------------------------------------------------- safetensors
def scale_name(weight: str) -> str:
    """`x.weight` -> `x.scale` (the official name of a quantised weight's scales)."""
    return weight[: -len(".weight")] + ".scale" if weight.endswith(".weight") else weight + ".scale"


class Checkpoint:
    """Memory-mapped tensors of one safetensors file or a sharded set (model.safetensors.index.json)."""

    def __init__(self, src: str):
        self.src = src
        index = os.path.join(src, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = read_json(index, "the shard index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConvertError(f"{index}: the shard index has no 'weight_map' object of tensor name -> file name")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            if not files:
                raise ConvertError(f"{src}: no *.safetensors files and no model.safetensors.index.json")
        self.fp8_block: int | None = None   # the dense FP8 tile the converter requires: 128 (V4) / 32 (V4.1)
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for fname in files:
            path = os.path.join(src, fname)
            if not os.path.isfile(path):
                raise ConvertError(f"{src}: shard {fname} named in the index is missing")
            for name, entry in read_safetensors_header(path).items():
                self.entries[name] = entry
        self._maps: dict[str, np.memmap] = {}

    def release(self) -> None:
        """Unmap the files: the pages read so far leave this process's resident set (called after every
        output tensor, so a many-GB checkpoint never accumulates in RSS)."""
        self._maps.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def dtype(self, name: str) -> str:
        return self._entry(name)[1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def _entry(self, name: str):
        e = self.entries.get(name)
        if e is None:
            raise ConvertError(f"{self.src}: tensor {name!r} is missing from the checkpoint")
        return e

    def raw(self, name: str) -> np.ndarray:
        """The stored values as a numpy view (bf16 / fp8 / e8m0 as raw integer codes)."""
        path, dt, shape, off, nbytes = self._entry(name)
        if dt not in ST_DTYPES:
            raise ConvertError(f"{self.src}: tensor {name!r} has dtype {dt}, which the converter does not know")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path][off: off + nbytes].view(ST_DTYPES[dt]).reshape(shape)

    def e8m0(self, name: str) -> np.ndarray:
        """A scale tensor as e8m0 codes: stored F8_E8M0 / U8, or F32 holding exact powers of two."""
        dt, s = self.dtype(name), self.raw(name)
        if dt in ("F8_E8M0", "U8"):
            return s
        if dt == "F32":
            m, e = np.frexp(np.asarray(s))
            if not ((m == 0.5) & (e >= -126) & (e <= 128)).all():
                raise ConvertError(f"{self.src}: scale {name!r} holds values that are not powers of two (not e8m0)")
            return (e + 126).astype(np.uint8)
        raise ConvertError(f"{self.src}: scale {name!r} has dtype {dt}, expected F8_E8M0")

    def floats(self, name: str, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows [r0, r1) of a weight, dequantised exactly to float32 (FP8 and FP4 use their `.scale`)."""
        dt = self.dtype(name)
        x = self.raw(name)
        x = x.reshape(1) if x.ndim == 0 else x
        r1 = x.shape[0] if r1 is None else r1
        if dt == "BF16":
            return quant.dequantize(np.ascontiguousarray(x[r0:r1]), QT.BF16, x[r0:r1].shape)
        if dt in ("F32", "F16", "F64"):
            return np.asarray(x[r0:r1], dtype=np.float32)
        sname = scale_name(name)
        if dt == "F8_E4M3":
            s = self.e8m0(sname)
            want = self.fp8_block
            try:
                b = official.fp8_block_size(x.shape, s.shape, prefer=(want or 128,))
            except ValueError as e:
                raise ConvertError(f"{self.src}: {name!r}: {e}") from None
            if want is not None and b != want:
                raise ConvertError(f"{self.src}: {name!r} uses {b}x{b} FP8 tiles; this config "
                                   f"({'V4.1' if want == 32 else 'V4'} Flash) uses {want}x{want}")
            return official.dequant_fp8(x[r0:r1], s[r0 // b: -(-r1 // b)], b)
        if dt in ("I8", "U8") and sname in self:     # routed expert: packed e2m1 pairs + e8m0 per 32
            return official.dequant_fp4(x[r0:r1], self.e8m0(sname)[r0:r1])
        raise ConvertError(f"{self.src}: tensor {name!r} has dtype {dt}, which is not a weight dtype")


# ----------------------------------------------------------------------------------------------- tokenizer
@dataclass
class Tokenizer:
    tokens: list[str]
    token_types: list[int]     # 1 normal, 3 control (added / special tokens: matched literally), 5 unused
    merges: list[str]          # "a b", rank = index
    bos: int = 0
    eos: int = 1
    pre: str = "joyai-llm"


def load_hf_tokenizer(path: str, vocab_size: int) -> Tokenizer:
    """tokenizer.json (HF byte-level BPE) -> GGUF tokenizer arrays padded to `vocab_size` rows."""
    with open(path, encoding="utf-8") as fh:
        tj = json.load(fh)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ConvertError(f"{path}: tokenizer model is {model.get('type')!r}, expected BPE")
    id_to_tok: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types = {i: 1 for i in id_to_tok}
    for a in tj.get("added_tokens", []):
        id_to_tok[int(a["id"])] = a["content"]
        types[int(a["id"])] = 3
    n = max(id_to_tok) + 1
    if n > vocab_size:
        raise ConvertError(f"{path}: the tokenizer has {n} ids but the model's vocab has {vocab_size} rows")
    tokens = [id_to_tok.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    ttypes = [types.get(i, 5) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    bos, eos = 0, 1
    cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as fh:
            tc = json.load(fh)
        rev = {t: i for i, t in enumerate(tokens)}
        for key in ("bos_token", "eos_token"):
            t = tc.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            if t in rev:
                bos, eos = (rev[t], eos) if key == "bos_token" else (bos, rev[t])
    return Tokenizer(tokens, ttypes, merges, bos, eos)


# ----------------------------------------------------------------------------------------------- writing
@dataclass
class OutTensor:
    name: str
    shape: tuple[int, ...]
    qtype: QT
    make: Callable[[], Any]            # -> uint8 / typed array with exactly nbytes(qtype, shape) bytes, or an
    #                                    iterable of such arrays (row chunks, in order) for a tensor streamed out

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        if self.qtype == QT.I32:
            return rows * self.shape[-1] * 4
        return rows * quant.row_nbytes(self.qtype, self.shape[-1])


def write_gguf(out: str, name: str, meta: list[tuple[str, str, Any]], tok: Tokenizer | None,
               tensors: list[OutTensor], progress: bool = True, after_tensor: Callable[[], None] | None = None,
               arch: str = ARCH) -> None:
    """Write a GGUF to `out` via a temporary file; tensors are built one at a time by `make()` and dropped
    once written (`after_tensor` runs after each one)."""
    import gguf

    out, tmp = output_paths(out)
    w = gguf.GGUFWriter(tmp, arch)
    restore_sigterm = _sigterm_raises()
    try:
        w.add_name(name)
        for key, typ, val in general_metadata([(t.name, t.qtype) for t in tensors]) + meta:
            if typ == "u32":
                w.add_uint32(key, int(val))
            elif typ == "f32":
                w.add_float32(key, float(val))
            elif typ == "bool":
                w.add_bool(key, bool(val))
            elif typ == "i32":
                w.add_int32(key, int(val))
            elif typ == "str":
                w.add_string(key, str(val))
            elif typ == "str[]":
                w.add_array(key, [str(v) for v in val])
            elif typ == "i32[]":
                w.add_key_value(key, [int(v) for v in val], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
            elif typ == "f32[]":
                w.add_key_value(key, [float(v) for v in val], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
            else:
                raise AssertionError(typ)
        if tok is not None:
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(tok.pre)
            w.add_token_list(tok.tokens)
            w.add_token_types(tok.token_types)
            w.add_token_merges(tok.merges)
            w.add_bos_token_id(tok.bos)
            w.add_eos_token_id(tok.eos)
            w.add_add_bos_token(False)
        w.add_array(checksum.KEY, [checksum.PLACEHOLDER] * len(tensors))     # patched once the data is written
        w.add_string(checksum.META_KEY, checksum.PLACEHOLDER)
        digests = []
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.int32 if t.qtype == QT.I32 else np.float32), t.nbytes,
                              raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(t.nbytes for t in tensors)
        done, t0 = 0, time.time()
        bar = Bar(f"writing {os.path.basename(out)}", total, unit="MiB", scale=2**20, enabled=None if progress else False)
        for i, t in enumerate(tensors):
            data = t.make()
            if isinstance(data, np.ndarray):
                data = np.ascontiguousarray(data)
                if data.nbytes != t.nbytes:
                    raise AssertionError(f"{t.name}: built {data.nbytes} bytes, planned {t.nbytes}")
                digests.append(checksum.digest_of(t.name, t.qtype, t.shape, data))
                w.write_tensor_data(data)
            else:
                digests.append(_write_chunks(w, t, data))
            done += t.nbytes
            bar.update(done, f"{i + 1}/{len(tensors)} {t.name}")
            del data
            if after_tensor is not None:
                after_tensor()
        w.close()
        checksum.patch(tmp, digests)
        os.replace(tmp, out)
        bar.close()
        if progress:
            print(f"wrote {out}: {len(tensors)} tensors, {_size(total)} in {time.time() - t0:.1f} s", file=sys.stderr)
    except BaseException as e:
        if "bar" in locals():
            bar.close()
        w.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):           # disk full, unwritable folder, I/O error: one line, not a trace
            raise ConvertError(f"{out}: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from e
        raise
    finally:
        restore_sigterm()


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _write_chunks(w, t: OutTensor, chunks) -> str:
    """Write a tensor given as row chunks (the writer's own padding rules, hashed as it goes); written pages are
    dropped from the page cache as they reach the disk, so a file larger than RAM does not evict everything
    else. Returns the tensor's digest."""
    import gguf

    fout = w.fout[0]
    if next(iter(w.tensors[0])) != t.name:
        raise AssertionError(f"{t.name}: written out of order")
    w.tensors[0].pop(t.name)
    w.write_padding(fout, fout.tell())
    h = checksum.hasher(t.name, t.qtype, t.shape)
    n = unsynced = 0
    for c in chunks:
        c = np.ascontiguousarray(c).reshape(-1).view(np.uint8)
        h.update(memoryview(c))
        fout.write(memoryview(c))
        n += c.nbytes
        unsynced += c.nbytes
        if unsynced >= 256 << 20:
            fout.flush()
            os.fdatasync(fout.fileno())
            os.posix_fadvise(fout.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            unsynced = 0
    if n != t.nbytes:
        raise AssertionError(f"{t.name}: built {n} bytes, planned {t.nbytes}")
    w.write_padding(fout, n)
    w.state = gguf.gguf_writer.WriterState.WEIGHTS
    return h.hexdigest()


def _sigterm_raises() -> Callable[[], None]:
    """While a GGUF is written, SIGTERM (kill, a service manager, a CI timeout) raises SystemExit as Ctrl-C raises
    KeyboardInterrupt, so the temporary file is removed on the way out. Returns what restores the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None                     # handlers can only be set from the main thread

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    prev = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)


def output_paths(out: str) -> tuple[str, str]:
    """(OUT, the temporary file beside it that is renamed to OUT on success); checked up front so that a bad
    OUT fails before any conversion work."""
    path = os.path.abspath(out)
    out_dir = os.path.dirname(path)
    if os.path.isdir(path):
        raise ConvertError(f"{out}: is a folder; give the name of the GGUF file to write")
    if not os.path.isdir(out_dir):
        raise ConvertError(f"{out}: the output folder {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK):
        raise ConvertError(f"{out}: the output folder {out_dir} is not writable")
    return path, os.path.join(out_dir, f".{os.path.basename(path)}.tmp-{os.getpid()}")


# ----------------------------------------------------------------------------------------------- conversion
def _f16_exact(x: np.ndarray) -> bool:
    h = x.astype(np.float16)
    return bool(np.array_equal(h.astype(np.float32), x) and np.isfinite(h).all() == np.isfinite(x).all())


def _encode(x: np.ndarray, qt: QT) -> np.ndarray:
    if qt == QT.F16:
        h = x.astype(np.float16)
        if not np.isfinite(h[np.isfinite(x)]).all():
            raise ConvertError("a value overflows F16")
        return h
    return quant.quantize(x, qt)


class _Converter:
    def __init__(self, ck: Checkpoint, shape: ModelConfig, experts: str, dense: str, progress: bool):
        self.ck, self.s, self.progress = ck, shape, progress
        self.expert_qt = EXPERT_TYPES[experts]
        self.dense = dense
        self.notes: list[str] = []
        self.grouped: dict[str, list[str]] = {}     # a note's text -> the tensors it applies to (one line each)

    def log(self, msg: str) -> None:
        if self.progress:
            print(msg, file=sys.stderr)

    def note(self, what: str, name: str) -> None:
        """A note that applies to many tensors alike (one per layer): printed once, by flush_notes."""
        self.grouped.setdefault(what, []).append(name)

    def flush_notes(self) -> None:
        for what, names in self.grouped.items():
            which = names[0] if len(names) == 1 else f"{len(names)} tensors ({names[0]} ... {names[-1]})"
            self.log(f"note: {which}: {what}")
        self.grouped = {}

    # -- source checks -------------------------------------------------------------------------------------
    def expect(self, name: str, shape: tuple[int, ...]) -> None:
        ck = self.ck
        dt, got = ck.dtype(name), ck.shape(name)
        if dt in ("I8", "U8") and len(shape) == 2 and scale_name(name) in ck:   # FP4: two values per byte
            shape = (shape[0], shape[1] // 2)
        if dt not in ST_DTYPES:
            raise ConvertError(f"{ck.src}: tensor {name!r} has dtype {dt}, which the converter does not know")
        if tuple(got) != tuple(shape):
            raise ConvertError(f"{ck.src}: tensor {name!r} has shape {list(got)}, expected {list(shape)} from config.json")

    def rows(self, name: str, nrows: int):
        for r0 in range(0, nrows, ROW_CHUNK):
            r1 = min(nrows, r0 + ROW_CHUNK)
            yield r0, r1, self.ck.floats(name, r0, r1)

    def all_exact_f16(self, name: str, nrows: int) -> bool:
        exact = all(_f16_exact(x) for _, _, x in self.rows(name, nrows))
        self.ck.release()                     # planning reads whole tensors too: keep RSS to one at a time
        return exact

    # -- plan ------------------------------------------------------------------------------------------------
    def plan(self, layout: list[Spec]) -> list[OutTensor]:
        out = []
        for sp in layout:
            if sp.slot == "experts":
                for e in sp.src:
                    self.expect(e, sp.shape[1:])
                out.append(self.plan_experts(sp))
                continue
            self.expect(sp.src, sp.shape)
            if sp.slot == "i32":
                out.append(OutTensor(sp.name, sp.shape, QT.I32, lambda sp=sp: self.make_i32(sp)))
                continue
            qt = self.slot_type(sp)
            out.append(OutTensor(sp.name, sp.shape, qt, lambda sp=sp, qt=qt: self.make_dense(sp, qt)))
        return out

    def slot_type(self, sp: Spec) -> QT:
        if sp.slot == "f32" or self.dense == "f32":
            return QT.F32
        if self.dense in ("q8_0", "q4_k"):
            if self.dense == "q4_k" and sp.slot == "q8" and sp.shape[-1] % 256 == 0:
                return QT.Q4_K
            if sp.slot == "q8" and sp.shape[-1] % 32 == 0:      # q4_k: rows narrower than a 256 block, as llama.cpp
                return QT.Q8_0
            return QT.F16
        nrows = sp.shape[0] if len(sp.shape) > 1 else 1
        if self.all_exact_f16(sp.src, nrows):
            return QT.F16
        self.notes.append(sp.name)
        self.note("not exactly representable in F16; written as F32", sp.name)
        return QT.F32

    def plan_experts(self, sp: Spec) -> OutTensor:
        qt = self.expert_qt[1 if "_down_" in sp.name else 0]
        dt = self.ck.dtype(sp.src[0])
        if qt == QT.MXFP4 and dt not in ("I8", "U8"):
            raise ConvertError(f"{self.ck.src}: {sp.src[0]!r} is {dt}, not packed FP4; MXFP4 output needs the "
                               "official FP4 experts (use --experts q4_k, q2_k or iq2_xxs)")
        block = 32 if qt == QT.MXFP4 else 256
        if sp.shape[-1] % block and qt != QT.MXFP4 and sp.shape[-1] % 32 == 0:
            # K-quants need rows of 256; like llama.cpp, narrower rows fall back to Q8_0
            self.note(f"rows of {sp.shape[-1]} are not a multiple of 256 (K-quant blocks); written as Q8_0", sp.name)
            qt = QT.Q8_0
        elif sp.shape[-1] % block:
            raise ConvertError(f"{sp.name}: input width {sp.shape[-1]} is not a multiple of the {qt.name} block {block}")
        return OutTensor(sp.name, sp.shape, qt, lambda sp=sp, qt=qt: self.make_experts(sp, qt))

    # -- builders --------------------------------------------------------------------------------------------
    def make_dense(self, sp: Spec, qt: QT) -> np.ndarray:
        if len(sp.shape) == 1:
            x = self.ck.floats(sp.src).reshape(sp.shape)
            self.check_finite(sp, x)
            return _encode(x, qt) if qt != QT.F32 else x.astype(np.float32)
        rb = quant.row_nbytes(qt, sp.shape[-1])
        buf = np.empty((sp.shape[0], rb), np.uint8)
        for r0, r1, x in self.rows(sp.src, sp.shape[0]):
            self.check_finite(sp, x)
            try:
                buf[r0:r1] = _encode(x, qt).view(np.uint8).reshape(r1 - r0, rb)
            except ConvertError as e:
                raise ConvertError(f"{sp.src!r} -> {sp.name}: {e}; use --dense f32") from None
        return buf

    def make_experts(self, sp: Spec, qt: QT) -> np.ndarray:
        NX, rows, cols = sp.shape
        rb = quant.row_nbytes(qt, cols)
        buf = np.empty((NX, rows, rb), np.uint8)
        for e, name in enumerate(sp.src):
            if qt == QT.MXFP4:
                sname = scale_name(name)
                s = self.ck.e8m0(sname)
                if s.shape != (rows, cols // 32):
                    raise ConvertError(f"{self.ck.src}: {sname!r} has shape {list(s.shape)}, expected {[rows, cols // 32]}")
                if (np.asarray(s) == 0xFF).any():
                    raise ConvertError(f"{self.ck.src}: {sname!r} holds a NaN (0xFF) e8m0 scale")
                buf[e] = quant.mxfp4_from_official(self.ck.raw(name), s)
            else:
                for r0, r1, x in self.rows(name, rows):
                    buf[e, r0:r1] = quant.quantize(x, qt)
        return buf

    def make_i32(self, sp: Spec) -> np.ndarray:
        x = np.asarray(self.ck.raw(sp.src))
        if x.dtype.kind not in "iu" or x.min() < 0 or x.max() >= self.s.n_experts:
            raise ConvertError(f"{self.ck.src}: {sp.src!r} must hold expert ids in [0, {self.s.n_experts})")
        return x.astype(np.int32)

    def check_finite(self, sp: Spec, x: np.ndarray) -> None:
        if not np.isfinite(x).all():
            raise ConvertError(f"{self.ck.src}: tensor {sp.src!r} holds NaN or infinite values")


def _mtp_ratio(cfg: dict[str, Any], n_layers: int) -> int:
    """The MTP block's compress ratio: config.json's compress_ratios has n_layers + 1 entries when the checkpoint
    has an MTP block (the official MTPBlock takes compress_ratios[n_layers]); 0 when it does not say."""
    ratios = cfg.get("compress_ratios") or []
    return int(ratios[n_layers]) if len(ratios) > n_layers else 0


def convert_checkpoint(src: str, out: str, experts: str = "mxfp4", dense: str = "q8_0",
                       tokenizer: str | None = None, progress: bool = True, mtp: str | None = None,
                       require_tokenizer: bool = False) -> None:
    """Convert an official V4 Flash checkpoint folder (config.json + safetensors) into a ds4-layout GGUF; with
    `mtp`, also write its MTP draft block (the official `mtp.0.*` tensors) as ds4's separate MTP GGUF there.
    require_tokenizer: refuse a folder without tokenizer.json (the command's default: run and serve need it)."""
    if experts not in EXPERT_TYPES:
        raise ConvertError(f"--experts {experts!r} is not one of {', '.join(EXPERT_TYPES)}")
    if dense not in DENSE_MODES:
        raise ConvertError(f"--dense {dense!r} is not one of {', '.join(DENSE_MODES)}")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: not a folder (expected a checkpoint folder with config.json)")
    output_paths(out)
    if mtp is not None:
        output_paths(mtp)
        if os.path.abspath(mtp) == os.path.abspath(out):
            raise ConvertError(f"--mtp {mtp}: the MTP file must not be the main output file")
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConvertError(f"{src}: config.json is missing")
    config = read_json(cfg_path, "config.json")
    shape = shape_from_config(config)
    if mtp is not None and shape.traits.draft != "mtp":
        raise ConvertError(f"--mtp {mtp}: a V4.1 checkpoint's draft (DSpark) is written into the V4.1 GGUF "
                           "itself; drop --mtp")
    ck = Checkpoint(src)
    ck.fp8_block = shape.traits.checkpoint_fp8_block
    if any((".engram." in n and not shape.traits.engram) or (n.startswith("dspark") and shape.traits.draft != "dspark")
           for n in ck.entries):
        raise ConvertError(f"{src}: Engram / DSpark tensors found, but config.json has none of V4.1's source layers")
    tok_path = tokenizer or os.path.join(src, "tokenizer.json")
    tok = None
    if tokenizer or os.path.isfile(tok_path):
        if not os.path.isfile(tok_path):
            raise ConvertError(f"{tok_path}: tokenizer file not found")
        tok = load_hf_tokenizer(tok_path, shape.vocab_size)
    elif require_tokenizer:
        raise ConvertError(f"{src}: no tokenizer.json, and run, chat and serve need the tokenizer inside the GGUF; "
                           f"give --tokenizer PATH/tokenizer.json, or --no-tokenizer to write the weights alone")

    draft_note = []
    if shape.has_dspark and schema.DSPARK_HEAD_TENSORS[0].src not in ck:
        from ds4py import convert_v41

        shape = convert_v41.without_draft(shape)
        draft_note = ["note: config.json declares a DSpark draft but the checkpoint has none (no mtp.0.main_proj): "
                      "the GGUF has no draft"]
    conv = _Converter(ck, shape, experts, dense, progress)
    tensors = conv.plan(ds4_layout(shape) + dspark_layout(shape))
    mtp_tensors = []
    if mtp is not None:
        if not any(n.startswith(schema.MTP_PREFIX) for n in ck.entries):
            raise ConvertError(f"{src}: --mtp was given but the checkpoint has no MTP block (no mtp.0.* tensors)")
        ratio = _mtp_ratio(config, shape.n_layers)
        if ratio != 0:
            raise ConvertError(f"config.json: the MTP block's compress ratio is {ratio}; the V4 Flash MTP block "
                               "(and ds4's MTP file) attends to its window only (ratio 0)")
        mtp_tensors = conv.plan(mtp_layout(shape))
    layouts = ds4_layout(shape) + dspark_layout(shape) + (mtp_layout(shape) if mtp is not None else [])
    used = {n for sp in layouts for n in (sp.src if isinstance(sp.src, list) else [sp.src])}
    used |= {scale_name(n) for n in used if n.endswith(".weight")}
    skipped = [n for n in ck.entries if n not in used]
    meta = gguf_metadata(shape)
    if shape.is_v41:                                        # the V4.1 converter's notes and metadata
        from ds4py import convert_v41

        notes, other = convert_v41.skipped(skipped, shape)
        meta = convert_v41.gguf_metadata(shape, meta, src, convert_v41.engram_digests(ck, shape))
    else:
        draft = [n for n in skipped if n.startswith("mtp.")]
        other = [n for n in skipped if not n.startswith("mtp.")]
        notes = []
        if draft and mtp is None:
            notes = [f"note: skipping {len(draft)} MTP tensors (ds4 keeps the draft block in a separate GGUF: "
                     "add --mtp OUT_MTP.gguf to write it)"]
        elif draft:
            notes = [f"note: skipping {len(draft)} tensors of further MTP blocks (ds4's MTP file holds mtp.0 only)"]
    if other:
        raise ConvertError(f"{src}: tensor {other[0]!r} is not part of the {shape.traits.title} "
                           f"layout ({len(other)} unexpected tensors in all)")
    conv.flush_notes()
    for note in draft_note + notes:
        conv.log(note)
    name = os.path.basename(os.path.normpath(src)) or shape.arch
    write_gguf(out, name, meta, tok, tensors, progress, after_tensor=ck.release, arch=shape.arch)
    if mtp is not None:
        write_gguf(mtp, name + "-mtp", gguf_metadata(shape), None, mtp_tensors, progress, after_tensor=ck.release,
                   arch=shape.arch)
