"""The domain sidecar and the post-training file (seed 000 §3, §4.2, §4.3): their directory format, the FP4
gain lattice, and the stack a backend mounts at load (docs/vq.md, "Sidecars").

    each routed expert's down row r:  g_eff = fl32(fl32(g_base · s_sidecar) · s_posttrain)
    each learned router:              b_eff = fl32(b + Δb_sidecar [+ Δb_posttrain])     (selection only)

A directory holds `manifest.json` (what it stacks on, per-layer solver numbers, the fitting corpus, and every
file's size and BLAKE2b digest), `gr_Lnn.bin` gain files (s − 1 in MXFP4 blocks: FP4 E2M1 codes, one E8M0
scale per 32 channels, the 17-byte ggml block, decoded with ds4py.quant's MXFP4 decoder) and `rb_Lnn.bin`
router-bias files (float32 per expert). A sidecar stacks on a base GGUF (its ds4py.fingerprint); a post-training
directory stacks on a sidecar (the sidecar's fingerprint: BLAKE2b of its manifest, which digests every file)
or on a bare base. Anything that does not fit is refused at load with one sentence: a stale file never runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.errors import Ds4Error
from ds4py.gguf import TensorInfo
from ds4py.quant import dequantize
from ds4py.quant import vq

FORMAT = "ds4py-sidecar"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
KINDS = ("sidecar", "posttrain")
MANIFEST = "manifest.json"
BLOCK = 32                                   # channels per FP4 scale
BLOCK_BYTES = 17                             # one E8M0 byte + 16 bytes of E2M1 nibbles (ggml MXFP4)
GAIN_MAGIC, BIAS_MAGIC = b"DS4G", b"DS4B"
FILE_HEAD = struct.Struct("<4sHHII16x")     # magic, version, layer, experts, channels (gains) / 0 (bias)
GAIN_KIND, BIAS_KIND = 1, 2
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
_E2M1_MID = (E2M1[1:] + E2M1[:-1]) / 2


class SidecarError(Ds4Error):
    """A sidecar or post-training directory that is malformed, corrupt or does not fit the model it is given."""


def gain_file(layer: int) -> str:
    return f"gr_L{layer:02d}.bin"


def bias_file(layer: int) -> str:
    return f"rb_L{layer:02d}.bin"


def down_name(layer: int) -> str:
    return vq.payload_name(layer, "down")


def bias_tensor(layer: int) -> str:
    return f"blk.{layer}.exp_probs_b.bias"


# ---------------------------------------------------------------------------------------------- FP4 lattice
def fp4_project(u: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Round u [..., C] (C a multiple of 32) onto the FP4 lattice, one power-of-two scale per 32 values; returns the
    MXFP4 blocks uint8 [..., C/32, 17]. Per block the scale is 2^k with k = ceil(log2(max|u| / 6)) − j for
    j in 0..3 (j > 0: the largest values clip at ±6·2^k, the rest get a finer grid), whichever gives the smallest
    Σ w (u − q)² (w: the curvature of the solver's quadratic, default 1); each value goes to the nearest of
    ±{0, .5, 1, 1.5, 2, 3, 4, 6}·2^k (a tie to the smaller magnitude). 0 is on the lattice: a block the solver
    leaves alone stays exactly 1."""
    u = np.asarray(u, np.float64)
    *lead, C = u.shape
    if C % BLOCK:
        raise ValueError(f"FP4 project: {C} values per row is not a multiple of {BLOCK}")
    ub = u.reshape(-1, BLOCK)
    wb = np.ones_like(ub) if w is None else np.broadcast_to(np.asarray(w, np.float64), u.shape).reshape(-1, BLOCK)
    amax = np.abs(ub).max(1)
    k0 = np.ceil(np.log2(np.where(amax > 0, amax, 6.0) / 6.0))
    best_err = np.full(len(ub), np.inf)
    best_k = np.zeros(len(ub))
    best_mag = np.zeros(ub.shape, np.uint8)
    for k in (k0, k0 - 1, k0 - 2, k0 - 3):
        k = np.clip(k, -125, 127)
        a = np.abs(ub) / np.exp2(k)[:, None]
        mag = np.searchsorted(_E2M1_MID, a, side="left").astype(np.uint8)        # nearest, ties down; clips at 6
        err = (wb * (np.abs(ub) - E2M1[mag] * np.exp2(k)[:, None]) ** 2).sum(1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_k = np.where(better, k, best_k)
        best_mag[better] = mag[better]
    codes = np.where((ub < 0) & (best_mag > 0), best_mag | 8, best_mag).astype(np.uint8)
    out = np.empty((len(ub), BLOCK_BYTES), np.uint8)
    out[:, 0] = (best_k + 127).astype(np.uint8)
    out[:, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out.reshape(*lead, C // BLOCK, BLOCK_BYTES)


def fp4_decode(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [..., n, 17] -> float32 [..., n·32] with the engine's own decoder (ds4py.quant)."""
    b = np.ascontiguousarray(blocks, np.uint8)
    *lead, n, nb = b.shape
    if nb != BLOCK_BYTES:
        raise ValueError(f"FP4 decode: blocks of {nb} bytes, expected {BLOCK_BYTES}")
    return dequantize(b.reshape(-1), Q.MXFP4, (*lead, n * BLOCK)).astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------------- one layer's files
@dataclass
class LayerEdit:
    """What one directory changes in one layer: the down projection's channel gains (s − 1 as FP4 blocks
    [X, D/32, 17]) and / or the router's selection bias Δb (float32 [X])."""
    gain_blocks: np.ndarray | None = None
    bias: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)          # solver numbers for the manifest

    def scale(self) -> np.ndarray | None:
        """s = 1 + (s − 1), float32 [X, D], or None."""
        return None if self.gain_blocks is None else (np.float32(1) + fp4_decode(self.gain_blocks))


def _pack(magic: bytes, layer: int, experts: int, channels: int, payload: bytes) -> bytes:
    body = FILE_HEAD.pack(magic, VERSION, layer, experts, channels) + payload
    return body + struct.pack("<I", zlib.crc32(body))


def encode_gains(layer: int, blocks: np.ndarray) -> bytes:
    X, nb, _ = blocks.shape
    return _pack(GAIN_MAGIC, layer, X, nb * BLOCK, np.ascontiguousarray(blocks, np.uint8).tobytes())


def encode_bias(layer: int, bias: np.ndarray) -> bytes:
    return _pack(BIAS_MAGIC, layer, len(bias), 0, np.asarray(bias, "<f4").tobytes())


def _unpack(data: bytes, where: str, magic: bytes, layer: int, experts: int, channels: int) -> bytes:
    """Check a gain / bias file's frame against what the model and the manifest expect; its payload."""
    what = "gain" if magic == GAIN_MAGIC else "router-bias"
    size = FILE_HEAD.size + (experts * channels // BLOCK * BLOCK_BYTES if magic == GAIN_MAGIC else 4 * experts) + 4
    if len(data) < FILE_HEAD.size + 4:
        raise SidecarError(f"{where}: is {len(data)} bytes, too short for a ds4py {what} file")
    m, version, lay, x, c = FILE_HEAD.unpack_from(data)
    if m != magic:
        raise SidecarError(f"{where}: not a ds4py {what} file (magic {m!r}, expected {magic!r})")
    if version not in SUPPORTED_VERSIONS:
        raise SidecarError(f"{where}: {what} file version {version} is not supported by this ds4py "
                           f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    if struct.unpack_from("<I", data, len(data) - 4)[0] != zlib.crc32(data[:-4]):
        raise SidecarError(f"{where}: is corrupt (its CRC-32 does not match)")
    if (lay, x, c) != (layer, experts, channels if magic == GAIN_MAGIC else 0):
        raise SidecarError(f"{where}: holds layer {lay} with {x} experts" + (f" x {c} channels" if c else "")
                           + f", but the model's layer {layer} has {experts} experts"
                           + (f" x {channels} channels" if magic == GAIN_MAGIC else ""))
    if len(data) != size:
        raise SidecarError(f"{where}: is {len(data)} bytes, expected {size}")
    return data[FILE_HEAD.size:-4]


def decode_gains(data: bytes, where: str, layer: int, experts: int, channels: int) -> np.ndarray:
    raw = _unpack(data, where, GAIN_MAGIC, layer, experts, channels)
    blocks = np.frombuffer(raw, np.uint8).reshape(experts, channels // BLOCK, BLOCK_BYTES).copy()
    if (blocks[..., 0] == 255).any():
        raise SidecarError(f"{where}: holds a NaN scale (E8M0 byte 255)")
    if not np.isfinite(fp4_decode(blocks)).all():
        raise SidecarError(f"{where}: decodes to a non-finite gain")
    return blocks


def decode_bias(data: bytes, where: str, layer: int, experts: int) -> np.ndarray:
    b = np.frombuffer(_unpack(data, where, BIAS_MAGIC, layer, experts, 0), "<f4").astype(np.float32)
    if not np.isfinite(b).all():
        raise SidecarError(f"{where}: holds a non-finite router bias")
    return b


# ---------------------------------------------------------------------------------------------- a directory
def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass
class Sidecar:
    """A sidecar ("sidecar") or post-training ("posttrain") directory, in memory.

    stacks_on: {"kind": "base" | "sidecar", "fingerprint": what it was solved on, "base_fingerprint": the base
    GGUF's, "name": informational}; shape: {"n_layers", "n_experts", "dim"} of the model; layers: the edits;
    meta: free JSON (the corpus, the solver's options) recorded in the manifest."""
    kind: str
    stacks_on: dict[str, str]
    shape: dict[str, int]
    layers: dict[int, LayerEdit] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    _manifest: bytes | None = field(default=None, repr=False)     # as read from disk

    def files(self) -> dict[str, bytes]:
        """Every file of the directory, manifest.json included, as the bytes that are written."""
        out: dict[str, bytes] = {}
        entries = []
        for layer in sorted(self.layers):
            ed = self.layers[layer]
            g = b = None
            if ed.gain_blocks is not None:
                g = gain_file(layer)
                out[g] = encode_gains(layer, ed.gain_blocks)
            if ed.bias is not None:
                b = bias_file(layer)
                out[b] = encode_bias(layer, ed.bias)
            if {"layer", "gains", "bias"} & set(ed.info):
                raise ValueError("a layer's info may not use the keys layer, gains or bias")
            entries.append({"layer": layer, "gains": g, "bias": b, **ed.info})
        manifest = {"format": FORMAT, "version": VERSION, "kind": self.kind, "stacks_on": self.stacks_on,
                    "model": self.shape, "layers": entries,
                    "files": {n: {"bytes": len(d), "blake2b": _digest(d)} for n, d in sorted(out.items())},
                    **self.meta}
        out[MANIFEST] = (json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
        return out

    @property
    def fingerprint(self) -> str:
        """BLAKE2b of the manifest (which digests every file): what a post-training file records. A directory
        read from disk is identified by its manifest's bytes as stored."""
        raw = self._manifest if self._manifest is not None else self.files()[MANIFEST]
        return _digest(b"ds4py-sidecar-1" + raw)

    def summary(self) -> str:
        g = sum(e.gain_blocks is not None for e in self.layers.values())
        b = sum(e.bias is not None for e in self.layers.values())
        return f"gains on {g} layer{'s' * (g != 1)}, router bias on {b}"

    # ---- disk ----------------------------------------------------------------------------------------------
    def write(self, out_dir: str, verify: bool = True) -> None:
        """Write the directory (to OUT.tmp-PID, renamed to OUT when complete; OUT must not exist). With verify,
        every file is read back and decoded with the loader's own decoder before the directory is kept."""
        if os.path.exists(out_dir):
            raise SidecarError(f"{out_dir}: already exists; remove it or choose another --out")
        parent = os.path.dirname(os.path.abspath(out_dir))
        if not os.path.isdir(parent):
            raise SidecarError(f"{out_dir}: the folder {parent} does not exist")
        tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        try:
            for name, data in self.files().items():
                with open(os.path.join(tmp, name), "wb") as fh:
                    fh.write(data)
            if verify:
                back = read(tmp, self.kind)
                for layer, ed in self.layers.items():
                    got = back.layers.get(layer, LayerEdit())
                    if not (_same(got.gain_blocks, ed.gain_blocks) and _same(got.bias, ed.bias)
                            and _same(got.scale(), ed.scale())):
                        raise SidecarError(f"{out_dir}: layer {layer} does not decode to what was solved")
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.path = out_dir


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                         and np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def read(path: str, kind: str | None = None) -> Sidecar:
    """Read and check a directory (every listed file: size, digest, frame, CRC); kind: the one expected."""
    what = {"sidecar": "--sidecar", "posttrain": "--posttrain"}.get(kind or "", "sidecar")
    if not os.path.isdir(path):
        raise SidecarError(f"{what} {path}: is not a directory")
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, "rb") as fh:
            raw = fh.read()
    except OSError:
        raise SidecarError(f"{what} {path}: is not a ds4py sidecar directory (no readable {MANIFEST})") from None
    try:
        m = json.loads(raw)
        if not isinstance(m, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise SidecarError(f"{mpath}: is not valid JSON ({e})") from None
    if m.get("format") != FORMAT:
        raise SidecarError(f"{mpath}: is not a ds4py sidecar manifest (format {m.get('format')!r})")
    if m.get("version") not in SUPPORTED_VERSIONS:
        raise SidecarError(f"{mpath}: sidecar format version {m.get('version')!r} is not supported by this ds4py "
                           f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    if m.get("kind") not in KINDS:
        raise SidecarError(f"{mpath}: unknown kind {m.get('kind')!r} (expected sidecar or posttrain)")
    if kind is not None and m["kind"] != kind:
        raise SidecarError(f"{what} {path}: is a {'post-training file' if m['kind'] == 'posttrain' else 'sidecar'}, "
                           f"not a {'post-training file' if kind == 'posttrain' else 'sidecar'}")
    try:
        shape = {k: int(m["model"][k]) for k in ("n_layers", "n_experts", "dim")}
        on = {k: str(v) for k, v in m["stacks_on"].items()}
        if on["kind"] not in ("base", "sidecar") or not on.get("fingerprint") or not on.get("base_fingerprint"):
            raise ValueError("stacks_on")
        files = {str(n): (int(f["bytes"]), str(f["blake2b"])) for n, f in m["files"].items()}
        entries = [(int(e["layer"]), e.get("gains"), e.get("bias"),
                    {k: v for k, v in e.items() if k not in ("layer", "gains", "bias")}) for e in m["layers"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SidecarError(f"{mpath}: is malformed (missing or bad field {e})") from None
    X, D = shape["n_experts"], shape["dim"]
    sc = Sidecar(m["kind"], on, shape, path=path, _manifest=raw,
                 meta={k: v for k, v in m.items() if k not in ("format", "version", "kind", "stacks_on", "model",
                                                               "layers", "files")})
    for layer, g, b, info in entries:
        if not 0 <= layer < shape["n_layers"] or layer in sc.layers:
            raise SidecarError(f"{mpath}: layer {layer} is out of range or listed twice")
        ed = LayerEdit(info=info)
        for name, expect in ((g, gain_file(layer)), (b, bias_file(layer))):
            if name is None:
                continue
            if name != expect or name not in files:
                raise SidecarError(f"{mpath}: layer {layer} names {name!r}, which the manifest does not list as "
                                   f"{expect!r}")
            fpath = os.path.join(path, name)
            try:
                with open(fpath, "rb") as fh:
                    data = fh.read()
            except OSError as e:
                raise SidecarError(f"{fpath}: cannot be read ({e.strerror or e})") from None
            if (len(data), _digest(data)) != files[name]:
                raise SidecarError(f"{fpath}: is corrupt or was replaced (its size or digest does not match "
                                   f"{MANIFEST})")
            if name == g:
                ed.gain_blocks = decode_gains(data, fpath, layer, X, D)
            else:
                ed.bias = decode_bias(data, fpath, layer, X)
        sc.layers[layer] = ed
    return sc


# ---------------------------------------------------------------------------------------------- mounting
def _short(fp: str) -> str:
    return fp[:12]


def _resolve(x: "str | Sidecar | None", kind: str) -> "Sidecar | None":
    if x is None or isinstance(x, Sidecar):
        return x
    return read(os.fspath(x), kind)


class Stack:
    """A base with an optional sidecar and post-training file, checked against each other and the model.

    Backends use `row_scales` (down-projection row-gain factors, in application order), `biases` (the router's
    effective bias tensors) and `fingerprint` (the combined model identity: saved states of another stack are
    refused). Build it with `Stack.open`, which refuses every mismatch in one sentence."""

    def __init__(self, cfg, gguf, base_fingerprint: str, sidecar: Sidecar | None, posttrain: Sidecar | None):
        self.cfg, self.gguf, self.base_fingerprint = cfg, gguf, base_fingerprint
        self.sidecar, self.posttrain = sidecar, posttrain
        for sc in filter(None, (sidecar, posttrain)):
            self._check(sc)

    @classmethod
    def open(cls, cfg, gguf, base_fingerprint: str, sidecar=None, posttrain=None) -> "Stack | None":
        sidecar, posttrain = _resolve(sidecar, "sidecar"), _resolve(posttrain, "posttrain")
        if sidecar is None and posttrain is None:
            return None
        return cls(cfg, gguf, base_fingerprint, sidecar, posttrain)

    def _name(self, sc: Sidecar) -> str:
        return f"{'--sidecar' if sc.kind == 'sidecar' else '--posttrain'} {sc.path or '(in memory)'}"

    def _check(self, sc: Sidecar) -> None:
        cfg, on, name = self.cfg, sc.stacks_on, self._name(sc)
        base = self.base_fingerprint
        if sc.kind == "sidecar" and on["kind"] != "base":
            raise SidecarError(f"{name}: a sidecar must stack on a base model, this one names a {on['kind']}")
        if on["base_fingerprint"] != base:
            raise SidecarError(f"{name}: was solved for another base model (fingerprint {_short(on['base_fingerprint'])}, "
                               f"this base is {_short(base)}); refit it against this base")
        if sc.kind == "posttrain":
            have = self.sidecar
            if on["kind"] == "sidecar" and have is None:
                raise SidecarError(f"{name}: was solved on top of sidecar {_short(on['fingerprint'])} "
                                   f"({on.get('name', '?')}); give that sidecar with --sidecar")
            if on["kind"] == "sidecar" and on["fingerprint"] != have.fingerprint:
                raise SidecarError(f"{name}: was solved against another sidecar (fingerprint {_short(on['fingerprint'])}, "
                                   f"{self._name(have)} is {_short(have.fingerprint)}); a stale post-training file "
                                   f"must be re-solved")
            if on["kind"] == "base" and have is not None:
                raise SidecarError(f"{name}: was solved on the bare base, without a sidecar; drop --sidecar or "
                                   f"re-solve it on top of that sidecar")
        elif on["fingerprint"] != base:
            raise SidecarError(f"{name}: names base {_short(on['fingerprint'])}, this base is {_short(base)}")
        want = {"n_layers": cfg.n_layers, "n_experts": cfg.n_experts, "dim": cfg.dim}
        if sc.shape != want:
            raise SidecarError(f"{name}: is for a model of shape {sc.shape}, this one is {want}")
        for layer, ed in sorted(sc.layers.items()):
            if ed.gain_blocks is not None and not vq.is_vq(self.gguf, down_name(layer)):
                qt = self.gguf.tensors[down_name(layer)].qtype.name
                raise SidecarError(f"{name}: layer {layer} has gains, but this base's routed experts there are "
                                   f"{qt}, not VQ-8: sidecar gains rescale VQ row gains (quantize-vq the base first)")
            if ed.bias is not None and (cfg.is_hash_layer(layer) or not cfg.has_route_bias(layer)):
                raise SidecarError(f"{name}: layer {layer} has a router bias, but that layer routes by token hash "
                                   f"and has no selection score to bias")

    def _stacked(self):
        return [sc for sc in (self.sidecar, self.posttrain) if sc is not None]

    def row_scales(self) -> list[tuple[str, np.ndarray]]:
        """(down-projection tensor, s [X, D]) in application order: the sidecar's, then the post-training file's."""
        return [(down_name(layer), ed.scale()) for sc in self._stacked() for layer, ed in sorted(sc.layers.items())
                if ed.gain_blocks is not None]

    def biases(self) -> dict[str, np.ndarray]:
        """Router-bias tensor name -> the effective float32 bias fl32(b + Δb ...), for the layers that change."""
        out: dict[str, np.ndarray] = {}
        for sc in self._stacked():
            for layer, ed in sorted(sc.layers.items()):
                if ed.bias is not None:
                    name = bias_tensor(layer)
                    base = out.get(name, np.asarray(self.gguf.tensor(name).raw, np.float32))
                    out[name] = (base + ed.bias).astype(np.float32)
        return out

    def resolver(self, resolve: Callable[[str], TensorInfo]) -> Callable[[str], TensorInfo]:
        """The reference binding's resolve with the router biases replaced by in-memory F32 tensors (their names
        carry the stack's fingerprint, so no cache mixes them up with the file's)."""
        tag = self.fingerprint[:12]
        over = {n: TensorInfo(f"{n}+{tag}", Q.F32, a.shape, a, -1, a.nbytes) for n, a in self.biases().items()}
        return lambda name: over.get(name) or resolve(name)

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(b"ds4py-stack-1" + self.base_fingerprint.encode(), digest_size=16)
        for sc in self._stacked():
            h.update(sc.kind.encode() + sc.fingerprint.encode())
        return h.hexdigest()

    def describe(self) -> str:
        return "; ".join(f"{sc.kind} {sc.path or '(in memory)'} ({sc.summary()})" for sc in self._stacked())


def check_files(model_path: str, sidecar=None, posttrain=None) -> "Stack | None":
    """Open just enough of a model to check a stack against it (serve refuses a bad pair before listening)."""
    from ds4py.config import ModelConfig
    from ds4py.fingerprint import file_fingerprint
    from ds4py.gguf import GGUFFile

    f = GGUFFile(model_path)
    cfg = ModelConfig.from_gguf(f)
    fp = file_fingerprint(model_path, head_bytes=min(t.offset for t in f.tensors.values()))
    return Stack.open(cfg, f, fp, sidecar, posttrain)
