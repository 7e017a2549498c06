"""Disk KV cache: checkpoints of a sequence's KV state, keyed by a hash of its token prefix, so that a warm
prefix survives a switch of conversation and a restart of the server (seed 002's `--kv-disk-dir`).

    disk = DiskCache("/tmp/ds4py-kv", space_mb=8192, model=model)
    entry = disk.best(prompt_ids)                 # the longest checkpoint whose tokens are a prefix of the prompt
    entry, n = disk.reuse(prompt_ids)             # or one past the shared prefix within its rollback horizon
    tokens, blob, logits = disk.load(entry)       # the state is model.load_state(blob)
    disk.save("cold", tokens, model.save_state(state), logits)

A checkpoint holds the exact token ids, the state (`model.save_state`, itself versioned, fingerprinted and
checksummed) and the logits of the next token, so that a prompt equal to the checkpoint samples at once. Which
moments write one (cold, continued, evict, shutdown) is the session's business (ds4py/session.py); this module
stores, finds and bounds them.

File `<hash>.kv` (the hash: BLAKE2b-160 of the model fingerprint, the numerics and the token ids):

| bytes | content |
|---|---|
| 0–7, 8–11, 12–15, 16–23 | magic `DS4PYKVC`, u32 version (1), u32 header length, u64 total length |
| 24… | header JSON: model fingerprint, numerics, reason, created (Unix s), n_tokens, vocab, the state's rollback floor, offsets and lengths |
| 8-aligned | u32 token ids; f32 logits (vocab of them, when present); the state blob |
| last 4 | CRC-32 of every byte before it |

Writes are atomic (a temporary file in the same folder, fsync, rename), done by one writer thread so that the
engine does not wait for the disk. Start-up reads every header: files of another model or numerics, another
format, truncated or corrupt, are ignored with one log line each and never deleted or counted (a truncated or
corrupt file of ours is found by its length and CRC when it is loaded, and dropped then). Least recently used
checkpoints (a hit touches the file's mtime, so the order survives restarts) are deleted to keep the folder's
checkpoints within `space_mb`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ds4py.errors import Ds4Error

log = logging.getLogger("ds4py.disk_cache")

MAGIC = b"DS4PYKVC"
VERSION = 1
REASONS = ("cold", "continued", "evict", "shutdown")
_FIXED = struct.Struct("<8sIIQ")          # magic, version, header length, total length
_HEADER_MAX = 1 << 20
SUFFIX = ".kv"


@dataclass(frozen=True)
class KVCachePolicy:
    """When the session writes checkpoints (seed 002's defaults, aligned to the scheduler's chunks).

    cold: a prompt of at least min_tokens + trim_tokens that started from nothing is checkpointed at
      `cold_point`: trim_tokens before its end (a later request that appends text may re-tokenise the last
      few tokens differently), rounded down to a multiple of align_tokens, or of the largest power of two
      below for a shorter prompt, so that it is a prefix of the next prompts that share most of this one (an
      agent's system prompt and tools) and lies on a prefill chunk boundary. Prompts above cold_max_tokens
      are left to the continued checkpoints.
    continued: whenever a sequence reaches a multiple of continued_interval tokens (prefill or generation).
    evict / shutdown: a live state of at least min_tokens, before an unrelated prompt replaces it and when
      the server stops.
    """
    min_tokens: int = 512
    cold_max_tokens: int = 30000
    trim_tokens: int = 32
    align_tokens: int = 2048
    continued_interval: int = 10240

    def cold_point(self, n_prompt: int) -> int | None:
        n = n_prompt - self.trim_tokens
        if n < self.min_tokens or n_prompt > self.cold_max_tokens:
            return None
        align = min(self.align_tokens, 1 << (n.bit_length() - 1))
        c = n // align * align
        return c if c >= self.min_tokens else None


@dataclass
class Entry:
    key: str
    path: Path
    tokens: np.ndarray            # int64 [n]
    has_logits: bool
    nbytes: int                   # file size
    reason: str
    created: float
    last_used: float
    floor: int | None = None      # the state's rollback floor (None: unknown, serves exact prefixes only)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def reach(self, prompt: np.ndarray) -> int:
        """How many of the prompt's tokens this checkpoint serves: all of its tokens when they are a prefix of
        the prompt (all of the prompt only with its logits), else the shared prefix when the state can be
        truncated to it (at least its rollback floor, and one prompt token left to step); 0 otherwise."""
        n = self.n_tokens
        m = min(n, len(prompt))
        differ = np.flatnonzero(self.tokens[:m] != prompt[:m])
        c = int(differ[0]) if differ.size else m
        if c == n and (n < len(prompt) or self.has_logits):
            return n
        r = min(c, len(prompt) - 1)
        return r if self.floor is not None and r > 0 and r >= self.floor else 0


@dataclass
class DiskStats:
    hits: int = 0                 # checkpoints loaded
    load_failures: int = 0
    writes: dict | None = None    # reason -> count
    written_bytes: int = 0
    read_bytes: int = 0
    deleted: int = 0              # LRU deletions
    skipped: int = 0              # checkpoints not written (writer busy, or larger than the whole space)

    def __post_init__(self):
        self.writes = {r: 0 for r in REASONS}


def prefix_key(model_fp: str, numerics: dict, tokens: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=20)
    h.update(model_fp.encode())
    h.update(json.dumps(numerics, sort_keys=True).encode())
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    return h.hexdigest()


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def encode_checkpoint(model_fp: str, numerics: dict, vocab: int, reason: str, tokens: Sequence[int], blob: bytes,
                      logits: np.ndarray | None, created: float | None = None, floor: int | None = None) -> bytes:
    toks = np.asarray(tokens, dtype="<u4").tobytes()
    lg = b"" if logits is None else np.asarray(logits, dtype="<f4").reshape(vocab).tobytes()
    header = {"model": model_fp, "numerics": numerics, "reason": reason,
              "created": round(time.time() if created is None else created, 3),
              "n_tokens": len(tokens), "vocab": vocab, "has_logits": logits is not None}
    if floor is not None:
        header["floor"] = int(floor)
    # the offsets depend on the header's length, which depends on the offsets: iterate to the fixed point
    t_off = -1
    while True:
        hj = json.dumps(header, separators=(",", ":")).encode()
        if _align8(_FIXED.size + len(hj)) == t_off:
            break
        t_off = _align8(_FIXED.size + len(hj))
        l_off = _align8(t_off + len(toks))
        s_off = _align8(l_off + len(lg))
        total = s_off + len(blob) + 4
        header.update(tokens_offset=t_off, logits_offset=l_off, state_offset=s_off, state_len=len(blob))
    buf = bytearray(total)
    buf[:_FIXED.size] = _FIXED.pack(MAGIC, VERSION, len(hj), total)
    buf[_FIXED.size:_FIXED.size + len(hj)] = hj
    buf[t_off:t_off + len(toks)] = toks
    buf[l_off:l_off + len(lg)] = lg
    buf[s_off:s_off + len(blob)] = blob
    buf[-4:] = struct.pack("<I", zlib.crc32(memoryview(buf)[:-4]))
    return bytes(buf)


def read_header(path: Path) -> tuple[dict, np.ndarray]:
    """(header, token ids) from the start of a checkpoint file; Ds4Error naming what is wrong."""
    with open(path, "rb") as fh:
        fixed = fh.read(_FIXED.size)
        if len(fixed) < _FIXED.size:
            raise Ds4Error("shorter than a checkpoint header")
        magic, version, hlen, total = _FIXED.unpack(fixed)
        if magic != MAGIC:
            raise Ds4Error("not a ds4py KV checkpoint (bad magic)")
        if version != VERSION:
            raise Ds4Error(f"checkpoint format version {version}, this ds4py reads {VERSION}")
        size = os.fstat(fh.fileno()).st_size
        if total != size:
            raise Ds4Error(f"truncated or padded: {size} bytes, the header says {total}")
        if hlen > _HEADER_MAX or _FIXED.size + hlen > size:
            raise Ds4Error("header length out of range")
        try:
            header = json.loads(fh.read(hlen))
            n, t_off, l_off, s_off = (int(header[k]) for k in ("n_tokens", "tokens_offset", "logits_offset",
                                                                "state_offset"))
        except (ValueError, KeyError, TypeError):
            raise Ds4Error("unreadable header") from None
        if not (0 < n and _FIXED.size + hlen <= t_off and t_off + 4 * n <= l_off <= s_off <= size - 4):
            raise Ds4Error("section offsets out of range")
        fh.seek(t_off)
        tokens = np.frombuffer(fh.read(4 * n), dtype="<u4").astype(np.int64)
    return header, tokens


class DiskCache:
    """The checkpoints of one model (fingerprint + numerics) in one folder, bounded to space_mb."""

    def __init__(self, directory: str | os.PathLike, space_mb: float, model=None, *, fingerprint: str | None = None,
                 numerics: dict | None = None, vocab: int | None = None, policy: KVCachePolicy | None = None,
                 asynchronous: bool = True, max_pending: int = 2):
        if not space_mb > 0:
            raise Ds4Error(f"--kv-disk-space-mb must be > 0, got {space_mb}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise Ds4Error(f"cannot use --kv-disk-dir {directory}: {e.strerror or e}") from None
        self.space = int(space_mb * (1 << 20))
        self.fingerprint = fingerprint if fingerprint is not None else model.fingerprint
        self.numerics = numerics if numerics is not None else model.numerics.to_dict()
        self.vocab = int(vocab if vocab is not None else model.config.vocab_size)
        self.policy = policy or KVCachePolicy()
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._pending: set[str] = set()
        self._ignored: set[str] = set()          # file names already logged as unusable
        self._scan()
        self._queue: queue.Queue | None = None
        if asynchronous:
            self._queue = queue.Queue(max_pending)
            self._writer = threading.Thread(target=self._write_loop, name="ds4py-kv-writer", daemon=True)
            self._writer.start()

    # ---- start-up ----------------------------------------------------------------------------------------
    def _scan(self) -> None:
        for tmp in self.dir.glob(".*.kv.tmp*"):        # a write interrupted by a crash: never renamed, never used
            try:
                tmp.unlink()
            except OSError:
                pass
        self._dir_mtime = self._mtime()
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            self._index(path)
        if self._entries:
            log.info("kv cache: %d checkpoints (%.1f MB) in %s", len(self._entries), self.nbytes() / 2**20, self.dir)
        with self._lock:
            self._evict_to(self.space)

    def _index(self, path: Path) -> None:
        """Add one checkpoint file to the index; one of another model, numerics or format is ignored with one
        log line (once per file)."""
        try:
            header, tokens = read_header(path)
            if header.get("model") != self.fingerprint:
                raise Ds4Error("written for another model file")
            if header.get("numerics") != self.numerics:
                raise Ds4Error(f"written with other numerics ({header.get('numerics')})")
            if int(header.get("vocab", -1)) != self.vocab or (tokens >= self.vocab).any():
                raise Ds4Error("token ids outside this model's vocabulary")
            st = path.stat()
        except (Ds4Error, OSError) as e:
            if path.name not in self._ignored:
                self._ignored.add(path.name)
                log.warning("kv cache: ignoring %s: %s", path.name, e)
            return
        key = path.name[:-len(SUFFIX)]
        floor = header.get("floor")
        floor = floor if isinstance(floor, int) and 0 <= floor <= len(tokens) else None
        entry = Entry(key, path, tokens, bool(header.get("has_logits")), st.st_size, str(header.get("reason")),
                      float(header.get("created", st.st_mtime)), st.st_mtime, floor)
        with self._lock:
            self._entries.setdefault(key, entry)

    def _mtime(self) -> int:
        try:
            return self.dir.stat().st_mtime_ns
        except OSError:
            return -1

    def refresh(self) -> None:
        """Index the checkpoints that other processes wrote into the folder since the last look (replicas that
        share one --kv-disk-dir: a conversation that moves to another replica finds its checkpoints there). A
        file created, renamed or deleted changes the folder's mtime: nothing is read while it stays the same."""
        m = self._mtime()
        if m == self._dir_mtime:
            return
        self._dir_mtime = m
        with self._lock:
            known = set(self._entries) | self._pending
        for path in self.dir.glob("*" + SUFFIX):
            if path.name[:-len(SUFFIX)] not in known and path.name not in self._ignored:
                self._index(path)

    # ---- queries (engine thread) ---------------------------------------------------------------------------
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def has(self, tokens: Sequence[int]) -> bool:
        key = prefix_key(self.fingerprint, self.numerics, tokens)
        with self._lock:
            return key in self._entries or key in self._pending

    def best(self, prompt: Sequence[int]) -> Entry | None:
        """The longest checkpoint whose tokens are a prefix of the prompt (one equal to the whole prompt only
        when it has its logits: the next token is sampled from them)."""
        self.refresh()
        p = np.asarray(prompt, dtype=np.int64)
        best = None
        for e in self.entries():
            n = e.n_tokens
            if (n < len(p) or (n == len(p) and e.has_logits)) and (best is None or n > best.n_tokens) \
                    and np.array_equal(e.tokens, p[:n]):
                best = e
        return best

    def reuse(self, prompt: Sequence[int]) -> tuple[Entry, int] | None:
        """(checkpoint, tokens it serves) of the one that serves most of the prompt (Entry.reach): a prefix of
        it, or one that runs past the shared prefix by no more than its state's rollback horizon (an edited or
        re-rendered last answer after a restart): loaded, it is truncated to the shared prefix. None: no use."""
        self.refresh()
        p = np.asarray(prompt, dtype=np.int64)
        best, best_n = None, 0
        for e in self.entries():
            n = e.reach(p)
            if n > best_n or (n == best_n and n > 0 and e.n_tokens == n and best.n_tokens != n):
                best, best_n = e, n                # a tie: the exact prefix, no truncation
        return (best, best_n) if best is not None else None

    def load(self, entry: Entry) -> tuple[list[int], bytes, np.ndarray | None] | None:
        """(tokens, state blob, logits), or None (logged, and the entry dropped) when the file is gone, truncated
        or corrupt. The blob is checked again by model.load_state."""
        try:
            data = entry.path.read_bytes()
            magic, version, hlen, total = _FIXED.unpack_from(data)
            if magic != MAGIC or version != VERSION:
                raise Ds4Error("no longer a checkpoint of this format")
            if len(data) != total or len(data) < _FIXED.size + 4:
                raise Ds4Error(f"truncated: {len(data)} bytes, the header says {total}")
            if struct.unpack_from("<I", data, len(data) - 4)[0] != zlib.crc32(memoryview(data)[:-4]):
                raise Ds4Error("checksum mismatch (the file is corrupt)")
            h = json.loads(data[_FIXED.size:_FIXED.size + hlen])
            n, t_off, l_off, s_off, s_len = (int(h[k]) for k in ("n_tokens", "tokens_offset", "logits_offset",
                                                                  "state_offset", "state_len"))
            tokens = np.frombuffer(data, "<u4", n, t_off).astype(np.int64)
            if not np.array_equal(tokens, entry.tokens):
                raise Ds4Error("its tokens changed since start-up")
            logits = np.frombuffer(data, "<f4", self.vocab, l_off).copy() if h.get("has_logits") else None
            blob = data[s_off:s_off + s_len]
        except (OSError, Ds4Error, ValueError, KeyError, struct.error) as e:
            self.discard(entry, str(getattr(e, "strerror", None) or e))
            return None
        now = time.time()
        try:
            os.utime(entry.path, (now, now))          # least recently used order, across restarts too
        except OSError:
            pass
        with self._lock:
            entry.last_used = now
            self.stats.hits += 1
            self.stats.read_bytes += len(data)
        return tokens.tolist(), blob, logits

    def discard(self, entry: Entry, why: str) -> None:
        """Stop using a checkpoint that failed to load (its file stays where it is unless it is ours and bad)."""
        log.warning("kv cache: ignoring %s: %s", entry.path.name, why)
        self._ignored.add(entry.path.name)       # not indexed again by refresh()
        with self._lock:
            self._entries.pop(entry.key, None)
            self.stats.load_failures += 1

    # ---- writes ----------------------------------------------------------------------------------------------
    def save(self, reason: str, tokens: Sequence[int], blob: bytes, logits: np.ndarray | None,
             block: bool = False, floor: int | None = None) -> bool:
        """Write a checkpoint (on the writer thread unless the cache is synchronous). False when it was skipped:
        already there, the writer is busy (block=False) or it is larger than the whole space."""
        if reason not in REASONS:
            raise ValueError(f"unknown checkpoint reason {reason!r}")
        tokens = [int(t) for t in tokens]
        key = prefix_key(self.fingerprint, self.numerics, tokens)
        with self._lock:
            if key in self._entries or key in self._pending:
                return False
            self._pending.add(key)
        item = (key, reason, tokens, blob, None if logits is None else np.array(logits, np.float32), floor)
        if self._queue is None:
            self._write(*item)
            return True
        try:
            self._queue.put(item, block=block)
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
                self.stats.skipped += 1
            log.info("kv cache: writer busy, %s checkpoint of %d tokens skipped", reason, len(tokens))
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued checkpoint is on disk."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        if self._queue is not None:
            self.flush()
            self._queue.put(None)
            self._writer.join(10)
            self._queue = None

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a bug must not kill the writer (the engine would wait on a full queue)
                log.exception("kv cache: writing a checkpoint failed")
            finally:
                self._queue.task_done()

    def _write(self, key: str, reason: str, tokens: list[int], blob: bytes, logits: np.ndarray | None,
               floor: int | None = None) -> None:
        path = self.dir / (key + SUFFIX)
        tmp = self.dir / f".{key}{SUFFIX}.tmp{os.getpid()}"
        try:
            data = encode_checkpoint(self.fingerprint, self.numerics, self.vocab, reason, tokens, blob, logits,
                                     floor=floor)
            if len(data) > self.space:
                log.info("kv cache: %s checkpoint of %d tokens (%.1f MB) exceeds --kv-disk-space-mb; not written",
                         reason, len(tokens), len(data) / 2**20)
                with self._lock:
                    self.stats.skipped += 1
                return
            with self._lock:
                self._evict_to(self.space - len(data))
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            now = time.time()
            with self._lock:
                self._entries[key] = Entry(key, path, np.asarray(tokens, np.int64), logits is not None, len(data),
                                           reason, now, now, floor)
                self.stats.writes[reason] += 1
                self.stats.written_bytes += len(data)
                self._evict_to(self.space)
            log.info("kv cache: wrote %s checkpoint of %d tokens (%.1f MB)", reason, len(tokens), len(data) / 2**20)
        except OSError as e:
            log.warning("kv cache: cannot write a checkpoint in %s: %s", self.dir, e.strerror or e)
            try:
                tmp.unlink()
            except OSError:
                pass
        finally:
            with self._lock:
                self._pending.discard(key)

    def _evict_to(self, limit: int) -> None:
        """Delete least recently used checkpoints until ours fit in `limit` bytes (lock held)."""
        total = sum(e.nbytes for e in self._entries.values())
        for e in sorted(self._entries.values(), key=lambda e: e.last_used):
            if total <= limit:
                break
            try:
                e.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("kv cache: cannot delete %s: %s", e.path.name, err.strerror or err)
                continue
            del self._entries[e.key]
            total -= e.nbytes
            self.stats.deleted += 1
