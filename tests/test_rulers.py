"""The seed's rulers against a hand computation (plain Python floats), and their input checks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from ds4py.vq.rulers import RulerError, rulers

from helpers import REPO

TEACHER = [[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0], [5.0, 4.0, -2.0, 0.5]]
STUDENT = [[1.0, 2.0, 0.0, -1.0], [0.5, 0.0, 2.0, 0.0], [1.0, 1.0, 0.0, 1.0], [4.0, 4.5, -1.0, 0.0]]
IDS = [3, 1, 0, 2, 1, 0]          # split 3: row j predicts ids[3 + j] for j < 3; row 3 has no target
SPLIT = 3


def softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    return [x / sum(e) for x in e]


def hand():
    pt, ps = [softmax(r) for r in TEACHER], [softmax(r) for r in STUDENT]
    top1 = [max(range(4), key=lambda v: (t[v], -v)) == max(range(4), key=lambda v: (s[v], -v))
            for t, s in zip(TEACHER, STUDENT)]
    smin = [sum(min(a, b) for a, b in zip(p, q)) for p, q in zip(pt, ps)]
    kl = [sum(a * math.log(a / b) for a, b in zip(p, q)) for p, q in zip(pt, ps)]
    srt = sorted(smin)
    p5 = srt[0] + 0.05 * (len(srt) - 1) * (srt[1] - srt[0])        # linear interpolation, as numpy's default
    tg = IDS[SPLIT:]
    nll_t = -sum(math.log(pt[j][tg[j]]) for j in range(len(tg))) / len(tg)
    nll_s = -sum(math.log(ps[j][tg[j]]) for j in range(len(tg))) / len(tg)
    return dict(same_top1=sum(top1) / 4, sigma_min_mean=sum(smin) / 4, sigma_min_median=(srt[1] + srt[2]) / 2,
                sigma_min_p5=p5, kl_mean=sum(kl) / 4, ppl_ratio=math.exp(nll_s - nll_t))


def test_rulers_equal_a_hand_computation():
    got = rulers(np.array(TEACHER, np.float32), np.array(STUDENT, np.float32), np.array(IDS), SPLIT)
    want = hand()
    assert got["rows"] == 4 and got["targets"] == 3
    assert got["same_top1"] == 0.5                   # rows 1 and 2 (ties in both: the lowest index wins)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    same = rulers(np.array(TEACHER), np.array(TEACHER))
    assert same["same_top1"] == 1 and same["sigma_min_p5"] == pytest.approx(1) and abs(same["kl_mean"]) < 1e-12
    assert "ppl_ratio" not in same


def test_bad_inputs_are_one_sentence():
    t, s = np.array(TEACHER, np.float32), np.array(STUDENT, np.float32)
    with pytest.raises(RulerError, match=r"differ in shape"):
        rulers(t, s[:3])
    bad = s.copy()
    bad[2, 1] = np.nan
    with pytest.raises(RulerError, match=r"NaN or inf \(first in row 2\)"):
        rulers(t, bad)
    with pytest.raises(RulerError, match=r"--split 2 of 6 ids gives 5 scored rows, but the logits have 4"):
        rulers(t, s, np.array(IDS), 2)
    with pytest.raises(RulerError, match=r"--split 9 is out of range"):
        rulers(t, s, np.array(IDS), 9)
    with pytest.raises(RulerError, match="go together"):
        rulers(t, s, np.array(IDS))
    with pytest.raises(RulerError, match="outside the logits' vocabulary"):
        rulers(t, s, np.array([0, 0, 0, 9, 0, 0]), SPLIT)
    with pytest.raises(RulerError, match="2-D"):
        rulers(t[0], s[0])


def test_cli_prints_one_json_object(tmp_path):
    np.save(tmp_path / "t.npy", np.array(TEACHER, np.float32))
    np.save(tmp_path / "s.npy", np.array(STUDENT, np.float32))
    np.save(tmp_path / "ids.npy", np.array(IDS))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "ds4py", "rulers", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, env=env, cwd=REPO)
    r = run(tmp_path / "t.npy", tmp_path / "s.npy", "--ids", tmp_path / "ids.npy", "--split", SPLIT)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["kl_mean"] == pytest.approx(hand()["kl_mean"], rel=1e-6)
    r = run(tmp_path / "t.npy", tmp_path / "missing.npy")
    assert r.returncode == 2 and "cannot read the student logits" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
