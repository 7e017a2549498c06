"""A cheap content fingerprint of a model file: identical files agree, different files disagree, and an 80 GB
GGUF costs a few MB of reads (no full-file hash).

What is hashed: the file size, its first `head_bytes` bytes (for a GGUF: the whole header, i.e. every metadata
value and tensor description; default 8 MiB) and 64 evenly spaced 64 KiB samples of the rest, so two files that
differ in metadata, layout or (practically any) weights get different fingerprints. The path and the file's
times are not part of it: a copied or moved file keeps its fingerprint. It identifies a file for caches
(saved KV states, sidecars); it is not a security hash (a deliberate edit between samples is not seen).
"""

from __future__ import annotations

import hashlib
import os

HEAD_BYTES = 8 << 20
SAMPLES = 64
SAMPLE_BYTES = 64 << 10
VERSION = b"ds4py-fingerprint-1"


def file_fingerprint(path: str | os.PathLike, head_bytes: int = HEAD_BYTES) -> str:
    """32 hex digits identifying the file's contents (see the module docstring)."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(VERSION + size.to_bytes(8, "little"))
    head = min(size, max(0, int(head_bytes)))
    with open(path, "rb") as fh:
        h.update(fh.read(head))
        rest = size - head
        if rest > 0:
            span = max(0, rest - SAMPLE_BYTES)
            for k in range(SAMPLES):
                fh.seek(head + span * k // (SAMPLES - 1))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()
