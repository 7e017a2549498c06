"""The files the trained-model benches share (bench/sidecar_trained.py, bench/posttrain_trained.py): the teacher (the
lossless conversion of ../shared/trained/v4-tiny-trained), its VQ-8 base and a domain sidecar fitted on the first
half of the domain's held-out text; each made once per work folder and reused."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds4py.convert import convert_checkpoint  # noqa: E402

LAMBDAS = "0.01,0.1,1,10,100,1000"      # the sidecars' ridge grid (bench/sidecar_trained.py's default)
TRAINED = Path(os.environ.get("DS4PY_TRAINED") or REPO.parent / "shared" / "trained" / "v4-tiny-trained")


def halves(text: str) -> tuple[str, str]:
    """The text split at the line boundary after its middle: (the half sidecars fit on, the held-out half). The
    folder ships no training text (corpus_split.json only names the files), only the held-out test texts."""
    cut = text.index("\n", len(text) // 2) + 1
    return text[:cut], text[cut:]


def teacher(work: Path) -> Path:
    """Dense F16, experts MXFP4 (the official FP4 as it is), with its tokenizer."""
    p = work / "teacher.gguf"
    if not p.exists():
        convert_checkpoint(str(TRAINED), str(p), experts="mxfp4", dense="f16", progress=False,
                           tokenizer=str(TRAINED / "tokenizer.json"))
    return p


def base(work: Path, biased: bool = False) -> Path:
    """VQ-8 of the teacher's routed experts (--min-pool 16: the model has 196,608 vectors per layer); biased: the
    k-means gains (quantize-vq --no-unbiased-gains, the default before the unbiased gains were)."""
    t = teacher(work)
    p = work / ("vq8b.gguf" if biased else "vq8u.gguf")
    if not p.exists():
        subprocess.run([sys.executable, "-m", "ds4py", "quantize-vq", str(t), str(p), "--bits", "8", "--min-pool",
                        "16", "--workers", "1", "-q"] + (["--no-unbiased-gains"] if biased else []),
                       check=True, cwd=REPO)
    return p


def prepare(work: str | None, biased: bool, prefix: str):
    """A bench's start: its work folder (`work`, made if missing; else a fresh temporary one named `prefix`...),
    the teacher and the VQ-8 base in it, and the teacher's tokenizer."""
    from ds4py.tokenizer import Tokenizer

    folder = Path(work or tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    t = teacher(folder)
    return folder, t, base(folder, biased), Tokenizer.from_gguf(str(t))


def sidecar(work: Path, dom: str, biased: bool = False, lambdas: str = LAMBDAS) -> tuple[Path, Path, float | None]:
    """The domain's sidecar on base(work, biased), fitted on the first half of its test text (`sidecar-fit --text
    --lambdas`): (folder, report, seconds the fit took; None when reused)."""
    import time

    b, t = base(work, biased), teacher(work)
    tag = f"{dom}{'_b' if biased else ''}{'' if lambdas == LAMBDAS else '_l' + lambdas.replace(',', '_')}"
    out, rep = work / f"sidecar_{tag}", work / f"sidecar_{tag}.json"
    if out.exists():
        return out, rep, None
    fit, _ = halves((TRAINED / f"test_{dom}.txt").read_text())
    text = work / f"{dom}_fit.txt"
    text.write_text(fit)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ds4py", "sidecar-fit", "--base", str(b), "--teacher", str(t), "--text",
                    str(text), "--out", str(out), "--report", str(rep), "--lambdas", lambdas, "-q"], check=True,
                   cwd=REPO)
    return out, rep, time.perf_counter() - t0
