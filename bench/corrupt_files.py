"""Corrupted model and checkpoint files through the commands a user runs: `inspect`, `inspect --verify`, `run`,
`serve` (its model load) and `convert`. Each answer is classified as
  refused    one line naming the problem (exit 2, a Ds4Error), as it should be for a corrupt input
  accepted   no error (for run / serve / --verify / convert on a corrupt input: a finding, the file is used)
  traceback  anything else (a finding)
`inspect` without --verify only describes a file; there only tracebacks count.

    python bench/corrupt_files.py [--json out.json]

The corpus (seeded, ~100 files) is built from the golden ds4-tiny GGUF and v4-tiny checkpoint: the recipes of
tests/test_corrupt_files.py and tests/test_convert_errors.py, truncations, random header byte flips, and
data byte flips in a file carrying checksums. DS4PY_REPO=path measures another checkout with the same corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
REPO = Path(os.environ.get("DS4PY_REPO", HERE))
sys.path.insert(0, str(HERE / "tests"))       # the recipes (gguf_tools, test modules)
sys.path.insert(0, str(REPO))                 # the ds4py under test
GOLDEN = HERE.parent / "shared" / "golden"


def gguf_corpus(tmp: Path, rng: random.Random) -> list[tuple[str, str]]:
    from gguf_tools import Gguf
    from test_corrupt_files import CASES

    base = Gguf.read(GOLDEN / "ds4-tiny" / "tiny.gguf")
    out = []
    for name, edit, _, _ in CASES:
        g = copy.deepcopy(base)
        edit(g)
        out.append((f"gguf:{name}", str(g.write(tmp / f"{name}.gguf"))))
    data = (GOLDEN / "ds4-tiny" / "tiny.gguf").read_bytes()
    for frac in (0.0005, 0.003, 0.01, 0.05, 0.2, 0.5, 0.9, 0.999):
        p = tmp / f"cut{frac}.gguf"
        p.write_bytes(data[: int(len(data) * frac)])
        out.append((f"gguf:truncated-{frac}", str(p)))
    header_end = data.index(b"token_embd.weight") + 2000          # well inside the tensor infos
    for i in range(30):
        b = bytearray(data)
        at = rng.randrange(8, header_end)
        b[at] ^= 1 << rng.randrange(8)
        p = tmp / f"hdr{i}.gguf"
        p.write_bytes(bytes(b))
        out.append((f"gguf:header-bit-{at}", str(p)))
    made = tmp / "made.gguf"
    try:
        from ds4py.tiny import make_tiny

        make_tiny(str(made), seed=5)
        from ds4py.gguf import GGUFFile

        f = GGUFFile(made)
        names = [t for t in f.tensors.values() if t.nbytes > 64]
        mdata = made.read_bytes()
        first_tensor = min(t.offset for t in f.tensors.values())
        for i in range(12):                      # header bits of a file that carries checksums
            b = bytearray(mdata)
            at = rng.randrange(8, first_tensor)
            b[at] ^= 1 << rng.randrange(8)
            p = tmp / f"mhdr{i}.gguf"
            p.write_bytes(bytes(b))
            out.append((f"gguf:checksummed-header-bit-{at}", str(p)))
        for i in range(12):
            t = rng.choice(names)
            b = bytearray(mdata)
            at = t.offset + rng.randrange(t.nbytes)
            b[at] ^= 1 << rng.randrange(8)
            p = tmp / f"data{i}.gguf"
            p.write_bytes(bytes(b))
            out.append((f"gguf:data-bit-{t.name}", str(p)))
    except Exception as e:                       # an older checkout without make_tiny: skip this part
        print(f"(no data-bit cases: {type(e).__name__}: {e})", file=sys.stderr)
    return out


def checkpoint_corpus(tmp: Path) -> list[tuple[str, str]]:
    import numpy as np

    from test_convert_errors import CONFIGS, _src

    out = []
    for name, kw, _ in CONFIGS:
        out.append((f"ckpt:{name}", str(_src(GOLDEN, tmp, f"ck-{name}", **kw))))
    blob = (GOLDEN / "v4-tiny" / "model.safetensors").read_bytes()
    import struct
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    variants = {"st-cut-data": blob[: len(blob) // 2], "st-cut-header": blob[:2000],
                "st-foreign": b"\x89PNG\r\n\x1a\n" + bytes(200), "st-bad-json": struct.pack("<Q", 8) + b"{nojson}"}
    k = next(iter(x for x in header if x != "__metadata__"))
    for label, mut in (("st-offsets-beyond", lambda h: h[k].update(data_offsets=[0, 10 ** 12])),
                       ("st-dtype-unknown", lambda h: h[k].update(dtype="Q99")),
                       ("st-shape-string", lambda h: h[k].update(shape="256")),
                       ("st-not-dict", lambda h: h.__setitem__(k, 5))):
        h = copy.deepcopy(header)
        mut(h)
        hb = json.dumps(h).encode()
        hb += b" " * (-len(hb) % 8)
        variants[label] = struct.pack("<Q", len(hb)) + hb + blob[8 + n:]
    for label, data in variants.items():
        d = tmp / label
        d.mkdir()
        shutil.copy(GOLDEN / "v4-tiny" / "config.json", d)
        (d / "model.safetensors").write_bytes(data)
        out.append((f"ckpt:{label}", str(d)))
    del np
    return out


def classify(fn) -> str:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = fn()
    except Exception as e:
        from ds4py.errors import Ds4Error

        if isinstance(e, Ds4Error) and "\n" not in str(e):
            return "refused"
        return "traceback"
    except SystemExit as e:
        rc = e.code
    text = err.getvalue().strip()
    if rc == 2 and len(text.splitlines()) == 1 and "Traceback" not in text:
        return "refused"
    return "accepted" if rc in (0, None) else "traceback"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from ds4py.__main__ import main as ds4py

    rng = random.Random(args.seed)
    results: dict[str, Counter] = defaultdict(Counter)
    findings = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ggufs, ckpts = gguf_corpus(tmp, rng), checkpoint_corpus(tmp)

        def serve_load(path):
            from ds4py.cli.serve import make_engine
            from ds4py.server.toolmemory import ToolMemory

            make_engine(path, "ref", 64, ToolMemory())
            return 0
        commands = {"inspect": lambda p: ds4py(["inspect", p]),
                    "inspect --verify": lambda p: ds4py(["inspect", p, "--verify"]),
                    "run": lambda p: ds4py(["run", "-m", p, "-p", "hi", "-n", "1", "--temp", "0"]),
                    "serve": serve_load}
        for name, path in ggufs:
            for cmd, fn in commands.items():
                if cmd == "inspect --verify" and "--verify" not in open(REPO / "ds4py/cli/inspect.py").read():
                    continue
                r = classify(lambda: fn(path))
                results[cmd][r] += 1
                if r == "traceback" or (r == "accepted" and cmd != "inspect"):
                    findings.append(f"{cmd} {name}: {r}")
        for name, path in ckpts:
            out = tmp / "o.gguf"
            r = classify(lambda: ds4py(["convert", path, str(out), "-q"]))
            results["convert"][r] += 1
            if r != "refused":
                findings.append(f"convert {name}: {r}")
            left = [p for p in os.listdir(tmp) if ".tmp-" in p]
            if left or out.exists():
                findings.append(f"convert {name}: left {left or out.name}")
                for p in left:
                    os.remove(tmp / p)
                out.unlink(missing_ok=True)
    summary = {"gguf_files": len(ggufs), "checkpoints": len(ckpts), "seconds": round(time.perf_counter() - t0, 1),
               "commands": {c: dict(v) for c, v in results.items()}, "findings": len(findings),
               "examples": findings[:60]}
    print(f"{len(ggufs)} corrupt GGUF files, {len(ckpts)} corrupt checkpoints ({summary['seconds']} s)")
    for cmd, v in summary["commands"].items():
        print(f"  {cmd:<17s} " + "  ".join(f"{k}:{n}" for k, n in sorted(v.items())))
    print(f"findings (tracebacks; corrupt inputs used without a word): {len(findings)}")
    for f in findings[:30]:
        print("  " + f)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
