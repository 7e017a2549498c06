"""The device check's last word: summary.json and results.tar.gz in $OUT, from the scratch folder.

    python bench/device_summary.py SCRATCH OUT DRY BUDGET_S ELAPSED_S

summary.json: every step (status, exit code, seconds, limit, reason), every GPU test (outcome, seconds, message:
from the junit XML of its file's process), every bench's and doctor's numbers (their JSON), the versions, and the
check of $OUT's shape (what the device tool returns: at most 8 files, 2 folders deep, 16 MiB each, plain names).
results.tar.gz: the scratch folder (logs, JSON, XML; not the kernel cache or the installed wheels), logs cut to
their last lines if the archive would pass 16 MiB. Writes SCRATCH/exit_status: 0 when every step passed (a dry
run: passed or stopped only for want of a GPU).
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

MAX_FILES, MAX_DEPTH, MAX_BYTES = 8, 2, 16 << 20
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
BENCHES = ("doctor", "cuda_decode", "cuda_decode_v41", "cuda_prefill", "gemv_bandwidth", "attn_moe_bandwidth", "ptxas",
           "engine_e2e", "versions")
EXCLUDE = ("cache", "site", "venv")
GOOD_DRY = {"ok", "no_gpu", "not_installed"}


def steps(scratch: Path) -> dict:
    out = {}
    tsv = scratch / "steps.tsv"
    for line in tsv.read_text().splitlines() if tsv.is_file() else []:
        name, status, rc, secs, limit, reason = (line.split("\t") + [""] * 6)[:6]
        out[name] = {"status": status, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                     "seconds": int(secs or 0), "limit": int(limit or 0), "reason": reason,
                     "log": f"logs/{name}.txt"}
    return out


def tests(scratch: Path) -> dict:
    out = {}
    for xml in sorted(scratch.glob("*.xml")):
        cases, counts = {}, {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError as e:
            out[xml.stem] = {"unreadable": str(e)}
            continue
        for tc in root.iter("testcase"):
            name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
            outcome, msg = "passed", ""
            for kind in ("failure", "error", "skipped"):
                el = tc.find(kind)
                if el is not None:
                    outcome = {"failure": "failed"}.get(kind, kind)
                    msg = (el.get("message") or el.text or "")[:500]
                    break
            counts[outcome] += 1
            cases[name] = {"outcome": outcome, "seconds": round(float(tc.get("time") or 0), 3), **(
                {"message": msg} if msg else {})}
        out[xml.stem] = {**counts, "cases": cases}
    return out


def numbers(scratch: Path) -> dict:
    out = {}
    for name in BENCHES:
        f = scratch / f"{name}.json"
        if f.is_file():
            try:
                out[name] = json.loads(f.read_text())
            except ValueError as e:
                out[name] = {"unreadable": str(e)}
    return out


def model_vs_measured(nums: dict) -> dict | None:
    """Per decode kernel, the GPU time model's time beside the one measured (cuda_decode.py --kernel-times): the
    first lent GPU's calibration of the model (docs/cuda.md "The GPU time model"). None when not measured."""
    kt = (nums.get("cuda_decode") or {}).get("kernel_times")
    if not isinstance(kt, dict):
        return None
    if "error" in kt:
        return {"error": kt["error"]}
    return {"profile": kt.get("profile"), "ctx": kt.get("ctx"), "measured_us": kt.get("measured_us"),
            "modelled_us": kt.get("modelled_us"), "ratio": kt.get("ratio"),
            "kernels": {k["kernel"]: {f: k.get(f) for f in ("launches", "measured_us", "modelled_us", "ratio",
                                                              "limiter")} for k in kt.get("kernels", [])}}


def archive(scratch: Path, dest: Path, tail_lines: int | None = None) -> None:
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        top = Path(info.name).parts[1:2]
        return None if top and top[0] in EXCLUDE else info

    with tarfile.open(dest, "w:gz") as tar:
        for p in sorted(scratch.iterdir()):
            if p.name in EXCLUDE or p.is_symlink():
                continue
            if tail_lines is not None and p.name == "logs":
                for log in sorted(p.iterdir()):
                    lines = log.read_text(errors="replace").splitlines()[-tail_lines:]
                    data = ("\n".join(lines) + "\n").encode()
                    info = tarfile.TarInfo(f"./logs/{log.name}")
                    info.size = len(data)
                    import io

                    tar.addfile(info, io.BytesIO(data))
                continue
            tar.add(p, arcname=f"./{p.name}", filter=keep)


def out_shape(out: Path) -> dict:
    """The device tool's rule for what comes back from $OUT."""
    files, problems = [], []
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if any(not NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with other characters than letters, digits, '.', '_', '-'")
        if p.is_symlink() or (not p.is_file() and not p.is_dir()):
            problems.append(f"{rel}: not a plain file")
        elif p.is_file():
            files.append(str(rel))
            if len(rel.parts) - 1 > MAX_DEPTH:
                problems.append(f"{rel}: more than {MAX_DEPTH} folders down")
            if p.stat().st_size > MAX_BYTES:
                problems.append(f"{rel}: {p.stat().st_size} bytes, over 16 MiB")
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files, more than {MAX_FILES}")
    return {"files": files, "ok": not problems, "problems": problems}


def main(scratch: str, out: str, dry: str, budget: str, elapsed: str) -> int:
    s, o = Path(scratch), Path(out)
    o.mkdir(parents=True, exist_ok=True)
    st = steps(s)
    dry_run = dry == "1"
    good = GOOD_DRY if dry_run else {"ok", "not_installed"}
    bad = {k: v["status"] for k, v in st.items() if v["status"] not in good}
    summary = {"mode": "dry-run" if dry_run else "device", "ok": not bad and bool(st), "failed_steps": bad,
               "budget_seconds": int(budget), "total_seconds": int(elapsed), "steps": st, "tests": tests(s),
               "numbers": numbers(s)}
    summary["model_vs_measured"] = model_vs_measured(summary["numbers"])
    dest = o / "results.tar.gz"
    archive(s, dest)
    if dest.stat().st_size > MAX_BYTES:
        archive(s, dest, tail_lines=400)
    summary["archive_bytes"] = dest.stat().st_size
    (o / "summary.json").write_text(json.dumps(summary, indent=1))
    shape = out_shape(o)
    summary["out_shape"] = shape
    if not shape["ok"]:
        summary["ok"] = False
    (o / "summary.json").write_text(json.dumps(summary, indent=1))
    width = max([len(k) for k in st] + [8])
    print(f"\n{'step':<{width}} {'status':<14} {'s':>4} {'limit':>5}  reason")
    for k, v in st.items():
        print(f"{k:<{width}} {v['status']:<14} {v['seconds']:>4} {v['limit']:>5}  {v['reason'][:90]}")
    t = summary["tests"]
    print(f"tests: {sum(x.get('passed', 0) for x in t.values())} passed, "
          f"{sum(x.get('failed', 0) + x.get('error', 0) for x in t.values())} failed, "
          f"{sum(x.get('skipped', 0) for x in t.values())} skipped; $OUT: {', '.join(shape['files'])}"
          + ("" if shape["ok"] else f" (SHAPE: {'; '.join(shape['problems'])})"))
    print(f"{summary['mode']}: {'ok' if summary['ok'] else 'FAILED ' + ', '.join(bad)} in {elapsed} s "
          f"(budget {budget} s)")
    (s / "exit_status").write_text("0" if summary["ok"] else "1")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
