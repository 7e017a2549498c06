"""Engram (V4.1, MODEL.md §3): n-gram hash ids and the table rows they select, for every backend.

    hasher = NgramHasher(cfg, tokens, token_types)     # the compressed token map, primes, multipliers, offsets
    ids = hasher.ids(history, chunk)                   # [T, n_engram_layers, (max_ngram - 1) · heads] int64
    tables = EngramTables.open(cfg, gguf_meta, engram_dir)
    rows = tables.rows(e, ids[:, e])                   # [T, cols · row width] float32, read from the shards

The compressed token map collapses tokens that normalise alike (NFKC, NFD, strip accents, lowercase, collapse
whitespace, strip) onto one id, so " The", "the" and "THE" hash the same way; its size must equal the model's
`engram_compressed_vocab`, because every multiplier is derived from it. For position t the compressed ids of
t, t-1, ... t-(n-1) (the pad token's before the sequence start) are multiplied by per-layer odd multipliers,
XOR-ed one lookback at a time, and the running value after each lookback is reduced modulo a prime per
(n-gram size, head) and shifted into that pair's bucket range of the layer's table.

The tables (~203 GB in the real checkpoint) never enter the GGUF: they stay in the official safetensors shards
and are memory-mapped; a token reads its (max_ngram - 1) · heads rows (FP8 e4m3 with one e8m0 scale per 32, ~6 KB
for V4.1 Flash). The GGUF records, per table, a digest of its header entry and of sampled rows (written by the
converter), so that a missing shard, a shard of another checkpoint or a table of another shape is one sentence
at load, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ds4py.checkpoint import ConvertError, read_safetensors_header
from ds4py.errors import Ds4Error


class EngramError(Ds4Error):
    """The Engram tables cannot be used: missing, from another checkpoint, wrong shape, or a bad vocabulary."""


# ---- the compressed token map (engram.build_compressed_token_map) -------------------------------------------
# Rust's char::is_whitespace (the White_Space property), which the tokenizers Strip normalizer uses; Python's
# str.strip also strips U+001C..U+001F, which are not White_Space.
WHITE_SPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
                        "\u200a\u2028\u2029\u202f\u205f\u3000")
_COLLAPSE = None


def normalize(text: str) -> str:
    """The official normalizer sequence: NFKC, NFD, strip accents (every Mark), lowercase (per character, as
    Rust's to_lowercase: no final-sigma rule), [ \\t\\r\\n]+ -> " ", a lone " " survives Strip, Strip."""
    global _COLLAPSE
    if _COLLAPSE is None:
        import regex

        _COLLAPSE = regex.compile(r"[ \t\r\n]+")
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))
    s = "".join(c.lower() for c in s)
    s = _COLLAPSE.sub(" ", s)
    if s == " ":
        return s
    a, b = 0, len(s)
    while a < b and s[a] in WHITE_SPACE:
        a += 1
    while b > a and s[b - 1] in WHITE_SPACE:
        b -= 1
    return s[a:b]


def token_text(token: str, added: bool) -> str:
    """What decoding the single token gives (the raw tokenizer's decode, special tokens kept): an added token's
    spelling, else its byte-level characters turned back into bytes and read as UTF-8 (U+FFFD where invalid)."""
    if added:
        return token
    from ds4py.tokenizer import CHAR_TO_BYTE

    raw = b"".join(bytes((CHAR_TO_BYTE[c],)) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in token)
    return raw.decode("utf-8", errors="replace")


def compressed_token_map(tokens: Sequence[str], added: Sequence[bool]) -> tuple[np.ndarray, int]:
    """(map [vocab] int64, compressed vocab size): tokens whose decoded text normalises alike share an id, ids
    in order of first appearance; a partial UTF-8 byte token is keyed by its raw spelling."""
    key_to_new: dict[str, int] = {}
    out = np.empty(len(tokens), np.int64)
    for i, (tok, is_added) in enumerate(zip(tokens, added)):
        text = token_text(tok, is_added)
        if "\ufffd" in text:
            key = tok
        else:
            key = normalize(text) or text
        out[i] = key_to_new.setdefault(key, len(key_to_new))
    return out, len(key_to_new)


