"""`python -m ds4py rulers TEACHER.npy STUDENT.npy [--ids IDS.npy --split P]`: compare two `score` outputs."""

from __future__ import annotations

import argparse

NAME = "rulers"
HELP = "compare student logits with teacher logits (same top-1, sigma-min, KL, PPL ratio) as one JSON object"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("teacher", metavar="TEACHER.npy", help="teacher logits [rows, vocab] (e.g. from `score`)")
    p.add_argument("student", metavar="STUDENT.npy", help="student logits, same shape")
    p.add_argument("--ids", help="the .npy token ids both were scored on (for ppl_ratio)")
    p.add_argument("--split", type=int, metavar="P", help="the --split the scores were made with")


def _load(path: str, what: str):
    import numpy as np

    from ds4py.vq.rulers import RulerError

    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise RulerError(f"cannot read the {what} from {path}: {e}") from e


def run(args: argparse.Namespace) -> int:
    import json

    import numpy as np

    from ds4py.vq.rulers import rulers

    teacher = _load(args.teacher, "teacher logits")
    student = _load(args.student, "student logits")
    ids = None
    if args.ids is not None:
        ids = np.asarray(_load(args.ids, "token ids"))
    print(json.dumps(rulers(teacher, student, ids, args.split)))
    return 0
