"""Content checksums in a GGUF: written by `convert` / `make-tiny`, checked by `inspect --verify` (everything) and at
every load (the metadata and the small tensors).

A tensor's digest is sha256 over its name, ggml type code and shape, then its bytes; they are stored in tensor
order as the string array `ds4py.tensor_sha256`. Covering the type matters: a tensor relabelled to another type
of the same size (F16 <-> BF16, F32 <-> I32) keeps its bytes but changes its digest. `ds4py.metadata_sha256` is
the sha256 of the raw bytes of every other metadata entry (shape, tokenizer, ...), in file order.

The header is written before the data, so the converter writes placeholders and patches them in place once every
tensor is written (same length, so nothing moves).
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from ds4py.errors import GGUFError

KEY = "ds4py.tensor_sha256"
META_KEY = "ds4py.metadata_sha256"        # sha256 of every other metadata entry's bytes, in file order
PLACEHOLDER = "0" * 64
_PIECE = 16 << 20                   # hash a mapped tensor in pieces: never a second copy of a large tensor


def hasher(name: str, qtype: int, shape: Iterable[int]) -> "hashlib._Hash":
    """A sha256 already fed with the tensor's identity; update it with the tensor's bytes."""
    h = hashlib.sha256()
    h.update(f"{name}\0{int(qtype)}\0{','.join(str(int(d)) for d in shape)}\0".encode())
    return h


def digest_of(name: str, qtype: int, shape: Iterable[int], data) -> str:
    """Digest of a tensor about to be written (`data`: its contiguous array)."""
    import numpy as np

    h = hasher(name, qtype, shape)
    h.update(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))
    return h.hexdigest()


def tensor_digest(t) -> str:
    """Digest of a ds4py.gguf.TensorInfo, read from the mapped file."""
    h = hasher(t.name, t.qtype, t.shape)
    flat = t.raw.reshape(-1).view("uint8") if t.nbytes else t.raw.view("uint8")
    for a in range(0, t.nbytes, _PIECE):
        h.update(memoryview(flat[a:a + _PIECE]))
    return h.hexdigest()


def stored_digests(f) -> list[str] | None:
    """The file's digests in tensor order, or None when it has none; GGUFError when they are malformed."""
    if not f.has(KEY):
        return None
    v = f.meta(KEY)
    if not isinstance(v, list) or len(v) != len(f.tensors) or not all(
            isinstance(d, str) and len(d) == 64 and all(c in "0123456789abcdef" for c in d) for d in v):
        raise GGUFError(f"{f.path}: metadata {KEY} is corrupt (expected one sha256 per tensor, "
                        f"{len(f.tensors)} in all)")
    if PLACEHOLDER in v:
        raise GGUFError(f"{f.path}: metadata {KEY} still holds placeholders: the file was not finished by its writer")
    return v


def metadata_digest(f) -> str:
    """sha256 over the raw bytes of every metadata entry except the two checksum entries (a ds4py.gguf.GGUFFile)."""
    h = hashlib.sha256()
    for key, (a, b) in sorted(f.kv_spans.items(), key=lambda kv: kv[1]):
        if key not in (KEY, META_KEY):
            h.update(memoryview(f._map[a:b]))
    return h.hexdigest()


def verify_metadata(f) -> bool:
    """GGUFError when the file's metadata checksum does not match; False when it has none."""
    if not f.has(META_KEY):
        return False
    want = f.meta(META_KEY)
    if want == PLACEHOLDER:
        raise GGUFError(f"{f.path}: metadata {META_KEY} is a placeholder: the file was not finished by its writer")
    if metadata_digest(f) != want:
        raise GGUFError(f"{f.path}: the metadata does not match its checksum: a value (shape, tokenizer, ...) changed "
                        f"after the file was written (a corrupt or edited file)")
    return True


def verify(f, *, max_tensor_bytes: int | None = None, budget_bytes: int | None = None) -> tuple[int, int]:
    """Check stored digests: every tensor, or (at load) those up to max_tensor_bytes, smallest first until
    budget_bytes are hashed. GGUFError naming the first mismatch. Returns (tensors checked, bytes hashed)."""
    digests = stored_digests(f)
    if digests is None:
        return 0, 0
    items = list(zip(f.tensors.values(), digests))
    if max_tensor_bytes is not None:
        items = sorted((x for x in items if x[0].nbytes <= max_tensor_bytes), key=lambda x: x[0].nbytes)
    n = hashed = 0
    for t, want in items:
        if budget_bytes is not None and hashed + t.nbytes > budget_bytes:
            break
        if tensor_digest(t) != want:
            raise GGUFError(f"{f.path}: tensor {t.name!r} ({t.qtype.name} {list(t.ne)}) does not match its checksum: "
                            f"its type, shape or bytes changed after it was written (a corrupt or edited file)")
        n, hashed = n + 1, hashed + t.nbytes
    return n, hashed


def patch(path: str, digests: list[str]) -> None:
    """Overwrite the placeholders of a just-written GGUF with the real digests (same byte lengths): the tensor
    digests, then the metadata digest (which covers neither)."""
    from ds4py.gguf import GGUFFile

    f = GGUFFile(path)
    a, b = f.kv_spans[KEY]
    if f.meta(KEY) != [PLACEHOLDER] * len(digests):
        raise GGUFError(f"{path}: {KEY} has the wrong shape to patch")
    first = b - len(digests) * (8 + 64)         # each element: u64 length 64, then 64 hex bytes
    meta = metadata_digest(f) if f.has(META_KEY) else None
    meta_at = f.kv_spans[META_KEY][1] - 64 if meta else None
    del f
    with open(path, "r+b") as fh:
        for i, d in enumerate(digests):
            fh.seek(first + i * 72 + 8)
            fh.write(d.encode())
        if meta:
            fh.seek(meta_at)
            fh.write(meta.encode())