# ---- the hash layout (engram.EngramLayout, NgramHashState) ---------------------------------------------------
def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the bases 2..41)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(n_layers: int, max_ngram: int, heads: int, base: int) -> np.ndarray:
    """[n_layers, max_ngram - 1, heads]: for each (layer, n-gram size, head) in that order, the smallest prime
    above the previous one of its n-gram size (starting at base - 1) that no earlier pair took."""
    seen: set[int] = set()
    out = np.empty((n_layers, max_ngram - 1, heads), np.int64)
    for e in range(n_layers):
        for n in range(max_ngram - 1):
            cur = base - 1
            for h in range(heads):
                cur += 1
                while not is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                out[e, n, h] = cur
    return out


def hash_multipliers(layer_ids: Sequence[int], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """[n_layers, max_ngram] odd int64 multipliers from a per-layer numpy generator (seed 10007 · layer id),
    bounded so that compressed id x multiplier never overflows int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * int(layer)).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return np.stack(rows).astype(np.int64)


class NgramHasher:
    """Hash ids of the n-grams ending at each position (the official NgramHashState, without its cache: the
    history comes from the state's `ngram_ids` ring)."""

    def __init__(self, cfg, tokens: Sequence[str] | None, added: Sequence[bool] | None, where: str = "model"):
        if tokens is None:
            raise EngramError(f"{where}: this V4.1 model has no vocabulary (tokenizer.ggml.tokens), and Engram's "
                              f"compressed token map is built from it; convert it with its tokenizer.json")
        if len(tokens) != cfg.vocab_size:
            raise EngramError(f"{where}: the vocabulary has {len(tokens)} tokens, the model {cfg.vocab_size} rows")
        token_map, n = compressed_token_map(tokens, added)
        if n != cfg.engram_compressed_vocab:
            raise EngramError(f"{where}: the vocabulary compresses to {n} Engram ids, but the model was trained with "
                              f"{cfg.engram_compressed_vocab} (another tokenizer?); its n-gram hashes would be wrong")
        self._setup(cfg, token_map, n, where)

    @classmethod
    def from_token_map(cls, cfg, token_map: np.ndarray, where: str = "model") -> "NgramHasher":
        """A hasher over a given compressed token map (vocab ids -> 0 .. engram_compressed_vocab - 1): the
        synthetic device-check model's, which has no vocabulary."""
        self = cls.__new__(cls)
        self._setup(cfg, np.asarray(token_map, np.int64), int(cfg.engram_compressed_vocab), where)
        return self

    def _setup(self, cfg, token_map: np.ndarray, n: int, where: str) -> None:
        self.token_map = token_map
        self.n_layers, self.max_ngram, self.heads = len(cfg.engram_layers), cfg.engram_max_ngram, cfg.engram_heads
        self.pad = int(self.token_map[cfg.engram_pad_id])
        self.primes = bucket_primes(self.n_layers, self.max_ngram, self.heads, cfg.engram_bucket_base)
        flat = self.primes.reshape(self.n_layers, -1)
        self.offsets = np.concatenate([np.zeros((self.n_layers, 1), np.int64), np.cumsum(flat, 1)[:, :-1]], 1)
        self.multipliers = hash_multipliers(cfg.engram_layers, self.max_ngram, n)
        self.table_rows = flat.sum(1)                  # rows the ids can reach, per layer
        short = [(l, int(r), int(need)) for l, r, need in zip(cfg.engram_layers, cfg.engram_rows, self.table_rows)
                 if r < need]
        if short:
            l, r, need = short[0]
            raise EngramError(f"{where}: the Engram table of layer {l} has {r} rows, but its hash buckets reach "
                              f"{need}")

    def ids(self, history: np.ndarray, chunk: np.ndarray, start: int) -> np.ndarray:
        """Hash ids [T, n_layers, (max_ngram - 1) · heads] of a chunk of token ids at positions start.. .
        history: the raw ids of positions start - (max_ngram - 1) .. start - 1 that exist (the last
        min(start, max_ngram - 1)), oldest first."""
        n1 = self.max_ngram - 1
        comp = self.token_map[np.concatenate([np.asarray(history, np.int64), np.asarray(chunk, np.int64)])]
        comp = np.concatenate([np.full(n1 - len(history), self.pad, np.int64), comp])   # before the start: pad
        T = len(chunk)
        # tokens[t, s] = compressed id of position start + t - s
        tokens = np.stack([comp[n1 - s: n1 - s + T] for s in range(self.max_ngram)], 1)
        prod = tokens[:, None, :] * self.multipliers[None]                  # [T, n_layers, max_ngram]
        rolling, out = prod[..., 0], []
        for i in range(1, self.max_ngram):
            rolling = np.bitwise_xor(rolling, prod[..., i])
            out.append(rolling[..., None] % self.primes[None, :, i - 1])
        return np.concatenate(out, -1) + self.offsets[None]


# ---- the tables in the official shards -------------------------------------------------------------------
DIGEST_ROWS = 64            # rows of each table hashed into its digest (first, last and evenly spaced)
E4M3 = None


def table_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"


def table_digest(entries: dict, weight: np.ndarray, scale: np.ndarray) -> str:
    """BLAKE2b of the two tensors' dtypes and shapes and of DIGEST_ROWS sampled rows of each (cheap on a
    100 GB shard; two checkpoints that differ anywhere in their tables practically always differ there)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([[e[1], list(e[2])] for e in entries.values()]).encode())
    n = weight.shape[0]
    rows = np.unique(np.linspace(0, n - 1, min(n, DIGEST_ROWS)).astype(np.int64))
    h.update(np.ascontiguousarray(weight[rows]).tobytes())
    h.update(np.ascontiguousarray(scale[rows]).tobytes())
    return h.hexdigest()


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), as the official lookup returns rows (exact for normal rows)."""
    u = x.view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return r.view(np.float32)


def dequantise_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Table rows from their codes [T, n] and scales [T, n / 32]: e4m3 · 2^(s-127), rounded to bf16 (float32)."""
    from ds4py.quant.official import E4M3, E8M0

    T = codes.shape[0]
    vals = E4M3[codes].reshape(T, -1, 32) * E8M0[scales][:, :, None]
    return _bf16(np.ascontiguousarray(vals, np.float32)).reshape(T, -1)


@dataclass
class _Table:
    layer: int
    path: str
    weight: np.ndarray          # uint8 [rows, row width] e4m3 codes (memory-mapped)
    scale: np.ndarray           # uint8 [rows, row width / 32] e8m0 codes (memory-mapped)


def _locate(folder: Path, names: list[str]) -> dict[str, str]:
    """tensor name -> shard path, from model.safetensors.index.json or else every *.safetensors header."""
    index = folder / "model.safetensors.index.json"
    found: dict[str, str] = {}
    if index.is_file():
        try:
            wm = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise EngramError(f"{index}: the shard index is not valid JSON with a weight_map") from None
        if not isinstance(wm, dict):
            raise EngramError(f"{index}: the shard index has no weight_map")
        for n in names:
            if n in wm:
                p = folder / str(wm[n])
                if not p.is_file():
                    raise EngramError(f"{folder}: the shard {wm[n]} that holds the Engram table {n} is missing")
                found[n] = str(p)
        return found
    for p in sorted(folder.glob("*.safetensors")):
        for n in read_safetensors_header(str(p)):
            if n in names and n not in found:
                found[n] = str(p)
    return found


class EngramTables:
    """The Engram tables of one model, memory-mapped from the official shards; rows are read per token."""

    def __init__(self, tables: list[_Table], row_dim: int):
        self.tables, self.row_dim = tables, row_dim
        self.rows_read = 0                     # table rows read so far (the bench and the tests count them)

    @classmethod
    def open(cls, cfg, folder: str | os.PathLike | None, digests: Sequence[str] | None,
             where: str = "model") -> "EngramTables":
        """Check and map every Engram table of cfg in `folder`; EngramError (one sentence) when a shard or a table
        is missing, has another dtype or shape, or differs from the one the GGUF was converted with (digests)."""
        names = [n for layer in cfg.engram_layers for n in table_names(layer)]
        if folder is None or not str(folder):
            raise EngramError(f"{where}: this V4.1 model reads its Engram tables ({names[0]}, ...) from the official "
                              f"checkpoint's safetensors shards: pass --engram-dir DIR (the folder that holds them)")
        folder = Path(folder)
        if not folder.is_dir():
            raise EngramError(f"{where}: the Engram folder {folder} does not exist; pass --engram-dir DIR, the folder "
                              f"with the official checkpoint's shards that hold {names[0]}")
        try:
            found = _locate(folder, names)
            headers = {p: read_safetensors_header(p) for p in sorted(set(found.values()))}
        except ConvertError as e:
            raise EngramError(str(e)) from None
        missing = [n for n in names if n not in found]
        if missing:
            raise EngramError(f"{folder}: no shard holds the Engram table {missing[0]} (is this the official V4.1 "
                              f"checkpoint folder, with all its shards?)")
        tables, maps = [], {}
        for e, layer in enumerate(cfg.engram_layers):
            wn, sn = table_names(layer)
            want = {wn: ("F8_E4M3", (cfg.engram_rows[e], cfg.engram_head_dim)),
                    sn: ("F8_E8M0", (cfg.engram_rows[e], cfg.engram_head_dim // 32))}
            arrays, entries = [], {}
            for n, (dt, shape) in want.items():
                path, got_dt, got_shape, off, nbytes = headers[found[n]][n]
                if got_dt not in (dt, "U8") or tuple(got_shape) != shape:
                    raise EngramError(f"{path}: the Engram table {n} is {got_dt} {list(got_shape)}; this model needs "
                                      f"{dt} {list(shape)} (a table of another model or config)")
                if path not in maps:
                    maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
                arrays.append(maps[path][off: off + nbytes].reshape(shape))
                entries[n] = (path, dt, shape)
            if digests is not None:
                if e >= len(digests):
                    raise EngramError(f"{where}: the GGUF records no digest for the Engram table of layer {layer}")
                if table_digest(entries, *arrays) != digests[e]:
                    raise EngramError(f"{found[wn]}: the Engram table {wn} is not the one this GGUF was converted "
                                      f"with (a shard of another checkpoint or revision)")
            tables.append(_Table(layer, found[wn], arrays[0], arrays[1]))
        return cls(tables, cfg.engram_head_dim)

    def codes(self, e: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows `ids` [T, cols] of table e as stored: (e4m3 codes [T, cols · row width], e8m0 scales
        [T, cols · row width / 32]) uint8, read from the memory-mapped shard (only these rows)."""
        t = self.tables[e]
        flat = np.asarray(ids, np.int64).reshape(-1)
        self.rows_read += len(flat)
        return t.weight[flat].reshape(len(ids), -1), t.scale[flat].reshape(len(ids), -1)

    def codes_into(self, e: int, ids: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
        """codes(e, ids) written into codes [T, cols · row width] and scales [T, cols · row width / 32] (e.g.
        pinned staging) without an intermediate copy."""
        t = self.tables[e]
        flat = np.asarray(ids, np.int64).reshape(-1)
        self.rows_read += len(flat)
        np.take(t.weight, flat, axis=0, out=codes.reshape(len(flat), -1))
        np.take(t.scale, flat, axis=0, out=scales.reshape(len(flat), -1))

    def rows(self, e: int, ids: np.ndarray) -> np.ndarray:
        """The rows `ids` [T, cols] of table e, dequantised (e4m3 · 2^(s-127), rounded to bf16 as the official
        lookup returns them) and flattened per position: [T, cols · row width] float32."""
        return dequantise_rows(*self.codes(e, ids))


# ---- GGUF metadata the converter writes and the loader reads ------------------------------------------------
def meta_keys(arch: str) -> tuple[str, str]:
    """(the recorded source folder, the per-table digests) metadata keys."""
    return f"{arch}.engram.source_dir", f"{arch}.engram.table_digests"


def gguf_vocabulary(f) -> tuple[list[str] | None, list[bool] | None]:
    """(tokens, is-added per token) from a GGUF's tokenizer metadata; (None, None) without a vocabulary.
    Added tokens (CONTROL / USER_DEFINED) decode to their spelling, the rest through the byte map."""
    tokens = f.meta("tokenizer.ggml.tokens", None)
    if not isinstance(tokens, list):
        return None, None
    types = f.meta("tokenizer.ggml.token_type", None)
    if not isinstance(types, list) or len(types) != len(tokens):
        types = [1] * len(tokens)
    return tokens, [t in (3, 4) for t in types]
