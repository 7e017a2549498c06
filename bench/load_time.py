"""Model load time on a real-width synthetic file: how fast the weights come off the disk, cold and from the page
cache, through the CUDA engine's own upload reader; on a GPU also the upload itself and the whole engine load.

    python bench/load_time.py [-m MODEL.gguf | --layers 1] [--repeat 2] [--gpu] [--json F]

Without -m it writes a real-width synthetic file (`make-synthetic --layers N`: V4 Flash's widths and the public q2
file's tensor types) into --dir and deletes it afterwards. Each round:

  cold        the file's pages dropped (fsync + POSIX_FADV_DONTNEED), then the tensor data read the way
              WeightUploader.upload_file reads it (ds4py.cuda.memory.file_filler: os.preadv into 64 MiB chunks,
              each chunk's pages dropped once read)
  page cache  the file read once plainly (its pages cached), then the same reader timed

On a machine with a GPU (--gpu, or found): the same two with the real upload (pinned double buffers, the copy
stream) into device memory, and `open_model(backend="cuda")` end to end (upload, conversions, kernels, graphs).
A tmpfs or an overlay whose pages cannot be dropped makes "cold" a page-cache number: the script says which file
system it read from. MB/s = 1e6 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py.cuda.gguf_upload import runs  # noqa: E402
from ds4py.cuda.memory import file_filler, plan_chunks  # noqa: E402
from ds4py.gguf import GGUFFile  # noqa: E402

CHUNK = 64 << 20                       # WeightUploader's default chunk


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: str) -> None:
    with open(path, "rb", buffering=0) as fh:
        while fh.read(CHUNK):
            pass


def read_spans(path: str, spans: list[tuple[int, int]]) -> float:
    """Seconds to read the spans through the upload's reader."""
    buf = np.empty(CHUNK, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for start, end in spans:
            fill = file_filler(fd, path, start)
            for off, n in plan_chunks(end - start, CHUNK):
                fill(buf, off, n)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def gpu_upload(path: str, spans: list[tuple[int, int]]) -> float:
    from ds4py.cuda.runtime import Runtime

    rt = Runtime(progress=lambda m: None)
    total = sum(b - a for a, b in spans)
    arena = rt.arena(total + (len(spans) + 1) * 4096, 1 << 20)
    up = rt.uploader()
    try:
        t0 = time.perf_counter()
        for a, b in spans:
            up.upload_file(path, a, b - a, arena.weights(b - a, np.uint8), progress=False)
        return time.perf_counter() - t0
    finally:
        up.close()


def fs_of(path: str) -> str:
    try:
        return subprocess.run(["df", "--output=fstype", path], capture_output=True, text=True).stdout.split()[-1]
    except (OSError, IndexError):
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a GGUF file (default: a synthetic real-width one)")
    ap.add_argument("--layers", type=int, default=1, help="layers of the synthetic file (default 1: 3.6 GB)")
    ap.add_argument("--dir", default=None, help="where the synthetic file goes (default: the temp folder)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="also time the device upload and the engine load")
    ap.add_argument("--json", default=None, metavar="F")
    args = ap.parse_args()

    tmp = None
    path = args.model
    if path is None:
        from ds4py.tiny import make_synthetic

        tmp = tempfile.TemporaryDirectory(dir=args.dir)
        path = os.path.join(tmp.name, f"synthetic-{args.layers}l.gguf")
        t0 = time.perf_counter()
        make_synthetic(path, n_layers=args.layers)
        print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    try:
        g = GGUFFile(path)
        spans = [(a, b) for a, b, _ in runs(g, None)]
        del g
        total = sum(b - a for a, b in spans)
        rows: dict[str, list[float]] = {"cold": [], "page cache": []}
        for _ in range(args.repeat):
            drop(path)
            rows["cold"].append(total / read_spans(path, spans) / 1e6)
            warm(path)
            rows["page cache"].append(total / read_spans(path, spans) / 1e6)
        if args.gpu:
            for _ in range(args.repeat):
                drop(path)
                rows.setdefault("GPU upload, cold", []).append(total / gpu_upload(path, spans) / 1e6)
                warm(path)
                rows.setdefault("GPU upload, page cache", []).append(total / gpu_upload(path, spans) / 1e6)
            from ds4py.model import open_model

            drop(path)
            t0 = time.perf_counter()
            open_model(path, backend="cuda")
            rows["engine load, cold (open_model cuda)"] = [total / (time.perf_counter() - t0) / 1e6]
        result = {"file": path, "file_system": fs_of(path), "bytes": total, "machine": platform.machine(),
                  "cpus": os.cpu_count(),
                  "mb_per_s": {k: {"mean": statistics.mean(v), "all": v} for k, v in rows.items()}}
        print(f"load time: {total / 1e9:.2f} GB of tensor data from {result['file_system']} ({path})")
        print("| read | MB/s | 80.8 GB at that rate |\n|---|---|---|")
        for k, v in rows.items():
            mean = statistics.mean(v)
            print(f"| {k} | {mean:,.0f} ({', '.join(f'{x:,.0f}' for x in v)}) | {80.8 * 2**30 / 1e6 / mean:,.0f} s |")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
